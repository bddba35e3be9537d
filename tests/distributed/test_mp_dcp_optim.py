"""torch's DCP (``get_state_dict`` / ``dcp.save`` / ``dcp.load`` / ``set_state_dict``) round-trips every
optimizer's state of a model sharded over 2 processes with ``dtensor_state_dict=True`` (row-wise, table-wise
and replicated tables, a DDP head), pending accumulation windows included; and ``tte.clip_grad_norm_`` under
data parallel exchanges the rows as the optimizer would (issue [hardening4] items 5 and 7).

One spawn of 2 gloo processes per job (tests/_h4_dcp_worker.py).
"""

from __future__ import annotations

from typing import Any

import _h4_dcp_worker as H
import _mp_worker as W
import pytest
import torch
from test_mp_build import ranks

import torch_tpu_embedding as tte
from torch_tpu_embedding.optim._state import state_save


def assert_bitwise(a: Any, b: Any, path: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, path
        assert torch.equal(a, b), (path, float((a.double() - b.double()).abs().max()) if a.numel() else 0)
    elif isinstance(a, dict):
        assert isinstance(b, dict) and sorted(map(str, a)) == sorted(map(str, b)), (path, list(a), list(b))
        for k in a:
            assert_bitwise(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_bitwise(x, y, f"{path}[{i}]")
    else:
        assert a == b, (path, a, b)


def per_call_sums(sd: dict[str, Any]) -> dict[str, Any]:
    """``sd`` (``{"model", "optim"}`` as stored) with each pending accumulation buffer (``acc_ids`` /
    ``acc_rows``, whose capacity is a layout detail: a loaded window is as wide as its largest call) as its
    rows summed per call and id."""
    optim = dict(sd["optim"])
    state = {}
    for key, entry in optim["state"].items():
        entry = dict(entry)
        if "acc_ids" in entry:
            calls = []
            for ids, rows in zip(entry.pop("acc_ids"), entry.pop("acc_rows"), strict=True):
                sums: dict[int, torch.Tensor] = {}
                for i, r in zip(ids.tolist(), rows, strict=True):
                    if i >= 0:
                        sums[i] = sums[i] + r if i in sums else r.clone()
                calls.append(dict(sorted(sums.items())))
            entry["pending"] = calls
        state[key] = entry
    optim["state"] = state
    return {"model": sd["model"], "optim": optim}


def test_clip_that_scales_nothing_leaves_use_gradient_accumulation_false_bitwise(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    """On main the clip summed each rank's duplicate ids before sending them (the optimizer sends them one
    by one under use_gradient_accumulation=False): 1.3e-3 off after one step."""
    for res in ranks(2, "clip", tmp_path_factory, worker=H.worker):
        assert_bitwise(res["clip"][True], res["clip"][False])


@pytest.mark.parametrize("name", list(H.DCP_CONFIGS))
def test_dcp_round_trip_of_every_optimizer_at_2_processes(name: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    """Loaded: every rank's model and optimizer state equal the saved run's (Adafactor's whole-table
    statistics of a table-wise table included: on main rank 0's zeros were kept for the table rank 1 owns;
    a pending accumulation window included: on main a fresh optimizer's template dropped it); trained on 3
    steps: still equal, bit for bit."""
    for r, res in enumerate(ranks(2, "dcp", tmp_path_factory, worker=H.worker)):
        saved, loaded = res[name]["loaded"]
        assert_bitwise(per_call_sums(loaded), per_call_sums(saved), f"rank {r} loaded")
        a, b = res[name]["trained"]
        assert_bitwise(per_call_sums(b), per_call_sums(a), f"rank {r} trained on")


@pytest.mark.parametrize("name", list(H.DCP_CONFIGS))
def test_the_2_process_checkpoint_loads_into_one_default_stacked_process(
        name: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    """The checkpoint the 2 processes saved (per-table keys, DTensors, a pending window in logical ids) read
    into one process with ``tte.checkpoint.read_torch_dcp`` and loaded into the default, stacked model equals
    one process trained on the global batch (float64 within 1e-10, as tests/distributed/test_mp_shard.py holds
    the sharded run to it), and so does training on 3 steps from it."""
    path = ranks(2, "dcp", tmp_path_factory, worker=H.worker)[0][name]["path"]
    cls, kw = H.DCP_CONFIGS[name]
    ref = W.Model(torch.float64)
    ref_opt = cls(ref.parameters(), **kw)
    W.train(ref, ref, ref_opt, torch.float64, steps=range(3))
    one = W.Model(torch.float64, seed=5)  # built as by default: its replicated and row tables stacked
    assert any("groups." in n for n, _ in one.named_parameters())
    opt = cls(one.parameters(), **kw)
    saved = tte.checkpoint.read_torch_dcp(path)
    one.load_state_dict(saved["model"])
    opt.load_state_dict(saved["optim"])
    for steps in (range(0), range(3, 6)):
        W.train(ref, ref, ref_opt, torch.float64, steps=steps)
        W.train(one, one, opt, torch.float64, steps=steps)
        for k, v in ref.state_dict().items():
            torch.testing.assert_close(one.state_dict()[k], v, rtol=1e-10, atol=1e-10, msg=k)
        ours, theirs = state_save.state_dict(opt)["state"], state_save.state_dict(ref_opt)["state"]
        assert sorted(ours) == sorted(theirs)
        for key, entry in theirs.items():
            for slot, v in entry.items():
                if slot not in ("acc_ids", "acc_rows"):
                    torch.testing.assert_close(ours[key][slot], v, rtol=1e-10, atol=1e-10, msg=f"{key}/{slot}")
