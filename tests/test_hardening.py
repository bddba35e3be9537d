"""Hardening (issue 17): unsafe files, unreadable saves, stale temporaries, silently converted inputs,
per-id weight gradients, 16-bit combiners, clear errors, table allocation, the README environment.

Every error case checks the message, and that the weights, every optimizer slot, the pending row
gradients and the files on disk are unchanged.
"""

from __future__ import annotations

import collections
import datetime
import hashlib
import os
import pathlib
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import torch_tpu_embedding as tte
from torch_tpu_embedding import _ckpt_io

ROOT = Path(__file__).resolve().parents[1]
V, D = 10, 3


def trained(combiner: str = "mean", dtype: torch.dtype = torch.float32):
    """A collection and Adagrad that have taken one step (so every slot exists)."""
    torch.manual_seed(0)
    t = tte.TableConfig(V, D, name="t", combiner=combiner, dtype=dtype)
    ec = tte.EmbeddingCollection({"f": tte.FeatureConfig(t, max_ids_per_bag=4), "g": tte.FeatureConfig(t)})
    opt = tte.optim.Adagrad(ec.parameters(), lr=0.1)
    out = ec({"f": tte.Jagged(torch.tensor([1, 2, 3]), lengths=torch.tensor([2, 1])), "g": torch.tensor([4, 5])})
    sum(v.float().sum() for v in out.values()).backward()
    opt.step()
    opt.zero_grad()
    return ec, opt


def snapshot(ec, opt, folder: Path | None = None):
    w = {k: v.detach().clone() for k, v in ec.state_dict().items()}
    slots = {id(p): {k: v.clone() if torch.is_tensor(v) else v for k, v in s.items()} for p, s in opt.state.items()}
    files = None
    if folder is not None:
        files = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()}
    return w, slots, {k: (i.clone(), r.clone()) for k, (i, r) in ec.row_grads().items()}, files


def assert_unchanged(before, ec, opt, folder: Path | None = None) -> None:
    w, slots, grads, files = before
    for k, v in ec.state_dict().items():
        assert torch.equal(v, w[k]), k
    for p, s in opt.state.items():
        for k, v in s.items():
            assert (torch.equal(v, slots[id(p)][k]) if torch.is_tensor(v) else v == slots[id(p)][k]), k
    now = ec.row_grads()
    assert now.keys() == grads.keys()
    for k, (i, r) in now.items():
        assert torch.equal(i, grads[k][0]) and torch.equal(r, grads[k][1]), k
    if folder is not None:
        assert snapshot(ec, opt, folder)[3] == files


