"""A small wide & deep click model trained with torch_tpu_embedding on synthetic data.

Run on the CPU:        python examples/quickstart.py
Run on XLA (TPU/CPU):  PJRT_DEVICE=CPU python examples/quickstart.py --xla

The wide table uses FTRL (per-table override), the deep tables lazy Adam; a hidden rule makes
clicks depend on the user and on the movies watched, so the loss must fall.
"""

from __future__ import annotations

import argparse
import functools

import torch

import torch_tpu_embedding as tte

USERS, MOVIES, DIM = 500, 300, 16


def make_batch(gen: torch.Generator, batch: int) -> tuple[dict[str, object], torch.Tensor]:
    user = torch.randint(0, USERS, (batch,), generator=gen)
    lengths = torch.randint(1, 6, (batch,), generator=gen)
    watched = torch.randint(0, MOVIES, (int(lengths.sum()),), generator=gen)
    bag_of = torch.repeat_interleave(torch.arange(batch), lengths)
    # Hidden rule: even users click, and so does anyone who watched a movie id < 60.
    likes = torch.zeros(batch).index_add_(0, bag_of, (watched < 60).float()) > 0
    label = ((user % 2 == 0) | likes).float()
    features = {"user": user, "watched": tte.Jagged(watched, lengths=lengths), "wide_user": user}
    return features, label


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--xla", action="store_true", help="run on torch_xla's device")
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()
    device = torch.device("cpu")
    if args.xla:
        import torch_xla

        device = torch_xla.device()

    torch.manual_seed(0)
    user = tte.TableConfig(USERS, DIM, name="user")
    movie = tte.TableConfig(MOVIES, DIM, name="movie", combiner="sqrtn")
    wide = tte.TableConfig(USERS, 1, name="wide", combiner="sum",
                           optimizer=functools.partial(tte.optim.FTRL, lr=0.5))
    ec = tte.EmbeddingCollection({
        "user": tte.FeatureConfig(user),
        "watched": tte.FeatureConfig(movie, max_ids_per_bag=8),
        "wide_user": tte.FeatureConfig(wide),
    }, device=device)
    mlp = torch.nn.Sequential(torch.nn.Linear(2 * DIM, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1)).to(device)
    opt = tte.optim.Adam(list(ec.parameters()) + list(mlp.parameters()), lr=0.01)  # lazy on tables
    gen = torch.Generator().manual_seed(1)
    for step in range(args.steps):
        features, label = make_batch(gen, 256)
        out = ec(features)
        logits = mlp(torch.cat([out["user"], out["watched"]], dim=1)).squeeze(1) + out["wide_user"].squeeze(1)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, label.to(device))
        loss.backward()
        opt.step()
        opt.zero_grad()
        if args.xla:
            torch_xla.sync()
        if step % 50 == 0 or step == args.steps - 1:
            print(f"step {step:4d}  loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
