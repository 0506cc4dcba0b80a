"""``ipu_tensorflow_addons.keras.layers.PopnnLSTM`` / ``LSTM`` and ``PopnnGRU`` / ``GRU``:
Keras's LSTM and GRU with Graphcore's constructors.

Graphcore ran these on PopLibs' fused LSTM/GRU kernels; its weights have Keras's layout, so
``set_weights(keras_layer.get_weights())`` carries a model over (its own tests do that).
Here the layers *are* Keras's LSTM and GRU, so the layout is Keras's by construction:

    kernel            [input_size, gates * units]   gates in Keras's order:
    recurrent_kernel  [units, gates * units]          LSTM  i, f, c, o   (4)
    bias ("biases")   [gates * units]                 GRU   z, r, h      (3)
                      [2, 3 * units] for GRU(reset_after=True): input and recurrent biases

and XLA lowers the recurrence to one ``while`` loop that the emulator runs step by step.

The weights are read once, before the loop, as PopLibs' kernel takes them as operands: the
step reads those tensors (loop-invariant captures), not the variables. Keras's cell reads
each variable inside the step, and TF's while-loop gradient then keeps a copy of every value
the backward pass needs *per step*, the kernels included (a variable read in the body is a
per-step tensor to it): ``[steps, input_size, gates * units]`` and
``[steps, units, gates * units]`` stacks that PopnnLSTM never holds (the recomputation
tutorial's 2,048 steps of 512 features, 256 units: 2 MB + 1 MB per step). Read outside, the
backward captures them once, and the per-step stash is the step's input, states and gates,
as PopLibs' intermediates. The values are the same ops on the same values. The loop runs in
a name scope naming PopLibs' kernel (``tf_ipu_popnn_lstm``, ``tf_ipu_popnn_gru``,
``tf_ipu_popnn_gru_reset_after``), from which the tile model lays out the loop's sequences
and sizes its backward pass as PopLibs does (``device_server/emulator/tiles/rnn.py``).

What Graphcore's layers add, and what it does here:

- ``time_major=True``: inputs and sequence outputs are ``[time, batch, features]``; the layer
  transposes around Keras's batch-major loop.
- ``seed``: seeds the kernel and recurrent initializers (those that take a seed and have none).
- ``dropout_seed``: Graphcore's pair of integers seeding the input-dropout masks; here the
  initial state of the layer's Keras ``SeedGenerator`` (the same pair gives the same masks).
  Dropout itself is Keras's: one mask per sequence on the inputs, the same at every step, as
  Graphcore's layer applied it.
- ``partials_dtype``, ``available_memory_proportion_fwd/bwd``, ``options``, ``options_bwd``,
  ``implementation``: planning hints for PopLibs' kernel. Accepted, kept in the config, and
  named once in a warning when set away from their defaults; they change no value.
- Arguments Graphcore refused (regularizers, constraints, ``use_bias=False``,
  ``recurrent_dropout``, ``go_backwards``, ``unroll``, masks) are honoured, as Keras does.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import keras
import tensorflow as tf
from keras import ops

from tf_ipu.graphcore.addons.keras.layers._common import (
    initializer,
    no_effect,
    register,
    seed_pair,
    start_seed_generator,
)

_PLANNING = "it steers PopLibs' planning of its fused kernel, which does not run here"
_PARTIALS = ("the recurrence's matmuls accumulate as XLA lowered them; "
             "IPUConfig.matmuls.partials_type sets the partials of every matmul")


def _partials_name(partials_dtype: Any) -> str:
    name = keras.backend.standardize_dtype(partials_dtype)
    if name not in ("float16", "float32"):
        raise ValueError("`partials_dtype` must be float16 or float32. "
                         f"Received: partials_dtype={partials_dtype!r}")
    return name


#: The cell attributes holding the weights its step reads (Keras's LSTMCell and GRUCell).
_LOOP_WEIGHTS = ("kernel", "recurrent_kernel", "bias")


@contextlib.contextmanager
def _weights_read_once(cell: keras.layers.Layer, names: tuple[str, ...]) -> Iterator[None]:
    """Within the block, ``cell.<name>`` is the variable's value read once here (cast as the
    layer's autocast scope casts it, so the step casts nothing) instead of the variable, so
    the recurrent loop captures a loop-invariant tensor rather than reading the variable at
    every step. The variables are put back on exit; nothing else about the cell changes."""
    saved = {}
    for name in names:
        var = getattr(cell, name, None)
        if isinstance(var, keras.Variable):
            saved[name] = var
    try:
        for name, var in saved.items():
            # Past Keras's attribute tracking: the cell keeps tracking the variable.
            object.__setattr__(cell, name, tf.convert_to_tensor(var.value))
        yield
    finally:
        for name, var in saved.items():
            object.__setattr__(cell, name, var)


def _swap_time_batch(shape: Any) -> Any:
    return None if shape is None else (shape[1], shape[0], *shape[2:])


class _PopnnRNN:
    """Graphcore's extras over a Keras RNN layer (mixed in before ``keras.layers.LSTM``/``GRU``):
    ``time_major``, the PopLibs planning arguments and Graphcore's attribute names."""

    _GRAPHCORE_NAME = ""

    def _popnn_setup(self, *, seed: int | None, dropout_seed: list[int] | None,
                     time_major: bool, partials_dtype: str, implementation: int,
                     available_memory_proportion_fwd: float | None,
                     available_memory_proportion_bwd: float | None,
                     options: dict[str, Any] | None, options_bwd: dict[str, Any] | None) -> None:
        name = self._GRAPHCORE_NAME
        self.time_major = bool(time_major)
        self._init_seed = seed
        self._dropout_seed = dropout_seed
        self._partials_dtype = partials_dtype
        self._implementation = implementation
        self._amp_fwd = available_memory_proportion_fwd
        self._amp_bwd = available_memory_proportion_bwd
        self._options = dict(options or {})
        self._options_bwd = dict(options_bwd or {})
        if dropout_seed is not None:
            start_seed_generator(self.cell.seed_generator, dropout_seed)
        no_effect(name, "partials_dtype", partials_dtype, "float32", _PARTIALS)
        no_effect(name, "implementation", implementation, 2,
                  "both implementations compute the same values; Keras's fused one runs")
        for arg, value in (("available_memory_proportion_fwd", available_memory_proportion_fwd),
                           ("available_memory_proportion_bwd", available_memory_proportion_bwd)):
            if value not in (None, -1, -1.0):
                no_effect(name, arg, value, None, _PLANNING)
        no_effect(name, "options", self._options, {}, _PLANNING)
        no_effect(name, "options_bwd", self._options_bwd, {}, _PLANNING)

    # Graphcore's attribute names.
    @property
    def num_units(self) -> int:
        """``units`` (Graphcore's name)."""
        return self.cell.units

    @property
    def kernel(self) -> keras.Variable:
        """The input kernel, ``[input_size, gates * units]``."""
        return self.cell.kernel

    @property
    def recurrent_kernel(self) -> keras.Variable:
        """The recurrent kernel, ``[units, gates * units]``."""
        return self.cell.recurrent_kernel

    @property
    def biases(self) -> keras.Variable | None:
        """The bias (Graphcore's name; Keras calls it ``bias``)."""
        return self.cell.bias

    def _popnn_scope(self) -> str:
        """The name scope of the recurrent loop, which tells the tile model that the loop is
        PopLibs' kernel of this kind (``device_server/emulator/tiles/rnn.py``)."""
        if isinstance(self, keras.layers.GRU):
            return "tf_ipu_popnn_gru_reset_after" if self.cell.reset_after else "tf_ipu_popnn_gru"
        return "tf_ipu_popnn_lstm"

    def inner_loop(self, sequences: Any, initial_state: Any, mask: Any,
                   training: bool = False) -> Any:
        """Keras's recurrence, with the cell's weights read once before the loop (see the
        module docstring), in a name scope that names PopLibs' kernel it stands for (the tile
        model lays out its sequences and sizes its backward pass as PopLibs does)."""
        with _weights_read_once(self.cell, _LOOP_WEIGHTS), tf.name_scope(self._popnn_scope()):
            return super().inner_loop(sequences, initial_state, mask, training=training)

    def build(self, sequences_shape: Any, initial_state_shape: Any = None) -> None:
        if self.time_major:
            sequences_shape = _swap_time_batch(sequences_shape)
        super().build(sequences_shape, initial_state_shape)

    def call(self, sequences: Any, initial_state: Any = None, mask: Any = None,
             training: bool = False) -> Any:
        if self.time_major:
            sequences = ops.transpose(sequences, (1, 0, 2))
            if mask is not None:
                mask = ops.transpose(mask, (1, 0))
        out = super().call(sequences, initial_state=initial_state, mask=mask, training=training)
        if not (self.time_major and self.return_sequences):
            return out
        if self.return_state:
            return (ops.transpose(out[0], (1, 0, 2)), *out[1:])
        return ops.transpose(out, (1, 0, 2))

    def compute_output_shape(self, sequences_shape: Any, initial_state_shape: Any = None) -> Any:
        if not self.time_major:
            return super().compute_output_shape(sequences_shape, initial_state_shape)
        shapes = super().compute_output_shape(_swap_time_batch(sequences_shape),
                                              initial_state_shape)
        if not self.return_sequences:
            return shapes
        if self.return_state:
            return (_swap_time_batch(shapes[0]), *shapes[1:])
        return _swap_time_batch(shapes)

    def _popnn_config(self, config: dict[str, Any]) -> dict[str, Any]:
        config = dict(config)
        config.update({
            "seed": self._init_seed,
            "dropout_seed": self._dropout_seed,
            "time_major": self.time_major,
            "partials_dtype": self._partials_dtype,
            "implementation": self._implementation,
            "available_memory_proportion_fwd": self._amp_fwd,
            "available_memory_proportion_bwd": self._amp_bwd,
            "options": dict(self._options),
            "options_bwd": dict(self._options_bwd),
        })
        return config


