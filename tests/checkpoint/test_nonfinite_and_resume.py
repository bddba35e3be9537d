"""Reliability: skip non-finite steps, kill -9 and resume to the same weights, corrupt checkpoints."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from optim_registry import NONFINITE, OptimizerConfig, cases

import torch_tpu_embedding as tte

ROOT = Path(__file__).parents[2]


def model():
    torch.manual_seed(0)
    t = tte.TableConfig(20, 3, name="t", combiner="sum", dtype=torch.float64)
    ec = tte.EmbeddingCollection({"f": tte.FeatureConfig(t, max_ids_per_bag=3)})
    head = torch.nn.Linear(3, 1).double()
    return ec, head


@pytest.mark.parametrize("cfg", cases(NONFINITE), ids=str)
def test_skip_nonfinite_leaves_params_and_slots_untouched(cfg: OptimizerConfig) -> None:
    ec, head = model()
    params = [ec.tables.t.weight, *head.parameters()]
    opt = cfg.make(params, skip_nonfinite=True)
    ids = torch.tensor([[1, 2, 3], [4, 5, 6]])

    def step(scale: float) -> None:
        out = ec({"f": tte.Padded(ids)})["f"]
        (head(out).sum() * scale).backward()
        opt.step()
        opt.zero_grad()

    step(1.0)
    before = [p.detach().clone() for p in params]
    slots = {id(p): {k: v.clone() for k, v in opt.state[p].items()} for p in params}
    step(float("inf"))  # inf * 0-gradients give NaN rows too
    assert opt.skipped_steps == 1
    for p, b in zip(params, before, strict=True):
        assert torch.equal(p.detach(), b)
        for k, v in opt.state[p].items():
            assert torch.equal(v, slots[id(p)][k]), k  # including the step counter
    step(1.0)  # training goes on
    assert opt.skipped_steps == 1
    assert not torch.equal(params[0].detach(), before[0])
    assert opt.state_dict()["skipped_steps"] == 1


def test_without_the_policy_nonfinite_gradients_reach_the_weights() -> None:
    ec, head = model()
    opt = tte.optim.SGD([ec.tables.t.weight, *head.parameters()], lr=0.1)
    (head(ec({"f": tte.Padded(torch.tensor([[1, 2, 3]]))})["f"]).sum() * float("inf")).backward()
    opt.step()
    assert not torch.isfinite(ec.tables.t.weight).all()
    assert opt.skipped_steps == 0


WORKER = r"""
import sys, time, torch
import torch_tpu_embedding as tte
ckpt, steps, slow = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
torch.manual_seed(0)
t = tte.TableConfig(50, 4, name="t", combiner="mean")
ec = tte.EmbeddingCollection({"f": tte.FeatureConfig(t, max_ids_per_bag=4)})
head = torch.nn.Linear(4, 1)
model = torch.nn.ModuleDict({"ec": ec, "head": head})
opt = tte.optim.Adafactor(model.parameters(), lr=0.05, use_ema=True, gradient_accumulation_steps=2)
start = 0
if len(sys.argv) > 4:
    start = tte.checkpoint.load(ckpt, model=model, optimizer=opt)["step"]
for s in range(start, steps):
    g = torch.Generator().manual_seed(s)
    ids = torch.randint(0, 50, (16,), generator=g)
    out = ec({"f": tte.Jagged(ids, lengths=torch.full((4,), 4))})["f"]
    (head(out) - 1).square().sum().backward()
    opt.step()
    opt.zero_grad()
    if (s + 1) % 5 == 0:
        tte.checkpoint.save(ckpt, model=model, optimizer=opt, extra={"step": s + 1})
    print("step", s + 1, flush=True)
    time.sleep(slow)
torch.save({k: v for k, v in model.state_dict().items()}, ckpt + ".final")
print("done", flush=True)
"""


def run_worker(*args: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.Popen([sys.executable, "-c", WORKER, *args], env=env, stdout=subprocess.PIPE, text=True)


def test_kill_9_mid_run_then_resume_reaches_the_uninterrupted_weights(tmp_path: Path) -> None:
    ref = run_worker(str(tmp_path / "ref.pt"), "20", "0")
    assert ref.wait(timeout=300) == 0
    victim = run_worker(str(tmp_path / "run.pt"), "20", "0.2")
    assert victim.stdout is not None
    for line in victim.stdout:  # kill it while it trains, after the step-10 checkpoint
        if line.strip() == "step 13":
            os.kill(victim.pid, signal.SIGKILL)
            break
    victim.wait(timeout=60)
    assert victim.returncode == -signal.SIGKILL
    assert tte.checkpoint.load(tmp_path / "run.pt") == {"step": 10}  # the last complete checkpoint
    resumed = run_worker(str(tmp_path / "run.pt"), "20", "0", "resume")
    assert resumed.wait(timeout=300) == 0
    want = torch.load(tmp_path / "ref.pt.final", weights_only=True)
    got = torch.load(tmp_path / "run.pt.final", weights_only=True)
    for k in want:
        assert torch.equal(got[k], want[k]), k  # CPU: bitwise


def test_truncated_or_corrupt_checkpoint_gives_a_clear_error(tmp_path: Path) -> None:
    ec, head = model()
    path = tmp_path / "c.pt"
    tte.checkpoint.save(path, model=ec)
    data = path.read_bytes()
    (tmp_path / "trunc.pt").write_bytes(data[: len(data) // 2])
    (tmp_path / "garbage.pt").write_bytes(b"not a checkpoint at all" * 10)
    (tmp_path / "empty.pt").write_bytes(b"")
    for name in ("trunc.pt", "garbage.pt", "empty.pt"):
        with pytest.raises(ValueError, match=rf"{name} is not a readable checkpoint \(truncated or corrupt\)"):
            tte.checkpoint.load(tmp_path / name, model=ec)
    with pytest.raises(FileNotFoundError):
        tte.checkpoint.load(tmp_path / "missing.pt", model=ec)
