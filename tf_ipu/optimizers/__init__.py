"""Optimizers of the project's own (not Graphcore API ports; those are in
``tf_ipu.graphcore.addons.keras.optimizers``).

    LARS   lars.py   layer-wise adaptive rate scaling with momentum, as the MLPerf ResNet-50
                     reference and Graphcore's v1.1 / v2.0 ResNet-50 submissions run it
"""

from tf_ipu.optimizers.lars import LARS

__all__ = ["LARS"]
