"""``tensorflow.python.ipu.ops.pipelining_ops`` (also ``ipu.pipelining_ops``): the pipeline's
schedule and recomputation names and the per-stage Poplar options (``PipelineStageOptions``),
which ``model.set_pipelining_options`` takes, and ``recomputation_checkpoint``
(tf_ipu.pipelining)."""

from __future__ import annotations

from tf_ipu.pipelining import (
    PipelineSchedule,
    PipelineStageOptions,
    RecomputationMode,
    recomputation_checkpoint,
)

__all__ = ["PipelineSchedule", "PipelineStageOptions", "RecomputationMode",
           "recomputation_checkpoint"]
