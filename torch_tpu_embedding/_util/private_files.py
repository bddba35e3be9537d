"""Files trusted from disk only as checked through the descriptor they are used by, never by a path looked up again.

A library loaded from a cache runs as this user (its constructors run at ``dlopen``). Checking a path with
``stat`` and then handing the path to the loader lets anyone who may write a directory on that path swap the
directory or the file in between; a file cut short (a crash while it was written, a full disk) makes ``dlopen``
fault (``SIGBUS``) when it touches the missing pages. So:

* :func:`open_dir` walks a directory's real path from ``/`` one component at a time (``openat`` with
  ``O_NOFOLLOW``), each checked through its own descriptor: owned by this user or root, and writable by
  nobody else, except a directory with the sticky bit (``/tmp``), where no one else may rename or delete
  what is ours; with ``private`` the directory itself must be this user's and writable by nobody else. What
  such a descriptor names then stays what was checked: only its owner (or root) may rename in it.
* :func:`read_file` opens a file in such a directory (``O_NOFOLLOW``), checks it through its descriptor (a
  regular file of this user's that nobody else may write, of a bounded size) and reads its bytes through it,
  for the caller to check (a content hash) before use.
* :func:`load_library` ``dlopen``\\ s through that descriptor (``/proc/self/fd/N``), so the loader maps the
  file that was checked, whatever its path names by then.
* :func:`make_temporary_dir` names a work directory for its host and process; :func:`remove_stale_temporaries`
  removes those of processes that are gone (killed while compiling) or older than :data:`STALE_AFTER`.

Linux only (``/proc/self/fd``); the callers keep nothing off Linux.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import re
import secrets
import socket
import stat
import time

__all__ = ["NotPrivate", "STALE_AFTER", "load_library", "make_temporary_dir", "open_dir", "read_file",
           "remove_stale_temporaries", "remove_tree"]

#: seconds after which a work directory is removed even if its process seems alive (its pid reused, or a
#: process of another pid namespace): well past the 120 s a compile may take
STALE_AFTER = 3600

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
#: descriptors of the libraries loaded through them, kept open for the process's life: the loader knows a
#: library by the name it was opened by, and a later ``dlopen`` of the same ``/proc/self/fd/N`` would be
#: handed that library instead of opening the file now behind ``N``
_LOADED: list[int] = []


class NotPrivate(OSError):
    """A directory or file that others may change (or that is not what it should be), so not trusted."""


def _check(st: os.stat_result, where: str, private: bool, kind: str) -> None:
    uid = os.geteuid()
    owners = (uid,) if private else (uid, 0)
    if st.st_uid not in owners:
        whose = "this user's" if private else "this user's or root's"
        raise NotPrivate(f"{kind} {where} belongs to uid {st.st_uid}, not {whose} (uid {uid})")
    shared = st.st_mode & 0o022
    if shared and (private or not st.st_mode & stat.S_ISVTX):
        raise NotPrivate(f"{kind} {where} may be written by other users (mode {stat.S_IMODE(st.st_mode):04o})")


def open_dir(path: str, *, private: bool, create: bool = False) -> tuple[int, str]:
    """``(descriptor, real path)`` of the directory ``path``, every directory from ``/`` to it checked through
    its own descriptor (module docstring); ``create`` makes the missing ones (mode ``0700``).

    Raises:
        NotPrivate: a directory on the way others may write or own (the message names it), or a symbolic
            link put in after the path was resolved.
        OSError: it does not exist (without ``create``), or cannot be opened or made.
    """
    real = os.path.realpath(path)  # (resolved once: each component of the result is then opened without following)
    parts = [p for p in real.split("/") if p]
    fd = os.open("/", _DIR_FLAGS)
    try:
        _check(os.fstat(fd), "/", private and not parts, "directory")
        for i, name in enumerate(parts):
            last = i == len(parts) - 1
            try:
                nxt = os.open(name, _DIR_FLAGS, dir_fd=fd)
            except FileNotFoundError:
                if not create:
                    raise
                try:
                    os.mkdir(name, 0o700, dir_fd=fd)
                except FileExistsError:  # (made meanwhile, by us or not: checked below like any other)
                    pass
                nxt = os.open(name, _DIR_FLAGS, dir_fd=fd)
            except OSError as e:
                if e.errno in (errno.ELOOP, errno.ENOTDIR):  # (O_NOFOLLOW met a symbolic link: ELOOP)
                    raise NotPrivate(f"{'/' + '/'.join(parts[:i + 1])} is not a directory (or became a "
                                     "symbolic link)") from e
                raise
            os.close(fd)
            fd = nxt
            _check(os.fstat(fd), "/" + "/".join(parts[:i + 1]), private and last, "directory")
        return fd, real
    except BaseException:
        os.close(fd)
        raise


def read_file(dir_fd: int, name: str, max_bytes: int) -> tuple[int, bytes]:
    """``(descriptor, contents)`` of the file ``name`` in the directory ``dir_fd``, opened without following a
    symbolic link and checked through the descriptor: a regular file of this user's that nobody else may write,
    of at most ``max_bytes``; the contents read through that descriptor. The caller closes the descriptor.

    Raises:
        NotPrivate: it fails a check. OSError: it cannot be opened or read.
    """
    fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=dir_fd)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise NotPrivate(f"{name} is not a regular file")
        _check(st, name, True, "file")
        if st.st_size > max_bytes:
            raise NotPrivate(f"{name} holds {st.st_size} bytes, more than the {max_bytes} expected")
        chunks, got = [], 0
        while got <= max_bytes:
            chunk = os.pread(fd, max_bytes + 1 - got, got)
            if not chunk:
                break
            chunks.append(chunk)
            got += len(chunk)
        if got > max_bytes:
            raise NotPrivate(f"{name} grew past {max_bytes} bytes while read")
        return fd, b"".join(chunks)
    except BaseException:
        os.close(fd)
        raise


def load_library(fd: int) -> ctypes.CDLL:
    """The shared library open at ``fd``, loaded through that descriptor (``/proc/self/fd/N``): the loader maps
    exactly the file behind ``fd``. The caller still closes ``fd`` (a duplicate stays open while loaded)."""
    kept = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 0)
    try:
        lib = ctypes.CDLL(f"/proc/self/fd/{kept}")
    except BaseException:
        os.close(kept)  # (nothing was loaded under its name)
        raise
    _LOADED.append(kept)
    return lib


def fsync_dir(dir_fd: int) -> None:
    """Commit the directory's entries (a rename into it) to disk, as far as the file system allows."""
    try:
        os.fsync(dir_fd)
    except OSError:  # (some file systems refuse fsync on a directory: the rename stands, only less durably)
        pass


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9.]", "_", socket.gethostname())[:64] or "host"


