"""``Path.ADDITIVE``'s C add (``optim/_kernels/c_add.py``) against the eager path it replaces: bitwise the same
tables after several SGD steps, at 1 and 2 threads, through the per-feature dict and ``concat=True``, with ids
repeated within and across features, padded bags, a jagged feature with per-id weights and an empty bag, and
pieces of one id, bags of 3 ids (sum, mean, sqrtn); the loop alone against torch's ``mul``, ``spread`` and
``index_add_`` for contiguous, column-sliced and broadcast gradient rows, padding skipped; an id outside the table
or a wrong shape raises and writes nothing; where it does not run (warm-up, ``loss_scale_factor``, the path turned
off), and one warning, then the eager path, when no C compiler works; the compiled library kept for later
processes, loaded without a compile, compiled again when damaged, never loaded from a cache others may write, and
compiled in the temporary directory when the cache's libraries cannot load (a noexec mount).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import torch_tpu_embedding as tte
from torch_tpu_embedding.optim._kernels import c_add, c_library, kernel_policy


@pytest.fixture
def c_loop() -> Any:
    """The compiled C loop; skips where this machine has no working C compiler (the eager add then runs)."""
    fn = c_add.loop()
    if fn is None:
        pytest.skip("no C compiler builds the add here")
    return fn


@pytest.fixture
def kernel_calls(monkeypatch: pytest.MonkeyPatch, c_loop: Any) -> Iterator[list[int]]:
    """The C add on (from the first step, as the default policy has it from call 50 on), and the number of
    ids of each piece it added."""
    monkeypatch.setattr(kernel_policy, "_ENABLED", True)
    before = kernel_policy.set_policy(0, 0)
    calls: list[int] = []
    real = c_add.add_piece

    def counted(fn: Any, p: torch.Tensor, ids: torch.Tensor, *rest: Any) -> None:
        calls.append(int(ids.numel()))
        real(fn, p, ids, *rest)

    monkeypatch.setattr(c_add, "add_piece", counted)
    yield calls
    kernel_policy.set_policy(*before)


def _model(width: int = 1, combiner: str = "sum", **opt: Any) -> tuple[tte.EmbeddingCollection, tte.optim.SGD]:
    torch.manual_seed(0)
    tables = [tte.TableConfig(50, 8, name=f"t{i}", combiner=combiner) for i in range(3)]
    features = {"a": tte.FeatureConfig(tables[0], max_ids_per_bag=width), "b": tte.FeatureConfig(tables[1]),
                "c": tte.FeatureConfig(tables[0]), "d": tte.FeatureConfig(tables[2])}
    ec = tte.EmbeddingCollection(features)
    return ec, tte.optim.SGD(ec.parameters(), lr=0.3, **opt)


def _batch(step: int, b: int = 16, width: int = 1) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step)
    ids = [torch.randint(0, 6, (b,), generator=g) for _ in range(3)]  # 6 of 50 rows: ids repeat
    a = torch.randint(0, 6, (b, width), generator=g)
    mask = torch.rand(b, width, generator=g) > 0.3  # padding in feature "a"
    return {"a": tte.Padded(a, mask), "b": ids[0], "c": ids[1],
            # per-id weights, a bag of 2 and one of none
            "d": tte.Jagged(ids[2], lengths=torch.tensor([1] * (b - 2) + [2, 0]), weights=torch.rand(b, generator=g))}


def _train(ec: tte.EmbeddingCollection, opt: torch.optim.Optimizer, steps: int, concat: bool,
           batch: Any = _batch, **kw: Any) -> list[torch.Tensor]:
    for s in range(steps):
        x = batch(s, **kw)
        if concat:
            out = ec(x, concat=True)
        else:
            parts = ec(x)
            out = torch.cat([parts[f] for f in ("a", "b", "c", "d")], dim=1)
        (out * torch.linspace(-1, 2, out.shape[1])).square().sum().backward()
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in ec.parameters()]


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("concat", [False, True], ids=["dict", "concat"])
@pytest.mark.parametrize(("width", "combiner"), [(1, "sum"), (3, "sum"), (3, "mean"), (3, "sqrtn")])
def test_c_add_is_the_eager_path_bitwise(kernel_calls: list[int], threads: int, concat: bool, width: int,
                                         combiner: str) -> None:
    """Feature "a" holds padded bags of ``width`` ids; "d" weighted jagged bags (a bag of 2, an empty one)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = _train(*_model(width, combiner), 4, concat, width=width)
        assert kernel_calls and all(n >= 1 for n in kernel_calls)  # it ran, never on no ids
        kernel_policy.set_enabled(False)
        want = _train(*_model(width, combiner), 4, concat, width=width)
    finally:
        torch.set_num_threads(before)
        kernel_policy.set_enabled(True)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)


