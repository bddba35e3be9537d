"""The cached lookup plan (modules/plan.py) for host ids of a stacked XLA group: joined, shifted, padded and checked
by one C pass on the host and moved in one transfer of int32 ids (``c_gather.join_ids``), or, where that does not
apply, joined feature-major by torch ops, moved with their masks and transposed on the device
(``AssembledBatch._major``). Calls that alternate masks, ids
dtypes, batch sizes, forms and strides replay where their signatures match and plan afresh where not: bitwise what
planning every call afresh gives, and the CPU's numbers; a bad id on a replayed call names its feature."""

from __future__ import annotations

from typing import Any

import pytest
import torch

torch_xla = pytest.importorskip("torch_xla")

import torch_tpu_embedding as tte  # noqa: E402
from torch_tpu_embedding.modules import assembly, plan  # noqa: E402
from torch_tpu_embedding.optim._kernels import kernel_policy  # noqa: E402
from torch_tpu_embedding.optim._kernels.c_gather import join_library  # noqa: E402

DEV = torch_xla.device()  # before any backward (the autograd engine sizes its device queues then)
F = 4


def _collection(device: Any) -> tte.EmbeddingCollection:
    torch.manual_seed(0)
    tables = [tte.TableConfig(20 + 5 * i, 3, name=f"t{i}", combiner=("mean", "sum")[i % 2]) for i in range(F)]
    return tte.EmbeddingCollection({f"f{i}": tte.FeatureConfig(t, max_ids_per_bag=4) for i, t in enumerate(tables)},
                                   device=device)


def _batch(seed: int, masked: bool = True, dtype: torch.dtype = torch.int64, dense: bool = False,
           b: int = 6) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    out: dict[str, Any] = {}
    for i in range(F):
        ids = torch.randint(0, 20, (b,) if dense else (b, 4), generator=g).to(dtype)
        out[f"f{i}"] = ids if dense else tte.Padded(ids, torch.rand(b, 4, generator=g) > 0.3 if masked else None)
    return out


def _calls() -> list[dict[str, Any]]:
    same = _batch(6)
    same["f1"] = same["f0"]  # one input object for two features
    strided = _batch(7)
    strided["f2"] = tte.Padded(strided["f2"].ids.t().contiguous().t(), strided["f2"].mask)
    strided["f3"] = tte.Padded(strided["f3"].ids[:1].expand(6, 4), strided["f3"].mask)  # (stride 0)
    masked_out = _batch(13)
    masked_out["f0"].ids[0, 0] = 10**6  # outside the mask: no id
    masked_out["f0"].mask[0, 0] = False
    return [_batch(0), _batch(1), _batch(2, masked=False), _batch(3), _batch(4, dtype=torch.int32), _batch(5, b=3),
            _batch(5), same, strided, _batch(9, dense=True), _batch(10, dense=True),
            _batch(11, dense=True, dtype=torch.int32), _batch(12), masked_out]


def _train(device: Any, fresh: bool, monkeypatch: pytest.MonkeyPatch) -> tuple[list[torch.Tensor],
                                                                            dict[str, torch.Tensor], int]:
    """Outputs, the final state and the calls replayed (no feature's signature read)."""
    reads = [0]
    real = plan.signature

    def counted(*args: Any) -> Any:
        reads[0] += 1
        return real(*args)

    monkeypatch.setattr(plan, "signature", counted)
    ec = _collection(device)
    opt = tte.optim.Adagrad(ec.parameters(), lr=0.3)
    outs, replays = [], 0
    for x in _calls():
        if fresh:
            plan._PLANS.pop(ec, None)
        reads[0] = 0
        out = ec(x, concat=True)
        replays += reads[0] == 0
        (out * torch.linspace(-1, 1, out.shape[1]).to(out.device)).sum().backward()
        opt.step()
        opt.zero_grad()
        outs.append(out.detach().cpu())
    return outs, {k: v.detach().cpu() for k, v in ec.state_dict().items()}, replays


def test_replayed_plans_of_an_xla_group_train_as_fresh_ones_and_as_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    outs, state, replays = _train(DEV, False, monkeypatch)
    assert replays == 5  # (the calls whose signatures are the last call's)
    want_outs, want_state, none = _train(DEV, True, monkeypatch)
    assert none == 0
    assert all(torch.equal(a, b) for a, b in zip(outs, want_outs, strict=True))
    assert all(torch.equal(state[k], want_state[k]) for k in want_state)
    cpu_outs, cpu_state, _ = _train("cpu", False, monkeypatch)
    for a, b in zip(outs, cpu_outs, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    for k, v in cpu_state.items():
        torch.testing.assert_close(state[k], v, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("c_join", [False, True])
def test_a_bad_id_on_a_replayed_xla_call_names_its_feature(c_join: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kernel_policy, "_ENABLED", c_join)
    ec = _collection(DEV)
    ec(_batch(0), concat=True)
    assert ec in plan._PLANS
    x = _batch(1)
    x["f2"].ids[1, 1] = 30  # t2 has 30 rows (the group more)
    x["f2"].mask[1, 1] = True
    with pytest.raises(ValueError, match=r"Feature `f2`: ids must be in \[0, 30\).*Received: 30"):
        ec(x, concat=True)


def test_the_c_join_moves_one_int32_tensor_and_trains_as_the_torch_ops_join(monkeypatch: pytest.MonkeyPatch) -> None:
    """Host ids bound for XLA: the C pass's int32 ids are the only transfer of a call (no mask, no int64 ids), and
    every call trains bitwise as the torch ops' join (stack, transfer of ids and masks, shift and ``where`` on the
    device). The suite runs with the kernel library off (tests/conftest.py): on here, as a user's run has it."""
    monkeypatch.setattr(kernel_policy, "_ENABLED", True)
    if join_library() is None:
        pytest.skip("no C compiler builds the library here")
    batches: list[tuple[assembly.AssembledBatch, list[torch.dtype]]] = []  # per batch assembled: what it moved
    real_upload, real_assemble = assembly.upload, assembly.AssembledBatch.assemble

    def upload(t: torch.Tensor, device: torch.device) -> torch.Tensor:
        batches[-1][1].append(t.dtype)
        return real_upload(t, device)

    def assemble(self: assembly.AssembledBatch, *args: Any, **kwargs: Any) -> None:
        batches.append((self, []))
        real_assemble(self, *args, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(assembly, "upload", upload)
        m.setattr(assembly.AssembledBatch, "assemble", assemble)
        outs, state, _ = _train(DEV, False, monkeypatch)
    c_joined = [moved for b, moved in batches if b._ready]
    assert len(c_joined) >= 20 and len(batches) - len(c_joined) >= 2  # (int32 ids and strided ones: torch ops)
    assert all(moved == [torch.int32] for moved in c_joined), c_joined  # one transfer, no mask
    with monkeypatch.context() as m:
        m.setattr(assembly, "join_ids", lambda *args: None)
        want_outs, want_state, _ = _train(DEV, False, monkeypatch)
    assert all(torch.equal(a, b) for a, b in zip(outs, want_outs, strict=True))
    assert all(torch.equal(state[k], want_state[k]) for k in want_state)
