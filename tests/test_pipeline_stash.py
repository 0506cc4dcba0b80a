"""How deep a pipeline stashes, as PopTorch/PopART pipeline: consecutive stages on one IPU
are one stage, and a stage's stash holds the micro-batches between its forward and its
backward (docs/tile_model.md, "Pipelines").

Sources: PopTorch user guide, "Pipelined execution" ("If two consecutive blocks/stages use the
same IPU, PopTorch will merge them into a single block/stage"); graphcore/popart
``willow/src/transforms/pipeline.cpp`` (``mergeConsecutivePipelineStages``; ``getStashSize``
= ``numIndependentStages(stash stage, largest restore stage + 1)``, the forward stage s of S
restored in backward stage 2S - 2 - s) and ``tests/integration/pipelining_tests/
pipeline_consecutive_stages_test.py``.
"""

from __future__ import annotations

import pytest

import tf_ipu
from tf_ipu.models.gpt2 import gpt2, gpt2_pipeline_stages, merge_consecutive_stages


def _popart_stash_size(stage: int, stages: int) -> int:
    """PopART's stash size of forward stage ``stage`` of ``stages`` (merged): its restore
    stage (the backward, 2 S - 2 - s) minus its stash stage, plus one."""
    restore = 2 * stages - 2 - stage
    return restore - stage + 1


def test_consecutive_stages_on_one_ipu_merge_as_poptorch_merges_them() -> None:
    # GPT-2 with layers_per_ipu [0, 2, 2]: wte, wpe, 4 layers, the LM head on IPUs ...
    stages, ipus = merge_consecutive_stages([0, 1, 2, 3, 4, 5, 6, 6], [0, 1, 1, 1, 2, 2, 0])
    assert ipus == [0, 1, 2, 0]
    assert stages == [0, 1, 1, 1, 2, 2, 3, 3]
    # a return to an IPU is a new stage; one IPU throughout is one stage
    assert merge_consecutive_stages([0, 1, 2], [0, 0, 0]) == ([0, 0, 0], [0])
    assert merge_consecutive_stages([0, 1, 2], [0, 1, 0]) == ([0, 1, 2], [0, 1, 0])
    with pytest.raises(ValueError, match=r"stage ids \[3\] have no IPU in stage_ipus \[0, 1\]"):
        merge_consecutive_stages([0, 3], [0, 1])


def _mlp(stage_of_layer: list[int], mapping: list[int]):
    import keras

    with tf_ipu.IPUStrategy().scope():
        model = keras.Sequential([keras.Input((64,))]
                                 + [keras.layers.Dense(64, activation="tanh", name=f"d{i}")
                                    for i in range(3)] + [keras.layers.Dense(4, name="head")])
        model.compile(optimizer="sgd", loss="mse")
        model.set_pipeline_stage_assignment(stage_of_layer)
        model.set_pipelining_options(gradient_accumulation_steps_per_replica=8,
                                     device_mapping=mapping)
    return model


def _estimate(model, **kw):
    return tf_ipu.estimate(model, 16, training=True, recomputation=True, ipu_version="ipu2",
                           tiles_per_ipu=16, **kw)


def test_four_blocks_on_two_ipus_stash_as_two_stages() -> None:
    """Four blocks [0, 0, 1, 1] on IPUs: unmerged (TensorFlow's stages), stage 0 keeps
    2 (4 - 1) + 1 = 7 micro-batches; merged (PopTorch), the pipeline is the 2-stage one: the
    stash of 2 (2 - 1) + 1 = 3 micro-batches PopART sizes, and the same bytes on every IPU."""
    four = _estimate(_mlp([0, 1, 2, 3], [0, 0, 1, 1]))
    stages, ipus = merge_consecutive_stages([0, 1, 2, 3], [0, 0, 1, 1])
    merged = _estimate(_mlp(stages, ipus))
    two = _estimate(_mlp([0, 0, 1, 1], [0, 1]))
    assert [s["in_flight"] for s in four.stages] == [7, 5, 3, 1]
    assert [s["in_flight"] for s in merged.stages] == \
        [_popart_stash_size(s, 2) for s in range(2)] == [3, 1]
    assert [d["peak_tile_bytes"] for d in merged.ipus] == \
        [d["peak_tile_bytes"] for d in two.ipus]
    assert merged.ipus[0]["stash_bytes"] == two.ipus[0]["stash_bytes"] > 0
    assert four.ipus[0]["stash_bytes"] > merged.ipus[0]["stash_bytes"]


