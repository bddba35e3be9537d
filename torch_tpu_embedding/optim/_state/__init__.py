"""Optimizer state in and out (private): ``state_io`` (``state_dict`` / a load's check and write, the
distributed-checkpoint form), ``state_check`` (checks before a load writes anything) and ``torch_form``
(torch.optim's layout, for ``torch.distributed.checkpoint.state_dict``'s helpers).
"""
