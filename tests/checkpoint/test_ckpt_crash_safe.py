"""[hardening3] 2 and 3: distributed checkpoints are crash-safe, and a failed distributed load changes nothing.

* ``save_distributed`` over a good checkpoint, killed (SIGKILL) at each of its disk operations in turn
  (tests/_crash_child.py): ``load_distributed`` then gives exactly the old checkpoint or exactly the
  new one, never a mix and never an error; the next save cleans up and publishes.
* ``load_distributed`` of a truncated file (60 %), of the mix a save killed by the old code left
  (the new data files beside the old ``tte_meta.pt``), or of a checkpoint written before manifests
  with a truncated file: an ``Exception`` naming the file, and the weights, slots, counters and
  pending gradients bitwise unchanged.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import _crash_child
import pytest
import torch
from _crash_child import build, train
from suite_helpers import same_tree, start_ranks
from test_load_all_or_nothing import prepared, snapshot, step

import torch_tpu_embedding as tte
from torch_tpu_embedding.checkpoint import CheckpointCorruptError, CheckpointMismatchError
from torch_tpu_embedding.checkpoint import publish as ckpt_publish

ROOT = Path(__file__).resolve().parents[2]


def state(m: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    return {"model": {k: v.detach().clone() for k, v in m.state_dict().items()}, "optimizer": opt.state_dict()}


def loaded(folder: Path) -> dict[str, Any]:
    m, opt = build()
    tte.checkpoint.load_distributed(folder, model=m, optimizer=opt)
    return state(m, opt)


def from_file(file: Path) -> dict[str, Any]:
    m, opt = build()
    tte.checkpoint.load(file, model=m, optimizer=opt)
    return state(m, opt)


def test_a_save_killed_at_any_operation_leaves_the_old_or_the_new_checkpoint(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, str(ROOT / "tests" / "_crash_child.py"), str(tmp_path)], env=env,
                         capture_output=True, text=True, timeout=900)
    lines = [ln for ln in run.stdout.splitlines() if ln.startswith("k=")]
    assert run.returncode == 0 and lines and lines[-1].endswith("status 0"), run.stdout + run.stderr[-3000:]
    kills = len(lines) - 1
    old, new = from_file(tmp_path / "old.pt"), from_file(tmp_path / "new.pt")
    assert not same_tree(old["model"], new["model"]) and not same_tree(old["optimizer"], new["optimizer"])
    outcomes: dict[str, list[int]] = {}
    for k in range(1, kills + 2):
        folder = tmp_path / f"k{k}"
        ck = folder / "ck"
        # (a killed save's lock file, ``.ck.tte-lock``, holds no lock: the next save takes it over and removes it)
        left = tuple(sorted(p.name for p in folder.iterdir() if p.name != ".ck.tte-lock"))
        try:  # never raises: a complete checkpoint is always there
            got = loaded(ck)
            which = "old" if same_tree(got, old) else "new" if same_tree(got, new) else "mixed"
        except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
            which = f"error {type(e).__name__}: {str(e)[:200]}"
        outcomes.setdefault(f"{which} {left}", []).append(k)
        assert which in ("old", "new"), (k, left, which)
        # The next save finishes what the killed one left, and publishes a complete checkpoint.
        m, opt = build()
        train(m, opt, 5)
        tte.checkpoint.save_distributed(ck, model=m, optimizer=opt)
        assert sorted(p.name for p in folder.iterdir()) == ["ck"], k
        assert same_tree(loaded(ck), state(m, opt)), k
    # Every state a kill can leave was seen: a staging directory beside the old checkpoint (killed
    # while writing it), the old one set aside with no checkpoint in place (between the renames),
    # and the new one in place with the old one half deleted.
    assert kills >= 15, lines  # each write, fsync, rename and deletion of a save (two data files, our two files)
    seen = set(outcomes)
    assert {"old ('.ck.tte-saving', 'ck')", "old ('.ck.tte-previous', '.ck.tte-saving')",
            "new ('.ck.tte-previous', 'ck')", "new ('ck',)"} <= seen, outcomes
    # only the run that was not killed, and the one killed at its last operation: removing its lock file
    assert outcomes["new ('ck',)"] == [kills, kills + 1], outcomes


def test_a_save_refuses_to_replace_a_directory_that_is_not_a_checkpoint(tmp_path: Path) -> None:
    m, opt = build()
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match=r"mine: it holds files that are not part of a distributed checkpoint "
                                              r"\(\['notes.txt'\]\)"):
        tte.checkpoint.save_distributed(folder, model=m, optimizer=opt)
    assert [p.name for p in folder.iterdir()] == ["notes.txt"] and sorted(os.listdir(tmp_path)) == ["mine"]


def test_several_ranks_publish_one_checkpoint(tmp_path: Path) -> None:
    """Two gloo ranks save twice into one directory (the second over the first): rank 0 publishes once
    every rank's files are written; no rank returns before; both load the saved state bitwise."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    start_ranks(_crash_child.ranks_worker, (2, port, str(tmp_path)), 2)
    want = from_file(tmp_path / "ref.pt")
    for r in range(2):
        extra = torch.load(tmp_path / f"rank{r}.pt", weights_only=True)["extra"]
        assert extra["listing"] == ["ck"], extra  # published, no staging or previous directory left
        assert {"__0_0.distcp", "__1_0.distcp", ".metadata", "tte_meta.pt", "tte_manifest.json"} <= set(
            extra["files"]), extra
        assert same_tree(from_file(tmp_path / f"rank{r}.pt"), want), r


