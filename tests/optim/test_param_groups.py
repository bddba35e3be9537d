"""torch.optim conformance of parameter groups and construction (issue 29, items 1 and 6).

Every option an optimizer's constructor takes means the same in a parameter group (checked against
a run where the constructor gets it); a key the constructor refuses raises ``TypeError`` in a group
too, naming the key and the group; construction refuses what torch.optim refuses, with its errors.
"""

from __future__ import annotations

import inspect

import pytest
import torch
from optim_registry import OPTIMIZER_INFOS, OptimizerInfo
from test_optim_generic import make_model, train

import torch_tpu_embedding as tte


def _slots_plus(p: torch.Tensor, names: tuple[str, ...], init: dict[str, float]) -> dict[str, torch.Tensor]:
    """Every slot shaped like the parameter, at its initial value + 0.25."""
    return {n: torch.full(p.shape, init[n] + 0.25, dtype=p.dtype) for n in names}


def _row_slots_plus(p: torch.Tensor, names: tuple[str, ...], init: dict[str, float]) -> dict[str, torch.Tensor]:
    """RowWiseAdagrad's: one accumulator per row (per element below rank 2)."""
    rows = p.shape[:1] if p.dim() >= 2 else p.shape
    return {n: torch.full(rows, init[n] + 0.25, dtype=p.dtype) for n in names}


COMMON = {
    "lr": {"lr": 0.05},
    "use_gradient_accumulation": {"use_gradient_accumulation": False},
    "clip_weight_min": {"clip_weight_min": -0.05},
    "clip_weight_max": {"clip_weight_max": 0.05},
    "weight_decay_factor": {"weight_decay_factor": 0.1},
    "multiply_weight_decay_factor_by_learning_rate": {"weight_decay_factor": 0.1,
                                                      "multiply_weight_decay_factor_by_learning_rate": True},
    "clipvalue": {"clipvalue": 0.01},
    "slot_creation_fn": {"slot_creation_fn": _slots_plus},
    "clipnorm": {"clipnorm": 0.01},
    "global_clipnorm": {"global_clipnorm": 0.01},
    "use_ema": {"use_ema": True},
    "ema_momentum": {"use_ema": True, "ema_momentum": 0.5, "ema_overwrite_frequency": 2},
    "ema_overwrite_frequency": {"use_ema": True, "ema_overwrite_frequency": 2},
    "loss_scale_factor": {"loss_scale_factor": 4.0, "clipvalue": 0.01},
    "gradient_accumulation_steps": {"gradient_accumulation_steps": 2},
    "skip_nonfinite": {"skip_nonfinite": True},
}
OWN = {
    "sgd": {},
    "adagrad": {"initial_accumulator_value": {"initial_accumulator_value": 0.5}},
    "adagrad_momentum": {"momentum": {"momentum": 0.5}, "use_nesterov": {"momentum": 0.5, "use_nesterov": True},
                         "exponent": {"exponent": 3.0}, "beta2": {"beta2": 0.9}, "epsilon": {"epsilon": 1e-3}},
    "adam": {"betas": {"betas": (0.5, 0.9)}, "eps": {"eps": 1e-2}, "lazy_adam": {"lazy_adam": False},
             "sum_inside_sqrt": {"sum_inside_sqrt": False}, "bias_correction": {"bias_correction": True}},
    "ftrl": {"learning_rate_power": {"learning_rate_power": -0.7}, "l1_regularization_strength":
             {"l1_regularization_strength": 0.01}, "l2_regularization_strength": {"l2_regularization_strength": 0.02},
             "beta": {"beta": 0.1}, "initial_accumulator_value": {"initial_accumulator_value": 0.3},
             "multiply_linear_by_learning_rate": {"multiply_linear_by_learning_rate": True},
             "allow_zero_accumulator": {"allow_zero_accumulator": True, "initial_accumulator_value": 0.0,
                                        "beta": 0.1}},
    "adafactor": {"beta_2_decay": {"beta_2_decay": -0.6}, "epsilon_1": {"epsilon_1": 1e-3},
                  "epsilon_2": {"epsilon_2": 0.5}, "clip_threshold": {"clip_threshold": 0.3},
                  "relative_step": {"relative_step": False}, "weight_decay": {"weight_decay": 0.05},
                  "row_stat_dtype": {"row_stat_dtype": torch.bfloat16}},
    "rowwise_adagrad": {"eps": {"eps": 1e-2}, "initial_accumulator_value": {"initial_accumulator_value": 0.5},
                        "weight_decay": {"weight_decay": 0.05}, "slot_creation_fn": {"slot_creation_fn": _row_slots_plus}},
}
OWN["lazy_adam"] = {k: v for k, v in OWN["adam"].items() if k != "lazy_adam"}


