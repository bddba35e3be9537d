"""Gradient intake: a parameter's gradient of this call, ready for its update path.

In Keras's order: loss scale ``g ← g / s`` → gradient accumulation over ``k`` calls → duplicate ids
summed (tables) → ``clipnorm``. ``global_clipnorm`` and ``skip_nonfinite`` look at every gradient
of the call at once (:func:`.step_gates.call_gates`).

Where a table's gradient comes from: its :class:`~torch_tpu_embedding._rows.row_grad.RowGrad` (the lookup's
backward), or a sparse COO ``.grad`` (``nn.Embedding(sparse=True)``); a dense parameter's from
``.grad``. Nothing is consumed by :func:`has_gradient`; :func:`take` consumes.

A table on the ``OWNER_LOCAL`` path (the id exchange) receives its gradient at the shards that own the
rows: ``(ids [n, M], rows [n, M, D])`` device-major. Accumulation buffers are kept per shard and
duplicates are summed on each shard (:func:`_prepare_owned`, one manual-sharding region); the result
stays device-major, so ``clipnorm``, ``global_clipnorm`` and ``skip_nonfinite`` reduce over every
shard as they reduce over any sharded tensor (the partitioner adds the small all-reduce).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from torch_tpu_embedding._rows.dedup import (
    coalesce_rows,
    dedup_static,
    drop_sentinel,
    is_static_device,
    sink_padding,
    sinks_sentinel,
    sync_free,
)
from torch_tpu_embedding._rows.placement import (
    TablePlacement,
    device_backend,
    process_group_placement,
    reduction_group,
)
from torch_tpu_embedding._rows.row_grad import RowGrad
from torch_tpu_embedding._rows.tables import table_info
from torch_tpu_embedding._util.dtypes import math_dtype
from torch_tpu_embedding.optim._core.extras import clip_by_norm
from torch_tpu_embedding.optim._core.rule_pipeline import Path
from torch_tpu_embedding.optim._core.stacked_members import clip_members, member_rows, segment_of
from torch_tpu_embedding.optim._core.step_values import StepClock
from torch_tpu_embedding.optim._kernels import triton_rows
from torch_tpu_embedding.optim._kernels.c_rules import grouped_ids, sorted_keys
from torch_tpu_embedding.optim._kernels.row_sums import RowSums, row_sums

__all__ = ["Taken", "Work", "arrives_as_rows", "has_gradient", "prepare", "take"]

Tensor = torch.Tensor


@dataclasses.dataclass
class Taken:
    """A parameter's raw gradient of this call: row pieces, ``(ids, rows)``, or a dense tensor."""

    pieces: RowGrad | None = None  # ADDITIVE, straight from the lookup (multiplied out piecewise)
    ids: Tensor | None = None  # [N] with duplicates and sentinel padding (OWNER_LOCAL: [n, M] shard-local)
    rows: Tensor | None = None  # [N, D] (OWNER_LOCAL: [n, M, D])
    dense: Tensor | None = None  # a dense parameter's .grad
    ok: Tensor | None = None  # OWNER_LOCAL: False when the lookup dropped ids (bucket overflow)


@dataclasses.dataclass
class Work:
    """One parameter's prepared gradient for this call."""

    p: Tensor
    group: dict[str, Any]
    state: dict[str, Tensor]
    path: Path
    clock: StepClock
    ids: Tensor | None  # unique touched rows (tables); None: dense update of the whole tensor
    g: Tensor  # [U, D] rows or the full gradient
    gate: Tensor | None  # XLA accumulation: update kept only where True (one graph for all calls)
    lr: Tensor = dataclasses.field(default_factory=lambda: torch.zeros(()))
    step_now: Tensor | None = None  # this call's step count, once the first row chunk has set it
    pieces: RowGrad | None = None  # ADDITIVE: the row gradient, added per id piece by piece
    divisor: float | None = None  # loss_scale_factor, applied to the pieces
    #: KERNEL: the factored gradient sorted by id, summed a range of rows at a time by the update
    #: (``g`` is then empty; :func:`.row_update.update` makes it for the reference path)
    sums: RowSums | None = None
    #: ``clipnorm`` of a table whose rows are split over a process group: this rank's ``Σ g²``, summed over the group
    #: and applied by :func:`.step_gates.call_gates` (``g`` is then not yet clipped)
    norm_part: Tensor | None = None


