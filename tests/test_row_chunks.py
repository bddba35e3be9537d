"""Eager row updates in chunks (``ROW_CHUNK``) give bitwise the updates of one whole-batch pass."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import torch_tpu_embedding as tte
from torch_tpu_embedding.optim import _paths

O = tte.optim  # noqa: E741
CASES: dict[str, tuple[Any, dict[str, Any]]] = {
    "sgd-decay-clip": (O.SGD, {"lr": 0.1, "clipvalue": 0.5, "weight_decay_factor": 0.01,
                               "clip_weight_min": -0.4, "clip_weight_max": 0.4}),
    "adagrad": (O.Adagrad, {"lr": 0.1}),
    "adagrad_momentum": (O.AdagradMomentum, {"lr": 0.1, "momentum": 0.9, "use_nesterov": True}),
    "lazy_adam-ema": (O.LazyAdam, {"lr": 0.05, "bias_correction": True, "use_ema": True}),
    "ftrl-accum-skip": (O.FTRL, {"lr": 0.1, "gradient_accumulation_steps": 2, "skip_nonfinite": True}),
    "adafactor": (O.Adafactor, {"lr": 0.1}),  # per-table statistics: never chunked
    "sgd-noaccum": (O.SGD, {"lr": 0.1, "use_gradient_accumulation": False}),  # ids repeat: never chunked
}


def run(name: str, chunk: int, monkeypatch: pytest.MonkeyPatch) -> tuple[dict[str, Any], dict[str, Any]]:
    monkeypatch.setattr(_paths, "ROW_CHUNK", chunk)
    monkeypatch.setattr(_paths, "ROW_CHUNK_PARALLEL", chunk)
    cls, kwargs = CASES[name]
    torch.manual_seed(0)
    t = tte.TableConfig(300, 6, name="t", combiner="sqrtn")
    ec = tte.EmbeddingCollection({"a": tte.FeatureConfig(t, max_ids_per_bag=5), "b": tte.FeatureConfig(t)})
    opt = cls(ec.parameters(), **kwargs)
    g = torch.Generator().manual_seed(1)
    for _ in range(5):
        out = ec({"a": tte.Padded(torch.randint(0, 300, (40, 5), generator=g)),
                  "b": torch.randint(0, 300, (40,), generator=g)})
        (out["a"] * out["b"]).sum().backward()
        opt.step()
        opt.zero_grad()
    return ec.state_dict(), opt.state_dict()["state"]


@pytest.mark.parametrize("name", list(CASES))
def test_chunked_updates_equal_whole_batch(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    whole_w, whole_s = run(name, 10**9, monkeypatch)
    chunked_w, chunked_s = run(name, 7, monkeypatch)  # ~150 touched rows: about 20 chunks
    for k, v in whole_w.items():
        assert torch.equal(chunked_w[k], v), k
    for key, slots in whole_s.items():
        for slot, v in slots.items():
            assert torch.equal(chunked_s[key][slot], v), (key, slot)


def test_sgd_adds_per_id_without_dedup_and_matches_the_summed_update() -> None:
    """SGD is additive: a plain eager step is one index_add_ of rule(0, g) per looked-up id. An option
    that needs the summed rows (here a weight clip that never binds) takes the dedup path instead."""
    from test_fused_tables import _CountOps

    def run(**kwargs: Any) -> tuple[dict[str, Any], Any]:
        torch.manual_seed(0)
        t = tte.TableConfig(50, 6, name="t", combiner="sum", dtype=torch.float64)
        ec = tte.EmbeddingCollection({"a": tte.FeatureConfig(t, max_ids_per_bag=5), "b": tte.FeatureConfig(t)})
        opt = O.SGD(ec.parameters(), lr=0.1, **kwargs)
        g = torch.Generator().manual_seed(1)
        ops = None
        for i in range(4):
            ids = torch.randint(0, 50, (30, 5), generator=g)  # many duplicates, and padding (id 0 masked)
            out = ec({"a": tte.Padded(ids, ids != 0), "b": torch.randint(0, 50, (30,), generator=g)})
            (out["a"] * out["b"]).sum().backward()
            if i == 3:
                with _CountOps() as ops:
                    opt.step()
            else:
                opt.step()
            opt.zero_grad()
        return ec.state_dict(), ops

    fast, fast_ops = run()
    summed, summed_ops = run(clip_weight_min=-1e9)
    torch.testing.assert_close(fast["tables.t.weight"], summed["tables.t.weight"], rtol=1e-12, atol=1e-14)
    assert fast_ops.counts["_unique2"] == 0 and fast_ops.counts["index_select"] == 0
    assert fast_ops.counts["index_add_"] == 2  # one per lookup (a: bags of 5 ids, b: one id)
    assert summed_ops.counts["_unique2"] == 1 and summed_ops.counts["index_copy_"] == 1
