"""The process-group transport: tables whose rows are sharded over ``torch.distributed`` processes.

The counterpart of the SPMD exchange (:mod:`torch_tpu_embedding.xla.exchange`) for ``torchrun``
processes (gloo, NCCL, any backend with ``all_to_all_single`` and ``all_reduce``): the same per-device
steps of :mod:`torch_tpu_embedding.routing` (dedup, owner, bucket, capacity), with the bytes moved by
``torch.distributed`` collectives. One rank's part of a step, for the ``m`` tables (``n`` shards each) a
forward call looks up over one group, ``N_t`` id positions each (:mod:`~.lookup_exchange`):

1. ``plan`` deduplicates the rank's ids of each table and buckets them by owner; the bucket size ``k`` is the
   largest load of any rank for any owner of any of the tables this step, agreed by ONE ``all_reduce(MAX)``
   of eight integers for all the tables (eager capacity: no id is ever dropped, and every rank's buckets
   have the same size), the step's one host read;
2. ``fetch_rows``: one ``all_to_all_single`` of every table's ``[n, k]`` int32 local rows (equal splits),
   each owner gathers its rows, a second ``all_to_all_single`` returns every table's ``[n, k, D_t]`` (side by
   side, as bytes);
3. ``send_grads`` (the backward): each position's gradient row summed into its bucket slot
   (``routing.bucket_rows``), one ``all_to_all_single`` of every training table's ``[n, k, D_t + 1]`` to the
   owners, which add ``(local rows, rows)`` to each shard's
   :class:`~torch_tpu_embedding._rows.row_grad.RowGrad`: the optimizer then updates the shard as an ordinary
   table of its own rows.

Only equal-split collectives: it runs where uneven all-to-all does not (TorchTPU's ``tpu_dist``).
Per rank and step that is ``n·k·(4·m + Σ_t (2·D_t + 1)·b_t) + 5·n·m`` bytes sent for ``b_t``-byte rows (the
backward's rows carry one more column, each slot's count of used positions: ``routed.py``; ``n·k`` is the
rank's distinct ids of its most loaded table plus the imbalance of the largest bucket; the ``5·n·m``: each
table's largest load, for ``largest_loads()``, and whether this rank's loss used it), plus 64 bytes for the
capacity and the step's agreement (:func:`agree_capacity`: every rank at the same exchange, none failed before
it), whatever ``m``.

What the optimizer needs summed over every shard of a row-sharded table (``clipnorm``, Adafactor's
statistics over rows, ``global_clipnorm``, the ``skip_nonfinite`` gate) is all-reduced over the group the
table's placement names (:meth:`GroupSharding.reduction_group`; the collectives are
``_rows/placement.py``'s). Nothing here imports torch_xla.

Every all-to-all of the process-group path goes through :func:`exchange` at a size agreed by
:func:`agree_capacity`: the lookup's above, and :func:`send_to_owners`, which moves items that each go to
one rank (no dedup, nothing summed) for the state's moves between the stored and the logical row order
(:mod:`torch_tpu_embedding.distributed.state`).
"""

from __future__ import annotations

import dataclasses
import zlib
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from torch_tpu_embedding._rows.placement import TablePlacement, process_group_placement
from torch_tpu_embedding._rows.routing import RowOwnership

__all__ = [
    "GroupSharding",
    "agree_capacity",
    "describe_tables",
    "exchange",
    "group_sharding",
    "lookups_named",
    "send_to_owners",
]

Tensor = torch.Tensor


