"""[hardening4] 3, 4 and 9: a distributed load reads one published checkpoint or fails; a save never costs the
last complete checkpoint; unreadable files are named.

Races are made deterministic by interposing: a save runs inside the load (between reading ``tte_meta.pt``
and the tensors) or inside another save (between writing its files and publishing them), not by timing.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from _crash_child import build, train

import torch_tpu_embedding as tte
from torch_tpu_embedding.checkpoint import CheckpointCorruptError, UnverifiedCheckpointWarning
from torch_tpu_embedding.checkpoint import api as ckpt_api
from torch_tpu_embedding.checkpoint import publish as ckpt_publish


def state(m: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    return {"model": {k: v.detach().clone() for k, v in m.state_dict().items()}, "optimizer": opt.state_dict()}


def same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def trained(steps: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    m, opt = build()
    train(m, opt, steps)
    return m, opt


def loaded(path: Path) -> dict[str, Any]:
    m, opt = build()
    tte.checkpoint.load_distributed(path, model=m, optimizer=opt)
    return state(m, opt)


def listing(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


# ----------------------------------------------------------------------------- 3: one snapshot per load
def test_a_save_published_while_a_load_reads_does_not_mix_into_it(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The evaluator's race: the trainer publishes save N+1 after the load read save N's ``tte_meta.pt`` and
    before it read the tensors. The load gets save N whole (weights and counters), never a mix; the old
    directory, set aside while the load held it, goes with the next save."""
    ck = tmp_path / "ck"
    a, b = trained(3), trained(6)
    tte.checkpoint.save_distributed(ck, model=a[0], optimizer=a[1])
    read_meta = ckpt_api.read_meta
    published = []

    def meta_then_publish(path: str) -> Any:
        meta = read_meta(path)
        if not published:
            published.append(True)
            tte.checkpoint.save_distributed(ck, model=b[0], optimizer=b[1])  # save N+1, published
        return meta

    monkeypatch.setattr(ckpt_api, "read_meta", meta_then_publish)
    got = loaded(ck)
    assert published
    monkeypatch.undo()
    assert same(got, state(*a)), "the load mixed two saves"
    assert same(loaded(ck), state(*b))  # the path names save N+1 now
    tte.checkpoint.save_distributed(ck, model=b[0], optimizer=b[1])
    assert listing(tmp_path) == ["ck"]  # the old directory set aside during the load is gone


