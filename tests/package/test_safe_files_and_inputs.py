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
from torch_tpu_embedding.checkpoint import files as ckpt_files
from torch_tpu_embedding.checkpoint import publish as ckpt_publish

ROOT = Path(__file__).resolve().parents[2]
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
    # (BytesStorageMetadata unpickles since read_torch_dcp reads torch's own DCP files: refused as an entry)
    ("bytes-entry", r"entries \['model/tables.t.weight'\] are not tensors"),
    ("chunk-entry", r"entries \['model/tables.t.weight'\] are not tensors"),
])
def test_crafted_dcp_metadata_runs_no_code(tmp_path: Path, how: str, pattern: str) -> None:
    ec, opt, ckpt = _dcp_checkpoint(tmp_path)
    marker = tmp_path / "pwned"
    _evil_metadata(ckpt, marker, how)
    ckpt_publish.write_manifest(str(ckpt))  # a crafted checkpoint comes with a manifest that matches it
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
    ckpt_publish.write_manifest(str(ckpt))  # a crafted checkpoint comes with a manifest that matches it
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
    ("custom", {"obj": _Custom()}, r"`extra\['obj'\]` is a test_safe_files_and_inputs._Custom"),
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
from torch_tpu_embedding.checkpoint import files as ckpt_files
with ckpt_files._locked_temp(sys.argv[1], "ckpt.pt") as (f, tmp):
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
        stale = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(ckpt_files.TMP_PREFIX))
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
        assert ckpt_files.remove_stale_temporaries(str(tmp_path)) == []
    finally:
        holder.kill()  # dies mid-write: its lock goes with it
        holder.wait()
    assert ckpt_files.remove_stale_temporaries(str(tmp_path)) == [tmp.name]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.pt"]


# ------------------------------------------------------------------ 6, 12. nothing converted silently; clear errors
def jag(values, lengths=None, offsets=None, weights=None):
    return tte.Jagged(values, offsets=offsets, lengths=lengths, weights=weights)


