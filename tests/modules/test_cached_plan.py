"""The cached lookup plan (modules/plan.py, issue [host]): a call whose inputs have the signatures of the last call's
is replayed without grouping its features again, and gives bitwise what planning afresh gives; an input of another
form, size, dtype or mask, a changed table, or a bad id takes the fresh plan (and its errors, naming the feature)."""

from __future__ import annotations

import copy
import gc
import weakref
from typing import Any

import pytest
import torch

import torch_tpu_embedding as tte
from torch_tpu_embedding.modules import plan

F = 6
B = 8


def _collection(stack: bool = True) -> tte.EmbeddingCollection:
    torch.manual_seed(0)
    tables = [tte.TableConfig(20 + 5 * i, 3, name=f"t{i}", combiner=("mean", "sum")[i % 2], dtype=torch.float64)
              for i in range(F)]
    return tte.EmbeddingCollection({f"f{i}": tte.FeatureConfig(t, max_ids_per_bag=4) for i, t in enumerate(tables)},
                                   stack_tables=stack)


def _batch(seed: int) -> dict[str, Any]:
    """Padded bags (masked) for the even features, dense ids for the odd ones."""
    g = torch.Generator().manual_seed(seed)
    out: dict[str, Any] = {}
    for i in range(F):
        ids = torch.randint(0, 20, (B, 4) if i % 2 == 0 else (B,), generator=g)
        out[f"f{i}"] = tte.Padded(ids, torch.rand(B, 4, generator=g) > 0.3) if i % 2 == 0 else ids
    return out


class _Signatures:
    """Counts the per-feature signatures read by plan_lookups (the grouping a replay skips)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls = 0
        real = plan.signature

        def counted(*args: Any) -> Any:
            self.calls += 1
            return real(*args)

        monkeypatch.setattr(plan, "signature", counted)

    def take(self) -> int:
        calls, self.calls = self.calls, 0
        return calls


def _train(batches: list[Any], fresh: bool, concat: bool = True, sig: _Signatures | None = None
           ) -> tuple[list[torch.Tensor], dict[str, torch.Tensor], list[int]]:
    """Steps of a model (Adagrad); ``fresh``: every call plans afresh. Returns the outputs, the final state and the
    signatures read per call."""
    ec = _collection()
    opt = tte.optim.Adagrad(ec.parameters(), lr=0.3)
    outs, reads = [], []
    for x in batches:
        if fresh:
            plan._PLANS.pop(ec, None)
        out = ec(x, concat=True) if concat else torch.cat([v for _, v in sorted(ec(x).items())], dim=1)
        reads.append(sig.take() if sig is not None else -1)
        outs.append(out.detach().clone())
        (out * torch.linspace(-1, 1, out.shape[1], dtype=out.dtype)).sum().backward()
        opt.step()
        opt.zero_grad()
    return outs, {k: v.clone() for k, v in ec.state_dict().items()}, reads


@pytest.mark.parametrize("concat", [True, False], ids=["concat", "dict"])
def test_a_replayed_plan_trains_bitwise_as_a_fresh_one(concat: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    sig = _Signatures(monkeypatch)
    batches = [_batch(s) for s in range(5)]
    outs, state, reads = _train(batches, fresh=False, concat=concat, sig=sig)
    assert reads == [F, 0, 0, 0, 0]  # planned once, then replayed
    want_outs, want_state, want_reads = _train(batches, fresh=True, concat=concat, sig=sig)
    assert want_reads == [F] * 5
    assert all(torch.equal(a, b) for a, b in zip(outs, want_outs, strict=True))
    assert state.keys() == want_state.keys() and all(torch.equal(state[k], want_state[k]) for k in state)


def _variants() -> list[tuple[str, Any]]:
    def ids_int32(x: dict[str, Any]) -> None:
        x["f2"] = tte.Padded(x["f2"].ids.int(), x["f2"].mask)

    def narrower(x: dict[str, Any]) -> None:
        x["f2"] = tte.Padded(x["f2"].ids[:, :3], x["f2"].mask[:, :3])

    def unmasked(x: dict[str, Any]) -> None:
        x["f4"] = tte.Padded(x["f4"].ids)

    def jagged(x: dict[str, Any]) -> None:
        p = x["f0"]
        x["f0"] = tte.Jagged(p.ids[p.mask], lengths=p.mask.sum(1))

    def weighted(x: dict[str, Any]) -> None:
        x["f2"] = tte.Padded(x["f2"].ids, x["f2"].mask, torch.rand(B, 4, dtype=torch.float64))

    def dense_as_column(x: dict[str, Any]) -> None:
        x["f3"] = x["f3"].unsqueeze(1)

    def dense_int32(x: dict[str, Any]) -> None:
        x["f5"] = x["f5"].int()

    return [(f.__name__, f) for f in (ids_int32, narrower, unmasked, jagged, weighted, dense_as_column, dense_int32)]


@pytest.mark.parametrize("name,change", _variants(), ids=[n for n, _ in _variants()])
def test_another_signature_plans_afresh(name: str, change: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A step whose inputs differ from the last in one feature's form, width, ids dtype, mask or weights, between
    replayable steps: planned afresh (signatures read again), and bitwise as planning every call afresh."""
    sig = _Signatures(monkeypatch)
    batches = [_batch(s) for s in range(4)]
    change(batches[2])
    outs, state, reads = _train(batches, fresh=False, sig=sig)
    assert reads[:2] == [F, 0] and reads[2] > 0 and reads[3] > 0, reads
    want_outs, want_state, _ = _train(batches, fresh=True)
    assert all(torch.equal(a, b) for a, b in zip(outs, want_outs, strict=True))
    assert all(torch.equal(state[k], want_state[k]) for k in state)


