"""check_structure (torch_tpu_embedding/_util/nest.py): a flat config skips its leaves at once; nested ones are still
walked, and each mismatch names where it is."""

from __future__ import annotations

import pytest

from torch_tpu_embedding._util.nest import check_structure

CONFIG = {"a": 1, "u": {"x": 2, "y": [3, 4]}}


def test_matching_structures_pass_whatever_their_leaves() -> None:
    check_structure(CONFIG, {"a": object(), "u": {"x": [9], "y": ({}, None)}}, "Inputs")
    check_structure({f"f{i}": i for i in range(100)}, {f"f{i}": {"any": "leaf"} for i in range(100)}, "Inputs")


@pytest.mark.parametrize("given,error,message", [
    ({"a": 0, "u": 5}, TypeError, r"Inputs at `u` must be a mapping like the feature config. Received: int"),
    ({"a": 0, "u": {"x": 0, "y": [0]}}, ValueError,
     r"Inputs at `u/y` must be a list/tuple of 2 entries like the feature config. Received: list of 1"),
    ({"a": 0, "u": {"x": 0, "z": [0, 0]}}, ValueError,
     r"Inputs at `u` do not match the feature config: missing \['y'\], unknown \['z'\]"),
    ({"a": 0}, ValueError, r"Inputs do not match the feature config: missing \['u'\], unknown \[\]"),
], ids=["not-a-mapping", "short-list", "other-key", "missing-key"])
def test_a_nested_mismatch_is_named(given: object, error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        check_structure(CONFIG, given, "Inputs")


def test_int_keys_are_walked_in_tfs_sorted_order_not_as_text() -> None:
    # TF's nest.flatten sorts dict keys with sorted(): 9 before 10. Sorting their text put 10 first, so the
    # unnamed tables were numbered (table_<i>) and concat=True's columns laid out in another order than TF's.
    import torch_tpu_embedding as tte

    a, b = tte.TableConfig(10, 2), tte.TableConfig(10, 3)
    ec = tte.EmbeddingCollection({10: tte.FeatureConfig(b), 9: tte.FeatureConfig(a)})
    assert ec.feature_names == ["9", "10"]
    assert ec.table_configs["table_0"] is a and ec.table_configs["table_1"] is b


def test_activations_come_back_in_the_configs_container_types() -> None:
    # TF's nest.pack_sequence_as keeps the config's types: an OrderedDict or namedtuple of features gives an
    # OrderedDict or namedtuple of activations (a plain dict / tuple lost the field names).
    import collections

    import torch

    import torch_tpu_embedding as tte

    Pair = collections.namedtuple("Pair", ["user", "item"])
    t = tte.TableConfig(10, 2, name="t")
    config = collections.OrderedDict(
        [("z", Pair(tte.FeatureConfig(t), tte.FeatureConfig(t))), ("a", [tte.FeatureConfig(t)])])
    ids = torch.tensor([1, 2])
    out = tte.EmbeddingCollection(config)(collections.OrderedDict([("z", Pair(ids, ids)), ("a", [ids])]))
    assert type(out) is collections.OrderedDict and list(out) == ["z", "a"]
    assert type(out["z"]) is Pair and out["z"].item.shape == (2, 2)
    assert type(out["a"]) is list


@pytest.mark.parametrize("config,given,message", [
    ({1: 0, 2: 0}, {"1": 0, "2": 0}, r"missing \[1, 2\], unknown \['1', '2'\]"),
    ({"1": 0}, {1: 0}, r"missing \['1'\], unknown \[1\]"),
], ids=["int-config-str-inputs", "str-config-int-inputs"])
def test_keys_that_differ_only_in_type_are_a_mismatch_named_as_such(config: dict, given: dict, message: str) -> None:
    # The keys were compared as text, so {1: ...} and {"1": ...} matched and the lookup failed later: KeyError 1.
    with pytest.raises(ValueError, match=r"Inputs do not match the feature config: " + message):
        check_structure(config, given, "Inputs")
    import torch

    import torch_tpu_embedding as tte

    ec = tte.EmbeddingCollection({0: tte.FeatureConfig(tte.TableConfig(10, 2)), 5: tte.FeatureConfig(tte.TableConfig(10, 2))})
    ids = torch.tensor([1])
    with pytest.raises(ValueError, match=r"Inputs `features` do not match the feature config: missing \[0, 5\]"):
        ec({"0": ids, "5": ids})
    with pytest.raises(ValueError, match=r"Argument `weights` do not match the feature config: missing \[5\]"):
        ec({0: ids, 5: ids}, {0: None, "5": None})
