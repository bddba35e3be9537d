"""The C add's kernel cache (``optim/_kernels/c_library.py``, ``_util/private_files.py``) trusts nothing it did not
check through the descriptor it loads: a library or cache directory swapped in between the check and the load
(interposed at the loader, deterministically) is not what runs; a cache under a directory others may write or
own is not used; a library cut short (``dlopen`` faults on it: SIGBUS) or altered is compiled again, never
loaded, in a new process that survives; a library built for another CPU (Arm's, whose ``/proc/cpuinfo`` has no
``flags``) is not loaded, and nothing is kept for a CPU that cannot be told; a new library is on disk (fsync) before its rename into the cache; a
process killed while compiling leaves nothing a later build does not remove.
"""

from __future__ import annotations

import ctypes
import hashlib
import io
import os
import signal
import subprocess
import sys
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from torch_tpu_embedding.optim._kernels import c_add, c_library

ROOT = Path(__file__).parents[2]


@pytest.fixture
def cc() -> str:
    """A C compiler's path (the tests build libraries of their own with it); skips where there is none."""
    found = c_library.c_compiler()
    if found is None:
        pytest.skip("no C compiler here")
    return found[0]


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch, cc: str) -> Iterator[None]:
    """No loop built in this process yet (each ``c_add.loop()`` then builds as a new process's first would)."""
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setattr(c_library, "_LIBRARY", [])
    monkeypatch.setattr(c_library, "_REFUSED", [], raising=False)  # (warned again in each test)
    yield


def _rebuild(monkeypatch: pytest.MonkeyPatch) -> Any:
    """The loop as the next process would build it."""
    monkeypatch.setattr(c_library, "_LIBRARY", [])
    return c_add.loop()


def _check_loop(fn: Any) -> None:
    """``fn`` is the loop: one piece against torch's ``index_add_``."""
    p, ids, rows = torch.zeros(8, 4), torch.tensor([1, 5, 1]), torch.arange(12.0).view(3, 4)
    want = p.clone().index_add_(0, ids, -0.5 * rows)
    c_add.add_piece(fn, p, ids, rows, None, torch.tensor(-0.5), torch.empty(4))
    assert torch.equal(p, want)


def _foreign_library(cc: str, where: Path, marker: Path) -> Path:
    """A library another user would put in the cache: its constructor writes ``marker`` when it is loaded."""
    src = where / "foreign.c"
    src.write_text('#include <stdio.h>\n'
                   '__attribute__((constructor)) static void foreign(void) {\n'
                   '  FILE *f = fopen(MARKER, "w"); if (f) { fputs("ran", f); fclose(f); } }\n'
                   'int tte_add_rows(void) { return -1; }\n')
    lib = where / "foreign.so"
    subprocess.run([cc, "-shared", "-fPIC", f'-DMARKER="{marker}"', str(src), "-o", str(lib)], check=True)
    lib.chmod(0o700)
    return lib


def _kept(cache: Path) -> list[Path]:
    return sorted(cache.glob("add_rows-*.so"))


def _loads(monkeypatch: pytest.MonkeyPatch, before_load: Any = None) -> list[str]:
    """The real path of every library ``dlopen``\\ ed from now on (``before_load(path)`` runs first, as the other
    user's swap would, between the check and the loader's open)."""
    seen: list[str] = []
    real = ctypes.CDLL

    def cdll(name: str, *args: Any, **kw: Any) -> Any:
        path = os.path.realpath(name)  # (through /proc/self/fd/N: the file that descriptor holds)
        seen.append(path)
        if before_load is not None:
            before_load(path)
        return real(name, *args, **kw)

    monkeypatch.setattr(ctypes, "CDLL", cdll)
    return seen