def test_a_bad_id_after_replayed_steps_names_its_feature_and_changes_nothing() -> None:
    ec = _collection()
    opt = tte.optim.Adagrad(ec.parameters(), lr=0.3)
    for s in range(2):
        ec(_batch(s), concat=True).sum().backward()
        opt.step()
        opt.zero_grad()
    before = {k: v.clone() for k, v in ec.state_dict().items()}
    bad = _batch(7)
    bad["f4"].ids[3, 1] = 45  # t4 has 40 rows (the stacked group has more: checked per table)
    bad["f4"].mask[3, 1] = True
    # (the error names the feature and its table, the user's names)
    with pytest.raises(ValueError, match=r"Feature `f4`: ids must be in \[0, 40\) \(num_embeddings of table `t4`\)\. "
                       r"Received: 45"):
        ec(bad, concat=True)
    masked = _batch(8)
    masked["f4"].ids[3, 1] = -7  # a masked-out position holds no id: any value
    masked["f4"].mask[3, 1] = False
    ec(masked, concat=True)
    assert all(torch.equal(v, before[k]) for k, v in ec.state_dict().items())


def test_changed_tables_plan_afresh(monkeypatch: pytest.MonkeyPatch) -> None:
    """Unstacking the groups (new tables, new locations) or a dtype conversion in place: the next call plans
    afresh and looks up the tables as they are now."""
    sig = _Signatures(monkeypatch)
    ec = _collection()
    x = _batch(0)
    first = ec(x, concat=True)
    ec(x, concat=True)
    assert sig.take() == F
    ec.unstack(list(ec.groups))
    assert torch.equal(ec(x, concat=True), first) and sig.take() == F
    ec.to(torch.float32)
    out = ec(x, concat=True)
    assert sig.take() == 0 and out.dtype == torch.float32  # the same tables, read as they are
    plan._PLANS.pop(ec)
    assert torch.equal(out, ec(x, concat=True)) and sig.take() == F
    assert torch.allclose(out, first.float(), rtol=1e-6, atol=1e-6)


def test_a_kept_plan_holds_no_table_alive() -> None:
    ec = _collection()
    ec(_batch(0), concat=True)
    assert ec in plan._PLANS
    weight = weakref.ref(next(iter(ec.physical_tables().values())).weight)
    twin = copy.deepcopy(ec)  # a copy plans for itself
    assert twin not in plan._PLANS
    del ec
    gc.collect()
    assert weight() is None


@pytest.mark.parametrize("change", ["unstack", "restack"])
def test_a_kept_plan_holds_no_dissolved_group_alive(change: str) -> None:
    """A group dissolved between calls (``unstack``, as ``tte.distributed.shard`` does, or ``restack`` for other
    placements) is freed at once, not at the next call: its plan held it through the table locations it kept."""
    ec = _collection()
    x = _batch(0)
    first = ec(x, concat=True).detach()
    assert ec in plan._PLANS
    groups = [weakref.ref(g.weight) for g in ec.groups.values()]
    assert groups
    if change == "unstack":
        ec.unstack(list(ec.groups))
    else:
        ec.restack({f"t{i}": ("row", "replicated")[i % 2] for i in range(F)})
    gc.collect()
    assert all(w() is None for w in groups)
    assert torch.equal(ec(x, concat=True), first)  # (the tables as they are now)


@pytest.mark.parametrize("dense", [True, False], ids=["dense", "padded"])
def test_scalar_ids_on_a_replayed_call_raise_the_features_own_error(dense: bool) -> None:
    """Ids of rank 0 in every feature of a replayed group: the fresh plan's error naming the feature (``torch.stack``
    of scalars along dim 1 raised an IndexError that the replay let through)."""
    def unmasked(x: dict[str, Any]) -> dict[str, Any]:
        return {k: tte.Padded(v.ids) if isinstance(v, tte.Padded) else v for k, v in x.items()}

    ec = _collection()
    ec(unmasked(_batch(0)), concat=True)
    assert ec in plan._PLANS
    x = unmasked(_batch(1))
    for i in range(F):
        if (i % 2 == 1) == dense:
            x[f"f{i}"] = torch.tensor(3) if dense else tte.Padded(torch.tensor(3))
    want = r"Feature `f1`: dense ids must have rank >= 1" if dense else r"Feature `f0`: Padded ids must be \[B, L\]"
    with pytest.raises(ValueError, match=want):
        ec(x, concat=True)
