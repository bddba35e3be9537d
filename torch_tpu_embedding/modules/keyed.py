"""TorchRec's input as it is: a ``KeyedJaggedTensor`` (or any object with its methods) as the features.

``EmbeddingCollection.forward`` takes a ``torchrec.KeyedJaggedTensor`` — or any object with its
``keys()``, ``values()``, ``lengths()`` or ``offsets()`` and, optionally, ``weights_or_none()`` (torchrec
need not be installed) — in place of the structure of ``feature_config``: its keys are the features'
names, its values the ids of every feature's bags, feature-major (all bags of ``keys()[0]``, then of
``keys()[1]``, ...), each feature with the same number of bags ``B = len(lengths) / len(keys)``.
The bags of every key are padded at once (:func:`keyed_inputs`): widths as the host would pad a
:class:`~torch_tpu_embedding.inputs.Jagged` input for XLA (``max_ids_per_bag``, else the longest bag
rounded up to a power of two), so results equal those of the same bags given per feature as
:class:`~torch_tpu_embedding.inputs.Padded`; given as ``Jagged`` to an eager table they are summed in another
order (no padding), and agree to rounding (float32: an ulp or so).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from torch_tpu_embedding._util.input_checks import INDEX_DTYPES
from torch_tpu_embedding._util.nest import Path, rebuild
from torch_tpu_embedding.config import FeatureConfig
from torch_tpu_embedding.inputs import Padded
from torch_tpu_embedding.modules.prepared import NotAhead


def _next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()

__all__ = ["is_keyed", "keyed_inputs"]

_PER_FEATURE_BATCH = ("A KeyedJaggedTensor input needs the same number of bags for each of its keys (a variable batch "
                      "per feature is not taken as a KeyedJaggedTensor: pass {name: tte.Jagged(...)} per feature "
                      "instead). ")


def is_keyed(features: Any) -> bool:
    """Whether ``features`` is a ``KeyedJaggedTensor`` (by its methods: a dict has ``keys``/``values`` only)."""
    return not isinstance(features, (dict, list, tuple, torch.Tensor)) and all(
        callable(getattr(features, m, None)) for m in ("keys", "values")) and (
        callable(getattr(features, "lengths", None)) or callable(getattr(features, "offsets", None)))


def keyed_inputs(features: Any, config: Any, order: list[tuple[Path, str, FeatureConfig]], ahead: bool = False
                 ) -> tuple[Any, Any]:
    """``(inputs, weights)`` in the structure of ``config`` from a ``KeyedJaggedTensor`` ``features``;
    ``order``: each feature's position, name and config. Each feature's bags become a
    :class:`~torch_tpu_embedding.inputs.Padded` (views of one ``[F·B, W]`` padding of every key, made by one
    scatter), so a stacked group's features are looked up as one (``modules/assembly.py``). Raises
    ``ValueError`` naming missing or unknown keys, parts on two devices, or the feature with a bag over its
    ``max_ids_per_bag``.

    ``ahead`` (``EmbeddingCollection.prepare`` off the main thread): parts on an XLA device raise
    :class:`~torch_tpu_embedding.modules.prepared.NotAhead` before any of them is read (the read of the lengths
    is a transfer, which torch_xla 2.9 races with the thread that syncs)."""
    keys = [str(k) for k in features.keys()]
    names = {name: path for path, name, _ in order}
    features_of = {name: fc for _, name, fc in order}
    unknown = [k for k in keys if k not in names]
    missing = [n for n in names if n not in keys]
    if unknown or missing or len(set(keys)) != len(keys):
        raise ValueError(
            "A KeyedJaggedTensor input must hold every feature of the collection once, keyed by its name "
            f"(EmbeddingCollection.feature_names): {sorted(names)}. Received keys {keys}"
            + (f"; unknown: {unknown}" if unknown else "") + (f"; missing: {missing}" if missing else "")
            + (". TorchRec's EmbeddingBagCollection ignores keys it has no feature for; here keep the collection's "
               "keys first: kjt.permute([kjt.keys().index(k) for k in ec.feature_names])" if unknown else ""))
    variable = getattr(features, "variable_stride_per_key", None)  # TorchRec's VBE: a batch size per key
    if callable(variable) and variable():
        raise ValueError(_PER_FEATURE_BATCH + "Received a KeyedJaggedTensor with variable_stride_per_key() True")
    values = features.values()
    lengths = features.lengths() if callable(getattr(features, "lengths", None)) else None
    if lengths is None and not callable(getattr(features, "offsets", None)):
        raise TypeError("A KeyedJaggedTensor input must give its bags by lengths() or offsets(). Received lengths() "
                        "None and no offsets()")
    offsets = features.offsets() if lengths is None else None
    weights = features.weights_or_none() if callable(getattr(features, "weights_or_none", None)) else None
    given = (values, lengths, offsets, weights)
    if ahead and any(isinstance(t, torch.Tensor) and t.device.type == "xla" for t in given):
        # (a tensor's device is read outside its data: safe off the thread that syncs)
        raise NotAhead("a KeyedJaggedTensor input on an XLA device (its lengths are read on the host, a transfer)")
    first = None  # offsets(): its first entry, read with the lengths below (it must be 0)
    if lengths is None:
        if not isinstance(offsets, torch.Tensor) or offsets.dim() != 1 or not offsets.numel():
            raise TypeError("A KeyedJaggedTensor input's offsets() must be a 1-D tensor of len(keys()) · B + 1 "
                            f"entries. Received {type(offsets).__name__}"
                            f"{'' if not isinstance(offsets, torch.Tensor) else tuple(offsets.shape)}")
        if offsets.dtype not in INDEX_DTYPES:  # (before the differences: bool offsets have none, float would truncate)
            raise TypeError("A KeyedJaggedTensor input's offsets() must be an integer tensor. Received "
                            f"{offsets.dtype}")
        lengths, first = offsets[1:] - offsets[:-1], offsets[:1]
    for what, t in (("values()", values), ("lengths()", lengths), ("weights_or_none()", weights)):
        if t is not None and (not isinstance(t, torch.Tensor) or t.dim() != 1):
            raise TypeError(f"A KeyedJaggedTensor input's {what} must be a 1-D tensor. Received "
                            f"{type(t).__name__}{'' if not isinstance(t, torch.Tensor) else tuple(t.shape)}")
    named = {"values()": values, "lengths()" if first is None else "offsets()": lengths, "weights_or_none()": weights}
    where = {what: t.device for what, t in named.items() if t is not None}
    if len(set(where.values())) > 1:  # (the bags are laid out where the values are, indexed by the lengths)
        raise ValueError("A KeyedJaggedTensor input's values(), lengths() or offsets() and weights_or_none() must be "
                         "on one device (kjt.to(device) moves them all). Received "
                         + ", ".join(f"{what} on {d}" for what, d in where.items()))
    if lengths.numel() % len(keys):
        raise ValueError(_PER_FEATURE_BATCH + f"Received {lengths.numel()} lengths for {len(keys)} keys")
    if lengths.dtype not in INDEX_DTYPES or values.dtype not in INDEX_DTYPES:
        raise TypeError("A KeyedJaggedTensor input's values() and lengths() must be integer tensors. Received "
                        f"{values.dtype} and {lengths.dtype}")
    if weights is not None and not weights.is_floating_point():  # (checked per feature below, named as the KJT's)
        raise TypeError(f"A KeyedJaggedTensor input's weights_or_none() must be a floating point tensor. Received "
                        f"{weights.dtype}")
    f, nnz = len(keys), values.numel()
    b = lengths.numel() // f
    lengths = lengths.to(torch.int64)
    per_key = lengths.view(f, b)  # [F, B]
    # The one host read of the input's structure (a sync for device lengths): each key's longest bag, the
    # total and the shortest (lengths must be >= 0 and add up to the values), and offsets()' first entry. (Each
    # reduced over a dim named: torch_xla 2.9's amin() of no dim returns the tensor as it is.)
    read = [per_key.amax(1), lengths.sum(0, keepdim=True), lengths.amin(0, keepdim=True)] if b \
        else [lengths.new_zeros(f + 2)]
    if first is not None:
        read.append(first.to(torch.int64))
    stats = torch.cat(read).tolist() if b or first is not None else [0] * (f + 2)
    longest, total, shortest = stats[:f], stats[f], stats[f + 1]
    if first is not None and (stats[f + 2] != 0 or total != nnz):  # (bag n: values()[offsets[n]:offsets[n + 1]])
        raise ValueError("A KeyedJaggedTensor input's offsets() must start at 0 and end at len(values()) = "
                         f"{nnz}. Received offsets from {stats[f + 2]} to {stats[f + 2] + total}")
    if first is not None and shortest < 0:  # (the lengths are its differences: name what was given)
        raise ValueError("A KeyedJaggedTensor input's offsets() must be non-decreasing. Received a bag of length "
                         f"{shortest}")
    if total != nnz or shortest < 0:
        raise ValueError(f"A KeyedJaggedTensor input's lengths must be >= 0 and add up to len(values()) = {nnz}. "
                         f"Received lengths adding up to {total}, the shortest {shortest}")
    if weights is not None and weights.numel() != nnz:
        raise ValueError(f"A KeyedJaggedTensor input's weights_or_none() must hold one weight per id: "
                         f"len(values()) = {nnz}. Received {weights.numel()} weights")
    # Sequences (max_sequence_length, or an output_shape of k·B positions) are truncated, not capped: as the
    # feature's bags given alone (to_bags), where max_ids_per_bag bounds only the bags it combines.
    shapes = {k: features_of[k].output_shape for k in keys}
    sequences = [k for k, shape in shapes.items()
                 if features_of[k].max_sequence_length or (shape is not None and math.prod(shape) != b)]
    if weights is not None and sequences:
        raise ValueError(
            f"A KeyedJaggedTensor input's weights_or_none() weighs the ids of every key, and {sequences} "
            f"{'is a sequence feature' if len(sequences) == 1 else 'are sequence features'}, which take no weights "
            "(TorchRec's EmbeddingCollection ignores them). Pass a KeyedJaggedTensor without weights, or the "
            "features as a dict, {name: tte.Jagged(values, lengths=..., weights=...)}, with weights for the bagged "
            "features only (docs/migration.md, From TorchRec)")
    widths = []
    for k, n in zip(keys, longest, strict=True):
        fc = features_of[k]
        cap = None if k in sequences else fc.max_ids_per_bag
        if cap is not None and n > cap:
            raise ValueError(f"Feature `{k}`: a bag holds {n} ids, more than max_ids_per_bag={cap}. Raise the "
                             "capacity; ids are never dropped silently.")
        widths.append(cap if cap is not None else _next_pow2(n))
    # Every key's bags padded at once: id k of bag n of key j at [j·B + n, k], one scatter.
    width = max(widths, default=1)
    offsets = torch.cumsum(lengths, 0) - lengths
    row = torch.repeat_interleave(torch.arange(f * b, device=values.device), lengths, output_size=nnz)
    rank = torch.arange(nnz, device=values.device) - offsets[row]
    ids = values.new_zeros(f * b, width).index_put_((row, rank), values)
    mask = torch.zeros(f * b, width, dtype=torch.bool, device=values.device).index_put_(
        (row, rank), torch.ones((), dtype=torch.bool, device=values.device))
    w = None if weights is None else weights.new_zeros(f * b, width).index_put_((row, rank), weights)
    if all(wd == width for wd in widths):  # each key's [B, W] a view, all in one op per tensor
        parts = zip(ids.view(f, b, width).unbind(0), mask.view(f, b, width).unbind(0),
                    [None] * f if w is None else w.view(f, b, width).unbind(0), strict=True)
    else:
        rows = [slice(j * b, (j + 1) * b) for j in range(f)]
        parts = zip([ids[r, :wd] for r, wd in zip(rows, widths, strict=True)],
                    [mask[r, :wd] for r, wd in zip(rows, widths, strict=True)],
                    [None if w is None else w[r, :wd] for r, wd in zip(rows, widths, strict=True)], strict=True)
    inputs = {names[k]: Padded(i, m, wt) for k, (i, m, wt) in zip(keys, parts, strict=True)}
    return rebuild(config, inputs), None
