"""One rank of a process group that a user gets wrong, for tests/distributed/test_mp_guards.py.

Run as ``python tests/_mp_guard_worker.py SCENARIO OUT_DIR`` with ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and
``MASTER_PORT`` set (one process per rank, as torchrun starts them); writes ``OUT_DIR/rank<r>.json``: what the
rank saw (each error's step, type and message, the steps it completed). The test runs every rank with a timeout,
so a rank that hangs fails the test instead of hanging it.
"""

from __future__ import annotations

import copy
import dataclasses
import datetime
import json
import os
import sys
import threading
from pathlib import Path
from typing import Any

import _mp_ckpt_guard
import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _dp_route_worker import ListReads, ScalarReads
from torch import nn

import torch_tpu_embedding as tte
from torch_tpu_embedding.distributed import grad_sync

B, DIM = 8, 4


def configs(rank: int, scenario: str) -> dict[str, tte.FeatureConfig]:
    item_rows = 1001 if scenario.endswith("rows_differ") and rank == 0 else 1000
    who_placement = "row" if scenario == "placement_differ" and rank == 0 else "table"
    item = tte.TableConfig(item_rows, DIM, name="item", placement="row")
    who = tte.TableConfig(600, DIM, name="who", placement=who_placement)
    kind = tte.TableConfig(20, DIM, name="kinds" if scenario == "names_differ" and rank == 1 else "kind",
                           placement="replicated")
    out = {"item": tte.FeatureConfig(item), "who": tte.FeatureConfig(who), "kind": tte.FeatureConfig(kind)}
    if scenario in ("stacking_differ", "dp_plain_member_frozen_on_one_rank"):  # a second replicated table, stacked
        # with `kind` where stack_tables is on
        out["tag"] = tte.FeatureConfig(tte.TableConfig(30, DIM, name="tag", placement="replicated"))
    return out


class Model(nn.Module):
    def __init__(self, features: dict[str, tte.FeatureConfig], stack_tables: bool = True) -> None:
        super().__init__()
        self.ec = tte.EmbeddingCollection(features, stack_tables=stack_tables)
        self.head = nn.Linear(DIM * len(features), 1)

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        if "tag" in self.ec.feature_names:  # (stacking_differ) looked up by the same ids as `kind`
            batch = {**batch, "tag": batch["kind"]}
        out = self.ec(batch)
        return self.head(torch.cat([out[k] for k in sorted(out)], dim=1)).squeeze(1)


def batch(rank: int, step: int, bad: bool = False, b: int = B) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    gen = torch.Generator().manual_seed(100 * step + rank)
    ids = {"item": torch.randint(0, 1000, (b,), generator=gen), "who": torch.randint(0, 600, (b,), generator=gen),
           "kind": torch.randint(0, 20, (b,), generator=gen)}
    if bad:
        ids["item"][3] = 1000  # one past the table's rows: refused by the lookup
    return ids, torch.rand(b, generator=gen)


def error(e: BaseException, step: int | None = None) -> dict[str, Any]:
    return {"step": step, "type": type(e).__name__, "message": str(e)}


def train(model: nn.Module, opt: Any, rank: int, steps: int, bad: tuple[int, int] | None,
          skip: tuple[type[BaseException], ...] = ()) -> dict[str, Any]:
    """``steps`` steps; at step ``bad[1]`` rank ``bad[0]`` has an out-of-range id. Every error is recorded; one
    of a type in ``skip`` skips the batch, any other ends the loop."""
    errors, done = [], []
    for step in range(steps):
        ids, label = batch(rank, step, bad == (rank, step))
        try:
            F.binary_cross_entropy_with_logits(model(ids), label).backward()
            opt.step()
            opt.zero_grad()
            done.append(step)
        except Exception as e:  # noqa: BLE001 - recorded
            errors.append(error(e, step))
            opt.zero_grad()
            if not isinstance(e, skip):
                break
    return {"errors": errors, "done": done}


