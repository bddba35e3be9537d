"""A checkpoint load or save whose part fails on one rank of a process group only: every rank raises, none hangs,
none loads (or publishes) alone (checkpoint/agreement.py).

Each case runs 2 gloo processes through tests/distributed/test_mp_guards.py's harness (scenarios in
tests/_mp_ckpt_guard.py) under its timeout: a rank that hangs fails the test. After the load or save every rank
meets the others at a barrier, as a job's next collective would.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from test_mp_guards import run


@pytest.mark.parametrize("scenario", ["ckpt_damaged_file", "ckpt_dcp_damaged_file"],
                         ids=["load_sharded", "load_distributed"])
def test_a_file_damaged_on_one_rank_refuses_the_load_on_every_rank(scenario: str, tmp_path: Path) -> None:
    """Each rank loads its own copy of the directory; rank 1's has a byte flipped. Before, rank 1 raised alone
    and rank 0 waited for it in the load's collective (the save's identity; DCP's read plan): a hang. Now rank 1
    raises its own error, rank 0 one naming rank 1 and the file, both CheckpointCorruptError, both unchanged."""
    r0, r1 = run(scenario, tmp_path)
    damaged = "rows-1.pt" if scenario == "ckpt_damaged_file" else "tte_meta.pt"
    assert [e["type"] for e in r1["errors"]] == ["CheckpointCorruptError"], r1
    assert damaged in r1["errors"][0]["message"] and "is altered" in r1["errors"][0]["message"], r1
    assert [e["type"] for e in r0["errors"]] == ["CheckpointCorruptError"], r0
    msg = r0["errors"][0]["message"]
    assert msg.startswith("Rank 1 of the process group failed: CheckpointCorruptError: "), msg
    assert damaged in msg and "nothing was loaded on any rank" in msg, msg
    assert r0["unchanged"] and r1["unchanged"], (r0, r1)


def test_a_set_extra_state_that_raises_on_one_rank_raises_on_every_rank(tmp_path: Path) -> None:
    """load_distributed sets the modules' extra states first (the user's code), then reads the tensors in place
    through DCP's collectives: rank 1's set_extra_state raising must not leave rank 0 in them, nor its own extra
    state set. Both raise, both unchanged, the extra state as it was (9, not the saved 4) on both."""
    r0, r1 = run("ckpt_dcp_extra_state_fails", tmp_path)
    assert [e["type"] for e in r1["errors"]] == ["ValueError"], r1
    assert "the tally refused its saved state (injected)" in r1["errors"][0]["message"], r1
    msg = r0["errors"][0]["message"]
    assert msg.startswith("Rank 1 of the process group failed: ValueError: the tally refused"), msg
    assert "nothing was loaded on any rank" in msg, msg
    assert r0["unchanged"] and r1["unchanged"] and r0["tally"] == r1["tally"] == 9, (r0, r1)


def test_a_one_file_checkpoint_cut_on_one_rank_is_loaded_on_none(tmp_path: Path) -> None:
    """``tte.checkpoint.load`` of a one-process ``save`` file into a sharded model: each rank reads the file inside the
    ranks' agreement, so rank 1's copy cut short raises on both ranks, none hangs, both unchanged. Before, the load
    was refused on every rank as torch's "size mismatch" of the rank's stored rows, whole copy or cut. Then the whole
    copy loads on every rank: each rank's rows and accumulators are the file's, bitwise."""
    r0, r1 = run("ckpt_file_cut", tmp_path)
    assert [e["type"] for e in r1["errors"]] == ["ValueError"], r1
    assert "is not a readable checkpoint" in r1["errors"][0]["message"], r1
    msg = r0["errors"][0]["message"]
    assert msg.startswith("Rank 1 of the process group failed: ValueError: ") and "one1.pt" in msg, msg
    assert "nothing was loaded on any rank" in msg, msg
    assert r0["unchanged"] and r1["unchanged"], (r0, r1)
    assert r0["rows"] and r1["rows"], (r0, r1)


def test_a_checkpoint_that_fits_one_rank_only_is_loaded_on_none(tmp_path: Path) -> None:
    """Rank 1 loads a checkpoint of Adagrad into Adam. Before, rank 1 raised after the ranks' last collective
    and rank 0 loaded (a job half loaded). Now both raise CheckpointMismatchError, both unchanged."""
    r0, r1 = run("ckpt_mismatch", tmp_path)
    assert [e["type"] for e in r1["errors"]] == ["CheckpointMismatchError"], r1
    assert "adagrad" in r1["errors"][0]["message"], r1
    assert [e["type"] for e in r0["errors"]] == ["CheckpointMismatchError"], r0
    msg = r0["errors"][0]["message"]
    assert msg.startswith("Rank 1 of the process group failed: CheckpointMismatchError: ") and "adagrad" in msg, msg
    assert r0["unchanged"] and r1["unchanged"], (r0, r1)


@pytest.mark.parametrize("scenario, failing, stage", [
    ("ckpt_save_rows", 1, "write_rows"), ("ckpt_save_publish", 0, "publish")], ids=["rows", "publish"])
def test_a_save_that_fails_on_one_rank_raises_on_every_rank(scenario: str, failing: int, stage: str,
                                                             tmp_path: Path) -> None:
    """save_sharded over a good checkpoint: rank 1 cannot write its rows (a full disk), or rank 0 cannot publish.
    Before, the other rank waited in the save's barrier for it (rank 0 then published a checkpoint without
    rank 1's rows, or rank 1 returned as if saved). Now every rank raises, naming the failed rank and the
    error, and the previous checkpoint is bitwise as it was."""
    results = run(scenario, tmp_path)
    for r, res in enumerate(results):
        assert len(res["errors"]) == 1, (r, res)
        msg = res["errors"][0]["message"]
        assert "No space left on device (injected)" in msg, (r, msg)
        if r != failing:
            assert res["errors"][0]["type"] == "RuntimeError", (r, res)
            assert msg.startswith(f"Rank {failing} of the process group failed: OSError: "), (r, msg)
        assert res["kept"], (r, stage, res)


def test_a_dtensor_refused_on_one_rank_raises_on_every_rank(tmp_path: Path) -> None:
    """A model sharded with ``dtensor_state_dict``: rank 1's ``load_state_dict`` gets table `who`'s DTensor (600
    rows) for table `item` (1000). Before, rank 1 raised and rank 0 waited for it in the move's collective (a
    hang). Now rank 1 raises its ValueError naming the table and rank 0 a RuntimeError naming rank 1."""
    r0, r1 = run("ckpt_dtensor_wrong_table", tmp_path)
    assert [e["type"] for e in r1["errors"]] == ["ValueError"], r1
    assert "Table `item`" in r1["errors"][0]["message"], r1
    assert [e["type"] for e in r0["errors"]] == ["RuntimeError"], r0
    assert "Rank 1 of the process group failed" in r0["errors"][0]["message"], r0


def test_a_read_found_changed_on_one_rank_raises_on_every_rank(tmp_path: Path) -> None:
    """load_distributed reads in place through DCP after every rank's checks agreed; rank 1's check after the read
    finds a file changed (injected). Before, rank 1 raised alone and rank 0 returned as if loaded (the job then
    trained on two states). Now every rank raises, rank 0 naming rank 1 and saying the others loaded their part."""
    r0, r1 = run("ckpt_dcp_write_fails", tmp_path)
    assert [e["type"] for e in r1["errors"]] == ["CheckpointCorruptError"], r1
    assert "(injected)" in r1["errors"][0]["message"], r1
    assert [e["type"] for e in r0["errors"]] == ["CheckpointCorruptError"], r0
    msg = r0["errors"][0]["message"]
    assert msg.startswith("Rank 1 of the process group failed: CheckpointCorruptError: "), msg
    assert "(injected)" in msg and "the other ranks loaded their part" in msg, msg


def test_an_optimizer_dtensor_refused_on_one_rank_raises_on_every_rank(tmp_path: Path) -> None:
    """torch's ``set_optimizer_state_dict`` into Adagrad of a model sharded with ``dtensor_state_dict``, rank 1's
    state holding table `who`'s accumulator DTensor (600 rows) for table `item` (1000). Before, rank 1 raised
    before the slots' moves and rank 0 waited for it in one (a hang). Now rank 1 raises its ValueError naming the
    table and the slot, rank 0 a RuntimeError naming rank 1; models and optimizers bitwise unchanged."""
    r0, r1 = run("ckpt_dtensor_optim_wrong_slot", tmp_path)
    assert [e["type"] for e in r1["errors"]] == ["ValueError"], r1
    assert "`item`" in r1["errors"][0]["message"] and "'accumulators'" in r1["errors"][0]["message"], r1
    assert [e["type"] for e in r0["errors"]] == ["RuntimeError"], r0
    assert "Rank 1 of the process group failed" in r0["errors"][0]["message"], r0
    assert r0["unchanged"] and r1["unchanged"], (r0, r1)


def test_a_plain_tensor_on_one_rank_and_dtensors_on_the_others_raises_on_every_rank(tmp_path: Path) -> None:
    """``load_state_dict`` of a model sharded with ``dtensor_state_dict``: table `item`'s entry is a plain tensor
    (its stored rows) on rank 1, the DTensor on rank 0. Before, rank 1 loaded its rows and went on while rank 0
    waited for it in the rows' move (a hang). Now both raise, naming the plain tensor and the table; both
    models and optimizers bitwise unchanged."""
    results = run("ckpt_dtensor_plain_on_one_rank", tmp_path)
    for r, res in enumerate(results):
        assert [e["type"] for e in res["errors"]] == ["RuntimeError"], (r, res)
        msg = res["errors"][0]["message"]
        assert "different exchanges" in msg and "table `item`'s state_dict entry as a plain tensor" in msg, (r, msg)
        assert res["unchanged"], (r, res)


def test_a_plain_tensor_on_every_rank_loads_as_each_ranks_stored_rows(tmp_path: Path) -> None:
    """The same with every rank giving its stored rows of table `item` as a plain tensor: loaded on every rank
    (each its own rows), as before."""
    for r, res in enumerate(run("ckpt_dtensor_plain_on_every_rank", tmp_path)):
        assert res["errors"] == [] and res["item_loaded"] and not res["unchanged"], (r, res)


def test_moves_of_different_tables_on_two_ranks_raise_on_every_rank(tmp_path: Path) -> None:
    """``load_state_dict(strict=False)`` of a model sharded with ``dtensor_state_dict``, rank 1's state without table
    `item`: rank 0 moves `item`'s rows while rank 1 moves `who`'s. Before, the two moves were paired (the same
    agreement tag for every table) and rank 0 raised an IndexError on rank 1's rows. Now every rank raises a
    RuntimeError naming both tables' moves; both unchanged."""
    for r, res in enumerate(run("ckpt_dtensor_item_missing_on_one_rank", tmp_path)):
        assert [e["type"] for e in res["errors"]] == ["RuntimeError"], (r, res)
        msg = res["errors"][0]["message"]
        assert "different exchanges" in msg and "(table `item`:" in msg and "(table `who`:" in msg, (r, msg)
        assert res["unchanged"], (r, res)