def _constructor_options(cls: type) -> set[str]:
    """The keyword arguments ``cls(...)`` takes, read from the signatures (LazyAdam forwards to Adam's)."""
    names: set[str] = set(COMMON) - {"use_gradient_accumulation", "clip_weight_min", "clip_weight_max",
                                     "weight_decay_factor", "multiply_weight_decay_factor_by_learning_rate",
                                     "clipvalue", "slot_creation_fn", "lr"}  # the Keras extras: every optimizer
    for klass in cls.__mro__:
        if klass is tte.optim.RowSparseOptimizer:
            break
        if "__init__" in klass.__dict__:
            names |= {n for n, a in inspect.signature(klass.__dict__["__init__"]).parameters.items()
                      if a.kind in (a.POSITIONAL_OR_KEYWORD, a.KEYWORD_ONLY)}
    return names - {"self", "params"} - ({"lazy_adam"} if cls is tte.optim.LazyAdam else set())


def _options(info: OptimizerInfo) -> dict[str, dict[str, object]]:
    opts = {k: v for k, v in COMMON.items() if k in _constructor_options(info.cls)}
    opts.update(OWN[info.name])
    return opts


def _cases() -> list[tuple[str, OptimizerInfo, dict[str, object]]]:
    return [(f"{info.name}-{key}", info, kw) for info in OPTIMIZER_INFOS for key, kw in _options(info).items()]


@pytest.mark.parametrize("info", OPTIMIZER_INFOS, ids=lambda i: i.name)
def test_every_constructor_option_is_covered(info: OptimizerInfo) -> None:
    """The table above names every option the constructor takes (a new option gets a case), and
    ``group_options()`` says the same."""
    assert set(_options(info)) == _constructor_options(info.cls) == set(info.cls.group_options())


@pytest.mark.parametrize(("name", "info", "kw"), _cases(), ids=[c[0] for c in _cases()])
def test_group_option_means_what_the_constructor_argument_means(name: str, info: OptimizerInfo,
                                                                 kw: dict[str, object]) -> None:
    """``Opt([{"params": a, **kw}, {"params": b}])`` trains ``a`` as ``Opt(a, **kw)`` and ``b`` as
    ``Opt(b)``: weights and optimizer state equal, bitwise."""
    ec, head = make_model()
    grouped = info.cls([{"params": [*ec.parameters(), head.weight], **kw}, {"params": [head.bias]}], **info.default)
    ec_r, head_r = make_model()
    ref_a = info.cls([*ec_r.parameters(), head_r.weight], **{**info.default, **kw})
    ref_b = info.cls([head_r.bias], **info.default)

    class Both:
        def step(self) -> None:
            ref_a.step()
            ref_b.step()

        def zero_grad(self) -> None:
            ref_a.zero_grad()
            ref_b.zero_grad()

    train(ec, head, grouped, 4)
    train(ec_r, head_r, Both(), 4)
    pairs = [(p, q, ref_a) for p, q in zip([*ec.parameters(), head.weight], [*ec_r.parameters(), head_r.weight],
                                           strict=True)] + [(head.bias, head_r.bias, ref_b)]
    for p, q, ref in pairs:
        torch.testing.assert_close(p, q, rtol=0, atol=0)
        mine, theirs = grouped.state[p], ref.state[q]
        assert sorted(mine) == sorted(theirs)
        for k in mine:
            torch.testing.assert_close(mine[k], theirs[k], rtol=0, atol=0, msg=f"slot {k}")


TORCH_ONLY = ("maximize", "foreach", "capturable", "differentiable", "fused", "amsgrad", "weight_decay", "nesterov",
              "dampening", "lr_decay", "decoupled_weight_decay")


def _refused() -> list[tuple[str, OptimizerInfo, str]]:
    return [(f"{info.name}-{k}", info, k) for info in OPTIMIZER_INFOS for k in TORCH_ONLY
            if k not in _constructor_options(info.cls)]


