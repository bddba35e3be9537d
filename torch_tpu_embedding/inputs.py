"""Input forms, and their normalisation to fixed-capacity padded bags.

Every feature input becomes :class:`Bags`: ``ids [N, L]`` (padding = the table's sentinel id),
a validity mask and optional per-id weights ``[N, L]``. ``N`` is the number of output positions and
``L`` the bag capacity. Accepted forms, per feature:

======================  ===================================================  =====================
form                    what it is                                           weights
======================  ===================================================  =====================
dense ``Tensor``        ``[B]`` or ``[B, ..., 1]`` int ids, one per output    rejected (always 1)
:class:`Jagged`         ``values [nnz]`` + ``offsets [B+1]`` or ``lengths``   ``[nnz]``
nested jagged tensor    ``torch.nested`` with ``layout=torch.jagged``         same offsets
sparse COO ``Tensor``   ``[B, L]`` (or ``[B, ..., L]``) like tf.SparseTensor  COO, same indices
:class:`Padded`         ``ids [B, L]`` + ``mask [B, L]`` (True = real id)     ``[B, L]``
======================  ===================================================  =====================

Variable-length forms are normalised on the host (they must be CPU tensors when the table is on
XLA), so that the device sees static shapes; on eager devices combined bags stay jagged (unpadded).
:class:`Padded` and dense inputs may already live on the device. A bag with more ids than
``FeatureConfig.max_ids_per_bag`` is an error, never truncated.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from typing import Any

import torch

from torch_tpu_embedding._util.dtypes import compute_dtype
from torch_tpu_embedding._util.input_checks import check_ids as _check_ids
from torch_tpu_embedding._util.input_checks import (
    check_index_dtype,
    check_tensor,
    check_weights_fit,
)
from torch_tpu_embedding._util.input_checks import check_weights as _check_weights
from torch_tpu_embedding._util.input_checks import err as _err
from torch_tpu_embedding._util.input_checks import tracing as _tracing
from torch_tpu_embedding._util.input_forms import JAGGED, JaggedNames, nested_weights
from torch_tpu_embedding._util.input_forms import RowPos as _RowPos
from torch_tpu_embedding._util.input_forms import from_nested as _from_nested
from torch_tpu_embedding._util.input_forms import from_offsets as _from_offsets
from torch_tpu_embedding._util.input_forms import from_sparse as _from_sparse
from torch_tpu_embedding.config import FeatureConfig

__all__ = ["Bags", "Jagged", "Padded", "to_bags"]


@dataclasses.dataclass(frozen=True)
class Jagged:
    """Variable-length bags as flat ``values`` plus ``offsets`` (``[B+1]``) or ``lengths`` (``[B]``).

    Example::

        >>> Jagged(torch.tensor([1, 2, 3, 3, 5]), lengths=torch.tensor([2, 0, 3]))  # 3 bags
        Jagged(...)
    """

    values: torch.Tensor
    offsets: torch.Tensor | None = None
    lengths: torch.Tensor | None = None
    weights: torch.Tensor | None = None


@dataclasses.dataclass(frozen=True)
class Padded:
    """Bags padded to a fixed width: ``ids [B, L]``, ``mask [B, L]`` (True = real id; ``None`` = all).

    The cheapest form on XLA: it can be built on the device and needs no host work. Where the mask holds no
    id, neither the id nor the weight is read: either may be any value.
    """

    ids: torch.Tensor
    mask: torch.Tensor | None = None
    weights: torch.Tensor | None = None


@dataclasses.dataclass(frozen=True)
class Bags:
    """A feature normalised for lookup.

    Attributes:
        ids: ``[N, L]`` int64 row ids; padding positions hold ``sentinel``.
        valid: ``[N, L]`` bool, True at real ids.
        weights: ``[N, L]`` per-id weights (any value at padding), or ``None`` for unit weights.
        out_shape: activation shape without ``D``; ``prod(out_shape) == N``.
        combine: True → reduce each row of ``ids`` with the table's combiner; False → ``L == 1``
            and each position is looked up as is (dense and sequence features).
        offsets: jagged bags (variable-length inputs on eager devices, never padded): ``ids``,
            ``valid`` and ``weights`` are ``[nnz]`` in bag order and bag ``n`` is ``[offsets[n],
            offsets[n+1])``; ``None`` for padded bags.
        full: every position holds a real id, known without reading ``valid`` (dense ids): no padding.
    """

    ids: torch.Tensor
    valid: torch.Tensor
    weights: torch.Tensor | None
    out_shape: tuple[int, ...]
    combine: bool
    offsets: torch.Tensor | None = None
    full: bool = False


def _next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def _check_strided(feature: str, what: str, t: torch.Tensor | None, form: str) -> None:
    """A part of a ``Padded`` or ``Jagged`` input must be a dense (strided) tensor, not a nested or sparse one."""
    if t is not None and (t.layout != torch.strided or t.is_nested):
        raise _err(feature, f"{what} must be a dense (strided) tensor. Received a "
                   f"{'nested' if t.is_nested else str(t.layout).removeprefix('torch.')} tensor: pass variable-length "
                   f"bags as the feature's input itself (Jagged of dense tensors, sparse COO or a torch.nested jagged "
                   f"tensor), not inside {form}")


def _normalise_variable(
    feature: str, value: object, weight: torch.Tensor | None, names: JaggedNames = JAGGED
) -> _RowPos | Padded:
    """Variable-length forms → :class:`_RowPos` on the host; :class:`Padded` is passed through. ``names``: a
    :class:`Jagged`'s parts as the user gave them (the methods of a TorchRec ``JaggedTensor`` it was made of)."""
    if isinstance(value, Padded):
        for what, t in (("Padded ids", value.ids), ("Padded mask", value.mask), ("Padded weights", value.weights)):
            check_tensor(feature, what, t)
            _check_strided(feature, what, t, "Padded")
        if weight is not None and value.weights is not None:
            raise _err(feature, "weights given twice (inside Padded and in `weights`)")
        return value if weight is None else dataclasses.replace(value, weights=weight)
    if isinstance(value, Jagged):
        # Its padding on the host has data-dependent shapes. The flag, not torch.compiler.is_exporting():
        # dynamo (torch.compile of a Jagged lookup) cannot trace that function on torch 2.9; it reads the flag.
        if torch.compiler._is_exporting_flag:
            raise _err(feature, f"torch.export cannot trace a {names.form} input: give the bags as Padded(ids, mask) "
                       "(docs/guide.md section 9)")
        if weight is not None and value.weights is not None:
            raise _err(feature, f"weights given twice ({names('weights')} and `weights`)")
        w = weight if weight is not None else value.weights
        for part, t in (("values", value.values), ("offsets", value.offsets), ("lengths", value.lengths)):
            check_tensor(feature, names(part), t)
            _check_strided(feature, names(part), t, names.form)
        check_tensor(feature, names("weights"), w)  # (they may be nested: the ids' offsets, checked below)
        if (value.offsets is None) == (value.lengths is None):
            raise _err(feature, "Jagged needs exactly one of `offsets` and `lengths`")
        if value.offsets is not None:
            offsets = value.offsets
            check_index_dtype(feature, names("offsets"), offsets)
        else:
            lengths = value.lengths
            assert lengths is not None  # for type checkers; guarded just above
            check_index_dtype(feature, names("lengths"), lengths)
            if lengths.dim() != 1 or (not _tracing() and bool((lengths < 0).any())):  # (values: see _check_ids)
                raise _err(feature, f"{names('lengths')} must be 1-D and >= 0. Received: {lengths}")
            offsets = torch.cat([lengths.new_zeros(1), torch.cumsum(lengths, 0)])
        if isinstance(w, torch.Tensor) and w.is_nested:
            w = nested_weights(feature, w, offsets, names("weights") if weight is None else "the weights")
        return _from_offsets(feature, value.values.cpu(), offsets.cpu(), None if w is None else w.cpu(),
                             None if names is JAGGED else names, value.lengths is not None)
    assert isinstance(value, torch.Tensor)
    if value.is_nested:
        if value.layout != torch.jagged or value.dim() != 2:
            raise _err(feature, "nested inputs must be 2-D torch.nested tensors with layout=torch.jagged")
        return _from_nested(feature, value, weight)
    if value.layout != torch.sparse_coo:
        raise _err(feature, f"sparse inputs must be sparse COO tensors (tf.SparseTensor's layout). Received layout "
                   f"{value.layout}: convert it with .to_sparse_coo()")
    return _from_sparse(feature, value.cpu(), None if weight is None else weight.cpu())


