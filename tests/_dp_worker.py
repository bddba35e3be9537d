"""Data-parallel runs for tests/distributed/test_data_parallel.py: one process per rank (gloo, CPU), and the same model,
batches and loop for the single-process reference.

A run trains a model (two tables of different widths, features sharing a table, padded bags, a dense head)
for some steps on rank ``r``'s share of each global batch, and returns its final model and optimizer state.
The parent compares the ranks with each other (bitwise) and with one process on the global batch.
"""

from __future__ import annotations

import functools
import os
import sys
import types
from typing import Any

import torch
import torch.distributed as dist
from suite_helpers import finish_rank, init_rank

import torch_tpu_embedding as tte

O = tte.optim  # noqa: E741
OPTIMIZERS: dict[str, tuple[Any, dict[str, Any]]] = {
    "sgd": (O.SGD, {"lr": 0.2}),
    "adagrad": (O.Adagrad, {"lr": 0.2}),
    "adagrad_momentum": (O.AdagradMomentum, {"lr": 0.05, "momentum": 0.5}),
    "adam": (O.Adam, {"lr": 0.01}),
    "adam-nonlazy": (O.Adam, {"lr": 0.01, "lazy_adam": False}),
    "lazy_adam": (O.LazyAdam, {"lr": 0.01}),
    "ftrl": (O.FTRL, {"lr": 0.2, "l1_regularization_strength": 0.001}),
    "adafactor": (O.Adafactor, {"lr": 0.1}),
    "adagrad-accum2": (O.Adagrad, {"lr": 0.2, "gradient_accumulation_steps": 2}),
    "adagrad-noaccum": (O.Adagrad, {"lr": 0.2, "use_gradient_accumulation": False}),
    "rowwise_adagrad": (O.RowWiseAdagrad, {"lr": 0.2}),
}
BATCH = 12  # the global batch: 6 per rank on 2 ranks, 4 on 3
STEPS = 10
TOL = {torch.float64: 1e-10, torch.float32: 1e-6}


def _variant_key(name: str) -> str:
    return name.replace("-", "_")


class Model(torch.nn.Module):
    """Tables and features, each feature's output concatenated into a linear head.

    Without ``variants``: table "a" (13 × 4) looked up by "fa" (mean bags of up to 3, padded) and "fc"
    (sum bags of 2), "b" (7 × 3) by "fb" (one id), "a2" (5 × 4) by "fd" (bags of 2). With ``variants``
    (optimizer names of ``OPTIMIZERS``): for each, tables ``a__<v>`` and ``b__<v>`` whose TableConfig
    names that optimizer, looked up as above, so one step trains every optimizer (one exchange per
    step for all of them).
    """

    def __init__(self, dtype: torch.dtype, seed: int, stack: bool = False, variants: tuple[str, ...] = ()) -> None:
        super().__init__()
        torch.manual_seed(seed)
        features: dict[str, tte.FeatureConfig] = {}
        if not variants:
            a = tte.TableConfig(13, 4, name="a", combiner="mean", dtype=dtype)
            a2 = tte.TableConfig(5, 4, name="a2", combiner="sum", dtype=dtype)
            features = {"fa": tte.FeatureConfig(a), "fc": tte.FeatureConfig(a),
                        "fb": tte.FeatureConfig(tte.TableConfig(7, 3, name="b", dtype=dtype)),
                        "fd": tte.FeatureConfig(a2)}
        for v in variants:
            cls, kw = OPTIMIZERS[v]
            opt = functools.partial(cls, **kw)
            k = _variant_key(v)
            a = tte.TableConfig(13, 4, name=f"a__{k}", combiner="mean", dtype=dtype, optimizer=opt)
            b = tte.TableConfig(7, 3, name=f"b__{k}", dtype=dtype, optimizer=opt)
            features.update({f"fa__{k}": tte.FeatureConfig(a), f"fc__{k}": tte.FeatureConfig(a),
                             f"fb__{k}": tte.FeatureConfig(b)})
        self.features = sorted(features)
        self.ec = tte.EmbeddingCollection(features, stack_tables=stack)
        width = sum(features[f].table.embedding_dim for f in self.features)
        self.head = torch.nn.Linear(width, 1, dtype=dtype)

    def forward(self, batch: dict[str, Any]) -> torch.Tensor:
        out = self.ec(batch)
        return self.head(torch.cat([out[f] for f in self.features], dim=1)).squeeze(1)


