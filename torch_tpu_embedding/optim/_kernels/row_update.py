"""The kernel path of eager row updates (``Path.KERNEL``): one compiled kernel per optimizer configuration.

On the CPU the reference row path (``Path.ROW_CHUNKS``) gathers the weight and each slot separately, runs the
rule as a dozen element-wise torch ops over ``[U, D]`` temporaries and scatters each array back. Here the same
Python — gather → :func:`~.rule_pipeline.pipeline` (clipvalue, weight decay, the optimizer's own ``rule``, weight
clipping) → the ``skip_nonfinite`` gate → EMA → scatter — is compiled by ``torch.compile`` (inductor: C++/OpenMP
loops; Triton on CUDA, where it takes the static ids of ``Path.ROWS`` and returns the rows to write) into one
loop that reads each touched row of the weight and its slots once and writes them back once.
The rule stays the one the XLA path traces and the numpy references mirror; nothing is rewritten.

A rule with statistics over rows (Adafactor, whose ``c`` and ``r_sum`` are slots of the whole table) gets the
context the reference path makes (which rows are real, how many per member table of a stacked group), every row
in one call, and returns its whole-table slots, which :func:`update` copies: one kernel instead of some fifteen
passes over ``[U, D]``.

Shapes are dynamic (the number of touched rows, the table size), so a configuration compiles once
(plus at most one more for a step with a single touched row, which dynamic shapes specialise). The learning
rate and step count are tensors, and so is every number of the group other than 0 and 1 (``momentum`` and
``betas``, which torch's ``OneCycleLR`` and ``CyclicLR`` rewrite at every step, a weight decay, an epsilon, FTRL's
strengths, clipping limits, ...: :func:`_form`), so a schedule of them does not recompile; flags, ``None``, 0 and
1 (on which a rule may branch: a decay that is off, FTRL's ``l1 = 0``) and the exponents (:data:`_CONSTANT`) are
constants of the kernel, and a new one compiles a new kernel. inductor keeps compiled
kernels on disk (``TORCHINDUCTOR_CACHE_DIR``, by default ``/tmp/torchinductor_<user>``), so a new
process with the same configuration reuses them.

The duplicate sum stays outside the kernel but runs a range of rows at a time: the ids are sorted
once (:func:`.row_sums.row_sums`), and for each range of about ``chunk_rows()`` distinct ids the
summed rows are made (one ``embedding_bag`` over the factored gradient) and the kernel runs on them, so
the summed rows and the kernel's own ``[rows, D]`` temporaries stay in cache instead of making passes
over ``[U, D]`` arrays in memory (RowWiseAdagrad at 20 ids per bag, 4 tables of 1,000,000 × 64: about
314,000 distinct rows, 80 MB per such array).

When a kernel is built (the optimizer's call count, the table's size: :func:`.kernel_policy.policy`), the
switch that turns the path off (``TTE_UPDATE_KERNEL=0``) and the one warning when a kernel cannot be compiled are
:mod:`.kernel_policy`'s: if compiling fails (no C++ compiler, say), the update falls back to the reference path.
"""

from __future__ import annotations

import numbers
import types
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch
import torch.fx.experimental._config as fx_config
from torch.utils.weak import WeakIdKeyDictionary

from torch_tpu_embedding._rows.dedup import sink_rows, sinks_sentinel
from torch_tpu_embedding._rows.tables import table_info
from torch_tpu_embedding._util.dtypes import math_dtype
from torch_tpu_embedding._util.registry import RULE_KEY, rule_of
from torch_tpu_embedding._util.transfer import upload
from torch_tpu_embedding.optim._core.contract import RowContext, Slots
from torch_tpu_embedding.optim._core.ema import ema_row_update, momentum_now
from torch_tpu_embedding.optim._core.rule_pipeline import gated, pipeline
from torch_tpu_embedding.optim._core.slots import logical_rows
from torch_tpu_embedding.optim._core.stacked_members import member_rows, segment_of
from torch_tpu_embedding.optim._kernels import kernel_policy, triton_rows