def pipeline(model: nn.Module, opt: Any, rank: int, fault: str, stale: bool) -> dict[str, Any]:
    """4 steps through ``tte.TrainPipeline`` with prefetch (``stale``: and pipelined execution); rank 1 fails at
    batch 2: ``fault`` ``"bad_id"``: an out-of-range id; ``"features"``: ``features(batch)`` raises; ``"source"``: the
    source raises instead of giving it. Records the steps done, the error with the step it was raised at, the
    prefetch threads left and the first unfinished batch's step."""
    failing = rank == 1
    data = [{"ids": ids, "label": label, "step": s}
            for s in range(4) for ids, label in [batch(rank, s, fault == "bad_id" and failing and s == 2)]]

    def source() -> Any:
        for b in data:
            if fault == "source" and failing and b["step"] == 2:
                raise OSError("the reader failed")
            yield b

    def features(b: dict[str, Any]) -> Any:
        if fault == "features" and failing and b["step"] == 2:
            raise KeyError("ids")
        return b["ids"]

    def step(m: nn.Module, b: dict[str, Any]) -> torch.Tensor:
        return F.binary_cross_entropy_with_logits(m(b["ids"]), b["label"])

    pipe = tte.TrainPipeline(model, opt, step=step, features=features, pipeline_execution_with_tensor_core=stale)
    errors, done = [], []
    try:
        for _ in pipe.run(source()):
            done.append(pipe.steps - 1)
    except Exception as e:  # noqa: BLE001 - recorded
        errors.append(error(e, pipe.steps))
    left = pipe.unfinished()
    return {"errors": errors, "done": done, "threads": sum(t.name == "tte-prefetch" for t in threading.enumerate()),
            "unfinished_first": left[0]["step"] if left else None}


def skip_model(dtype: torch.dtype = torch.float64) -> Model:
    """The model of the ``skip_*`` scenarios: the three tables in ``dtype``, the head frozen (no DDP: a rank that
    skips its backward skips DDP's all-reduce too, which torch's DDP never forgives)."""
    torch.manual_seed(0)
    feats = {n: tte.FeatureConfig(dataclasses.replace(f.table, dtype=dtype)) for n, f in configs(0, "").items()}
    model = Model(feats).to(dtype)
    model.head.requires_grad_(False)
    return model


def skip_steps(model: Model, opt: Any, rank: int, skip: str, steps: int = 3) -> dict[str, Any]:
    """``steps`` steps; at step 1 rank 1 looks up its batch and skips its backward (``skip="backward"``: it still
    calls ``opt.step()``, as a loop that catches an error in its loss does; ``"both"``: no step either)."""
    errors, done = [], []
    for step in range(steps):
        ids, label = batch(rank, step)
        try:
            loss = F.binary_cross_entropy_with_logits(model(ids), label.to(torch.float64))
            if not (rank == 1 and step == 1):
                loss.backward()
            if not (rank == 1 and step == 1 and skip == "both"):
                opt.step()
            done.append(step)
        except Exception as e:  # noqa: BLE001 - recorded
            errors.append(error(e, step))
            break
        finally:
            opt.zero_grad()
    tables = {}
    for name, t in model.ec.tables.items():
        tables[name] = {"ids": tte.distributed.logical_ids(t).tolist(), "rows": t.weight.detach().tolist()}
    return {"errors": errors, "done": done, "tables": tables}


def unused_steps(model: Model, opt: Any, rank: int, case: str, steps: int = 3) -> dict[str, Any]:
    """``steps`` steps whose loss leaves out table `who`'s activations (``case="every_rank"``: on every rank, every
    step after the first, as a model that looks up a feature it only logs; ``"one_rank"``: on rank 1 at step 1 only, the rest of its
    backward run). Records the errors, the steps done and the tables' stored rows."""
    errors, done = [], []
    before: dict[str, torch.Tensor] = {}
    for step in range(steps):
        ids, label = batch(rank, step)
        try:
            out = model.ec(ids)
            drop = (case == "every_rank" and step >= 1) or (rank == 1 and step == 1)
            used = [out[k] if not (drop and k == "who") else torch.zeros_like(out[k]).detach() for k in sorted(out)]
            logit = model.head(torch.cat(used, dim=1)).squeeze(1)
            F.binary_cross_entropy_with_logits(logit, label.to(torch.float64)).backward()
            opt.step()
            done.append(step)
        except Exception as e:  # noqa: BLE001 - recorded
            errors.append(error(e, step))
            break
        finally:
            opt.zero_grad()
        if step == 0:  # (what the steps after the first move)
            before = {name: t.weight.detach().clone() for name, t in model.ec.tables.items()}
    tables = {}
    for name, t in model.ec.tables.items():
        tables[name] = {"ids": tte.distributed.logical_ids(t).tolist(), "rows": t.weight.detach().tolist()}
    moved = {name: float((t.weight.detach() - before[name]).abs().max()) if t.weight.numel() else 0.0
             for name, t in model.ec.tables.items()}
    return {"errors": errors, "done": done, "tables": tables, "moved": moved}


