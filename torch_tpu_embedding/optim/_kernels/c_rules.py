"""The kernel path's fused C row update for RowWiseAdagrad and Adam / LazyAdam on eager CPU tables.

:func:`.row_update.update` runs a rule as an inductor-compiled loop over ranges of rows whose gradient sums
(:meth:`.RowSums.rows`, an ``embedding_bag``) were made first: passes over the summed rows, and no prefetching
of the table's rows, which are scattered over a large table (a random row costs a cache and a TLB miss, some
100 ns on an AMD EPYC VM). For the two rules here, one C loop (:mod:`.c_rules_source`, compiled into the
kernels' one C library, :func:`.c_library.library`: its compiler, flags and verified kernel cache) does it all per
distinct id: sums its contributions, applies the rule to its weight row and slot rows in place, and prefetches
the rows of the ids a few ahead. Measured at one thread (docs/benchmarks.md, 2026-11-29, third session).

It covers the rule alone, as :func:`.rule_pipeline.pipeline` runs it when no option around it is set: float32
contiguous CPU tables and slots, no ``clipvalue``, ``weight_decay_factor``, weight clipping, EMA or update gate
(accumulation, ``skip_nonfinite``), the rule of the optimizer being exactly :func:`rowwise_adagrad_rule` or
:func:`adam_rule` (a subclass with its own rule is not covered). Everything else takes
:func:`.row_update.update` as before, as does every step while :func:`.kernel_policy.warming_up` (the same policy:
which path a step takes depends only on the call count and the configuration). The rules stay the one
definition of the math (XLA, reference path, numpy references); tests/optim/test_c_rules.py pins this loop to
them for every option it accepts.

With several torch threads the distinct ids are split into one range per thread, run at once (ctypes releases
the GIL; the ranges' rows are disjoint), so the result does not depend on the thread count.
"""

from __future__ import annotations

import concurrent.futures
import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch.autograd.graph import increment_version

from torch_tpu_embedding._rows.dedup import sync_free
from torch_tpu_embedding._util.registry import rule_of
from torch_tpu_embedding.optim._kernels import c_library, kernel_policy
from torch_tpu_embedding.optim._kernels.c_args import in_memory
from torch_tpu_embedding.optim._kernels.row_sums import RowSums

if TYPE_CHECKING:
    from torch_tpu_embedding.optim._core.grad_intake import Work

__all__ = ["covered", "grouped_ids", "in_parallel", "run_rows", "sorted_keys", "update"]

Tensor = torch.Tensor

#: the rules this loop implements, by (module, name) of the rule function: the loop's name and its slots
_RULES: dict[tuple[str, str], tuple[str, tuple[str, ...]]] = {
    ("torch_tpu_embedding.optim.rowwise_adagrad", "rowwise_adagrad_rule"): ("rowwise_adagrad", ("accumulators",)),
    ("torch_tpu_embedding.optim.adam", "adam_rule"): ("adam", ("momenta", "velocities")),
}
#: group entries that change the row update around the rule: set (truthy), the loop does not apply
_AROUND_RULE = ("clipvalue", "weight_decay_factor", "use_ema")
#: distinct ids per thread below which the rows are not split over threads (a range costs some 20 µs)
_MIN_ROWS_PER_THREAD = 2048
_POOL: list[concurrent.futures.ThreadPoolExecutor] = []
_POOL_PID: list[int] = []  # the process the pool's threads belong to


def covered(item: Work) -> str | None:
    """The loop's rule name (``"rowwise_adagrad"``, ``"adam"``) if it can run ``item``'s update, else ``None``."""
    p, group = item.p, item.group
    rule = rule_of(group).rule
    found = _RULES.get((getattr(rule, "__module__", ""), getattr(rule, "__qualname__", "")))
    if (found is None or item.gate is not None or item.ids is None
            or any(group.get(k) for k in _AROUND_RULE)
            or group.get("clip_weight_min") is not None or group.get("clip_weight_max") is not None
            or p.device.type != "cpu" or sync_free(p.device) or p.dtype != torch.float32 or p.dim() != 2
            or not p.is_contiguous()
            or not sys.platform.startswith(("linux", "darwin"))):
        return None
    name, slots = found
    for k in slots:
        s = item.state.get(k)
        want = (p.shape[0],) if name == "rowwise_adagrad" else tuple(p.shape)
        if (s is None or s.dtype != torch.float32 or tuple(s.shape) != want or not s.is_contiguous()
                or s.device != p.device):
            return None
    return name


def _hp(name: str, item: Work, step: Tensor) -> Tensor:
    """The loop's hyper-parameters as float32 (Python numbers round to float32 as torch's scalar ops round them)."""
    group, lr = item.group, item.lr
    if name == "rowwise_adagrad":
        values = [lr.to(torch.float32), group["eps"], group["weight_decay"]]
    else:
        b1, b2 = group["betas"]
        eps = group["eps"]
        if group["bias_correction"]:  # adam_rule's expression, as it computes the rate
            t = step.to(torch.float32)
            lr = lr * torch.sqrt(1 - torch.pow(b2, t)) / (1 - torch.pow(b1, t))
        inside = bool(group["sum_inside_sqrt"])
        values = [lr.to(torch.float32), b1, 1 - b1, b2, 1 - b2, eps * eps if inside else eps, float(inside)]
    # (a float32 tensor's value is exact as a Python float: the list rounds each number to float32 once)
    return torch.tensor([float(v) for v in values], dtype=torch.float32)


