"""Per-stage Poplar options of a pipeline (Graphcore's ``PipelineStageOptions``): each stage's
``availableMemoryProportion`` plans the matmuls of that pass of that stage in the tile model
(device_server/emulator/tiles/proportions.py; docs/tile_model.md, "availableMemoryProportion").

A two-stage MLP (FP32, 16 tiles a GC200 IPU so that the proportion binds): a low proportion on
stage 0 lowers the temporaries of stage 0's products in the pass it is given for, and leaves
stage 1's plans as they were; ``tf_ipu.estimate`` reads the model's options and a per-stage
list, and the compile path (gRPC options, the server's checks) plans the same program the same
way; a pipeline trained with the options gives the weights of plain Keras on the CPU within
1e-5 relative L2 (FP32). About 40 s on 2 shared cores.
"""

from __future__ import annotations

import numpy as np
import pytest
from keras_util import attached_ipus, rel_l2

TILES = 16
RNG = np.random.default_rng(11)
X = RNG.normal(size=(32, 64)).astype("float32")
Y = RNG.normal(size=(32, 64)).astype("float32")


def _options(*amps):
    from tensorflow.python.ipu import pipelining_ops

    return [pipelining_ops.PipelineStageOptions(
        matmul_options={"availableMemoryProportion": str(a)}) for a in amps]


def _model(width: int = 512, strategy=None, **pipelining):
    """Dense(width) -> ReLU in stage 0, Dense(width) in stage 1, SGD, mse, under ``strategy``
    (a new IPUStrategy by default); ``pipelining``: set_pipelining_options' per-stage options."""
    import keras

    import tf_ipu

    with (strategy or tf_ipu.IPUStrategy()).scope():
        inputs = keras.Input((width,))
        with keras.ipu.PipelineStage(0):
            x = keras.layers.Dense(width, activation="relu", name="first")(inputs)
        with keras.ipu.PipelineStage(1):
            y = keras.layers.Dense(width, name="second")(x)
        model = keras.Model(inputs, y)
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
        model.set_pipelining_options(gradient_accumulation_steps_per_replica=4,
                                     gradient_accumulation_reduction_method="mean",
                                     device_mapping=[0, 1], **pipelining)
    return model


@pytest.fixture(scope="module")
def captured():
    """tf_ipu.estimate of the model with stage 0's forward and backward at 0.05 (none on
    stage 1): the estimate, and the module and arguments it gave the tile model."""
    import importlib

    import tf_ipu

    estimate_module = importlib.import_module("tf_ipu.estimate")  # the module, not the function
    seen = {}
    original = estimate_module.estimate_module

    def spy(module, live, target, **kwargs):
        seen.update(module=module, target=target, kwargs=kwargs)
        return original(module, live, target, **kwargs)

    estimate_module.estimate_module = spy
    try:
        model = _model(forward_propagation_stages_poplar_options=[*_options(0.05), _plain()],
                       backward_propagation_stages_poplar_options=[*_options(0.05), _plain()])
        est = tf_ipu.estimate(model, 256, training=True, ipu_version="ipu2", tiles_per_ipu=TILES)
    finally:
        estimate_module.estimate_module = original
    return est, seen


def _plain():
    from tensorflow.python.ipu import pipelining_ops

    return pipelining_ops.PipelineStageOptions()


def _products(plan, module):
    """(stage, phase) -> {name: (temporaries per tile, plan)} of the dots planned."""
    from device_server.emulator.tiles.irinfo import stage_of
    from device_server.emulator.tiles.pipeline import phases

    phase = phases(module)
    out: dict[tuple[int, str], dict[str, tuple[float, str]]] = {}
    for comp in module.computations:
        for instr in comp.instructions:
            if instr.opcode == "dot" and instr.name in plan.ops:
                rec = plan.op(instr.name)
                out.setdefault((stage_of(instr), phase[instr.name]), {})[instr.name] = (
                    rec.temp_bytes_per_tile, rec.plan)
    return out


def _plan(seen, entries):
    from device_server.emulator.tiles.planner import plan_module

    kw = seen["kwargs"]
    return plan_module(seen["module"], seen["target"], param_kinds=kw["param_kinds"],
                       stages=kw["pipeline_stages"], memory_proportions=kw["memory_proportions"],
                       stage_memory_proportions=entries)


