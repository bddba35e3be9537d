"""One rank of tests/distributed/test_mp_one_exchange.py: the collectives and host reads of one steady training step
of a model whose tables are sharded over a gloo group, with 1 or 3 sharded groups, and the 3-group model's rows
against plain torch in float64 written here (one process on the global batch).

Run as ``python tests/_mp_one_exchange_worker.py OUT_DIR`` with ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and
``MASTER_PORT`` set (``suite_helpers.run_ranks``); writes ``OUT_DIR/rank<r>.pt``: for each model (``"one"``: one
table looked up by three features; ``"three"``: three tables of dims 4, 3 and 2, the last float32 and table-wise,
one feature each), ``largest_loads()`` and the same counted here from the ids, the counts of step 2 (``dist.all_reduce`` of the agreement's eight int64, ``all_to_all_single``
in the forward and in the backward, host reads: ``Tensor.tolist`` and ``aten._local_scalar_dense``, which
``.item()``, ``int()`` and ``bool()`` of a tensor run), and the largest distance of every stored row from the
reference after three SGD steps; or the error it raised. ``"left_out"``: the three tables, rank 1's loss using no
feature of table ``b`` (rank 0's does): its rows owned by rank 1 still get rank 0's gradient.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch
import torch.distributed as dist
from suite_helpers import finish_rank, init_rank
from torch.utils._python_dispatch import TorchDispatchMode

import torch_tpu_embedding as tte

B, LR, STEPS, COUNTED = 4, 0.1, 3, 1
#: feature -> (table, bag width)
FEATURES = {"one": {"fa": ("a", 3), "fb": ("a", 2), "fc": ("a", 1)},
            "three": {"fa": ("a", 3), "fb": ("b", 2), "fc": ("c", 1)}}
#: table -> (rows, dim, dtype, placement, combiner)
TABLES = {"a": (40, 4, torch.float64, "row", "sum"), "b": (30, 3, torch.float64, "row", "mean"),
          "c": (20, 2, torch.float32, "table", "sum")}


def init(table: str) -> torch.Tensor:
    v, d, dtype, _, _ = TABLES[table]
    return torch.randn(v, d, generator=torch.Generator().manual_seed(ord(table)), dtype=torch.float64).to(dtype)


def ids(model: str, rank: int, step: int, feature: str) -> torch.Tensor:
    table, width = FEATURES[model][feature]
    g = torch.Generator().manual_seed(1000 * step + 10 * rank + ord(feature[1]))
    return torch.randint(0, TABLES[table][0], (B, width), generator=g)


def act_grad(rank: int, step: int, feature: str, dim: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(5000 + 1000 * step + 10 * rank + ord(feature[1]))
    return torch.randn(B, dim, generator=g, dtype=torch.float64)


class _HostReads(TorchDispatchMode):
    """Counts ``aten._local_scalar_dense`` (a tensor's value read on the host)."""

    def __init__(self) -> None:
        super().__init__()
        self.reads = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.ops.aten._local_scalar_dense.default:
            self.reads += 1
        return func(*args, **(kwargs or {}))


class _Counts:
    """``dist.all_reduce`` of eight int64 (the agreement) and ``all_to_all_single``, counted while ``on``."""

    def __init__(self) -> None:
        self.on, self.agreements, self.all_to_all, self.tolist = False, 0, 0, 0
        reduce, a2a, tolist = dist.all_reduce, dist.all_to_all_single, torch.Tensor.tolist

        def all_reduce(t: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if self.on and t.dtype == torch.int64 and t.numel() == 8:
                self.agreements += 1
            return reduce(t, *args, **kwargs)

        def all_to_all_single(*args: Any, **kwargs: Any) -> Any:
            self.all_to_all += self.on
            return a2a(*args, **kwargs)

        def counted_tolist(t: torch.Tensor) -> Any:
            self.tolist += self.on
            return tolist(t)

        dist.all_reduce, dist.all_to_all_single = all_reduce, all_to_all_single  # type: ignore[assignment]
        torch.Tensor.tolist = counted_tolist  # type: ignore[assignment,method-assign]


#: the features each rank's loss leaves out, by case (``"left_out"``: rank 1's loss uses no feature of table ``b``)
LEFT_OUT: dict[str, dict[int, set[str]]] = {"one": {}, "three": {}, "left_out": {1: {"fb"}}}


def reference(model: str, case: str) -> dict[str, torch.Tensor]:
    """SGD on the mean of the ranks' losses, each ``Σ_f activations_f · act_grad_f`` (``f`` not left out), in
    float64."""
    world = dist.get_world_size()
    tables = {t: init(t).double() for t in {t for t, _ in FEATURES[model].values()}}
    for step in range(STEPS):
        ws = {t: w.clone().requires_grad_() for t, w in tables.items()}
        loss = torch.zeros((), dtype=torch.float64)
        for r in range(world):
            for f, (t, _) in FEATURES[model].items():
                if f in LEFT_OUT[case].get(r, set()):
                    continue
                bags = ws[t][ids(model, r, step, f)]  # [B, L, D]
                pooled = bags.sum(1) if TABLES[t][4] == "sum" else bags.mean(1)
                loss = loss + (pooled * act_grad(r, step, f, pooled.shape[1])).sum() / world
        grads = torch.autograd.grad(loss, list(ws.values()))
        tables = {t: tables[t] - LR * g for t, g in zip(ws, grads, strict=True)}
    return tables


def loads(model: str, ec: tte.EmbeddingCollection) -> dict[str, dict[str, Any]]:
    """``largest_loads()`` as counted here: per table, the most distinct ids one rank had for one owner in one step
    (the owners: which rank stores each logical id), over the steps, and in the last step."""
    world, out = dist.get_world_size(), {}
    for name, table in ec.physical_tables().items():
        every: list[Any] = [None] * world
        dist.all_gather_object(every, tte.distributed.logical_ids(table).tolist())
        owner = {i: r for r, stored in enumerate(every) for i in stored if i < TABLES[name][0]}
        per_step = []
        for step in range(STEPS):
            most = 0
            for r in range(world):
                distinct = {int(i) for f, (t, _) in FEATURES[model].items() if t == name
                            for i in ids(model, r, step, f).reshape(-1)}
                most = max([most] + [sum(owner[i] == o for i in distinct) for o in range(world)])
            per_step.append(most)
        out[name] = {"largest_load": [max(per_step)] * world, "capacity": per_step[-1]}
    return out


def run(model: str, rank: int, counts: _Counts, case: str) -> dict[str, Any]:
    configs = {t: tte.TableConfig(TABLES[t][0], TABLES[t][1], name=t, combiner=TABLES[t][4], dtype=TABLES[t][2],
                                  initializer=init(t).clone(), placement=TABLES[t][3])
               for t in {t for t, _ in FEATURES[model].values()}}
    features = {f: tte.FeatureConfig(configs[t], max_ids_per_bag=width) for f, (t, width) in FEATURES[model].items()}
    ec = tte.EmbeddingCollection(features)
    tte.distributed.shard(ec)
    opt = tte.optim.SGD(ec.parameters(), lr=LR)
    out: dict[str, Any] = {}
    for step in range(STEPS):
        counts.on = step == COUNTED
        counts.agreements = counts.all_to_all = counts.tolist = 0
        with _HostReads() as forward_reads:
            acts = ec({f: tte.Padded(ids(model, rank, step, f)) for f in FEATURES[model]})
        if counts.on:
            out["forward_all_to_all"] = counts.all_to_all
        loss = sum((a.double() * act_grad(rank, step, f, a.shape[1])).sum() for f, a in acts.items()
                   if f not in LEFT_OUT[case].get(rank, set()))
        with _HostReads() as backward_reads:
            loss.backward()
        if counts.on:
            out.update(agreements=counts.agreements, all_to_all=counts.all_to_all,
                       host_reads=forward_reads.reads + backward_reads.reads + counts.tolist)
        counts.on = False
        opt.step()
        opt.zero_grad()
    out["loads"], out["want_loads"] = ec.largest_loads(), loads(model, ec)
    want, err = reference(model, case), 0.0
    for name, table in ec.physical_tables().items():
        stored = table.weight.detach().double()
        for j, i in enumerate(tte.distributed.logical_ids(table).tolist()):
            if i < TABLES[name][0]:
                err = max(err, float((stored[j] - want[name][i]).abs().max()))
    out["distance"] = err
    return out


def frozen(rank: int, counts: _Counts, everywhere: bool) -> dict[str, Any]:
    """The three tables, ``c`` frozen on every rank (``everywhere``: its activations record no gradient, the step's
    collectives as with every table training, the other tables' rows as plain torch's) or on rank 1 only (every
    rank raises at the agreement, naming the tables)."""
    model = "three"
    configs = {t: tte.TableConfig(TABLES[t][0], TABLES[t][1], name=t, combiner=TABLES[t][4], dtype=TABLES[t][2],
                                  initializer=init(t).clone(), placement=TABLES[t][3]) for t in "abc"}
    ec = tte.EmbeddingCollection({f: tte.FeatureConfig(configs[t], max_ids_per_bag=width)
                                  for f, (t, width) in FEATURES[model].items()})
    tte.distributed.shard(ec)
    if everywhere or rank == 1:
        ec.tables.c.weight.requires_grad_(False)
    counts.on = True
    counts.agreements = counts.all_to_all = 0
    try:
        acts = ec({f: tte.Padded(ids(model, rank, 0, f)) for f in FEATURES[model]})
        sum((a.double() * act_grad(rank, 0, f, a.shape[1])).sum() for f, a in acts.items()).backward()
    except RuntimeError as e:
        return {"raised": str(e)}
    finally:
        counts.on = False
    return {"agreements": counts.agreements, "all_to_all": counts.all_to_all,
            "c_records_grad": acts["fc"].requires_grad, "rows": sorted(ec.row_grads())}


def main() -> None:
    rank, out_dir = int(os.environ["RANK"]), sys.argv[1]
    init_rank(rank, int(os.environ["WORLD_SIZE"]), int(os.environ["MASTER_PORT"]))
    counts = _Counts()
    results: dict[str, Any] = {}
    for case in LEFT_OUT:
        try:
            results[case] = run("three" if case == "left_out" else case, rank, counts, case)
        except Exception as e:  # (recorded for the test, which shows it)
            results[case] = {"error": f"{type(e).__name__}: {e}"}
    for case, everywhere in (("frozen", True), ("frozen_on_one_rank", False)):
        try:
            results[case] = frozen(rank, counts, everywhere)
        except Exception as e:  # (recorded for the test, which shows it)
            results[case] = {"error": f"{type(e).__name__}: {e}"}
    finish_rank(results, out_dir, rank)


if __name__ == "__main__":
    main()
