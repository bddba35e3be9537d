"""The step of an eager accelerator (CUDA): no host read, static shapes, and the CPU's results.

On CUDA a host read of a tensor's value (``.item()``, ``bool()``, a data-dependent shape such as ``unique``'s)
waits for the device, and the host falls behind it every step. There the optimizer keeps static shapes: the
duplicate sum keeps ``N`` entries with a sentinel tail, written through the table's last row
(``torch_tpu_embedding._rows.dedup.sink_rows`` / ``sink_padding``). Two checks, with no GPU:

* the same path on the CPU (``HOST_READ_DEVICE_TYPES`` emptied; the CPU raises on an out-of-range index as
  CUDA asserts) gives the CPU's own results, every optimizer with its options (tests/optim_registry.py,
  target ``sync_free``), on batches that touch the sink row, leave it alone, and pad a whole group;
* every step on the meta device (a stand-in accelerator: every read of a value and every data-dependent
  shape raises there) runs: forward, backward and ``step()`` (on ``Path.ROWS``: the compiled kernel runs only on the
  CPU and CUDA, tests/package/test_cuda.py checks it there); and the
  steady steps copy nothing from the host with a blocking copy (on CUDA one synchronises the stream).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from optim_registry import KERNEL_PATH, SYNC_FREE, OptimizerConfig, case, cases
from test_frozen_tables_and_bag_edges import STACKED_CASES, _freeze_run
from test_host_ops import _batches as host_batches
from test_host_ops import _model, _step
from test_kernel_update import _tensors, assert_same
from test_kernel_update import model as kernel_model
from test_kernel_update import step as kernel_step
from test_member_sums import force_spread
from test_stacked_groups import _CountOps
from torch.utils._python_dispatch import TorchDispatchMode

import torch_tpu_embedding as tte
from torch_tpu_embedding._rows import dedup
from torch_tpu_embedding.modules import assembly, plan
from torch_tpu_embedding.optim._core.update_paths import Path
from torch_tpu_embedding.optim._kernels import kernel_policy, row_update
from torch_tpu_embedding.optim._kernels.c_gather import join_library

CASES = cases(SYNC_FREE)
# Each configuration with a stacked group's per-member sums as the CPU takes them (index_add), and those whose rule
# sums over rows once more with them spread over lanes, as CUDA takes them (tests/optim/test_member_sums.py).
SUMS = [pytest.param(c, False, id=str(c)) for c in CASES] + [
    pytest.param(c, True, id=f"{c}-spread") for c in CASES if not c.info.per_row_rule]
F64 = torch.float64


def _collection(device: str | torch.device = "cpu") -> tte.EmbeddingCollection:
    torch.manual_seed(0)
    a = tte.TableConfig(40, 4, name="a", combiner="mean", dtype=F64)
    b = tte.TableConfig(30, 4, name="b", combiner="sum", dtype=F64)  # stacked after a: its row 29 is the sink
    c = tte.TableConfig(20, 3, name="c", combiner="sqrtn", dtype=F64)  # a group of its own (dim 3)
    return tte.EmbeddingCollection({"fa": tte.FeatureConfig(a, max_ids_per_bag=4),
                                    "fb": tte.FeatureConfig(b, max_ids_per_bag=3),
                                    "fc": tte.FeatureConfig(c, max_ids_per_bag=2)}, device=device)


def _batches() -> list[dict[str, tte.Padded]]:
    """Duplicates and padding every step; the sink rows (b's 29, c's 19) looked up in steps 0 and 3 only;
    in step 2 c's feature is all padding (its group gets no real id)."""
    g = torch.Generator().manual_seed(1)
    out = []
    for step in range(5):
        fa = torch.randint(0, 40, (12, 4), generator=g)
        fb = torch.randint(0, 29, (12, 3), generator=g)
        fc = torch.randint(0, 19, (12, 2), generator=g)
        if step in (0, 3):
            fb[1, 0] = fb[5, 2] = 29
            fc[2, 1] = 19
        mask_c = torch.rand(12, 2, generator=g) > 0.3
        if step == 2:
            mask_c[:] = False
        out.append({"fa": tte.Padded(fa, torch.rand(12, 4, generator=g) > 0.25),
                    "fb": tte.Padded(fb, torch.rand(12, 3, generator=g) > 0.25),
                    "fc": tte.Padded(fc, mask_c)})
    return out