def test_a_reduced_gpt2_has_one_stage_per_change_of_ipu() -> None:
    """Graphcore's GPT-2 placement at a reduced size (layers_per_ipu [0, 2, 2]): seven
    BeginBlocks, four PopTorch stages (IPUs 0, 1, 2, 0), each keeping PopART's stash size."""
    model = gpt2(4, 32, 4, 16, 50, dropout=0.0)
    with tf_ipu.IPUStrategy().scope():
        model.compile(optimizer="sgd", loss=keras_loss())
    blocks, block_ipus = gpt2_pipeline_stages(model, [0, 2, 2])
    stages, ipus = merge_consecutive_stages(blocks, block_ipus)
    assert (max(blocks) + 1, ipus) == (7, [0, 1, 2, 0])
    from tensorflow.python import ipu as gc

    with tf_ipu.IPUStrategy().scope():
        model.set_pipeline_stage_assignment(stages)
        model.set_pipelining_options(
            gradient_accumulation_steps_per_replica=8, device_mapping=ipus,
            recomputation_mode=gc.pipelining_ops.RecomputationMode.RecomputeAndBackpropagateInterleaved)
    est = _estimate(model)
    assert [s["ipu"] for s in est.stages] == ipus
    assert [s["in_flight"] for s in est.stages] == [_popart_stash_size(s, 4) for s in range(4)]


def keras_loss():
    import keras

    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def test_a_pipelines_all_reduce_count_is_per_weight_update() -> None:
    """With replicas, the report counts a pipeline's all-reduces per weight update (each
    replica, every stage's IPU): the same at 4 or 8 micro-batches per update, while a call
    of one micro-batch runs 1/M of an update (``all_reduces``, per call, rounds to 0)."""
    ests = {}
    for m in (4, 8):
        model = _mlp([0, 0, 1, 1], [0, 1])
        with tf_ipu.IPUStrategy().scope():
            model.set_pipelining_options(gradient_accumulation_steps_per_replica=m,
                                         device_mapping=[0, 1])
        ests[m] = _estimate(model, replicas=2)
    for m, e in ests.items():
        assert e.micro_batches_per_call == 1 and e.weight_updates_per_call == pytest.approx(1 / m)
        # one implied gradient all-reduce per stage's IPU, per update
        assert e.all_reduces_per_update == 2
        assert e.all_reduces == round(e.all_reduces_per_update * e.weight_updates_per_call) == 0
    assert ests[4].all_reduce_bytes == pytest.approx(2 * ests[8].all_reduce_bytes, abs=1)


def _checkpointed_mlp(last: bool):
    """Stage 0 (IPU 0): Dense 256 tanh, a checkpoint, Dense 512 (linear), with a checkpoint
    after it or not; stage 1 (IPU 1): the head, the only reader of stage 0's output."""
    import keras
    from ipu_tensorflow_addons.keras.layers import RecomputationCheckpoint
    from tensorflow.python import ipu as gc

    with tf_ipu.IPUStrategy().scope():
        inp = keras.Input((64,))
        with keras.ipu.PipelineStage(0):
            x = RecomputationCheckpoint()(keras.layers.Dense(256, activation="tanh")(inp))
            x = keras.layers.Dense(512)(x)
            if last:
                x = RecomputationCheckpoint()(x)
        with keras.ipu.PipelineStage(1):
            x = keras.layers.Dense(4)(x)
        model = keras.Model(inp, x)
        model.compile(optimizer="sgd", loss="mse")
        model.set_pipelining_options(
            gradient_accumulation_steps_per_replica=8, device_mapping=[0, 1],
            recomputation_mode=gc.pipelining_ops.RecomputationMode.RecomputeAndBackpropagateInterleaved)
    return model


def test_a_checkpoint_only_the_next_stage_reads_is_stashed_there_alone() -> None:
    """Stage 0 stashes its input (16 x 64 FP32) and the checkpoint its backward recomputes
    from (16 x 256); a checkpoint on its output, read only by stage 1 on the other IPU, is
    stashed by stage 1 as its input, not by stage 0 as well (PopART stashes a tensor that
    appears in one stage, consumed by the copy to the next IPU, nowhere)."""
    plain = _estimate(_checkpointed_mlp(False))
    last = _estimate(_checkpointed_mlp(True))
    for e in (plain, last):
        assert e.stages[0]["checkpoint_bytes"] == 16 * (64 + 256) * 4
        assert e.stages[0]["in_flight"] == 3 and e.stages[0]["recomputation"]
    assert last.ipus[0]["stash_bytes"] == plain.ipus[0]["stash_bytes"] == 2 * 16 * 320 * 4
