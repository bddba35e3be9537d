"""tte.distributed.shard's entry points used as a user may use them: copies of a sharded model, and wrong calls.

The process-group cases run in one spawn of 2 gloo processes (tests/_mp_entry_worker.py, through
tests/distributed/test_mp_build.py's spawn helper).
"""

from __future__ import annotations

from typing import Any

import _mp_entry_worker as E
import _mp_worker as W
import pytest
import test_mp_build as TB
import torch

import torch_tpu_embedding as tte


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


#: case → (error type, what the message must hold: the argument or the user's table, the rule, the received value)
REFUSED = {
    "module": ("ValueError", ("Argument `module`", "must be a torch.nn.Module", "Received: 'str'")),
    "group": ("ValueError", ("Argument `group`", "ProcessGroup", "Received: 'str'")),
    "device_int": ("ValueError", ("Argument `device`", "must be None, a str or a torch.device", "Received: 5")),
    "device_name": ("ValueError", ("Argument `device`", "must name a device torch knows", "Received: 'gpu0'")),
    "device_meta": ("ValueError", ("Argument `device`", "cannot be 'meta'", "Received: 'meta'")),
    "dtensor_int": ("ValueError", ("Argument `dtensor_state_dict`", "must be a boolean", "Received: 1")),
    "column": ("ValueError", ("Table `ads`", "exists only under torch_xla SPMD", "Received: placement='column'")),
    "all_replicated": ("ValueError", ("Argument `dtensor_state_dict`", "{'tiny': 'replicated'}",
                                      "Received: dtensor_state_dict=True")),
    "moved_to_meta": ("RuntimeError", ("Table `ads`", "without a recorded draw", "it was moved there")),
    "twice": ("RuntimeError", ("Table `row2`", "shard a model once", "Received: a model laid out by an earlier")),
    "pickle": ("TypeError", ("Table `row2`", "cannot be pickled", "Received: a pickle of the table (placement")),
    "dtensor_into_plain": ("ValueError", ("`row2`", "dtensor_state_dict=True", "Received: DTensor slots ['accumulators'] "
                                          "for a table sharded without dtensor_state_dict")),
    "whole_into_dtensor": ("ValueError", ("table:row2", "slot 'accumulators' has shape (1000, 4), expected (512, 4)",
                                          "table:big")),
    "wrong_rows": ("ValueError", ("`row2`", "must be a Shard(0) of shape (1000, 4): the table's 1000 logical rows",
                                  "Received: slot 'accumulators', a DTensor of shape (999, 4)")),
    "wrong_width": ("ValueError", ("`tw`", "must be a Shard(0) of shape (600, 3)",
                                   "Received: slot 'accumulators', a DTensor of shape (600, 5)")),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_wrong_calls_are_refused_and_change_nothing(case: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    """Wrong calls of tte.distributed.shard (a non-module, a group or device of the wrong kind, a device torch
    does not know or 'meta', a non-bool dtensor_state_dict, a 'column' table, dtensor_state_dict=True where every
    table is replicated, a table moved to the meta device, a second shard) and of loading torch's optimizer
    state (DTensor slots into a model sharded without dtensor_state_dict, a one-process state's whole tables, a
    DTensor slot of other rows or width), and pickling a sharded model, each on both ranks alike: the error names the argument or the user's
    table, the rule and the value received, and the model's parameters, layouts and optimizer slots are as
    before (a second shard keeps the first one's plain state_dict)."""
    kind, parts = REFUSED[case]
    for r, res in enumerate(entry(tmp_path_factory)):
        got = res["refusals"][case]
        assert got["type"] == kind, (r, case, got)
        for part in parts:
            assert part in got["message"], (r, case, part, got["message"])
        assert got["unchanged"], (r, case)
        assert set(res["refusals"]["twice_dtensor"].values()) == {"Tensor"}


def test_plain_optimizer_state_loads_into_a_dtensor_model(tmp_path_factory: pytest.TempPathFactory) -> None:
    """torch's get_optimizer_state_dict of a model sharded without dtensor_state_dict (each rank's stored rows as
    plain tensors), set into a model sharded with it: loaded as the stored rows they are, as a plain entry of
    the model's state_dict is (the slots equal the saving optimizer's, which trained one step more)."""
    for r, res in enumerate(entry(tmp_path_factory)):
        assert res["refusals"]["plain_into_dtensor"] == dict.fromkeys(W.SHARDED, True), r


def _meta_collection() -> tte.EmbeddingCollection:
    return tte.EmbeddingCollection({"clicks": tte.FeatureConfig(tte.TableConfig(100, 2, name="ads", placement="row"))},
                                   device="meta")


def test_a_meta_built_model_refuses_forward_and_to() -> None:
    """A collection built with device='meta' holds no values: a forward call before shard / to_empty, and .to()
    (torch's 'Cannot copy out of meta tensor'), raise naming the table, the feature and the ways out;
    to_empty() still materializes it."""
    ec = _meta_collection()
    with pytest.raises(RuntimeError, match=r"Table `ads` is on the meta device.*tte.distributed.shard.*to_empty"
                                           r".*Received: feature `clicks`'s ids on cpu"):
        ec({"clicks": torch.tensor([1, 2])})
    with pytest.raises(RuntimeError, match=r"Table `ads` is on the meta device and holds no values: .to\(\).*"
                                           r"to_empty.*Received: Cannot copy out of meta tensor"):
        ec.to("cpu")
    assert ec.tables["ads"].weight.is_meta
    ec.to_empty(device="cpu")
    assert ec({"clicks": torch.tensor([1, 2])})["clicks"].shape == (2, 2)


def test_shard_without_a_process_group_names_the_state() -> None:
    with pytest.raises(RuntimeError, match=r"needs an initialised process group.*Received: torch.distributed."
                                           r"is_initialized\(\) is False"):
        tte.distributed.shard(_meta_collection())


@pytest.mark.parametrize(("device", "rule"), ((5, "must be None, a str or a torch.device"),
                                              ("gpu0", "must name a device torch knows")))
def test_a_collection_refuses_a_wrong_device(device: Any, rule: str) -> None:
    """EmbeddingCollection(..., device=...) as tte.distributed.shard: the argument, the rule and the value named
    (torch's own error for 5 is about a missing CUDA driver)."""
    config = {"clicks": tte.FeatureConfig(tte.TableConfig(10, 2, name="ads"))}
    with pytest.raises(ValueError, match=rf"Argument `device` {rule}.*Received: {device!r}"):
        tte.EmbeddingCollection(config, device=device)
