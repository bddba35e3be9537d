"""Checkpoint files on disk: atomic writes, stale temporaries, what a save may hold, safe DCP metadata.

* :func:`write_atomic` writes to ``.tte-tmp-<name>-<random>`` beside the target while holding an
  exclusive ``flock`` on it, fsyncs, and renames it over the target. A writer killed mid-write leaves
  its temporary behind; the kernel drops its lock. Every later write in that folder removes the
  temporaries of ours (``.tte-tmp-*``) that no live process holds locked — never one being written
  (a concurrent saver holds its lock until its rename), never a file of another name.
* :func:`check_records` reads every record of a ``torch.save`` file against the CRC-32 its writer stored: torch's
  reader checks none (a flipped byte inside a tensor loads as another value, torch 2.9 and 2.13 alike).
* :func:`check_loadable` refuses, before anything is written, a payload that ``torch.load(...,
  weights_only=True)`` could not read back (numpy values, paths, datetimes, custom objects), naming
  the key path and the type.
* :func:`dcp_reader` is ``torch.distributed.checkpoint.FileSystemReader`` whose ``.metadata`` pickle
  is read with an allow-list of the metadata classes it holds: a crafted file can construct nothing
  else, so it cannot run code; non-tensor entries (read back with an unrestricted ``torch.load``
  by DCP's planner) are refused too.
"""

from __future__ import annotations

import collections
import contextlib
import gc
import importlib
import io
import os
import pickle
import re
import tempfile
import warnings
import zipfile
from collections.abc import Iterator
from typing import IO, Any

import torch

try:  # POSIX advisory locks; elsewhere no stale temporary is ever removed
    import fcntl
except ImportError:  # pragma: no cover - not on Linux
    fcntl = None  # type: ignore[assignment]

__all__ = ["TMP_PREFIX", "SaveLock", "check_loadable", "check_records", "dcp_quiet", "dcp_reader", "fsync_dir",
           "hold", "held", "load_refusal", "read_dcp_metadata", "release", "remove_stale_temporaries", "through",
           "write_atomic"]

#: name prefix of our temporary files (``.tte-tmp-<target name>-<random>``)
TMP_PREFIX = ".tte-tmp-"


# ----------------------------------------------------------------------------- verified files, read as verified
# A load hashes each file against the manifest, then reads it again (tte_meta.pt, .metadata, the data and rank
# files, some through torch's DCP reader). Opened again by name, a file renamed over meanwhile (another save's
# copied in, as cp or rsync do) would be read unverified; so the descriptor it was hashed through is kept
# (path -> descriptor) and every read opens the file through it (/proc/self/fd/<fd>: the same inode).
_HELD: dict[str, int] = {}


def hold(path: str, fd: int) -> None:
    """Keep a duplicate of ``fd`` (the descriptor ``path`` was verified through) for :func:`through`."""
    key = os.path.normpath(path)
    old = _HELD.pop(key, None)
    if old is not None:
        os.close(old)
    _HELD[key] = os.dup(fd)


def held(path: str) -> int | None:
    """The descriptor ``path`` was verified through (:func:`hold`), if any."""
    return _HELD.get(os.path.normpath(path))


def through(path: str) -> str:
    """A path that opens the file ``path`` was verified as (:func:`hold`), else ``path``."""
    fd = held(path)
    inner = f"/proc/self/fd/{fd}"
    return inner if fd is not None and os.path.exists(inner) else path


def release(folder: str) -> None:
    """Close the descriptors held for files of ``folder`` (the load of it is over)."""
    prefix = os.path.normpath(folder) + os.sep
    for key in [k for k in _HELD if k.startswith(prefix)]:
        os.close(_HELD.pop(key))


# ----------------------------------------------------------------------------- atomic writes
def _lock(f: IO[bytes], blocking: bool) -> bool:
    if fcntl is None:
        return True
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
    except BlockingIOError:
        return False
    return True


def _same_file(path: str, f: IO[bytes]) -> bool:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    own = os.fstat(f.fileno())
    return (st.st_dev, st.st_ino) == (own.st_dev, own.st_ino)


