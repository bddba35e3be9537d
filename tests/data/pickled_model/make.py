"""Writes model.pt: a whole model saved with ``torch.save(model)`` at commit 7bb2a6a, before the package's
modules moved into subpackages (issue 41); and outputs.pt: its lookups of ``INPUTS`` then. Kept as made:
tests/package/test_pickled_model.py loads both at every later commit. Run from the repository root:
``PYTHONPATH=. python tests/data/pickled_model/make.py``."""

from __future__ import annotations

from pathlib import Path

import torch

import torch_tpu_embedding as tte

HERE = Path(__file__).parent
INPUTS = {"user": tte.Jagged(torch.tensor([1, 2, 3, 49, 0]), torch.tensor([0, 2, 3, 5])),
          "movie": tte.Jagged(torch.tensor([0, 29, 5, 6, 7, 7]), torch.tensor([0, 2, 4, 6])),
          "tag": tte.Jagged(torch.tensor([19, 1, 2, 0]), torch.tensor([0, 2, 3, 4])),
          "movie2": torch.tensor([1, 28, 3])}


def build() -> torch.nn.Module:
    torch.manual_seed(0)
    users = tte.TableConfig(name="users", num_embeddings=50, embedding_dim=8, combiner="mean")
    movies = tte.TableConfig(name="movies", num_embeddings=30, embedding_dim=8, combiner="sum")
    tags = tte.TableConfig(name="tags", num_embeddings=20, embedding_dim=4, combiner="sqrtn", optimizer="sgd")
    features = {"user": tte.FeatureConfig(name="user", table=users), "movie": tte.FeatureConfig(name="movie", table=movies),
                "tag": tte.FeatureConfig(name="tag", table=tags), "movie2": tte.FeatureConfig(name="movie2", table=movies)}
    stacked = tte.EmbeddingCollection(features)
    plain = tte.EmbeddingCollection({k: features[k] for k in ("user", "movie")}, fuse_tables=False)
    return torch.nn.ModuleDict({"stacked": stacked, "plain": plain, "head": torch.nn.Linear(28, 1)})


def lookups(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    out = {f"stacked.{k}": v for k, v in model["stacked"](INPUTS).items()}
    out.update({f"plain.{k}": v for k, v in model["plain"]({k: INPUTS[k] for k in ("user", "movie")}).items()})
    return {k: v.detach() for k, v in out.items()}


if __name__ == "__main__":
    model = build()
    torch.save(model, HERE / "model.pt")
    torch.save(lookups(model), HERE / "outputs.pt")