def update(item: Work) -> bool:
    """Run ``item``'s row update through the C loop; ``False`` (nothing done, ``item`` unchanged) where it does not
    apply (:func:`covered`, the warm-up policy, fewer than 2 rows, or no library): :func:`.row_update.update`
    then runs."""
    ids = item.ids
    if ids is None or ids.shape[0] < 2 or kernel_policy.warming_up(item):
        return False
    name = covered(item)
    lib = c_library.library() if name is not None else None
    if name is None or lib is None:
        return False
    p, state = item.p, item.state
    step = state["step"] + 1
    slots = [state[k] for k in _RULES_SLOTS[name]]
    run_rows(getattr(lib, name), p, slots, ids, item.sums, item.g, _hp(name, item, step))
    state["step"].copy_(step)
    return True


_RULES_SLOTS = {name: slots for name, slots in _RULES.values()}


def run_rows(fn: Callable[..., int], p: Tensor, slots: list[Tensor], ids: Tensor, sums: RowSums | None, g: Tensor,
             hp: Tensor) -> None:
    """``fn`` (a loop of the library) over the sorted distinct ``ids`` of ``p``: their gradient rows summed from
    ``sums``, or (``sums`` ``None``) the rows ``g`` ``[U, D]`` as they are. Everything is checked here: the loop
    trusts its pointers (it checks only that the ids are rows of ``p``, ascending, and that the gradient rows it
    reads are ``src``'s)."""
    rows, dim = p.shape
    ids = ids.contiguous()
    n = ids.shape[0]
    if sums is not None:
        src, offsets, cols = sums.src, sums.offsets.contiguous(), sums.cols.contiguous()
        weights = None if sums.weights is None else sums.weights.contiguous()
    else:
        src, offsets, cols, weights = g, None, None, None
    if src.dim() == 2 and src.shape[0] and src.stride(0) == 0 and src.stride(1) != 1:
        # every row one row (a broadcast gradient, as loss = out.sum() gives): that row, read for every id
        src = src[:1].contiguous().expand(src.shape)
    elif src.dim() != 2 or src.stride(1) != 1:
        src = src.contiguous()
    tensors = [p, *slots, ids, src, hp] + [t for t in (offsets, cols, weights) if t is not None]
    lib = c_library.loaded()  # (fn is one of its loops: the table's slots and hyper-parameters it reads, by loop)
    assert lib is not None
    slot_shapes, hps = {id(lib.rowwise_adagrad): ([(rows,)], 3), id(lib.adam): ([(rows, dim)] * 2, 7)}.get(
        id(fn), ([], -1))
    if (p.dtype != torch.float32 or p.dim() != 2 or not p.is_contiguous() or hp.numel() != hps
            or [tuple(s.shape) for s in slots] != slot_shapes
            or not all(s.dtype == torch.float32 and s.is_contiguous() for s in slots)):
        raise ValueError(f"c_rules.run_rows: a {p.dtype} {tuple(p.shape)} table, slots "
                         f"{[(s.dtype, tuple(s.shape)) for s in slots]}, {hp.numel()} hyper-parameters; expected a "
                         f"contiguous float32 table and float32 contiguous slots of shapes {slot_shapes}, {hps} "
                         "hyper-parameters (the loop writes through their pointers)")
    if (ids.dtype != torch.int64 or ids.dim() != 1 or src.dtype != torch.float32 or src.dim() != 2
            or src.shape[1] != dim or hp.dtype != torch.float32 or not hp.is_contiguous()
            or (sums is None and src.shape[0] != n)
            or (offsets is not None and (offsets.dtype != torch.int64 or offsets.shape != (n + 1,)))
            or (cols is not None and (cols.dtype != torch.int64 or cols.dim() != 1))
            or (weights is not None and (weights.dtype != torch.float32 or cols is None or weights.shape != cols.shape))
            or not all(in_memory(t) for t in tensors)):
        raise ValueError(f"c_rules.run_rows: ids {ids.dtype} {tuple(ids.shape)}, gradient {src.dtype} "
                         f"{tuple(src.shape)} for a {tuple(p.shape)} table: expected int64 [U], float32 [., {dim}]")
    threads = max(1, min(torch.get_num_threads(), n // _MIN_ROWS_PER_THREAD))
    bounds = [n * t // threads for t in range(threads + 1)]
    scratch = torch.empty(threads, dim, dtype=torch.float32)
    ncols = 0 if cols is None else cols.shape[0]

    def ranged(t: int, before: int = 0) -> list[Any]:
        """Range ``t``'s ``ids, n, rows, offsets, cols, ncols, srows``: ``rows_ok``'s arguments (``before``: from the
        range before's last id on, checked ascending across the ranges), the loops' too."""
        a, b = bounds[t] - (before if t else 0), bounds[t + 1]  # ids and offsets from a on (offsets index cols)
        return [ids.data_ptr() + 8 * a, b - a, rows, None if offsets is None else offsets.data_ptr() + 8 * a,
                None if cols is None else cols.data_ptr(), ncols, src.shape[0]]

    def part(t: int) -> int:
        ids_at, count, _, offsets_at, cols_at, _, srows = ranged(t)
        # without offsets, src's rows from the range's first id on
        src_ptr = src.data_ptr() + (0 if offsets is not None else 4 * bounds[t] * src.stride(0))
        return fn(p.data_ptr(), *[s.data_ptr() for s in slots], rows, dim, ids_at, count, offsets_at, cols_at,
                  None if weights is None else weights.data_ptr(), src_ptr, src.stride(0), ncols, srows,
                  hp.data_ptr(), scratch[t].data_ptr())

    # Each loop checks its own range before writing it. Over threads every range is checked first: one range
    # refused after another was written would leave the step half applied (a failed step changes nothing).
    if (threads > 1 and not all(in_parallel(lambda t: int(lib.rows_ok(*ranged(t, 1))), threads))) \
            or any(in_parallel(part, threads)):
        raise IndexError(f"an id to update is outside the table's {rows} rows or not above the one before it (they "
                         f"are distinct and ascending), or a gradient row outside the {src.shape[0]} given (an "
                         "internal error: ids are checked at the lookup)")
    for t in (p, *slots):
        increment_version(t)  # (written through its pointer: autograd's check of saved tensors sees the change)


def in_parallel(part: Callable[[int], int], threads: int) -> list[int]:
    """``[part(0), ..., part(threads - 1)]``, run at once: ``part(0)`` on this thread, each other on a thread of its
    own (a C loop called through ctypes releases the GIL), kept for the next call in this process."""
    if threads == 1:
        return [part(0)]
    if _POOL_PID and _POOL_PID[0] != os.getpid():  # a forked child: the parent's pool threads are not here
        _POOL.clear()
    _POOL_PID[:] = [os.getpid()]
    if len(_POOL) < threads - 1:  # (one single-worker pool per extra thread: each range on its own thread)
        _POOL.extend(concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tte-rows")
                     for _ in range(threads - 1 - len(_POOL)))
    futures = [_POOL[t - 1].submit(part, t) for t in range(1, threads)]
    return [part(0), *[f.result() for f in futures]]


def sorted_keys(keys: Tensor, bound: int) -> Tensor:
    """``keys`` (distinct, in ``[0, bound)``) sorted, for :func:`.row_sums.row_sums`: on the CPU by the C radix sort of
    the kernel library once this process has loaded it (the kernel path's first step past its warm-up does; nothing
    is compiled here), else by ``torch.sort``, whose comparison sort below 32,768 keys took 0.69–0.89 ms for the
    16,384 keys of a 1-id step against 0.15 ms (docs/benchmarks.md). Distinct keys have one sorted order: the result
    is the same either way."""
    lib = c_library.loaded() if keys.device.type == "cpu" and keys.dtype == torch.int64 and keys.dim() == 1 else None
    if lib is None:
        return torch.sort(keys).values
    keys, scratch = keys.contiguous(), torch.empty_like(keys)  # (both held until the C sort returns)
    lib.sort_keys(keys.data_ptr(), scratch.data_ptr(), keys.numel(), max(1, (bound - 1).bit_length()))
    return keys


def grouped_ids(ids: Tensor, bound: int, width: int) -> tuple[Tensor, Tensor, Tensor, Tensor] | None:
    """``ids`` (int64 ``[n]``, in ``[0, bound)``) grouped for :func:`.row_sums.row_sums` by one C call of the kernel
    library, once this process has loaded it: the distinct ids ascending ``[U]``, where each one's positions start
    ``[U + 1]``, the positions in (id, position) order ``[n]`` (the stable sort's permutation) and those divided by
    ``width``. ``None`` where it does not apply (not loaded, not a CPU tensor, keys over 62 bits): ``row_sums``
    then sorts and groups with torch ops, to the same result (one order sorts distinct keys)."""
    lib = c_library.loaded() if ids.device.type == "cpu" and ids.dtype == torch.int64 and ids.dim() == 1 else None
    n = ids.numel()
    shift = max(1, (n - 1).bit_length())
    bits = shift + max(1, (bound - 1).bit_length())
    if lib is None or not n or bits > 62 or width < 1:
        return None
    ids = ids.contiguous()
    keys, tmp, uniq, perm = (torch.empty(n, dtype=torch.int64) for _ in range(4))
    offsets = torch.empty(n + 1, dtype=torch.int64)
    cols = torch.empty(n, dtype=torch.int64) if width > 1 else perm
    u = lib.group_ids(ids.data_ptr(), n, shift, bits, width, keys.data_ptr(), tmp.data_ptr(), uniq.data_ptr(),
                      offsets.data_ptr(), perm.data_ptr(), cols.data_ptr() if width > 1 else None)
    return uniq[:u], offsets[: u + 1], perm, cols
