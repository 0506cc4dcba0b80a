"""``ipu_tensorflow_addons.keras.layers.Embedding``: Keras's Embedding with Graphcore's
constructor (``serialization_factor``).

On an IPU, ``serialization_factor=n`` splits the lookup into ``n`` lookups of ``input_dim / n``
rows each, trading cycles for the temporary memory of one big lookup. The values are those of
one lookup, and that is what runs here: one gather. The factor is checked (it must divide
``input_dim``) and kept in the config; a factor above 1 is named once in a warning.
"""

from __future__ import annotations

from typing import Any

import keras

from tf_ipu.graphcore.addons.keras.layers._common import no_effect, register


@register
class Embedding(keras.layers.Embedding):
    """Turns integer indices into dense vectors: ``keras.layers.Embedding`` with Graphcore's
    arguments. Same weights (``embeddings``, ``[input_dim, output_dim]``) and results.

    Args:
        input_dim: Size of the vocabulary (largest index + 1).
        output_dim: Size of each embedding vector.
        embeddings_initializer: Initializer of the ``embeddings`` matrix.
        embeddings_regularizer: Regularizer of the ``embeddings`` matrix (honoured here;
            Graphcore's layer refused it).
        activity_regularizer: Regularizer of the output (honoured here; Graphcore refused it).
        embeddings_constraint: Constraint of the ``embeddings`` matrix (honoured here;
            Graphcore refused it).
        mask_zero: Whether index 0 is padding that downstream layers mask (honoured here;
            Graphcore refused it).
        input_length: Accepted and dropped, as Keras 3 does (shapes come from the inputs).
        serialization_factor: Into how many lookups Graphcore's IPU splits the lookup; must
            divide ``input_dim``. The values do not depend on it: one lookup here.
        **kwargs: Keras layer arguments (``name``, ``dtype``, ``trainable``, ...).

    Example:
        >>> from ipu_tensorflow_addons.keras.layers import Embedding
        >>> layer = Embedding(1000, 16, serialization_factor=4)
        >>> layer(np.array([[1, 2, 3]])).shape
        TensorShape([1, 3, 16])
    """

    def __init__(self, input_dim: int, output_dim: int,
                 embeddings_initializer: Any = "uniform", embeddings_regularizer: Any = None,
                 activity_regularizer: Any = None, embeddings_constraint: Any = None,
                 mask_zero: bool = False, input_length: int | None = None,
                 serialization_factor: int = 1, **kwargs: Any) -> None:
        if (not isinstance(serialization_factor, int) or isinstance(serialization_factor, bool)
                or serialization_factor < 1):
            raise ValueError("`serialization_factor` must be a positive integer. "
                             f"Received: serialization_factor={serialization_factor!r}")
        if isinstance(input_dim, int) and input_dim % serialization_factor:
            raise ValueError(
                f"`serialization_factor` ({serialization_factor}) must divide `input_dim` "
                f"({input_dim}): the lookup is split into {serialization_factor} equal parts. "
                f"Received: input_dim={input_dim}, serialization_factor={serialization_factor}")
        super().__init__(input_dim, output_dim, embeddings_initializer=embeddings_initializer,
                         embeddings_regularizer=embeddings_regularizer,
                         activity_regularizer=activity_regularizer,
                         embeddings_constraint=embeddings_constraint, mask_zero=mask_zero,
                         **kwargs)
        self.serialization_factor = serialization_factor
        no_effect("Embedding", "serialization_factor", serialization_factor, 1,
                  "the lookup is one gather; splitting it changes memory on an IPU, not values")
        no_effect("Embedding", "input_length", input_length, None,
                  "shapes come from the inputs (Keras 3 dropped the argument)")

    def get_config(self) -> dict[str, Any]:
        """Keras's config plus ``serialization_factor``."""
        return {**super().get_config(), "serialization_factor": self.serialization_factor}


__all__ = ["Embedding"]
