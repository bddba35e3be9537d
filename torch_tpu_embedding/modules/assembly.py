"""The features of a lookup batch assembled at once: one id tensor, one range check, one lookup.

A stacked group looks its features up as FBGEMM's table-batched embedding does (TorchRec's
``KeyedJaggedTensor`` layout, padded): the features' ``[B, L]`` ids side by side, ``[B, F, L]``, shifted
to their tables' first rows in the group by one add of a ``[1, F, 1]`` offset tensor, checked in one host
pass (an ``aminmax``, or a clamp to a ``[1, F, 1]`` bound tensor), and looked up by one ``embedding_bag`` whose
output ``[B·F, D]`` is each feature's ``[B, D]`` as a slice of it viewed ``[B, F·D]``, or all of them side by
side (``concat``). Host ids of a host table, once the kernel library is loaded, and host ids bound for an
accelerator are joined, shifted, padded and checked in one C pass instead
(:func:`~torch_tpu_embedding.optim._kernels.c_gather.join_ids`; the latter int32 where they fit, masks left on the
host).
The ops a step dispatches for the group do not grow with its number of features; what does is Python
bookkeeping (a signature per feature, read from sizes and dtypes, never from values). The bound and
offset tensors are made once per group layout and device (:func:`_bounds`, :func:`_shifts`).

Forms taken here: :class:`~torch_tpu_embedding.inputs.Padded` and dense ids, on the host or on the table's
eager device, for features without ``output_shape`` or a sequence length. Everything else (jagged,
sparse, sequence features, XLA-resident ids, which are screened on the device, row-sharded tables) takes
the per-feature normalisation of :func:`~torch_tpu_embedding.inputs.to_bags`; a bad input found by the
group's check is re-checked there, feature by feature, so the error names the feature as it always did.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch

from torch_tpu_embedding._rows.row_grad import RowGrad
from torch_tpu_embedding._util.dtypes import compute_dtype
from torch_tpu_embedding._util.input_checks import INDEX_DTYPES, tracing
from torch_tpu_embedding._util.nest import Path
from torch_tpu_embedding._util.transfer import upload
from torch_tpu_embedding.config import FeatureConfig
from torch_tpu_embedding.inputs import Padded, to_bags
from torch_tpu_embedding.modules.lookup import bags_lookup
from torch_tpu_embedding.optim._kernels.c_gather import join_ids, join_library

__all__ = ["AssembledBatch", "signature"]

_INDEX_DTYPES = frozenset(INDEX_DTYPES)


def signature(value: Any, weight: Any, fc: FeatureConfig, table_device: torch.device) -> tuple[Any, ...] | None:
    """What the group assembly needs to know of one feature's input, from sizes and dtypes only: ``(form,
    B, L, ids dtype, ids device, masked, weights dtype)``, or ``None`` for an input it does not take (then
    :func:`~torch_tpu_embedding.inputs.to_bags` normalises it, and raises where it is wrong).

    Called for every feature in every step: each attribute is read once (a tensor's ``shape`` and
    ``device`` are made anew at each read)."""
    if fc.output_shape is not None or fc.max_sequence_length:
        return None
    if type(value) is Padded:
        ids, mask, w = value.ids, value.mask, value.weights
        if w is not None and weight is not None:
            return None  # (weights given twice: to_bags says so)
        w = weight if w is None else w
        if not isinstance(ids, torch.Tensor) or ids.dtype not in _INDEX_DTYPES or ids.layout != torch.strided \
                or ids.is_nested:  # (before its shape: a strided nested tensor has none)
            return None
        shape, device = ids.shape, ids.device
        if len(shape) != 2 or (fc.max_ids_per_bag is not None and shape[1] > fc.max_ids_per_bag):
            return None
        if mask is not None and (not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool
                                 or mask.layout != torch.strided or mask.is_nested
                                 or mask.shape != shape or mask.device != device):
            return None
        if w is not None and (not isinstance(w, torch.Tensor) or not w.is_floating_point()
                              or w.layout != torch.strided or w.is_nested
                              or w.shape != shape or w.device != device):
            return None
        form, width = "padded", shape[1]
    elif isinstance(value, torch.Tensor) and weight is None and value.dtype in _INDEX_DTYPES \
            and value.layout == torch.strided and not value.is_nested:
        shape, device = value.shape, value.device
        if not (len(shape) == 1 or (len(shape) == 2 and shape[1] == 1)):
            return None
        mask = w = None
        form, width = "dense" if len(shape) == 1 else "dense2", 1
    else:
        return None
    if device.type != "cpu" and (device != table_device or device.type == "xla"):
        return None  # (XLA-resident ids are screened on the device; ids elsewhere: to_bags says so)
    return form, shape[0], width, value.dtype if form != "padded" else ids.dtype, device, mask is not None, \
        None if w is None else w.dtype


@functools.lru_cache(maxsize=512)
def _bounds(vocabs: tuple[int, ...], dtype: torch.dtype, device: torch.device, feature_major: bool = False
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """``0`` and the ``[1, F, 1]`` (``feature_major``: ``[F, 1, 1]``) largest ids of a batch's columns in the
    ids' ``dtype`` on ``device`` (made once)."""
    top = torch.iinfo(dtype).max
    last = torch.tensor([min(v - 1, top) for v in vocabs], dtype=dtype)
    last = (last.view(-1, 1, 1) if feature_major else last.view(1, -1, 1)).to(device)
    return torch.zeros((), dtype=dtype).to(device), last


