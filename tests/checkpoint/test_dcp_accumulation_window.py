"""``tte.checkpoint.load_distributed`` refuses a table's pending accumulation buffer whose call count is not the
loaded group's ``gradient_accumulation_steps`` (as ``optimizer.load_state_dict`` does, commit 64efa11).

Before, a ``tte_meta.pt`` whose group said k = 4 while the buffers held 2 calls loaded, and the next step raised
``IndexError: index 3 is out of bounds for dimension 0 with size 2``; one saying k = 2 over 4 calls loaded and
added the 2 stale calls to every later window (0.105 off the run that never stopped)."""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pytest
import torch
from suite_helpers import same_tree

import torch_tpu_embedding as tte
from torch_tpu_embedding.checkpoint import CheckpointMismatchError
from torch_tpu_embedding.checkpoint import publish as ckpt_publish

ROWS, D, LR = {"a": 7, "b": 5}, 3, 0.1


def _model(stack: bool) -> tte.EmbeddingCollection:
    torch.manual_seed(0)
    feats = {f"f{t}": tte.FeatureConfig(tte.TableConfig(n, D, name=t, dtype=torch.float64)) for t, n in ROWS.items()}
    return tte.EmbeddingCollection(feats, stack_tables=stack)


def _batch(s: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Per table: the call's ids and the gradient of each looked-up row (a linear loss: the gradients do not
    depend on the weights, so the float64 numpy reference needs no forward)."""
    g = torch.Generator().manual_seed(50 + s)
    return {t: (torch.randint(0, n, (4,), generator=g), torch.randn(4, D, generator=g, dtype=torch.float64))
            for t, n in ROWS.items()}


def _call(ec: tte.EmbeddingCollection, opt: torch.optim.Optimizer, s: int) -> None:
    batch = _batch(s)
    out = ec({f"f{t}": ids for t, (ids, _) in batch.items()})
    sum((out[f"f{t}"] * g).sum() for t, (_, g) in batch.items()).backward()
    opt.step()
    opt.zero_grad()


def _reference(w: dict[str, np.ndarray], k: int, calls: range) -> dict[str, np.ndarray]:
    """Keras-style accumulation in float64 numpy: each full window of ``k`` calls applies lr * mean gradient."""
    w = {t: v.copy() for t, v in w.items()}
    acc = {t: np.zeros_like(v) for t, v in w.items()}
    for i, s in enumerate(calls, start=1):
        for t, (ids, g) in _batch(s).items():
            np.add.at(acc[t], ids.numpy(), g.numpy())
        if i % k == 0:
            w = {t: w[t] - LR * acc[t] / k for t in w}
            acc = {t: np.zeros_like(v) for t, v in w.items()}
    return w


def _weights(ec: tte.EmbeddingCollection) -> dict[str, np.ndarray]:
    return {t: ec.tables[t].weight.detach().numpy().copy() for t in ROWS}


@pytest.mark.parametrize("stack", [False, True], ids=["unstacked", "stacked"])
@pytest.mark.parametrize("saved, edited", [(2, 4), (4, 2)])
def test_a_pending_buffer_of_another_window_length_is_refused(tmp_path: Path, saved: int, edited: int,
                                                              stack: bool) -> None:
    ec = _model(stack)
    w0 = _weights(ec)
    opt = tte.optim.SGD(ec.parameters(), lr=LR, gradient_accumulation_steps=saved)
    for s in range(saved + 1):  # one call into the second window: a pending buffer of `saved` calls
        _call(ec, opt, s)
    good, bad = tmp_path / "good", tmp_path / "bad"
    tte.checkpoint.save_distributed(good, model=ec, optimizer=opt)
    tte.checkpoint.save_distributed(bad, model=ec, optimizer=opt)
    meta = torch.load(bad / "tte_meta.pt", weights_only=True)
    meta["optimizer"]["param_groups"][0]["gradient_accumulation_steps"] = edited
    torch.save(meta, bad / "tte_meta.pt")
    ckpt_publish.write_manifest(str(bad))  # edited by hand and sealed again: the meta's own checks must refuse it

    other = _model(stack)
    other_opt = tte.optim.SGD(other.parameters(), lr=LR, gradient_accumulation_steps=edited)
    _call(other, other_opt, 99)  # a pending buffer of its own, which a failed load must keep
    before = copy.deepcopy((other.state_dict(), other_opt.state_dict()))
    names = "table:a, table:b \\(stacked together\\)" if stack else "table:a"
    with pytest.raises(CheckpointMismatchError, match=f"nothing was loaded.*{names}: pending accumulation buffers "
                                                      f"hold {saved} calls, but the group's "
                                                      f"`gradient_accumulation_steps` is {edited}"):
        tte.checkpoint.load_distributed(bad, model=other, optimizer=other_opt)
    assert same_tree(before, (other.state_dict(), other_opt.state_dict()))

    # The checkpoint as saved loads into the optimizer built with another k: the saved k wins, and the window
    # goes on as the float64 numpy reference of the run that never stopped.
    tte.checkpoint.load_distributed(good, model=other, optimizer=other_opt)
    assert other_opt.param_groups[0]["gradient_accumulation_steps"] == saved
    for s in range(saved + 1, 3 * saved):
        _call(other, other_opt, s)
    want = _reference(w0, saved, range(3 * saved))
    for t in ROWS:
        np.testing.assert_allclose(other.tables[t].weight.detach().numpy(), want[t], rtol=1e-13, atol=1e-13)