def global_batch(step: int, dtype: torch.dtype, model: Model) -> tuple[dict[str, Any], torch.Tensor]:
    """Step ``step``'s global batch for ``model``'s features: skewed ids, so ranks share rows."""
    g = torch.Generator().manual_seed(1000 + step)
    skew = torch.tensor([8.0, 4, 2, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1])
    fa = torch.multinomial(skew.expand(BATCH, -1), 3, replacement=True, generator=g)
    mask = torch.rand(BATCH, 3, generator=g) > 0.25
    base = {"fa": tte.Padded(fa, mask),
            "fc": tte.Padded(torch.multinomial(skew.expand(BATCH, -1), 2, replacement=True, generator=g)),
            "fb": torch.randint(0, 7, (BATCH,), generator=g),
            "fd": tte.Padded(torch.randint(0, 5, (BATCH, 2), generator=g))}
    y = torch.randn(BATCH, generator=g, dtype=dtype)
    return {f: base[f.split("__")[0]] for f in model.features}, y


def share(batch: dict[str, Any], y: torch.Tensor, rank: int, world: int) -> tuple[dict[str, Any], torch.Tensor]:
    """Rank ``rank``'s equal share of a global batch."""
    n = BATCH // world
    s = slice(rank * n, (rank + 1) * n)

    def cut(x: Any) -> Any:
        return tte.Padded(x.ids[s], None if x.mask is None else x.mask[s]) if isinstance(x, tte.Padded) else x[s]

    return {k: cut(x) for k, x in batch.items()}, y[s]


ZOO = tuple(OPTIMIZERS)


def make_opt(name: str, params: Any) -> torch.optim.Optimizer:
    """Optimizer ``name`` over ``params`` (``"zoo"``: Adagrad for the head, each table its own)."""
    cls, kw = OPTIMIZERS["adagrad" if name == "zoo" else name]
    opt: torch.optim.Optimizer = cls(params, **kw)
    return opt


def build(name: str, dtype: torch.dtype, seed: int, stack: bool = False) -> Model:
    return Model(dtype, seed, stack=stack, variants=ZOO if name == "zoo" else ())


def state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    return {"model": {k: v.clone() for k, v in model.state_dict().items()}, "optimizer": opt.state_dict()}


