"""``ipu_tensorflow_addons.keras.layers.RecomputationCheckpoint``: the identity, marked.

Its outputs are its inputs, checkpointed with ``ipu.pipelining_ops.recomputation_checkpoint``
(tf_ipu.pipelining): in a pipelined model that recomputes activations in the
``RecomputeAndBackpropagateInterleaved`` mode they are stashed, and the backward recomputes
from them (the tile model charges it, docs/tile_model.md); anywhere else only the identity.
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
        >>> x = RecomputationCheckpoint()(np.ones((2, 3), "float32"))  # doctest: +SKIP
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.supports_masking = True

    def call(self, inputs: Any, **kwargs: Any) -> Any:
        """The inputs, unchanged (and marked as recomputation checkpoints)."""
        from tf_ipu.pipelining import recomputation_checkpoint

        return recomputation_checkpoint(inputs)

    def compute_output_shape(self, input_shape: Any) -> Any:
        return input_shape


__all__ = ["RecomputationCheckpoint"]