@dataclasses.dataclass(frozen=True)
class GroupSharding(TablePlacement):
    """How one table is laid out over a process group (``TableInfo.sharding``).

    ``placement``: ``"row"`` (rows split by ``ownership`` over the ``world`` ranks) or ``"table"``
    (the whole table on rank ``owner``). ``rows``: the table's logical rows ``V``; ``ownership``:
    its physical rows over the ranks (for ``"table"``, ``"range"`` over ``world · V`` virtual rows, of
    which the owner's block is real). ``group``: the process group the exchange runs on.
    ``dtensor_state_dict``: the table's ``state_dict`` entry and its optimizer's row slots go to torch's
    checkpoint helpers as DTensors ``Shard(0)`` of the logical rows (``tte.distributed.shard(...,
    dtensor_state_dict=True)``); kept here, with the layout, so that everything holding the parameter
    (the table's state-dict hooks, the optimizer) reads the one flag, and a copy of the table keeps it.
    """

    placement: str
    group: Any
    world: int
    rank: int
    rows: int
    ownership: RowOwnership
    owner: int = 0
    dtensor_state_dict: bool = False
    #: the table's name, for errors
    table: str = ""
    # read by ``TableInfo.routed``: lookups go through :meth:`routed_lookup` (modules layer); not the SPMD
    # owner-local path (``TableInfo.owner_local``). Class attributes (no annotation): not fields.
    over_process_group = True
    exchange = False

    def __post_init__(self) -> None:
        describe_tables([self.table])  # so that this rank can name this table in another rank's step errors

    def move_failed(self, device: torch.device) -> None:
        """This rank refuses a state it would have moved between the stored and the logical rows (a DTensor of
        ``load_state_dict``, an optimizer's DTensor slots): it takes part in the move's agreement
        (:func:`agree_capacity`) as failed, so that the other ranks raise there, naming it, instead of waiting
        for it. The caller then raises its own error."""
        agree_capacity(torch.zeros((), dtype=torch.int64, device=device), self.group, table=self.table, failed=True)

    def state_checked(self, device: torch.device, failed: bool) -> None:
        """An optimizer's torch-layout state read, its DTensor slots moved (if any) and checked on this rank:
        one agreement (:func:`agree_capacity`, tag ``"optim"``) before anything is written, so that a rank
        refusing its state (``failed``) makes every other raise, naming it, and a rank given plain tensors
        (no move) meets the other ranks' first move there, every rank raising. The caller raises its own
        error when ``failed``."""
        agree_capacity(torch.zeros((), dtype=torch.int64, device=device), self.group, what="optim", table=self.table,
                       failed=failed)

    def lookup_failed(self, device: torch.device) -> None:
        """This rank's forward failed before its first exchange (a bad id, a missing feature): take part in
        the step's agreement (:func:`agree_capacity`) with the failure, so that every rank raises at this step
        instead of pairing it with this rank's next one. The caller then raises its own error."""
        agree_capacity(torch.zeros((), dtype=torch.int64, device=device), self.group, what="lookup", table=self.table,
                       grad=torch.is_grad_enabled(), failed=True)

    def __deepcopy__(self, memo: dict[int, Any]) -> GroupSharding:
        # Immutable, and its process group is a handle on the running processes, not data: a copy of the
        # table (copy.deepcopy of a sharded model) is laid out over the same group.
        return self

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise TypeError(
            f"Table `{self.table}` is sharded over a process group (tte.distributed.shard) and cannot be pickled: "
            "its layout holds the process group of the running processes. Save model.state_dict() (or "
            "tte.distributed.save_sharded) instead. Received: a pickle of the table (placement "
            f"{self.placement!r}, {self.rows} rows over {self.world} ranks)"
        )

    @property
    def id_rows(self) -> int:
        """The padding id of the table's bags (any id at or above it is padding)."""
        return self.ownership.rows if self.placement == "row" else self.rows

    @property
    def local_rows(self) -> int:
        """Rows this rank stores: its shard (``"row"``), the whole table or none (``"table"``)."""
        if self.placement == "row":
            return self.ownership.rows_per_shard
        return self.rows if self.rank == self.owner else 0

    def route_ids(self, ids: Tensor) -> Tensor:
        """Logical ids (padding ``>= id_rows``) in the ownership's id space."""
        if self.placement == "row":
            return ids
        valid = ids < self.rows
        return torch.where(valid, ids + self.owner * self.rows, torch.full_like(ids, self.ownership.rows))

    @property
    def num_shards(self) -> int:
        return self.world

    def reduction_group(self) -> Any:
        """The group, for a table whose rows are split over more than one rank (``"row"``), else ``None``."""
        return self.group if self.placement == "row" and self.world > 1 else None

    def local_logical_ids(self) -> Tensor:
        """The logical id of each row this rank stores (``>= rows``: a padding row), ``[local_rows]``."""
        if self.placement == "table":
            return torch.arange(self.local_rows, dtype=torch.int64)
        per = self.ownership.rows_per_shard
        return self.ownership.logical_id(torch.arange(self.rank * per, (self.rank + 1) * per, dtype=torch.int64))