L21 = torch.tensor([2, 1])
IDS3 = torch.tensor([1, 2, 3])
COO_IDX = torch.tensor([[0, 0, 1], [0, 1, 0]])
INPUT_CASES = [
    # 6. float / bool lengths and offsets would be truncated
    ("lengths-float", jag(IDS3, torch.tensor([1.5, 1.5])), None, TypeError,
     r"Feature `f`: Jagged lengths must be an integer tensor. Received dtype torch.float32 \(it would be truncated"),
    ("lengths-float64", jag(IDS3, torch.tensor([2.0, 1.0], dtype=torch.float64)), None, TypeError,
     r"Feature `f`: Jagged lengths must be an integer tensor. Received dtype torch.float64"),
    ("lengths-bool", jag(torch.tensor([1, 2]), torch.tensor([True, True])), None, TypeError,
     r"Feature `f`: Jagged lengths must be an integer tensor. Received dtype torch.bool"),
    ("offsets-float", jag(IDS3, offsets=torch.tensor([0.0, 1.5, 3.0])), None, TypeError,
     r"Feature `f`: Jagged offsets must be an integer tensor. Received dtype torch.float32"),
    ("offsets-half", jag(IDS3, offsets=torch.tensor([0, 2, 3], dtype=torch.float16)), None, TypeError,
     r"Feature `f`: Jagged offsets must be an integer tensor"),
    # weights that would overflow in the combiner's dtype
    ("weights-f64-overflow", jag(IDS3, L21, weights=torch.tensor([1e300, 1.0, 1.0], dtype=torch.float64)), None,
     ValueError, r"Feature `f`: weights must be finite in torch.float32 .* Received 1e\+300, which would overflow"),
    ("padded-weights-f64-overflow", tte.Padded(torch.ones(2, 2, dtype=torch.long), None,
                                               torch.full((2, 2), -1e39, dtype=torch.float64)), None, ValueError,
     r"Feature `f`: weights must be finite in torch.float32 .* Received 1e\+39"),
    # 12. numpy arrays and lists inside inputs name the feature and the field
    ("jagged-numpy-values", jag(np.array([1, 2, 3]), L21), None, TypeError,
     r"Feature `f`: Jagged values must be a torch.Tensor. Received ndarray; convert it with torch.as_tensor"),
    ("jagged-list-lengths", jag(IDS3, [2, 1]), None, TypeError, r"Feature `f`: Jagged lengths must be a torch.Tensor. Received list"),
    ("jagged-numpy-offsets", jag(IDS3, offsets=np.array([0, 2, 3])), None, TypeError, r"Feature `f`: Jagged offsets must be a torch.Tensor"),
    ("jagged-list-values", jag([1, 2, 3], L21), None, TypeError, r"Feature `f`: Jagged values must be a torch.Tensor. Received list"),
    ("jagged-numpy-weights", jag(IDS3, L21, weights=np.ones(3)), None, TypeError, r"Feature `f`: Jagged weights must be a torch.Tensor"),
    ("padded-numpy-ids", tte.Padded(np.ones((2, 2), dtype=np.int64)), None, TypeError, r"Feature `f`: Padded ids must be a torch.Tensor"),
    ("padded-list-mask", tte.Padded(torch.ones(2, 2, dtype=torch.long), [[True, True], [True, False]]), None, TypeError,
     r"Feature `f`: Padded mask must be a torch.Tensor"),
    ("padded-numpy-weights", tte.Padded(torch.ones(2, 2, dtype=torch.long), None, np.ones((2, 2))), None, TypeError,
     r"Feature `f`: Padded weights must be a torch.Tensor"),
    ("weights-arg-list", jag(IDS3, L21), {"f": [1.0, 1.0, 1.0], "g": None}, TypeError,
     r"Feature `f`: the weights must be a torch.Tensor. Received list"),
    ("weights-arg-numpy", jag(IDS3, L21), {"f": np.ones(3), "g": None}, TypeError, r"Feature `f`: the weights must be a torch.Tensor"),
    # 12. sparse COO built without check_invariants: indices outside the shape, duplicate indices
    ("sparse-row-outside", torch.sparse_coo_tensor(torch.tensor([[0, 1, 5], [0, 1, 0]]), IDS3, (2, 3)), None, ValueError,
     r"Feature `f`: sparse indices must lie inside the tensor's shape \(2, 3\). Received index 5 in dim 0"),
    ("sparse-col-outside", torch.sparse_coo_tensor(torch.tensor([[0, 1], [0, 7]]), torch.tensor([1, 2]), (2, 3)), None,
     ValueError, r"Received index 7 in dim 1"),
    ("sparse-col-negative", torch.sparse_coo_tensor(torch.tensor([[0, 1], [0, -1]]), torch.tensor([1, 2]), (2, 3)), None,
     ValueError, r"Received index -1 in dim 1"),
    ("sparse-duplicates", torch.sparse_coo_tensor(torch.tensor([[0, 0, 1], [0, 0, 0]]), IDS3, (2, 3)), None, ValueError,
     r"Feature `f`: a sparse input holds two ids at the same index"),
    ("sparse-ids-out-of-range", torch.sparse_coo_tensor(COO_IDX, torch.tensor([1, 99, 2]), (2, 3)), None, ValueError,
     r"Feature `f`: ids must be in \[0, 10\).*Received: 99"),
]


@pytest.mark.parametrize("f, weights, exc, pattern", [c[1:] for c in INPUT_CASES], ids=[c[0] for c in INPUT_CASES])
def test_input_is_never_converted_silently(f, weights, exc, pattern) -> None:
    ec, opt = trained()
    before = snapshot(ec, opt)
    with pytest.raises(exc, match=pattern):
        out = ec({"f": f, "g": torch.tensor([4, 5])}, weights)
        sum(v.sum() for v in out.values()).backward()  # only reached if the forward wrongly accepted it
        opt.step()
    assert_unchanged(before, ec, opt)


def test_integer_lengths_of_every_width_still_work() -> None:
    ec, _ = trained()
    ref = ec({"f": jag(IDS3, L21), "g": torch.tensor([4, 5])})["f"]
    for dt in (torch.int32, torch.int16, torch.int8, torch.uint8):
        assert torch.equal(ec({"f": jag(IDS3, L21.to(dt)), "g": torch.tensor([4, 5])})["f"], ref)
        assert torch.equal(ec({"f": jag(IDS3, offsets=torch.tensor([0, 2, 3], dtype=dt)), "g": torch.tensor([4, 5])})["f"], ref)


