"""Variable-length inputs (jagged values + offsets, sparse COO) as bag coordinates, checked on the host:
the first step of :func:`torch_tpu_embedding.inputs.to_bags` for those forms."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

from torch_tpu_embedding._util.input_checks import check_sparse_indices
from torch_tpu_embedding._util.input_checks import check_weights as _check_weights
from torch_tpu_embedding._util.input_checks import err as _err
from torch_tpu_embedding._util.input_checks import tracing as _tracing

__all__ = ["JAGGED", "JaggedNames", "RowPos", "from_nested", "from_offsets", "from_sparse", "nested_entries",
           "nested_weights"]


@dataclasses.dataclass(frozen=True)
class JaggedNames:
    """A jagged input's parts as its errors name them: what the user passed. ``tte.Jagged``'s fields
    (``Jagged lengths``), or, with ``methods``, the methods of the user's TorchRec ``JaggedTensor`` under its own type
    name ``form`` (``JaggedTensor lengths()``, ``JaggedTensor weights_or_none()``)."""

    form: str = "Jagged"
    methods: bool = False

    def __call__(self, part: str) -> str:
        """``part`` (``values``, ``offsets``, ``lengths`` or ``weights``) as the user gave it."""
        if not self.methods:
            return f"{self.form} {part}"
        return f"{self.form} {'weights_or_none' if part == 'weights' else part}()"


#: ``tte.Jagged``'s parts
JAGGED = JaggedNames()


@dataclasses.dataclass
class RowPos:
    """Variable-length bags as coordinates: id ``vals[k]`` sits in bag ``row[k]`` at ``pos[k]``."""

    row: torch.Tensor
    pos: torch.Tensor  # position used for sequences (column index for sparse, rank for jagged)
    rank: torch.Tensor  # 0-based rank of the id inside its bag (for packing combined bags)
    vals: torch.Tensor
    weights: torch.Tensor | None
    leading: tuple[int, ...]  # bag grid: prod(leading) bags


def from_offsets(
    feature: str, values: torch.Tensor, offsets: torch.Tensor, weights: torch.Tensor | None,
    names: JaggedNames | None = None, by_lengths: bool = False,
) -> RowPos:
    """Bags ``[offsets[b], offsets[b+1])`` of ``values``; ``names``: the parts as the user's input names them (else
    generic words), ``by_lengths``: ``offsets`` are the running sum of lengths the user gave (checked >= 0)."""
    vals, offs = ("jagged values", "offsets") if names is None else (names("values"), names("offsets"))
    if values.dim() != 1:
        raise _err(feature, f"{vals} must be 1-D. Received shape {tuple(values.shape)}")
    if offsets.dim() != 1 or offsets.numel() < 1:
        raise _err(feature, f"{offs} must be 1-D with B+1 entries. Received shape {tuple(offsets.shape)}")
    offsets = offsets.to(torch.int64)
    lengths = offsets[1:] - offsets[:-1]
    # Values are read where they exist: not while torch.compile / torch.export trace (as inputs.py checks ids).
    if not _tracing() and (int(offsets[0]) != 0 or int(offsets[-1]) != values.numel() or bool((lengths < 0).any())):
        got = lengths if by_lengths else offsets
        # A tte.Jagged given lengths is named as the user wrote it (its offsets are ours, made from them).
        by = JAGGED if names is None else names
        raise _err(
            feature,
            (f"{by('lengths')} must add up to len({by('values')})={values.numel()}"  # (>= 0: checked by the caller)
             if by_lengths else
             f"{offs} must start at 0, be non-decreasing and end at len({vals if names else 'values'})="
             f"{values.numel()}") + f". Received: {_shown(got)}",
        )
    b = lengths.numel()
    # output_size: the count it has (checked above), known without reading lengths, so a compiled
    # graph keeps one size for the ids and their bags.
    row = torch.repeat_interleave(torch.arange(b), lengths, output_size=values.numel())
    rank = torch.arange(values.numel()) - offsets[:-1][row]
    if weights is not None:
        _check_weights(feature, weights, tuple(values.shape), "the jagged values" if names is None else vals)
    return RowPos(row, rank, rank, values, weights, (b,))


def _layout(nt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A jagged nested tensor's ``(offsets(), lengths())`` (methods torch's type stubs do not list)."""
    jagged: Any = nt
    return jagged.offsets(), jagged.lengths()


def nested_entries(nt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """A jagged nested tensor's own entries as host ``(values, offsets)``, and their positions in its ``values()``
    (``None``: all of them, in order). One with holes (built with ``lengths=``, or by ``torch.nested.narrow``)
    holds row ``b`` at ``values()[offsets[b] : offsets[b] + lengths[b]]``; the entries between rows are not its
    own (``unbind()`` leaves them out), so they are never ids or weights."""
    offsets, lengths = _layout(nt)
    values, offsets = nt.values().cpu(), offsets.cpu()
    if lengths is None:
        return values, offsets, None
    lengths = lengths.cpu().to(torch.int64)
    packed = torch.cat([lengths.new_zeros(1), torch.cumsum(lengths, 0)])
    row = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)
    take = offsets[:-1].to(torch.int64)[row] + torch.arange(row.numel()) - packed[:-1][row]
    return values[take], packed, take


