"""The lookups ahead of ``tte.TrainPipeline``'s pipelined execution: batch ``N + 1`` looked up during step ``N``.

On CUDA tables they run on a side stream, so that they overlap the step's dense part (they are independent of it);
the update of step ``N`` writes the rows they read, so it waits for them (:meth:`LookupsAhead.wait`).
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import torch
from torch.utils._pytree import tree_map

from torch_tpu_embedding.modules.collection import EmbeddingCollection
from torch_tpu_embedding.modules.prepared import PreparedFeatures

__all__ = ["LookupsAhead"]


class LookupsAhead:
    """Looks prepared features up ahead for ``collection`` (on CUDA tables: on a stream of its own, made at the
    first lookup that needs it)."""

    def __init__(self, collection: EmbeddingCollection) -> None:
        self.collection = collection
        self._stream: Any = None

    def __call__(self, prepared: PreparedFeatures, concat: bool) -> None:
        """``collection.look_up_ahead(prepared, concat, keep_error=True)``: its error is raised at its own step."""
        stream = self._side_stream()
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream) if stream is not None else nullcontext():
            self.collection.look_up_ahead(prepared, concat, keep_error=True)
        if stream is not None and prepared.outputs is not None:  # made on the side stream, used on this one:
            current = torch.cuda.current_stream()  # their memory kept until it has used them
            tree_map(lambda t: t.record_stream(current) if isinstance(t, torch.Tensor) else t, prepared.outputs)

    def wait(self) -> None:
        """Before an update: the update writes the rows the lookups ahead read."""
        if self._stream is not None:
            torch.cuda.current_stream().wait_stream(self._stream)

    def _side_stream(self) -> Any:
        if not any(p.device.type == "cuda" for p in self.collection.parameters()):
            return None
        if self._stream is None:
            self._stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
        return self._stream
