"""[hardening] item 4: a checkpoint load that fails changes nothing.

``tte.checkpoint.load`` (and ``load_distributed``) check the model's keys, shapes and dtype kinds and
the optimizer's kind, groups, hyper-parameters and slots before writing anything. Each case saves a good
checkpoint, tries a mismatching one, and shows: one ``CheckpointMismatchError`` naming what is wrong in
the model and in the optimizer; the weights, every slot, the call counter and the pending row gradients
unchanged; the files on disk unchanged; and the good checkpoint still loads and training continues
exactly as in a model that never saw the failed load.
"""

from __future__ import annotations

import copy
import hashlib
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from suite_helpers import same_tree

import torch_tpu_embedding as tte
from torch_tpu_embedding.checkpoint import CheckpointMismatchError
from torch_tpu_embedding.checkpoint import publish as ckpt_publish

O = tte.optim  # noqa: E741
D = 3


def build(rows_b: int = 9, extra: bool = False, stack: bool = False, dtype: torch.dtype = torch.float64,
          opt: Callable[..., torch.optim.Optimizer] | None = None) -> tuple[torch.nn.ModuleDict, torch.optim.Optimizer]:
    torch.manual_seed(0)
    a = tte.TableConfig(12, D, name="a", dtype=dtype)
    b = tte.TableConfig(rows_b, D, name="b", dtype=dtype)
    feats = {"fa": tte.FeatureConfig(a, max_ids_per_bag=2), "fb": tte.FeatureConfig(b)}
    if extra:
        feats["fc"] = tte.FeatureConfig(tte.TableConfig(5, D, name="c", dtype=dtype))
    ec = tte.EmbeddingCollection(feats, stack_tables=stack)
    m = torch.nn.ModuleDict({"ec": ec, "head": torch.nn.Linear(2 * D, 1).to(dtype)})
    make = opt or (lambda ps: O.Adam(ps, lr=0.05, gradient_accumulation_steps=2, use_ema=True))
    return m, make(m.parameters())


def step(m: torch.nn.ModuleDict, opt: torch.optim.Optimizer, s: int, update: bool = True) -> None:
    g = torch.Generator().manual_seed(s)
    batch = {"fa": tte.Jagged(torch.randint(0, 12, (5,), generator=g), lengths=torch.tensor([2, 1, 2])),
             "fb": torch.randint(0, 9, (3,), generator=g)}
    if "fc" in m["ec"].feature_names:
        batch["fc"] = torch.randint(0, 5, (3,), generator=g)
    out = m["ec"](batch)
    m["head"](torch.cat([out["fa"], out["fb"]], 1)).square().sum().backward()
    if update:
        opt.step()
        opt.zero_grad()


def snapshot(m: torch.nn.ModuleDict, opt: torch.optim.Optimizer, folder: Path) -> dict[str, Any]:
    return {
        "model": {k: v.detach().clone() for k, v in m.state_dict().items()},
        "optimizer": copy.deepcopy(opt.state_dict()),
        "row_grads": {k: (i.clone(), r.clone()) for k, (i, r) in m["ec"].row_grads().items()},
        "dense_grads": {n: None if p.grad is None else p.grad.clone() for n, p in m.named_parameters()},
        "files": {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.rglob("*")) if p.is_file()},
    }


def prepared(tmp_path: Path, **good: Any) -> tuple[torch.nn.ModuleDict, torch.optim.Optimizer, Path]:
    """A model trained 3 steps (mid-accumulation) and saved to ``good.pt``, then one more step and a
    pending backward."""
    m, opt = build(**good)
    for s in range(3):
        step(m, opt, s)
    tte.checkpoint.save(tmp_path / "good.pt", model=m, optimizer=opt)
    step(m, opt, 3)  # the model moves on from the good checkpoint
    step(m, opt, 4, update=False)  # pending row gradients: a failed load must not eat them
    return m, opt, tmp_path / "good.pt"


