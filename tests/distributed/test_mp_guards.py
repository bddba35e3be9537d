"""A process group whose ranks a user gets out of step: every rank raises, naming the cause, and none hangs.

Each case starts 2 fresh gloo processes, each running tests/_mp_guard_worker.py as its ``__main__`` as torchrun's
``python`` would (forked from a server that imported torch and the package once: suite_helpers.run_ranks), under
a timeout: a rank that hangs fails the test (as each of these did before the guards) instead of hanging the suite.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from suite_helpers import run_ranks

ROOT = Path(__file__).parents[2]
WORKER = ROOT / "tests" / "_mp_guard_worker.py"
#: seconds a case may take (two processes importing torch on a loaded machine); a hang ends here, as a failure
HANG = 240


def run(scenario: str, tmp_path: Path, world: int = 2) -> list[dict[str, Any]]:
    """Every rank's record of ``scenario``; fails (killing the ranks) when one does not end within :data:`HANG`."""
    logs = run_ranks(WORKER, [scenario, str(tmp_path)], world, HANG, scenario)
    out = []
    for r in range(world):
        f = tmp_path / f"rank{r}.json"
        assert f.exists(), f"{scenario}: rank {r} wrote no result\n{logs[r][-4000:]}"
        out.append(json.loads(f.read_text(encoding="utf-8")))
    return out


def test_a_rank_that_never_calls_shard_is_named_not_waited_for(tmp_path: Path) -> None:
    """Rank 1 forgets ``shard`` and trains on: rank 0 raises after its ``timeout``, naming the likely cause, and
    rank 1's next collective then fails (its peer is gone) instead of waiting."""
    r0, r1 = run("forgot_shard", tmp_path)
    assert len(r0["errors"]) == 1, r0
    msg = r0["errors"][0]["message"]
    assert "every rank must call tte.distributed.shard(model)" in msg and "timeout=" in msg, msg
    assert r1["errors"], r1  # it trained into a collective whose peer left: an error, not a hang


@pytest.mark.parametrize("scenario, want", [
    ("rows_differ", ["table `item`: num_embeddings 1001 on rank 0, 1000 on rank 1"]),
    ("placement_differ", ["table `who`: placement 'row' on rank 0, 'table' on rank 1"]),
    ("names_differ", ["table `kind` exists on ranks [0] but not on ranks [1]",
                      "table `kinds` exists on ranks [1] but not on ranks [0]"]),
    ("stacking_differ", ["table `kind`: stacked with ['kind', 'tag'] on rank 0, 'no other table' on rank 1",
                         "table `tag`: stacked with ['kind', 'tag'] on rank 0, 'no other table' on rank 1",
                         "stack_tables"]),
], ids=["1001 and 1000 rows", "row and table placements", "other table names", "stack_tables on one rank"])
def test_ranks_with_different_layouts_raise_at_shard(scenario: str, want: list[str], tmp_path: Path) -> None:
    """Every rank raises at ``shard``, naming the table and each rank's value; nothing trains. (``stack_tables`` on
    rank 0 only: its replicated tables `kind` and `tag` stayed one stacked parameter there, two on rank 1; shard
    passed, and the first step's exchange of their row gradients aborted a rank inside gloo, 'Received data size
    doesn't match expected size'.)"""
    for r, res in enumerate(run(scenario, tmp_path)):
        assert res.get("stage") == "shard", (r, res)
        msg = res["errors"][0]["message"]
        assert "hold different models" in msg and all(w in msg for w in want), (r, msg)


def test_a_bad_id_on_one_rank_raises_at_that_step_on_every_rank(tmp_path: Path) -> None:
    """Rank 1 meets an out-of-range id at step 1 and skips the batch: rank 0 raises at step 1 too, naming rank 1
    (before, rank 0's step 1 paired with rank 1's step 2, and the run hung or failed steps later)."""
    r0, r1 = run("bad_id_skipped", tmp_path)
    assert r0["done"] == [0] and [e["step"] for e in r0["errors"]] == [1], r0
    assert "Rank 1 of the process group failed this step" in r0["errors"][0]["message"], r0
    assert "table `item`" in r0["errors"][0]["message"]
    assert r1["errors"][0]["step"] == 1 and r1["errors"][0]["type"] == "ValueError", r1
    assert "Feature `item`" in r1["errors"][0]["message"], r1


