"""Tables sharded over a process group (tte.distributed.shard) for tests/distributed/test_mp_shard.py: one process per
rank (gloo, CPU), and the same model, batches and loop for the single-process reference.

The model mixes every placement: two row-sharded tables of the same width (stacked when the collection
fuses, unstacked by shard), a row-sharded table shared by a bag feature and a sequence feature, two
table-wise tables (spread over the ranks by size), two replicated tables (stacked), weighted ``sqrtn``
bags, uniform and Zipf(1.1) ids with duplicates, and a dense head wrapped in
``tte.distributed.DistributedDataParallel``. A rank returns its stored rows of every sharded table with
their logical ids, its optimizer state, and the storage sizes; the parent compares them with one
process trained on the global batch.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from _dp_worker import OPTIMIZERS
from suite_helpers import finish_rank, init_rank

import torch_tpu_embedding as tte

O = tte.optim  # noqa: E741
#: name → (optimizer, arguments): every optimizer of tte.optim, and the options with global statistics
CONFIGS: dict[str, tuple[Any, dict[str, Any]]] = {
    **{n: OPTIMIZERS[n] for n in ("sgd", "adagrad", "adagrad_momentum", "adam", "adam-nonlazy", "lazy_adam", "ftrl",
                                  "adafactor", "rowwise_adagrad")},  # data parallel's settings of each optimizer
    "adagrad-accum2-ema": (O.Adagrad, {"lr": 0.2, "gradient_accumulation_steps": 2, "use_ema": True}),
    "adam-clipnorm": (O.Adam, {"lr": 0.01, "clipnorm": 0.05}),
    "adafactor-global_clipnorm-ema": (O.Adafactor, {"lr": 0.1, "global_clipnorm": 0.1, "use_ema": True}),
    "ftrl-global_clipnorm-skip": (O.FTRL, {"lr": 0.2, "global_clipnorm": 0.1, "skip_nonfinite": True}),
    "sgd-clipnorm-accum2": (O.SGD, {"lr": 0.2, "clipnorm": 0.02, "gradient_accumulation_steps": 2}),
    "adagrad-clip_grad_norm": (O.Adagrad, {"lr": 0.2}),  # and tte.clip_grad_norm_ before each step
}
GLOBAL_BATCH = 24  # 12, 8 and 6 per rank on 2, 3 and 4 ranks
STEPS = 10
#: float64 against one process: 1e-10 (relative above magnitude 1). float64 rounds at 2**-52 = 2.2e-16; these runs
#: amplify rounding less than 1000-fold (float32's largest errors below are under 1e-4, 840 times its eps), so
#: float64's stay under 2.2e-13: 1e-10 leaves a margin of 450, on any CPU.
TOL = {torch.float64: 1e-10}
#: float32 against one process: a bound per leaf derived from float32 arithmetic (float32_bounds), not fitted to one
#: CPU's errors. The ranks and the one process do the same float32 arithmetic in other orders and groupings (each
#: rank's loss is a mean over its share divided by the world size, where one process divides by 24; DDP all-reduces
#: the head's gradient summed per rank; each rank sums its duplicate ids before the owner adds the ranks' sums;
#: other batch sizes, other kernel blockings), so both approximate one exact computation, and for every element
#:     |ranks - one| <= |ranks - exact| + |one - exact|.
#: "exact" is shadow: the float32 run's start (its model's values, its batches) trained in float64, whose own error
#: is 2**-29 of float32's. Each run's error is float32's rounding (EPS32 = 2**-23 = 1.19e-7, relative) of the terms
#: it adds, amplified by the computation: the head's last-bit differences reach every later prediction, and an update
#: that divides by a root of the gradient's own squares amplifies an error of g where g nearly cancels
#: (AdagradMomentum's first steps divide g by (g^2 + 1e-10)^(1/2): up to 1e5 times a last-bit error of g near
#: g = 0). That amplification is measured on the shadow itself: JITTERS runs of it, each scaling every example's
#: squared error by 1 + u, u uniform in [-EPS32, EPS32] at every step, perturb every gradient term by a rounding's
#: worth, where no rounding ever lands the same way twice; R is the largest distance from the shadow of those runs
#: and of the one float32 process, per leaf. Near-cancelling rows make that distance heavy-tailed (AdagradMomentum's
#: momenta: 1e-6 to 6e-5 from one jittered run to the next), hence several runs. A leaf's bound is AMPLIFY * R
#: (4: 2 for the two runs' errors adding, 2 for the tail beyond the largest of 9 samples and for roundings the
#: jitter does not model, such as world 3's division by 3), plus ROUNDINGS * EPS32 * the leaf's peak magnitude
#: (its largest over the start and the steps of the shadow) for the roundings that are not amplified: each run
#: rounds a stored value and its update, of half an ulp (EPS32 / 2 relative) each, at each of the STEPS steps,
#: 2 runs * 2 * STEPS * EPS32 / 2. Integer leaves (counters) are held to 0. The same rule holds every configuration
#: at every world size, and none of it depends on the CPU: the jittered shadows are float64, seeded, and a CPU (or
#: MKL path) whose kernels round otherwise changes the float32 runs only within what they measure. It stays tight:
#: a learning rate 1 % off, or the gradient of one rank's share lost at one step, moves some leaf hundreds of times
#: beyond its bound (tests/distributed/test_mp_shard.py, test_bounds_catch_a_wrong_update, on the one-process runs).
EPS32 = torch.finfo(torch.float32).eps
AMPLIFY = 4.0
JITTERS = 8
ROUNDINGS = 2 * STEPS
#: the float32 configurations also run with the head frozen (no DDP, tte.distributed.data_parallel for the
#: replicated tables), to hold the tables sharded over the group to the bound without the head's amplification:
#: those whose updates normalise by a root of squares (AdagradMomentum, RowWiseAdagrad, Adafactor) or clip by a
#: norm, where the head's last bits were seen to reach 1e-6 on some CPU
FROZEN_HEAD = ("adagrad_momentum", "rowwise_adagrad", "adafactor", "adafactor-global_clipnorm-ema", "adam-clipnorm")
SHARDED = ("big", "row2", "tw", "tw2")


class Model(torch.nn.Module):
    def __init__(self, dtype: torch.dtype, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        big = tte.TableConfig(1500, 4, name="big", combiner="mean", dtype=dtype, placement="row")
        row2 = tte.TableConfig(1000, 4, name="row2", combiner="sum", dtype=dtype, placement="row")
        tw = tte.TableConfig(600, 3, name="tw", combiner="sqrtn", dtype=dtype, placement="table")
        tw2 = tte.TableConfig(400, 3, name="tw2", combiner="sum", dtype=dtype, placement="table")
        rep = tte.TableConfig(20, 2, name="rep", combiner="mean", dtype=dtype, placement="replicated")
        rep2 = tte.TableConfig(30, 2, name="rep2", combiner="sum", dtype=dtype, placement="auto")  # small: replicated
        self.features = {
            "u": tte.FeatureConfig(big, max_ids_per_bag=4),
            "u_seq": tte.FeatureConfig(big, max_sequence_length=3),  # shares "big"
            "r2": tte.FeatureConfig(row2, max_ids_per_bag=3),
            "t": tte.FeatureConfig(tw, max_ids_per_bag=3),  # weighted sqrtn bags
            "t2": tte.FeatureConfig(tw2),
            "p": tte.FeatureConfig(rep, max_ids_per_bag=2),
            "p2": tte.FeatureConfig(rep2),
        }
        self.ec = tte.EmbeddingCollection(self.features)
        self.head = torch.nn.Linear(4 + 3 * 4 + 4 + 3 + 3 + 2 + 2, 1, dtype=dtype)

    def forward(self, batch: dict[str, Any]) -> torch.Tensor:
        out = self.ec(batch)
        seq = out["u_seq"].reshape(out["u_seq"].shape[0], -1)
        parts = [out["u"], seq, out["r2"], out["t"], out["t2"], out["p"], out["p2"]]
        return self.head(torch.cat(parts, dim=1)).squeeze(1)


def _zipf(v: int, shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
    p = 1.0 / torch.arange(1, v + 1, dtype=torch.float64) ** 1.1
    return torch.multinomial(p, int(torch.tensor(shape).prod()), replacement=True, generator=g).reshape(shape)


def global_batch(step: int, dtype: torch.dtype) -> tuple[dict[str, Any], torch.Tensor]:
    """Step ``step``'s global batch: Zipf(1.1) ids (hot rows shared by every rank) and uniform ones."""
    g = torch.Generator().manual_seed(1000 + step)
    b = GLOBAL_BATCH
    batch = {
        "u": tte.Padded(_zipf(1500, (b, 4), g), torch.rand(b, 4, generator=g) > 0.3),
        "u_seq": tte.Padded(_zipf(1500, (b, 3), g), torch.rand(b, 3, generator=g) > 0.2),
        "r2": tte.Padded(torch.randint(0, 1000, (b, 3), generator=g), torch.rand(b, 3, generator=g) > 0.2),
        "t": tte.Padded(_zipf(600, (b, 3), g), torch.rand(b, 3, generator=g) > 0.2,
                        torch.rand(b, 3, generator=g, dtype=dtype) + 0.5),
        "t2": torch.randint(0, 400, (b,), generator=g),
        "p": tte.Padded(torch.randint(0, 20, (b, 2), generator=g)),
        "p2": _zipf(30, (b,), g),
    }
    return batch, torch.randn(b, generator=g, dtype=dtype)


