"""The id exchange's bookkeeping, independent of how bytes move: which shard owns a row, how big the
routing buckets are, where a row's optimizer-slot entries live, and the routing plan of one device.

Every function here is plain torch on static shapes (no torch_xla, no ``torch.distributed``): it runs
on any device, and each transport wraps the same per-device steps in its own collectives — resharding
under torch_xla SPMD (:mod:`torch_tpu_embedding.xla.exchange`), ``all_to_all_single`` over a process
group. One device's part of a step, ``N`` ids, ``n`` shards, bucket capacity ``k``:

1. :func:`plan_routes` deduplicates the ids and buckets them by owner: ``send [n, k]`` (the owners'
   local rows, sentinel ``R/n`` in unused slots), ``slot [N]`` (the bucket slot each position reads,
   ``n·k`` for padding and overflow) and ``load [n]`` (unique ids per owner, before capacity);
2. the transport sends ``send`` to the owners; each owner reads its rows with :func:`gather_owned_rows`;
   the transport sends them back, and :func:`rows_at_positions` gives every position its row;
3. in the backward :func:`bucket_rows` sums each position's gradient row into its bucket slot (an id's
   duplicates become one row), the transport sends the buckets to the owners, and the owner's
   optimizer sums what several devices sent for one row.

Ownership. A row-sharded table has ``R`` physical rows (a multiple of its row block,
``lcm(512, n)``) split evenly over ``n`` shards: shard ``d`` holds physical rows
``[d·R/n, (d+1)·R/n)``. An *ownership scheme* maps a logical id to a physical row; the owner and the
shard-local row follow (``owner = physical // (R/n)``, ``local = physical % (R/n)``):

* ``"range"``: physical row = id. Contiguous ids share a shard, so a frequency-ordered vocabulary (hot
  ids first) puts its whole head on shard 0.
* ``"mod"``: owner ``id % n``, local row ``id // n`` (TF's mod sharding). The physical order depends
  on ``n``: a checkpoint of the physical table would have to record ``n`` and be permuted on loading
  at another device count (an all-to-all of the table), not resharded in place.
* ``"interleaved"``: the load balance of ``"mod"`` with a physical order independent of ``n``. The
  ``R`` rows are cut into ``C`` chunks of ``c = R / C`` rows (``C`` = the row block,
  ``lcm(512, n)``); id ``i`` lives in chunk ``rev(i % C)`` at row ``i // C``. For ``C = 2^b``,
  ``rev`` reverses the ``b`` bits; for ``C = m·2^b`` (``m`` odd) it reverses the digits of
  ``x = (x // m)·m + x % m`` written with radices ``m, 2, …, 2``: ``rev(x) = (x % m)·2^b +
  bitrev_b(x // m)``. For every ``n = m·2^j`` dividing ``C``, shard ``d`` holds whole chunks and
  ``owner(i)`` is a one-to-one function of ``i % n``: ``"mod"`` with the shards relabelled. Any other
  ``n`` dividing ``C`` still owns whole chunks, the same number each.

For ``"mod"`` and ``"interleaved"`` the table is stored permuted: ``state_dict`` (logical order) is
``table[physical_row(arange(V))]`` and loading writes ``table[physical_row(arange(V))] = values``
(fixed gathers/scatters: on a sharded table, the all-gather ``.cpu()`` already does, plus a
permutation). Padding rows (``V <= r < R``) are spread over the chunks instead of sitting at the end;
stacked tables permute the group's row space once. With ``"interleaved"`` a distributed checkpoint of
the physical table still reshards in place between device counts dividing ``C``.

Example (two shards, ``"mod"``; one device's ids, capacity 2)::

    >>> import torch
    >>> own = RowOwnership("mod", rows=8, num_shards=2)
    >>> plan = plan_routes(torch.tensor([5, 2, 5, 8]), own, capacity=2)   # 8 is padding
    >>> plan.send.tolist(), plan.slot.tolist(), plan.load.tolist()
    ([[1, 4], [2, 4]], [2, 0, 2, 4], [1, 1])
"""

from __future__ import annotations