def test_a_whole_table_as_a_plain_tensor_is_refused_on_every_rank(tmp_path: Path) -> None:
    """Every rank's ``load_state_dict`` gets table `who`'s whole logical rows (600, table-wise: rank 0 stores them,
    rank 1 none) as a plain tensor. Before, rank 0 loaded them and rank 1 raised a size mismatch (a job half
    loaded). Now rank 1 raises a ValueError naming the table and its stored rows, rank 0 a RuntimeError naming
    rank 1; both models bitwise unchanged."""
    r0, r1 = run("ckpt_dtensor_whole_plain_on_every_rank", tmp_path)
    assert [e["type"] for e in r1["errors"]] == ["ValueError"], r1
    msg = r1["errors"][0]["message"]
    assert "Table `who`" in msg and "stored rows (0 rows here" in msg and "(600, 4)" in msg, msg
    assert [e["type"] for e in r0["errors"]] == ["RuntimeError"], r0
    assert "Rank 1 of the process group failed" in r0["errors"][0]["message"], r0
    assert r0["unchanged"] and r1["unchanged"], (r0, r1)


def test_an_optimizer_state_refused_after_its_moves_on_one_rank_raises_on_every_rank(tmp_path: Path) -> None:
    """torch's ``set_optimizer_state_dict`` into Adagrad of a model sharded with ``dtensor_state_dict``, rank 1's
    state with a negative ``lr``: refused by the checks that run after the slots' moves. Before, rank 1 raised
    and rank 0 loaded (a job half loaded). Now every rank checks, then the ranks agree before anything is written:
    rank 1 raises its ValueError naming ``lr``, rank 0 a RuntimeError naming rank 1; both unchanged."""
    r0, r1 = run("ckpt_dtensor_optim_bad_lr_on_one_rank", tmp_path)
    assert [e["type"] for e in r1["errors"]] == ["ValueError"], r1
    assert "Optimizer state does not match" in r1["errors"][0]["message"], r1
    assert "lr" in r1["errors"][0]["message"], r1
    assert [e["type"] for e in r0["errors"]] == ["RuntimeError"], r0
    msg = r0["errors"][0]["message"]
    assert "Rank 1 of the process group failed" in msg and "checks an optimizer state loaded" in msg, msg
    assert r0["unchanged"] and r1["unchanged"], (r0, r1)