def test_every_rank_skipping_the_failed_step_stays_in_step(tmp_path: Path) -> None:
    """Every rank catches the step's error and moves on: they train the remaining steps together, their
    replicated parameters (the DDP head, the replicated table) equal."""
    r0, r1 = run("bad_id_every_rank_skips", tmp_path)
    for res in (r0, r1):
        assert res["done"] == [0, 2, 3] and [e["step"] for e in res["errors"]] == [1], res
    assert r0["head"] == r1["head"] and r0["kind"] == r1["kind"]


def test_a_lookup_on_one_rank_only_raises_on_both(tmp_path: Path) -> None:
    """Rank 0 alone evaluates (a forward under ``no_grad``) between training steps: both ranks raise at that
    exchange, naming what each was doing, instead of pairing the evaluation with rank 1's training step."""
    r0, r1 = run("eval_on_one_rank", tmp_path)
    for res in (r0, r1):
        assert res["done"] == [0, 1], res
        msg = res["errors"][0]["message"]
        assert "at different exchanges" in msg and "without gradients (evaluation)" in msg, msg


def test_a_table_frozen_on_one_rank_only_raises_on_both(tmp_path: Path) -> None:
    """Rank 0 freezes row-sharded table `item` (``requires_grad_(False)``), rank 1 trains it: both raise at its first
    lookup, naming what each does (before: rank 1 waited in its backward's all-to-all, which rank 0, without a
    backward through the table, never made, until the process group's timeout: 30 minutes on gloo)."""
    r0, r1 = run("frozen_on_one_rank", tmp_path)
    for res in (r0, r1):
        assert res["done"] == [] and [e["step"] for e in res["errors"]] == [0], res
        msg = res["errors"][0]["message"]
        assert "at different exchanges" in msg and "frozen (requires_grad=False)" in msg, msg
        assert "looks up table `item` with gradients (training)" in msg, msg


def test_a_state_dict_on_one_rank_only_raises_on_both(tmp_path: Path) -> None:
    """Rank 0 alone takes the ``state_dict`` of a model sharded with ``dtensor_state_dict`` (a collective: the
    rows move to their logical blocks) while rank 1 trains on: both raise at that exchange."""
    r0, r1 = run("state_on_one_rank", tmp_path)
    for res in (r0, r1):
        assert res["done"] == [0, 1], res
        msg = res["errors"][0]["message"]
        assert "at different exchanges" in msg and "moves a sharded table's rows between ranks" in msg, msg
        assert "looks up table `item` with gradients (training)" in msg, msg


def test_clip_grad_norm_on_a_rank_without_gradient_rows(tmp_path: Path) -> None:
    """``tte.clip_grad_norm_`` of a float64 table-wise table alone: rank 1 holds none of its rows and no dense
    gradient, and summed a float32 zero where rank 0 summed float64 (gloo aborted both processes: 'Received data
    size doesn't match expected size'). Every rank returns the global norm, written out here from the ids of both
    ranks: the loss is linear, so row i's gradient is count_i · c / (B · 2), c = (1, ..., D)."""
    r0, r1 = run("clip_rank_without_rows", tmp_path)
    c = torch.arange(1.0, 5, dtype=torch.float64)
    want = []
    for step, order in enumerate((2.0, float("inf"))):
        counts = torch.bincount(torch.tensor(r0["ids"][step] + r1["ids"][step]), minlength=600).to(torch.float64)
        grad = counts[:, None] * c / (len(r0["ids"][step]) * 2)
        want.append(float(torch.linalg.vector_norm(grad, order)))
    for res in (r0, r1):
        assert res["norms"] == pytest.approx(want, rel=1e-13, abs=0), (res["norms"], want)


