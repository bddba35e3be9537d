"""A load reads one published checkpoint: its directory is opened once and every file is read through it.

A save publishes a new directory by renames and then deletes the old one (``checkpoint/publish.py``), so a
load that read a checkpoint's files by path — the manifest and ``tte_meta.pt`` first, the tensors later —
could read some of them from one save and the rest from the next (an evaluator looping over
``load_distributed`` while the trainer saved got the weights of one save with the counters of the other).

:func:`pinned` resolves the path once, opens the directory and holds a shared ``flock`` on it for the
whole load, and gives the load a path that names that open directory (``/proc/self/fd/<fd>``): a rename of
the path to another directory changes nothing read through it, and the save that publishes next sets the
old directory aside instead of deleting it while the lock is held (``publish._remove``). A save never writes a
published directory's files in place; files copied into it by other means (another save's, file by file, as
``cp`` or ``rsync`` put them) after the load verified them are found by :class:`Seal`, which the load checks
before its first write (and after its reads). Errors name the user's path, not the descriptor's.

Where ``/proc/self/fd`` is missing (not Linux) the load reads by the resolved path and checks when it is done
that the path still names the directory it opened; a checkpoint replaced under it then raises
:class:`CheckpointCorruptError` (after it has read: the model may hold some new values).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import warnings
from collections.abc import Iterator

from torch_tpu_embedding.checkpoint.files import held, release
from torch_tpu_embedding.checkpoint.publish import MANIFEST, CheckpointCorruptError, resolve, stamp

try:  # POSIX advisory locks; elsewhere the directory is opened without one
    import fcntl
except ImportError:  # pragma: no cover - not on Linux
    fcntl = None  # type: ignore[assignment]

__all__ = ["Seal", "UnverifiedCheckpointWarning", "identity", "pinned"]


class UnverifiedCheckpointWarning(UserWarning):
    """A distributed checkpoint written before manifests: a changed byte in it cannot be detected."""


def _open(path: str) -> int | None:
    """A descriptor on directory ``path`` holding a shared lock, or ``None`` when it is not a directory."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except (FileNotFoundError, NotADirectoryError):
        return None
    if fcntl is not None:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)  # waits only while a save deletes this very directory
        except OSError:
            pass  # a file system without flock on directories: read unlocked
    return fd


def _renamed(e: BaseException, inner: str, shown: str) -> None:
    """Name ``shown`` instead of ``inner`` in ``e``'s message (and its cause's): errors name the user's path."""
    seen: set[int] = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        e.args = tuple(a.replace(inner, shown) if isinstance(a, str) else a for a in e.args)
        if isinstance(e, OSError) and isinstance(e.filename, str):
            e.filename = e.filename.replace(inner, shown)
        e = e.__cause__  # type: ignore[assignment]


@contextlib.contextmanager
def pinned(path: str) -> Iterator[str]:
    """The checkpoint directory ``path`` resolves to (``publish.resolve``), as a path that reads that one
    directory for as long as the block runs (the module docstring). Warns
    (:class:`UnverifiedCheckpointWarning`) of a directory without a manifest."""
    shown = resolve(path)
    fd = None
    for _ in range(3):  # a save may delete the directory between resolving and locking it: resolve again
        fd = _open(shown)
        if fd is None or os.fstat(fd).st_nlink:
            break
        os.close(fd)
        fd, shown = None, resolve(path)
    if fd is None:
        yield shown  # nothing there (the load says so), or deleted three times over
        return
    try:
        inner = f"/proc/self/fd/{fd}"
        if not os.path.isdir(inner):
            inner = shown
        if not os.path.exists(os.path.join(inner, MANIFEST)) and os.path.exists(os.path.join(inner, ".metadata")):
            warnings.warn(
                f"{shown} has no {MANIFEST}: it was written before torch_tpu_embedding sealed its checkpoints, so "
                "only its files' sizes are checked and a changed byte would load unnoticed. Save it again "
                "(tte.checkpoint.save_distributed) to seal it.", UnverifiedCheckpointWarning, stacklevel=4)
        try:
            yield inner
        except BaseException as e:
            if inner != shown:
                _renamed(e, inner, shown)
            raise
        if inner == shown:
            st, own = os.stat(shown) if os.path.exists(shown) else None, os.fstat(fd)
            if st is None or (st.st_dev, st.st_ino) != (own.st_dev, own.st_ino):
                raise CheckpointCorruptError(f"{shown} was replaced by another save while it was loaded; load it "
                                             "again (the model may hold values of both).")
    finally:
        release(inner)
        os.close(fd)


def identity(path: str) -> str:
    """Which save the pinned directory ``path`` holds: the sha256 of its manifest (``""`` without one), for
    the ranks of a group to check that they opened the same one."""
    try:
        with open(os.path.join(path, MANIFEST), "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()
    except FileNotFoundError:
        return ""


class Seal:
    """The files ``publish.verify`` checked, as it read them (``publish.stamp`` through the descriptor it hashed).

    A load reads those files again by name (``tte_meta.pt``, ``.metadata``, the data and rank files): a file
    replaced in the directory meanwhile (another save's copied over this one, ``rsync`` renaming file by
    file) or written in place would be read unverified: another save's counters beside this one's weights.
    :meth:`check` finds it.
    """

    def __init__(self, path: str, stamps: dict[str, tuple[int, ...]]) -> None:
        self.path, self.stamps = path, stamps

    def changed(self) -> str | None:
        """The first file replaced or written to since it was verified (``None``: none)."""
        for file, saw in sorted(self.stamps.items()):
            fd = held(file)  # the file as it is read (files.through): renamed over or not, written to in place
            try:
                now: tuple[int, ...] | None = stamp(os.stat(file) if fd is None else os.fstat(fd))
            except OSError:
                now = None
            if fd is not None and now is not None:  # a rename over it changes its change time, not what is read
                now, saw = now[:4], saw[:4]
            if now != saw:
                return file
        return None

    def check(self, written: bool = False) -> None:
        """Raise :class:`CheckpointCorruptError` if a file changed since ``publish.verify`` (``written``: the load
        has written some values already; else nothing was loaded)."""
        file = self.changed()
        if file is not None:
            raise CheckpointCorruptError(
                f"{file} was replaced or written to while the checkpoint {self.path} was loaded (another save or "
                "a copy into the directory); " + ("the model may hold values of both. " if written else
                                                  "nothing was loaded. ") + "Load it again.")
