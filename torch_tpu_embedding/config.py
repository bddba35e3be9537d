"""Table and feature configuration: frozen, validated dataclasses.

A :class:`TableConfig` describes one embedding table (``[num_embeddings, embedding_dim]``); a
:class:`FeatureConfig` describes one input feature looked up in a table. Several features may share
one ``TableConfig`` object (sharing is by object identity). The configs are immutable and
:class:`~torch_tpu_embedding.EmbeddingCollection` never mutates them (TF's ``TPUEmbedding`` fills in
``optimizer`` and ``name`` on the user's objects; we do not).

Example::

    >>> import torch_tpu_embedding as tte
    >>> user = tte.TableConfig(num_embeddings=1000, embedding_dim=16, name="user")
    >>> tte.FeatureConfig(user, name="user_id")
    FeatureConfig(table=TableConfig(num_embeddings=1000, embedding_dim=16, name='user', ...), ...)
"""

from __future__ import annotations

import dataclasses
import math
import operator
from collections.abc import Callable, Sequence
from typing import Any, Union

import torch

from torch_tpu_embedding._util.registry import OPTIMIZER_NAMES
from torch_tpu_embedding._util.validation import arg_error, check_int

__all__ = [
    "COMBINERS",
    "DEFAULT_REPLICATE_BELOW_BYTES",
    "OPTIMIZER_NAMES",
    "PLACEMENTS",
    "FeatureConfig",
    "Initializer",
    "TableConfig",
    "auto_placement",
    "default_initializer",
    "default_truncation",
    "table_bytes",
    "to_truncated_normal_",
    "truncated_uniform_",
]

COMBINERS = ("mean", "sum", "sqrtn")
#: Table layouts on a device mesh (see ``TableConfig.placement`` and docs/sharding.md).
PLACEMENTS = ("auto", "row", "column", "replicated", "table")
#: ``placement="auto"`` replicates tables smaller than this (4 MiB: 16,384 rows of 64 float32).
DEFAULT_REPLICATE_BELOW_BYTES = 4 << 20
_FLOAT_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)

#: An initializer fills a ``[num_embeddings, embedding_dim]`` tensor in place (torch.nn.init style,
#: e.g. ``functools.partial(torch.nn.init.normal_, std=0.01)``) or returns a tensor of that shape, or
#: is a tensor of that shape holding pretrained values.
Initializer = Union[Callable[[torch.Tensor], Any], torch.Tensor]


def default_initializer(weight: torch.Tensor) -> torch.Tensor:
    """TF's default table initializer: truncated normal, std ``1/sqrt(dim)``, cut at ±2 std.

    Fills ``weight`` in place and returns it. TF re-draws samples outside ±2σ; this draws from the
    same distribution by the inverse of the normal CDF on a uniform draw confined to [Φ(-2), Φ(2)]
    (the method of ``torch.nn.init.trunc_normal_`` up to torch 2.9). The standard deviation is not
    variance-scaled (the truncated draw has std ≈ 0.88/sqrt(dim)).
    """
    with torch.no_grad():
        return _truncated_normal_(weight, *default_truncation(int(weight.shape[-1])))


def default_truncation(dim: int) -> tuple[float, float, float]:
    """:func:`default_initializer`'s ``(std, a, b)`` for rows of width ``dim``: ``1/sqrt(dim)``, ±2 std."""
    std = 1.0 / math.sqrt(dim)
    return std, -2 * std, 2 * std


def _truncated_normal_(weight: torch.Tensor, std: float, a: float, b: float) -> torch.Tensor:
    """Fill ``weight`` with N(0, std²) cut to [a, b], in place: no second buffer of its size.

    Written out rather than calling ``torch.nn.init.trunc_normal_``: after torch 2.9 that function
    redraws by rejection through ``torch.where`` with full-size temporaries (building a 1 GiB table
    peaked at 4.3 GiB of host memory on torch 2.13, against 1.0 here) and draws other values from the
    same seed. These are the same operations in the same order as its torch 2.9 version, so a seed
    draws the same float32 / float64 table on every torch version (16-bit tables follow each
    version's own ``uniform_`` / ``erfinv_`` kernels).

    The one random draw is ``uniform_``, which takes one value of the CPU generator per element in
    order, and the rest is element-wise: so a table's rows can also be drawn chunk by chunk, each chunk
    transformed alone (:mod:`torch_tpu_embedding.modules.deferred_init`, for tables built on the meta device).
    """
    truncated_uniform_(weight, std, a, b)
    return to_truncated_normal_(weight, std, a, b)


def _norm_cdf(x: float) -> float:
    return (1.0 + math.erf(x / math.sqrt(2.0))) / 2.0


