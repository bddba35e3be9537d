"""A load checks the optimizer's state once (``state_load.state_problems`` walks every slot).

Before, a load checked it up to three times: ``tte.checkpoint``'s check of the file (or, for torch's layout
over a process group, ``from_torch_layout``'s before the ranks' agreement), ``staged_load``'s, then the write's
own. Now the check hands on what it passed (``state_check.CheckedState``) and the write does not check again.
A state a load pre-hook may have changed is still checked after the hooks, and a user's direct
``load_state_dict`` still refuses a bad state. (Over a process group: tests/distributed/test_mp_ckpt_agreement.py.)
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from _stacked_model import Model, batches

import torch_tpu_embedding as tte
from torch_tpu_embedding.optim._state import state_load, state_save
from torch_tpu_embedding.optim._state.state_check import CheckedState


def _trained(seed: int = 0) -> tuple[Model, Any]:
    model = Model(seed=seed)
    opt = tte.optim.Adagrad(model.parameters(), lr=0.1)
    data: Iterator[dict[str, tte.Jagged]] = batches(seed + 1)
    for _ in range(2):
        model(next(data)).backward()
        opt.step()
        opt.zero_grad()
    return model, opt


@pytest.fixture
def checks(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """One entry per call of ``state_load.state_problems`` (every check of a load goes through the module's name)."""
    calls: list[int] = []
    real = state_load.state_problems

    def counted(*args: Any) -> list[str]:
        calls.append(1)
        return real(*args)

    monkeypatch.setattr(state_load, "state_problems", counted)
    return calls


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def test_load_state_dict_checks_once(checks: list[int]) -> None:
    _, opt = _trained()
    _, opt2 = _trained(seed=3)
    sd = opt.state_dict()
    opt2.load_state_dict(sd)
    assert len(checks) == 1
    assert _same(opt2.state_dict(), sd)


def test_a_direct_load_of_a_bad_state_is_still_refused_after_one_check(checks: list[int]) -> None:
    _, opt = _trained()
    _, opt2 = _trained(seed=3)
    sd = opt.state_dict()
    sd["param_groups"][0]["lr"] = -1.0
    before = opt2.state_dict()
    with pytest.raises(ValueError, match="Optimizer state does not match: group 0: .*lr"):
        opt2.load_state_dict(sd)
    assert len(checks) == 1
    assert _same(opt2.state_dict(), before)


def test_a_checkpoint_load_checks_once(tmp_path: Path, checks: list[int]) -> None:
    model, opt = _trained()
    tte.checkpoint.save(tmp_path / "ckpt.pt", model=model, optimizer=opt)
    model2, opt2 = _trained(seed=3)
    checks.clear()  # (the save checks nothing; cleared all the same, so that only the load counts)
    tte.checkpoint.load(tmp_path / "ckpt.pt", model=model2, optimizer=opt2)
    assert len(checks) == 1
    assert _same(opt2.state_dict(), opt.state_dict())


def test_a_checkpoint_load_checks_again_what_a_load_pre_hook_changed(tmp_path: Path) -> None:
    """The file's check passed, but a pre-hook changes the state after it: refused, not written unchecked."""
    model, opt = _trained()
    tte.checkpoint.save(tmp_path / "ckpt.pt", model=model, optimizer=opt)
    model2, opt2 = _trained(seed=3)
    before = opt2.state_dict()

    def bad_lr(o: Any, sd: dict[str, Any]) -> dict[str, Any]:
        return {**sd, "param_groups": [{**g, "lr": -1.0} for g in sd["param_groups"]]}

    opt2.register_load_state_dict_pre_hook(bad_lr)
    with pytest.raises(ValueError, match="Optimizer state does not match: group 0: .*lr"):
        tte.checkpoint.load(tmp_path / "ckpt.pt", model=model2, optimizer=opt2)
    assert _same(opt2.state_dict(), before)


def test_torchs_layout_checks_once(checks: list[int]) -> None:
    _, opt = _trained()
    sd = tte.optim.use_torch_layout(opt).state_dict()
    assert set(sd["state"]) == set(range(6))  # torch's layout: positions
    _, opt2 = _trained(seed=3)
    checks.clear()
    opt2.load_state_dict(sd)
    assert len(checks) == 1
    assert _same(state_save.state_dict(opt2), state_save.state_dict(opt))


def test_torchs_layout_refused_after_one_check(checks: list[int]) -> None:
    _, opt = _trained()
    sd = tte.optim.use_torch_layout(opt).state_dict()
    sd["param_groups"][0]["lr"] = -1.0
    _, opt2 = _trained(seed=3)
    before = state_save.state_dict(opt2)
    checks.clear()
    with pytest.raises(ValueError, match="Optimizer state does not match: group 0: .*lr"):
        opt2.load_state_dict(sd)
    assert len(checks) == 1
    assert _same(state_save.state_dict(opt2), before)


def test_a_state_checked_for_another_optimizer_is_checked_again(checks: list[int]) -> None:
    _, opt = _trained()
    _, opt2 = _trained(seed=3)
    passed = state_load.checked(opt, opt.state_dict())
    assert isinstance(passed, CheckedState) and len(checks) == 1
    opt2.staged_load(passed)()
    assert len(checks) == 2
    opt2.staged_load(CheckedState.of(passed.state, opt2))()  # checked for opt2: written as it is
    assert len(checks) == 2


def test_a_checkpoint_load_checks_again_when_the_models_load_changed_the_optimizer(tmp_path: Path,
                                                                                  checks: list[int]) -> None:
    """The file was checked against the optimizer's groups, then a hook of the model's load changed them (a new
    group): the state is checked again against what the optimizer is now, and refused; nothing is loaded."""
    model, opt = _trained()
    tte.checkpoint.save(tmp_path / "ckpt.pt", model=model, optimizer=opt)
    model2, opt2 = _trained(seed=3)
    extra = torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))

    def add_group(module: torch.nn.Module, state_dict: Any, *args: Any) -> None:
        if not any(p is extra for g in opt2.param_groups for p in g["params"]):
            opt2.add_param_group({"params": [extra]})

    model2.register_load_state_dict_pre_hook(add_group)
    weights = {k: v.clone() for k, v in model2.state_dict().items()}
    checks.clear()
    with pytest.raises(ValueError, match="Optimizer state does not match"):
        tte.checkpoint.load(tmp_path / "ckpt.pt", model=model2, optimizer=opt2)
    assert len(checks) == 2  # the file's, then staged_load's against the changed groups
    assert all(torch.equal(v, model2.state_dict()[k]) for k, v in weights.items())