def two_losses(model: Model, rank: int, order: tuple[str, str] = ("item", "who"), steps: int = 3) -> dict[str, Any]:
    """Two losses and two optimizers on one forward (table `item`'s, then table `who`'s): ``loss1.backward()``,
    ``opt1.step()``, ``loss2.backward()``, ``opt2.step()`` at every step. Records the errors, the steps done and the
    tables' stored rows."""
    tables = model.ec.tables
    opts = [tte.optim.Adam(tables[n].parameters(), lr=0.05, lazy_adam=False) for n in order]
    errors, done = [], []
    for step in range(steps):
        ids, _ = batch(rank, step)
        try:
            out = model.ec(ids)
            for name, opt in zip(order, opts, strict=True):
                out[name].square().mean().backward()
                opt.step()
            done.append(step)
        except Exception as e:  # noqa: BLE001 - recorded
            errors.append(error(e, step))
            break
        finally:
            for opt in opts:
                opt.zero_grad()
    rows = {name: {"ids": tte.distributed.logical_ids(t).tolist(), "rows": t.weight.detach().tolist()}
            for name, t in tables.items()}
    return {"errors": errors, "done": done, "tables": rows}


def zeroed_steps(model: Model, opt: Any, rank: int) -> dict[str, Any]:
    """Step 0; an evaluation outside ``torch.no_grad()`` (``model.eval()`` alone: its lookup pending, no backward);
    step 1's backward, then ``opt.zero_grad()`` without its step (a batch dropped after its backward); step 2.
    Records the errors, the steps done and the tables' stored rows."""
    errors, done = [], []
    for step in range(3):
        ids, label = batch(rank, step)
        try:
            F.binary_cross_entropy_with_logits(model(ids), label.to(torch.float64)).backward()
            if step != 1:
                opt.step()
                done.append(step)
        except Exception as e:  # noqa: BLE001 - recorded
            errors.append(error(e, step))
            break
        finally:
            opt.zero_grad()
        if step == 0:
            model.eval()(batch(rank, 9)[0])
            model.train()
    rows = {name: {"ids": tte.distributed.logical_ids(t).tolist(), "rows": t.weight.detach().tolist()}
            for name, t in model.ec.tables.items()}
    return {"errors": errors, "done": done, "tables": rows}


