"""Eager row updates in chunks (``ROW_CHUNK``) give bitwise the updates of one whole-batch pass."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from optim_registry import CHUNKS, OptimizerConfig, cases

import torch_tpu_embedding as tte
from torch_tpu_embedding.optim._core import update_paths
from torch_tpu_embedding.optim._kernels import kernel_policy

O = tte.optim  # noqa: E741
# Every optimizer, with EMA, with accumulation + skip_nonfinite, and without dedup where it takes
# use_gradient_accumulation=False (ids repeat: never chunked); Adafactor's per-table statistics are
# never chunked either (tests/optim_registry.py, target ``chunks``).
CASES = cases(CHUNKS)


def run(cfg: OptimizerConfig, chunk: int, monkeypatch: pytest.MonkeyPatch) -> tuple[dict[str, Any], dict[str, Any]]:
    monkeypatch.setattr(update_paths, "ROW_CHUNK", chunk)
    monkeypatch.setattr(update_paths, "ROW_CHUNK_PARALLEL", chunk)
    torch.manual_seed(0)
    t = tte.TableConfig(300, 6, name="t", combiner="sqrtn")
    ec = tte.EmbeddingCollection({"a": tte.FeatureConfig(t, max_ids_per_bag=5), "b": tte.FeatureConfig(t)})
    opt = cfg.make(ec.parameters())
    g = torch.Generator().manual_seed(1)
    for _ in range(5):
        out = ec({"a": tte.Padded(torch.randint(0, 300, (40, 5), generator=g)),
                  "b": torch.randint(0, 300, (40,), generator=g)})
        (out["a"] * out["b"]).sum().backward()
        opt.step()
        opt.zero_grad()
    return ec.state_dict(), opt.state_dict()["state"]


@pytest.mark.parametrize("cfg", CASES, ids=str)
def test_chunked_updates_equal_whole_batch(cfg: OptimizerConfig, monkeypatch: pytest.MonkeyPatch) -> None:
    whole_w, whole_s = run(cfg, 10**9, monkeypatch)
    chunked_w, chunked_s = run(cfg, 7, monkeypatch)  # ~150 touched rows: about 20 chunks
    for k, v in whole_w.items():
        assert torch.equal(chunked_w[k], v), k
    for key, slots in whole_s.items():
        for slot, v in slots.items():
            assert torch.equal(chunked_s[key][slot], v), (key, slot)


def test_sgd_adds_per_id_without_dedup_and_matches_the_summed_update(monkeypatch: pytest.MonkeyPatch) -> None:
    """SGD is additive: a plain eager step is one index_add_ of increment(g) per looked-up id. An option
    that needs the summed rows (here a weight clip that never binds) takes the dedup path instead (the reference
    one, whatever ``TTE_UPDATE_KERNEL`` the suite runs with: the kernel path dedups by its own sort)."""
    from test_stacked_groups import _CountOps

    monkeypatch.setattr(kernel_policy, "_ENABLED", False)

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
    assert fast_ops.counts["index_add_"] == 1  # both lookups' rows in one call (a: bags of 5 ids, b: one id)
    assert summed_ops.counts["_unique2"] == 1 and summed_ops.counts["index_copy_"] == 1