@pytest.mark.parametrize(("name", "info", "key"), _refused(), ids=[c[0] for c in _refused()])
def test_key_the_constructor_refuses_is_refused_in_a_group(name: str, info: OptimizerInfo, key: str) -> None:
    w, b = torch.nn.Parameter(torch.ones(3, 2)), torch.nn.Parameter(torch.ones(2))
    value = 0.01 if key == "weight_decay" else True
    with pytest.raises(TypeError):
        info.cls([w], **info.default, **{key: value})
    with pytest.raises(TypeError, match=rf"Parameter group 1: {info.cls.__name__} takes no option `{key}`"):
        info.cls([{"params": [w]}, {"params": [b], key: value}], **info.default)
    opt = info.cls([w], **info.default)
    with pytest.raises(TypeError, match=rf"Parameter group 1: .* `{key}`"):
        opt.add_param_group({"params": [b], key: value})
    assert len(opt.param_groups) == 1  # a rejected group is not added
    if key == "weight_decay":  # torch's coupled weight_decay is never taken as TF's decoupled factor
        with pytest.raises(TypeError, match="weight_decay_factor"):
            info.cls([{"params": [w], key: value}], **info.default)


@pytest.mark.parametrize("info", OPTIMIZER_INFOS, ids=lambda i: i.name)
def test_a_copy_of_a_group_is_a_valid_group(info: OptimizerInfo) -> None:
    """``add_param_group({**opt.param_groups[0], "params": ...})`` (the keys a group carries) works."""
    w, b = torch.nn.Parameter(torch.ones(3, 2)), torch.nn.Parameter(torch.ones(2))
    opt = info.cls([w], **info.default)
    opt.add_param_group({**opt.param_groups[0], "params": [b]})
    assert opt.param_groups[1]["params"] == [b]


@pytest.mark.parametrize("info", OPTIMIZER_INFOS, ids=lambda i: i.name)
def test_params_must_be_an_iterable_like_torch(info: OptimizerInfo) -> None:
    """``Opt(tensor)`` is torch.optim's TypeError, not a complaint about the tensor's rows."""
    w = torch.nn.Parameter(torch.ones(3, 2))
    with pytest.raises(TypeError, match="params argument given to the optimizer should be an iterable of Tensors "
                                        "or dicts, but got torch.FloatTensor"):
        info.cls(w, **info.default)


@pytest.mark.parametrize("info", OPTIMIZER_INFOS, ids=lambda i: i.name)
def test_a_group_of_a_set_is_refused_like_torch(info: OptimizerInfo) -> None:
    """A group's ``params`` given as a set is torch.optim's TypeError at construction as in ``add_param_group``: a
    set's order changes between runs, and dense parameters' state is saved by their position."""
    w, b = torch.nn.Parameter(torch.ones(3, 2)), torch.nn.Parameter(torch.ones(2))
    message = "optimizer parameters need to be organized in ordered collections"
    with pytest.raises(TypeError, match=message):
        torch.optim.SGD([{"params": {w, b}}], lr=0.1)  # torch's own
    with pytest.raises(TypeError, match=message):
        info.cls([{"params": {w, b}}], **info.default)
    opt = info.cls([w], **info.default)
    with pytest.raises(TypeError, match=message):
        opt.add_param_group({"params": {b}})
    assert len(opt.param_groups) == 1


@pytest.mark.parametrize("info", OPTIMIZER_INFOS, ids=lambda i: i.name)
@pytest.mark.parametrize("named_first", [True, False])
def test_named_and_unnamed_parameters_mixed_is_torch_error(info: OptimizerInfo, named_first: bool) -> None:
    w, b = torch.nn.Parameter(torch.ones(3, 2)), torch.nn.Parameter(torch.ones(2))
    params = [("w", w), b] if named_first else [b, ("w", w)]
    with pytest.raises(ValueError, match="all optimizer params should be with/without names"):
        info.cls(params, **info.default)
    with pytest.raises(ValueError, match="all optimizer params should be with/without names"):
        torch.optim.SGD(params, lr=0.1)  # the same message as torch's
    opt = info.cls([("w", w)], **info.default)
    assert opt.param_groups[0]["param_names"] == ["w"]


def test_adafactor_weight_decay_in_a_group_is_its_decoupled_decay() -> None:
    """Adafactor's own ``weight_decay`` (Keras's ``w·wd·lr``) decays a group's weights."""
    w, b = torch.nn.Parameter(torch.ones(3, 2)), torch.nn.Parameter(torch.ones(2))
    opt = tte.optim.Adafactor([{"params": [w], "weight_decay": 0.1}, {"params": [b]}], lr=0.1)
    assert opt.param_groups[0]["weight_decay_factor"] == 0.1
    assert opt.param_groups[1]["weight_decay_factor"] is None


