"""Rating prediction on MovieLens-100k: a wide + FM + deep ranking model on one EmbeddingCollection.

Predicts whether a user rates a movie 4 or 5 (55% of the ratings do) from the user id, movie id,
gender, age bucket, occupation, zip code (its first 3 characters), release year and the movie's
genres (a bag of 1-6 ids, given as ``tte.Jagged``, combiner mean). Every field has a deep table
(dim 16, initial values N(0, 0.01²)) and a wide dim-1 table (zeros); the logit is

    b + Σ_f wide_f + Σ_{f<g} <deep_f, deep_g> (FM) + MLP([deep_1, ..., deep_8])   (MLP 128-64-32-1)

One optimizer object, ``tte.optim.Adam(model.parameters(), lr=3e-3)`` with torch.optim.Adam's numbers
(bias correction, ε outside the square root), trains the MLP; per-table overrides
(``TableConfig(optimizer=...)``, docs/optimizers.md "Per-table optimizers") train the deep tables with
Adagrad (lr 0.7; ``--deep-optimizer lazy_adam|adafactor`` for the others) and the wide ones with FTRL
(lr 0.05). Batches of 1024.

Data: the MovieLens-100k files that ship inside the recbole wheel
(``recbole/dataset_example/ml-100k/``), located with ``importlib.util.find_spec`` and read as RecBole
atomic files; recbole is not imported (``pip install --no-deps recbole==1.2.1``). Splits: random 80/20
(``--seed``) or ``--split time`` (the latest 20% by timestamp is the test set); 10% of the rest (random,
or its latest for ``--split time``) is the validation set. Early stopping on the validation AUC
(``--patience`` 3, at most ``--epochs`` 30); the test split is scored with the best epoch's weights.
AUC is the rank formula with tied scores given their average rank (:func:`auc`).

On XLA (the default; XLA:CPU here, ``PJRT_DEVICE=TPU`` on a TPU): one batch size (the last partial
training batch is dropped and the order changes every epoch; the last evaluation batch is padded), the
bag capacity fixed by ``max_ids_per_bag``, one ``torch_xla.sync()`` per step and no ``.item()``, so
training and evaluation are one graph each, whatever the number of steps; the count is printed.

Run from the repository root (the package importable: ``pip install -e .`` or ``PYTHONPATH=.``)::

    python examples/movielens.py                       # XLA
    python examples/movielens.py --compare-torch       # and the plain-PyTorch twin, side by side
    python examples/movielens.py --split time --compare-torch
    python examples/movielens.py --device cpu          # eager PyTorch, torch_xla not imported
    python examples/movielens.py --short               # CI: half the training split, 3 epochs
    python examples/movielens.py --epochs 5 --save ckpt.pt   # a checkpoint after every epoch
    python examples/movielens.py --resume ckpt.pt      # continues from epoch 6

``--compare-torch`` trains a twin after ours: the same features, architecture, initial weights, loop,
splits and early stopping, with ``nn.Embedding`` tables (the genre bag as padded ids and a mask) and one
``torch.optim.Adam`` (lr 3e-3) for every parameter. ``--save``/``--resume`` hold our model only (with its
optimizer, the history and the best weights so far); the twin always starts afresh.

Measured 2026-11-26 (the time split's twin: 2026-11-23), XLA:CPU on a shared 2-core Intel Xeon, torch
2.9.0 / torch_xla 2.9.0, seed 0. The last digits depend on the CPU (an AMD EPYC prints 0.7897 / 0.5489,
best epoch 14, for the first row): README.md shows the default run per CPU and the bands every CPU's
run falls in, which tests/docs/test_readme_movielens_figures.py checks:

    split    model                          test AUC  log loss  best epoch
    random   ours (Adagrad + FTRL + Adam)     0.7896    0.5530          17
    random   twin (nn.Embedding + Adam)       0.7861    0.5538           7
    time     ours                             0.6975    0.6299           5
    time     twin                             0.6970    0.6263           2

Wall time (one machine, quieter than README.md's fresh-clone runs; README.md gives their ranges): 64 s
for the default run (54-57 s of it training and evaluating), 80-87 s with
``--compare-torch``, 41 s for ``--split time --compare-torch``; ``--short`` 13 s (test AUC 0.7564),
5 s with ``--device cpu``. Eager CPU (``--device cpu --compare-torch``, 31 s): ours 0.7901 / 0.5483,
the twin 0.7874 / 0.5529. XLA compilations: 3 in the default run (training, evaluation and the
optimizer's state initialisation); the twin adds 3 (its first Adam step, which creates its state, is a
graph of its own). On the time split 85% of the test ratings come from users with no rating before
(cold start: only their side features help). The split moves the AUC more than the model does: over
seeds 0-3 (eager CPU, where the numbers differ from XLA:CPU in the last digits) ours measured
0.7901 / 0.7864 / 0.7929 / 0.7824 (mean 0.7880), the twin 0.7874 / 0.7857 / 0.7955 / 0.7807 (0.7873).
LazyAdam on the deep tables (TPU Adam, lr 1e-3 to 3e-3) measured 0.7861-0.7880 at seed 0 and a mean of
0.7871 over the four seeds (it overfits after 4-7 epochs); Adafactor (lr 0.05-0.2) 0.7852-0.7855.

License: MovieLens-100k is from the GroupLens Research Project, University of Minnesota. Its terms allow
research use with acknowledgement (F. M. Harper and J. A. Konstan, The MovieLens Datasets: History and
Context, ACM TiiS 5(4), 2015), without implying their endorsement, and forbid redistribution without
separate permission and commercial use without permission. This repository therefore holds no copy of
the data: the example reads the files installed with recbole and writes only its plot and checkpoints.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

import torch_tpu_embedding as tte

RECBOLE_INSTALL = "pip install --no-deps recbole==1.2.1"
#: the single-valued fields, then the genre bag; each has a deep table (dim --dim) and a wide one (dim 1)
FIELDS = ("user", "item", "gender", "age", "occupation", "zip", "year", "genre")
MAX_GENRES = 6  # the most genres of one movie in ml-100k: the bag capacity (static shape on XLA)
AGE_BUCKETS = (18, 25, 35, 45, 50, 56)  # MovieLens-1M's age groups: <18, 18-24, ..., 50-55, 56+
ZIP_PREFIX = 3  # zip codes as their first 3 characters (the sectional center: ~380 values)
SHORT_TRAIN_FRACTION = 0.5  # --short: this share of the training split, --epochs 3


# ---------------------------------------------------------------------------------------- data
def data_dir() -> str:
    """The ml-100k directory inside the installed recbole wheel (recbole itself is not imported)."""
    spec = importlib.util.find_spec("recbole")  # a top-level name: nothing is imported
    roots = list(spec.submodule_search_locations or []) if spec is not None else []
    for root in roots:
        path = os.path.join(root, "dataset_example", "ml-100k")
        if all(os.path.isfile(os.path.join(path, f"ml-100k.{ext}")) for ext in ("inter", "user", "item")):
            return path
    where = f" (found recbole at {roots[0]}, but not dataset_example/ml-100k/)" if roots else ""
    raise SystemExit(
        "MovieLens-100k is read from the recbole wheel's data files, which were not found" + where
        + f". Install them with: {RECBOLE_INSTALL}"
    )


def read_atomic(path: str) -> dict[str, list[str]]:
    """A RecBole atomic file: tab-separated, a header of ``name:type`` fields. Returns name -> column."""
    with open(path, encoding="utf-8") as f:
        names = [h.split(":")[0] for h in f.readline().rstrip("\n").split("\t")]
        columns: list[list[str]] = [[] for _ in names]
        for line in f:
            parts = line.rstrip("\n").split("\t")
            if len(parts) != len(names):
                raise ValueError(f"{path}: expected {len(names)} fields, got {len(parts)} in {line!r}")
            for column, value in zip(columns, parts, strict=True):
                column.append(value)
    return dict(zip(names, columns, strict=True))


def index_tokens(tokens: Sequence[str], unknown: Callable[[str], bool] = lambda t: not t) -> tuple[np.ndarray, int]:
    """Tokens -> ids ``1..K`` in sorted order, ``0`` for the unknown ones. Returns (ids, K + 1)."""
    vocab = {t: i + 1 for i, t in enumerate(sorted({t for t in tokens if not unknown(t)}))}
    return np.array([vocab.get(t, 0) for t in tokens], dtype=np.int64), len(vocab) + 1


@dataclass
class MovieLens:
    """Interactions (``user``, ``item``, ``label``, ``time``: ``[N]``) and side features by user / item id.

    ``sides`` maps each single-valued field to ``(index array, per-entity ids)``: the field's id of
    interaction ``n`` is ``sides[f][1][sides[f][0][n]]``. Genres: ``genres [items, MAX_GENRES]`` (0-padded)
    with ``genre_len [items]``. ``vocab``: field -> table rows (id 0 is "unknown" where a value is missing).
    """

    user: np.ndarray
    item: np.ndarray
    label: np.ndarray
    time: np.ndarray
    sides: dict[str, tuple[np.ndarray, np.ndarray]]
    genres: np.ndarray
    genre_len: np.ndarray
    vocab: dict[str, int]

    def __len__(self) -> int:
        return len(self.label)


def load_movielens(path: str) -> MovieLens:
    inter = read_atomic(os.path.join(path, "ml-100k.inter"))
    users = read_atomic(os.path.join(path, "ml-100k.user"))
    items = read_atomic(os.path.join(path, "ml-100k.item"))
    user_row = {u: i + 1 for i, u in enumerate(users["user_id"])}  # row 0: a user missing from the .user file
    item_row = {m: i + 1 for i, m in enumerate(items["item_id"])}
    user = np.array([user_row.get(u, 0) for u in inter["user_id"]], dtype=np.int64)
    item = np.array([item_row.get(m, 0) for m in inter["item_id"]], dtype=np.int64)
    rating = np.array(inter["rating"], dtype=np.float64)
    when = np.array(inter["timestamp"], dtype=np.float64)

    def per_row(values: np.ndarray) -> np.ndarray:  # entity row -> id, row 0 unknown
        return np.concatenate([[0], values])

    gender, n_gender = index_tokens(users["gender"])
    ages = np.array([int(a) for a in users["age"]])
    age = np.searchsorted(np.array(AGE_BUCKETS), ages, side="right") + 1
    occupation, n_occupation = index_tokens(users["occupation"])
    zip_code, n_zip = index_tokens([z[:ZIP_PREFIX] for z in users["zip_code"]])
    year, n_year = index_tokens(items["release_year"], unknown=lambda t: not t.isdigit())  # "unkonwn" in the file
    genre_vocab = {g: i + 1 for i, g in enumerate(sorted({g for c in items["class"] for g in c.split()}))}
    genres = np.zeros((len(items["item_id"]) + 1, MAX_GENRES), dtype=np.int64)
    genre_len = np.zeros(len(items["item_id"]) + 1, dtype=np.int64)
    for row, classes in enumerate(items["class"], start=1):
        ids = [genre_vocab[g] for g in classes.split()]
        if len(ids) > MAX_GENRES:
            raise ValueError(f"item {items['item_id'][row - 1]} has {len(ids)} genres; MAX_GENRES is {MAX_GENRES}")
        genres[row, : len(ids)] = ids
        genre_len[row] = len(ids)
    sides = {
        "user": (user, np.arange(len(users["user_id"]) + 1)),
        "item": (item, np.arange(len(items["item_id"]) + 1)),
        "gender": (user, per_row(gender)),
        "age": (user, per_row(age)),
        "occupation": (user, per_row(occupation)),
        "zip": (user, per_row(zip_code)),
        "year": (item, per_row(year)),
    }
    vocab = {"user": len(users["user_id"]) + 1, "item": len(items["item_id"]) + 1, "gender": n_gender,
             "age": len(AGE_BUCKETS) + 2, "occupation": n_occupation, "zip": n_zip, "year": n_year,
             "genre": len(genre_vocab) + 1}
    return MovieLens(user, item, (rating >= 4).astype(np.float32), when, sides, genres, genre_len, vocab)


def split(ml: MovieLens, how: str, seed: int) -> dict[str, np.ndarray]:
    """Interaction indices: ``test`` 20% (random, or the latest by timestamp), ``valid`` 10% of the rest
    (random, or the latest of the rest), ``train`` the others."""
    n = len(ml)
    if how == "random":
        order = np.random.default_rng(seed).permutation(n)
    else:
        order = np.argsort(ml.time, kind="stable")
    n_test = n // 5
    rest, test = order[: n - n_test], order[n - n_test:]
    n_valid = len(rest) // 10
    return {"train": rest[: len(rest) - n_valid], "valid": rest[len(rest) - n_valid:], "test": test}


@dataclass
class Batch:
    """Host tensors of one batch: ``ids`` field -> ``[B]``, genres ``[B, MAX_GENRES]`` + ``lengths [B]``."""

    ids: dict[str, torch.Tensor]
    genres: torch.Tensor
    lengths: torch.Tensor
    label: torch.Tensor


def make_batch(ml: MovieLens, idx: np.ndarray) -> Batch:
    ids = {f: torch.from_numpy(table[rows[idx]]) for f, (rows, table) in ml.sides.items()}
    item = ml.item[idx]
    return Batch(ids, torch.from_numpy(ml.genres[item]), torch.from_numpy(ml.genre_len[item]),
                 torch.from_numpy(ml.label[idx]))


# -------------------------------------------------------------------------------------- models
#: --deep-optimizer choices -> (class, default lr): the rates that measured best here (see the docstring)
DEEP_OPTIMIZERS: dict[str, tuple[type[tte.optim.RowSparseOptimizer], float]] = {
    "adagrad": (tte.optim.Adagrad, 0.7),
    "lazy_adam": (tte.optim.LazyAdam, 1e-3),
    "adafactor": (tte.optim.Adafactor, 0.05),
}


def table_configs(vocab: dict[str, int], dim: int, deep_opt: Any, wide_opt: Any) -> dict[str, dict[str, Any]]:
    """``{"deep": {field: FeatureConfig}, "wide": {field: FeatureConfig}}``: per field a deep table
    (``dim``, init N(0, 0.01²), combiner mean) and a wide dim-1 table (zeros, combiner sum), each with
    its per-table optimizer factory (the dense layers keep the optimizer they are given to)."""
    normal = functools.partial(nn.init.normal_, std=0.01)
    out: dict[str, dict[str, Any]] = {"deep": {}, "wide": {}}
    for f in FIELDS:
        bag = MAX_GENRES if f == "genre" else None  # the bag's static capacity
        deep = tte.TableConfig(vocab[f], dim, name=f"deep_{f}", initializer=normal, optimizer=deep_opt,
                               combiner="mean")
        wide = tte.TableConfig(vocab[f], 1, name=f"wide_{f}", initializer=nn.init.zeros_, optimizer=wide_opt,
                               combiner="sum")
        out["deep"][f] = tte.FeatureConfig(deep, max_ids_per_bag=bag)
        out["wide"][f] = tte.FeatureConfig(wide, max_ids_per_bag=bag)
    return out


class TorchLookup(nn.Module):
    """The plain-PyTorch twin of the EmbeddingCollection: one ``nn.Embedding`` per table, the genre
    bag as ``(ids [B, L], mask [B, L])``, combined like the table's combiner; the collection's output
    structure. (``F.embedding_bag`` would fall back to the host on XLA, hence the mask.)"""

    def __init__(self, configs: dict[str, dict[str, tte.FeatureConfig]], initial: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.combiners = {part: {f: fc.table.combiner for f, fc in cs.items()} for part, cs in configs.items()}
        self.tables = nn.ModuleDict({
            part: nn.ModuleDict({f: nn.Embedding.from_pretrained(initial[fc.table.name or ""].clone(), freeze=False)
                                 for f, fc in cs.items()})
            for part, cs in configs.items()
        })

    def forward(self, inputs: dict[str, dict[str, Any]]) -> dict[str, dict[str, torch.Tensor]]:
        out: dict[str, dict[str, torch.Tensor]] = {}
        for part, feats in inputs.items():
            out[part] = {}
            for f, x in feats.items():
                emb: nn.Embedding = self.tables[part][f]  # type: ignore[assignment]
                if isinstance(x, tuple):
                    ids, mask = x[0], x[1].to(emb.weight.dtype)  # [B, L]
                    total = (emb(ids) * mask[..., None]).sum(1)
                    if self.combiners[part][f] == "mean":
                        total = total / mask.sum(1, keepdim=True).clamp(min=1.0)
                    elif self.combiners[part][f] == "sqrtn":
                        total = total / mask.sum(1, keepdim=True).clamp(min=1.0).sqrt()
                    out[part][f] = total
                else:
                    out[part][f] = emb(x)
        return out


class Ranker(nn.Module):
    """``logit = b + Σ_f wide_f + FM(deep) + MLP([deep_1, ..., deep_F])``.

    ``wide_f [B, 1]``: each field's dim-1 table (a linear model); ``deep_f [B, D]``: each field's
    embedding; FM: the sum of the pairwise dot products ``Σ_{f<g} <deep_f, deep_g>`` computed as
    ``((Σ e)² − Σ e²) / 2``; the MLP takes the ``F·D`` concatenation.
    """

    def __init__(self, lookup: nn.Module, dim: int, hidden: Sequence[int]) -> None:
        super().__init__()
        self.lookup = lookup
        sizes = [len(FIELDS) * dim, *hidden, 1]
        layers: list[nn.Module] = []
        for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:], strict=True)):
            layers.append(nn.Linear(a, b))
            if i < len(sizes) - 2:
                layers.append(nn.ReLU())
        self.mlp = nn.Sequential(*layers)
        self.bias = nn.Parameter(torch.zeros(1))

    def forward(self, inputs: dict[str, dict[str, Any]]) -> torch.Tensor:
        out = self.lookup(inputs)
        deep = torch.stack([out["deep"][f] for f in FIELDS], dim=1)  # [B, F, D]
        fm = 0.5 * (deep.sum(1).square() - deep.square().sum(1)).sum(1)  # [B]
        wide = torch.cat([out["wide"][f] for f in FIELDS], dim=1).sum(1)  # [B]
        return self.bias + wide + fm + self.mlp(deep.flatten(1)).squeeze(1)


def ours_inputs(batch: Batch, device: torch.device) -> dict[str, dict[str, Any]]:
    """Host ids; the genre bag as ``tte.Jagged`` (padded to ``max_ids_per_bag`` by the collection)."""
    mask = torch.arange(MAX_GENRES) < batch.lengths[:, None]
    x = {**batch.ids, "genre": tte.Jagged(batch.genres[mask], lengths=batch.lengths)}
    return {"deep": x, "wide": x}


def torch_inputs(batch: Batch, device: torch.device) -> dict[str, dict[str, Any]]:
    """The twin's inputs, on the device; the genre bag as padded ids and a mask."""
    mask = torch.arange(MAX_GENRES) < batch.lengths[:, None]
    x: dict[str, Any] = {f: v.to(device) for f, v in batch.ids.items()}
    x["genre"] = (batch.genres.to(device), mask.to(device))
    return {"deep": x, "wide": x}


