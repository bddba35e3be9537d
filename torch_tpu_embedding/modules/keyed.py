"""TorchRec's input as it is: a ``KeyedJaggedTensor`` (or any object with its methods) as the features.

``EmbeddingCollection.forward`` takes a ``torchrec.KeyedJaggedTensor`` — or any object with its
``keys()``, ``values()``, ``lengths()`` or ``offsets()`` and, optionally, ``weights_or_none()`` (torchrec
need not be installed) — in place of the structure of ``feature_config``: its keys are the features'
names, its values the ids of every feature's bags, feature-major (all bags of ``keys()[0]``, then of
``keys()[1]``, ...), each feature with the same number of bags ``B = len(lengths) / len(keys)``.
Each feature becomes a :class:`~torch_tpu_embedding.inputs.Jagged` view of the values (one split, no copy).
"""

from __future__ import annotations

from typing import Any

import torch

from torch_tpu_embedding._util.nest import Path, rebuild
from torch_tpu_embedding.inputs import Jagged

__all__ = ["is_keyed", "keyed_inputs"]


def is_keyed(features: Any) -> bool:
    """Whether ``features`` is a ``KeyedJaggedTensor`` (by its methods: a dict has ``keys``/``values`` only)."""
    return not isinstance(features, (dict, list, tuple, torch.Tensor)) and all(
        callable(getattr(features, m, None)) for m in ("keys", "values")) and (
        callable(getattr(features, "lengths", None)) or callable(getattr(features, "offsets", None)))


def keyed_inputs(features: Any, config: Any, order: list[tuple[Path, str]]) -> tuple[Any, Any]:
    """``(inputs, weights)`` in the structure of ``config`` from a ``KeyedJaggedTensor`` ``features``;
    ``order``: each feature's position and name. Raises ``ValueError`` naming missing or unknown keys."""
    keys = [str(k) for k in features.keys()]
    names = {name: path for path, name in order}
    unknown = [k for k in keys if k not in names]
    missing = [n for n in names if n not in keys]
    if unknown or missing or len(set(keys)) != len(keys):
        raise ValueError(
            "A KeyedJaggedTensor input must hold every feature of the collection once, keyed by its name "
            f"(EmbeddingCollection.feature_names): {sorted(names)}. Received keys {keys}"
            + (f"; unknown: {unknown}" if unknown else "") + (f"; missing: {missing}" if missing else ""))
    values = features.values()
    lengths = features.lengths() if callable(getattr(features, "lengths", None)) else None
    if lengths is None:
        offsets = features.offsets()
        lengths = offsets[1:] - offsets[:-1]
    weights = features.weights_or_none() if callable(getattr(features, "weights_or_none", None)) else None
    for what, t in (("values()", values), ("lengths()", lengths), ("weights_or_none()", weights)):
        if t is not None and (not isinstance(t, torch.Tensor) or t.dim() != 1):
            raise TypeError(f"A KeyedJaggedTensor input's {what} must be a 1-D tensor. Received "
                            f"{type(t).__name__}{'' if not isinstance(t, torch.Tensor) else tuple(t.shape)}")
    if lengths.numel() % len(keys):
        raise ValueError(
            f"A KeyedJaggedTensor input needs the same number of bags for each of its {len(keys)} keys (a variable "
            f"batch per feature is not taken as a KeyedJaggedTensor: pass {{name: tte.Jagged(...)}} per "
            f"feature instead). Received {lengths.numel()} lengths")
    per_key = lengths.view(len(keys), -1)  # [F, B]
    sizes = per_key.sum(1).tolist()  # the one host read of the input's structure (a sync for device lengths)
    if sum(sizes) != values.numel():
        raise ValueError(f"A KeyedJaggedTensor input's lengths must add up to len(values()) = {values.numel()}. "
                         f"Received lengths adding up to {sum(sizes)}")
    vals = values.split(sizes)
    ws = weights.split(sizes) if weights is not None else [None] * len(keys)
    lens = per_key.unbind(0)
    inputs = {names[k]: Jagged(v, lengths=n) for k, v, n in zip(keys, vals, lens, strict=True)}
    per_id = {names[k]: w for k, w in zip(keys, ws, strict=True)}
    return rebuild(config, inputs), None if weights is None else rebuild(config, per_id)