def save_bad(tmp_path: Path, **bad: Any) -> Path:
    m, opt = build(**bad)
    for s in range(2):
        step(m, opt, 10 + s)
    tte.checkpoint.save(tmp_path / "bad.pt", model=m, optimizer=opt)
    return tmp_path / "bad.pt"


CASES: dict[str, tuple[dict[str, Any], dict[str, Any], list[str]]] = {
    # name: (the loading model, the saved model, patterns every one of which the error names)
    "table of the wrong size": ({}, {"rows_b": 11}, [
        r"model: size mismatch for ec.tables.b.weight: copying a param with shape torch.Size\(\[11, 3\]\)",
        r"optimizer: table:b: slot 'ema' has shape \(11, 3\), expected \(9, 3\)"]),
    "missing table": ({"extra": True}, {}, [r"model: Missing key\(s\) in state_dict: \"ec.tables.c.weight\"",
                                            r"optimizer: group 0: missing \['param:4', 'table:c'\]"]),
    "unexpected table": ({}, {"extra": True}, [r"model: Unexpected key\(s\) in state_dict: \"ec.tables.c.weight\"",
                                               r"optimizer: group 0: missing \['param:2'\], unexpected \['param:4', 'table:c'\]"]),
    "Adagrad into Adam": ({}, {"opt": lambda ps: O.Adagrad(ps, lr=0.1)},
                          [r"optimizer: group 0: saved by optimizer 'adagrad', loading into 'adam'"]),
    "stacked member of the wrong size": ({"stack": True}, {"rows_b": 11, "stack": True}, [
        r"model: size mismatch for ec.tables.b.weight: copying a param with shape torch.Size\(\[11, 3\]\) from "
        r"checkpoint, the shape in current model is torch.Size\(\[9, 3\]\)"]),
    "integer values for a float table": ({}, {"dtype": torch.float64}, []),  # patched below: int64 weight
}


@pytest.mark.parametrize("strict", [True, False], ids=["strict", "nonstrict"])
@pytest.mark.parametrize("case", list(CASES))
def test_a_failed_load_changes_nothing_and_the_good_checkpoint_still_loads(tmp_path: Path, case: str,
                                                                           strict: bool) -> None:
    mine, theirs, patterns = CASES[case]
    m, opt, good = prepared(tmp_path, **mine)
    bad = save_bad(tmp_path, **theirs)
    if case == "integer values for a float table":
        payload = torch.load(bad, weights_only=True)
        payload["model"]["ec.tables.a.weight"] = payload["model"]["ec.tables.a.weight"].round().to(torch.int64)
        torch.save(payload, bad)
        patterns = [r"model: ec.tables.a.weight: the checkpoint holds integer values \(torch.int64\), "
                    r"the model a floating point tensor \(torch.float64\)"]
    if not strict:  # missing/unexpected keys are allowed; everything else still refuses
        patterns = [p for p in patterns if "Missing" not in p and "Unexpected" not in p]
    before = snapshot(m, opt, tmp_path)
    with pytest.raises(CheckpointMismatchError, match="nothing was loaded") as err:
        tte.checkpoint.load(bad, model=m, optimizer=opt, strict=strict)
    assert isinstance(err.value, ValueError) and isinstance(err.value, RuntimeError)  # both old error types
    for p in patterns:
        assert re.search(p, str(err.value)), (p, str(err.value))
    after = snapshot(m, opt, tmp_path)
    for part in before:
        assert same_tree(before[part], after[part]), part
    # The good checkpoint still loads into the same objects and training goes on as in a fresh twin.
    ref, ref_opt = build(**mine)
    tte.checkpoint.load(good, model=ref, optimizer=ref_opt)
    opt.zero_grad()
    tte.checkpoint.load(good, model=m, optimizer=opt)
    for s in range(3, 6):
        step(m, opt, s)
        step(ref, ref_opt, s)
    assert same_tree(m.state_dict(), ref.state_dict()) and same_tree(opt.state_dict(), ref_opt.state_dict())


