"""float16 and bfloat16 tables through every optimizer of the registry, against a float64 numpy reference.

Two tables of one 16-bit dtype (stacked in one group, or each on its own), looked up by a weighted mean bag
and dense ids, the activations as a dict or side by side (``concat=True``). The loss is linear in the
activations with coefficients that 16 bits hold exactly, so every step's gradient is known exactly and does
not depend on the weights. What the library documents of a 16-bit table is written into the reference: the
lookup's per-id gradient rows are the table's dtype (``gain · dL/dout``, rounded), duplicates are summed and
the update is computed in float32 with float32 state (``docs/optimizers.md``), and the weight is stored
rounded to its dtype after each step. What is left between the two is float32 against float64 arithmetic
and the rounding of the stored weight: a weight may land on the neighbouring 16-bit value (one unit in the
last place, ``eps · |w|``) and carry that through FTRL's weight-dependent linear term and weight decay.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from optim_registry import GENERIC, OptimizerConfig, cases
from test_optim_reference import np_step

import torch_tpu_embedding as tte

V, D, STEPS = 12, 4, 3
_COEF = torch.tensor([[0.5, -1.25, 2.0, 0.75]], dtype=torch.float64)  # dL/dout: exact in 16 bits


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    a = torch.randint(0, 8, (7,), generator=g)
    a[1] = a[0]  # a duplicate inside a bag
    wa = torch.rand(7, generator=g) + 0.2
    return a, wa, torch.tensor([3, 2, 0, 2]), torch.randint(2, 10, (4,), generator=g)


def _rounded(x: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    return torch.from_numpy(np.ascontiguousarray(x)).to(dtype).double().numpy()


def _reference_grads(step: int, dtype: torch.dtype) -> dict[str, tuple[np.ndarray, set[int]]]:
    """Each table's dense float64 gradient, from per-id rows ``gain · dL/dout`` rounded to ``dtype``."""
    a, wa, la, b = _batch(step)
    ga, gb = np.zeros((V, D)), np.zeros((V, D))
    coef = _COEF.numpy()[0]
    start = 0
    for n in la.tolist():
        w = wa[start : start + n]
        gain = (w / w.sum()).numpy()  # the mean bag's gains, float32 as the lookup makes them
        for i, g in zip(a[start : start + n].tolist(), gain, strict=True):
            ga[i] += _rounded(np.float64(g) * coef, dtype)
        start += n
    for i in b.tolist():
        gb[i] += _rounded(coef, dtype)
    return {"t1": (ga, set(a.tolist())), "t2": (gb, set(b.tolist()))}


@pytest.mark.parametrize("concat", [False, True], ids=["dict", "concat"])
@pytest.mark.parametrize("stack", [True, False], ids=["stacked", "unstacked"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["f16", "bf16"])
@pytest.mark.parametrize("cfg", cases(GENERIC), ids=str)
def test_16_bit_tables_match_the_float64_reference(
    cfg: OptimizerConfig, dtype: torch.dtype, stack: bool, concat: bool
) -> None:
    torch.manual_seed(0)
    tables = {n: tte.TableConfig(V, D, name=n, combiner="mean", dtype=dtype) for n in ("t1", "t2")}
    ec = tte.EmbeddingCollection({"a": tte.FeatureConfig(tables["t1"]), "b": tte.FeatureConfig(tables["t2"])},
                                 stack_tables=stack)
    assert bool(ec.groups) == stack
    opt = cfg.make(ec.parameters())
    hp = opt.param_groups[0]
    ref = {n: ec.state_dict()[f"tables.{n}.weight"].double().numpy().copy() for n in tables}
    slots = {n: cfg.info.table_slots(hp, (V, D)) for n in tables}
    eps, eps32 = torch.finfo(dtype).eps, torch.finfo(torch.float32).eps
    budget = {n: np.zeros((V, D)) for n in tables}  # how far a weight may be from the reference
    for step in range(STEPS):
        a, wa, la, b = _batch(step)
        out = ec({"a": tte.Jagged(a, lengths=la, weights=wa), "b": b}, concat=concat)
        oa, ob = (out[:, :D], out[:, D:]) if concat else (out["a"], out["b"])
        assert oa.dtype == ob.dtype == dtype
        ((oa.double() * _COEF).sum() + (ob.double() * _COEF).sum()).backward()
        opt.step()
        opt.zero_grad()
        for n, (g, touched) in _reference_grads(step, dtype).items():
            before = ref[n].copy()
            np_step(cfg.info, hp, ref[n], slots[n], touched if cfg.lazy else range(V), g, hp["lr"], step + 1)
            ref[n][:] = _rounded(ref[n], dtype)  # stored in the table's dtype
            # A step rounds to the dtype at most the weight and the step's change (SGD adds each id's
            # increment rounded to the table's dtype): eps of each, per step (the rest is float32's)
            budget[n] += eps * (np.abs(before) + np.abs(ref[n] - before)) + 8 * eps32 * np.abs(ref[n])
    state = opt.state_dict()["state"]
    for n in tables:
        got = ec.state_dict()[f"tables.{n}.weight"]
        assert got.dtype == dtype
        excess = np.abs(got.double().numpy() - ref[n]) - budget[n]
        assert excess.max() <= 0, (n, np.unravel_index(excess.argmax(), excess.shape), excess.max())
        for k, want in slots[n].items():
            have = state[f"table:{n}"][k]
            assert have.dtype == torch.float32, (n, k, have.dtype)  # float32 state for a 16-bit table
            # float32 arithmetic over the steps; through the weight (FTRL's linear term) its last-place units too
            scale = np.abs(ref[n]).max() + np.abs(want).max()
            np.testing.assert_allclose(have.double().numpy(), want, rtol=16 * STEPS * eps32,
                                       atol=STEPS * eps * scale, err_msg=f"{n} {k}")


@pytest.mark.parametrize(("saved", "loaded"), [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32)],
                         ids=["f32-to-bf16", "bf16-to-f32"])
