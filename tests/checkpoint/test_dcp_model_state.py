"""What a distributed checkpoint (``tte.checkpoint.save_distributed``) keeps of a model besides its parameters: as
``state_dict()`` does, the persistent buffers and each module's extra state (``get_extra_state``), and not the
non-persistent buffers.

Until 2026-12-02 it kept every buffer and no extra state: a module's ``get_extra_state`` (a step counter, a
vocabulary) came back from a load as the loading model had it, silently, and a non-persistent buffer (a cache) was
overwritten with the saving model's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import torch_tpu_embedding as tte
from torch_tpu_embedding.checkpoint import api
from torch_tpu_embedding.checkpoint.dcp import META, read_meta


class Counter(torch.nn.Module):
    """A module with an extra state, a persistent buffer and a non-persistent one."""

    def __init__(self) -> None:
        super().__init__()
        self.seen = 0
        self.names: list[str] = []
        self.register_buffer("kept", torch.zeros(2))
        self.register_buffer("cache", torch.zeros(3), persistent=False)

    def get_extra_state(self) -> Any:
        return {"seen": self.seen, "names": list(self.names), "t": torch.tensor([float(self.seen)])}

    def set_extra_state(self, state: Any) -> None:
        if state["seen"] < 0:
            raise ValueError("a negative count")
        self.seen, self.names = state["seen"], list(state["names"])


class Model(torch.nn.Module):
    def __init__(self, seed: int, stack: bool = True) -> None:
        super().__init__()
        torch.manual_seed(seed)
        a = tte.TableConfig(20, 3, name="a", combiner="sum")
        b = tte.TableConfig(10, 3, name="b", combiner="sum")
        self.ec = tte.EmbeddingCollection({"fa": tte.FeatureConfig(a), "fb": tte.FeatureConfig(b)},
                                          stack_tables=stack)
        self.counter = Counter()
        self.head = torch.nn.Sequential(torch.nn.Linear(3, 1), Counter())


def _trained(seed: int = 0) -> Model:
    m = Model(seed)
    m.counter.seen, m.counter.names = 7, ["x", "y"]
    m.head[1].seen = 3
    with torch.no_grad():
        m.counter.kept += 2
        m.counter.cache += 5
    return m


def _state(m: Model) -> dict[str, Any]:
    return {"sd": {k: v.clone() for k, v in m.state_dict().items() if isinstance(v, torch.Tensor)},
            "extra": [(c.seen, list(c.names)) for c in (m.counter, m.head[1])], "cache": m.counter.cache.clone()}


def _assert_same(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a["extra"] == b["extra"]
    assert set(a["sd"]) == set(b["sd"])
    for k in a["sd"]:
        assert torch.equal(a["sd"][k], b["sd"][k]), k
    assert torch.equal(a["cache"], b["cache"])


@pytest.mark.parametrize("how", ["in place", "restacked", "converted"])
def test_extra_states_and_persistent_buffers_come_back(how: str, tmp_path: Path) -> None:
    """In place (the same layout), through the host (tables stacked otherwise) and as a :func:`save` file
    (``convert_distributed``); the loading model's non-persistent buffer stays its own."""
    saved = _trained()
    tte.checkpoint.save_distributed(tmp_path / "c", model=saved)
    m = Model(seed=5, stack=how != "restacked")
    if how == "converted":
        tte.checkpoint.convert_distributed(tmp_path / "c", tmp_path / "c.pt")
        tte.checkpoint.load(tmp_path / "c.pt", model=m)
    else:
        tte.checkpoint.load_distributed(tmp_path / "c", model=m)
    assert (m.counter.seen, m.counter.names, m.head[1].seen) == (7, ["x", "y"], 3)
    assert torch.equal(m.counter.kept, torch.full((2,), 2.0))
    assert torch.equal(m.counter.cache, torch.zeros(3))  # not state: not saved, not loaded
    want, got = saved.ec.state_dict(), m.ec.state_dict()
    for name in ("a", "b"):
        assert torch.equal(got[f"tables.{name}.weight"], want[f"tables.{name}.weight"]), name


