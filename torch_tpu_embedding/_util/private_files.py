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
* :func:`work_dir` makes a private work directory, locked while in use; :func:`remove_stale_temporaries`
  removes those whose lock nobody holds (their process was killed while compiling).

The descriptors and ``openat`` calls are POSIX; the load through a descriptor needs ``/proc/self/fd`` (Linux,
where the kernel cache is kept; elsewhere only a library compiled in a private directory is loaded).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import os
import re
import secrets
import socket
import stat
import time
from collections.abc import Iterator

__all__ = ["NotPrivate", "STALE_AFTER", "fsync_dir", "load_library", "open_dir", "read_file",
           "remove_stale_temporaries", "remove_tree", "work_dir"]

#: seconds after which a work directory whose lock cannot tell is removed even if its process seems alive (its
#: pid reused, say): well past the 2 × 120 s a compile may take
STALE_AFTER = 3600
#: the prefix of a work directory's name until its lock is held
_UNBORN = ".new-"

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


def load_library(fd: int, path: str) -> ctypes.CDLL:
    """The shared library open at ``fd``, loaded through that descriptor (``/proc/self/fd/N``): the loader maps
    exactly the file behind ``fd``, whatever its path ``path`` names by then. Without ``/proc`` (macOS) it is
    loaded by ``path``, which must have been reached through directories :func:`open_dir` checked (only this
    user or root may rename in them). The caller still closes ``fd`` (a duplicate stays open while loaded)."""
    if not os.path.isdir("/proc/self/fd"):
        return ctypes.CDLL(path)
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


@contextlib.contextmanager
def work_dir(dir_fd: int, where: str, prefix: str) -> Iterator[tuple[int, str]]:
    """``(descriptor, real path)`` of a new private directory in ``dir_fd`` (whose real path is ``where``), named
    ``prefix``, this host, this process's id and a random part; removed on exit. While it is in use its ``.lock``
    is held (``flock``): the kernel lets go of it when the process ends however it ends, so that
    :func:`remove_stale_temporaries` can tell one in use from one left by a process that was killed. It is made
    under a hidden name and renamed to ``prefix...`` only once locked: no one sees it unlocked."""
    name = f"{prefix}{_host()}-{os.getpid()}-{secrets.token_hex(6)}"
    hidden = _UNBORN + name
    os.mkdir(hidden, 0o700, dir_fd=dir_fd)
    current, fd, lock = hidden, -1, -1
    try:
        fd = os.open(hidden, _DIR_FLAGS, dir_fd=dir_fd)
        _check(os.fstat(fd), os.path.join(where, hidden), True, "directory")
        lock = os.open(".lock", os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=fd)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # (a file system without locks: others fall back to the process id and the age)
            pass
        os.rename(hidden, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        current = name
        yield fd, os.path.join(where, name)
    finally:
        for held in (lock, fd):
            if held >= 0:
                os.close(held)
        try:
            remove_tree(dir_fd, current)
        except OSError:
            pass


def _in_use(dir_fd: int, name: str) -> bool | None:
    """Whether the work directory ``name``'s lock is held (``None``: it has no lock, or locks do not work here)."""
    try:
        sub = os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
    except OSError:
        return None
    try:
        lock = os.open(".lock", os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=sub)
    except OSError:
        return None
    finally:
        os.close(sub)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return None
    finally:
        os.close(lock)  # (its lock, if taken, with it)
    return False


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:  # (EPERM: it exists, as another user's)
        return False
    return False


def remove_stale_temporaries(dir_fd: int, prefix: str, legacy: tuple[str, ...] = ()) -> list[str]:
    """Remove this user's work directories (:func:`work_dir`, named ``prefix...``) in ``dir_fd`` whose lock no one
    holds (their process is gone: killed while it compiled, say); where the lock cannot tell, those whose process
    on this host is gone or that are older than :data:`STALE_AFTER`; and entries named ``legacy...`` (or left
    before their lock was taken) older than that. The names removed; errors (another process removing them too)
    are ignored."""
    removed = []
    now, host = time.time(), _host()
    for name in os.listdir(dir_fd):
        if not name.startswith((prefix, _UNBORN + prefix, *legacy)):
            continue
        try:
            st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        except OSError:
            continue
        if st.st_uid != os.geteuid():  # (another user's, in a shared temporary directory: theirs to remove)
            continue
        stale = now - st.st_mtime > STALE_AFTER
        if name.startswith(prefix):
            in_use = _in_use(dir_fd, name)
            if in_use is None:
                fields = name[len(prefix):].rsplit("-", 2)
                dead = (len(fields) == 3 and fields[0] == host and fields[1].isdigit()
                        and int(fields[1]) != os.getpid() and _gone(int(fields[1])))
                stale = stale or dead
            else:
                stale = not in_use
        if stale:
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
