"""Screening of inputs that already live on an XLA device (read back only at ``check_ids()``).

Ids and per-id weights built on the device cannot be read without a sync, so they are checked on the
device inside the step: an out-of-range id, or an id whose weight is NaN or inf, becomes padding (it
contributes nothing and trains no row — never a silent remap to a row, never a NaN in a table), and
is counted per feature in ``[1]``-shaped device tensors (one traced graph per step).
:meth:`DeviceScreen.problems` syncs and reports (``EmbeddingCollection.check_ids`` raises).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

__all__ = ["DeviceScreen", "overflow_problem", "warn_unchecked_drops", "warn_unreported"]


class DeviceScreen:
    """Per-feature device-side counts of out-of-range ids and non-finite weights."""

    def __init__(self) -> None:
        self.invalid_ids: dict[str, torch.Tensor] = {}
        self.nonfinite_weights: dict[str, torch.Tensor] = {}

    def screen(
        self, feature: str, vocab: int, ids: torch.Tensor, valid: torch.Tensor, sentinel: int,
        weights: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(ids, valid)`` with bad positions turned into padding (``sentinel``, not valid); counted."""
        bad = valid & ((ids < 0) | (ids >= vocab))
        _add(self.invalid_ids, feature, bad)
        if weights is not None and weights.device == ids.device:  # host weights were checked on the host
            nonfinite = valid & ~torch.isfinite(weights)
            _add(self.nonfinite_weights, feature, nonfinite)
            bad = bad | nonfinite
        return torch.where(bad, torch.full_like(ids, sentinel), ids), valid & ~bad

    @staticmethod
    def counts(counts: dict[str, torch.Tensor]) -> dict[str, int]:
        """Host ints (a device-to-host transfer: ``.item()`` on XLA counts as a host fallback op)."""
        return {f: int(c.cpu().reshape(-1)[0]) for f, c in counts.items()}

    def problems(self, vocab: dict[str, int]) -> list[str]:
        """The error text for every feature with a bad id or weight since the last call (empty if none); reset."""
        ids = {f: n for f, n in self.counts(self.invalid_ids).items() if n}
        weights = {f: n for f, n in self.counts(self.nonfinite_weights).items() if n}
        self.invalid_ids.clear()
        self.nonfinite_weights.clear()
        detail = [f"Feature `{f}`: {n} id(s) outside [0, {vocab[f]})" for f, n in sorted(ids.items())]
        detail += [f"Feature `{f}`: {n} NaN or inf weight(s)" for f, n in sorted(weights.items())]
        if not detail:
            return []
        what = " and ".join(w for w, c in (("Out-of-range ids", ids), ("non-finite per-id weights", weights)) if c)
        return [f"{what} in device inputs since the last check_ids(): {'; '.join(detail)}. They were "
                "dropped from their bags (no row was trained with them)."]


def overflow_problem(
    features: list[str], table: str, members: list[str] | None, dropped: list[int], largest: list[int], capacity: int
) -> str | None:
    """The error text for ids a row-sharded table's exchange dropped (per shard: ``dropped`` ids,
    ``largest`` distinct ids one device had for it in a step), or ``None`` if none. ``members``: the
    tables stacked in ``table``, whose capacities add up to the group's."""
    shards = [s for s, n in enumerate(dropped) if n]
    if not shards:
        return None
    feats = ", ".join(f"`{f}`" for f in features)
    where = f"table `{table}`"
    fix = "set TableConfig(max_unique_ids_per_shard=...)"
    if members:
        where = f"tables {', '.join(f'`{m}`' for m in members)}, stacked as `{table}`"
        fix = f"{fix} on each of those tables (the group's capacity is their sum)"
    per = ", ".join(f"{dropped[s]} for shard {s}" for s in shards)
    most = ", ".join(str(largest[s]) for s in shards)
    return (f"Feature(s) {feats} ({where}): ids over the exchange capacity {capacity} were dropped since the last "
            f"check_ids(): {per} (the most distinct ids one device had for each in one step: {most}). A "
            f"capacity of {max(largest)} would have sufficed: {fix}; size it with largest_loads(). The "
            f"{'tables were' if members else 'table was'} not updated in the steps that dropped ids.")


def warn_unchecked_drops(module: Any, state_dict: Any, prefix: str, local_metadata: Any) -> None:
    """State-dict hook of ``EmbeddingCollection``: :func:`warn_unreported` on saving."""
    warn_unreported(module, prefix.rstrip("."), stacklevel=4)


def warn_unreported(module: Any, name: str, stacklevel: int = 3) -> None:
    """Saving a collection whose device-side counters hold dropped ids (bad device inputs, ids over
    an exchange capacity) not yet reported by ``check_ids()`` warns, so a run that never calls it
    does not lose updates unnoticed until the end. Reads the counters (a small transfer); resets
    nothing."""
    screen: DeviceScreen = module._screen
    bad = sum(sum(DeviceScreen.counts(c).values()) for c in (screen.invalid_ids, screen.nonfinite_weights))
    over = sum(sum(c.per_shard()[0]) for c in module._exchange_counts.values())
    if bad or over:
        warnings.warn(
            f"Saving the embedding collection `{name or type(module).__name__}` although "
            f"{bad} bad device input(s) (out-of-range ids, non-finite weights) and {over} id(s) over an id-exchange "
            "capacity were dropped since the last check_ids(): no table row was trained from them. Call "
            "check_ids() (it raises, naming the features) at a sync point of the training loop.",
            stacklevel=stacklevel)


def _add(counts: dict[str, torch.Tensor], feature: str, bad: torch.Tensor) -> None:
    prev = counts.get(feature)
    if prev is None:  # uploaded (not created on the device) and kept [1]-shaped: every step traces one graph
        prev = torch.zeros(1, dtype=torch.int64).to(bad.device)
    counts[feature] = prev + bad.sum().reshape(1)
