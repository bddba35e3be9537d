"""The optimizer's call counters (``iterations``, ``skipped_steps``, ``overflowed_steps``) in every checkpoint form.

``skipped_steps`` is state: the moving average's counter leaves the calls ``skip_nonfinite`` dropped out, and the
call counter leaves out those an exchange overflow dropped (``overflowed_steps``). A distributed checkpoint
(``tte.checkpoint.save_distributed``) saved neither until 2026-12-02: the run it resumed reported no skipped call,
kept the loading optimizer's own count, and its moving averages drifted from the run that saved it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from optim_registry import NONFINITE, OptimizerConfig, cases

import torch_tpu_embedding as tte
from torch_tpu_embedding.optim._state import state_save

IDS = torch.tensor([[1, 2, 3], [4, 5, 6]])


def _model(seed: int = 0) -> tuple[tte.EmbeddingCollection, torch.nn.Linear]:
    torch.manual_seed(seed)
    t = tte.TableConfig(20, 3, name="t", combiner="sum", dtype=torch.float64)
    return tte.EmbeddingCollection({"f": tte.FeatureConfig(t, max_ids_per_bag=3)}), torch.nn.Linear(3, 1).double()


def _steps(ec: tte.EmbeddingCollection, head: torch.nn.Linear, opt: Any, scales: list[float]) -> None:
    for i, scale in enumerate(scales):
        (head(ec({"f": tte.Padded((IDS + i) % 20)})["f"]).sum() * scale).backward()
        opt.step()
        opt.zero_grad()


def _everything(ec: tte.EmbeddingCollection, head: torch.nn.Linear, opt: Any) -> dict[str, Any]:
    return {"model": {**ec.state_dict(), **head.state_dict()}, "optim": state_save.state_dict(opt)}


def _assert_equal(a: Any, b: Any, path: str = "") -> None:
    if isinstance(a, dict):
        assert set(a) == set(b), path
        for k in a:
            _assert_equal(a[k], b[k], f"{path}/{k}")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_equal(x, y, f"{path}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert torch.equal(a, b), path
    else:
        assert a == b, (path, a, b)


@pytest.mark.parametrize("cfg", cases(NONFINITE), ids=str)
def test_a_distributed_checkpoint_keeps_the_skipped_calls(cfg: OptimizerConfig, tmp_path: Path) -> None:
    """Saved after a dropped call and loaded into an optimizer that dropped two of its own: the count is the
    checkpoint's, and trained on, the run equals the one that saved it, moving averages included."""
    ec, head = _model()
    opt = cfg.make([*ec.parameters(), *head.parameters()], skip_nonfinite=True, use_ema=True)
    _steps(ec, head, opt, [1.0, float("inf"), 1.0])
    assert opt.skipped_steps == 1
    tte.checkpoint.save_distributed(tmp_path / "c", model=torch.nn.ModuleList([ec, head]), optimizer=opt)
    ec2, head2 = _model(seed=5)
    opt2 = cfg.make([*ec2.parameters(), *head2.parameters()], skip_nonfinite=True, use_ema=True)
    _steps(ec2, head2, opt2, [float("inf"), 1.0, float("inf")])
    assert opt2.skipped_steps == 2
    tte.checkpoint.load_distributed(tmp_path / "c", model=torch.nn.ModuleList([ec2, head2]), optimizer=opt2)
    assert opt2.skipped_steps == 1 and opt2.overflowed_steps == 0
    _assert_equal(_everything(ec2, head2, opt2), _everything(ec, head, opt))
    _steps(ec, head, opt, [1.0, 0.5, 2.0])
    _steps(ec2, head2, opt2, [1.0, 0.5, 2.0])
    _assert_equal(_everything(ec2, head2, opt2), _everything(ec, head, opt))


def _counted(skipped: int, overflowed: int) -> tuple[tte.EmbeddingCollection, torch.nn.Linear, Any]:
    """An optimizer whose counters read ``skipped`` / ``overflowed`` (an overflow needs routed tables under SPMD,
    tests/xla_spmd/test_overflow_rule.py: here the counters arrive through a load)."""
    ec, head = _model()
    opt = tte.optim.Adam([*ec.parameters(), *head.parameters()], lr=0.1, skip_nonfinite=True, use_ema=True)
    _steps(ec, head, opt, [1.0, 1.0])
    sd = opt.state_dict()
    sd.update(iterations=9, skipped_steps=skipped, overflowed_steps=overflowed)
    opt.load_state_dict(sd)
    return ec, head, opt


@pytest.mark.parametrize("form", ["state_dict", "torch_layout", "save", "save_distributed"])
def test_every_form_keeps_the_overflowed_calls(form: str, tmp_path: Path) -> None:
    ec, head, opt = _counted(3, 2)
    assert (opt.skipped_steps, opt.overflowed_steps) == (3, 2)
    ec2, head2 = _model(seed=5)
    opt2 = tte.optim.Adam([*ec2.parameters(), *head2.parameters()], lr=0.1, skip_nonfinite=True, use_ema=True)
    _steps(ec2, head2, opt2, [float("inf")])
    assert bool(opt2.last_step_skipped)
    both, both2 = torch.nn.ModuleList([ec, head]), torch.nn.ModuleList([ec2, head2])
    if form == "state_dict":
        opt2.load_state_dict(opt.state_dict())
    elif form == "torch_layout":
        opt2.load_state_dict(tte.optim.use_torch_layout(opt).state_dict())
    elif form == "save":
        tte.checkpoint.save(tmp_path / "c.pt", model=both, optimizer=opt)
        tte.checkpoint.load(tmp_path / "c.pt", model=both2, optimizer=opt2)
    else:
        tte.checkpoint.save_distributed(tmp_path / "c", model=both, optimizer=opt)
        tte.checkpoint.load_distributed(tmp_path / "c", model=both2, optimizer=opt2)
    assert (opt2._run.iterations, opt2.skipped_steps, opt2.overflowed_steps) == (9, 3, 2)
    assert not bool(opt2.last_step_skipped)  # no call since the load (until 2026-12-03: the loading one's last)
    if form in ("state_dict", "torch_layout"):  # (the checkpoints carry the model)
        both2.load_state_dict(both.state_dict())
    _steps(ec, head, opt, [1.0, float("nan"), 0.5])  # the call counter leaves the 2 overflowed calls out
    _steps(ec2, head2, opt2, [1.0, float("nan"), 0.5])
    _assert_equal(_everything(ec2, head2, opt2), _everything(ec, head, opt))


@pytest.mark.parametrize(("skipped", "overflowed", "why"), [
    (3, 4, "'overflowed_steps' counts some of 'skipped_steps', so it must be at most it. Received 4 and 3"),
    (3, -1, "'overflowed_steps' must be an integer >= 0. Received int -1"),
    (3, 1.5, "'overflowed_steps' must be an integer >= 0"),
])
def test_counters_that_cannot_be_are_refused_before_anything_changes(skipped: int, overflowed: Any,
                                                                     why: str) -> None:
    ec, head = _model()
    opt = tte.optim.Adam([*ec.parameters(), *head.parameters()], lr=0.1, skip_nonfinite=True)
    _steps(ec, head, opt, [1.0, float("inf")])
    sd = opt.state_dict()
    sd.update(skipped_steps=skipped, overflowed_steps=overflowed)
    before = _everything(ec, head, opt)
    with pytest.raises(ValueError) as info:
        opt.load_state_dict(sd)
    assert why in str(info.value), str(info.value)
    _assert_equal(_everything(ec, head, opt), before)
    assert (opt.skipped_steps, opt.overflowed_steps) == (1, 0)