# ------------------------------------------------------------------ 7. per-id weights get a gradient
def _reference(table: torch.Tensor, bags, weights, combiner: str):
    """float64 autograd reference: out_b = Σ w e / (1 | Σ w | sqrt Σ w²); returns (out, w leaf, table leaf)."""
    W = table.detach().double().requires_grad_()
    w = weights.detach().double().requires_grad_()
    outs, start = [], 0
    for bag in bags:
        ww, rows = w[start : start + len(bag)], W[torch.tensor(bag, dtype=torch.long)]
        start += len(bag)
        total = {"sum": torch.tensor(1.0, dtype=torch.float64), "mean": ww.sum(), "sqrtn": ww.square().sum().sqrt()}[combiner]
        outs.append((ww[:, None] * rows).sum(0) / total if len(bag) else torch.zeros(W.shape[1], dtype=torch.float64))
    return torch.stack(outs), w, W


BAGS = [[1, 2], [3, 3, 7], [], [9]]
WTS = [0.5, 2.0, -1.0, 3.0, 0.25, 1.5]


def _as_form(form: str, w: torch.Tensor):
    """The bags of BAGS with weights ``w`` (a leaf that requires grad) in one input form."""
    flat = torch.tensor([i for b in BAGS for i in b])
    lengths = torch.tensor([len(b) for b in BAGS])
    if form == "jagged":
        return tte.Jagged(flat, lengths=lengths, weights=w), None
    if form == "weights-arg":
        return tte.Jagged(flat, lengths=lengths), w
    if form == "nested":
        return (torch.nested.nested_tensor_from_jagged(flat, offsets=torch.cat([torch.zeros(1, dtype=torch.long),
                                                                                lengths.cumsum(0)])),
                torch.nested.nested_tensor_from_jagged(w, offsets=torch.cat([torch.zeros(1, dtype=torch.long),
                                                                             lengths.cumsum(0)])))
    rows = torch.repeat_interleave(torch.arange(len(BAGS)), lengths)
    cols = torch.cat([torch.arange(len(b)) for b in BAGS])
    if form == "sparse":
        idx = torch.stack([rows, cols])
        return torch.sparse_coo_tensor(idx, flat, (len(BAGS), 3)), torch.sparse_coo_tensor(idx, w, (len(BAGS), 3))
    ids = torch.zeros(len(BAGS), 3, dtype=torch.long).index_put((rows, cols), flat)  # "padded"
    mask = torch.zeros(len(BAGS), 3, dtype=torch.bool).index_put((rows, cols), torch.tensor(True))
    return tte.Padded(ids, mask, torch.zeros(len(BAGS), 3).index_put((rows, cols), w)), None


@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
@pytest.mark.parametrize("form", ["jagged", "weights-arg", "nested", "sparse", "padded"])
def test_per_id_weights_get_the_reference_gradient(combiner: str, form: str) -> None:
    torch.manual_seed(1)
    t = tte.TableConfig(V, 4, name="t", combiner=combiner)
    ec = tte.EmbeddingCollection({"f": tte.FeatureConfig(t, max_ids_per_bag=3)})
    leaf = torch.tensor(WTS, requires_grad=True)
    value, weights = _as_form(form, leaf)
    out = ec({"f": value}, None if weights is None else {"f": weights})["f"]
    g = torch.randn(out.shape)
    (out * g).sum().backward()
    ref, w_ref, table_ref = _reference(ec.tables.t.weight, BAGS, leaf, combiner)
    (ref * g.double()).sum().backward()
    assert torch.allclose(out.double(), ref, atol=1e-6)
    grad = leaf.grad if form != "padded" else None
    if form == "padded":  # the leaf was scattered into the padded weights: its gradient came through them
        grad = leaf.grad
    assert grad is not None
    assert torch.allclose(grad.double(), w_ref.grad, atol=1e-5), (grad, w_ref.grad)
    ids, rows = ec.row_grads()["t"]  # and the table's row gradient is unchanged by it
    dense = torch.zeros(V + 1, 4, dtype=torch.float64).index_add_(0, ids, rows.double())[:V]
    assert torch.allclose(dense, table_ref.grad, atol=1e-6)


