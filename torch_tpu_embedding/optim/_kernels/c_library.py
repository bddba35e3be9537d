"""The kernels' one C library: its source assembled, compiled, kept in a verified on-disk cache and loaded.

SGD's add loop (:mod:`.c_add`, source in :mod:`.c_add_source`), RowWiseAdagrad's and Adam's fused row loops
(:mod:`.c_rules`, source in :mod:`.c_rules_source`) and the lookup's row gather and id join (:mod:`.c_gather`)
are one library: one build, one cache entry, one set of checks (:func:`library`).

The library is compiled with the system's C compiler (``CC``, else ``cc``, ``gcc`` or ``clang``) and called
through :mod:`ctypes`. On Linux it is kept in :func:`cache_dir` (``TTE_KERNEL_CACHE``, else
``~/.cache/torch_tpu_embedding/kernels``), named by a hash of the source, the compiler command and flags and the
CPU's identity (``-march=native``: x86's model and flags, Arm's part and features; where ``/proc/cpuinfo`` tells
none, nothing is kept), so later processes load it instead of compiling: the compiler's process inside the step
that first adds through the loop slowed the next steps too (docs/benchmarks.md).
``TTE_KERNEL_CACHE=0`` turns the cache off. A library there runs as this user, so nothing in it is trusted
unchecked (:mod:`~torch_tpu_embedding._util.private_files`; docs/reliability.md, "The kernel cache"): the
cache directory is used only if it is this user's and nobody else may write it, nor any directory above it (a
sticky one such as ``/tmp`` excepted), all checked through descriptors (one warning, then a compile for this
process, if not); a library is named by the sha256 of its bytes, opened without following links, checked
(this user's, nobody else may write it) and hashed through its descriptor, and loaded through that same
descriptor (``/proc/self/fd/N``), so that neither a swap after the check nor a file cut short (``dlopen``
faults on one) is loaded: one that fails is removed and compiled again. A new library is written to disk
(fsync) before it is renamed into the cache; a compile's work directory holds a lock while in use, and the
next build removes those whose lock is free (their process killed while compiling). Where no library loads
from the cache (a ``noexec`` mount), the loop is compiled again in a private directory under the system's
temporary one.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import warnings
from collections.abc import Callable
from typing import NamedTuple

from torch_tpu_embedding._util import private_files
from torch_tpu_embedding._util.env import is_off
from torch_tpu_embedding.optim._kernels import kernel_policy
from torch_tpu_embedding.optim._kernels.c_add_source import SOURCE as ADD_SOURCE
from torch_tpu_embedding.optim._kernels.c_rules_source import SOURCE as RULES_SOURCE

__all__ = ["Library", "c_compiler", "cache_dir", "library", "loaded"]

_SOURCE = ADD_SOURCE + RULES_SOURCE  # (one library: the fused row rules of .c_rules too)


class Library(NamedTuple):
    """The functions of the compiled library: the add loop, :mod:`.c_rules`' fused row updates and sort, and
    :mod:`.c_gather`'s row gather and id join."""

    add: Callable[..., int]
    rowwise_adagrad: Callable[..., int]
    adam: Callable[..., int]
    sort_keys: Callable[..., None]
    gather: Callable[..., int]
    group_ids: Callable[..., int]
    rows_ok: Callable[..., int]
    join_ids: Callable[..., int]


#: the compiled library (``None``: it could not be compiled), once per process
_LIBRARY: list[Library | None] = []
_BUILDING = threading.Lock()  # (held while one thread builds or loads the library: the others wait for it)
#: the kernel cache refused (others may change it): warned once per process
_REFUSED: list[str] = []
#: the work directories of compiles (with host and process id); the old ``TemporaryDirectory`` ones' prefix
_TEMPORARY, _LEGACY_TEMPORARY = "tmp-add_rows-", "tte_add_rows_"
#: a cached library's name ends in the sha256 of its bytes; no library of the loop is near this size
_DIGEST, _MAX_BYTES = re.compile(r"[0-9a-f]{64}"), 16 << 20
#: the lines of ``/proc/cpuinfo`` that tell what ``-march=native`` compiles for: x86's, Arm's (which has no
#: ``model name`` nor ``flags``: SVE is in its ``Features``), RISC-V's, POWER's and s390's
_CPU_FIELDS = ("vendor_id", "cpu family", "model", "model name", "stepping", "flags", "CPU implementer",
               "CPU architecture", "CPU variant", "CPU part", "CPU revision", "Features", "isa", "uarch", "cpu",
               "features")


