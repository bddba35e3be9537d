"""``placement="table"`` (a whole table on one process, tte.distributed.shard) is refused by the SPMD
placement, naming the table; the ``"auto"`` rule is the same under both transports."""

from __future__ import annotations

import pytest

pytest.importorskip("torch_xla")

import torch_tpu_embedding as tte  # noqa: E402
from torch_tpu_embedding.xla.sharding import DEFAULT_REPLICATE_BELOW_BYTES, choose_placement  # noqa: E402


def test_table_placement_is_refused_under_spmd() -> None:
    with pytest.raises(ValueError, match="Table `ids`: placement 'table'"):
        choose_placement(tte.TableConfig(10, 4, name="ids", placement="table"), 4, DEFAULT_REPLICATE_BELOW_BYTES)


@pytest.mark.parametrize("rows", [100, 20_000, 1_000_000])
@pytest.mark.parametrize("devices", [1, 2, 4])
def test_auto_is_the_same_rule_as_over_a_process_group(rows: int, devices: int) -> None:
    config = tte.TableConfig(rows, 64, name="t")
    assert tte.distributed.DEFAULT_REPLICATE_BELOW_BYTES == DEFAULT_REPLICATE_BELOW_BYTES
    assert choose_placement(config, devices, DEFAULT_REPLICATE_BELOW_BYTES) == tte.distributed.group_placement(
        "t", config, devices, DEFAULT_REPLICATE_BELOW_BYTES)