import dataclasses
import math

import torch

from torch_tpu_embedding._rows.dedup import dedup_static
from torch_tpu_embedding._util.validation import arg_error, check_int, check_number

__all__ = [
    "SCHEMES",
    "RoutePlan",
    "RowOwnership",
    "bucket_rows",
    "capacity_for_load",
    "default_capacity",
    "gather_owned_rows",
    "plan_routes",
    "rows_at_positions",
    "slot_from_table_order",
    "slot_row",
    "slot_rows",
    "slot_table_order",
]

#: The ownership schemes (module docstring).
SCHEMES = ("range", "mod", "interleaved")


def _bitrev(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Reverse the low ``bits`` bits of non-negative integers ``x`` (shape kept)."""
    out = torch.zeros_like(x)
    for i in range(bits):
        out = out + ((x // (1 << i)) % 2) * (1 << (bits - 1 - i))
    return out


def _radices(chunks: int) -> tuple[int, int]:
    """``(m, b)`` with ``chunks = m·2^b``, ``m`` odd."""
    b = (chunks & -chunks).bit_length() - 1
    return chunks >> b, b


def _reverse(x: torch.Tensor, chunks: int) -> torch.Tensor:
    """The chunk of residue ``x`` in ``[0, chunks)`` (module docstring): ``(x % m)·2^b + bitrev_b(x // m)``."""
    m, b = _radices(chunks)
    if m == 1:  # a power of two: the bit reversal alone (no extra ops in the traced step)
        return _bitrev(x, b)
    return (x % m) * (1 << b) + _bitrev(x // m, b)


def _unreverse(p: torch.Tensor, chunks: int) -> torch.Tensor:
    """The inverse of :func:`_reverse`."""
    m, b = _radices(chunks)
    if m == 1:
        return _bitrev(p, b)
    return p // (1 << b) + m * _bitrev(p % (1 << b), b)


@dataclasses.dataclass(frozen=True)
class RowOwnership:
    """Ownership of the ``rows`` physical rows of a table split over ``num_shards`` shards.

    Args:
        scheme: one of :data:`SCHEMES`.
        rows: ``R``, the physical rows (a multiple of ``num_shards``; for ``"interleaved"`` of
            ``chunks``).
        num_shards: ``n``.
        chunks: ``C`` for ``"interleaved"`` (the table's row block), divisible by ``n``.

    Ids outside ``[0, rows)`` are padding: their physical row is the sentinel ``rows``, owned by no
    shard (owner ``n``).
    """

    scheme: str
    rows: int
    num_shards: int
    chunks: int = 512

    def __post_init__(self) -> None:
        if self.scheme not in SCHEMES:
            raise arg_error("scheme", f"must be one of {SCHEMES}", self.scheme)
        check_int("num_shards", self.num_shards, minimum=1)
        check_int("rows", self.rows, minimum=self.num_shards)
        if self.rows % self.num_shards:
            raise arg_error("rows", f"must be a multiple of num_shards={self.num_shards}", self.rows)
        if self.scheme == "interleaved":
            c = check_int("chunks", self.chunks, minimum=1)
            if c % self.num_shards or self.rows % c:
                raise ValueError(
                    "Ownership 'interleaved' needs `chunks` divisible by num_shards and dividing rows. "
                    f"Received: chunks={c}, num_shards={self.num_shards}, rows={self.rows}"
                )

    @property
    def rows_per_shard(self) -> int:
        """``R / n``: rows of one shard."""
        return self.rows // self.num_shards

    def physical_row(self, ids: torch.Tensor) -> torch.Tensor:
        """Physical row of each logical id (``rows`` for padding); same shape and dtype."""
        r, n = self.rows, self.num_shards
        valid = (ids >= 0) & (ids < r)
        safe = torch.where(valid, ids, torch.zeros_like(ids))
        if self.scheme == "range":
            phys = safe
        elif self.scheme == "mod":
            phys = (safe % n) * self.rows_per_shard + safe // n
        else:
            c = self.chunks
            phys = _reverse(safe % c, c) * (r // c) + safe // c
        return torch.where(valid, phys, torch.full_like(ids, r))

    def logical_id(self, physical: torch.Tensor) -> torch.Tensor:
        """Inverse of :meth:`physical_row` on ``[0, rows)``."""
        n = self.num_shards
        if self.scheme == "range":
            return physical
        if self.scheme == "mod":
            return (physical % self.rows_per_shard) * n + physical // self.rows_per_shard
        c = self.chunks
        per = self.rows // c
        return (physical % per) * c + _unreverse(physical // per, c)

    def owner(self, ids: torch.Tensor) -> torch.Tensor:
        """Owning shard of each logical id (``n`` for padding)."""
        return self.physical_row(ids) // self.rows_per_shard

    def local_row(self, ids: torch.Tensor) -> torch.Tensor:
        """Row of each logical id inside its owner's shard (``0`` for padding)."""
        return self.physical_row(ids) % self.rows_per_shard


def _binomial_tail(trials: int, p: float, c: int) -> float:
    """``P(X > c)`` for ``X ~ Binomial(trials, p)``, ``c`` at or above the mean: the pmf summed from
    ``c + 1`` up (log-space recurrence) until its terms vanish."""
    if c >= trials:
        return 0.0
    j = c + 1
    log_term = (math.lgamma(trials + 1) - math.lgamma(j + 1) - math.lgamma(trials - j + 1)
                + j * math.log(p) + (trials - j) * math.log1p(-p))
    step = math.log(p) - math.log1p(-p)
    total = 0.0
    while j <= trials:
        term = math.exp(log_term)
        total += term
        if term <= 1e-18 * total or (total == 0.0 and log_term < -800):
            break
        log_term += math.log(trials - j) - math.log(j + 1) + step if j < trials else 0.0
        j += 1
    return total


def default_capacity(
    ids_per_device: int, num_shards: int, *, overflow_probability: float = 1e-6, multiple: int = 8
) -> int:
    """Default bucket capacity ``k``: unique ids one device may send to one shard per step.

    The smallest ``k`` for which a step overflows with probability at most ``overflow_probability``
    when every device's ``N = ids_per_device`` ids are distinct and spread uniformly over the ``n``
    shards (each of the ``n²`` buckets holds Binomial(N, 1/n) ids; union bound), at least the mean
    ``N/n``, rounded up to ``multiple`` and at most ``N`` (which never overflows). Dedup only lowers
    the counts; ``"mod"`` and ``"interleaved"`` spread skewed (Zipf) ids about uniformly, ``"range"``
    does not. A skewed stream needs less: size it from measured loads with :func:`capacity_for_load`.

    The exchange moves ``n·k`` rows per device: at ``N = 576`` that is 704, 832 and 960 for
    ``n = 2, 4, 8`` (1.2–1.7 × N). The relative fluctuation of a bucket grows as ``√(n/N)``, so a
    small per-device batch on many devices pays more headroom (``N = 576, n = 256``: ``k`` = 24, ``n·k`` =
    10.7 N; ``N = 26,624``: ``k`` = 184, 1.77 N).
    """
    n_ids = check_int("ids_per_device", ids_per_device, minimum=1)
    n = check_int("num_shards", num_shards, minimum=1)
    check_number("overflow_probability", overflow_probability, minimum=0.0, maximum=1.0, min_inclusive=False)
    check_int("multiple", multiple, minimum=1)
    if n == 1:
        return n_ids
    lo, hi = n_ids // n, n_ids  # P(overflow) <= target at hi; binary search for the smallest
    while lo < hi:
        mid = (lo + hi) // 2
        if n * n * _binomial_tail(n_ids, 1 / n, mid) <= overflow_probability:
            hi = mid
        else:
            lo = mid + 1
    return min(-(-lo // multiple) * multiple, n_ids)


def capacity_for_load(largest_load: int, *, headroom: float = 1.25, multiple: int = 8) -> int:
    """A capacity sized from measured loads (TF's ``max_unique_ids_per_partition`` workflow): the
    largest per-shard load seen over a few steps (:attr:`RoutePlan.load`; under SPMD
    :func:`torch_tpu_embedding.xla.exchange.largest_load`) times ``headroom``, rounded up to ``multiple``."""
    check_int("largest_load", largest_load, minimum=0)
    check_number("headroom", headroom, minimum=1.0)
    check_int("multiple", multiple, minimum=1)
    cap = max(1, math.ceil(largest_load * headroom))
    return -(-cap // multiple) * multiple


# ---------------------------------------------------------------------------------------------------
# The routing plan of one device (module docstring, steps 1-3). A transport runs these per device: on
# its own shard inside a manual-sharding region under SPMD, or in its own process over a process group.


@dataclasses.dataclass(frozen=True)
class RoutePlan:
    """Where one device's ids go (:func:`plan_routes`).

    Attributes:
        send: ``[n, k]`` int32: the local rows (at owner ``d``, row ``d``) of the unique ids this device
            requests from each shard, ascending; unused slots hold the local sentinel ``R/n``.
        slot: ``[N]`` int64: the slot of the flattened ``[n·k]`` buckets position ``i`` reads; ``n·k``
            for padding and for ids over capacity.
        load: ``[n]`` int32: unique ids this device had for each shard, before capacity (those over
            ``k`` are dropped: ``max(load - k, 0)``).
    """

    send: torch.Tensor
    slot: torch.Tensor
    load: torch.Tensor


def plan_routes(ids: torch.Tensor, ownership: RowOwnership, capacity: int) -> RoutePlan:
    """Deduplicate one device's ``ids [N]`` and bucket them by owner, ``capacity`` unique ids a bucket.

    Ids outside ``[0, ownership.rows)`` are padding: not routed, their positions read no row. Static
    shapes only (sort, cumsum, scatter): the same graph every step on XLA.

    Raises:
        ValueError: ``ids`` is not a 1-D integer tensor, or ``capacity`` is not an int >= 1 (checked on
            the host; no tensor value is read).
    """
    integer = isinstance(ids, torch.Tensor) and not (ids.is_floating_point() or ids.is_complex())
    if not integer or ids.dtype == torch.bool or ids.dim() != 1:
        shape = tuple(ids.shape) if isinstance(ids, torch.Tensor) else type(ids).__name__
        raise arg_error("ids", "must be a 1-D integer tensor (one device's ids)",
                        f"{getattr(ids, 'dtype', '')} {shape}".strip())
    cap = check_int("capacity", capacity, minimum=1)
    n, per, rows = ownership.num_shards, ownership.rows_per_shard, ownership.rows
    m = ids.shape[0]
    phys = ownership.physical_row(ids.to(torch.int64))  # padding -> rows, which sorts last
    # Sorted unique physical rows: owners are non-decreasing, so each owner's ids are contiguous.
    uniq, inv = dedup_static(phys, rows)
    owner = uniq // per  # padding -> n
    counts = torch.zeros(n + 1, dtype=torch.int64, device=ids.device)
    counts = counts.scatter_add(0, owner, torch.ones_like(owner))
    first = torch.cumsum(counts, 0) - counts  # first unique slot of each owner
    rank = torch.arange(m, dtype=torch.int64, device=ids.device) - first.index_select(0, owner)
    fits = (owner < n) & (rank < cap)
    uslot = torch.where(fits, owner * cap + rank, torch.full_like(rank, n * cap))
    local = torch.where(owner < n, uniq - owner * per, torch.full_like(uniq, per))
    # One spare slot collects every unrouted id; it is cut off.
    send = torch.full((n * cap + 1,), per, dtype=torch.int64, device=ids.device).scatter(0, uslot, local)
    return RoutePlan(send[: n * cap].reshape(n, cap).to(torch.int32), uslot.index_select(0, inv),
                     counts[:n].to(torch.int32))


def gather_owned_rows(shard: torch.Tensor, wanted: torch.Tensor) -> torch.Tensor:
    """At an owner: the rows of its ``shard [R/n, D]`` at the local rows ``wanted [...]`` that other
    devices sent (:attr:`RoutePlan.send`), ``[..., D]``; the sentinel ``R/n`` reads a zero row."""
    per = shard.shape[0]
    rows = shard.index_select(0, wanted.reshape(-1).clamp(max=per - 1)).reshape(*wanted.shape, -1)
    return rows * (wanted < per).unsqueeze(-1).to(rows.dtype)


def rows_at_positions(rows_back: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
    """Back at the device: the row of every position, ``[N, D]``, from the rows its buckets got back,
    ``rows_back [n·k, D]`` (flattened in bucket order). Padding and dropped ids get zero rows."""
    spare = rows_back.shape[0]
    got = rows_back.index_select(0, slot.clamp(max=spare - 1))
    return got * (slot < spare).unsqueeze(-1).to(got.dtype)


def bucket_rows(grad: torch.Tensor, slot: torch.Tensor, num_shards: int, capacity: int) -> torch.Tensor:
    """The backward's buckets: each position's gradient row ``grad [N, D]`` summed into its bucket slot
    (an id's duplicates become one row), ``[n, k, D]`` to send to the owners; padding and dropped ids
    send nothing."""
    n, cap, d = num_shards, capacity, grad.shape[-1]
    # The spare slot n·k takes padding and overflow; it is cut off.
    buckets = torch.zeros(n * cap + 1, d, dtype=grad.dtype, device=grad.device).index_add(0, slot, grad)
    return buckets[: n * cap].reshape(n, cap, d)


# ---------------------------------------------------------------------------------------------------
# Optimizer slots aligned with the table's shards.
#
# Row-indexed slot ``k`` (1-based) of an XLA table has ``k`` extra rows per chunk of the table: the
# ``R`` table rows are cut into ``C`` chunks of ``c = R / C`` rows and each chunk is followed by ``k``
# trash rows, ``C · (c + k) = R + k · C`` rows in all (the same size as ``k`` blocks of trash rows at
# the end). Every donated table-sized buffer keeps a distinct size, and for every ``n`` dividing ``C``
# shard ``d`` of the slot holds exactly the slot rows of shard ``d`` of the table, so an owner can
# update a row and its slots with no communication. Table row ``r`` (physical, or shard-local: the
# formula is the same because shards start at chunk boundaries) is slot row
# ``(r // c) · (c + k) + r % c``; the sentinel ``R`` (or ``R / n`` locally) maps one past the end,
# where XLA's scatter drops it and its gather clamps it.


def slot_rows(rows: int, k: int, chunks: int) -> int:
    """Rows of slot ``k`` of a table of ``rows`` rows cut into ``chunks`` chunks: ``rows + k·chunks``."""
    if rows % chunks:
        raise arg_error("rows", f"must be a multiple of chunks={chunks}", rows)
    return rows + k * chunks


def slot_row(table_rows: torch.Tensor, k: int, chunk_rows: int) -> torch.Tensor:
    """Slot-``k`` row of each table row ``r``: ``(r // c)·(c + k) + r % c`` with ``c = chunk_rows``."""
    return (table_rows // chunk_rows) * (chunk_rows + k) + table_rows % chunk_rows


def slot_table_order(slot: torch.Tensor, k: int, chunks: int) -> torch.Tensor:
    """The ``R`` rows of slot ``k`` in table-row order, trash dropped: ``[R + k·C, ...] -> [R, ...]``.

    A reshape and a slice: on a row-sharded slot each shard keeps its rows (no communication).
    """
    per = slot.shape[0] // chunks
    view = slot.reshape(chunks, per, *slot.shape[1:])[:, : per - k]
    return view.reshape(chunks * (per - k), *slot.shape[1:])


def slot_from_table_order(values: torch.Tensor, k: int, chunks: int, fill: float = 0.0) -> torch.Tensor:
    """Slot ``k`` laid out with its trash rows from ``values [R, ...]`` in table-row order."""
    c = values.shape[0] // chunks
    pad = torch.full((chunks, k, *values.shape[1:]), fill, dtype=values.dtype, device=values.device)
    out = torch.cat([values.reshape(chunks, c, *values.shape[1:]), pad], dim=1)
    return out.reshape(chunks * (c + k), *values.shape[1:])
