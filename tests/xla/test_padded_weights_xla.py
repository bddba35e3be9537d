"""``Padded`` weights where the mask holds no id, on one XLA device: host bags (checked on the host) and bags on
the device (counted there) are looked up alike, as a float64 numpy reference of the combiners says (forward and
the rows after one SGD step); tests/modules/test_padded_weights_at_padding.py is the eager CPU case."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

torch_xla = pytest.importorskip("torch_xla")

from test_padded_weights_at_padding import (  # noqa: E402
    BAGS,
    TABLE_OF,
    VOCAB,
    D,
    _collection,
    _padded,
    _reference,
    _rows,
)

import torch_tpu_embedding as tte  # noqa: E402

assert os.environ.get("PJRT_DEVICE"), "run the XLA tests with PJRT_DEVICE=CPU"
DEV = torch_xla.device()


@pytest.mark.parametrize("resident", [False, True], ids=["host-bags", "device-bags"])
@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
def test_weights_at_padding_are_no_weights_on_xla(combiner: str, resident: bool) -> None:
    ec = _collection(combiner, True).to(DEV)
    feats = {f: _padded(f, float("nan"), torch.float32) for f in BAGS}
    if resident:
        feats = {f: tte.Padded(p.ids.to(DEV), p.mask.to(DEV), p.weights.to(DEV)) for f, p in feats.items()}
    out = ec(feats)
    rng = np.random.default_rng(0)
    grads = {f: rng.standard_normal((len(BAGS[f]), D)) for f in BAGS}
    expected = {n: _rows(n) for n in VOCAB}
    for f in BAGS:
        ref, gains = _reference(f, combiner)
        np.testing.assert_allclose(out[f].detach().cpu().double().numpy(), ref, rtol=1e-6, atol=1e-6)
        for i, b, g in gains:
            expected[TABLE_OF[f]][i] -= g * grads[f][b]
    sum((out[f] * torch.tensor(grads[f], dtype=out[f].dtype, device=DEV)).sum() for f in BAGS).backward()
    tte.optim.SGD(ec.parameters(), lr=1.0).step()
    for n in VOCAB:
        np.testing.assert_allclose(ec.embedding_tables[n].detach().cpu().double().numpy(), expected[n], rtol=1e-6,
                                   atol=1e-6)
    ec.check_ids()  # nothing counted: no id's weight was bad