def remove_stale_temporaries(folder: str) -> list[str]:
    """Delete ``folder``'s ``.tte-tmp-*`` files that no live process holds locked; returns their names.

    A writer holds its lock from just after creating its file until after its rename, so a file that
    can be locked here belongs to a writer that died (or to an older version of this library, which
    did not use this prefix: such files are left alone).
    """
    if fcntl is None:
        return []
    removed = []
    try:
        names = [n for n in os.listdir(folder) if n.startswith(TMP_PREFIX)]
    except OSError:
        return []
    for name in names:
        path = os.path.join(folder, name)
        try:
            f = open(path, "rb")  # noqa: SIM115 - closed below, after unlinking under the lock
        except OSError:
            continue
        with f:
            if _lock(f, blocking=False) and _same_file(path, f):
                with contextlib.suppress(OSError):
                    os.unlink(path)
                    removed.append(name)
    return removed


@contextlib.contextmanager
def _locked_temp(folder: str, name: str) -> Iterator[tuple[IO[bytes], str]]:
    """A new temporary file in ``folder``, opened for writing and locked until the block ends."""
    while True:
        fd, tmp = tempfile.mkstemp(prefix=f"{TMP_PREFIX}{name}-", dir=folder)
        f = os.fdopen(fd, "wb")
        _lock(f, blocking=True)
        # A cleaner may have locked and unlinked the file between mkstemp and our lock: then retry.
        if _same_file(tmp, f):
            break
        f.close()
    try:
        yield f, tmp
    finally:
        f.close()


