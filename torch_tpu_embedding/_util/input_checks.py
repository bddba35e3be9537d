"""Checks on one feature's input, each raising an error that names the feature and the rule.

Nothing is converted silently: a float or bool ``lengths``/``offsets`` would be truncated, a weight
beyond the range of the dtype the combiner computes in would become inf, and a sparse index outside
the tensor's shape or repeated would misplace ids — all of these raise instead.
"""

from __future__ import annotations

import torch

from torch_tpu_embedding._util.dtypes import compute_dtype

__all__ = ["INDEX_DTYPES", "check_ids", "check_index_dtype", "check_sparse_indices", "check_tensor",
           "check_weights", "check_weights_fit", "err", "tracing"]

#: integer dtypes accepted for ids, lengths and offsets (never bool, never float)
INDEX_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


def err(feature: str, msg: str) -> ValueError:
    return ValueError(f"Feature `{feature}`: {msg}")


def tracing() -> bool:
    return bool(torch.compiler.is_compiling() or torch.compiler.is_exporting())


def check_tensor(feature: str, what: str, value: object) -> None:
    """``value`` must be a tensor (``None`` is checked by the caller)."""
    if value is not None and not isinstance(value, torch.Tensor):
        raise TypeError(
            f"Feature `{feature}`: {what} must be a torch.Tensor. Received {type(value).__name__}; "
            "convert it with torch.as_tensor(...)."
        )


def check_index_dtype(feature: str, what: str, t: torch.Tensor) -> None:
    if t.dtype not in INDEX_DTYPES:
        raise TypeError(
            f"Feature `{feature}`: {what} must be an integer tensor. Received dtype {t.dtype} "
            "(it would be truncated to integers)."
        )


def check_ids(feature: str, ids: torch.Tensor, vocab: int, table: str | None = None) -> None:
    """Integer ids in ``[0, vocab)``; ``table``: the user's name of the feature's table, for the error."""
    if ids.dtype not in INDEX_DTYPES:
        raise TypeError(
            f"Feature `{feature}`: ids must be an integer tensor. Received dtype {ids.dtype}."
        )
    # Range checks need the values: done wherever they are readable without a device sync
    # (host tensors, and eager accelerators). XLA-resident ids are not read back here, nor are
    # ids being traced by torch.export / torch.compile (their values do not exist yet).
    if ids.numel() and ids.device.type != "xla" and not tracing():
        lo, hi = (int(x) for x in torch.aminmax(ids))
        if lo < 0 or hi >= vocab:
            bad = lo if lo < 0 else hi
            whose = "the table's num_embeddings" if table is None else f"num_embeddings of table `{table}`"
            raise err(feature, f"ids must be in [0, {vocab}) ({whose}). Received: {bad}")


def _of_ids(w: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
    """The weights of real ids, 0 elsewhere: where a ``Padded`` mask holds no id the weight is never used (the
    combiner takes none there, as the device's count of bad weights skips it), so it may be anything, NaN too.
    (``torch.where``, not ``w[valid]``: no shape that depends on the data, no sync with a CUDA device.)"""
    if valid is None or valid.device != w.device or tracing():
        return w
    return torch.where(valid, w, torch.zeros((), dtype=w.dtype, device=w.device))


def check_weights(
    feature: str, w: torch.Tensor, shape: tuple[int, ...], what: str, valid: torch.Tensor | None = None
) -> None:
    """Floating point weights of ``shape``, finite where ``valid`` (a ``Padded`` mask of that shape) holds an id."""
    if w.layout != torch.strided or w.is_nested:  # (nested weights were unpacked by the caller: not these)
        kind = "nested" if w.is_nested else str(w.layout).removeprefix("torch.")
        raise err(feature, f"weights must be a dense (strided) tensor of the shape of {what} {shape}, one weight per "
                  f"id. Received a {kind} tensor (nested weights go with nested or Jagged ids, sparse COO weights with "
                  "sparse COO ids at the same indices)")
    if not torch.is_floating_point(w):
        raise TypeError(
            f"Feature `{feature}`: weights must be a floating point tensor. Received dtype {w.dtype}."
        )
    if tuple(w.shape) != shape:
        raise err(feature, f"weights must have the shape of {what} {shape}. Received: {tuple(w.shape)}")
    if w.device.type != "xla" and w.numel() and not tracing() and not bool(torch.isfinite(_of_ids(w, valid)).all()):
        raise err(feature, "weights must be finite. Received a NaN or inf weight.")


def check_weights_fit(feature: str, w: torch.Tensor, dtype: torch.dtype, valid: torch.Tensor | None = None) -> None:
    """Host weights stay finite once converted to the compute dtype of a ``dtype`` table (where ``valid`` holds
    an id)."""
    target = compute_dtype(dtype)
    if w.device.type == "xla" or not w.numel() or tracing() or torch.finfo(target).max >= torch.finfo(w.dtype).max:
        return
    big = float(_of_ids(w, valid).abs().max())
    if big > torch.finfo(target).max:
        raise err(feature, f"weights must be finite in {target} (the dtype the table's combiner computes in). "
                  f"Received {big:g}, which would overflow to inf.")


def check_sparse_indices(feature: str, idx: torch.Tensor, shape: tuple[int, ...], key: torch.Tensor) -> None:
    """Indices ``[ndim, nnz]`` inside ``shape`` and unique (``key``: their sorted linear positions)."""
    for d, size in enumerate(shape):
        if idx.shape[1] and (int(idx[d].min()) < 0 or int(idx[d].max()) >= size):
            bad = int(idx[d].min()) if int(idx[d].min()) < 0 else int(idx[d].max())
            raise err(feature, f"sparse indices must lie inside the tensor's shape {shape}. Received index "
                      f"{bad} in dim {d} (the tensor was built without check_invariants).")
    if key.numel() > 1 and bool((key[1:] == key[:-1]).any()):
        raise err(feature, "a sparse input holds two ids at the same index (uncoalesced duplicates). Put each "
                  "id at its own position; coalesce() would add the ids together.")
