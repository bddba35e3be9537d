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
        assert private_files.load_library(fd).which() == 1
    finally:
        os.close(fd)
    # (and a later load through a new descriptor is that file's, not the first one's, whatever number it gets)
    fd = os.open(tmp_path / "one.so", os.O_RDONLY)
    try:
        assert private_files.load_library(fd).which() == 2
    finally:
        os.close(fd)


def test_stale_work_directories_are_removed_and_no_others(tmp_path: Path) -> None:
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(gone.stdout)
    host = private_files._host()
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        live = private_files.make_temporary_dir(fd, "tmp-x-")  # (this process's, recent)
        (tmp_path / live / "x.c").write_text("int x;")
        dead = f"tmp-x-{host}-{dead_pid}-abc"
        (tmp_path / dead / "sub").mkdir(parents=True)
        (tmp_path / dead / "sub" / "x.so").write_bytes(b"x")
        (tmp_path / dead / "link").symlink_to(tmp_path / live)  # (removed as a link; what it names stays)
        old_live = f"tmp-x-{host}-1-abc"  # (pid 1 lives: removed only for its age)
        recent_live = f"tmp-x-{host}-1-def"
        other_host = f"tmp-x-elsewhere-{dead_pid}-abc"  # (a pid of another host says nothing here)
        legacy_old, legacy_recent, unrelated = "old_abc", "old_def", "kept.so"
        for name in (old_live, recent_live, other_host, legacy_old, legacy_recent, unrelated):
            (tmp_path / name).mkdir()
        past = time.time() - private_files.STALE_AFTER - 10
        for name in (old_live, legacy_old):
            os.utime(tmp_path / name, (past, past))
        removed = private_files.remove_stale_temporaries(fd, "tmp-x-", legacy=("old_",))
    finally:
        os.close(fd)
    assert sorted(removed) == sorted([dead, old_live, legacy_old])
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([live, recent_live, other_host, legacy_recent,
                                                                 unrelated])
    assert (tmp_path / live / "x.c").exists()
