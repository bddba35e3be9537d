"""The kernel eager row update (``Path.KERNEL``, ``optim/_kernels/row_update.py``) against the reference path
(``Path.ROW_CHUNKS``, or ``Path.ROWS`` for Adafactor's statistics over rows, which tests/optim/test_optim_reference.py
checks against float64 numpy), for every optimizer and option (tests/optim_registry.py, target ``kernel_path``); the
number of compilations over a loop whose batch sizes and id counts change every step (the fallbacks, when a kernel
cannot run: tests/optim/test_kernel_fallbacks.py).

The rest of the suite runs the reference path (tests/conftest.py sets ``TTE_UPDATE_KERNEL=0``): each
configuration compiles its own kernel, a few seconds each.
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from optim_registry import KERNEL_PATH, OptimizerConfig, cases

import torch_tpu_embedding as tte
from torch_tpu_embedding._rows.tables import table_info
from torch_tpu_embedding.optim._core import base, update_paths
from torch_tpu_embedding.optim._core.update_paths import Path, choose_path
from torch_tpu_embedding.optim._kernels import kernel_policy, row_update


def _path_of(cfg: OptimizerConfig, dtype: torch.dtype = torch.float32) -> Path:
    """The path of ``cfg`` with a lookup of bags of 3 ids pending, as in a step."""
    t = tte.TableConfig(4, 2, name="t", dtype=dtype)
    ec = tte.EmbeddingCollection({"f": tte.FeatureConfig(t, max_ids_per_bag=3)})
    ec.tables.t.row_grad.keep_factored = True  # as every step but the first has it
    ec({"f": tte.Padded(torch.tensor([[0, 1, 1], [2, 3, 0]]))})["f"].sum().backward()
    before = kernel_policy.set_enabled(True)
    try:
        return choose_path(ec.tables.t.weight, cfg.make(ec.parameters()).param_groups[0], row_grad=True)
    finally:
        kernel_policy.set_enabled(before)


# SGD without options adds rule(0, g) per id (Path.ADDITIVE): there is no row update to compile.
CASES = [c for c in cases(KERNEL_PATH) if _path_of(c) is Path.KERNEL]


needs_compiler = pytest.mark.usefixtures("compiler")


@pytest.fixture(autouse=True)
def kernel_from_the_first_step() -> Iterator[None]:
    """Every table here is small and every run short: the default policy (tests/optim/test_kernel_warmup.py)
    would keep them on the reference path."""
    before = kernel_policy.set_policy(0, 0)
    yield
    kernel_policy.set_policy(*before)


@pytest.fixture
def kernel_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel path on, with no kernel built yet: a test counts the kernels its own run builds (one built by an
    earlier test for the same configuration, whose numbers other than 0 and 1 are data, would count none)."""
    monkeypatch.setattr(kernel_policy, "_ENABLED", True)
    monkeypatch.setattr(row_update, "_KERNELS", {})


def model(cfg: OptimizerConfig, dtype: torch.dtype) -> tuple[tte.EmbeddingCollection, torch.nn.Linear, Any]:
    """Two features on one table (bags of up to 5 ids with padding, and single ids), a dense head."""
    torch.manual_seed(0)
    t = tte.TableConfig(300, 6, name="t", combiner="sqrtn", dtype=dtype)
    ec = tte.EmbeddingCollection({"a": tte.FeatureConfig(t, max_ids_per_bag=5), "b": tte.FeatureConfig(t)})
    head = torch.nn.Linear(6, 1).to(dtype)
    return ec, head, cfg.make([*ec.parameters(), *head.parameters()])


def step(ec: tte.EmbeddingCollection, head: torch.nn.Linear, opt: Any, s: int, scale: float, kernel: bool) -> list[Path]:
    """One training call on batch ``s``; the paths its updates took."""
    g = torch.Generator().manual_seed(s)
    ids = torch.randint(0, 300, (40, 5), generator=g)
    out = ec({"a": tte.Padded(ids, ids % 7 != 0), "b": torch.randint(0, 300, (40,), generator=g)})
    (head(out["a"] * out["b"]).square().sum() * scale).backward()
    ran: list[Path] = []
    real = update_paths.update

    def spy(item: Any) -> None:
        real(item)
        ran.append(item.path)  # after the update: a path that could not compile has become ROW_CHUNKS

    before = kernel_policy.set_enabled(kernel)
    base.update = spy  # type: ignore[assignment]
    try:
        opt.step()
    finally:
        base.update = real  # type: ignore[assignment]
        kernel_policy.set_enabled(before)
    opt.zero_grad()
    return ran


