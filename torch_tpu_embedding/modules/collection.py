"""``EmbeddingCollection``: many tables, many features, row-sparse gradients."""

from __future__ import annotations

import dataclasses
import warnings
from contextlib import nullcontext
from typing import Any, cast

import torch
from torch import nn

from torch_tpu_embedding._rows.placement import lookup_failed, lookup_starts
from torch_tpu_embedding._rows.tables import retire_table
from torch_tpu_embedding._util.nest import Path, check_structure, flatten, rebuild
from torch_tpu_embedding._util.validation import check_device
from torch_tpu_embedding.config import PLACEMENTS, TableConfig
from torch_tpu_embedding.modules.ahead import AheadLookups
from torch_tpu_embedding.modules.keyed import is_keyed, keyed_inputs
from torch_tpu_embedding.modules.lookup_batch import id_shapes, side_by_side
from torch_tpu_embedding.modules.naming import name_features
from torch_tpu_embedding.modules.plan import plan_lookups
from torch_tpu_embedding.modules.prepared import PreparedFeatures
from torch_tpu_embedding.modules.screening import DeviceScreen, overflow_problem, warn_unchecked_drops
from torch_tpu_embedding.modules.stacking import (
    StackedTables,
    TableView,
    join_stacked_weights,
    plan_groups,
    split_stacked_weights,
    stack_groups,
    stacking_argument,
)
from torch_tpu_embedding.modules.table import EmbeddingTable

__all__ = ["EmbeddingCollection", "EmbeddingTable", "split_parameters"]
_NO_TORCHSCRIPT = ("EmbeddingCollection does not support TorchScript ({}). Use torch.export (bags as tte.Padded ids "
                   "and masks; docs/guide.md section 9) or torch.compile.")


class _Named(nn.ModuleDict):
    """A ``ModuleDict`` keyed by any table name TF accepts, ``keys``, ``items`` or ``update`` too.

    ``nn.Module.add_module`` refuses a name that is already an attribute (a method of ``ModuleDict``), so such
    a table failed construction with an internal ``KeyError``. Entries are read as items (``tables[name]``) and
    through ``_modules`` (state_dict, parameters), never as attributes, so a shadowed method is harmless. A name
    every module holds as its own value (``training``, ``_parameters``, ...) is refused by name: torch assigns
    it (``train()`` sets ``training``), which a child module of that name would break.
    """

    def add_module(self, name: str, module: nn.Module | None) -> None:
        if module is not None and name and "." not in name and name not in self._modules and hasattr(self, name):
            if name in self.__dict__:
                raise ValueError(f"A table may not be named `{name}`: every torch.nn.Module keeps a value of that "
                                 "name, which a table of that name would break (module.train() sets `training`). "
                                 "Give its TableConfig another name.")
            self._modules[name] = module
            return
        super().add_module(name, module)

    def _get_name(self) -> str:  # repr(ec) shows the container users know
        return "ModuleDict"


