"""``tensorflow.python.ipu.ops.pipelining_ops``: the pipeline's schedule and recomputation
names, which ``model.set_pipelining_options`` takes (tf_ipu.pipelining)."""

from __future__ import annotations

from tf_ipu.pipelining import PipelineSchedule, RecomputationMode

__all__ = ["PipelineSchedule", "RecomputationMode"]
