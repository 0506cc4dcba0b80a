"""Pipelining with Graphcore's Keras API: stages on a replica's IPUs (tf_ipu/pipelining.py).

A pipelined model trains with gradient accumulation (Graphcore's rule); with reduction
'mean' over N micro-batches of size B it makes the updates of one device at batch N x B, in
every schedule and with recomputation (they change the order of the work and what stays
live, not the results), and with R replicas at learning rate lr / R those of batch
R x N x B (replicas sum their gradients, docs/porting.md). Reference: plain Keras on the
CPU; weights within 1e-4 relative L2 (FP32).
"""

from __future__ import annotations

import numpy as np
import pytest
from keras_util import attached_ipus

RNG = np.random.default_rng(5)
X = RNG.normal(size=(64, 6)).astype("float32")
Y = RNG.normal(size=(64, 2)).astype("float32")


def ipus(cfg, count: int, recompute: bool = False):
    """The process's IPU system with ``count`` IPUs for the block."""
    return attached_ipus(cfg, count, recompute)


def _sequential():
    import keras

    return keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="tanh"),
                             keras.layers.Dense(8, activation="tanh"),
                             keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(2)])


def _functional():
    """Graphcore's user guide example8 shape: layers built and called in PipelineStage
    scopes, 4 stages."""
    import keras

    inputs = keras.Input((6,))
    x = inputs
    for stage, width in enumerate((8, 8, 8, 2)):
        with keras.ipu.PipelineStage(stage):
            x = keras.layers.Dense(width, activation="tanh" if width > 2 else None)(x)
    return keras.Model(inputs, x)


def _distance(got, want) -> float:
    return max(float(np.linalg.norm(a - b) / np.linalg.norm(b)) for a, b in zip(got, want, strict=True))


def _cpu(build, initial, lr: float, batch: int):
    import keras

    model = build() if build is _sequential else _plain_functional()
    model.set_weights(initial)
    model.compile(optimizer=keras.optimizers.SGD(lr), loss="mse")
    model.fit(X, Y, batch_size=batch, epochs=2, shuffle=False, verbose=0)
    return model.get_weights()


def _plain_functional():
    import keras

    inputs = keras.Input((6,))
    x = inputs
    for width in (8, 8, 8, 2):
        x = keras.layers.Dense(width, activation="tanh" if width > 2 else None)(x)
    return keras.Model(inputs, x)


@pytest.mark.parametrize("schedule", ["Grouped", "Interleaved", "Sequential"])
def test_a_two_stage_sequential_pipeline_trains_as_one_device(ipu_system, schedule):
    import keras
    from tensorflow.python import ipu

    import tf_ipu

    initial = _sequential().get_weights()
    want = _cpu(_sequential, initial, 0.05, batch=16)
    with ipus(ipu_system, 2):
        strategy = tf_ipu.IPUStrategy()
        with strategy.scope():
            model = _sequential()
            model.set_weights(initial)
            model.set_pipeline_stage_assignment([0, 0, 1, 1])
            model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse", steps_per_execution=8)
            model.set_pipelining_options(
                gradient_accumulation_steps_per_replica=4,
                gradient_accumulation_reduction_method="mean",
                pipeline_schedule=getattr(ipu.ops.pipelining_ops.PipelineSchedule, schedule))
        model.fit(X, Y, batch_size=4, epochs=2, shuffle=False, verbose=0)
        weights = model.get_weights()
        report = [r for r in strategy.reports if "stages=2" in r.name][-1]
    assert _distance(weights, want) <= 1e-4
    assert report.fits


def test_four_stages_in_scopes_with_recomputation_train_as_one_device(ipu_system):
    import keras

    import tf_ipu

    keras.utils.set_random_seed(2)
    initial = _plain_functional().get_weights()
    want = _cpu(_plain_functional, initial, 0.05, batch=32)
    with ipus(ipu_system, 4, recompute=True):
        with tf_ipu.IPUStrategy().scope():
            model = _functional()
            model.set_weights(initial)
            model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse", steps_per_execution=8)
            model.set_pipelining_options(gradient_accumulation_steps_per_replica=8,
                                         gradient_accumulation_reduction_method="mean")
            assert [a.pipeline_stage for a in model.get_pipeline_stage_assignment()] == [0, 1, 2, 3]
        model.fit(X, Y, batch_size=4, epochs=2, shuffle=False, verbose=0)
        weights = model.get_weights()
    assert _distance(weights, want) <= 1e-4