# ------------------------------------------------------------------------------------- metrics
def auc(labels: np.ndarray, scores: np.ndarray) -> float:
    """ROC AUC by the rank formula (Mann–Whitney U), ties given their average rank.

    ``AUC = (Σ_{positives} rank − P(P+1)/2) / (P·N)`` with 1-based ranks of the scores; equal to the
    share of (positive, negative) pairs ordered correctly, a tie counting 1/2. NaN without both classes.
    """
    y = np.asarray(labels).astype(bool).ravel()
    s = np.asarray(scores, dtype=np.float64).ravel()
    pos, neg = int(y.sum()), int((~y).sum())
    if pos == 0 or neg == 0:
        return float("nan")
    order = np.argsort(s, kind="mergesort")
    _, first, counts = np.unique(s[order], return_index=True, return_counts=True)
    ranks = np.empty(len(s), dtype=np.float64)
    ranks[order] = np.repeat(first + (counts + 1) / 2.0, counts)  # average 1-based rank of each tie group
    return float((ranks[y].sum() - pos * (pos + 1) / 2.0) / (pos * neg))


def log_loss(labels: np.ndarray, logits: np.ndarray) -> float:
    """Mean binary cross-entropy of ``sigmoid(logits)``, computed stably in float64."""
    y = np.asarray(labels, dtype=np.float64)
    z = np.asarray(logits, dtype=np.float64)
    return float(np.mean(np.logaddexp(0.0, z) - y * z))  # -y log σ(z) - (1-y) log σ(-z)