def group_sharding(p: Tensor) -> GroupSharding | None:
    """The :class:`GroupSharding` of table parameter ``p``, ``None`` when it is not sharded over a group
    (:func:`~torch_tpu_embedding._rows.placement.process_group_placement`, typed as this backend's)."""
    sharding = process_group_placement(p)
    return sharding if isinstance(sharding, GroupSharding) else None


#: what :func:`agree_capacity` agrees on: a collective's tag (see :func:`_tag`) → its description, for errors; at most
#: :data:`_DESCRIBED_MAX`, the oldest dropped first (a tag no longer described is named by its number in an error)
_DESCRIBED: dict[int, str] = {}
_DESCRIBED_MAX = 4096
#: the kinds of exchange, named in errors
_KINDS = {"lookup": "looks up table `{table}`",
          "lookups": "looks up {table}",
          "data_parallel": "looks up data-parallel tables {table}",
          "rows": "moves a sharded table's rows between ranks ({of}its state_dict, load_state_dict or a checkpoint)",
          "plain": "loads table `{table}`'s state_dict entry as a plain tensor (its stored rows, given so on every "
                   "rank), not as a DTensor of its logical rows",
          "optim": "checks an optimizer state loaded in torch's layout, its DTensor slots moved (a rank given plain "
                   "tensors, its stored rows, for table `{table}` or every table moves none)",
          "step": "exchanges the row gradients of data-parallel tables (an optimizer's step() or clip_grad_norm_)"}
#: what a rank whose training forwards per step differ from another's is told (:func:`agree_capacity`)
_FORWARDS_DIFFER = (
    "The ranks of the process group ran different numbers of training forward passes (micro-batches) before an "
    "optimizer's step(): {seen}. Every forward of a data-parallel table meets the other ranks' (the step's "
    "agreement), and its row gradients are exchanged at step(), so one rank's extra forward meets another's "
    "step(). Give every rank the same number of micro-batches per step (gradient accumulation alike on every "
    "rank: split an uneven last batch into as many micro-batches on every rank, or drop it on every rank)."
)


def _tag(what: str, table: str, grad: bool) -> int:
    """A number every process computes alike for one kind of exchange (``hash`` is salted per process)."""
    tag = zlib.crc32(f"{what}|{table}|{grad}".encode()) & 0x3FFFFFFF
    if tag not in _DESCRIBED:
        text = _KINDS[what].format(table=table, of=f"table `{table}`: " if table else "")
        _DESCRIBED[tag] = text + (" with gradients (training)" if grad else " without gradients (evaluation) or "
                                  "frozen (requires_grad=False)" if what == "lookup" else "")
        if len(_DESCRIBED) > _DESCRIBED_MAX:  # (data parallel's tags follow its input shapes: a bound, not a leak)
            del _DESCRIBED[next(iter(_DESCRIBED))]
    return tag


#: the tag of the exchange of data-parallel row gradients at step(), known to every process (named in its errors)
_STEP_TAG = _tag("step", "", False)


def describe_tables(tables: Sequence[str]) -> None:
    """Make the exchanges of ``tables`` known by name to this process's errors (a rank names what another
    rank's tag stands for only if it computed that tag itself)."""
    for table in tables:
        for grad in (True, False):
            _tag("lookup", table, grad)
        _tag("plain", table, False)
        _tag("rows", table, False)
        _tag("optim", table, False)
    _tag("rows", "", False)


def _lookups_text(entries: Sequence[tuple[str, bool]]) -> str:
    # (each table in the words of its own lookup's tag: an error names each as a one-table forward would)
    return ", ".join(f"table `{t}` " + ("with gradients (training)" if g else
                                        "without gradients (evaluation) or frozen (requires_grad=False)")
                     for t, g in entries)