# ------------------------------------------------------------------ 1. DCP metadata runs no code
class _Evil:
    """Unpickling this runs ``touch <marker>`` (what a crafted .metadata would do)."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _dcp_checkpoint(tmp_path: Path):
    ec, opt = trained()
    ckpt = tmp_path / "dcp"
    tte.checkpoint.save_distributed(ckpt, model=ec, optimizer=opt)
    return ec, opt, ckpt


def _evil_metadata(ckpt: Path, marker: Path, how: str) -> None:
    md = pickle.loads((ckpt / ".metadata").read_bytes())  # our own, trusted file
    if how == "whole":
        payload = _Evil(str(marker))
    elif how == "nested":  # a real Metadata with a code-running object inside
        md.planner_data = {"x": _Evil(str(marker))}
        payload = md
    else:  # a non-tensor entry, which DCP's planner would read back with an unrestricted torch.load
        md_mod = pytest.importorskip("torch.distributed.checkpoint.metadata")
        entry = md_mod.BytesStorageMetadata() if how == "bytes-entry" else md_mod.ChunkStorageMetadata(
            torch.Size([0]), torch.Size([1]))
        md.state_dict_metadata["model/tables.t.weight"] = entry
        payload = md
    (ckpt / ".metadata").write_bytes(pickle.dumps(payload))


@pytest.mark.parametrize("how, pattern", [
    ("whole", r"refers to `posix.system`, which such a file never holds \(refused without running it\)"),
    ("nested", r"refers to `posix.system`"),
    ("bytes-entry", r"refers to `torch.distributed.checkpoint.metadata.BytesStorageMetadata`"),
    ("chunk-entry", r"entries \['model/tables.t.weight'\] are not tensors"),
])
def test_crafted_dcp_metadata_runs_no_code(tmp_path: Path, how: str, pattern: str) -> None:
    ec, opt, ckpt = _dcp_checkpoint(tmp_path)
    marker = tmp_path / "pwned"
    _evil_metadata(ckpt, marker, how)
    ec2, opt2 = trained()
    before = snapshot(ec2, opt2, ckpt)
    with pytest.raises(ValueError, match=pattern):
        tte.checkpoint.load_distributed(ckpt, model=ec2, optimizer=opt2)
    assert_unchanged(before, ec2, opt2, ckpt)
    with pytest.raises(ValueError, match=pattern):
        tte.checkpoint.convert_distributed(ckpt, tmp_path / "out.pt")
    assert not (tmp_path / "out.pt").exists()
    assert not marker.exists()
    if how in ("whole", "nested"):  # the payload is live: plain pickle would have run it
        pickle.loads((ckpt / ".metadata").read_bytes())
        assert marker.exists()


def test_crafted_tte_meta_runs_no_code(tmp_path: Path) -> None:
    ec, opt, ckpt = _dcp_checkpoint(tmp_path)
    marker = tmp_path / "pwned"
    torch.save({"format": tte.checkpoint.FORMAT, "rows": _Evil(str(marker))}, ckpt / "tte_meta.pt")
    ec2, opt2 = trained()
    before = snapshot(ec2, opt2, ckpt)
    for call in (lambda: tte.checkpoint.load_distributed(ckpt, model=ec2, optimizer=opt2),
                 lambda: tte.checkpoint.convert_distributed(ckpt, tmp_path / "out.pt")):
        with pytest.raises(ValueError, match=r"tte_meta.pt is not a readable checkpoint file \(refused by weights_only"):
            call()
    assert_unchanged(before, ec2, opt2, ckpt)
    assert not marker.exists() and not (tmp_path / "out.pt").exists()


def test_genuine_dcp_checkpoint_still_loads_and_converts(tmp_path: Path) -> None:
    ec, opt, ckpt = _dcp_checkpoint(tmp_path)
    ec2, opt2 = trained()
    with torch.no_grad():
        ec2.tables.t.weight.zero_()
    tte.checkpoint.load_distributed(ckpt, model=ec2, optimizer=opt2)
    assert torch.equal(ec2.tables.t.weight, ec.tables.t.weight)
    tte.checkpoint.convert_distributed(ckpt, tmp_path / "one.pt")
    ec3, opt3 = trained()
    tte.checkpoint.load(tmp_path / "one.pt", model=ec3, optimizer=opt3)
    assert torch.equal(ec3.tables.t.weight, ec.tables.t.weight)
    assert torch.equal(opt3.state[ec3.tables.t.weight]["accumulators"], opt.state[ec.tables.t.weight]["accumulators"])


# ------------------------------------------------------------------ 2. save refuses what load cannot read
class _Custom:
    pass


BAD_EXTRAS = [
    ("np-float32", {"lr": np.float32(0.1)}, r"`extra\['lr'\]` is a numpy.float32"),
    ("np-int64", {"step": np.int64(3)}, r"`extra\['step'\]` is a numpy.int64"),
    ("np-array", {"a": np.ones(2)}, r"`extra\['a'\]` is a numpy.ndarray"),
    ("path", {"dir": pathlib.Path("x")}, r"`extra\['dir'\]` is a pathlib.PosixPath"),
    ("datetime", {"when": datetime.datetime(2026, 1, 1)}, r"`extra\['when'\]` is a datetime.datetime"),
    ("custom", {"obj": _Custom()}, r"`extra\['obj'\]` is a test_hardening._Custom"),
    ("nested", {"a": [1, {"b": (2, np.float64(3))}]}, r"`extra\['a'\]\[1\]\['b'\]\[1\]` is a numpy.float64"),
    ("key", {np.int64(1): 2}, r"`extra \(a key\)` is a numpy.int64"),
    ("frozenset", {"s": frozenset([1])}, r"`extra\['s'\]` is a frozenset"),
    ("lambda", {"f": lambda: 0}, r"`extra\['f'\]` is a function"),
    ("not-a-dict", np.float32(1), r"`extra` is a numpy.float32"),
]


@pytest.mark.parametrize("extra, pattern", [c[1:] for c in BAD_EXTRAS], ids=[c[0] for c in BAD_EXTRAS])
def test_save_refuses_extras_load_cannot_read(tmp_path: Path, extra, pattern: str) -> None:
    ec, opt = trained()
    tte.checkpoint.save(tmp_path / "ckpt.pt", model=ec, optimizer=opt, extra={"step": 1})
    before = snapshot(ec, opt, tmp_path)
    with pytest.raises(TypeError, match=pattern + r".*Nothing was written"):
        tte.checkpoint.save(tmp_path / "ckpt.pt", model=ec, optimizer=opt, extra=extra)
    assert_unchanged(before, ec, opt, tmp_path)
    assert tte.checkpoint.load(tmp_path / "ckpt.pt", model=ec, optimizer=opt) == {"step": 1}


def test_every_accepted_extra_round_trips(tmp_path: Path) -> None:
    ec, opt = trained()
    extra = {"step": 3, "lr": 0.1, "big": 2**70, "c": 1 + 2j, "name": "run", "b": b"x", "ba": bytearray(b"y"),
             "none": None, "flag": True, "t": torch.arange(3), "sp": torch.ones(2).to_sparse(),
             "bf": torch.ones(2, dtype=torch.bfloat16), "dtype": torch.float16, "dev": torch.device("cpu"),
             "size": torch.Size([2, 3]), "layout": torch.strided, "od": collections.OrderedDict(a=1),
             "nested": {"a": [1, (2, 3), {4, 5}], 7: {"deep": [torch.zeros(1)]}}}
    tte.checkpoint.save(tmp_path / "ckpt.pt", model=ec, optimizer=opt, extra=extra)
    got = tte.checkpoint.load(tmp_path / "ckpt.pt", model=ec, optimizer=opt)
    assert got.keys() == extra.keys()
    for k, v in extra.items():
        if torch.is_tensor(v):
            assert torch.equal(got[k].to_dense(), v.to_dense()), k
        elif k == "nested":
            assert got[k]["a"] == v["a"] and torch.equal(got[k][7]["deep"][0], v[7]["deep"][0])
        else:
            assert got[k] == v and (type(got[k]) is type(v) or k in ("od", "size")), k  # saved as dict, tuple


# ------------------------------------------------------------------ 3. a killed save's temporary is cleared
_KILLED_SAVER = r"""
import os, sys, time, torch
import torch_tpu_embedding as tte
folder = sys.argv[1]
def stuck_fsync(fd):  # the disk "hangs" after the data is written, before the rename
    open(os.path.join(folder, "in-fsync"), "w").close()
    time.sleep(600)
