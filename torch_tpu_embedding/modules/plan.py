"""The lookups of one forward call: every feature's input normalised and grouped into the batches looked up
together (``EmbeddingCollection.forward``)."""

from __future__ import annotations

import dataclasses
import operator
import weakref
from collections.abc import Callable
from typing import Any

import torch

from torch_tpu_embedding._rows.backward_order import check_xla_backward
from torch_tpu_embedding._rows.tables import table_info
from torch_tpu_embedding._util.input_checks import tracing
from torch_tpu_embedding._util.nest import Path, pick
from torch_tpu_embedding._util.validation import check_not_meta
from torch_tpu_embedding.inputs import Padded, to_bags
from torch_tpu_embedding.modules.assembly import AssembledBatch, signature
from torch_tpu_embedding.modules.lookup_batch import LookupBatch
from torch_tpu_embedding.modules.prepared import NotAhead

__all__ = ["plan_lookups"]


def _input_device(value: Any) -> str:
    """The device type of a feature's ids (``"cpu"`` for anything else)."""
    ids = value if isinstance(value, torch.Tensor) else getattr(value, "ids", getattr(value, "values", None))
    return ids.device.type if isinstance(ids, torch.Tensor) else "cpu"


def _device_resident(value: Any) -> bool:
    """True when a feature's ids arrived already on an XLA device (not readable without a sync)."""
    return _input_device(value) == "xla"


@dataclasses.dataclass
class _Plan:
    """The assembled batches of a call in which every feature was assembled, kept to be replayed while later
    calls give inputs of the same signatures (:func:`_replay`): the grouping is then not redone feature by
    feature, only each feature's form, ids dtype and mask read (a cached plan, as issue [host] allows).

    Tables and weights are held weakly: a plan never keeps a replaced table's memory alive (nor a stacked group's
    that ``unstack`` or ``restack`` dissolved before the next call)."""

    features: list[Any]  # the collection's feature list it was made for
    #: per table name: a reference to the module holding its rows, its first row there (``ec._located``)
    located: dict[str, tuple[Any, int]]
    tables: list[tuple[str, Any, Any, torch.device, int]]  # (a name, table ref, weight ref, device, rows)
    #: per batch: its table's index in ``tables``, a batch of the call it was made in (its weight and
    #: row_grad replaced at each replay) and a getter of its features' inputs
    batches: list[tuple[int, dict[str, Any], Any]]


#: per collection, the plan of its last call (none while its inputs take another path)
_PLANS: weakref.WeakKeyDictionary[Any, _Plan] = weakref.WeakKeyDictionary()


def _getter(paths: list[Path]) -> Any:
    """``features -> [input per path]`` (one C call for a flat structure)."""
    if all(len(p) == 1 for p in paths):
        get = operator.itemgetter(*[p[0] for p in paths])
        return (lambda f: [get(f)]) if len(paths) == 1 else (lambda f: list(get(f)))
    return lambda f: [pick(f, p) for p in paths]


def _keep(ec: Any, assembled: list[AssembledBatch], tables: dict[int, tuple[str, Any, torch.Tensor]],
          rows_of: Callable[[torch.Tensor], int]) -> None:
    """Keep this call's plan for the next (only where every feature was assembled, without separate weights)."""
    _PLANS.pop(ec, None)
    if sum(len(b.items) for b in assembled) != len(ec._features) or any(b.sig[6] is not None for b in assembled):
        return
    index = {id(w): i for i, (_, _, w) in enumerate(tables.values())}
    static = ("combiner", "resident", "sig", "sentinel", "items", "tables", "members", "_columns")
    _PLANS[ec] = _Plan(ec._features, {n: (weakref.ref(t), o) for n, (t, o) in ec._located.items()},
                       [(n, weakref.ref(t), weakref.ref(w), w.device, rows_of(w)) for n, t, w in tables.values()],
                       [(index[id(b.weight)], {k: getattr(b, k) for k in static}, _getter([p for p, _ in b.items]))
                        for b in assembled])


def _same_forms(batch: AssembledBatch, values: list[Any]) -> bool:
    """Each feature's input of the form, ids dtype and mask presence of ``batch``'s signature (what
    :meth:`AssembledBatch.fits` cannot see once stacked)."""
    form, _, _, dtype, _, masked, _ = batch.sig
    if form != "padded":
        return all(type(v) is torch.Tensor and v.dtype == dtype for v in values)
    tensor = torch.Tensor
    for v in values:
        if type(v) is not Padded or v.weights is not None:
            return False
        ids, mask = v.ids, v.mask
        if type(ids) is not tensor or ids.dtype != dtype:
            return False
        if (type(mask) is not tensor) if masked else (mask is not None):
            return False
    return True


