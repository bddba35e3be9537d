"""Clear errors on one XLA device that leave the state unchanged (issue 28, item 10): ``Padded`` host ids with a
mask on the device, and a CPU backward that ran before the XLA runtime started (detected at the next XLA lookup
that will be differentiated, instead of PyTorch's internal assert at the backward)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

torch_xla = pytest.importorskip("torch_xla")

import torch_tpu_embedding as tte  # noqa: E402

assert os.environ.get("PJRT_DEVICE"), "run the XLA tests with PJRT_DEVICE=CPU"
DEV = torch_xla.device()  # before any backward: the autograd engine sizes its device queues once
ROOT = Path(__file__).resolve().parents[2]


def test_padded_host_ids_with_a_device_mask_name_the_argument_and_the_devices() -> None:
    torch.manual_seed(0)
    ec = tte.EmbeddingCollection({"f": tte.FeatureConfig(tte.TableConfig(10, 4, name="t"), max_ids_per_bag=3)},
                                 device=DEV)
    opt = tte.optim.Adagrad(ec.parameters(), lr=0.1)
    ids = torch.tensor([[1, 2, 3], [4, 5, 6]])
    mask = torch.tensor([[True, True, False], [True, False, False]])
    ec({"f": tte.Padded(ids, mask=mask)})["f"].sum().backward()  # host ids and mask: fine
    w = ec.tables.t.weight.detach().cpu().clone()
    with pytest.raises(ValueError, match=re.escape(
            f"Feature `f`: Padded host ids need their mask on the same device (the ids are checked under the mask "
            f"on the host). Received ids on cpu, mask on {DEV}")):
        ec({"f": tte.Padded(ids, mask=mask.to(DEV))})
    assert len(ec.tables.t.row_grad) == 1  # only the first lookup's gradient is pending
    out = ec({"f": tte.Padded(ids.to(DEV), mask=mask.to(DEV))})["f"]  # both on the device: fine
    out.sum().backward()
    opt.step()
    torch_xla.sync()
    assert not torch.equal(ec.tables.t.weight.detach().cpu(), w)


_EARLY_CPU_BACKWARD = """
import torch
import torch_tpu_embedding as tte
t = tte.TableConfig(10, 4, name="t")
cpu = tte.EmbeddingCollection({"f": tte.FeatureConfig(t)})
cpu({"f": torch.tensor([1, 2])})["f"].sum().backward()  # before the XLA runtime started
import torch_xla
ec = tte.EmbeddingCollection({"f": tte.FeatureConfig(t)}, device=torch_xla.device())
with torch.no_grad():
    assert ec({"f": torch.tensor([1, 2])})["f"].shape == (2, 4)  # a lookup without a backward still works
try:
    out = ec({"f": torch.tensor([1, 2])})["f"]
    out.sum().backward()
except RuntimeError as e:
    print("ERROR:", e)
"""


def test_a_cpu_backward_before_the_xla_runtime_is_named_with_the_remedy() -> None:
    env = {**os.environ, "PJRT_DEVICE": "CPU", "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = subprocess.run([sys.executable, "-c", _EARLY_CPU_BACKWARD], env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    msg = out.stdout
    assert "ERROR: Table `t` is looked up on XLA with gradients enabled, but a backward pass of this process ran " \
           "on the CPU" in msg, (msg, out.stderr[-2000:])
    assert "Start the runtime before the first backward (`torch_xla.device()`" in msg, msg
    assert "INTERNAL ASSERT" not in msg
