"""examples/dlrm_synthetic.py on 4 virtual devices: it learns, compiles one graph, falls back never, and
lays every table out as asked (row-sharded, or the size rule's mix of row and replicated); its row-sharded
tables, and only those, train through the id exchange (loads reported, no id dropped).

Short mode: 8 tables (vocabularies 20,000 and 600 alternating, two of them multi-hot bags of <= 8 ids),
batch 256, 40 steps. The example clears torch_xla's metrics after building the model and its
optimizer state (one sync), so "compiled graphs: 1 (after warm-up: 0)" means that the training step
is exactly one graph, compiled at the first step and reused by the 39 others.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("torch_xla")
ROOT = Path(__file__).parents[2]
EXAMPLE = ROOT / "examples" / "dlrm_synthetic.py"
SHORT = ["--tables", "8", "--vocab", "20000,600", "--multi-hot", "2", "--batch", "256", "--steps", "40",
         "--log-every", "10"]


def run(*args: str, env_extra: dict[str, str] | None = None) -> str:
    env = {**os.environ, "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "4", "OMP_WAIT_POLICY": "PASSIVE", **(env_extra or {})}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.pop("XLA_USE_SPMD", None)  # set by use_spmd() in this process; the child calls use_spmd() itself
    done = subprocess.run([sys.executable, str(EXAMPLE), *SHORT, *args], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def check_learns_in_one_graph(out: str) -> dict[str, list]:
    assert "devices=4" in out and "spmd=True" in out and "shard_batch=True" in out, out
    first, last = map(float, re.search(r"loss first ([\d.]+) last ([\d.]+)", out).groups())  # type: ignore[union-attr]
    assert last < first - 0.03, out
    assert "compiled graphs: 1 (after warm-up: 0); host fallbacks: []" in out, out
    shardings: dict[str, list] = json.loads(re.search(r"^shardings: (.*)$", out, re.M).group(1))  # type: ignore[union-attr]
    assert sorted(shardings) == [f"t{t}" for t in range(8)]
    for name, (_, rows, _) in shardings.items():  # padded to an even split, never below the vocabulary
        assert rows % 4 == 0 and rows >= (20000 if int(name[1:]) % 2 == 0 else 600), (name, rows)
    return shardings


def exchange_loads(out: str) -> dict[str, list[int]]:
    """The example's ``id exchange`` line: ``{table: [largest per-shard load, capacity]}``. Only tables that
    trained through the id exchange are listed (``EmbeddingCollection.largest_loads``); none: no line."""
    m = re.search(r"^id exchange, largest per-shard load / capacity: (.*)$", out, re.M)
    loads: dict[str, list[int]] = json.loads(m.group(1)) if m else {}
    for name, (load, cap) in loads.items():
        assert 0 < load <= cap, (name, load, cap)  # ids were routed, none dropped
    return loads


def test_row_sharded_tables_with_distributed_checkpoint(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    out = run("--placement", "row", "--save", str(ckpt))
    shardings = check_learns_in_one_graph(out)
    assert "placements: {'row': 8}" in out, out
    for name, (placement, _, spec) in shardings.items():
        assert placement == "row" and spec == "{devices=[4,1]0,1,2,3}", (name, placement, spec)
    # Every row-sharded table goes through the id exchange: here all 8, stacked in one group (the default).
    assert list(exchange_loads(out)) == ["fused_0"], out

    # The directory loads into the same model on the CPU (no torch_xla there): logical rows, trained.
    spec = importlib.util.spec_from_file_location("dlrm_synthetic", EXAMPLE)
    assert spec is not None and spec.loader is not None
    dlrm = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(dlrm)
    args = dlrm.parse_args([*SHORT, "--placement", "row"])
    model = dlrm.build_model(args, torch.device("cpu"))
    opt = dlrm.build_optimizers(model, args)[0]
    before = model.embeddings.tables.t0.weight.detach().clone()
    import torch_tpu_embedding as tte

    tte.checkpoint.load_distributed(ckpt, model=model, optimizer=opt)
    after = model.embeddings.tables.t0.weight.detach()
    assert after.shape == (20000, 16)
    changed = (after != before).any(1)
    assert 0 < int(changed.sum()) < 20000  # lazy updates: the rows the batches touched, not the others
    assert opt.state_dict()["state"]["table:t0"]["momenta"].shape == (20000, 16)


def test_auto_placement_mixes_row_and_replicated() -> None:
    out = run("--placement", "auto", "--replicate-below-bytes", "100000")  # 20000 x 16 x 4 B sharded, 600 rows not
    shardings = check_learns_in_one_graph(out)
    assert "placements: {'replicated': 4, 'row': 4}" in out, out
    for name, (placement, _, spec) in shardings.items():
        if int(name[1:]) % 2 == 0:
            assert placement == "row" and spec == "{devices=[4,1]0,1,2,3}", (name, placement, spec)
        else:
            assert placement == "replicated" and spec == "{replicated}", (name, placement, spec)
    # The row-sharded ones (t0, t2, t4, t6; stacked in one group) go through the exchange, not the others.
    loads = exchange_loads(out)  # keyed by physical table: one row group (the replicated ones: another group)
    assert len(loads) == 1 and next(iter(loads)).startswith("fused_"), out


def test_stacked_replicated_tables_share_one_buffer_and_copy_no_table(tmp_path: Path) -> None:
    """--stack-tables --placement replicated: all 8 tables in one group. Unstacked, the four 20,000-row
    tables are equal-sized buffers, and XLA's donation pairing copied whole tables every step."""
    dump = tmp_path / "hlo"
    out = run("--stack-tables", "--placement", "replicated",
              env_extra={"XLA_FLAGS": f"--xla_dump_to={dump} --xla_dump_hlo_as_text"})
    shardings = check_learns_in_one_graph(out)
    assert "placements: {'replicated': 8}" in out and "--stack-tables True" in out, out
    assert {tuple(v) for v in shardings.values()} == {("replicated", 82432, "{replicated}")}  # 82,400 rows padded
    assert exchange_loads(out) == {}  # replicated: no id exchange
    step = max(dump.glob("*after_optimizations.txt"), key=lambda f: f.stat().st_size)  # the training step
    copies = re.findall(r"f32\[(\d+),16\]\S* copy\(", step.read_text())
    assert not [c for c in copies if int(c) >= 600], copies