def _sequence_weights(feature: str, fc: FeatureConfig, positions: int) -> ValueError:
    """TF's error for weights of a sequence feature, with what makes it one: an ``output_shape`` of ``k·B`` positions
    makes a sequence of a feature without ``max_sequence_length`` (TF ignores its weights; they are refused here)."""
    why = (f"max_sequence_length={fc.max_sequence_length}" if fc.is_sequence or fc.output_shape is None else
           f"output_shape {tuple(fc.output_shape)} holds {positions} positions per bag: prod(output_shape) is "
           f"{positions} × the batch, so each bag's ids are looked up one per position, not combined")
    return ValueError(f"Weight specified for `{feature}`, but this is a sequence feature ({why}). A sequence takes "
                      "no weights: give its input without weights (None for it in `weights`).")


def _jagged_tensor(value: object) -> Jagged | None:
    """TorchRec's ``JaggedTensor`` (a value of ``KeyedJaggedTensor.to_dict()``), or any object with its ``values()``,
    ``lengths()`` or ``offsets()`` and ``weights_or_none()``, as the :class:`Jagged` of its parts; ``None``: not one
    (a mapping, which has ``values()`` too, never is)."""
    jt: Any = value
    if not callable(getattr(jt, "values", None)) or callable(getattr(jt, "keys", None)):
        return None
    lengths = jt.lengths() if callable(getattr(jt, "lengths", None)) else None
    offsets = jt.offsets() if lengths is None and callable(getattr(jt, "offsets", None)) else None
    if lengths is None and offsets is None:
        return None
    weights = jt.weights_or_none() if callable(getattr(jt, "weights_or_none", None)) else None
    return Jagged(jt.values(), offsets=offsets, lengths=lengths, weights=weights)


