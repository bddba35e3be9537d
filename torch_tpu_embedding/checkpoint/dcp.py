"""Reading ``tte.checkpoint.save_distributed`` directories (``torch.distributed.checkpoint`` plus ``tte_meta.pt``)
on the host: their metadata, their tensors, and their logical form (one :func:`tte.checkpoint.save` payload).

Shared by ``tte.checkpoint.load_distributed`` / ``convert_distributed`` and by
``tte.distributed.load_sharded``, which loads such a directory into a model sharded over a process group.
"""

from __future__ import annotations

import importlib
import io
import os
from typing import Any

import torch

from torch_tpu_embedding._rows.placement import device_backend
from torch_tpu_embedding._rows.row_order import layout_of, to_logical
from torch_tpu_embedding.checkpoint.files import dcp_quiet, dcp_reader, read_dcp_metadata, through
from torch_tpu_embedding.checkpoint.host import split_stacked_entries
from torch_tpu_embedding.checkpoint.publish import read_errors
from torch_tpu_embedding.optim._core.step_values import COUNTERS

__all__ = ["FORMAT", "META", "dcp", "logical_payload", "present", "read_meta", "read_tensors", "read_torch_dcp",
           "saved_groups", "saved_sizes", "uses_xla", "xla_planner"]

#: written into every checkpoint; ``tte.checkpoint.load`` refuses other formats
FORMAT = "torch_tpu_embedding.checkpoint/1"
#: the metadata file of a ``save_distributed`` directory
META = "tte_meta.pt"


def dcp() -> Any:
    """``torch.distributed.checkpoint`` (untyped here: its names are not re-exported for mypy)."""
    return importlib.import_module("torch.distributed.checkpoint")


def xla_planner(kind: str) -> Any:
    """torch_xla's DCP planner ``kind`` for XLA tensors (through the ``"xla"`` device backend)."""
    return device_backend("xla").dcp_planner(kind)


def uses_xla(tensors: dict[str, torch.Tensor]) -> bool:
    return any(t.device.type == "xla" for t in tensors.values())


def read_meta(path: str) -> Any:
    """``tte_meta.pt`` of a distributed checkpoint, read with ``weights_only=True`` (no pickled code)."""
    file = os.path.join(path, META)
    if not os.path.exists(file):
        raise FileNotFoundError(f"No distributed checkpoint at {path} (no {META})")
    try:
        meta = torch.load(through(file), map_location="cpu", weights_only=True)
    except Exception as e:  # weights-only refusals and damaged files raise several types
        raise ValueError(f"{file} is not a readable checkpoint file (refused by weights_only loading, "
                         f"truncated or corrupt): {str(e).splitlines()[0]}") from e
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise ValueError(f"{file} is not a torch_tpu_embedding distributed checkpoint ({FORMAT}).")
    rows = meta.get("rows")
    if not isinstance(rows, dict) or not all(n is None or (isinstance(n, int) and n >= 0) for n in rows.values()) \
            or not isinstance(meta.get("members", {}), dict) or "optimizer" not in meta:
        raise ValueError(f"{file} is damaged: 'rows' must map each tensor to its logical rows (an int or None), "
                         "with 'members' and 'optimizer' beside it.")
    named = meta.get("aliases", {})
    if not isinstance(named, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in named.items()):
        raise ValueError(f"{file} is damaged: 'aliases' must map state_dict keys to state_dict keys.")
    return meta


def present(path: str) -> None:
    if not os.path.isdir(path) or not os.path.exists(os.path.join(path, META)):
        raise FileNotFoundError(f"No distributed checkpoint at {path} (no {META})")


def read_tensors(path: str, dest: dict[str, torch.Tensor], local: bool = False) -> None:
    """Read ``dest``'s tensors from the distributed checkpoint ``path`` in place: with the other ranks of the
    default process group (``torch.distributed.checkpoint``'s collectives: every rank gets any rank's read
    error), or ``local``: this process alone (host tensors read whole; no collective)."""
    api = dcp()
    planner = xla_planner("SPMDLoadPlanner") if uses_xla(dest) else None
    with dcp_quiet(), read_errors(path):
        api.load(dest, storage_reader=dcp_reader(path), planner=planner, no_dist=local)


def logical_payload(target: str, meta: Any) -> dict[str, Any]:
    """A distributed checkpoint read on the host into a :func:`save` payload: logical rows, per table."""
    md = read_dcp_metadata(target)
    host: dict[str, torch.Tensor] = {
        k: torch.empty(v.size, dtype=v.properties.dtype)
        for k, v in md.state_dict_metadata.items()
        if hasattr(v, "size")
    }
    # Each process reads every tensor whole: no collective, so a process whose own checks failed before it
    # leaves none waiting here (the loads agree once they have checked, checkpoint/agreement.py).
    read_tensors(target, host, local=True)

    def logical(k: str) -> torch.Tensor:
        n = meta["rows"].get(k)
        order, slot_k = layout_of(meta.get("layouts", {}).get(k))
        return host[k] if n is None else to_logical(host[k], n, order, slot_k).clone()

    members = meta.get("members", {})
    model_sd: dict[str, torch.Tensor] = {}
    for k in host:
        if k.startswith("model/") and k in members:  # a stacked group: its tables' weights
            prefix = k[len("model/"):].rsplit("groups.", 1)[0]
            value = logical(k)
            model_sd.update({f"{prefix}tables.{t}.weight": value[off : off + n] for t, off, n in members[k]})
        elif k.startswith("model/"):
            model_sd[k[len("model/"):]] = logical(k)
    optimizer_sd = None
    if meta["optimizer"] is not None:
        state: dict[str, dict[str, torch.Tensor]] = {}
        for k in host:
            if k.startswith("optim/"):
                key, slot = k[len("optim/"):].rsplit("/", 1)
                state.setdefault(key, {})[slot] = logical(k)
        for key, bufs in meta["optimizer"]["acc"].items():
            state.setdefault(key, {}).update(bufs)
        split_stacked_entries(state, members, meta["rows"], prefix="optim/")
        optimizer_sd = {"state": state, "param_groups": meta["optimizer"]["param_groups"],
                        **{k: v for k, v in meta["optimizer"].items() if k in COUNTERS}}
    # The modules' extra states (checkpoints written before 2026-12-02: none saved), and the keys that name what
    # another names, stored once (``aliases``; checkpoints written before 2026-12-03: none recorded)
    model_sd.update(meta.get("extra_state") or {})
    model_sd.update({alias: model_sd[k] for alias, k in (meta.get("aliases") or {}).items() if k in model_sd})
    return {"format": FORMAT, "model": model_sd, "optimizer": optimizer_sd, "extra": meta.get("extra")}


