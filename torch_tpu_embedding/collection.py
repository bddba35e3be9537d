"""``EmbeddingCollection``: many tables, many features, row-sparse gradients."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any, cast

import torch
from torch import nn

from torch_tpu_embedding._fused import FusedTables, TableView, fuse_key
from torch_tpu_embedding._lookup import lookup
from torch_tpu_embedding._screening import DeviceScreen
from torch_tpu_embedding._validation import check_bool
from torch_tpu_embedding.combiners import bag_gains
from torch_tpu_embedding.config import FeatureConfig, TableConfig
from torch_tpu_embedding.inputs import Bags, to_bags
from torch_tpu_embedding.table import EmbeddingTable

__all__ = ["EmbeddingCollection", "EmbeddingTable", "split_parameters"]

Path = tuple[Any, ...]


def _flatten(struct: Any, path: Path = ()) -> Iterator[tuple[Path, Any]]:
    """Leaves of a nested dict/list/tuple in TF ``nest`` order (dict keys sorted)."""
    if isinstance(struct, Mapping):
        for key in sorted(struct, key=str):
            yield from _flatten(struct[key], (*path, key))
    elif isinstance(struct, (list, tuple)):
        for i, item in enumerate(struct):
            yield from _flatten(item, (*path, i))
    else:
        yield path, struct


def _path_name(path: Path) -> str:
    return "/".join(str(p) for p in path) if path else "<root>"


def _pick(struct: Any, path: Path) -> Any:
    for key in path:
        struct = struct[key]
    return struct


def _rebuild(template: Any, values: dict[Path, Any], path: Path = ()) -> Any:
    """``template``'s structure with the leaf at ``path`` replaced by ``values[path]``."""
    if isinstance(template, Mapping):
        return {k: _rebuild(v, values, (*path, k)) for k, v in template.items()}
    if isinstance(template, (list, tuple)):
        items = [_rebuild(v, values, (*path, i)) for i, v in enumerate(template)]
        return items if isinstance(template, list) else tuple(items)
    return values[path]


def _check_structure(config: Any, given: Any, what: str, path: Path = ()) -> None:
    """``given`` must have ``config``'s structure (leaves of ``given`` may be anything)."""
    where = f" at `{_path_name(path)}`" if path else ""
    if isinstance(config, Mapping):
        if not isinstance(given, Mapping):
            raise TypeError(f"{what}{where} must be a mapping like the feature config. "
                            f"Received: {type(given).__name__}")
        missing = sorted(set(map(str, config)) - set(map(str, given)))
        unknown = sorted(set(map(str, given)) - set(map(str, config)))
        if missing or unknown:
            raise ValueError(
                f"{what}{where} do not match the feature config: missing {missing}, "
                f"unknown {unknown}."
            )
        for key in config:
            _check_structure(config[key], given[key], what, (*path, key))
    elif isinstance(config, (list, tuple)):
        if not isinstance(given, (list, tuple)) or len(given) != len(config):
            raise ValueError(
                f"{what}{where} must be a list/tuple of {len(config)} entries like the feature "
                f"config. Received: {type(given).__name__}"
                + (f" of {len(given)}" if isinstance(given, (list, tuple)) else "")
            )
        for i, (c, g) in enumerate(zip(config, given, strict=True)):
            _check_structure(c, g, what, (*path, i))


def _input_device(value: Any) -> str:
    """The device type of a feature's ids (``"cpu"`` for anything else)."""
    ids = value if isinstance(value, torch.Tensor) else getattr(value, "ids", getattr(value, "values", None))
    return ids.device.type if isinstance(ids, torch.Tensor) else "cpu"


def _device_resident(value: Any) -> bool:
    """True when a feature's ids arrived already on an XLA device (not readable without a sync)."""
    return _input_device(value) == "xla"


