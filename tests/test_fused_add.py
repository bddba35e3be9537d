"""``Path.ADDITIVE``'s compiled increment-and-add (``optim/_fused_add.py``) against the eager path it
replaces: bitwise the same tables after several SGD steps, at 1 and 2 threads, through the per-feature
dict and ``concat=True``, with ids repeated within and across features, padded bags, a jagged feature
with per-id weights and an empty bag, and pieces of fewer than 2 ids; where it does not run (warm-up,
bags of several ids, ``loss_scale_factor``, the path turned off), and one warning, then the eager path,
when nothing can be compiled.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import torch_tpu_embedding as tte
from torch_tpu_embedding.optim import _fused_add, _fused_update


@pytest.fixture
def kernel_calls(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[list[int]]]:
    """The compiled path on (from the first step, as the default policy has it from call 50 on), and the
    number of ids of each piece of each kernel call."""
    monkeypatch.setattr(_fused_update, "_ENABLED", True)
    before = _fused_update.set_policy(0, 0)
    calls: list[list[int]] = []
    real = _fused_update.call

    def counted(fn: Any, args: tuple[Any, ...]) -> None:
        calls.append([int(i.numel()) for i in args[1]])
        real(fn, args)

    monkeypatch.setattr(_fused_update, "call", counted)
    yield calls
    _fused_update.set_policy(*before)


def _model(width: int = 1, combiner: str = "sum", **opt: Any) -> tuple[tte.EmbeddingCollection, tte.optim.SGD]:
    torch.manual_seed(0)
    tables = [tte.TableConfig(50, 8, name=f"t{i}", combiner=combiner) for i in range(3)]
    features = {"a": tte.FeatureConfig(tables[0], max_ids_per_bag=width), "b": tte.FeatureConfig(tables[1]),
                "c": tte.FeatureConfig(tables[0]), "d": tte.FeatureConfig(tables[2])}
    ec = tte.EmbeddingCollection(features)
    return ec, tte.optim.SGD(ec.parameters(), lr=0.3, **opt)


def _batch(step: int, b: int = 16, width: int = 1) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step)
    ids = [torch.randint(0, 6, (b,), generator=g) for _ in range(3)]  # 6 of 50 rows: ids repeat
    a = torch.randint(0, 6, (b, width), generator=g)
    mask = torch.rand(b, width, generator=g) > 0.3  # padding in feature "a"
    return {"a": tte.Padded(a, mask), "b": ids[0], "c": ids[1],
            # per-id weights, a bag of 2 and one of none
            "d": tte.Jagged(ids[2], lengths=torch.tensor([1] * (b - 2) + [2, 0]), weights=torch.rand(b, generator=g))}


def _train(ec: tte.EmbeddingCollection, opt: torch.optim.Optimizer, steps: int, concat: bool,
           batch: Any = _batch, **kw: Any) -> list[torch.Tensor]:
    for s in range(steps):
        x = batch(s, **kw)
        if concat:
            out = ec(x, concat=True)
        else:
            parts = ec(x)
            out = torch.cat([parts[f] for f in ("a", "b", "c", "d")], dim=1)
        (out * torch.linspace(-1, 2, out.shape[1])).square().sum().backward()
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in ec.parameters()]


@pytest.mark.usefixtures("compiler")
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("concat", [False, True], ids=["dict", "concat"])
def test_compiled_add_is_the_eager_path_bitwise(kernel_calls: list[list[int]], threads: int, concat: bool) -> None:
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = _train(*_model(), 4, concat)
        assert kernel_calls and all(n >= 2 for c in kernel_calls for n in c)  # it ran, never on 0 or 1 ids
        assert max(len(c) for c in kernel_calls) > 1  # several pieces in one call
        _fused_update.set_enabled(False)
        want = _train(*_model(), 4, concat)
    finally:
        torch.set_num_threads(before)
        _fused_update.set_enabled(True)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)


@pytest.mark.usefixtures("compiler")
def test_pieces_of_one_id_and_padding_only(kernel_calls: list[list[int]]) -> None:
    """Batches of one bag and a padded feature with every position masked: pieces of 0 or 1 id take the
    eager add (no compile for sizes 0 and 1). Only the first step's rows, which arrive multiplied out,
    make a piece of 2 ids ("a", "b", "c" looked up together, the padding dropped)."""
    def batch(step: int) -> dict[str, Any]:
        x = _batch(step, b=1)
        x["a"] = tte.Padded(x["a"].ids, torch.zeros(1, 1, dtype=torch.bool))
        x["d"] = tte.Jagged(torch.tensor([step % 6]), lengths=torch.tensor([1]))
        return x

    got = _train(*_model(), 3, False, batch=batch)
    assert kernel_calls == [[2]]
    _fused_update.set_enabled(False)
    try:
        want = _train(*_model(), 3, False, batch=batch)
    finally:
        _fused_update.set_enabled(True)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("case", ["warming_up", "bags_of_3_ids", "loss_scale_factor", "disabled"])
def test_where_the_eager_path_runs(kernel_calls: list[list[int]], case: str) -> None:
    if case == "warming_up":
        _fused_update.set_policy(after=50)
    if case == "disabled":
        _fused_update.set_enabled(False)
    try:
        ec, opt = _model(width=3 if case == "bags_of_3_ids" else 1,
                         **({"loss_scale_factor": 4.0} if case == "loss_scale_factor" else {}))
        width = 3 if case == "bags_of_3_ids" else 1
        _train(ec, opt, 1, False, width=width)  # (a first step's rows arrive multiplied out: any path takes them)
        kernel_calls.clear()
        _train(ec, opt, 2, False, width=width)
    finally:
        _fused_update.set_enabled(True)
    assert kernel_calls == []


def test_a_kernel_that_cannot_compile_warns_once_and_the_eager_path_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(fn: Any, **kwargs: Any) -> Any:
        def fail(*args: Any) -> None:
            raise RuntimeError("LoweringException: something inductor cannot lower")
        return fail

    monkeypatch.setattr(_fused_update, "_ENABLED", True)
    monkeypatch.setattr(_fused_update, "_WARNED", False)
    monkeypatch.setattr(_fused_add, "_KERNELS", {})
    monkeypatch.setattr(torch, "compile", broken)
    before = _fused_update.set_policy(0, 0)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = _train(*_model(), 3, True)
        _fused_update.set_enabled(False)
        want = _train(*_model(), 3, True)
    finally:
        _fused_update.set_policy(*before)
    msgs = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(msgs) == 1 and "something inductor cannot lower" in msgs[0]
    assert _fused_add._KERNELS and not any(_fused_add._KERNELS.values())  # not tried again
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