class _BlockingCopies(TorchDispatchMode):
    """Counts the host-to-device copies that block (on CUDA a blocking copy synchronises the stream), and lists
    every host-to-device copy (``copies``)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocking: list[str] = []
        self.copies: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if name == "_to_copy" and args[0].device.type == "cpu" and kwargs.get("device", args[0].device).type != "cpu":
            self.copies.append(f"_to_copy {tuple(args[0].shape)} {args[0].dtype}")
            if not kwargs.get("non_blocking", False):
                self.blocking.append(f"_to_copy {tuple(args[0].shape)}")
        elif name == "copy_" and args[1].device.type == "cpu" and args[0].device.type != "cpu":
            self.copies.append(f"copy_ {tuple(args[1].shape)} {args[1].dtype}")
            if not (args[2] if len(args) > 2 else kwargs.get("non_blocking", False)):
                self.blocking.append(f"copy_ {tuple(args[1].shape)}")
        return func(*args, **kwargs)


def _train(cfg: OptimizerConfig, device: str | torch.device = "cpu",
           steady: Callable[[], contextlib.AbstractContextManager[Any]] | None = None
           ) -> tuple[dict[str, Any], dict[str, Any]]:
    """The collection's and the optimizer's state after 5 steps (``{}``, ``{}`` on the meta device: a state dict
    reads counters, which is no step's business); ``steady``: makes the context each of the last two steps runs in
    (each step's ids new from the host; tests/package/test_cuda.py runs them on CUDA under ``set_sync_debug_mode``;
    a new context per step: a ``contextlib.contextmanager`` is entered once)."""
    ec = _collection(device)
    opt = cfg.make(ec.parameters())
    head = {f: torch.linspace(-1.0, 1.5, 12 * d, dtype=F64).view(12, d).to(device)
            for f, d in (("fa", 4), ("fb", 4), ("fc", 3))}
    for i, batch in enumerate(_batches()):
        with steady() if steady is not None and i >= 3 else contextlib.nullcontext():
            out = ec(batch)
            sum((out[f] * head[f]).sum() for f in head).backward()  # type: ignore[union-attr]
            opt.step()
            opt.zero_grad()
    if torch.device(device).type == "meta":
        return {}, {}
    return ec.state_dict(), opt.state_dict()["state"]


@pytest.mark.parametrize(("cfg", "spread"), SUMS)
def test_the_accelerator_path_gives_the_cpu_results(cfg: OptimizerConfig, spread: bool,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    weights, state = _train(cfg)
    monkeypatch.setattr(dedup, "HOST_READ_DEVICE_TYPES", set())
    assert dedup.sync_free(torch.device("cpu"))
    taken = force_spread(monkeypatch) if spread else []
    static_weights, static_state = _train(cfg)
    assert set(taken) == ({2} if spread else set()), taken  # (the group of a and b)
    # The same float64 operations on every touched row (N rows with a tail instead of the U distinct ones):
    # bitwise, but where a sum runs over rows (Adafactor's statistics, clipnorm's norm) and adds the tail's
    # zeros in another order: a few ulps.
    over_rows = cfg.info.whole_slots or "clipnorm" in cfg.kwargs
    tol = {"rtol": 1e-13, "atol": 1e-15} if over_rows else {"rtol": 0.0, "atol": 0.0}
    for k, v in weights.items():
        torch.testing.assert_close(static_weights[k], v, **tol, msg=lambda m, k=k: f"{k}: {m}")
    for key, slots in state.items():
        for slot, v in slots.items():
            torch.testing.assert_close(static_state[key][slot], v, **tol, msg=lambda m, s=slot: f"{s}: {m}")


@pytest.mark.parametrize(("cfg", "spread"), SUMS)
def test_every_step_runs_without_reading_the_device(cfg: OptimizerConfig, spread: bool,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    # The meta tables hold no values, which a lookup refuses (the user must lay them out first): allowed here.
    monkeypatch.setattr(plan, "check_not_meta", lambda *args: None)
    taken = force_spread(monkeypatch) if spread else []
    copies = _BlockingCopies()
    _train(cfg, "meta", lambda: copies)
    assert copies.blocking == []  # the batch's ids travel without a blocking copy
    assert bool(taken) == spread


@pytest.mark.parametrize("cfg", [c for c in CASES if str(c) in ("sgd", "lazy_adam", "adafactor")], ids=str)
def test_host_ids_joined_in_c_travel_as_one_int32_tensor_without_reading_the_device(
        cfg: OptimizerConfig, monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel library on (as a user's run has it; the suite's is off, tests/conftest.py): each batch's host ids
    are joined, shifted and padded on the host by the C pass and moved as one int32 tensor, non-blocking, without
    their masks; the steps still read nothing of the device."""
    monkeypatch.setattr(kernel_policy, "_ENABLED", True)
    if join_library() is None:
        pytest.skip("no C compiler builds the library here")
    monkeypatch.setattr(plan, "check_not_meta", lambda *args: None)
    moved: list[torch.dtype] = []
    real = assembly.upload
    monkeypatch.setattr(assembly, "upload", lambda t, device: (moved.append(t.dtype), real(t, device))[1])
    copies = _BlockingCopies()
    _train(cfg, "meta", lambda: copies)
    assert copies.blocking == []
    assert moved and set(moved) == {torch.int32}, moved


def test_the_stand_in_catches_a_host_read(monkeypatch: pytest.MonkeyPatch) -> None:
    """The check can fail: with the meta device taken for one where host reads are free (the CPU's path: a
    ``unique`` of the ids, a read of how many are padding), the first step raises."""
    monkeypatch.setattr(plan, "check_not_meta", lambda *args: None)
    monkeypatch.setattr(dedup, "HOST_READ_DEVICE_TYPES", {"cpu", "meta"})
    with pytest.raises((NotImplementedError, RuntimeError), match="(?i)meta"):
        _train(next(c for c in CASES if c.id == "adagrad"), "meta")


@pytest.mark.parametrize("touched", [True, False])
def test_sink_rows_writes_the_tail_as_the_sink_row_ends(touched: bool) -> None:
    """The tail goes to the last row (5) with that row's new value when it is among the ids, else its old one."""
    sentinel, row5_old = 6, 55.0
    ids = torch.tensor([1, 3, 5 if touched else 4, sentinel, sentinel])
    old = torch.tensor([[11.0], [33.0], [row5_old if touched else 44.0], [row5_old], [row5_old]])  # at ids.clamp(max=5)
    new = torch.arange(5.0).view(5, 1)
    at, values = dedup.sink_rows(ids, new, old, sentinel)
    assert at.tolist() == [1, 3, 5 if touched else 4, 5, 5]
    assert values.view(-1).tolist() == ([0.0, 1.0, 2.0, 2.0, 2.0] if touched else [0.0, 1.0, 2.0, row5_old, row5_old])


def test_sink_rows_with_every_id_padding_changes_nothing() -> None:
    ids = torch.full((3,), 6)
    old = torch.full((3, 2), 7.0)  # row 5, gathered three times
    at, values = dedup.sink_rows(ids, torch.zeros(3, 2), old, 6)
    assert at.tolist() == [5, 5, 5] and torch.equal(values, old)


def test_sink_padding_adds_negative_zero() -> None:
    table = torch.tensor([[0.0], [-0.0], [float("nan")], [3.0]])
    ids, rows = dedup.sink_padding(torch.tensor([4, 4, 0]), torch.tensor([[5.0], [float("inf")], [1.0]]), 4)
    table.index_add_(0, ids, rows)
    assert ids.tolist() == [3, 3, 0] and table[3].item() == 3.0 and table[0].item() == 1.0
    assert torch.signbit(table[1]).item() and torch.isnan(table[2]).item()


def test_an_accelerator_step_dispatches_as_many_ops_at_100_features_as_at_1(monkeypatch: pytest.MonkeyPatch) -> None:
    """issue [host]'s step (T features stacked in one group, ``Padded`` host bags, ``mean``, a ``Linear`` head on
    ``concat=True``, Adam) on the meta device: the ops a steady step dispatches do not grow with T (≤ 1.3×), and
    the only host reads are of host data (the group's range check of its host ids)."""
    monkeypatch.setattr(plan, "check_not_meta", lambda *args: None)
    counts = {}
    for t in (1, 100):
        ec, head, names = _model(t, device="meta")
        opt = tte.optim.Adam([*ec.parameters(), *head.to("meta").parameters()], lr=0.01)
        data = host_batches(names, 4)
        for i in range(6):
            _step(ec, head, opt, data[i % 4], True)
        with _CountOps() as ops:
            _step(ec, head, opt, data[1], True)
        counts[t] = ops.counts
    total = {t: sum(c.values()) for t, c in counts.items()}
    print(f"ops per steady step on the meta device: {total}")
    assert total[100] <= 1.3 * total[1], total
    reads = 0 if join_library() is not None else 2  # aminmax's two; none where the C join checks (kernel library on)
    assert counts[100]["_local_scalar_dense"] == counts[1]["_local_scalar_dense"] == reads, counts


def test_an_accelerator_sgd_step_dispatches_as_many_ops_at_163840_ids_as_at_1280(monkeypatch: pytest.MonkeyPatch) -> None:
    """SGD's additive step on the meta device (an accelerator without the add kernel: CUDA with ``TTE_TRITON=0``):
    4 stacked tables of 8 columns, ``Padded`` bags of 20 host ids, ``concat=True``, batch 16 and 2,048. The ids are
    added in pieces of ``ADDITIVE_DEVICE_BYTES`` (64 MiB: 2,097,152 rows of 8 float32), not the CPU's 16,384: the ops
    of a steady step do not grow with the ids (at 2,048 bags they were 203 against 23 at 16: ten pieces of a dozen
    ops each). (A few more where a piece of more than half a chunk is added by itself, a smaller one waiting in the
    scratch buffer for others.)"""
    monkeypatch.setattr(plan, "check_not_meta", lambda *args: None)
    counts = {}
    for batch in (16, 2048):
        torch.manual_seed(0)
        features = {f"f{i}": tte.FeatureConfig(tte.TableConfig(5000, 8, name=f"t{i}", combiner="mean"),
                                               max_ids_per_bag=20) for i in range(4)}
        ec = tte.EmbeddingCollection(features, device="meta")
        opt = tte.optim.SGD(ec.parameters(), lr=0.1)
        g = torch.Generator().manual_seed(1)
        data = [{f: tte.Padded(torch.randint(0, 5000, (batch, 20), generator=g)) for f in features} for _ in range(2)]
        for i in range(4):
            ec(data[i % 2], concat=True).sum().backward()
            opt.step()
            opt.zero_grad()
        ec(data[1], concat=True).sum().backward()
        with _CountOps() as ops:
            opt.step()
        counts[batch] = sum(ops.counts.values())
    assert counts[2048] <= counts[16] + 3, counts
    print(f"ops of a steady SGD step on the meta device: {counts}")


@pytest.mark.usefixtures("compiler")
@pytest.mark.parametrize("cfg", [case(KERNEL_PATH, c) for c in ("lazy_adam-options", "rowwise_adagrad-accum-clipnorm",
                                                                "ftrl", "adafactor-options")], ids=str)
def test_the_accelerator_kernel_equals_its_reference_path(cfg: OptimizerConfig, monkeypatch: pytest.MonkeyPatch) -> None:
    """The compiled update (``Path.KERNEL``: Triton on CUDA, here inductor's C++ on the CPU forced onto the
    accelerator's path) of the static ids, sentinel tail and sink row included, against that path's reference
    (``Path.ROWS``), in lockstep as tests/optim/test_kernel_update.py compares the CPU's: within 1e-6 (float32)
    after every call. Four configurations (Adafactor's statistics over rows mask the tail): each compiles a kernel of
    its own (seconds)."""
    monkeypatch.setattr(dedup, "HOST_READ_DEVICE_TYPES", set())
    before = kernel_policy.set_policy(0, 0)
    try:
        kernel, ref = kernel_model(cfg, torch.float32), kernel_model(cfg, torch.float32)
        k = cfg.kwargs.get("gradient_accumulation_steps") or 1
        for s in range(4 * k):
            scale = float("inf") if cfg.kwargs.get("skip_nonfinite") and s == 3 else 1.0
            got, want = kernel_step(*kernel, s, scale, kernel=True), kernel_step(*ref, s, scale, kernel=False)
            if (s + 1) % k == 0:
                assert Path.KERNEL in got and Path.ROWS in want and Path.KERNEL not in want, (got, want)
            assert_same(kernel, ref, f"call {s}")
            with torch.no_grad():  # each call compared from the same state (a last-bit difference not carried on)
                for (a, sa), (b, sb) in zip(_tensors(*kernel), _tensors(*ref), strict=True):
                    a.copy_(b)
                    for n in sa:
                        sa[n].copy_(sb[n])
    finally:
        kernel_policy.set_policy(*before)


@pytest.mark.usefixtures("compiler")
@pytest.mark.parametrize(("cfg", "spread"), [pytest.param(case(SYNC_FREE, "adafactor"), False, id="adafactor-index-add"),
                                             pytest.param(case(SYNC_FREE, "adafactor-ema"), True, id="adafactor-ema-spread")])
def test_the_accelerator_kernel_of_a_stacked_group_gives_the_cpu_results(cfg: OptimizerConfig, spread: bool,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Adafactor's compiled update on the accelerator's path (forced on the CPU; ``spread``: its per-member sums over
    lanes, as CUDA takes them), from the third step: a stacked group (statistics per member, the sentinel tail
    masked, the sink row) and a table of its own, against the CPU's reference path (float64, 1e-8: the kernel sums
    in its own order). tests/package/test_cuda.py runs the same on CUDA."""
    weights, state = _train(cfg)
    monkeypatch.setattr(dedup, "HOST_READ_DEVICE_TYPES", set())
    taken = force_spread(monkeypatch) if spread else []
    ran: list[int] = []
    call = row_update.call

    def counted(fn: Any, args: tuple[Any, ...]) -> Any:
        ran.append(args[0].shape[0])
        return call(fn, args)

    monkeypatch.setattr(row_update, "call", counted)
    before, enabled = kernel_policy.set_policy(2, 0), kernel_policy.set_enabled(True)  # (the suite turns it off)
    try:
        got_weights, got_state = _train(cfg)
    finally:
        kernel_policy.set_policy(*before)
        kernel_policy.set_enabled(enabled)
    assert sorted(set(ran)) == [20, 70], ran  # both groups (c; a and b stacked) on the kernel
    assert bool(taken) == spread, taken  # (the sums traced into the kernel: spread over lanes, or index_add)
    for k, v in weights.items():
        torch.testing.assert_close(got_weights[k], v, rtol=1e-8, atol=1e-8, msg=lambda m, k=k: f"{k}: {m}")
    for key, slots in state.items():
        for slot, v in slots.items():
            torch.testing.assert_close(got_state[key][slot], v, rtol=1e-8, atol=1e-8, msg=lambda m, s=slot: f"{s}: {m}")


_FROZEN_CASES = [c for c in STACKED_CASES if c.id in ("adagrad-clipnorm", "lazy_adam-ema-accum-gclip", "adafactor")]
_FROZEN = [pytest.param(c, False, id=str(c)) for c in _FROZEN_CASES] + [
    pytest.param(c, True, id=f"{c}-spread") for c in _FROZEN_CASES if c.id == "adafactor"]


@pytest.mark.parametrize(("cfg", "spread"), _FROZEN)
def test_a_frozen_member_adds_nothing_to_what_sums_over_rows(cfg: OptimizerConfig, spread: bool,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """A frozen member of a stacked group has its ids made the sentinel (the lookup's backward), which the CPU drops
    and the accelerator keeps as the duplicate sum's tail: that tail must carry no rows into a sum over rows
    (``clipnorm`` per member, ``global_clipnorm``; Adafactor's statistics mask it, summed by ``index_add`` or, as on
    CUDA, spread over lanes). With the frozen rows kept it held their sum, and the other members trained up to 1e-2
    away from the CPU's (``adagrad-clipnorm``)."""
    _, want = _freeze_run(cfg, True, "module")
    monkeypatch.setattr(dedup, "HOST_READ_DEVICE_TYPES", set())
    taken = force_spread(monkeypatch) if spread else []
    _, got = _freeze_run(cfg, True, "module")
    assert bool(taken) == spread
    for n in ("a", "b", "c"):
        for k, v in want[n].items():
            if not k.startswith("acc_"):  # (the window's capacity follows the path: N entries, or U)
                torch.testing.assert_close(got[n][k], v, rtol=1e-12, atol=1e-14, msg=lambda m, w=f"{n}/{k}": f"{w}: {m}")


def test_a_negative_norm_sees_no_zero_row_of_the_sentinel_tail(monkeypatch: pytest.MonkeyPatch) -> None:
    """``tte.clip_grad_norm_`` with ``norm_type=-inf`` (the smallest |g| of the dense gradient, as torch's): every
    row of the table looked up leaves no zero row, on the accelerator's path too (its duplicate sum keeps a tail
    of zero rows, which the norm read as 0)."""
    monkeypatch.setattr(dedup, "HOST_READ_DEVICE_TYPES", set())
    ec = tte.EmbeddingCollection({"f": tte.FeatureConfig(tte.TableConfig(3, 2, name="t"))})
    (ec({"f": torch.tensor([0, 1, 2, 2])})["f"] * torch.tensor([1.0, 2.0])).sum().backward()
    i, r = ec.row_grads()["t"]
    want = torch.nn.utils.get_total_norm([torch.zeros(4, 2).index_add_(0, i, r)[:3]], -math.inf)
    assert float(tte.clip_grad_norm_(ec.parameters(), 1.0, norm_type=-math.inf)) == float(want) == 1.0


def test_a_learning_rate_schedule_copies_nothing_blocking(monkeypatch: pytest.MonkeyPatch) -> None:
    """A schedule sets a new learning rate each step (a float, or a host tensor): it travels to the device as the ids
    do, not by a blocking copy (on CUDA one waits for the device every step)."""
    monkeypatch.setattr(plan, "check_not_meta", lambda *args: None)
    ec = _collection("meta")
    opt = tte.optim.Adagrad(ec.parameters(), lr=0.1)
    head = {"fa": 4, "fb": 4, "fc": 3}
    for i, batch in enumerate(_batches()):
        copies = _BlockingCopies()
        opt.param_groups[0]["lr"] = 0.1 / (i + 1) if i % 2 else torch.tensor(0.1 / (i + 1))
        with copies:
            out = ec(batch)
            sum(out[f].sum() * d for f, d in head.items()).backward()  # type: ignore[union-attr]
            opt.step()
            opt.zero_grad()
        if i >= 2:  # (the first steps make the state and the cached bounds: once)
            assert copies.blocking == [], (i, copies.blocking)


@pytest.mark.parametrize("name", ["Adagrad", "RowWiseAdagrad"])
def test_clipnorm_per_table_copies_nothing_from_the_host(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A stacked group's ``clipnorm`` (each table's own norm) makes what it compares rows with on the device: a
    steady step copies from the host what the same step without ``clipnorm`` copies (the batch), nothing per step
    of its own (on XLA a transfer, on CUDA a pinned copy, each step)."""
    monkeypatch.setattr(plan, "check_not_meta", lambda *args: None)
    seen = {}
    for clip in ({}, {"clipnorm": 0.05}):
        ec = _collection("meta")
        opt = getattr(tte.optim, name)(ec.parameters(), lr=0.1, **clip)
        for i, batch in enumerate(_batches()):
            copies = _BlockingCopies()
            with copies if i == 4 else contextlib.nullcontext():
                out = ec(batch)
                sum(v.sum() for v in out.values()).backward()
                opt.step()
                opt.zero_grad()
        seen[bool(clip)] = copies.copies
    assert seen[True] == seen[False] != [], seen


def test_jagged_sparse_and_nested_host_ids_step_without_reading_the_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """The other host input forms (``Jagged``, a sparse COO tensor, a ``torch.nested`` jagged tensor) are converted
    on the host (their lengths are host data) and travel as the padded ones do: a steady step on the meta device
    reads nothing there and copies nothing from the host with a blocking copy."""
    monkeypatch.setattr(plan, "check_not_meta", lambda *args: None)
    t = tte.TableConfig(50, 4, name="t", combiner="mean", dtype=F64)
    u = tte.TableConfig(60, 4, name="u", combiner="sum", dtype=F64)
    ec = tte.EmbeddingCollection({"j": tte.FeatureConfig(t), "s": tte.FeatureConfig(t, name="s"),
                                  "n": tte.FeatureConfig(u, name="n")}, device="meta")
    opt = tte.optim.Adam(ec.parameters(), lr=0.1)
    for i in range(4):
        j = tte.Jagged(torch.tensor([1, 2, 3, 4 + i]), lengths=torch.tensor([1, 3]))
        sp = torch.sparse_coo_tensor(torch.tensor([[0, 1, 1], [0, 0, 1]]), torch.tensor([5, 6, 7 + i]), (2, 2))
        n = torch.nested.nested_tensor([torch.tensor([1, 2 + i]), torch.tensor([3])], layout=torch.jagged)
        copies = _BlockingCopies()
        with copies if i == 3 else contextlib.nullcontext():
            out = ec({"j": j, "s": sp, "n": n})
            sum(v.sum() for v in out.values()).backward()
            opt.step()
            opt.zero_grad()
    assert copies.blocking == []