class EmbeddingCollection(nn.Module):
    """Many embedding tables looked up by many features, with row-sparse gradients.

    Args:
        feature_config: a :class:`FeatureConfig` or a nested ``dict``/``list``/``tuple`` of them.
            Features may share a :class:`TableConfig` object; tables are created once, in order of
            first occurrence (dict keys sorted, as TF's ``nest.flatten``). Unnamed tables are
            called ``table_<i>``.
        device: where the tables live (CPU by default; CUDA or an XLA device). Initial values are
            drawn on the CPU, so a seed gives the same tables on every device.
        fuse_tables: stack tables with the same ``embedding_dim``, ``dtype``, ``placement`` and
            ``optimizer`` override in one buffer per group (``groups``), so an optimizer step does
            one dedup, gather and scatter per group instead of per table (much faster with many
            tables, above all on XLA; docs/benchmarks.md). Values, updates and ``state_dict``
            (per table) are the same as unfused. Not for optimizers whose state spans a whole table
            (Adafactor's factored statistics) or ``clipnorm`` (a norm per table): those raise.

    Forward:
        ``forward(features, weights=None)`` takes inputs in the structure of ``feature_config``
        (any form of :mod:`torch_tpu_embedding.inputs`) and optional per-id weights in the same
        structure (``None`` leaves allowed), and returns activations in that structure: ``[B, D]``
        for combined bags, ``[B, S, D]`` for sequence features, ``output_shape + [D]`` where set.

    Gradients:
        ``backward`` gives each table a row-sparse gradient: per looked-up id, one ``[D]`` row,
        summed over features sharing the table and accumulated over backward calls until an
        optimizer from :mod:`torch_tpu_embedding.optim` consumes it or ``zero_grad`` clears it.
        No ``[V, D]`` gradient is ever made. Stock ``torch.optim`` optimizers refuse to step a
        table (they would silently not train it).

    Example::

        >>> import torch, torch_tpu_embedding as tte
        >>> movie = tte.TableConfig(num_embeddings=100, embedding_dim=4, name="movie")
        >>> ec = tte.EmbeddingCollection({
        ...     "watched": tte.FeatureConfig(movie),
        ...     "liked": tte.FeatureConfig(movie, max_sequence_length=3),
        ... })
        >>> out = ec({"watched": tte.Jagged(torch.tensor([1, 2, 7]), lengths=torch.tensor([2, 1])),
        ...           "liked": tte.Jagged(torch.tensor([4]), lengths=torch.tensor([0, 1]))})
        >>> out["watched"].shape, out["liked"].shape
        (torch.Size([2, 4]), torch.Size([2, 3, 4]))
    """

    def __init__(
        self, feature_config: Any, *, device: torch.device | str | None = None, fuse_tables: bool = False
    ) -> None:
        super().__init__()
        check_bool("fuse_tables", fuse_tables)
        flat = list(_flatten(feature_config))
        if not flat:
            raise ValueError("Argument `feature_config` must hold at least one FeatureConfig. Received: "
                             f"{feature_config!r}")
        for path, fc in flat:
            if not isinstance(fc, FeatureConfig):
                raise TypeError(
                    f"Argument `feature_config` must hold only FeatureConfig leaves; found "
                    f"{type(fc).__name__} at `{_path_name(path)}`."
                )
        table_names: dict[int, str] = {}  # id(TableConfig) -> name
        configs: dict[int, TableConfig] = {}
        for _, fc in flat:
            if id(fc.table) not in configs:
                configs[id(fc.table)] = fc.table
                i = len(table_names)
                table_names[id(fc.table)] = fc.table.name if fc.table.name is not None else f"table_{i}"
        names = list(table_names.values())
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(
                f"Tables must have a unique name. Multiple tables with name {dupes[0]!r} found."
            )
        self._config = feature_config
        self._features: list[tuple[Path, str, FeatureConfig, str]] = [
            (path, fc.name or _path_name(path), fc, table_names[id(fc.table)]) for path, fc in flat
        ]
        feature_names = [f[1] for f in self._features]
        dupe_features = sorted({n for n in feature_names if feature_names.count(n) > 1})
        if dupe_features:
            raise ValueError(f"Features must have unique names. Duplicated: {dupe_features}")
        self._screen = DeviceScreen()  # device-side counts of bad ids and weights, see check_ids()
        tables: dict[str, nn.Module] = {
            table_names[key]: EmbeddingTable(cfg, table_names[key]) for key, cfg in configs.items()
        }
        #: fused table groups (``fuse_tables=True``): group name → :class:`FusedTables`
        self.groups = nn.ModuleDict()
        #: table name → (the module holding its rows, its first row there)
        self._located = {n: (cast(EmbeddingTable, t), 0) for n, t in tables.items()}
        if fuse_tables:
            tables = self._fuse(tables)
        self.tables = nn.ModuleDict(tables)
        self._register_state_dict_hook(_split_fused_weights)  # type: ignore[no-untyped-call]
        self.register_load_state_dict_pre_hook(_join_fused_weights)  # type: ignore[no-untyped-call]
        if device is not None:
            self.to(device)

    def _fuse(self, tables: dict[str, nn.Module]) -> dict[str, nn.Module]:
        """Stack tables with equal :func:`fuse_key` (two or more) into :class:`FusedTables`."""
        by_key: dict[tuple[Any, ...], list[EmbeddingTable]] = {}
        for t in tables.values():
            table = cast(EmbeddingTable, t)
            by_key.setdefault(fuse_key(table.config), []).append(table)
        out: dict[str, nn.Module] = dict(tables)
        for same in by_key.values():
            if len(same) < 2:
                continue
            i = len(self.groups)
            name = f"fused_{i}"
            while name in tables:  # a table may be called fused_<i> already
                name = "_" + name
            group = FusedTables(same, name)
            self.groups[name] = group
            for (tname, off, _), t in zip(group.members(), same, strict=True):
                out[tname] = TableView(t.config, tname, group, off)
                self._located[tname] = (group, off)
        return out

    # ------------------------------------------------------------------ accessors
    @property
    def embedding_tables(self) -> dict[str, torch.Tensor]:
        """Table name → weight ``[num_embeddings, embedding_dim]`` (the parameter; for a fused table,
        a view of its group's parameter)."""
        return {name: t.weight for name, t in self.tables.items()}  # type: ignore[misc]

    def physical_tables(self) -> dict[str, EmbeddingTable]:
        """The modules that own table parameters: unfused tables by name, then fused groups."""
        out = {n: t for n, t in self.tables.items() if isinstance(t, EmbeddingTable)}
        out.update({n: cast(EmbeddingTable, g) for n, g in self.groups.items()})
        return out

    def fused_members(self) -> dict[str, tuple[tuple[str, int, int], ...]]:
        """Fused group name → its tables as ``(name, first row, rows)``."""
        return {n: cast(FusedTables, g).members() for n, g in self.groups.items()}

    @property
    def table_configs(self) -> dict[str, TableConfig]:
        return {name: t.config for name, t in self.tables.items()}  # type: ignore[misc]

    @property
    def feature_names(self) -> list[str]:
        return [f[1] for f in self._features]

    def feature_tables(self) -> dict[str, str]:
        """Feature name → the name of the table it is looked up in."""
        return {f[1]: f[3] for f in self._features}

    def row_grads(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Pending row-sparse gradients: table name → ``(ids [N], rows [N, D])``.

        Raw accumulation: duplicate ids are not summed and padding entries carry the sentinel id
        ``weight.shape[0]`` with zero rows. Tables with no pending gradient are omitted. A fused
        group reports under its group name, with ids of the group's rows.
        """
        out = {}
        for name, t in self.physical_tables().items():
            if t.row_grad:
                out[name] = t.row_grad.collect()
        return out

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear pending row-sparse table gradients and the ``.grad`` of any other parameter."""
        super().zero_grad(set_to_none)
        for t in self.physical_tables().values():
            t.row_grad.clear()

    # ------------------------------------------------------------------ forward
    def forward(self, features: Any, weights: Any = None) -> Any:
        _check_structure(self._config, features, "Inputs `features`")
        if weights is not None:
            _check_structure(self._config, weights, "Argument `weights`")
        # Features looked up in the same physical table with the same bag width and combiner are
        # looked up together: one gather and one backward node per such batch, not per feature. Host
        # inputs for a device table are normalised and batched on the host and then moved in one
        # transfer per batch (TorchRec's KJT and TBE do the same).
        batches: dict[tuple[int, int, str, bool], list[tuple[Path, Bags]]] = {}
        tables: dict[int, EmbeddingTable] = {}
        host = torch.device("cpu")
        for path, fname, fc, tname in self._features:
            table, offset = self._located[tname]
            weight = table.weight
            value = _pick(features, path)
            resident = weight.device.type == "cpu" or _input_device(value) != "cpu"
            bags = to_bags(
                fname,
                fc,
                value,
                None if weights is None else _pick(weights, path),
                sentinel=weight.shape[0],
                device=weight.device if resident else host,
                dtype=weight.dtype,
                static=weight.device.type == "xla",
            )
            if _device_resident(value):  # host inputs were checked in to_bags
                ids, valid = self._screen_device_ids(
                    fname, fc.table.num_embeddings, bags.ids, bags.valid, weight.shape[0], bags.weights
                )
                bags = dataclasses.replace(bags, ids=ids, valid=valid)
            if offset:  # a fused table's rows start at `offset` of the group; padding stays the sentinel
                bags = dataclasses.replace(bags, ids=torch.where(bags.valid, bags.ids + offset, bags.ids))
            combiner = fc.table.combiner if bags.combine else "sum"
            tables[id(table)] = table
            batches.setdefault((id(table), bags.ids.shape[1], combiner, resident), []).append((path, bags))
        outputs: dict[Path, torch.Tensor] = {}
        for (key, _, combiner, resident), items in batches.items():
            table = tables[key]
            dtype, dim, device = table.weight.dtype, table.weight.shape[1], table.weight.device
            if len(items) == 1:
                ids, valid, w = items[0][1].ids, items[0][1].valid, items[0][1].weights
            else:
                ids = torch.cat([b.ids for _, b in items])
                valid = torch.cat([b.valid for _, b in items])
                w = None
                if any(b.weights is not None for _, b in items):
                    w = torch.cat([b.valid.to(dtype) if b.weights is None else b.weights for _, b in items])
            if not resident:  # one transfer of the batch's ids (and weights); padding is the sentinel
                ids = ids.to(device)
                valid = ids != table.weight.shape[0]
                w = None if w is None else w.to(device)
            out = lookup(table.weight, ids, bag_gains(valid, w, combiner, dtype), table.row_grad)
            pieces = torch.split(out, [b.ids.shape[0] for _, b in items]) if len(items) > 1 else (out,)
            for (path, b), piece in zip(items, pieces, strict=True):
                outputs[path] = piece.reshape(*b.out_shape, dim)
        return _rebuild(self._config, outputs)

    # ------------------------------------------------------------------ device-side id validation
    def _screen_device_ids(
        self, feature: str, vocab: int, ids: torch.Tensor, valid: torch.Tensor, sentinel: int,
        weights: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """XLA-resident ids and weights: bad ones counted on the device and dropped (:class:`DeviceScreen`)."""
        return self._screen.screen(feature, vocab, ids, valid, sentinel, weights)

    def invalid_id_counts(self) -> dict[str, int]:
        """Out-of-range ids seen on the device per feature since the last :meth:`check_ids` (syncs XLA)."""
        return self._screen.counts(self._screen.invalid_ids)

    def nonfinite_weight_counts(self) -> dict[str, int]:
        """NaN/inf per-id weights seen on the device per feature since the last :meth:`check_ids` (syncs XLA)."""
        return self._screen.counts(self._screen.nonfinite_weights)

    def check_ids(self) -> None:
        """Raise if any XLA-resident input held an out-of-range id or a NaN/inf per-id weight since the
        last call, then reset.

        Host inputs (the usual case) are checked during input normalisation and raise at once. Ids and
        weights built on the device are screened on the device instead: such an id is dropped (it
        trains no row) and counted; call this at a sync point (e.g. every N steps, or with the loss
        logging) to turn the counts into an error.
        """
        self._screen.check({fname: fc.table.num_embeddings for _, fname, fc, _ in self._features})

    def extra_repr(self) -> str:
        by_table: dict[str, list[str]] = {}
        for _, fname, fc, tname in self._features:
            tag = fname + (f"[seq {fc.max_sequence_length}]" if fc.is_sequence else "")
            by_table.setdefault(tname, []).append(tag)
        lines = [f"features: {len(self._features)}, tables: {len(self.tables)}"]
        for tname, feats in by_table.items():
            lines.append(f"{tname} ← {', '.join(feats)}")
        return "\n".join(lines)


def split_parameters(
    module: nn.Module,
) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """Split ``module``'s parameters into ``(embedding_tables, dense_parameters)``.

    For users who want one optimizer for the tables (from :mod:`torch_tpu_embedding.optim`) and
    any ``torch.optim`` optimizer for the rest::

        >>> tables, dense = tte.split_parameters(model)
        >>> opt_tables = tte.optim.Adagrad(tables, lr=0.1)
        >>> opt_dense = torch.optim.AdamW(dense, lr=1e-3)
    """
    tables: list[nn.Parameter] = []
    dense: list[nn.Parameter] = []
    seen: set[int] = set()
    for sub in module.modules():
        if isinstance(sub, EmbeddingTable):  # fused groups included
            tables.append(sub.weight)
            seen.add(id(sub.weight))
    for p in module.parameters():
        if id(p) not in seen:
            dense.append(p)
    return tables, dense


def _split_fused_weights(module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
    """``state_dict`` hook: each fused group's weight becomes its tables' ``tables.<name>.weight``
    (in table order, as an unfused collection's)."""
    collection = cast(EmbeddingCollection, module)
    fused = collection.fused_members()
    if not fused:
        return
    mine = {k: state_dict.pop(k) for k in [k for k in state_dict if k.startswith(prefix)]}
    for gname, members in fused.items():
        value = mine.pop(prefix + f"groups.{gname}.weight", None)
        if value is not None:
            mine.update({prefix + f"tables.{t}.weight": value[off : off + n] for t, off, n in members})
    order = [prefix + f"tables.{t}.weight" for t in collection.tables]
    state_dict.update({k: mine.pop(k) for k in order if k in mine})
    state_dict.update(mine)


def _join_fused_weights(
    module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any, strict: bool,
    missing_keys: list[str], unexpected_keys: list[str], error_msgs: list[str],
) -> None:
    """Load pre-hook: per-table weights of fused tables stacked into their group's weight.

    Tables absent from ``state_dict`` keep their values (and are reported missing when ``strict``);
    a state_dict that holds the group's weight itself (a distributed checkpoint) loads as is.
    """
    for gname, members in cast(EmbeddingCollection, module).fused_members().items():
        gkey = prefix + f"groups.{gname}.weight"
        keys = [prefix + f"tables.{tname}.weight" for tname, _, _ in members]
        if gkey in state_dict or not any(k in state_dict for k in keys):
            if gkey not in state_dict and strict:
                missing_keys.extend(keys)
                state_dict[gkey] = _current_rows(module, gname)
            continue
        device = next(state_dict[k].device for k in keys if k in state_dict)
        pieces = []
        for key, (_, off, n) in zip(keys, members, strict=True):
            value = state_dict.pop(key, None)
            current = _current_rows(module, gname)[off : off + n]
            if value is None:
                if strict:
                    missing_keys.append(key)
                value = current
            elif tuple(value.shape) != tuple(current.shape):
                error_msgs.append(
                    f"size mismatch for {key}: copying a param with shape {tuple(value.shape)} from "
                    f"checkpoint, the shape in current model is {tuple(current.shape)}."
                )
                value = current
            pieces.append(value.detach().to(device=device))
        state_dict[gkey] = torch.cat(pieces)


def _current_rows(module: nn.Module, gname: str) -> torch.Tensor:
    group = cast(FusedTables, cast(EmbeddingCollection, module).groups[gname])
    return group.weight.detach()[: group.config.num_embeddings]