def test_pieces_of_one_id_and_padding_only(kernel_calls: list[int]) -> None:
    """Batches of one bag and a padded feature with every position masked: pieces of one id are added by the
    loop too, and a piece of padding alone changes nothing (the loop skips the sentinel); a piece of none is
    not passed to it."""
    def batch(step: int) -> dict[str, Any]:
        x = _batch(step, b=1)
        x["a"] = tte.Padded(x["a"].ids, torch.zeros(1, 1, dtype=torch.bool))
        x["d"] = tte.Jagged(torch.tensor([step % 6]), lengths=torch.tensor([1]))
        return x

    got = _train(*_model(), 3, False, batch=batch)
    assert 1 in kernel_calls and 0 not in kernel_calls
    kernel_policy.set_enabled(False)
    try:
        want = _train(*_model(), 3, False, batch=batch)
    finally:
        kernel_policy.set_enabled(True)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("layout", ["contiguous", "column_slice", "broadcast"])
def test_the_loop_is_torch_mul_and_index_add(c_loop: Any, layout: str) -> None:
    """One piece through the loop against ``index_add_(ids, factor · g)`` in torch, ids repeated."""
    g = torch.Generator().manual_seed(1)
    p = torch.randn(40, 24, generator=g)
    ids = torch.randint(0, 40, (300,), generator=g)
    wide = torch.randn(300, 72, generator=g)
    rows = {"contiguous": wide[:, :24].contiguous(), "column_slice": wide[:, 24:48],
            "broadcast": torch.randn(1, 24, generator=g).expand(300, 24)}[layout]
    factor = -torch.tensor(0.37)
    want = p.clone().index_add_(0, ids, factor * rows)
    c_add.add_piece(c_loop, p, ids, rows, None, factor, torch.empty(24))
    assert torch.equal(p, want)


@pytest.mark.parametrize("layout", ["contiguous", "column_slice", "broadcast"])
def test_the_loop_on_bags_is_torch_spread_and_index_add(c_loop: Any, layout: str) -> None:
    """Bags of 5 ids with their gains, padding (the sentinel 40) among them: each id gets ``gain · (factor · g)``
    of its bag, as the eager path spreads and adds it (``BagRows.spread``, ``index_add_``)."""
    g = torch.Generator().manual_seed(2)
    p = torch.randn(40, 24, generator=g)
    ids = torch.randint(0, 41, (60, 5), generator=g)
    gains = torch.rand(60, 5, generator=g)
    wide = torch.randn(60, 72, generator=g)
    rows = {"contiguous": wide[:, :24].contiguous(), "column_slice": wide[:, 24:48],
            "broadcast": torch.randn(1, 24, generator=g).expand(60, 24)}[layout]
    factor = -torch.tensor(0.37)
    spread = (gains.unsqueeze(-1) * (factor * rows).unsqueeze(1)).reshape(-1, 24)
    keep = ids.reshape(-1) != 40
    want = p.clone().index_add_(0, ids.reshape(-1)[keep], spread[keep])
    c_add.add_piece(c_loop, p, ids.reshape(-1), rows, gains, factor, torch.empty(24))
    assert torch.equal(p, want)


