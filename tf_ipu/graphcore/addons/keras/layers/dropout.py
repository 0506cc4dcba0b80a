"""``ipu_tensorflow_addons.keras.layers.Dropout``: Keras's Dropout with Graphcore's seed and
rate rules.

In training each element is dropped with probability ``rate`` and the kept ones are scaled by
``1 / (1 - rate)``; in inference the layer is the identity. ``seed`` is Graphcore's pair of
integers (it seeds the masks: the same pair gives the same masks) or Keras's integer (then the
layer is ``keras.layers.Dropout(rate, seed=seed)``); with no seed it draws from Keras's global
seed, exactly as ``keras.layers.Dropout``. ``ref`` (Graphcore's switch between keeping the mask
for the backward pass and regenerating it from the seed) changes no value and is only kept.
"""

from __future__ import annotations

from typing import Any

import keras

from tf_ipu.graphcore.addons.keras.layers._common import (
    no_effect,
    register,
    seed_pair,
    start_seed_generator,
)


@register
class Dropout(keras.layers.Dropout):
    """Dropout with Graphcore's arguments: ``keras.layers.Dropout`` whose ``seed`` may be
    Graphcore's pair of integers.

    Args:
        rate: Fraction of the inputs to drop, in ``[0, 1)`` (Graphcore's range).
        noise_shape: Shape of the binary mask broadcast over the inputs (Keras's rules:
            ``None`` entries take the input's size).
        seed: A pair of integers (Graphcore), an integer (Keras), or None.
        **kwargs: Keras layer arguments; Graphcore's ``ref`` is accepted.

    Example:
        >>> from ipu_tensorflow_addons.keras.layers import Dropout
        >>> drop = Dropout(0.5, seed=[42, 42])
        >>> y = drop(np.ones((2, 8), "float32"), training=True)  # 0 or 2 each
    """

    def __init__(self, rate: float, noise_shape: Any = None, seed: Any = None,
                 **kwargs: Any) -> None:
        self.ref = bool(kwargs.pop("ref", True))
        if not 0.0 <= float(rate) < 1.0:
            raise ValueError(f"The rate must be in the range [0, 1), but was {rate}. "
                             f"Received: rate={rate}")
        pair = None if seed is None or isinstance(seed, int) else seed_pair(seed, "seed")
        super().__init__(rate, noise_shape=noise_shape,
                         seed=pair[0] if pair is not None else seed, **kwargs)
        self.seed = pair if pair is not None else seed
        if pair is not None and rate > 0:
            start_seed_generator(self.seed_generator, pair)
        no_effect("Dropout", "ref", self.ref, True,
                  "the mask is whatever XLA keeps for the backward pass")

    def get_config(self) -> dict[str, Any]:
        """Keras's config (``seed`` as given) plus ``ref``."""
        return {**super().get_config(), "ref": self.ref}


__all__ = ["Dropout"]
