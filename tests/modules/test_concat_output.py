"""``EmbeddingCollection(...)(features, concat=True)``: every feature's ``[B, D]`` side by side, ``[B, Σ D]``, in
``feature_names`` order (TorchRec's ``KeyedTensor.values()``), equal to ``torch.cat`` of the per-feature outputs
forward and in training; a stacked group looked up batch-major straight into it, with no copy."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import torch_tpu_embedding as tte
from torch_tpu_embedding import optim as O


class _FloatCats(TorchDispatchMode):
    """Counts operators; ``cat``/``stack`` of floating tensors apart (a copy of activations or gradients)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if name in ("cat", "stack") and isinstance(out, torch.Tensor) and out.is_floating_point():
            name = "float_" + name
        self.counts[name] += 1
        return out


def _model(kind: str, dtype: torch.dtype = torch.float64) -> tuple[tte.EmbeddingCollection, dict[str, Any]]:
    torch.manual_seed(0)
    a = tte.TableConfig(40, 4, name="a", combiner="mean", dtype=dtype)
    b = tte.TableConfig(30, 4, name="b", combiner="mean", dtype=dtype)
    c = tte.TableConfig(20, 3, name="c", combiner="sqrtn", dtype=dtype)  # another dim: a group of its own
    if kind == "stacked":  # one group, one bag width, one combiner: one side-by-side lookup
        features = {"u": tte.FeatureConfig(a, max_ids_per_bag=3), "v": tte.FeatureConfig(b, max_ids_per_bag=3),
                    "w": tte.FeatureConfig(a, max_ids_per_bag=3)}
    else:  # two groups, a jagged feature, bag widths apart
        features = {"u": tte.FeatureConfig(a, max_ids_per_bag=3), "v": tte.FeatureConfig(b),
                    "w": tte.FeatureConfig(c, max_ids_per_bag=2), "x": tte.FeatureConfig(a, max_ids_per_bag=3),
                    "y": tte.FeatureConfig(b, max_ids_per_bag=3)}
    return tte.EmbeddingCollection(features, stack_tables=kind != "unstacked"), features


def _batch(features: dict[str, Any], g: torch.Generator, b: int = 6) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, fc in features.items():
        width, rows = fc.max_ids_per_bag or 1, fc.table.num_embeddings
        if width == 1:
            out[name] = torch.randint(0, rows, (b,), generator=g)
        elif fc.table.name == "c":  # jagged, weighted
            lengths = torch.randint(0, 3, (b,), generator=g)
            out[name] = tte.Jagged(torch.randint(0, rows, (int(lengths.sum()),), generator=g), lengths=lengths,
                                   weights=torch.rand(int(lengths.sum()), generator=g, dtype=torch.float64))
        else:
            ids = torch.randint(0, rows, (b, width), generator=g)
            out[name] = tte.Padded(ids, torch.rand(b, width, generator=g) > 0.3)
    return out


@pytest.mark.parametrize("kind", ["stacked", "mixed", "unstacked"])
@pytest.mark.parametrize("opt_cls", [O.SGD, O.Adagrad, O.LazyAdam], ids=lambda c: c.__name__)
def test_concat_equals_cat_of_the_features_in_training(kind: str, opt_cls: Any) -> None:
    runs = []
    for concat in (False, True):
        ec, features = _model(kind)
        opt = opt_cls(ec.parameters(), lr=0.1)
        g = torch.Generator().manual_seed(1)
        outs = []
        for _ in range(3):
            batch = _batch(features, g)
            if concat:
                out = ec(batch, concat=True)
            else:
                d = ec(batch)
                out = torch.cat([d[f] for f in ec.feature_names], dim=1)
            outs.append(out.detach())
            head = torch.linspace(-1, 1, out.shape[1], dtype=out.dtype)
            (out @ head).pow(2).sum().backward()
            opt.step()
            opt.zero_grad()
        runs.append((outs, ec.state_dict()))
    (want_out, want_sd), (got_out, got_sd) = runs
    for w, o in zip(want_out, got_out, strict=True):
        torch.testing.assert_close(o, w, rtol=1e-13, atol=1e-13)
    for k, v in want_sd.items():  # the same rows summed in another order (bag-major): equal to rounding
        torch.testing.assert_close(got_sd[k], v, rtol=1e-12, atol=1e-12, msg=k)


def test_a_stacked_group_is_looked_up_straight_into_the_output() -> None:
    """One embedding_bag writes the [B, ΣD] output; no float cat or stack forward or backward; SGD's step adds
    the gradient with one index_add_ (the dict path concatenates in the caller's torch.cat)."""
    ec, features = _model("stacked", torch.float32)
    opt = O.SGD(ec.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(0)
    for _ in range(2):  # the first step asks the lookups to keep their rows factored
        batch = _batch(features, g)
        with _FloatCats() as ops:
            out = ec(batch, concat=True)
            out.sum().backward()
            opt.step()
        opt.zero_grad()
        assert out.shape == (6, 12)
    assert ops.counts["_embedding_bag"] == 1, {k: v for k, v in ops.counts.items() if "bag" in k or "cat" in k}
    assert ops.counts["float_cat"] == 0 and ops.counts["float_stack"] == 0, ops.counts
    assert ops.counts["index_add_"] == 1, ops.counts


def test_concat_refusals_name_the_feature_and_change_nothing() -> None:
    a = tte.TableConfig(40, 4, name="a")
    ec = tte.EmbeddingCollection({"u": tte.FeatureConfig(a), "s": tte.FeatureConfig(a, max_sequence_length=3)})
    before = {k: v.clone() for k, v in ec.state_dict().items()}
    batch = {"u": torch.tensor([1, 2]), "s": tte.Padded(torch.tensor([[1, 2, 3], [4, 5, 6]]))}
    with pytest.raises(ValueError, match=r"feature `s` gives \[2, 3, 'D'\]"):
        ec(batch, concat=True)
    ec2 = tte.EmbeddingCollection({"u": tte.FeatureConfig(a), "v": tte.FeatureConfig(a)})
    with pytest.raises(ValueError, match=r"one batch size B.*`u`: 2.*`v`: 3"):
        ec2({"u": torch.tensor([1, 2]), "v": torch.tensor([1, 2, 3])}, concat=True)
    with pytest.raises(TypeError, match=r"`concat` must be a bool; received 'yes'"):
        ec2({"u": torch.tensor([1, 2]), "v": torch.tensor([1, 2])}, concat="yes")
    assert all(torch.equal(v, before[k]) for k, v in ec.state_dict().items())
    assert not ec.row_grads() and not ec2.row_grads()
