"""Does torch_xla's ``while_loop`` carry a tensor sharded over an SPMD mesh? (docs/sharding.md, "The capacity")

A one-trip loop whose body adds 1 to a ``[4, 4, 8]`` float32 tensor sharded on dim 0 over 4 devices.
On torch 2.9.0 / torch_xla 2.9.0 with XLA:CPU it fails XLA's HLO verifier ("Inconsistent while sharding
among instructions": the loop's parameter is sharded in one computation and replicated in the other),
so neither a loop over exchange rounds nor a conditional larger exchange can be built on this stack.
Prints ``ok`` and the values if a later release builds it.

Run from the repository root:

    PJRT_DEVICE=CPU CPU_NUM_DEVICES=4 python scripts/while_loop_sharding_probe.py
"""

from __future__ import annotations

import numpy as np
import torch
import torch_xla
import torch_xla.runtime as xr

xr.use_spmd()
import torch_xla.distributed.spmd as xs  # noqa: E402
import torch_xla.experimental.fori_loop  # noqa: E402,F401  (registers the XLA while_loop)
from torch._higher_order_ops.while_loop import while_loop  # noqa: E402


def main() -> None:
    n = xr.global_runtime_device_count()
    mesh = xs.Mesh(np.arange(n), (n,), ("x",))
    dev = torch_xla.device()
    x = torch.arange(n * n * 8, dtype=torch.float32).reshape(n, n, 8).to(dev)
    xs.mark_sharding(x, mesh, ("x", None, None))
    trips = torch.tensor([1], dtype=torch.int32, device=dev)
    try:
        _, y = while_loop(lambda i, t: i[0] > 0, lambda i, t: (i - 1, t + 1), (trips, x))
        torch_xla.sync()
        print("ok", bool(torch.equal(y.cpu(), x.cpu() + 1)))
    except Exception as err:  # noqa: BLE001  (report whatever this release raises)
        print(f"fails: {type(err).__name__}: {str(err).splitlines()[0][:300]}")


if __name__ == "__main__":
    main()
