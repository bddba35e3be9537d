"""``tte.distributed.shard(model, group=...)`` on a rank outside ``group``: torch's ``new_group`` returns
``GroupMember.NON_GROUP_MEMBER`` (the int -100) there, and ``shard`` said only ``Received: 'int'``. In one process:
a group of one (gloo, the ``group_of_one`` fixture of conftest.py), given the value ``new_group`` hands the ranks it leaves out."""

from __future__ import annotations

import pytest
import torch.distributed as dist

import torch_tpu_embedding as tte


def test_a_rank_outside_the_group_is_told_so(group_of_one: None) -> None:
    ec = tte.EmbeddingCollection({"f": tte.FeatureConfig(tte.TableConfig(20, 4, name="t", placement="row"))})
    with pytest.raises(ValueError, match=r"Argument `group` must be a process group this rank belongs to: rank 0 of "
                                         r"the default group is not one of its ranks .*NON_GROUP_MEMBER.* Call "
                                         r"tte\.distributed\.shard only on the group's ranks\. Received: -100$"):
        tte.distributed.shard(ec, group=dist.GroupMember.NON_GROUP_MEMBER)
    assert tte.distributed.shard(ec) == {"t": "row"}  # refused before anything changed