def test_a_stage_proportion_replans_that_stage_and_pass_only(captured) -> None:
    est, seen = captured
    entries = seen["kwargs"]["stage_memory_proportions"]
    assert sorted(entries) == [("backward", 0, "matmul", 0.05), ("forward", 0, "matmul", 0.05)]
    module = seen["module"]
    base = _products(_plan(seen, ()), module)
    low = _products(_plan(seen, entries), module)
    forward_only = _products(_plan(seen, [("forward", 0, "matmul", 0.05)]), module)
    assert {(0, "forward"), (0, "backward"), (1, "forward"), (1, "backward")} <= set(base)
    peak = {k: max(t for t, _ in v.values()) for k, v in base.items()}
    for key in ((0, "forward"), (0, "backward")):  # fewer temporaries, none more
        assert max(t for t, _ in low[key].values()) < peak[key], key
        assert all(low[key][n][0] <= base[key][n][0] for n in base[key]), key
    for key in ((1, "forward"), (1, "backward")):  # stage 1's plans untouched
        assert low[key] == base[key], key
    # Only the pass given: the forward's plans change, the backward's stay.
    assert forward_only[(0, "backward")] == base[(0, "backward")]
    assert forward_only[(0, "forward")] == low[(0, "forward")]
    assert est.context["stage_available_memory_proportion"] == {
        "backward matmul": [0.05, None], "forward matmul": [0.05, None]}


def test_the_estimate_takes_the_models_options_or_a_list_per_stage(captured) -> None:
    import tf_ipu

    est, _ = captured
    plain = tf_ipu.estimate(_model(), 256, training=True, ipu_version="ipu2",
                            tiles_per_ipu=TILES)
    listed = tf_ipu.estimate(_model(), 256, training=True, ipu_version="ipu2",
                             tiles_per_ipu=TILES, available_memory_proportion=[0.05, None])
    by_ipu = [{d["ipu"]: d["peak_tile_bytes"] for d in getattr(e, "step", e).ipus}
              for e in (plain, est, listed)]
    assert by_ipu[1][0] < by_ipu[0][0]          # IPU 0 (stage 0): the products planned smaller
    assert by_ipu[1][1] == by_ipu[0][1]         # IPU 1 (stage 1): as without options
    assert by_ipu[2] == by_ipu[1]               # the list: the same per stage, both passes


