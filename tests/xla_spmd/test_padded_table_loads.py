"""``load_state_dict`` into a table padded for the mesh (``tte.xla.shard``) checks the shape the CPU checks,
``[num_embeddings, D]``, not the padded weight's. Run in its own process: PJRT_DEVICE=CPU CPU_NUM_DEVICES=4.
"""

from __future__ import annotations

import pytest
import torch

torch_xla = pytest.importorskip("torch_xla")
import torch_xla.runtime as xr  # noqa: E402

if not xr.is_spmd():  # once per process: a second call warns (XLA_USE_SPMD is set by the first)
    xr.use_spmd()  # before any XLA tensor exists
import torch_tpu_embedding as tte  # noqa: E402
from torch_tpu_embedding.xla import device_mesh, shard, sharding_spec  # noqa: E402


@pytest.mark.parametrize("placement", ["row", "column", "replicated"])
def test_a_tensor_of_the_padded_row_count_is_refused_as_on_the_cpu(placement: str) -> None:
    """1,001 rows padded to 1,024: a [1024, 8] tensor (another vocabulary) was loaded without an error, its rows
    taken as stored (for a row-sharded table the interleaved order of the exchange: row 5 got another row's
    values); a [1000, 8] one was refused naming the padded shape (1024, 8), which the user never made."""
    torch.manual_seed(0)
    ec = tte.EmbeddingCollection({
        "f": tte.FeatureConfig(tte.TableConfig(1001, 8, name="user", placement=placement)),
        "g": tte.FeatureConfig(tte.TableConfig(40, 4, name="item", placement=placement)),
    }, device=torch_xla.device(), stack_tables=False)
    shard(ec, device_mesh())
    weight = ec.tables.user.weight
    assert weight.shape[0] == 1024
    before, spec = ec.state_dict()["tables.user.weight"].cpu().clone(), sharding_spec(weight)
    for rows in (1024, 1000):
        given = {**ec.state_dict(), "tables.user.weight": torch.randn(rows, 8)}
        with pytest.raises(RuntimeError, match=rf"size mismatch for tables\.user\.weight: copying a param with shape "
                           rf"\({rows}, 8\) from checkpoint, the shape in current model is \(1001, 8\)\."):
            ec.load_state_dict(given)
        assert ec.tables.user.weight is weight and sharding_spec(weight) == spec
        assert torch.equal(ec.state_dict()["tables.user.weight"].cpu(), before)
    new = torch.randn(1001, 8)  # the table's own shape still loads, into the padded, permuted weight
    ec.load_state_dict({**ec.state_dict(), "tables.user.weight": new})
    assert torch.equal(ec.state_dict()["tables.user.weight"].cpu(), new) and sharding_spec(weight) == spec
