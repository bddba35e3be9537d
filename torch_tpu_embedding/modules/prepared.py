"""A forward's inputs prepared ahead of it: checked, padded, assembled and on the tables' device.

``EmbeddingCollection.prepare(features)`` does the host half of a forward — the structure and range checks,
padding, the group assembly (:mod:`~torch_tpu_embedding.modules.assembly`) and the transfer — and returns a
:class:`PreparedFeatures`; ``ec(prepared)`` then only looks up. ``tte.TrainPipeline`` prepares batch ``N + 1``
on a background thread while step ``N`` runs. With ``ahead=True`` nothing is put on a device but host tensors
moved to it, so a stacked group's ids are shifted to their rows on the host. On CUDA the transfers are
non-blocking copies from pinned memory on a side stream, which the forward's stream waits for. On XLA the
prepared ids stay on the host and the lookup moves them: torch_xla 2.9's tensors cannot be touched off the
thread that runs ``torch_xla.sync()`` (a size read or a transfer races with it; the sizes come from
``EmbeddingCollection.know_rows``). Ids already on an XLA device (screened on the device: graph nodes, which
would join whichever step syncs next) are refused with :class:`NotAhead` (prepare them on the main thread).

Example::

    >>> import torch, torch_tpu_embedding as tte
    >>> ec = tte.EmbeddingCollection({"a": tte.FeatureConfig(tte.TableConfig(10, 4, name="t"))})
    >>> prepared = ec.prepare({"a": torch.tensor([1, 2])})
    >>> ec(prepared)["a"].shape
    torch.Size([2, 4])
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from torch_tpu_embedding._util.nest import flatten, path_name

__all__ = ["NotAhead", "PreparedFeatures", "leaves_of", "versions_of"]


class NotAhead(Exception):
    """Inputs that cannot be prepared off the main thread (ids on an XLA device, or XLA tables of unrecorded size)."""


def leaves_of(value: Any) -> tuple[int, ...]:
    """The identities of a nested input's leaves (what a forward call is matched to its prepared inputs by)."""
    return tuple(id(leaf) for _, leaf in flatten(value))


def _tensors(leaf: Any) -> list[torch.Tensor]:
    """A leaf's tensors: itself, or the tensor fields of an input object (``Padded``, ``Jagged``, a KJT)."""
    if isinstance(leaf, torch.Tensor):
        return [leaf]
    fields = getattr(leaf, "__dict__", None)
    return [v for v in fields.values() if isinstance(v, torch.Tensor)] if fields else []


def versions_of(value: Any) -> tuple[tuple[tuple[int, int], ...], ...]:
    """Per leaf of a nested input, its tensors' identities and version counters (an in-place write bumps them). XLA
    tensors are left out: their ids are screened on the device, and nothing of them is read off the thread that
    syncs."""
    return tuple(tuple((id(t), t._version) for t in _tensors(leaf) if t.device.type != "xla")
                 for _, leaf in flatten(value))


@dataclasses.dataclass
class PreparedFeatures:
    """One forward's lookups, planned and checked (``batches``), or the error its inputs raised (``error``).

    Made by ``EmbeddingCollection.prepare``; looked up once, by ``ec(prepared)`` (or by the forward whose
    ``features`` are the very objects prepared, while ``tte.TrainPipeline`` holds it). ``outputs``: the
    activations when they were looked up ahead (the pipeline's one-step-stale schedule), with the
    ``concat`` they were looked up with; every forward of those inputs while the pipeline holds them gets them.
    """

    owner: int  # id() of the collection that prepared it
    batches: list[Any] | None
    error: BaseException | None
    features: tuple[int, ...]  # leaves_of(features)
    weights: tuple[int, ...] | None  # leaves_of(weights), None without weights
    stream_event: Any = None  # CUDA: the side stream's event the transfers recorded
    outputs: Any = None
    concat: bool | None = None
    used: bool = False
    #: ``outputs`` once a forward took them while ``use_prepared`` holds these features: a later forward of the same
    #: step on the same inputs gets them too (every lookup of the batch one step stale, as the first)
    served: Any = None
    #: the error of a lookup ahead (``look_up_ahead(..., keep_error=True)``): raised by the forward that uses these
    #: features, at their own step (over a process group every rank took part in that lookup's agreement already)
    ahead_error: BaseException | None = None
    #: ``versions_of(features)`` then ``versions_of(weights)`` when prepared: a later in-place write is seen
    versions: tuple[tuple[tuple[int, int], ...], ...] = ()

    @classmethod
    def failed(cls, owner: int, error: BaseException) -> PreparedFeatures:
        """Features that could not be prepared (``error``: e.g. what reading them from the batch raised): their
        lookup raises ``error``, after taking part in the step's agreement as any failed lookup does."""
        return cls(owner, None, error, (), None)

    def matches(self, features: Any, weights: Any) -> bool:
        """Whether a forward's ``features`` and ``weights`` are the very objects this was prepared from."""
        if leaves_of(features) != self.features:
            return False
        if self.weights is None:
            return weights is None
        return weights is not None and leaves_of(weights) == self.weights

    def modified(self, features: Any, weights: Any) -> str | None:
        """The name of the first input (``"b"``, ``"user/ids"``; a weight's: ``"weights b"``) written in place since
        these features were prepared from it (their :meth:`matches` objects), or ``None``."""
        now = versions_of(features) + (() if weights is None else versions_of(weights))
        if not self.versions or now == self.versions:
            return None
        for name, then, later in zip(self.input_names(features, weights), self.versions, now, strict=True):
            current = dict(later)  # (a tensor an input object made since, e.g. a KJT's cached offsets, is not an edit)
            if any(current.get(t, v) != v for t, v in then):
                return name
        return None

    def input_names(self, features: Any, weights: Any) -> list[str]:
        """The names of :attr:`versions`' leaves (``"b"``, ``"user/ids"``; a weight's: ``"weights b"``)."""
        names = [path_name(p) for p, _ in flatten(features)]
        return names + ([f"weights {path_name(p)}" for p, _ in flatten(weights)] if weights is not None else [])

    def refills(self, earlier: PreparedFeatures) -> int | None:
        """The index of this input's first leaf that holds a tensor of ``earlier``'s (inputs still alive) written
        since ``earlier`` was prepared: a source that refills the tensors of the batch it gave before; or ``None``."""
        then = {t: v for leaf in earlier.versions for t, v in leaf}
        return next((i for i, leaf in enumerate(self.versions) if any(then.get(t, v) != v for t, v in leaf)), None)

    def take(self, owner: int) -> list[Any]:
        """The batches to look up (once), after the CUDA transfers; raises the inputs' error if they had one."""
        if owner != self.owner:
            raise ValueError("These prepared features were prepared by another EmbeddingCollection: call "
                             "prepare() on the collection that looks them up.")
        if self.used:
            raise ValueError("These prepared features were looked up already: a PreparedFeatures is looked up "
                             "once (its lookup records the gradient rows of one backward). Call prepare() again.")
        self.used = True
        if self.error is not None:
            raise self.error
        if self.stream_event is not None:  # CUDA: the side stream's copies, then their memory kept for this one
            stream = torch.cuda.current_stream()
            stream.wait_event(self.stream_event)
            for batch in self.batches or ():
                for t in getattr(batch, "device_tensors", list)():
                    if t.device.type == "cuda":
                        t.record_stream(stream)
        assert self.batches is not None
        return self.batches