# ------------------------------------------------------------------ a damaged checkpoint changes nothing
def _dcp(tmp_path: Path, name: str) -> Path:
    (tmp_path / name).mkdir()
    m, opt, _ = prepared(tmp_path / name)
    ckpt = tmp_path / name / "dcp"
    tte.checkpoint.save_distributed(ckpt, model=m, optimizer=opt)
    return ckpt


def _truncate(file: Path, fraction: float = 0.6) -> None:
    data = file.read_bytes()
    file.write_bytes(data[: int(len(data) * fraction)])


def _model(tmp_path: Path) -> tuple[Any, Any]:
    """A model that trained on and holds pending row gradients: what a failed load must leave alone."""
    (tmp_path / "mine").mkdir()
    m, opt, _ = prepared(tmp_path / "mine")
    step(m, opt, 7)
    step(m, opt, 8, update=False)
    return m, opt


@pytest.mark.parametrize("manifest", [True, False], ids=["manifest", "written-before-manifests"])
@pytest.mark.parametrize("name", ["__0_0.distcp", ".metadata", "tte_meta.pt"])
def test_a_truncated_file_is_named_and_changes_nothing(tmp_path: Path, name: str, manifest: bool) -> None:
    ckpt = _dcp(tmp_path, "a")
    if not manifest:
        (ckpt / "tte_manifest.json").unlink()
    _truncate(ckpt / name)
    m, opt = _model(tmp_path)
    before = snapshot(m, opt, ckpt)
    with pytest.raises(Exception) as err:  # noqa: PT011 - the point: an Exception (DCP's own is a BaseException)
        tte.checkpoint.load_distributed(ckpt, model=m, optimizer=opt)
    assert isinstance(err.value, ValueError), repr(err.value)
    assert str(ckpt / name) in str(err.value), str(err.value)
    if manifest or name == "__0_0.distcp":
        assert isinstance(err.value, CheckpointCorruptError) and "Nothing was loaded" in str(err.value)
    after = snapshot(m, opt, ckpt)
    for part in before:
        assert same_tree(before[part], after[part]), part
    with pytest.raises(ValueError, match=str(ckpt / name).replace(".", r"\.")):
        tte.checkpoint.convert_distributed(ckpt, tmp_path / "out.pt")
    assert not (tmp_path / "out.pt").exists()