def test_a_second_job_saving_to_the_path_is_refused_not_mixed(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Job B saves to the path while job A is between writing its files and publishing them: B is refused
    (nothing of B's is written, A's files untouched) and A publishes its checkpoint whole."""
    ck = tmp_path / "ck"
    a, b = trained(3), trained(6)
    tte.checkpoint.save_distributed(ck, model=b[0], optimizer=b[1])  # an older checkpoint in place
    write_manifest = ckpt_api.write_manifest
    refusals: list[BaseException] = []

    def second_job_first(staging: str) -> None:
        if not refusals:
            try:
                tte.checkpoint.save_distributed(ck, model=b[0], optimizer=b[1])
                refusals.append(AssertionError("the second save was not refused"))
            except BlockingIOError as e:
                refusals.append(e)
        write_manifest(staging)

    monkeypatch.setattr(ckpt_api, "write_manifest", second_job_first)
    tte.checkpoint.save_distributed(ck, model=a[0], optimizer=a[1])
    monkeypatch.undo()
    assert isinstance(refusals[0], BlockingIOError), refusals
    assert f"Another save to {ck} is in progress" in str(refusals[0]) and "nothing was written" in str(refusals[0])
    assert same(loaded(ck), state(*a))
    assert listing(tmp_path) == ["ck"]


def test_a_checkpoint_without_a_manifest_warns_that_a_changed_byte_is_not_detected(tmp_path: Path) -> None:
    """A checkpoint written before manifests (the manifest removed) still loads, but not silently: DCP's
    files hold no checksum, so a flipped weight byte cannot be found; the load says so."""
    ck = tmp_path / "ck"
    m, opt = trained(3)
    tte.checkpoint.save_distributed(ck, model=m, optimizer=opt)
    (ck / "tte_manifest.json").unlink()
    data = ck / "__0_0.distcp"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x10
    data.write_bytes(bytes(raw))
    with pytest.warns(UnverifiedCheckpointWarning, match=f"{ck} has no tte_manifest.json.*a changed byte would "
                                                         "load unnoticed"):
        loaded(ck)


# ----------------------------------------------------------------------------- 4: the last good checkpoint kept
def _killed_between_renames(ck: Path) -> None:
    """What a save killed between its two renames leaves, then a restarted job's ``os.makedirs``."""
    os.rename(ck, ck.parent / f".{ck.name}.tte-previous")
    os.makedirs(ck, exist_ok=True)


def test_an_emptied_path_beside_the_set_aside_checkpoint_loads_it_and_a_save_keeps_it(tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    a, b = trained(3), trained(6)
    tte.checkpoint.save_distributed(ck, model=a[0], optimizer=a[1])
    _killed_between_renames(ck)
    assert same(loaded(ck), state(*a))
    tte.checkpoint.convert_distributed(ck, tmp_path / "one.pt")
    (tmp_path / "one.pt").unlink()
    tte.checkpoint.save_distributed(ck, model=b[0], optimizer=b[1])
    assert listing(tmp_path) == ["ck"] and same(loaded(ck), state(*b))


def test_a_refused_save_keeps_the_set_aside_checkpoint(tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    a = trained(3)
    tte.checkpoint.save_distributed(ck, model=a[0], optimizer=a[1])
    _killed_between_renames(ck)
    (ck / "notes.txt").write_text("mine")
    before = {p.relative_to(tmp_path): p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    with pytest.raises(FileExistsError, match=r"\['notes.txt'\]"):
        tte.checkpoint.save_distributed(ck, model=a[0], optimizer=a[1])
    after = {p.relative_to(tmp_path): p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    assert before == after  # the refused save changed nothing: the set-aside checkpoint is whole


def test_a_users_meta_pt_is_neither_a_checkpoint_nor_deleted(tmp_path: Path) -> None:
    """``meta.pt`` is ours only where a manifest of ours lists it (a ``save_sharded`` directory's)."""
    a = trained(3)
    mine = tmp_path / "mine"
    mine.mkdir()
    torch.save({"epoch": 3}, mine / "meta.pt")
    with pytest.raises(FileExistsError, match=r"\['meta.pt'\]"):
        tte.checkpoint.save_distributed(mine, model=a[0], optimizer=a[1])
    assert listing(mine) == ["meta.pt"] and torch.load(mine / "meta.pt") == {"epoch": 3}
    ck = tmp_path / "ck"
    tte.checkpoint.save_distributed(ck, model=a[0], optimizer=a[1])
    torch.save({"epoch": 3}, ck / "meta.pt")  # the user's file dropped into a checkpoint
    assert same(loaded(ck), state(*a))  # a save_distributed checkpoint still (its manifest says so)
    with pytest.raises(FileExistsError, match=r"\['meta.pt'\]"):
        tte.checkpoint.save_distributed(ck, model=a[0], optimizer=a[1])
    assert (ck / "meta.pt").exists()


def test_a_symlinked_checkpoint_directory_takes_every_save(tmp_path: Path) -> None:
    real, ck = tmp_path / "disk" / "ck", tmp_path / "ck"
    real.parent.mkdir()
    real.mkdir()
    ck.symlink_to(real)
    for steps in (3, 6, 9):
        m, opt = trained(steps)
        tte.checkpoint.save_distributed(ck, model=m, optimizer=opt)
        assert same(loaded(ck), state(m, opt)), steps
    assert ck.is_symlink() and os.readlink(ck) == str(real)
    assert listing(real.parent) == ["ck"] and "tte_manifest.json" in listing(real)


# ----------------------------------------------------------------------------- 9: errors that name the file
def test_a_pickled_payload_in_a_rows_file_is_named_and_refused(tmp_path: Path) -> None:
    """A sharded checkpoint whose rank file holds a pickled object (sealed by a matching manifest)."""
    ck = tmp_path / "ck"
    ck.mkdir()
    meta = {"world": 1, "tables": {"t": {"placement": "row", "rows": 4, "owner": 0, "key": "tables.t.weight"}},
            "model": {}}
    torch.save(meta, ck / "meta.pt")
    torch.save({"t": {"ids": torch.arange(4), "weight": torch.zeros(4, 2), "hook": print}}, ck / "rows-0.pt")
    ckpt_publish.write_manifest(str(ck))
    with pytest.raises(CheckpointCorruptError) as err:
        tte.checkpoint.convert_distributed(ck, tmp_path / "one.pt")
    text = str(err.value)
    assert str(ck / "rows-0.pt") in text and "GLOBAL print" in text and "refused without running" in text, text
    assert "weights_only=False" not in text and "weights_only` set to `False" not in text, text
    assert not (tmp_path / "one.pt").exists()


def _sealed(tmp_path: Path) -> Path:
    ck = tmp_path / "ck"
    m, opt = trained(3)
    tte.checkpoint.save_distributed(ck, model=m, optimizer=opt)
    return ck


def test_a_deeply_nested_manifest_is_refused_by_name(tmp_path: Path) -> None:
    ck = _sealed(tmp_path)
    (ck / "tte_manifest.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(CheckpointCorruptError, match=f"{ck / 'tte_manifest.json'} is not a readable checkpoint "
                                                     "manifest: it nests deeper"):
        loaded(ck)


def test_a_newer_manifest_format_is_named(tmp_path: Path) -> None:
    ck = _sealed(tmp_path)
    manifest = json.loads((ck / "tte_manifest.json").read_text())
    manifest["format"] = "torch_tpu_embedding.manifest/2"
    (ck / "tte_manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointCorruptError, match=r"in checkpoint manifest format "
                                                     r"'torch_tpu_embedding\.manifest/2'; this version of "
                                                     r"torch_tpu_embedding reads 'torch_tpu_embedding\.manifest/1'"):
        loaded(ck)


def test_a_manifest_naming_a_file_outside_the_directory_is_refused(tmp_path: Path) -> None:
    """(Hostile pass) a manifest listing ``../secret`` would have the load hash a file outside the checkpoint."""
    ck = _sealed(tmp_path)
    (tmp_path / "secret").write_bytes(b"x")
    manifest = json.loads((ck / "tte_manifest.json").read_text())
    manifest["files"]["../secret"] = {"size": 1, "sha256": "0" * 64}
    (ck / "tte_manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointCorruptError, match="not a readable checkpoint manifest"):
        loaded(ck)