def test_torch_ddp_on_a_sharded_model_names_the_wrapper(tmp_path: Path) -> None:
    """torch's own DistributedDataParallel around a sharded model with a replicated table: every rank raises at
    the first forward naming tte.distributed.DistributedDataParallel (before: torch's shape check failed inside
    torch on the table-wise table, ``[0, 4]`` off its owner)."""
    for r, res in enumerate(run("torch_ddp", tmp_path)):
        msg = res["errors"][0]["message"]
        assert "tte.distributed.DistributedDataParallel" in msg and "`kind`" in msg.replace("'", "`"), (r, msg)


def test_an_optimizer_built_before_shard_names_the_tables_and_shard(tmp_path: Path) -> None:
    """It named the internal group `fused_0` and torch_tpu_embedding.xla.shard; ``shard``'s ``timeout`` is
    checked before anything changes (the tables stay stacked for the shard that follows)."""
    for r, res in enumerate(run("opt_before_shard", tmp_path)):
        assert ["Argument `timeout`" in m for m in res["refused"]] == [True] * 3, res["refused"]
        assert res["groups"], res  # the tables were stacked before shard unstacked them
        msg = res["errors"][0]["message"]
        assert "tte.distributed.shard(model)" in msg and "`alpha`, `beta`" in msg, (r, msg)
        assert all(g not in msg for g in res["groups"]), (r, msg)  # no internal group name



_DP = pytest.mark.parametrize("wrapper", ["plain", "ddp"], ids=["data_parallel", "DistributedDataParallel"])


@_DP
def test_data_parallel_a_bad_id_on_one_rank_raises_at_that_step_on_every_rank(wrapper: str, tmp_path: Path) -> None:
    """Data parallel, no table sharded (the row gradients exchanged at ``step()``; with DDP its all-reduce of the
    head in the backward first): rank 1 meets an out-of-range id at step 1 and skips the batch. Rank 0 raises at
    step 1 too, naming rank 1 and its own lookup (before: rank 0's steps 1 and 2 trained on rank 1's steps 2 and
    3, and it failed only when rank 1 left)."""
    r0, r1 = run(f"dp_{wrapper}_bad_id_skipped", tmp_path)
    assert r1["errors"][0]["step"] == 1 and r1["errors"][0]["type"] == "ValueError", r1
    assert "Feature `item`" in r1["errors"][0]["message"], r1
    assert r0["done"] == [0] and [e["step"] for e in r0["errors"]] == [1], r0
    msg = r0["errors"][0]["message"]
    assert "Rank 1 of the process group failed this step" in msg, r0
    assert "looks up data-parallel tables `item`" in msg and "with gradients (training)" in msg, msg


@_DP
def test_data_parallel_every_rank_skipping_the_failed_step_stays_in_step(wrapper: str, tmp_path: Path) -> None:
    """Every rank catches the step's error and moves on: they train the remaining steps together, their replicas
    (the tables, and the head under DDP) equal."""
    r0, r1 = run(f"dp_{wrapper}_every_rank_skips", tmp_path)
    for res in (r0, r1):
        assert res["done"] == [0, 2, 3] and [e["step"] for e in res["errors"]] == [1], res
    assert (r0["kind"], r0["item"]) == (r1["kind"], r1["item"])
    if wrapper == "ddp":
        assert r0["head"] == r1["head"]


@_DP
def test_data_parallel_ranks_with_other_micro_batches_per_step_raise_on_every_rank(wrapper: str,
                                                                                   tmp_path: Path) -> None:
    """Gradient accumulation, at step 1 rank 0 two micro-batches, rank 1 one. Rank 0's second forward met rank 1's
    exchange of row gradients in ``step()`` (its lookup agreement, an ``all_reduce`` of int64, against the
    ``all_gather`` of rank 1's row counts), and both waited for gloo's timeout (30 minutes by default; 20 s here).
    The exchange now starts with the step's agreement, the same collective: both raise at step 1, naming the cause
    and each rank's number of forwards. (Not at step 0 under DDP: its second forward rebuilds its buckets, a
    collective of torch's own, which meets rank 1's step first.)"""
    for res in run(f"dp_{wrapper}_micro_batches_differ", tmp_path):
        assert res["done"] == [0] and [e["step"] for e in res["errors"]] == [1], res
        msg = res["errors"][0]["message"]
        assert "ran different numbers of training forward passes (micro-batches) before an optimizer's step()" \
            in msg and "1 on one rank and 2 on another" in msg, msg


