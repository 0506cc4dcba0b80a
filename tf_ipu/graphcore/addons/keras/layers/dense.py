"""``ipu_tensorflow_addons.keras.layers.SerialDense`` (a Dense layer whose matmul is done as
``serialization_factor`` smaller ones, as Graphcore's was) and ``Dense``.

``Dense`` is Graphcore's FP8-capable Dense: for tensor inputs it is ``keras.layers.Dense``.
Its FP8 inputs (the ``[data, metadata]`` pair of ``ConvertToF8``) do not exist here (no FP8
type), so its FP8 arguments (``kernel_format``, ``kernel_scale``,
``kernel_data_initializer``) are checked, kept and named once in a warning.

With inputs ``[..., m, k]`` and the kernel ``[k, n]``, ``serialization_dimension`` picks the
dimension split into ``serialization_factor`` equal slices:

    "input_columns"              m: slices of the inputs' rows, results concatenated
    "input_rows_kernel_columns"  k: slices of both, partial products summed in order
    "kernel_rows"                n: slices of the kernel's columns, results concatenated

The pieces are separate matmuls in the lowered program, so the device plans and sizes each
on its own (the point of serializing: smaller temporaries). The values are a Dense layer's
(up to the summation order when ``k`` is split). The gradients are those of the sliced
program. When ``m`` is unknown at trace time (a ``None`` batch outside the IPU) the layer
does one matmul; programs for the device always have static shapes.
"""

from __future__ import annotations

from typing import Any

import keras
from keras import ops

from tf_ipu.graphcore.addons.keras.layers._common import no_effect, register

DIMENSIONS = ("input_columns", "input_rows_kernel_columns", "kernel_rows")


@register
class SerialDense(keras.layers.Dense):
    """``output = activation(inputs @ kernel + bias)`` with the matmul serialized.

    Args:
        units: Size of the output.
        serialization_factor: Number of smaller matmuls; must divide the serialized dimension.
        serialization_dimension: ``"input_columns"``, ``"input_rows_kernel_columns"`` or
            ``"kernel_rows"`` (see the module docstring).
        activation, use_bias, kernel_initializer, bias_initializer, kernel_regularizer,
        bias_regularizer, activity_regularizer, kernel_constraint, bias_constraint: as in
            ``keras.layers.Dense`` (same weights: ``kernel [k, units]``, ``bias [units]``).
        **kwargs: Keras layer arguments.

    Example:
        >>> from ipu_tensorflow_addons.keras.layers import SerialDense
        >>> layer = SerialDense(32, serialization_factor=4, serialization_dimension="kernel_rows")
        >>> layer(np.ones((8, 16), "float32")).shape
        TensorShape([8, 32])
    """

    def __init__(self, units: int, serialization_factor: int, serialization_dimension: str,
                 activation: Any = None, use_bias: bool = True,
                 kernel_initializer: Any = "glorot_uniform", bias_initializer: Any = "zeros",
                 kernel_regularizer: Any = None, bias_regularizer: Any = None,
                 activity_regularizer: Any = None, kernel_constraint: Any = None,
                 bias_constraint: Any = None, **kwargs: Any) -> None:
        if "input_shape" not in kwargs and "input_dim" in kwargs:
            kwargs["input_shape"] = (kwargs.pop("input_dim"),)
        factor = int(serialization_factor)
        if factor < 1:
            raise ValueError("serialization_factor has to be at least 1. "
                             f"Received: serialization_factor={serialization_factor!r}")
        if serialization_dimension not in DIMENSIONS:
            raise ValueError(f"Invalid serialization_dimension, expected one of {DIMENSIONS}. "
                             f"Received: serialization_dimension={serialization_dimension!r}")
        units = int(units)
        if serialization_dimension == "kernel_rows" and units % factor:
            raise ValueError(f"serialization_factor ({factor}) must divide units ({units}), "
                             "the dimension serialized by 'kernel_rows'. Received: "
                             f"units={units}, serialization_factor={factor}")
        super().__init__(units, activation=activation, use_bias=use_bias,
                         kernel_initializer=kernel_initializer,
                         bias_initializer=bias_initializer,
                         kernel_regularizer=kernel_regularizer,
                         bias_regularizer=bias_regularizer,
                         activity_regularizer=activity_regularizer,
                         kernel_constraint=kernel_constraint, bias_constraint=bias_constraint,
                         **kwargs)
        self.serialization_factor = factor
        self.serialization_dimension = serialization_dimension

    def build(self, input_shape: tuple[int | None, ...]) -> None:
        k = input_shape[-1]
        if (self.serialization_dimension == "input_rows_kernel_columns" and k is not None
                and k % self.serialization_factor):
            raise ValueError(
                f"serialization_factor ({self.serialization_factor}) must divide the inputs' "
                f"last dimension ({k}), the dimension serialized by "
                f"'input_rows_kernel_columns'. Received: input shape {tuple(input_shape)}")
        super().build(input_shape)

    def _matmul(self, inputs: Any) -> Any:
        factor, kernel = self.serialization_factor, self.kernel
        if factor == 1:
            return ops.matmul(inputs, kernel)
        if self.serialization_dimension == "kernel_rows":
            size = self.units // factor
            return ops.concatenate([ops.matmul(inputs, kernel[:, i * size:(i + 1) * size])
                                    for i in range(factor)], axis=-1)
        if self.serialization_dimension == "input_rows_kernel_columns":
            size = kernel.shape[0] // factor
            out = ops.matmul(inputs[..., :size], kernel[:size])
            for i in range(1, factor):
                out = out + ops.matmul(inputs[..., i * size:(i + 1) * size],
                                       kernel[i * size:(i + 1) * size])
            return out
        m = inputs.shape[-2]
        if m is None:  # traced with an unknown batch: values are the same unsplit
            return ops.matmul(inputs, kernel)
        if m % factor:
            raise ValueError(
                f"serialization_factor ({factor}) must divide the inputs' rows ({m}), the "
                f"dimension serialized by 'input_columns'. Received: input shape "
                f"{tuple(inputs.shape)}")
        size = m // factor
        return ops.concatenate([ops.matmul(inputs[..., i * size:(i + 1) * size, :], kernel)
                                for i in range(factor)], axis=-2)

    def call(self, inputs: Any, training: bool | None = None) -> Any:
        """``activation(serialized_matmul(inputs, kernel) + bias)``."""
        x = self._matmul(inputs)
        if self.bias is not None:
            x = ops.add(x, self.bias)
        if self.activation is not None:
            x = self.activation(x)
        return x

    def get_config(self) -> dict[str, Any]:
        """Keras's Dense config plus the serialization arguments."""
        return {**super().get_config(), "serialization_factor": self.serialization_factor,
                "serialization_dimension": self.serialization_dimension}