def truncated_uniform_(
    weight: torch.Tensor, std: float, a: float, b: float, generator: torch.Generator | None = None
) -> torch.Tensor:
    """The random half of :func:`_truncated_normal_`: a uniform draw on erf's range for ``[a, b]``."""
    lo, hi = _norm_cdf(a / std), _norm_cdf(b / std)
    return weight.uniform_(2 * lo - 1, 2 * hi - 1, generator=generator)


def to_truncated_normal_(weight: torch.Tensor, std: float, a: float, b: float) -> torch.Tensor:
    """The element-wise half of :func:`_truncated_normal_`: :func:`truncated_uniform_`'s values to
    N(0, std²) cut to [a, b], in place."""
    weight.erfinv_()
    weight.mul_(std * math.sqrt(2.0))
    return weight.clamp_(min=a, max=b)  # erfinv's rounding may land a hair outside


@dataclasses.dataclass(frozen=True, eq=False)
class TableConfig:
    """One embedding table.

    Args:
        num_embeddings: vocabulary size V (TF ``vocabulary_size``), an int >= 1.
        embedding_dim: row width D (TF ``dim``), an int >= 1.
        name: unique table name; used in ``state_dict`` keys (``tables.<name>.weight``) and in
            optimizer state. ``None`` → ``"table_<i>"`` in table order. No ``.`` allowed.
        initializer: ``None`` (TF default: truncated normal, std 1/sqrt(D), cut at ±2 std), a
            callable, or a ``[V, D]`` tensor of values. The callable is called with the table's
            ``[V, D]`` host tensor (uninitialised) and either fills it in place (torch.nn.init
            style, e.g. ``functools.partial(torch.nn.init.normal_, std=0.01)``; returning it or
            ``None``) or returns a ``[V, D]`` tensor of values (TF style: what it returns is the
            table). One that does neither (returns ``None`` or its argument with the tensor's first
            and last elements unwritten) is refused with a ``ValueError`` naming the table, as is a
            returned tensor of another shape; a returned non-tensor is a ``TypeError``. A tensor given
            here is checked once, at construction, to fit ``dtype`` (finite values that would become inf,
            e.g. 7e4 in float16, raise ``ValueError``: one read of the tensor); a callable's values are
            not checked (that would take a pass over each table as it is built).
        optimizer: per-table optimizer override, a name in ``OPTIMIZER_NAMES`` or a factory such as
            ``functools.partial(tte.optim.FTRL, lr=0.1)``. ``None`` uses the optimizer's default.
        combiner: how bags of ids are reduced: ``"mean"`` (default), ``"sum"`` or ``"sqrtn"``.
        dtype: parameter dtype (float32 default; float64 for reference tests).
        placement: how :func:`torch_tpu_embedding.xla.shard` lays the table out on a device mesh:
            ``"row"`` (rows split over the devices; large tables), ``"column"`` (the embedding
            dimension split; needs ``embedding_dim`` divisible by the device count),
            ``"replicated"`` (a full copy on every device; small tables — TF's mode without the
            embedding accelerator) or ``"auto"`` (default: replicated below a size threshold,
            else row-sharded). Ignored off XLA and on one device. Over a ``torch.distributed``
            process group, :func:`torch_tpu_embedding.distributed.shard` reads it too: ``"row"``,
            ``"replicated"``, ``"auto"`` (the same rule) and ``"table"`` (the whole table on one
            process, TorchRec's table-wise; process groups only), but not ``"column"`` (SPMD only).
        max_unique_ids_per_shard: the static capacity of a row-sharded table's id exchange under
            SPMD (docs/sharding.md): how many distinct ids of one step one device may send to one
            shard (TF/keras-rs ``max_unique_ids_per_partition``; ids are deduplicated per device
            before routing, so a hot id counts once). ``None`` (default) derives it from the batch
            with headroom (``torch_tpu_embedding.routing.default_capacity``). Ids over the
            capacity are dropped from that step, counted, and reported by
            ``EmbeddingCollection.check_ids()``, which names the capacity that would have sufficed;
            the table is not updated in that step. Size it from
            ``EmbeddingCollection.largest_loads()``.

    Two ``TableConfig`` objects are two tables even when their fields are equal; share a table by
    passing the same object to several :class:`FeatureConfig` s.

    Raises:
        ValueError: for any argument that breaks the rules above.
    """

    num_embeddings: int
    embedding_dim: int
    name: str | None = None
    initializer: Initializer | None = None
    optimizer: Any = None
    combiner: str = "mean"
    dtype: torch.dtype = torch.float32
    placement: str = "auto"
    max_unique_ids_per_shard: int | None = None

    def __post_init__(self) -> None:
        try:
            self._check()
        except ValueError as e:  # built in a loop over many tables, the argument alone does not say which table
            raise ValueError(f"{e} (in the TableConfig {_label(self.name)})") from None

    def _check(self) -> None:
        check_int("num_embeddings", self.num_embeddings, minimum=1)
        check_int("embedding_dim", self.embedding_dim, minimum=1)
        if self.name is not None and (
            not isinstance(self.name, str) or not self.name or "." in self.name
        ):
            raise arg_error("name", "must be a non-empty str without '.' (or None)", self.name)
        init = self.initializer
        if isinstance(init, torch.Tensor):
            if tuple(init.shape) != (self.num_embeddings, self.embedding_dim):
                raise arg_error(
                    "initializer",
                    f"must have shape ({self.num_embeddings}, {self.embedding_dim}) when it is "
                    "a tensor",
                    tuple(init.shape),
                )
            if init.is_meta or init.layout != torch.strided or init.is_complex():
                # (else the table's build failed inside torch: "Cannot copy out of meta tensor; no data!")
                raise arg_error(
                    "initializer",
                    "must hold real values when it is a tensor: a dense (strided) tensor, not complex, not on the "
                    "meta device (pass the pretrained values, e.g. .to_dense() or loaded from their file)",
                    f"{init.dtype} {init.layout} tensor on {init.device}",
                )
        elif init is not None and not callable(init):
            raise arg_error("initializer", "must be a callable, a tensor or None", init)
        if not isinstance(self.combiner, str):
            raise arg_error("combiner", f"must be a str in {COMBINERS}", self.combiner)
        if self.combiner not in COMBINERS:
            raise arg_error("combiner", f"must be in {COMBINERS}", self.combiner)
        opt = self.optimizer
        names = OPTIMIZER_NAMES
        if isinstance(opt, str):
            if opt not in names:
                raise arg_error("optimizer", f"must be one of {names} when a str", opt)
        elif opt is not None and not callable(opt):
            raise arg_error("optimizer", f"must be None, a name in {names} or a factory", opt)
        if self.dtype not in _FLOAT_DTYPES:
            raise arg_error("dtype", f"must be one of {_FLOAT_DTYPES}", self.dtype)
        if self.placement not in PLACEMENTS:
            raise arg_error("placement", f"must be one of {PLACEMENTS}", self.placement)
        if self.max_unique_ids_per_shard is not None:
            check_int("max_unique_ids_per_shard", self.max_unique_ids_per_shard, minimum=1)
        if isinstance(init, torch.Tensor):
            _check_fits(init, self.dtype)

    def __repr__(self) -> str:
        init = self.initializer
        init_repr = (
            "None"
            if init is None
            else f"tensor{tuple(init.shape)}"
            if isinstance(init, torch.Tensor)
            else getattr(init, "__name__", repr(init))
        )
        return (
            f"TableConfig(num_embeddings={self.num_embeddings}, embedding_dim={self.embedding_dim}, "
            f"name={self.name!r}, initializer={init_repr}, optimizer={self.optimizer!r}, "
            f"combiner={self.combiner!r}, dtype={self.dtype}, placement={self.placement!r}"
            + (f", max_unique_ids_per_shard={self.max_unique_ids_per_shard}" if self.max_unique_ids_per_shard else "")
            + ")"
        )