def read_torch_dcp(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Everything a ``torch.distributed.checkpoint`` directory holds, read into this process as the nested
    dict it was saved from (what ``dcp.save`` was given: e.g. ``{"model": ..., "optim": ...}``), DTensors as
    whole tensors.

    torch's ``dcp.load`` reads only the keys of the dict it fills, so a checkpoint of one model's layout
    cannot fill the template of another's: the optimizer state of tables saved one per parameter
    (``stack_tables=False``, or sharded over processes by ``tte.distributed.shard``) is keyed
    ``ec.tables.<name>.weight``, which the default, stacked collection's template does not have (``dcp.load``
    raises ``Missing key in checkpoint state_dict``). Read the whole checkpoint with this instead and load
    each part where it goes; an optimizer of this package maps per-table state into a stacked group and
    back (pending accumulation windows included)::

        saved = tte.checkpoint.read_torch_dcp(directory)
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optim"])

    One process reads everything: for a model that holds its whole tables. The metadata is read with an
    allow-list and every non-tensor entry with ``torch.load(weights_only=True)`` (torch's own ``dcp.load``
    unpickles them with ``weights_only=False``).

    Raises:
        FileNotFoundError: no DCP checkpoint at ``path``.
        CheckpointCorruptError: a file of it cannot be read.
    """
    path = os.fspath(path)
    if not os.path.exists(os.path.join(path, ".metadata")):
        raise FileNotFoundError(f"No torch.distributed.checkpoint directory at {path} (no .metadata)")
    md = read_dcp_metadata(path, non_tensors=True)
    flat: dict[str, Any] = {k: torch.empty(v.size, dtype=v.properties.dtype) if hasattr(v, "size") else None
                            for k, v in md.state_dict_metadata.items()}
    with dcp_quiet(), read_errors(path):
        dcp().load(flat, storage_reader=dcp_reader(path, non_tensors=True), planner=_safe_planner(), no_dist=True)
    mapping = md.planner_data if isinstance(md.planner_data, dict) else {}
    out: dict[str, Any] = {}
    for k, v in flat.items():
        _set_path(out, tuple(mapping.get(k, (k,))), v)
    return out


def saved_groups(members: Any) -> Any:
    """A model's stacked groups as recorded in a distributed checkpoint: ``{key: [(table, first row, rows)]}``."""
    if not isinstance(members, dict):
        return members
    return {k: [tuple(m) for m in v] for k, v in members.items() if str(k).startswith("model/")}


def saved_sizes(path: str) -> tuple[dict[str, torch.Size], dict[str, torch.dtype]]:
    """The shape and dtype of every tensor of the ``torch.distributed.checkpoint`` directory ``path``."""
    md = read_dcp_metadata(path)  # allow-listed unpickling: a crafted .metadata runs no code
    entries = [(k, v) for k, v in md.state_dict_metadata.items() if hasattr(v, "size")]
    return {k: v.size for k, v in entries}, {k: v.properties.dtype for k, v in entries}


def _safe_planner() -> Any:
    """torch's default load planner on flat keys, non-tensor entries read with ``weights_only=True``."""
    base = importlib.import_module("torch.distributed.checkpoint").DefaultLoadPlanner

    class _WeightsOnly(base):  # type: ignore[misc, valid-type]
        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            # into the dict given to dcp.load (self.state_dict is a copy of it)
            self.original_state_dict[read_item.dest_index.fqn] = torch.load(value, weights_only=True)

    return _WeightsOnly(flatten_state_dict=False)


def _set_path(root: dict[str, Any], path: tuple[Any, ...], value: Any) -> None:
    """``root[path[0]][path[1]]... = value``, making the dicts (string keys) and lists (int keys) on the way,
    as DCP's flattening recorded them."""
    cur: Any = root
    for key, nxt in zip(path[:-1], path[1:], strict=True):
        if isinstance(cur, list):
            cur.extend([None] * (key + 1 - len(cur)))
            if cur[key] is None:
                cur[key] = [] if isinstance(nxt, int) else {}
            cur = cur[key]
        else:
            cur = cur.setdefault(key, [] if isinstance(nxt, int) else {})
    if isinstance(cur, list):
        cur.extend([None] * (path[-1] + 1 - len(cur)))
    cur[path[-1]] = value