def test_per_id_weight_gradient_matches_nn_embedding_bag() -> None:
    torch.manual_seed(2)
    t = tte.TableConfig(V, 4, name="t", combiner="sum")
    ec = tte.EmbeddingCollection({"f": tte.FeatureConfig(t)})
    bag = torch.nn.EmbeddingBag.from_pretrained(ec.tables.t.weight.detach().clone(), freeze=False, mode="sum")
    flat = torch.tensor([i for b in BAGS for i in b])
    offsets = torch.tensor([0, 2, 5, 5])
    w1, w2 = torch.tensor(WTS, requires_grad=True), torch.tensor(WTS, requires_grad=True)
    g = torch.randn(len(BAGS), 4)
    (ec({"f": tte.Jagged(flat, offsets=torch.cat([offsets, torch.tensor([6])]), weights=w1)})["f"] * g).sum().backward()
    (bag(flat, offsets, per_sample_weights=w2) * g).sum().backward()
    assert torch.allclose(w1.grad, w2.grad, atol=1e-6)


def test_per_id_weight_gradient_with_sgd_factored_rows_and_16_bit_tables() -> None:
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        torch.manual_seed(3)
        t = tte.TableConfig(V, 4, name="t", combiner="mean", dtype=dtype)
        ec = tte.EmbeddingCollection({"f": tte.FeatureConfig(t, max_ids_per_bag=3)})
        opt = tte.optim.SGD(ec.parameters(), lr=0.1)  # SGD keeps eager row gradients factored
        leaf = torch.tensor(WTS, requires_grad=True)
        value, _ = _as_form("jagged", leaf)
        g = torch.randn(len(BAGS), 4)
        (ec({"f": value})["f"].float() * g).sum().backward()
        _, w_ref, _ = _reference(ec.tables.t.weight.float(), BAGS, leaf, "mean")
        ref, w_ref, _ = _reference(ec.tables.t.weight.float(), BAGS, leaf, "mean")
        (ref * g.double()).sum().backward()
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        assert torch.allclose(leaf.grad.double(), w_ref.grad, atol=tol), dtype
        opt.step()  # the table trains as before


# ------------------------------------------------------------------ 9. 16-bit tables combine in float32
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("combiner, weights", [("mean", [4e4, 4e4]), ("sqrtn", [300.0, 300.0]), ("sum", [7e4, 1.0]),
                                               ("mean", [6e4, -6e4 + 1]), ("sqrtn", [1e-4, 1e-4])])
def test_16_bit_tables_combine_in_float32(dtype: torch.dtype, combiner: str, weights: list[float]) -> None:
    torch.manual_seed(4)
    t = tte.TableConfig(V, 4, name="t", combiner=combiner, dtype=dtype)
    ec = tte.EmbeddingCollection({"f": tte.FeatureConfig(t, max_ids_per_bag=2)})
    with torch.no_grad():
        ec.tables.t.weight.copy_(torch.linspace(-0.5, 0.5, V * 4).reshape(V, 4).to(dtype))
    w = torch.tensor(weights)
    out = ec({"f": tte.Jagged(torch.tensor([1, 2]), lengths=torch.tensor([2]), weights=w)})["f"]
    assert out.dtype == dtype
    ref, _, _ = _reference(ec.tables.t.weight, [[1, 2]], w, combiner)
    assert torch.isfinite(out).all()
    assert torch.allclose(out.double(), ref, rtol=1e-2, atol=1e-3), (out, ref)
    (out.float().sum()).backward()
    ids, rows = ec.row_grads()["t"]
    assert rows.dtype == dtype  # row gradients stay in the table's dtype: gain · dL/dout must fit in it
    if combiner != "sum":  # (a gain of 7e4 times a gradient of 1 does not fit in float16)
        assert torch.isfinite(rows).all()


def test_float16_weight_beyond_its_range_is_kept_in_float32() -> None:
    t = tte.TableConfig(V, 4, name="t", combiner="mean", dtype=torch.float16)
    ec = tte.EmbeddingCollection({"f": tte.FeatureConfig(t, max_ids_per_bag=2)})
    out = ec({"f": tte.Jagged(torch.tensor([1, 1]), lengths=torch.tensor([2]), weights=torch.tensor([7e4, 7e4]))})["f"]
    assert torch.allclose(out.float(), ec.tables.t.weight[1].float(), atol=1e-3)  # mean of one row twice