def share(batch: dict[str, Any], y: torch.Tensor, rank: int, world: int) -> tuple[dict[str, Any], torch.Tensor]:
    n = GLOBAL_BATCH // world
    s = slice(rank * n, (rank + 1) * n)

    def cut(x: Any) -> Any:
        if isinstance(x, tte.Padded):
            return tte.Padded(x.ids[s], None if x.mask is None else x.mask[s],
                              None if x.weights is None else x.weights[s])
        return x[s]

    return {k: cut(x) for k, x in batch.items()}, y[s]


def make_opt(name: str, params: Any) -> torch.optim.Optimizer:
    cls, kw = CONFIGS[name]
    opt: torch.optim.Optimizer = cls(params, **kw)
    return opt


def as_dtype(batch: dict[str, Any], y: torch.Tensor, dtype: torch.dtype) -> tuple[dict[str, Any], torch.Tensor]:
    """The batch with its floating values (weights, targets) in ``dtype``; ids and masks as they are."""
    def cast(x: Any) -> Any:
        if isinstance(x, tte.Padded) and x.weights is not None:
            return tte.Padded(x.ids, x.mask, x.weights.to(dtype))
        return x

    return {k: cast(x) for k, x in batch.items()}, y.to(dtype)


def train(model: Model, run: torch.nn.Module, opt: torch.optim.Optimizer, dtype: torch.dtype, rank: int = 0,
          world: int = 1, nan_step: int | None = None, clip: bool = False, steps: range = range(STEPS),
          drawn: torch.dtype | None = None, observe: Callable[[], None] | None = None,
          jitter: int | None = None) -> None:
    """``nan_step``: that step's first target is NaN (on rank 0's share), so the whole step is non-finite;
    ``clip``: ``tte.clip_grad_norm_`` to 0.05 before each step; ``drawn``: the batches are drawn in that dtype
    (default ``dtype``) and cast to ``dtype``; ``observe``: called after each step; ``jitter`` (a seed): each
    example's squared error is scaled by 1 + u, u uniform in [-EPS32, EPS32], drawn anew each step."""
    for step in steps:
        batch, y = as_dtype(*global_batch(step, drawn or dtype), dtype)
        if step == nan_step:
            y[0] = float("nan")
        batch, y = share(batch, y, rank, world)
        err = (run(batch) - y) ** 2
        if jitter is not None:
            g = torch.Generator().manual_seed(jitter * 1000 + step)
            err = err * (1 + EPS32 * (2 * torch.rand(err.shape, generator=g, dtype=err.dtype) - 1))
        loss = err.mean()
        opt.zero_grad()
        loss.backward()
        if clip:
            tte.clip_grad_norm_(run.parameters(), 0.05)
        opt.step()
        if observe is not None:
            observe()
    model.ec.check_ids()  # nothing dropped (eager capacity)


