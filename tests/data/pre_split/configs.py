"""The models, optimizers and batches of the pre-split checkpoints (see ``make.py``)."""

from __future__ import annotations

from typing import Any

import torch

import torch_tpu_embedding as tte

O = tte.optim  # noqa: E741
CONFIGS: dict[str, tuple[Any, dict[str, Any], bool]] = {  # optimizer, its arguments, stack_tables
    "sgd": (O.SGD, {"lr": 0.1, "clipvalue": 0.5, "weight_decay_factor": 0.01}, False),
    "adagrad": (O.Adagrad, {"lr": 0.1, "initial_accumulator_value": 0.2}, False),
    "adagrad_momentum": (O.AdagradMomentum, {"lr": 0.1, "momentum": 0.9, "use_nesterov": True}, False),
    "adam": (O.Adam, {"lr": 0.05, "bias_correction": True}, False),
    "adam-nonlazy": (O.Adam, {"lr": 0.05, "lazy_adam": False}, False),
    "lazy_adam-ema-accum": (O.LazyAdam, {"lr": 0.05, "use_ema": True, "ema_momentum": 0.8,
                                         "gradient_accumulation_steps": 3, "global_clipnorm": 0.5}, False),
    "ftrl": (O.FTRL, {"lr": 0.1, "l1_regularization_strength": 0.001, "beta": 0.1}, False),
    "adafactor": (O.Adafactor, {"lr": 0.1, "use_ema": True, "gradient_accumulation_steps": 2,
                                "clipnorm": 1.0}, False),
    "adagrad-fused-accum": (O.Adagrad, {"lr": 0.1, "gradient_accumulation_steps": 2}, True),
    "adam-dcp": (O.Adam, {"lr": 0.05}, False),
}


def build(name: str, default_construction: bool = False) -> tuple[torch.nn.ModuleDict, Any]:
    """The model and optimizer of checkpoint ``name``; ``default_construction``: the collection built
    with no ``stack_tables`` flag (today's default), instead of the flag the checkpoint was written with."""
    cls, kwargs, stack = CONFIGS[name]
    torch.manual_seed(0)
    a = tte.TableConfig(30, 4, name="a", combiner="sqrtn", dtype=torch.float64)
    b = tte.TableConfig(17, 4, name="b", combiner="mean", dtype=torch.float64)
    features = {"a": tte.FeatureConfig(a, max_ids_per_bag=3), "a1": tte.FeatureConfig(a), "b": tte.FeatureConfig(b)}
    ec = tte.EmbeddingCollection(features) if default_construction else tte.EmbeddingCollection(
        features, stack_tables=stack)
    model = torch.nn.ModuleDict({"ec": ec, "head": torch.nn.Linear(12, 1).to(torch.float64)})
    return model, cls(model.parameters(), **kwargs)


def train(model: torch.nn.ModuleDict, opt: Any, start: int, steps: int) -> None:
    for s in range(start, start + steps):
        g = torch.Generator().manual_seed(100 + s)
        bags = torch.randint(0, 30, (8,), generator=g)
        out = model["ec"]({
            "a": tte.Jagged(bags, lengths=torch.tensor([3, 1, 0, 2, 2])),
            "a1": torch.randint(0, 30, (5,), generator=g),
            "b": torch.randint(0, 17, (5,), generator=g),
        })
        x = torch.cat([out["a"], out["a1"], out["b"]], dim=1)
        y = torch.randint(0, 2, (5,), generator=g).to(torch.float64)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(model["head"](x).squeeze(1), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
