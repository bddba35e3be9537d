"""A distributed load reads only the files it verified: files of another save copied into the checkpoint's
directory (file by file, as ``cp`` or ``rsync`` do) after the load checked them against the manifest are
refused, before anything is written when they are found before the first write; a data file renamed over
between the check and the read is not read at all (each file is read through the descriptor it was hashed with).

The load verifies every file (size, sha256) and then reads ``tte_meta.pt``, ``.metadata`` and the data files
again by name. Pinning the directory (checkpoint/snapshot.py) covers a save that publishes a new directory,
not a file replaced inside the directory: before ``checkpoint.snapshot.Seal``, such a load took the other
save's tensors with this save's counters (or the other save whole, unverified) and said nothing. The copies
are made deterministic by interposing on the load's own steps, not by timing.
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from _crash_child import build
from test_ckpt_snapshot import same, trained

import torch_tpu_embedding as tte
from torch_tpu_embedding.checkpoint import CheckpointCorruptError
from torch_tpu_embedding.checkpoint import api as ckpt_api
from torch_tpu_embedding.checkpoint import publish as ckpt_publish
from torch_tpu_embedding.checkpoint.publish import write_manifest
from torch_tpu_embedding.distributed import sharded_checkpoint


def state(m: torch.nn.Module, opt: torch.optim.Optimizer | None) -> dict[str, Any]:
    out = {"model": {k: v.detach().clone() for k, v in m.state_dict().items()}}
    if opt is not None:
        out["optimizer"] = opt.state_dict()
    return out


def copy_over(src: Path, dest: Path) -> None:
    """Every file of ``src`` into ``dest`` as ``rsync`` puts it: a temporary beside it, renamed over the old."""
    for f in sorted(src.iterdir()):
        tmp = dest / f".{f.name}.part"
        shutil.copyfile(f, tmp)
        os.replace(tmp, dest / f.name)


def after(fn: Callable[..., Any], action: Callable[[], None]) -> Callable[..., Any]:
    """``fn``, then ``action`` once (the first call)."""
    done: list[bool] = []

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        out = fn(*args, **kwargs)
        if not done:
            done.append(True)
            action()
        return out

    return wrapped


def two_saves(tmp_path: Path) -> tuple[Path, Path]:
    ck, other = tmp_path / "ck", tmp_path / "other"
    a, b = trained(3), trained(6)
    tte.checkpoint.save_distributed(ck, model=a[0], optimizer=a[1])
    tte.checkpoint.save_distributed(other, model=b[0], optimizer=b[1])
    return ck, other


@pytest.mark.parametrize("step", ["verify", "read_meta"])
def test_files_of_another_save_copied_in_after_verifying_are_refused_and_change_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, step: str) -> None:
    """Copied in right after the files were verified (the other save would load whole, unverified), or after
    ``tte_meta.pt`` was read (its tensors would load with this save's counters): refused naming a file, and
    the model and optimizer are bitwise unchanged; the same load once the copy is over reads the copy."""
    ck, other = two_saves(tmp_path)
    m, opt = trained(1)
    before = state(m, opt)
    monkeypatch.setattr(ckpt_api, step, after(getattr(ckpt_api, step), lambda: copy_over(other, ck)))
    with pytest.raises(CheckpointCorruptError, match=r"ck/\S+ was replaced or written to while the checkpoint "
                                                     r"\S*ck was loaded .*nothing was loaded"):
        tte.checkpoint.load_distributed(ck, model=m, optimizer=opt)
    assert same(state(m, opt), before), "a refused load changed the model or the optimizer"
    monkeypatch.undo()
    want, got = trained(6), build()
    tte.checkpoint.load_distributed(ck, model=got[0], optimizer=got[1])  # the copy is over: it is save b
    assert same(state(*got), state(*want))


def test_files_copied_in_while_the_tensors_are_read_are_refused(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Copied in after the tensors were read in place (too late to change nothing): refused all the same,
    saying the model may hold values of both; the optimizer's counters are not loaded."""
    ck, other = two_saves(tmp_path)
    m, opt = trained(1)
    iterations = opt.state_dict()["iterations"]
    monkeypatch.setattr(ckpt_api, "read_tensors", after(ckpt_api.read_tensors, lambda: copy_over(other, ck)))
    with pytest.raises(CheckpointCorruptError, match="was replaced or written to .* may hold values of both"):
        tte.checkpoint.load_distributed(ck, model=m, optimizer=opt)
    assert opt.state_dict()["iterations"] == iterations


def test_convert_refuses_files_copied_in_after_verifying(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``convert_distributed`` writes no file mixing two saves."""
    ck, other = two_saves(tmp_path)
    out = tmp_path / "out.pt"
    monkeypatch.setattr(ckpt_api, "read_meta", after(ckpt_api.read_meta, lambda: copy_over(other, ck)))
    with pytest.raises(CheckpointCorruptError, match="was replaced or written to"):
        tte.checkpoint.convert_distributed(ck, out)
    assert not out.exists()


def sharded_dir(path: Path, scale: float) -> None:
    """A ``save_sharded`` directory of one row-sharded table "t" saved by 2 ranks (their files, ``meta.pt`` and
    the manifest, as ``save_sharded`` writes them), rows ``scale * id``."""
    path.mkdir()
    for r in range(2):
        ids = torch.arange(r, 10, 2)
        rows = ids.to(torch.float64)[:, None].expand(-1, 4) * scale
        torch.save({"t": {"ids": ids, "weight": rows.clone()}}, path / f"rows-{r}.pt")
    meta = {"world": 2, "tables": {"t": {"placement": "row", "rows": 10, "owner": 0, "key": "tables.t.weight"}},
            "model": {}}
    torch.save(meta, path / "meta.pt")
    write_manifest(str(path))


def test_a_sharded_checkpoint_with_rows_of_another_save_copied_in_is_refused(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A ``save_sharded`` directory loaded whole into one process: rank files of another save copied in
    after they were verified are refused, the table unchanged."""
    ck, other = tmp_path / "ck", tmp_path / "other"
    sharded_dir(ck, 1.0)
    sharded_dir(other, -1.0)
    ec = tte.EmbeddingCollection({"f": tte.FeatureConfig(tte.TableConfig(10, 4, name="t", dtype=torch.float64))})
    before = state(ec, None)
    monkeypatch.setattr(sharded_checkpoint, "verify", after(sharded_checkpoint.verify,
                                                            lambda: copy_over(other, ck)))
    with pytest.raises(CheckpointCorruptError, match="was replaced or written to .*nothing was loaded"):
        tte.checkpoint.load_distributed(ck, model=ec)
    assert same(state(ec, None), before)
    monkeypatch.undo()
    tte.checkpoint.load_distributed(ck, model=ec)  # the copy is over: the other save, whole
    assert torch.equal(ec.state_dict()["tables.t.weight"],
                       -torch.arange(10, dtype=torch.float64)[:, None].expand(-1, 4))


def test_data_files_renamed_over_between_the_check_and_the_read_are_not_read(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Another save's data files renamed over this one's after they were verified and before DCP reads them
    (as ``rsync`` puts them; the manifest left as it was): the load reads each file through the descriptor it
    hashed, so it loads the verified save bitwise. Before, DCP opened them again by name, read the other save's
    tensors into the model and then raised, the model holding values of both."""
    ck, other = two_saves(tmp_path)
    data = [f for f in sorted(other.iterdir()) if f.name.endswith(".distcp")]
    assert data

    def swap_data() -> None:
        for f in data:
            tmp = ck / f".{f.name}.part"
            shutil.copyfile(f, tmp)
            os.replace(tmp, ck / f.name)

    def read_after_swap(*args: Any, **kwargs: Any) -> Any:
        swap_data()
        return real(*args, **kwargs)

    real = ckpt_api.read_tensors
    monkeypatch.setattr(ckpt_api, "read_tensors", read_after_swap)
    m, opt = trained(1)
    tte.checkpoint.load_distributed(ck, model=m, optimizer=opt)
    want = trained(3)
    assert same(state(m, opt), state(*want))


def test_a_manifest_rewritten_whole_before_it_is_read_is_checked_as_read(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The manifest renamed over by an identical copy just before the load opens it (a sync tool rewriting the
    same save): the load checks the manifest it read, through the handle it read it with, and loads. Before, the
    manifest's stamp was taken by name before it was opened, so the load ended saying the manifest was replaced
    while the checkpoint was loaded."""
    ck, _ = two_saves(tmp_path)
    manifest = ck / ckpt_publish.MANIFEST

    def rewrite_then_read(*args: Any, **kwargs: Any) -> Any:
        if not done and sys._getframe(1).f_code.co_name == "verify":  # (not a listing of the directory's files)
            done.append(True)
            shutil.copyfile(manifest, ck / ".manifest.part")
            os.replace(ck / ".manifest.part", manifest)
        return real(*args, **kwargs)

    done: list[bool] = []
    real = ckpt_publish._manifest
    monkeypatch.setattr(ckpt_publish, "_manifest", rewrite_then_read)
    m, opt = trained(1)
    tte.checkpoint.load_distributed(ck, model=m, optimizer=opt)
    assert done
    assert same(state(m, opt), state(*trained(3)))