def nan_step(name: str) -> int | None:
    """Configurations with ``skip_nonfinite`` see one non-finite step (step 4)."""
    return 4 if "skip" in name else None


def reference(name: str, dtype: torch.dtype, frozen_head: bool = False, shadow: bool = False,
              jitter: int | None = None) -> dict[str, Any]:
    """One process on the global batch (``frozen_head``: the dense head does not train). ``shadow``: float64
    from the float32 run's start (its model's values, its batches), the float32 run's exact counterpart; it
    also returns "peak", each leaf's largest magnitude over the start and every step. ``jitter``: train's."""
    model = Model(dtype)
    if shadow:
        assert dtype == torch.float64
        model.load_state_dict(Model(torch.float32).state_dict())  # the float32 values, exactly
    model.head.requires_grad_(not frozen_head)
    opt = make_opt(name, model.parameters())
    peak: dict[str, float] = {}

    def observe() -> None:
        for key, v in leaves({"model": model.state_dict(), "optimizer": opt.state_dict()}).items():
            if v.is_floating_point() and v.numel():
                peak[key] = max(peak.get(key, 0.0), float(v.abs().max()))

    if shadow:
        observe()
    train(model, model, opt, dtype, nan_step=nan_step(name), clip="clip_grad_norm" in name,
          drawn=torch.float32 if shadow else None, observe=observe if shadow else None, jitter=jitter)
    out = {"model": {k: v.clone() for k, v in model.state_dict().items()}, "optimizer": opt.state_dict()}
    return {**out, "peak": peak} if shadow else out


