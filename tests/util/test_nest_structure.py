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