def c_compiler() -> list[str] | None:
    """The command of the C compiler the loop is built with: ``CC`` (split as a shell would, e.g. ``ccache gcc``),
    else the first of ``cc``, ``gcc``, ``clang`` on the PATH."""
    cc = shlex.split(os.environ.get("CC", ""))
    if cc:
        return cc
    for name in ("cc", "gcc", "clang"):
        found = shutil.which(name)
        if found:
            return [found]
    return None


def cache_dir() -> str | None:
    """Where compiled loops are kept for later processes (Linux): ``TTE_KERNEL_CACHE``, else
    ``$XDG_CACHE_HOME/torch_tpu_embedding/kernels`` (``~/.cache/...``), also for a value that turns a switch on
    (``1``, ``true``, ``on``, ``yes``: not a directory ``1`` made in the working directory); ``None`` with
    ``TTE_KERNEL_CACHE=0``, off Linux (no CPU identity to name a ``-march=native`` library by) or without a home
    (no ``HOME`` nor passwd entry, as in a container run as an arbitrary uid: not a directory ``~`` made in the
    working directory). A relative ``TTE_KERNEL_CACHE`` is taken from the working directory of the process's first
    build; a relative ``XDG_CACHE_HOME`` is ignored, as its specification says."""
    chosen = os.environ.get("TTE_KERNEL_CACHE", "").strip()
    if is_off(chosen) or not sys.platform.startswith("linux"):
        return None
    if chosen and chosen.lower() not in ("1", "true", "on", "yes"):
        return os.path.abspath(os.path.expanduser(chosen))
    base = os.environ.get("XDG_CACHE_HOME", "")
    if not os.path.isabs(base):
        base = os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "torch_tpu_embedding", "kernels") if os.path.isabs(base) else None


def _cpu() -> str:
    """The CPU's identity for ``-march=native`` (:data:`_CPU_FIELDS` of ``/proc/cpuinfo``: x86's model and flags,
    Arm's implementer, part and features, ...); ``""`` where it cannot be told (nothing is then kept: a library
    compiled for one CPU may not run on another, as a cache in a home directory shared by several hosts has it)."""
    try:
        with open("/proc/cpuinfo") as f:
            text = f.read()
    except OSError:
        return ""
    lines = [ln.strip() for ln in text.splitlines() if ln.split(":")[0].strip() in _CPU_FIELDS]
    return "\n".join(dict.fromkeys(lines))  # (one line of each, as every core repeats them)


def loaded() -> Library | None:
    """The library if this process has already loaded it (:func:`library`), else ``None``: nothing is compiled."""
    return _LIBRARY[0] if _LIBRARY else None


def library() -> Library | None:
    """The functions of :data:`_SOURCE`, loaded from :func:`cache_dir` or compiled, on the first call; ``None``
    (after one warning) if they cannot be (no compiler, a failed compile or load, a symbol missing: AttributeError)."""
    with _BUILDING:  # (one build: the join of host ids may ask from a pipeline's thread at once)
        if not _LIBRARY:
            try:
                _LIBRARY.append(_build())
            except (OSError, RuntimeError, AttributeError, subprocess.SubprocessError) as e:
                _LIBRARY.append(None)
                text = str(e).strip()
                kernel_policy.warn_once(f"{type(e).__name__}: {text.splitlines()[0] if text else ''}")
        return _LIBRARY[0]