def lookups_named(entries: Sequence[tuple[str, bool]]) -> str:
    """The ``table`` of :func:`agree_capacity` (``what="lookups"``) for one forward's lookups of several tables
    over a group, ``entries``: each table's name and whether its lookup records gradients, in the order looked
    up. The lookups another rank most likely runs instead are made known too (each table's gradients on or off,
    every table's, one table left out), so that this rank's error names them when it meets one."""
    for i in range(len(entries)):
        flipped = [(t, g if j != i else not g) for j, (t, g) in enumerate(entries)]
        fewer = [e for j, e in enumerate(entries) if j != i]
        _tag("lookups", _lookups_text(flipped), False)
        if len(fewer) > 1:  # (one table's lookup alone: its own tag, described by describe_tables)
            _tag("lookups", _lookups_text(fewer), False)
    _tag("lookups", _lookups_text([(t, not g) for t, g in entries]), False)
    text = _lookups_text(entries)
    _tag("lookups", text, False)
    return text


def agree_capacity(largest: Tensor, group: Any, *, what: str = "rows", table: str = "", grad: bool = False,
                   failed: bool = False, config: int = 0, disagree: Callable[[], None] | None = None,
                   forwards: int = 0) -> int:
    """The bucket size every rank of ``group`` uses: the largest of every rank's ``largest`` (a 0-d or 1-element
    integer tensor, on the group's device), at least 1. Every rank's buckets then have that size, so every
    all-to-all splits equally and nothing is dropped.

    The same collective agrees that every rank is at the same step: one ``all_reduce(MAX)`` of eight int64 (the
    largest load; a tag of the exchange (``what``: ``"lookup"`` of ``table``, ``grad``: recording gradients,
    ``"lookups"``: a forward's lookups of several tables, ``table`` from :func:`lookups_named`,
    ``"data_parallel"``: a training lookup of replicated tables (``distributed/step_agreement.py``),
    ``"step"``: the exchange of their row gradients at ``step()`` (``distributed/grad_sync.py``),
    ``"rows"``, ``"plain"``: a load of ``table``'s stored rows, which moves nothing, or ``"optim"``: an
    optimizer's loaded state checked, :meth:`GroupSharding.state_checked`) and its negation, so
    that the maximum and the minimum of the tags arrive; the highest
    rank that ``failed`` plus one; ``forwards``, the training forwards of data-parallel tables since the group's
    last exchange of their row gradients, and its negation), read back once. Every agreement has these eight
    numbers: any two that meet have the same size (gloo aborts a process whose collective meets one of
    another size). A rank whose step failed before its first collective takes
    part with ``failed=True`` (:meth:`GroupSharding.lookup_failed`) instead of skipping it: the others then
    raise at that step rather than pair this exchange with the failed rank's next one. A training lookup adds
    ``config`` (a number for this rank's optimizers, :func:`~.optim_agreement.fingerprint`) and its negation: where
    the ranks' numbers differ (every rank sees it, none failed, all at the same exchange) each calls ``disagree``,
    which raises.

    Raises:
        RuntimeError: (on every rank but a failed one) another rank failed this step, or the ranks are at
            different exchanges (another table, another kind, a lookup with gradients on some ranks only, a
            data-parallel lookup on one rank and ``step()`` on another), or ran different numbers of training
            forwards of data-parallel tables since their last ``step()``.
    """
    tag = _tag(what, table, grad)
    rank = dist.get_rank(group)
    step = torch.tensor([tag, -tag, rank + 1 if failed else 0, config, -config, forwards, -forwards],
                        dtype=torch.int64).to(largest.device)
    k = torch.cat([largest.detach().to(torch.int64).reshape(1), step])  # a new tensor: all_reduce writes in place
    try:
        dist.all_reduce(k, op=dist.ReduceOp.MAX, group=group)
    except RuntimeError as e:  # (gloo's timeout, or a peer gone: name what usually leaves a rank waiting here)
        raise RuntimeError(
            f"Rank {rank} of the process group waited where it {_DESCRIBED[tag]}, and the other ranks did not "
            "arrive within the group's timeout, or left. A rank elsewhere leaves it here: one still in the backward "
            "of a batch this rank skipped without a backward (every rank must run the backward of each training "
            "lookup of a sharded table, or skip the batch on every rank alike), or one that failed or stopped "
            f"outside the library. Received: {e}"
        ) from e
    got = k.tolist()  # the step's one host read
    if failed:
        return 1
    if got[3]:
        raise RuntimeError(
            f"Rank {got[3] - 1} of the process group failed this step before its exchange (its own error is raised "
            f"there: see that rank's output), while this rank {_DESCRIBED[tag]}. Every rank raises here, at the same "
            "step, so that none waits for it or pairs this step's collectives with another step's. To skip such a "
            "batch, catch the error on every rank alike (each rank then moves to the next batch together)."
        )
    if got[1] != -got[2]:
        theirs = [_DESCRIBED.get(t, f"makes an exchange this rank does not know (tag {t})")
                  for t in (got[1], -got[2])]
        if _STEP_TAG in (got[1], -got[2]):  # one rank at step(), another at a training forward
            raise RuntimeError(_FORWARDS_DIFFER.format(seen=_forwards_seen(got, rank, forwards, _DESCRIBED[tag],
                                                                           theirs[0] if got[1] != tag else theirs[1])))
        raise RuntimeError(
            "The ranks of the process group are at different exchanges: one "
            f"{theirs[0]}, another {theirs[1]} (this rank {_DESCRIBED[tag]}). Every rank must run the same lookups "
            "and state moves in the same order: a forward on some ranks only (evaluation on rank 0 alone), a batch "
            "skipped on one rank, state_dict() of a model sharded with dtensor_state_dict on one rank only, or its "
            "load_state_dict given a table's DTensor on some ranks and a plain tensor on others pairs one rank's "
            "collectives with another's; so do a table frozen (requires_grad=False) on some ranks only, and batches "
            "of other shapes where data parallel exchanges row gradients "
            "at static sizes (an accelerator: the same batch size and padded widths on every rank). Received: "
            "different exchanges on the ranks of one step"
        )
    if got[6] != -got[7]:
        raise RuntimeError(_FORWARDS_DIFFER.format(seen=_forwards_seen(got, rank, forwards, _DESCRIBED[tag],
                                                                       _DESCRIBED[tag])))
    if disagree is not None and got[4] != -got[5]:
        disagree()
    return max(1, int(got[0]))


