"""Run 20 training steps of an EmbeddingCollection + optimizer on XLA (used by test_xla_optim.py).

Usage: python _optim_step_script.py V OPTIMIZER [OPTIMIZER ...] (ids of tests/optim_registry.py, target
``xla_compile``); prints one JSON line per optimizer with its compile and fallback counts.
"""

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch_xla
import torch_xla.debug.metrics as met

import torch_tpu_embedding as tte

sys.path.insert(0, str(Path(__file__).parents[1]))  # tests/: the optimizer registry
from optim_registry import XLA_COMPILE, case  # noqa: E402

V, D = int(sys.argv[1]), 16
dev = torch_xla.device()


def run(make: Callable[[list[torch.nn.Parameter]], Any]) -> dict[str, object]:
    t = tte.TableConfig(V, D, name="t", combiner="mean")
    ec = tte.EmbeddingCollection(
        {"a": tte.FeatureConfig(t, max_ids_per_bag=4), "b": tte.FeatureConfig(t)}, device=dev
    )
    head = torch.nn.Linear(D, 1).to(dev)
    opt = make(list(ec.parameters()) + list(head.parameters()))
    factors = [1.0, 0.0, 1.0, 0.5, 0.0, 0.25]  # passes through 0 and 1 repeatedly
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: factors[s % len(factors)])
    opt.init_state()
    torch_xla.sync()
    met.clear_all()
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        a = torch.randint(0, V, (64,), generator=g)
        b = torch.randint(0, V, (16,), generator=g)
        out = ec({"a": tte.Jagged(a, lengths=torch.full((16,), 4)), "b": b})
        (head(out["a"]) * head(out["b"])).sum().backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        torch_xla.sync()
    return {"compiles": met.counter_value("UncachedCompile") or 0, "fallbacks": sorted(met.executed_fallback_ops())}


# OPTIMIZER: configuration ids of the registry's ``xla_compile`` target (tests/optim_registry.py), run one after
# the other in this process (one torch_xla start-up). Their step graphs differ (another rule or option), so each
# still compiles its own graph exactly once: a graph shared with an earlier configuration would count 0, not 1.
for name in sys.argv[2:]:
    print(json.dumps({"optimizer": name, **run(case(XLA_COMPILE, name).make)}), flush=True)
