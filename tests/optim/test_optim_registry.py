"""The test registry is complete and agrees with the package: every optimizer of ``tte.optim`` has an
``OptimizerInfo`` (so none can be added without its numpy reference), and each entry's slot names,
shapes, initial values, arguments and capability flags are what its class does."""

from __future__ import annotations

import inspect

import numpy as np
import pytest
import torch
from optim_registry import (
    INFO_BY_NAME,
    OPTIMIZER_INFOS,
    SHARED_ARG_VALUES,
    SHARED_ERRORS,
    TARGETS,
    OptimizerInfo,
    cases,
    error_cases,
)

import torch_tpu_embedding as tte

V, D = 7, 3


def registered_classes() -> list[type]:
    base = tte.optim.RowSparseOptimizer
    objs = [getattr(tte.optim, n) for n in tte.optim.__all__]
    return [o for o in objs if inspect.isclass(o) and issubclass(o, base) and o is not base]


def test_every_optimizer_has_an_optimizer_info() -> None:
    missing_names = sorted(set(tte.OPTIMIZER_NAMES) - set(INFO_BY_NAME))
    assert not missing_names, f"add an OptimizerInfo to tests/optim_registry.py for {missing_names}"
    classes = {info.cls for info in OPTIMIZER_INFOS}
    missing = [c.__name__ for c in registered_classes() if c not in classes]
    assert not missing, f"add an OptimizerInfo to tests/optim_registry.py for {missing}"
    assert len(classes) == len(OPTIMIZER_INFOS)  # one entry per class
    assert sorted(INFO_BY_NAME) == sorted(tte.OPTIMIZER_NAMES)
    for info in OPTIMIZER_INFOS:
        assert info.cls.algorithm == info.name
        assert tte.optim.optimizer_class(info.name) is info.cls


@pytest.mark.parametrize("info", OPTIMIZER_INFOS, ids=str)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
def test_slot_names_shapes_and_initial_values(info: OptimizerInfo, dtype: torch.dtype) -> None:
    """The entry's slots of a [V, D] table (names, shapes, values from np_init) are the optimizer's."""
    torch.manual_seed(0)
    ec = tte.EmbeddingCollection({"f": tte.FeatureConfig(tte.TableConfig(V, D, name="t", dtype=dtype))})
    opt = info.cls(ec.parameters(), **info.default)
    opt.init_state()
    state = opt.state[ec.tables.t.weight]
    want = info.table_slots(opt.param_groups[0], (V, D))
    assert sorted(state) == sorted([*want, "step"])
    assert set(info.whole_slots) <= set(want)
    assert info.has_slots or "slot_creation_fn" not in info.shared_args
    for name, value in want.items():
        assert tuple(state[name].shape) == value.shape, name
        expected = torch.from_numpy(value).to(dtype).double().numpy()  # the float64 value, stored in dtype
        np.testing.assert_array_equal(state[name].double().numpy(), expected, err_msg=name)
        assert (name in info.whole_slots) == (value.shape[:1] != (V,)), name  # only row slots start with V


@pytest.mark.parametrize("info", OPTIMIZER_INFOS, ids=str)
@pytest.mark.parametrize("arg", sorted(SHARED_ARG_VALUES))
def test_shared_args_are_the_arguments_the_class_takes(info: OptimizerInfo, arg: str) -> None:
    """``shared_args`` decides which shared error cases run for an entry: it must be exact."""
    p = torch.nn.Parameter(torch.zeros(3, 2))
    kwargs = {"lr": 0.1, arg: SHARED_ARG_VALUES[arg]}
    if arg in info.shared_args:
        info.cls([p], **kwargs)
    else:
        with pytest.raises(TypeError):
            info.cls([p], **kwargs)


def test_shared_errors_use_only_shared_arguments() -> None:
    for e in SHARED_ERRORS:
        assert e.args <= set(SHARED_ARG_VALUES), e.id
    assert len(error_cases()) >= 25


@pytest.mark.parametrize("info", OPTIMIZER_INFOS, ids=str)
def test_stacked_and_no_dedup_flags(info: OptimizerInfo) -> None:
    """supports_stacked_groups / supports_no_dedup say what the constructor accepts."""
    tables = [tte.TableConfig(10, 4, name="x"), tte.TableConfig(12, 4, name="y")]
    ec = tte.EmbeddingCollection({t.name: tte.FeatureConfig(t) for t in tables}, stack_tables=True)
    if info.supports_stacked_groups:
        info.cls(ec.parameters(), **info.default)
    else:
        with pytest.raises(ValueError, match=f"optimizer '{info.name}' keeps per-table state"):
            info.cls(ec.parameters(), **info.default)
    p = torch.nn.Parameter(torch.zeros(3, 2))
    if info.supports_no_dedup:
        info.cls([p], **info.default, use_gradient_accumulation=False)
    else:
        with pytest.raises((TypeError, ValueError)):
            info.cls([p], **info.default, use_gradient_accumulation=False)


@pytest.mark.parametrize("info", [i for i in OPTIMIZER_INFOS if i.per_row_rule], ids=str)
def test_per_row_reference_rules_read_only_their_row(info: OptimizerInfo) -> None:
    """The flag per_row_rule holds for the numpy reference: rows updated apart == together."""
    opt = info.cls([torch.nn.Parameter(torch.zeros(V, D))], **info.default)
    hp = opt.param_groups[0]
    rng = np.random.default_rng(0)
    w, g = rng.normal(size=(V, D)), rng.normal(size=(V, D))
    slots = {k: v + rng.uniform(0.1, 1.0, size=v.shape) for k, v in info.table_slots(hp, (V, D)).items()}
    w_all, s_all = info.np_rule(hp, w, g, slots, 0.1, 3, V)
    for lo, hi in ((0, 2), (2, V)):
        w_part, s_part = info.np_rule(hp, w[lo:hi], g[lo:hi], {k: v[lo:hi] for k, v in slots.items()}, 0.1, 3, V)
        np.testing.assert_array_equal(w_part, w_all[lo:hi])
        for k in slots:
            np.testing.assert_array_equal(s_part[k], s_all[k][lo:hi])


@pytest.mark.parametrize("target", sorted(TARGETS))
def test_every_target_builds_its_configurations(target: str) -> None:
    """Each configuration constructs; an opt-out entry (flags) is absent, every other one present."""
    got = cases(target)
    assert got
    names = {c.info.name for c in got}
    t = TARGETS[target]
    for info in OPTIMIZER_INFOS:
        allowed = not t.requires or getattr(info, t.requires)
        if t.every:
            assert (info.name in names) == allowed, info.name
        elif not allowed:
            assert info.name not in names
    for c in got:
        c.make([torch.nn.Parameter(torch.zeros(3, 2))])