def test_data_parallel_ranks_with_as_many_micro_batches_per_step_train_together(tmp_path: Path) -> None:
    """Two micro-batches per step on every rank: the forwards counted per step agree, nothing raises, and the
    replicas stay equal."""
    r0, r1 = run("dp_plain_micro_batches_alike", tmp_path)
    for res in (r0, r1):
        assert res["done"] == [0, 1] and not res["errors"], res
    assert (r0["kind"], r0["item"]) == (r1["kind"], r1["item"])


def test_data_parallel_agreement_costs_one_host_read_per_training_forward(tmp_path: Path) -> None:
    """The agreement is one ``tolist()`` per training forward (measured against the same forward with the tables
    opted out of the exchange), and evaluation under ``no_grad`` on rank 0 alone makes no collective: the ranks
    train on together afterwards."""
    for res in run("dp_plain_reads", tmp_path):
        assert res["done"] == [0, 1] and not res["errors"], res
        (scalars, lists), (local_scalars, local_lists) = res["reads"]
        assert (scalars - local_scalars, lists - local_lists) == (0, 1), res["reads"]
        assert res["after"] == {"errors": [], "done": [0]}, res


@_DP
def test_data_parallel_ranks_with_different_tables_raise_at_construction(wrapper: str, tmp_path: Path) -> None:
    """Data parallel, no table sharded: rank 0's table `item` has 1001 rows, rank 1's 1000. Every rank raises
    when the model is prepared (``data_parallel`` / the ``DistributedDataParallel`` wrapper), naming the table
    and each rank's shape (before: the broadcast of the tables from rank 0 aborted rank 1 inside gloo, 'Received
    data size doesn't match expected size', and rank 0 failed on its lost peer at its first step)."""
    for r, res in enumerate(run(f"dp_{wrapper}_rows_differ", tmp_path)):
        assert len(res["errors"]) == 1, (r, res)
        msg = res["errors"][0]["message"]
        assert "hold different tables" in msg and "Nothing was changed" in msg, (r, msg)
        assert "table `item`: [1001, 4] float32 on rank 0, [1000, 4] float32 on rank 1" in msg, (r, msg)


def test_data_parallel_batches_of_other_sizes_at_static_sizes_raise_on_every_rank(tmp_path: Path) -> None:
    """An accelerator's data parallel exchanges row gradients at static sizes (forced here on the CPU): the same
    batch size on both ranks at step 0, then 8 bags on rank 0 and 6 on rank 1 at step 1. Every rank raises at
    step 1's forward, naming the shapes of its ids, and the ranks, skipping that step alike, train on together.
    (Before, each rank checked its sizes only at a shape it had not seen: rank 1 started the check's collective
    and rank 0, whose shape repeated, its exchange: gloo aborted a rank; NCCL would hang or mix the buffers.)"""
    for r, res in enumerate(run("dp_plain_static_sizes", tmp_path)):
        assert res["done"] == [0, 2] and [e["step"] for e in res["errors"]] == [1], (r, res)
        msg = res["errors"][0]["message"]
        assert "different exchanges" in msg and "static sizes" in msg, (r, msg)
        shape = "[8, 1]" if r == 0 else "[6, 1]"  # (dense ids [B] are bags of one id: [B, 1])
        assert f"looks up data-parallel tables `item` with ids of shapes {shape}" in msg, (r, msg)