# --------------------------------------------------------------------------- swapped between check and load
@pytest.mark.parametrize("swap", ["file", "directory", "directory_under_a_shared_parent"])
def test_a_library_swapped_in_between_the_check_and_the_load_never_runs(monkeypatch: pytest.MonkeyPatch,
                                                                          tmp_path: Path, cc: str, fresh: None,
                                                                          swap: str) -> None:
    """Another user swaps the cached library, or the whole cache directory (``renameat2(RENAME_EXCHANGE)`` in the
    issue), at the one moment that matters: after the checks, as the loader opens the library. The library
    checked is the one loaded; the foreign one's constructor never runs, then or in a later build."""
    parent = tmp_path / ("shared" if swap == "directory_under_a_shared_parent" else "private")
    parent.mkdir()
    cache = parent / "kernels"
    monkeypatch.setenv("TTE_KERNEL_CACHE", str(cache))
    marker = tmp_path / "foreign_constructor_ran"
    foreign = _foreign_library(cc, tmp_path, marker)
    c_add.loop()  # (the cache holds this user's library)
    if swap == "directory_under_a_shared_parent":
        parent.chmod(0o777)  # (anyone may rename in it: the other user's way in)

    def other_user(path: str) -> None:
        if not path.startswith(str(parent) + "/") or marker.exists() or (tmp_path / "swapped").exists():
            return
        (tmp_path / "swapped").touch()
        if swap == "file":
            os.replace(foreign, path)
        else:
            os.rename(cache, parent / "aside")
            cache.mkdir()
            os.replace(foreign, cache / os.path.basename(path))

    loads = _loads(monkeypatch, other_user)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # (the shared parent's cache refused: warned)
        fn = _rebuild(monkeypatch)
        assert not marker.exists(), "the foreign library's constructor ran in this process"
        _check_loop(fn)  # (the loop checked is the loop loaded)
        _check_loop(_rebuild(monkeypatch))  # a later build does not load it either
    assert not marker.exists()
    if swap == "directory_under_a_shared_parent":
        assert not any(p.startswith(str(parent)) for p in loads)  # that cache was never loaded from


@pytest.mark.parametrize("case", ["world_writable_parent", "parent_of_another_user", "world_writable_grandparent",
                                  "cache_of_another_user", "symlink_into_a_shared_directory"])
def test_a_cache_others_may_change_is_not_used(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, fresh: None,
                                               case: str) -> None:
    """Every directory above the cache is checked, not only the cache: where another user may rename in one of
    them (or owns it), nothing is loaded from or kept in the cache; one warning names the directory, and the loop
    is compiled for this process and runs."""
    top = tmp_path / "top"
    cache = top / "mid" / "kernels"
    cache.mkdir(parents=True, mode=0o700)
    named = cache
    if "another_user" in case and os.getuid() != 0:
        pytest.skip("only root can give a directory to another user")
    if case == "world_writable_parent":
        cache.parent.chmod(0o777)
    elif case == "parent_of_another_user":
        os.chown(cache.parent, 65534, 65534)  # (nobody's)
    elif case == "world_writable_grandparent":
        top.chmod(0o777)
    elif case == "cache_of_another_user":
        os.chown(cache, 65534, 65534)
    else:
        cache.parent.chmod(0o777)
        named = tmp_path / "link"
        named.symlink_to(cache)  # (our own link, resolved: the directories checked are the real ones)
    monkeypatch.setenv("TTE_KERNEL_CACHE", str(named))
    loads = _loads(monkeypatch)
    with pytest.warns(RuntimeWarning, match="not used: directory .* (belongs to uid 65534|may be written by other)"):
        _check_loop(c_add.loop())
    assert _kept(cache) == []
    assert not any(p.startswith(str(tmp_path)) for p in loads)


def test_a_cache_under_roots_sticky_directory_is_used(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                      fresh: None) -> None:
    """A world-writable directory with the sticky bit (``/tmp``) lets nobody else rename what is ours in it: a
    private cache below one is used (kept, then loaded without a compile), and no warning."""
    shared = tmp_path / "sticky"
    shared.mkdir()
    shared.chmod(0o1777)
    monkeypatch.setenv("TTE_KERNEL_CACHE", str(shared / "kernels"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _check_loop(c_add.loop())
        (kept,) = _kept(shared / "kernels")
        loads = _loads(monkeypatch)
        _check_loop(_rebuild(monkeypatch))
    assert loads == [str(kept)]


# ------------------------------------------------------------------------------- damaged cached libraries
_CHILD = """
import torch
from torch_tpu_embedding.optim._kernels import c_add
fn = c_add.loop()
p, ids, rows = torch.zeros(8, 4), torch.tensor([1, 5, 1]), torch.arange(12.0).view(3, 4)
want = p.clone().index_add_(0, ids, -0.5 * rows)
c_add.add_piece(fn, p, ids, rows, None, torch.tensor(-0.5), torch.empty(4))
assert torch.equal(p, want)
print("ok")
"""


def _child(cache: Path, code: str = _CHILD, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT), "TTE_KERNEL_CACHE": str(cache), **env})


