"""What ``tte.xla.shard``, ``shard_batch`` and ``replicate`` refuse: errors name the argument, the value and the
user's tables (never a stacked group's internal name), and a refused call changes nothing. Run in its own process: PJRT_DEVICE=CPU CPU_NUM_DEVICES=4.
"""

from __future__ import annotations

import pytest
import torch

torch_xla = pytest.importorskip("torch_xla")
import torch_xla.runtime as xr  # noqa: E402

if not xr.is_spmd():  # once per process: a second call warns (XLA_USE_SPMD is set by the first)
    xr.use_spmd()  # before any XLA tensor exists
import torch_tpu_embedding as tte  # noqa: E402
from torch_tpu_embedding.xla import device_mesh, replicate, shard, shard_batch, sharding_spec  # noqa: E402


def test_a_column_table_too_narrow_is_named_and_nothing_is_laid_out() -> None:
    """Two column tables 6 wide stack into one group; 6 does not split over 4 devices. The error names both
    tables (not the group), and the row table laid out before the group keeps its rows and has no sharding."""
    big = tte.TableConfig(1001, 8, name="big", placement="row")
    user = tte.TableConfig(100, 6, name="user", placement="column")
    item = tte.TableConfig(50, 6, name="item", placement="column")
    ec = tte.EmbeddingCollection({"b": tte.FeatureConfig(big), "u": tte.FeatureConfig(user),
                                  "i": tte.FeatureConfig(item)}, device=torch_xla.device())
    groups = ec.stacked_members()
    assert list(groups.values()) == [(("item", 0, 50), ("user", 50, 100))]  # `big` is a table of its own
    weights = {n: t.weight for n, t in ec.physical_tables().items()}
    with pytest.raises(ValueError, match="embedding_dim divisible by the 4 devices") as err:
        shard(ec, device_mesh())
    message = str(err.value)
    assert "Table `item`" in message and "Table `user`" in message and "embedding_dim=6" in message, message
    assert list(groups)[0] not in message, message  # the group's name is ours, not the user's
    assert {n: t.weight for n, t in ec.physical_tables().items()} == weights  # no parameter replaced
    assert tuple(ec.tables.big.weight.shape) == (1001, 8) and sharding_spec(ec.tables.big.weight) == ""
    assert ec.tables.big.row_layout is None


def test_a_stacked_group_on_the_cpu_is_named_by_its_tables() -> None:
    user = tte.TableConfig(100, 8, name="user", placement="row")
    item = tte.TableConfig(50, 8, name="item", placement="row")
    ec = tte.EmbeddingCollection({"u": tte.FeatureConfig(user), "i": tte.FeatureConfig(item)})
    (group,) = ec.stacked_members()
    with pytest.raises(ValueError, match="move the collection to the XLA device") as err:
        shard(ec, device_mesh())
    assert "`item`, `user`" in str(err.value) and group not in str(err.value), str(err.value)


def test_shard_batch_and_replicate_name_what_is_wrong() -> None:
    """A batch or a dense module left on the CPU, a 0-d batch, an unknown axis, a mesh that is not one: each
    refused naming the argument and the value (before: torch_xla's 'Expected XLA tensor. Got:
    torch.FloatTensor', an AssertionError on the partition spec, an AttributeError on a str)."""
    dev = torch_xla.device()
    with pytest.raises(ValueError, match=r"Argument `x` of shard_batch must be .* on the XLA device.*2-d tensor on cpu"):
        shard_batch(torch.ones(8, 2))
    with pytest.raises(ValueError, match=r"Argument `x` of shard_batch must be a tensor with a batch dimension"):
        shard_batch(torch.tensor(1.0).to(dev))
    with pytest.raises(ValueError, match=r"Argument `axis` must be one of the mesh axes \('x',\). Received: 'y'"):
        shard_batch(torch.ones(8, 2).to(dev), axis="y")
    tower = torch.nn.Sequential(torch.nn.Linear(4, 4).to(dev), torch.nn.Linear(4, 1))  # the second left behind
    with pytest.raises(ValueError, match=r"Argument `params` of replicate .* Received: \"parameter '1.weight' on cpu\""):
        replicate(tower)
    assert sharding_spec(tower[0].weight) == ""  # nothing marked by the refused call
    with pytest.raises(ValueError, match=r"Argument `mesh` must be a torch_xla.distributed.spmd.Mesh.*Received: 'x'"):
        shard(tte.EmbeddingCollection({"f": tte.FeatureConfig(tte.TableConfig(8, 4, name="t"))}, device=dev), "x")


@pytest.mark.parametrize("stack", [False, True], ids=["own", "stacked"])
def test_no_dedup_on_a_row_sharded_table_is_refused_naming_the_tables(stack: bool) -> None:
    """Through the id exchange each device sums its duplicate ids before they travel, so
    ``use_gradient_accumulation=False`` cannot update from every duplicate as one device does: it trained on
    per-device sums (other weights than on one device, and than with the default). Refused at ``step()`` as
    over a process group, naming the user's tables; SGD without options that need summed rows is exact and runs."""
    def model() -> tte.EmbeddingCollection:
        t = tte.TableConfig(8, 4, name="t", combiner="sum", placement="row", initializer=torch.nn.init.ones_)
        u = tte.TableConfig(8, 4, name="u", combiner="sum", placement="row", initializer=torch.nn.init.ones_)
        ec = tte.EmbeddingCollection({"f": tte.FeatureConfig(t), "g": tte.FeatureConfig(u)},
                                     device=torch_xla.device(), stack_tables=stack)
        shard(ec, device_mesh())
        return ec

    for make, refused in ((lambda ps: tte.optim.Adagrad(ps, lr=0.5, use_gradient_accumulation=False), True),
                          (lambda ps: tte.optim.SGD(ps, lr=0.5, use_gradient_accumulation=False), False)):
        ec = model()
        opt = make(ec.parameters())
        ids = tte.Jagged(torch.tensor([1, 1, 1, 2, 1, 3, 1, 2]), lengths=torch.tensor([3, 1, 2, 2]))
        out = ec({"f": ids, "g": torch.tensor([0, 0, 5, 0])})
        (out["f"] + out["g"]).sum().backward()
        if not refused:
            opt.step()
            torch_xla.sync()
            w = ec.state_dict()["tables.t.weight"].cpu()
            assert torch.equal(w[1], torch.full((4,), 1.0 - 0.5 * 5)) and torch.equal(w[0], torch.ones(4))
            continue
        with pytest.raises(ValueError, match=r"use_gradient_accumulation=False.*cannot be applied") as err:
            opt.step()
        message = str(err.value)
        assert "'t'" in message and ("'u'" in message) == stack, message
        assert "Received: use_gradient_accumulation=False" in message