if TYPE_CHECKING:
    from torch_tpu_embedding.optim._core.grad_intake import Work

__all__ = ["call", "chunk_rows", "compiled_kernels", "update"]

Tensor = torch.Tensor

#: compiled kernels by configuration key; ``None``: compiling failed (the reference path runs)
_KERNELS: dict[tuple[Any, ...], Callable[..., list[Tensor]] | None] = {}
#: bytes of summed gradient rows per kernel call (see :func:`chunk_rows`)
_CHUNK_BYTES = 2**22
#: group entries that are not hyper-parameters of the rule (``RULE_KEY``: the rule itself)
_NOT_HP = frozenset({"params", "lr", "slot_creation_fn", RULE_KEY})
#: the form (:func:`_form`) of a number the kernel takes as data, in a configuration's key
_DATA = "<data>"
#: numbers that stay constants of the kernel: exponents, whose value picks the code of a power as eager torch picks
#: it (``x ** -0.5`` as ``1 / sqrt(x)``; a tensor exponent is a general ``pow()``, a last bit apart)
_CONSTANT = frozenset({"learning_rate_power", "exponent"})
#: the data numbers on a device, by device and numbers (read only by the kernels: shared by every group and call)
_UPLOADED: dict[tuple[torch.device, tuple[float, ...]], Tensor] = {}
#: group entries the kernel does not read (the intake's, the per-call EMA's, the rule's name: the key
#: names the rule itself): configurations that differ only here share a kernel
_NOT_IN_KERNEL = frozenset({
    "algorithm", "use_gradient_accumulation", "gradient_accumulation_steps", "loss_scale_factor", "clipnorm",
    "global_clipnorm", "skip_nonfinite", "ema_overwrite_frequency",
})


def compiled_kernels() -> int:
    """How many update kernels this process has built (each compiled on its first use)."""
    return sum(fn is not None for fn in _KERNELS.values())


