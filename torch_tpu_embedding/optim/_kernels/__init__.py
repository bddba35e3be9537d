"""The compiled update kernels of the eager step (private): ``row_update`` (one ``torch.compile`` kernel
per optimizer configuration) and ``kernel_policy`` (when that path runs), ``c_add`` (SGD's additive update,
one C loop, in the C library that ``c_library`` builds, caches and loads) and ``row_sums`` (the duplicate
sum that feeds them).
"""
