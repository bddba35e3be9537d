"""Row-sharded tables under SPMD train through the id exchange (torch_tpu_embedding/xla/routed.py and the
OWNER_LOCAL update path), with nothing changed in the training loop:

* every optimizer (one table each, by per-table overrides), with EMA + gradient accumulation + clipnorm, with
  global_clipnorm + loss scaling + skip_nonfinite; non-lazy Adam; a stacked group; bfloat16 tables: the logical
  state after 4 steps equals the CPU eager run to 1e-5 (float32), with Zipf and duplicate ids, host bags and
  batch-sharded device ids; one compiled graph; no host fallback; shardings unchanged — on 4 devices here and on
  2, 6 and 8 in subprocesses (_routed_script.py);
* the step takes the OWNER_LOCAL path;
* a capacity too small: ``check_ids()`` raises naming the features, the shard and the capacity that would have
  sufficed; the table and its slots are unchanged; ``largest_loads()`` equals the loads counted on the host;
* a single-file checkpoint loads into such a table with its and its slots' shardings kept.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

torch_xla = pytest.importorskip("torch_xla")
import torch_xla.debug.metrics as met  # noqa: E402
import torch_xla.runtime as xr  # noqa: E402

if not xr.is_spmd():  # once per process: a second call warns (XLA_USE_SPMD is set by the first)
    xr.use_spmd()
sys.path.insert(0, str(Path(__file__).parent))
import _routed_script as script  # noqa: E402

import torch_tpu_embedding as tte  # noqa: E402
from torch_tpu_embedding.optim._core import update_paths  # noqa: E402
from torch_tpu_embedding.optim._core.update_paths import Path as UpdatePath  # noqa: E402
from torch_tpu_embedding.xla import device_mesh, replicate, shard, sharding_spec  # noqa: E402

ROOT = Path(__file__).parents[2]
DEV = torch_xla.device()
N = 4


def check(r: dict[str, Any], fresh: bool) -> None:
    """``fresh``: a new process (exactly one compile); in process an earlier test may have compiled the graph."""
    tol = 1e-2 if r["config"] == "bfloat16" else 1e-5  # bfloat16 weights: one rounding of a float32 update
    bad = {k: e for k, e in r["errors"].items() if e > tol}
    assert not bad, (r["config"], bad)
    assert r["shapes_equal"]
    first = r["compiles"][0]
    assert (first == 1 if fresh else first <= 1) and r["compiles"] == [first] * len(r["compiles"]), r["compiles"]
    assert r["fallbacks"] == []
    assert r["specs_before"] == r["specs_after"]
    assert r["moved"] > 1e-2  # the steps did train


@pytest.mark.parametrize("config", script.CONFIGS)
def test_equals_cpu_on_4_devices(config: str) -> None:
    check(script.run(config), fresh=False)


@pytest.mark.parametrize("n", [2, 6, 8])
def test_equals_cpu_on_2_6_and_8_devices(n: int) -> None:
    """6 devices: not a power of two, so the row block (and chunk count) is lcm(512, 6) = 1,536 (as on a
    768-chip slice)."""
    env = {**os.environ, "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": str(n)}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.pop("XLA_USE_SPMD", None)  # the child calls use_spmd() itself
    configs = list(script.EXTRAS)  # every optimizer, plain and with every extra
    out = subprocess.run([sys.executable, script.__file__, *configs], env=env, capture_output=True, text=True,
                         timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    results = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert [r["config"] for r in results] == configs
    for r in results:
        check(r, fresh=True)


@pytest.mark.parametrize("config", ["plain", "ema-accum-clipnorm", "stacked"])
def test_more_devices_than_the_row_alignment_equal_cpu(config: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """On more than 512 devices (a power of two) the interleaved order has one chunk per device. That
    path, taken here on 4 devices with the alignment lowered to 2: every optimizer equals the CPU."""
    monkeypatch.setattr("torch_tpu_embedding.xla.sharding.ROW_ALIGNMENT", 2)
    ec, _, opt = _model()  # through the exchange, one chunk per device
    layout = ec.tables.t.row_layout
    assert layout is not None and layout.chunks == N
    assert update_paths.choose_path(ec.tables.t.weight, opt.param_groups[0], row_grad=True) is UpdatePath.OWNER_LOCAL
    check(script.run(config), fresh=False)


def test_more_devices_than_the_row_alignment_checkpoint_moves_to_the_usual_layout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A table stored in one chunk per device (alignment 2, 4 devices: 1,004 rows, 4 chunks) saves a
    distributed checkpoint that loads into the usual layout (1,024 rows, 512 chunks) and on the CPU."""
    monkeypatch.setattr("torch_tpu_embedding.xla.sharding.ROW_ALIGNMENT", 2)
    ec, head, opt = _model()
    layout = ec.tables.t.row_layout
    assert layout is not None and layout.chunks == 4 and ec.tables.t.weight.shape[0] == 1004
    g = torch.Generator().manual_seed(5)
    for _ in range(2):
        _step(ec, head, opt, torch.randint(0, 1001, (8, 4), generator=g), torch.randint(0, 1001, (8,), generator=g))
    saved = _logical(ec, opt)
    tte.checkpoint.save_distributed(tmp_path / "dcp", model=ec, optimizer=opt)
    monkeypatch.undo()
    ec2, _, opt2 = _model()
    layout = ec2.tables.t.row_layout
    assert layout is not None and layout.chunks == 512 and ec2.tables.t.weight.shape[0] == 1024
    tte.checkpoint.load_distributed(tmp_path / "dcp", model=ec2, optimizer=opt2)
    torch_xla.sync()
    for k, v in _logical(ec2, opt2).items():
        torch.testing.assert_close(v, saved[k], rtol=0, atol=0, msg=k)
    cpu = tte.EmbeddingCollection({"a": tte.FeatureConfig(ec.tables.t.config, max_ids_per_bag=4),
                                   "b": tte.FeatureConfig(ec.tables.t.config)})
    cpu_opt = tte.optim.Adam([*cpu.parameters(), *torch.nn.Linear(8, 1).parameters()], lr=0.1)  # as _model
    tte.checkpoint.load_distributed(tmp_path / "dcp", model=cpu, optimizer=cpu_opt)
    assert torch.equal(cpu.state_dict()["tables.t.weight"], saved["weight"])


