"""Where data parallel's per-step agreement reduces its numbers (``distributed/step_agreement.py``): on the host
wherever the process group has a CPU backend, so that a CUDA or XLA step's read of it waits for no device.

The backend strings are ``torch.distributed.get_backend_config``'s, checked against a live gloo group here.
"""

from __future__ import annotations

import socket

import pytest
import torch
import torch.distributed as dist

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