def optimizers_differ(case: str, rank: int) -> dict[str, Any]:
    """``"<dp|shard>_<case>"``: data parallel or sharded tables, 3 steps, each rank's optimizer built by ``case``:
    ``lr``: 0.1 on rank 0, 0.2 on rank 1 (``numpy_lr``: as ``np.float32``); ``eps``: Adam's 1e-7 and 1e-6; ``class``: Adam and Adagrad; ``changed``:
    alike, then rank 1 sets Adam's eps to 1e-6 after step 0; ``rebuilt``: alike, built anew on every rank after
    step 0, the old one kept alive on rank 0 (``rebuilt_lr``: the new one's lr 0.2 on rank 1); ``scheduler``: alike,
    with an ``ExponentialLR`` on every rank; ``copied``: alike, then after step 0 every rank trains a
    ``copy.deepcopy`` of the model and optimizer (the originals kept alive), rank 1's copy with eps 1e-6;
    ``snapshot``: as ``scheduler``, and after step 0 rank 0 alone keeps a ``copy.deepcopy`` of both aside. Records
    the errors, the steps done and the ``all_gather_object`` calls of the steps."""
    torch.manual_seed(0)
    model = Model(configs(rank, ""))
    if case.startswith("dp_"):
        tte.distributed.data_parallel(model)
    else:
        tte.distributed.shard(model)
    kind = case.split("_", 1)[1]
    tables = list(model.ec.parameters())
    if kind == "lr":
        opt: Any = tte.optim.Adagrad(tables, lr=0.1 if rank == 0 else 0.2)
    elif kind == "numpy_lr":  # numpy scalars, which the optimizers take for numbers
        opt = tte.optim.Adagrad(tables, lr=np.float32(0.1 if rank == 0 else 0.2))
    elif kind == "eps":
        opt = tte.optim.Adam(tables, lr=0.1, eps=1e-7 if rank == 0 else 1e-6)
    elif kind == "class":
        opt = (tte.optim.Adam if rank == 0 else tte.optim.Adagrad)(tables, lr=0.1)
    else:
        opt = tte.optim.Adam(tables, lr=0.1)
    sched = torch.optim.lr_scheduler.ExponentialLR(opt, 0.5) if kind in ("scheduler", "snapshot") else None
    gathers = []
    gather = dist.all_gather_object

    def counted(*args: Any, **kwargs: Any) -> Any:
        gathers.append(1)
        return gather(*args, **kwargs)

    dist.all_gather_object = counted  # type: ignore[assignment]
    errors, done, lrs = [], [], []
    kept = []
    for step in range(3):
        if kind == "changed" and rank == 1 and step == 1:
            opt.param_groups[0]["eps"] = 1e-6
        if kind == "copied" and step == 1:  # every rank trains a copy on, the original kept alive; rank 1 alone
            kept.append((model, opt))  # sets the copy's eps
            model, opt = copy.deepcopy((model, opt))
            if rank == 1:
                opt.param_groups[0]["eps"] = 1e-6
        if kind == "snapshot" and step == 1 and rank == 0:  # rank 0 alone keeps a copy aside (its lr stays 0.05)
            kept.append(copy.deepcopy((model, opt)))
        if kind.startswith("rebuilt") and step == 1:  # every rank builds its optimizer anew (rebuilt_lr: with lr 0.2
            if rank == 0:  # on rank 1); rank 0 keeps the old one alive (a helper of its own refers to it)
                kept.append(opt)
            opt = tte.optim.Adam(tables, lr=0.2 if kind == "rebuilt_lr" and rank == 1 else 0.1)
        ids, label = batch(rank, step)
        try:
            F.binary_cross_entropy_with_logits(model(ids), label).backward()
            opt.step()
            done.append(step)
        except Exception as e:  # noqa: BLE001 - recorded
            errors.append(error(e, step))
            break
        finally:
            opt.zero_grad()
        if sched is not None:
            sched.step()
        lrs.append(opt.param_groups[0]["lr"])
    return {"errors": errors, "done": done, "gathers": len(gathers), "lrs": lrs}