def test_a_raising_set_extra_state_changes_nothing(tmp_path: Path) -> None:
    saved = _trained()
    saved.head[1].seen = -1  # the second module's set_extra_state refuses it; the first's is set before
    tte.checkpoint.save_distributed(tmp_path / "c", model=saved)
    m = Model(seed=5)
    m.counter.seen = 2
    before = _state(m)
    with pytest.raises(ValueError, match="a negative count"):
        tte.checkpoint.load_distributed(tmp_path / "c", model=m)
    _assert_same(_state(m), before)


def test_extra_states_that_do_not_match_are_refused_before_anything_changes(tmp_path: Path) -> None:
    saved = _trained()
    tte.checkpoint.save_distributed(tmp_path / "c", model=saved)
    m = Model(seed=5)
    m.extra = Counter()  # a module with an extra state the checkpoint lacks
    before = _state(m)
    with pytest.raises(tte.checkpoint.CheckpointMismatchError,
                       match=r"missing the extra state of \['extra._extra_state'\]"):
        tte.checkpoint.load_distributed(tmp_path / "c", model=m)
    _assert_same(_state(m), before)
    assert m.extra.seen == 0


def test_a_checkpoint_that_saved_a_non_persistent_buffer_still_loads(tmp_path: Path, monkeypatch: Any) -> None:
    """As checkpoints written before 2026-12-02 did: the buffer's saved value is not loaded."""
    saved = _trained()
    with monkeypatch.context() as patch:
        patch.setattr(api, "_non_persistent", lambda model: set())
        tte.checkpoint.save_distributed(tmp_path / "c", model=saved)
    m = Model(seed=5)
    tte.checkpoint.load_distributed(tmp_path / "c", model=m)
    assert torch.equal(m.counter.cache, torch.zeros(3)) and m.counter.seen == 7


def test_extra_comes_back_from_every_load(tmp_path: Path) -> None:
    """``extra`` as :func:`tte.checkpoint.save` takes it: published with the tensors, returned by
    ``load_distributed`` (in place and through the host) and by ``load`` of the converted file."""
    saved = _trained()
    given = {"step": 1200, "loader": {"epoch": 2, "offset": torch.tensor([3, 4])}}
    tte.checkpoint.save_distributed(tmp_path / "c", model=saved, extra=given)
    for stack in (True, False):
        got = tte.checkpoint.load_distributed(tmp_path / "c", model=Model(seed=5, stack=stack))
        assert got is not None and got["step"] == 1200 and got["loader"]["epoch"] == 2
        assert torch.equal(got["loader"]["offset"], torch.tensor([3, 4]))
    tte.checkpoint.convert_distributed(tmp_path / "c", tmp_path / "c.pt")
    assert tte.checkpoint.load(tmp_path / "c.pt", model=Model(seed=5))["step"] == 1200
    tte.checkpoint.save_distributed(tmp_path / "c", model=saved)
    assert tte.checkpoint.load_distributed(tmp_path / "c", model=Model(seed=5)) is None


def test_an_extra_a_load_could_not_read_is_refused_before_anything_changes(tmp_path: Path) -> None:
    saved = _trained()
    tte.checkpoint.save_distributed(tmp_path / "c", model=saved, extra={"step": 1})
    before = sorted(p.name for p in (tmp_path / "c").iterdir())
    with pytest.raises(Exception, match="extra") as info:
        tte.checkpoint.save_distributed(tmp_path / "c", model=saved, extra={"step": 2, "bad": Counter()})
    assert "Counter" in str(info.value), str(info.value)
    assert sorted(p.name for p in (tmp_path / "c").iterdir()) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c"]
    assert tte.checkpoint.load_distributed(tmp_path / "c", model=Model(seed=5)) == {"step": 1}


class SavesOnly(torch.nn.Module):
    """``get_extra_state`` without ``set_extra_state``: torch's ``state_dict()`` saves its key, and its strict
    ``load_state_dict`` finds the key unexpected."""

    def get_extra_state(self) -> Any:
        return {"v": 1}


class SetsOnly(torch.nn.Module):
    """``set_extra_state`` without ``get_extra_state``: nothing saved, and torch's strict load misses the key."""

    def set_extra_state(self, state: Any) -> None:
        self.state = state


