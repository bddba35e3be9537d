"""The lookup plan's runner: a :class:`LookupBatch` (the features looked up together from one table) moves its
bags to the table's device and looks them up in one :mod:`~torch_tpu_embedding.modules.lookup` call, feature by
feature or side by side (:func:`side_by_side`: ``[B, F·D]`` written by one lookup, no ``torch.cat``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from torch_tpu_embedding._rows.row_grad import RowGrad
from torch_tpu_embedding._util.dtypes import compute_dtype
from torch_tpu_embedding._util.nest import Path
from torch_tpu_embedding._util.transfer import upload
from torch_tpu_embedding.inputs import Bags
from torch_tpu_embedding.modules.lookup import bags_lookup, jagged_lookup

__all__ = ["LookupBatch", "id_shapes", "side_by_side"]


@dataclasses.dataclass
class LookupBatch:
    """Features looked up together: one physical table, one bag width, one combiner.

    ``items`` are the features' positions in the input structure and their :class:`Bags` (ids on
    the table's device when ``resident``, else on the host, moved in one transfer by :meth:`run`).
    """

    weight: torch.Tensor
    row_grad: RowGrad
    combiner: str
    resident: bool
    items: list[tuple[Path, Bags]] = dataclasses.field(default_factory=list)
    #: the tables the items look up (several when the weight is a stacked group's)
    tables: set[str] = dataclasses.field(default_factory=set)

    def run(self) -> dict[Path, torch.Tensor]:
        """Look the batch up: each feature's activations ``[*out_shape, D]`` by its position."""
        items, dim = self.items, self.weight.shape[1]
        if items[0][1].offsets is not None:
            return self._run_jagged()
        pieces = self._lookup(torch.cat, tuple(b.ids.shape[0] for _, b in items))
        # (no reshape of a piece already in shape: each would add a node to the backward)
        return {path: piece if piece.shape == (*b.out_shape, dim) else piece.reshape(*b.out_shape, dim)
                for (path, b), piece in zip(items, pieces, strict=True)}

    def move_ahead(self) -> None:
        """Move the items' host bags to the table's device now, without a device op (``ahead`` planning)."""
        where = self.weight.device
        self.items = [(path, dataclasses.replace(
            b, ids=upload(b.ids, where), valid=upload(b.valid, where),
            weights=None if b.weights is None else upload(b.weights, where),
            offsets=None if b.offsets is None else upload(b.offsets, where))) for path, b in self.items]
        self.resident = True

    def device_tensors(self) -> list[torch.Tensor]:
        """The tensors :meth:`move_ahead` moved (CUDA: recorded on the stream that uses them)."""
        return [t for _, b in self.items for t in (b.ids, b.valid, b.weights, b.offsets) if t is not None]

    def side_by_side(self) -> bool:
        """Whether :meth:`run_side_by_side` can look the batch up: padded bags, each item ``[B]`` bags, one ``B``."""
        shapes = {b.out_shape for _, b in self.items}
        return self.items[0][1].offsets is None and len(shapes) == 1 and len(next(iter(shapes))) == 1

    def run_side_by_side(self) -> torch.Tensor:
        """The items' activations side by side, ``[B, F·D]`` (``F`` items in order): the bags looked up
        batch-major (bag ``b`` of every item, then bag ``b + 1``), so one ``embedding_bag`` writes what a
        ``torch.cat`` of :meth:`run`'s outputs would copy, and the backward gets its gradient as one tensor."""
        items, b = self.items, self.items[0][1].out_shape[0]

        def interleave(parts: list[torch.Tensor]) -> torch.Tensor:  # [B, L] each -> [B·F, L], batch-major
            return torch.stack(parts, dim=1).reshape(b * len(parts), *parts[0].shape[1:])

        (out,) = self._lookup(interleave, None)
        return out.view(b, len(items) * out.shape[1])

    def _lookup(self, join: Any, splits: tuple[int, ...] | None) -> tuple[torch.Tensor, ...]:
        """:func:`lookup` of the items' bags joined by ``join`` (several items) into one ``[N, L]``."""
        weight, items, dtype = self.weight, self.items, self.weight.dtype
        if len(items) == 1:
            ids, w = items[0][1].ids, items[0][1].weights
        else:
            ids = join([b.ids for _, b in items])
            w = None
            if any(b.weights is not None for _, b in items):
                w = join([b.valid.to(dtype) if b.weights is None else b.weights for _, b in items])
        if not self.resident:  # one transfer of the batch's ids (and weights)
            ids = upload(ids, weight.device)
            w = None if w is None else upload(w, weight.device)
        return bags_lookup(weight, ids, w, self.combiner, self.row_grad, self.tables, all(b.full for _, b in items),
                           splits)

    def _run_jagged(self) -> dict[Path, torch.Tensor]:
        """:meth:`run` for jagged bags (eager devices): one pooled lookup of every item's ids, unpadded."""
        weight, items, dtype = self.weight, self.items, self.weight.dtype
        offsets = [b.offsets for _, b in items]
        ids = torch.cat([b.ids for _, b in items]) if len(items) > 1 else items[0][1].ids
        w = None
        if any(b.weights is not None for _, b in items):
            w = torch.cat([torch.ones(b.ids.shape, dtype=compute_dtype(dtype), device=b.ids.device)
                           if b.weights is None else b.weights for _, b in items])
        counts = [int(o.numel()) - 1 for o in offsets if o is not None]
        starts = [0]
        for _, b in items[:-1]:  # each item's first id in the batch (no read of a device tensor)
            starts.append(starts[-1] + b.ids.numel())
        whole = torch.cat([o[:-1] + s for o, s in zip(offsets, starts, strict=True) if o is not None]
                          + [torch.full((1,), ids.numel(), dtype=torch.int64, device=ids.device)])
        ids, whole = upload(ids, weight.device), upload(whole, weight.device)
        w = None if w is None else upload(w, weight.device)
        # output_size: one bag per id, known without reading ``whole`` (a compiled graph keeps one size).
        bag = torch.repeat_interleave(torch.arange(sum(counts), device=ids.device), whole.diff(),
                                      output_size=ids.numel())
        pieces = jagged_lookup(weight, ids, w, self.combiner, bag, whole, self.row_grad, self.tables, tuple(counts))
        dim = weight.shape[1]
        return {path: piece.reshape(*b.out_shape, dim) for (path, b), piece in zip(items, pieces, strict=True)}


