"""Run 20 training steps of an EmbeddingCollection + optimizer on XLA (used by test_xla_optim.py).

Usage: python _optim_step_script.py V OPTIMIZER; prints one JSON line with compile and fallback counts.
"""

import json
import sys

import torch
import torch_xla
import torch_xla.debug.metrics as met

import torch_tpu_embedding as tte

V, D = int(sys.argv[1]), 16
make = {
    "sgd": lambda p: tte.optim.SGD(p, lr=0.1),
    "adagrad": lambda p: tte.optim.Adagrad(p, lr=0.1),
    "adagrad_momentum": lambda p: tte.optim.AdagradMomentum(p, lr=0.1, momentum=0.9),
    "adam": lambda p: tte.optim.Adam(p, lr=0.1),
    "lazy_adam": lambda p: tte.optim.LazyAdam(p, lr=0.1, bias_correction=True),
    "ftrl": lambda p: tte.optim.FTRL(p, lr=0.1, multiply_linear_by_learning_rate=True),
    "adafactor": lambda p: tte.optim.Adafactor(p, lr=0.1),
    # The Keras extras: accumulation calls and update calls must share one graph.
    "adam-ema-accum": lambda p: tte.optim.Adam(p, lr=0.1, use_ema=True, gradient_accumulation_steps=4,
                                               clipnorm=1.0, loss_scale_factor=8.0),
    "adafactor-ema-accum": lambda p: tte.optim.Adafactor(p, lr=0.1, use_ema=True, ema_momentum=0.9,
                                                         gradient_accumulation_steps=3, global_clipnorm=0.5),
}[sys.argv[2]]
dev = torch_xla.device()
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
print(json.dumps({
    "compiles": met.counter_value("UncachedCompile") or 0,
    "fallbacks": sorted(met.executed_fallback_ops()),
}))