def assert_same(a: tuple[Any, ...], b: tuple[Any, ...], what: str) -> None:
    """Weights and every state tensor within 1e-6 (relative and absolute); a NaN where the other has one (the
    accumulation window's rows of a non-finite call, dropped by ``skip_nonfinite``)."""
    for (pa, sa), (pb, sb) in zip(_tensors(*a), _tensors(*b), strict=True):
        torch.testing.assert_close(pa, pb, rtol=1e-6, atol=1e-6, msg=lambda m: f"{what}: weight: {m}")
        assert sa.keys() == sb.keys()
        for k in sa:
            torch.testing.assert_close(sa[k], sb[k], rtol=1e-6, atol=1e-6, equal_nan=True,
                                       msg=lambda m, k=k: f"{what}: {k}: {m}")


def _tensors(ec: Any, head: Any, opt: Any) -> list[tuple[torch.Tensor, dict[str, torch.Tensor]]]:
    params = [*ec.parameters(), *head.parameters()]
    return [(p.detach(), dict(opt.state[p])) for p in params]


def run_lockstep(cfg: OptimizerConfig, dtype: torch.dtype = torch.float32, steps: int = 6) -> int:
    """The same calls on two copies, one kernel and one on the reference path, compared after every
    call; the kernel copy is then set to the reference's values, so each call is compared from the
    same state (differences in the last bit are not carried on). Returns the calls that were bitwise
    equal."""
    kernel, ref = model(cfg, dtype), model(cfg, dtype)
    if dtype == torch.float32:  # every call as in a long run: the lookups' rows kept factored
        for p in kernel[0].parameters():
            info = table_info(p)
            assert info is not None
            info.row_grad.keep_factored = True
    k = cfg.kwargs.get("gradient_accumulation_steps") or 1
    bitwise = 0
    for s in range(steps * k):
        scale = float("inf") if cfg.kwargs.get("skip_nonfinite") and s == 3 else 1.0
        got = step(*kernel, s, scale, kernel=True)
        want = step(*ref, s, scale, kernel=False)
        if (s + 1) % k == 0:
            assert Path.KERNEL in got or s == 0 and cfg.kwargs.get("use_gradient_accumulation") is False, got
            # (the reference of a rule with statistics over rows is one pass, ROWS)
            assert Path.KERNEL not in want and (Path.ROW_CHUNKS in want or Path.ROWS in want), want
        assert_same(kernel, ref, f"call {s}")
        pairs = list(zip(_tensors(*kernel), _tensors(*ref), strict=True))
        bitwise += all(torch.equal(a, b) and all(torch.equal(sa[n], sb[n]) for n in sa)
                       for (a, sa), (b, sb) in pairs)
        with torch.no_grad():
            for (a, sa), (b, sb) in pairs:
                a.copy_(b)
                for n in sa:
                    sa[n].copy_(sb[n])
    if cfg.kwargs.get("skip_nonfinite"):
        assert kernel[2].skipped_steps == ref[2].skipped_steps == 1
    return bitwise


@needs_compiler
@pytest.mark.parametrize("cfg", CASES, ids=str)
def test_kernel_update_equals_the_reference_path(cfg: OptimizerConfig) -> None:
    run_lockstep(cfg)


@needs_compiler
def test_16_bit_table_kernel_equals_reference() -> None:
    """bfloat16 weight, float32 slots and arithmetic (the backward multiplies the rows out from float32
    gains and rounds them to 16 bits, as on the reference path, before the float32 sum)."""
    run_lockstep(next(c for c in cases(KERNEL_PATH) if c.id == "lazy_adam"), dtype=torch.bfloat16)


