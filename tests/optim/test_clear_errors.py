"""Clear errors that leave the state unchanged (issue 28, item 10; the CPU cases): an ``lr`` callable
returning a tensor of several elements, and a plain ``torch.optim`` optimizer or torch's DDP given a stacked
group's parameter, named by the user's tables rather than the internal group name."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import torch_tpu_embedding as tte

ROOT = Path(__file__).resolve().parents[2]


def _stacked() -> tte.EmbeddingCollection:
    torch.manual_seed(0)
    t, u = tte.TableConfig(10, 4, name="t"), tte.TableConfig(12, 4, name="u")
    ec = tte.EmbeddingCollection({"a": tte.FeatureConfig(t), "b": tte.FeatureConfig(u)})
    assert list(ec.physical_tables()) == ["fused_0"]  # one stacked group
    return ec


def _backward(ec: tte.EmbeddingCollection) -> None:
    out = ec({"a": torch.tensor([1, 2]), "b": torch.tensor([3, 4])})
    (out["a"].sum() + out["b"].sum()).backward()


@pytest.mark.parametrize("bad", [torch.tensor([0.1, 0.2]), torch.ones(1, 2) * 0.1])
def test_an_lr_callable_returning_several_numbers_is_named(bad: torch.Tensor) -> None:
    ec = _stacked()
    opt = tte.optim.Adagrad(ec.parameters(), lr=lambda: bad)
    _backward(ec)
    w = ec.groups.fused_0.weight.detach().clone()
    pending = ec.physical_tables()["fused_0"].row_grad.collect()
    with pytest.raises(ValueError, match=re.escape(f"must return one number (a float or a 0-d tensor). It "
                                                   f"returned a tensor of shape {tuple(bad.shape)}")) as info:
        opt.step()
    assert "The callable `lr`" in str(info.value)
    assert torch.equal(ec.groups.fused_0.weight.detach(), w) and not opt.state[ec.groups.fused_0.weight]
    again = ec.physical_tables()["fused_0"].row_grad.collect()  # the gradient is still pending
    assert all(torch.equal(a, b) for a, b in zip(pending, again, strict=True))


def test_a_plain_torch_optimizer_names_the_stacked_tables() -> None:
    ec = _stacked()
    opt = torch.optim.SGD(ec.parameters(), lr=0.1)
    _backward(ec)
    w = ec.groups.fused_0.weight.detach().clone()
    with pytest.raises(TypeError, match=re.escape("was given embedding tables 't', 'u' (stacked in group "
                                                  "'fused_0'), whose gradient is row-sparse")):
        opt.step()
    assert torch.equal(ec.groups.fused_0.weight.detach(), w)


@pytest.mark.parametrize("stacked", [True, False], ids=["stacked", "own"])
def test_a_table_weight_used_outside_a_lookup_is_refused_naming_it(stacked: bool) -> None:
    """A loss term on a table's weight itself (an L2 penalty over the table, the table as a tied output layer)
    gives it a dense ``.grad``, which the optimizers, reading a table's row gradient only, dropped without a
    word: the step trained the looked-up rows and nothing else. Refused now, naming the tables, before anything
    changes; the lookup's row gradient is still pending."""
    torch.manual_seed(0)
    t, u = tte.TableConfig(10, 4, name="t"), tte.TableConfig(12, 4, name="u")
    ec = tte.EmbeddingCollection({"a": tte.FeatureConfig(t), "b": tte.FeatureConfig(u)}, stack_tables=stacked)
    opt = tte.optim.Adagrad(ec.parameters(), lr=0.1)
    out = ec({"a": torch.tensor([1, 2]), "b": torch.tensor([3, 4])})
    (out["a"].sum() + out["b"].sum() + 1e-3 * ec.embedding_tables["t"].square().sum()).backward()
    before = [p.detach().clone() for p in ec.parameters()]
    named = "embedding tables 't', 'u' (stacked in group 'fused_0')" if stacked else "embedding table 't'"
    with pytest.raises(RuntimeError, match=re.escape(f"The optimizer was given {named}, whose weight has a dense "
                                                     "`.grad`")):
        opt.step()
    assert all(torch.equal(p.detach(), b) for p, b in zip(ec.parameters(), before, strict=True))
    assert not any(opt.state.get(p) for p in ec.parameters())
    assert all(table.row_grad for table in ec.physical_tables().values())
    opt.zero_grad()  # clears the dense .grad too: the next step trains as usual
    _backward(ec)
    opt.step()


_DDP = """
import os, torch, torch.distributed as dist
import torch_tpu_embedding as tte
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ["TEST_PORT"])
dist.init_process_group("gloo", rank=0, world_size=1)
t, u = tte.TableConfig(10, 4, name="t"), tte.TableConfig(12, 4, name="u")

class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.ec = tte.EmbeddingCollection({"a": tte.FeatureConfig(t), "b": tte.FeatureConfig(u)})
        self.head = torch.nn.Linear(8, 1)

    def forward(self, a, b):
        out = self.ec({"a": a, "b": b})
        return self.head(torch.cat([out["a"], out["b"]], dim=1)).sum()

ddp = torch.nn.parallel.DistributedDataParallel(Model())
try:
    ddp(torch.tensor([1]), torch.tensor([2]))
except RuntimeError as e:
    print("ERROR:", e)
dist.destroy_process_group()
"""


def test_torch_ddp_on_stacked_tables_names_them() -> None:
    """torch's DDP (a process group of one) on a model whose tables are stacked: refused at the forward,
    naming the user's tables, not the internal group."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "TEST_PORT": str(port), "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = subprocess.run([sys.executable, "-c", _DDP], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "ERROR: Embedding tables 't', 'u' (stacked in group 'fused_0') are reduced by DistributedDataParallel" \
        in out.stdout, (out.stdout, out.stderr[-2000:])