class EmbeddingCollection(AheadLookups, nn.Module):
    """Many embedding tables looked up by many features, with row-sparse gradients.

    Args:
        feature_config: a :class:`FeatureConfig` or a nested ``dict``/``list``/``tuple`` of them.
            Features may share a :class:`TableConfig` object; tables are created once, in order of
            first occurrence (dict keys sorted, as TF's ``nest.flatten``). Unnamed tables are
            called ``table_<i>``.
        device: where the tables live (CPU by default; CUDA or an XLA device). Initial values are
            drawn on the CPU, so a seed gives the same tables on every device. ``"meta"`` (or building
            under ``with torch.device("meta"):``) allocates no table: each records its draw, and
            :func:`torch_tpu_embedding.distributed.shard` draws each rank's rows only (docs/guide.md).
        stack_tables: stack tables with the same ``embedding_dim``, ``dtype``, ``placement`` and
            ``optimizer`` override in one buffer per group (``groups``), so an optimizer step does
            one dedup, gather and scatter per group instead of per table (much faster with many
            tables, above all on XLA; docs/benchmarks.md). On by default; ``False`` keeps one
            parameter per table. Values, updates, ``state_dict``, optimizer state and
            :meth:`row_grads` stay per table, with every optimizer and option (statistics over a
            table's rows, ``clipnorm`` and ``slot_creation_fn`` stay per table). Groups are formed
            deterministically (docs/guide.md §13) and listed by ``repr(ec)`` and ``stacked_members()``;
            :func:`torch_tpu_embedding.xla.shard` re-forms them by each table's resolved placement.

    Forward: :meth:`forward` (``ec(features, weights=None)``).

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
        self, feature_config: Any, *, device: torch.device | str | None = None, stack_tables: bool | None = None,
        fuse_tables: bool | None = None,
    ) -> None:
        """Create the tables of ``feature_config`` (each :class:`TableConfig` once) on ``device``,
        stacked in groups unless ``stack_tables=False``; the arguments are the class's (``Args``).
        ``fuse_tables``: the deprecated name of ``stack_tables`` (a ``DeprecationWarning``; not both).

        Raises ``ValueError`` / ``TypeError`` naming the feature or table: no feature, a leaf that is
        not a :class:`FeatureConfig`, two tables or two features with one name.
        """
        super().__init__()
        stack_tables = stacking_argument(stack_tables, fuse_tables)
        flat = list(flatten(feature_config))
        if not flat:
            raise ValueError("Argument `feature_config` must hold at least one FeatureConfig. Received: "
                             f"{feature_config!r}")
        configs, self._features = name_features(flat)
        self._config = feature_config
        self._screen = DeviceScreen()  # device-side counts of bad ids and weights, see check_ids()
        self._exchange_counts: dict[str, Any] = {}  # row-sharded tables: overflow and loads, see check_ids()
        # device="meta": built there (each table records its draw, tte.distributed.shard draws a rank's rows)
        where = check_device("device", device)
        with torch.device("meta") if where is not None and where.type == "meta" else nullcontext():
            tables: dict[str, nn.Module] = {name: EmbeddingTable(cfg, name) for name, cfg in configs.items()}
        self._fuse = stack_tables  # the saved name (pickled models restore it)
        self._stack(tables)
        self._register_state_dict_hook(split_stacked_weights)  # type: ignore[no-untyped-call]
        self._register_state_dict_hook(warn_unchecked_drops)  # type: ignore[no-untyped-call]
        self.register_load_state_dict_pre_hook(join_stacked_weights)  # type: ignore[no-untyped-call]
        if device is not None:
            self.to(device)

    def _stack(self, tables: dict[str, nn.Module], placements: dict[str, str] | None = None) -> None:
        """Set ``tables`` (name → its :class:`EmbeddingTable`), stacked in groups when fusing."""
        #: stacked table groups (``stack_tables=True``): group name → :class:`StackedTables`
        self.groups = nn.ModuleDict()
        #: table name → (the module holding its rows, its first row there)
        self._located = {n: (cast(EmbeddingTable, t), 0) for n, t in tables.items()}
        if self._fuse:
            tables = stack_groups(tables, self.groups, self._located, placements)
        self.tables = _Named(tables)

    def restack(self, placements: dict[str, str]) -> None:
        """Re-form the groups for each table's resolved placement (``placements``: name → placement).

        Called by :func:`torch_tpu_embedding.xla.shard` before it lays tables out, so stacking never
        changes a table's placement (``"auto"`` is decided per table). Tables keep their values; a
        group whose tables stay together is kept as is. Build the optimizer after this.
        """
        if not isinstance(placements, dict) or sorted(placements) != sorted(self.tables) or any(
                p not in PLACEMENTS or p in ("auto", "table") for p in placements.values()):
            raise ValueError("Argument `placements` must map every table name to 'row', 'column' or 'replicated'. "
                             f"Tables: {list(self.tables)}. Received: {placements!r}")
        if not self._fuse:
            return
        groups = [cast(StackedTables, g) for g in self.groups.values()]
        if plan_groups(self.table_configs, placements) == [tuple(m[0] for m in g.members()) for g in groups]:
            for g in groups:  # the same groups: each takes its tables' resolved placement
                g.config = dataclasses.replace(g.config, placement=placements[g.members()[0][0]])
            return
        tables: dict[str, nn.Module] = {}
        frozen = [n for n, t in self.tables.items()
                  if not (t.trainable if isinstance(t, TableView) else cast(EmbeddingTable, t).weight.requires_grad)]
        for n, t in self.tables.items():
            # A stacked table becomes a table of its own again, then re-stacked; so does a table laid
            # out by an earlier `shard` (rows padded or permuted): groups are joined from logical rows.
            if isinstance(t, TableView):
                t = EmbeddingTable(t.config, n, weight=t.logical_weight().to(t.group.weight.device, copy=True))
            elif isinstance(t, EmbeddingTable) and (t.row_layout is not None or t.padding_rows):
                t = EmbeddingTable(t.config, n, weight=t.logical_weight().to(t.weight.device, copy=True))
            tables[n] = t
        before = [t.weight for t in self.physical_tables().values()]
        self._stack(tables, placements)
        for n in frozen:  # frozen tables stay frozen in their new groups (or on their own)
            self.tables[n].requires_grad_(False)
        kept = {id(t.weight) for t in self.physical_tables().values()}
        for w in before:
            if id(w) not in kept:
                retire_table(w, "the tables were stacked anew for their placements (new group parameters)")

    def unstack(self, groups: list[str]) -> None:
        """Dissolve the stacked ``groups`` (names in ``self.groups``): each of their tables becomes a table of
        its own with its logical rows. Called by ``tte.distributed.shard`` for tables it shards over a
        process group (each is laid out alone). Build the optimizer after this."""
        for gname in groups:
            group = cast(StackedTables, self.groups[gname])
            logical = group.logical_weight()
            for tname, first, rows in group.members():
                t = EmbeddingTable(group.member_configs[tname], tname,
                                   weight=logical[first : first + rows].to(group.weight.device, copy=True))
                self.tables[tname] = t
                self._located[tname] = (t, 0)
            del self.groups[gname]
            retire_table(group.weight, "its tables were unstacked to be sharded over a process group")

    # ------------------------------------------------------------------ accessors
    @property
    def embedding_tables(self) -> dict[str, torch.Tensor]:
        """Table name → weight ``[num_embeddings, embedding_dim]`` (the parameter; for a stacked table,
        a view of its group's parameter)."""
        return {name: t.weight for name, t in self.tables.items()}  # type: ignore[misc]

    def physical_tables(self) -> dict[str, EmbeddingTable]:
        """The modules that own table parameters: unstacked tables by name, then stacked groups."""
        out = {n: t for n, t in self.tables.items() if isinstance(t, EmbeddingTable)}
        out.update({n: cast(EmbeddingTable, g) for n, g in self.groups.items()})
        return out

    def stacked_members(self) -> dict[str, tuple[tuple[str, int, int], ...]]:
        """Stacked group name → its tables as ``(name, first row, rows)``."""
        return {n: cast(StackedTables, g).members() for n, g in self.groups.items()}

    def fused_members(self) -> dict[str, tuple[tuple[str, int, int], ...]]:
        """Deprecated name of :meth:`stacked_members` (a ``DeprecationWarning``)."""
        warnings.warn("EmbeddingCollection.fused_members() is deprecated: use stacked_members()",
                      DeprecationWarning, stacklevel=2)
        return self.stacked_members()

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
        """Pending row-sparse gradients: table name → ``(ids [N], rows [N, D])``, in table order.

        One contract on every layout: ``ids`` are the table's own (logical) ids, 1-D; padding
        entries carry the id ``num_embeddings`` with zero rows. Raw accumulation: duplicate ids are
        not summed. Tables with no pending gradient are omitted. A stacked table reports its own
        entries of its group's gradient (none when its bags were all empty; on XLA, with static
        shapes: the group's ``N`` entries, the other tables' entries as padding). A row-sharded
        table trained through the id exchange reports what its shards received, shard after shard.
        """
        pending: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        for name, t in self.physical_tables().items():
            pending.update(t.pending_row_grads(name))
        order = [n for n in self.tables if n in pending] + [n for n in pending if n not in self.tables]
        return {n: pending[n] for n in order}

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear pending row-sparse table gradients and the ``.grad`` of any other parameter."""
        super().zero_grad(set_to_none)
        for t in self.physical_tables().values():
            t.row_grad.clear()

    # ------------------------------------------------------------------ forward
    def forward(self, features: Any, weights: Any = None, *, concat: bool = False) -> Any:
        """Look up every feature; activations in the structure of ``feature_config``.

        Args:
            features: one input per feature, in the structure of ``feature_config``, in any form of
                :mod:`torch_tpu_embedding.inputs` (ids ``[B]``, ``Jagged``, ``Padded``, sparse COO, nested); or
                TorchRec's ``KeyedJaggedTensor`` of every feature, keyed by name (any object with its
                ``keys()``, ``values()``, ``lengths()`` or ``offsets()``, ``weights_or_none()``).
            weights: per-id weights in the same structure (``None`` leaves allowed), or inside ``Jagged``/``Padded``.
            concat: one ``[B, Σ D]`` tensor instead, the features side by side in :attr:`feature_names`
                order (TorchRec's ``KeyedTensor.values()``); a stacked group is looked up straight into it.

        Returns ``[B, D]`` for a combined bag, ``[B, S, D]`` for a sequence feature, ``output_shape
        + [D]`` where set. Ids outside ``[0, num_embeddings)`` raise ``ValueError`` naming the
        feature, before any state changes. ``backward`` gives the tables row-sparse gradients
        (:meth:`row_grads`), consumed by a :mod:`torch_tpu_embedding.optim` optimizer.
        """
        prepared = features if isinstance(features, PreparedFeatures) else None
        if prepared is not None and weights is not None:
            raise TypeError("Argument `weights` must be None with prepared features: pass the weights to prepare().")
        if prepared is None:  # (tte.TrainPipeline may have prepared these very inputs)
            prepared = self._held_for(features, weights)
        if prepared is not None:
            return self._look_up_prepared(prepared, concat)
        try:
            batches = self._plan(features, weights, False)
        except Exception:  # a process group's other ranks raise at this step too (not at this rank's next)
            self._lookup_failed()
            raise
        return self._outputs(batches, concat)

    def __prepare_scriptable__(self) -> nn.Module:  # torch.jit.script's hook: refused by name
        raise RuntimeError(_NO_TORCHSCRIPT.format("torch.jit.script"))

    def _plan(self, features: Any, weights: Any, ahead: bool) -> list[Any]:
        if torch._C._get_tracing_state() is not None:  # a trace would keep the host checks and sizes of one batch
            raise RuntimeError(_NO_TORCHSCRIPT.format("torch.jit.trace"))
        if is_keyed(features):  # TorchRec's KeyedJaggedTensor (modules/keyed.py)
            if weights is not None:
                raise TypeError("Argument `weights` must be None with a KeyedJaggedTensor input: its per-id "
                                "weights are its weights_or_none().")
            features, weights = keyed_inputs(features, self._config, [f[:3] for f in self._features], ahead)
        check_structure(self._config, features, "Inputs `features`")
        if weights is not None:
            check_structure(self._config, weights, "Argument `weights`")
        return plan_lookups(self, features, weights, ahead)

    def _weights(self) -> list[torch.Tensor]:
        """The physical tables' weights in the order the forward looks them up."""
        return [self._located[t][0].weight for t in dict.fromkeys(f[3] for f in self._features)]

    def _lookup_failed(self) -> None:
        lookup_failed(self._weights(), self.training and torch.is_grad_enabled())

    def _outputs(self, batches: list[Any], concat: bool) -> Any:
        # Over a data-parallel group a training lookup meets the other ranks' first (a failed one raises here).
        lookup_starts(self._weights, self.training and torch.is_grad_enabled(), lambda: id_shapes(batches))
        if concat is not False:  # (checked to be True there)
            return side_by_side(batches, [(f[0], f[1]) for f in self._features], concat)
        outputs: dict[Path, torch.Tensor] = {}
        for batch in batches:
            outputs.update(batch.run())
        return rebuild(self._config, outputs)

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
        """Raise if ids were dropped on the device since the last call, then reset (syncs XLA).

        Two cases, both counted on the device without a sync and turned into an error here, at a
        sync point of your choosing (e.g. every N steps, or with the loss logging):

        * Out-of-range ids and NaN/inf per-id weights in XLA-resident inputs (host inputs, the usual
          case, are checked during input normalisation and raise at once): dropped from their bags,
          training no row.
        * Ids over the capacity of a row-sharded table's id exchange (``TableConfig.
          max_unique_ids_per_shard``; docs/sharding.md): dropped from that step's lookup, and the
          table was not updated in that step. The error names the table's features, the shard and
          the capacity that would have sufficed.
        """
        problems = self._screen.problems({fname: fc.table.num_embeddings for _, fname, fc, _ in self._features})
        loads = self.largest_loads()
        counted = dict(self._exchange_counts)
        self._exchange_counts.clear()
        tables_of = self.feature_tables()
        for table, c in sorted(counted.items()):
            # The features as counted: `shard` may have re-formed the group (`table`) since.
            features = list(getattr(c, "features", ())) or self._table_features(table)
            members = list(dict.fromkeys(tables_of[f] for f in features)) if table not in self.tables else None
            text = overflow_problem(features, table, members, c.per_shard()[0], loads[table]["largest_load"],
                                    loads[table]["capacity"])
            problems += [text] if text else []
        if problems:
            raise ValueError(" ".join(problems))

    def largest_loads(self) -> dict[str, dict[str, Any]]:
        """Row-sharded tables trained through the id exchange: the most distinct ids one device had for
        each shard in one step since the last :meth:`check_ids`, to size ``TableConfig.
        max_unique_ids_per_shard`` (e.g. 1.25 × the largest over a few hundred steps;
        ``torch_tpu_embedding.routing.capacity_for_load``). Syncs XLA.

        Returns ``{table: {"largest_load": [per shard], "capacity": the capacity in use}}`` (a stacked
        group reports under its group name).
        """
        return {t: {"largest_load": c.per_shard()[1], "capacity": c.capacity} for t, c in self._exchange_counts.items()}

    def _table_features(self, physical: str) -> list[str]:
        """Names of the features looked up in physical table ``physical`` (a table or a stacked group)."""
        return [f for _, f, _, t in self._features if self._located[t][0].name == physical]

    def extra_repr(self) -> str:
        by_table: dict[str, list[str]] = {}
        for _, fname, fc, tname in self._features:
            tag = fname + (f"[seq {fc.max_sequence_length}]" if fc.is_sequence else "")
            by_table.setdefault(tname, []).append(tag)
        lines = [f"features: {len(self._features)}, tables: {len(self.tables)}"]
        lines += [f"{tname} ← {', '.join(feats)}" for tname, feats in by_table.items()]
        for gname, g in self.groups.items():  # stacked tables: one line per group, in group order
            c = cast(StackedTables, g).config
            lines.append(f"group {gname} = {' + '.join(m[0] for m in cast(StackedTables, g).members())}: "
                         f"{c.num_embeddings} rows × {c.embedding_dim}, {c.dtype}, placement {c.placement!r}")
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
        if isinstance(sub, EmbeddingTable):  # stacked groups included
            tables.append(sub.weight)
            seen.add(id(sub.weight))
    for p in module.parameters():
        if id(p) not in seen:
            dense.append(p)
    return tables, dense
