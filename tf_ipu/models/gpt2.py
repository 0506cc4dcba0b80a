"""GPT-2 (Radford et al., "Language Models are Unsupervised Multitask Learners", 2019) with
Keras layers, as Graphcore's PopTorch GPT-2 trains and runs it.

    model = gpt2()                                   # GPT-2 small: 12 x 768, 12 heads, 124M weights
    medium = gpt2(layers=24, hidden=1024, heads=16)  # GPT-2 medium: 355M
    model.compile(optimizer="adamw", loss=lm_loss(serialized_seq_len=128))
    gpt2_pipeline_stages(model, [0, 4, 4, 4])        # Graphcore's layers_per_ipu

Published definition followed (our own code, no lines copied): graphcore/examples
``nlp/gpt2/pytorch`` at commit 3cc8f81f13728dd8c17d0d3c8d2fc1549b159485. ``train_gpt2.py``'s
``GPT2Wrapper`` is Hugging Face's ``GPT2LMHeadModel`` (``config/config.json``: vocabulary
50272, LayerNorm epsilon 1e-5, GELU, dropout 0.1 on embeddings, attention probabilities and
residual branches) with ``model/optimized_gpt2_attn.py``'s attention:

* ``wte`` token embedding plus ``wpe`` learned position embedding (``n_positions`` = the
  sequence length), dropout;
* ``layers`` pre-LN decoder layers (``tf_ipu.models.vit.pre_ln_block`` with a causal mask):
  ``x + Dropout(Attention(LN(x)))``, ``x + Dropout(Dense(hidden)(gelu(Dense(4 hidden)(LN(x)))))``;
  the attention's scores, mask and softmax in the model's FP16 (``.half()``; the optimized
  attention casts the scores to the values' dtype before its softmax), so ``FP16Attention``;
* ``ln_f``, then the LM head: the transpose of ``wte`` (tied weights, ``tie_weights()``):
  :class:`TiedEmbedding` called a second time with ``reverse=True``.

Loss (``GPT2Wrapper.forward`` with ``--enable-sequence-serialized``): the logits are cut into
chunks of ``serialized_seq_len`` (128) positions; each chunk's cross-entropy is summed, and
the total divided by the number of labels: :func:`lm_loss`. PopART computes the chunks one
after another; XLA computes them as one (the same sum, the softmax of all chunks at once).

Placement (``GPT2Wrapper.__init__``): ``wte`` on IPU 0, ``wpe`` on IPU 1, decoder layer ``i``
on the IPU ``layers_per_ipu`` gives it, ``ln_f`` with the last layer, the LM head on IPU 0.
``poptorch.AutoStage.AutoIncrement`` (``ipu_options.py``; ``inference_gpt2.py`` with
``ShardedExecution``) gives each ``BeginBlock`` a stage id of its own: ``wte``, ``wpe``, every
decoder layer, the LM head (:func:`gpt2_pipeline_stages`). A pipelined (training) program then
runs one stage per change of IPU: PopTorch merges consecutive blocks on the same IPU into one
stage (PopTorch user guide, "Pipelined execution"; PopART's ``mergeConsecutivePipelineStages``
in ``willow/src/transforms/pipeline.cpp``, tested by ``pipeline_consecutive_stages_test.py``):
:func:`merge_consecutive_stages`. ``--recompute-checkpoint-every-layer`` marks each decoder
layer's output as a recomputation checkpoint (``checkpoints="every_layer"``).

Parameter counts: 124,439,808 for GPT-2 small and 354,823,168 for medium with OpenAI's
vocabulary of 50257 (Hugging Face's model cards: 124M and 355M); the application pads the
vocabulary to 50272 (+11,520 and +15,360).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import keras
from keras import layers as kl
from keras import ops

from tf_ipu.models.bert import PositionEmbedding
from tf_ipu.models.vit import pre_ln_block


def _init() -> keras.initializers.Initializer:
    return keras.initializers.RandomNormal(stddev=0.02)  # GPT-2's initializer_range


@keras.saving.register_keras_serializable(package="tf_ipu")
class TiedEmbedding(kl.Embedding):
    """``keras.layers.Embedding`` that is also the LM head: called with ``reverse=True`` on
    ``(..., hidden)`` activations it returns ``(..., vocab)`` logits, the activations times
    the transposed embedding table (one set of weights, as ``tie_weights()`` shares it)."""

    def call(self, inputs: Any, reverse: bool = False) -> Any:
        if not reverse:
            return super().call(inputs)
        table = ops.cast(self.embeddings, inputs.dtype)
        return ops.matmul(inputs, ops.transpose(table))

    def compute_output_spec(self, inputs: Any, reverse: bool = False) -> Any:
        if not reverse:
            return super().compute_output_spec(inputs)
        return keras.KerasTensor((*inputs.shape[:-1], self.input_dim), dtype=self.compute_dtype)


def gpt2(
    layers: int = 12,
    hidden: int = 768,
    heads: int = 12,
    seq_len: int = 1024,
    vocab: int = 50272,
    *,
    dropout: float = 0.1,
    epsilon: float = 1e-5,
    fp16_softmax: bool = True,
    checkpoints: str | None = "every_layer",
    name: str = "gpt2",
) -> keras.Model:
    """GPT-2 language model: ``(batch, seq_len)`` int32 token ids -> ``(batch, seq_len,
    vocab)`` logits (module docstring). ``checkpoints``: ``"every_layer"`` puts a
    ``RecomputationCheckpoint`` on each decoder layer's output (``h_{i}_checkpoint``).

    Raises:
        ValueError: ``hidden`` not a multiple of ``heads``, or another ``checkpoints`` value.
    """
    if hidden % heads:
        raise ValueError(f"gpt2: hidden ({hidden}) must be a multiple of heads ({heads})")
    if checkpoints not in (None, "every_layer"):
        raise ValueError(f"gpt2: checkpoints must be 'every_layer' or None. Received: {checkpoints!r}")
    if checkpoints:
        from tf_ipu.graphcore.addons.keras.layers.recomputation import RecomputationCheckpoint
    ids = keras.Input((seq_len,), dtype="int32", name="input_ids")
    wte = TiedEmbedding(vocab, hidden, embeddings_initializer=_init(), name="wte")
    x = wte(ids)
    x = PositionEmbedding(seq_len, name="wpe")(x)
    x = kl.Dropout(dropout, name="drop")(x)
    for i in range(layers):
        x = pre_ln_block(x, heads, 4 * hidden, f"h_{i}", epsilon=epsilon, dropout=dropout,
                         attention_dropout=dropout, causal=True, fp16_softmax=fp16_softmax,
                         initializer=_init())
        if checkpoints:
            x = RecomputationCheckpoint(name=f"h_{i}_checkpoint")(x)
    x = kl.LayerNormalization(epsilon=epsilon, name="ln_f")(x)
    logits = wte(x, reverse=True)
    return keras.Model(ids, logits, name=name)


@keras.saving.register_keras_serializable(package="tf_ipu")
class SerializedLMLoss(keras.losses.Loss):
    """The language-model loss of ``GPT2Wrapper.forward``: sparse softmax cross-entropy of
    ``(batch, seq)`` int labels against ``(batch, seq, vocab)`` logits, summed over chunks of
    ``serialized_seq_len`` positions (None: one chunk) and divided by the number of labels.
    ``dtype``: the dtype it computes in (Keras' floatx if None; the application's FP16 model
    computes it in FP16)."""

    def __init__(self, serialized_seq_len: int | None = None, name: str = "lm_loss",
                 dtype: str | None = None, **kwargs: Any) -> None:
        if serialized_seq_len is not None and (not isinstance(serialized_seq_len, int)
                                               or serialized_seq_len < 1):
            raise ValueError(f"lm_loss: serialized_seq_len must be a positive int or None. "
                             f"Received: {serialized_seq_len!r}")
        super().__init__(name=name, dtype=dtype, **kwargs)
        self.serialized_seq_len = serialized_seq_len

    def __call__(self, y_true: Any, y_pred: Any, sample_weight: Any = None) -> Any:
        """The loss; the labels stay integers (``Loss.__call__`` would convert them to the
        loss's dtype, and FP16 holds integers exactly only up to 2048)."""
        if sample_weight is not None:
            raise ValueError(f"{self.name}: sample weights are not supported (every label counts)")
        with keras.name_scope(self.name):
            return self.call(ops.cast(y_true, "int32"), ops.cast(y_pred, self.dtype))

    def call(self, y_true: Any, y_pred: Any) -> Any:
        """Each chunk's summed cross-entropy, then their sum over the labels' count. The chunks
        are rows of the reshaped logits, not slices: the backward of a slice pads its gradient
        back to the whole logits (TensorFlow's ``StridedSliceGrad``), so slicing would hold one
        full-size gradient per chunk at once where PopART accumulates into its chunks."""
        seq, vocab = y_pred.shape[1], y_pred.shape[2]
        step = self.serialized_seq_len or seq
        if seq % step:
            raise ValueError(f"{self.name}: the sequence ({seq}) is not a multiple of "
                             f"serialized_seq_len ({step})")
        logits = ops.reshape(y_pred, (-1, seq // step, step, vocab))
        labels = ops.reshape(y_true, (-1, seq // step, step, 1))
        # -log softmax at the label, in the logits' dtype (PopART's FP16 cross-entropy);
        # TensorFlow's fused sparse softmax cross-entropy computes FP16 logits in FP32.
        shifted = logits - ops.stop_gradient(ops.max(logits, axis=-1, keepdims=True))
        log_sum = ops.log(ops.sum(ops.exp(shifted), axis=-1))
        picked = ops.squeeze(ops.take_along_axis(shifted, labels, axis=-1), -1)
        per_chunk = ops.sum(log_sum - picked, axis=(0, 2))
        total = ops.sum(per_chunk)
        return total / ops.cast(ops.size(y_true), total.dtype)

    def get_config(self) -> dict[str, Any]:
        return {**super().get_config(), "serialized_seq_len": self.serialized_seq_len}


def lm_loss(serialized_seq_len: int | None = None, dtype: str | None = None) -> SerializedLMLoss:
    """:class:`SerializedLMLoss` (Graphcore's ``--enable-sequence-serialized`` loss with
    ``--serialized-seq-len``)."""
    return SerializedLMLoss(serialized_seq_len, dtype=dtype)


def gpt2_pipeline_stages(model: keras.Model, layers_per_ipu: Sequence[int]) -> tuple[list[int], list[int]]:
    """Sets the pipeline stage of each layer call of a :func:`gpt2` model as ``GPT2Wrapper``
    places it under ``AutoStage.AutoIncrement`` (module docstring): ``wte`` (IPU 0), ``wpe``
    (IPU 1, with the embeddings' dropout), one stage per decoder layer on the IPU of
    ``layers_per_ipu`` (``ln_f`` with the last), the LM head (IPU 0). Returns the stages and
    each stage's IPU (the ``device_mapping``).

    Raises:
        ValueError: ``layers_per_ipu`` does not place the model's decoder layers.
    """
    import re

    ipu_of = [ipu for ipu, n in enumerate(layers_per_ipu) for _ in range(int(n))]
    assignments = model.get_pipeline_stage_assignment()
    names = [a.layer.name for a in assignments]
    count = len({m.group(1) for n in names if (m := re.match(r"h_(\d+)_", n))})
    if count != len(ipu_of):
        raise ValueError(f"gpt2_pipeline_stages: layers_per_ipu {list(layers_per_ipu)} places "
                         f"{len(ipu_of)} layers; {model.name} has {count}")
    head = count + 2
    stages, seen_wte = [], False
    for n in names:
        m = re.match(r"h_(\d+)_", n)
        if m:
            stages.append(2 + int(m.group(1)))
        elif n == "wte":
            stages.append(head if seen_wte else 0)
            seen_wte = True
        elif n in ("wpe", "drop"):
            stages.append(1)
        elif n == "ln_f":
            stages.append(head - 1)
        else:
            stages.append(0)  # the input
    model.set_pipeline_stage_assignment(stages)
    return stages, [0, 1, *ipu_of, 0]


def merge_consecutive_stages(stages: Sequence[int], stage_ipus: Sequence[int]
                             ) -> tuple[list[int], list[int]]:
    """PopTorch's pipeline stages from its blocks' stage ids: consecutive stages on the same
    IPU become one (PopTorch user guide, "Pipelined execution": "If two consecutive
    blocks/stages use the same IPU, PopTorch will merge them into a single block/stage";
    PopART ``Pipeline::apply`` calls ``mergeConsecutivePipelineStages``, graphcore/popart
    ``willow/src/transforms/pipeline.cpp``). ``stages``: each layer call's stage id;
    ``stage_ipus``: each stage id's IPU. Returns the merged stage of each layer call and each
    merged stage's IPU, e.g. IPUs ``[0, 1, 1, 1, 2, 2, 0]`` -> ``[0, 1, 2, 0]``.

    Raises:
        ValueError: a stage id with no IPU in ``stage_ipus``, or a negative one.
    """
    ipus = [int(i) for i in stage_ipus]
    bad = [s for s in stages if not 0 <= int(s) < len(ipus)]
    if bad:
        raise ValueError(f"merge_consecutive_stages: stage ids {sorted(set(bad))} have no IPU in "
                         f"stage_ipus {ipus} ({len(ipus)} stage(s))")
    merged, new = [], []
    for ipu in ipus:
        if not new or ipu != new[-1]:
            new.append(ipu)
        merged.append(len(new) - 1)
    return [merged[int(s)] for s in stages], new
