"""``tte.clip_grad_norm_`` on XLA: the norm of a table's densified gradient, as on the CPU.

XLA's duplicate sum keeps static shapes: ``N`` entries, the distinct ids first and a tail of zero rows at the
sentinel (``torch_tpu_embedding._rows.dedup.dedup_static``). Those rows are no rows of the table: a negative
``norm_type`` (``-inf``: the smallest ``|g|``) must not see them, or every step with a duplicate id or a padded
position would give 0 where torch's dense gradient has none.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

torch_xla = pytest.importorskip("torch_xla")

import torch_tpu_embedding as tte  # noqa: E402

# The autograd engine sizes its device queues at the first backward: create the XLA device first.
torch_xla.device()

#: bags of table t (4 rows, every one looked up): duplicates (row 2 twice in a bag, row 1 in two bags) and
#: padding, so the duplicate sum has a sentinel tail of 3 zero rows out of 8 entries
IDS = [[0, 1], [2, 2], [1, 3], [3, 3]]
MASK = [[True, True], [True, True], [True, True], [True, False]]
SCALE = [[1.0, -2.0], [0.5, 3.0], [-1.5, 0.25], [2.0, 1.0]]  # each bag's dL/dout: no summed row is 0
MAX_NORM = 0.1


def _norm(device: torch.device, norm_type: float) -> tuple[float, np.ndarray]:
    """The total norm ``tte.clip_grad_norm_`` returns, and the table's row gradient after clipping (dense)."""
    ec = tte.EmbeddingCollection(
        {"f": tte.FeatureConfig(tte.TableConfig(4, 2, name="t", combiner="sum"), max_ids_per_bag=2)},
        device=device)
    out = ec({"f": tte.Padded(torch.tensor(IDS), torch.tensor(MASK))})["f"]
    (out * torch.tensor(SCALE, device=device)).sum().backward()
    total = tte.clip_grad_norm_(ec.parameters(), MAX_NORM, norm_type=norm_type)
    ids, rows = ec.row_grads()["t"]
    keep = ids.cpu() < 4
    dense = torch.zeros(4, 2, dtype=torch.float64).index_add_(0, ids.cpu()[keep], rows.cpu().double()[keep])
    return float(total.cpu()), dense.numpy()


def _reference(norm_type: float) -> tuple[float, np.ndarray]:
    """float64 numpy: the dense [4, 2] gradient, its norm of ``norm_type`` and the clipped gradient."""
    g = np.zeros((4, 2))
    for bag, scale in zip(np.array(IDS)[np.array(MASK)].reshape(-1).tolist(),
                          np.repeat(np.array(SCALE)[:, None, :], 2, axis=1)[np.array(MASK)], strict=True):
        g[bag] += scale
    a = np.abs(g).reshape(-1)
    if math.isinf(norm_type):
        total = a.max() if norm_type > 0 else a.min()
    else:
        total = (a ** norm_type).sum() ** (1.0 / norm_type)
    return float(total), g * min(MAX_NORM / (total + 1e-6), 1.0)


@pytest.mark.parametrize("norm_type", [-math.inf, -2.0, 2.0, math.inf], ids=["-inf", "-2", "2", "inf"])
def test_every_row_looked_up_gives_the_dense_gradients_norm(norm_type: float) -> None:
    """Every row of the table looked up, each summed row nonzero: XLA's total norm and clipped rows equal the
    float64 reference and the eager CPU's (a negative order sees no zero row of the sentinel tail)."""
    want, want_g = _reference(norm_type)
    assert want > MAX_NORM  # (no row of the reference is 0; the clip scales: its coefficient is below 1)
    cpu, cpu_g = _norm(torch.device("cpu"), norm_type)
    xla, xla_g = _norm(torch_xla.device(), norm_type)
    np.testing.assert_allclose([cpu, xla], [want, want], rtol=1e-6)
    np.testing.assert_allclose(cpu_g, want_g, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(xla_g, want_g, rtol=1e-6, atol=1e-7)


def _stacked_norm(device: torch.device, stack: bool, norm_type: float) -> float:
    """Three tables of one width (stacked: one group): t's bags as above, u's two rows cancel (its dense gradient
    is 0), v looked up once."""
    torch.manual_seed(0)
    tables = [tte.TableConfig(4, 2, name=n, combiner="sum") for n in ("t", "u", "v")]
    ec = tte.EmbeddingCollection({f"f_{t.name}": tte.FeatureConfig(t, max_ids_per_bag=2) for t in tables},
                                 device=device, stack_tables=stack)
    out = ec({"f_t": tte.Padded(torch.tensor(IDS), torch.tensor(MASK)),
              "f_u": tte.Padded(torch.tensor([[1, 1], [1, 0], [0, 0], [0, 0]]),
                                torch.tensor([[True, False], [True, False], [False, False], [False, False]])),
              "f_v": tte.Padded(torch.tensor([[3, 0], [0, 0], [0, 0], [0, 0]]),
                                torch.tensor([[True, False], [False, False], [False, False], [False, False]]))})
    u_scale = torch.tensor([[1.0, 1.0], [-1.0, -1.0], [0.0, 0.0], [0.0, 0.0]], device=device)
    ((out["f_t"] * torch.tensor(SCALE, device=device)).sum() + (out["f_u"] * u_scale).sum() + out["f_v"].sum()).backward()
    return float(tte.clip_grad_norm_(ec.parameters(), MAX_NORM, norm_type=norm_type).cpu())


@pytest.mark.parametrize("stack", [False, True], ids=["unstacked", "stacked"])
def test_norm_type_0_counts_each_table_stacked_or_not(stack: bool) -> None:
    """torch's order 0 counts the gradient tensors with a nonzero entry: t's and v's dense gradients, not u's
    (its rows cancel), so 2 (a stacked group counted as one tensor: 1), on XLA as on the CPU."""
    assert _stacked_norm(torch.device("cpu"), stack, 0.0) == 2.0
    assert _stacked_norm(torch_xla.device(), stack, 0.0) == 2.0