def arrives_as_rows(p: Tensor) -> bool:
    """``p``'s gradient comes as rows: a table's, or a sparse COO ``.grad``."""
    return table_info(p) is not None or bool(p.grad is not None and p.grad.is_sparse)


def has_gradient(p: Tensor, group: dict[str, Any], state: dict[str, Tensor] | None) -> bool:
    """Whether ``p`` has something to apply this call (a gradient, or a pending accumulation)."""
    info = table_info(p)
    if info is not None and info.row_grad:
        return True
    if p.grad is not None and (p.grad.is_sparse or info is None):
        return True
    return bool(group["gradient_accumulation_steps"]) and "acc_ids" in (state or {})


def take(p: Tensor, group: dict[str, Any], path: Path) -> Taken:
    """Consume ``p``'s gradient (the table's pending rows are cleared; ``.grad`` is left to zero_grad)."""
    info = table_info(p)
    # ADDITIVE multiplies the factored rows out piecewise; KERNEL sums them per id without doing so,
    # except on a 16-bit table: its backward multiplies float32 gains out and rounds the rows to 16
    # bits, and the factored form (16-bit gains) would round differently from the reference path.
    # (An accelerator's KERNEL takes the static duplicate sum: the factored one's sort reads sizes on the host; on
    # CUDA with Triton the static sum itself takes the factored rows, :func:`_summed_on_device`.)
    factored = path is Path.ADDITIVE or (path is Path.KERNEL and math_dtype(p) == p.dtype
                                         and (not sync_free(p.device) or _sums_factored(p, group)))
    piecewise = factored and not group["gradient_accumulation_steps"]
    if info is not None:
        # The next backward hands over its rows factored only to a consumer that multiplies them out
        # piecewise (ADDITIVE without accumulation).
        info.row_grad.keep_factored = piecewise
    if info is not None and info.row_grad:
        if piecewise:
            return Taken(pieces=info.row_grad.take())
        if path is Path.OWNER_LOCAL:
            ids, rows, ok = info.row_grad.collect_owned()
            info.row_grad.clear()
            return Taken(ids=ids, rows=rows, ok=ok)
        ids, rows = info.row_grad.collect()
        info.row_grad.clear()
        return Taken(ids=ids, rows=rows)
    if p.grad is not None and p.grad.is_sparse:
        if p.dim() != 2:
            raise ValueError(
                "Sparse gradients are supported for 2-D (embedding) parameters only. "
                f"Received a sparse gradient for a parameter of shape {tuple(p.shape)}."
            )
        coalesced = p.grad.coalesce()
        return Taken(ids=coalesced.indices()[0], rows=coalesced.values())
    if p.grad is not None and info is None:
        return Taken(dense=p.grad)
    return Taken()


