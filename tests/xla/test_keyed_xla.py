"""A ``KeyedJaggedTensor`` whose parts are on the XLA device: looked up on the thread that syncs as the CPU looks it
up, and refused by ``prepare(..., ahead=True)`` (``NotAhead``) before any of its data is read: its lengths' host read
is a transfer, which torch_xla 2.9 races with the thread that syncs (``modules/ahead.py``)."""

from __future__ import annotations

import pytest
import torch

torch_xla = pytest.importorskip("torch_xla")
import torch_xla.debug.metrics as met  # noqa: E402

import torch_tpu_embedding as tte  # noqa: E402
from torch_tpu_embedding.modules.prepared import NotAhead  # noqa: E402

DEV = torch_xla.device()  # before any backward (the autograd engine sizes its device queues then)
KEYS = ["user", "watched"]
LENGTHS = torch.tensor([1, 1, 2, 0, 3, 1])
VALUES = torch.tensor([7, 8, 1, 2, 3, 4, 5, 6])


class _KJT:
    def __init__(self, device: torch.device | str) -> None:
        self._v, self._l = VALUES.to(device), LENGTHS.to(device)

    def keys(self) -> list[str]:
        return KEYS

    def values(self) -> torch.Tensor:
        return self._v

    def lengths(self) -> torch.Tensor:
        return self._l


def _collection(device: torch.device | str) -> tte.EmbeddingCollection:
    torch.manual_seed(0)
    tables = [tte.TableConfig(10, 3, name="t_user"), tte.TableConfig(12, 3, name="t_movie", combiner="mean")]
    return tte.EmbeddingCollection({k: tte.FeatureConfig(t) for k, t in zip(KEYS, tables, strict=True)},
                                   device=device)


def test_a_keyed_input_on_the_device_equals_the_cpus() -> None:
    got = _collection(DEV)(_KJT(DEV), concat=True).cpu()
    torch.testing.assert_close(got, _collection("cpu")(_KJT("cpu"), concat=True).detach(), rtol=1e-6, atol=1e-6)


def test_a_keyed_input_on_the_device_is_not_prepared_ahead_nor_read() -> None:
    ec = _collection(DEV)
    ec.know_rows()  # (the tables' sizes: else prepare refuses for them first)
    kjt = _KJT(DEV)
    torch_xla.sync()
    met.clear_all()
    with pytest.raises(NotAhead, match="KeyedJaggedTensor input on an XLA device"):
        ec.prepare(kjt, ahead=True)
    assert met.metric_data("TransferFromDeviceTime") is None  # nothing read back (the lengths' read was one)
    assert ec(ec.prepare(kjt), concat=True).shape == (3, 6)  # prepared on the thread that syncs


@pytest.mark.parametrize("values_on, lengths_on", [("xla", "cpu"), ("cpu", "xla")])
def test_a_keyed_input_with_its_lengths_on_another_device_than_its_values_raises(values_on: str,
                                                                                  lengths_on: str) -> None:
    """Host lengths with device values (or the reverse) crashed in the padding with torch_xla's "Expected XLA
    tensor. Got: torch.LongTensor"."""
    kjt = _KJT("cpu")
    kjt._v, kjt._l = kjt._v.to(DEV if values_on == "xla" else "cpu"), kjt._l.to(DEV if lengths_on == "xla" else "cpu")
    with pytest.raises(ValueError, match=rf"must be on one device .* Received values\(\) on {values_on}.*, "
                                         rf"lengths\(\) on {lengths_on}"):
        _collection(DEV)(kjt)
