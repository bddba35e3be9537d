"""Nested feature structures (dicts, lists and tuples of leaves), walked in TF ``nest`` order."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch.utils._pytree import tree_map

__all__ = ["Path", "check_structure", "detached", "flatten", "path_name", "pick", "rebuild", "sorted_keys"]

#: a leaf's position: the keys and indices from the root
Path = tuple[Any, ...]


def sorted_keys(struct: Mapping[Any, Any]) -> list[Any]:
    """A mapping's keys in TF ``nest`` order: sorted by value (``9`` before ``10``, as ``sorted``), whatever
    the insertion order (OrderedDicts too). Keys of mixed types, which TF refuses, are sorted by their text
    rather than refused: the order stays deterministic."""
    try:
        return sorted(struct)
    except TypeError:
        return sorted(struct, key=str)


def flatten(struct: Any, path: Path = ()) -> Iterator[tuple[Path, Any]]:
    """Leaves of a nested dict/list/tuple in TF ``nest`` order (dict keys sorted)."""
    if isinstance(struct, Mapping):
        for key in sorted_keys(struct):
            yield from flatten(struct[key], (*path, key))
    elif isinstance(struct, (list, tuple)):
        for i, item in enumerate(struct):
            yield from flatten(item, (*path, i))
    else:
        yield path, struct


def detached(struct: Any) -> Any:
    """``struct`` with every tensor detached, in its own containers (torch's pytree: an OrderedDict or a
    namedtuple of activations stays one)."""
    return tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, struct)


def path_name(path: Path) -> str:
    return "/".join(str(p) for p in path) if path else "<root>"


def pick(struct: Any, path: Path) -> Any:
    for key in path:
        struct = struct[key]
    return struct


def rebuild(template: Any, values: dict[Path, Any], path: Path = ()) -> Any:
    """``template``'s structure with the leaf at ``path`` replaced by ``values[path]``: keys in the template's
    order, and its container types kept as TF's ``nest.pack_sequence_as`` keeps them (an OrderedDict or
    namedtuple of features gives an OrderedDict or namedtuple of activations)."""
    if isinstance(template, Mapping):
        pairs = [(k, rebuild(v, values, (*path, k))) for k, v in template.items()]
        if type(template) is dict:
            return dict(pairs)
        if isinstance(template, defaultdict):  # its constructor takes the factory first
            return defaultdict(template.default_factory, pairs)
        try:
            return type(template)(pairs)  # type: ignore[call-arg]
        except TypeError:  # a mapping type that cannot be built from pairs: a plain dict
            return dict(pairs)
    if isinstance(template, (list, tuple)):
        items = [rebuild(v, values, (*path, i)) for i, v in enumerate(template)]
        if isinstance(template, list):
            return items
        return type(template)(*items) if hasattr(template, "_fields") else tuple(items)  # namedtuples by field
    return values[path]


#: per type: whether its instances are branches of a structure (a mapping, list or tuple), not leaves. Asked of
#: the config's entries at every call: a dict lookup per type instead of an ABC ``isinstance`` per feature.
_BRANCH: dict[type, bool] = {}


def _is_branch_type(kind: type) -> bool:
    known = _BRANCH.get(kind)
    if known is None:
        known = _BRANCH[kind] = issubclass(kind, (Mapping, list, tuple))
    return known


def _where(path: Path) -> str:
    return f" at `{path_name(path)}`" if path else ""


def check_structure(config: Any, given: Any, what: str, path: Path = ()) -> None:
    """``given`` must have ``config``'s structure (leaves of ``given`` may be anything)."""
    if isinstance(config, Mapping):
        if not isinstance(given, Mapping):
            raise TypeError(f"{what}{_where(path)} must be a mapping like the feature config. "
                            f"Received: {type(given).__name__}")
        if given.keys() != config.keys():  # (equal keys, the usual case: nothing to list)
            # The keys themselves, not their text: an int key 1 and a str key "1" are two keys (a lookup of
            # one by the other failed later with a bare KeyError).
            missing = [k for k in sorted_keys(config) if k not in given]
            unknown = [k for k in sorted_keys(given) if k not in config]
            if missing or unknown:
                raise ValueError(
                    f"{what}{_where(path)} do not match the feature config: missing {missing}, "
                    f"unknown {unknown}."
                )
        if not any(map(_is_branch_type, set(map(type, config.values())))):
            return  # (leaves only, the usual case: a leaf may be given as anything, nothing to check)
        for key, sub in config.items():
            if _is_branch_type(type(sub)):
                check_structure(sub, given[key], what, (*path, key))
    elif isinstance(config, (list, tuple)):
        if not isinstance(given, (list, tuple)) or len(given) != len(config):
            raise ValueError(
                f"{what}{_where(path)} must be a list/tuple of {len(config)} entries like the feature "
                f"config. Received: {type(given).__name__}"
                + (f" of {len(given)}" if isinstance(given, (list, tuple)) else "")
            )
        for i, (c, g) in enumerate(zip(config, given, strict=True)):
            if _is_branch_type(type(c)):
                check_structure(c, g, what, (*path, i))
