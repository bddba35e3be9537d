"""Lookups prepared ahead of the forward, and looked up ahead of it (``EmbeddingCollection``'s part of
``tte.TrainPipeline``): :meth:`AheadLookups.prepare`, :meth:`AheadLookups.look_up_ahead`,
:meth:`AheadLookups.use_prepared`. What is prepared is :class:`~torch_tpu_embedding.modules.prepared.PreparedFeatures`.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch

from torch_tpu_embedding._util.nest import detached
from torch_tpu_embedding.modules.prepared import NotAhead, PreparedFeatures, leaves_of, versions_of
from torch_tpu_embedding.modules.table import EmbeddingTable

__all__ = ["AheadLookups"]


class AheadLookups:
    """``EmbeddingCollection``'s methods for inputs prepared ahead (mixed in; the collection supplies the plan,
    the outputs and the failure signal)."""

    _held: PreparedFeatures | None
    _rows_known: dict[int, tuple[weakref.ref[torch.Tensor], int]]

    #: per-process state of these methods, never pickled nor copied: weak references, CUDA streams, the held inputs
    _RUNTIME = ("_rows_known", "_side_streams", "_held")

    def __getstate__(self) -> dict[str, Any]:
        state: dict[str, Any] = dict(super().__getstate__())  # type: ignore[call-overload]
        for key in self._RUNTIME:
            state.pop(key, None)
        return state

    def _plan(self, features: Any, weights: Any, ahead: bool) -> list[Any]:
        raise NotImplementedError

    def _outputs(self, batches: list[Any], concat: bool) -> Any:
        raise NotImplementedError

    def _lookup_failed(self) -> None:
        raise NotImplementedError

    def physical_tables(self) -> dict[str, EmbeddingTable]:
        raise NotImplementedError

    def _held_for(self, features: Any, weights: Any) -> PreparedFeatures | None:
        """What :meth:`use_prepared` holds for a forward given ``features`` and ``weights``, or ``None`` (plan them
        now). Inputs written in place since they were prepared (a step that edits its batch before the forward)
        are planned again as they are now, as the plain forward would; when they were looked up ahead already,
        that lookup read them as they were, and this raises."""
        held: PreparedFeatures | None = self.__dict__.get("_held")
        if held is None or not held.matches(features, weights):
            return None
        looked_up = held.outputs is not None or held.served is not None
        if not looked_up:  # (looked up ahead: held for the step's every forward, all one step stale)
            self._held = None
        name = held.modified(features, weights)
        if name is None and (looked_up or not self._replaced_tables(held)):
            if held.outputs is not None:
                held.served = held.outputs
            return held
        if name is None:  # a table's weight replaced since: planned again, for the tables as they are now
            held.used = True
            return None
        if looked_up or held.ahead_error is not None:
            raise ValueError(f"Input `{name}` was modified in place after it was looked up ahead (look_up_ahead(); "
                             "tte.TrainPipeline(pipeline_execution_with_tensor_core=True) looks a batch up during the "
                             "step before its own): modify it before the pipeline takes the batch (in your data "
                             "source, or in `features(batch)`), not in the step.")
        held.used = True  # (done with: these inputs are planned again, as they are now)
        return None

    def _look_up_prepared(self, prepared: PreparedFeatures, concat: bool) -> Any:
        if prepared.ahead_error is not None:  # (this rank took part in its step's agreement when it was looked up)
            raise prepared.ahead_error
        ahead = prepared.outputs if prepared.outputs is not None else prepared.served
        if ahead is not None:  # looked up ahead (tte.TrainPipeline's one-step-stale schedule)
            if concat is not prepared.concat:
                raise ValueError(f"These features were looked up ahead with concat={prepared.concat}; the forward "
                                 f"asks for concat={concat!r}. Give the pipeline the concat your model uses.")
            replaced = self._replaced_tables(prepared)
            if replaced:  # (its graph holds the old weight: a backward would train nothing any optimizer steps)
                raise ValueError(
                    "These features were looked up ahead (look_up_ahead(); tte.TrainPipeline(pipeline_execution_"
                    "with_tensor_core=True)) before the weight of table(s) "
                    f"{', '.join(f'`{n}`' for n in replaced)} was replaced: their activations read the old weight "
                    "and their gradient would reach no optimizer. Write new values in place (load_state_dict "
                    "without assign) or replace weights between pipelines.")
            outputs, prepared.outputs = ahead, None
            if not torch.is_grad_enabled():  # (looked up ahead with gradients; a forward under no_grad has none)
                outputs = detached(outputs)
            return outputs
        try:
            batches = prepared.take(id(self))
            replaced = self._replaced_tables(prepared)
            if replaced:
                raise ValueError(
                    "These prepared features were prepared before the weight of table(s) "
                    f"{', '.join(f'`{n}`' for n in replaced)} was replaced "
                    "(load_state_dict(assign=True), a new Parameter, unstack/restack, a move that made a new "
                    "parameter): their lookup would read the old weight and give it the gradient. Call prepare() "
                    "again after replacing a table's weight.")
        except Exception:
            self._lookup_failed()
            raise
        return self._outputs(batches, concat)

    def _replaced_tables(self, prepared: PreparedFeatures) -> list[str]:
        """The tables whose batches in ``prepared`` look up a weight that is no longer a table's (replaced since
        it was prepared: the lookup would read stale rows and its gradient reach no optimizer), sorted."""
        live = {id(t.weight) for t in self.physical_tables().values()}
        return sorted({n for batch in prepared.batches or () for b in getattr(batch, "batches", [batch])
                       if id(b.weight) not in live for n in b.tables})

    # ------------------------------------------------------------------ inputs prepared ahead
    def prepare(self, features: Any, weights: Any = None, *, ahead: bool = False,
                keep_error: bool = False) -> PreparedFeatures:
        """The host half of :meth:`forward` done now: structure and range checks, padding, the group assembly and
        the transfer to the tables' device. ``ec(prepared)`` (or ``ec(prepared, concat=True)``) then only looks
        up, once. Raises what :meth:`forward` would raise for these inputs.

        ``ahead=True`` (a background thread, as ``tte.TrainPipeline``'s): no op is put on a device, host tensors
        are moved there only (CUDA: pinned, non-blocking, on a side stream the lookup's stream waits for), and an
        error is kept and raised by the lookup, on the thread that looks up. Tables on an XLA device are prepared
        on the host only (their sizes as :meth:`know_rows` recorded them; the lookup moves the ids, on its
        thread); ids already on an XLA device cannot be prepared ahead
        (:class:`~torch_tpu_embedding.modules.prepared.NotAhead`: prepare them on the thread that looks up).
        ``keep_error=True``: an error is kept so on the main thread too (raised by the lookup, at the step of
        these inputs).

        Example::

            >>> prepared = ec.prepare(batch)     # doctest: +SKIP
            >>> out = ec(prepared)               # doctest: +SKIP
        """
        where = (leaves_of(features), None if weights is None else leaves_of(weights))
        # read before planning: a write while it plans (a source refilling the tensors it gave) is seen at the lookup
        versions = versions_of(features) + (() if weights is None else versions_of(weights))
        if ahead:
            # Off the thread that calls torch_xla.sync(), an XLA tensor's data cannot be touched in torch_xla 2.9, not
            # even a table's size or a new transfer: sync() rewrites every live tensor's data unlocked, and the other
            # thread then raises "Check failed: data()->tensor_data" or corrupts the heap. Measured on XLA:CPU against
            # a main thread that updates and syncs: 6,900 of 7.3M `weight.shape` reads raised and one of two runs
            # aborted in malloc; 6 of 153k `.to(xla)` (and reads of the result) raised. So the plan reads the sizes
            # know_rows() recorded and keeps XLA tables' ids on the host; `.device`, `.dtype` and `.requires_grad`
            # live outside the data (26M reads from a thread, none failed).
            known = self.__dict__.get("_rows_known") or {}
            for t in self.physical_tables().values():
                ref = known.get(id(t.weight), (None,))[0]
                if t.weight.device.type == "xla" and (ref is None or ref() is not t.weight):
                    raise NotAhead(f"table `{t.name}` is on an XLA device and its size was not recorded: call "
                                   "know_rows() on the thread that looks up first")
        side = self._side_stream() if ahead else None
        if side is not None:  # (inputs already on the GPU were made on its default stream)
            side.wait_stream(torch.cuda.default_stream(side.device))
        try:
            with torch.cuda.stream(side) if side is not None else nullcontext():
                batches = self._plan(features, weights, ahead)
                event = side.record_event() if side is not None else None
        except NotAhead:
            raise
        except Exception as e:
            if ahead or keep_error:
                return PreparedFeatures(id(self), None, e, *where, versions=versions)
            self._lookup_failed()
            raise
        return PreparedFeatures(id(self), batches, None, *where, stream_event=event, versions=versions)

    def look_up_ahead(self, prepared: PreparedFeatures, concat: bool = False, *, keep_error: bool = False) -> None:
        """Look ``prepared`` up now, with the tables as they are; the forward given its inputs (while
        :meth:`use_prepared` holds it) or ``prepared`` itself then returns these activations, whatever the
        tables hold by then. ``tte.TrainPipeline(pipeline_execution_with_tensor_core=True)`` does this for
        batch ``N + 1`` before update ``N``: TF's one-step-stale lookups.

        ``keep_error=True``: an error of this lookup (the inputs' own, kept by :meth:`prepare`; over a process
        group, another rank's failure, reported by the lookup's exchange) is kept in ``prepared``
        (``prepared.ahead_error``) and raised by the forward that uses it, at its own step. Every rank of a process
        group takes part in the lookup's agreement now, failed or not, so every rank raises at that step and none
        waits for another's collective."""
        if prepared.outputs is not None or prepared.ahead_error is not None:
            raise ValueError("These prepared features were looked up ahead already.")
        try:
            outputs = self._look_up_prepared(prepared, concat)
        except Exception as e:
            if not keep_error:
                raise
            prepared.ahead_error = e
            return
        prepared.outputs, prepared.concat = outputs, concat

    def know_rows(self) -> None:
        """Record every table's row count now, for :meth:`prepare` ``(ahead=True)`` on another thread: an XLA
        tensor's shape is read from its data, which the thread running the steps replaces at each update
        (``tte.TrainPipeline`` calls this when it starts; a table replaced since is read as before)."""
        self._rows_known = {id(t.weight): (weakref.ref(t.weight), int(t.weight.shape[0]))
                            for t in self.physical_tables().values()}

    @contextmanager
    def use_prepared(self, prepared: PreparedFeatures | None) -> Iterator[None]:
        """While inside, the first forward whose ``features`` (and ``weights``) are the very objects ``prepared``
        was made from looks ``prepared`` up instead of preparing them again (how ``tte.TrainPipeline`` feeds a
        model that calls the collection itself). Looked up ahead, ``prepared``'s activations are what every such
        forward gets (a step that looks its batch up twice: both one step stale, as TF's schedule has them)."""
        before = self.__dict__.get("_held")
        self._held = prepared
        try:
            yield
        finally:
            self._held = before
            if prepared is not None:  # (let go: on XLA a tensor alive at torch_xla.sync() becomes a graph output)
                prepared.served = None

    def _side_stream(self) -> Any:
        """CUDA tables: the stream inputs prepared ahead are moved on (one per device); else ``None``."""
        devices = {t.weight.device for t in self.physical_tables().values() if t.weight.device.type == "cuda"}
        if not devices:
            return None
        streams = self.__dict__.setdefault("_side_streams", {})
        device = min(devices, key=str)
        if device not in streams:
            streams[device] = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
        return streams[device]
