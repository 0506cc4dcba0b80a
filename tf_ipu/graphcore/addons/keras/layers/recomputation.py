"""``ipu_tensorflow_addons.keras.layers.RecomputationCheckpoint``: the identity.

On an IPU the layer marks its inputs as values to keep, not recompute, when a pipelined model
recomputes activations in the ``RecomputeAndBackpropagateInterleaved`` mode; its outputs are
its inputs. This project has no pipelining and no recomputation, so every activation is kept
already and the identity is the whole of what the layer does here.
"""

from __future__ import annotations

from typing import Any

import keras

from tf_ipu.graphcore.addons.keras.layers._common import register


@register
class RecomputationCheckpoint(keras.layers.Layer):
    """Returns its inputs (a tensor or a structure of tensors) unchanged.

    Example:
        >>> from ipu_tensorflow_addons.keras.layers import RecomputationCheckpoint
        >>> x = RecomputationCheckpoint()(np.ones((2, 3), "float32"))
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.supports_masking = True

    def call(self, inputs: Any, **kwargs: Any) -> Any:
        """The inputs, unchanged."""
        return inputs

    def compute_output_shape(self, input_shape: Any) -> Any:
        return input_shape


__all__ = ["RecomputationCheckpoint"]
