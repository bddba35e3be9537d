"""Every rank of a process group raises when one rank's part of a checkpoint load or save fails: none waits
for a rank that left, none loads alone.

A load's checks read the files and compare them with each rank's own model and optimizer, so one rank can
fail where the others pass: its copy of a file damaged or unreadable, a shape only its model has. Raised
there alone, the error would leave the others to load and go on to their next collective, where they wait
for the failed rank (a hang), or train on a job that is half loaded. So each phase of a load or save that
can fail on some ranks only runs under :class:`Attempt` (its ``Exception`` kept, not raised), and then every
rank meets the others in :func:`agree`: one ``all_gather_object`` of each rank's outcome (and a value of its
own to compare, such as which save it opened). If any rank failed, every rank raises: the failed rank its
own error, the others one naming that rank and its error, of its kind (:class:`CheckpointMismatchError` for a
checkpoint that does not fit, else :class:`CheckpointCorruptError`).
"""

from __future__ import annotations

from types import TracebackType
from typing import Any

from torch_tpu_embedding.checkpoint.checks import CheckpointMismatchError
from torch_tpu_embedding.checkpoint.publish import CheckpointCorruptError, distributed

__all__ = ["Attempt", "agree", "given_on_every_rank"]


class Attempt:
    """A block whose ``Exception`` is kept in :attr:`error` instead of raised (for :func:`agree`); a
    ``BaseException`` that is not an ``Exception`` (``KeyboardInterrupt``) goes through."""

    def __init__(self) -> None:
        self.error: Exception | None = None

    def __enter__(self) -> Attempt:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 tb: TracebackType | None) -> bool:
        if isinstance(error, Exception):
            self.error = error
            return True
        return False


def agree(error: Exception | None, group: Any = None, value: Any = None, *, done: str,
          other: type[Exception] = CheckpointCorruptError) -> list[Any]:
    """Meet every rank of ``group`` (the default one: ``None``) with this rank's ``error`` (``None``: it
    succeeded) and a ``value``; returns every rank's value, in rank order. Without a process group (or a
    group of one rank) nothing is exchanged.

    Raises on every rank if any rank brought an error: ``error`` itself where it is not ``None``; on the
    others the first failed rank's error, named (``Rank 1 of the process group failed: ...``) and followed by
    ``done``: what the others did (for example, that nothing was loaded on any rank). Its type: the failed
    rank's where that is :class:`CheckpointMismatchError` or :class:`CheckpointCorruptError`, else ``other``.
    """
    dist = distributed()
    world = 1 if dist is None else int(dist.get_world_size(group))
    if world == 1:
        if error is not None:
            raise error
        return [value]
    kind = next((k for k in (CheckpointMismatchError, CheckpointCorruptError) if isinstance(error, k)), None)
    mine = None if error is None else (kind is CheckpointMismatchError, kind is CheckpointCorruptError,
                                       type(error).__name__, str(error))
    got: list[Any] = [None] * world
    dist.all_gather_object(got, (value, mine), group=group)
    if error is not None:
        raise error
    failed = [(r, outcome) for r, (_, outcome) in enumerate(got) if outcome is not None]
    if failed:
        r, (mismatch, corrupt, name, message) = failed[0]
        more = f" (and ranks {[q for q, _ in failed[1:]]})" if len(failed) > 1 else ""
        cls = CheckpointMismatchError if mismatch else CheckpointCorruptError if corrupt else other
        raise cls(f"Rank {r} of the process group failed{more}: {name}: {message} ({done})")
    return [v for v, _ in got]


def given_on_every_rank(given: list[bool], argument: str, function: str, done: str) -> None:
    """Raises ``ValueError`` (on every rank: ``given`` is every rank's, as :func:`agree` returns them) where
    ``argument`` of ``function`` was given on some ranks only (a save would publish some ranks' part of it, a
    load leave the others' as it was); ``done``: what happened instead."""
    if len(set(given)) > 1:
        on = [r for r, g in enumerate(given) if g]
        raise ValueError(f"Argument `{argument}` of tte.distributed.{function} must be given on every rank of the "
                         f"process group or on none ({done}). Received: given on ranks {on}, None on ranks "
                         f"{[r for r in range(len(given)) if r not in on]}")