@needs_compiler
@pytest.mark.parametrize("name", ["adagrad", "adafactor-stacked"])
def test_compiles_once_over_50_steps_of_changing_batches(kernel_on: None, name: str) -> None:
    """Batch size, bag widths and the number of distinct ids change every step: one kernel, one graph. Adafactor on a
    stacked group of two tables: its statistics per member table, over however many rows a step touches."""
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    t = tte.TableConfig(1000, 8, name="t", combiner="mean")
    u = tte.TableConfig(1000, 8, name="u", combiner="mean") if name == "adafactor-stacked" else t
    ec = tte.EmbeddingCollection({"f": tte.FeatureConfig(t), "g": tte.FeatureConfig(u, max_ids_per_bag=9)})
    # (Adagrad: RowWiseAdagrad and Adam run the fused C loop, tests/optim/test_c_rules.py, and compile nothing)
    opt = tte.optim.Adagrad(ec.parameters(), lr=0.01, initial_accumulator_value=0.3) if name == "adagrad" \
        else tte.optim.Adafactor(ec.parameters(), lr=0.01, epsilon_2=0.02)
    assert len(list(ec.parameters())) == 1
    gen = torch.Generator().manual_seed(2)
    kernels, graphs = row_update.compiled_kernels(), counters["stats"]["unique_graphs"]
    sizes = set()
    for step in range(50):
        n = int(torch.randint(2, 200, (), generator=gen))
        lengths = torch.randint(0, 10, (n,), generator=gen)
        ids = torch.randint(0, 1000 if step % 2 else 50, (int(lengths.sum()),), generator=gen)
        out = ec({"f": torch.randint(0, 1000, (n,), generator=gen), "g": tte.Jagged(ids, lengths=lengths)})
        (out["f"] * out["g"]).sum().backward()
        opt.step()
        opt.zero_grad()
        sizes.add(int(ids.numel()))
    assert len(sizes) > 40
    assert row_update.compiled_kernels() - kernels == 1
    assert counters["stats"]["unique_graphs"] - graphs == 1
    assert not any(p in row_update._REFERENCE_ONLY for p in ec.parameters())  # every step ran the kernel


@needs_compiler
def test_tables_of_distinct_sizes_share_one_kernel_and_one_graph(kernel_on: None) -> None:
    """Twelve unstacked tables of distinct sizes (more than torch.compile's recompiles per kernel): one
    kernel, one graph, every table on the kernel path, the reference path's numbers."""
    from torch._dynamo.utils import counters

    def build() -> tuple[tte.EmbeddingCollection, Any]:
        torch.manual_seed(0)
        tables = [tte.TableConfig(5 + 37 * i, 4, name=f"t{i}") for i in range(12)]
        ec = tte.EmbeddingCollection({f"f{i}": tte.FeatureConfig(t) for i, t in enumerate(tables)},
                                     stack_tables=False)
        return ec, tte.optim.Adagrad(ec.parameters(), lr=0.1, initial_accumulator_value=0.2)

    def train(ec: tte.EmbeddingCollection, opt: Any) -> None:
        gen = torch.Generator().manual_seed(4)
        for _ in range(3):
            out = ec({f"f{i}": torch.randint(0, 5 + 37 * i, (16,), generator=gen) for i in range(12)})
            sum((i + 1) * o.square().sum() for i, o in enumerate(out.values())).backward()
            opt.step()
            opt.zero_grad()

    kernels, graphs = row_update.compiled_kernels(), counters["stats"]["unique_graphs"]
    ours = build()
    train(*ours)
    assert row_update.compiled_kernels() - kernels == 1
    assert counters["stats"]["unique_graphs"] - graphs == 1
    assert not any(p in row_update._REFERENCE_ONLY for p in ours[0].parameters())
    before = kernel_policy.set_enabled(False)
    try:
        ref = build()
        train(*ref)
    finally:
        kernel_policy.set_enabled(before)
    for k, v in ref[0].state_dict().items():
        torch.testing.assert_close(ours[0].state_dict()[k], v, rtol=1e-6, atol=1e-7, msg=k)


@needs_compiler
@pytest.mark.parametrize(("name", "clipnorm"), [("lazy_adam", None), ("lazy_adam", 0.05), ("adafactor", None),
                                                ("adafactor", 0.05)], ids=["plain", "clipnorm", "adafactor",
                                                                            "adafactor-clipnorm"])
