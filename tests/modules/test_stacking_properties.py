"""Property-based (hypothesis, bounded): stacked groups are invisible. Random tables of one width (so
they stack), features mapped to them (shared tables included), every input form — dense ids, Padded
with and without a mask and with weights, Jagged with and without weights, sequence features — and
every combiner: the default (stacked) collection gives the same outputs, row gradients and optimizer
step as ``stack_tables=False``."""

from __future__ import annotations

from typing import Any

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import torch_tpu_embedding as tte

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
FORMS = ["dense", "padded", "padded_mask", "padded_weights", "jagged", "jagged_weights", "sequence_jagged",
         "sequence_padded"]
B = 4


@st.composite
def collections(draw: Any) -> dict[str, Any]:
    vocabs = draw(st.lists(st.integers(1, 12), min_size=1, max_size=4))
    combiners = draw(st.lists(st.sampled_from(["sum", "mean", "sqrtn"]), min_size=len(vocabs),
                              max_size=len(vocabs)))
    n_features = draw(st.integers(1, 6))
    features = []
    for _ in range(n_features):
        table = draw(st.integers(0, len(vocabs) - 1))
        form = draw(st.sampled_from(FORMS))
        v = vocabs[table]
        if form == "dense":
            data: Any = draw(st.lists(st.integers(0, v - 1), min_size=B, max_size=B))
        else:
            lengths = draw(st.lists(st.integers(0, 3), min_size=B, max_size=B))
            ids = draw(st.lists(st.integers(0, v - 1), min_size=sum(lengths), max_size=sum(lengths)))
            weights = draw(st.lists(st.floats(0.25, 2, width=32), min_size=sum(lengths), max_size=sum(lengths)))
            data = (lengths, ids, weights)
        features.append((table, form, data))
    return {"vocabs": vocabs, "combiners": combiners, "features": features, "seed": draw(st.integers(0, 999))}


def _input(form: str, data: Any, sentinel_fill: int) -> Any:
    if form == "dense":
        return torch.tensor(data)
    lengths, ids, weights = data
    if form.startswith("jagged") or form == "sequence_jagged":
        w = torch.tensor(weights) if form == "jagged_weights" else None
        return tte.Jagged(torch.tensor(ids, dtype=torch.int64), lengths=torch.tensor(lengths), weights=w)
    width = 3
    padded = torch.full((B, width), sentinel_fill, dtype=torch.int64)
    mask = torch.zeros(B, width, dtype=torch.bool)
    wts = torch.zeros(B, width)
    k = 0
    for b, n in enumerate(lengths):
        padded[b, :n] = torch.tensor(ids[k : k + n], dtype=torch.int64)
        mask[b, :n] = True
        wts[b, :n] = torch.tensor(weights[k : k + n])
        k += n
    if form == "padded":  # no mask: every position is an id (padding positions hold id 0)
        return tte.Padded(torch.where(mask, padded, 0))
    if form == "padded_weights":
        return tte.Padded(torch.where(mask, padded, 0), mask, wts)
    return tte.Padded(torch.where(mask, padded, 0), mask)  # padded_mask, sequence_padded


def _run(case: dict[str, Any], stack: bool) -> tuple[dict[str, torch.Tensor], dict[str, Any], dict[str, torch.Tensor]]:
    torch.manual_seed(case["seed"])
    tables = [tte.TableConfig(v, 3, name=f"t{i}", combiner=c)
              for i, (v, c) in enumerate(zip(case["vocabs"], case["combiners"], strict=True))]
    configs, inputs = {}, {}
    for j, (t, form, data) in enumerate(case["features"]):
        seq = form.startswith("sequence")
        configs[f"f{j}"] = tte.FeatureConfig(tables[t], max_sequence_length=2 if seq else 0,
                                             max_ids_per_bag=None if seq or form == "dense" else 3)
        inputs[f"f{j}"] = _input(form, data, 0)
    ec = tte.EmbeddingCollection(configs, stack_tables=stack)
    opt = tte.optim.Adagrad(ec.parameters(), lr=0.3)
    out = ec(inputs)
    loss = sum((i + 1) * o.square().sum() + o.sum() for i, o in enumerate(out.values()))
    loss.backward()  # type: ignore[union-attr]
    grads = ec.row_grads()
    opt.step()
    return {k: v.detach() for k, v in out.items()}, grads, ec.state_dict()


def _dense(ids: torch.Tensor, rows: torch.Tensor, vocab: int) -> torch.Tensor:
    keep = ids < vocab
    return torch.zeros(vocab, rows.shape[1], dtype=rows.dtype).index_add_(0, ids[keep], rows[keep])


@given(collections())
@SETTINGS
def test_stacked_equals_unstacked_for_every_input_form(case: dict[str, Any]) -> None:
    out_s, grads_s, state_s = _run(case, stack=True)
    out_u, grads_u, state_u = _run(case, stack=False)
    for k, v in out_u.items():
        torch.testing.assert_close(out_s[k], v, rtol=0, atol=0, msg=k)
    assert sorted(grads_s) == sorted(grads_u)
    for name, (ids, rows) in grads_u.items():
        vocab = case["vocabs"][int(name[1:])]
        torch.testing.assert_close(_dense(*grads_s[name], vocab), _dense(ids, rows, vocab), rtol=1e-6, atol=1e-6)
    for k, v in state_u.items():
        torch.testing.assert_close(state_s[k], v, rtol=1e-6, atol=1e-6, msg=k)