def test_a_pipeline_on_two_replicas(ipu_system):
    """2 stages x 2 replicas = 4 IPUs; replicas sum their gradients: lr / 2."""
    import keras

    import tf_ipu

    initial = _sequential().get_weights()
    want = _cpu(_sequential, initial, 0.05, batch=32)
    with ipus(ipu_system, 4):
        with tf_ipu.IPUStrategy().scope():
            model = _sequential()
            model.set_weights(initial)
            model.set_pipeline_stage_assignment([0, 0, 1, 1])
            model.compile(optimizer=keras.optimizers.SGD(0.05 / 2), loss="mse",
                          steps_per_execution=4)
            model.set_pipelining_options(gradient_accumulation_steps_per_replica=4,
                                         gradient_accumulation_reduction_method="mean")
        model.fit(X, Y, batch_size=4, epochs=2, shuffle=False, verbose=0)
        weights = model.get_weights()
        iterations = int(model.optimizer.iterations.numpy())
    assert _distance(weights, want) <= 1e-4
    assert iterations == 2 * 64 // 32


def test_several_stages_on_one_ipu_and_the_stage_of_every_instruction(ipu_system):
    """device_mapping [0, 0, 1, 1]: 4 stages on 2 IPUs, as Graphcore allows; every
    instruction of the program carries its stage, each layer's forward and backward ops and
    its variables' updates in the layer's stage."""
    import keras

    import tf_ipu
    from device_server.protocol import ir_pb2
    from tf_ipu import runtime

    initial = _sequential().get_weights()
    want = _cpu(_sequential, initial, 0.05, batch=16)
    with ipus(ipu_system, 2):
        with tf_ipu.IPUStrategy().scope():
            model = _sequential()
            model.set_weights(initial)
            model.set_pipeline_stage_assignment([0, 1, 2, 3])
            model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse", steps_per_execution=4)
            model.set_pipelining_options(gradient_accumulation_steps_per_replica=4,
                                         device_mapping=[0, 0, 1, 1],
                                         gradient_accumulation_reduction_method="mean")
        model.fit(X, Y, batch_size=4, epochs=2, shuffle=False, verbose=0)
        weights = model.get_weights()
    assert _distance(weights, want) <= 1e-4
    entry = [e for e in runtime.get_runtime()._programs if e.pipeline][-1]
    assert entry.pipeline["stage_ipus"] == [0, 0, 1, 1] and entry.pipeline["ipus_per_replica"] == 2
    module = ir_pb2.Module.FromString(entry.program)
    layer_names = [layer.name for layer in model.layers]
    for comp in module.computations:
        for instr in comp.instructions:
            assert "pipeline_stage" in instr.attrs
            for stage, name in enumerate(layer_names):
                if f"/{name}" in instr.source_op and instr.opcode == "dot":
                    assert instr.attrs["pipeline_stage"].i == stage, (instr.name, instr.source_op)


def test_pipeline_assignments_of_a_functional_model_can_be_edited(ipu_system, capsys):
    """Graphcore's example9 pattern: get the assignments, set their stages, set them back."""
    import keras

    import tf_ipu

    with tf_ipu.IPUStrategy().scope():
        model = _plain_functional()
        assignments = model.get_pipeline_stage_assignment()
        assert [a.pipeline_stage for a in assignments] == [None] * 4
        stage = 0
        for a in assignments:
            a.pipeline_stage = stage
            if a.layer is assignments[2].layer:  # split after the third Dense
                stage = 1
        model.set_pipeline_stage_assignment(assignments)
        model.print_pipeline_stage_assignment_summary()
    assert [a.pipeline_stage for a in model.get_pipeline_stage_assignment()] == [0, 0, 0, 1]
    printed = capsys.readouterr().out
    assert "pipeline stage assignment" in printed and assignments[3].layer.name in printed
    assert isinstance(assignments[0], keras.ipu.FunctionalLayerPipelineStageAssignment)


