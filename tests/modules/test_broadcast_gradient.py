"""A loss like ``torch.cat(outputs, 1).sum()`` hands a stacked lookup each feature's gradient as one value broadcast
(strides 0): the backward keeps it so (no ``[B·F, D]`` join is written), the C row loops read that one row, and
every optimizer's result is bitwise the one it gets from the same gradient written out (``(out * ones).sum()``),
on the kernel path (C loops at 1 and 2 threads, the duplicate sum's rows for ``clipnorm``) and the reference path.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import torch_tpu_embedding as tte
from torch_tpu_embedding.optim._kernels import c_library, c_rules, kernel_policy


class _FloatCats(TorchDispatchMode):
    """Counts ``cat``/``stack``/``clone`` of floating tensors (a copy of activations or gradients)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if name in ("cat", "stack", "clone") and isinstance(out, torch.Tensor) and out.is_floating_point() \
                and out.dim() == 2 and out.shape[0] > 1:
            self.counts["float_" + name] += 1
        return out


@pytest.fixture
def kernel_path(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    if c_library.library() is None:
        pytest.skip("no C compiler builds the library here")
    monkeypatch.setattr(kernel_policy, "_ENABLED", True)
    before = kernel_policy.set_policy(0, 0)
    yield
    kernel_policy.set_policy(*before)


OPTIMIZERS = {
    "rowwise_adagrad": lambda ps: tte.optim.RowWiseAdagrad(ps, lr=0.1, weight_decay=0.01),
    "rowwise_adagrad_clipnorm": lambda ps: tte.optim.RowWiseAdagrad(ps, lr=0.1, clipnorm=0.5),
    "lazy_adam": lambda ps: tte.optim.LazyAdam(ps, lr=0.01),
    "sgd": lambda ps: tte.optim.SGD(ps, lr=0.5),
}


def _train(make: Any, broadcast: bool, steps: int = 3) -> tuple[dict[str, torch.Tensor], Counter[str]]:
    """4 features of one table width and combiner (one stacked group, looked up batch-major), 1 id per bag."""
    torch.manual_seed(0)
    tables = [tte.TableConfig(500, 8, name=f"t{i}") for i in range(4)]
    ec = tte.EmbeddingCollection({f"f{i}": tte.FeatureConfig(t) for i, t in enumerate(tables)})
    opt = make(ec.parameters())
    counts: Counter[str] = Counter()
    for s in range(steps):
        g = torch.Generator().manual_seed(s)
        out = ec({f"f{i}": torch.randint(0, 500, (96,), generator=g) for i in range(4)})
        joined = torch.cat([out[f] for f in ec.feature_names], dim=1)
        loss = joined.sum() if broadcast else (joined * torch.ones_like(joined)).sum()
        with _FloatCats() as ops:
            loss.backward()
            opt.step()
        counts += ops.counts
        opt.zero_grad()
    return {k: v.clone() for k, v in ec.state_dict().items()}, counts


@pytest.mark.parametrize("opt", sorted(OPTIMIZERS))
@pytest.mark.parametrize("threads", [1, 2])
def test_a_broadcast_gradient_is_not_joined_and_trains_bitwise_alike(kernel_path: None, opt: str, threads: int,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(c_rules, "_MIN_ROWS_PER_THREAD", 64)  # (small rows: split over threads all the same)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got, counts = _train(OPTIMIZERS[opt], broadcast=True)
        want, _ = _train(OPTIMIZERS[opt], broadcast=False)
    finally:
        torch.set_num_threads(before)
    assert counts["float_cat"] == 0 and counts["float_stack"] == 0, counts
    if opt != "rowwise_adagrad_clipnorm":  # (clipnorm sums every row first: the rows made whole)
        assert counts["float_clone"] == 0, counts
    for k, v in want.items():
        assert torch.equal(got[k], v), k


def test_the_reference_path_trains_bitwise_alike(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows multiplied out in the backward (no kernel path): the broadcast value is multiplied as the written one."""
    monkeypatch.setattr(kernel_policy, "_ENABLED", False)
    for make in (OPTIMIZERS["rowwise_adagrad"], lambda ps: tte.optim.Adagrad(ps, lr=0.1)):
        got, _ = _train(make, broadcast=True)
        want, _ = _train(make, broadcast=False)
        for k, v in want.items():
            assert torch.equal(got[k], v), k
