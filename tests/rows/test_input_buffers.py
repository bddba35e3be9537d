"""A data loader may refill its input buffers in place before the optimizer step (gradient
accumulation over micro-batches, pinned staging buffers). The ids a backward leaves for the step must
be the library's own copy: the update must not change when the caller's tensors are overwritten."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import torch_tpu_embedding as tte

FORMS = ["dense", "padded", "padded_mask", "jagged"]


def _inputs(form: str, ids: torch.Tensor) -> Any:
    """``ids [B, 2]`` in one input form (a view or the tensor itself where the form allows)."""
    if form == "dense":
        return ids[:, 0]
    if form == "padded":
        return tte.Padded(ids)
    if form == "padded_mask":
        return tte.Padded(ids, torch.ones_like(ids, dtype=torch.bool))
    return tte.Jagged(ids.reshape(-1), lengths=torch.full((ids.shape[0],), 2))


def _train(form: str, stack: bool, make_opt: Any, reuse: bool) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    tables = [tte.TableConfig(20, 4, name=n, combiner="sum") for n in "ab"]
    ec = tte.EmbeddingCollection({n: tte.FeatureConfig(t) for n, t in zip("ab", tables, strict=True)},
                                 stack_tables=stack)
    opt = make_opt(ec.parameters())
    buffers = {n: torch.zeros(3, 2, dtype=torch.int64) for n in "ab"}
    for micro in range(3):  # three micro-batches accumulated into one step
        for i, buf in enumerate(buffers.values()):
            buf.copy_((torch.arange(6).reshape(3, 2) * (micro + 1) + i) % 20)
        feats = {n: _inputs(form, buf if reuse else buf.clone()) for n, buf in buffers.items()}
        out = ec(feats)
        (out["a"].square().sum() + 2 * out["b"].sum()).backward()
    for buf in buffers.values():  # the loader refills its buffers before the step
        buf.fill_(7)
    opt.step()
    return {k: v.clone() for k, v in ec.state_dict().items()}


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("stack", [True, False], ids=["stacked", "unstacked"])
@pytest.mark.parametrize("name", ["sgd", "adam"])
def test_refilling_the_input_buffers_before_the_step_changes_nothing(form: str, stack: bool, name: str) -> None:
    make_opt = {"sgd": lambda ps: tte.optim.SGD(ps, lr=0.5),  # keeps the bags factored until the step
                "adam": lambda ps: tte.optim.Adam(ps, lr=0.1)}[name]
    want = _train(form, stack, make_opt, reuse=False)
    got = _train(form, stack, make_opt, reuse=True)
    for k, v in want.items():
        assert torch.equal(got[k], v), k
