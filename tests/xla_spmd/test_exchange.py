"""The id exchange of a row-sharded table (torch_tpu_embedding.xla.exchange) on SPMD meshes of 2, 4 and 8 devices.

* Routing and rows back, value by value, against the host (duplicates, padding, buckets, overflow counts).
* Training steps (exchange lookup → backward → gradient exchange → owner-local Adam with chunk-aligned slots)
  equal a float64 CPU reference to 1e-5 (float32), with duplicate ids, padding and Zipf ids, for every ownership
  scheme; one compile over the steps; no host fallback; table and slot shardings unchanged.
* A capacity too small: the dropped ids are counted exactly per (source, destination) and nothing is updated.
* The step's collectives, from the optimized HLO: three all-to-alls plus small all-reduces, the same bytes per
  device at n = 2 and n = 4 (a fixed per-device batch and n·capacity), and no table-sized copy.

In process on 4 devices; other device counts and HLO dumps run _exchange_script.py in subprocesses.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

torch_xla = pytest.importorskip("torch_xla")
import torch_xla.distributed.spmd as xs  # noqa: E402
import torch_xla.runtime as xr  # noqa: E402

if not xr.is_spmd():  # once per process: a second call warns (XLA_USE_SPMD is set by the first)
    xr.use_spmd()
sys.path.insert(0, str(Path(__file__).parent))
import _exchange_script as script  # noqa: E402

from torch_tpu_embedding.xla.exchange import (  # noqa: E402
    exchange_grad,
    exchange_lookup,
    largest_load,
    route_ids,
    total_overflow,
)
from torch_tpu_embedding.xla.hlo import collectives, large_copies, step_hlo_path  # noqa: E402
from torch_tpu_embedding.xla.manual import all_reduce, shard_local  # noqa: E402
from torch_tpu_embedding.xla.ownership import RowOwnership  # noqa: E402

ROOT = Path(__file__).parents[2]
N = 4
MESH = xs.Mesh(np.arange(N), (N,), ("x",))
DEV = torch_xla.device()


def check_training(r: dict[str, Any], n: int, fresh: bool = True) -> None:
    """``fresh``: a new process (exactly one compile); in process an earlier test may have compiled the graph."""
    spec = "{devices=[%d,1]%s}" % (n, ",".join(map(str, range(n))))
    assert r["n"] == n
    first = r["compiles"][0]
    assert (first == 1 if fresh else first <= 1) and r["compiles"] == [first] * len(r["compiles"]), r["compiles"]
    assert r["fallbacks"] == []
    assert r["before"] == r["after"] == [spec] * 3  # table, m, v keep their row sharding
    assert r["overflow"] == r["expected_overflow"]
    assert not np.any(r["overflow"])
    assert r["largest_load"] == r["expected_largest_load"]
    for k, err in r["err"].items():
        assert err <= 1e-5 * max(1.0, r["scale"].get(k, 1.0)), (k, err, r["scale"])
    assert r["changed"]["w"] > 1e-3  # the steps did train


def test_routing_and_rows_back_value_by_value() -> None:
    """4 devices × 6 ids over 64 rows (16 per shard), duplicates and padding (-1 and 64)."""
    own = RowOwnership("mod", 64, N)
    ids = torch.tensor([[5, 5, 9, -1, 12, 5],      # device 0: 5 twice more, padding
                        [0, 4, 8, 12, 64, 64],     # four ids of shard 0 (id % 4 == 0) + padding
                        [63, 62, 61, 60, 63, 62],
                        [1, 2, 3, 1, 2, 3]])
    table = (torch.arange(64 * 2, dtype=torch.float32).reshape(64, 2) + 1)
    phys = table[own.logical_id(torch.arange(64))]  # stored in the scheme's physical order
    t_x, ids_x = phys.to(DEV), ids.to(DEV)
    xs.mark_sharding(t_x, MESH, ("x", None))
    xs.mark_sharding(ids_x, MESH, ("x", None))
    cap = 3
    rows, routing = exchange_lookup(t_x, ids_x, own, cap, MESH)
    grad = torch.arange(N * 6 * 2, dtype=torch.float32).reshape(N, 6, 2) + 1
    local_ids, local_rows = exchange_grad(grad.to(DEV), routing)
    torch_xla.sync()
    send, load, over = routing.send.cpu(), routing.load.cpu(), routing.overflow.cpu()
    rows, local_ids, local_rows = rows.cpu(), local_ids.cpu(), local_rows.cpu()
    assert int(largest_load(routing).cpu()) == 4 and int(total_overflow(routing).cpu()) == 1
    exp_rows = torch.zeros(N, 6, 2)
    for s in range(N):
        valid = ids[s][(ids[s] >= 0) & (ids[s] < 64)]
        uniq = torch.unique(valid)
        for d in range(N):
            mine = uniq[own.owner(uniq) == d]
            assert load[s, d] == len(mine) and over[s, d] == max(len(mine) - cap, 0)
            sent = own.local_row(mine)[:cap]  # ascending local rows; the largest ones overflow
            assert send[s, d, : len(sent)].tolist() == sent.tolist()
            assert (send[s, d, len(sent):] == 16).all()  # the local sentinel R/n
        for i, x in enumerate(ids[s].tolist()):
            fits = 0 <= x < 64 and x in uniq[own.owner(uniq) == x % N][:cap].tolist()
            if fits:
                exp_rows[s, i] = table[x]
    torch.testing.assert_close(rows, exp_rows, rtol=0, atol=0)
    assert over[1, 0] == 1  # device 1: four ids for shard 0, capacity 3: 12 (local row 3) was dropped
    # Backward: owner d receives, per source, its summed gradient rows at the ids that were routed.
    got = torch.zeros(64, 2)
    for d in range(N):
        for j in range(N * cap):
            if local_ids[d, j] < 16:
                got[own.logical_id(torch.tensor(d * 16) + local_ids[d, j])] += local_rows[d, j]
            else:
                assert (local_rows[d, j] == 0).all()
    exp = torch.zeros(64, 2)
    for s in range(N):
        for i, x in enumerate(ids[s].tolist()):
            if exp_rows[s, i].any():  # routed
                exp[x] += grad[s, i]
    torch.testing.assert_close(got, exp, rtol=0, atol=0)


def test_shard_local_updates_in_place_and_all_reduces() -> None:
    """Each shard adds the column sums of all shards to its rows; outputs: global max/min, the shard's row count."""
    from torch_tpu_embedding.xla.sharding import sharding_spec

    w = torch.randn(N * 3, 2, generator=torch.Generator().manual_seed(0))
    w_x = w.to(DEV)
    xs.mark_sharding(w_x, MESH, ("x", None))
    scale = torch.tensor([2.0]).to(DEV).reshape(())
    torch_xla.sync()

    def fn(shards: list, inputs: list, rep: list) -> tuple[list, list]:
        (t,), (k,) = shards, rep
        top, low = all_reduce(t.max(), MESH, op="max"), all_reduce(t.min(), MESH, op="min")
        return [t + k * all_reduce(t.sum(0), MESH)], [top, low, torch.tensor(t.shape[0], device=t.device)]

    top, low, rows = shard_local(fn, [w_x], [], [scale], mesh=MESH)
    torch_xla.sync()
    torch.testing.assert_close(w_x.cpu(), w + 2 * w.sum(0))
    assert top.cpu().tolist() == [w.max().item()] * N and low.cpu().tolist() == [w.min().item()] * N
    assert rows.cpu().tolist() == [3] * N
    assert sharding_spec(w_x) == "{devices=[4,1]0,1,2,3}"
    with pytest.raises(ValueError, match=r"fn returned a shard \(2, 2\)"):
        shard_local(lambda s, i, r: ([s[0][:2]], []), [w_x], mesh=MESH)
    with pytest.raises(ValueError, match=r"Argument `op` must be one of"):
        all_reduce(scale, MESH, op="mean")


