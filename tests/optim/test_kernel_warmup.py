"""When the kernel eager update (``optim/_kernels/row_update.py``) takes over from the reference path: by the
optimizer's call count and the table's size alone (:func:`.kernel_policy.policy`),
never by how long a compile took, so two runs with one seed are bitwise equal across the switch-over.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path as FsPath
from typing import Any

import pytest
import torch

import torch_tpu_embedding as tte
from torch_tpu_embedding.optim._core import base, update_paths
from torch_tpu_embedding.optim._core.update_paths import Path
from torch_tpu_embedding.optim._kernels import kernel_policy, row_update

REPO = FsPath(__file__).resolve().parents[2]


@pytest.fixture
def kernel_on() -> Iterator[None]:
    before_on, before_policy = kernel_policy.set_enabled(True), kernel_policy.policy()
    yield
    kernel_policy.set_enabled(before_on)
    kernel_policy.set_policy(*before_policy)


def _paths_taken(steps: int, rows: int, monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    torch.manual_seed(0)
    ec = tte.EmbeddingCollection({"f": tte.FeatureConfig(tte.TableConfig(rows, 4, name="t"), max_ids_per_bag=3)})
    opt = tte.optim.Adam(ec.parameters(), lr=0.01)
    ran: list[Path] = []
    real = update_paths.update

    def spy(item: Any) -> None:
        real(item)
        ran.append(item.path)  # after the update: a step kept on the reference path has become ROW_CHUNKS

    monkeypatch.setattr(base, "update", spy)
    for s in range(steps):
        ids = torch.randint(0, rows, (16, 3), generator=torch.Generator().manual_seed(s))
        ec({"f": tte.Padded(ids)})["f"].sum().backward()
        opt.step()
        opt.zero_grad()
    return ran


@pytest.mark.usefixtures("compiler", "kernel_on")
def test_the_reference_path_runs_the_first_after_calls_then_the_kernel_one(monkeypatch: pytest.MonkeyPatch) -> None:
    kernel_policy.set_policy(after=3, min_elements=0)
    assert _paths_taken(5, 50, monkeypatch) == [Path.ROW_CHUNKS] * 3 + [Path.KERNEL] * 2


@pytest.mark.usefixtures("kernel_on")
def test_a_table_below_min_elements_never_compiles(monkeypatch: pytest.MonkeyPatch) -> None:
    kernel_policy.set_policy(after=0, min_elements=50 * 4 + 1)  # one more than the table holds
    kernels = row_update.compiled_kernels()
    assert _paths_taken(3, 50, monkeypatch) == [Path.ROW_CHUNKS] * 3
    assert row_update.compiled_kernels() == kernels


@pytest.mark.usefixtures("kernel_on")
def test_the_default_policy_keeps_short_runs_of_small_tables_off_the_compiler(monkeypatch: pytest.MonkeyPatch) -> None:
    after, min_elements = kernel_policy.policy()
    assert after > 3 and min_elements > 50 * 4
    kernels = row_update.compiled_kernels()
    assert _paths_taken(3, 50, monkeypatch) == [Path.ROW_CHUNKS] * 3
    assert row_update.compiled_kernels() == kernels


@pytest.mark.parametrize("bad", [-1, 1.5, True, "3"])
def test_set_policy_names_a_wrong_value(bad: object) -> None:
    with pytest.raises(ValueError, match=r"set_policy: after must be an int >= 0, got"):
        kernel_policy.set_policy(after=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"set_policy: min_elements must be an int >= 0, got"):
        kernel_policy.set_policy(min_elements=bad)  # type: ignore[arg-type]


# One training run: a digest of every weight and optimizer state tensor after each step, the paths the
# table's updates took and the kernels built. Two tables (Adam with EMA, RowWiseAdagrad), bags with
# duplicates and padding, a dense head.
_RUN = textwrap.dedent("""
    import hashlib, json, sys
    import torch
    import torch_tpu_embedding as tte
    from torch_tpu_embedding.optim._core import base
    from torch_tpu_embedding.optim._kernels import row_update
    from torch_tpu_embedding.optim._core import update_paths

    torch.manual_seed(int(sys.argv[1]))
    a = tte.TableConfig(60, 5, name="a", combiner="mean")
    b = tte.TableConfig(40, 3, name="b", optimizer=lambda ps: tte.optim.RowWiseAdagrad(ps, lr=0.1))
    ec = tte.EmbeddingCollection({"x": tte.FeatureConfig(a, max_ids_per_bag=4), "y": tte.FeatureConfig(b)})
    head = torch.nn.Linear(8, 1)
    opt = tte.optim.Adam([*ec.parameters(), *head.parameters()], lr=0.05, use_ema=True)
    paths = []
    real = update_paths.update
    def spy(item):
        real(item)
        if item.p.dim() == 2 and item.p.shape[1] != 8:
            paths.append(item.path.value)
    base.update = spy
    digests = []
    for s in range(int(sys.argv[2])):
        g = torch.Generator().manual_seed(100 + s)
        ids = torch.randint(0, 60, (24, 4), generator=g)
        out = ec({"x": tte.Padded(ids, ids % 5 != 0), "y": torch.randint(0, 40, (24,), generator=g)})
        head(torch.cat([out["x"], out["y"]], dim=1)).square().sum().backward()
        opt.step()
        opt.zero_grad()
        h = hashlib.sha256()
        for p in [*ec.parameters(), *head.parameters()]:
            h.update(p.detach().numpy().tobytes())
            for k, v in sorted(opt.state[p].items()):
                if isinstance(v, torch.Tensor):
                    h.update(k.encode() + v.detach().cpu().numpy().tobytes())
        digests.append(h.hexdigest())
    print("RUN " + json.dumps({"digests": digests, "paths": paths, "kernels": row_update.compiled_kernels()}))