def _replay(ec: Any, plan: _Plan, features: Any, rows_of: Callable[[torch.Tensor], int],
            ahead: bool) -> list[AssembledBatch] | None:
    """The batches of ``plan`` for ``features``, or ``None`` when they are not what it was made for (the
    caller then plans afresh, and raises where an input is wrong)."""
    located = ec._located
    if ec._features is not plan.features or located.keys() != plan.located.keys() or any(
            located[n][0] is not ref() or located[n][1] != o for n, (ref, o) in plan.located.items()):
        return None
    live = []
    for tname, table_ref, weight_ref, device, rows in plan.tables:  # the per-table facts plan_lookups reads
        table, weight = table_ref(), weight_ref()
        if table is None or weight is None or table.weight is not weight or weight.device != device \
                or rows_of(weight) != rows or table.row_layout is not None:
            return None
        if device.type == "xla" and weight.requires_grad and torch.is_grad_enabled():
            check_xla_backward(tname)
        live.append((table, weight))
    batches = []
    for at, static, get in plan.batches:
        values = get(features)
        batch = AssembledBatch(live[at][1], live[at][0].row_grad, _values=values, _wvalues=[None] * len(values),
                               **static)
        if not _same_forms(batch, values):
            return None
        batches.append(batch)
    try:  # sizes, devices and layouts: checked on the stacked tensors (stack refuses unequal sizes or devices;
        joined = [b.join() for b in batches]  # ids of rank 0 an IndexError)
    except (RuntimeError, TypeError, ValueError, IndexError):
        return None
    if not all(b.fits(j) for b, j in zip(batches, joined, strict=True)):
        return None
    for b, j in zip(batches, joined, strict=True):
        b.assemble(j, ahead)
    return batches


