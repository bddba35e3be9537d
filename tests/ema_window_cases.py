"""``use_ema`` with gradient accumulation on XLA (one device: tests/xla/test_ema_last_xla.py; a 4-device mesh:
tests/xla_spmd/test_ema_last_spmd.py) against the CPU: the raw ``ema`` and ``ema_last`` slots, and a checkpoint moved
between the CPU and XLA, which must continue as on the layout it came from.

``ema_last`` is the call at which a row's average was last brought up to date. Eagerly a window's accumulate-only calls
update nothing, so a row's average moves only at the window's last call. On XLA every call runs the update (one graph),
gated by the window; the touched rows' averages were not gated by it, so an accumulate-only call brought up to date the
rows of the window's buffer, stale slots of the last window included (rows the call did not touch): ``ema_last`` then
named that call, one to k - 1 calls after the CPU's, and the raw ``ema`` was caught up further (the caught-up averages
agreed, which is why comparisons of ``moving_average`` did not see it).

With ``skip_nonfinite`` XLA also checked the accumulate-only calls (over the window so far and the last window's stale
slots), counting each that saw a NaN, and took one call off the average's counter per count, where the CPU counts a
dropped window once and takes its k calls off: ``skipped_steps`` (saved) meant another thing on each layout, so a
checkpoint moved after a dropped window continued with the counter off, and a window with two NaN micro-batches set
the counter one call apart (``ema_last`` too) in a single run.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_map

import torch_tpu_embedding as tte
from torch_tpu_embedding._rows.row_order import to_logical

CPU = torch.device("cpu")
R, D, K = 40, 4, 2
#: name: (optimizer, keywords); the non-lazy one keeps no ``ema_last`` (its average moves every call, as in Keras)
CASES: dict[str, tuple[Any, dict[str, Any]]] = {
    "sgd": (tte.optim.SGD, {}),
    "adagrad-skip": (tte.optim.Adagrad, {"skip_nonfinite": True}),
    "adam-nonlazy": (tte.optim.Adam, {"lazy_adam": False}),
    "adam-nonlazy-skip": (tte.optim.Adam, {"lazy_adam": False, "skip_nonfinite": True}),
}
#: ``(case, calls whose gradients are NaN)``: windows ``skip_nonfinite`` drops (a NaN in a window's first, last or both
#: micro-batches). A lazy table's, the window of calls 2-3; a non-lazy table's, whose average moves at every call, the
#: window of calls 4-5: in the window after the first the accumulate-only call's average is its weight (the first
#: window's momentum is 0: the average is the weight, and a call that does not update moves nothing), nothing to undo.
DROPPED = [("adagrad-skip", (2,)), ("adagrad-skip", (3,)), ("adagrad-skip", (2, 3)),
           ("adam-nonlazy-skip", (4,)), ("adam-nonlazy-skip", (5,)), ("adam-nonlazy-skip", (4, 5))]
Setup = Callable[[tte.EmbeddingCollection], None]  # places a collection built on the device (a mesh's shard)
Sync = Callable[[], None]


def build(device: torch.device, case: str, setup: Setup | None) -> tuple[tte.EmbeddingCollection, Any]:
    torch.manual_seed(0)
    t = tte.TableConfig(R, D, name="t", placement="row", dtype=torch.float64)
    ec = tte.EmbeddingCollection({"f": tte.FeatureConfig(t, max_ids_per_bag=2)}, device=device)
    if device != CPU and setup is not None:
        setup(ec)
    cls, kw = CASES[case]
    opt = cls(ec.parameters(), lr=0.1, use_ema=True, ema_momentum=0.9, gradient_accumulation_steps=K, **kw)
    opt.init_state()
    return ec, opt


def train(ec: tte.EmbeddingCollection, opt: Any, device: torch.device, calls: range, sync: Sync,
          nan_at: tuple[int, ...] = ()) -> None:
    """``nan_at``: the calls whose gradients are NaN (a window ``skip_nonfinite`` drops)."""
    for i in calls:  # rows >= 20 are never looked up
        ids = torch.randint(0, 20, (4, 2), generator=torch.Generator().manual_seed(i))
        loss = ec({"f": tte.Padded(ids.to(device))})["f"].square().sum()
        (loss * float("nan") if i in nan_at else loss).backward()
        opt.step()
        opt.zero_grad()
        if device != CPU:
            sync()


def saved(ec: tte.EmbeddingCollection, opt: Any) -> dict[str, torch.Tensor]:
    out = {"weight": ec.state_dict()["tables.t.weight"].cpu()}
    out.update({k: v.cpu() for k, v in opt.state_dict()["state"]["table:t"].items() if not k.startswith("acc_")})
    return out


def averages(ec: tte.EmbeddingCollection, opt: Any) -> torch.Tensor:
    """The caught-up averages (``moving_average``) in the table's logical row order."""
    table = ec.physical_tables()["t"]
    return to_logical(opt.moving_average(table.weight).cpu(), table.config.num_embeddings, table.row_layout)


def check_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(want)
    for k, v in want.items():
        if v.dtype == torch.int32:
            assert torch.equal(got[k], v), (k, got[k].tolist(), v.tolist())
        else:
            torch.testing.assert_close(got[k], v, rtol=1e-12, atol=1e-14, msg=k)


def raw_slots_equal(dev: torch.device, case: str, setup: Setup | None, sync: Sync, nan_at: tuple[int, ...] = ()) -> None:
    """7 calls (the last accumulate-only): every slot, ``ema_last`` and the raw ``ema`` included, as on the CPU, on
    touched and untouched rows; and ``skipped_steps``."""
    got, want = build(dev, case, setup), build(CPU, case, None)
    train(*got, dev, range(7), sync, nan_at)
    train(*want, CPU, range(7), sync, nan_at)
    assert got[1].skipped_steps == want[1].skipped_steps == (1 if nan_at else 0)
    g, w = saved(*got), saved(*want)
    if "ema_last" in w:  # lazy tables: rows brought up to date at different calls, untouched rows at -1
        assert len(set(w["ema_last"].tolist())) >= 3 and (w["ema_last"][20:] == -1).all()
    check_equal(g, w)


def moved_checkpoint_continues(dev: torch.device, case: str, direction: str, setup: Setup | None, sync: Sync,
                               nan_at: tuple[int, ...] = ()) -> None:
    """6 calls on one layout (``nan_at`` among them), saved, loaded on the other, 5 more calls there (ending
    mid-window): weights, ``ema``, ``ema_last`` as the layout it came from continued, and the caught-up averages too."""
    src, dst = (CPU, dev) if direction == "cpu-to-xla" else (dev, CPU)
    ec, opt = build(src, case, setup)
    train(ec, opt, src, range(6), sync, nan_at)
    # Copies: a state dict's tensors may be the live ones, which the next calls change.
    model_sd = {k: v.cpu().clone() for k, v in ec.state_dict().items()}
    opt_sd = tree_map(lambda v: v.cpu().clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v), opt.state_dict())
    train(ec, opt, src, range(6, 11), sync)
    moved, moved_opt = build(dst, case, setup)
    moved.load_state_dict(model_sd)
    moved_opt.load_state_dict(opt_sd)
    train(moved, moved_opt, dst, range(6, 11), sync)
    check_equal(saved(moved, moved_opt), saved(ec, opt))
    torch.testing.assert_close(averages(moved, moved_opt), averages(ec, opt), rtol=1e-12, atol=1e-14)