def _mode(feature: str, fc: FeatureConfig, leading: tuple[int, ...]) -> tuple[bool, int, tuple[int, ...]]:
    """Resolve TF's output-shape rules (§2.4) → (combine, seq_len, out_shape)."""
    b = math.prod(leading)
    os = fc.output_shape
    sequence = fc.is_sequence
    if sequence and len(leading) != 1:
        # TF's enqueue and CPU lookup alike: a sparse input of rank > 2 combines its bags as any feature's do
        # and max_sequence_length is ignored, with a warning (weights stay rejected: to_bags).
        warnings.warn(f"Feature `{feature}`: max_sequence_length={fc.max_sequence_length} is ignored: the "
                      f"input is of rank {len(leading) + 1}, and only rank 2 inputs are sequences", stacklevel=2)
        sequence = False
    if os is None:
        if sequence:
            return False, fc.max_sequence_length, (b, fc.max_sequence_length)
        return True, 0, leading
    p = math.prod(os)
    if sequence:
        if p != b * fc.max_sequence_length:
            raise _err(
                feature,
                f"Inconsistent shape: output_shape is set to {tuple(os)} but the input gives "
                f"{(b, fc.max_sequence_length)} (batch {b} × max_sequence_length).",
            )
        return False, fc.max_sequence_length, tuple(os)
    if p == b:
        return True, 0, tuple(os)
    if b > 0 and p % b == 0 and len(leading) == 1:
        return False, p // b, tuple(os)
    raise ValueError(
        f"Output shape set in the FeatureConfig should be the factor of the input data batch size. "
        f"But instead got output shape {tuple(os)}, input data batch size {b} (feature `{feature}`)."
    )


