"""``keras.ipu.optimizers``: Graphcore's IPU Keras optimizers, as this project has them.

    keras.ipu.optimizers.ALSOptimizer(opt, ...)                        automatic loss scaling
    keras.ipu.optimizers.ALSGradientAccumulationOptimizer(als, n, ...)  ... with accumulation
    keras.ipu.optimizers.als_optimizer                                  their module

Both wrap a Keras 3 optimizer (``als_optimizer.py`` says how). Graphcore's
``GradientAccumulationOptimizer`` and the ALS specialisations ``ALSOptimizerSGD``,
``ALSOptimizerAdam`` and ``ALSOptimizerRMSProp`` are not here (``AttributeError``).
"""

from __future__ import annotations

from tf_ipu.graphcore.keras_ipu.optimizers import als_optimizer
from tf_ipu.graphcore.keras_ipu.optimizers.als_optimizer import (
    ALSGradientAccumulationOptimizer,
    ALSOptimizer,
    ALSOptimizerGradientAccumulationWrapper,
)

__all__ = ["ALSGradientAccumulationOptimizer", "ALSOptimizer",
           "ALSOptimizerGradientAccumulationWrapper", "als_optimizer"]