def test_bad_pipelines_name_the_numbers_and_the_fix(ipu_system):
    import keras

    import tf_ipu

    with pytest.raises(RuntimeError, match="only be used from within an IPUStrategy"):
        with keras.ipu.PipelineStage(0):
            pass
    strategy = tf_ipu.IPUStrategy()
    with strategy.scope():
        with pytest.raises(RuntimeError, match=r"must not be nested: PipelineStage\(1\) inside "
                                               r"PipelineStage\(0\)"):
            with keras.ipu.PipelineStage(0), keras.ipu.PipelineStage(1):
                pass
        model = _sequential()
        with pytest.raises(ValueError, match=r"3 stages given for 4 layers"):
            model.set_pipeline_stage_assignment([0, 0, 1])
        model.set_pipeline_stage_assignment([0, 0, 1, 1])
        model.compile(optimizer="sgd", loss="mse", steps_per_execution=4)
    with pytest.raises(ValueError, match=r"1 IPU is attached, but the model's pipeline of 2 "
                                         r"stages .* needs 2 IPUs per replica"):
        model.fit(X, Y, batch_size=4, epochs=1, verbose=0)
    with ipus(ipu_system, 2):
        with pytest.raises(ValueError, match=r"pipelined models train with gradient accumulation: "
                                             r"call model.set_pipelining_options\("
                                             r"gradient_accumulation_steps_per_replica=N"):
            model.fit(X, Y, batch_size=4, epochs=1, verbose=0)
        with strategy.scope():
            model.set_pipelining_options(gradient_accumulation_steps_per_replica=4,
                                         device_mapping=[0, 1, 2])
        with pytest.raises(ValueError, match=r"device_mapping \[0, 1, 2\] names 3 IPUs for 2 "
                                             r"pipeline stages.*device_mapping=\[0, 1\]"):
            model.fit(X, Y, batch_size=4, epochs=1, verbose=0)
    with strategy.scope():
        model.set_pipelining_options(gradient_accumulation_steps_per_replica=4)
    with ipus(ipu_system, 3):
        with pytest.raises(ValueError, match=r"3 IPUs are attached, but the model's pipeline of 2 "
                                             r"stages .* needs 2 IPUs per replica"):
            model.fit(X, Y, batch_size=4, epochs=1, verbose=0)
    with strategy.scope():  # one layer in two stages on two IPUs: its weights cannot be split
        shared = keras.layers.Dense(6, activation="tanh")
        inputs = keras.Input((6,))
        with keras.ipu.PipelineStage(0):
            x = shared(inputs)
        with keras.ipu.PipelineStage(1):
            x = shared(x)
            x = keras.layers.Dense(2)(x)
        two = keras.Model(inputs, x)
        two.compile(optimizer="sgd", loss="mse", steps_per_execution=4)
        two.set_pipelining_options(gradient_accumulation_steps_per_replica=4)
    with ipus(ipu_system, 2):
        with pytest.raises(ValueError, match=rf"layer '{shared.name}' is called in stages \[0, 1\], "
                                             r"mapped to IPUs \[0, 1\]"):
            two.fit(X, Y, batch_size=4, epochs=1, verbose=0)


