"""Tables built on the meta device: each table's draw recorded, later drawn one chunk of rows at a time.

Under ``with torch.device("meta"):`` (torch's deferred-initialization idiom, as TorchRec and FSDP use it)
an :class:`~torch_tpu_embedding.EmbeddingTable` allocates no values. It records what its initializer
would have drawn instead (:func:`defer`: a :class:`DeferredDraw` holding the CPU generator's state at
that point) and moves the generator on as the draw would have, chunk by chunk with nothing kept, so
whatever is drawn after it (the next table, a dense layer, the data) sees the stream of an ordinary
build. :func:`fill` later writes any set of the table's rows — one rank's shard
(``tte.distributed.shard``) — from that state, one chunk of rows at a time: exactly the values one
process draws with the same seed, in the memory of the rows written plus one chunk.

What can be drawn so: ``initializer=None`` and :func:`~torch_tpu_embedding.default_initializer` (the
truncated normal: one ``uniform_`` draw, which takes one generator value per element in order, then an
element-wise transform; ``config._truncated_normal_``), and a tensor of values (its rows are copied).
A callable of the user's own is refused by name: the library can neither draw a row range of it nor
know how far it moves the generator. Every rank draws the whole table's uniform stream (to skip to its
rows: the CPU generator cannot jump ahead) and transforms only its own rows.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from torch_tpu_embedding.config import (
    TableConfig,
    default_initializer,
    default_truncation,
    to_truncated_normal_,
    truncated_uniform_,
)

__all__ = ["CHUNK_BYTES", "DeferredDraw", "chunk_rows", "defer", "fill"]

Tensor = torch.Tensor

#: The rows drawn at once (at least one row): the memory a deferred draw needs beyond the rows it writes.
CHUNK_BYTES = 4 << 20


@dataclasses.dataclass(frozen=True, eq=False)
class DeferredDraw:
    """What table ``name``'s initializer would have drawn when it was built on the meta device: the CPU
    generator's ``state`` just before (``None``: a tensor initializer, which draws nothing)."""

    name: str
    config: TableConfig
    state: Tensor | None


def chunk_rows(config: TableConfig) -> int:
    """Rows of ``config``'s table drawn at once: :data:`CHUNK_BYTES` of them, at least one."""
    row = config.embedding_dim * torch.empty((), dtype=config.dtype).element_size()
    return max(1, CHUNK_BYTES // row)


def defer(name: str, config: TableConfig) -> DeferredDraw:
    """Record table ``name``'s draw instead of drawing it, and move the CPU generator past it.

    Raises:
        ValueError: ``config.initializer`` is a callable other than ``default_initializer``.
    """
    init = config.initializer
    if isinstance(init, torch.Tensor):
        if init.is_meta:
            raise ValueError(
                f"Table `{name}`: its initializer is a tensor on the meta device, which holds no values (made "
                "under `with torch.device('meta'):`?). Make the tensor of values off the meta device. Received: "
                f"initializer of shape {tuple(init.shape)} on {init.device}"
            )
        return DeferredDraw(name, config, None)
    if init is not None and init is not default_initializer:
        label = getattr(init, "__name__", None) or type(init).__name__
        raise ValueError(
            f"Table `{name}`: built on the meta device, it is drawn later one row range at a time (each rank "
            f"only its rows), which only initializer=None (tte.default_initializer) or a tensor of values allow; "
            f"initializer={label} is a callable of your own, whose rows the library cannot draw by range. Give "
            f"that table initializer=None or a tensor, or build it off the meta device (tte.distributed.shard "
            f"then keeps each rank's rows of the drawn table). Received: initializer={init!r}"
        )
    state = torch.random.get_rng_state()
    # Move the generator on as drawing the table would: uniform_ takes one generator value per element, in
    # order, whatever its bounds, so chunks of the same dtype take the same values as one whole draw.
    total = config.num_embeddings * config.embedding_dim
    buf = torch.empty(min(total, chunk_rows(config) * config.embedding_dim), dtype=config.dtype, device="cpu")
    done = 0
    while done < total:
        n = min(buf.numel(), total - done)
        buf[:n].uniform_()
        done += n
    return DeferredDraw(name, config, state)


def fill(draw: DeferredDraw, out: Tensor, local_row: Callable[[Tensor], Tensor]) -> None:
    """Write into ``out`` ``[rows, D]`` the rows of ``draw``'s table that ``local_row`` places: it maps
    logical ids ``[k]`` int64 to rows of ``out`` (a row outside ``[0, rows)``: not written). The values
    are those the initializer draws for the whole table; one chunk of rows is drawn at a time."""
    config = draw.config
    v, d = config.num_embeddings, config.embedding_dim
    step = chunk_rows(config)
    source = config.initializer if draw.state is None else None
    generator = torch.Generator()
    if draw.state is not None:
        generator.set_state(draw.state)
    std, a, b = default_truncation(d)
    # Two chunk buffers for the whole draw (the uniform draw, this rank's rows of it): a new one per chunk
    # would leave the allocator's heap holding several chunks once freed.
    buf = sel = None
    if source is None:
        buf = torch.empty(min(v, step), d, dtype=config.dtype, device="cpu")
        sel = torch.empty_like(buf)
    for start in range(0, v, step):
        n = min(step, v - start)
        where = local_row(torch.arange(start, start + n, dtype=torch.int64))
        idx = ((where >= 0) & (where < out.shape[0])).nonzero().squeeze(1)
        if isinstance(source, Tensor):
            if idx.numel():
                rows = source[start : start + n].index_select(0, idx.to(source.device))
                out.index_copy_(0, where[idx].to(out.device), rows.to(device=out.device, dtype=out.dtype))
            continue
        assert buf is not None and sel is not None
        chunk = truncated_uniform_(buf[:n], std, a, b, generator=generator)
        if idx.numel():
            rows = to_truncated_normal_(torch.index_select(chunk, 0, idx, out=sel[: idx.numel()]), std, a, b)
            out.index_copy_(0, where[idx].to(out.device), rows.to(device=out.device, dtype=out.dtype))
