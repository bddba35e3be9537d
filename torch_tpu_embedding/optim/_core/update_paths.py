"""Which update path a parameter takes this step, and the paths themselves.

Every path runs the same pipeline around the optimizer's pure rule (:func:`pipeline`); they differ
only in which rows they hand it and how the results are written back:

====================  ==========================================================================
``DENSE``             every row: dense parameters, and tables of non-lazy optimizers (``g = 0``
                      where a row was not looked up; O(V·D), as TF's non-lazy Adam)
``ADDITIVE``          eager, the rule is additive (SGD) and no option needs the summed rows:
                      ``increment(g)`` (``rule(w, g) − w``) is added per looked-up id with
                      ``index_add_`` — no dedup, gather or scatter; where ``KERNEL`` would run, in
                      one C loop per piece of ids (bags spread in it), bitwise the same (:mod:`.c_add`);
                      the path itself is :mod:`.additive`
``NO_DEDUP``          ``use_gradient_accumulation=False``: every contribution updates from the same
                      old rows and the changes are added (exact for SGD, an approximation otherwise),
                      then the rows are clipped to ``clip_weight_min/max`` again (TF's last step);
                      on an eager accelerator padding adds ``-0.0`` to the sink row (``sink_padding``)
``ROWS``              duplicates summed, the touched rows in one pass: XLA (one static-shape graph),
                      the reference of rules with statistics over rows (Adafactor), and an eager
                      accelerator's reference (no host read: ``N`` rows with a sentinel tail written
                      through the sink row, ``_rows.dedup.sink_rows``)
``KERNEL``            eager: the same pipeline compiled into one kernel that
                      reads and writes each touched row and its slots once; on the CPU the duplicate
                      sum done without multiplying the gradient out (:mod:`.row_update`), on an
                      accelerator the static ids of ``ROWS`` (nothing read on the host);
                      RowWiseAdagrad and Adam on CPU float32 tables: one C loop that also sums the
                      duplicates, prefetching rows (:mod:`.c_rules`); a rule with statistics over rows
                      (Adafactor) gets every row in one call
``ROW_CHUNKS``        eager with a per-row rule when ``KERNEL`` is off, cannot compile, or its
                      policy keeps the step here (the first calls, small tables: ``policy()``): the
                      touched rows in cache-sized chunks (the reference for ``KERNEL``)
``OWNER_LOCAL``       a row-sharded table trained through the id exchange: its gradient arrives
                      at the shards that own the rows, and every shard runs ``ROWS`` (``DENSE``
                      for a non-lazy optimizer) on its own rows and slots in a manual-sharding
                      region, with no collective; what the rule sums over rows is all-reduced
                      (``RowContext.all_reduce``)
====================  ==========================================================================

:func:`choose_path` is the one place that decides (:class:`~.rule_pipeline.Path` names the paths).
Every path reads and writes through a :class:`~.slots.RowSpace` (a whole parameter, or one shard of
a table), so the row bookkeeping is written once.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from torch_tpu_embedding._rows.dedup import (
    is_static_device,
    sink_padding,
    sink_rows,
    sinks_sentinel,
    sync_free,
    unique_ids,
)
from torch_tpu_embedding._rows.placement import process_group_placement
from torch_tpu_embedding._rows.tables import table_info
from torch_tpu_embedding._util.dtypes import math_dtype
from torch_tpu_embedding._util.registry import rule_of
from torch_tpu_embedding.optim._core.contract import RowContext
from torch_tpu_embedding.optim._core.ema import ema_rows
from torch_tpu_embedding.optim._core.rule_pipeline import Path, gated, pipeline
from torch_tpu_embedding.optim._core.slots import RowSpace, rule_slots
from torch_tpu_embedding.optim._core.stacked_members import member_rows, segment_of
from torch_tpu_embedding.optim._kernels import c_rules, kernel_policy, row_update
from torch_tpu_embedding.optim._kernels.additive import update_additive

if TYPE_CHECKING:
    from torch_tpu_embedding.optim._core.grad_intake import Work

__all__ = ["ROW_CHUNK", "ROW_CHUNK_PARALLEL", "Path", "choose_path", "update"]

Tensor = torch.Tensor

#: Eager row updates run in chunks of this many rows, and of ``ROW_CHUNK_PARALLEL`` rows with more
#: than one torch thread: each element-wise op then wakes the thread pool, which costs too much on
#: chunks this small (measured on 2 cores with ``OMP_WAIT_POLICY=PASSIVE``, LazyAdam at 4 × 81,920
#: rows × 64: 1 thread 256 ms at 2,048 rows vs 322 ms at 16,384; 2 threads 436–499 ms at 2,048 vs
#: 217–256 ms at 16,384).
ROW_CHUNK = 2048
ROW_CHUNK_PARALLEL = 16384

#: Options that need a row's gradient summed over the batch (or its rows), so no ADDITIVE step.
_NEEDS_SUMMED_ROWS = ("clipvalue", "weight_decay_factor", "clip_weight_min", "clip_weight_max", "use_ema",
                      "clipnorm", "global_clipnorm", "skip_nonfinite")


def choose_path(p: Tensor, group: Mapping[str, Any], *, row_grad: bool) -> Path:
    """The path of parameter ``p`` in ``group``; ``row_grad``: its gradient arrives as rows (a table,
    or a sparse COO ``.grad``) rather than as a dense ``.grad``."""
    cls = rule_of(group)
    info = table_info(p)
    summed_rows = any(group.get(k) not in (None, False, 0) for k in _NEEDS_SUMMED_ROWS)
    if row_grad and info is not None and info.owner_local:
        if not group["use_gradient_accumulation"] and not (cls.additive and not summed_rows):
            raise ValueError(
                f"The {info.described()} is row-sharded over the mesh through the id exchange (tte.xla.shard), where "
                "each device's duplicate ids are summed before they travel to the row's owner, so "
                "`use_gradient_accumulation=False` (every duplicate updating from the same old row) cannot be applied "
                "as one device would. Use use_gradient_accumulation=True (the default) for it. Received: "
                "use_gradient_accumulation=False"
            )
        return Path.OWNER_LOCAL
    if not row_grad or not cls.is_lazy(group):
        return Path.DENSE
    if info is None and _whole_slots(p, group):
        # A sparse COO .grad of a plain parameter (nn.Embedding(sparse=True)) under a rule with statistics
        # over all its rows (Adafactor): densified, as Keras densifies IndexedSlices, so it trains as on a
        # dense .grad. Only a table keeps the bookkeeping (Adafactor's r_sum) a lazy update of them needs.
        return Path.DENSE
    if cls.additive and not is_static_device(p.device) and not summed_rows:
        # Not KERNEL, even where it runs: adding each looked-up id's increment reads and writes each row once,
        # as the kernel's gather and scatter do, without their sort and sum (measured slower on KERNEL at
        # 1 and 20 ids per bag, docs/benchmarks.md); where KERNEL would run, the add is one C loop (c_add).
        return Path.ADDITIVE
    if not group["use_gradient_accumulation"]:
        return Path.NO_DEDUP
    if is_static_device(p.device):
        return Path.ROWS
    whole = _whole_slots(p, group)  # statistics over every touched row (Adafactor): one pass
    if kernel_policy.usable(p) and _compiles(p, group, whole):
        return Path.KERNEL  # (on an accelerator its kernel takes the static ids of ROWS: row_update.update)
    return Path.ROWS if whole or sync_free(p.device) else Path.ROW_CHUNKS


def _compiles(p: Tensor, group: Mapping[str, Any], whole: bool) -> bool:
    """Whether ``p``'s update may take the compiled kernel (where one runs: :func:`.kernel_policy.usable`).

    Not where the rule rounds a value to 16 bits and reads it again, as the reference path does: inductor keeps such
    a round trip in float32 (and its ``emulate_precision_casts`` fails to build on the CPU, torch 2.9). That is a
    16-bit table's stored weight, which the moving average reads (``use_ema``), and a 16-bit statistic
    (Adafactor's ``row_stat_dtype``). Nor a rule with statistics over rows on a table split over a process group:
    what it sums over rows is also summed over the ranks (``RowSpace.all_reduce``)."""
    if group["use_ema"] and math_dtype(p) != p.dtype:
        return False
    if not whole:
        return True
    specs = rule_of(group).slot_specs(tuple(p.shape), group, True).values()
    return process_group_placement(p) is None and all(spec.dtype in (None, math_dtype(p)) for spec in specs)


def row_chunk() -> int:
    if torch.compiler.is_compiling():  # (dynamo cannot trace torch.get_num_threads(); the size is moot there)
        return ROW_CHUNK
    return ROW_CHUNK if torch.get_num_threads() == 1 else ROW_CHUNK_PARALLEL


def update(item: Work) -> None:
    """Apply ``item``'s update along its path (EMA of touched rows included; see ``_core.ema``)."""
    if item.path is Path.OWNER_LOCAL:
        _update_owner_local(item)
        return
    if item.path is Path.ADDITIVE:  # (adds to the rows in place: no RowSpace)
        update_additive(item)
        return
    space = RowSpace.of(item.p, item.group, item.state)
    if item.path is Path.DENSE:
        _update_dense(item, space, item.g)
    else:
        ids = item.ids
        assert ids is not None
        # RowWiseAdagrad and Adam: one fused C loop (c_rules); other rules, or options it does not cover, the compiled
        # kernel of the rule (row_update).
        if item.path is Path.KERNEL and (c_rules.update(item) or row_update.update(item)):
            return
        whole = _whole_slots(item.p, item.group)  # (once per update, not on the kernel's: the chunks below share it)
        if item.path is Path.KERNEL:
            # No compiled kernel: the reference path (an accelerator's keeps its static shapes; statistics over rows
            # take every row at once)
            item.path = Path.ROWS if sync_free(item.p.device) or whole else Path.ROW_CHUNKS
        chunk = row_chunk()
        # Under torch.compile the count of touched rows is a symbol with no value to compare (and the
        # compiled code fuses the rule's passes anyway): one pass.
        if item.path is not Path.ROW_CHUNKS or torch.compiler.is_compiling() or ids.shape[0] <= chunk:
            _update_rows(item, space, ids, item.g, whole)
            return
        # Cache-sized chunks: the rule's ~10 element-wise passes run over temporaries that stay in
        # cache instead of over [U, D] arrays (Adam's rule ran 3.2× faster at 100k rows × 64).
        for start in range(0, ids.shape[0], chunk):
            _update_rows(item, space, ids[start : start + chunk], item.g[start : start + chunk], whole)


def _update_dense(item: Work, space: RowSpace, g: Tensor) -> None:
    """Every row of ``space`` (``g = 0`` where a table's row was not looked up)."""
    p, group, state, gate = space.p, item.group, space.state, item.gate
    names = rule_slots(item.p, group)
    slots = {k: space.table_order(k) for k in names}  # a table's row slots without their trash rows
    ctx = RowContext(mask=None, count=None, num_rows=space.num_rows, all_reduce=space.all_reduce)
    step = state["step"] + 1
    w0 = p.to(math_dtype(p))
    w, new = pipeline(w0, g, slots, item.lr, step, group, ctx)
    info = table_info(p)
    frozen = None if info is None else info.frozen_rows  # frozen members of a stacked group keep their rows
    if frozen is not None and frozen.shape[0] == p.shape[0]:
        w = torch.where(frozen[:, None], w0, w)
        new = {k: torch.where(frozen.view(-1, *[1] * (v.dim() - 1)), slots[k].to(v.dtype), v)
               if v.dim() and v.shape[0] == p.shape[0] else v for k, v in new.items()}
    for k in names:
        value = gated(gate, new[k].to(slots[k].dtype), slots[k])
        if k in space.where.numbers:
            space.write(k, value)
        else:
            _write(state[k], value)
    _write(state["step"], gated(gate, step, state["step"]))
    _write(p, gated(gate, w, w0))


def _update_rows(item: Work, space: RowSpace, ids: Tensor, g: Tensor, whole: bool, seg: Tensor | None = None) -> None:
    """Gather the rows ``ids`` of ``space`` (and their slots), run the pipeline, write them back.

    ``whole``: the rule keeps whole-table slots (:func:`_whole_slots`, asked once per update, not per chunk).
    ``seg``: the member table of each row in a stacked group whose rule keeps them (found from ``ids`` when not
    given; the owner-local path computes it outside its manual region)."""
    p, group, state, gate, where = space.p, item.group, space.state, item.gate, space.where
    sentinel = p.shape[0]
    dedup = bool(group["use_gradient_accumulation"])  # else ids repeat (NO_DEDUP): changes are added
    # On XLA the sentinel tail is clamped for the gather and dropped by the scatter.
    at = ids.clamp(max=sentinel - 1)
    w0 = p.index_select(0, at).to(math_dtype(p))  # 16-bit tables update in float32
    names = rule_slots(item.p, group)
    slots = {k: space.gather(k, ids) if k in where.numbers else state[k] for k in names}
    rows_of = member_rows(item.p) if whole else ()
    if rows_of and seg is None:  # a stacked group: statistics over rows stay per member table
        seg = segment_of(item.p, ids)
    ctx = RowContext.touched(ids < sentinel, space.num_rows, space.all_reduce, seg if rows_of else None, rows_of)
    ema = group["use_ema"]
    lo, hi = group.get("clip_weight_min"), group.get("clip_weight_max")
    clip_sum = not dedup and (lo is not None or hi is not None)  # the added changes may overshoot the bounds
    once = unique_ids(ids, sentinel) if (ema or clip_sum) and not dedup else ids  # ids repeat: each row once
    # (the moving average's rows before the update; the clip alone reads only the rows after it)
    once_w0 = p.index_select(0, once.clamp(max=sentinel - 1)).to(w0.dtype) if ema and not dedup else w0
    step = item.step_now if item.step_now is not None else state["step"] + 1
    w, new = pipeline(w0, g, slots, item.lr, step, group, ctx)
    w = gated(gate, w, w0)
    new = {k: gated(gate, new[k].to(slots[k].dtype), slots[k]) for k in names}
    if item.step_now is None:  # the first chunk counts the step; later chunks use the same count
        item.step_now = step
        _write(state["step"], gated(gate, step, state["step"]))
    # An eager accelerator keeps the sentinel tail (no read of how many rows are real) and has no scatter that
    # drops it, as XLA's does: the tail is written into the last row with the value that row gets anyway.
    sink = sinks_sentinel(p.device)

    def copy_rows(dst: Tensor, name: str | None, value: Tensor, old: Tensor) -> None:
        at, value = sink_rows(ids, value, old, sentinel) if sink else (ids, value)
        dst.index_copy_(0, at if name is None else where.at(name, at), value)

    def add_rows(dst: Tensor, name: str | None, delta: Tensor) -> None:
        at, delta = sink_padding(ids, delta, sentinel) if sink else (ids, delta)
        dst.index_add_(0, at if name is None else where.at(name, at), delta)

    for k in names:
        if k not in where.numbers:
            _write(state[k], new[k])
        elif dedup:  # ids are unique: write the rows
            copy_rows(state[k], k, new[k], slots[k])
        else:  # ids repeat: add the changes
            add_rows(state[k], k, new[k] - slots[k])
    if dedup:
        copy_rows(p, None, w.to(p.dtype), w0.to(p.dtype))
    else:
        add_rows(p, None, (w - w0).to(p.dtype))
        if clip_sum:
            # Each contribution's update ends clipped, but their changes added may leave [min, max]: the clip is the
            # last step of TF's update, so the summed rows are clipped once more (each distinct row once).
            now = p.index_select(0, once.clamp(max=sentinel - 1))
            clipped = gated(gate, now.clamp(min=lo, max=hi), now)
            at, clipped = sink_rows(once, clipped, now, sentinel) if sink else (once, clipped)
            p.index_copy_(0, at, clipped)
    if ema:
        if dedup:
            ema_rows(item, space, ids, w0, w.to(p.dtype).to(w0.dtype))  # the stored weight
        else:
            ema_rows(item, space, once, once_w0, p.index_select(0, once.clamp(max=sentinel - 1)).to(w0.dtype))


def _write(dst: Tensor, value: Tensor) -> None:
    """``dst.copy_(value)``. Under ``torch.compile`` a 0-d ``dst`` is written through a 1-element view:
    torch (2.9 to 2.13) silently drops an in-place write to a 0-d float64 or integer CPU graph input (its
    fake tensor memoises ``.item()`` as a symbol, which the ``tensorify_python_scalars`` pass then
    specialises), but not one to a view of it (Adafactor's ``r_sum``; tests/optim/test_optim_compile.py)."""
    if dst.dim() == 0 and torch.compiler.is_compiling():
        dst, value = dst.view(1), value.reshape(1)
    dst.copy_(value)


def _whole_slots(p: Tensor, group: Mapping[str, Any]) -> bool:
    """Whether the rule of ``p``'s group keeps whole-table slots (statistics over a table's rows)."""
    specs = rule_of(group).slot_specs(tuple(p.shape), group, True)
    return any(not spec.rows for spec in specs.values())


def _update_owner_local(item: Work) -> None:
    """OWNER_LOCAL: every shard updates its own rows and slots — the same :func:`_update_rows` (or
    :func:`_update_dense`) on its part of the table — in one manual-sharding region, with no collective
    beyond the small all-reduces of ``RowContext.all_reduce``.

    ``item.ids [n, M]`` (shard-local rows, unique per shard, sentinel ``R/n``) and ``item.g [n, M, D]``
    are device-major: row ``d`` belongs to shard ``d`` (:mod:`~torch_tpu_embedding.optim._core.grad_intake`).
    """
    info = table_info(item.p)
    assert info is not None and info.sharding is not None and item.ids is not None
    sharding = info.sharding
    whole = RowSpace.of(item.p, item.group, item.state)
    rows = {"": item.p, **{k: v for k, v in item.state.items() if k in whole.where.numbers}}
    small = {k: v for k, v in item.state.items() if k not in rows and k not in ("acc_ids", "acc_rows")}
    clock = item.clock.device_values(item.p.device)
    lazy = rule_of(item.group).is_lazy(item.group)

    whole_slots = _whole_slots(item.p, item.group)
    seg = segment_of(item.p, item.ids, owned=True) if lazy and whole_slots else None

    def on_shard(rows: dict[str, Tensor], small: dict[str, Tensor], inputs: list[Tensor],
                 rep: list[Tensor | None]) -> list[Tensor]:
        ids, g, *segs = inputs
        lr, gate, *clock_now = rep
        assert lr is not None
        space = dataclasses.replace(whole, p=rows[""], state={**rows, **small},
                                    all_reduce=sharding.all_reduce)
        mine = dataclasses.replace(item, lr=lr, gate=gate, clock=item.clock.with_device_values(clock_now))
        if lazy:
            _update_rows(mine, space, ids, g, whole_slots, segs[0] if segs else None)
        else:  # every local row, g = 0 where not looked up (the sentinel's rows are dropped)
            _update_dense(mine, space, torch.zeros_like(space.p, dtype=g.dtype).index_add_(0, ids, g))
        return []

    inputs = [item.ids, item.g] if seg is None else [item.ids, item.g, seg]
    sharding.on_shards(on_shard, rows, small, inputs, [item.lr, item.gate, *clock])