# ------------------------------------------------------------------ 12. empty batches
@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
def test_empty_batch_gives_empty_outputs(combiner: str) -> None:
    t = tte.TableConfig(V, D, name="t", combiner=combiner)
    ec = tte.EmbeddingCollection({"f": tte.FeatureConfig(t, max_ids_per_bag=4), "s": tte.FeatureConfig(t, max_sequence_length=2)})
    empty = tte.Jagged(torch.tensor([], dtype=torch.long), lengths=torch.tensor([], dtype=torch.long))
    w0 = ec.tables.t.weight.detach().clone()
    for opt in (tte.optim.Adagrad(ec.parameters(), lr=0.1), tte.optim.SGD(ec.parameters(), lr=0.1)):
        out = ec({"f": empty, "s": empty})
        assert out["f"].shape == (0, D) and out["s"].shape == (0, 2, D)
        (out["f"].sum() + out["s"].sum()).backward()
        opt.step()  # nothing looked up: no row changes
        opt.zero_grad()
        assert torch.equal(ec.tables.t.weight, w0) and ec.row_grads() == {}


# ------------------------------------------------------------------ 13. building a table: one buffer, named failures
def test_seeded_values_are_unchanged() -> None:
    """The in-place draw gives what drawing into a separate host buffer gave (the previous way)."""
    for init in (None, torch.nn.init.normal_, lambda w: torch.full_like(w, 0.5), torch.arange(12.0).reshape(4, 3)):
        torch.manual_seed(7)
        ec = tte.EmbeddingCollection({"f": tte.FeatureConfig(tte.TableConfig(4, 3, name="t", initializer=init))})
        torch.manual_seed(7)
        host = torch.empty(4, 3)
        if init is None:
            tte.config.default_initializer(host)
        elif isinstance(init, torch.Tensor):
            host.copy_(init)
        else:
            host.copy_(init(host))
        assert torch.equal(ec.tables.t.weight.detach(), host)


def test_a_table_too_large_for_host_memory_is_named() -> None:
    with pytest.raises(MemoryError, match=r"Table `huge`: cannot allocate its weight \[1000000000000, 64\] "
                                          r"torch.float32 \(238418.58 GiB\) in host memory"):
        tte.EmbeddingCollection({"f": tte.FeatureConfig(tte.TableConfig(10**12, 64, name="huge"))})


