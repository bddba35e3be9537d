"""A ``tte.checkpoint.save`` file with one byte flipped anywhere in a record's data (a tensor's bytes, the pickle):
``tte.checkpoint.load`` refuses it with a ValueError naming the file and the record, and the model and optimizer
are as they were. torch's reader checks none of the CRC-32s its zip records carry (torch 2.9 and 2.13): before, a
byte flipped inside a table's rows loaded silently as another value.
"""

from __future__ import annotations

import zipfile
from pathlib import Path

import pytest
import torch
from suite_helpers import same_state, snapshot_state

import torch_tpu_embedding as tte


def trained(seed: int) -> tuple[tte.EmbeddingCollection, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    ec = tte.EmbeddingCollection({"f": tte.FeatureConfig(tte.TableConfig(40, 4, name="t", dtype=torch.float64))})
    opt = tte.optim.Adagrad(ec.parameters(), lr=0.1)
    ec({"f": torch.tensor([1, 2, 3, 3])})["f"].sum().backward()
    opt.step()
    return ec, opt


def data_span(path: Path, name: str) -> tuple[int, int]:
    """Where record ``name``'s data lies in the zip file ``path``: (first byte, length)."""
    raw = path.read_bytes()
    info = zipfile.ZipFile(path).getinfo(name)
    at = info.header_offset  # the local header: 30 bytes, the name, the extra field (torch's alignment)
    first = at + 30 + int.from_bytes(raw[at + 26:at + 28], "little") + int.from_bytes(raw[at + 28:at + 30], "little")
    return first, info.file_size


@pytest.fixture
def saved(tmp_path: Path) -> Path:
    ec, opt = trained(0)
    path = tmp_path / "ckpt.pt"
    tte.checkpoint.save(path, model=ec, optimizer=opt, extra={"step": 1})
    return path


def test_every_record_with_a_flipped_byte_is_refused_and_changes_nothing(saved: Path, tmp_path: Path) -> None:
    records = [i.filename for i in zipfile.ZipFile(saved).infolist() if i.file_size]
    tensors = [r for r in records if "/data/" in r and not r.endswith(".pkl")]
    assert len(tensors) >= 3, records  # the table, its accumulator, ...: every one is tried below
    ec, opt = trained(1)
    before = snapshot_state(ec, opt)
    for name in records:
        first, size = data_span(saved, name)
        raw = bytearray(saved.read_bytes())
        raw[first + size // 2] ^= 0x10  # one bit of one byte in the middle of the record's data
        bad = tmp_path / "bad.pt"
        bad.write_bytes(bytes(raw))
        with pytest.raises(ValueError, match=rf"bad\.pt is not a readable checkpoint .*record '{name}' .*CRC-32"):
            tte.checkpoint.load(bad, model=ec, optimizer=opt)
        assert same_state(before, snapshot_state(ec, opt)), name
    # (the file unflipped loads: the table as saved, bit for bit)
    assert tte.checkpoint.load(saved, model=ec, optimizer=opt) == {"step": 1}
    assert torch.equal(ec.tables["t"].weight, trained(0)[0].tables["t"].weight)