def test_the_mix_a_killed_save_used_to_leave_is_refused(tmp_path: Path) -> None:
    """The old code, killed after torch's files and before ``tte_meta.pt``, left the new data files beside
    the old meta file, and ``load_distributed`` loaded the new weights with the old counters."""
    (tmp_path / "b").mkdir()
    old = _dcp(tmp_path, "a")
    m2, opt2, _ = prepared(tmp_path / "b")
    for s in range(20, 23):
        step(m2, opt2, s)
    new = tmp_path / "b" / "dcp"
    tte.checkpoint.save_distributed(new, model=m2, optimizer=opt2)
    for name in ("__0_0.distcp", ".metadata"):
        shutil.copyfile(new / name, old / name)
    m, opt = _model(tmp_path)
    before = snapshot(m, opt, old)
    with pytest.raises(CheckpointCorruptError, match=r"\.metadata is altered: its sha256 differs"):
        tte.checkpoint.load_distributed(old, model=m, optimizer=opt)
    after = snapshot(m, opt, old)
    for part in before:
        assert same_tree(before[part], after[part]), part


def test_a_failed_read_is_an_exception_naming_the_checkpoint(tmp_path: Path) -> None:
    """A failure inside torch's reader (here: a checkpoint written before manifests, whose data file was
    overwritten with zeros) raises ``CheckpointCorruptError``, not DCP's ``CheckpointException``."""
    ckpt = _dcp(tmp_path, "a")
    (ckpt / "tte_manifest.json").unlink()
    data = ckpt / "__0_0.distcp"
    data.write_bytes(bytes(data.stat().st_size))
    m, opt = _model(tmp_path)
    with pytest.raises(CheckpointCorruptError, match=f"Reading the distributed checkpoint {ckpt} failed"):
        tte.checkpoint.load_distributed(ckpt, model=m, optimizer=opt)


@pytest.mark.parametrize("damage, pattern", [
    (lambda meta: meta["optimizer"]["acc"]["table:b"]["acc_ids"].__setitem__((0, 0), 12),
     r"table:b: slot 'acc_ids' must hold -1 \(padding\) or rows of this table, in \[0, 9\). Received \[12\]"),
    (lambda meta: meta["optimizer"].__setitem__("iterations", "x"), r"'iterations' must be an integer >= 0. "
                                                                     r"Received str 'x'"),
], ids=["pending-id-out-of-range", "iterations-x"])
def test_crafted_distributed_counters_and_pending_ids_change_nothing(tmp_path: Path, damage: Any,
                                                                     pattern: str) -> None:
    """``tte_meta.pt`` altered and sealed again (a manifest that matches it): its values are refused
    before any tensor is read in place."""
    ckpt = _dcp(tmp_path, "a")
    meta = torch.load(ckpt / "tte_meta.pt", weights_only=True)
    damage(meta)
    torch.save(meta, ckpt / "tte_meta.pt")
    ckpt_publish.write_manifest(str(ckpt))
    m, opt = _model(tmp_path)
    before = snapshot(m, opt, ckpt)
    with pytest.raises(CheckpointMismatchError, match=pattern):
        tte.checkpoint.load_distributed(ckpt, model=m, optimizer=opt)
    after = snapshot(m, opt, ckpt)
    for part in before:
        assert same_tree(before[part], after[part]), part


def test_a_single_file_save_puts_its_rename_on_disk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``tte.checkpoint.save`` fsyncs the file, renames it over the target, then fsyncs the folder: without the
    last, a power loss after ``save`` returned may bring back the previous file (the rename not yet on disk)."""
    ec = tte.EmbeddingCollection({"f": tte.FeatureConfig(tte.TableConfig(6, 2, name="t"))})
    target = tmp_path / "ckpt.pt"
    events: list[str] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        events.append("fsync dir" if os.path.isdir(f"/proc/self/fd/{fd}") else "fsync file")
        real_fsync(fd)

    def replace(src: Any, dst: Any) -> None:
        events.append("rename")
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    tte.checkpoint.save(target, model=ec)
    assert events[-3:] == ["fsync file", "rename", "fsync dir"], events
    assert sorted(os.listdir(tmp_path)) == ["ckpt.pt"]