def _model(capacity: int | None = None) -> tuple[tte.EmbeddingCollection, torch.nn.Module, Any]:
    torch.manual_seed(0)
    t = tte.TableConfig(1001, 8, name="t", placement="row", max_unique_ids_per_shard=capacity)
    ec = tte.EmbeddingCollection({"a": tte.FeatureConfig(t, max_ids_per_bag=4), "b": tte.FeatureConfig(t)}, device=DEV)
    head = torch.nn.Linear(8, 1).to(DEV)
    shard(ec, device_mesh())
    replicate(head)
    opt = tte.optim.Adam([*ec.parameters(), *head.parameters()], lr=0.1)
    opt.init_state()
    torch_xla.sync()
    return ec, head, opt


def _step(ec: tte.EmbeddingCollection, head: torch.nn.Module, opt: Any, a: torch.Tensor, b: torch.Tensor) -> None:
    out = ec({"a": tte.Padded(a), "b": b})
    (head(out["a"]) * head(out["b"])).sum().backward()
    opt.step()
    opt.zero_grad()
    torch_xla.sync()


def test_the_step_takes_the_owner_local_path(monkeypatch: pytest.MonkeyPatch) -> None:
    ec, head, opt = _model()
    w = ec.tables.t.weight
    assert update_paths.choose_path(w, opt.param_groups[0], row_grad=True) is UpdatePath.OWNER_LOCAL
    nonlazy = tte.optim.Adam([w], lr=0.1, lazy_adam=False).param_groups[0]
    assert update_paths.choose_path(w, nonlazy, row_grad=True) is UpdatePath.OWNER_LOCAL  # dense update per shard
    ran: list[UpdatePath] = []
    real = update_paths.update

    def spy(item: Any) -> None:
        if item.p is w:
            ran.append(item.path)
        real(item)

    monkeypatch.setattr("torch_tpu_embedding.optim._core.base.update", spy)
    g = torch.Generator().manual_seed(0)
    _step(ec, head, opt, torch.randint(0, 1001, (8, 4), generator=g), torch.randint(0, 1001, (8,), generator=g))
    assert ran == [UpdatePath.OWNER_LOCAL]


def _logical(ec: tte.EmbeddingCollection, opt: Any) -> dict[str, torch.Tensor]:
    out = {"weight": ec.state_dict()["tables.t.weight"].cpu().clone()}
    out.update({f"opt/{k}": v.cpu().clone() for k, v in opt.state_dict()["state"]["table:t"].items()})
    return out