def to_bags(
    feature: str,
    fc: FeatureConfig,
    value: object,
    weight: torch.Tensor | None,
    *,
    sentinel: int,
    device: torch.device,
    dtype: torch.dtype,
    static: bool | None = None,
    offset: int = 0,
    table: str | None = None,
) -> Bags:
    """Normalise one feature's input (and optional weights) to :class:`Bags` on ``device``.

    Args:
        feature: the feature's name, for error messages.
        fc: its :class:`FeatureConfig`.
        value: one of the input forms in this module's table.
        weight: per-id weights in the form matching ``value`` (or ``None``).
        sentinel: the id that marks padding (the table's physical row count).
        device, dtype: where the bags are built (the table's device, or the host for a batched
            transfer) and the table's float dtype.
        static: whether the table needs static shapes (default: ``device`` is XLA); bag widths of
            variable-length inputs are then rounded up to a power of two.
        offset: added to every real id after its range check (a stacked table's first row in its
            group), in the same pass that writes the sentinel at padding.
        table: the name of the feature's table in the collection, for the range error.
    """
    vocab = fc.table.num_embeddings
    static = device.type == "xla" if static is None else static
    check_tensor(feature, "the weights", weight)
    if isinstance(value, torch.Tensor) and value.layout == torch.strided and not value.is_nested:
        return _dense_bags(feature, fc, value, weight, vocab, device, offset, table)
    names = JAGGED
    if not isinstance(value, (Jagged, Padded, torch.Tensor)):
        given, value = type(value).__name__, _jagged_tensor(value)
        if value is None:
            raise TypeError(
                f"Feature `{feature}`: unsupported input type {given}. Use a dense id tensor, Jagged, Padded, a "
                "sparse COO tensor, a torch.nested jagged tensor or TorchRec's JaggedTensor."
            )
        names = JaggedNames(given, methods=True)  # (its errors name its methods, not the Jagged made of them)
    if static and not isinstance(value, Padded):
        tensors: list[object] = (
            [value] if isinstance(value, torch.Tensor) else [value.values, value.offsets, value.lengths]
        )
        if any(isinstance(t, torch.Tensor) and t.device.type == "xla" for t in tensors):
            raise _err(
                feature,
                "variable-length inputs must be host (CPU) tensors when the table is on XLA: "
                "they are padded on the host to a static shape. Pass CPU tensors, or a Padded input.",
            )
    rp = _normalise_variable(feature, value, weight, names)
    if isinstance(rp, Padded):
        return _padded_bags(feature, fc, rp, vocab, sentinel, device, dtype, offset, table)
    _check_ids(feature, rp.vals, vocab, table)
    combine, seq_len, out_shape = _mode(feature, fc, rp.leading)
    nbags = math.prod(rp.leading)
    # (a sequence feature combining a rank > 2 input too, as TF's CPU lookup rejects them by the config alone)
    if (not combine or fc.is_sequence) and rp.weights is not None:
        raise _sequence_weights(feature, fc, seq_len)
    if not combine:
        keep = rp.pos < seq_len
        ids2d = torch.full((nbags, seq_len), sentinel, dtype=torch.int64)
        ids2d[rp.row[keep], rp.pos[keep]] = rp.vals[keep].to(torch.int64) + offset
        ids = ids2d.reshape(-1, 1)
        return Bags(ids.to(device), (ids != sentinel).to(device), None, out_shape, False)
    cap = fc.max_ids_per_bag
    # The longest bag, read on the host: the padded width and the capacity check need it; the eager
    # jagged lookup does not, and while torch.compile traces there is no value to read.
    read = rp.rank.numel() and (static or (cap is not None and not _tracing()))
    longest = int(rp.rank.max()) + 1 if read else 0
    if cap is not None:
        if longest > cap:
            raise _err(
                feature,
                f"a bag holds {longest} ids, more than max_ids_per_bag={cap}. Raise the capacity; "
                "ids are never dropped silently.",
            )
        width = cap
    else:
        width = _next_pow2(longest)
    if not static:  # eager: jagged, straight to the pooled lookup (memory follows the ids, not the longest bag)
        ids = rp.vals.to(device=device, dtype=torch.int64, copy=True).add_(offset)  # never the caller's buffer
        if rp.weights is not None:
            check_weights_fit(feature, rp.weights, dtype)
        w = None if rp.weights is None else rp.weights.to(device=device, dtype=compute_dtype(dtype))
        counts = torch.bincount(rp.row, minlength=nbags)
        offsets = torch.cat([counts.new_zeros(1), torch.cumsum(counts, 0)]).to(device)
        return Bags(ids, torch.ones_like(ids, dtype=torch.bool), w, out_shape, True, offsets)
    ids2d = torch.full((nbags, width), sentinel, dtype=torch.int64)
    ids2d[rp.row, rp.rank] = rp.vals.to(torch.int64) + offset
    w2d = None
    if rp.weights is not None:  # in the combiner's compute dtype (float32 for 16-bit tables)
        check_weights_fit(feature, rp.weights, dtype)
        w2d = torch.zeros((nbags, width), dtype=compute_dtype(dtype))
        w2d[rp.row, rp.rank] = rp.weights.to(w2d.dtype)
        w2d = w2d.to(device)
    return Bags(ids2d.to(device), (ids2d != sentinel).to(device), w2d, out_shape, True)