def _shown(t: torch.Tensor) -> object:
    """``t`` as an error message shows it: its entries where few, else the tensor's own (abridged) form."""
    return t.tolist() if t.numel() <= 16 else t


def nested_weights(feature: str, w: torch.Tensor, offsets: torch.Tensor, what: str) -> torch.Tensor:
    """The entries of nested weights ``what`` given beside jagged ids (``offsets``: the ids' ``[B+1]``), which must
    hold the ids' bags: of the same count and total alone, a weight would weigh an id of another bag than its own."""
    entries, packed, _ = nested_entries(w)
    offsets = offsets.cpu().to(torch.int64)
    if not _tracing() and not torch.equal(packed.to(torch.int64), offsets):
        raise _err(feature, f"{what}, a nested tensor, must hold the bags of the ids: bag lengths "
                   f"{_shown(offsets.diff())}. Received bag lengths {_shown(packed.diff())}")
    return entries


def from_nested(feature: str, nt: torch.Tensor, w: torch.Tensor | None) -> RowPos:
    """A 2-D jagged nested tensor's bags (holes left out); ``w``: nested weights of its offsets and lengths, or
    one weight per entry of its ``values()``."""
    ids, offsets, take = nested_entries(nt)
    if isinstance(w, torch.Tensor) and w.is_nested:
        (wo, wl), (io, il) = _layout(w), _layout(nt)
        if not (torch.equal(wo.cpu(), io.cpu()) and (wl is None) == (il is None)
                and (wl is None or il is None or torch.equal(wl.cpu(), il.cpu()))):
            raise _err(feature, "nested weights must have the same offsets (and lengths) as the ids")
        w = nested_entries(w)[0]
    elif w is not None and take is not None:  # (the ids' holes have weights too: left out with them)
        if w.layout != torch.strided or tuple(w.shape) != tuple(nt.values().shape):  # (its error: layout, shape)
            _check_weights(feature, w, tuple(nt.values().shape), "the nested ids' values()")
        w = w.cpu()[take]
    return from_offsets(feature, ids, offsets, None if w is None else w.cpu())


def from_sparse(feature: str, sp: torch.Tensor, wsp: torch.Tensor | None) -> RowPos:
    if sp.dim() < 2:
        raise _err(feature, f"a sparse input must have rank >= 2. Received shape {tuple(sp.shape)}")
    if sp.dense_dim():  # (its values are rows, not ids: its indices would be read as the bags' and positions')
        raise _err(feature, f"a sparse input must hold one id at each index, as tf.SparseTensor does (dense_dim() 0). "
                   f"Received a hybrid sparse COO tensor of shape {tuple(sp.shape)} with {sp.dense_dim()} dense "
                   f"dim(s) (values of shape {tuple(sp._values().shape)}): build it with "
                   "torch.sparse_coo_tensor(indices, ids) over every dim, or give the bags as Jagged or Padded")
    idx, vals = sp._indices(), sp._values()
    leading = tuple(sp.shape[:-1])
    # Linear bag index over the leading dims, then sort entries by (bag, column) as TF requires.
    row = torch.zeros(idx.shape[1], dtype=torch.int64)
    for d, size in enumerate(leading):
        row = row * size + idx[d]
    col = idx[-1]
    key = row * sp.shape[-1] + col
    order = torch.argsort(key, stable=True)
    check_sparse_indices(feature, idx, tuple(sp.shape), key[order])
    row, col, vals = row[order], col[order], vals[order]
    w = None
    if wsp is not None:
        if not (isinstance(wsp, torch.Tensor) and wsp.layout == torch.sparse_coo):
            raise TypeError(
                f"Weight for `{feature}` is type {type(wsp).__name__} "
                f"({getattr(wsp, 'layout', '-')}) which does not match type input which is a "
                "sparse COO tensor."
            )
        if wsp.shape != sp.shape or not torch.equal(wsp._indices(), sp._indices()):
            raise _err(feature, "sparse weights must have the same shape and indices as the ids")
        # In index order: coalesce() sorts the (unique, checked above) indices as `order` does, and
        # unlike _values() it carries a gradient back to weights that require one.
        w = wsp.coalesce().values() if wsp.requires_grad else wsp._values()[order]
        _check_weights(feature, w, tuple(vals.shape), "the sparse values")
    counts = torch.bincount(row, minlength=math.prod(leading))
    starts = torch.cumsum(counts, 0) - counts
    rank = torch.arange(vals.numel()) - starts[row]
    return RowPos(row, col, rank, vals, w, leading)
