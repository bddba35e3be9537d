"""Training loops: :class:`TrainPipeline` (input prefetch, and TF's pipelined execution on request)."""

from torch_tpu_embedding.train.pipeline import TrainPipeline

__all__ = ["TrainPipeline"]
