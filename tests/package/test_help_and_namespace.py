"""Papercuts a new user hits (issue 29, item 9): help() texts, the optim namespace, row_grads()'s
one contract. (Guide sections run alone: tests/docs/test_docs_snippets.py::test_guide_section_runs_alone.)"""

from __future__ import annotations

import inspect
import types

import pytest
import torch
from torch import nn

import torch_tpu_embedding as tte


@pytest.mark.parametrize(("method", "words"), [("forward", ("features", "weights", "[B, D]")),
                                               ("__init__", ("feature_config", "stack_tables"))])
def test_embedding_collection_help_is_its_own(method: str, words: tuple[str, ...]) -> None:
    """``help(tte.EmbeddingCollection.forward)`` / ``__init__`` show this class's text, not nn.Module's."""
    doc = inspect.getdoc(getattr(tte.EmbeddingCollection, method))
    assert doc is not None and doc != inspect.getdoc(getattr(nn.Module, method))
    assert all(w in doc for w in words), doc


@pytest.mark.parametrize("name", sorted(tte.optim.OPTIMIZER_NAMES))
def test_every_optimizer_help_has_its_formula_and_args(name: str) -> None:
    cls = tte.optim.optimizer_class(name)
    doc = inspect.getdoc(cls)
    assert doc is not None and "Args:" in doc and len(doc.splitlines()) >= 10, (cls.__name__, doc)
    assert ":math:" in doc or ".. math::" in doc, cls.__name__


def test_optim_namespace_exports_no_helper_module() -> None:
    """``tte.optim`` holds its API and its optimizer modules, no ``sys``; ``__all__`` names the API."""
    public = [n for n in dir(tte.optim) if not n.startswith("_")]
    assert "sys" not in public
    non_modules = sorted(n for n in public if not isinstance(getattr(tte.optim, n), types.ModuleType))
    assert non_modules == sorted(tte.optim.__all__)
    modules = [n for n in public if isinstance(getattr(tte.optim, n), types.ModuleType)]
    assert all(getattr(tte.optim, n).__name__ == f"torch_tpu_embedding.optim.{n}" for n in modules), modules


def _check_contract(got: dict[str, tuple[torch.Tensor, torch.Tensor]], sizes: dict[str, tuple[int, int]]) -> None:
    for name, (ids, rows) in got.items():
        v, d = sizes[name]
        assert ids.dim() == 1 and rows.shape == (ids.shape[0], d), (name, ids.shape, rows.shape)
        assert int(ids.min()) >= 0 and int(ids.max()) <= v, name
        pad = ids == v  # padding: the id num_embeddings, with a zero row
        assert torch.equal(rows[pad], torch.zeros_like(rows[pad])), name


@pytest.mark.parametrize("stack", [True, False])
def test_row_grads_is_ids_n_rows_n_d_with_padding_num_embeddings(stack: bool) -> None:
    a = tte.TableConfig(7, 3, name="a")
    b = tte.TableConfig(5, 3, name="b")
    ec = tte.EmbeddingCollection({"x": tte.FeatureConfig(a), "y": tte.FeatureConfig(b), "z": tte.FeatureConfig(a)},
                                 stack_tables=stack)
    out = ec({"x": tte.Padded(torch.tensor([[1, 6], [2, 0]]), torch.tensor([[True, True], [True, False]])),
              "y": tte.Jagged(torch.tensor([4, 0, 4]), lengths=torch.tensor([2, 1])),
              "z": torch.tensor([3, 3])})
    sum((i + 1.0) * o.square().sum() for i, o in enumerate(out.values())).backward()
    got = ec.row_grads()
    assert list(got) == ["a", "b"]
    _check_contract(got, {"a": (7, 3), "b": (5, 3)})
    dense = torch.zeros(8, 3).index_add_(0, got["a"][0], got["a"][1])[:7]
    assert dense[[1, 2, 3, 6]].abs().sum(1).gt(0).all() and dense[[0, 4, 5]].abs().sum() == 0
