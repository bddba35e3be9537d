"""The on/off environment switches share one rule (``env.py``): ``0``, ``false``, ``off``, ``no`` in any case and
with surrounding spaces turn a switch off; anything else, or nothing, leaves it on."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

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


@pytest.mark.parametrize(("old", "new"), [("TTE_FUSED_UPDATE", "TTE_UPDATE_KERNEL"), ("TTE_FUSED_AFTER", "TTE_KERNEL_AFTER"),
                                          ("TTE_FUSED_MIN_ELEMENTS", "TTE_KERNEL_MIN_ELEMENTS")])
def test_a_renamed_setting_is_read_by_its_old_name_and_the_new_name_wins(old: str, new: str,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    assert env.RENAMED[new] == old
    monkeypatch.delenv(new, raising=False)
    monkeypatch.delenv(old, raising=False)
    assert env.env_setting(new) == (new, None) and env.switched_on(new)
    monkeypatch.setenv(old, "0")
    assert env.env_setting(new) == (old, "0") and not env.switched_on(new)
    monkeypatch.setenv(new, "1")
    assert env.env_setting(new) == (new, "1") and env.switched_on(new)


def _kernel_settings(**values: str) -> str:
    """What the kernel path reads at import in a fresh process with only ``values`` of its settings set."""
    base = {k: v for k, v in os.environ.items() if k not in env.RENAMED and k not in env.RENAMED.values()}
    repo = str(Path(__file__).resolve().parents[1])
    r = subprocess.run([sys.executable, "-c", "from torch_tpu_embedding.optim._kernels import kernel_policy as r; "
                        "print(r.enabled(), *r.policy())"],
                       env={**base, **values, "PYTHONPATH": os.pathsep.join(p for p in (repo, base.get("PYTHONPATH")) if p)},
                       capture_output=True, text=True, timeout=600)
    return r.stdout.strip() if r.returncode == 0 else r.stderr


def test_the_kernel_path_reads_the_old_names_of_its_settings() -> None:
    assert _kernel_settings(TTE_FUSED_UPDATE="0", TTE_FUSED_AFTER="7", TTE_FUSED_MIN_ELEMENTS="9") == "False 7 9"
    assert _kernel_settings(TTE_FUSED_UPDATE="0", TTE_UPDATE_KERNEL="1", TTE_FUSED_AFTER="7", TTE_KERNEL_AFTER="3",
                            TTE_KERNEL_MIN_ELEMENTS="5") == "True 3 5"
    assert "environment variable TTE_FUSED_AFTER must be an int >= 0, got 'x'" in _kernel_settings(TTE_FUSED_AFTER="x")
