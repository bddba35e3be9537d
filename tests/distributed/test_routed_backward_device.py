"""The backward of a process-group sharded lookup (``distributed/routed.py``) builds the rows it sends on the
rows' device: no tensor made on the host and copied over in a step (docs/design.md, "the host is part of the
step"). Its payload (each position's gradient row over the group's size, then a column of 1 where some loss used
the position) equals plain float64 torch.

The backward runs on the ``meta`` device, so that a host tensor is visible on a machine without an accelerator;
the exchange (``send_grads``, gloo's ``all_to_all_single``) is replaced by a recorder, and the ``ctx`` is a
lookup's that records no rows (``needs_input_grad`` False), so only the payload is built. Before, the used-count
column was ``torch.ones`` / ``torch.zeros`` on the host, then copied to the rows' device every step.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from torch_tpu_embedding.distributed import routed

SPLITS, D, WORLD = (2, 3), 4, 2


class _Devices(TorchDispatchMode):
    """Every aten op's name and the devices of the tensors it returns."""

    def __init__(self) -> None:
        super().__init__()
        self.made: list[tuple[str, set[str]]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        self.made.append((str(func), {t.device.type for t in tree_leaves(out) if isinstance(t, torch.Tensor)}))
        return out


def backward_payload(monkeypatch: pytest.MonkeyPatch, device: str, grads: tuple[torch.Tensor | None, ...]
                     ) -> tuple[torch.Tensor, list[tuple[str, set[str]]]]:
    """What the backward sends to the owners for ``grads`` (one per item), and every op it ran."""
    sent: list[torch.Tensor] = []
    # (no other rank's loss used the table: a host tensor, as read after a real exchange; made before the ops are seen)
    none_used = torch.zeros(1, dtype=torch.bool)

    def send(g: list[torch.Tensor], slot: list[torch.Tensor], k: int, sharding: Any, reached: torch.Tensor
             ) -> tuple[list[torch.Tensor], torch.Tensor]:
        sent.extend(g)
        return g, none_used

    monkeypatch.setattr(routed, "send_grads", send)
    n = sum(SPLITS)
    table = routed._Table(SimpleNamespace(world=WORLD, rank=0, table="t"), None, frozenset({"t"}),  # type: ignore[arg-type]
                          torch.float64, torch.zeros(n, dtype=torch.int64, device=device), SPLITS, grad=True,
                          slot=torch.zeros(n, dtype=torch.int64, device=device),
                          local=torch.zeros(n, dtype=torch.int64, device=device))
    ctx = SimpleNamespace(joint=routed._Joint([table], k=n), weight_shapes=[(20, D)], weight_infos=[None],
                          needs_input_grad=(False, False), next_functions=((None, 0),))
    with _Devices() as seen:
        routed._Exchange.backward(ctx, *grads)
    assert len(sent) == 1
    return sent[0], seen.made


def item_grads(device: str, used: tuple[bool, ...]) -> tuple[torch.Tensor | None, ...]:
    g = torch.Generator().manual_seed(0)
    return tuple(torch.randn(s, D, generator=g, dtype=torch.float64).to(device) if u else None
                 for s, u in zip(SPLITS, used, strict=True))


@pytest.mark.parametrize("used", [(True, True), (False, False)], ids=["every-item-used", "no-item-used"])
def test_the_payload_is_made_on_the_rows_device(monkeypatch: pytest.MonkeyPatch, used: tuple[bool, ...]) -> None:
    payload, made = backward_payload(monkeypatch, "meta", item_grads("meta", used))
    assert payload.device.type == "meta" and payload.shape == (sum(SPLITS), D + 1)
    on_host = [op for op, devices in made if "cpu" in devices]
    assert not on_host, made


@pytest.mark.parametrize("used", [(True, True), (False, False), (True, False), (False, True)],
                         ids=["both", "neither", "first", "second"])
def test_the_payload_equals_float64_torch(monkeypatch: pytest.MonkeyPatch, used: tuple[bool, ...]) -> None:
    grads = item_grads("cpu", used)
    payload, _ = backward_payload(monkeypatch, "cpu", grads)
    rows = torch.cat([torch.zeros(s, D, dtype=torch.float64) if g is None else g / WORLD
                      for s, g in zip(SPLITS, grads, strict=True)])
    column = torch.cat([torch.full((s, 1), float(u), dtype=torch.float64) for s, u in zip(SPLITS, used, strict=True)])
    assert torch.equal(payload, torch.cat([rows, column], dim=1))
