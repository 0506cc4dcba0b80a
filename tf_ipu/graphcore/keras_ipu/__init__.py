"""``keras.ipu``: Graphcore's IPU additions to Keras (the SDK 3 namespace), as this project has them.

    import keras                      from tensorflow import keras   (TF's lazy loader over
    keras.ipu.layers.Dense            keras.ipu.layers.Dense          keras._tf_keras.keras)
              \\______________ the same objects ______________/

Installed by ``import tf_ipu`` (``tf_ipu.graphcore.install``) as the attribute ``ipu`` of both
``keras`` and ``keras._tf_keras.keras`` and as ``keras.ipu`` in ``sys.modules``, unless the
installed Keras has its own ``keras.ipu`` (Graphcore's wheel), which is left alone.

Only what this project implements is here: a name of Graphcore's ``keras.ipu`` that is absent
is an ``AttributeError``, never a placeholder.
"""

from __future__ import annotations

from tf_ipu.graphcore.keras_ipu import layers, optimizers

# SDK 3.0's top-level names (SDK 3.1 kept them in keras.ipu.optimizers only).
from tf_ipu.graphcore.keras_ipu.optimizers import (
    ALSOptimizer,
    ALSOptimizerGradientAccumulationWrapper,
)
from tf_ipu.pipelining import (
    FunctionalLayerPipelineStageAssignment,
    FunctionalNestedModelPipelineStageAssignment,
    ModelLayerPipelineStageAssignment,
    NestedModelPipelineStageAssignment,
    PipelineStage,
    SequentialLayerPipelineStageAssignment,
    SequentialNestedModelPipelineStageAssignment,
)
from tf_ipu.replication import ReplicatedMetricReductionMethod

__all__ = ["ALSOptimizer", "ALSOptimizerGradientAccumulationWrapper",
           "FunctionalLayerPipelineStageAssignment", "FunctionalNestedModelPipelineStageAssignment",
           "ModelLayerPipelineStageAssignment", "NestedModelPipelineStageAssignment",
           "PipelineStage", "ReplicatedMetricReductionMethod",
           "SequentialLayerPipelineStageAssignment",
           "SequentialNestedModelPipelineStageAssignment", "layers", "optimizers"]
