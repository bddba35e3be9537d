"""The four state-dict hooks of torch.optim fire as torch fires them (issue 29, item 2), on every optimizer.

Each test records the same calls on a ``torch.optim.SGD`` and on this package's optimizer and
compares the two records: order (``prepend`` included), arguments, and what a hook's result does.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from optim_registry import OPTIMIZER_INFOS, OptimizerInfo
from test_optim_generic import make_model, train


def _model_and_opt(info: OptimizerInfo | None) -> tuple[Any, torch.optim.Optimizer]:
    ec, head = make_model()
    if info is None:  # torch's own, on the dense head (its state_dict cannot hold a table's row gradients)
        opt: torch.optim.Optimizer = torch.optim.SGD(head.parameters(), lr=0.1, momentum=0.9)
        loss = head(torch.ones(2, head.in_features, dtype=head.weight.dtype)).sum()
        loss.backward()
        opt.step()
        opt.zero_grad()
    else:
        opt = info.cls([*ec.parameters(), *head.parameters()], **info.default)
        train(ec, head, opt, 2)
    return (ec, head), opt


def _record_state_dict(opt: torch.optim.Optimizer) -> list[tuple[Any, ...]]:
    log: list[tuple[Any, ...]] = []
    opt.register_state_dict_pre_hook(lambda o: log.append(("pre-a", o is opt)))
    opt.register_state_dict_pre_hook(lambda o: log.append(("pre-first", o is opt)), prepend=True)
    dropped = opt.register_state_dict_pre_hook(lambda o: log.append(("removed",)))
    dropped.remove()

    def post_a(o: Any, sd: dict[str, Any]) -> None:
        log.append(("post-a", o is opt, sorted(k for k in sd if k in ("state", "param_groups"))))
        sd["tag"] = "a"  # in place

    def post_b(o: Any, sd: dict[str, Any]) -> dict[str, Any]:
        log.append(("post-b", sd.get("tag")))
        return {**sd, "tag": "b"}  # a new state dict replaces it

    opt.register_state_dict_post_hook(post_b)
    opt.register_state_dict_post_hook(post_a, prepend=True)
    sd = opt.state_dict()
    log.append(("returned", sd["tag"]))
    return log


@pytest.mark.parametrize("info", OPTIMIZER_INFOS, ids=lambda i: i.name)
def test_state_dict_hooks_fire_as_torch(info: OptimizerInfo) -> None:
    _, ref = _model_and_opt(None)
    _, opt = _model_and_opt(info)
    expected = _record_state_dict(ref)
    assert expected == [("pre-first", True), ("pre-a", True), ("post-a", True, ["param_groups", "state"]),
                        ("post-b", "a"), ("returned", "b")]
    assert _record_state_dict(opt) == expected


def _record_load(opt: torch.optim.Optimizer) -> list[tuple[Any, ...]]:
    sd = opt.state_dict()
    sd["extra"] = 1
    lr_before = opt.param_groups[0]["lr"]
    log: list[tuple[Any, ...]] = []

    def pre_a(o: Any, got: dict[str, Any]) -> None:
        log.append(("pre-a", o is opt, got is sd, got.get("extra"), got["param_groups"][0]["lr"]))
        del got["extra"]  # the hook gets a shallow copy: the caller's dict keeps its key

    def pre_first(o: Any, got: dict[str, Any]) -> dict[str, Any]:
        log.append(("pre-first", o is opt, got is sd))
        groups = [{**g, "lr": 0.5} for g in got["param_groups"]]
        return {**got, "param_groups": groups}  # loaded instead

    def post(o: Any) -> None:
        log.append(("post", o is opt, o.param_groups[0]["lr"]))

    opt.register_load_state_dict_pre_hook(pre_a)
    opt.register_load_state_dict_pre_hook(pre_first, prepend=True)
    opt.register_load_state_dict_post_hook(post)
    removed = opt.register_load_state_dict_post_hook(lambda o: log.append(("removed",)))
    removed.remove()
    opt.load_state_dict(sd)
    log.append(("caller keeps", sd.get("extra"), opt.param_groups[0]["lr"] != lr_before))
    return log


@pytest.mark.parametrize("info", OPTIMIZER_INFOS, ids=lambda i: i.name)
def test_load_state_dict_hooks_fire_as_torch(info: OptimizerInfo) -> None:
    _, ref = _model_and_opt(None)
    _, opt = _model_and_opt(info)
    expected = _record_load(ref)
    assert expected == [("pre-first", True, False), ("pre-a", True, False, 1, 0.5), ("post", True, 0.5),
                        ("caller keeps", 1, True)]
    assert _record_load(opt) == expected


@pytest.mark.parametrize("info", OPTIMIZER_INFOS, ids=lambda i: i.name)
def test_load_post_hook_sees_the_loaded_state(info: OptimizerInfo) -> None:
    """The post hook runs after the state is in place: a fresh optimizer's state equals the saved one."""
    (ec, head), opt = _model_and_opt(info)
    sd = opt.state_dict()
    fresh = info.cls([*ec.parameters(), *head.parameters()], **info.default)
    seen: list[dict[str, Any]] = []
    fresh.register_load_state_dict_post_hook(lambda o: seen.append(o.state_dict()["state"]))
    fresh.load_state_dict(sd)
    assert len(seen) == 1 and sorted(seen[0]) == sorted(sd["state"])
    for key, slots in sd["state"].items():
        for name, value in slots.items():
            if isinstance(value, torch.Tensor):
                torch.testing.assert_close(seen[0][key][name], value, rtol=0, atol=0)