def test_the_loop_skips_padding(c_loop: Any) -> None:
    """The sentinel (one past the last row) marks padding: skipped, as the eager path drops it."""
    p = torch.zeros(10, 4)
    ids = torch.tensor([10, 1, 10, 2, 1, 10])
    rows = torch.arange(24, dtype=torch.float32).view(6, 4)
    c_add.add_piece(c_loop, p, ids, rows, None, torch.tensor(-0.5), torch.empty(4))
    keep = ids != 10
    assert torch.equal(p, torch.zeros(10, 4).index_add_(0, ids[keep], -0.5 * rows[keep]))


@pytest.mark.parametrize("bad", ["id_above", "id_below", "rows_shape", "ids_dtype", "gains_shape", "scratch"])
def test_the_loop_refuses_what_it_cannot_add_and_writes_nothing(c_loop: Any, bad: str) -> None:
    p = torch.zeros(10, 4)
    ids = torch.tensor([1, 2, 3])
    rows = torch.ones(3, 4)
    if bad == "id_above":  # (10 is the sentinel: padding)
        ids = torch.tensor([1, 11, 3])
    if bad == "id_below":
        ids = torch.tensor([1, -1, 3])
    if bad == "rows_shape":
        rows = torch.ones(3, 5)
    if bad == "ids_dtype":
        ids = ids.to(torch.int32)
    gains = torch.ones(3, 2) if bad == "gains_shape" else None  # (3 ids are not 3 bags of 2)
    inc = torch.empty(2 if bad == "scratch" else 4)
    with pytest.raises(IndexError if bad.startswith("id_") else ValueError):
        c_add.add_piece(c_loop, p, ids, rows, gains, torch.tensor(-0.5), inc)
    assert not p.any()


@pytest.mark.parametrize("operand", ["rows", "gains", "ids"])
def test_the_loop_refuses_a_zero_tensor_and_writes_nothing(c_loop: Any, operand: str) -> None:
    """A zero tensor (``torch._efficientzerotensor``) has no memory: its pointer is null, and the loop read through
    it and crashed the process (SIGSEGV). Refused (``ValueError``), nothing written."""
    p, ids, rows, gains = torch.zeros(10, 4), torch.tensor([1, 2, 3]), torch.ones(3, 4), torch.ones(3, 1)
    if operand == "rows":
        rows = torch._efficientzerotensor(3, 4)
    elif operand == "gains":
        gains = torch._efficientzerotensor(3, 1)
    else:
        ids = torch._efficientzerotensor(3, dtype=torch.int64)
    with pytest.raises(ValueError, match="add_piece"):
        c_add.add_piece(c_loop, p, ids, rows, gains, torch.tensor(-0.5), torch.empty(4))
    assert not p.any()


@pytest.mark.parametrize("case", ["warming_up", "loss_scale_factor", "disabled"])
def test_where_the_eager_path_runs(kernel_calls: list[int], case: str) -> None:
    if case == "warming_up":
        kernel_policy.set_policy(after=50)
    if case == "disabled":
        kernel_policy.set_enabled(False)
    try:
        ec, opt = _model(**({"loss_scale_factor": 4.0} if case == "loss_scale_factor" else {}))
        _train(ec, opt, 1, False)  # (a first step's rows arrive multiplied out: any path takes them)
        kernel_calls.clear()
        _train(ec, opt, 2, False)
    finally:
        kernel_policy.set_enabled(True)
    assert kernel_calls == []