def test_optimizer_slots_plain_on_one_rank_and_dtensors_on_the_others_raise_on_every_rank(tmp_path: Path) -> None:
    """The same load, every table's slots given as plain tensors (rank 1's stored rows, as a job sharded without
    ``dtensor_state_dict`` saves them) on rank 1, as DTensors on rank 0. Before, rank 1 loaded its rows and went
    on while rank 0 waited for it in the slots' first move (a hang). Now rank 1's agreement after its checks
    meets rank 0's move: both raise, naming the move and the plain tensors; models and optimizers bitwise
    unchanged."""
    for r, res in enumerate(run("ckpt_dtensor_optim_plain_on_one_rank", tmp_path)):
        assert [e["type"] for e in res["errors"]] == ["RuntimeError"], (r, res)
        msg = res["errors"][0]["message"]
        assert "different exchanges" in msg and "(table `item`:" in msg and "plain tensors" in msg, (r, msg)
        assert res["unchanged"], (r, res)


def test_optimizer_slots_plain_on_every_rank_load_as_each_ranks_stored_rows(tmp_path: Path) -> None:
    """The same with every rank giving its stored rows of every table's slots as plain tensors: loaded on every
    rank, each its own rows (table `item`'s checked; the optimizer's own layout holds them so), after the one
    agreement. Each rank checks the state once: the check before that agreement is the load's only one."""
    for r, res in enumerate(run("ckpt_dtensor_optim_plain_on_every_rank", tmp_path)):
        assert res["errors"] == [] and res["item_loaded"] and not res["unchanged"], (r, res)
        assert res["checks"] == 1, (r, res)