def leaves(run: dict[str, Any]) -> dict[str, torch.Tensor]:
    """A reference run's tensors by the names tests/distributed/test_mp_shard.py reports: model keys, "<state key>/<slot>"."""
    out = dict(run["model"])
    for key, slots in run["optimizer"]["state"].items():
        out.update({f"{key}/{slot}": v for slot, v in slots.items() if isinstance(v, torch.Tensor)})
    return out


def float32_bounds(one: dict[str, Any], exact: dict[str, Any], jittered: list[dict[str, Any]]) -> dict[str, float]:
    """Each leaf's float32 bound (the derivation above TOL): AMPLIFY * R + ROUNDINGS * EPS32 * the leaf's peak
    magnitude, R the largest distance from the float64 shadow ``exact`` (reference(shadow=True)) of the one-process
    float32 run ``one`` and of the ``jittered`` shadows (reference(shadow=True, jitter=seed)); integer leaves 0."""
    out, ones, shadows = {}, leaves(one), [leaves(j) for j in jittered]
    for key, want in leaves(exact).items():
        if not want.is_floating_point() or not want.numel():
            out[key] = 0.0
            continue
        r = max(float((run[key].double() - want).abs().max()) for run in [ones, *shadows])
        out[key] = AMPLIFY * r + ROUNDINGS * EPS32 * exact["peak"][key]
    return out


def storage_bytes(t: torch.Tensor) -> int:
    return int(t.untyped_storage().nbytes())


def _run(name: str, dtype: torch.dtype, rank: int, world: int, frozen_head: bool = False) -> dict[str, Any]:
    """One configuration on this rank; ``frozen_head``: the head does not train, so there is no DDP (the
    replicated tables are data parallel's, tte.distributed.data_parallel)."""
    model = Model(dtype, seed=0)
    placements = tte.distributed.shard(model)
    if frozen_head:
        model.head.requires_grad_(False)
        ddp: torch.nn.Module = tte.distributed.data_parallel(model)
    else:
        ddp = tte.distributed.DistributedDataParallel(model)
    opt = make_opt(name, ddp.parameters())
    train(model, ddp, opt, dtype, rank, world, nan_step=nan_step(name), clip="clip_grad_norm" in name)
    tables = model.ec.physical_tables()
    sharded = {}
    for t in SHARDED:
        w = tables[t].weight
        slots = {k: v for k, v in opt.state[w].items() if isinstance(v, torch.Tensor)}
        sharded[t] = {"ids": tte.distributed.logical_ids(tables[t]), "rows": w.detach().clone(),
                      "bytes": storage_bytes(w), "slot_bytes": {k: storage_bytes(v) for k, v in slots.items()},
                      "slot_rows": {k: (tuple(v.shape), v.element_size()) for k, v in slots.items()}}
    return {"placements": placements, "sharded": sharded, "optimizer": opt.state_dict(),
            "model": {k: v.clone() for k, v in model.state_dict().items()},
            "groups": sorted(model.ec.groups), "skipped": getattr(opt, "skipped_steps", 0)}


