"""``_util/private_files.py``: directories and files checked through the descriptors they are used by. A symbolic
link put on the path after it was resolved (interposed at that point), a directory others may write or own
anywhere on the path, and a file that is a link, not regular, others', writable by others or too large are
refused; a library loads through its descriptor even after its path names another file; work directories are
removed once their process is gone or they are old, never another user's or a live recent one.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from torch_tpu_embedding._util import private_files
from torch_tpu_embedding._util.private_files import NotPrivate


def _close(fd_and: tuple[int, Any]) -> Any:
    os.close(fd_and[0])
    return fd_and[1]


def test_open_dir_checks_every_directory_from_the_root(tmp_path: Path) -> None:
    deep = tmp_path / "a" / "b"
    assert _close(private_files.open_dir(str(deep), private=True, create=True)) == str(deep)
    assert deep.is_dir() and (deep.stat().st_mode & 0o777) == 0o700
    (tmp_path / "a").chmod(0o777)
    with pytest.raises(NotPrivate, match=f"directory {tmp_path / 'a'} may be written by other users .mode 0777"):
        private_files.open_dir(str(deep), private=True)
    (tmp_path / "a").chmod(0o1777)  # (sticky: others cannot rename what is ours in it)
    _close(private_files.open_dir(str(deep), private=True))
    deep.chmod(0o1777)  # (but the directory itself must be private)
    with pytest.raises(NotPrivate, match="may be written by other users"):
        private_files.open_dir(str(deep), private=True)
    _close(private_files.open_dir(str(deep), private=False))
    with pytest.raises(FileNotFoundError):
        private_files.open_dir(str(tmp_path / "missing"), private=True)


@pytest.mark.skipif(os.getuid() != 0, reason="only root can give a directory to another user")
def test_open_dir_refuses_a_directory_of_another_user_on_the_way(tmp_path: Path) -> None:
    (tmp_path / "theirs" / "ours").mkdir(parents=True)
    os.chown(tmp_path / "theirs", 65534, 65534)
    with pytest.raises(NotPrivate, match=f"{tmp_path / 'theirs'} belongs to uid 65534"):
        private_files.open_dir(str(tmp_path / "theirs" / "ours"), private=True)


def test_a_symbolic_link_put_on_the_path_after_it_was_resolved_is_refused(monkeypatch: pytest.MonkeyPatch,
                                                                          tmp_path: Path) -> None:
    """The walk opens each component without following links: a directory swapped for a link to somewhere else
    between the path's resolution and the walk is not entered."""
    (tmp_path / "ours" / "cache").mkdir(parents=True)
    (tmp_path / "elsewhere" / "cache").mkdir(parents=True)
    real = os.path.realpath

    def resolved_then_swapped(path: str) -> str:
        out = real(path)
        os.rename(tmp_path / "ours", tmp_path / "aside")
        (tmp_path / "ours").symlink_to(tmp_path / "elsewhere")
        return out

    monkeypatch.setattr(private_files.os.path, "realpath", resolved_then_swapped)
    with pytest.raises(NotPrivate, match="symbolic link"):
        private_files.open_dir(str(tmp_path / "ours" / "cache"), private=True)


@pytest.mark.parametrize("kind", ["symlink", "fifo", "directory", "world_writable", "too_large", "another_user"])
def test_read_file_refuses_what_is_not_a_private_regular_file(tmp_path: Path, kind: str) -> None:
    target = tmp_path / "real"
    target.write_bytes(b"x" * 100)
    target.chmod(0o600)
    name = tmp_path / "f"
    if kind == "symlink":
        name.symlink_to(target)
    elif kind == "fifo":
        os.mkfifo(name, 0o600)  # (opened without blocking: no writer needed to be refused)
    elif kind == "directory":
        name.mkdir()
    else:
        os.replace(target, name)
        if kind == "world_writable":
            name.chmod(0o666)
        elif kind == "another_user":
            if os.getuid() != 0:
                pytest.skip("only root can give a file to another user")
            os.chown(name, 65534, 65534)
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        with pytest.raises(OSError):
            private_files.read_file(fd, "f", 10 if kind == "too_large" else 1000)
    finally:
        os.close(fd)


