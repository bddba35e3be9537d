"""A load whose user code raises after the checks passed changes nothing (checkpoint/rollback.py).

``tte.checkpoint.load`` checks the file against the model and optimizer first; the user's own load code
(a module's ``set_extra_state``, load pre- and post-hooks, a ``_load_from_state_dict`` override, the
optimizer's load pre-hook) runs after that. When it raises, every parameter, buffer, extra state and the
optimizer's state are bitwise as before; a retry loads exactly what a fresh model loads.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import torch_tpu_embedding as tte

D = 3


class Versioned(torch.nn.Module):
    """A submodule with a buffer, a parameter and extra state; its load code raises while ``fail`` says so."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones(D, dtype=torch.float64))
        self.register_buffer("seen", torch.zeros(2, dtype=torch.float64))
        self.meta: dict[str, Any] = {"version": 1, "note": "built"}
        self.fail = ""  # "set_extra_state" or "override": the load code that raises
        self.failures = 0  # how many more loads raise

    def get_extra_state(self) -> Any:
        return copy.deepcopy(self.meta)

    def set_extra_state(self, state: Any) -> None:
        self.meta = copy.deepcopy(state)  # written before it refuses: the rollback must put it back
        if self.fail == "set_extra_state" and self.failures:
            self.failures -= 1
            raise ValueError("refused")

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        super()._load_from_state_dict(state_dict, prefix, *args)
        if self.fail == "override" and self.failures:
            self.failures -= 1
            with torch.no_grad():
                self.seen.add_(100.0)  # writes, then raises
            raise RuntimeError("override refused")


def build(stack: bool) -> tuple[torch.nn.ModuleDict, torch.optim.Optimizer]:
    torch.manual_seed(0)
    feats = {"fa": tte.FeatureConfig(tte.TableConfig(12, D, name="a", dtype=torch.float64)),
             "fb": tte.FeatureConfig(tte.TableConfig(9, D, name="b", dtype=torch.float64)),
             "fc": tte.FeatureConfig(tte.TableConfig(7, D + 1, name="c", dtype=torch.float64))}
    m = torch.nn.ModuleDict({"ec": tte.EmbeddingCollection(feats, stack_tables=stack),
                             "head": torch.nn.Linear(2 * D + D + 1, 1).to(torch.float64), "sub": Versioned()})
    return m, tte.optim.Adam(m.parameters(), lr=0.05)


def train(m: torch.nn.ModuleDict, opt: torch.optim.Optimizer, steps: range) -> None:
    for s in steps:
        g = torch.Generator().manual_seed(s)
        out = m["ec"]({"fa": torch.randint(0, 12, (4,), generator=g), "fb": torch.randint(0, 9, (4,), generator=g),
                       "fc": torch.randint(0, 7, (4,), generator=g)})
        x = torch.cat([out["fa"], out["fb"], out["fc"]], 1)
        (m["head"](x).square().sum() * m["sub"].scale.sum()).backward()
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            m["sub"].seen.add_(1.0)
        m["sub"].meta = {"version": 1, "note": f"step {s}"}


def everything(m: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """Every parameter (the tables as stored), buffer and extra state, and the optimizer's state, copied."""
    return {
        "params": {n: p.detach().clone() for n, p in m.named_parameters()},
        "buffers": {n: b.detach().clone() for n, b in m.named_buffers()},
        "extra": copy.deepcopy(m["sub"].meta),
        "state_dict": {k: v.detach().clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v)
                       for k, v in m.state_dict().items()},
        "optimizer": copy.deepcopy(opt.state_dict()),
    }


