"""Distributed-checkpoint directories that are published whole and verified before a load writes anything.

A save writes into a sibling staging directory ``.<name>.tte-saving``; when every rank's files and
``tte_meta.pt`` are on disk (fsynced, with the directory), rank 0 writes :data:`MANIFEST` (each file's
size and sha256), and publishes the directory with renames (POSIX ``rename`` is atomic):

1. no ``<name>`` yet: ``.tte-saving`` → ``<name>``;
2. replacing one: ``<name>`` → ``.<name>.tte-previous``, ``.tte-saving`` → ``<name>``, then the
   previous one is deleted.

A process killed at any point leaves ``<name>`` complete (the old or the new checkpoint), or, between
the two renames of 2., no ``<name>`` (or an empty directory a restarted job made again) and the complete
old one at ``.tte-previous``: :func:`resolve` reads that one, and the next save moves it back
(:func:`prepare_staging`), never deletes it. A staging directory is never read. The rank that publishes
holds the save lock (``files.SaveLock``) from before :func:`prepare_staging` until it has published, so a
second save to the path is refused (:func:`begin_save`, on every rank). An old checkpoint a load is
reading (its shared ``flock``, ``checkpoint/snapshot.py``) is set aside, not deleted (:func:`_remove`).
Which files are a checkpoint's is its manifest's word (:func:`foreign_files`). :func:`verify` checks every
file against the manifest (sizes first, then checksums) before a load writes anything; a directory
written before manifests existed is checked against the byte ranges its ``.metadata`` records (a
truncated file is found; a changed byte is not: the load warns of it).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import json
import mmap
import os
import shutil
from typing import Any

from torch_tpu_embedding.checkpoint.files import SaveLock, fsync_dir, hold, read_dcp_metadata

try:  # POSIX advisory locks; elsewhere an old checkpoint is deleted even while a load reads it
    import fcntl
except ImportError:  # pragma: no cover - not on Linux
    fcntl = None  # type: ignore[assignment]

__all__ = ["BUFFER", "CHUNK", "MANIFEST", "RESERVE", "SHARDED_META", "CheckpointCorruptError", "barrier",
           "begin_save", "distributed", "foreign_files", "is_sharded", "prepare_staging", "publish", "rank",
           "read_errors", "resolve", "stamp", "staging_path", "verify", "write_manifest"]

#: the manifest of a distributed checkpoint: ``{"format", "files": {name: {"size", "sha256"}}}``
MANIFEST = "tte_manifest.json"
_MANIFEST_FORMAT = "torch_tpu_embedding.manifest/1"
_META = "tte_meta.pt"
#: the metadata file of a process-group-sharded checkpoint (``tte.distributed.save_sharded``)
SHARDED_META = "meta.pt"
#: The most that reading a checkpoint adds to a process's peak resident memory (4 MiB; a load's own state
#: aside: the rows it writes into, dense layers read whole): one read buffer of :data:`BUFFER` bytes alive
#: at a time (the checksums' here, then each window of rows with all its bookkeeping, ``checkpoint/logical_rows.py``)
#: and :data:`RESERVE` for the rest.
CHUNK = 1 << 22
#: The part of :data:`CHUNK` kept for what a load allocates beside its read buffer that no size here bounds:
#: interpreter objects (the files' metadata, the load's dicts and frames, hashlib's state) and the pages of
#: the rank files' pickles and headers read through their mappings. Measured well under it in a process
#: that has loaded once (tests/distributed/test_mp_ckpt.py::test_loading_memory_is_one_chunk; a process's first load
#: also faults in the pages of code it runs, up to about 1 MiB of libtorch's, once).
RESERVE = 1 << 19
#: The one read buffer's bytes, its rounding to whole pages included: what a load's memory grows by for its
#: reads (for a window of rows: its mapping and its ids' placing, ``checkpoint/logical_rows.py``), with :data:`RESERVE`
#: left within :data:`CHUNK`.
BUFFER = CHUNK - RESERVE


class CheckpointCorruptError(ValueError):
    """A checkpoint file that is missing, truncated, altered or unreadable; nothing was loaded.

    An ``Exception`` (``torch.distributed.checkpoint``'s own ``CheckpointException`` is a
    ``BaseException``, which ``except Exception`` does not catch): the message names the file.
    """


# ----------------------------------------------------------------------------- ranks
def distributed() -> Any:
    """``torch.distributed`` where a default process group is up, else ``None`` (one process)."""
    dist = importlib.import_module("torch.distributed")
    return dist if dist.is_available() and dist.is_initialized() else None


def rank() -> int:
    """This process's rank in the default process group (0 without one)."""
    dist = distributed()
    return 0 if dist is None else int(dist.get_rank())


