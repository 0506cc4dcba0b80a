"""``ipu_tensorflow_addons.keras.layers`` normalizations: GroupNorm, InstanceNorm, LayerNorm
(and their long names), with Graphcore's constructors.

All three normalize each example by statistics of the example alone (no moving averages;
training and inference compute the same thing):

    GroupNormalization(groups=G)  the channels split into G groups; mean and variance over
                                  each group and all non-batch, non-channel axes
    InstanceNormalization         G = channels
    LayerNormalization(axis)      mean and variance over ``axis``: keras.layers.LayerNormalization

``strided_channel_grouping`` (Graphcore's default, True) is PopLibs' grouping: channel ``c`` is in
group ``c % G``. With False the groups are contiguous (channel ``c`` in group ``c // (C / G)``),
which is ``keras.layers.GroupNormalization``'s. Both are computed here, so weights trained on
an IPU keep their meaning. ``gamma_initializer``/``beta_initializer`` left at None start at
ones and zeros (Graphcore's None fell through to Keras's ``glorot_uniform``, which made an
untrained layer scale and shift at random).
"""

from __future__ import annotations

from typing import Any

import keras
from keras import ops

from tf_ipu.graphcore.addons.keras.layers._common import register


@register
class GroupNormalization(keras.layers.Layer):
    """Group normalization (Wu and He, 2018) with Graphcore's arguments and grouping.

    Args:
        groups: Number of groups; must divide the number of channels.
        channels_axis: The channel axis (not the batch axis 0).
        center: Add the learned offset ``beta``.
        scale: Multiply by the learned scale ``gamma``.
        epsilon: Added to the variance before the square root.
        beta_initializer: Initializer of ``beta`` (None: zeros).
        gamma_initializer: Initializer of ``gamma`` (None: ones).
        strided_channel_grouping: Group channel ``c`` with ``c % groups`` (PopLibs', the
            default) rather than contiguously (Keras's ``GroupNormalization``).
        trainable: Whether ``gamma`` and ``beta`` are trained.
        **kwargs: Keras layer arguments.

    Example:
        >>> from ipu_tensorflow_addons.keras.layers import GroupNorm
        >>> GroupNorm(groups=4)(np.random.rand(2, 5, 5, 8)).shape
        TensorShape([2, 5, 5, 8])
    """

    def __init__(self, groups: int = 2, channels_axis: int = -1, center: bool = True,
                 scale: bool = True, epsilon: float = 1e-3, beta_initializer: Any = None,
                 gamma_initializer: Any = None, strided_channel_grouping: bool = True,
                 trainable: bool = True, **kwargs: Any) -> None:
        super().__init__(trainable=trainable, **kwargs)
        if not isinstance(groups, int) or isinstance(groups, bool):
            raise ValueError(f"`groups` must be a positive integer. Received: groups={groups!r}")
        self.groups = groups
        self.channels_axis = channels_axis
        self.center = center
        self.scale = scale
        self.epsilon = epsilon
        self.beta_initializer = keras.initializers.get(beta_initializer or "zeros")
        self.gamma_initializer = keras.initializers.get(gamma_initializer or "ones")
        self.strided_channel_grouping = bool(strided_channel_grouping)
        self.supports_masking = True

    def _groups_for(self, channels: int) -> int:
        return self.groups

    def build(self, input_shape: tuple[int | None, ...]) -> None:
        rank = len(input_shape)
        axis = self.channels_axis + rank if self.channels_axis < 0 else self.channels_axis
        if not 0 < axis < rank:
            raise ValueError(
                f"`channels_axis` must name a non-batch axis of the input. Received: "
                f"channels_axis={self.channels_axis} for an input of shape {input_shape}")
        channels = input_shape[axis]
        if channels is None:
            raise ValueError(f"The channel axis {self.channels_axis} of the input must be "
                             f"known. Received: input shape {input_shape}")
        groups = self._groups_for(channels)
        if groups < 1 or groups > channels or channels % groups:
            raise ValueError(
                f"The number of groups ({groups}) must divide the number of channels "
                f"({channels}). Received: groups={groups}, channels={channels}")
        self._axis = axis
        self._channels = channels
        if self.scale:
            self.gamma = self.add_weight(shape=(channels,), name="gamma",
                                         initializer=self.gamma_initializer)
        else:
            self.gamma = None
        if self.center:
            self.beta = self.add_weight(shape=(channels,), name="beta",
                                        initializer=self.beta_initializer)
        else:
            self.beta = None

    def call(self, inputs: Any, training: bool | None = None) -> Any:
        """Normalizes ``inputs``; ``training`` changes nothing (no moving statistics)."""
        axis, channels = self._axis, self._channels
        groups = self._groups_for(channels)
        per_group = channels // groups
        # Split the channel axis so that one axis indexes the group: [.., C/G, G] when
        # strided (channel c = j * G + g), [.., G, C/G] when contiguous (c = g * C/G + j).
        split = (per_group, groups) if self.strided_channel_grouping else (groups, per_group)
        group_axis = axis + 1 if self.strided_channel_grouping else axis
        shape = ops.shape(inputs)
        grouped_shape = (*shape[:axis], *split, *shape[axis + 1:])
        dtype = inputs.dtype
        x = ops.cast(ops.reshape(inputs, grouped_shape), keras.backend.result_type(dtype,
                                                                                 "float32"))
        axes = [a for a in range(1, len(grouped_shape)) if a != group_axis]
        mean, variance = ops.moments(x, axes=axes, keepdims=True)
        # The per-channel parameters in the same grouped layout, broadcast over the rest.
        param_shape = [1] * len(grouped_shape)
        param_shape[axis], param_shape[axis + 1] = split
        inv = ops.rsqrt(variance + self.epsilon)
        if self.gamma is not None:
            inv = inv * ops.reshape(ops.cast(self.gamma, x.dtype), param_shape)
        offset = -mean * inv
        if self.beta is not None:
            offset = offset + ops.reshape(ops.cast(self.beta, x.dtype), param_shape)
        return ops.cast(ops.reshape(x * inv + offset, shape), dtype)

    def compute_output_shape(self, input_shape: tuple[int | None, ...]) -> tuple:
        return input_shape

    def get_config(self) -> dict[str, Any]:
        """Graphcore's arguments (initializers serialized) and Keras's layer arguments."""
        return {**super().get_config(), "groups": self.groups,
                "channels_axis": self.channels_axis, "center": self.center,
                "scale": self.scale, "epsilon": self.epsilon,
                "beta_initializer": keras.initializers.serialize(self.beta_initializer),
                "gamma_initializer": keras.initializers.serialize(self.gamma_initializer),
                "strided_channel_grouping": self.strided_channel_grouping}