def test_model_and_optimizer_problems_in_one_error(tmp_path: Path) -> None:
    m, opt, _ = prepared(tmp_path)
    bad = save_bad(tmp_path, rows_b=11, opt=lambda ps: O.Adagrad(ps, lr=0.1))
    with pytest.raises(CheckpointMismatchError) as err:
        tte.checkpoint.load(bad, model=m, optimizer=opt)
    text = str(err.value)
    assert "model: size mismatch for ec.tables.b.weight" in text
    assert "optimizer: group 0: saved by optimizer 'adagrad', loading into 'adam'" in text


def test_invalid_saved_hyper_parameters_change_nothing(tmp_path: Path) -> None:
    m, opt, good = prepared(tmp_path)
    payload = torch.load(good, weights_only=True)
    payload["optimizer"]["param_groups"][0]["lr"] = -5.0
    torch.save(payload, tmp_path / "lr.pt")
    before = snapshot(m, opt, tmp_path)
    with pytest.raises(CheckpointMismatchError, match=r"optimizer: group 0: Argument `lr` must be a finite number and >= 0.0. Received: -5.0"):
        tte.checkpoint.load(tmp_path / "lr.pt", model=m, optimizer=opt)
    after = snapshot(m, opt, tmp_path)
    assert all(same_tree(before[k], after[k]) for k in before)


def test_a_torch_optimizer_refusal_leaves_the_model_unwritten(tmp_path: Path) -> None:
    """Optimizers of other libraries check their own state; it is loaded before the model is written."""
    m, _ = build(opt=lambda ps: O.SGD(ps, lr=0.1))
    dense = torch.optim.Adam(m["head"].parameters(), lr=0.01)
    tte.checkpoint.save(tmp_path / "c.pt", model=m, optimizer=dense)
    other, _ = build(opt=lambda ps: O.SGD(ps, lr=0.1))
    with torch.no_grad():
        for p in other.parameters():
            p.add_(1.0)
    before = {k: v.clone() for k, v in other.state_dict().items()}
    wrong = torch.optim.Adam([*other["head"].parameters(), *other["ec"].parameters()], lr=0.01)  # 4 params, not 2
    with pytest.raises(ValueError, match="parameter group that doesn't match the size"):
        tte.checkpoint.load(tmp_path / "c.pt", model=other, optimizer=wrong)
    assert same_tree(before, other.state_dict())


def test_a_failed_distributed_load_changes_nothing(tmp_path: Path) -> None:
    m, opt, _ = prepared(tmp_path)
    ckpt = tmp_path / "dcp"
    tte.checkpoint.save_distributed(ckpt, model=m, optimizer=opt)
    meta = torch.load(ckpt / "tte_meta.pt", weights_only=True)
    meta["optimizer"]["param_groups"][0]["betas"] = (1.5, 0.999)  # a hyper-parameter the constructor refuses
    torch.save(meta, ckpt / "tte_meta.pt")
    ckpt_publish.write_manifest(str(ckpt))  # altered by hand and sealed again: the meta's checks refuse it
    other, other_opt = build()
    step(other, other_opt, 7)
    step(other, other_opt, 8, update=False)
    before = snapshot(other, other_opt, ckpt)
    with pytest.raises(CheckpointMismatchError, match=r"nothing was loaded\): group 0: .*betas"):
        tte.checkpoint.load_distributed(ckpt, model=other, optimizer=other_opt)
    after = snapshot(other, other_opt, ckpt)
    assert all(same_tree(before[k], after[k]) for k in before)