@pytest.mark.parametrize("size", [4096, 8192])
def test_a_cached_library_cut_short_is_compiled_again_and_the_process_lives(monkeypatch: pytest.MonkeyPatch,
                                                                            tmp_path: Path, fresh: None,
                                                                            size: int) -> None:
    """A library cut to a few KiB (a crash while written) made ``dlopen`` fault (SIGBUS) in every later process.
    Its bytes no longer hash to its name: a new process removes it, compiles the loop again and runs; the cache
    then holds the whole library again."""
    cache = tmp_path / "kernels"
    monkeypatch.setenv("TTE_KERNEL_CACHE", str(cache))
    # Compiled by a child: a library this process had loaded would be mapped here, and cutting its file short
    # would make this process fault (SIGBUS) when it next touches those pages, at the latest at exit.
    first = _child(cache)
    assert first.returncode == 0 and first.stdout.strip() == "ok", (first.returncode, first.stderr[-2000:])
    (kept,) = _kept(cache)
    whole = kept.read_bytes()
    assert len(whole) > size
    os.truncate(kept, size)
    out = _child(cache)
    assert out.returncode == 0 and out.stdout.strip() == "ok", (out.returncode, out.stderr[-2000:])
    (again,) = _kept(cache)
    assert again.read_bytes() == whole and hashlib.sha256(whole).hexdigest() in again.name


def test_an_altered_cached_library_is_never_loaded(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                   fresh: None) -> None:
    """One byte changed, size and owner as before: the library fails its hash and is compiled again and replaced,
    never handed to the loader."""
    cache = tmp_path / "kernels"
    monkeypatch.setenv("TTE_KERNEL_CACHE", str(cache))
    c_add.loop()
    (kept,) = _kept(cache)
    data = bytearray(kept.read_bytes())
    data[len(data) // 2] ^= 0xFF
    altered = cache / "altered"
    altered.write_bytes(bytes(data))
    altered.chmod(0o700)
    os.replace(altered, kept)
    inode = kept.stat().st_ino
    loads: list[int] = []
    real = ctypes.CDLL

    def cdll(name: str, *args: Any, **kw: Any) -> Any:
        loads.append(os.stat(name).st_ino)
        return real(name, *args, **kw)

    monkeypatch.setattr(ctypes, "CDLL", cdll)
    _check_loop(_rebuild(monkeypatch))
    assert loads and inode not in loads
    (again,) = _kept(cache)
    assert again.read_bytes() != bytes(data)


def test_the_library_is_on_disk_before_its_rename_into_the_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                                 fresh: None) -> None:
    """fsync of the library before it is renamed into the cache (a crash then leaves all of it or none under its
    name), then of the cache directory (the rename itself kept)."""
    cache = tmp_path / "kernels"
    monkeypatch.setenv("TTE_KERNEL_CACHE", str(cache))
    events: list[tuple[str, Any]] = []
    real_fsync, real_rename, real_replace = os.fsync, os.rename, os.replace

    def fsync(fd: int) -> None:
        events.append(("fsync", os.fstat(fd).st_ino))
        real_fsync(fd)

    def rename(src: Any, dst: Any, **kw: Any) -> None:
        real_rename(src, dst, **kw)
        events.append(("rename", os.path.basename(dst)))

    def replace(src: Any, dst: Any, **kw: Any) -> None:
        real_replace(src, dst, **kw)
        events.append(("rename", os.path.basename(dst)))

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "rename", rename)
    monkeypatch.setattr(os, "replace", replace)
    c_add.loop()
    (kept,) = _kept(cache)
    renamed = events.index(("rename", kept.name))
    assert ("fsync", kept.stat().st_ino) in events[:renamed]
    assert ("fsync", cache.stat().st_ino) in events[renamed:]


# ---------------------------------------------------------------------------------- the CPU it was built for
#: two Arm CPUs as /proc/cpuinfo shows them (no "model name" nor "flags" lines): a Neoverse N1, and a V1 with SVE
_NEOVERSE_N1 = ("processor\t: 0\nBogoMIPS\t: 243.75\nFeatures\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics "
                "fphp asimdhp cpuid asimdrdm lrcpc dcpop asimddp ssbs\nCPU implementer\t: 0x41\nCPU architecture: "
                "8\nCPU variant\t: 0x3\nCPU part\t: 0xd0c\nCPU revision\t: 1\n\n")
_NEOVERSE_V1 = ("processor\t: 0\nBogoMIPS\t: 2100.00\nFeatures\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics "
                "fphp asimdhp cpuid asimdrdm jscvt fcma lrcpc dcpop sha3 sm3 sm4 asimddp sha512 sve asimdfhm dit uscat "
                "ilrcpc flagm ssbs paca pacg dcpodp svei8mm svebf16 i8mm bf16 dgh rng\nCPU implementer\t: 0x41\n"
                "CPU architecture: 8\nCPU variant\t: 0x1\nCPU part\t: 0xd40\nCPU revision\t: 1\n\n")


def _cpuinfo(monkeypatch: pytest.MonkeyPatch, text: str | None) -> None:
    """``/proc/cpuinfo`` reads as ``text`` in ``c_library`` from now on (``None``: it cannot be read)."""
    real = open

    def fake(file: Any, *args: Any, **kw: Any) -> Any:
        if file == "/proc/cpuinfo":
            if text is None:
                raise PermissionError(13, "Permission denied", file)
            return io.StringIO(text)
        return real(file, *args, **kw)

    monkeypatch.setattr(c_library, "open", fake, raising=False)  # (c_library's open: a module global before the builtin)