@pytest.mark.parametrize(("cc", "why"), [
    ("/nonexistent/bin/cc", "/nonexistent/bin/cc"),  # no such compiler
    ("true", "add_rows.so"),  # "succeeds" and writes nothing
    ("cc -include /nonexistent/tte.h", "failed"),  # fails, with and without -march=native
    ("cc -Dtte_add_rows=another_name", "tte_add_rows"),  # a library without the loop's symbol
], ids=["missing", "no_output", "fails", "no_symbol"])
def test_without_a_c_compiler_it_warns_once_and_the_eager_path_runs(monkeypatch: pytest.MonkeyPatch, cc: str,
                                                                      why: str, tmp_path: Path) -> None:
    if cc.startswith("cc ") and c_library.c_compiler() is None:
        pytest.skip("no cc here")
    monkeypatch.setenv("CC", cc)
    monkeypatch.setenv("TTE_KERNEL_CACHE", str(tmp_path))  # (nothing cached there to load instead)
    monkeypatch.setattr(kernel_policy, "_ENABLED", True)
    monkeypatch.setattr(kernel_policy, "_WARNED", False)
    monkeypatch.setattr(c_library, "_LIBRARY", [])
    before = kernel_policy.set_policy(0, 0)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = _train(*_model(), 3, True)
        kernel_policy.set_enabled(False)
        want = _train(*_model(), 3, True)
    finally:
        kernel_policy.set_policy(*before)
        kernel_policy.set_enabled(True)
    msgs = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(msgs) == 1 and why in msgs[0], msgs
    assert c_library._LIBRARY == [None]  # not tried again
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)


# ------------------------------------------------------------------------------------- the kernel cache
def _compiles(monkeypatch: pytest.MonkeyPatch) -> list[list[str]]:
    """Every compiler command the loop's build runs from now on."""
    runs: list[list[str]] = []
    real = c_library.subprocess.run

    def counted(cmd: list[str], **kw: Any) -> Any:
        runs.append(cmd)
        return real(cmd, **kw)

    monkeypatch.setattr(c_library.subprocess, "run", counted)
    return runs


def _check_loop(fn: Any) -> None:
    """``fn`` is the loop: one piece against torch's ``index_add_``."""
    p, ids, rows = torch.zeros(8, 4), torch.tensor([1, 5, 1]), torch.arange(12.0).view(3, 4)
    want = p.clone().index_add_(0, ids, -0.5 * rows)
    c_add.add_piece(fn, p, ids, rows, None, torch.tensor(-0.5), torch.empty(4))
    assert torch.equal(p, want)


@pytest.fixture
def fresh_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, c_loop: Any) -> Path:
    """An empty kernel cache, and no loop built in this process yet."""
    monkeypatch.setenv("TTE_KERNEL_CACHE", str(tmp_path / "kernels"))
    monkeypatch.setattr(c_library, "_LIBRARY", [])
    monkeypatch.setattr(c_library, "_REFUSED", [])
    return tmp_path / "kernels"


def test_a_later_process_loads_the_loop_from_the_cache(monkeypatch: pytest.MonkeyPatch, fresh_cache: Path) -> None:
    """The first build compiles and keeps the library (private to this user); the next build, as a new
    process's first, loads it without running the compiler."""
    runs = _compiles(monkeypatch)
    _check_loop(c_add.loop())
    assert runs, "the first build compiles"
    kept = list(fresh_cache.glob("add_rows-*.so"))
    assert len(kept) == 1 and not kept[0].stat().st_mode & 0o022 and not fresh_cache.stat().st_mode & 0o077
    assert [p.name for p in fresh_cache.iterdir()] == [kept[0].name]  # (its temporary directory is gone)
    runs.clear()
    monkeypatch.setattr(c_library, "_LIBRARY", [])
    _check_loop(c_add.loop())
    assert runs == []


def test_a_damaged_cached_library_is_compiled_again_and_replaced(monkeypatch: pytest.MonkeyPatch,
                                                                 fresh_cache: Path) -> None:
    c_add.loop()
    (kept,) = fresh_cache.glob("add_rows-*.so")
    bad = fresh_cache / "bad"
    bad.write_bytes(b"not a library")
    bad.chmod(0o700)
    os.replace(bad, kept)  # (a new file: the library this process loaded stays mapped as it was)
    runs = _compiles(monkeypatch)
    monkeypatch.setattr(c_library, "_LIBRARY", [])
    _check_loop(c_add.loop())
    assert runs
    assert kept.read_bytes()[:4] == b"\x7fELF"