def test_stacked_table_group_and_state_dict_equal_the_reference_path(name: str, clipnorm: float | None) -> None:
    """Two tables in one stacked group (``stack_tables=True``), LazyAdam or Adafactor (its statistics per member
    table), the kernel update and the reference path in lockstep (as :func:`run_lockstep`): after every call the
    same ``state_dict`` keys and structure, values within 1e-6. ``clipnorm`` binds (gradient norms far above 0.05)
    and clips each table of the group by its own norm on both paths."""
    cfg = next(c for c in cases(KERNEL_PATH) if c.id == name)
    if clipnorm is not None:
        cfg = dataclasses.replace(cfg, kwargs={**cfg.kwargs, "clipnorm": clipnorm})

    def build() -> tuple[tte.EmbeddingCollection, Any]:
        torch.manual_seed(0)
        t, u = tte.TableConfig(300, 6, name="t", combiner="mean"), tte.TableConfig(120, 6, name="u")
        ec = tte.EmbeddingCollection({"a": tte.FeatureConfig(t, max_ids_per_bag=4), "b": tte.FeatureConfig(u)},
                                     stack_tables=True)
        return ec, cfg.make(ec.parameters())

    runs = {True: build(), False: build()}
    assert len(list(runs[True][0].parameters())) == 1  # one stacked parameter
    for s in range(4):
        for kernel, (ec, opt) in runs.items():
            g = torch.Generator().manual_seed(s)
            ids = torch.randint(0, 300, (30, 4), generator=g)
            out = ec({"a": tte.Padded(ids, ids % 5 != 0), "b": torch.randint(0, 120, (30,), generator=g)})
            (out["a"] * out["b"]).square().sum().backward()
            before = kernel_policy.set_enabled(kernel)
            real, ran = update_paths.update, []

            def spy(item: Any, ran: list[Path] = ran, real: Any = real) -> None:
                real(item)
                ran.append(item.path)

            base.update = spy  # type: ignore[assignment]
            try:
                opt.step()
            finally:
                base.update = real  # type: ignore[assignment]
                kernel_policy.set_enabled(before)
            assert ran == [Path.KERNEL if kernel else Path.ROWS if name == "adafactor" else Path.ROW_CHUNKS], ran
            opt.zero_grad()
        (ec_f, opt_f), (ec_r, opt_r) = [(ec.state_dict(), opt.state_dict()) for ec, opt in runs.values()]
        assert ec_f.keys() == ec_r.keys()
        for k in ec_f:
            torch.testing.assert_close(ec_f[k], ec_r[k], rtol=1e-6, atol=1e-6, msg=lambda m, k=k, s=s: f"call {s}: {k}: {m}")
        assert opt_f["param_groups"] == opt_r["param_groups"]
        assert opt_f["state"].keys() == opt_r["state"].keys()
        for key, st in opt_f["state"].items():
            assert st.keys() == opt_r["state"][key].keys()
            for n, v in st.items():
                torch.testing.assert_close(v, opt_r["state"][key][n], rtol=1e-6, atol=1e-6,
                                           msg=lambda m, n=n, s=s: f"call {s}: {n}: {m}")
        with torch.no_grad():  # the next call starts from the same state (last-bit differences not carried)
            (ec_a, opt_a), (ec_b, opt_b) = runs[True], runs[False]
            for a, b in zip(ec_a.parameters(), ec_b.parameters(), strict=True):
                a.copy_(b)
                for n, v in opt_a.state[a].items():
                    v.copy_(opt_b.state[b][n])


def test_a_16_bit_round_trip_keeps_the_reference_path() -> None:
    """A value rounded to 16 bits and read again (inductor's kernel would keep it in float32) takes the reference
    path: Adafactor's ``r`` stored in 16 bits (``Path.ROWS``), a 16-bit table's stored weight read by the moving
    average (``Path.ROW_CHUNKS``); the same configurations without it, the kernel."""
    ada = next(c for c in cases(KERNEL_PATH) if c.id == "adafactor")
    assert _path_of(ada) is Path.KERNEL
    assert _path_of(dataclasses.replace(ada, kwargs={**ada.kwargs, "row_stat_dtype": torch.bfloat16})) is Path.ROWS
    ema = next(c for c in cases(KERNEL_PATH) if c.id == "adagrad")
    ema = dataclasses.replace(ema, kwargs={**ema.kwargs, "use_ema": True})
    assert _path_of(ema) is Path.KERNEL
    assert _path_of(ema, torch.bfloat16) is Path.ROW_CHUNKS


def test_adafactor_on_a_table_split_over_processes_keeps_the_reference_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """A table sharded over a process group (``tte.distributed.shard``) sums Adafactor's statistics over the ranks too
    (``RowSpace.all_reduce``), which the kernel does not: ``Path.ROWS``; a per-row rule there keeps the kernel."""
    monkeypatch.setattr(update_paths, "process_group_placement", lambda p: object())  # (as a shard's table has one)
    ada = next(c for c in cases(KERNEL_PATH) if c.id == "adafactor")
    assert _path_of(ada) is Path.ROWS
    assert _path_of(next(c for c in cases(KERNEL_PATH) if c.id == "adagrad")) is Path.KERNEL


