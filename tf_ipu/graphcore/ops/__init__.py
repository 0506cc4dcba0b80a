"""``tensorflow.python.ipu.ops``: the parts of Graphcore's IPU ops this project has.

    ipu.ops.pipelining_ops.PipelineSchedule / RecomputationMode  -> tf_ipu.pipelining
"""

from __future__ import annotations

from tf_ipu.graphcore.ops import pipelining_ops

__all__ = ["pipelining_ops"]