@pytest.mark.parametrize("damage, pattern", [
    (lambda pl: pl.__setitem__("model", [1, 2]), r"model: not a state_dict \(a mapping of names to tensors\): found list"),
    (lambda pl: pl["optimizer"]["state"].__setitem__("table:a", 5),
     r"optimizer: state\['table:a'\] is a int, not a mapping of slot names to tensors"),
    (lambda pl: pl["optimizer"].__setitem__("param_groups", [5]),
     r"optimizer: param_groups\[0\] is a int, not a mapping with a 'params' list"),
    (lambda pl: pl["optimizer"].__setitem__("state", [1]),
     r"optimizer: not an optimizer state_dict \(needs 'state' and 'param_groups'\)"),
], ids=["model-not-a-mapping", "slot-entry-not-a-mapping", "group-not-a-mapping", "state-not-a-mapping"])
def test_a_damaged_structure_is_named_and_changes_nothing(tmp_path: Path, damage: Callable[[dict[str, Any]], None],
                                                          pattern: str) -> None:
    """A checkpoint whose structure was altered (by hand or by another tool) is refused by name, not with
    an AttributeError from deep inside the load, and nothing changes."""
    m, opt, good = prepared(tmp_path)
    payload = torch.load(good, weights_only=True)
    damage(payload)
    torch.save(payload, tmp_path / "damaged.pt")
    before = snapshot(m, opt, tmp_path)
    with pytest.raises(CheckpointMismatchError, match=pattern):
        tte.checkpoint.load(tmp_path / "damaged.pt", model=m, optimizer=opt)
    after = snapshot(m, opt, tmp_path)
    assert all(same_tree(before[k], after[k]) for k in before)


# ------------------------------------------------------------------ crafted or damaged values ([hardening3] 5)
def _stacked_group_key_only(pl: dict[str, Any]) -> None:
    """strict=False with a stacked group's own weight key of the wrong shape (its tables' keys removed)."""
    del pl["model"]["ec.tables.a.weight"], pl["model"]["ec.tables.b.weight"]
    pl["model"]["ec.groups.fused_0.weight"] = torch.zeros(5, D, dtype=torch.float64)


def _stacked_group_key_beside_tables(pl: dict[str, Any]) -> None:
    pl["model"]["ec.groups.fused_0.weight"] = torch.zeros(21, D, dtype=torch.float64)


def _out_of_range_pending_id(pl: dict[str, Any]) -> None:
    ids = pl["optimizer"]["state"]["table:b"]["acc_ids"]  # table b has 9 rows
    ids[0, 0] = 12


PAYLOADS: dict[str, tuple[bool, bool, Callable[[dict[str, Any]], None], str]] = {
    # name: (stacked, strict, damage, the error names the key, the rule and the received value)
    "strict=False, wrong-shape stacked group key": (True, False, _stacked_group_key_only,
        r"size mismatch for ec.groups.fused_0.weight: copying a param with shape torch.Size\(\[5, 3\]\) from "
        r"checkpoint, the shape in current model is torch.Size\(\[21, 3\]\)"),
    "strict=False, stacked group key beside its tables": (True, False, _stacked_group_key_beside_tables,
        r"ec.groups.fused_0.weight: the stacked group's weight and its tables' keys \['ec.tables.a.weight', "
        r"'ec.tables.b.weight'\] are both in the state_dict"),
    "meta-device table": (False, True, lambda pl: pl["model"].__setitem__(
        "ec.tables.a.weight", torch.empty(12, D, dtype=torch.float64, device="meta")),
        r"model: ec.tables.a.weight must hold data \(a meta-device tensor has none\). Received a torch.float64 "
        r"tensor of shape \(12, 3\) on meta"),
    "meta-device stacked table": (True, True, lambda pl: pl["model"].__setitem__(
        "ec.tables.b.weight", torch.empty(9, D, dtype=torch.float64, device="meta")),
        r"model: ec.tables.b.weight must hold data \(a meta-device tensor has none\)"),
    "meta-device slot": (False, True, lambda pl: pl["optimizer"]["state"]["table:a"].__setitem__(
        "momenta", torch.empty(12, D, dtype=torch.float64, device="meta")),
        r"optimizer: table:a: slot 'momenta' must hold data \(a meta-device tensor has none\). Received a "
        r"torch.float64 tensor of shape \(12, 3\) on meta"),
    "sparse stacked table": (True, True, lambda pl: pl["model"].__setitem__(
        "ec.tables.a.weight", pl["model"]["ec.tables.a.weight"].to_sparse()),
        r"model: ec.tables.a.weight must be a dense \(strided\) tensor. Received a torch.float64 tensor of shape "
        r"\(12, 3\) on cpu, layout torch.sparse_coo"),
    "iterations='x'": (False, True, lambda pl: pl["optimizer"].__setitem__("iterations", "x"),
                       r"optimizer: 'iterations' must be an integer >= 0. Received str 'x'"),
    "step of shape [2]": (False, True, lambda pl: pl["optimizer"]["state"]["table:a"].__setitem__(
        "step", torch.zeros(2)),
        r"optimizer: table:a: slot 'step' must be one real number \(a 0-d tensor or a Python number\). Received "
        r"a torch.float32 tensor of shape \(2,\)"),
    "pending id 12 of a 9-row stacked table": (True, True, _out_of_range_pending_id,
        r"optimizer: table:b: slot 'acc_ids' must hold -1 \(padding\) or rows of this table, in \[0, 9\). "
        r"Received \[12\]"),
    "pending id out of range, unstacked": (False, True, _out_of_range_pending_id,
        r"optimizer: table:b: slot 'acc_ids' must hold -1 \(padding\) or rows of this table, in \[0, 9\)"),
    "slot saved as a list": (False, True, lambda pl: pl["optimizer"]["state"]["table:a"].__setitem__(
        "momenta", [[0.0] * D] * 12), r"optimizer: table:a: slot 'momenta' must be a tensor. Received list"),
    "negative step": (False, True, lambda pl: pl["optimizer"]["state"]["table:a"].__setitem__(
        "step", torch.tensor(-1.0)), r"optimizer: table:a: slot 'step' must be a finite number >= 0. Received -1.0"),
}


