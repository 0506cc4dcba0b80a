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

Two options follow Graphcore's PopART BERT (the MLPerf submissions' model definition) where
Keras's defaults differ; neither changes what the model computes beyond rounding:

* ``softmax_in_compute_dtype=True``: the attention scores, their softmax and the
  probabilities stay in the layer's compute dtype (``FP16Attention``). Keras's
  ``MultiHeadAttention`` computes them in FP32 when dropout is off (``ops.dot_product_attention``
  casts the scores to FP32 for the softmax, then the probabilities back), which holds an FP32
  and an FP16 copy of every ``(batch, heads, seq_len, seq_len)`` probability tensor; PopART's
  BERT keeps one FP16 copy: in ``bert_model.py``'s attention (graphcore/examples
  ``applications/popart/bert``, and each MLPerf submission's copy) the scores' matmul, the
  ``1/sqrt(head size)`` scale, the mask's add and ``aiOnnx.softmax`` are all in the model's
  ``popart_dtype`` (FLOAT16).
* ``checkpoints``: ``RecomputationCheckpoint`` layers (``ipu_tensorflow_addons``) after the
  blocks named, as PopART's ``builder.checkpointOutput`` in ``bert_model.py``'s
  ``build_graph``: ``"every_layer"`` after each layer's output, or ``(layer, "attention" |
  "ffn")`` pairs, after that layer's attention block (``layer_{i}_attention_checkpoint``) or
  feed-forward block (``layer_{i}_output_checkpoint``). They are the identity; a pipelined
  model trained with recomputation in ``RecomputeAndBackpropagateInterleaved`` stashes them
  and recomputes from them (docs/tile_model.md, "Recomputation").
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import keras
from keras import layers, ops

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


@keras.saving.register_keras_serializable(package="tf_ipu")
class FP16Attention(layers.MultiHeadAttention):
    """``MultiHeadAttention`` whose scores, softmax and probabilities stay in the layer's
    compute dtype (FP16 under a ``float16`` or ``mixed_float16`` policy), as PopART's BERT
    computes them (module docstring); the projections are Keras's. Keras's own attention
    computes the scores and the softmax in FP32 when dropout is off. The softmax is Keras's
    ``Softmax`` layer on the compute dtype (TensorFlow's lowering sums each row in FP32 and
    divides in the compute dtype)."""

    def _compute_attention(self, query: Any, key: Any, value: Any, attention_mask: Any = None,
                           training: Any = None, return_attention_scores: bool = False,
                           use_causal_mask: bool = False, **kwargs: Any) -> tuple[Any, Any]:
        """Keras's documented override point: the attention of projected ``query``, ``key``
        and ``value`` (``(batch, seq, heads, size)``), in ``query``'s dtype throughout."""
        if use_causal_mask:
            causal = self._compute_causal_mask(query, value)
            attention_mask = causal if attention_mask is None else ops.logical_and(
                ops.cast(attention_mask, "bool"), causal)
        query = ops.multiply(query, ops.cast(self._inverse_sqrt_key_dim, query.dtype))
        scores = ops.einsum(self._dot_product_equation, key, query)  # (batch, heads, T, S)
        probs = self._masked_softmax(scores, attention_mask)  # Keras's Softmax, in scores' dtype
        kept = self._dropout_layer(probs, training=training) if self._dropout > 0.0 else probs
        return ops.einsum(self._combine_equation, kept, value), probs


def bert_encoder(
    layers: int = 12,  # shadows the keras.layers module in this function only
    hidden: int = 768,
    heads: int = 12,
    seq_len: int = 128,
    vocab: int = 30522,
    *,
    intermediate: int | None = None,
    dropout: float = 0.1,
    softmax_in_compute_dtype: bool = False,
    checkpoints: str | Iterable[tuple[int, str]] | None = None,
    name: str = "bert_encoder",
) -> keras.Model:
    """The encoder: ``(batch, seq_len)`` int32 token ids -> ``(batch, seq_len, hidden)``.

    ``intermediate`` is the feed-forward width (default ``4 * hidden``); ``dropout`` the rate
    of every Dropout (embeddings, attention probabilities, residual branches; 0 disables them).
    ``softmax_in_compute_dtype``: attention probabilities in the compute dtype (``FP16Attention``,
    PopART's BERT) instead of Keras's FP32 softmax. ``checkpoints``: recomputation checkpoints
    after the blocks named: ``"every_layer"`` (each layer's output), or ``(layer, "attention" |
    "ffn")`` pairs (module docstring).

    Raises:
        ValueError: ``hidden`` not a multiple of ``heads``, or a checkpoint naming a layer
            outside ``0 .. layers - 1`` or a block other than "attention" / "ffn".
    """
    marks = _checkpoints(checkpoints, layers)
    return _encoder(layers, hidden, heads, seq_len, vocab, intermediate or 4 * hidden, dropout, name,
                    softmax_in_compute_dtype, marks)