@pytest.mark.parametrize("kind", [SavesOnly, SetsOnly])
@pytest.mark.parametrize("how", ["in place", "restacked", "converted"])
def test_extra_states_follow_torchs_rule_for_each_direction(kind: type[torch.nn.Module], how: str,
                                                             tmp_path: Path) -> None:
    """torch saves an extra state where ``get_extra_state`` is overridden and loads one where ``set_extra_state``
    is: a module with one of them cannot take its own state_dict back (strict). Every load of ours refuses the same,
    before anything changes (until 2026-12-02 the distributed load judged the load by the saving rule: a module that
    only sets had nothing checked and loaded as if it had no state)."""
    saved = _trained()
    saved.odd = kind()
    m = Model(seed=5, stack=how != "restacked")
    m.odd = kind()
    with pytest.raises(RuntimeError):  # torch itself: its own state_dict back
        m.load_state_dict(saved.state_dict())
    word = "unexpected" if kind is SavesOnly else "missing"
    tte.checkpoint.save_distributed(tmp_path / "c", model=saved)
    before = _state(m)
    with pytest.raises(tte.checkpoint.CheckpointMismatchError, match=f"(?i){word}.*odd._extra_state"):
        if how == "converted":
            tte.checkpoint.convert_distributed(tmp_path / "c", tmp_path / "c.pt")
            tte.checkpoint.load(tmp_path / "c.pt", model=m)
        else:
            tte.checkpoint.load_distributed(tmp_path / "c", model=m)
    _assert_same(_state(m), before)


class Shared(torch.nn.Module):
    """Modules reached by two paths (``state_dict()`` holds their state under each): one with an extra state and
    buffers, the embedding collection (its stacked groups' tables); and a weight two modules hold."""

    def __init__(self, seed: int, stack: bool = True) -> None:
        super().__init__()
        self.model = Model(seed, stack)
        self.alias = self.model.counter
        self.ec_too = self.model.ec
        self.tied = torch.nn.Linear(3, 1, bias=False)
        self.tied.weight = self.model.head[0].weight


@pytest.mark.parametrize("how", ["in place", "restacked", "converted"])
def test_a_module_reached_by_two_paths_has_its_extra_state_under_each(how: str, tmp_path: Path) -> None:
    """As torch's ``state_dict()``: under each path (until 2026-12-02 the distributed save kept it under the first
    alone, and a load through the host or a converted file then missed the second)."""
    saved = Shared(0)
    saved.model.counter.seen, saved.model.counter.names = 7, ["x"]
    with torch.no_grad():
        saved.alias.kept += 4
    want = saved.state_dict()
    assert {"model.counter._extra_state", "alias._extra_state", "alias.kept", "ec_too.tables.a.weight",
            "tied.weight"} <= set(want)
    tte.checkpoint.save_distributed(tmp_path / "c", model=saved)
    m = Shared(5, stack=how != "restacked")
    if how == "converted":
        tte.checkpoint.convert_distributed(tmp_path / "c", tmp_path / "c.pt")
        tte.checkpoint.load(tmp_path / "c.pt", model=m)
    else:
        tte.checkpoint.load_distributed(tmp_path / "c", model=m)
    assert (m.alias.seen, m.alias.names) == (7, ["x"])
    got = m.state_dict()
    for k, v in want.items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(got[k], v), k


@pytest.mark.parametrize("bad", [["model.x"], {"alias.kept": 3}])
def test_a_meta_file_whose_aliases_are_not_keys_is_refused_as_damaged(bad: Any, tmp_path: Path) -> None:
    """The aliases are read before the tensors: anything but a mapping of keys to keys is a damaged file, named."""
    tte.checkpoint.save_distributed(tmp_path / "c", model=Shared(0))
    meta = read_meta(str(tmp_path / "c"))
    assert meta["aliases"]["alias.kept"] == "model.counter.kept"
    torch.save({**meta, "aliases": bad}, tmp_path / "c" / META)
    with pytest.raises(ValueError, match="is damaged: 'aliases' must map state_dict keys"):
        read_meta(str(tmp_path / "c"))