# --------------------------------------------------------------------------------------- the update kernel
def _kernel_source(
    rule_hp: Mapping[str, Any], names: tuple[str, ...], mdtype: torch.dtype, gate: bool, ema: bool, sink: bool,
    masked: bool = False, whole: tuple[str, ...] = (), members: tuple[int, ...] = (),
) -> Callable[..., list[Tensor]]:
    """The Python that is compiled: the reference row update of ``_core.update_paths`` for unique ids.

    ``whole``: the rule's whole-table slots (Adafactor's ``c`` and ``r_sum``; ``names`` are then its row slots),
    passed whole and returned, after the rows, in that order: the rule sums over every row of the update, so it gets
    the reference path's context (which rows are real, how many per table; ``members``: the logical rows of each
    member of a stacked group, whose member of each row comes as ``seg``), and the update is one call.

    With ``sink`` (an eager accelerator: the sorted ids of ``dedup_static`` with their sentinel tail) it writes
    nothing: it returns the rows to write (in the order slots, weight, EMA), which :func:`update` copies. The
    tail's rows are the sink row's new rows, and a kernel that wrote them itself would read that row in one
    position after another position had written it (a fused loop, or a GPU's threads, runs positions in no
    order): measured as the update applied twice to the sink row. With ``masked`` (CUDA with Triton) the copy
    skips the tail (:func:`.triton_rows.copy_rows`), so the rows are returned as computed; without it they
    carry :func:`~torch_tpu_embedding._rows.dedup.sink_rows`' values, copied at the clamped ids."""
    # the entries with data numbers, each with its form (read outside the traced code), in ``values``' order
    forms = [(k, f) for k, f in _forms(rule_hp) if _DATA in (f if isinstance(f, tuple) else (f,))]

    def kernel_rows(p: Tensor, ids: Tensor, g: Tensor, row_slots: list[Tensor], whole_slots: list[Tensor],
                    lr: Tensor, step: Tensor, num_rows: int, gate_t: Tensor | None, ema_t: Tensor | None,
                    ema_last: Tensor | None, it: Tensor | None, keep: Tensor | None, mu: Tensor | None,
                    seg: Tensor | None, values: Tensor) -> list[Tensor]:
        hp, taken = dict(rule_hp), iter(range(values.shape[0]))  # the data numbers from ``values``, in their shapes
        for k, f in forms:
            hp[k] = tuple(values[next(taken)] if x == _DATA else x for x in f) if isinstance(f, tuple) \
                else values[next(taken)]
        sentinel = p.shape[0]
        at = ids.clamp(max=sentinel - 1) if sink else ids
        out: list[Tensor] = []

        def copy_rows(dst: Tensor, value: Tensor, old: Tensor) -> None:
            if sink:
                out.append(value if masked else sink_rows(ids, value, old, sentinel)[1])
            else:
                dst.index_copy_(0, ids, value)

        w0 = p[at].to(mdtype)
        slots: Slots = {k: s[at] for k, s in zip(names, row_slots, strict=True)}
        slots.update(zip(whole, whole_slots, strict=True))
        ctx = RowContext(mask=None, count=None, num_rows=num_rows)
        if whole:  # as _core.update_paths._update_rows makes it (the sentinel tail is not real)
            ctx = RowContext.touched(ids < sentinel, num_rows, segment=seg, member_rows=members)
        w, new = pipeline(w0, g, slots, lr, step, hp, ctx)
        if gate:
            w = gated(gate_t, w, w0)
        stored = w.to(p.dtype)
        for k, s in zip(names, row_slots, strict=True):
            value = new[k].to(s.dtype)
            copy_rows(s, gated(gate_t, value, slots[k]) if gate else value, slots[k])
        kept = [gated(gate_t, new[k].to(s.dtype), s) if gate else new[k].to(s.dtype)
                for k, s in zip(whole, whole_slots, strict=True)]
        copy_rows(p, stored, w0.to(p.dtype))
        if ema:
            assert ema_t is not None and ema_last is not None and it is not None and mu is not None
            avg0, last0 = ema_t[at], ema_last[at]
            avg, last = ema_row_update(avg0, last0, w0, stored.to(mdtype), it, keep, mu, hp["ema_momentum"])
            copy_rows(ema_t, avg, avg0)
            copy_rows(ema_last, last, last0)
        return out + kept

    return kernel_rows


def _key(item: Work, names: tuple[str, ...], whole: tuple[str, ...], members: tuple[int, ...]) -> tuple[Any, ...]:
    p, group, state = item.p, item.group, item.state
    rule = rule_of(group).rule
    hp = tuple((k, repr(f)) for k, f in _forms(group))  # (a data number by its form alone)
    slot_dtypes = tuple(state[k].dtype for k in names + whole)
    # (the device with its index: a kernel compiled for cuda:0 is guarded on it, and would recompile for cuda:1)
    return (rule.__module__, rule.__qualname__, hp, p.device, p.dtype, p.dim(), slot_dtypes, whole, members,
            item.gate is not None, torch.get_num_threads(), sinks_sentinel(p.device), _masked(p))


def _build(item: Work, names: tuple[str, ...], whole: tuple[str, ...], members: tuple[int, ...]
           ) -> Callable[..., list[Tensor]]:
    group = item.group
    rule_hp = {k: v for k, v in group.items() if k not in _NOT_HP}
    src = _kernel_source(rule_hp, names, math_dtype(item.p), item.gate is not None, bool(group["use_ema"]),
                         sinks_sentinel(item.p.device), _masked(item.p), whole, members)
    # A code object of its own per configuration: torch.compile keeps its compiled graphs per code
    # object, and a shared one would count every configuration against one recompile limit.
    code = src.__code__.replace(co_name=f"kernel_rows_{group['algorithm']}_{len(_KERNELS)}")
    fn = types.FunctionType(code, src.__globals__, code.co_name, src.__defaults__, src.__closure__)
    # compile_threads=1: one kernel compiles faster in this process than through a pool of workers
    # that each import torch first.
    compiled: Callable[..., list[Tensor]] = torch.compile(fn, dynamic=True, fullgraph=True,
                                                  options={"compile_threads": 1})
    return compiled