def _counted_compiles(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Where each compile of the loop from now on works (``c_library._compile``'s directory)."""
    where: list[str] = []
    real = c_library._compile

    def compile_(cc: Any, flags: Any, where_fd: int, at: str, stem: Any) -> Any:
        where.append(at)
        return real(cc, flags, where_fd, at, stem)

    monkeypatch.setattr(c_library, "_compile", compile_)
    return where


def test_a_library_built_for_another_cpu_is_never_loaded(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                         fresh: None) -> None:
    """A cache shared by hosts of two Arm CPUs (a home directory): ``-march=native`` built the first host's library
    for its CPU (the N1's), which the V1's must not load (nor the N1's the V1's, whose SVE it lacks: SIGILL). Arm's
    ``/proc/cpuinfo`` has no ``model name`` nor ``flags``: the key held no CPU at all, and the V1 loaded the N1's."""
    cache = tmp_path / "kernels"
    monkeypatch.setenv("TTE_KERNEL_CACHE", str(cache))
    compiles = _counted_compiles(monkeypatch)
    _cpuinfo(monkeypatch, _NEOVERSE_N1)
    _check_loop(_rebuild(monkeypatch))
    assert len(compiles) == 1 and len(_kept(cache)) == 1
    _cpuinfo(monkeypatch, _NEOVERSE_V1)
    _check_loop(_rebuild(monkeypatch))
    assert len(compiles) == 2, "the other CPU's library was loaded"
    assert len(_kept(cache)) == 2
    _cpuinfo(monkeypatch, _NEOVERSE_N1)  # (each CPU's own library is still kept and loaded)
    _check_loop(_rebuild(monkeypatch))
    assert len(compiles) == 2


@pytest.mark.parametrize("cpuinfo", ["unreadable", "no_identity"])
def test_a_cpu_that_cannot_be_told_keeps_nothing(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, fresh: None,
                                                 cpuinfo: str) -> None:
    """Where ``/proc/cpuinfo`` cannot be read or names no CPU, a library compiled for it could be loaded on any
    other CPU later: it is compiled for this process alone, and nothing is kept nor loaded from the cache."""
    cache = tmp_path / "kernels"
    monkeypatch.setenv("TTE_KERNEL_CACHE", str(cache))
    compiles = _counted_compiles(monkeypatch)
    _cpuinfo(monkeypatch, None if cpuinfo == "unreadable" else "processor\t: 0\nBogoMIPS\t: 50.00\n\n")
    _check_loop(_rebuild(monkeypatch))
    _check_loop(_rebuild(monkeypatch))
    assert len(compiles) == 2 and not any(at.startswith(str(cache)) for at in compiles)
    assert not cache.exists() or _kept(cache) == []


# ------------------------------------------------------------------------------ killed while compiling
def test_the_work_directory_of_a_process_killed_while_compiling_is_removed(monkeypatch: pytest.MonkeyPatch,
                                                                           tmp_path: Path, fresh: None) -> None:
    """A process killed while its compiler ran left its source and work directory in the cache for good; the next
    build removes them (their process is gone) and keeps only the library."""
    cache = tmp_path / "kernels"
    started = tmp_path / "compiler_started"
    compiler = tmp_path / "slow_cc"
    compiler.write_text(f'#!/bin/sh\necho $$ > "{started}.part" && mv "{started}.part" "{started}"\nexec sleep 600\n')
    compiler.chmod(0o700)
    child = subprocess.Popen([sys.executable, "-c", "from torch_tpu_embedding.optim._kernels import c_add; "
                              "c_add.loop()"], cwd=ROOT, start_new_session=True,
                             env={**os.environ, "PYTHONPATH": str(ROOT), "TTE_KERNEL_CACHE": str(cache),
                                  "CC": str(compiler)})
    try:
        for _ in range(3000):  # (until the compiler runs: a bound on waiting, nothing measured)
            if started.exists() or child.poll() is not None:
                break
            time.sleep(0.1)
        assert started.exists(), "the child never ran its compiler"
    finally:
        os.killpg(child.pid, signal.SIGKILL)  # (the child's own session: it and its compiler)
        child.wait()
    left = [p.name for p in cache.iterdir()]
    assert left and _kept(cache) == []  # (its work directory, holding the source)
    monkeypatch.setenv("TTE_KERNEL_CACHE", str(cache))
    _check_loop(c_add.loop())
    assert [p.name for p in cache.iterdir()] == [p.name for p in _kept(cache)] != []
