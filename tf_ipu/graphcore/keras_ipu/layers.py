"""``keras.ipu.layers``: Graphcore's Keras layer specialisations.

``Dense`` is Graphcore's ``keras.ipu.layers.Dense``: for tensor inputs it is
``keras.layers.Dense`` (same arguments, weights and results). Graphcore's version also takes
FP8 ``QuarterTensor`` inputs; this project has no FP8 type, so that input does not exist here.
"""

from __future__ import annotations

import keras


@keras.saving.register_keras_serializable(package="keras.ipu")
class Dense(keras.layers.Dense):
    """``keras.layers.Dense`` under Graphcore's name (see the module docstring)."""


__all__ = ["Dense"]