def barrier() -> None:
    """Wait for every rank of the default process group (nothing without one)."""
    dist = distributed()
    if dist is not None:
        dist.barrier()


def begin_save(target: str, lead: bool, group: Any = None) -> SaveLock | None:
    """Every rank of ``group`` (the default one: ``None``) before a save of ``target``: the leading rank takes
    the save lock (:class:`~torch_tpu_embedding.checkpoint.files.SaveLock`) and prepares the staging
    directory (:func:`prepare_staging`); a refusal (a save in progress, a foreign file) changes nothing and
    is raised on every rank, none left waiting. Returns the lead's lock, to release once published."""
    lock, error = None, None
    if lead:
        try:
            lock = SaveLock(target)
            prepare_staging(target)
        except (OSError, ValueError) as e:
            if lock is not None:
                lock.release()
            lock, error = None, e
    dist = distributed()
    if dist is not None:
        box = [error]
        dist.broadcast_object_list(box, group=group, group_src=0)
        error = box[0]
    if error is not None:
        raise error
    return lock


# ----------------------------------------------------------------------------- publishing
def _siblings(target: str) -> tuple[str, str]:
    parent, name = os.path.split(target)
    return os.path.join(parent, f".{name}.tte-saving"), os.path.join(parent, f".{name}.tte-previous")


def staging_path(target: str) -> str:
    """The staging directory every rank writes a save of ``target`` into."""
    return _siblings(target)[0]


def _dcp_file(name: str) -> bool:
    """A file name a ``save_distributed`` directory written before manifests held (DCP's files, ours, a dead
    writer's temporary). A ``save_sharded`` directory always has a manifest: its ``meta.pt`` and
    ``rows-<rank>.pt`` are ours only where a manifest of ours lists them (a user's own ``meta.pt`` is not)."""
    return (name in (".metadata", ".metadata.tmp", _META, f".{MANIFEST}.tmp")
            or (name.startswith("__") and name.endswith((".distcp", ".metadata")))
            or name.startswith(".tte-tmp-"))


def _listed(path: str) -> set[str] | None:
    """The files the manifest of directory ``path`` lists (with the manifest); ``None`` without a readable one."""
    try:
        files = _manifest(path)
    except CheckpointCorruptError:
        return None
    return None if files is None else {*files, MANIFEST}


def _ours_unlisted(name: str) -> bool:
    """A file of a checkpoint of ours whose manifest is there but unreadable (damaged): a save replaces it."""
    return _dcp_file(name) or name in (MANIFEST, SHARDED_META) or (name.startswith("rows-") and name.endswith(".pt"))


def _published(path: str) -> bool:
    """Whether ``path`` is a directory a save published (it holds a manifest)."""
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, MANIFEST))


def is_sharded(path: str) -> bool:
    """Whether directory ``path`` is a ``save_sharded`` checkpoint: its manifest lists ``meta.pt`` (without a
    readable manifest: it holds ``meta.pt`` and no ``tte_meta.pt``; its load then refuses the manifest)."""
    listed = _listed(path)
    if listed is not None:
        return SHARDED_META in listed
    return os.path.isfile(os.path.join(path, SHARDED_META)) and not os.path.isfile(os.path.join(path, _META))


def _empty_dir(path: str) -> bool:
    return os.path.isdir(path) and not os.listdir(path)