@pytest.mark.parametrize("case", list(PAYLOADS))
def test_a_crafted_value_is_refused_before_anything_changes(tmp_path: Path, case: str) -> None:
    """Each payload used to pass the checks and fail half-way (the optimizer's state replaced, twice a
    table overwritten too), or, for the pending id, load and update a neighbouring table's row. Now one
    error names the file, the key, the rule and the value, and weights, slots, counters and pending
    gradients are bitwise unchanged; so is ``opt.load_state_dict`` of the optimizer part alone."""
    stack, strict, damage, pattern = PAYLOADS[case]
    m, opt, good = prepared(tmp_path, stack=stack)
    payload = torch.load(good, weights_only=True)
    damage(payload)
    bad = tmp_path / "crafted.pt"
    torch.save(payload, bad)
    before = snapshot(m, opt, tmp_path)
    with pytest.raises(CheckpointMismatchError) as err:
        tte.checkpoint.load(bad, model=m, optimizer=opt, strict=strict)
    assert str(err.value).startswith(f"{bad} does not match (nothing was loaded)"), str(err.value)
    assert re.search(pattern, str(err.value)), (pattern, str(err.value))
    if pattern.startswith("optimizer: "):
        with pytest.raises(ValueError, match=pattern[len("optimizer: "):]):
            opt.load_state_dict(payload["optimizer"])
    after = snapshot(m, opt, tmp_path)
    for part in before:
        assert same_tree(before[part], after[part]), part


@pytest.mark.parametrize("stack", [False, True], ids=["unstacked", "stacked"])
@pytest.mark.parametrize("number", [3, 3.0], ids=["int", "float"])
def test_a_step_saved_as_a_python_number_loads(tmp_path: Path, number: float, stack: bool) -> None:
    """[conformance] 6: torch's optimizers accept a ``step`` that is a Python number; so do ours."""
    m, opt, good = prepared(tmp_path, stack=stack)
    sd = torch.load(good, weights_only=True)["optimizer"]
    for s in sd["state"].values():
        s["step"] = number
    opt.load_state_dict(sd)
    for p, s in opt.state.items():
        assert s["step"].shape == () and s["step"].dtype == torch.float32 and float(s["step"]) == 3.0, p.shape
    step(m, opt, 9)  # and training goes on
