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
