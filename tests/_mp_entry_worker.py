"""tte.distributed.shard's entry points on a gloo group, for tests/distributed/test_mp_entry.py: one process per rank, every
case in one spawn.

:func:`copies` checks that a sharded model's copies (``copy.deepcopy``, ``.float()``) keep its
``dtensor_state_dict`` choice in the model's ``state_dict`` and in its optimizer's (torch's helpers) alike.
:func:`refusals` makes the wrong calls a user can make on a process group and records each error and
whether the model changed.
"""

from __future__ import annotations

import copy
import pickle
from typing import Any

import _mp_worker as W
import torch
import torch.distributed as dist
from suite_helpers import finish_rank, init_rank
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
from torch.distributed.tensor import DTensor, Shard

import torch_tpu_embedding as tte
from torch_tpu_embedding.distributed.exchange import group_sharding, send_to_owners


def _kinds(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """What each sharded table is in the model's ``state_dict`` and in torch's ``get_optimizer_state_dict`` (its
    row slots): ``"DTensor"`` or ``"Tensor"``, and the logical values of the model's entry gathered whole (the
    test compares copies by value)."""
    sd = model.state_dict()
    osd = get_optimizer_state_dict(model, opt)
    out: dict[str, Any] = {}
    for t in W.SHARDED:
        v = sd[f"ec.tables.{t}.weight"]
        slots = osd["state"][f"ec.tables.{t}.weight"]
        out[t] = {"model": type(v).__name__,
                  "value": v.full_tensor() if isinstance(v, DTensor) else v.clone(),
                  "slots": {k: type(s).__name__ for k, s in slots.items() if isinstance(s, torch.Tensor) and s.dim()}}
    return out


def copies(rank: int, world: int) -> dict[str, Any]:
    """For ``dtensor_state_dict`` True and False: a sharded model trained 2 steps, its ``copy.deepcopy`` (with a
    new optimizer of the copy's parameters, its slots created), and the copy moved by ``.float()``."""
    out: dict[str, Any] = {}
    for flag in (True, False):
        model = W.Model(torch.float64)
        tte.distributed.shard(model, dtensor_state_dict=flag)
        opt = W.make_opt("adagrad", model.parameters())
        W.train(model, model, opt, torch.float64, rank, world, steps=range(2))
        twin = copy.deepcopy(model)
        twin_opt = W.make_opt("adagrad", twin.parameters())
        out[f"{flag}/original"] = _kinds(model, opt)
        out[f"{flag}/deepcopy"] = _kinds(twin, twin_opt)
        twin.float()
        out[f"{flag}/float"] = _kinds(twin, W.make_opt("adagrad", twin.parameters()))
    return out


def _items(rank: int, world: int, m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s ``m`` items of :func:`transport`: destinations, int64 tags ``rank·1000 + i`` and float64
    rows ``[m, 3]`` (every rank can draw every rank's)."""
    g = torch.Generator().manual_seed(rank * 100 + m)
    dest = torch.randint(0, world, (m,), generator=g)
    return dest, rank * 1000 + torch.arange(m), torch.randn(m, 3, generator=g, dtype=torch.float64)


def transport(rank: int, world: int) -> dict[str, Any]:
    """``_pg_exchange.send_to_owners`` for ``m`` items per rank (0 on every rank included): what this rank got,
    and what it should have got, worked out from every rank's draws (each sender's items to this rank in their
    order, padded to the largest bucket of any rank with the fill values)."""
    out = {}
    for m in (0, 1, 5, 17):
        dest, tags, rows = _items(rank, world, m)
        got_tags, got_rows = send_to_owners(dest, (tags, rows), (-1, 0.5), world, dist.group.WORLD)
        every = [_items(r, world, m) for r in range(world)]
        cap = max(1, max(int((d == o).sum()) for d, _, _ in every for o in range(world)))
        want_tags = torch.full((world * cap,), -1, dtype=torch.int64)
        want_rows = torch.full((world * cap, 3), 0.5, dtype=torch.float64)
        for r, (d, t, x) in enumerate(every):
            mine = d == rank
            want_tags[r * cap : r * cap + int(mine.sum())] = t[mine]
            want_rows[r * cap : r * cap + int(mine.sum())] = x[mine]
        out[m] = {"tags": torch.equal(got_tags, want_tags), "rows": torch.equal(got_rows, want_rows)}
    return out


def _snapshot(model: torch.nn.Module, opt: torch.optim.Optimizer | None = None) -> list[Any]:
    """Everything a refused call must leave as it was: each parameter (the object and its values), each table's
    layout and the optimizer's slots."""
    tables = [m for m in model.modules() if isinstance(m, tte.EmbeddingTable)]
    out: list[Any] = [(n, p, p.detach().clone()) for n, p in model.named_parameters()]
    out += [(t.name, tte.distributed.logical_ids(t).clone(), group_sharding(t.weight)) for t in tables]
    if opt is not None:
        out += [{k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in st.items()} for st in opt.state.values()]
    return out


def _same(a: list[Any], b: list[Any]) -> bool:
    def eq(x: Any, y: Any) -> bool:
        if isinstance(x, torch.Tensor):
            if not isinstance(y, torch.Tensor) or x.shape != y.shape or x.device != y.device:
                return False
            return x.is_meta or bool(torch.equal(x, y))  # meta: no values to compare
        if isinstance(x, (tuple, list)):
            return isinstance(y, type(x)) and len(x) == len(y) and all(eq(i, j) for i, j in zip(x, y, strict=True))
        if isinstance(x, dict):
            return isinstance(y, dict) and x.keys() == y.keys() and all(eq(x[k], y[k]) for k in x)
        return x is y or x == y
    return eq(a, b)


def _refused(call: Any, model: torch.nn.Module, opt: torch.optim.Optimizer | None = None) -> dict[str, Any]:
    """``call()``'s error (its type and message; ``"none"`` when it raised nothing) and whether ``model`` and
    ``opt`` are as they were."""
    before = _snapshot(model, opt)
    try:
        call()
        kind, msg = "none", ""
    except Exception as e:  # noqa: BLE001 (recorded and asserted on by the test)
        kind, msg = type(e).__name__, str(e)
    return {"type": kind, "message": msg, "unchanged": _same(before, _snapshot(model, opt))}


def _replicated_only() -> tte.EmbeddingCollection:
    return tte.EmbeddingCollection({"clicks": tte.FeatureConfig(tte.TableConfig(20, 2, name="tiny", placement="auto"))})


def _opt_state(flag: bool, rank: int, world: int, steps: int = 2,
               ) -> tuple[W.Model, torch.optim.Optimizer, dict[str, Any]]:
    """A model sharded with ``dtensor_state_dict=flag``, trained ``steps`` steps with Adagrad, and torch's
    ``get_optimizer_state_dict`` of it."""
    model = W.Model(torch.float64)
    tte.distributed.shard(model, dtensor_state_dict=flag)
    opt = W.make_opt("adagrad", model.parameters())
    W.train(model, model, opt, torch.float64, rank, world, steps=range(steps))
    return model, opt, get_optimizer_state_dict(model, opt)


def _reshaped(osd: dict[str, Any], table: str, shape: tuple[int, ...]) -> dict[str, Any]:
    """``osd`` with each DTensor slot of ``table`` replaced by a DTensor ``Shard(0)`` of global ``shape``."""
    out = {"state": dict(osd["state"]), "param_groups": osd["param_groups"]}
    key = f"ec.tables.{table}.weight"
    entry = dict(out["state"][key])
    for k, v in entry.items():
        if isinstance(v, DTensor):
            full = torch.zeros(shape, dtype=v.dtype)
            entry[k] = DTensor.from_local(full.chunk(v.device_mesh.size())[v.device_mesh.get_local_rank()].clone(),
                                          v.device_mesh, [Shard(0)], run_check=False, shape=full.shape,
                                          stride=full.stride())
    out["state"][key] = entry
    return out


def refusals(rank: int, world: int) -> dict[str, Any]:
    """Wrong calls of tte.distributed.shard and of loading an optimizer's DTensor state: each call's error and
    whether the model (and optimizer) changed."""
    out: dict[str, Any] = {}
    fresh = W.Model(torch.float64)
    shard = tte.distributed.shard
    out["module"] = _refused(lambda: shard("my_model"), fresh)  # type: ignore[arg-type]
    out["group"] = _refused(lambda: shard(fresh, "my_group"), fresh)
    out["device_int"] = _refused(lambda: shard(fresh, device=5), fresh)  # type: ignore[arg-type]
    out["device_name"] = _refused(lambda: shard(fresh, device="gpu0"), fresh)
    out["device_meta"] = _refused(lambda: shard(fresh, device="meta"), fresh)
    out["dtensor_int"] = _refused(lambda: shard(fresh, dtensor_state_dict=1), fresh)  # type: ignore[arg-type]
    col = tte.EmbeddingCollection({
        "user": tte.FeatureConfig(tte.TableConfig(600, 4, name="users", placement="row")),
        "ad": tte.FeatureConfig(tte.TableConfig(600, 4, name="ads", placement="column")),
    })
    out["column"] = _refused(lambda: shard(col), col)
    tiny = _replicated_only()
    out["all_replicated"] = _refused(lambda: shard(tiny, dtensor_state_dict=True), tiny)
    moved = tte.EmbeddingCollection({"user": tte.FeatureConfig(tte.TableConfig(600, 4, name="users", placement="row")),
                                     "ad": tte.FeatureConfig(tte.TableConfig(600, 4, name="ads", placement="row"))},
                                    stack_tables=False)
    moved.tables["ads"].to("meta")
    out["moved_to_meta"] = _refused(lambda: shard(moved), moved)
    once = W.Model(torch.float64)
    shard(once)
    out["twice"] = _refused(lambda: shard(once, dtensor_state_dict=True), once)
    out["pickle"] = _refused(lambda: pickle.dumps(once), once)
    out["twice_dtensor"] = {t: type(once.state_dict()[f"ec.tables.{t}.weight"]).__name__ for t in W.SHARDED}
    # an optimizer's state saved by torch's helpers from a model sharded one way, loaded into one sharded the other
    m_dt, o_dt, osd_dt = _opt_state(True, rank, world)
    m_pl, o_pl, osd_pl = _opt_state(False, rank, world, steps=3)  # other values than m_dt's
    out["dtensor_into_plain"] = _refused(lambda: set_optimizer_state_dict(m_pl, o_pl, osd_dt), m_pl, o_pl)
    osd_whole = {"state": {k: {s: v.full_tensor() if isinstance(v, DTensor) else v for s, v in e.items()}
                           for k, e in osd_dt["state"].items()}, "param_groups": osd_dt["param_groups"]}
    out["whole_into_dtensor"] = _refused(lambda: set_optimizer_state_dict(m_dt, o_dt, osd_whole), m_dt, o_dt)
    # plain entries are each rank's stored rows (as a plain entry of the model's state_dict): loaded as they are
    set_optimizer_state_dict(m_dt, o_dt, osd_pl)
    dt, pl = m_dt.ec.physical_tables(), m_pl.ec.physical_tables()
    out["plain_into_dtensor"] = {t: _same([o_dt.state[dt[t].weight]], [o_pl.state[pl[t].weight]]) for t in W.SHARDED}
    m_dt, o_dt, osd_dt = _opt_state(True, rank, world)
    out["wrong_rows"] = _refused(lambda: set_optimizer_state_dict(m_dt, o_dt, _reshaped(osd_dt, "row2", (999, 4))),
                                 m_dt, o_dt)
    out["wrong_width"] = _refused(lambda: set_optimizer_state_dict(m_dt, o_dt, _reshaped(osd_dt, "tw", (600, 5))),
                                  m_dt, o_dt)
    return out


def worker(rank: int, world: int, port: int, out_dir: str, job: str) -> None:
    init_rank(rank, world, port)
    results: dict[str, Any] = {"transport": transport(rank, world), "copies": copies(rank, world),
                               "refusals": refusals(rank, world)}
    finish_rank(results, out_dir, rank)
