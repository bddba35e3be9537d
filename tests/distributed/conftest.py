"""Fixtures of the process-group tests run in one process."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch.distributed as dist


@pytest.fixture
def group_of_one(tmp_path: Path) -> Iterator[None]:
    """A gloo process group of one rank (this process) for the test's duration."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
