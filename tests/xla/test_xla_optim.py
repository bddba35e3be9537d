"""Optimizers on XLA: same numbers as CPU, one compilation, no host fallback, no [V, D] temporary."""

from __future__ import annotations

import functools
import glob
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from optim_registry import XLA, XLA_COMPILE, OptimizerConfig, cases, ids

torch_xla = pytest.importorskip("torch_xla")

import torch_tpu_embedding as tte  # noqa: E402

# The autograd engine sizes its device queues at the first backward: create the XLA device first.
torch_xla.device()

SCRIPT = Path(__file__).with_name("_optim_step_script.py")
ROOT = Path(__file__).parents[2]
def _run(device: torch.device, cfg: OptimizerConfig, steps: int = 5):
    torch.manual_seed(0)
    t = tte.TableConfig(40, 4, name="t", combiner="sqrtn")
    u = tte.TableConfig(30, 4, name="u", combiner="sum")
    ec = tte.EmbeddingCollection(
        {"a": tte.FeatureConfig(t, max_ids_per_bag=4), "b": tte.FeatureConfig(t),
         "c": tte.FeatureConfig(u, max_sequence_length=3)},
        device=device,
    )
    head = torch.nn.Linear(4, 1).to(device)
    opt = cfg.make(list(ec.parameters()) + list(head.parameters()))
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        a = torch.randint(0, 20, (12,), generator=g)  # rows >= 20 of t are never touched
        lengths = torch.tensor([4, 0, 3, 2, 3])
        w = torch.rand(12, generator=g) + 0.5
        b = torch.randint(0, 20, (5,), generator=g)
        c = torch.randint(0, 30, (7,), generator=g)
        out = ec({"a": tte.Jagged(a, lengths=lengths, weights=w), "b": b,
                  "c": tte.Jagged(c, lengths=torch.tensor([2, 0, 4, 1, 0]))})
        loss = (head(out["a"]) * head(out["b"])).sum() + out["c"].square().sum()
        loss.backward()
        opt.step()
        opt.zero_grad()
        if device.type == "xla":
            torch_xla.sync()
    # Accumulation buffers are sized by the padded batch, which differs between devices. A table's raw EMA rows and
    # ema_last are compared too (an accumulate-only call on XLA once brought rows up to date: tests/ema_window_cases.py).
    state = {
        f"{key}/{slot}": v.cpu() for key, s in opt.state_dict()["state"].items()
        for slot, v in s.items() if slot not in ("acc_ids", "acc_rows")
    }
    if opt.param_groups[0]["use_ema"]:
        for name, table in ec.embedding_tables.items():
            state[f"ema_now/{name}"] = opt.moving_average(table).cpu()
    return {k: v.detach().cpu() for k, v in ec.state_dict().items()}, state


@pytest.mark.parametrize("cfg", cases(XLA), ids=str)
def test_xla_matches_cpu(cfg: OptimizerConfig) -> None:
    cpu_params, cpu_state = _run(torch.device("cpu"), cfg)
    xla_params, xla_state = _run(torch_xla.device(), cfg)
    for k in cpu_params:
        torch.testing.assert_close(xla_params[k], cpu_params[k], rtol=1e-5, atol=1e-6, msg=k)
    assert set(xla_state) == set(cpu_state)
    for k in cpu_state:
        assert xla_state[k].shape == cpu_state[k].shape, k  # trash rows never leak
        torch.testing.assert_close(xla_state[k], cpu_state[k], rtol=1e-5, atol=1e-6, msg=k)
    if cfg.lazy:  # rows 20.. of table t untouched on both devices
        torch.manual_seed(0)
        init = tte.TableConfig(40, 4).initializer
        assert init is None
        assert torch.equal(xla_params["tables.t.weight"][20:], cpu_params["tables.t.weight"][20:])


def _script(v: int, opts: list[str], env_extra: dict[str, str] | None = None) -> dict[str, dict[str, object]]:
    """Runs ``opts`` one after the other in one fresh process: optimizer id -> its compile and fallback counts."""
    env = {**os.environ, "PJRT_DEVICE": "CPU", **(env_extra or {})}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.pop("CPU_NUM_DEVICES", None)
    out = subprocess.run([sys.executable, str(SCRIPT), str(v), *opts], env=env, check=True,
                         capture_output=True, text=True, timeout=600)
    results = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert [r.pop("optimizer") for r in results] == opts
    return dict(zip(opts, results, strict=True))


@functools.cache
def _twenty_steps() -> dict[str, dict[str, object]]:
    # One process for every configuration: each torch_xla start-up costs ~7 s (was one process per case).
    return _script(1000, ids(XLA_COMPILE))


@pytest.mark.parametrize("opt", ids(XLA_COMPILE))
def test_twenty_steps_lambda_lr_through_zero_and_one_compile_once(opt: str) -> None:
    """Also with EMA + gradient accumulation (+ clipnorm / global_clipnorm / loss scale) on."""
    assert _twenty_steps()[opt] == {"compiles": 1, "fallbacks": []}


def _step_report(dump: Path) -> tuple[int, str]:
    reports = glob.glob(str(dump / "*SyncTensorsGraph*after_optimizations-memory-usage-report.txt"))
    # The training step is the largest graph (the others materialise initial values).
    step = max(reports, key=lambda f: os.path.getsize(f.replace("-memory-usage-report", "")))
    text = Path(step).read_text()
    temp = sum(int(float(m.group(1)) * {"B": 1, "KiB": 1024, "MiB": 2**20}[m.group(2)])
               for m in re.finditer(r"size ([\d.]+)(B|KiB|MiB), preallocated-temp", text))
    return temp, Path(step.replace("-memory-usage-report", "")).read_text()


def test_lazy_step_has_no_table_sized_temporary(tmp_path: Path) -> None:
    """Adam's step: temp bytes identical at V=4096 and V=65536, and no table-sized copy()."""
    temps = {}
    for v in (4096, 65536):
        dump = tmp_path / f"dump{v}"
        _script(v, ["adam"], {"XLA_FLAGS": f"--xla_dump_to={dump} --xla_dump_hlo_as_text"})
        temps[v], hlo = _step_report(dump)
        for rows in (v, v + 1, v + 2):
            assert not re.search(rf"f32\[{rows},16\]\S* copy\(", hlo), f"table copy at V={v}"
    assert temps[4096] == temps[65536], temps
    assert temps[4096] < 4096 * 16 * 4  # smaller than one table
