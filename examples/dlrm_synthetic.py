"""DLRM on synthetic click data: many embedding tables on a device mesh (torch_xla SPMD) or on the CPU.

The model is DLRM's (Naumov et al., 2019): a bottom MLP on the dense features, one embedding per
categorical feature (26 tables by default, as in Criteo; the first ``--multi-hot`` features are bags
of up to ``--max-ids-per-bag`` ids), the dot-product interaction of every pair of those vectors, a
top MLP and a binary cross-entropy loss. Ids follow a Zipf law (``--zipf-alpha``), drawn on the host
with a seeded generator; a fixed random teacher (a hidden score per id plus a linear function of the
dense features) draws the labels, so the loss has something to learn and falls.

Placement: every table gets ``TableConfig(placement=--placement)``; ``auto`` replicates tables under
``--replicate-below-bytes`` and row-shards the others (docs/sharding.md). Inputs are replicated,
or batch-sharded with ``torch_tpu_embedding.xla.shard_batch`` (``--shard-batch``, the default: the
dense layers are then data parallel). Tables are trained by ``--optimizer`` (any optimizer of
``tte.optim``, as a per-table override), dense layers by ``--dense-optimizer`` (``adam``/``sgd``:
``tte.optim``, the same optimizer object; ``torch-adam``/``torch-sgd``: a second, ``torch.optim``
one). Every step is one XLA graph: fixed batch size and bag capacities, no ``.item()`` in the
loop, one ``torch_xla.sync()`` per step; losses are read back after the sync, every
``--log-every`` steps. At the end it prints steps/s, the loss, the number of compiled graphs
(``UncachedCompile``), the host fallbacks and every table's sharding.

Run here (XLA on the CPU, 4 virtual devices, one process)::

    PJRT_DEVICE=CPU CPU_NUM_DEVICES=4 python examples/dlrm_synthetic.py --steps 100
    python examples/dlrm_synthetic.py --device cpu --steps 100            # eager CPU, no torch_xla

On a Cloud TPU VM (one host: SPMD over its chips; not run by this project, which has no TPU)::

    PJRT_DEVICE=TPU python examples/dlrm_synthetic.py --steps 1000 --batch 8192 --vocab 1000000,100000,1000

On a multi-host TPU slice, the same command on every worker at the same time (run from outside the
TPU VMs). Each process calls ``xr.use_spmd()`` and sees one global mesh over every chip of every
host; torch_xla reads the slice's topology from the TPU VM, so no ``torchrun`` is needed::

    gcloud compute tpus tpu-vm ssh $TPU_NAME --zone=$ZONE --worker=all \\
        --command="cd torch_tpu_embedding && PJRT_DEVICE=TPU python examples/dlrm_synthetic.py --steps 1000"

torch_xla 2.9 documents ``torchrun`` for multi-process (non-SPMD) runs with ``init_method='xla://'``;
its SPMD-with-torchrun recipe (``--nnodes=$HOSTS --node_rank=$RANK --nproc_per_node=1``, one
process per host) was written for GPUs (docs r2.8 ``spmd_gpu.md``) and is not needed on TPU.
Every host draws the same global batch from the same seed; ``shard_batch`` then uploads to each
device only its part of the batch. A real input pipeline reads its host's part instead.

Checkpoints (``--save``): a directory is written with ``tte.checkpoint.save_distributed`` (every
process writes its shards; no table is gathered; on several hosts the script first joins a ``gloo``
process group with ``init_method='xla://'``, as torch_xla's distributed-checkpoint guide
prescribes, since ``torch.distributed.checkpoint`` coordinates the writers; a ``torch.optim`` dense
optimizer's state goes in as its ``extra``); a path ending in ``.pt`` with
``tte.checkpoint.save``, called by every process because gathering a sharded table to the host is a
computation over all devices (on several hosts, each writes the same file: use a local path).

Measured here (2026-11-23; XLA:CPU, 4 virtual devices in one process on a shared 2-core machine,
torch 2.9.0 + torch_xla 2.9.0; the defaults: 26 tables of dim 16 with vocabularies 100,000 / 20,000 /
5,000 / 1,000 cycled, 4 multi-hot bags of <= 8 ids, batch 512, Zipf 1.05, lazy TPU Adam for tables
and dense layers, 100 steps; one parameter per table, i.e. today's ``--no-stack-tables``: these runs
predate stacking by default). Every run: one compiled graph (the first step, ~10 s), none after, no
host fallback, loss 0.69 -> 0.57 (the teacher's own loss is 0.37). Steady steps/s, three runs each
(other jobs shared the cores; XLA:CPU is no guide to TPU speed):

* ``--placement auto`` (7 tables row-sharded, 19 replicated): 7.1-10.9
* ``--placement row``: 6.5-7.9; ``column``: 7.1-7.9; ``replicated``: 3.9-4.2
* ``--placement auto --no-shard-batch``: 7.1-7.2
* one XLA device (``CPU_NUM_DEVICES=1``, no SPMD): 9.0-9.7; ``--device cpu`` (eager): 26-28

With ``--stack-tables`` (now the default; one run each, the machine otherwise idle; unstacked in brackets,
same run): ``--placement replicated`` 17.1 (7.3), ``row`` 13.5 (11.4), ``auto`` 16.8 (12.8; measured when
``auto`` decided by the size of the whole group, so all 26 tables were one row-sharded group; now each
table keeps the placement ``auto`` gives it alone and groups form per placement, as unstacked).
Unstacked replicated tables of one size are equal-sized buffers that XLA's donation pairing mixes up:
the step copied whole tables (8 ``f32[20480,16]`` copies per step in the test's short mode); one group has no such copy
(``tests/xla_spmd/test_dlrm_example.py``).

``torch-adam``/``torch-sgd`` dense optimizers create their state in the first step, so the run
compiles two graphs (steps 1 and 2) and none after.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import time
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

import torch_tpu_embedding as tte

# Table learning rates that learn this task in ~100 steps (measured here). A table row's gradient
# is ~1/batch of a mean loss and TF's Adagrad/FTRL start from accumulators of 0.1, hence large rates.
TABLE_LR = {"sgd": 20.0, "adagrad": 10.0, "adagrad_momentum": 0.5, "adam": 0.05, "lazy_adam": 0.05,
            "ftrl": 5.0, "adafactor": 0.1}
DENSE_OPTIMIZERS = ("adam", "sgd", "torch-adam", "torch-sgd")
DENSE_LR = {"adam": 1e-3, "sgd": 0.5, "torch-adam": 1e-3, "torch-sgd": 0.5}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--device", choices=["xla", "cpu"], default="xla",
                    help="xla: torch_xla's device, SPMD over every device when there are several; "
                         "cpu: eager PyTorch, torch_xla not imported")
    ap.add_argument("--devices", type=int, default=None,
                    help="expected device count; on XLA:CPU it sets CPU_NUM_DEVICES before torch_xla starts")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--warmup", type=int, default=2, help="steps left out of the steps/s (they compile)")
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--batch", type=int, default=512, help="global batch size (fixed: one graph)")
    ap.add_argument("--tables", type=int, default=26, help="categorical features, one table each")
    ap.add_argument("--vocab", default="100000,20000,5000,1000",
                    help="vocabulary size(s), comma-separated, cycled over the tables")
    ap.add_argument("--dim", type=int, default=16, help="embedding dimension (also the bottom MLP's output)")
    ap.add_argument("--dense-features", type=int, default=13)
    ap.add_argument("--multi-hot", type=int, default=4, help="how many features (the first ones) are bags")
    ap.add_argument("--max-ids-per-bag", type=int, default=8, help="bag capacity of the multi-hot features")
    ap.add_argument("--zipf-alpha", type=float, default=1.05, help="id i has probability ~ (i + 1)^-alpha")
    ap.add_argument("--placement", choices=list(tte.PLACEMENTS), default="auto",
                    help="TableConfig.placement of every table (auto: the size rule)")
    ap.add_argument("--replicate-below-bytes", type=int, default=4 << 20,
                    help="placement auto replicates tables smaller than this")
    ap.add_argument("--stack-tables", action=argparse.BooleanOptionalAction, default=True,
                    help="stack tables of one placement in one buffer per group (EmbeddingCollection stack_tables; "
                         "the default)")
    ap.add_argument("--shard-batch", action=argparse.BooleanOptionalAction, default=True,
                    help="split the inputs over the mesh by batch (data parallel dense layers)")
    ap.add_argument("--optimizer", choices=sorted(TABLE_LR), default="adam", help="for the tables")
    ap.add_argument("--lr", type=float, default=None, help="table learning rate (default: per optimizer)")
    ap.add_argument("--dense-optimizer", choices=DENSE_OPTIMIZERS, default="adam")
    ap.add_argument("--dense-lr", type=float, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--save", default="", help="checkpoint at the end: a directory (distributed) or a .pt file")
    args = ap.parse_args(argv)
    args.vocabs = [int(v) for v in args.vocab.split(",")]
    for name in ("steps", "batch", "tables", "dim", "dense_features", "max_ids_per_bag", "log_every"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    if min(args.vocabs) < 1 or not 0 <= args.multi_hot <= args.tables or args.zipf_alpha < 0:
        ap.error("--vocab sizes must be >= 1, --multi-hot in [0, --tables], --zipf-alpha >= 0")
    if not 0 <= args.warmup < args.steps:
        ap.error("--warmup must be in [0, --steps)")
    return args


class SyntheticClicks:
    """Criteo-like batches with Zipf-distributed ids and labels from a fixed random teacher.

    Feature ``t`` draws ids from ``P(rank r) ~ (r + 1)^-alpha`` over its vocabulary, mapped through a
    fixed permutation (hot ids are spread over the rows, as after hashing). The teacher's logit is
    ``3 (sum_t mean_bag s_t[id]) / sqrt(T) + x . w`` with hidden scores ``s_t ~ N(0, 1)`` per id and
    ``w ~ N(0, 1/F)``; the label is a Bernoulli draw of its sigmoid.
    """

    def __init__(self, vocabs: list[int], dense_features: int, multi_hot: int, bag: int, alpha: float,
                 seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.vocabs, self.multi_hot, self.bag, self.dense_features = vocabs, multi_hot, bag, dense_features
        self.cdfs, self.perms, self.scores = [], [], []
        for v in vocabs:
            p = (torch.arange(1, v + 1, dtype=torch.float64)) ** -alpha
            self.cdfs.append(torch.cumsum(p / p.sum(), 0))
            self.perms.append(torch.randperm(v, generator=g))
            self.scores.append(torch.randn(v, generator=g))
        self.w = torch.randn(dense_features, generator=g) / math.sqrt(dense_features)
        self.gen = torch.Generator().manual_seed(seed + 1)  # the batches: the same on every host

    def _ids(self, t: int, n: int) -> torch.Tensor:
        u = torch.rand(n, generator=self.gen, dtype=torch.float64)
        rank = torch.searchsorted(self.cdfs[t], u).clamp_(max=self.vocabs[t] - 1)
        return self.perms[t][rank]

    def batch(self, b: int) -> tuple[torch.Tensor, list[torch.Tensor | tte.Padded], torch.Tensor]:
        """``(dense [B, F], one input per feature, labels [B])``, host tensors of fixed shapes.

        Single-hot features are ``[B]`` ids; multi-hot ones ``Padded(ids [B, L], mask [B, L])`` with
        ``1..L`` real ids per bag (padding positions hold id 0 and are masked out).
        """
        dense = torch.randn(b, self.dense_features, generator=self.gen)
        logit = dense @ self.w
        hidden = torch.zeros(b)
        sparse: list[torch.Tensor | tte.Padded] = []
        for t in range(len(self.vocabs)):
            if t < self.multi_hot:
                lengths = torch.randint(1, self.bag + 1, (b,), generator=self.gen)
                mask = torch.arange(self.bag) < lengths[:, None]
                ids = torch.where(mask, self._ids(t, b * self.bag).view(b, self.bag), 0)
                hidden += (self.scores[t][ids] * mask).sum(1) / lengths
                sparse.append(tte.Padded(ids, mask))
            else:
                ids = self._ids(t, b)
                hidden += self.scores[t][ids]
                sparse.append(ids)
        logit += 3.0 * hidden / math.sqrt(len(self.vocabs))
        label = torch.bernoulli(torch.sigmoid(logit), generator=self.gen)
        return dense, sparse, label


def mlp(sizes: list[int], last_relu: bool) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:], strict=True)):
        layers.append(nn.Linear(a, b))
        if i < len(sizes) - 2 or last_relu:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class DLRM(nn.Module):
    """Bottom MLP ``[B, F] -> [B, D]``, embeddings ``T x [B, D]``, pairwise dots of the ``T + 1``
    vectors (``[B, (T+1) T / 2]``, the strict upper triangle), top MLP on ``[bottom, dots]`` -> ``[B]``."""

    def __init__(self, features: dict[str, tte.FeatureConfig], dense_features: int, dim: int,
                 device: torch.device, stack_tables: bool = True) -> None:
        super().__init__()
        self.names = list(features)
        self.embeddings = tte.EmbeddingCollection(features, device=device, stack_tables=stack_tables)
        self.bottom = mlp([dense_features, 64, dim], last_relu=True)
        n = len(features) + 1
        upper = torch.triu_indices(n, n, offset=1)
        self.register_buffer("pairs", upper[0] * n + upper[1], persistent=False)  # flat [i, j], i < j
        self.top = mlp([dim + n * (n - 1) // 2, 128, 64, 1], last_relu=False)
        self.bottom.to(device)
        self.top.to(device)
        self.pairs = self.pairs.to(device)

    def forward(self, dense: torch.Tensor, sparse: dict[str, Any]) -> torch.Tensor:
        x = self.bottom(dense)
        emb = self.embeddings(sparse)
        f = torch.stack([x, *(emb[k] for k in self.names)], dim=1)  # [B, T + 1, D]
        dots = torch.bmm(f, f.transpose(1, 2)).flatten(1).index_select(1, self.pairs)
        return self.top(torch.cat([x, dots], dim=1)).squeeze(1)


def build_model(args: argparse.Namespace, device: torch.device) -> DLRM:
    """The model of these arguments: feature ``cat_<t>`` looked up in table ``t<t>`` of vocabulary
    ``vocabs[t % len(vocabs)]``, every table with ``--placement`` and ``--optimizer`` as its override."""
    torch.manual_seed(args.seed)  # the same initial tables and layers on every host
    table_opt = functools.partial(tte.optim.optimizer_class(args.optimizer), lr=table_lr(args))
    features = {
        f"cat_{t}": tte.FeatureConfig(
            tte.TableConfig(v, args.dim, name=f"t{t}", optimizer=table_opt, placement=args.placement),
            max_ids_per_bag=args.max_ids_per_bag if t < args.multi_hot else None)
        for t, v in enumerate(vocabs(args))
    }
    return DLRM(features, args.dense_features, args.dim, device, stack_tables=args.stack_tables)


def vocabs(args: argparse.Namespace) -> list[int]:
    return [args.vocabs[t % len(args.vocabs)] for t in range(args.tables)]


def table_lr(args: argparse.Namespace) -> float:
    return TABLE_LR[args.optimizer] if args.lr is None else args.lr


def build_optimizers(model: DLRM, args: argparse.Namespace) -> list[torch.optim.Optimizer]:
    """Tables: ``--optimizer`` (a per-table override, so one ``tte.optim`` object can also train the
    dense layers); dense layers: the same object, or a ``torch.optim`` one."""
    dense_params = [*model.bottom.parameters(), *model.top.parameters()]
    dense_lr = DENSE_LR[args.dense_optimizer] if args.dense_lr is None else args.dense_lr
    if args.dense_optimizer == "torch-adam":
        dense_opt: torch.optim.Optimizer = torch.optim.Adam(dense_params, lr=dense_lr)
    elif args.dense_optimizer == "torch-sgd":
        dense_opt = torch.optim.SGD(dense_params, lr=dense_lr)
    else:
        cls = tte.optim.Adam if args.dense_optimizer == "adam" else tte.optim.SGD
        return [cls([*model.embeddings.parameters(), *dense_params], lr=dense_lr)]  # tables: overridden
    return [tte.optim.optimizer_class(args.optimizer)(model.embeddings.parameters(), lr=table_lr(args)), dense_opt]


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    on_xla = args.device == "xla"
    spmd = False
    if on_xla:
        if args.devices and os.environ.get("PJRT_DEVICE", "CPU") == "CPU":
            os.environ["CPU_NUM_DEVICES"] = str(args.devices)  # read when the runtime starts
        import torch_xla
        import torch_xla.core.xla_model as xm
        import torch_xla.debug.metrics as met
        import torch_xla.runtime as xr

        n_devices = xr.global_runtime_device_count()
        if args.devices and n_devices != args.devices:
            raise SystemExit(f"--devices {args.devices}: this runtime has {n_devices} devices")
        spmd = n_devices > 1
        if spmd:
            xr.use_spmd()  # before any XLA tensor exists, in every process
        device = torch_xla.device()
        processes, process_index = xr.process_count(), xr.process_index()
        if processes > 1 and args.save and not args.save.endswith(".pt"):
            # torch.distributed.checkpoint coordinates the hosts' writes over a CPU process group
            # (torch_xla's distributed-checkpoint guide: gloo, hosts found by init_method 'xla://').
            import torch.distributed as dist
            import torch_xla.distributed.xla_backend  # noqa: F401  registers 'xla://'

            dist.init_process_group("gloo", init_method="xla://")
    else:
        device, n_devices, processes, process_index = torch.device("cpu"), 1, 1, 0

    def log(line: str) -> None:
        if process_index == 0:  # every host runs the same steps; one of them reports
            print(line, flush=True)

    model = build_model(args, device)
    placements: dict[str, str] = {}
    mesh = None
    if spmd:
        from torch_tpu_embedding.xla import device_mesh, replicate, shard, shard_batch, sharding_spec

        mesh = device_mesh()  # every device of every host, axis "x"
        placements = shard(model.embeddings, mesh, replicate_below_bytes=args.replicate_below_bytes)
        replicate(model.bottom, mesh)
        replicate(model.top, mesh)
    optimizers = build_optimizers(model, args)
    for opt in optimizers:
        if isinstance(opt, tte.optim.RowSparseOptimizer):
            opt.init_state()  # slots now, laid out like their tables: the loop's graph is the only one
    counts = {p: list(placements.values()).count(p) for p in sorted(set(placements.values()))}
    log(f"device={args.device} devices={n_devices} processes={processes} spmd={spmd} "
          f"shard_batch={args.shard_batch and spmd} tables={args.tables} batch={args.batch} "
          f"optimizer={args.optimizer}(lr={table_lr(args)}) dense_optimizer={args.dense_optimizer}")
    if spmd:
        log(f"placements: {counts} (--placement {args.placement}, --stack-tables {args.stack_tables}, "
              f"--replicate-below-bytes {args.replicate_below_bytes})")

    data = SyntheticClicks(vocabs(args), args.dense_features, args.multi_hot, args.max_ids_per_bag,
                           args.zipf_alpha, args.seed)
    names = model.names

    def to_device(x: torch.Tensor) -> torch.Tensor:
        x = x.to(device)
        return shard_batch(x, mesh) if spmd and args.shard_batch else x

    def train_step(dense: torch.Tensor, sparse: list[Any], label: torch.Tensor) -> torch.Tensor:
        if spmd and args.shard_batch:  # ids on the device, split by batch; else host ids, replicated
            sparse = [tte.Padded(to_device(s.ids), to_device(s.mask)) if isinstance(s, tte.Padded)
                      else to_device(s) for s in sparse]
        logits = model(to_device(dense), dict(zip(names, sparse, strict=True)))
        loss = nn.functional.binary_cross_entropy_with_logits(logits, to_device(label))
        loss.backward()
        for opt in optimizers:
            opt.step()
            opt.zero_grad()
        return loss.detach()

    if on_xla:
        torch_xla.sync()
        xm.wait_device_ops()
        met.clear_all()
    losses: list[float] = []
    pending: list[torch.Tensor] = []
    compiles_after_warmup = 0
    start = time.perf_counter()
    warmup_s = 0.0
    for step in range(args.steps):
        if step == args.warmup:
            if on_xla:
                xm.wait_device_ops()  # the timing starts with an idle device
                compiles_after_warmup = met.counter_value("UncachedCompile") or 0
            warmup_s, start = time.perf_counter() - start, time.perf_counter()
        pending.append(train_step(*data.batch(args.batch)))
        if on_xla:
            torch_xla.sync()
        if len(pending) == args.log_every or step == args.steps - 1:
            # after the sync each loss is device data: reading it is a transfer, not a graph break
            window = [float(x.cpu()) for x in pending]
            losses += window
            pending = []
            log(f"step {step:5d} loss {sum(window) / len(window):.4f}")
    if on_xla:
        xm.wait_device_ops()
    elapsed = time.perf_counter() - start
    timed = args.steps - args.warmup
    k = min(args.log_every, len(losses))
    first, last = sum(losses[:k]) / k, sum(losses[-k:]) / k
    log(f"steps/s {timed / elapsed:.2f} ({timed} steps in {elapsed:.2f} s after {args.warmup} warm-up steps "
        f"in {warmup_s:.1f} s; {args.batch * timed / elapsed:,.0f} examples/s)")
    log(f"loss first {first:.4f} last {last:.4f} (means of {k} steps)")
    if on_xla:
        compiles = met.counter_value("UncachedCompile") or 0
        log(f"compiled graphs: {compiles} (after warm-up: {compiles - compiles_after_warmup}); "
              f"host fallbacks: {met.executed_fallback_ops()}")
    if spmd:
        # Row-sharded tables train through the id exchange: each device sends its ids to the shards that
        # own them, with a fixed capacity per (device, shard); ids over it are counted on the device (never
        # read back in the loop), as are out-of-range ids sent to the device. Report the loads, and raise
        # now if any id was dropped. After the metrics: reading the counters is a transfer.
        loads = model.embeddings.largest_loads()
        if loads:
            log("id exchange, largest per-shard load / capacity: "
                + json.dumps({t: [max(v["largest_load"]), v["capacity"]] for t, v in sorted(loads.items())}))
        model.embeddings.check_ids()
    if spmd:
        # Per table: its placement, and the rows and layout of the parameter holding it (its group's, if stacked).
        physical = model.embeddings.physical_tables()
        owner = {t: g for g, members in model.embeddings.stacked_members().items() for t, _, _ in members}
        weights = {n: physical[owner.get(n, n)].weight for n in model.embeddings.tables}
        log("shardings: " + json.dumps({n: [placements[n], w.shape[0], sharding_spec(w)] for n, w in weights.items()}))
    if args.save:
        save(args.save, model, optimizers)
        log(f"saved {args.save}")


def save(path: str, model: DLRM, optimizers: list[torch.optim.Optimizer]) -> None:
    """Tables and slots with ``tte.checkpoint``; a ``torch.optim`` dense optimizer's state as ``extra`` (every
    process: the gather of a sharded table, or of a sharded slot in ``extra``, runs on every device)."""
    opt, rest = optimizers[0], optimizers[1:]
    extra = {"dense_optimizer": rest[0].state_dict()} if rest else None
    if path.endswith(".pt"):
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        tte.checkpoint.save(path, model=model, optimizer=opt, extra=extra)
    else:  # (extra published with the shards: never another save's dense state beside these tables)
        tte.checkpoint.save_distributed(path, model=model, optimizer=opt, extra=extra)


if __name__ == "__main__":
    main()