@register
class PopnnLSTM(_PopnnRNN, keras.layers.LSTM):
    """Long Short-Term Memory layer with Graphcore's arguments: ``keras.layers.LSTM``, plus
    ``time_major``; the same weights (Keras's layout, gates i, f, c, o) and the same results.

    Args:
        units: Size of the output and of each state.
        activation: Activation of the cell candidate and output (default ``"tanh"``).
        recurrent_activation: Activation of the gates (default ``"sigmoid"``).
        use_bias: Whether the layer has a bias.
        kernel_initializer: Initializer of ``kernel``.
        recurrent_initializer: Initializer of ``recurrent_kernel``.
        bias_initializer: Initializer of the bias.
        unit_forget_bias: Adds 1 to the forget gate's bias at initialization.
        kernel_regularizer, recurrent_regularizer, bias_regularizer, activity_regularizer,
        kernel_constraint, recurrent_constraint, bias_constraint: as in Keras (honoured;
            Graphcore's layer refused them).
        dropout: Fraction of the inputs dropped in training (one mask per sequence).
        dropout_seed: Graphcore's pair of integers seeding the dropout masks (see the module
            docstring), or None.
        recurrent_dropout: Fraction of the recurrent state dropped (honoured; Graphcore refused).
        implementation: Accepted (1 or 2); the values do not depend on it.
        return_sequences: Return the whole output sequence, not only the last output.
        return_state: Also return the last ``h`` and ``c`` states: ``(output, h, c)``.
        go_backwards, stateful, unroll: as in Keras.
        partials_dtype: PopLibs' partials type (``float32`` or ``float16``); no effect here.
        seed: Seed of the kernel and recurrent initializers.
        time_major: Inputs and sequence outputs are ``[time, batch, features]``.
        available_memory_proportion_fwd, available_memory_proportion_bwd, options,
        options_bwd: PopLibs planning options; no effect here.
        **kwargs: Keras layer arguments (``name``, ``dtype``, ``use_cudnn``, ...).

    Example:
        >>> from ipu_tensorflow_addons.keras.layers import LSTM
        >>> lstm = LSTM(8, return_sequences=True, time_major=True)
        >>> lstm(np.zeros((5, 2, 3), "float32")).shape  # [time, batch, units]
        TensorShape([5, 2, 8])
    """

    _GRAPHCORE_NAME = "PopnnLSTM"

    def __init__(self, units: int, activation: Any = "tanh",
                 recurrent_activation: Any = "sigmoid", use_bias: bool = True,
                 kernel_initializer: Any = "glorot_uniform",
                 recurrent_initializer: Any = "orthogonal", bias_initializer: Any = "zeros",
                 unit_forget_bias: bool = True, kernel_regularizer: Any = None,
                 recurrent_regularizer: Any = None, bias_regularizer: Any = None,
                 activity_regularizer: Any = None, kernel_constraint: Any = None,
                 recurrent_constraint: Any = None, bias_constraint: Any = None,
                 dropout: float = 0.0, dropout_seed: Any = None, recurrent_dropout: float = 0.0,
                 implementation: int = 2, return_sequences: bool = False,
                 return_state: bool = False, go_backwards: bool = False, stateful: bool = False,
                 unroll: bool = False, partials_dtype: Any = "float32", seed: int | None = None,
                 time_major: bool = False, available_memory_proportion_fwd: float | None = None,
                 available_memory_proportion_bwd: float | None = None,
                 options: dict[str, Any] | None = None,
                 options_bwd: dict[str, Any] | None = None, **kwargs: Any) -> None:
        pair = seed_pair(dropout_seed, "dropout_seed")
        super().__init__(
            units, activation=activation, recurrent_activation=recurrent_activation,
            use_bias=use_bias, kernel_initializer=initializer(kernel_initializer, seed),
            recurrent_initializer=initializer(recurrent_initializer, seed),
            bias_initializer=bias_initializer, unit_forget_bias=unit_forget_bias,
            kernel_regularizer=kernel_regularizer, recurrent_regularizer=recurrent_regularizer,
            bias_regularizer=bias_regularizer, activity_regularizer=activity_regularizer,
            kernel_constraint=kernel_constraint, recurrent_constraint=recurrent_constraint,
            bias_constraint=bias_constraint, dropout=dropout,
            recurrent_dropout=recurrent_dropout, seed=None if pair is None else pair[0],
            return_sequences=return_sequences, return_state=return_state,
            go_backwards=go_backwards, stateful=stateful, unroll=unroll, **kwargs)
        self._popnn_setup(seed=seed, dropout_seed=pair, time_major=time_major,
                          partials_dtype=_partials_name(partials_dtype),
                          implementation=implementation,
                          available_memory_proportion_fwd=available_memory_proportion_fwd,
                          available_memory_proportion_bwd=available_memory_proportion_bwd,
                          options=options, options_bwd=options_bwd)

    def state_shape(self, batch_size: int) -> tuple[list[int], list[int]]:
        """Shapes of the ``h`` and ``c`` states for ``batch_size``."""
        return [batch_size, self.units], [batch_size, self.units]

    def get_config(self) -> dict[str, Any]:
        """Keras's LSTM config plus Graphcore's arguments (``seed`` is the initializers')."""
        return self._popnn_config(super().get_config())


