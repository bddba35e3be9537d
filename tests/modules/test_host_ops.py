"""The host's work per step does not grow with the number of features of a stacked group (issue [host]).

Counts, not times: the aten ops one steady training step dispatches (``TorchDispatchMode``), the host reads
among them (``_local_scalar_dense``) — the same on every machine. The step is ``benchmarks/host_ops.py``'s:
``T`` features, one table each, stacked in one group, ``Padded`` bags of 4 host ids (a quarter masked out),
``mean``, a ``Linear`` head, ``tte.optim.Adam``, past the kernel switch (the steady step). And the assembled lookup against the
per-feature one, in float64: outputs, row gradients and a step, bitwise; errors still name the feature.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch
from test_stacked_groups import _CountOps

import torch_tpu_embedding as tte
from torch_tpu_embedding.optim._core import update_paths
from torch_tpu_embedding.optim._kernels import c_library, kernel_policy


class DuckKJT:
    """A stand-in for ``torchrec.KeyedJaggedTensor`` (its methods only; torchrec is not installed)."""

    def __init__(self, keys: list[str], values: torch.Tensor, lengths: torch.Tensor,
                 weights: torch.Tensor | None = None, use_offsets: bool = False) -> None:
        self._k, self._v, self._l, self._w = keys, values, lengths, weights
        if use_offsets:
            self.lengths = None  # type: ignore[assignment]  # (only offsets(), as some producers give)

    def keys(self) -> list[str]:
        return self._k

    def values(self) -> torch.Tensor:
        return self._v

    def lengths(self) -> torch.Tensor:
        return self._l

    def offsets(self) -> torch.Tensor:
        return torch.cat([self._l.new_zeros(1), torch.cumsum(self._l, 0)])

    def weights_or_none(self) -> torch.Tensor | None:
        return self._w


def _model(t: int, dtype: torch.dtype = torch.float32, **kw: Any) -> tuple[Any, Any, list[str]]:
    torch.manual_seed(0)
    features = {f"f{i:03d}": tte.FeatureConfig(tte.TableConfig(1000, 16, name=f"t{i:03d}", combiner="mean",
                                                               dtype=dtype), max_ids_per_bag=4) for i in range(t)}
    ec = tte.EmbeddingCollection(features, **kw)
    head = torch.nn.Linear(16 * t, 1, dtype=dtype)
    return ec, head, list(features)


def _batches(names: list[str], n: int, seed: int = 1) -> list[dict[str, Any]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        out.append({f: tte.Padded(torch.randint(0, 1000, (64, 4), generator=g), torch.rand(64, 4, generator=g) > 0.25)
                    for f in names})
    return out


def _step(ec: Any, head: Any, opt: Any, x: Any, concat: bool) -> None:
    if concat:
        act = ec(x, concat=True)
    else:
        out = ec(x)
        act = torch.cat([out[k] for k in sorted(out)], dim=1)
    head(act).square().mean().backward()
    opt.step()
    opt.zero_grad()


def _count(t: int, concat: bool) -> Counter[str]:
    ec, head, names = _model(t)
    opt = tte.optim.Adam(ec.parameters(), lr=0.01)
    data = _batches(names, 4)
    for i in range(52):  # past the kernel switch (TTE_KERNEL_AFTER, 50 calls by default): the steady step
        _step(ec, head, opt, data[i % 4], concat)
    with _CountOps() as ops:
        _step(ec, head, opt, data[1], concat)
    return ops.counts


def test_ops_per_step_do_not_grow_with_features(monkeypatch: pytest.MonkeyPatch) -> None:
    # The suite runs the reference update (tests/conftest.py), in chunks of ROW_CHUNK touched rows: ops that
    # follow the ids of a step (25,600 at T = 100), not its features. One chunk here, to count the latter.
    monkeypatch.setattr(update_paths, "ROW_CHUNK", 1 << 20)
    monkeypatch.setattr(update_paths, "ROW_CHUNK_PARALLEL", 1 << 20)
    if kernel_policy.enabled():  # (TTE_UPDATE_KERNEL=1: only T = 100's table was large enough for the kernel path, whose
        monkeypatch.setattr(kernel_policy, "_MIN_ELEMENTS", 0)  # update and C join of host ids read less: every T on it)
        c_library.library()
    counts = {(t, concat): _count(t, concat) for t in (1, 100) for concat in (True, False)}
    ops = {k: sum(c.values()) for k, c in counts.items()}
    # concat=True: the group's ops do not depend on its features (goal ≤ 1.3× of one feature).
    assert ops[100, True] <= 1.3 * ops[1, True], ops
    # The dict output: each feature's [B, D] a view, and its slice in the backward of the user's torch.cat.
    assert ops[100, False] - ops[1, False] <= 3 * 99, ops
    # Host reads: one range check per group, whatever the number of features.
    reads = {k: c["_local_scalar_dense"] for k, c in counts.items()}
    assert reads[100, True] == reads[1, True] and reads[100, False] == reads[1, False], reads


def _reference_ids(x: dict[str, Any]) -> dict[str, Any]:
    """The same bags as jagged inputs (the per-feature normalisation)."""
    return {f: tte.Jagged(p.ids[p.mask], lengths=p.mask.sum(1)) for f, p in x.items()}


@pytest.mark.parametrize("concat", [False, True])
def test_assembled_lookup_equals_the_per_feature_one(concat: bool) -> None:
    ec, head, names = _model(5, torch.float64)
    ref, _, _ = _model(5, torch.float64, stack_tables=False)
    ref.load_state_dict(ec.state_dict())
    opt = tte.optim.Adagrad(ec.parameters(), lr=0.1)
    ref_opt = tte.optim.Adagrad(ref.parameters(), lr=0.1)
    for x in _batches(names, 3, seed=3):
        out, ref_out = ec(x, concat=concat), ref(_reference_ids(x), concat=concat)
        if concat:
            torch.testing.assert_close(out, ref_out, rtol=0, atol=0)
            (out * torch.arange(out.shape[1], dtype=out.dtype)).sum().backward()
            (ref_out * torch.arange(out.shape[1], dtype=out.dtype)).sum().backward()
        else:
            for f in names:
                torch.testing.assert_close(out[f], ref_out[f], rtol=0, atol=0)
            sum((i + 1) * out[f].sum() for i, f in enumerate(names)).backward()
            sum((i + 1) * ref_out[f].sum() for i, f in enumerate(names)).backward()
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    for name, w in ref.embedding_tables.items():
        torch.testing.assert_close(ec.embedding_tables[name], w, rtol=0, atol=1e-15)


def test_weights_and_dense_ids_assembled() -> None:
    ec, _, names = _model(3, torch.float64)
    ref, _, _ = _model(3, torch.float64, stack_tables=False)
    ref.load_state_dict(ec.state_dict())
    g = torch.Generator().manual_seed(5)
    ids = {f: torch.randint(0, 1000, (8, 4), generator=g) for f in names}
    w = {f: torch.rand(8, 4, generator=g, dtype=torch.float64) for f in names}
    out = ec({f: tte.Padded(ids[f], weights=w[f]) for f in names})
    want = ref({f: tte.Jagged(ids[f].reshape(-1), lengths=torch.full((8,), 4), weights=w[f].reshape(-1))
                for f in names})
    for f in names:
        torch.testing.assert_close(out[f], want[f], rtol=0, atol=1e-15)
    dense = {f: ids[f][:, 0] for f in names}
    got, want = ec(dense), ref(dense)
    for f in names:
        torch.testing.assert_close(got[f], want[f], rtol=0, atol=0)


def test_group_check_names_the_feature_and_changes_nothing() -> None:
    ec, _, names = _model(4)
    x = _batches(names, 1)[0]
    bad = x[names[2]].ids.clone()
    bad[3, 1] = 1000
    x[names[2]] = tte.Padded(bad, torch.ones_like(bad, dtype=torch.bool))
    with pytest.raises(ValueError, match=rf"Feature `{names[2]}`: ids must be in \[0, 1000\).*1000"):
        ec(x)
    assert not ec.row_grads()
    masked = torch.ones_like(bad, dtype=torch.bool)
    masked[3, 1] = False  # masked out: not an id, never checked (as before)
    x[names[2]] = tte.Padded(bad, masked)
    ec(x)
    w = torch.ones(64, 4)
    w[0, 0] = float("nan")
    x[names[1]] = tte.Padded(x[names[1]].ids, weights=w)
    with pytest.raises(ValueError, match=rf"Feature `{names[1]}`: weights must be finite"):
        ec(x)


def test_pending_ids_are_not_the_callers_buffer() -> None:
    ec, _, names = _model(2, torch.float64)
    ids = {f: torch.randint(0, 1000, (8, 4)) for f in names}
    ec({f: tte.Padded(ids[f]) for f in names}, concat=True).sum().backward()
    before = {n: i.clone() for n, (i, _) in ec.row_grads().items()}
    for t in ids.values():
        t.fill_(7)  # a loader refilling its buffer before the optimizer step
    after = {n: i for n, (i, _) in ec.row_grads().items()}
    for n in before:
        assert torch.equal(before[n], after[n])


@pytest.mark.parametrize("use_offsets", [False, True])
def test_keyed_jagged_tensor_input(use_offsets: bool) -> None:
    torch.manual_seed(0)
    user = tte.TableConfig(50, 4, name="user", combiner="sum", dtype=torch.float64)
    movie = tte.TableConfig(40, 4, name="movie", combiner="mean", dtype=torch.float64)
    ec = tte.EmbeddingCollection({"user_id": tte.FeatureConfig(user), "watched": tte.FeatureConfig(movie),
                                  "liked": tte.FeatureConfig(movie)})
    keys = ["user_id", "watched", "liked"]
    lengths = torch.tensor([1, 1, 2, 0, 1, 3])
    values = torch.tensor([7, 8, 1, 2, 3, 4, 5, 6])
    weights = torch.tensor([1.0, 2.0, 0.5, 0.25, 3.0, 1.0, 1.0, 2.0], dtype=torch.float64)
    got = ec(DuckKJT(keys, values, lengths, weights, use_offsets=use_offsets))
    want = ec({"user_id": tte.Jagged(values[:2], lengths=lengths[:2], weights=weights[:2]),
               "watched": tte.Jagged(values[2:4], lengths=lengths[2:4], weights=weights[2:4]),
               "liked": tte.Jagged(values[4:], lengths=lengths[4:], weights=weights[4:])})
    for k in keys:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=0)
    side = ec(DuckKJT(keys, values, lengths), concat=True)
    assert side.shape == (2, 12)
    with pytest.raises(ValueError, match=r"missing: \['liked'\]"):
        ec(DuckKJT(keys[:2], values[:4], lengths[:4]))
    with pytest.raises(ValueError, match=r"unknown: \['clicked'\]"):
        ec(DuckKJT([*keys, "clicked"], values, torch.cat([lengths, torch.tensor([0, 0])])))
    with pytest.raises(ValueError, match=r"one weight per id: len\(values\(\)\) = 8. Received 7 weights"):
        ec(DuckKJT(keys, values, lengths, weights[:7]))
    with pytest.raises(ValueError, match="same number of bags"):
        ec(DuckKJT(keys, values, torch.cat([lengths, torch.tensor([0])])))
    with pytest.raises(ValueError, match=r"Feature `user_id`: ids must be in \[0, 50\)"):
        ec(DuckKJT(keys, torch.tensor([70, 8, 1, 2, 3, 4, 5, 6]), lengths))