@pytest.mark.parametrize("scenario", ["ckpt_torch_layout", "ckpt_torch_layout_dtensor"],
                         ids=["stored-rows", "dtensor_state_dict"])
def test_an_optimizer_in_torchs_layout_saves_and_loads_sharded(scenario: str, tmp_path: Path) -> None:
    """An optimizer made to give torch.optim's layout (``tte.optim.use_torch_layout``, documented for code that reads
    torch's layout from ``state_dict()``) round-trips through ``save_sharded`` / ``load_sharded``. Before, the save
    raised ``AttributeError: 'int' object has no attribute 'split'`` on every rank (rank 0 filtered the state's keys,
    positions in that layout), the load a bare ``KeyError: 0``; with ``dtensor_state_dict=True`` rank 0 alone
    started the state_dict's collectives (its slots moved into DTensors) and both ranks hung."""
    for r, res in enumerate(run(scenario, tmp_path)):
        assert res["errors"] == [] and res["restored"], (r, res)


@pytest.mark.parametrize("call", ["save", "load"])
def test_an_optimizer_given_on_one_rank_only_raises_on_every_rank(call: str, tmp_path: Path) -> None:
    """``save_sharded`` / ``load_sharded`` given the optimizer on rank 0 and ``None`` on rank 1: every rank raises,
    naming the argument and the ranks, nothing published or loaded (model, optimizer and files unchanged). Before,
    the save published a checkpoint holding rank 0's optimizer rows only, from which a load gave rank 1 no
    accumulators of its own (silently); the load loaded rank 0's optimizer and left rank 1's as it was."""
    for r, res in enumerate(run(f"ckpt_optimizer_on_rank_0_{call}", tmp_path)):
        assert [e["type"] for e in res["errors"]] == ["ValueError"], (r, res)
        msg = res["errors"][0]["message"]
        assert f"Argument `optimizer` of tte.distributed.{call}_sharded must be given on every rank" in msg, (r, msg)
        assert "given on ranks [0], None on ranks [1]" in msg, (r, msg)
        assert res["unchanged"] and res["kept"], (r, res)
