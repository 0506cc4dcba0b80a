"""``ipu_tensorflow_addons.keras.layers.AssumeEqualAcrossReplicas``: the identity.

On an IPU the layer tells Poplar that a value is the same on every replica, so that a
conditional on it is not rejected as divergent control flow (replicas taking different
branches and waiting forever at a cross-replica sync inside one of them). Its outputs are its
inputs. The emulator runs replicas without that compile-time check (a collective that only
some replicas reach is reported when it happens), so there is nothing to mark and the identity
is exact, replicated or not (``ipu.cross_replica_ops.assume_equal_across_replicas`` is the
same for tensors). ``inplace`` (copy the tensor or mark it in place) changes no value; it is
kept in the config.
"""

from __future__ import annotations

from typing import Any

import keras

from tf_ipu.graphcore.addons.keras.layers._common import no_effect, register


@register
class AssumeEqualAcrossReplicas(keras.layers.Layer):
    """Returns its inputs (a tensor or a structure of tensors) unchanged.

    Args:
        inplace: Graphcore's choice of marking the tensor in place rather than a copy;
            accepted, no effect.
        **kwargs: Keras layer arguments.

    Example:
        >>> from ipu_tensorflow_addons.keras.layers import AssumeEqualAcrossReplicas
        >>> x = AssumeEqualAcrossReplicas()(np.ones((2, 3), "float32"))
    """

    def __init__(self, inplace: bool = False, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.inplace = bool(inplace)
        self.supports_masking = True
        no_effect("AssumeEqualAcrossReplicas", "inplace", self.inplace, False,
                  "XLA values have no in-place form to mark; the output equals the input")

    def call(self, inputs: Any, **kwargs: Any) -> Any:
        """The inputs, unchanged."""
        return inputs

    def compute_output_shape(self, input_shape: Any) -> Any:
        return input_shape

    def get_config(self) -> dict[str, Any]:
        """Keras's layer config plus ``inplace``."""
        return {**super().get_config(), "inplace": self.inplace}


__all__ = ["AssumeEqualAcrossReplicas"]