def _load(fd: int, path: str) -> Library:
    """The functions of the library open at ``fd`` (at ``path``), loaded through that descriptor (the file
    checked): :func:`.private_files.load_library`."""
    lib = private_files.load_library(fd, path)  # (the mapping outlives the file, deleted or replaced)
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    # (the rules': rows, d, ids, n, offsets, cols, weights, src, ss0, ncols, srows, hp, g after the table and slots)
    rows: list[type[ctypes.c_int64 | ctypes.c_void_p]] = [i64, i64, ptr, i64, ptr, ptr, ptr, ptr, i64, i64, i64,
                                                          ptr, ptr]
    fns = (lib.tte_add_rows, lib.tte_rowwise_adagrad_rows, lib.tte_adam_rows)
    fns[0].argtypes = [ptr, i64, i64, ptr, i64, i64, ptr, i64, i64, ptr, ptr, ptr]
    fns[1].argtypes = [ptr, ptr, *rows]
    fns[2].argtypes = [ptr, ptr, ptr, *rows]
    for fn in fns:
        fn.restype = ctypes.c_int
    sort = lib.tte_sort_keys
    sort.argtypes, sort.restype = [ptr, ptr, i64, i64], None
    gather = lib.tte_gather_rows
    gather.argtypes, gather.restype = [ptr, ptr, i64, i64, ptr, i64], ctypes.c_int
    group = lib.tte_group_ids
    group.argtypes, group.restype = [ptr, i64, i64, i64, i64, ptr, ptr, ptr, ptr, ptr, ptr], i64
    rows_ok = lib.tte_rows_ok
    rows_ok.argtypes, rows_ok.restype = [ptr, i64, i64, ptr, ptr, i64, i64], ctypes.c_int
    join = lib.tte_join_ids
    join.argtypes, join.restype = [ptr, ctypes.c_int, ptr, ptr, ptr, ptr, i64, i64, i64, i64, i64], ctypes.c_int
    return Library(*fns, sort, gather, group, rows_ok, join)


def _build() -> Library:
    cc = c_compiler()
    if cc is None:
        raise RuntimeError("no C compiler (set CC, or install cc, gcc or clang)")
    cc = [shutil.which(cc[0]) or cc[0], *cc[1:]]  # (a path: see close_fds in _compile)
    # -ffp-contract=off: a product and a sum, each rounded, as torch's mul and index_add_ (an FMA
    # would round once and differ in the last bit). -fno-math-errno: sqrtf vectorised (IEEE sqrt all the
    # same; nothing reads errno). -march=native only where the compiler takes it.
    flags = ["-O3", "-ffp-contract=off", "-fno-math-errno", "-fPIC", "-shared"]
    cpu = _cpu()
    cache = cache_dir() if cpu else None  # (a CPU it cannot tell apart from another: nothing kept nor loaded)
    if cache is not None:
        key = hashlib.sha256("\0".join([_SOURCE, *cc, *flags, platform.machine(), cpu]).encode()).hexdigest()
        stem = f"add_rows-{key[:24]}-"
        try:
            cache_fd, real = private_files.open_dir(cache, private=True, create=True)
        except private_files.NotPrivate as e:
            _refused(cache, e)
        except OSError:  # (it cannot be made or opened: nothing kept, as with TTE_KERNEL_CACHE=0)
            pass
        else:
            try:
                private_files.remove_stale_temporaries(cache_fd, _TEMPORARY, legacy=(_LEGACY_TEMPORARY,))
                fn = _load_kept(cache_fd, real, stem)
                if fn is not None:
                    return fn
                try:
                    return _compile(cc, flags, cache_fd, real, stem)
                except OSError:  # e.g. a cache on a noexec mount, whose libraries do not load
                    pass
            finally:
                os.close(cache_fd)
    # In a directory of its own under the system's temporary one (root's, sticky), for this process only.
    tmp_fd, real = private_files.open_dir(tempfile.gettempdir(), private=False)
    try:
        private_files.remove_stale_temporaries(tmp_fd, _TEMPORARY)
        return _compile(cc, flags, tmp_fd, real, None)
    finally:
        os.close(tmp_fd)


def _refused(cache: str, why: OSError) -> None:
    """Warn, once per process, that the kernel cache is not used because others may change it."""
    if _REFUSED:
        return
    _REFUSED.append(cache)
    warnings.warn(f"torch_tpu_embedding: the kernel cache {cache} (TTE_KERNEL_CACHE) is not used: {why}; the C add "
                  "is compiled for this process only. Point TTE_KERNEL_CACHE at a directory that only you may "
                  "write, under directories only you or root may write (chmod go-w), or set TTE_KERNEL_CACHE=0.",
                  RuntimeWarning, stacklevel=4)