def run(scenario: str, rank: int, world: int) -> dict[str, Any]:
    if scenario.startswith("optimizers_"):  # "optimizers_<dp|shard>_<case>": the ranks' optimizers differ, or not
        return optimizers_differ(scenario.removeprefix("optimizers_"), rank)
    if scenario == "local_after_training":  # a sharded model, and a second one trained data parallel, then each
        # rank's own (tte.distributed.local_tables), rank 1's with lr 0.2: a run of its own, not a difference
        model = skip_model()
        tte.distributed.shard(model, timeout=datetime.timedelta(seconds=20))
        torch.manual_seed(1)
        side = tte.distributed.data_parallel(tte.EmbeddingCollection(
            {"tag": tte.FeatureConfig(tte.TableConfig(30, DIM, name="tag", dtype=torch.float64))}))
        opts = [tte.optim.Adam(model.ec.parameters(), lr=0.05), tte.optim.Adagrad(side.parameters(), lr=0.1)]
        errors, done = [], []
        for step in range(3):
            if step == 1:
                tte.distributed.local_tables(side)
                opts[1].param_groups[0]["lr"] = 0.2 if rank == 1 else 0.1
            ids, label = batch(rank, step)
            try:
                loss = F.binary_cross_entropy_with_logits(model(ids), label.to(torch.float64))
                (loss + side({"tag": ids["kind"]})["tag"].sum()).backward()
                for opt in opts:
                    opt.step()
                done.append(step)
            except Exception as e:  # noqa: BLE001 - recorded
                errors.append(error(e, step))
                break
            finally:
                for opt in opts:
                    opt.zero_grad()
        return {"errors": errors, "done": done}
    if scenario == "double_backward":  # every rank: loss.backward(retain_graph=True), then a second backward
        model = skip_model()
        tte.distributed.shard(model, timeout=datetime.timedelta(seconds=20))
        ids, label = batch(rank, 0)
        loss = F.binary_cross_entropy_with_logits(model(ids), label.to(torch.float64))
        loss.backward(retain_graph=True)
        try:
            loss.backward()
        except Exception as e:  # noqa: BLE001 - recorded
            return {"errors": [error(e, 0)]}
        return {"errors": []}
    if scenario == "zeroed":  # a backward whose gradient zero_grad() drops, behind an evaluation's pending lookup
        model = skip_model()
        tte.distributed.shard(model, timeout=datetime.timedelta(seconds=20))
        return zeroed_steps(model, tte.optim.Adam(model.ec.parameters(), lr=0.05), rank)
    if scenario.startswith("two_losses"):  # two losses, two optimizers, each loss's backward and step in turn
        model = skip_model()
        tte.distributed.shard(model, timeout=datetime.timedelta(seconds=20))
        return two_losses(model, rank, ("who", "item") if scenario.endswith("_reversed") else ("item", "who"))
    if scenario.startswith("unused_"):  # "unused_<every_rank|one_rank>": table `who` left out of a loss
        model = skip_model()
        tte.distributed.shard(model, timeout=datetime.timedelta(seconds=20))
        opt = tte.optim.Adam(model.ec.parameters(), lr=0.05, lazy_adam=False)
        return unused_steps(model, opt, rank, scenario.removeprefix("unused_"))
    if scenario.startswith("skip_"):  # "skip_<backward|both>": rank 1 skips its backward (and its step) at step 1
        model = skip_model()
        wait = 10 if scenario == "skip_both" else 60  # (skip_both: how long rank 0 waits for rank 1)
        tte.distributed.shard(model, timeout=datetime.timedelta(seconds=wait))
        opt = tte.optim.Adam(model.ec.parameters(), lr=0.05)
        return skip_steps(model, opt, rank, scenario.removeprefix("skip_"))
    torch.manual_seed(0)
    model = Model(configs(rank, scenario), stack_tables=not (scenario == "stacking_differ" and rank == 1))
    if scenario == "forgot_shard":
        if rank == 0:  # rank 1 never calls shard and trains on
            try:
                tte.distributed.shard(model, timeout=datetime.timedelta(seconds=5))
            except RuntimeError as e:
                return {"errors": [error(e)]}
            return {"errors": []}
        opt = tte.optim.Adagrad(model.parameters(), lr=0.1)
        return train(model, opt, rank, 3, None)
    if scenario == "opt_before_shard":
        stacked = Model({n: tte.FeatureConfig(tte.TableConfig(1000, DIM, name=n, placement="row"))
                         for n in ("alpha", "beta")})
        stale = tte.optim.Adagrad(stacked.parameters(), lr=0.1)
        grouped = list(stacked.ec.stacked_members())
        refused = []
        seconds = datetime.timedelta(seconds=5)
        for timeout, group in ((5, None), (datetime.timedelta(0), None), (seconds, dist.group.WORLD)):
            try:  # not a timedelta; not positive; with a group given (which shard does not create): refused
                tte.distributed.shard(stacked, group, timeout=timeout)  # type: ignore[arg-type]
            except ValueError as e:
                refused.append(str(e))
        tte.distributed.shard(stacked)
        ids = {n: torch.tensor([1, 2]) for n in ("alpha", "beta")}
        stacked(ids).sum().backward()
        try:
            stale.step()
        except RuntimeError as e:
            return {"errors": [error(e)], "groups": grouped, "refused": refused}
        return {"errors": [], "groups": grouped, "refused": refused}
    if scenario.startswith("dp_"):  # data parallel, no table sharded: "dp_<ddp|plain>_<case>"
        # ddp: tte.distributed.DistributedDataParallel (DDP's all-reduce of the head in the backward); plain:
        # tte.distributed.data_parallel alone (the tables' exchange at step() is the step's first collective)
        dp = tte.distributed.DistributedDataParallel(model) if scenario.startswith("dp_ddp_") \
            else tte.distributed.data_parallel(model)
        opt = tte.optim.Adagrad(dp.parameters(), lr=0.1)
        if scenario == "dp_plain_reads":  # a training forward's host reads, with and without the agreement
            out = train(dp, opt, rank, 2, None)
            ids = batch(rank, 5)[0]
            reads = []
            for tables in ("exchanged", "local"):
                if tables == "local":
                    tte.distributed.local_tables(model)  # no exchange: no agreement
                with ListReads() as lists, ScalarReads() as scalars:
                    model(ids)
                opt.zero_grad()
                reads.append([scalars.reads, lists.reads])
            tte.distributed.data_parallel(model, broadcast=False)  # exchanged again
            if rank == 0:  # evaluation on rank 0 alone makes no collective: the ranks then train on together
                with torch.no_grad():
                    model.eval()(batch(rank, 9)[0])
                model.train()
            return out | {"reads": reads, "after": train(dp, opt, rank, 1, None)}
        if "_pipeline_" in scenario:  # "dp_<wrapper>_pipeline_<fault>[_stale]": as "pipeline_<fault>[_stale]" below
            fault = scenario.split("_pipeline_", 1)[1].removesuffix("_stale")
            return pipeline(dp, opt, rank, fault, scenario.endswith("_stale"))
        if scenario == "dp_plain_static_sizes":  # an accelerator's exchange (static sizes), forced on the CPU:
            # the same batch size at step 0, then 8 on rank 0 (a shape it has checked) and 6 on rank 1 (a new one)
            grad_sync.DEDUP_DEVICE_TYPES.discard("cpu")
            errors, done = [], []
            for step, size in enumerate((B, B if rank == 0 else B - 2, B)):
                ids, label = batch(rank, step, b=size)
                try:
                    F.binary_cross_entropy_with_logits(dp(ids), label).backward()
                    opt.step()
                    done.append(step)
                except Exception as e:  # noqa: BLE001 - recorded; every rank skips the step alike
                    errors.append(error(e, step))
                opt.zero_grad()
            return {"errors": errors, "done": done}
        if "_micro_batches_" in scenario:  # "dp_<wrapper>_micro_batches_<alike|differ>": gradient accumulation,
            # 2 micro-batches per step on every rank (alike); or (differ) 1 at step 0 (DDP's forward after its first
            # step makes a collective of its own, the rebuild of its buckets), then 2 on rank 0 and 1 on rank 1
            errors, done = [], []
            for step in range(2):
                try:
                    for micro in range(2 if scenario.endswith("_alike") or (rank == 0 and step == 1) else 1):
                        ids, label = batch(rank, 10 * step + micro)
                        F.binary_cross_entropy_with_logits(dp(ids), label).backward()
                    opt.step()
                    done.append(step)
                except Exception as e:  # noqa: BLE001 - recorded; the loop ends
                    errors.append(error(e, step))
                    break
                opt.zero_grad()
            return {"errors": errors, "done": done, "kind": float(model.ec.tables["kind"].weight.detach().sum()),
                    "item": float(model.ec.tables["item"].weight.detach().sum())}
        if scenario == "dp_plain_member_frozen_on_one_rank":  # rank 0 freezes `tag`, stacked with `kind`
            if rank == 0:
                model.ec.tables["tag"].requires_grad_(False)
            return train(dp, opt, rank, 2, None)
        if scenario == "dp_plain_frozen_on_one_rank":  # rank 0 freezes every table (fine-tunes the head only)
            if rank == 0:
                for p in model.ec.parameters():
                    p.requires_grad_(False)
            return train(dp, opt, rank, 2, None)
        if scenario.endswith("_every_rank_skips"):  # every rank skips a failed step alike: they stay in step
            out = train(dp, opt, rank, 4, (1, 1), (Exception,))
            return out | {"head": [float(x) for x in model.head.weight.detach().reshape(-1)],
                          "kind": float(model.ec.tables["kind"].weight.detach().sum()),
                          "item": float(model.ec.tables["item"].weight.detach().sum())}
        # rank 1 skips its bad batch (as in bad_id_skipped); rank 0 stops at an error
        return train(dp, opt, rank, 4, (1, 1), (ValueError,))
    try:
        tte.distributed.shard(model, dtensor_state_dict=scenario == "state_on_one_rank")
    except RuntimeError as e:
        return {"errors": [error(e)], "stage": "shard"}
    if scenario == "torch_ddp":
        try:
            ddp = nn.parallel.DistributedDataParallel(model)
            ids, label = batch(rank, 0)
            F.binary_cross_entropy_with_logits(ddp(ids), label).backward()
        except RuntimeError as e:
            return {"errors": [error(e)]}
        return {"errors": []}
    ddp = tte.distributed.DistributedDataParallel(model)
    opt = tte.optim.Adagrad(ddp.parameters(), lr=0.1)
    if scenario == "frozen_on_one_rank":  # rank 0 freezes row-sharded table `item` after shard; rank 1 trains it
        if rank == 0:
            model.ec.tables["item"].weight.requires_grad_(False)
        return train(ddp, opt, rank, 2, None)
    if scenario in ("rows_differ", "placement_differ", "names_differ", "stacking_differ"):
        return train(ddp, opt, rank, 2, None)
    if scenario.startswith("pipeline_"):  # "pipeline_<fault>[_stale]": rank 1 fails at batch 2 in tte.TrainPipeline
        return pipeline(ddp, opt, rank, scenario[len("pipeline_"):].removesuffix("_stale"), scenario.endswith("_stale"))
    if scenario == "bad_id_skipped":  # rank 1 skips its bad batch (as the user did); rank 0 stops at an error
        return train(ddp, opt, rank, 4, (1, 1), (ValueError,))
    if scenario == "bad_id_every_rank_skips":  # every rank skips a failed step alike: they stay in step
        out = train(ddp, opt, rank, 4, (1, 1), (Exception,))
        out["head"] = [float(x) for x in model.head.weight.detach().reshape(-1)]
        out["kind"] = float(model.ec.tables["kind"].weight.detach().sum())
        return out
    if scenario == "state_on_one_rank":  # rank 0 alone takes the state_dict (a collective with DTensors)
        out = train(ddp, opt, rank, 2, None)
        try:
            if rank == 0:
                model.state_dict()
            train_more = train(ddp, opt, rank, 1, None)
        except RuntimeError as e:
            return out | {"errors": [error(e)]}
        return out | {"errors": train_more["errors"]}
    if scenario == "clip_rank_without_rows":  # tte.clip_grad_norm_ of table-wise `who` alone (float64): its owner,
        # rank 0, holds every gradient row; rank 1 none, and no dense gradient
        model = skip_model()
        tte.distributed.shard(model, timeout=datetime.timedelta(seconds=60))
        c = torch.arange(1.0, DIM + 1, dtype=torch.float64)
        opt = tte.optim.SGD(model.ec.parameters(), lr=0.1)
        norms, ids_seen = [], []
        for step, norm_type in enumerate((2.0, float("inf"))):
            ids, _ = batch(rank, step)
            ((model.ec(ids)["who"] @ c).mean()).backward()  # a linear loss: row i's gradient is count_i · c / (B·n)
            norms.append(float(tte.clip_grad_norm_([model.ec.tables["who"].weight], 1e-3, norm_type=norm_type)))
            ids_seen.append(ids["who"].tolist())
            opt.step()
            opt.zero_grad()
        return {"norms": norms, "ids": ids_seen}
    if scenario == "eval_on_one_rank":  # rank 0 alone looks up under no_grad between training steps
        out = train(ddp, opt, rank, 2, None)  # (DDP rebuilds its buckets, a collective, in its second forward)
        try:
            if rank == 0:
                with torch.no_grad():
                    model(batch(rank, 9)[0])
            train_more = train(ddp, opt, rank, 1, None)
        except RuntimeError as e:
            return out | {"errors": [error(e)]}
        return out | {"errors": train_more["errors"]}
    raise SystemExit(f"unknown scenario {scenario!r}")


def main() -> None:
    scenario, out = sys.argv[1], Path(sys.argv[2])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    # (micro_batches: a hang before the fix ends at this short timeout, on both ranks, instead of gloo's 30 minutes)
    wait = datetime.timedelta(seconds=20) if "_micro_batches_" in scenario else None
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=wait)
    try:
        if scenario.startswith("ckpt_"):  # a checkpoint load or save that fails on one rank (tests/_mp_ckpt_guard.py)
            torch.manual_seed(0)
            result = _mp_ckpt_guard.run(scenario, rank, Model(configs(rank, scenario)), batch, out)
        else:
            result = run(scenario, rank, world)
    except Exception as e:  # noqa: BLE001 - recorded for the test, which checks what each rank saw
        result = {"errors": [error(e)], "uncaught": True}
    (out / f"rank{rank}.json").write_text(json.dumps(result), encoding="utf-8")
    os._exit(0)  # never wait in destroy_process_group for a rank that failed


if __name__ == "__main__":
    main()