""")


def _run(seed: int, steps: int, cache: FsPath, after: int) -> dict[str, Any]:
    env = dict(os.environ, TTE_UPDATE_KERNEL="1", TTE_KERNEL_AFTER=str(after), TTE_KERNEL_MIN_ELEMENTS="0",
               TORCHINDUCTOR_CACHE_DIR=str(cache), OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p))
    r = subprocess.run([sys.executable, "-c", _RUN, str(seed), str(steps)], env=env, capture_output=True, text=True,
                       timeout=1800)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "No CUDA runtime is found" not in r.stderr, r.stderr[-3000:]
    line = next(x for x in r.stdout.splitlines() if x.startswith("RUN "))
    out: dict[str, Any] = json.loads(line[4:])
    return out


@pytest.mark.usefixtures("compiler")
def test_two_runs_with_one_seed_are_bitwise_equal_across_the_switch_over(tmp_path: FsPath) -> None:
    """The first run compiles into an empty inductor cache, the second finds the kernels cached (a
    compile seconds shorter): the same paths and bitwise the same weights and state after every step."""
    cold = _run(7, 5, tmp_path, after=2)
    warm = _run(7, 5, tmp_path, after=2)
    assert cold["kernels"] >= 1  # the switch-over happened
    # two tables a step: the reference path for calls 0 and 1, the kernel one from call 2 on
    assert cold["paths"] == ["row_chunks"] * 4 + ["kernel"] * 6, cold["paths"]
    assert warm["paths"] == cold["paths"]
    assert warm["digests"] == cold["digests"]
    # a run that never switches: the same numbers up to the switch-over
    never = _run(7, 5, tmp_path, after=100)
    assert never["digests"][:2] == cold["digests"][:2]
    assert never["paths"] == ["row_chunks"] * 10


def test_a_wrong_environment_value_is_named() -> None:
    env = dict(os.environ, TTE_KERNEL_AFTER="fifty",
               PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p))
    r = subprocess.run([sys.executable, "-c", "import torch_tpu_embedding"], env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode != 0
    assert "environment variable TTE_KERNEL_AFTER must be an int >= 0, got 'fifty'" in r.stderr, r.stderr[-2000:]