@pytest.mark.parametrize("info", OPTIMIZER_INFOS, ids=lambda i: i.name)
def test_user_metadata_is_kept_and_a_misspelt_option_is_refused(info: OptimizerInfo) -> None:
    """Keys that name no optimizer's option are the user's (torch.optim keeps them); a near-miss of
    an option is refused, naming it, instead of being kept and ignored."""
    w, b = torch.nn.Parameter(torch.ones(3, 2)), torch.nn.Parameter(torch.ones(2))
    opt = info.cls([{"params": [w], "name": "dense", "lr_scale": 0.5}], **info.default)
    assert (opt.param_groups[0]["name"], opt.param_groups[0]["lr_scale"]) == ("dense", 0.5)
    opt.add_param_group({"params": [b], "name": "bias"})
    assert opt.param_groups[1]["name"] == "bias"
    w.grad = torch.ones_like(w)
    b.grad = torch.ones_like(b)
    opt.step()  # the metadata changes nothing in the update
    for typo in ("clipnrom", "weight_decay_facter"):
        with pytest.raises(TypeError, match=rf"Parameter group 0: .* `{typo}`"):
            info.cls([{"params": [w], typo: 1.0}], **info.default)


@pytest.mark.parametrize("info", OPTIMIZER_INFOS, ids=lambda i: i.name)
def test_repr_shows_the_users_hyper_parameters_in_torchs_format(info: OptimizerInfo) -> None:
    """``print(optimizer)`` is torch.optim's listing of each group's keys less ``params``, without the rule class
    the core keeps in each group (it showed ``_rule: <class ...>``; ``state_dict`` never saved it): the keys shown
    are the ones ``state_dict`` saves, and ``slot_creation_fn`` (a callable, which it does not)."""
    ec, head = make_model()
    opt = info.cls([{"params": list(ec.parameters()), "name": "tables"}, {"params": list(head.parameters())}],
                   **info.default)

    class Listed:  # torch's own __repr__ over what the user gave, under our class name
        param_groups = [{k: v for k, v in g.items() if not k.startswith("_")} for g in opt.param_groups]

    Listed.__name__ = type(opt).__name__
    assert repr(opt) == torch.optim.Optimizer.__repr__(Listed())  # type: ignore[arg-type]
    shown = {line.split(":")[0].strip() for line in repr(opt).splitlines() if line.startswith("    ")}
    saved = {k for g in opt.state_dict()["param_groups"] for k in g} - {"params"}
    assert {"algorithm", "lr", "name"} <= shown and not [k for k in shown if k.startswith("_")], sorted(shown)
    assert sorted(shown - saved) == ["slot_creation_fn"] and saved <= shown  # (a callable: never saved)


def test_a_callable_lr_shared_by_groups_is_called_once_per_step() -> None:
    """TF's test_variable_learning_rate: the rate of call j is max(0.5, 1 − 0.05·j) and a row (SGD, gradient 1 each
    step) ends at its initial value − Σ_j lr_j. The constructor's callable is every group's (a table's, a dense
    layer's): TF evaluates a callable once per step for all the tables holding it, so each group gets call j's rate
    at step j (called once per group, the table took calls 0, 2, 4 and the dense layer 1, 3, 5)."""
    calls: list[int] = []

    def lr() -> float:
        calls.append(1)
        return max(0.5, 1 - 0.05 * (len(calls) - 1))

    t = tte.TableConfig(4, 2, name="t", combiner="sum", dtype=torch.float64)
    ec = tte.EmbeddingCollection({"f": tte.FeatureConfig(t)})
    dense = torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))
    opt = tte.optim.SGD([{"params": ec.parameters()}, {"params": [dense]}], lr=lr)
    row0 = ec.tables.t.weight.detach()[1].clone()
    steps = 12  # past the floor of 0.5 at call 10
    for _ in range(steps):
        (ec({"f": torch.tensor([1])})["f"].sum() + dense.sum()).backward()
        opt.step()
        opt.zero_grad()
    total = sum(max(0.5, 1 - 0.05 * j) for j in range(steps))  # float64, the rates TF's test expects
    assert len(calls) == steps
    torch.testing.assert_close(ec.tables.t.weight.detach()[1], row0 - total, rtol=0, atol=1e-12)
    torch.testing.assert_close(dense.detach(), torch.full((2,), -total, dtype=torch.float64), rtol=0, atol=1e-12)