def prepare(
    p: Tensor, group: dict[str, Any], state: dict[str, Tensor], taken: Taken, path: Path, clock: StepClock
) -> Work | None:
    """``p``'s gradient this call after loss scaling, accumulation, dedup and clipnorm; ``None`` on an
    eager call that only accumulates."""
    k = group["gradient_accumulation_steps"]
    s = group["loss_scale_factor"]
    gate: Tensor | None = None
    ids: Tensor | None = None

    def work(ids: Tensor | None, g: Tensor, gate: Tensor | None, **more: Any) -> Work:
        item = Work(p=p, group=group, state=state, path=path, clock=clock, ids=ids, g=g, gate=gate, **more)
        if group["clipnorm"] and reduction_group(p) is not None:  # (_clip left g as it is)
            item.norm_part = (g * g).sum()
        return item

    if path is Path.NO_DEDUP and process_group_placement(p) is not None:
        info = table_info(p)
        raise ValueError(
            f"Table `{info.name if info else '?'}` is sharded over a process group (tte.distributed.shard), where "
            "each rank's duplicate ids are summed before they travel to the row's owner, so "
            "`use_gradient_accumulation=False` (every duplicate updating from the same old row) cannot be "
            "applied as one process would. Use use_gradient_accumulation=True (the default) for this table. "
            "Received: use_gradient_accumulation=False"
        )
    if path is Path.OWNER_LOCAL:
        ids, g, gate = _prepare_owned(p, group, state, taken, clock)
        if group["clipnorm"]:
            g = _clip(p, g, ids, group["clipnorm"], owned=True)  # the norm over every shard's rows
        return work(ids, g, gate)
    if taken.dense is not None:
        g = taken.dense.to(math_dtype(p))
        g = g if s is None else g / s
        if k:
            acc = _accumulate_dense(state, g, k, p.device, clock)
            if acc is None:
                return None
            g, gate = acc
    else:
        if taken.pieces is not None and path is Path.KERNEL and sync_free(p.device):
            summed = _summed_on_device(p, taken.pieces) if s is None else None
            if summed is not None:
                ids, g = summed
                return work(ids, _clip(p, g, ids, group["clipnorm"]) if group["clipnorm"] else g, None)
            all_ids, all_rows = taken.pieces.collect()  # multiplied out, summed below as on the reference path
            taken = Taken(ids=all_ids, rows=all_rows)
        if taken.pieces is not None and path is Path.KERNEL:
            sums = row_sums(taken.pieces, p, sort_keys=sorted_keys, group=grouped_ids)
            if sums is None:  # multiplied out and summed as on the reference path
                all_ids, all_rows = taken.pieces.collect()
                taken = Taken(ids=all_ids, rows=all_rows)
            elif s is None and not any(group[k] for k in ("clipnorm", "global_clipnorm", "skip_nonfinite")):
                # Nothing needs every summed row at once: the update sums them a range at a time.
                return work(sums.ids, sums.src.new_empty(0, sums.src.shape[1]), None, sums=sums)
            else:
                g = sums.rows() if s is None else sums.rows() / s
                return work(sums.ids, _clip(p, g, sums.ids, group["clipnorm"]) if group["clipnorm"] else g, None)
        if taken.pieces is not None:
            return work(torch.empty(0, dtype=torch.int64), torch.empty(0), None, pieces=taken.pieces, divisor=s)
        rows = taken.rows
        ids = taken.ids
        if rows is not None:
            rows = rows.to(math_dtype(p)) if s is None else rows.to(math_dtype(p)) / s
        if k:
            acc_rows = _accumulate_rows(state, ids, rows, k, p, clock)
            if acc_rows is None:
                return None
            ids, rows, gate = acc_rows
        assert ids is not None and rows is not None
        if path is Path.ADDITIVE:  # accumulated (or sparse COO) rows: added per id like the piecewise path
            whole = RowGrad()
            whole.add(ids, rows / k if k else rows)
            return work(torch.empty(0, dtype=torch.int64), torch.empty(0), None, pieces=whole)
        sentinel = p.shape[0]
        if path is Path.NO_DEDUP:
            ids, rows = drop_sentinel(ids, rows, sentinel)
        else:
            ids, rows = coalesce_rows(ids, rows, sentinel)
        if k:
            rows = rows / k
        if path is Path.DENSE:  # a non-lazy table: every row updates, with g = 0 where not looked up
            if sinks_sentinel(p.device):
                ids, rows = sink_padding(ids, rows, sentinel)
            g = torch.zeros_like(p, dtype=rows.dtype).index_add_(0, ids, rows)  # (float32 for a 16-bit table)
            ids = None
        else:
            g = rows
    if group["clipnorm"]:
        g = _clip(p, g, ids, group["clipnorm"])
    return work(ids, g, gate)


def _sums_factored(p: Tensor, group: dict[str, Any]) -> bool:
    """Whether ``p``'s static duplicate sum takes its rows factored (:func:`_summed_on_device`): CUDA with Triton,
    no loss scale (the reference path divides each row before the sum)."""
    return sinks_sentinel(p.device) and triton_rows.adds(p.device) and group["loss_scale_factor"] is None


