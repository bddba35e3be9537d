"""Batches taken from a source and prepared on a background thread, one step ahead (``tte.TrainPipeline``).

The thread takes the next batch from the user's iterator and runs ``prepare`` on it (an
``EmbeddingCollection.prepare(..., ahead=True)``: checks, padding, id assembly, the transfer) while the main
thread runs a step; at most ``depth`` batches wait prepared. Nothing it does is a collective or a graph node:
collectives and lookups stay on the main thread, in one order on every rank.

Every batch taken from the source is kept until the main thread takes it: an error of the source or of
``prepare`` is handed over with its batch, at the point of the stream where it happened; :meth:`Prefetcher.close`
stops the thread and joins it for a bounded time (a source blocked in ``next()`` keeps it: the batch it returns
then is kept, unprepared, for :meth:`Prefetcher.take_ready`); :meth:`Prefetcher.waiting` lists the batches taken
and not handed over. The thread is a daemon: one left blocked in a source does not hold up the interpreter's exit.
The thread holds the prefetcher, the source and ``prepare`` (``TrainPipeline``'s holds the pipeline weakly): a
pipeline dropped without ``close()`` is collected, and its finalizer calls :meth:`Prefetcher.stop`.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["Prefetcher", "Ready", "ReusedBuffersError", "call_weakly", "refilled"]


@dataclasses.dataclass
class Ready:
    """One batch as the thread left it: the batch, what ``prepare`` made of it (``None``: prepare it on the
    main thread), and the error ``prepare`` raised; or the source's own error (``batch`` unset)."""

    batch: Any
    prepared: Any = None
    error: BaseException | None = None
    source_error: BaseException | None = None


class Prefetcher:
    """A background thread taking batches from ``source`` and preparing them, ``depth`` ahead.

    ``prepare(batch)`` returns what the step needs, or ``None`` to have the main thread prepare it (inputs
    that cannot be prepared off it).
    """

    def __init__(self, source: Iterator[Any], prepare: Callable[[Any], Any], depth: int = 1) -> None:
        self._source, self._prepare, self._depth = source, prepare, depth
        self._ready: collections.deque[Ready] = collections.deque()
        self._cond = threading.Condition()
        self._busy = False  # between taking a batch and handing it over
        self._stop = False
        self._done = False  # the source is exhausted (or raised)
        self._thread = threading.Thread(target=self._run, name="tte-prefetch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            with self._cond:
                while len(self._ready) >= self._depth and not self._stop:
                    self._cond.wait()
                if self._stop:
                    return
                self._busy = True
            item: Ready | None
            try:
                batch = next(self._source)
            except StopIteration:
                item = None
            except BaseException as e:  # the source's error, handed over in its place in the stream
                item = Ready(None, source_error=e)
            else:
                with self._cond:
                    stopped = self._stop
                try:
                    # (stopped meanwhile: kept as taken, prepared by whoever trains it)
                    item = Ready(batch) if stopped else Ready(batch, self._prepare(batch))
                except BaseException as e:  # (prepare keeps input errors itself; anything else lands here)
                    item = Ready(batch, error=e)
            with self._cond:
                self._busy = False
                if item is None or item.source_error is not None:
                    self._done = True
                if item is not None:
                    self._ready.append(item)
                self._cond.notify_all()
                if self._done:
                    return

    def next(self) -> Ready | None:
        """The next batch prepared (waiting for it), or ``None`` when the source is exhausted."""
        with self._cond:
            while not self._ready and not self._done and not self._stop:
                self._cond.wait()
            if not self._ready:
                return None
            item = self._ready.popleft()
            self._cond.notify_all()
            return item

    def waiting(self, then: Callable[[], list[Any]] = list) -> list[Any]:
        """The batches taken from the source and not handed over yet, in order (after the one being taken), followed
        by ``then()``, read while the thread takes nothing (the batches its source holds)."""
        with self._cond:
            while self._busy:
                self._cond.wait()
            return [r.batch for r in self._ready if r.source_error is None] + then()

    def stop(self) -> None:
        """Tell the thread to stop taking batches, without waiting for it (it ends after the batch it is taking)."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()

    def close(self, timeout: float | None = None) -> bool:
        """Stop taking batches and join the thread, waiting at most ``timeout`` seconds (``None``: until it ends);
        whether it ended. The batch it is taking, if any, is kept, also when it comes after the wait: a source
        blocked in ``next()`` keeps the thread (a daemon) until it returns."""
        self.stop()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)
        return not self._thread.is_alive()

    def take_ready(self) -> tuple[list[Any], BaseException | None]:
        """Remove and return the batches taken and not handed over, in order, without waiting (the one being
        taken is not among them), and the source's error met after them, if any (raised by whoever goes on)."""
        with self._cond:
            ready, self._ready = self._ready, collections.deque()
            self._cond.notify_all()
        error = next((r.source_error for r in ready if r.source_error is not None), None)
        return [r.batch for r in ready if r.source_error is None], error

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def done(self) -> bool:
        """Whether the thread takes no more batches: its source is exhausted or raised."""
        with self._cond:
            return self._done


def call_weakly(method: weakref.WeakMethod[Callable[[Any], Any]], batch: Any) -> Any:
    """``method(batch)`` while its object lives (else ``None``: nothing prepared, for a pipeline already gone)."""
    bound = method()
    return None if bound is None else bound(batch)


class ReusedBuffersError(ValueError):
    """A source gave a batch in the tensors of the batch before it, rewritten (see :func:`refilled`)."""


def refilled(prepared: Any, earlier: Any, inputs: Callable[[], tuple[Any, Any]],
             index: int) -> ReusedBuffersError | None:
    """The error for batch ``index`` (``prepared``) when it holds tensors of the batch before it (``earlier``, still
    alive) written since that one was prepared: its source refills the buffers of the batches it gave. Taken ahead,
    a batch is taken while the one before it trains, which then reads its tensors rewritten. (``inputs()``: its
    ``features`` and ``weights``, to name the input.)"""
    leaf = prepared.refills(earlier)
    if leaf is None:
        return None
    name = prepared.input_names(*inputs())[leaf]
    return ReusedBuffersError(
        f"Batch {index} from the source holds the tensors of the batch before it, rewritten (input `{name}`): the "
        "source refills the buffers of the batches it gave. TrainPipeline takes each batch while the step before it "
        "runs (prefetch=True, or pipelined execution), so that step may have read them rewritten: make the source "
        "give each batch tensors of its own (e.g. clone them), or use prefetch=False without pipelined execution.")
