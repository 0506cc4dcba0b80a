"""``tf_ipu.models.bert``'s options that follow PopART's BERT (the MLPerf submissions' model):
attention probabilities in the compute dtype (``softmax_in_compute_dtype``) and recomputation
checkpoints after named blocks (``checkpoints``). Small sizes; no server."""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

SIZE = {"layers": 2, "hidden": 32, "heads": 4, "seq_len": 16, "vocab": 50, "dropout": 0.0}


@pytest.fixture
def float16():
    """The ``float16`` policy (the bench's), restored afterwards."""
    import keras

    keras.mixed_precision.set_global_policy("float16")
    yield
    keras.mixed_precision.set_global_policy("float32")


def _ids() -> np.ndarray:
    return np.random.default_rng(0).integers(0, SIZE["vocab"], (2, SIZE["seq_len"])).astype(np.int32)


def _same_weights(a, b) -> None:
    assert [w.shape for w in a.weights] == [w.shape for w in b.weights]
    b.set_weights(a.get_weights())


def test_fp16_softmax_keeps_the_probabilities_in_fp16(float16) -> None:
    """Keras's attention computes the (batch, heads, T, S) scores and softmax in FP32; with
    the option the lowered step's scores, exponentials and probabilities (the softmax's
    divide) are FP16 (only the row sums' transient convert is FP32), and the outputs agree."""
    import tensorflow as tf

    from tf_ipu.models import FP16Attention, bert_encoder

    keras_attention = bert_encoder(**SIZE)
    popart = bert_encoder(**SIZE, softmax_in_compute_dtype=True)
    assert isinstance(popart.get_layer("layer_0_attention"), FP16Attention)
    _same_weights(keras_attention, popart)
    ids = tf.constant(_ids())
    shape = f"[2,{SIZE['heads']},{SIZE['seq_len']},{SIZE['seq_len']}]"
    hlo = {}
    for name, model in (("keras", keras_attention), ("popart", popart)):
        fn = tf.function(model.__call__, jit_compile=True)
        hlo[name] = fn.experimental_get_compiler_ir(ids)(stage="hlo")

    def made(text: str, dtype: str) -> set[str]:
        """Opcodes of the instructions making a ``dtype`` tensor of the scores' shape."""
        return {line.split(f"{dtype}{shape}")[1].split("(")[0].split()[-1]
                for line in text.splitlines() if f"= {dtype}{shape}" in line}

    assert {"exponential", "divide"} <= made(hlo["keras"], "f32")
    assert made(hlo["popart"], "f32") <= {"convert"}
    assert {"dot", "exponential", "divide"} <= made(hlo["popart"], "f16")
    a = keras_attention(ids).numpy().astype(np.float32)
    b = popart(ids).numpy().astype(np.float32)
    assert b.dtype == np.float32 and np.allclose(a, b, atol=2e-2), np.abs(a - b).max()


def test_fp16_attention_matches_keras_in_float32() -> None:
    """In FP32 the two attentions are the same function (and the layer round-trips its
    config)."""
    import keras

    from tf_ipu.models import FP16Attention

    x = np.random.default_rng(1).normal(size=(2, 8, 16)).astype(np.float32)
    ref = keras.layers.MultiHeadAttention(2, 8)
    ours = FP16Attention(2, 8)
    ref(x, x)
    ours(x, x)
    ours.set_weights(ref.get_weights())
    np.testing.assert_allclose(ours(x, x), ref(x, x), rtol=1e-5, atol=1e-5)
    again = FP16Attention.from_config(ours.get_config())
    assert isinstance(again, FP16Attention) and again.get_config()["num_heads"] == 2


def test_checkpoints_are_placed_where_asked_and_change_nothing() -> None:
    """``every_layer`` marks each layer's output, pairs mark the blocks named; the outputs are
    the model's without them; a bad position is refused."""
    from tf_ipu.models import bert_encoder

    plain = bert_encoder(**SIZE)
    every = bert_encoder(**SIZE, checkpoints="every_layer")
    some = bert_encoder(**SIZE, checkpoints=[(0, "attention"), (1, "ffn")])

    def marked(model) -> list[str]:
        return [layer.name for layer in model.layers if type(layer).__name__ == "RecomputationCheckpoint"]

    assert marked(plain) == []
    assert marked(every) == ["layer_0_output_checkpoint", "layer_1_output_checkpoint"]
    assert marked(some) == ["layer_0_attention_checkpoint", "layer_1_output_checkpoint"]
    _same_weights(plain, some)
    np.testing.assert_allclose(some(_ids()), plain(_ids()), rtol=1e-6, atol=1e-6)
    for bad in ("every_block", [(2, "ffn")], [(0, "norm")]):
        with pytest.raises(ValueError, match="checkpoint"):
            bert_encoder(**SIZE, checkpoints=bad)


def test_checkpoints_are_stashed_in_a_pipeline() -> None:
    """In a 2-stage pipeline trained with recomputation in the
    RecomputeAndBackpropagateInterleaved mode, stage 0's stashed input checkpoint grows by the
    checkpointed block (the IR marks it), and its recomputation shortens."""
    import keras

    import tf_ipu
    from tf_ipu.models import bert_classifier, bert_encoder
    from tf_ipu.pipelining import RecomputationMode

    def stage0(checkpoints) -> dict:
        with tf_ipu.IPUStrategy().scope():
            model = bert_classifier(bert_encoder(**SIZE, checkpoints=checkpoints), classes=2)
            model.compile(optimizer="sgd",
                          loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
            names = [a.layer.name for a in model.get_pipeline_stage_assignment()]
            model.set_pipeline_stage_assignment(
                [0 if n.startswith(("token_", "position_", "embedding", "layer_0_")) else 1
                 for n in names])
            model.set_pipelining_options(
                gradient_accumulation_steps_per_replica=4, device_mapping=[0, 1],
                recomputation_mode=RecomputationMode.RecomputeAndBackpropagateInterleaved)
        est = tf_ipu.estimate(model, 2, training=True, ipu_version="ipu2", recomputation=True)
        return est.stages[0]

    plain, marked = stage0(None), stage0([(0, "attention")])
    hidden = 2 * SIZE["seq_len"] * SIZE["hidden"] * 4  # one FP32 (batch, seq, hidden) tensor
    assert marked["checkpoint_bytes"] >= plain["checkpoint_bytes"] + hidden
    assert marked["recompute_cycles"] < plain["recompute_cycles"]
