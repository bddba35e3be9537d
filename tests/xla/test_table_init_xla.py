"""Tables built for an XLA device draw their values on the CPU (one seed, one table on every device), built
with ``device=`` or under ``with torch.device(xla):``; an initializer that fills nothing is refused there too."""

from __future__ import annotations

import functools
import os

import pytest
import torch

torch_xla = pytest.importorskip("torch_xla")

import torch_tpu_embedding as tte  # noqa: E402

assert os.environ.get("PJRT_DEVICE"), "run the XLA tests with PJRT_DEVICE=CPU"
DEV = torch_xla.device()
V, D = 50, 4
WAYS = ["device-argument", "device-context"]


def build(init, how: str, stack: bool = False) -> tte.EmbeddingCollection:
    a = tte.TableConfig(V, D, name="a", initializer=init)
    b = tte.TableConfig(9, D, name="b")
    features = {"f": tte.FeatureConfig(a), "g": tte.FeatureConfig(b)}
    torch.manual_seed(0)
    if how == "device-argument":
        return tte.EmbeddingCollection(features, device=DEV, stack_tables=stack)
    with torch.device(DEV):
        return tte.EmbeddingCollection(features, stack_tables=stack)


@pytest.mark.parametrize("stack", [False, True], ids=["unstacked", "stacked"])
@pytest.mark.parametrize("how", WAYS)
def test_a_seed_draws_the_cpu_table_on_xla(how: str, stack: bool) -> None:
    """Under the device context the tables were drawn by XLA's generator: -0.33 where the CPU draws -0.0032."""
    normal = functools.partial(torch.nn.init.normal_, std=0.01)
    ec = build(normal, how, stack)
    torch.manual_seed(0)
    want = torch.empty(V, D).normal_(std=0.01)  # plain torch on the CPU, the same seed
    assert ec.tables["a"].weight.device.type == "xla"
    assert torch.equal(ec.tables["a"].weight.detach().cpu(), want)
    torch.manual_seed(0)  # the default initializer: as the CPU collection draws it
    on_cpu = tte.EmbeddingCollection({"f": tte.FeatureConfig(tte.TableConfig(V, D, name="a", initializer=normal)),
                                      "g": tte.FeatureConfig(tte.TableConfig(9, D, name="b"))}, stack_tables=stack)
    assert torch.equal(ec.tables["b"].weight.detach().cpu(), on_cpu.tables["b"].weight.detach())

@pytest.mark.parametrize("how", WAYS)
def test_an_initializer_that_fills_nothing_is_refused_on_xla(how: str) -> None:
    with pytest.raises(ValueError, match=r"Table `a`: its initializer '<lambda>' neither filled the \[50, 4\] weight "
                       r"tensor.*\(it returned None;"):
        build(lambda t: None, how)


@pytest.mark.parametrize("how", WAYS)
def test_returned_values_are_the_table_on_xla(how: str) -> None:
    want = torch.arange(V * D, dtype=torch.float64).reshape(V, D)
    ec = build(lambda t: want, how)
    assert torch.equal(ec.tables["a"].weight.detach().cpu(), want.float())