def _dense_bags(
    feature: str,
    fc: FeatureConfig,
    value: torch.Tensor,
    weight: torch.Tensor | None,
    vocab: int,
    device: torch.device,
    offset: int = 0,
    table: str | None = None,
) -> Bags:
    if fc.is_sequence:
        raise _err(feature, "is a sequence feature but a dense tensor was passed. Use Jagged, "
                   "Padded, a sparse COO or a nested jagged tensor.")
    if weight is not None:
        raise ValueError(
            f"Weight specified for `{feature}`, but input is dense. Weight will always be 1 in "
            "this case; use Padded or Jagged inputs for weighted bags."
        )
    if value.dim() == 0:
        raise _err(feature, "dense ids must have rank >= 1. Received a scalar.")
    if value.dim() >= 2 and value.shape[-1] != 1:
        raise _err(
            feature,
            "Rank 2 or above dense tensor should have last dimension as 1 as the last dimension "
            f"will always be reduced. Received shape {tuple(value.shape)}. For bags of ids use "
            "Padded(ids, mask) or Jagged.",
        )
    _check_ids(feature, value, vocab, table)
    natural = tuple(value.shape) if value.dim() == 1 else tuple(value.shape[:-1])
    out_shape = natural
    if fc.output_shape is not None:
        if math.prod(fc.output_shape) != math.prod(natural):
            raise _err(
                feature,
                f"Inconsistent shape: output_shape is set to {tuple(fc.output_shape)} but the "
                f"dense input gives {natural}.",
            )
        out_shape = tuple(fc.output_shape)
    # A new tensor, never the caller's: the ids wait in the table's pending gradient until the
    # optimizer step, and a loader may refill its buffer before then (gradient accumulation).
    ids = value.reshape(-1, 1)
    if offset and ids.dtype == torch.int64 and ids.device == device:
        ids = ids + offset  # (the copy and the offset in one pass)
    else:
        ids = ids.to(device=device, dtype=torch.int64, copy=True)
        if offset:
            ids += offset
    return Bags(ids, torch.ones_like(ids, dtype=torch.bool), None, out_shape, False, full=True)


def _padded_bags(
    feature: str,
    fc: FeatureConfig,
    p: Padded,
    vocab: int,
    sentinel: int,
    device: torch.device,
    dtype: torch.dtype,
    offset: int = 0,
    table: str | None = None,
) -> Bags:
    ids = p.ids
    if ids.dim() != 2:
        raise _err(feature, f"Padded ids must be [B, L]. Received shape {tuple(ids.shape)}")
    mask = p.mask
    if mask is not None:
        if mask.dtype != torch.bool or tuple(mask.shape) != tuple(ids.shape):
            raise _err(
                feature,
                f"Padded mask must be a bool tensor of the ids' shape {tuple(ids.shape)}. "
                f"Received {mask.dtype} {tuple(mask.shape)}",
            )
        if ids.device.type != "xla" and mask.device != ids.device:  # host ids are checked under their mask
            raise _err(
                feature,
                "Padded host ids need their mask on the same device (the ids are checked under the mask on "
                f"the host). Received ids on {ids.device}, mask on {mask.device}: pass both host tensors (the "
                "lookup moves them) or both device tensors",
            )
    if ids.device.type != "xla":
        _check_ids(feature, ids if mask is None or _tracing() else ids[mask], vocab, table)
    elif ids.dtype.is_floating_point:
        _check_ids(feature, ids, vocab)  # dtype error only
    if p.weights is not None:
        _check_weights(feature, p.weights, tuple(ids.shape), "the padded ids", mask)
        check_weights_fit(feature, p.weights, dtype, mask)
    combine, seq_len, out_shape = _mode(feature, fc, (ids.shape[0],))
    # Without a mask nothing below copies: copy here, so the ids kept for the optimizer step are
    # never the caller's tensor (as for dense ids).
    ids = ids.to(device=device, dtype=torch.int64, copy=mask is None)
    if offset:  # a stacked table's first row in its group; positions outside the mask become the sentinel below
        ids = ids.add_(offset) if mask is None else ids + offset  # in place only on this function's copy
    valid = torch.ones_like(ids, dtype=torch.bool) if mask is None else mask.to(device)
    if combine and fc.max_ids_per_bag is not None and ids.shape[1] > fc.max_ids_per_bag:
        raise _err(
            feature,
            f"Padded width {ids.shape[1]} exceeds max_ids_per_bag={fc.max_ids_per_bag}.",
        )
    if not combine:
        if p.weights is not None:
            raise _sequence_weights(feature, fc, seq_len)
        width = ids.shape[1]
        if width >= seq_len:
            ids, valid = ids[:, :seq_len], valid[:, :seq_len]
        else:
            pad = seq_len - width
            ids = torch.nn.functional.pad(ids, (0, pad), value=sentinel)
            valid = torch.nn.functional.pad(valid, (0, pad), value=False)
        ids = torch.where(valid, ids, sentinel).reshape(-1, 1)
        return Bags(ids, valid.reshape(-1, 1), None, out_shape, False)
    if mask is not None:
        ids = torch.where(valid, ids, sentinel)
    w = None if p.weights is None else p.weights.to(device=device, dtype=compute_dtype(dtype))
    if w is not None and p.weights is not None and p.weights.device.type == "xla" and w.device.type != "xla":
        _check_weights(feature, w, tuple(ids.shape), "the padded ids", valid)  # read back to the host: check here
    return Bags(ids, valid, w, out_shape, True)