def test_compile_plans_as_the_estimate_and_training_matches_keras(captured, ipu_system) -> None:
    import keras

    import tf_ipu
    from device_server.emulator import CompileOptions, compile_module

    est, seen = captured
    kw = seen["kwargs"]
    opts = CompileOptions(pipeline_stages=2, stage_ipus=(0, 1), ipus_per_replica=2,
                          micro_batches=kw["micro_batches"],
                          stage_memory_proportions=kw["stage_memory_proportions"])
    compiled = compile_module(seen["module"], seen["target"], opts).estimate
    step = getattr(est, "step", est)
    assert [d["peak_tile_bytes"] for d in compiled.ipus] == [d["peak_tile_bytes"] for d in step.ipus]
    assert compiled.context["stage_available_memory_proportion"] == \
        step.context["stage_available_memory_proportion"]

    # Trained on the device server (the options cross gRPC): CPU Keras's weights.
    width = 64
    keras.utils.set_random_seed(3)
    reference = keras.Sequential([keras.Input((width,)),
                                  keras.layers.Dense(width, activation="relu"),
                                  keras.layers.Dense(width)])
    initial = reference.get_weights()
    reference.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    reference.fit(X, Y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    with attached_ipus(ipu_system, 2):
        strategy = tf_ipu.IPUStrategy()
        model = _model(width, strategy,
                       forward_propagation_stages_poplar_options=_options(0.05, 0.3),
                       backward_propagation_stages_poplar_options=_options(0.1, 0.3))
        with strategy.scope():
            model.set_weights(initial)
            model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse", steps_per_execution=4)
        model.fit(X, Y, batch_size=4, epochs=2, shuffle=False, verbose=0)
        weights = model.get_weights()
        report = [r for r in strategy.reports if r.stages == 2][-1]
    assert max(rel_l2(a, b) for a, b in zip(weights, reference.get_weights(), strict=True)) <= 1e-5
    assert report.details["context"]["stage_available_memory_proportion"] == {
        "backward matmul": [0.1, 0.3], "forward matmul": [0.05, 0.3]}


def test_bad_stage_options_name_the_option_the_stage_and_the_value() -> None:
    from tensorflow.python.ipu import pipelining_ops

    import tf_ipu
    from device_server.emulator import CompileOptions, compile_module, get_target
    from device_server.protocol import ir_pb2

    with pytest.raises(ValueError, match=r"forward_propagation_stages_poplar_options\[1\] "
                                         r"\(pipeline stage 1\)\.matmul_options"
                                         r"\['availableMemoryProportion'\].*Received: '1\.5'"):
        _model(forward_propagation_stages_poplar_options=_options(0.2, 1.5))
    with pytest.raises(ValueError, match=r"backward_propagation_stages_poplar_options\[0\].*"
                                         r"'availableMemoryProportions' is not a PopLibs matMul "
                                         r"option\. Did you mean 'availableMemoryProportion'"):
        _model(backward_propagation_stages_poplar_options=[
            pipelining_ops.PipelineStageOptions(
                matmul_options={"availableMemoryProportions": "0.2"}), _plain()])
    with pytest.raises(TypeError, match=r"forward_propagation_stages_poplar_options\[0\] "
                                        r"\(pipeline stage 0\) must be a PipelineStageOptions"):
        _model(forward_propagation_stages_poplar_options=[{"availableMemoryProportion": "0.2"}])
    with pytest.raises(TypeError, match="PipelineStageOptions.matmul_options must be a dict"):
        pipelining_ops.PipelineStageOptions(matmul_options=[("availableMemoryProportion", "0.2")])
    # One per stage, as Graphcore's rule: counted once the stages are known.
    model = _model(forward_propagation_stages_poplar_options=_options(0.2, 0.2, 0.2))
    with pytest.raises(ValueError, match=r"forward_propagation_stages_poplar_options has 3 "
                                         r"PipelineStageOptions for 2 pipeline stages"):
        tf_ipu.estimate(model, 8, training=True, tiles_per_ipu=TILES)
    with pytest.raises(ValueError, match=r"available_memory_proportion gives 3 proportions for "
                                         r"the 2 pipeline stages"):
        tf_ipu.estimate(_model(64), 8, training=True, tiles_per_ipu=TILES,
                        available_memory_proportion=[0.1, 0.2, 0.3])
    with pytest.raises(ValueError, match=r"available_memory_proportion\[1\] \(pipeline stage 1\) "
                                         r"must be a number in \[0, 1\].*Received: 2"):
        tf_ipu.estimate(_model(64), 8, training=True, tiles_per_ipu=TILES,
                        available_memory_proportion=[0.1, 2])
    # The emulator's own check (compile requests are checked the same way).
    with pytest.raises(ValueError, match=r"pipeline stage 2 is not one of the program's 2 stages"):
        compile_module(ir_pb2.Module(), get_target("ipu2"),
                       CompileOptions(pipeline_stages=2, stage_memory_proportions=(
                           ("forward", 2, "matmul", 0.2),)))


def test_server_checks_and_graphcore_names() -> None:
    from tensorflow.python import ipu

    import tf_ipu
    from device_server.compile_requests import pipeline_options
    from device_server.protocol import device_pb2
    from device_server.sessions import ServiceError

    assert ipu.ops.pipelining_ops.PipelineStageOptions is tf_ipu.pipelining.PipelineStageOptions
    opts = device_pb2.CompileOptions(pipeline_stages=2, stage_ipus=[0, 1], ipus_per_replica=2)
    opts.stage_memory_proportions.add(phase="backward", stage=1, kind="convolution",
                                      proportion=0.25)
    assert pipeline_options(opts, "m")["stage_memory_proportions"] == (
        ("backward", 1, "convolution", 0.25),)
    opts.stage_memory_proportions.add(phase="backward", stage=1, kind="matmul", proportion=1.25)
    with pytest.raises(ServiceError, match=r"backward pass of pipeline stage 1 has matmul "
                                           r"availableMemoryProportion 1\.25"):
        pipeline_options(opts, "m")
    # Serving's pipelines pass theirs as the stages' forward options.
    from tf_ipu import serving

    plan = serving._pipeline_plan(2, None, None, _options(0.1, 0.4), "export_pipeline")
    assert plan["stage_memory_proportions"] == [["forward", 0, "matmul", 0.1],
                                                ["forward", 1, "matmul", 0.4]]
