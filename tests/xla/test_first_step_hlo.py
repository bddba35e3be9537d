"""The first step's graph of a user's script on XLA grows with the features of a stacked group by their output
views only: per feature its activation's slice and its gradient's slice (``modules/lookup.py``'s
``_columns_whole`` joins the gradients of the caller's ``torch.cat`` by a ``cat`` of them side by side, which XLA
folds into the tensor they were sliced from; a ``stack`` added a reshape per feature and a concatenation XLA
could not fold: the first compile at 100 features took 4× that of one).

Counts of HLO instructions as torch_xla hands the graph to XLA (not compiled here), issue [host]'s user step:
default construction (all tables stacked), a ``Linear`` head on the dict concatenated by the caller's
``torch.cat``, ``tte.optim.Adam`` without ``init_state()``. ``benchmarks/xla_tables.py --parts first-compile``
times the compile."""

from __future__ import annotations

import collections
import re

import pytest
import torch

pytest.importorskip("torch_xla")

import torch_xla  # noqa: E402

import torch_tpu_embedding as tte  # noqa: E402


def _first_step_hlo(features: int) -> collections.Counter[str]:
    """The first step's HLO instructions by opcode (the tables, the head and every optimizer slot it updates)."""
    dev = torch_xla.device()
    torch.manual_seed(0)
    names = [f"f{i:03d}" for i in range(features)]
    ec = tte.EmbeddingCollection({n: tte.FeatureConfig(tte.TableConfig(50, 4, name=f"t{n}", combiner="mean"),
                                                       max_ids_per_bag=2) for n in names}, device=dev)
    head = torch.nn.Linear(4 * features, 1).to(dev)
    opt, head_opt = tte.optim.Adam(ec.parameters(), lr=0.1), torch.optim.SGD(head.parameters(), lr=0.1)
    torch_xla.sync()
    g = torch.Generator().manual_seed(1)
    out = ec({n: tte.Padded(torch.randint(0, 50, (8, 2), generator=g)) for n in names})
    head(torch.cat([out[n] for n in names], dim=1)).square().mean().backward()
    opt.step()
    head_opt.step()
    state = [t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    hlo = torch_xla._XLAC._get_xla_tensors_hlo([*ec.parameters(), *head.parameters(), *state])
    return collections.Counter(re.findall(r" = \S+ ([a-z-]+)\(", hlo))


def test_the_first_steps_graph_grows_by_two_slices_a_feature() -> None:
    one, hundred = _first_step_hlo(1), _first_step_hlo(100)
    grown = hundred - one
    # measured: 267 and 477 instructions, slice +199 and 11 others (a stack of the gradients: reshape +100 more)
    assert sum(grown.values()) <= 2 * 99 + 16, (one, hundred)
    assert grown["reshape"] <= 4 and grown["concatenate"] <= 2, (one, hundred)
