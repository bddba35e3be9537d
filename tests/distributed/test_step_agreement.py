"""Where data parallel's per-step agreement reduces its numbers (``distributed/step_agreement.py``): on the host
wherever the process group has a CPU backend, so that a CUDA or XLA step's read of it waits for no device.

The backend strings are ``torch.distributed.get_backend_config``'s, checked against a live gloo group here.
"""

from __future__ import annotations

import gc
import socket

import pytest
import torch
import torch.distributed as dist

from torch_tpu_embedding.distributed import grad_sync
from torch_tpu_embedding.distributed.step_agreement import agreement_device

CUDA, XLA, CPU = torch.device("cuda", 1), torch.device("xla", 0), torch.device("cpu")


@pytest.mark.parametrize(("backend", "device", "where"), [
    ("cpu:gloo,cuda:gloo", CUDA, CPU),  # init_process_group("gloo")
    ("cpu:gloo,cuda:nccl", CUDA, CPU),  # init_process_group(), torch's default with CUDA
    ("cuda:nccl,cpu:gloo", CUDA, CPU),
    ("CPU:GLOO, CUDA:NCCL", CUDA, CPU),
    ("gloo", CUDA, CPU),
    ("mpi", CUDA, CPU),
    ("cuda:nccl", CUDA, CUDA),  # init_process_group("nccl"): no host collectives
    ("xla:xla", XLA, XLA),  # torch_xla's backend
    ("cpu:gloo,cuda:gloo", CPU, CPU),
])
def test_the_agreement_is_reduced_on_the_host_where_the_group_can(backend: str, device: torch.device,
                                                                 where: torch.device) -> None:
    assert agreement_device(backend, device) == where


def test_a_gloo_group_names_its_cpu_backend() -> None:
    """The string the agreement reads is what a live group reports (one process, gloo)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        config = dist.get_backend_config()
        assert agreement_device(config, CUDA) == CPU, config
    finally:
        dist.destroy_process_group()


def test_the_descriptions_of_exchanges_stay_bounded() -> None:
    """Data parallel's tags follow its input shapes (a new text per distinct set of id shapes): a run whose batch
    shapes keep changing keeps at most ``_DESCRIBED_MAX`` descriptions, the newest still named in errors."""
    from torch_tpu_embedding.distributed import exchange

    before = dict(exchange._DESCRIBED)
    try:
        tags = [exchange._tag("data_parallel", f"`t` with ids of shapes [{n}, 1]", True)
                for n in range(exchange._DESCRIBED_MAX + 50)]
        assert len(exchange._DESCRIBED) <= exchange._DESCRIBED_MAX
        assert "[4145, 1]" in exchange._DESCRIBED[tags[-1]]
    finally:
        exchange._DESCRIBED.clear()
        exchange._DESCRIBED.update(before)


def test_the_shapes_text_is_spelled_once_per_input_structure() -> None:
    """A steady loop's forwards repeat one set of id shapes: its text is made once, not per forward."""
    from torch_tpu_embedding.distributed.step_agreement import _with_shapes

    _with_shapes.cache_clear()
    shapes = tuple((4096, 1) for _ in range(100))
    texts = {id(_with_shapes("`t`", shapes)) for _ in range(5)}
    assert len(texts) == 1 and _with_shapes.cache_info().hits == 4
    assert _with_shapes("`t`", ((2, 3),)) == "`t` with ids of shapes [2, 3]"


def _unfinished_step(group: object) -> int:
    """A training forward of ``group``'s data-parallel tables whose backward and step() never ran (an exception in
    the loss), and the static route's size check of its exchange; returns the forwards counted for ``group``."""
    n = grad_sync.count_forward(group)
    grad_sync._check_equal_sizes([3], group, 1, CPU)
    return n


def test_a_destroyed_group_leaves_no_state(group_of_one: None) -> None:
    """The count of an unfinished forward and the sizes checked belong to the group object: once groups are
    destroyed and collected, nothing is kept that a group made later at one of their addresses could inherit.
    (Keyed by ``id(group)``, 20 groups destroyed left 10-15 entries, and a new group made at a destroyed one's
    address counted its first forward as the 2nd to 8th: the ranks' counts then differ and the agreement raises.)"""
    for _ in range(20):
        g = dist.new_group([0])
        assert _unfinished_step(g) == 1
        dist.destroy_process_group(g)
        del g
    gc.collect()
    assert len(grad_sync._FORWARDS) == 0
    assert len(grad_sync._CHECKED_SIZES) == 0


def test_an_object_at_a_dead_groups_address_starts_afresh(group_of_one: None, monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    """CPython gives a new object the address of one just freed: the new group's first forward counts 1, and its
    exchange's sizes are checked (a gather on every rank), not trusted from the dead group's check."""

    class Group:  # (a stand-in: it lands at a freed address at once, mostly; real groups after tens of tries)
        pass

    gathers: list[int] = []
    gather = grad_sync._gather
    monkeypatch.setattr(grad_sync, "_gather", lambda flat, group, world: gathers.append(1) or gather(
        flat, dist.group.WORLD, world))
    for attempt in range(50):  # (an allocation in between can take the freed address: then try again)
        g = Group()
        assert _unfinished_step(g) == 1 and len(gathers) == 2 * attempt + 1
        old = id(g)
        del g
        h = Group()
        assert _unfinished_step(h) == 1 and len(gathers) == 2 * attempt + 2
        if id(h) == old:
            break
    assert id(h) == old  # the premise: some new object was where the old one had been