def _load_kept(cache_fd: int, cache: str, stem: str) -> Library | None:
    """The loop from the cache's ``{stem}{sha256 of the library}.so``, checked through the descriptor it is loaded
    by: this user's, nobody else may write it, and its bytes hash to its name's (a library cut short would make
    ``dlopen`` fault); one that fails is removed (compiled again and replaced), never loaded. ``None``: none."""
    for name in sorted(os.listdir(cache_fd)):
        digest = name[len(stem):-3] if name.startswith(stem) and name.endswith(".so") else ""
        if not _DIGEST.fullmatch(digest):
            continue
        try:
            fd, data = private_files.read_file(cache_fd, name, _MAX_BYTES)
        except OSError:  # (NotPrivate included)
            _discard(cache_fd, name)
            continue
        try:
            if hashlib.sha256(data).hexdigest() != digest:
                _discard(cache_fd, name)
                continue
            try:
                return _load(fd, os.path.join(cache, name))
            except (OSError, AttributeError):  # unloadable or not the loop: compiled again, and replaced
                _discard(cache_fd, name)
        finally:
            os.close(fd)
    return None


def _discard(dir_fd: int, name: str) -> None:
    """Remove ``name`` from the cache (whatever it is: a library that failed its checks is never kept)."""
    try:
        private_files.remove_tree(dir_fd, name)
    except OSError:
        pass


def _compile(cc: list[str], flags: list[str], where_fd: int, where: str, stem: str | None) -> Library:
    """The loop compiled in a new directory of its own in ``where`` (open at ``where_fd``, its real path) and loaded
    through the descriptor its bytes were read by; with ``stem``, the library then kept in ``where`` as
    ``{stem}{its sha256}.so``, written to disk (fsync) before it is renamed there. The work directory is removed
    (if this process is killed first, a later build removes it: its lock is free)."""
    with private_files.work_dir(where_fd, where, _TEMPORARY) as (tmp_fd, tmp):
        return _compile_in(cc, flags, tmp_fd, tmp, where_fd, stem)


def _compile_in(cc: list[str], flags: list[str], tmp_fd: int, tmp: str, where_fd: int,
                stem: str | None) -> Library:
    src, lib = os.path.join(tmp, "add_rows.c"), os.path.join(tmp, "add_rows.so")
    with open(os.open("add_rows.c", os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                      dir_fd=tmp_fd), "w") as f:
        f.write(_SOURCE)
    errors = ""
    for extra in (["-march=native"], []):
        # close_fds=False and the compiler's path: CPython then starts it with posix_spawn, not fork. A fork
        # while a process group's gloo threads run aborted 3 of 43 two-rank runs at exit (std::terminate);
        # none of 32 did with posix_spawn or with the compile before init_process_group. (Python's own
        # descriptors are not inheritable: the compiler gets no more than it would.) The paths are safe to
        # name: every directory on them was checked, and none but this user or root may rename in them.
        run = subprocess.run([*cc, *flags, *extra, src, "-o", lib], capture_output=True, text=True, timeout=120,
                             close_fds=False)
        if run.returncode == 0:
            break
        errors = run.stderr.strip()
    else:
        raise RuntimeError(f"{' '.join(cc)} failed: {errors.splitlines()[0] if errors else 'no output'}")
    fd, data = private_files.read_file(tmp_fd, "add_rows.so", _MAX_BYTES)
    try:
        fn = _load(fd, lib)
        if stem is not None:
            # Kept once it loaded, under the hash of the bytes just read and loaded: on disk (fsync) before
            # the rename, so that a crash leaves the whole library or none under its name, and the rename
            # itself then written (processes compiling at once each rename their own; the last stays). A
            # cache that cannot take it only costs the next process a compile.
            try:
                os.fchmod(fd, 0o700)
                os.fsync(fd)
                kept = f"{stem}{hashlib.sha256(data).hexdigest()}.so"
                os.rename("add_rows.so", kept, src_dir_fd=tmp_fd, dst_dir_fd=where_fd)
                private_files.fsync_dir(where_fd)
                for name in os.listdir(where_fd):  # (another process's build of the same loop, differing in bytes)
                    if name.startswith(stem) and name != kept:
                        _discard(where_fd, name)
            except OSError:
                pass
    finally:
        os.close(fd)
    return fn