def train(model: Model, opt: torch.optim.Optimizer, steps: range, dtype: torch.dtype, rank: int = 0,
          world: int = 1, wrapped: torch.nn.Module | None = None, average_dense: Any = None,
          tables: list[torch.Tensor] | None = None) -> None:
    """The loop; ``average_dense``: a process group over which the head's grads are averaged by hand;
    ``tables``: parameters that must never get a ``.grad``."""
    run = wrapped if wrapped is not None else model
    for step in steps:
        batch, y = share(*global_batch(step, dtype, model), rank, world)
        loss = ((run(batch) - y) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        for t in tables or []:
            assert t.grad is None, "a table got a .grad"
        if average_dense is not None:
            n = dist.get_world_size(average_dense)
            for p in model.head.parameters():
                assert p.grad is not None
                dist.all_reduce(p.grad, group=average_dense)
                p.grad.div_(n)
        opt.step()


@functools.lru_cache(maxsize=None)
def reference(name: str, dtype: torch.dtype, steps: int = STEPS, stack: bool = False) -> dict[str, Any]:
    """One process on the global batch."""
    model = build(name, dtype, seed=0, stack=stack)
    opt = make_opt(name, model.parameters())
    train(model, opt, range(steps), dtype)
    return state(model, opt)


# ------------------------------------------------------------------------------------------ ranks
def _ddp_run(name: str, dtype: torch.dtype, rank: int, world: int, stack: bool = False) -> dict[str, Any]:
    """DDP-wrapped; every rank starts from different tables (the wrapper broadcasts rank 0's). DDP must
    reduce the head only, and no table may get a ``.grad``."""
    model = build(name, dtype, seed=rank, stack=stack)
    ddp = tte.distributed.DistributedDataParallel(model)
    tables, _ = tte.split_parameters(model)
    assert not any(q is t for q in ddp._module_parameters for t in tables), "DDP reduces a table"
    head_bytes = sum(p.numel() * p.element_size() for p in model.head.parameters())
    assert ddp._get_ddp_logging_data()["total_parameter_size_bytes"] == head_bytes
    opt = make_opt(name, ddp.parameters())
    train(model, opt, range(STEPS), dtype, rank, world, wrapped=ddp, tables=tables)
    return state(model, opt)


def _plain_run(name: str, dtype: torch.dtype, rank: int, world: int) -> dict[str, Any]:
    """No DDP and no tte.distributed call: same seed everywhere, the head's grads averaged by hand."""
    model = build(name, dtype, seed=0)
    opt = make_opt(name, model.parameters())
    tables, _ = tte.split_parameters(model)
    train(model, opt, range(STEPS), dtype, rank, world, average_dense=dist.group.WORLD, tables=tables)
    return state(model, opt)


def _plain_ddp_error(rank: int, world: int) -> str:
    """torch's own DistributedDataParallel around a model with tables: the forward must refuse."""
    model = build("adagrad", torch.float64, seed=0)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    batch, _ = share(*global_batch(0, torch.float64, model), rank, world)
    try:
        ddp(batch)
    except RuntimeError as e:
        return str(e)
    return ""


def _clip_run(dtype: torch.dtype, rank: int, world: int) -> dict[str, Any]:
    """DDP + tte.clip_grad_norm_: the returned norms, their largest difference from the same clipping done
    by hand over the global gradient, and the final state."""
    model = build("adagrad", dtype, seed=0)
    ddp = tte.distributed.DistributedDataParallel(model)
    opt = make_opt("adagrad", ddp.parameters())
    norms, errors = [], []
    for step in range(STEPS):
        batch, y = share(*global_batch(step, dtype, model), rank, world)
        opt.zero_grad()
        ((ddp(batch) - y) ** 2).mean().backward()
        # By hand: each rank's densified table gradient, summed over the ranks / world (DDP's mean).
        tables = model.ec.physical_tables()
        want = {}
        for name, (ids, rows) in model.ec.row_grads().items():
            w = tables[name].weight
            g = torch.zeros(w.shape[0] + 1, w.shape[1], dtype=dtype).index_add_(0, ids, rows)[:-1]
            dist.all_reduce(g)
            want[name] = g / world
        head = [p.grad.clone() for p in model.head.parameters() if p.grad is not None]
        total = torch.linalg.vector_norm(torch.cat([g.reshape(-1) for g in head + list(want.values())]))
        coef = min(0.05 / (float(total) + 1e-6), 1.0)
        got = tte.clip_grad_norm_(ddp.parameters(), 0.05)
        norms.append(float(got))
        errors.append(abs(float(got) - float(total)) / float(total))
        for p, g in zip(model.head.parameters(), head, strict=True):
            errors.append(float((p.grad - g * coef).abs().max()))
        for name, (ids, rows) in model.ec.row_grads().items():
            w = tables[name].weight
            g = torch.zeros(w.shape[0] + 1, w.shape[1], dtype=dtype).index_add_(0, ids, rows)[:-1]
            errors.append(float((g - want[name] * coef).abs().max()))
        opt.step()
    return {"norms": norms, "max_error": max(errors), **state(model, opt)}


def _checkpoint_run(path: str, rank: int, world: int) -> dict[str, Any]:
    """5 DP steps, rank 0 saves, every rank loads into a fresh model and optimizer, 5 more steps."""
    dtype = torch.float64
    model = build("lazy_adam", dtype, seed=rank)
    ddp = tte.distributed.DistributedDataParallel(model)
    opt = make_opt("lazy_adam", ddp.parameters())
    train(model, opt, range(5), dtype, rank, world, wrapped=ddp)
    if rank == 0:
        tte.checkpoint.save(path, model=model, optimizer=opt, extra={"step": 5})
    dist.barrier()
    model2 = build("lazy_adam", dtype, seed=100 + rank)
    ddp2 = tte.distributed.DistributedDataParallel(model2)
    opt2 = make_opt("lazy_adam", ddp2.parameters())
    assert tte.checkpoint.load(path, model=model2, optimizer=opt2) == {"step": 5}
    train(model2, opt2, range(5, STEPS), dtype, rank, world, wrapped=ddp2)
    return state(model2, opt2)


def _subgroup_run(rank: int, world: int) -> dict[str, Any]:
    """3 ranks: ranks 0 and 1 train data parallel over an explicit group on halves of the global batch;
    rank 2 opts its tables out (tte.distributed.local_tables) and trains on the whole global batch."""
    dtype = torch.float64
    pair = dist.new_group([0, 1])  # every rank takes part in creating it
    model = build("adagrad", dtype, seed=0)
    if rank < 2:
        tte.distributed.data_parallel(model, process_group=pair)
    else:
        tte.distributed.local_tables(model)
    opt = make_opt("adagrad", model.parameters())
    if rank < 2:
        train(model, opt, range(STEPS), dtype, rank, 2, average_dense=pair)
    else:
        train(model, opt, range(STEPS), dtype)
    return state(model, opt)


def _spmd_excluded(rank: int, world: int) -> dict[str, Any]:
    """Under (a stand-in for) torch_xla SPMD nothing is exchanged: each rank trains on its own share."""
    runtime = types.ModuleType("torch_xla.runtime")
    runtime.is_spmd = lambda: True  # type: ignore[attr-defined]
    sys.modules["torch_xla.runtime"] = runtime
    try:
        model = build("adagrad", torch.float64, seed=0)
        group = tte.distributed.exchange_group(model.ec.tables["a"].weight)
        try:
            tte.distributed.data_parallel(model)
            refused = ""
        except RuntimeError as e:
            refused = str(e)
        opt = make_opt("adagrad", model.parameters())
        train(model, opt, range(3), torch.float64, rank, world)
        return {"group": group, "refused": refused, **state(model, opt)}
    finally:
        del sys.modules["torch_xla.runtime"]


def _static_run(rank: int, world: int) -> dict[str, Any]:
    """The static-shape exchange (XLA multi-process: raw padded rows, sizes checked once), run on the CPU."""
    dp = sys.modules["torch_tpu_embedding.distributed.grad_sync"]
    real = dp.is_static_device  # type: ignore[attr-defined]
    dp.is_static_device = lambda device: True  # type: ignore[attr-defined]
    try:
        return _plain_run("zoo", torch.float64, rank, world)
    finally:
        dp.is_static_device = real  # type: ignore[attr-defined]


def worker(rank: int, world: int, port: int, out_dir: str) -> None:
    init_rank(rank, world, port)
    results: dict[str, Any] = {}
    for dtype in (torch.float64, torch.float32):
        results[f"ddp/{dtype}"] = _ddp_run("zoo", dtype, rank, world)
        results[f"plain/{dtype}"] = _plain_run("zoo", dtype, rank, world)
        results[f"clip/{dtype}"] = _clip_run(dtype, rank, world)
    results["ddp-stacked"] = _ddp_run("adagrad", torch.float64, rank, world, stack=True)
    results["static"] = _static_run(rank, world)
    results["plain-ddp-error"] = _plain_ddp_error(rank, world)
    results["checkpoint"] = _checkpoint_run(os.path.join(out_dir, "ckpt.pt"), rank, world)
    results["spmd"] = _spmd_excluded(rank, world)
    if world == 3:
        results["subgroup"] = _subgroup_run(rank, world)
    finish_rank(results, out_dir, rank)
