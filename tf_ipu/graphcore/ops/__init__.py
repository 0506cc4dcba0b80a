"""``tensorflow.python.ipu.ops``: the parts of Graphcore's IPU ops this project has.

    ipu.ops.pipelining_ops.PipelineSchedule / RecomputationMode /  -> tf_ipu.pipelining
        PipelineStageOptions
    ipu.ops.cross_replica_ops.cross_replica_sum / _mean,         -> cross_replica_ops.py
        assume_equal_across_replicas                                (tf_ipu_all_reduce)
"""

from __future__ import annotations

from tf_ipu.graphcore.ops import cross_replica_ops, pipelining_ops

__all__ = ["cross_replica_ops", "pipelining_ops"]