@register
class PopnnGRU(_PopnnRNN, keras.layers.GRU):
    """Gated Recurrent Unit layer with Graphcore's arguments: ``keras.layers.GRU``, plus
    ``time_major``; the same weights (Keras's layout, gates z, r, h) and the same results.

    ``reset_after=True`` (the default, as in Keras) applies the reset gate after the recurrent
    matmul and has a ``[2, 3 * units]`` bias (input and recurrent); ``reset_after=False``
    applies it before, with a ``[3 * units]`` bias.

    Args:
        units: Size of the output and of the state.
        activation: Activation of the candidate (default ``"tanh"``).
        recurrent_activation: Activation of the gates (default ``"sigmoid"``).
        use_bias, kernel_initializer, recurrent_initializer, bias_initializer,
        kernel_regularizer, recurrent_regularizer, bias_regularizer, activity_regularizer,
        kernel_constraint, recurrent_constraint, bias_constraint: as in Keras.
        dropout: Fraction of the inputs dropped in training (one mask per sequence).
        dropout_seed: Graphcore's pair of integers seeding the dropout masks, or None.
        recurrent_dropout: Fraction of the recurrent state dropped (honoured).
        implementation: Accepted (1 or 2); the values do not depend on it.
        return_sequences: Return the whole output sequence.
        return_state: Also return the last state: ``(output, state)``.
        go_backwards, stateful, unroll: as in Keras.
        reset_after: Where the reset gate applies (see above).
        seed: Seed of the kernel and recurrent initializers.
        partials_dtype: PopLibs' partials type; no effect here.
        time_major: Inputs and sequence outputs are ``[time, batch, features]``.
        available_memory_proportion_fwd, available_memory_proportion_bwd, options,
        options_bwd: PopLibs planning options; no effect here.
        **kwargs: Keras layer arguments.

    Example:
        >>> from ipu_tensorflow_addons.keras.layers import GRU
        >>> output, state = GRU(8, return_state=True)(np.zeros((2, 5, 3), "float32"))
    """

    _GRAPHCORE_NAME = "PopnnGRU"

    def __init__(self, units: int, activation: Any = "tanh",
                 recurrent_activation: Any = "sigmoid", use_bias: bool = True,
                 kernel_initializer: Any = "glorot_uniform",
                 recurrent_initializer: Any = "orthogonal", bias_initializer: Any = "zeros",
                 kernel_regularizer: Any = None, recurrent_regularizer: Any = None,
                 bias_regularizer: Any = None, activity_regularizer: Any = None,
                 kernel_constraint: Any = None, recurrent_constraint: Any = None,
                 bias_constraint: Any = None, dropout: float = 0.0, dropout_seed: Any = None,
                 recurrent_dropout: float = 0.0, implementation: int = 2,
                 return_sequences: bool = False, return_state: bool = False,
                 go_backwards: bool = False, stateful: bool = False, unroll: bool = False,
                 reset_after: bool = True, seed: int | None = None,
                 partials_dtype: Any = "float32", time_major: bool = False,
                 available_memory_proportion_fwd: float | None = None,
                 available_memory_proportion_bwd: float | None = None,
                 options: dict[str, Any] | None = None,
                 options_bwd: dict[str, Any] | None = None, **kwargs: Any) -> None:
        pair = seed_pair(dropout_seed, "dropout_seed")
        super().__init__(
            units, activation=activation, recurrent_activation=recurrent_activation,
            use_bias=use_bias, kernel_initializer=initializer(kernel_initializer, seed),
            recurrent_initializer=initializer(recurrent_initializer, seed),
            bias_initializer=bias_initializer, kernel_regularizer=kernel_regularizer,
            recurrent_regularizer=recurrent_regularizer, bias_regularizer=bias_regularizer,
            activity_regularizer=activity_regularizer, kernel_constraint=kernel_constraint,
            recurrent_constraint=recurrent_constraint, bias_constraint=bias_constraint,
            dropout=dropout, recurrent_dropout=recurrent_dropout,
            seed=None if pair is None else pair[0], return_sequences=return_sequences,
            return_state=return_state, go_backwards=go_backwards, stateful=stateful,
            unroll=unroll, reset_after=reset_after, **kwargs)
        self._popnn_setup(seed=seed, dropout_seed=pair, time_major=time_major,
                          partials_dtype=_partials_name(partials_dtype),
                          implementation=implementation,
                          available_memory_proportion_fwd=available_memory_proportion_fwd,
                          available_memory_proportion_bwd=available_memory_proportion_bwd,
                          options=options, options_bwd=options_bwd)

    def state_shape(self, batch_size: int) -> list[int]:
        """Shape of the state for ``batch_size``."""
        return [batch_size, self.units]

    def get_config(self) -> dict[str, Any]:
        """Keras's GRU config plus Graphcore's arguments (``seed`` is the initializers')."""
        return self._popnn_config(super().get_config())


LSTM = PopnnLSTM
GRU = PopnnGRU

__all__ = ["GRU", "LSTM", "PopnnGRU", "PopnnLSTM"]