@needs_compiler
@pytest.mark.parametrize("name", ["adagrad", "adafactor"])
def test_a_dropped_window_counts_no_call_of_the_average(name: str) -> None:
    """``use_ema`` with ``gradient_accumulation_steps=2`` and ``skip_nonfinite``: the window whose last call is
    non-finite (call 3) is dropped, and none of its calls counts in the average's call counter (``ema_last``), on
    the kernel as on the reference path. The kernel counted one of them: ``ema_last`` one ahead, the average's
    catch-up of later steps off by up to 2× (measured before the fix)."""
    cfg = next(c for c in cases(KERNEL_PATH) if c.id == name)
    run_lockstep(dataclasses.replace(cfg, kwargs={**cfg.kwargs, "use_ema": True, "ema_momentum": 0.8,
                                                  "gradient_accumulation_steps": 2, "skip_nonfinite": True}))


@needs_compiler
@pytest.mark.parametrize("name", ["adagrad", "rowwise_adagrad", "lazy_adam", "adafactor"])
@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
@pytest.mark.parametrize("chunk", [None, 3], ids=["one-range", "ranges-of-3"])
@pytest.mark.parametrize("weighted", [True, False], ids=["weights", "no-weights"])
def test_summed_rows_by_range_equal_the_reference_path(name: str, combiner: str, chunk: int | None, weighted: bool,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The duplicate sum of the kernel path (ids sorted once, rows summed by ``embedding_bag`` a range of
    ids at a time, ``optim/_kernels/row_sums.py``) against the reference path, within 1e-6 after every call: two
    features on one table (bags of up to 6 ids with per-id weights, or without (one gain per bag, applied
    once per bag), heavy duplicates and empty bags; one
    id per bag; a jagged feature, whose rows arrive multiplied out), every combiner; ``ranges-of-3``: the
    kernel runs on ranges of 3 ids (a last range of 1 id joins the one before), as on 16,384 at full size; Adafactor,
    whose statistics span the rows, in one call all the same. Each call starts from the reference's state (last-bit
    differences of the sums are not carried on)."""
    if chunk is not None:
        monkeypatch.setattr(row_update, "chunk_rows", lambda dim: chunk)
        assert row_update._spans(22, 7) == [(0, 7), (7, 14), (14, 22)]  # 1 left over: joined
    cfg = next(c for c in cases(KERNEL_PATH) if c.id == name)

    def build() -> tuple[tte.EmbeddingCollection, Any]:
        torch.manual_seed(0)
        t = tte.TableConfig(60, 5, name="t", combiner=combiner)
        ec = tte.EmbeddingCollection({"a": tte.FeatureConfig(t, max_ids_per_bag=6), "b": tte.FeatureConfig(t),
                                      "c": tte.FeatureConfig(t)})
        ec.tables.t.row_grad.keep_factored = True  # as every step but the first has it
        return ec, cfg.make(ec.parameters())

    runs = {True: build(), False: build()}
    real = update_paths.update
    for s in range(3):
        ran: dict[bool, set[Path]] = {}
        for kernel, (ec, opt) in runs.items():
            g = torch.Generator().manual_seed(s)
            ids = torch.randint(0, 12, (25, 6), generator=g)  # 12 of 60 rows: many duplicates
            mask = torch.rand(25, 6, generator=g) < 0.7
            mask[::5] = False  # empty bags
            lengths = torch.randint(0, 4, (9,), generator=g)
            w = torch.rand(25, 6, generator=g) + 0.5
            out = ec({"a": tte.Padded(ids, mask, w if weighted else None),
                      "b": torch.randint(0, 60, (25,), generator=g),
                      "c": tte.Jagged(torch.randint(0, 60, (int(lengths.sum()),), generator=g), lengths=lengths)})
            ((out["a"] * out["b"]).square().sum() + out["c"].sum() * 3).backward()
            paths: list[Path] = []

            def spy(item: Any, paths: list[Path] = paths) -> None:
                real(item)
                paths.append(item.path)

            before = kernel_policy.set_enabled(kernel)
            monkeypatch.setattr("torch_tpu_embedding.optim._core.base.update", spy)
            try:
                opt.step()
            finally:
                kernel_policy.set_enabled(before)
                monkeypatch.setattr("torch_tpu_embedding.optim._core.base.update", real)
            opt.zero_grad()
            ran[kernel] = set(paths)
        assert ran == {True: {Path.KERNEL}, False: {Path.ROWS if name == "adafactor" else Path.ROW_CHUNKS}}, ran
        pairs = zip(*[[(p.detach(), dict(opt.state[p])) for p in ec.parameters()] for ec, opt in runs.values()],
                    strict=True)
        for (a, sa), (b, sb) in pairs:
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, msg=lambda m, s=s: f"call {s}: {m}")
            for k in sa:
                torch.testing.assert_close(sa[k], sb[k], rtol=1e-6, atol=1e-6,
                                           msg=lambda m, k=k, s=s: f"call {s}: {k}: {m}")
            with torch.no_grad():  # the next call starts from the same state (as run_lockstep)
                a.copy_(b)
                for k in sa:
                    sa[k].copy_(sb[k])


def test_tables_on_two_gpus_get_kernels_of_their_own() -> None:
    """The kernel cache's key holds the device with its index: a kernel compiled for a table on ``cuda:0`` is
    guarded on that device by torch.compile, so an equal table on ``cuda:1`` sharing it recompiled at each switch
    until the recompile limit sent both to the reference path. (Two GPUs stood in for by tensors that report them.)"""
    def on(index: int) -> Any:
        class OnGpu(torch.Tensor):
            @property
            def device(self) -> torch.device:  # type: ignore[override]
                return torch.device("cuda", index)
        return torch.zeros(4, 2).as_subclass(OnGpu)

    opt = tte.optim.Adagrad([torch.nn.Parameter(torch.zeros(4, 2))], lr=0.1)
    keys = [row_update._key(types.SimpleNamespace(p=on(i), group=opt.param_groups[0], state={}, gate=None),  # type: ignore[arg-type]
                            (), (), ()) for i in (0, 1, 1)]
    assert keys[0] != keys[1] and keys[1] == keys[2]


@needs_compiler
@pytest.mark.parametrize("name", ["adagrad_momentum", "adam"])
def test_a_momentum_schedule_compiles_one_kernel(kernel_on: None, name: str) -> None:
    """OneCycleLR and CyclicLR (``cycle_momentum``, their default) write a new ``momentum`` or ``betas[0]`` into
    every group at every step: the kernel takes them as data, as it takes the learning rate. They were constants
    of it, so each step compiled a kernel of its own (seconds each) and kept it. The numbers: the reference path's."""
    def run(kernel: bool) -> tuple[tte.EmbeddingCollection, Any]:
        torch.manual_seed(0)
        ec = tte.EmbeddingCollection({"f": tte.FeatureConfig(tte.TableConfig(300, 6, name="t"), max_ids_per_bag=4)})
        opt = tte.optim.AdagradMomentum(ec.parameters(), lr=0.1, momentum=0.9) if name == "adagrad_momentum" \
            else tte.optim.Adam(ec.parameters(), lr=0.1, weight_decay_factor=0.01,  # (weight decay: not the C loop)
                                 bias_correction=True)  # (betas^t: in the step's dtype, not float64: 3e-5 apart)
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.5, total_steps=8)
        gen, before = torch.Generator().manual_seed(1), kernel_policy.set_enabled(kernel)
        try:
            for _ in range(5):
                ec({"f": tte.Padded(torch.randint(0, 300, (40, 4), generator=gen))})["f"].square().sum().backward()
                opt.step()
                opt.zero_grad()
                sched.step()
        finally:
            kernel_policy.set_enabled(before)
        return ec, opt

    kernels = row_update.compiled_kernels()
    (ours, opt), (ref, ref_opt) = run(True), run(False)
    assert row_update.compiled_kernels() - kernels == 1
    assert not any(p in row_update._REFERENCE_ONLY for p in ours.parameters())
    torch.testing.assert_close(ours.tables.t.weight, ref.tables.t.weight, rtol=1e-6, atol=1e-6)
    for k, v in opt.state_dict()["state"]["table:t"].items():
        torch.testing.assert_close(v, ref_opt.state_dict()["state"]["table:t"][k], rtol=1e-6, atol=1e-6, msg=k)
