"""Inputs of a layout their form does not take (a nested or sparse tensor inside ``Padded`` or ``Jagged``, a strided
nested tensor as dense ids, a sparse tensor other than COO) raise the feature's error naming the rule, on a first call
and on one that would replay the last call's plan; they raised torch's internal errors (``NestedTensorImpl doesn't
support sizes``, ``aminmax`` or ``_indices`` not implemented for the sparse or nested layout)."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch

import torch_tpu_embedding as tte


def _nested(layout: torch.layout) -> torch.Tensor:
    with warnings.catch_warnings():  # (torch's prototype warning for the strided layout)
        warnings.simplefilter("ignore")
        return torch.nested.nested_tensor([torch.tensor([1, 2]), torch.tensor([3, 4])], layout=layout)


def _csr() -> torch.Tensor:
    with warnings.catch_warnings():  # (torch's beta warning for the layout)
        warnings.simplefilter("ignore")
        return _IDS.to_sparse_csr()


_IDS = torch.tensor([[1, 2], [3, 4]])
_CASES: list[tuple[str, Callable[[], Any], str]] = [
    ("dense_strided_nested", lambda: _nested(torch.strided), r"nested inputs must be 2-D torch.nested tensors with "
                                                            r"layout=torch.jagged"),
    ("padded_strided_nested_ids", lambda: tte.Padded(_nested(torch.strided)),
     r"Padded ids must be a dense \(strided\) tensor. Received a nested tensor"),
    ("padded_jagged_nested_ids", lambda: tte.Padded(_nested(torch.jagged)),
     r"Padded ids must be a dense \(strided\) tensor. Received a nested tensor"),
    ("padded_sparse_ids", lambda: tte.Padded(_IDS.to_sparse()),
     r"Padded ids must be a dense \(strided\) tensor. Received a sparse_coo tensor"),
    ("padded_sparse_mask", lambda: tte.Padded(_IDS, torch.ones(2, 2, dtype=torch.bool).to_sparse()),
     r"Padded mask must be a dense \(strided\) tensor. Received a sparse_coo tensor"),
    ("padded_sparse_weights", lambda: tte.Padded(_IDS, None, torch.ones(2, 2).to_sparse()),
     r"Padded weights must be a dense \(strided\) tensor. Received a sparse_coo tensor"),
    ("sparse_csr", lambda: _csr(), r"sparse inputs must be sparse COO tensors .* Received layout torch.sparse_csr: "
                                   r"convert it with .to_sparse_coo\(\)"),
    ("jagged_sparse_values", lambda: tte.Jagged(torch.tensor([1, 2]).to_sparse(), lengths=torch.tensor([1, 1])),
     r"Jagged values must be a dense \(strided\) tensor. Received a sparse_coo tensor"),
    ("jagged_nested_lengths", lambda: tte.Jagged(torch.tensor([1, 2]), lengths=_nested(torch.jagged)),
     r"Jagged lengths must be a dense \(strided\) tensor. Received a nested tensor"),
]


@pytest.mark.parametrize("replayed", [False, True], ids=["first", "replayed"])
@pytest.mark.parametrize("make,pattern", [c[1:] for c in _CASES], ids=[c[0] for c in _CASES])
def test_an_input_of_another_layout_names_the_feature(make: Callable[[], Any], pattern: str, replayed: bool) -> None:
    torch.manual_seed(0)
    tables = [tte.TableConfig(10, 3, name=f"t{i}") for i in range(2)]
    ec = tte.EmbeddingCollection({"a": tte.FeatureConfig(tables[0]), "b": tte.FeatureConfig(tables[1])})
    before = {k: v.clone() for k, v in ec.state_dict().items()}
    if replayed:  # (a plan kept for inputs of these features' forms)
        dense = isinstance(make(), torch.Tensor)
        ec({"a": torch.tensor([1, 2]) if dense else tte.Padded(_IDS), "b": torch.tensor([5, 6])})
    with pytest.raises(ValueError, match=r"Feature `a`: " + pattern):
        ec({"a": make(), "b": torch.tensor([5, 6])})
    assert all(torch.equal(v, before[k]) for k, v in ec.state_dict().items())