def test_data_parallel_tables_frozen_on_one_rank_only_raise_on_every_rank(tmp_path: Path) -> None:
    """Data parallel: rank 0 freezes every table (``requires_grad_(False)``: it fine-tunes the head), rank 1
    trains them. Every rank raises at the first training forward, naming the frozen tables. (Before, rank 0 made
    no agreement and no exchange of row gradients, and rank 1 waited in its exchange: a hang.)"""
    for r, res in enumerate(run("dp_plain_frozen_on_one_rank", tmp_path)):
        assert res["done"] == [] and [e["step"] for e in res["errors"]] == [0], (r, res)
        msg = res["errors"][0]["message"]
        assert "different exchanges" in msg and "frozen (requires_grad=False) on some ranks only" in msg, (r, msg)
        assert "(frozen: `item`, `kind`, `who`)" in msg or r == 1, msg  # (rank 1 cannot read rank 0's tables)


def test_data_parallel_a_stacked_table_frozen_on_one_rank_only_raises_on_every_rank(tmp_path: Path) -> None:
    """Rank 0 freezes table `tag` (``ec.tables["tag"].requires_grad_(False)``), stacked with `kind` in one parameter;
    rank 1 trains it. Every rank raises at the first training forward. (Before, both exchanged the group's rows,
    rank 0's `tag` ids as padding: rank 1 updated `tag` from both ranks' gradients and rank 0 kept it, the replicas
    apart, silently.)"""
    for r, res in enumerate(run("dp_plain_member_frozen_on_one_rank", tmp_path)):
        assert res["done"] == [] and [e["step"] for e in res["errors"]] == [0], (r, res)
        msg = res["errors"][0]["message"]
        assert "different exchanges" in msg and "frozen (requires_grad=False) on some ranks only" in msg, (r, msg)
        assert "(frozen: `tag`)" in msg or r == 1, msg


def _worker() -> Any:
    import importlib
    import sys

    sys.path.insert(0, str(ROOT / "tests"))
    return importlib.import_module("_mp_guard_worker")


def test_a_rank_that_skips_its_backward_times_out_on_every_rank_naming_it(tmp_path: Path) -> None:
    """Rank 1 looks up its batch at step 1, skips its backward (and its step) and looks up its next batch. A sharded
    table's gradient rows go to their owners in the backward, an exchange every rank makes: rank 0 waits there for
    rank 1, and rank 1 in its next lookup's agreement, until the exchange group's timeout (``shard(timeout=...)``,
    10 s here; torch's default: 30 minutes on gloo). Each then raises naming the likely cause and what to do (skip a
    batch on every rank alike), not gloo's bare timeout."""
    r0, r1 = run("skip_both", tmp_path)
    assert r0["done"] == [0] and [e["step"] for e in r0["errors"]] == [1], r0
    msg = r0["errors"][0]["message"]
    assert msg.startswith("Table `") and "rank 0 could not send a lookup's gradient rows" in msg, msg
    assert "skip the batch on every rank alike" in msg, msg
    assert r1["done"] == [0, 1] and [e["step"] for e in r1["errors"]] == [2], r1
    msg = r1["errors"][0]["message"]
    assert "one still in the backward of a batch this rank skipped" in msg, msg


@pytest.mark.parametrize("tables", ["dp", "shard"], ids=["data_parallel", "sharded"])
@pytest.mark.parametrize("case, want", [
    ("lr", "`lr` of tables `item`, `kind`, `who`: 0.1 on rank 0, 0.2 on rank 1"),
    ("eps", "`eps` of tables `item`, `kind`, `who`: 1e-07 on rank 0, 1e-06 on rank 1"),
    ("numpy_lr", "`lr` of tables `item`, `kind`, `who`: 0.10000000149011612 on rank 0, 0.20000000298023224 on rank 1"),
    ("class", "optimizer of tables `item`, `kind`, `who`: 'Adam' on rank 0, 'Adagrad' on rank 1"),
], ids=["lr", "eps", "numpy lr", "optimizer class"])
def test_ranks_whose_optimizers_differ_raise_on_every_rank(tables: str, case: str, want: str, tmp_path: Path) -> None:
    """Rank 0 and rank 1 build their optimizers of the shared tables with another ``lr``, ``eps`` or class: every
    rank raises a ValueError at the first training lookup, naming the hyper-parameter, each rank's value and the
    tables, before anything is updated. (Before, each rank trained its replica or shard with its own settings,
    silently apart.)"""
    for r, res in enumerate(run(f"optimizers_{tables}_{case}", tmp_path)):
        assert res["done"] == [] and [(e["step"], e["type"]) for e in res["errors"]] == [(0, "ValueError")], (r, res)
        msg = res["errors"][0]["message"]
        assert want in msg and "different optimizers" in msg, (r, msg)