def test_overflow_raises_at_check_ids_and_updates_nothing(tmp_path: Path) -> None:
    ec, head, opt = _model(capacity=2)
    before = _logical(ec, opt)
    g = torch.Generator().manual_seed(3)
    a, b = torch.randint(0, 1001, (8, 4), generator=g), torch.randint(0, 1001, (8,), generator=g)
    met.clear_all()
    _step(ec, head, opt, a, b)
    assert met.executed_fallback_ops() == []
    # The loads counted on the host: device d looks up rows [2d, 2d + 2) of both features (8 examples, 4 devices).
    layout = ec.tables.t.row_layout
    assert layout is not None
    own = layout.ownership(int(ec.tables.t.weight.shape[0]), N)
    loads = torch.zeros(N, N, dtype=torch.int64)
    for d in range(N):
        ids = torch.unique(torch.cat([a[2 * d : 2 * d + 2].reshape(-1), b[2 * d : 2 * d + 2]]))
        loads[d] = torch.bincount(own.owner(ids), minlength=N)
    want = loads.amax(0).tolist()
    assert ec.largest_loads() == {"t": {"largest_load": want, "capacity": 2}}
    shard_over = [s for s in range(N) if want[s] > 2]
    assert shard_over
    total = int((loads - 2).clamp(min=0).sum())
    with pytest.warns(UserWarning, match=rf"and {total} id\(s\) over an id-exchange capacity were dropped since"):
        ec.state_dict()  # a save before check_ids() says so
    with pytest.warns(UserWarning, match=rf"and {total} id\(s\) over an id-exchange capacity were dropped since"):
        tte.checkpoint.save_distributed(tmp_path / "dcp", model=ec)  # which does not call state_dict()
    with pytest.raises(ValueError) as info:
        ec.check_ids()
    msg = str(info.value)
    assert "Feature(s) `a`, `b` (table `t`): ids over the exchange capacity 2 were dropped" in msg, msg
    for s in shard_over:
        dropped = int((loads[:, s] - 2).clamp(min=0).sum())
        assert f"{dropped} for shard {s}" in msg, msg
    assert f"A capacity of {max(want)} would have sufficed" in msg, msg
    assert "max_unique_ids_per_shard" in msg
    after = _logical(ec, opt)
    for k, v in before.items():  # nothing was updated from the step that dropped ids: table, slots, step
        assert torch.equal(after[k], v), k
    ec.check_ids()  # counters were reset
    # A batch that fits trains.
    _step(ec, head, opt, torch.tensor([[1, 2, 3, 4]] * 8), torch.tensor([5] * 8))
    ec.check_ids()
    assert not torch.equal(_logical(ec, opt)["weight"], before["weight"])


def test_single_file_checkpoint_keeps_the_shardings(tmp_path: Path) -> None:
    """tte.checkpoint.load into a table trained through the exchange: logical rows written into the interleaved
    table and chunked slots from the host, whose layouts stay row-sharded (copying a replicated device tensor
    into them left Adam's slots replicated: a whole table-sized slot on every device); the state equals the
    saved one, and the next step compiles nothing new."""
    ec, head, opt = _model()
    g = torch.Generator().manual_seed(5)
    _step(ec, head, opt, torch.randint(0, 1001, (8, 4), generator=g), torch.randint(0, 1001, (8,), generator=g))
    tte.checkpoint.save(tmp_path / "ckpt.pt", model=ec, optimizer=opt)
    saved = _logical(ec, opt)

    ec2, head2, opt2 = _model()
    w = ec2.tables.t.weight
    shardings = {"weight": sharding_spec(w), **{k: sharding_spec(v) for k, v in opt2.state[w].items() if v.dim()}}
    assert shardings["weight"] == "{devices=[4,1]0,1,2,3}" and shardings["momenta"] == shardings["weight"]
    tte.checkpoint.load(tmp_path / "ckpt.pt", model=ec2, optimizer=opt2)
    torch_xla.sync()
    assert {"weight": sharding_spec(w), **{k: sharding_spec(opt2.state[w][k]) for k in shardings if k != "weight"}} \
        == shardings
    loaded = _logical(ec2, opt2)
    for k, v in saved.items():
        assert torch.equal(loaded[k], v), k
    a, b = torch.randint(0, 1001, (8, 4), generator=g), torch.randint(0, 1001, (8,), generator=g)
    _step(ec2, head2, opt2, a, b)  # the first step after the load may compile (the loaded buffers are new)
    met.clear_all()
    _step(ec2, head2, opt2, a, b)
    assert (met.counter_value("UncachedCompile") or 0) == 0 and met.executed_fallback_ops() == []
    assert sharding_spec(w) == shardings["weight"]