def _summed_on_device(p: Tensor, pieces: RowGrad) -> tuple[Tensor, Tensor] | None:
    """The static duplicate sum of ``coalesce_rows`` from factored rows: ``(uniq [N], g [N, D])``, ``dedup_static``'s
    ids with their sentinel tail and each id's ``gain · dL/dout`` added into its row by
    :func:`.triton_rows.add_rows` (no ``[N, D]`` rows made, then summed: the products and the atomic adds are
    ``spread``'s and ``index_add_``'s). ``None`` where the kernel does not take the tensors (nothing done)."""
    chunks = pieces.chunks()
    ids = torch.cat([i for i, _ in chunks]) if len(chunks) > 1 else chunks[0][0]
    uniq, inv = dedup_static(ids, p.shape[0])
    # Padding (and a frozen member's ids, made the sentinel) points past g's rows, so the kernel adds nothing there:
    # the sentinel's row stays 0 as coalesce_rows leaves it (a unit bag's padding has no gain of 0 to rely on, and
    # clipnorm's norms run over every row of g).
    inv = torch.where(ids < p.shape[0], inv, ids.shape[0])
    dtype = math_dtype(p)
    g = torch.zeros(ids.shape[0], p.shape[1], dtype=dtype, device=p.device)
    if not triton_rows.add_pieces(g, chunks, lambda rows: rows.to(dtype), at=inv):
        return None
    return uniq, g


def _clip(p: Tensor, g: Tensor, ids: Tensor | None, clipnorm: float, owned: bool = False) -> Tensor:
    """``clipnorm`` on ``p``'s gradient ``g`` (rows ``ids``; ``None``: every row): in a stacked group each
    member table's rows by that table's own norm, as for tables of their own. A table whose rows are
    split over a process group: ``g`` as it is, clipped by :func:`.step_gates.call_gates` once every table's part
    of its norm is known (``Work.norm_part``), all summed over the group in one all-reduce."""
    if reduction_group(p) is not None:
        return g
    if not member_rows(p):
        return clip_by_norm(g, clipnorm)
    rows = torch.arange(p.shape[0], device=g.device) if ids is None else ids
    seg = segment_of(p, rows, owned=owned)
    assert seg is not None
    return clip_members(g, seg, len(member_rows(p)), clipnorm)


def _accumulate_dense(
    state: dict[str, Tensor], g: Tensor, k: int, device: torch.device, clock: StepClock
) -> tuple[Tensor, Tensor | None] | None:
    """Keras accumulation for a dense gradient: ``None`` on accumulate-only calls (eager)."""
    acc = state["accumulated_gradients"]
    total = acc + g
    if is_static_device(device):
        # One graph for every call: the update runs always and is kept only on the k-th call.
        gate = torch.remainder(clock.on(device) + 1, k) == 0
        kept = torch.where(gate, torch.zeros_like(total), total)
        # A call the exchange's overflow drops leaves the window as it was.
        acc.copy_(kept if clock.clean is None else torch.where(clock.clean.to(device), kept, acc))
        return total / k, gate
    if (clock.iterations + 1) % k:
        acc.copy_(total)
        return None
    acc.zero_()
    return total / k, None


def _accumulate_rows(
    state: dict[str, Tensor], ids: Tensor | None, rows: Tensor | None, k: int, p: Tensor, clock: StepClock
) -> tuple[Tensor, Tensor, Tensor | None] | None:
    """Keras accumulation for a table: a ``[k, capacity]`` buffer of (ids, rows), one slot per call.

    Call ``i`` writes slot ``i % k`` (a call without lookups writes padding), so every slot is
    rewritten each cycle and the buffer never needs clearing; the k-th call updates from all
    slots. Capacity grows to the largest chunk seen; in a steady loop the shapes are static.
    """
    sentinel, dim = p.shape[0], p.shape[1]
    n = 0 if ids is None else ids.numel()
    buf_ids, buf_rows = state.get("acc_ids"), state.get("acc_rows")
    if buf_ids is None or buf_rows is None or buf_ids.shape[1] < n:
        cap = max(n, 0 if buf_ids is None else buf_ids.shape[1])
        # Built on the host and transferred: device data, not graph constants, on XLA.
        new_ids = torch.full((k, cap), sentinel, dtype=torch.int64)
        new_rows = torch.zeros((k, cap, dim), dtype=math_dtype(p))
        if buf_ids is not None and buf_rows is not None:
            # On XLA widened on the host too: on the device, the step would be a graph of its own (the first
            # after loading buffers narrower than the step's, saved on the CPU or on a mesh of another size).
            if p.device.type != "xla":
                new_ids, new_rows = new_ids.to(p.device), new_rows.to(p.device)
            new_ids[:, : buf_ids.shape[1]] = buf_ids.to(new_ids.device)
            new_rows[:, : buf_ids.shape[1]] = buf_rows.to(new_rows.device)
        buf_ids, buf_rows = new_ids.to(p.device), new_rows.to(p.device)
        if p.device.type == "xla":
            device_backend("xla").shard_slot(p, buf_ids, rows=False)
            device_backend("xla").shard_slot(p, buf_rows, rows=False)
        state["acc_ids"], state["acc_rows"] = buf_ids, buf_rows
    cap = buf_ids.shape[1]
    if ids is None or rows is None:
        ids = torch.empty(0, dtype=torch.int64, device=p.device)
        rows = torch.empty(0, dim, dtype=math_dtype(p), device=p.device)
    chunk_ids, chunk_rows = _padded(ids, rows, cap, sentinel)
    if is_static_device(p.device):
        it = clock.on(p.device)
        all_ids, all_rows = _window(buf_ids, buf_rows, chunk_ids, chunk_rows, it, k,
                                   None if clock.clean is None else clock.clean.to(p.device))
        return all_ids, all_rows, torch.remainder(it + 1, k) == 0
    buf_ids[clock.iterations % k] = chunk_ids
    buf_rows[clock.iterations % k] = chunk_rows
    if (clock.iterations + 1) % k:
        return None
    return buf_ids.reshape(-1), buf_rows.reshape(-1, dim), None