def test_an_optimizer_changed_on_one_rank_raises_on_every_rank_at_the_next_lookup(tmp_path: Path) -> None:
    """Rows sharded: after step 0, rank 1 alone sets Adam's ``eps`` to 1e-6: both ranks raise at step 1's lookup,
    naming it (before: rank 1 trained on with its own ``eps``)."""
    for r, res in enumerate(run("optimizers_shard_changed", tmp_path)):
        assert res["done"] == [0] and [(e["step"], e["type"]) for e in res["errors"]] == [(1, "ValueError")], (r, res)
        assert "`eps` of tables `item`, `kind`, `who`: 1e-07 on rank 0, 1e-06 on rank 1" in res["errors"][0]["message"]


@pytest.mark.parametrize("tables", ["dp", "shard"], ids=["data_parallel", "sharded"])
def test_a_scheduler_changing_lr_alike_on_every_rank_adds_no_collective(tables: str, tmp_path: Path) -> None:
    """An ``ExponentialLR`` halves ``lr`` on every rank at each step: the ranks train on, and the check gathers
    nothing (``all_gather_object`` never called): ``lr`` is agreed inside each training lookup's agreement."""
    for r, res in enumerate(run(f"optimizers_{tables}_scheduler", tmp_path)):
        assert res["done"] == [0, 1, 2] and not res["errors"], (r, res)
        assert res["lrs"] == [0.05, 0.025, 0.0125] and res["gathers"] == 0, (r, res)


def _assert_gathered(ranks: list[dict[str, Any]], want: dict[str, Any]) -> None:
    """Each table's rows as the ranks reported their shards (``res["tables"][name]``: ``ids`` and ``rows``, padding
    ids past the table) equal ``want[name]``, one process's ``[V, D]`` float64 table, every row held by some rank."""
    import torch

    for name, whole in want.items():
        got = torch.full_like(whole, float("nan"))
        for res in ranks:
            ids = torch.tensor(res["tables"][name]["ids"], dtype=torch.int64)
            rows = torch.tensor(res["tables"][name]["rows"], dtype=torch.float64).reshape(-1, whole.shape[1])
            real = ids < whole.shape[0]
            got[ids[real]] = rows[real]
        torch.testing.assert_close(got, whole, rtol=0, atol=1e-12, msg=name)


def _one_process_unused(case: str) -> dict[str, Any]:
    """The ``unused_*`` scenarios' tables as one process trains them on the global batch (Adam, ``lazy_adam=False``):
    table `who`'s activations replaced by zeros in the loss of every rank's share at the steps after the first
    (``"every_rank"``: one process then has no gradient of `who`, and steps no row of it), or of rank 1's share at
    step 1 (``"one_rank"``)."""
    import torch
    import torch.nn.functional as F

    import torch_tpu_embedding as tte

    worker = _worker()
    model = worker.skip_model()
    opt = tte.optim.Adam(model.ec.parameters(), lr=0.05, lazy_adam=False)
    for step in range(3):
        parts = [worker.batch(r, step) for r in range(2)]
        ids = {k: torch.cat([p[0][k] for p in parts]) for k in parts[0][0]}
        label = torch.cat([p[1] for p in parts]).to(torch.float64)
        out = model.ec(ids)
        who = out["who"]
        if case == "every_rank" and step >= 1:
            out["who"] = torch.zeros_like(who).detach()
        elif case == "one_rank" and step == 1:
            out["who"] = torch.cat([who[:worker.B], torch.zeros_like(who[worker.B:]).detach()])
        logit = model.head(torch.cat([out[k] for k in sorted(out)], dim=1)).squeeze(1)
        F.binary_cross_entropy_with_logits(logit, label).backward()
        opt.step()
        opt.zero_grad()
    return {name: t.logical_weight() for name, t in model.ec.tables.items()}