def same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        bits = (lambda t: t.reshape(-1).view(torch.uint8)) if a.dtype.is_floating_point else (lambda t: t)
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and bool(
            torch.equal(bits(a), bits(b)))  # bitwise (NaN payloads and -0.0 included)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def pre_hook_raises(m: torch.nn.ModuleDict, opt: torch.optim.Optimizer) -> None:
    def hook(module: Any, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        if m["sub"].failures:
            m["sub"].failures -= 1
            raise KeyError("pre-hook refused")
    m["sub"].register_load_state_dict_pre_hook(hook)


def post_hook_on_root_raises(m: torch.nn.ModuleDict, opt: torch.optim.Optimizer) -> None:
    def hook(module: Any, incompatible: Any) -> None:
        if m["sub"].failures:
            m["sub"].failures -= 1
            raise RuntimeError("post-hook refused")
    m.register_load_state_dict_post_hook(hook)


def post_hook_on_collection_raises(m: torch.nn.ModuleDict, opt: torch.optim.Optimizer) -> None:
    def hook(module: Any, incompatible: Any) -> None:
        if m["sub"].failures:
            m["sub"].failures -= 1
            raise RuntimeError("post-hook on the collection refused")
    m["ec"].register_load_state_dict_post_hook(hook)


def error_message_added(m: torch.nn.ModuleDict, opt: torch.optim.Optimizer) -> None:
    def hook(module: Any, state_dict: dict[str, Any], prefix: str, local: Any, strict: bool, missing: list[str],
             unexpected: list[str], errors: list[str]) -> None:
        if m["sub"].failures:
            m["sub"].failures -= 1
            errors.append("a hook's own refusal")
    m["ec"].register_load_state_dict_pre_hook(hook)


def optimizer_pre_hook_raises(m: torch.nn.ModuleDict, opt: torch.optim.Optimizer) -> None:
    def hook(optimizer: Any, state_dict: dict[str, Any]) -> None:
        if m["sub"].failures:
            m["sub"].failures -= 1
            raise ValueError("optimizer pre-hook refused")
    opt.register_load_state_dict_pre_hook(hook)


def set_extra_state_raises(m: torch.nn.ModuleDict, opt: torch.optim.Optimizer) -> None:
    m["sub"].fail = "set_extra_state"


def override_raises(m: torch.nn.ModuleDict, opt: torch.optim.Optimizer) -> None:
    m["sub"].fail = "override"


CASES: dict[str, tuple[Callable[[torch.nn.ModuleDict, torch.optim.Optimizer], None], type[BaseException], str]] = {
    "set_extra_state": (set_extra_state_raises, ValueError, "refused"),
    "load_from_state_dict override": (override_raises, RuntimeError, "override refused"),
    "load pre-hook": (pre_hook_raises, KeyError, "pre-hook refused"),
    "load post-hook on the root": (post_hook_on_root_raises, RuntimeError, "post-hook refused"),
    "load post-hook on the collection": (post_hook_on_collection_raises, RuntimeError, "on the collection"),
    "error added by a pre-hook": (error_message_added, RuntimeError, "a hook's own refusal"),
    "optimizer load pre-hook": (optimizer_pre_hook_raises, ValueError, "optimizer pre-hook refused"),
}


def saved(tmp_path: Path, stack: bool) -> tuple[Path, torch.nn.ModuleDict, torch.optim.Optimizer]:
    """``good.pt`` after 3 steps, and a model trained 5 other steps (every value differs from the file's)."""
    m, opt = build(stack)
    train(m, opt, range(3))
    path = tmp_path / "good.pt"
    tte.checkpoint.save(path, model=m, optimizer=opt)
    m2, opt2 = build(stack)
    train(m2, opt2, range(10, 15))
    return path, m2, opt2


@pytest.mark.parametrize("stack", [True, False], ids=["stacked", "per-table"])
@pytest.mark.parametrize("case", list(CASES))
def test_a_user_hook_that_raises_changes_nothing(tmp_path: Path, case: str, stack: bool) -> None:
    path, m, opt = saved(tmp_path, stack)
    arm, error, match = CASES[case]
    arm(m, opt)
    m["sub"].failures = 1 << 30  # every attempt
    before = everything(m, opt)
    with pytest.raises(error, match=match):
        tte.checkpoint.load(path, model=m, optimizer=opt)
    assert same(everything(m, opt), before)


@pytest.mark.parametrize("stack", [True, False], ids=["stacked", "per-table"])
@pytest.mark.parametrize("case", list(CASES))
def test_a_retry_after_a_hook_raised_loads_the_file(tmp_path: Path, case: str, stack: bool) -> None:
    path, m, opt = saved(tmp_path, stack)
    arm, error, match = CASES[case]
    arm(m, opt)
    m["sub"].failures = 1  # the first attempt only
    with pytest.raises(error, match=match):
        tte.checkpoint.load(path, model=m, optimizer=opt)
    tte.checkpoint.load(path, model=m, optimizer=opt)
    fresh, fresh_opt = build(stack)
    tte.checkpoint.load(path, model=fresh, optimizer=fresh_opt)
    assert same(everything(m, opt), everything(fresh, fresh_opt))
    # and both train on alike
    train(m, opt, range(20, 22))
    train(fresh, fresh_opt, range(20, 22))
    assert same(everything(m, opt), everything(fresh, fresh_opt))


def test_a_torch_optimizer_whose_load_post_hook_raises_is_put_back(tmp_path: Path) -> None:
    m, _ = build(True)
    opt = torch.optim.Adam(m["head"].parameters(), lr=0.1)
    x = torch.ones(4, 2 * D + D + 1, dtype=torch.float64)
    m["head"](x).sum().backward()
    opt.step()
    tte.checkpoint.save(tmp_path / "t.pt", model=m, optimizer=opt)
    m["head"](x).sum().backward()
    opt.step()
    opt.register_load_state_dict_post_hook(lambda o: (_ for _ in ()).throw(RuntimeError("post refused")))
    before = everything(m, opt)
    state_obj = opt.state
    with pytest.raises(RuntimeError, match="post refused"):
        tte.checkpoint.load(tmp_path / "t.pt", model=m, optimizer=opt)
    assert same(everything(m, opt), before)
    assert opt.state is state_obj


def test_post_hooks_see_the_load_finished_but_the_tables(tmp_path: Path) -> None:
    """Documented order: user code runs before the tables are written; after load returns, all is loaded."""
    path, m, opt = saved(tmp_path, True)
    seen: dict[str, Any] = {}

    def hook(module: Any, incompatible: Any) -> None:
        seen["head"] = m["head"].weight.detach().clone()
        seen["table"] = m["ec"].tables["a"].weight.detach().clone()
    m.register_load_state_dict_post_hook(hook)
    old_table = m["ec"].tables["a"].weight.detach().clone()
    tte.checkpoint.load(path, model=m, optimizer=opt)
    assert torch.equal(seen["head"], m["head"].weight) and torch.equal(seen["table"], old_table)
    fresh, fresh_opt = build(True)
    tte.checkpoint.load(path, model=fresh, optimizer=fresh_opt)
    assert same(everything(m, opt), everything(fresh, fresh_opt))


@pytest.mark.parametrize("saved_stacked", [True, False], ids=["same-stacking", "stacked-otherwise"])
def test_load_distributed_with_a_raising_hook_changes_nothing(tmp_path: Path, saved_stacked: bool) -> None:
    """``load_distributed`` reads the tables in place without module code; a checkpoint stacked otherwise than the
    model goes through ``load``'s order, where a hook that raises changes nothing."""
    def make(stack: bool) -> tuple[torch.nn.ModuleDict, torch.optim.Optimizer]:
        m, _ = build(stack)
        del m["sub"]  # (a distributed checkpoint holds no extra state)
        return m, tte.optim.Adam(m.parameters(), lr=0.05)

    def steps(m: torch.nn.ModuleDict, opt: torch.optim.Optimizer, seeds: range) -> None:
        for s in seeds:
            g = torch.Generator().manual_seed(s)
            out = m["ec"]({f: torch.randint(0, n, (4,), generator=g) for f, n in (("fa", 12), ("fb", 9), ("fc", 7))})
            m["head"](torch.cat([out["fa"], out["fb"], out["fc"]], 1)).square().sum().backward()
            opt.step()
            opt.zero_grad()

    src, src_opt = make(saved_stacked)
    steps(src, src_opt, range(3))
    tte.checkpoint.save_distributed(tmp_path / "d", model=src, optimizer=src_opt)
    m, opt = make(True)
    steps(m, opt, range(10, 14))
    failures = [1]

    def hook(module: Any, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        if failures[0]:
            failures[0] -= 1
            raise KeyError("pre-hook refused")
    m["head"].register_load_state_dict_pre_hook(hook)
    before = {"params": {n: p.detach().clone() for n, p in m.named_parameters()},
              "optimizer": copy.deepcopy(opt.state_dict())}
    if saved_stacked:  # read in place: no module code runs
        tte.checkpoint.load_distributed(tmp_path / "d", model=m, optimizer=opt)
        assert failures == [1]
        return
    with pytest.raises(KeyError, match="pre-hook refused"):
        tte.checkpoint.load_distributed(tmp_path / "d", model=m, optimizer=opt)
    assert same({"params": {n: p.detach().clone() for n, p in m.named_parameters()},
                 "optimizer": copy.deepcopy(opt.state_dict())}, before)
    tte.checkpoint.load_distributed(tmp_path / "d", model=m, optimizer=opt)
    fresh, fresh_opt = make(True)
    tte.checkpoint.load_distributed(tmp_path / "d", model=fresh, optimizer=fresh_opt)
    assert same(m.state_dict(), fresh.state_dict()) and same(opt.state_dict(), fresh_opt.state_dict())