def test_route_ids_rejects_a_wrong_layout() -> None:
    own = RowOwnership("range", 64, N)
    with pytest.raises(ValueError, match=r"ids must be \[n, N\] with n = 4"):
        route_ids(torch.zeros(2, 6, dtype=torch.int64, device=DEV), own, 3, MESH)


@pytest.mark.parametrize(("scheme", "dist"), [("interleaved", "zipf"), ("interleaved", "uniform"),
                                              ("mod", "zipf"), ("range", "uniform")])
def test_training_steps_equal_float64_reference(scheme: str, dist: str) -> None:
    r = script.run({**script.DEFAULTS, "scheme": scheme, "dist": dist})
    check_training(r, N, fresh=False)


def test_overflow_is_counted_exactly_and_nothing_is_updated() -> None:
    r = script.run({**script.DEFAULTS, "scheme": "interleaved", "dist": "uniform", "capacity": 4, "steps": 2})
    assert r["overflow"] == r["expected_overflow"]
    assert all(np.sum(o) > 0 for o in r["overflow"])  # ids were dropped in every step...
    assert r["largest_load"] == r["expected_largest_load"]
    assert r["changed"] == {"w": 0.0, "m": 0.0, "v": 0.0}  # ...so the table and slots did not move
    assert r["compiles"][0] <= 1 and r["compiles"][0] == r["compiles"][1] and r["fallbacks"] == []


@cache
def subprocess_run(n: int, dump: str) -> dict[str, Any]:
    env = {**os.environ, "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": str(n),
           "XLA_FLAGS": f"--xla_dump_to={dump} --xla_dump_hlo_as_text"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.pop("XLA_USE_SPMD", None)  # the child calls use_spmd() itself
    out = subprocess.run([sys.executable, str(Path(script.__file__)), json.dumps({"steps": 3})], env=env,
                         check=True, capture_output=True, text=True, timeout=600)
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    result["hlo"] = Path(step_hlo_path(dump)).read_text()
    return result


@pytest.fixture(scope="module")
def dumps(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return lambda n: subprocess_run(n, str(tmp_path_factory.getbasetemp() / f"exchange_dump_{n}"))


@pytest.mark.parametrize("n", [2, 8])
def test_training_steps_on_2_and_8_devices(n: int, dumps: Any) -> None:
    check_training(dumps(n), n)


def test_step_collectives_are_all_to_alls_and_flat_in_the_device_count(dumps: Any) -> None:
    cfg = script.DEFAULTS
    per_device = {}
    for n in (2, 4):
        r = dumps(n)
        check_training(r, n)
        ops = collectives(r["hlo"])
        a2a = [c for c in ops if c[0] == "all-to-all"]
        assert len(a2a) == 3, ops  # ids out, rows back, gradient rows out
        for op, shapes, size in ops:
            assert op in ("all-to-all", "all-reduce"), ops
            if op == "all-reduce":  # the overflow gate, the largest load, a [D] column sum
                assert size <= cfg["D"] * 8, (op, shapes)
        slots = cfg["total_slots"]  # n · capacity: fixed
        assert sorted(s for _, _, s in a2a) == sorted([slots * 4, slots * cfg["D"] * 4, slots * cfg["D"] * 4])
        # No copy of a table shard: the donated table and slots keep distinct sizes and stay in place.
        assert large_copies(r["hlo"], cfg["V"] // n // 2) == []
        per_device[n] = sorted((op, size) for op, _, size in ops)
    assert per_device[2] == per_device[4]
