"""``TrainPipeline``: a training loop whose input work overlaps the step, with TF's one-step-stale lookups on request.

Each step is the user's: ``step(model, batch)`` returns the loss (or ``(loss, anything)``), the pipeline calls
``backward``, the optional ``before_update()`` (a gradient clip) and every optimizer's ``step`` and ``zero_grad``.
Around it:

* **Input prefetch** (``prefetch=True``, exact): a background thread takes batch ``N + 1`` from the source and
  prepares it (``EmbeddingCollection.prepare(..., ahead=True)``: checks, padding, the group assembly, the
  transfer) while step ``N`` runs; the model's call ``collection(features(batch))`` then only looks up. The
  results equal the plain loop's bitwise. Tables on XLA: the thread only takes the batch from the source, the main
  thread prepares it (torch_xla's tensors cannot be touched off the thread that runs ``torch_xla.sync()``).
* **Pipelined execution** (``pipeline_execution_with_tensor_core=True``, TF's flag; off by default): batch
  ``N + 1`` is looked up before update ``N`` is applied, so its activations come from the tables as they were
  after update ``N - 1`` — one step stale, TF's documented semantics ("the TPU embedding computations will overlap
  with the TensorCore computations (and hence will be one step old ...)"). The gradient of step ``N + 1`` is
  applied to the tables as they are then. The lookup of ``N + 1`` and the dense part of ``N`` are independent:
  on XLA they are one graph, on CUDA the lookup runs on a side stream.

Collectives (a process group's id exchange, data-parallel gradient syncs) run on the main thread only, in one
order on every rank: the thread prepares, it never looks up. A batch that fails on one rank (a bad id, ``features``
raising, the source raising) fails its lookup there, and that rank still takes part in the lookup's agreement
(with pipelined execution: the lookup ahead, during the previous step), so every rank raises at that batch's step and
none waits for another (tests/distributed/test_mp_pipeline.py).

A checkpoint between steps: :meth:`TrainPipeline.state_dict` holds the batches taken from the source and not yet
trained (and, with pipelined execution, the activations already looked up for the first of them); saved with
the model's and the optimizers' state and restored with :meth:`~TrainPipeline.load_state_dict`, the run goes on
as if uninterrupted: give :meth:`~TrainPipeline.run` the source from batch ``state_dict()["taken"]`` on.

Example::

    >>> import torch, torch_tpu_embedding as tte
    >>> ec = tte.EmbeddingCollection({"f": tte.FeatureConfig(tte.TableConfig(100, 4, name="t"))})
    >>> model = torch.nn.ModuleDict({"ec": ec, "head": torch.nn.Linear(4, 1)})
    >>> def step(model, batch):                      # the user's forward and loss
    ...     out = model["ec"](batch["sparse"])
    ...     return torch.nn.functional.mse_loss(model["head"](out["f"]).squeeze(1), batch["label"])
    >>> tables, dense = tte.split_parameters(model)
    >>> opts = [tte.optim.Adagrad(tables, lr=0.1), torch.optim.SGD(dense, lr=0.1)]
    >>> data = [{"sparse": {"f": torch.randint(0, 100, (8,))}, "label": torch.rand(8)} for _ in range(5)]
    >>> pipe = tte.TrainPipeline(model, opts, step=step, features=lambda batch: batch["sparse"])
    >>> losses = [loss.detach() for loss in pipe.run(data)]
    >>> len(losses), pipe.steps
    (5, 5)
"""

from __future__ import annotations

import collections
import functools
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, NoReturn

import torch

from torch_tpu_embedding._util.nest import detached
from torch_tpu_embedding.modules.collection import EmbeddingCollection
from torch_tpu_embedding.modules.prepared import NotAhead, PreparedFeatures
from torch_tpu_embedding.train.lookahead import LookupsAhead
from torch_tpu_embedding.train.prefetch import Prefetcher, Ready, ReusedBuffersError, call_weakly, refilled
from torch_tpu_embedding.train.restored import failed_update, host_copy, restore, saved_state, state_problem

__all__ = ["TrainPipeline"]


