"""Data parallel's exchange routes (torch_tpu_embedding.distributed.grad_sync.static_route): on an accelerator
the row gradients are exchanged at static sizes, with no host read once a shape has been checked; on the CPU
each rank sums its duplicates first and the ranks' row counts are read every step.

Both routes run on 2 gloo CPU processes (tests/_dp_route_worker.py; the static one forced by emptying
``DEDUP_DEVICE_TYPES``) and must give the same training as each other and as one process on the global
batch (float64 ≤ 1e-10), while the static route reads the host in its first exchange only.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import _dp_route_worker as R
import _dp_worker as W
import pytest
import torch
from suite_helpers import free_port, start_ranks
from test_data_parallel import assert_close, assert_replicas_equal

from torch_tpu_embedding._rows.row_grad import RowGrad
from torch_tpu_embedding.distributed import grad_sync

WORLD = 2
_RUN: list[list[dict[str, Any]]] = []


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """Every rank's results of one spawn (tests/_dp_route_worker.py)."""
    if not _RUN:
        out: Path = tmp_path_factory.mktemp("route")
        start_ranks(R.worker, (WORLD, free_port(), str(out)), WORLD)
        _RUN.append([torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(WORLD)])
    return _RUN[0]


def test_accelerators_take_the_static_route() -> None:
    """The policy: static on every device but the CPU, unless a table's rows came from jagged bags (their count
    follows each rank's data) on an eager device; XLA is static always."""
    route = grad_sync.static_route
    assert route(torch.device("cuda", 0)) and route(torch.device("xla", 0)) and route(torch.device("meta"))
    assert not route(torch.device("cpu"))
    assert not route(torch.device("cuda", 0), variable_rows=True)
    assert not route(torch.device("cpu"), variable_rows=True)
    assert route(torch.device("xla", 0), variable_rows=True)


@pytest.mark.parametrize("name", R.NAMES)
def test_static_route_trains_as_the_dedup_route_and_one_process(name: str, ranks: list[dict[str, Any]]) -> None:
    """Model, every slot and the dense head: the ranks bitwise equal, each route equal to one process on the
    global batch, and the two routes equal to each other."""
    for route in ("dedup", "static"):
        assert_replicas_equal([r[f"{route}/{name}"] for r in ranks])
        assert_close(ranks[0][f"{route}/{name}"], W.reference(name, torch.float64), 1e-10)
    assert_close(ranks[0][f"static/{name}"], ranks[0][f"dedup/{name}"], 1e-10)


@pytest.mark.parametrize("name", R.NAMES)
def test_static_route_reads_the_host_in_its_first_exchange_only(name: str, ranks: list[dict[str, Any]]) -> None:
    """The static route checks the sizes once (a host read) and never reads again while they repeat: no
    ``_local_scalar_dense`` and no ``tolist()``; the counted route reads every step (so the count can fail)."""
    for r in ranks:
        static, dedup = r[f"static/{name}/reads"], r[f"dedup/{name}/reads"]
        assert len(static) == len(dedup) == W.STEPS
        assert static[0][0] >= 1 and static[1:] == [(0, 0)] * (W.STEPS - 1), static
        assert all(sum(reads) >= 1 for reads in dedup), dedup
        # every step: the step's agreement (a host tensor where the group reduces on the host: a rank still at a
        # training forward raises there) and the ranks' row counts
        assert all(lists == 2 for _, lists in dedup), dedup


@pytest.mark.parametrize("name", R.NAMES)
def test_a_cuda_ranks_step_trains_as_one_process(name: str, ranks: list[dict[str, Any]]) -> None:
    """What a CUDA rank runs, on the CPU: the static route (padding sent as it is) and the optimizer's sync-free
    path (the exchanged sentinel entries kept as a tail and written through the sink row): the ranks bitwise
    equal, equal to one process on the global batch, and reading the host in the first exchange only."""
    assert_replicas_equal([r[f"accelerator/{name}"] for r in ranks])
    assert_close(ranks[0][f"accelerator/{name}"], W.reference(name, torch.float64), 1e-10)
    for r in ranks:
        reads = r[f"accelerator/{name}/reads"]
        assert len(reads) == W.STEPS and reads[1:] == [(0, 0)] * (W.STEPS - 1), reads


def test_jagged_bags_are_counted_on_any_eager_device(ranks: list[dict[str, Any]]) -> None:
    """Jagged bags give each rank as many rows as its ids (different here): even with the static route forced
    on the CPU they are exchanged by count, and train as one process on the global batch (padded)."""
    assert_replicas_equal([r["jagged"] for r in ranks])
    assert_close(ranks[0]["jagged"], W.reference("adagrad", torch.float64), 1e-10)
    assert all(lists == 2 for r in ranks for _, lists in r["jagged/reads"])  # the agreement and the counts, every step


@pytest.mark.parametrize("factored", [False, True])
def test_the_counted_route_sends_each_distinct_id_once_on_an_accelerator(factored: bool) -> None:
    """With "cuda" added to ``DEDUP_DEVICE_TYPES`` a CUDA rank takes the counted route, which sends each distinct
    id once with its summed row and no padding (``U`` rows), as the CPU's: not the ``N`` entries of the
    accelerator's static duplicate sum with its sentinel tail. A CUDA rank stood in for by the CPU with
    ``HOST_READ_DEVICE_TYPES`` emptied (its sync-free step), the CPU's own counted route the reference
    (bitwise: the same sums); ``factored``: an SGD gradient kept factored (summed piece by piece)."""
    sentinel, world = 9, 2
    p = torch.zeros(sentinel, 3, dtype=torch.float64)
    ids = torch.tensor([4, 1, sentinel, 4, 8, sentinel, 1, 0])
    rows = torch.arange(24, dtype=torch.float64).view(8, 3) * torch.tensor([[1.0], [2.0], [0.0], [3.0], [1.0],
                                                                            [0.0], [5.0], [1.0]])

    def sent() -> tuple[torch.Tensor, torch.Tensor]:
        rg = RowGrad()
        rg.add(ids, rows)
        rg.keep_factored = factored
        out = grad_sync._local_rows(p, rg, world, dedup=True, static=False)
        assert out is not None
        return out

    cpu_ids, cpu_rows = sent()
    with R.sync_free_step(True):
        acc_ids, acc_rows = sent()
    assert cpu_ids.tolist() == [0, 1, 4, 8]
    assert torch.equal(acc_ids, cpu_ids) and torch.equal(acc_rows, cpu_rows), (acc_ids, acc_rows)
