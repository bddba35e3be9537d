"""The package's layers hold (docs/design.md, "Layers"): the names that moved down still serve, the
optimizer-name registry matches the optimizers, and the transport-neutral modules load without torch_xla.
(`lint-imports` and scripts/import_graph.py check the import graph itself in scripts/test.sh.)"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch_tpu_embedding as tte
from torch_tpu_embedding import routing
from torch_tpu_embedding._util import registry
from torch_tpu_embedding.xla import ownership

ROOT = Path(__file__).parents[2]


def test_the_package_registers_exactly_its_named_optimizers_first() -> None:
    """`TableConfig` accepts `registry.OPTIMIZER_NAMES`; importing the optimizers registers them, in order."""
    names = registry.optimizer_names()
    assert names[: len(registry.OPTIMIZER_NAMES)] == registry.OPTIMIZER_NAMES
    assert tte.OPTIMIZER_NAMES is registry.OPTIMIZER_NAMES is tte.optim.OPTIMIZER_NAMES
    for name in registry.OPTIMIZER_NAMES:
        assert registry.optimizer_class(name).algorithm == name
        tte.TableConfig(10, 4, optimizer=name)  # accepted


def test_the_old_ownership_path_serves_the_routing_names() -> None:
    """docs/sharding.md's `xla.ownership.default_capacity` / `capacity_for_load` keep working, as the same objects."""
    for name in ownership.__all__:
        assert getattr(ownership, name) is getattr(routing, name)
    assert ownership.default_capacity(576, 8) == routing.default_capacity(576, 8) == 120


def test_routing_and_the_ownership_shim_import_without_torch_xla() -> None:
    code = (
        "import sys; sys.modules['torch_xla'] = None\n"
        "import torch\n"
        "import torch_tpu_embedding.routing as r, torch_tpu_embedding.xla.ownership as o\n"
        "own = r.RowOwnership('interleaved', rows=1024, num_shards=4)\n"
        "plan = r.plan_routes(torch.tensor([3, 3, 700, 5000]), own, capacity=2)\n"
        "assert plan.load.sum() == 2 and o.capacity_for_load(10) == 16\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
