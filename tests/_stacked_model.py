"""A small model for the conformance tests: two tables of width 4 that stack into one group, a table of
its own (width 8) and a dense MLP, all float64; and endless jagged batches for it."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

import torch_tpu_embedding as tte

DIMS = {"a": (40, 4), "b": (17, 4), "c": (9, 8)}  # a + b stack (dim 4); c is a table of its own


class Model(nn.Module):
    def __init__(self, stack: bool = True, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        tables = {n: tte.TableConfig(v, d, name=n, dtype=torch.float64) for n, (v, d) in DIMS.items()}
        self.ec = tte.EmbeddingCollection({n: tte.FeatureConfig(t) for n, t in tables.items()}, stack_tables=stack)
        self.mlp = nn.Sequential(nn.Linear(16, 3, dtype=torch.float64), nn.ReLU(), nn.Linear(3, 1, dtype=torch.float64))

    def forward(self, features: dict[str, tte.Jagged]) -> torch.Tensor:
        out = self.ec(features)
        return self.mlp(torch.cat([out[n] for n in DIMS], dim=1)).square().sum()


def batches(seed: int = 1) -> Iterator[dict[str, tte.Jagged]]:
    g = torch.Generator().manual_seed(seed)
    while True:
        out = {}
        for name, (vocab, _) in DIMS.items():
            lengths = torch.randint(1, 4, (5,), generator=g)
            out[name] = tte.Jagged(torch.randint(0, vocab, (int(lengths.sum()),), generator=g), lengths=lengths)
        yield out