_NO_FP8 = "it describes FP8 kernels, and this project has no FP8 type"


@register
class Dense(keras.layers.Dense):
    """``keras.layers.Dense`` under Graphcore's name, taking its FP8 arguments.

    Args:
        units: Size of the output.
        kernel_format: Graphcore's FP8 format of the kernel; no effect here.
        kernel_scale: Graphcore's FP8 kernel scale, in ``[-32, 31]``; no effect here.
        kernel_data_initializer: Initializer of Graphcore's FP8 kernel data; no effect here.
        **kwargs: ``keras.layers.Dense``'s arguments (same weights and results).

    Example:
        >>> from ipu_tensorflow_addons.keras.layers import Dense
        >>> Dense(3)(np.ones((2, 4), "float32")).shape
        TensorShape([2, 3])
    """

    def __init__(self, units: int, kernel_format: Any = None, kernel_scale: int = 0,
                 kernel_data_initializer: Any = None, **kwargs: Any) -> None:
        if not -32 <= int(kernel_scale) <= 31:
            raise ValueError("`kernel_scale` should be in the range [-32, 31]. "
                             f"Received: kernel_scale={kernel_scale!r}")
        super().__init__(units, **kwargs)
        self.kernel_format = None if kernel_format is None else str(kernel_format)
        self.kernel_scale = int(kernel_scale)
        self.kernel_data_initializer = kernel_data_initializer
        no_effect("Dense", "kernel_format", kernel_format, None, _NO_FP8)
        no_effect("Dense", "kernel_scale", self.kernel_scale, 0, _NO_FP8)
        no_effect("Dense", "kernel_data_initializer", kernel_data_initializer, None, _NO_FP8)

    def get_config(self) -> dict[str, Any]:
        """Keras's Dense config plus ``kernel_format`` and ``kernel_scale`` (not
        ``kernel_data_initializer``: FP8 kernel data has no form here)."""
        return {**super().get_config(), "kernel_format": self.kernel_format,
                "kernel_scale": self.kernel_scale}


__all__ = ["Dense", "SerialDense"]