def _padded(ids: Tensor, rows: Tensor, cap: int, sentinel: int) -> tuple[Tensor, Tensor]:
    """``ids [m]``, ``rows [m, D]`` padded to ``cap`` entries (sentinel ids, zero rows)."""
    m = ids.shape[0]
    if m == cap:
        return ids.to(torch.int64), rows
    pad_ids = torch.full((cap - m,), sentinel, dtype=torch.int64, device=ids.device)
    pad_rows = torch.zeros((cap - m, rows.shape[1]), dtype=rows.dtype, device=rows.device)
    return torch.cat([ids.to(torch.int64), pad_ids]), torch.cat([rows, pad_rows])


def _window(
    buf_ids: Tensor, buf_rows: Tensor, ids: Tensor, rows: Tensor, it: Tensor, k: int, keep: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """Static-shape accumulation: write this call's ``ids [cap]``, ``rows [cap, D]`` into slot ``it % k``
    of the ``[k, cap]`` buffers (in place) and return every slot's entries, ``[k·cap]`` and ``[k·cap, D]``.
    ``keep`` False (a call the exchange's overflow drops): the slot keeps what it held."""
    at = torch.remainder(it, k).reshape(1)
    if keep is not None:
        ids = torch.where(keep, ids, buf_ids.index_select(0, at)[0])
        rows = torch.where(keep, rows, buf_rows.index_select(0, at)[0])
    buf_ids.index_copy_(0, at, ids[None])
    buf_rows.index_copy_(0, at, rows[None])
    return buf_ids.reshape(-1), buf_rows.reshape(-1, buf_rows.shape[-1])


def _prepare_owned(
    p: Tensor, group: dict[str, Any], state: dict[str, Tensor], taken: Taken, clock: StepClock
) -> tuple[Tensor, Tensor, Tensor | None]:
    """OWNER_LOCAL intake: loss scale, then on every shard (one manual-sharding region) the
    accumulation window and the sum of duplicate rows. Returns device-major ``(ids [n, U] unique per
    shard with the local sentinel tail, g [n, U, D], gate)``.

    A call whose lookup dropped ids (``taken.ok`` False) contributes no gradient, and its update is
    gated off (nothing is updated from an incomplete lookup); the accumulation window is left as it was
    when any lookup of the call overflowed (``clock.clean``, :func:`exchange_clean`).
    """
    info = table_info(p)
    assert info is not None and info.sharding is not None
    sharding, n = info.sharding, info.sharding.num_shards
    sentinel = p.shape[0] // n  # shard-local padding row
    k, s = group["gradient_accumulation_steps"], group["loss_scale_factor"]
    ok, ids, rows = taken.ok, taken.ids, taken.rows
    if ids is None or rows is None:  # a call without lookups of this table (accumulation pending)
        ids, rows = _owned_empty(p, n, max(1, state["acc_ids"].shape[1] if "acc_ids" in state else 1), sharding)
    rows = rows.to(math_dtype(p)) if s is None else rows.to(math_dtype(p)) / s
    if ok is not None:
        rows = torch.where(ok, rows, torch.zeros_like(rows))
        ids = torch.where(ok, ids, torch.full_like(ids, sentinel))
    dedup = group["use_gradient_accumulation"]
    inputs = [ids, rows]
    if k:  # the per-shard buffers enter as device-major [n, k, cap(, D)] inputs and leave as new tensors
        buf_ids, buf_rows = _owned_buffers(state, ids.shape[1], k, p, n, sentinel)
        inputs += [buf_ids.reshape(n, k, -1), buf_rows.reshape(n, k, buf_ids.shape[1], -1)]

    def on_shard(sharded: dict[str, Tensor], small: dict[str, Tensor], inputs: list[Tensor],
                 rep: list[Tensor | None]) -> list[Tensor]:
        ids, rows, *bufs = inputs
        if k:
            it, clean = rep
            assert it is not None
            ids, rows = _padded(ids, rows, bufs[0].shape[1], sentinel)
            ids, rows = _window(bufs[0], bufs[1], ids, rows, it, k, clean)
        return [*(coalesce_rows(ids, rows, sentinel) if dedup else (ids, rows)), *bufs]

    clean = None if clock.clean is None else clock.clean.to(p.device)
    uniq, g, *bufs = sharding.on_shards(on_shard, {}, {}, inputs, [clock.on(p.device), clean])
    if k:
        # New tensors every step, made at the same point of the step: the step's graph keeps one order of
        # outputs from the first step on (buffers made during the first step and then updated in place would
        # move ahead of the tensors each forward makes, and the second step would compile another graph).
        # clone(): not reshape views (on XLA a view stays tied to its base, an extra output of the step).
        state["acc_ids"] = bufs[0].reshape(n * k, -1).clone()
        state["acc_rows"] = bufs[1].reshape(n * k, bufs[0].shape[-1], -1).clone()
    gate = ok
    if k:
        g = g / k
        due = torch.remainder(clock.on(p.device) + 1, k) == 0
        gate = due if gate is None else gate & due
    return uniq, g, gate


def _owned_empty(p: Tensor, n: int, width: int, sharding: TablePlacement) -> tuple[Tensor, Tensor]:
    """An owner-local chunk with no ids: ``[n, width]`` local sentinels and zero rows, row-sharded."""
    ids = torch.full((n, width), p.shape[0] // n, dtype=torch.int64).to(p.device)
    rows = torch.zeros((n, width, p.shape[1]), dtype=math_dtype(p)).to(p.device)
    return sharding.row_sharded(ids), sharding.row_sharded(rows)


def _owned_buffers(
    state: dict[str, Tensor], width: int, k: int, p: Tensor, n: int, sentinel: int
) -> tuple[Tensor, Tensor]:
    """Per-shard accumulation buffers: ``acc_ids [n·k, cap]`` (shard-local rows) and ``acc_rows
    [n·k, cap, D]``, row-sharded (shard ``d`` holds its ``k`` slots). ``cap`` grows to the widest chunk."""
    buf_ids, buf_rows = state.get("acc_ids"), state.get("acc_rows")
    if buf_ids is None or buf_rows is None or buf_ids.shape[1] < width:
        cap = max(width, 0 if buf_ids is None else buf_ids.shape[1])
        new_ids = torch.full((n * k, cap), sentinel, dtype=torch.int64)
        new_rows = torch.zeros((n * k, cap, p.shape[1]), dtype=math_dtype(p))
        if buf_ids is not None and buf_rows is not None:  # widened on the host (see _accumulate_rows)
            new_ids[:, : buf_ids.shape[1]] = buf_ids.cpu()
            new_rows[:, : buf_ids.shape[1]] = buf_rows.cpu()
        new_ids, new_rows = new_ids.to(p.device), new_rows.to(p.device)
        device_backend("xla").shard_slot(p, new_ids, rows=True)
        device_backend("xla").shard_slot(p, new_rows, rows=True)
        state["acc_ids"], state["acc_rows"] = new_ids, new_rows
    return state["acc_ids"], state["acc_rows"]
