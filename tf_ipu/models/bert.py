"""A BERT encoder (Devlin et al., 2019) with Keras layers.

    encoder = bert_encoder()                        # BERT-base: 12 layers, 768 wide, 12 heads
    model = bert_classifier(encoder, classes=2)     # pooled [CLS] -> tanh Dense -> logits

``bert_encoder`` maps token ids ``(batch, seq_len)`` (int32) to the sequence output
``(batch, seq_len, hidden)``: token embedding plus a learned position embedding, then
LayerNormalization and dropout; then ``layers`` post-LN transformer blocks, each
``x = LN(x + Dropout(MultiHeadAttention(x, x)))`` and
``x = LN(x + Dropout(Dense(hidden)(gelu(Dense(intermediate)(x)))))`` with the exact (erf) GELU.
Not included: segment (token type) embeddings and attention masks (every sequence is one
segment of ``seq_len`` tokens). Initializers are BERT's (truncated normal, stddev 0.02);
LayerNormalization epsilon 1e-12.
"""

from __future__ import annotations

from typing import Any

import keras
from keras import layers

LN_EPSILON = 1e-12


def _init() -> keras.initializers.Initializer:
    return keras.initializers.TruncatedNormal(stddev=0.02)


@keras.saving.register_keras_serializable(package="tf_ipu")
class PositionEmbedding(layers.Layer):
    """Adds a learned embedding of each position, ``(seq_len, hidden)``, to its input."""

    def __init__(self, max_length: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.max_length = int(max_length)

    def build(self, input_shape: tuple[int | None, ...]) -> None:
        self.embeddings = self.add_weight(
            shape=(self.max_length, int(input_shape[-1])), initializer=_init(), name="embeddings"
        )

    def call(self, x: Any) -> Any:
        length = x.shape[-2]
        if length is None or length > self.max_length:
            raise ValueError(f"{self.name}: sequence length {length} (max {self.max_length})")
        return x + self.embeddings[:length]

    def get_config(self) -> dict[str, Any]:
        return {**super().get_config(), "max_length": self.max_length}


def bert_encoder(
    layers: int = 12,  # shadows the keras.layers module in this function only
    hidden: int = 768,
    heads: int = 12,
    seq_len: int = 128,
    vocab: int = 30522,
    *,
    intermediate: int | None = None,
    dropout: float = 0.1,
    name: str = "bert_encoder",
) -> keras.Model:
    """The encoder: ``(batch, seq_len)`` int32 token ids -> ``(batch, seq_len, hidden)``.

    ``intermediate`` is the feed-forward width (default ``4 * hidden``); ``dropout`` the rate
    of every Dropout (embeddings, attention probabilities, residual branches; 0 disables them).
    """
    return _encoder(layers, hidden, heads, seq_len, vocab, intermediate or 4 * hidden, dropout, name)


def _encoder(n_layers: int, hidden: int, heads: int, seq_len: int, vocab: int, inner: int,
             dropout: float, name: str) -> keras.Model:
    if hidden % heads:
        raise ValueError(f"bert_encoder: hidden ({hidden}) must be a multiple of heads ({heads})")
    ids = keras.Input((seq_len,), dtype="int32", name="input_ids")
    x = layers.Embedding(vocab, hidden, embeddings_initializer=_init(), name="token_embedding")(ids)
    x = PositionEmbedding(seq_len, name="position_embedding")(x)
    x = layers.LayerNormalization(epsilon=LN_EPSILON, name="embedding_norm")(x)
    x = layers.Dropout(dropout, name="embedding_dropout")(x)
    for i in range(n_layers):
        p = f"layer_{i}"
        attn = layers.MultiHeadAttention(
            heads, hidden // heads, dropout=dropout, kernel_initializer=_init(), name=f"{p}_attention"
        )(x, x)
        attn = layers.Dropout(dropout, name=f"{p}_attention_dropout")(attn)
        x = layers.LayerNormalization(epsilon=LN_EPSILON, name=f"{p}_attention_norm")(
            layers.Add(name=f"{p}_attention_add")([x, attn])
        )
        h = layers.Dense(inner, activation="gelu", kernel_initializer=_init(), name=f"{p}_intermediate")(x)
        h = layers.Dense(hidden, kernel_initializer=_init(), name=f"{p}_output")(h)
        h = layers.Dropout(dropout, name=f"{p}_output_dropout")(h)
        x = layers.LayerNormalization(epsilon=LN_EPSILON, name=f"{p}_output_norm")(
            layers.Add(name=f"{p}_output_add")([x, h])
        )
    return keras.Model(ids, x, name=name)


def bert_classifier(encoder: keras.Model, classes: int, *, name: str = "bert_classifier") -> keras.Model:
    """``encoder`` with BERT's pooler (the first token through a tanh Dense) and a dense
    classifier producing logits ``(batch, classes)``."""
    first = encoder.output[:, 0, :]
    pooled = layers.Dense(encoder.output.shape[-1], activation="tanh", kernel_initializer=_init(),
                          name="pooler")(first)
    logits = layers.Dense(classes, kernel_initializer=_init(), name="classifier")(pooled)
    return keras.Model(encoder.input, logits, name=name)
