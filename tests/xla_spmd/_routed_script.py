"""Training through the id exchange (row-sharded tables under SPMD) against the same model on the CPU.

One model per config: row-sharded tables, each trained by its own optimizer (``TableConfig.optimizer``
factories, so one compiled graph covers every optimizer), plus a replicated dense head. Per table a bag
feature from the host (``Jagged``, Zipf ids with duplicates, an empty bag, per-id weights on one table,
a batch that is not a multiple of the device count) and a single-id feature on the device, batch-sharded
with ``shard_batch``. ``STEPS`` steps on the current SPMD mesh and on the CPU; the logical state
(``state_dict`` of the model and of the optimizer, caught-up moving averages) is compared.

Used in process by test_routed_training.py (4 devices) and as a script for 2, 6 and 8 devices:
``PJRT_DEVICE=CPU CPU_NUM_DEVICES=n python _routed_script.py CONFIG [CONFIG ...]`` prints one JSON line
per config.
"""

from __future__ import annotations

import functools
import json
import sys
from typing import Any

import numpy as np
import torch

import torch_tpu_embedding as tte
from torch_tpu_embedding._rows.row_order import to_logical

O = tte.optim  # noqa: E741
V, D, B_HOST, B_DEV, L, STEPS = 1001, 8, 12, 16, 6, 4

#: the optimizers of the package, each with a table of its own
RULES: dict[str, Any] = {
    "sgd": functools.partial(O.SGD, lr=0.1),
    "adagrad": functools.partial(O.Adagrad, lr=0.1),
    "adagrad_momentum": functools.partial(O.AdagradMomentum, lr=0.05, momentum=0.9, use_nesterov=True),
    "adam": functools.partial(O.Adam, lr=0.05),
    "lazy_adam": functools.partial(O.LazyAdam, lr=0.05, bias_correction=True, sum_inside_sqrt=False),
    "ftrl": functools.partial(O.FTRL, lr=0.1, l1_regularization_strength=0.001),
    "adafactor": functools.partial(O.Adafactor, lr=0.1),
    "rowwise_adagrad": functools.partial(O.RowWiseAdagrad, lr=0.1, weight_decay=0.01),
}
EXTRAS: dict[str, dict[str, Any]] = {
    "plain": {},
    # Keras extras on every table: EMA (lazy catch-up per row), accumulation buffers per shard, clipnorm
    "ema-accum-clipnorm": {"use_ema": True, "ema_momentum": 0.8, "gradient_accumulation_steps": 2, "clipnorm": 0.5},
    # one norm over every table and the head; loss scaling; the non-finite gate (all finite here)
    "global-clipnorm": {"global_clipnorm": 0.5, "loss_scale_factor": 8.0, "skip_nonfinite": True},
}
CONFIGS = [*EXTRAS, "nonlazy-adam", "stacked", "bfloat16"]


def tables(config: str) -> dict[str, tte.TableConfig]:
    """The row-sharded tables of ``config``: name -> config (each with its optimizer override)."""
    dtype = torch.bfloat16 if config == "bfloat16" else torch.float32
    if config == "nonlazy-adam":
        rules = {"adam": functools.partial(O.Adam, lr=0.05, lazy_adam=False)}
    elif config == "stacked":  # one stacked group of three tables (one optimizer): one routing, one update
        rules = {f"f{i}": functools.partial(O.Adagrad, lr=0.1) for i in range(3)}
    elif config == "bfloat16":
        rules = {k: RULES[k] for k in ("adagrad", "adam", "adafactor")}
    else:
        extras = EXTRAS[config]
        rules = {k: functools.partial(r, **extras) for k, r in RULES.items()}
    return {name: tte.TableConfig(V, D, name=name, combiner="mean" if i % 2 else "sqrtn", placement="row",
                                  optimizer=rule, dtype=dtype) for i, (name, rule) in enumerate(rules.items())}


def build(config: str, device: torch.device) -> tuple[tte.EmbeddingCollection, torch.nn.Module, Any]:
    torch.manual_seed(0)
    feats: dict[str, tte.FeatureConfig] = {}
    for name, t in tables(config).items():
        feats[f"{name}_bag"] = tte.FeatureConfig(t, max_ids_per_bag=L)
        feats[f"{name}_id"] = tte.FeatureConfig(t)
    ec = tte.EmbeddingCollection(feats, device=device, stack_tables=config == "stacked")
    head = torch.nn.Linear(D, 1).to(device=device)
    if device.type == "xla":
        from torch_tpu_embedding.xla import replicate, shard

        assert set(shard(ec).values()) == {"row"}
        replicate(head)
    extras = {k: v for k, v in EXTRAS.get(config, {}).items() if k != "clipnorm"}  # the head: no clipnorm
    opt = O.Adam([*ec.parameters(), *head.parameters()], lr=0.01, **extras)
    opt.init_state()
    return ec, head, opt