def test_a_library_loads_through_its_descriptor_whatever_its_path_names_by_then(tmp_path: Path) -> None:
    cc = next(filter(None, map(shutil.which, ("cc", "gcc", "clang"))), None)
    if cc is None:
        pytest.skip("no C compiler here")
    for name, value in (("one", 1), ("two", 2)):
        (tmp_path / f"{name}.c").write_text(f"int which(void) {{ return {value}; }}\n")
        subprocess.run([cc, "-shared", "-fPIC", str(tmp_path / f"{name}.c"), "-o", str(tmp_path / f"{name}.so")],
                       check=True)
    fd = os.open(tmp_path / "one.so", os.O_RDONLY)
    os.replace(tmp_path / "two.so", tmp_path / "one.so")
    try:
        assert private_files.load_library(fd, str(tmp_path / "one.so")).which() == 1
    finally:
        os.close(fd)
    # (and a later load through a new descriptor is that file's, not the first one's, whatever number it gets)
    fd = os.open(tmp_path / "one.so", os.O_RDONLY)
    try:
        assert private_files.load_library(fd, str(tmp_path / "one.so")).which() == 2
    finally:
        os.close(fd)


def test_a_work_directory_is_removed_once_its_process_is_gone_and_not_before(tmp_path: Path) -> None:
    """A work directory's lock says whether its process lives (whatever its age, its host or its pid namespace);
    one without a lock, by its process id on this host or its age; a directory left before its lock was taken and
    the old unnamed ones, by their age; nothing else, and nothing of another user's."""
    killed = subprocess.run([sys.executable, "-c", (
        "import os, sys; from torch_tpu_embedding._util import private_files as pf\n"
        f"fd = os.open({str(tmp_path)!r}, os.O_RDONLY | os.O_DIRECTORY)\n"
        f"with pf.work_dir(fd, {str(tmp_path)!r}, 'tmp-x-') as (w, path):\n"
        "    open(os.path.join(path, 'x.c'), 'w').close(); print(os.path.basename(path)); sys.stdout.flush()\n"
        "    os._exit(0)  # (as if killed: nothing cleaned up)\n")], capture_output=True, text=True,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])})
    assert killed.returncode == 0, killed.stderr
    dead_locked, dead_pid = killed.stdout.strip(), int(killed.stdout.strip().split("-")[-2])
    host = private_files._host()
    past = time.time() - private_files.STALE_AFTER - 10
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        with private_files.work_dir(fd, str(tmp_path), "tmp-x-") as (_, live):
            live = os.path.basename(live)
            os.utime(tmp_path / live, (past, past))  # (old, but in use)
            unlocked = {"dead_pid": f"tmp-x-{host}-{dead_pid}-abc", "old": f"tmp-x-{host}-1-abc",
                        "live_pid": f"tmp-x-{host}-1-def", "other_host": f"tmp-x-elsewhere-{dead_pid}-abc",
                        "unborn_old": f".new-tmp-x-{host}-1-abc", "unborn": f".new-tmp-x-{host}-1-def",
                        "legacy_old": "old_abc", "legacy": "old_def", "unrelated": "kept.so"}
            for name in unlocked.values():
                (tmp_path / name).mkdir()
            (tmp_path / unlocked["dead_pid"] / "link").symlink_to(tmp_path / live)  # (removed as a link)
            for case in ("old", "unborn_old", "legacy_old"):
                os.utime(tmp_path / unlocked[case], (past, past))
            removed = private_files.remove_stale_temporaries(fd, "tmp-x-", legacy=("old_",))
            assert sorted(removed) == sorted([dead_locked, *(unlocked[c] for c in ("dead_pid", "old", "unborn_old",
                                                                                   "legacy_old"))])
            assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
                [live, *(unlocked[c] for c in ("live_pid", "other_host", "unborn", "legacy", "unrelated"))])
        assert not (tmp_path / live).exists()  # (removed by its own process on exit)
    finally:
        os.close(fd)
