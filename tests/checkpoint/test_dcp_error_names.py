"""A ``save_distributed`` directory refused by a model stacked as it was saved (the in-place path) names the stacked
group's tables, the names the user gave: before, the message named the group alone ("missing
['optim/table:fused_0/accumulators']; unexpected ['optim/table:fused_0/momenta', ...]"), a name of the library's.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import torch_tpu_embedding as tte


def _model(dim_c: int = 3) -> tte.EmbeddingCollection:
    torch.manual_seed(0)
    a, b = tte.TableConfig(10, 4, name="a"), tte.TableConfig(7, 4, name="b")  # stacked (one group)
    c = tte.TableConfig(5, dim_c, name="c")
    return tte.EmbeddingCollection({"fa": tte.FeatureConfig(a), "fb": tte.FeatureConfig(b), "fc": tte.FeatureConfig(c)})


def test_a_refused_in_place_load_names_the_stacked_tables(tmp_path: Path) -> None:
    source = _model()
    opt = tte.optim.Adam(source.parameters(), lr=0.1)
    opt.init_state()
    tte.checkpoint.save_distributed(tmp_path / "ck", model=source, optimizer=opt)
    model = _model()
    other = tte.optim.Adagrad(model.parameters(), lr=0.1)
    with pytest.raises(tte.checkpoint.CheckpointMismatchError) as e:
        tte.checkpoint.load_distributed(tmp_path / "ck", model=model, optimizer=other)
    msg = str(e.value)
    assert re.search(r"missing \[\"optimizer slot 'accumulators' of table:c\", \"optimizer slot 'accumulators' of "
                     r"table:fused_\d \(stacked tables `a`, `b`\)\"\]", msg), msg
    assert re.search(r"unexpected \[.*\"optimizer slot 'momenta' of table:fused_\d \(stacked tables `a`, `b`\)\"", msg), msg
    assert "saved by optimizer 'adam', loading into 'adagrad'" in msg, msg
    assert "optim/" not in msg, msg
