"""The names of a collection's tables and features, each checked to be unique, in the user's words."""

from __future__ import annotations

from typing import Any

from torch_tpu_embedding._util.nest import Path, path_name
from torch_tpu_embedding.config import FeatureConfig, TableConfig

__all__ = ["name_features"]


def name_features(
    flat: list[tuple[Path, Any]],
) -> tuple[dict[str, TableConfig], list[tuple[Path, str, FeatureConfig, str]]]:
    """Name the tables and features of a flattened ``feature_config``.

    Returns ``({table name: its TableConfig}, [(path, feature name, FeatureConfig, table name)])``:
    tables once each, in order of first occurrence, an unnamed one called ``table_<i>``; a feature
    is its ``FeatureConfig(name=...)``, else its path. Raises ``TypeError`` for a leaf that is not
    a :class:`FeatureConfig`, ``ValueError`` for two tables or two features of one name, naming them.

    Example::

        >>> from torch_tpu_embedding._util.nest import flatten
        >>> t = TableConfig(10, 4)
        >>> tables, features = name_features(list(flatten({"a": FeatureConfig(t), "b": FeatureConfig(t)})))
        >>> list(tables), [f[1] for f in features]
        (['table_0'], ['a', 'b'])
    """
    for path, fc in flat:
        if not isinstance(fc, FeatureConfig):
            raise TypeError(
                f"Argument `feature_config` must hold only FeatureConfig leaves; found "
                f"{type(fc).__name__} at `{path_name(path)}`."
            )
    table_names: dict[int, str] = {}  # id(TableConfig) -> name
    configs: dict[str, TableConfig] = {}
    for _, fc in flat:
        if id(fc.table) not in table_names:
            table_names[id(fc.table)] = fc.table.name if fc.table.name is not None else f"table_{len(table_names)}"
            configs.setdefault(table_names[id(fc.table)], fc.table)
    names = list(table_names.values())
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        users = [path_name(p) for p, fc in flat if table_names[id(fc.table)] == dupes[0]]
        raise ValueError(
            f"Tables must have a unique name. Multiple tables with name {dupes[0]!r} found (distinct TableConfig "
            f"objects, looked up by the features at {users}; a TableConfig without a name is called table_<i> in "
            "table order). To share one table, pass the same TableConfig object to those features; else give each "
            "TableConfig its own name.")
    features = [(path, fc.name or path_name(path), fc, table_names[id(fc.table)]) for path, fc in flat]
    feature_names = [f[1] for f in features]
    dupe_features = sorted({n for n in feature_names if feature_names.count(n) > 1})
    if dupe_features:
        at = [path_name(f[0]) for f in features if f[1] == dupe_features[0]]
        raise ValueError(f"Features must have unique names. Duplicated: {dupe_features} (the features at {at}; a "
                         "feature's name is its FeatureConfig(name=...), else its path). Give them distinct names.")
    return configs, features