def batches(names: list[str], seed: int = 1) -> list[dict[str, Any]]:
    """Per step and table: host bags (Zipf(1.1) ids, duplicates, an empty bag, weights) and device ids."""
    g = np.random.default_rng(seed)
    p = 1.0 / np.arange(1, V + 1) ** 1.1
    p /= p.sum()
    out = []
    for _ in range(STEPS):
        step: dict[str, Any] = {}
        for i, name in enumerate(names):
            lengths = g.integers(1, L + 1, size=B_HOST)
            lengths[3] = 0  # an empty bag
            ids = g.choice(V, size=int(lengths.sum()), p=p)
            ids[1] = ids[0]  # a duplicate inside the first bag
            weights = torch.from_numpy(g.uniform(0.5, 2.0, size=ids.shape)).float() if i == 0 else None
            step[f"{name}_bag"] = (torch.from_numpy(ids), torch.from_numpy(lengths), weights)
            step[f"{name}_id"] = torch.from_numpy(g.choice(V, size=B_DEV, p=p))
        step["y"] = torch.from_numpy(g.standard_normal(B_DEV)).float()
        out.append(step)
    return out


def train(config: str, device: torch.device) -> dict[str, Any]:
    ec, head, opt = build(config, device)
    xla = device.type == "xla"
    if xla:
        import torch_xla
        import torch_xla.debug.metrics as met

        from torch_tpu_embedding.xla import shard_batch, sharding_spec

        torch_xla.sync()
        met.clear_all()
        specs = {k: sharding_spec(v) for k, v in _sharded(ec, opt).items()}
    names = list(tables(config))
    compiles = []
    for step in batches(names):
        inputs: dict[str, Any] = {}
        for name in names:
            ids, lengths, w = step[f"{name}_bag"]
            inputs[f"{name}_bag"] = tte.Jagged(ids, lengths=lengths, weights=w)
            dev_ids = step[f"{name}_id"].to(device)
            inputs[f"{name}_id"] = shard_batch(dev_ids) if xla else dev_ids
        out = ec(inputs)
        y = step["y"].to(device)
        loss = torch.zeros((), device=device)
        for name in names:
            bag = head(out[f"{name}_bag"].float()).sum() * 0.1
            single = head(out[f"{name}_id"].float()).squeeze(1)
            loss = loss + ((single - y) ** 2).sum() + bag
        loss.backward()
        opt.step()
        opt.zero_grad()
        if xla:
            torch_xla.sync()
            compiles.append(met.counter_value("UncachedCompile") or 0)
    result: dict[str, Any] = {}
    if xla:  # before anything reads the device (skipped_steps in state_dict() is an .item())
        after = _sharded(ec, opt)
        result.update(compiles=compiles, fallbacks=sorted(met.executed_fallback_ops()), specs_before=specs,
                      specs_after={k: sharding_spec(after[k]) for k in specs})
        ec.check_ids()  # raises if any id was dropped (capacity) or out of range
    result["state"] = comparable(ec, head, opt)
    return result


def _sharded(ec: tte.EmbeddingCollection, opt: Any) -> dict[str, torch.Tensor]:
    """Every table and its table-sized slots (their shardings must not change)."""
    out = {}
    for name, t in ec.physical_tables().items():
        out[name] = t.weight
        for slot, v in opt.state[t.weight].items():
            if v.dim() and slot not in ("c",):
                out[f"{name}/{slot}"] = v
    return out


def comparable(ec: tte.EmbeddingCollection, head: torch.nn.Module, opt: Any) -> dict[str, torch.Tensor]:
    out = {k: v.detach().cpu().double() for k, v in ec.state_dict().items()}
    out.update({f"head.{k}": v.detach().cpu().double() for k, v in head.state_dict().items()})
    for key, slots in opt.state_dict()["state"].items():
        for slot, v in slots.items():
            # Accumulation buffers are sized by the device's batch. A lazy table's raw EMA rows and ema_last are
            # compared too (tests/ema_window_cases.py), and the caught-up averages below.
            if slot in ("acc_ids", "acc_rows"):
                continue
            out[f"{key}/{slot}"] = v.detach().cpu().double()
    for name, t in ec.physical_tables().items():
        group = opt._group_of(t.weight)
        if group["use_ema"]:
            avg = opt.moving_average(t.weight).cpu()  # in the table's stored row order
            out[f"ema_now/{name}"] = to_logical(avg, t.config.num_embeddings, t.row_layout).double()
    return out


def compare(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], config: str) -> dict[str, float]:
    """Largest error per entry relative to ``max(1, |want|)``, and the keys that differ."""
    assert set(got) == set(want), sorted(set(got) ^ set(want))
    return {k: float(((got[k] - want[k]).abs() / want[k].abs().clamp(min=1.0)).max()) if want[k].numel() else 0.0
            for k in want}


def run(config: str) -> dict[str, Any]:
    import torch_xla

    xla = train(config, torch_xla.device())
    cpu = train(config, torch.device("cpu"))
    shapes_equal = all(xla["state"][k].shape == cpu["state"][k].shape for k in cpu["state"])
    moved = max(float((cpu["state"][k] - build_initial(config)[k]).abs().max()) for k in build_initial(config))
    return {"config": config, "errors": compare(xla["state"], cpu["state"], config), "shapes_equal": shapes_equal,
            "compiles": xla["compiles"], "fallbacks": xla["fallbacks"], "specs_before": xla["specs_before"],
            "specs_after": xla["specs_after"], "moved": moved}


@functools.cache
def build_initial(config: str) -> dict[str, torch.Tensor]:
    ec, _, _ = build(config, torch.device("cpu"))
    return {k: v.detach().double() for k, v in ec.state_dict().items()}


if __name__ == "__main__":
    import torch_xla.runtime as xr

    xr.use_spmd()
    for name in sys.argv[1:] or CONFIGS:
        print(json.dumps(run(name)), flush=True)