def make_temporary_dir(dir_fd: int, prefix: str) -> str:
    """The name of a new directory (mode ``0700``) in ``dir_fd``: ``prefix``, this host, this process's id and a
    random part, so that :func:`remove_stale_temporaries` can tell when its process is gone."""
    name = f"{prefix}{_host()}-{os.getpid()}-{secrets.token_hex(6)}"
    os.mkdir(name, 0o700, dir_fd=dir_fd)
    return name


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:  # (EPERM: it exists, as another user's)
        return False
    return False


def remove_stale_temporaries(dir_fd: int, prefix: str, legacy: tuple[str, ...] = ()) -> list[str]:
    """Remove this user's work directories (:func:`make_temporary_dir`, named ``prefix...``) in ``dir_fd`` whose
    process, on this host, is gone or that are older than :data:`STALE_AFTER`, and entries named ``legacy...``
    (without a process id) older than that; the names removed. Errors (another process removing them too) are
    ignored."""
    removed = []
    now, host = time.time(), _host()
    for name in os.listdir(dir_fd):
        if name.startswith(prefix):
            fields = name[len(prefix):].rsplit("-", 2)
            owner = (fields[0], int(fields[1])) if len(fields) == 3 and fields[1].isdigit() else None
        elif name.startswith(legacy):
            owner = None
        else:
            continue
        try:
            st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        except OSError:
            continue
        if st.st_uid != os.geteuid():  # (another user's, in a shared temporary directory: theirs to remove)
            continue
        old = now - st.st_mtime > STALE_AFTER
        dead = owner is not None and owner[0] == host and owner[1] != os.getpid() and _gone(owner[1])
        if old or dead:
            try:
                remove_tree(dir_fd, name)
                removed.append(name)
            except OSError:
                pass
    return removed


def remove_tree(dir_fd: int, name: str) -> None:
    """Remove ``name`` in ``dir_fd`` and what it holds, through descriptors (no symbolic link followed)."""
    try:
        sub = os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR):  # a file or a symbolic link, not a directory
            os.unlink(name, dir_fd=dir_fd)
            return
        if isinstance(e, FileNotFoundError):
            return
        raise
    try:
        for entry in os.listdir(sub):
            remove_tree(sub, entry)
    finally:
        os.close(sub)
    os.rmdir(name, dir_fd=dir_fd)