@pytest.mark.parametrize("case", ["every_rank"])
def test_a_loss_that_leaves_a_table_out_trains_as_one_process(case: str, tmp_path: Path) -> None:
    """Every rank's loss leaves table `who`'s activations out at the steps after the first (a feature the model only
    logs: its lookup made with gradients, its backward never run): the tables equal one process's on the global batch
    (Adam with ``lazy_adam=False``, which moves every row of a table that has a gradient): no row of `who` moves."""

    ranks = run(f"unused_{case}", tmp_path)
    for res in ranks:
        assert res["done"] == [0, 1, 2] and not res["errors"], res
    if case == "every_rank":
        assert all(res["moved"]["who"] == 0 for res in ranks), [res["moved"] for res in ranks]
    _assert_gathered(ranks, _one_process_unused(case))


def test_two_losses_each_with_its_optimizer_step_in_turn(tmp_path: Path) -> None:
    """One forward, two losses and two optimizers (table `item`'s, then table `who`'s): ``loss1.backward()``,
    ``opt1.step()``, ``loss2.backward()``, ``opt2.step()``: the tables equal one process's on the global batch."""
    import torch

    import torch_tpu_embedding as tte

    ranks = run("two_losses", tmp_path)
    for res in ranks:
        assert res["done"] == [0, 1, 2] and not res["errors"], res
    worker = _worker()
    model = worker.skip_model()
    tables = model.ec.tables
    opts = [tte.optim.Adam(tables[n].parameters(), lr=0.05, lazy_adam=False) for n in ("item", "who")]
    for step in range(3):
        parts = [worker.batch(r, step)[0] for r in range(2)]
        out = model.ec({k: torch.cat([p[k] for p in parts]) for k in parts[0]})
        for name, opt in zip(("item", "who"), opts, strict=True):
            out[name].square().mean().backward()
            opt.step()
            opt.zero_grad()
    _assert_gathered(ranks, {name: t.logical_weight() for name, t in tables.items()})


@pytest.mark.parametrize("case", ["rebuilt", "rebuilt_lr"])
def test_an_optimizer_rebuilt_with_the_old_one_alive_on_one_rank(case: str, tmp_path: Path) -> None:
    """Rows sharded: after step 0 every rank builds its Adam anew, and rank 0 keeps the old one alive (a helper of its
    own refers to it). Alike (``rebuilt``): the ranks train on, nothing gathered (before: every rank raised, 'optimizer
    of tables ... (another optimizer): 'Adam' on rank 0, 'no optimizer' on rank 1'); the new one's ``lr`` 0.2 on
    rank 1 (``rebuilt_lr``): both raise at step 1, naming it against the new one's 0.1 on rank 0."""
    for r, res in enumerate(run(f"optimizers_shard_{case}", tmp_path)):
        if case == "rebuilt":
            assert res["done"] == [0, 1, 2] and not res["errors"] and res["gathers"] == 0, (r, res)
            continue
        assert res["done"] == [0] and [(e["step"], e["type"]) for e in res["errors"]] == [(1, "ValueError")], (r, res)
        assert "`lr` of tables `item`, `kind`, `who`: 0.1 on rank 0, 0.2 on rank 1" in res["errors"][0]["message"]


