"""Train a sharded embedding model with torch_xla SPMD — the same script on one host or many.

Tables are placed on a 1-D device mesh by their ``TableConfig.placement`` (a large row-sharded user
table, a column-sharded item table, a small replicated table); the dense tower is replicated. The
row-sharded table trains through the id exchange: each device looks up its slice of the batch by
sending the ids to the shards that own them, and the optimizer updates every row where it lives, so
per-device communication follows the device's own batch, not the number of devices times the batch.
The optimizer's slots are created with their table's layout, and every training step is one compiled
graph (docs/sharding.md).

Run here (XLA on the CPU, 4 virtual devices, single process)::

    PJRT_DEVICE=CPU CPU_NUM_DEVICES=4 python examples/tpu_train.py --steps 20

On a Cloud TPU VM (one host)::

    PJRT_DEVICE=TPU python examples/tpu_train.py --steps 1000

On a multi-host TPU pod slice, the same command on every worker (each process sees the global mesh)::

    gcloud compute tpus tpu-vm ssh $TPU_NAME --zone=$ZONE --worker=all \\
        --command="cd torch_tpu_embedding && PJRT_DEVICE=TPU python examples/tpu_train.py --steps 1000"

Every host draws the same global batch from the same seed (the inputs are replicated); a real input
pipeline reads its host's part and marks it batch-sharded with ``torch_tpu_embedding.xla.shard_batch``.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

import torch_tpu_embedding as tte


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--users", type=int, default=200_000)
    ap.add_argument("--optimizer", choices=["adam", "adafactor", "adagrad"], default="adam")
    ap.add_argument("--save", default="", help="write the model and optimizer state_dict here at the end")
    args = ap.parse_args()

    import torch_xla
    import torch_xla.debug.metrics as met
    import torch_xla.runtime as xr

    xr.use_spmd()  # before any XLA tensor exists
    from torch_tpu_embedding.xla import device_mesh, replicate, shard

    dev = torch_xla.device()
    mesh = device_mesh()
    dim = 16
    user = tte.TableConfig(args.users, dim, name="user", placement="row")
    item = tte.TableConfig(50_000, dim, name="item", placement="column", combiner="sqrtn")
    genre = tte.TableConfig(32, dim, name="genre", placement="replicated")
    features = {
        "user": tte.FeatureConfig(user),
        "history": tte.FeatureConfig(item, max_ids_per_bag=8),
        "genres": tte.FeatureConfig(genre, max_ids_per_bag=4),
        "candidate": tte.FeatureConfig(item),
    }
    ec = tte.EmbeddingCollection(features, device=dev)
    tower = torch.nn.Sequential(torch.nn.Linear(4 * dim, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)).to(dev)
    placements = shard(ec, mesh)  # before the optimizer: row sharding pads the rows
    replicate(tower, mesh)
    make = {
        "adam": lambda ps: tte.optim.Adam(ps, lr=1e-3),
        "adafactor": lambda ps: tte.optim.Adafactor(ps, lr=1e-2),
        "adagrad": lambda ps: tte.optim.Adagrad(ps, lr=0.05),
    }[args.optimizer]
    opt = make(list(ec.parameters()) + list(tower.parameters()))
    opt.init_state()
    torch_xla.sync()
    met.clear_all()
    print(f"devices={xr.global_runtime_device_count()} processes={xr.process_count()} placements={placements}")

    g = torch.Generator().manual_seed(0)  # the same global batch on every host
    b = args.batch
    start = time.perf_counter()
    for step in range(args.steps):
        users = torch.randint(0, args.users, (b,), generator=g)
        lengths = torch.randint(0, 9, (b,), generator=g)
        history = torch.randint(0, 50_000, (int(lengths.sum()),), generator=g)
        genres = torch.randint(0, 32, (b, 4), generator=g)
        candidate = torch.randint(0, 50_000, (b,), generator=g)
        label = (users % 2 == candidate % 2).float().to(dev)
        out = ec({"user": users, "history": tte.Jagged(history, lengths=lengths),
                  "genres": tte.Padded(genres, genres >= 8), "candidate": candidate})
        x = torch.cat([out["user"], out["history"], out["genres"], out["candidate"]], dim=1)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(tower(x).squeeze(1), label)
        loss.backward()
        opt.step()
        opt.zero_grad()
        torch_xla.sync()
        if step % 10 == 0 or step == args.steps - 1:
            print(f"step {step:4d} loss {float(loss.detach().cpu()):.4f}")  # a transfer, not a host op
    elapsed = time.perf_counter() - start
    compiles = met.counter_value("UncachedCompile") or 0
    fallbacks = met.executed_fallback_ops()
    print(f"{args.steps} steps in {elapsed:.1f}s; compiled graphs: {compiles}; host fallbacks: {fallbacks}")
    # Ids over the capacity of the id exchange are counted on the device (reading the counters gathers them:
    # do it at a sync point, e.g. with the loss logging). Raise if any was dropped: the error names the
    # capacity that would have sufficed.
    loads = ec.largest_loads()
    ec.check_ids()
    print("id exchange, largest per-shard load / capacity: "
          + ", ".join(f"{t}: {max(v['largest_load'])} / {v['capacity']}" for t, v in loads.items()))
    if args.save:
        # Every process calls save: gathering a sharded table to the host runs on all devices. On
        # several hosts each writes the same logical checkpoint to its own (local) path; for tables
        # too large for one host use tte.checkpoint.save_distributed (docs/checkpoints.md).
        os.makedirs(os.path.dirname(os.path.abspath(args.save)), exist_ok=True)
        tte.checkpoint.save(args.save, model=ec, optimizer=opt)
        print(f"saved {args.save}")


if __name__ == "__main__":
    main()