@dataclasses.dataclass(frozen=True, eq=False)
class FeatureConfig:
    """One input feature, looked up in ``table``.

    Args:
        table: the :class:`TableConfig` to look ids up in (may be shared with other features).
        max_sequence_length: 0 (default) combines each bag into one row with the table's combiner.
            ``S > 0`` makes a sequence feature: a rank-2 bag input gives ``[B, S, D]`` with position
            ``p`` holding the row of the ``p``-th id, truncated at ``S`` and zero padded; weights are
            rejected.
        output_shape: activation shape without the trailing ``D`` (TF semantics, §2.4 of the spec):
            for bag inputs ``prod(output_shape) == B`` combines then reshapes, ``== k·B`` gives a
            sequence of length ``k`` (combiner not used, weights rejected); for dense inputs it must
            hold as many positions as the input. ``None`` derives it from the input.
        name: feature name used in error messages; ``None`` → its path in the config structure.
        max_ids_per_bag: static bag capacity ``L`` for XLA (ids per bag after padding). More ids in a
            bag raise an error, never truncate. ``None`` pads to the batch's longest bag, rounded up
            to a power of two on XLA so that few shapes (and compilations) occur.

    Raises:
        ValueError / TypeError: for any argument that breaks the rules above.
    """

    table: TableConfig
    max_sequence_length: int = 0
    output_shape: Sequence[int] | None = None
    name: str | None = None
    max_ids_per_bag: int | None = None

    def __post_init__(self) -> None:
        try:
            self._check()
        except ValueError as e:
            table = _label(self.table.name)
            raise ValueError(f"{e} (in the FeatureConfig {_label(self.name)} of table {table})") from None

    def _check(self) -> None:
        if not isinstance(self.table, TableConfig):
            raise TypeError(
                f"Argument `table` has invalid type {type(self.table).__name__}. "
                "Expected `torch_tpu_embedding.TableConfig`."
            )
        check_int("max_sequence_length", self.max_sequence_length, minimum=0)
        if self.output_shape is not None:
            dims = _dims(self.output_shape)
            if dims is None:
                raise arg_error(
                    "output_shape", "must be a sequence of ints >= 1 (or None)", self.output_shape
                )
            # Stored as a tuple so the frozen config stays hashable-by-identity and immutable.
            object.__setattr__(self, "output_shape", dims)
        if self.name is not None and (not isinstance(self.name, str) or not self.name):
            raise arg_error("name", "must be a non-empty str (or None)", self.name)
        if self.max_ids_per_bag is not None:
            check_int("max_ids_per_bag", self.max_ids_per_bag, minimum=1)

    @property
    def is_sequence(self) -> bool:
        return self.max_sequence_length > 0

    def __repr__(self) -> str:
        return (
            f"FeatureConfig(table={self.table!r}, max_sequence_length={self.max_sequence_length}, "
            f"output_shape={self.output_shape}, name={self.name!r}, "
            f"max_ids_per_bag={self.max_ids_per_bag})"
        )


