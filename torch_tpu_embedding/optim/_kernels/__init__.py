"""The compiled update kernels of the eager step (private): ``row_update`` (one ``torch.compile`` kernel
per optimizer configuration), ``c_add`` (SGD's additive update, one C loop) and ``row_sums`` (the
duplicate sum that feeds them).
"""