@pytest.mark.parametrize("tables", ["dp", "shard"], ids=["data_parallel", "sharded"])
def test_a_copied_optimizer_is_agreed_on(tables: str, tmp_path: Path) -> None:
    """After step 0 every rank trains on a ``copy.deepcopy`` of its model and optimizer (the originals kept alive),
    rank 1's copy with Adam's ``eps`` 1e-6: both raise at step 1's lookup, naming it. (Before, a copy was not
    registered for the agreement: only the originals, alike, were compared, and rank 1 trained its replica or
    shard with its own ``eps``, silently apart.)"""
    for r, res in enumerate(run(f"optimizers_{tables}_copied", tmp_path)):
        assert res["done"] == [0] and [(e["step"], e["type"]) for e in res["errors"]] == [(1, "ValueError")], (r, res)
        assert "`eps` of tables `item`, `kind`, `who`: 1e-07 on rank 0, 1e-06 on rank 1" in res["errors"][0]["message"]


@pytest.mark.parametrize("tables", ["dp", "shard"], ids=["data_parallel", "sharded"])
def test_a_copy_kept_aside_on_one_rank_is_no_difference(tables: str, tmp_path: Path) -> None:
    """An ``ExponentialLR`` halves ``lr`` on every rank at each step, and after step 0 rank 0 alone keeps a
    ``copy.deepcopy`` of its model and optimizer aside (a snapshot, its ``lr`` staying 0.05): the ranks train on,
    nothing gathered. The lookups of the trained model agree on the optimizers of its own tables, not on a copy's
    whose tables only share their names."""
    for r, res in enumerate(run(f"optimizers_{tables}_snapshot", tmp_path)):
        assert res["done"] == [0, 1, 2] and not res["errors"], (r, res)
        assert res["lrs"] == [0.05, 0.025, 0.0125] and res["gathers"] == 0, (r, res)


def test_a_gradient_dropped_by_zero_grad_after_an_evaluation_with_gradients_is_not_applied(tmp_path: Path) -> None:
    """Step 0; an evaluation outside ``torch.no_grad()`` (a lookup with gradients and no backward); step 1's
    backward, then ``opt.zero_grad()`` without a step; step 2: step 1's gradients are dropped, as one process drops
    them, and the tables equal one process's that trains steps 0 and 2 on the global batch."""
    import torch
    import torch.nn.functional as F

    import torch_tpu_embedding as tte

    ranks = run("zeroed", tmp_path)
    for res in ranks:
        assert res["done"] == [0, 2] and not res["errors"], res
    worker = _worker()
    model = worker.skip_model()
    opt = tte.optim.Adam(model.ec.parameters(), lr=0.05)
    for step in (0, 2):
        parts = [worker.batch(r, step) for r in range(2)]
        ids = {k: torch.cat([p[0][k] for p in parts]) for k in parts[0][0]}
        label = torch.cat([p[1] for p in parts]).to(torch.float64)
        F.binary_cross_entropy_with_logits(model(ids), label).backward()
        opt.step()
        opt.zero_grad()
    _assert_gathered(ranks, {name: t.logical_weight() for name, t in model.ec.tables.items()})


def test_a_second_backward_of_a_sharded_lookup_names_the_table(tmp_path: Path) -> None:
    """``loss.backward(retain_graph=True)`` then ``loss.backward()`` on every rank: the second reaches a lookup whose
    gradient went to the owners at the first; both ranks raise a RuntimeError naming the table and what to do
    (before: ``'NoneType' object has no attribute ...``)."""
    for r, res in enumerate(run("double_backward", tmp_path)):
        assert [e["type"] for e in res["errors"]] == ["RuntimeError"], (r, res)
        msg = res["errors"][0]["message"]
        assert "a second backward reached a lookup of this sharded table" in msg and "retain_graph=True" in msg, msg
        assert msg.startswith("Table `"), msg


def test_tables_made_local_after_training_are_no_longer_compared(tmp_path: Path) -> None:
    """A sharded model, and a second one trained data parallel at step 0; then ``tte.distributed.local_tables`` makes
    the second one each rank's own, and rank 1 trains it with ``lr`` 0.2: the ranks train on (before: both raised,
    '`lr` of tables `tag`: 0.1 on rank 0, 0.2 on rank 1': the tables compared were those found at step 0)."""
    for r, res in enumerate(run("local_after_training", tmp_path)):
        assert res["done"] == [0, 1, 2] and not res["errors"], (r, res)
