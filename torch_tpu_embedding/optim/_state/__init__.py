"""Optimizer state in and out (private): ``state_save`` (``state_dict``, the distributed-checkpoint form),
``state_load`` (a load's check and write), ``state_check`` (checks before a load writes anything) and
``torch_form`` (torch.optim's layout, for ``torch.distributed.checkpoint.state_dict``'s helpers).
"""