@functools.lru_cache(maxsize=512)
def _shifts(offsets: tuple[int, ...], sentinel: int, device: torch.device) -> tuple[torch.Tensor | None, torch.Tensor]:
    """``[1, F, 1]`` first rows of a batch's columns in their group (``None``: all 0) and its padding id.

    Made on the host and moved: on XLA a view made on the device would stay a pending graph node until the
    first step's graph computes it, and the second step would then trace another graph."""
    first = torch.tensor(offsets, dtype=torch.int64).view(1, -1, 1).to(device) if any(offsets) else None
    return first, torch.tensor(sentinel, dtype=torch.int64).to(device)


def _wide(ids: torch.Tensor) -> torch.Tensor:
    """``ids`` as int64 (the C join's int32 ids, widened on the device that looks them up)."""
    return ids if ids.dtype == torch.int64 else ids.to(torch.int64)


@dataclasses.dataclass
class _Item:
    """One feature of an assembled batch, as :class:`~torch_tpu_embedding.modules.lookup_batch.LookupBatch` lists
    them for :func:`~torch_tpu_embedding.modules.lookup_batch.side_by_side` (its position and activation shape)."""

    out_shape: tuple[int, ...]


@dataclasses.dataclass
class AssembledBatch:
    """The features of one physical table (a stacked group or a table) with one :func:`signature` and one
    combiner, looked up as one: ``ids [B·F, L]`` batch-major (bag ``b`` of every feature, then bag ``b + 1``).

    :meth:`add` the features (no op), :meth:`assemble` once (the group's ops, its check and its transfer),
    then :meth:`run` (each feature's ``[B, D]``, views) or :meth:`run_side_by_side` (``[B, F·D]``).
    A later call whose features have the same signatures may make its batch from this one's items, tables,
    members and columns (``modules/plan.py``'s cached plan), never added to then.
    """

    weight: torch.Tensor
    row_grad: RowGrad
    combiner: str
    resident: bool
    sig: tuple[Any, ...]
    sentinel: int
    items: list[tuple[Path, _Item]] = dataclasses.field(default_factory=list)
    tables: set[str] = dataclasses.field(default_factory=set)
    #: per feature: its name, config, its table's first row in the group and its table's name
    members: list[tuple[str, FeatureConfig, int, str]] = dataclasses.field(default_factory=list)
    #: per feature: its input and separate weights (dropped once assembled: never the caller's tensors kept)
    _values: list[Any] = dataclasses.field(default_factory=list)
    _wvalues: list[Any] = dataclasses.field(default_factory=list)
    _columns: tuple[tuple[int, ...], tuple[int, ...]] | None = None  # (num_embeddings, first rows), made once
    _ids: torch.Tensor | None = None
    _weights: torch.Tensor | None = None
    #: :meth:`join`'s ids are shifted, padded and checked already (its C pass on the host), ``[B, F, L]``
    _ready: bool = False

    def add(self, path: Path, feature: str, fc: FeatureConfig, table: str, value: Any, weight: Any,
            offset: int) -> None:
        """Take one feature (its input ``value`` and separate ``weight``; ``offset``: its table's first row)."""
        shape = self.items[0][1] if self.items else _Item((self.sig[1],))  # every feature's bags: [B]
        self.items.append((path, shape))
        self.tables.add(table)
        self.members.append((feature, fc, offset, table))
        self._values.append(value)
        self._wvalues.append(weight)

    @property
    def _major(self) -> bool:
        """:meth:`join` stacks feature-major: host ids of several features for another device."""
        return not self.resident and len(self._values) > 1

    def join(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The features' ids and masks stacked, ``[B, F, L]``; host ids for another device ``[F, B, L]``
        feature-major (each feature one contiguous copy, several times faster than writing every feature
        strided), transposed there. Copies: never the caller's tensors. Host ids come ``[B, F, L]`` shifted,
        padded and checked, without their masks, where :func:`join_ids` applies (``_ready``: :meth:`assemble` then
        does none of that), int32 where they are bound for another device and fit."""
        form, values, dim = self.sig[0], self._values, 0 if self._major else 1
        self._ready = False
        if self.sig[4].type == "cpu" and not tracing():
            ids = self._joined_in_c()
            if ids is not None:
                self._ready = True
                return ids, None
        if form == "padded":
            ids = torch.stack([v.ids for v in values], dim)
            return ids, torch.stack([v.mask for v in values], dim) if self.sig[5] else None
        ids = torch.stack(values, dim)
        return ids.unsqueeze(-1) if form == "dense" else ids, None

    def _joined_in_c(self) -> torch.Tensor | None:
        """Host ids joined by :func:`join_ids`' one C pass: for a host table once the kernel library is loaded (not
        XLA's); bound for an accelerator, from the first call (:func:`join_library`), int32 where they fit (CUDA:
        in pinned memory). ``None``: the torch ops join."""
        if self.resident:
            lib, narrow, pinned = None, False, False  # (None: the library if loaded, else no C pass)
        else:
            lib, narrow, pinned = join_library(), True, self.weight.device.type == "cuda"
            if lib is None:
                return None
        vocabs, offsets = self._layout()
        form, values = self.sig[0], self._values
        shape = (self.sig[1],) if form == "dense" else (self.sig[1], self.sig[2])  # (each value's: dense2 [B, 1])
        ids = [v.ids for v in values] if form == "padded" else values
        masks = [v.mask for v in values] if self.sig[5] else None
        return join_ids(ids, shape, offsets, vocabs, masks, self.sentinel, narrow, pinned, lib)

    def fits(self, joined: tuple[torch.Tensor, torch.Tensor | None]) -> bool:
        """Whether :meth:`join`'s tensors are what the signature says (sizes, dtypes, device, layout): a
        replayed plan's check of what it did not read feature by feature."""
        if self._ready:  # (join_ids took only contiguous host tensors of the signature's shapes and dtypes)
            return True
        ids, mask = joined
        _, b, width, dtype, device, masked, _ = self.sig
        f = len(self.items)
        shape = (f, b, width) if self._major else (b, f, width)
        return (ids.shape == shape and ids.dtype == dtype and ids.device == device and ids.layout == torch.strided
                and not ids.is_nested and (mask is None) != masked
                and (mask is None or (mask.shape == shape and mask.dtype == torch.bool and mask.device == device
                                      and mask.layout == torch.strided and not mask.is_nested)))

    def assemble(self, joined: tuple[torch.Tensor, torch.Tensor | None] | None = None, ahead: bool = False) -> None:
        """Join (unless given :meth:`join`'s), check, shift and move the features' ids (and weights): a fixed
        number of ops and of host reads.

        ``ahead`` (``EmbeddingCollection.prepare`` off the main thread): host ids are shifted and shaped on the host
        and moved as they are (the preparing thread puts no op on a device; XLA's are moved by the lookup).
        Raises the :func:`~torch_tpu_embedding.inputs.to_bags` error of the first bad feature.
        """
        _, b, width, dtype, device, _, wdtype = self.sig
        values = self._values
        vocabs, offsets = self._layout()
        ids, mask = self.join() if joined is None else joined
        ready = self._ready  # (set by the join() that made joined)
        major = self._major and not ready  # (the C pass writes [B, F, L])
        if ids.numel() and not tracing() and not ready:  # (no values while torch.compile traces, as to_bags)
            # Host ids: one pass (a vectorised reduction) and two host reads settle the usual case, every id
            # in [0, the smallest num_embeddings). Else two passes and one read (one sync for device ids):
            # every id in [0, num_embeddings) is what clamping leaves unchanged. Only when that fails are the
            # ids masked out (which are not ids: any value) told apart, at a cost.
            lo, hi = torch.aminmax(ids) if device.type == "cpu" else (None, None)
            if lo is None or hi is None or int(lo) < 0 or int(hi) >= min(vocabs):
                bounds = _bounds if type(ids) is torch.Tensor else _bounds.__wrapped__  # (as _shifts below)
                zero, last = bounds(vocabs, dtype, device, major)
                if not torch.equal(torch.clamp(ids, zero, last), ids) and (
                        mask is None or bool((mask & ((ids < zero) | (ids > last))).any())):
                    self._raise()
        w = None
        if wdtype is not None:
            w = torch.stack([v.weights if v.weights is not None else wv for v, wv in zip(values, self._wvalues,
                                                                                        strict=True)],
                            0 if major else 1)
            if w.numel() and not tracing():
                target = compute_dtype(self.weight.dtype)
                if not bool(torch.isfinite(w).all()) or (
                        torch.finfo(target).max < torch.finfo(w.dtype).max
                        and bool(w.abs().amax() > torch.finfo(target).max)):
                    # (a masked-out position holds no id, and its weight may be anything: only the features' own
                    # checks, under their masks, tell; the lookup's gains take no weight there)
                    self._raise(masked_weights=self.sig[5])
        moved = not self.resident and not ahead
        if moved:  # one transfer of the batch's ids (and mask, weights); the rest is the device's
            ids = upload(ids, self.weight.device)
            mask = None if mask is None else upload(mask, self.weight.device)
            w = None if w is None else upload(w, self.weight.device)
        if major:  # [B, F, L] on the device (ahead: on the host)
            ids = ids.transpose(0, 1)
            mask = None if mask is None else mask.transpose(0, 1)
            w = None if w is None else w.transpose(0, 1)
        ids = ids if ready else self._shifted(ids, mask, offsets)  # (the C join's int32: widened by _lookup)
        f = len(values)
        self._ids = ids.reshape(b * f, width) if major else ids.view(b * f, width)
        if w is not None:
            w = w.to(compute_dtype(self.weight.dtype))
            self._weights = w.reshape(b * f, width) if major else w.view(b * f, width)
        where = self.weight.device
        if ahead and not self.resident and where.type != "xla":  # (XLA: moved by the lookup, on the thread that
            self._ids = upload(self._ids, where)            # syncs; see modules/ahead.py)
            self._weights = None if self._weights is None else upload(self._weights, where)
        self._values, self._wvalues = [], []  # (the caller's tensors are not kept)

    def _layout(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The features' tables' ``num_embeddings`` and first rows in the group (made once)."""
        if self._columns is None:
            self._columns = (tuple(fc.table.num_embeddings for _, fc, _, _ in self.members),
                             tuple(o for _, _, o, _ in self.members))
        return self._columns

    def _shifted(self, ids: torch.Tensor, mask: torch.Tensor | None, offsets: tuple[int, ...]) -> torch.Tensor:
        """``ids [B, F, L]`` moved to their tables' rows in the group, int64, padding the sentinel."""
        # Kept only for plain tensors: under torch.export / torch.compile they would be fake (and kept fake).
        shifts = _shifts if type(ids) is torch.Tensor and not tracing() else _shifts.__wrapped__
        first, sentinel = shifts(offsets, self.sentinel, ids.device)
        if first is not None:
            ids = ids + first
        elif ids.dtype != torch.int64:
            ids = ids.to(torch.int64)
        if mask is not None:
            ids = torch.where(mask, ids, sentinel)
        return ids

    def device_tensors(self) -> list[torch.Tensor]:
        """The tensors :meth:`assemble` made (CUDA: recorded on the stream that uses them)."""
        return [t for t in (self._ids, self._weights) if t is not None]

    def _raise(self, masked_weights: bool = False) -> None:
        """The first bad feature's own error, from its per-feature normalisation. ``masked_weights``: the group
        check found a non-finite weight and the features have masks; returns if each lies where its mask holds
        no id."""
        for (feature, fc, _, table), value, weight in zip(self.members, self._values, self._wvalues, strict=True):
            to_bags(feature, fc, value, weight, sentinel=self.sentinel, device=torch.device("cpu"),
                    dtype=self.weight.dtype, table=table)
        if not masked_weights:
            raise AssertionError("the group check found a bad id or weight that no feature's own check finds")

    def _lookup(self, columns: int) -> tuple[torch.Tensor, ...]:
        assert self._ids is not None, "assemble() first"
        ids, w, where = self._ids, self._weights, self.weight.device
        if ids.device != where:  # prepared ahead for an XLA table: moved now, on the thread that looks up
            ids, w = ids.to(where), None if w is None else w.to(where)
        ids = _wide(ids)  # (the C join's int32, widened on the device where the lookup runs, not by a preparer)
        return bags_lookup(self.weight, ids, w, self.combiner, self.row_grad, self.tables,
                           not self.sig[5], columns=columns)  # (full: no mask, no padding)

    def run(self) -> dict[Path, torch.Tensor]:
        """Each feature's ``[B, D]`` activations by its position: slices of one ``[B, F·D]``."""
        pieces = self._lookup(len(self.items) if len(self.items) > 1 else 0)
        return {path: piece for (path, _), piece in zip(self.items, pieces, strict=True)}

    def side_by_side(self) -> bool:
        """Always (every feature is ``[B]`` bags): :func:`~torch_tpu_embedding.modules.lookup_batch.side_by_side`."""
        return True

    def run_side_by_side(self) -> torch.Tensor:
        """The features' activations side by side, ``[B, F·D]``, as one tensor (nothing copied)."""
        (out,) = self._lookup(0)
        return out.view(self.sig[1], len(self.items) * out.shape[1])