_PEAK = r"""
import torch
import torch_tpu_embedding as tte

def status(key):
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith(key + ":"))

with open("/proc/self/clear_refs", "w") as f:  # reset the peak (VmHWM) to the current RSS
    f.write("5")
base = status("VmRSS")
ec = tte.EmbeddingCollection({"f": tte.FeatureConfig(tte.TableConfig(1 << 21, 128, name="t"))})  # 1 GiB
print((status("VmHWM") - base) / 2**20)
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux's peak-RSS reset")
def test_building_a_table_needs_its_size_once_in_host_memory() -> None:
    out = subprocess.run([sys.executable, "-c", _PEAK], env={**os.environ, "PYTHONPATH": str(ROOT)},
                         capture_output=True, text=True, check=True)
    peak_gib = float(out.stdout.strip().splitlines()[-1])
    assert 0.9 < peak_gib < 1.3, peak_gib  # 2.0 when the draw went through a second buffer (measured)


# ------------------------------------------------------------------ 21. the guide's numbers repeat
def test_guide_section_1_draws_its_tables_from_a_seed() -> None:
    sys.path.insert(0, str(ROOT / "tests" / "docs"))
    import test_docs_snippets as harness

    first = harness.blocks(ROOT / "docs" / "guide.md")[0]
    tables = []
    for _ in range(2):
        torch.rand(7)  # whatever ran before: the guide's tables must not depend on it
        ns: dict[str, object] = {}
        exec(compile(first.code, "guide.md[block 0]", "exec"), ns)  # noqa: S102
        tables.append({k: v.detach().clone() for k, v in ns["ec"].state_dict().items()})
    assert tables[0].keys() == tables[1].keys()
    assert all(torch.equal(tables[0][k], tables[1][k]) for k in tables[0])


# ------------------------------------------------------------------ 16. one environment for both README commands
def _env_sh_copy(tmp_path: Path) -> Path:
    clone = tmp_path / "clone"
    (clone / "scripts").mkdir(parents=True)
    (clone / ".ci").mkdir()
    for rel in ("scripts/env.sh", ".ci/requirements.txt", ".ci/requirements-nodeps.txt"):
        (clone / rel).write_bytes((ROOT / rel).read_bytes())
    return clone


def _fake_python(path: Path, log: Path) -> None:
    """A stand-in interpreter that records its arguments (no installs)."""
    path.parent.mkdir(parents=True)
    path.write_text(f'#!/bin/sh\necho "$@" >> {log}\n')
    path.chmod(0o755)


def test_test_command_reuses_the_readme_venv(tmp_path: Path) -> None:
    clone, log = _env_sh_copy(tmp_path), tmp_path / "pip.log"
    _fake_python(clone / ".venv" / "bin" / "python", log)
    env = {**os.environ, "TTE_ENV_CACHE": str(tmp_path / "cache")}
    for _ in range(2):  # the second run finds its marker and installs nothing
        out = subprocess.run(["bash", "scripts/env.sh"], cwd=clone, env=env, capture_output=True, text=True, check=True)
        assert out.stdout.strip() == str(clone / ".venv")
    calls = log.read_text().splitlines()
    assert calls == ["-m pip install -q -r .ci/requirements.txt",
                     "-m pip install -q --no-deps -r .ci/requirements-nodeps.txt"]
    assert not (tmp_path / "cache").exists()  # no second virtualenv
    assert len(list((clone / ".venv").glob(".tte-pinned-*"))) == 1


def test_without_a_venv_the_cached_environment_is_used(tmp_path: Path) -> None:
    clone = _env_sh_copy(tmp_path)
    key = hashlib.sha256((ROOT / ".ci/requirements.txt").read_bytes() + (ROOT / ".ci/requirements-nodeps.txt").read_bytes())
    cached = tmp_path / "cache" / f"venv-py3-{key.hexdigest()[:16]}"
    cached.mkdir(parents=True)
    (cached / ".complete").touch()
    out = subprocess.run(["bash", "scripts/env.sh"], cwd=clone, env={**os.environ, "TTE_ENV_CACHE": str(tmp_path / "cache")},
                         capture_output=True, text=True, check=True)
    assert out.stdout.strip() == str(cached)


def test_venv_is_ignored_and_pins_satisfy_the_extras() -> None:
    import ast

    from packaging.requirements import Requirement

    assert ".venv/" in (ROOT / ".gitignore").read_text().splitlines()
    tree = ast.parse((ROOT / "setup.py").read_text())
    extras = {t.id: ast.literal_eval(n.value) for n in tree.body if isinstance(n, ast.Assign)
              for t in n.targets if isinstance(t, ast.Name) and t.id in ("XLA", "EXAMPLES", "TEST")}
    pins = {}
    for line in (ROOT / ".ci/requirements.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            r = Requirement(line)
            pins[r.name.lower().replace("_", "-")] = next(iter(r.specifier)).version
    specs = [Requirement(s) for group in extras.values() for s in group]
    assert {r.name.lower().replace("_", "-") for r in specs} <= set(pins)  # every extra is pinned for CI
    for r in specs:
        assert r.specifier.contains(pins[r.name.lower().replace("_", "-")]), (str(r), pins)


# ------------------------------------------------------------------ 20. docs cite only this repository
def test_docs_cite_no_private_files() -> None:
    import re

    pattern = re.compile(r"shared/|tf_spec|XLA_NOTES|DESIGN\.md")
    files = [ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *(ROOT / "examples").glob("*.py")]
    hits = [f"{p.name}:{i}" for p in files for i, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]
    assert hits == []


def test_code_cites_no_private_files() -> None:
    """The package, its tests, benchmarks and scripts cite only files in this repository (public sources, such as
    TF's or Keras's, by their own paths), never the private workshop beside it."""
    import re

    pattern = re.compile(r"shared/|tf_spec|XLA_NOTES|DESIGN\.md|/work/")
    this = Path(__file__).resolve()
    files = [p for d in ("torch_tpu_embedding", "tests", "benchmarks", "scripts", "examples")
             for p in (ROOT / d).rglob("*") if p.suffix in (".py", ".sh", ".md", ".toml", ".c") and p.resolve() != this]
    hits = [f"{p.relative_to(ROOT)}:{i}" for p in files
            for i, line in enumerate(p.read_text(errors="replace").splitlines(), 1) if pattern.search(line)]
    assert hits == []