def plan_lookups(ec: Any, features: Any, weights: Any, ahead: bool = False) -> list[Any]:
    """Every feature of ``ec`` (an ``EmbeddingCollection``) normalised to padded bags, grouped into the batches
    looked up together; each batch's ids checked before any is looked up.

    Features of the same physical table with the same bag width and combiner are looked up
    together: one gather and one backward node per batch, not per feature. ``Padded`` and dense ids are
    assembled per batch (:class:`~torch_tpu_embedding.modules.assembly.AssembledBatch`: the batch's ops and
    host reads do not grow with its features); other forms are normalised feature by feature. Host inputs for a
    device table are normalised and batched on the host and moved in one transfer per batch
    (TorchRec's KJT and TBE do the same). The batches of a table trained through the id exchange
    (row-sharded under SPMD) are routed together: one routed lookup per table, made by the table's
    placement (``TablePlacement.routed_lookup``, ``torch_tpu_embedding/_rows/placement.py``), which the
    backend that laid the table out recorded on it. Routed lookups that have a ``together`` (the process group's)
    are handed to it, all at once: it returns the lookups to run, those of one group joined into one.

    A call whose features were all assembled is kept (:class:`_Plan`) and replayed by the next call whose
    inputs have the same signatures, with no per-feature grouping; anything else plans afresh.

    ``ahead`` (``EmbeddingCollection.prepare`` off the main thread): no op on a device, host tensors moved
    there only (:mod:`~torch_tpu_embedding.modules.prepared`; XLA's stay on the host, moved by the lookup), table
    sizes as ``know_rows`` recorded them; ids already on an XLA device raise
    :class:`~torch_tpu_embedding.modules.prepared.NotAhead`.
    """
    rows_known = ec.__dict__.get("_rows_known") or {}  # (AheadLookups.know_rows: no XLA tensor read off its thread)

    def rows_of(weight: torch.Tensor) -> int:
        ref, rows = rows_known.get(id(weight), (None, None))
        return int(weight.shape[0]) if ref is None or ref() is not weight else int(rows)

    plan = None if weights is not None or tracing() else _PLANS.get(ec)
    if plan is not None:
        replayed = _replay(ec, plan, features, rows_of, ahead)
        if replayed is not None:
            return replayed
    batches: dict[tuple[Any, ...], Any] = {}
    routed: dict[int, Any] = {}
    host = torch.device("cpu")
    local: dict[int, Any] = {}  # per physical table: its layout when trained through the id exchange
    assembled: list[AssembledBatch] = []
    # per physical table: (its weight, its weight's device; None: not assembled (routed or laid out permuted))
    fast: dict[int, tuple[torch.Tensor, torch.device] | None] = {}
    seen: dict[int, tuple[str, Any, torch.Tensor]] = {}  # per physical table: a name of it, it, its weight
    for path, fname, fc, tname in ec._features:
        table, offset = ec._located[tname]
        value = features[path[0]] if len(path) == 1 else pick(features, path)  # (every feature, every step)
        if id(table) not in local:
            weight = table.weight
            if weight.device.type == "xla" and weight.requires_grad and torch.is_grad_enabled():
                check_xla_backward(tname)
            check_not_meta(tname, fname, weight, _input_device(value))
            info = table_info(weight)
            local[id(table)] = info.sharding if info is not None and info.routed else None
            fast[id(table)] = None if local[id(table)] is not None or table.row_layout is not None else (
                weight, weight.device)
            seen[id(table)] = (tname, table, weight)
        wvalue = None if weights is None else pick(weights, path)
        # Padded and dense ids of a table or a stacked group: looked up as one (modules/assembly.py)
        known = fast[id(table)]
        sig = None if known is None else signature(value, wvalue, fc, known[1])
        if sig is not None:
            combiner = fc.table.combiner if sig[0] == "padded" else "sum"
            key = (id(table), combiner, sig)
            batch = batches.get(key)
            if batch is None:
                weight = known[0]  # type: ignore[index]
                resident = weight.device.type == "cpu" or sig[4].type != "cpu"
                batch = batches[key] = AssembledBatch(weight, table.row_grad, combiner, resident, sig,
                                                      rows_of(weight))
                assembled.append(batch)
            batch.add(path, fname, fc, tname, value, wvalue, offset)
            continue
        weight = table.weight
        owner_local = local[id(table)] is not None
        # A table sharded over a process group stores only its shard: padding is its layout's id.
        layout = local[id(table)]
        sentinel = int(layout.id_rows) if hasattr(layout, "id_rows") else rows_of(weight)
        on_device = _device_resident(value)
        if on_device and ahead:
            raise NotAhead(f"feature `{fname}`: its ids are on an XLA device (screened there, graph nodes)")
        resident = weight.device.type == "cpu" or _input_device(value) != "cpu"
        bags = to_bags(
            fname,
            fc,
            value,
            wvalue,
            sentinel=sentinel,
            device=weight.device if resident else host,
            dtype=weight.dtype,
            # a routed lookup (the id exchange: SPMD or a process group) buckets padded bags
            static=weight.device.type == "xla" or owner_local,
            offset=0 if on_device else offset,  # a stacked table's rows start at `offset` of its group
            table=tname,
        )
        if on_device:  # host inputs were checked in to_bags; these are screened before the offset
            ids, valid = ec._screen_device_ids(
                fname, fc.table.num_embeddings, bags.ids, bags.valid, weight.shape[0], bags.weights
            )
            if offset:  # padding stays the sentinel
                ids = torch.where(valid, ids + offset, ids)
            bags = dataclasses.replace(bags, ids=ids, valid=valid, full=False)  # (dropped ids: padding)
        if table.row_layout is not None and not owner_local:  # stored permuted: look up the stored row
            order = table.row_layout.ownership(rows_of(weight))
            bags = dataclasses.replace(bags, ids=order.physical_row(bags.ids.to(torch.int64)))
        combiner = fc.table.combiner if bags.combine else "sum"
        bkey = (id(table), bags.ids.shape[1] if bags.offsets is None else -1, combiner, resident)  # -1: jagged
        if bkey not in batches:
            batches[bkey] = LookupBatch(weight, table.row_grad, combiner, resident)
            if owner_local:
                if id(table) not in routed:
                    names = [f for _, f, _, t in ec._features if ec._located[t][0] is table]
                    routed[id(table)] = local[id(table)].routed_lookup(
                        table.name, weight, table.config.max_unique_ids_per_shard, names, ec._exchange_counts)
                routed[id(table)].batches.append(batches[bkey])
        batches[bkey].items.append((path, bags))
        batches[bkey].tables.add(tname)
    for batch in assembled:  # every group checked before anything is looked up
        batch.assemble(ahead=ahead)
    if not tracing():
        _keep(ec, assembled, seen, rows_of)
    taken = {id(b) for r in routed.values() for b in r.batches}
    plain = [b for b in batches.values() if id(b) not in taken]
    if ahead:  # host bags moved now (a routed lookup moves its own ids, in its exchange)
        for b in plain:
            if isinstance(b, LookupBatch) and not b.resident and b.weight.device.type != "xla":
                b.move_ahead()  # (XLA: moved by its lookup, on the thread that syncs; see modules/ahead.py)
    lookups = list(routed.values())
    # A backend whose lookups run best together (one agreement and one exchange for every table of a process
    # group: distributed/routed.py) joins them here; the others' lookups have no `together`.
    together = next((r.together for r in lookups if hasattr(r, "together")), None)
    return plain + (lookups if together is None else together(lookups))