@register
class InstanceNormalization(GroupNormalization):
    """Instance normalization (Ulyanov et al., 2016): ``GroupNormalization`` with one group
    per channel, each channel normalized over the example's other non-batch axes.

    Args:
        channels_axis: The channel axis.
        center, scale, epsilon, beta_initializer, gamma_initializer, trainable: as in
            ``GroupNormalization``.
        **kwargs: Keras layer arguments.

    Example:
        >>> from ipu_tensorflow_addons.keras.layers import InstanceNorm
        >>> y = InstanceNorm()(np.random.rand(2, 5, 5, 3))
    """

    def __init__(self, channels_axis: int = -1, center: bool = True, scale: bool = True,
                 epsilon: float = 1e-3, beta_initializer: Any = None,
                 gamma_initializer: Any = None, trainable: bool = True, **kwargs: Any) -> None:
        kwargs.pop("groups", None)
        kwargs.pop("strided_channel_grouping", None)
        super().__init__(groups=0, channels_axis=channels_axis, center=center, scale=scale,
                         epsilon=epsilon, beta_initializer=beta_initializer,
                         gamma_initializer=gamma_initializer, trainable=trainable, **kwargs)

    def _groups_for(self, channels: int) -> int:
        return channels

    def get_config(self) -> dict[str, Any]:
        """As ``GroupNormalization``'s, without ``groups`` and the grouping."""
        config = super().get_config()
        del config["groups"], config["strided_channel_grouping"]
        return config


@register
class LayerNormalization(keras.layers.LayerNormalization):
    """Layer normalization (Ba et al., 2016) with Graphcore's arguments:
    ``keras.layers.LayerNormalization``, the same weights and results.

    Args:
        axis: The axis or axes normalized over (default the last).
        epsilon: Added to the variance before the square root.
        center: Add the learned offset ``beta``.
        scale: Multiply by the learned scale ``gamma``.
        beta_initializer, gamma_initializer: Initializers (zeros and ones).
        beta_regularizer, gamma_regularizer, beta_constraint, gamma_constraint: as in Keras
            (honoured; Graphcore's layer refused them).
        trainable: Whether ``gamma`` and ``beta`` are trained.
        **kwargs: Keras layer arguments.

    Example:
        >>> from ipu_tensorflow_addons.keras.layers import LayerNorm
        >>> y = LayerNorm(axis=-1)(np.random.rand(2, 4, 8))
    """

    def __init__(self, axis: int | list[int] | tuple[int, ...] = -1, epsilon: float = 1e-3,
                 center: bool = True, scale: bool = True, beta_initializer: Any = "zeros",
                 gamma_initializer: Any = "ones", beta_regularizer: Any = None,
                 gamma_regularizer: Any = None, beta_constraint: Any = None,
                 gamma_constraint: Any = None, trainable: bool = True, **kwargs: Any) -> None:
        if not isinstance(axis, int | list | tuple):
            raise ValueError("Expected an int or a list/tuple of ints for the argument "
                             f"'axis'. Received: axis={axis!r}")
        super().__init__(axis=axis, epsilon=epsilon, center=center, scale=scale,
                         beta_initializer=beta_initializer, gamma_initializer=gamma_initializer,
                         beta_regularizer=beta_regularizer, gamma_regularizer=gamma_regularizer,
                         beta_constraint=beta_constraint, gamma_constraint=gamma_constraint,
                         trainable=trainable, **kwargs)


GroupNorm = GroupNormalization
InstanceNorm = InstanceNormalization
LayerNorm = LayerNormalization

__all__ = ["GroupNorm", "GroupNormalization", "InstanceNorm", "InstanceNormalization",
           "LayerNorm", "LayerNormalization"]