def _forwards_seen(got: list[int], rank: int, forwards: int, mine: str, theirs: str) -> str:
    """The counts of an agreement whose ranks ran different numbers of training forwards per step, in words."""
    where = f"it {mine}" + ("" if theirs == mine else f", while another rank {theirs}")
    return (f"{-got[7]} on one rank and {got[6]} on another, counting the training forwards of data-parallel tables "
            f"since the last step() (rank {rank} has run {forwards}; {where})")


def exchange(buckets: Tensor, group: Any) -> Tensor:
    """One equal-split ``all_to_all_single`` over ``group``: ``buckets [n, ...]``, row ``s`` to rank ``s``;
    returns what every rank sent this one (row ``s`` from rank ``s``), of the same shape and dtype."""
    buckets = buckets.contiguous()
    got = torch.empty_like(buckets)
    dist.all_to_all_single(got, buckets, group=group)
    return got


def send_to_owners(dest: Tensor, payloads: Sequence[Tensor], fills: Sequence[float], world: int,
                   group: Any, table: str = "") -> list[Tensor]:
    """Send item ``i`` of every payload (``[m, ...]``, on the group's device) to rank ``dest[i]`` (``[m]`` int64
    on the CPU): each payload bucketed by destination (a bucket keeps its items' order), every rank's buckets
    padded to the largest (:func:`agree_capacity`) with that payload's ``fills`` value, one :func:`exchange`
    per payload, in the order given. Returns each payload's received items, ``[world·k, ...]``: ``k`` from
    each rank in rank order, padding holding the fill value. For moves where one item goes to one rank (no
    duplicates to sum: the state's rows, :mod:`torch_tpu_embedding.distributed.state`), of table ``table``: the
    agreement's tag, so that ranks moving different tables raise instead of swapping their rows."""
    dev = payloads[0].device
    counts = torch.bincount(dest, minlength=world)
    cap = agree_capacity(counts.max().to(dev), group, table=table)  # counts has `world` entries even when dest is empty
    order = torch.argsort(dest, stable=True)
    first = torch.cumsum(counts, 0) - counts
    to = dest[order]
    flat = to * cap + torch.arange(dest.numel()) - first[to]  # bucket slot of each item, in sorted order
    out = []
    for payload, fill in zip(payloads, fills, strict=True):
        send = payload.new_full((world * cap, *payload.shape[1:]), fill)
        send[flat.to(payload.device)] = payload[order.to(payload.device)]
        out.append(exchange(send, group))
    return out