# ------------------------------------------------------------------------------------ training
@dataclass
class Run:
    """One model's training: its per-epoch history and the test numbers of its best epoch."""

    name: str
    history: dict[str, list[float]] = field(default_factory=lambda: {"epoch": [], "train_loss": [], "valid_auc": []})
    best_epoch: int = 0
    best_valid_auc: float = -math.inf
    test_auc: float = float("nan")
    test_log_loss: float = float("nan")
    seconds: float = 0.0
    compiles: int | None = None


class Loop:
    """The training and evaluation loop, shared by our model and the twin (one graph each on XLA)."""

    def __init__(self, args: argparse.Namespace, ml: MovieLens, splits: dict[str, np.ndarray],
                 device: torch.device) -> None:
        self.args, self.ml, self.splits, self.device = args, ml, splits, device
        self.on_xla = device.type == "xla"

    def sync(self) -> None:
        if self.on_xla:
            import torch_xla

            torch_xla.sync()

    def train_epoch(self, model: nn.Module, opt: torch.optim.Optimizer, prepare: Callable[..., Any],
                    epoch: int, desc: str) -> float:
        """One pass over the shuffled training split in full batches (the last partial batch is dropped:
        one batch size, one graph; a new order each epoch). Returns the mean training loss."""
        from tqdm import tqdm

        b = self.args.batch
        order = np.random.default_rng([self.args.seed, epoch]).permutation(self.splits["train"])
        steps = len(order) // b
        model.train()
        losses = []
        bar = tqdm(range(steps), desc=f"{desc} epoch {epoch}", leave=False, disable=self.args.no_progress or None)
        for s in bar:
            batch = make_batch(self.ml, order[s * b: (s + 1) * b])
            logits = model(prepare(batch, self.device))
            loss = nn.functional.binary_cross_entropy_with_logits(logits, batch.label.to(self.device))
            loss.backward()
            opt.step()
            opt.zero_grad()
            self.sync()  # once per step; no .item() before it
            losses.append(loss.detach())
        return float(np.mean([float(x.cpu()) for x in losses]))  # after the syncs: transfers, no graph

    @torch.no_grad()
    def predict(self, model: nn.Module, prepare: Callable[..., Any], part: str) -> np.ndarray:
        """Logits for a split, in batches of ``--eval-batch`` (the last one padded: one graph)."""
        model.eval()
        idx = self.splits[part]
        b = self.args.eval_batch
        out = []
        for start in range(0, len(idx), b):
            chunk = idx[start: start + b]
            n = len(chunk)
            if n < b:
                chunk = np.concatenate([chunk, np.repeat(chunk[:1], b - n)])
            logits = model(prepare(make_batch(self.ml, chunk), self.device))
            self.sync()
            out.append(logits.cpu().numpy()[:n])
        return np.concatenate(out)

    def evaluate(self, model: nn.Module, prepare: Callable[..., Any], part: str) -> tuple[float, float]:
        logits = self.predict(model, prepare, part)
        labels = self.ml.label[self.splits[part]]
        return auc(labels, logits), log_loss(labels, logits)

    def fit(self, run: Run, model: nn.Module, opt: torch.optim.Optimizer, prepare: Callable[..., Any],
            start_epoch: int = 1, best_state: dict[str, torch.Tensor] | None = None,
            on_epoch: Callable[[Run, int, dict[str, torch.Tensor] | None], None] | None = None) -> None:
        """Train up to ``--epochs`` with early stopping on the validation AUC (``--patience`` epochs
        without a better one), then evaluate the test split with the best epoch's weights."""
        args = self.args
        start = time.perf_counter()
        for epoch in range(start_epoch, args.epochs + 1):
            if run.best_epoch and epoch - run.best_epoch > args.patience:
                print(f"[{run.name}] early stop: no better validation AUC since epoch {run.best_epoch}")
                break
            t0 = time.perf_counter()
            train_loss = self.train_epoch(model, opt, prepare, epoch, run.name)
            valid_auc, valid_loss = self.evaluate(model, prepare, "valid")
            run.history["epoch"].append(epoch)
            run.history["train_loss"].append(train_loss)
            run.history["valid_auc"].append(valid_auc)
            better = valid_auc > run.best_valid_auc
            if better:
                run.best_epoch, run.best_valid_auc = epoch, valid_auc
                best_state = snapshot(model)
            print(f"[{run.name}] epoch {epoch:2d}  train loss {train_loss:.4f}  valid AUC {valid_auc:.4f}  "
                  f"valid log loss {valid_loss:.4f}  {time.perf_counter() - t0:5.1f}s{'  *' if better else ''}",
                  flush=True)
            if on_epoch is not None:
                on_epoch(run, epoch, best_state)
        if best_state is not None:
            model.load_state_dict(best_state)
        run.test_auc, run.test_log_loss = self.evaluate(model, prepare, "test")
        run.seconds += time.perf_counter() - start


def snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    """A host copy of the model's weights (never sharing memory with the training weights)."""
    return {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}


# ---------------------------------------------------------------------------------------- main
def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--device", choices=["xla", "cpu"], default="xla",
                    help="xla: torch_xla's device (XLA:CPU unless PJRT_DEVICE says otherwise); cpu: eager")
    ap.add_argument("--split", choices=["random", "time"], default="random",
                    help="random: a seeded 80/20 split; time: the latest 20%% by timestamp is the test set")
    ap.add_argument("--epochs", type=int, default=None, help="most epochs (default 30; --short: 3)")
    ap.add_argument("--patience", type=int, default=3, help="epochs without a better validation AUC before stopping")
    ap.add_argument("--batch", type=int, default=1024)
    ap.add_argument("--eval-batch", type=int, default=4096)
    ap.add_argument("--dim", type=int, default=16, help="deep embedding dimension")
    ap.add_argument("--hidden", default="64,32", help="MLP hidden sizes, comma-separated")
    ap.add_argument("--lr", type=float, default=3e-3, help="Adam on the dense layers (and on everything in the twin)")
    ap.add_argument("--deep-optimizer", choices=sorted(DEEP_OPTIMIZERS), default="adagrad",
                    help="the deep tables' optimizer (a TableConfig override)")
    ap.add_argument("--deep-lr", type=float, default=None,
                    help="its learning rate (default: " + ", ".join(f"{k} {v[1]:g}" for k, v in DEEP_OPTIMIZERS.items())
                    + ")")
    ap.add_argument("--wide-lr", type=float, default=0.05, help="FTRL on the wide tables")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--short", action="store_true",
                    help=f"CI: {SHORT_TRAIN_FRACTION:.0%}% of the training split, 3 epochs")
    ap.add_argument("--compare-torch", action="store_true",
                    help="also train the plain-PyTorch twin (nn.Embedding + torch.optim.Adam) and compare")
    ap.add_argument("--save", default="", help="checkpoint (model, optimizer, history) after every epoch")
    ap.add_argument("--resume", default="", help="continue training from this checkpoint's epoch")
    ap.add_argument("--plot", default="movielens_curve.png", help="PNG of the training curve")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = ap.parse_args(argv)
    if args.epochs is None:
        args.epochs = 3 if args.short else 30
    args.hidden_sizes = [int(h) for h in args.hidden.split(",") if h]
    for name in ("epochs", "patience", "batch", "eval_batch", "dim"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


def settings(args: argparse.Namespace) -> dict[str, Any]:
    """What a checkpoint must agree with to be resumed."""
    return {"split": args.split, "seed": args.seed, "short": args.short, "batch": args.batch, "dim": args.dim,
            "hidden": args.hidden, "deep_optimizer": args.deep_optimizer}


def main(argv: Sequence[str] | None = None) -> list[Run]:
    args = parse_args(argv)
    ml = load_movielens(data_dir())
    splits = split(ml, args.split, args.seed)
    if args.short:
        splits["train"] = splits["train"][: int(len(splits["train"]) * SHORT_TRAIN_FRACTION)]
    on_xla = args.device == "xla"
    met: Any = None
    if on_xla:
        os.environ.setdefault("PJRT_DEVICE", "CPU")  # XLA:CPU here, the TPU where PJRT_DEVICE=TPU
        import torch_xla
        import torch_xla.debug.metrics as met

        device = torch_xla.device()  # before any backward: autograd sizes its device queues then
    else:
        device = torch.device("cpu")
    print(f"MovieLens-100k: {len(ml)} ratings, {ml.vocab['user'] - 1} users, {ml.vocab['item'] - 1} movies; "
          f"split {args.split}: train {len(splits['train'])}, valid {len(splits['valid'])}, "
          f"test {len(splits['test'])}; device {device}")

    torch.manual_seed(args.seed)
    deep_cls, deep_lr = DEEP_OPTIMIZERS[args.deep_optimizer]
    deep_lr = deep_lr if args.deep_lr is None else args.deep_lr
    configs = table_configs(ml.vocab, args.dim, functools.partial(deep_cls, lr=deep_lr),
                            functools.partial(tte.optim.FTRL, lr=args.wide_lr))
    ec = tte.EmbeddingCollection(configs)
    model = Ranker(ec, args.dim, args.hidden_sizes)
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}  # the twin starts here too
    model.to(device)
    # Dense layers: torch.optim.Adam's numbers; the tables: their TableConfig's optimizer (deep / FTRL).
    opt = tte.optim.Adam(model.parameters(), lr=args.lr, bias_correction=True, sum_inside_sqrt=False, eps=1e-8)
    opt.init_state()
    algorithms = sorted({g["algorithm"] for g in opt.param_groups})  # one object, a group per table
    print(f"optimizers ({', '.join(algorithms)}): deep tables {deep_cls.__name__}(lr={deep_lr:g}), "
          f"wide tables FTRL(lr={args.wide_lr:g}), dense layers Adam(lr={args.lr:g})")
    ours = Run("torch_tpu_embedding")
    start_epoch, best_state = 1, None
    if args.resume:
        extra = tte.checkpoint.load(args.resume, model=model, optimizer=opt) or {}
        if extra.get("settings") != settings(args):
            raise SystemExit(f"{args.resume} was saved with {extra.get('settings')}; this run has {settings(args)}")
        ours.history = {k: list(v) for k, v in extra["history"].items()}
        ours.best_epoch, ours.best_valid_auc = int(extra["best_epoch"]), float(extra["best_valid_auc"])
        best_state = extra["best_state"]
        start_epoch = int(extra["epoch"]) + 1
        print(f"resumed from {args.resume}: epoch {start_epoch - 1} done; continuing from epoch {start_epoch}")
    if on_xla:
        torch_xla.sync()
        compiles_before = met.counter_value("UncachedCompile") or 0

    def save(run: Run, epoch: int, best: dict[str, torch.Tensor] | None) -> None:
        if args.save:
            tte.checkpoint.save(args.save, model=model, optimizer=opt, extra={
                "epoch": epoch, "history": run.history, "best_epoch": run.best_epoch,
                "best_valid_auc": run.best_valid_auc, "best_state": best, "settings": settings(args)})

    loop = Loop(args, ml, splits, device)
    loop.fit(ours, model, opt, ours_inputs, start_epoch, best_state, on_epoch=save)
    if on_xla:
        ours.compiles = (met.counter_value("UncachedCompile") or 0) - compiles_before
    runs = [ours]

    if args.compare_torch:
        twin = Ranker(TorchLookup(configs, {k.split(".")[-2]: v for k, v in initial.items() if "tables." in k}),
                      args.dim, args.hidden_sizes)
        twin.mlp.load_state_dict({k[len("mlp."):]: v for k, v in initial.items() if k.startswith("mlp.")})
        twin.to(device)
        twin_opt = torch.optim.Adam(twin.parameters(), lr=args.lr)
        if on_xla:
            torch_xla.sync()
            compiles_before = met.counter_value("UncachedCompile") or 0
        twin_run = Run("torch twin")
        loop.fit(twin_run, twin, twin_opt, torch_inputs)
        if on_xla:
            twin_run.compiles = (met.counter_value("UncachedCompile") or 0) - compiles_before
        runs.append(twin_run)

    plot(args.plot, runs)
    print(f"\n{'model':<40} {'valid AUC':>9} {'test AUC':>9} {'log loss':>9} {'best epoch':>10} {'time':>7}"
          + (f" {'compiles':>8}" if on_xla else ""))
    labels = {"torch_tpu_embedding": f"ours ({deep_cls.__name__} + FTRL + Adam)",
              "torch twin": "twin (nn.Embedding + torch.optim.Adam)"}
    for r in runs:
        print(f"{labels[r.name]:<40} {r.best_valid_auc:9.4f} {r.test_auc:9.4f} {r.test_log_loss:9.4f} "
              f"{r.best_epoch:10d} {r.seconds:6.1f}s" + (f" {r.compiles:8d}" if r.compiles is not None else ""))
    if on_xla:
        print(f"XLA compilations: {met.counter_value('UncachedCompile') or 0} in all "
              f"(training + evaluation of ours: {ours.compiles})")
    print(f"plot: {args.plot}")
    print(f"test AUC {ours.test_auc:.4f}  log loss {ours.test_log_loss:.4f}  (best epoch {ours.best_epoch})")
    return runs


def plot(path: str, runs: list[Run]) -> None:
    """Training loss and validation AUC per epoch, one line per model (matplotlib, Agg: no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, (ax_loss, ax_auc) = plt.subplots(1, 2, figsize=(10, 4))
    for r in runs:
        ax_loss.plot(r.history["epoch"], r.history["train_loss"], marker="o", label=r.name)
        ax_auc.plot(r.history["epoch"], r.history["valid_auc"], marker="o", label=r.name)
        if r.best_epoch:
            ax_auc.axvline(r.best_epoch, color=ax_auc.lines[-1].get_color(), linestyle=":", linewidth=1)
    ax_loss.set(xlabel="epoch", ylabel="training log loss", title="train loss")
    ax_auc.set(xlabel="epoch", ylabel="AUC", title="validation AUC (dotted: best epoch)")
    for ax in (ax_loss, ax_auc):
        ax.grid(alpha=0.3)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.legend()
    fig.suptitle("MovieLens-100k, rating >= 4")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    main()
