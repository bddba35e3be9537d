"""The on/off environment switches share one rule (``env.py``): ``0``, ``false``, ``off``, ``no`` in any case and
with surrounding spaces turn a switch off; anything else, or nothing, leaves it on."""

from __future__ import annotations

import pytest

from torch_tpu_embedding._util import env


@pytest.mark.parametrize("value", ["0", "false", "OFF", " No ", "off\n"])
def test_off_values(value: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TTE_SOME_SWITCH", value)
    assert env.is_off(value) and not env.switched_on("TTE_SOME_SWITCH")


@pytest.mark.parametrize("value", ["1", "", "on", "yes", "00", "nope"])
def test_other_values_and_unset_leave_it_on(value: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TTE_SOME_SWITCH", value)
    assert not env.is_off(value) and env.switched_on("TTE_SOME_SWITCH")
    monkeypatch.delenv("TTE_SOME_SWITCH")
    assert env.switched_on("TTE_SOME_SWITCH")