def test_a_checkpoint_moves_between_float32_and_bfloat16_tables(tmp_path: Any, saved: torch.dtype,
                                                                loaded: torch.dtype) -> None:
    """A table's width may change between save and load (docs/checkpoints.md: dtype kinds are checked): its
    values are cast to the loading table's dtype (rounded to nearest), its float32 state loads as it is."""
    def make(dtype: torch.dtype) -> tuple[tte.EmbeddingCollection, Any]:
        torch.manual_seed(0)
        t = {n: tte.TableConfig(V, D, name=n, dtype=dtype) for n in ("t1", "t2")}
        ec = tte.EmbeddingCollection({"a": tte.FeatureConfig(t["t1"]), "b": tte.FeatureConfig(t["t2"])})
        return ec, tte.optim.Adam(ec.parameters(), lr=0.1)

    src, opt = make(saved)
    a, wa, la, b = _batch(0)
    out = src({"a": tte.Jagged(a, lengths=la, weights=wa), "b": b})
    ((out["a"].double() * _COEF).sum() + (out["b"].double() * _COEF).sum()).backward()
    opt.step()
    tte.checkpoint.save(tmp_path / "ck.pt", model=src, optimizer=opt)
    dst, dst_opt = make(loaded)
    tte.checkpoint.load(tmp_path / "ck.pt", model=dst, optimizer=dst_opt)
    for k, v in src.state_dict().items():
        have = dst.state_dict()[k]
        assert have.dtype == loaded
        np.testing.assert_array_equal(have.double().numpy(), _rounded(v.double().numpy(), loaded), err_msg=k)
    want = opt.state_dict()["state"]
    for table, slots in dst_opt.state_dict()["state"].items():
        for k, v in slots.items():
            assert v.dtype == want[table][k].dtype == torch.float32
            assert torch.equal(v, want[table][k]), (table, k)


def test_tables_of_two_dtypes_stack_apart_and_keep_their_dtypes() -> None:
    """A float16 and a float32 table never share a group (nor are cast to share one); each looks up in its dtype."""
    torch.manual_seed(0)
    t = [tte.TableConfig(6, D, name="h1", dtype=torch.float16), tte.TableConfig(5, D, name="f", dtype=torch.float32),
         tte.TableConfig(4, D, name="h2", dtype=torch.float16)]
    ec = tte.EmbeddingCollection({c.name: tte.FeatureConfig(c) for c in t})
    values = {n: v.clone() for n, v in ec.state_dict().items()}
    assert ec.stacked_members() == {"fused_0": (("h1", 0, 6), ("h2", 6, 4))}
    assert {p.dtype for p in ec.parameters()} == {torch.float16, torch.float32}
    out = ec({"h1": torch.tensor([5]), "f": torch.tensor([4]), "h2": torch.tensor([3])})
    assert {n: o.dtype for n, o in out.items()} == {"h1": torch.float16, "f": torch.float32, "h2": torch.float16}
    assert torch.equal(out["h2"][0], values["tables.h2.weight"][3]) and torch.equal(out["f"][0], values["tables.f.weight"][4])
    side = ec({"h1": torch.tensor([5]), "f": torch.tensor([4]), "h2": torch.tensor([3])}, concat=True)
    assert side.dtype == torch.float32  # torch.cat's promotion: the float16 values exactly, side by side
    assert torch.equal(side[0], torch.cat([out[n][0].float() for n in ec.feature_names]))
    assert {k: v.dtype for k, v in ec.state_dict().items()} == {k: v.dtype for k, v in values.items()}