def test_suggest_pipeline_balances_estimated_cycles_within_memory(ipu_system):
    """tf_ipu.suggest_pipeline: contiguous stages over the layer calls; the split is the best
    of all contiguous splits for the slowest stage's cycles (checked by trying each), within
    each IPU's budget; a budget no split fits names the largest layer."""
    import itertools

    import keras

    import tf_ipu
    from tf_ipu import pipeline_split

    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(512, activation="relu"),
                              keras.layers.Dense(64, activation="relu"),
                              keras.layers.Dense(512, activation="relu"),
                              keras.layers.Dense(64, activation="relu"), keras.layers.Dense(8)])
    model.compile(optimizer="sgd", loss="mse")
    suggestion = tf_ipu.suggest_pipeline(model, ipus=2, batch_size=16, ipu_version="ipu2")
    stages = list(suggestion)
    assert len(stages) == 5 and stages[0] == 0 and stages[-1] == 1
    assert all(b - a in (0, 1) for a, b in itertools.pairwise(stages))
    # The same costs, every contiguous split: none has a faster slowest stage.
    est = tf_ipu.estimate(model, 16, training=True, ipu_version="ipu2")
    per_layer = pipeline_split._layer_cycles(est)
    cycles = [per_layer.get(layer.name, 0.0) for layer in model.layers]
    best = min(max(sum(cycles[:k]), sum(cycles[k:])) for k in range(1, 5))
    assert max(suggestion.stage_cycles) == pytest.approx(best, rel=1e-9)
    assert suggestion.balance >= 1.0 and all(b <= suggestion.ipu_bytes for b in suggestion.stage_bytes)
    with tf_ipu.IPUStrategy().scope():
        again = keras.models.clone_model(model)
    again.set_pipeline_stage_assignment(suggestion)
    assert [a.pipeline_stage for a in again.get_pipeline_stage_assignment()] == stages
    assert "stage 1:" in suggestion.summary()
    with pytest.raises(ValueError, match=r"no split of .* over 2 GC200 IPUs keeps every stage "
                                         r"within .* the largest layer, 'dense"):
        tf_ipu.suggest_pipeline(model, ipus=2, batch_size=16, memory_fraction=1e-6)


def test_estimate_of_a_pipelined_model_per_ipu_and_its_time_to_train(ipu_system):
    """tf_ipu.estimate plans a pipelined model stage by stage on its IPUs (its stages from
    set_pipeline_stage_assignment, its micro-batches from set_pipelining_options); the time
    to train is weight updates x (micro-batches per update x a micro-batch's share)."""
    import keras

    import tf_ipu

    with tf_ipu.IPUStrategy().scope():
        model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(256, activation="relu"),
                                  keras.layers.Dense(256, activation="relu"), keras.layers.Dense(8)])
        model.compile(optimizer="sgd", loss="mse")
        model.set_pipeline_stage_assignment([0, 1, 1])
        model.set_pipelining_options(gradient_accumulation_steps_per_replica=8)
    est = tf_ipu.estimate(model, 4, training=True, ipu_version="ipu2")
    assert (est.pipeline_stages, est.micro_batches, est.ipus_per_replica) == (2, 8, 2)
    assert len(est.ipus) == 2 and est.peak_tile_bytes == max(i["peak_tile_bytes"] for i in est.ipus)
    assert "2-stage grouped pipeline over 2 IPUs" in est.summary()
    t = tf_ipu.estimate(model, 4, training=True, ipu_version="ipu2", dataset_size=3200, epochs=2)
    updates = 2 * 3200 // (4 * 8)
    assert t.effective_batch == 32 and t.updates() == updates
    assert t.time_to_train_s == pytest.approx(updates * 8 * t.step.cycles / t.step.clock_hz, rel=1e-9)
    with pytest.raises(ValueError, match="is pipelined: its micro-batches per weight update"):
        tf_ipu.estimate(model, 4, training=True, dataset_size=3200,
                        gradient_accumulation_steps_per_replica=4)


def test_stage_scopes_are_read_from_merged_op_names():
    """An instruction XLA made of several TF ops carries their names joined by ";": its stage
    scope is read after a ";" as after a "/" (it was missed, and the instruction took its
    operand's stage); a name that only contains the scope's text names no stage."""
    from tf_ipu.lowering.stages import scoped_stage

    assert scoped_stage("Exp;tf_ipu_stage_1/PartitionedCall/Exp") == 1
    assert scoped_stage("model/tf_ipu_stage_0_1/dense/MatMul") == 0   # a scope entered twice
    assert scoped_stage("a/tf_ipu_stage_2/b;c/tf_ipu_stage_3/d") == 3   # the innermost, last
    assert scoped_stage("tf_ipu_stage_12x/b") is None
    assert scoped_stage("Exp;PartitionedCall/Exp") is None
