"""``torch.distributed`` without SPMD: data parallel (replicated tables) and tables sharded over a process group.

The public names are those of :mod:`torch_tpu_embedding.distributed.data_parallel`; the other modules of this package
are the process-group backend (placement, the id exchange, lookups, state, checkpoints, gradient sync),
file for file the counterpart of :mod:`torch_tpu_embedding.xla`.
"""

# The process-group backend serves the layers below the public face through the interfaces they declare.
from torch_tpu_embedding._rows.placement import install_lookup_agreement as _install_lookup_agreement  # noqa: E402
from torch_tpu_embedding._rows.placement import install_row_grad_sync as _install_row_grad_sync  # noqa: E402
from torch_tpu_embedding.checkpoint import sharded as _sharded  # noqa: E402
from torch_tpu_embedding.distributed import grad_sync as _grad_sync  # noqa: E402
from torch_tpu_embedding.distributed import sharded_checkpoint as _sharded_checkpoint  # noqa: E402
from torch_tpu_embedding.distributed import step_agreement as _step_agreement  # noqa: E402
from torch_tpu_embedding.distributed.data_parallel import *  # noqa: F403
from torch_tpu_embedding.distributed.data_parallel import __all__ as __all__

_install_row_grad_sync(_grad_sync.sync_row_grads)
_install_lookup_agreement(_step_agreement.agree_lookup)
_sharded.install(_sharded_checkpoint.CHECKPOINTS)