def _checkpoints(given: str | Iterable[tuple[int, str]] | None, n_layers: int) -> set[tuple[int, str]]:
    """``bert_encoder``'s ``checkpoints`` as a set of ``(layer, "attention" | "ffn")``."""
    if given is None:
        return set()
    if isinstance(given, str):
        if given != "every_layer":
            raise ValueError(f"bert_encoder: checkpoints must be 'every_layer', None or (layer, "
                             f"'attention' | 'ffn') pairs. Received: {given!r}")
        return {(i, "ffn") for i in range(n_layers)}
    marks = set()
    for mark in given:
        layer, block = mark
        if block not in ("attention", "ffn") or not 0 <= int(layer) < n_layers:
            raise ValueError(f"bert_encoder: checkpoint {mark!r} must be (layer in 0 .. "
                             f"{n_layers - 1}, 'attention' or 'ffn').")
        marks.add((int(layer), str(block)))
    return marks


def _encoder(n_layers: int, hidden: int, heads: int, seq_len: int, vocab: int, inner: int,
             dropout: float, name: str, fp16_softmax: bool = False,
             marks: set[tuple[int, str]] | frozenset[tuple[int, str]] = frozenset()) -> keras.Model:
    if hidden % heads:
        raise ValueError(f"bert_encoder: hidden ({hidden}) must be a multiple of heads ({heads})")
    if marks:
        from tf_ipu.graphcore.addons.keras.layers.recomputation import RecomputationCheckpoint
    attention = FP16Attention if fp16_softmax else layers.MultiHeadAttention
    ids = keras.Input((seq_len,), dtype="int32", name="input_ids")
    x = layers.Embedding(vocab, hidden, embeddings_initializer=_init(), name="token_embedding")(ids)
    x = PositionEmbedding(seq_len, name="position_embedding")(x)
    x = layers.LayerNormalization(epsilon=LN_EPSILON, name="embedding_norm")(x)
    x = layers.Dropout(dropout, name="embedding_dropout")(x)
    for i in range(n_layers):
        p = f"layer_{i}"
        attn = attention(
            heads, hidden // heads, dropout=dropout, kernel_initializer=_init(), name=f"{p}_attention"
        )(x, x)
        attn = layers.Dropout(dropout, name=f"{p}_attention_dropout")(attn)
        x = layers.LayerNormalization(epsilon=LN_EPSILON, name=f"{p}_attention_norm")(
            layers.Add(name=f"{p}_attention_add")([x, attn])
        )
        if (i, "attention") in marks:
            x = RecomputationCheckpoint(name=f"{p}_attention_checkpoint")(x)
        h = layers.Dense(inner, activation="gelu", kernel_initializer=_init(), name=f"{p}_intermediate")(x)
        h = layers.Dense(hidden, kernel_initializer=_init(), name=f"{p}_output")(h)
        h = layers.Dropout(dropout, name=f"{p}_output_dropout")(h)
        x = layers.LayerNormalization(epsilon=LN_EPSILON, name=f"{p}_output_norm")(
            layers.Add(name=f"{p}_output_add")([x, h])
        )
        if (i, "ffn") in marks:
            x = RecomputationCheckpoint(name=f"{p}_output_checkpoint")(x)
    return keras.Model(ids, x, name=name)


def bert_classifier(encoder: keras.Model, classes: int, *, name: str = "bert_classifier") -> keras.Model:
    """``encoder`` with BERT's pooler (the first token through a tanh Dense) and a dense
    classifier producing logits ``(batch, classes)``."""
    first = encoder.output[:, 0, :]
    pooled = layers.Dense(encoder.output.shape[-1], activation="tanh", kernel_initializer=_init(),
                          name="pooler")(first)
    logits = layers.Dense(classes, kernel_initializer=_init(), name="classifier")(pooled)
    return keras.Model(encoder.input, logits, name=name)