def _check_fits(values: torch.Tensor, dtype: torch.dtype) -> None:
    """A tensor initializer's finite values must stay finite in the table's ``dtype`` (``.to(float16)`` turns
    70000.0 into inf, silently). One read of the tensor (``aminmax``), skipped where ``dtype`` holds its
    dtype's whole range: a float32 tensor for a float32 table is not read."""
    if values.dtype == torch.bool or values.numel() == 0:
        return
    info = torch.finfo(values.dtype) if values.dtype.is_floating_point else torch.iinfo(values.dtype)
    if float(info.max) <= torch.finfo(dtype).max:
        return
    lo, hi = torch.aminmax(values.detach())
    if bool(lo.isnan() | hi.isnan()):  # aminmax propagates NaN: the extremes of the other values
        rest = values.detach()[~values.detach().isnan()]
        if rest.numel() == 0:
            return
        lo, hi = torch.aminmax(rest)
    extremes = torch.stack([lo, hi]).cpu()
    if bool((extremes.to(dtype).isinf() & extremes.isfinite()).any()):
        largest = max(extremes.tolist(), key=abs)
        raise ValueError(
            f"Argument `initializer` must hold values that the table's dtype {dtype} can represent (its largest "
            f"finite value is {torch.finfo(dtype).max:g}; larger ones become inf): scale the values, or give the "
            f"table a wider dtype. Received: a {values.dtype} tensor whose largest value is {largest!r}"
        )


def _label(name: Any) -> str:
    """A config's ``name`` for an error message: quoted, or ``'without a name'`` when it is not a usable one."""
    return repr(name) if isinstance(name, str) and name else "without a name"


def _dims(shape: Any) -> tuple[int, ...] | None:
    """``shape``'s sizes as Python ints, or ``None`` when it is not a sequence of integers >= 1. Integers
    as TF's ``TensorShape`` takes them, numpy's too (``np.prod`` and ``array.shape`` give those, as does a
    numpy array of sizes); never a bool (``True`` is not a size), a float or a str."""
    if isinstance(shape, (str, bytes)):
        return None
    try:
        items = list(shape)
    except TypeError:
        return None
    dims = []
    for s in items:
        if isinstance(s, bool):
            return None
        try:
            d = operator.index(s)  # numpy's ints have __index__; floats and numpy's bools do not
        except TypeError:
            return None
        if d < 1:
            return None
        dims.append(d)
    return tuple(dims)


def table_bytes(config: TableConfig) -> int:
    """The bytes of ``config``'s whole weight."""
    return config.num_embeddings * config.embedding_dim * torch.empty((), dtype=config.dtype).element_size()


def auto_placement(config: TableConfig, num_shards: int, replicate_below_bytes: int) -> str:
    """What ``placement="auto"`` means over ``num_shards`` devices or processes, the same rule under torch_xla
    SPMD and over a process group: replicated when there is one shard or the table is smaller than
    ``replicate_below_bytes``, else ``"row"``."""
    return "replicated" if num_shards == 1 or table_bytes(config) < replicate_below_bytes else "row"