def foreign_files(target: str) -> list[str]:
    """The files of directory ``target`` that are not a checkpoint's of ours: those its manifest does not
    list, or without a manifest those a directory written before manifests could not hold."""
    listed = _listed(target)
    ours = _ours_unlisted if listed is None and os.path.isfile(os.path.join(target, MANIFEST)) else _dcp_file
    return sorted(n for n in os.listdir(target) if not (n in (listed or ()) or ours(n)))


def _remove(path: str) -> None:
    """Delete the old checkpoint directory ``path`` unless a load is reading it (it holds a shared ``flock``
    on the directory, ``checkpoint/snapshot.py``): then it is set aside under a name of its own, deleted by a
    later save once no load holds it."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        if fcntl is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                parent, name = os.path.split(path)
                if ".tte-retired-" not in name:  # (one set aside already stays where it is)
                    os.rename(path, os.path.join(parent, f"{name.removesuffix('.tte-previous')}.tte-retired-"
                                                 f"{os.getpid()}-{os.urandom(4).hex()}"))
                return
            except OSError:
                pass  # a file system without flock on directories (some network ones): deleted as before
        shutil.rmtree(path)
    finally:
        os.close(fd)


def _sweep_retired(target: str) -> None:
    """Delete the old checkpoints of ``target`` set aside while loads read them, once none does."""
    parent, name = os.path.split(target)
    for n in os.listdir(parent):
        if n.startswith(f".{name}.tte-retired-"):
            with contextlib.suppress(OSError):
                _remove(os.path.join(parent, n))


def prepare_staging(target: str) -> None:
    """Rank 0, before a save: check that ``target`` (if it exists) is a checkpoint of ours or an empty
    directory (its files are replaced) — a refused save changes nothing —, then finish what an interrupted
    save left (the complete old checkpoint aside at ``.tte-previous`` goes back in place of a missing or
    empty ``target``), and make a fresh, empty staging directory. The same for both kinds of directory
    (``save_distributed``'s and ``save_sharded``'s)."""
    staging, previous = _siblings(target)
    if os.path.lexists(target):
        if not os.path.isdir(target):
            raise FileExistsError(f"A checkpoint save to {target}: it exists and is not a directory")
        foreign = foreign_files(target)
        if foreign:
            raise FileExistsError(
                f"A checkpoint save to {target}: it holds files that are not part of a distributed checkpoint "
                f"({foreign[:5]}); a save replaces the whole directory, so it refuses to. Choose another path."
            )
    if os.path.isdir(previous):
        if _published(previous) and (not os.path.lexists(target) or _empty_dir(target)):
            if os.path.lexists(target):
                os.rmdir(target)  # e.g. os.makedirs(path, exist_ok=True) on a restart after a kill
            os.rename(previous, target)  # killed between the two renames: the old checkpoint is back
            fsync_dir(os.path.dirname(target))
        else:
            _remove(previous)  # the new checkpoint was published; the old one was being deleted
    _sweep_retired(target)
    if os.path.lexists(staging):
        shutil.rmtree(staging)  # a save that died before publishing
    os.makedirs(staging)


def _sha256(path: str, stamps: dict[str, tuple[int, ...]] | None = None) -> str:
    """The sha256 of file ``path``; ``stamps[path]``: :func:`stamp` of the descriptor it was read through."""
    h = hashlib.sha256()
    # One buffer of BUFFER bytes (a multiple of the page), refilled: a reader's memory grows by it alone
    # (and RESERVE: hashlib's state, the file object). An anonymous mapping of its own, which goes back to
    # the system when closed (freed to malloc, it would stay resident in the heap beside the buffers a load
    # allocates next).
    with mmap.mmap(-1, BUFFER) as buffer, open(path, "rb", buffering=0) as f:
        if stamps is not None:  # before reading: a write while it is hashed changes the file's stamp
            stamps[path] = stamp(os.fstat(f.fileno()))
            hold(path, f.fileno())  # the load reads the file through this descriptor (files.through)
        view = memoryview(buffer)
        try:
            while n := f.readinto(view):
                h.update(view[:n])
        finally:
            view.release()  # (a view still open would make closing the mapping raise)
    return h.hexdigest()


def stamp(st: os.stat_result) -> tuple[int, ...]:
    """Which file and which version of it: device, inode, size, modification and change times (a rename or a
    write changes the change time)."""
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


def write_manifest(staging: str) -> None:
    """Rank 0, after every rank's files are written: fsync them, record each one's size and sha256 in
    :data:`MANIFEST` (written to a temporary, fsynced and renamed), and fsync the directory."""
    files = {}
    for name in sorted(os.listdir(staging)):
        if name in (MANIFEST, f".{MANIFEST}.tmp"):
            continue
        path = os.path.join(staging, name)
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)  # DCP fsyncs what it writes; files written by other ranks are synced here again
        finally:
            os.close(fd)
        files[name] = {"size": os.path.getsize(path), "sha256": _sha256(path)}
    tmp = os.path.join(staging, f".{MANIFEST}.tmp")
    with open(tmp, "w") as f:
        json.dump({"format": _MANIFEST_FORMAT, "files": files}, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(staging, MANIFEST))
    fsync_dir(staging)


def publish(staging: str, target: str) -> None:
    """Rank 0: make the complete ``staging`` directory the checkpoint at ``target`` (renames; see above)."""
    parent = os.path.dirname(target)
    _, previous = _siblings(target)
    if not os.path.lexists(target):
        os.rename(staging, target)
        fsync_dir(parent)
        return
    os.rename(target, previous)
    fsync_dir(parent)
    os.rename(staging, target)
    fsync_dir(parent)
    _remove(previous)


def resolve(target: str) -> str:
    """The directory a load reads for ``target`` (a symlink followed): ``target``, or the complete old
    checkpoint that a save killed between its two renames left at ``.<name>.tte-previous`` while
    ``target`` is missing or an empty directory (made again by a restarted job's ``os.makedirs``)."""
    target = os.path.realpath(target)
    if _published(target):
        return target
    _, previous = _siblings(target)
    if _published(previous) and (not os.path.lexists(target) or _empty_dir(target)):
        return previous
    return target


# ----------------------------------------------------------------------------- verifying
def _manifest(path: str, stamps: dict[str, tuple[int, ...]] | None = None) -> dict[str, dict[str, Any]] | None:
    """The manifest's ``files`` (``None`` where there is no manifest); ``stamps`` gets the :func:`stamp` of the
    file read, taken through the handle it was read with (not of whatever holds the name before or after)."""
    file = os.path.join(path, MANIFEST)
    if not os.path.exists(file):
        return None
    try:
        with open(file) as f:
            if stamps is not None:
                stamps[file] = stamp(os.fstat(f.fileno()))
            data = json.load(f)
    except RecursionError as e:  # json nests one Python frame per level
        raise CheckpointCorruptError(f"{file} is not a readable checkpoint manifest: it nests deeper than Python's "
                                     "recursion limit (a manifest of ours is two levels deep). Nothing was "
                                     "loaded.") from e
    except (OSError, ValueError) as e:
        raise CheckpointCorruptError(f"{file} is not a readable checkpoint manifest (truncated or altered): {e}. "
                                     "Nothing was loaded.") from e
    found = data.get("format") if isinstance(data, dict) else None
    if isinstance(found, str) and found != _MANIFEST_FORMAT and found.startswith(_MANIFEST_FORMAT.split("/")[0]):
        raise CheckpointCorruptError(f"{file} is in checkpoint manifest format {found!r}; this version of "
                                     f"torch_tpu_embedding reads {_MANIFEST_FORMAT!r} (a checkpoint written by a "
                                     "newer version? Load it with that version). Nothing was loaded.")
    files = data.get("files") if isinstance(data, dict) else None
    if found != _MANIFEST_FORMAT:
        raise CheckpointCorruptError(f"{file} is not a readable checkpoint manifest (truncated or altered): not "
                                     f"a {_MANIFEST_FORMAT} manifest (format found: {found!r}). Nothing was loaded.")
    if not isinstance(files, dict) or not all(
        isinstance(k, str) and isinstance(v, dict) and type(v.get("size")) is int and v["size"] >= 0
        and isinstance(v.get("sha256"), str) and _plain_name(k) for k, v in files.items()
    ):
        raise CheckpointCorruptError(f"{file} is not a readable checkpoint manifest (truncated or altered): its "
                                     "'files' must map plain file names of the directory to {'size': a whole number "
                                     "of bytes, 'sha256': a string}. Nothing was loaded.")
    return files


def _plain_name(name: str) -> bool:
    """A file name directly in the checkpoint directory (a manifest naming ``../x`` or ``a/b`` is refused)."""
    return bool(name) and name not in (".", "..") and "/" not in name and "\\" not in name and "\0" not in name


def verify(path: str, required: tuple[str, ...] = (".metadata", _META)) -> dict[str, tuple[int, ...]]:
    """Raise :class:`CheckpointCorruptError` naming the first file of ``path`` that is missing, of the
    wrong size or whose sha256 differs from the manifest (sizes of every file first: cheap); the
    manifest must list the ``required`` files. Without a manifest (a DCP directory written before
    manifests existed): every byte range ``.metadata`` refers to must exist. Returns each file checked (by
    path) as it was read (:func:`stamp`; ``snapshot.Seal`` checks them again before a load writes)."""
    stamps: dict[str, tuple[int, ...]] = {}
    files = _manifest(path, stamps)
    if files is None:
        if ".metadata" not in required:
            raise CheckpointCorruptError(f"{os.path.join(path, MANIFEST)} is missing: the save did not finish "
                                         "(or the directory is not a checkpoint). Nothing was loaded.")
        return _verify_ranges(path)
    for required_file in required:
        if required_file not in files:
            raise CheckpointCorruptError(f"{os.path.join(path, MANIFEST)} does not list {required_file}. "
                                         "Nothing was loaded.")
    for name, want in sorted(files.items()):
        file = os.path.join(path, name)
        size = os.path.getsize(file) if os.path.isfile(file) else None
        if size != want["size"]:
            found = "it is missing" if size is None else f"it has {size} bytes"
            raise CheckpointCorruptError(f"{file} is truncated, missing or altered: the manifest records "
                                         f"{want['size']} bytes, {found}. Nothing was loaded.")
    for name, want in sorted(files.items()):
        file = os.path.join(path, name)
        if _sha256(file, stamps) != want["sha256"]:
            raise CheckpointCorruptError(f"{file} is altered: its sha256 differs from the one the manifest "
                                         "records. Nothing was loaded.")
    return stamps


def _verify_ranges(path: str) -> dict[str, tuple[int, ...]]:
    """Check the byte ranges of a directory without a manifest; returns the stamps of the files it checked."""
    stamps = {os.path.join(path, n): stamp(os.stat(os.path.join(path, n))) for n in (".metadata", _META)
              if os.path.isfile(os.path.join(path, n))}
    md = read_dcp_metadata(path)
    need: dict[str, int] = {}
    for info in (md.storage_data or {}).values():
        name = os.fspath(getattr(info, "relative_path", ""))
        end = int(getattr(info, "offset", 0)) + int(getattr(info, "length", 0))
        need[name] = max(need.get(name, 0), end)
    for name, end in sorted(need.items()):
        file = os.path.join(path, name)
        size = os.path.getsize(file) if os.path.isfile(file) else None
        if size is None or size < end:
            found = "it is missing" if size is None else f"it has {size} bytes"
            raise CheckpointCorruptError(f"{file} is truncated or missing: {os.path.join(path, '.metadata')} "
                                         f"refers to its bytes up to {end}, {found}. Nothing was loaded.")
        stamps[file] = stamp(os.stat(file))
    return stamps


@contextlib.contextmanager
def read_errors(path: str) -> Any:
    """``torch.distributed.checkpoint``'s ``CheckpointException`` (a ``BaseException``) raised while
    reading ``path``, as a :class:`CheckpointCorruptError` naming the directory and the first failure."""
    api = importlib.import_module("torch.distributed.checkpoint.api")
    try:
        yield
    except api.CheckpointException as e:
        first = next(iter(e.failures.values()), None)
        cause = "unknown" if first is None else f"{type(first[0]).__name__}: {first[0]}"
        raise CheckpointCorruptError(f"Reading the distributed checkpoint {path} failed ({cause}); "
                                     "some tensors may have been read.") from e
