"""``tte.interop`` on a collection sharded over a process group (``tte.distributed.shard``), 2 gloo processes.

Each rank's TorchRec state_dict and ``nn.EmbeddingBag`` hold every table whole, as one process holds them (a
row-sharded table's rows are stored interleaved, a table-wise table on one rank only); a TorchRec state_dict
loads each rank's rows of it, and lookups then equal one process's; a state_dict wrong on one rank makes every
rank raise and changes nothing, and so does a DTensor value (a sharded TorchRec model's). Ranks run as separate ``python`` processes under a timeout, so a hang fails.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import _mp_interop_worker as W
import pytest
import torch
from suite_helpers import run_ranks

import torch_tpu_embedding as tte

ROOT = Path(__file__).parents[2]
HANG = 240  # seconds for two processes that import torch; a rank still running then fails the test


def run(dtensor: bool, tmp_path: Path, world: int = 2) -> list[dict[str, Any]]:
    logs = run_ranks(ROOT / "tests" / "_mp_interop_worker.py", [str(int(dtensor)), str(tmp_path)], world, HANG)
    for r in range(world):
        assert (tmp_path / f"rank{r}.pt").exists(), f"rank {r} saved nothing\n{logs[r][-4000:]}"
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(world)]


def _same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert list(got) == list(want)
    for k in want:
        assert got[k].shape == want[k].shape and torch.equal(got[k], want[k]), k


@pytest.mark.parametrize("dtensor", [False, True], ids=["plain", "dtensor"])
def test_torchrec_layout_of_a_collection_sharded_over_a_process_group(dtensor: bool, tmp_path: Path) -> None:
    one = {s: tte.interop.to_torchrec_state_dict(W.collection(s)) for s in (0, 1, 2)}
    loaded = W.collection(1)
    want_lookups = loaded(W.batch())
    after_bag = dict(one[1], **{"embedding_bags.tw.weight": one[2]["embedding_bags.tw.weight"]})
    for r, res in enumerate(run(dtensor, tmp_path)):
        _same(res["saved"], one[0])
        assert torch.equal(res["bag_row"], one[0]["embedding_bags.row.weight"]), r
        assert torch.equal(res["bag_tw"], one[0]["embedding_bags.tw.weight"]), r
        _same(res["loaded"], one[1])
        _same(res["lookups"], want_lookups)
        assert "TorchRec state_dict does not match the collection" in res["error"], (r, res["error"])
        assert ("table 'row' has shape (3, 4) in the state_dict, expected (1500, 4)" if r else
                "another rank's state_dict does not match the collection") in res["error"], (r, res["error"])
        assert "'embedding_bags.row.weight' is a DTensor, not a plain tensor" in res["dtensor_error"], r
        _same(res["after_error"], one[1])
        _same(res["after_bag"], after_bag)