CKPT = "adafactor-global_clipnorm-ema"  # whole-table statistics, EMA and row slots to carry over


def _result(model: Model, opt: torch.optim.Optimizer) -> dict[str, Any]:
    tables = model.ec.physical_tables()
    sharded = {t: {"ids": tte.distributed.logical_ids(tables[t]), "rows": tables[t].weight.detach().clone()}
               for t in SHARDED}
    return {"sharded": sharded, "optimizer": opt.state_dict(),
            "model": {k: v.clone() for k, v in model.state_dict().items()}, "skipped": opt.skipped_steps}


def _checkpoint(rank: int, world: int, out_dir: str) -> dict[int, dict[str, Any]]:
    """World 4: 5 steps, save_sharded; then ranks 0..w-1 of new groups of 2 and 3 load it and train 5 more
    (the parent loads it into one process). Returns each resumed run by its world size."""
    dtype, path = torch.float64, os.path.join(out_dir, "ckpt")
    model = Model(dtype)
    tte.distributed.shard(model)
    ddp = tte.distributed.DistributedDataParallel(model)
    opt = make_opt(CKPT, ddp.parameters())
    train(model, ddp, opt, dtype, rank, world, steps=range(5))
    tte.distributed.save_sharded(path, model, opt)
    out = {}
    for w in (2, 3):
        group, dense = dist.new_group(list(range(w))), dist.new_group(list(range(w)))  # every rank takes part
        if rank < w:
            resumed = Model(dtype, seed=100 + rank)  # other values everywhere: all must come from the files
            tte.distributed.shard(resumed, group)
            ddp2 = tte.distributed.DistributedDataParallel(resumed, process_group=dense)
            opt2 = make_opt(CKPT, ddp2.parameters())
            tte.distributed.load_sharded(path, resumed, opt2)
            train(resumed, ddp2, opt2, dtype, rank, w, steps=range(5, STEPS))
            out[w] = _result(resumed, opt2)
        dist.barrier()
    return out


def _errors(rank: int, world: int) -> dict[str, str]:
    """What shard and the optimizer refuse, by message."""
    out = {}
    col = tte.TableConfig(600, 4, name="wide", placement="column")
    try:
        tte.distributed.shard(tte.EmbeddingCollection({"f": tte.FeatureConfig(col)}))
    except ValueError as e:
        out["column"] = str(e)
    model = Model(torch.float64)
    tte.distributed.shard(model)
    try:
        tte.distributed.shard(model)
    except RuntimeError as e:
        out["twice"] = str(e)
    model.float()  # new parameters: the sharded tables keep their layout
    moved = model.ec.tables["big"].weight
    out["moved"] = f"{moved.dtype} {tuple(moved.shape)} {tte.distributed.logical_ids(moved).shape[0]}"
    model.double()
    opt = O.Adagrad(model.parameters(), lr=0.1, use_gradient_accumulation=False)
    batch, y = share(*global_batch(0, torch.float64), rank, world)
    ((model(batch) - y) ** 2).mean().backward()
    try:
        opt.step()
    except ValueError as e:
        out["noaccum"] = str(e)
    return out


#: what the recording backend saw: (collective, input sizes, split sizes)
LOG: list[dict[str, Any]] = []