def id_shapes(batches: list[Any]) -> tuple[tuple[int, ...], ...] | None:
    """The shapes of a lookup's ids (``LookupBatch``es and assembled groups), batch by batch: what its row gradients
    hold, fixed by the input's shape; ``None`` where some features are jagged (their counts follow the data)."""
    shapes: list[tuple[int, ...]] = []
    for batch in batches:
        if isinstance(batch, LookupBatch):
            if any(b.offsets is not None for _, b in batch.items):
                return None
            shapes += [tuple(b.ids.shape) for _, b in batch.items]
        else:
            shapes += [tuple(t.shape) for t in batch.device_tensors()[:1]]
    return tuple(shapes)


def side_by_side(batches: list[Any], order: list[tuple[Path, str]], concat: Any = True) -> torch.Tensor:
    """Every feature's ``[B, D_f]`` activations side by side, ``[B, Σ D_f]``, in ``order`` (position, name).

    A :class:`LookupBatch` of several features next to each other in ``order`` is looked up side by side
    (:meth:`LookupBatch.run_side_by_side`); the rest is looked up as usual and concatenated. One batch of every
    feature (tables stacked into one group, the features of one bag width and combiner) copies nothing.
    ``concat``: the caller's argument (``EmbeddingCollection.forward``'s), which must be ``True``.
    """
    if concat is not True:
        raise TypeError(f"Argument `concat` must be a bool; received {concat!r}.")
    if len(batches) == 1 and hasattr(batches[0], "run_side_by_side"):  # every feature in one batch (a group)
        items = batches[0].items
        if 1 < len(items) == len(order) and [p for p, _ in items] == [p for p, _ in order] \
                and batches[0].side_by_side():  # (in order, every feature [B], one B: nothing below to check)
            out: torch.Tensor = batches[0].run_side_by_side()
            return out
    shapes = {path: bags.out_shape for batch in batches  # (a routed lookup holds LookupBatches)
              for b in getattr(batch, "batches", [batch]) for path, bags in b.items}
    for path, shape in shapes.items():  # checked before anything is looked up
        if len(shape) != 1:
            raise ValueError(f"concat=True needs every feature's activations as [B, D]; feature `{dict(order)[path]}` "
                             f"gives {[*shape, 'D']} (a sequence feature or an output_shape). Look it up without "
                             f"concat, or in a collection of its own.")
    if len({s[0] for s in shapes.values()}) > 1:
        names = dict(order)
        raise ValueError("concat=True needs one batch size B for every feature; got "
                         + ", ".join(f"`{names[p]}`: {s[0]}" for p, s in shapes.items()) + ".")
    position = {path: i for i, (path, _) in enumerate(order)}
    blocks: dict[int, tuple[int, torch.Tensor]] = {}  # first feature's index -> (features, [B, F·D])
    outputs: dict[Path, torch.Tensor] = {}
    for batch in batches:
        # (a LookupBatch or an assembly.AssembledBatch; a routed lookup is looked up as usual)
        at = [position[p] for p, _ in batch.items] if hasattr(batch, "run_side_by_side") else []
        if len(at) > 1 and at == list(range(at[0], at[0] + len(at))) \
                and batch.side_by_side():
            blocks[at[0]] = (len(at), batch.run_side_by_side())
        else:
            outputs.update(batch.run())
    parts, i = [], 0
    while i < len(order):
        if i in blocks:
            parts.append(blocks[i][1])
            i += blocks[i][0]
            continue
        parts.append(outputs[order[i][0]])
        i += 1
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