def _form(k: str, v: Any) -> Any:
    """How the kernel holds group entry ``k``'s value ``v``: :data:`_DATA` for a number it takes as data (a real
    number other than 0 and 1, outside :data:`_CONSTANT`), else ``v`` itself, a constant of the kernel; a tuple
    (``betas``, ``clipvalue``) by element. 0 and 1 stay constants: a rule branches on them
    (:func:`~torch_tpu_embedding.optim._core.contract.is_set`), as XLA keeps them constants of its graphs."""
    if isinstance(v, tuple | list):
        return tuple(_form(k, x) for x in v)
    data = isinstance(v, numbers.Real) and not isinstance(v, bool) and v not in (0, 1) and k not in _CONSTANT
    return _DATA if data else v


def _forms(group: Mapping[str, Any]) -> list[tuple[str, Any]]:
    """The forms of the group entries the kernel reads, by name."""
    return [(k, _form(k, group[k])) for k in sorted(group) if k not in _NOT_HP | _NOT_IN_KERNEL]


def _scheduled(group: Mapping[str, Any], device: torch.device) -> Tensor:
    """The group's data numbers (:func:`_form`), in :func:`_forms`' order, as a float64 tensor on ``device``: the
    rule computes with them as with the Python numbers (``1 - b1`` in float64, the product in the rows' dtype).
    Uploaded when they change (a schedule's step), else the tensor of the last call with the same numbers."""
    values: list[float] = []
    for k, f in _forms(group):
        pairs = zip(group[k], f, strict=True) if isinstance(f, tuple) else [(group[k], f)]
        values.extend(float(x) for x, form in pairs if form == _DATA)
    key = (device, tuple(values))
    if key not in _UPLOADED:
        if len(_UPLOADED) >= 64:  # (a schedule's numbers, one set per step: the oldest go)
            del _UPLOADED[next(iter(_UPLOADED))]
        _UPLOADED[key] = upload(torch.tensor(values, dtype=torch.float64), device)
    return _UPLOADED[key]


def call(fn: Callable[..., list[Tensor]], args: tuple[Any, ...]) -> list[Tensor]:
    """``fn(*args)``, a compiled kernel, under the settings every kernel here is compiled with."""
    # Python numbers of the kernel are constants of it, as in the eager rule (an unspecialised float
    # exponent makes inductor call pow() where eager torch.pow computes x ** -0.5 as 1 / sqrt(x)). No
    # duck sizing: sizes that happen to be equal in the first call (the touched rows and the rows of a
    # buffer) must not become one symbol, or the next call recompiles. The few shape guards are checked in
    # Python: compiled to C++ they cost a compiler run per kernel.
    no_duck, dynamo = _settings()
    with dynamo, no_duck, torch.no_grad():
        return fn(*args)


_SETTINGS: list[Any] = []


def _settings() -> list[Any]:
    """The config patches of :func:`call`, made once: making one costs about 0.3 ms (it builds classes),
    entering a made one about 5 µs (measured on torch 2.9; a step may call several kernels)."""
    if not _SETTINGS:
        _SETTINGS.extend([fx_config.patch(use_duck_shape=False),  # type: ignore[attr-defined]
                          torch._dynamo.config.patch(specialize_float=True, enable_cpp_symbolic_shape_guards=False)])
    return _SETTINGS