class Recording(dist.ProcessGroup):
    """A process-group backend that records every collective and runs it on gloo: what any caller issues
    (this library, DDP's C++ reducer, DTensor) passes through it. A collective it does not implement
    raises, so an unexpected kind fails the test rather than going unseen."""

    def __init__(self, inner: Any, rank: int, size: int) -> None:
        super().__init__(rank, size)
        self.inner = inner

    def _log(self, name: str, tensors: list[torch.Tensor], splits: tuple[Any, ...] = ()) -> None:
        LOG.append({"name": name, "sizes": [t.numel() for t in tensors], "splits": [list(x) for x in splits],
                    "bytes": [t.numel() * t.element_size() for t in tensors]})

    def allreduce(self, tensors: Any, opts: Any = None) -> Any:
        self._log("all_reduce", tensors)
        return self.inner.allreduce(tensors, opts) if opts is not None else self.inner.allreduce(tensors)

    def alltoall_base(self, out: Any, inp: Any, out_splits: Any, in_splits: Any, opts: Any = None) -> Any:
        self._log("all_to_all_single", [inp], (out_splits, in_splits))
        args = (out, inp, out_splits, in_splits) + ((opts,) if opts is not None else ())
        return self.inner.alltoall_base(*args)

    def _allgather_base(self, out: Any, inp: Any, opts: Any = None) -> Any:
        self._log("all_gather_into_tensor", [inp])
        return self.inner._allgather_base(out, inp, opts) if opts is not None else self.inner._allgather_base(out, inp)

    # torch >= 2.13 calls these names for all_gather_into_tensor and all_to_all_single (gloo keeps the old ones)
    def all_gather_single(self, out: Any, inp: Any, opts: Any = None) -> Any:
        return self._allgather_base(out, inp, opts)

    def all_to_all_single(self, out: Any, inp: Any, out_splits: Any, in_splits: Any, opts: Any = None) -> Any:
        return self.alltoall_base(out, inp, out_splits, in_splits, opts)

    def allgather(self, outs: Any, inp: Any, opts: Any = None) -> Any:
        self._log("all_gather", inp)
        return self.inner.allgather(outs, inp, opts) if opts is not None else self.inner.allgather(outs, inp)

    def broadcast(self, tensors: Any, opts: Any = None) -> Any:
        self._log("broadcast", tensors)
        return self.inner.broadcast(tensors, opts)

    def barrier(self, opts: Any = None) -> Any:
        self._log("barrier", [])
        return self.inner.barrier(opts) if opts is not None else self.inner.barrier()

    def getBackendName(self) -> str:  # noqa: N802 (torch's name)
        return "recording"

    def size(self) -> int:
        return int(self.inner.size())

    def rank(self) -> int:
        return int(self.inner.rank())


def _create_recording(store: Any, rank: int, size: int, timeout: Any) -> Recording:
    return Recording(dist.ProcessGroupGloo(store, rank, size, timeout), rank, size)


def _collectives(rank: int, world: int) -> list[dict[str, Any]]:
    """The collectives of one training step (after a first one) as the recording backend saw them: every
    placement, the head in tte.distributed.DistributedDataParallel, Adafactor with global_clipnorm and
    skip_nonfinite."""
    dtype = torch.float64
    model = Model(dtype)
    tte.distributed.shard(model)
    ddp = tte.distributed.DistributedDataParallel(model)
    opt = O.Adafactor(ddp.parameters(), lr=0.1, global_clipnorm=0.1, skip_nonfinite=True)

    def step(s: int) -> None:
        batch, y = share(*global_batch(s, dtype), rank, world)
        opt.zero_grad()
        ((ddp(batch) - y) ** 2).mean().backward()
        opt.step()

    step(0)
    LOG.clear()
    step(1)
    return list(LOG)


def worker(rank: int, world: int, port: int, out_dir: str) -> None:
    init_rank(rank, world, port, "recording", _create_recording)  # gloo, every collective recorded
    results: dict[str, Any] = {}
    for name in CONFIGS:
        for dtype in (torch.float64, torch.float32):
            results[f"{name}/{dtype}"] = _run(name, dtype, rank, world)
    for name in FROZEN_HEAD:
        results[f"{name}/frozen-head"] = _run(name, torch.float32, rank, world, frozen_head=True)
    results["errors"] = _errors(rank, world)
    results["collectives"] = _collectives(rank, world)
    if world == 4:
        results["checkpoint"] = _checkpoint(rank, world, out_dir)
    finish_rank(results, out_dir, rank)
