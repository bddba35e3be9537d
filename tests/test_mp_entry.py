"""tte.distributed.shard's entry points used as a user may use them: copies of a sharded model, and wrong calls.

The process-group cases run in one spawn of 2 gloo processes (tests/_mp_entry_worker.py, through
tests/test_mp_build.py's spawn helper).
"""

from __future__ import annotations

from typing import Any

import _mp_entry_worker as E
import _mp_worker as W
import pytest
import test_mp_build as TB
import torch


def entry(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return TB.ranks(2, "entry", tmp_path_factory, worker=E.worker)


def test_copies_keep_dtensor_state_dict(tmp_path_factory: pytest.TempPathFactory) -> None:
    """``copy.deepcopy`` of a model sharded with ``dtensor_state_dict`` True / False, and the copy cast by
    ``.float()``: the copy's ``state_dict`` and torch's ``get_optimizer_state_dict`` of an optimizer of the copy
    agree with each other and with the original (every sharded table and every row slot a DTensor, or none),
    and the copy holds the original's values."""
    for r, res in enumerate(entry(tmp_path_factory)):
        got = res["copies"]
        for flag in (True, False):
            want = "DTensor" if flag else "Tensor"
            original = got[f"{flag}/original"]
            for case in ("original", "deepcopy", "float"):
                for t in W.SHARDED:
                    k = got[f"{flag}/{case}"][t]
                    assert k["model"] == want, (r, flag, case, t, k["model"])
                    assert k["slots"] and set(k["slots"].values()) == {want}, (r, flag, case, t, k["slots"])
                    same = k["value"].to(original[t]["value"].dtype)
                    assert torch.equal(same, original[t]["value"]) if case != "float" else torch.allclose(
                        same, original[t]["value"], atol=1e-6), (r, flag, case, t)


def test_send_to_owners(tmp_path_factory: pytest.TempPathFactory) -> None:
    """The transport's one move of items to the ranks that own them (_pg_exchange.send_to_owners, which the
    DTensor state moves use): every rank receives each sender's items to it in their order, every bucket
    padded with the fill values to the largest of any rank (at least 1), for 0, 1, 5 and 17 items a rank."""
    for r, res in enumerate(entry(tmp_path_factory)):
        for m, ok in res["transport"].items():
            assert ok == {"tags": True, "rows": True}, (r, m, ok)