class TrainPipeline:
    """Train ``model`` with ``optimizers``, one ``step(model, batch)`` per batch, its input work done ahead.

    Args:
        model: the user's module (it calls ``collection`` on ``features(batch)``).
        optimizers: the optimizers of the tables and of the rest; each step calls ``step()`` then ``zero_grad()``
            on each, in order.
        step: ``step(model, batch)`` → the loss, or a tuple whose first item is the loss; ``run`` yields it.
        features: ``features(batch)`` → the collection's inputs for ``batch``: the very objects the model passes to
            the collection (matched by identity; a model that looks up other objects raises at the first step).
        collection: the :class:`~torch_tpu_embedding.EmbeddingCollection` (default: the only one in ``model``).
        weights: ``weights(batch)`` → the per-id weights the model passes, if it passes any.
        concat: the ``concat`` the model calls the collection with (needed for lookups ahead).
        prefetch: take the next batch from the source and prepare it on a background thread (default ``True``;
            tables on XLA: prepared on the main thread); ``False`` does both in the step, as the plain loop does.
        pipeline_execution_with_tensor_core: TF's flag: look up batch ``N + 1`` before update ``N`` (one step
            stale). Default ``False``.
        before_update: called after each step's ``backward()`` and before its optimizers' ``step()``: to clip the
            gradients (``lambda: tte.clip_grad_norm_(model.parameters(), 1.0)``). If it raises, the step failed
            before its update, as if its loss had raised: its gradients are dropped, its batch trained again first.
        after_step: called after each step's optimizer steps (on XLA: ``torch_xla.sync``, so that a step is one
            graph).

    Use :meth:`run` (a generator: one item per step) or :meth:`progress`; both stop the thread at the end, at an
    error and at :meth:`close` (also on leaving ``with pipe:``; a pipeline collected without it stops its thread
    too). Batches taken but not trained are never dropped silently: :meth:`unfinished` lists them,
    :meth:`state_dict` saves them; after a step that raised before its update, a later :meth:`run` trains the
    failed batch first, as if that step had not run. A step may edit its batch's ids in place before its forward
    (they are planned again, as in the plain loop), but not a batch looked up ahead (pipelined execution: that
    raises). Taken ahead (``prefetch``, or pipelined execution), a batch is taken while the step before it runs: the
    source must give each batch tensors of its own (one that refills the tensors it gave raises, naming the input).
    """

    def __init__(
        self, model: torch.nn.Module, optimizers: torch.optim.Optimizer | Sequence[torch.optim.Optimizer], *,
        step: Callable[[Any, Any], Any], features: Callable[[Any], Any],
        collection: EmbeddingCollection | None = None, weights: Callable[[Any], Any] | None = None,
        concat: bool = False, prefetch: bool = True, pipeline_execution_with_tensor_core: bool = False,
        after_step: Callable[[], Any] | None = None, before_update: Callable[[], Any] | None = None,
    ) -> None:
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"Argument `model` must be a torch.nn.Module. Received: {type(model).__name__}")
        opts = [optimizers] if isinstance(optimizers, torch.optim.Optimizer) else list(optimizers)
        if not opts or not all(isinstance(o, torch.optim.Optimizer) for o in opts):
            raise TypeError("Argument `optimizers` must be a torch.optim.Optimizer or a sequence of them. "
                            f"Received: {optimizers!r}")
        for name, fn in (("step", step), ("features", features), ("weights", weights), ("after_step", after_step),
                         ("before_update", before_update)):
            if fn is not None and not callable(fn):
                raise TypeError(f"Argument `{name}` must be callable. Received: {fn!r}")
        if collection is None:
            found = [m for m in model.modules() if isinstance(m, EmbeddingCollection)]
            if len(found) != 1:
                raise ValueError(f"Argument `collection` must name the EmbeddingCollection the model looks up: "
                                 f"the model holds {len(found)}.")
            collection = found[0]
        if not isinstance(collection, EmbeddingCollection):
            raise TypeError("Argument `collection` must be an EmbeddingCollection. "
                            f"Received: {type(collection).__name__}")
        for name, flag in (("concat", concat), ("prefetch", prefetch),
                           ("pipeline_execution_with_tensor_core", pipeline_execution_with_tensor_core)):
            if not isinstance(flag, bool):
                raise TypeError(f"Argument `{name}` must be a bool. Received: {flag!r}")
        self.model, self.optimizers, self.collection = model, opts, collection
        self._step_fn, self._features, self._weights, self._after = step, features, weights, after_step
        self._before_update = before_update
        self.concat, self.prefetch, self.stale = concat, prefetch, pipeline_execution_with_tensor_core
        #: steps trained, and batches taken from the sources (trained, or waiting in :meth:`unfinished`)
        self.steps, self.taken = 0, 0
        self._source: Iterator[Any] | None = None
        self._given: Iterator[Any] | None = None  # the iterator given to progress()
        self._prefetcher: Prefetcher | None = None
        self._next: Ready | None = None  # the batch after the current one (pipelined execution: looked up)
        self._resume: list[Any] = []  # batches from a checkpoint, trained before the source's
        self._resume_outputs: Any = None  # their first's activations looked up ahead (pipelined execution)
        self._failed: list[Any] = []  # the batch of a step that raised before its update (trained first by a later run)
        self._updating = False  # the current step's optimizers have begun its update
        self._in_update = False  # an optimizer's step() raised: its update may be applied in part
        self._ahead_outputs: Any = None  # the current batch's activations looked up ahead (pipelined execution)
        self._failed_outputs: Any = None  # the failed batch's (restored when trained again, as a checkpoint's)
        self._lookups_ahead = LookupsAhead(collection)  # (on CUDA: on a side stream)
        self._finalizer: Any = None  # stops the thread of a pipeline collected without close()
        # A thread close() left blocked in the source's next(): the batch it returns goes into _resume at _late_at.
        self._late: Prefetcher | None = None
        self._late_at = 0
        self._resumed: collections.deque[Any] = collections.deque()  # _resume's batches the running source holds
        self._handed: Ready | None = None  # the batch prepared last (kept alive: its tensors' ids are compared)
        # The source's error met ahead and not raised when the pipeline stopped (a break, a failed step): raised after
        # _resume's batches, where the source raised it (a generator that raised is done: it never raises it again).
        # One error at most, in a list: the source's chain refers to it, never to the pipeline (held weakly).
        self._source_error: list[BaseException] = []

    # ------------------------------------------------------------------ the loop
    def run(self, batches: Iterable[Any]) -> Iterator[Any]:
        """Train on ``batches`` (after any restored by :meth:`load_state_dict`); yields each step's result."""
        source = iter(batches)
        if self._source is not None:  # (refused before the try: closing would stop the run going on)
            raise ValueError("TrainPipeline.run() was called while another run() (or progress()) of this pipeline is "
                             "going on: finish it, or break out of it (close() after progress()), first.")
        try:
            while True:
                try:
                    result = self.progress(source)
                except StopIteration:
                    return
                yield result
        finally:
            self.close()

    def progress(self, source: Iterator[Any]) -> Any:
        """Train one step on the next batch of ``source`` (the same iterator at every call, as TorchRec's
        ``progress``); returns ``step``'s result. Raises ``StopIteration`` when it is exhausted."""
        if self._source is None:
            self._start(source)
        elif source is not self._given:  # (self._source is the pipeline's own chain, never handed out)
            raise ValueError("TrainPipeline.progress() must be given the same iterator at every call (the next "
                             "batches are taken from it ahead); close() the pipeline to start on another.")
        try:
            current = self._next if self._next is not None else self._take()
        except Exception as e:  # the source's error
            self.close()
            self._fail(e)
        except BaseException:  # an interrupt: the source's own (its chain, or the thread, ended), or while waiting
            if self._prefetcher is None or self._prefetcher.done:  # (a later call starts on the source again)
                self.close()
            raise
        self._next = None
        if current is None:
            self.close()
            raise StopIteration
        if current.source_error is not None:  # met while looking ahead during the previous step: its place is here
            self.close()
            raise current.source_error
        try:
            return self._train(current)
        except BaseException as e:
            if not self._updating:  # failed before its update: trained first by a later run, from no gradient
                self._failed = [current.batch]  # (restored activations it had not kept yet: still its own)
                self._failed_outputs = self._ahead_outputs if self._ahead_outputs is not None else self._resume_outputs
                for opt in self.optimizers:
                    opt.zero_grad()
            self.close()
            if isinstance(e, StopIteration):  # (as PEP 479's generators do: else it reads as the end of the batches)
                raise RuntimeError(f"StopIteration was raised in step {self.steps} of TrainPipeline (by `step`, "
                                   "`features`, `weights`, `before_update`, `after_step` or an optimizer): run() and "
                                   "progress() would take it for the end of the batches.") from e
            raise

    def _train(self, current: Ready) -> Any:
        self._updating, self._ahead_outputs, self._in_update = False, None, False
        prepared = self._prepared(current)
        if prepared.ahead_error is not None:  # its lookup, during the previous step, failed (here or on another rank)
            raise prepared.ahead_error
        if self._resume_outputs is not None:  # restored: its activations as looked up before the checkpoint
            self._look_up_ahead(prepared, self._resume_outputs)
        # (looked up ahead: kept should the step fail before its update, for the later run that trains it again;
        # restored ones are let go only once kept there: an interrupt before keeps them too)
        self._ahead_outputs = None if prepared.outputs is None else detached(prepared.outputs)
        self._resume_outputs = None
        if self.stale:  # batch N + 1 looked up now: the tables before update N
            try:
                following = self._take()
            except Exception as e:  # the source's error, raised after this step, at its place in the stream
                following = Ready(None, source_error=e)
            # (kept before its lookup: a step interrupted there, a KeyboardInterrupt, lists it and trains it later)
            self._next = following
            if following is not None:
                # Looked up even when its inputs (or the source) failed, the error kept for its step: over a process
                # group the failed rank takes part in this lookup's agreement, so that every rank raises at that step.
                ahead = (self._prepared(following, keep_error=True) if following.source_error is None
                         else PreparedFeatures.failed(id(self.collection), following.source_error))
                self._look_up_ahead(ahead)
            if following is not None and isinstance(ahead.error, ReusedBuffersError):  # (this step's batch too)
                raise ahead.error
        with self.collection.use_prepared(prepared):
            result = self._step_fn(self.model, current.batch)
        if not prepared.used:
            raise ValueError("The model did not look up the features TrainPipeline prepared: `features(batch)` must "
                             "return the very objects the model passes to the collection (they are matched by "
                             "identity), and `weights(batch)` its per-id weights if it passes any.")
        loss = result[0] if isinstance(result, tuple) else result
        if not isinstance(loss, torch.Tensor):
            raise TypeError(f"`step(model, batch)` must return the loss tensor, or a tuple whose first item is the "
                            f"loss. Received: {type(loss).__name__}")
        loss.backward()  # type: ignore[no-untyped-call]  # (torch 2.9 leaves Tensor.backward unannotated)
        self._lookups_ahead.wait()  # (before `before_update` too: it may write the rows they read)
        if self._before_update is not None:  # (raising: a failure before the update, as the loss's)
            self._before_update()
        # From here a failure leaves this update applied, maybe in part: never retried. (The activations kept for a
        # retry are let go before after_step: on XLA a tensor alive at torch_xla.sync() becomes a graph output.)
        self._updating, self._ahead_outputs, self._in_update = True, None, True
        self.steps += 1  # (its batch is spent from here: counted, as state_dict()'s `taken` counts it)
        for opt in self.optimizers:
            opt.step()
        self._in_update = False
        for opt in self.optimizers:
            opt.zero_grad()
        if self._after is not None:
            self._after()
        return result

    # ------------------------------------------------------------------ batches
    def _start(self, source: Iterator[Any]) -> None:
        self._settle_late(self.close_timeout, "run()/progress()", "Unblock it (its batch is then trained first) or go "
                          "on with a new TrainPipeline (from unfinished()).")
        self._given = source
        if self._failed:  # a step raised: its batch first, then the one looked up ahead during it (looked up again)
            ahead = self._next
            if ahead is not None and ahead.source_error is not None:  # (met while the failed step looked ahead)
                self._source_error[:], ahead = [ahead.source_error], None
            again = [*self._failed, *([ahead.batch] if ahead is not None else [])]
            self._resume, self.taken = [*again, *self._resume], self.taken - len(again)  # (counted again when taken)
            self._failed, self._next = [], None
            self._resume_outputs, self._failed_outputs = self._failed_outputs, None  # (its activations, as looked up)
        resumed = self._resumed = collections.deque(self._resume)  # (what close() finds left goes back to _resume)
        self._resume, pending = [], self._source_error

        def chained() -> Iterator[Any]:
            while resumed:
                yield resumed.popleft()
            if pending:
                raise pending.pop()
            for batch in source:  # (not `yield from`: closing this generator would close the caller's iterator)
                yield batch

        self._source = chained()
        self.collection.know_rows()  # (the thread reads no XLA tensor)
        if self.prefetch:
            # The thread holds this pipeline weakly: dropped without close(), it is collected and its finalizer
            # stops the thread (a join there could wait on a source that blocks).
            prepare = functools.partial(call_weakly, weakref.WeakMethod(self._prepare_ahead))
            self._prefetcher = Prefetcher(self._source, prepare)
            self._finalizer = weakref.finalize(self, self._prefetcher.stop)

    def _prepare_ahead(self, batch: Any) -> PreparedFeatures | None:
        try:
            return self.collection.prepare(*self._inputs(batch), ahead=True)  # (its input errors kept in it)
        except NotAhead:
            return None  # (tables or ids on an XLA device: prepared on the main thread)

    def _inputs(self, batch: Any) -> tuple[Any, Any]:
        return self._features(batch), None if self._weights is None else self._weights(batch)

    def _take(self) -> Ready | None:
        """The next batch (prepared when prefetching), or ``None`` at the end; raises the source's error."""
        if self._prefetcher is not None:
            item = self._prefetcher.next()
        else:
            assert self._source is not None
            try:
                item = Ready(next(self._source))
            except StopIteration:
                item = None
        if item is None:
            return None
        if item.source_error is not None:
            raise item.source_error
        self.taken += 1
        return item

    def _prepared(self, item: Ready, keep_error: bool = False) -> PreparedFeatures:
        """``item``'s prepared features (prepared now where the thread did not). An error of its inputs (or of
        ``features`` / ``weights`` reading them) is kept in them (raised by their lookup, at their own step) when
        ``keep_error``, else raised now; either way by a lookup, which over a process group tells the other ranks."""
        if item.prepared is None and item.error is None:
            try:
                inputs = self._inputs(item.batch)
            except Exception as e:
                item.error = e
            else:
                item.prepared = self.collection.prepare(*inputs, keep_error=keep_error)
        if item.error is not None:  # `features(batch)` raised: the lookup of its step fails with that error
            if not keep_error:
                self._fail(item.error)
            item.prepared, item.error = PreparedFeatures.failed(id(self.collection), item.error), None
        prepared: PreparedFeatures = item.prepared
        if self.prefetch or self.stale:  # (taken while the batch before it trains: a source refilling it is told)
            earlier, self._handed = self._handed, item
            error = (None if earlier is None or earlier is item  # (`is`: a Ready's == would compare tensors)
                     else refilled(prepared, earlier.prepared, lambda: self._inputs(item.batch), self.taken - 1))
            if error is not None:  # (its lookup raises it, at its step: with pipelined execution, this step too)
                prepared = item.prepared = PreparedFeatures.failed(id(self.collection), error)
                if not keep_error:
                    self._fail(error)
        return prepared

    def _fail(self, error: BaseException) -> NoReturn:
        """Raise ``error`` as this step's lookup: over a process group the other ranks' lookups of this step then
        raise too (the failed rank takes part in their agreement) instead of waiting for this rank."""
        self.collection(PreparedFeatures.failed(id(self.collection), error))
        raise error  # (the lookup raised it already)

    def _look_up_ahead(self, prepared: PreparedFeatures, saved: Any = None) -> None:  # saved: restored values
        self._lookups_ahead(prepared, self.concat)
        if saved is not None and prepared.outputs is not None:  # (else its error is raised at its step)
            prepared.outputs = restore(prepared.outputs, saved)

    # ------------------------------------------------------------------ stopping, checkpoints
    #: seconds :meth:`close` waits for the background thread (a source blocked in ``next()`` holds it)
    close_timeout: float = 2.0

    def close(self) -> None:
        """Stop the background thread; the batches it took stay in :meth:`unfinished`.

        Joined for at most :attr:`close_timeout` seconds: a source blocked in ``next()`` (a queue that never yields)
        keeps the thread (a daemon: no hold on the interpreter's exit). The batch it returns later is kept, once:
        :meth:`unfinished` lists it from then on, after those taken before it; a later :meth:`run` trains it first."""
        taken: list[Any] = []
        if self._prefetcher is not None:
            prefetcher, self._prefetcher = self._prefetcher, None
            self._finalizer.detach()
            ended = prefetcher.close(self.close_timeout)
            taken, error = prefetcher.take_ready()
            if error is not None:
                self._source_error[:] = [error]
            if not ended:
                self._late, self._late_at = prefetcher, len(taken)
        self._resume = [*taken, *self._resumed, *self._resume]  # (restored batches the source had not yielded)
        self._resumed = collections.deque()
        self._source, self._handed = None, None

    def _settle_late(self, timeout: float, what: str = "", advice: str = "") -> None:
        """Put the batch of a thread :meth:`close` left blocked in the source where it belongs in ``_resume``,
        waiting at most ``timeout`` seconds for it; still blocked: raises for ``what`` (where given)."""
        if self._late is not None and not self._late.close(timeout):
            if what:
                raise RuntimeError(f"TrainPipeline.{what}: the source has not returned the batch the background thread "
                                   f"was taking when close() stopped it (it blocks in next()). {advice}")
            return
        if self._late is not None:
            late, self._late = self._late, None
            batches, error = late.take_ready()
            self._resume[self._late_at:self._late_at] = batches
            if error is not None:
                self._source_error[:] = [error]

    def unfinished(self) -> list[Any]:
        """The batches taken from the source and not trained, in order (the batch of a step that raised first): what
        a later :meth:`run` trains before its source's. (A batch a source blocked at :meth:`close` returns later is
        listed from then on.)"""
        self._settle_late(0.0)
        pending = [] if self._next is None or self._next.source_error is not None else [self._next.batch]
        rest: Callable[[], list[Any]] = functools.partial(list, self._resumed)  # (restored, not yielded yet)
        waiting = self._prefetcher.waiting(rest) if self._prefetcher is not None else rest()
        return [*self._failed, *pending, *waiting, *self._resume]

    def state_dict(self) -> dict[str, Any]:
        """Between steps: ``steps``, ``taken`` and the batches not yet trained (``unfinished``, as given by the
        source), with the activations already looked up for the first of them (pipelined execution). After a step
        that raised before its update (which wrote no table, slot or counter), the state after the last step done.

        Raises:
            RuntimeError: an optimizer's ``step()`` raised (its update may be in part); a source blocks (:meth:`close`).
        """
        if self._in_update:
            raise RuntimeError(failed_update(self.steps - 1))
        self._settle_late(0.0, "state_dict()", "Take it once the source has returned it (unfinished() lists it then).")
        failed = len(self._failed)  # (its batch, first in unfinished(), was counted in self.taken when taken)
        ahead = self._failed_outputs if failed else (  # (its own activations: the ones looked up during it, again)
            None if self._next is None or self._next.prepared is None else self._next.prepared.outputs)
        outputs = host_copy(ahead) if ahead is not None else None if failed else self._resume_outputs
        unfinished = self.unfinished()
        handed = int(self._next is not None and self._next.source_error is None)  # (counted in self.taken already)
        return saved_state(self.steps, self.taken - handed - failed, unfinished, outputs, self.stale)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` before :meth:`run`: its unfinished batches are trained first."""
        if self._source is not None:
            raise RuntimeError("TrainPipeline.load_state_dict() must come before run() or progress().")
        self._settle_late(0.0, "load_state_dict()", "Restore the state into a new TrainPipeline.")
        problem = state_problem(state, self.stale)  # (checked whole before anything changes)
        if problem is not None:
            raise ValueError(problem)
        self.steps, self.taken = int(state["steps"]), int(state["taken"]) - len(state["unfinished"])
        self._next, self._in_update = None, False
        self._resume, self._resume_outputs, self._failed = list(state["unfinished"]), state["outputs_ahead"], []
        self._source_error.clear()  # (the source given to run() from `taken` on raises its own)

    def __enter__(self) -> TrainPipeline:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