os.fsync = stuck_fsync
tte.checkpoint.save(os.path.join(folder, "ckpt.pt"), extra={"step": 2, "blob": torch.ones(1 << 20)})
"""

_HOLDER = r"""
import sys
from torch_tpu_embedding import _ckpt_io
with _ckpt_io._locked_temp(sys.argv[1], "ckpt.pt") as (f, tmp):
    f.write(b"half a checkpoint")
    f.flush()
    print(tmp, flush=True)
    sys.stdin.readline()   # a concurrent saver, mid-write, until told to stop
"""


def _run(code: str, *args: str, **kw) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-c", code, *args], env=env, **kw)


def _wait_for(path: Path, proc: subprocess.Popen, seconds: float = 120) -> None:
    deadline = time.monotonic() + seconds
    while not path.exists():
        assert proc.poll() is None, "the saver ended before reaching the point to kill it"
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_killed_save_leaves_old_checkpoint_and_next_save_clears_its_temporary(tmp_path: Path) -> None:
    ec, opt = trained()
    tte.checkpoint.save(tmp_path / "ckpt.pt", model=ec, optimizer=opt, extra={"step": 1})
    (tmp_path / "notes.tmp-keep").write_text("not ours")  # other files are never touched
    (tmp_path / ".tmp-legacy.pt").write_text("older naming: left alone")
    first = None
    for _ in range(2):  # killed twice: the second save clears the first one's temporary
        proc = _run(_KILLED_SAVER, str(tmp_path))
        _wait_for(tmp_path / "in-fsync", proc)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        (tmp_path / "in-fsync").unlink()
        stale = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(_ckpt_io.TMP_PREFIX))
        assert len(stale) == 1 and stale[0].startswith(".tte-tmp-ckpt.pt-") and stale[0] != first
        assert (tmp_path / stale[0]).stat().st_size > 4 << 20  # the data was written, not yet renamed
        first = stale[0]
    ec2, opt2 = trained()  # the previous checkpoint is intact
    assert tte.checkpoint.load(tmp_path / "ckpt.pt", model=ec2, optimizer=opt2) == {"step": 1}
    tte.checkpoint.save(tmp_path / "other.pt", extra={"step": 3})  # any save in the folder clears them
    assert sorted(p.name for p in tmp_path.iterdir()) == [".tmp-legacy.pt", "ckpt.pt", "notes.tmp-keep", "other.pt"]


def test_a_concurrent_savers_temporary_is_never_removed(tmp_path: Path) -> None:
    holder = _run(_HOLDER, str(tmp_path), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        tmp = Path(holder.stdout.readline().strip())
        assert tmp.name.startswith(".tte-tmp-ckpt.pt-")
        tte.checkpoint.save(tmp_path / "ckpt.pt", extra={"step": 1})  # runs the cleaner
        assert tmp.read_bytes() == b"half a checkpoint"  # still there: its writer is alive
        assert _ckpt_io.remove_stale_temporaries(str(tmp_path)) == []
    finally:
        holder.kill()  # dies mid-write: its lock goes with it
        holder.wait()
    assert _ckpt_io.remove_stale_temporaries(str(tmp_path)) == [tmp.name]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.pt"]