def fsync_dir(path: str) -> None:
    """Commit the directory's entries (a rename into it) to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(payload: Any, path: str | os.PathLike[str]) -> None:
    """``torch.save(payload)`` to a locked temporary beside ``path``, fsync, rename: a reader sees the
    old file or the new one, never half of one. Stale temporaries of dead writers are removed first."""
    target = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(target))
    remove_stale_temporaries(folder)
    tmp = ""
    try:
        with _locked_temp(folder, os.path.basename(target)) as (f, tmp):
            torch.save(payload, f)
            f.flush()
            os.fsync(f.fileno())
            os.replace(tmp, target)  # still locked: a cleaner cannot take the file before this
            tmp = ""
        # The rename on disk too: else a power loss after save() returned may bring back the previous file
        # (the new one is whole, fsynced above; some file systems refuse fsync on a directory: less durable)
        with contextlib.suppress(OSError):
            fsync_dir(folder)
    except BaseException:
        if tmp and os.path.exists(tmp):
            os.unlink(tmp)
        raise
    finally:
        # torch.save leaves a reference cycle (a closure over its table of written storages) that
        # keeps every tensor it wrote alive until the cycle collector runs: for a checkpoint of
        # device tensors, a fresh host copy of every table and slot per save (RSS grew ~8% over 2
        # saves in benchmarks/soak.py; tests/xla/test_ckpt_memory.py).
        gc.collect()


def check_records(f: IO[bytes]) -> None:
    """Read every record of the ``torch.save`` file ``f`` (a zip archive: the pickle, one record per storage) against
    the CRC-32 torch stored for it, and return to the start. torch's own reader checks none of them: a byte flipped
    on disk or in transit inside a tensor's data loads silently as another value (torch 2.9 and 2.13). Every file
    torch has written since 1.6 holds them, so files saved by earlier versions are checked too; a file that is no
    zip archive is left to ``torch.load``.

    Raises:
        ValueError: a record whose bytes differ from those written, naming it.
    """
    f.seek(0)
    if zipfile.is_zipfile(f):
        with zipfile.ZipFile(f) as archive:
            for record in archive.infolist():
                try:
                    with archive.open(record) as r:
                        while r.read(1 << 22):  # (zipfile compares the CRC-32 at the record's end)
                            pass
                except zipfile.BadZipFile as e:
                    raise ValueError(f"record {record.filename!r} is not the bytes torch.save wrote (its CRC-32 "
                                     f"differs: altered on disk or in transit). Nothing was loaded. ({e})") from e
    f.seek(0)


# ----------------------------------------------------------------------------- one save at a time
class SaveLock:
    """An exclusive ``flock`` on ``.<name>.tte-lock`` beside a checkpoint directory, held by the process that
    publishes a save (rank 0) from before it touches anything until it has published: a second save to the
    same path (another job) is refused, not mixed in. The file is removed by its holder; the kernel drops the
    lock of a process that dies (its file is then taken over by the next save)."""

    def __init__(self, target: str) -> None:
        parent, name = os.path.split(target)
        self.path = os.path.join(parent, f".{name}.tte-lock")
        while True:
            f = open(self.path, "a+b")  # noqa: SIM115 - held until release()
            if not _lock(f, blocking=False):
                f.close()
                raise BlockingIOError(
                    f"Another save to {target} is in progress (a live process holds {self.path}); nothing was "
                    "written. Save to another path, or after that save has finished.")
            if _same_file(self.path, f):  # not a file its last holder removed while we opened it
                break
            f.close()
        self._file: IO[bytes] | None = f

    def release(self) -> None:
        """Remove the lock file and drop the lock (removed first: a waiter never locks a file about to go)."""
        if self._file is not None:
            with contextlib.suppress(OSError):
                os.unlink(self.path)
            self._file.close()
            self._file = None


# ----------------------------------------------------------------------------- what a save may hold
_LEAVES = (type(None), bool, int, float, complex, str, bytes, bytearray, torch.Size, torch.dtype, torch.device,
           torch.layout)
_CONTAINERS = (dict, collections.OrderedDict, list, tuple, set)


def _path(base: str, key: Any) -> str:
    return f"{base}[{key!r}]"


def _find_unloadable(obj: Any, where: str) -> tuple[str, str] | None:
    """``(key path, type name)`` of the first value ``torch.load(weights_only=True)`` cannot rebuild."""
    kind = type(obj)
    if kind in _LEAVES:
        return None
    if kind is torch.Tensor or kind is torch.nn.Parameter:
        return None
    if kind in (dict, collections.OrderedDict):
        for k, v in obj.items():
            found = _find_unloadable(k, f"{where} (a key)") or _find_unloadable(v, _path(where, k))
            if found:
                return found
        return None
    if kind in (list, tuple, set):
        for i, v in enumerate(obj):
            found = _find_unloadable(v, _path(where, i))
            if found:
                return found
        return None
    return where, f"{kind.__module__}.{kind.__qualname__}" if kind.__module__ != "builtins" else kind.__qualname__


def _skeleton(obj: Any) -> Any:
    """``obj`` with every tensor replaced by an empty one of its dtype (for a cheap trial load)."""
    if isinstance(obj, torch.Tensor):
        return torch.empty(0, dtype=obj.dtype)
    if isinstance(obj, dict):
        return type(obj)((k, _skeleton(v)) for k, v in obj.items())
    if isinstance(obj, (list, tuple, set)):
        return type(obj)(_skeleton(v) for v in obj)
    return obj


def check_loadable(obj: Any, name: str) -> None:
    """Raise ``TypeError`` naming the key path and type of the first value in ``obj`` that
    ``torch.load(..., weights_only=True)`` (and so ``tte.checkpoint.load``) could not read back."""
    found = _find_unloadable(obj, name)
    if found is None:
        buf = io.BytesIO()  # the allow-list above, confirmed by a trial round trip without tensor data
        try:
            torch.save(_skeleton(obj), buf)
            buf.seek(0)
            torch.load(buf, weights_only=True)
            return
        except Exception as e:  # pickling errors and weights-only refusals have several types
            raise TypeError(f"`{name}` cannot be saved: tte.checkpoint.load (weights_only) could not read "
                            f"it back ({str(e).splitlines()[0]}). Nothing was written.") from e
    where, kind = found
    raise TypeError(
        f"`{where}` is a {kind}, which tte.checkpoint.load (torch.load with weights_only=True) cannot read "
        "back. Checkpoints hold tensors, Python numbers, strings, bytes, None, torch dtypes/devices/sizes "
        "and dicts, lists, tuples and sets of them: convert it first (e.g. float(x), x.tolist(), "
        "torch.from_numpy(a), str(path), dt.isoformat()). Nothing was written."
    )


def load_refusal(e: BaseException) -> str:
    """Why ``torch.load(..., weights_only=True)`` refused a checkpoint file, in words that do not suggest
    ``weights_only=False`` (which would run whatever the file holds)."""
    text = str(e)
    found = re.search(r"WeightsUnpickler error: ([^\n]*)", text)
    if found or isinstance(e, pickle.UnpicklingError):
        detail = found.group(1).split(" was not an allowed global")[0] if found else text.splitlines()[0]
        return (f"it holds pickled objects other than tensors, numbers, strings and containers ({detail}); "
                "refused without running them (checkpoints of ours never hold any)")
    if isinstance(e, RecursionError):
        return "it nests deeper than Python's recursion limit"
    first = text.splitlines()[0] if text else ""
    return f"truncated or corrupt ({type(e).__name__}: {first})"


# ----------------------------------------------------------------------------- safe DCP metadata
_DCP_CLASSES = {
    "torch.distributed.checkpoint.metadata": (
        "Metadata", "TensorStorageMetadata", "ChunkStorageMetadata", "TensorProperties", "StorageMeta",
        "MetadataIndex", "_MEM_FORMAT_ENCODING",
        "BytesStorageMetadata",  # a non-tensor entry (torch's helpers' param_groups), a field-less dataclass
    ),
    "torch.distributed.checkpoint.filesystem": ("_StorageInfo",),
    "torch.serialization": ("_get_layout",),  # a layout by name (torch.strided)
    "torch": ("Size",),
    "pathlib": ("PosixPath", "PurePosixPath", "PureWindowsPath"),  # StorageMeta.checkpoint_id
    "collections": ("OrderedDict",),
}


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles only the classes a ``torch.distributed.checkpoint`` ``.metadata`` file holds."""

    def __init__(self, file: IO[bytes], path: str) -> None:
        super().__init__(file)
        self._where = path

    def find_class(self, module: str, name: str) -> Any:
        if name in _DCP_CLASSES.get(module, ()):
            return getattr(importlib.import_module(module), name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(
            f"{self._where} is not a torch.distributed.checkpoint metadata file we can read safely: it "
            f"refers to `{module}.{name}`, which such a file never holds (refused without running it)."
        )


def read_dcp_metadata(path: str, non_tensors: bool = False) -> Any:
    """The ``Metadata`` of a DCP folder's ``.metadata`` file, unpickled with the allow-list above.
    ``non_tensors``: entries that are not tensors are allowed (for a reader whose planner reads them with
    ``weights_only=True``: ``tte.checkpoint.read_torch_dcp``)."""
    md_mod = importlib.import_module("torch.distributed.checkpoint.metadata")
    file = os.path.join(path, ".metadata")
    try:
        with open(through(file), "rb") as f:
            md = _MetadataUnpickler(f, file).load()
    except FileNotFoundError:
        raise
    except pickle.UnpicklingError as e:  # our refusals name the file; the unpickler's own errors do not
        raise ValueError(str(e) if file in str(e) else f"{file} is not a readable distributed-checkpoint "
                         f"metadata file (truncated or corrupt): {e}") from e
    except Exception as e:  # truncated or garbage streams raise several types
        raise ValueError(f"{file} is not a readable distributed-checkpoint metadata file: {e!r}") from e
    if not isinstance(md, md_mod.Metadata):
        raise ValueError(f"{file} holds a {type(md).__name__}, not torch.distributed.checkpoint Metadata.")
    tensor_md = md_mod.TensorStorageMetadata
    entries = md.state_dict_metadata if isinstance(md.state_dict_metadata, dict) else None
    allowed = (tensor_md, md_mod.BytesStorageMetadata) if non_tensors else tensor_md
    bad = sorted(k for k, v in (entries or {}).items() if not isinstance(v, allowed))
    if entries is None or bad:
        raise ValueError(f"{file}: entries {bad} are not tensors. Our distributed checkpoints hold only tensors; "
                         "other entries would be read back with an unrestricted torch.load, so they are refused.")
    if getattr(md, "storage_meta", None) is None:  # as FileSystemReader.read_metadata does
        md.storage_meta = md_mod.StorageMeta()
    return md


@contextlib.contextmanager
def dcp_quiet() -> Iterator[None]:
    """``torch.distributed.checkpoint`` calls made on our users' behalf, without its warning that
    "torch.distributed is disabled ... assuming the intent is to save in a single process": a single
    process (CPU, one device, single-process SPMD) is an intended use of our distributed checkpoints."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


_READER: Any = None


def dcp_reader(path: str, non_tensors: bool = False) -> Any:
    """A ``FileSystemReader`` for ``path`` whose ``read_metadata`` is :func:`read_dcp_metadata` (``non_tensors``
    passed on)."""
    global _READER
    if _READER is None:
        base = importlib.import_module("torch.distributed.checkpoint").FileSystemReader

        class _SafeReader(base):  # type: ignore[misc, valid-type]
            def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
                if kwargs.get("rank") is not None:
                    raise ValueError("Per-rank distributed-checkpoint metadata is not supported.")
                md = read_dcp_metadata(os.fspath(self.path), getattr(self, "tte_non_tensors", False))
                md.storage_meta.load_id = self.load_id
                return md

            def __init__(self, *args: Any, **kwargs: Any) -> None:
                super().__init__(*args, **kwargs)
                opens = self.fs.create_stream  # each data file opened as it was verified (through())
                self.fs.create_stream = lambda p, mode: opens(through(os.fspath(p)) if "r" in mode else p, mode)

        _READER = _SafeReader
    reader = _READER(path)
    reader.tte_non_tensors = non_tensors
    return reader