def chunk_rows(dim: int) -> int:
    """Distinct ids per kernel call on the CPU when the summed rows are made a range at a time: 4 MB of
    float32 rows (16,384 rows of 64; 2 MB measured 10% slower at 2 threads, LazyAdam and 20 ids per bag:
    more calls, each waking the thread pool), at least 1,024 rows (each call costs some 50 µs of Python). Steps
    of at most 4 such ranges run in one call."""
    return max(1024, _CHUNK_BYTES // (4 * max(dim, 1)))


def _spans(n: int, size: int) -> list[tuple[int, int]]:
    """``[0, n)`` in ranges of ``size``, none of a single row (dynamic shapes specialise size 1)."""
    spans = [(a, min(a + size, n)) for a in range(0, n, size)]
    if len(spans) > 1 and spans[-1][1] - spans[-1][0] < 2:
        spans[-2:] = [(spans[-2][0], n)]
    return spans


def _to_reference(item: Work, start: int = 0) -> bool:
    """``False``, with ``item``'s rows from ``start`` on summed for the reference path (when the kernel
    path took the factored gradient, :attr:`~.grad_intake.Work.sums`)."""
    if item.sums is not None:
        assert item.ids is not None
        item.g, item.ids, item.sums = item.sums.rows(start), item.ids[start:], None
    return False


def update(item: Work) -> bool:
    """Run ``item``'s row update (unique ids, no sentinel; on an accelerator the static ids of
    ``dedup_static``, sentinel tail included) as update kernel calls; ``False`` if no
    kernel could be compiled, fewer than 2 rows were touched (dynamic shapes specialise sizes 0 and 1,
    and such a step is no work to speed up), a ``TorchDispatchMode`` is active, or
    :func:`.kernel_policy.policy` keeps this step on the reference path:
    the caller then runs the reference path on ``item.ids`` and ``item.g`` (the rows not yet updated).

    With ``item.sums`` (the factored gradient, sorted) the summed rows are made and updated a range of
    :func:`chunk_rows` ids at a time on the CPU; each row's update is the same either way."""
    p, group, state, ids = item.p, item.group, item.state, item.ids
    assert ids is not None
    if ids.shape[0] < 2 or kernel_policy.warming_up(item):
        return _to_reference(item)
    if torch._C._len_torch_dispatch_stack():
        # A TorchDispatchMode is active (the user's FLOP or op counter, say). Newer torch (2.13) does not run
        # compiled code under one: dynamo skips the frame, runs the kernel's Python eagerly, which writes the
        # rows, and then raises. Caught here, that step's rows were written twice; uncaught, the step failed
        # half applied. The reference path runs the same rule op by op, and the mode sees its ops.
        return _to_reference(item)
    specs = rule_of(group).slot_specs(tuple(p.shape), group, table_info(p) is not None)  # (rule_slots' names)
    whole = tuple(k for k, spec in specs.items() if not spec.rows)  # statistics over rows (Adafactor)
    names = tuple(k for k in specs if k not in whole)
    members = member_rows(p) if whole else ()
    key = _key(item, names, whole, members)
    first = key not in _KERNELS
    if first:
        if not kernel_policy.has_compiler():
            return _to_reference(item)
        _KERNELS[key] = _build(item, names, whole, members)
    fn = _KERNELS[key]
    if fn is None or (not first and p in _REFERENCE_ONLY):
        return _to_reference(item)
    step = state["step"] + 1
    ema = bool(group["use_ema"])
    clock, skip = item.clock, group["skip_nonfinite"]
    sums, n = item.sums, ids.shape[0]
    rest = (
        [state[k] for k in names], [state[k] for k in whole], item.lr, step, logical_rows(p), item.gate,
        state["ema"] if ema else None, state["ema_last"] if ema else None,
        # (a window dropped by skip_nonfinite counts none of its calls, as on the reference path: _core.ema.ema_rows)
        clock.ema_on(p.device, skip, group["gradient_accumulation_steps"]).to(torch.int32) if ema else None,
        clock.keep(p.device, skip) if ema else None,
        momentum_now(group, clock, p.device, math_dtype(p)) if ema else None,
        segment_of(p, ids) if members else None, _scheduled(group, p.device),
    )
    chunk = chunk_rows(p.shape[1])
    # Ranges where the arrays would outgrow the cache many times over; one call below (each costs Python). A rule
    # that sums over every row (whole-table slots) takes them in one call.
    spans = _spans(n, chunk) if sums is not None and p.device.type == "cpu" and n > 4 * chunk and not whole \
        else [(0, n)]
    for start, stop in spans:
        g = item.g if sums is None else sums.rows(start, stop)
        # Not views: the compiled code would guard on each view's base (its size, and whether there is one).
        # Not the Parameter either: dynamo keeps a parameter's shape static (force_parameter_static_shapes),
        # so every table size would compile its own kernel; the detached alias writes the same storage.
        part = ids if len(spans) == 1 else ids[start:stop].clone()
        args = (p.detach(), part.detach(), g.detach(), *rest)
        if first:
            first = False
            try:
                _write(args, call(fn, args), state, whole)
            except Exception as e:  # compiling failed before anything was written
                _KERNELS[key] = None
                text = str(e).strip()
                # No compiler, or the first build of the process failed (a toolchain without Python's
                # headers or OpenMP, say): later configurations would fail too, each after seconds of
                # tracing. Once a kernel has been built, a failure is this configuration's alone.
                why = f"{type(e).__name__}: {text.splitlines()[0] if text else ''}"
                if "InvalidCxxCompiler" in text or compiled_kernels() == 0:
                    kernel_policy.give_up(why)
                else:
                    kernel_policy.warn_once(why)
                return _to_reference(item)
            continue
        try:
            _write(args, call(fn, args), state, whole)
        except torch._dynamo.exc.FailOnRecompileLimitHit:
            # Raised by the guards, before the kernel runs: this table's shapes would need one more
            # compile than torch.compile allows per kernel (a guard that sizes do not pass: tables of
            # distinct sizes share one graph). This table takes the reference path from now on, from
            # the rows not yet updated (the step count moves once, below or on the reference path).
            _REFERENCE_ONLY[p] = True
            return _to_reference(item, start)
    state["step"].copy_(step if item.gate is None else torch.where(item.gate, step, state["step"]))
    return True


def _masked(p: Tensor) -> bool:
    """Whether a sink kernel's rows for ``p`` are copied by :func:`.triton_rows.copy_rows` (the tail skipped)."""
    return sinks_sentinel(p.device) and triton_rows.available(p.device)


def _write(args: tuple[Any, ...], out: list[Tensor], state: dict[str, Tensor], whole: tuple[str, ...]) -> None:
    """Copy a kernel's whole-table slots (the last ``len(whole)`` of its ``out``) into ``state``, and a sink
    kernel's rows (:func:`_kernel_source`) into the slots, the weight and the EMA state of its ``args``: with Triton
    at the real ids alone, else at the clamped ids (duplicates of the sink row carry the same bytes); no rows for a
    kernel that wrote them itself."""
    rows = out[: len(out) - len(whole)]
    with torch.no_grad():
        for k, value in zip(whole, out[len(rows):], strict=True):
            state[k].copy_(value)
    if not rows:
        return
    p, ids, _, row_slots, _, *_, ema_t, ema_last = args[:11]
    dsts = [*row_slots, p, *([ema_t, ema_last] if ema_t is not None else [])]
    sentinel = p.shape[0]
    if _masked(p):
        # (each kernel checks its tensors before launching: one refused is copied through torch, below)
        left = [(dst, value) for dst, value in zip(dsts, rows, strict=True)
                if not triton_rows.copy_rows(dst, ids, value, sentinel)]
        if not left:
            return
        # (rows made for the masked copy: their tail is given the sink row's values here, from rows not yet
        # written)
        at = ids.clamp(max=sentinel - 1)
        with torch.no_grad():
            for dst, value in left:
                dst.index_copy_(0, at, sink_rows(ids, value, dst.index_select(0, at), sentinel)[1])
        return
    at = ids.clamp(max=sentinel - 1)
    with torch.no_grad():
        for dst, value in zip(dsts, rows, strict=True):
            dst.index_copy_(0, at, value)


_REFERENCE_ONLY: WeakIdKeyDictionary = WeakIdKeyDictionary()  # type: ignore[no-untyped-call]