@pytest.mark.parametrize("case", ["off", "shared_directory", "shared_library"])
def test_the_cache_is_not_used_when_off_or_writable_by_others(monkeypatch: pytest.MonkeyPatch, fresh_cache: Path,
                                                              case: str) -> None:
    """``TTE_KERNEL_CACHE=0`` keeps nothing; a cache directory or library that others may write is never loaded
    from (a library there runs as this user): every build compiles."""
    if case == "off":
        monkeypatch.setenv("XDG_CACHE_HOME", str(fresh_cache))
        monkeypatch.setenv("HOME", str(fresh_cache))
        monkeypatch.setenv("TTE_KERNEL_CACHE", "0")
    else:
        c_add.loop()
        monkeypatch.setattr(c_library, "_LIBRARY", [])
        (kept,) = fresh_cache.glob("add_rows-*.so")
        (fresh_cache if case == "shared_directory" else kept).chmod(0o777)
    runs = _compiles(monkeypatch)
    if case == "shared_directory":  # (the user set a cache that is not used: told so, once)
        with pytest.warns(RuntimeWarning, match="is not used: directory .* may be written by other users"):
            _check_loop(c_add.loop())
    else:
        _check_loop(c_add.loop())
    assert runs
    if case == "off":
        assert not fresh_cache.exists()


@pytest.mark.parametrize("value", ["1", "true", " On ", "yes"])
def test_a_value_that_turns_the_cache_on_is_the_default_directory(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                                  value: str) -> None:
    """``TTE_KERNEL_CACHE=1`` (as the other ``TTE_*`` switches are turned on) keeps the cache where it is by default,
    not in a directory named ``1`` made in whatever directory the process runs in."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TTE_KERNEL_CACHE", value)
    assert c_library.cache_dir() == str(tmp_path / "xdg" / "torch_tpu_embedding" / "kernels")
    monkeypatch.setenv("TTE_KERNEL_CACHE", "kernels-here")  # (a relative path: from the working directory)
    assert c_library.cache_dir() == str(tmp_path / "kernels-here")


def test_without_a_home_nothing_is_kept_in_the_working_directory(monkeypatch: pytest.MonkeyPatch,
                                                                  tmp_path: Path) -> None:
    """No ``HOME`` and no passwd entry (a container run as an arbitrary uid): ``~`` stays ``~``, and the cache was
    ``~/.cache/...`` relative to the working directory (a directory ``~`` made there). Nothing is kept then; a
    relative ``XDG_CACHE_HOME`` is ignored (its specification) for the home's."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("TTE_KERNEL_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/cache")
    monkeypatch.setattr(os.path, "expanduser", lambda path: path)  # (what Python does without HOME nor passwd)
    assert c_library.cache_dir() is None
    monkeypatch.undo()
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/cache")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("TTE_KERNEL_CACHE", raising=False)
    assert c_library.cache_dir() == str(tmp_path / "home" / ".cache" / "torch_tpu_embedding" / "kernels")


def test_a_cache_whose_libraries_cannot_load_compiles_in_the_temporary_directory(monkeypatch: pytest.MonkeyPatch,
                                                                                 fresh_cache: Path) -> None:
    """As on a ``noexec`` mount: the library compiled in the cache does not load there, so it is compiled again in
    the system's temporary directory and runs; nothing is kept."""
    real = c_library._load

    def load(fd: int, lib: str) -> Any:  # (loaded through the descriptor fd: lib says where it lies)
        if lib.startswith(str(fresh_cache)):
            raise OSError(f"{lib}: failed to map segment from shared object")
        return real(fd, lib)

    monkeypatch.setattr(c_library, "_load", load)
    runs = _compiles(monkeypatch)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _check_loop(c_add.loop())
    assert len(runs) == 2  # ([..., '-o', library]: first in the cache, then not)
    assert runs[0][-1].startswith(str(fresh_cache)) and not runs[1][-1].startswith(str(fresh_cache))
    assert list(fresh_cache.iterdir()) == []
