"""The tile model's estimate of pipelined programs (device_server/emulator/tiles/pipeline.py).

A pipelined program is one replica's, each instruction tagged with its stage (IR attribute
``pipeline_stage``); each stage runs on its IPU. The modules here are Keras training steps
lowered as the host lowers them, their stages set on the IR by the layer each instruction
belongs to (gradients and updates with their layer; the rest after its operands), as
/tmp/pipeline_contract.md describes. The pipeline's figures are recomputed here from the
stages' reported cycles and the system's links, without the model's code
(docs/tile_model.md, "Pipelines").
"""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET

import pytest

from device_server.emulator import CompileOptions, OutOfMemoryError, compile_module, get_target
from device_server.emulator.tiles import Estimate, estimate_module
from device_server.emulator.tiles.irinfo import STAGE_ATTR, layer_name
from device_server.emulator.tiles.replication import GCL_STEP_OVERHEAD_S
from device_server.protocol import hardware, ir_pb2

IPU2 = get_target("ipu2")


@pytest.fixture(scope="module")
def tf():
    import tensorflow as tf

    return tf


def _lowered(tf, layers, width, batch, name, optimizer="sgd"):
    """A Keras MLP's training step (``layers`` Dense layers d0, d1, ... and a head)."""
    import keras

    from tf_ipu.lowering.program import lower_function

    model = keras.Sequential([keras.Input((width,))]
                             + [keras.layers.Dense(width, activation="relu", name=f"d{i}")
                                for i in range(layers)]
                             + [keras.layers.Dense(10, name="head")])
    model.compile(optimizer=optimizer,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))

    def step(x, y):
        return model.train_step((x, y))

    lowered = lower_function(step, [tf.TensorSpec([batch, width]), tf.TensorSpec([batch], tf.int32)],
                             name)
    kinds = {n: {"arg": "argument", "var": "variable", "const": "constant"}[p["kind"]]
             for n, p in enumerate(json.loads(lowered.signature)["params"])}
    return lowered.module, kinds


def _staged(module: ir_pb2.Module, stage_of_layer: dict[str, int]) -> ir_pb2.Module:
    """A copy of ``module`` with ``pipeline_stage`` set: an instruction of a layer (its
    forward, gradient or variable) takes the layer's stage; any other the latest stage of
    its operands (what follows the model's output goes last), else 0."""
    out = ir_pb2.Module()
    out.CopyFrom(module)
    for comp in out.computations:
        stage: dict[int, int | None] = {}
        for instr in comp.instructions:
            s = stage_of_layer.get(layer_name(instr).removesuffix(" (backward)"))
            if s is None:
                s = max((stage[o] for o in instr.operands if stage.get(o) is not None), default=None)
            stage[instr.id] = s
        for instr in comp.instructions:
            instr.attrs[STAGE_ATTR].i = stage[instr.id] or 0
    return out


@pytest.fixture(scope="module")
def mlp(tf):
    """4 Dense layers of 512 and a head, batch 64, SGD; stages 0 (d0, d1) and 1 (d2, d3, head)."""
    module, kinds = _lowered(tf, 4, 512, 64, "mlp")
    return _staged(module, {"d0": 0, "d1": 0, "d2": 1, "d3": 1, "head": 1}), kinds


def _estimate(mlp, **kw) -> Estimate:
    module, kinds = mlp
    kw.setdefault("pipeline_stages", 2)
    return estimate_module(module, None, kw.pop("target", IPU2), param_kinds=kinds, **kw)


def _ipu(est: Estimate, i: int) -> dict:
    return next(d for d in est.ipus if d["ipu"] == i)


# ------------------------------------------------------------------ memory per IPU


def test_memory_per_ipu_is_reported_and_each_ipu_holds_its_stages_variables(mlp) -> None:
    one = _estimate(mlp, pipeline_stages=1)
    est = _estimate(mlp, micro_batches=8)
    assert est.pipeline_stages == 2 and est.ipus_per_replica == 2 and est.stage_ipus == [0, 1]
    assert [d["stages"] for d in est.ipus] == [[0], [1]]
    weights = {0: 2 * (512 * 512 + 512) * 4, 1: 2 * (512 * 512 + 512) * 4 + (512 * 10 + 10) * 4}
    for i, d in enumerate(est.ipus):
        variables = d["bytes_by_category"]["variables"]
        assert variables >= weights[i]                          # its own layers' variables
        assert variables < weights[i] + weights[1 - i]          # not the other IPU's
        assert len(d["tile_bytes"]) == IPU2.tiles_per_ipu
        assert d["peak_tile_bytes"] == max(d["tile_bytes"])
        assert d["fits"]
    worst = max(est.ipus, key=lambda d: d["peak_tile_bytes"])
    assert (est.peak_ipu, est.peak_tile, est.peak_tile_bytes) == \
        (worst["ipu"], worst["peak_tile"], worst["peak_tile_bytes"])
    # Split over two IPUs, each holds less than the whole program on one.
    assert all(d["always_live_bytes"] < one.always_live_bytes for d in est.ipus)
    assert sum(d["bytes_by_category"]["variables"] for d in est.ipus) == \
        pytest.approx(sum(one.memory["variables"]), rel=0.01)
    assert est.fits and est.memory_order in ("scheduled", "hlo")


def test_interleaved_needs_less_memory_than_grouped(mlp) -> None:
    grouped = _estimate(mlp, micro_batches=8, pipeline_schedule="grouped")
    interleaved = _estimate(mlp, micro_batches=8, pipeline_schedule="interleaved")
    sequential = _estimate(mlp, micro_batches=8, pipeline_schedule="sequential")
    # Micro-batches in flight per stage: 2(S-1-s)+1, S-s, 1.
    assert [s["in_flight"] for s in grouped.stages] == [3, 1]
    assert [s["in_flight"] for s in interleaved.stages] == [2, 1]
    assert [s["in_flight"] for s in sequential.stages] == [1, 1]
    stash = grouped.stages[0]["stash_bytes"]
    assert stash > 0
    assert _ipu(grouped, 0)["stash_bytes"] == 2 * stash
    assert _ipu(interleaved, 0)["stash_bytes"] == stash
    assert _ipu(sequential, 0)["stash_bytes"] == 0
    for i in (0, 1):
        assert _ipu(sequential, i)["peak_tile_bytes"] <= _ipu(interleaved, i)["peak_tile_bytes"] \
            <= _ipu(grouped, i)["peak_tile_bytes"]
    assert _ipu(interleaved, 0)["peak_tile_bytes"] < _ipu(grouped, 0)["peak_tile_bytes"]
    assert interleaved.total_bytes < grouped.total_bytes
    # ... and the schedules differ in time: sequential runs one stage at a time.
    assert grouped.pipeline_cycles_per_update < sequential.pipeline_cycles_per_update


def test_recomputation_lowers_memory_and_adds_cycles(mlp) -> None:
    plain = _estimate(mlp, micro_batches=8)
    again = _estimate(mlp, micro_batches=8, recomputation=True)
    s0, s1 = again.stages
    assert s0["recomputation"] and s0["recompute_cycles"] == s0["forward_cycles"] > 0
    assert not s1["recomputation"] and s1["recompute_cycles"] == 0  # the last stage: k = 1
    # Stage 0 keeps its input checkpoint (the streamed batch) instead of its activations.
    assert 0 < s0["checkpoint_bytes"] < s0["stash_bytes"]
    assert _ipu(again, 0)["stash_bytes"] == 2 * s0["checkpoint_bytes"]
    assert _ipu(again, 0)["peak_tile_bytes"] < _ipu(plain, 0)["peak_tile_bytes"]
    assert again.total_bytes < plain.total_bytes
    assert again.pipeline_cycles_per_update > plain.pipeline_cycles_per_update
    assert again.cycles > plain.cycles


# ------------------------------------------------------------------ time


def _send_seconds(system: hardware.System, a: int, b: int, nbytes: float) -> float:
    """Bytes over the path from IPU a to IPU b: the slowest hop's bandwidth + the hops' latencies."""
    path = system.path(a, b)
    hops = list(zip(path, path[1:], strict=False))
    return nbytes / min(system.link(u, v).bytes_per_s for u, v in hops) + \
        sum(system.link(u, v).latency_s for u, v in hops)


def test_two_stage_time_per_update_tends_to_the_slower_stage_times_micro_batches(mlp) -> None:
    system = hardware.plain_system(2, "ipu2")
    clock = IPU2.clock_hz
    ratios = []
    for m in (2, 8, 32, 128):
        est = _estimate(mlp, micro_batches=m)
        s0, s1 = est.stages
        slower = max(s["forward_cycles"] + s["backward_cycles"] for s in est.stages)
        # A steady-state slot: both IPUs run a forward and a backward; stage 0 sends its
        # activations forwards while stage 1 sends its gradients back; one sync.
        sends = max(_send_seconds(system, 0, 1, s0["sends_forward_bytes"]),
                    _send_seconds(system, 1, 0, s1["sends_backward_bytes"])) * clock
        sync = IPU2.sync_cycles + 2 * system.link(0, 1).latency_s * clock
        steady = slower + sends + sync
        update = max(s["update_cycles"] for s in est.stages)
        # Grouped: M + 2(S - 1) slots, the first and last S - 1 of them only partly busy.
        assert len(est.pipeline_timeline) == m + 2
        assert est.pipeline_cycles_per_update <= (m + 2) * steady + update + 1
        assert est.pipeline_cycles_per_update >= m * steady
        ratios.append(est.pipeline_cycles_per_update / (m * slower))
        limit = steady / slower
        assert est.weight_updates_per_call == pytest.approx(1 / m)
        assert est.device_cycles == pytest.approx(est.pipeline_cycles_per_update / m, rel=1e-3, abs=2)
    assert ratios == sorted(ratios, reverse=True)
    assert ratios[-1] == pytest.approx(limit, rel=0.02)   # the slower stage (and its sends)
    assert ratios[0] > 1.2 * ratios[-1]                   # ramp-up and ramp-down, amortized


def test_the_timeline_has_stages_by_micro_batches(mlp, tmp_path) -> None:
    est = _estimate(mlp, micro_batches=4, pipeline_schedule="interleaved")
    slots = est.pipeline_timeline
    assert len(slots) == 2 * 4 + 2 * 2 - 2
    passes = [tuple(p) for sl in slots for p in sl["passes"]]
    assert sorted(passes) == sorted((s, i, k) for s in (0, 1) for i in range(4) for k in "FB")
    # Interleaved: one pass per stage per slot.
    for sl in slots:
        stages = [p[0] for p in sl["passes"]]
        assert len(stages) == len(set(stages))
    d = json.loads(est.to_json())
    back = Estimate.from_dict(d)
    assert back.stages == est.stages and back.ipus == est.ipus
    assert back.pipeline_timeline == est.pipeline_timeline
    page = open(est.save_html(str(tmp_path / "pipeline.html"))).read()
    ET.fromstring(page)  # well-formed
    assert "Memory per IPU" in page and "Pipeline: stages and timeline" in page
    assert "micro-batch 3 on stage 1" in page


def test_several_stages_on_one_ipu_need_no_sends(mlp) -> None:
    est = _estimate(mlp, stage_ipus=(0, 0), micro_batches=4)
    assert est.ipus_per_replica == 1 and [d["stages"] for d in est.ipus] == [[0, 1]]
    assert est.pipeline_transfers == []
    assert all(sl["transfer"] == 0 and sl["sync"] == 0 for sl in est.pipeline_timeline)


def test_pipelined_replicas_all_reduce_per_stage_ipu(mlp) -> None:
    module, kinds = mlp
    bow = get_target("bow")
    system = hardware.get_system("bow2000")
    variables = sum(4 * int(__import__("numpy").prod(i.shape.dims)) for i in
                    module.computations[-1].instructions
                    if i.opcode == "parameter" and kinds.get(i.parameter_number) == "variable")
    est = estimate_module(module, None, bow, param_kinds=kinds, pipeline_stages=2, micro_batches=4,
                          replicas=2, system=system, implied_all_reduce_bytes=variables)
    est.items_per_call = 64  # the batch of the one micro-batch a call runs, per replica
    assert est.replicas == 2 and est.ipu_ids == [0, 1, 2, 3]
    # IPU 0 of each replica (0 and 2) all-reduce stage 0's share, IPU 1 (1 and 3) stage 1's.
    var_bytes = {0: 0, 1: 0}
    for i in module.computations[-1].instructions:
        if i.opcode == "parameter" and kinds.get(i.parameter_number) == "variable":
            var_bytes[i.attrs[STAGE_ATTR].i] += 4 * int(__import__("numpy").prod(i.shape.dims))
    expected = 0.0
    for stage, (a, b) in ((0, (0, 2)), (1, (1, 3))):
        link = system.link(a, b)
        sync = bow.sync_cycles / bow.clock_hz + 2 * link.latency_s
        step = link.latency_s + sync + GCL_STEP_OVERHEAD_S
        nbytes = variables * var_bytes[stage] / sum(var_bytes.values())
        expected = max(expected, 2 * 1 / 2 * nbytes / link.bytes_per_s + 2 * step)
    per_call = expected * bow.clock_hz * est.weight_updates_per_call
    assert est.all_reduce_cycles == pytest.approx(per_call, rel=0.01)
    assert est.cycles == est.device_cycles + est.all_reduce_cycles + est.replica_sync_cycles \
        + est.host_cycles
    assert est.throughput == pytest.approx(2 * 64 / est.seconds)
    # The same IPUs named by each replica's first one (as the device server names them).
    again = estimate_module(module, None, bow, param_kinds=kinds, pipeline_stages=2, micro_batches=4,
                            replicas=2, system=system, ipu_ids=(0, 2),
                            implied_all_reduce_bytes=variables)
    assert again.ipu_ids == [0, 1, 2, 3] and again.cycles == est.cycles


@pytest.fixture(scope="module")
def device_loop(tf):
    """A device loop of 8 micro-batches (a ``while`` named as the host names it) of a 2-layer
    step that accumulates its gradients and updates every 4 micro-batches in a ``cond``,
    as Keras's gradient accumulation does; layer d0 in stage 0, d1 in stage 1."""
    from tf_ipu.lowering.program import lower_function

    w = [tf.Variable(tf.zeros([256, 256]), name=f"d{n}/kernel") for n in range(2)]
    acc = [tf.Variable(tf.zeros([256, 256]), name=f"d{n}/accumulator") for n in range(2)]

    def loop(n, xs, ys):
        def body(i):
            with tf.GradientTape() as tape:
                h = xs[i]
                with tf.name_scope("model"):
                    for k in range(2):
                        with tf.name_scope(f"d{k}"):
                            h = tf.nn.relu(h @ w[k])
                loss = tf.reduce_mean((h - ys[i]) ** 2)
            for a, g in zip(acc, tape.gradient(loss, w), strict=True):
                a.assign_add(g)

            def update():
                with tf.name_scope("model"):
                    for k in range(2):
                        with tf.name_scope(f"d{k}"):
                            w[k].assign_sub(0.1 * acc[k])
                            acc[k].assign(tf.zeros_like(acc[k]))
                return tf.constant(0)

            tf.cond(tf.equal((i + 1) % 4, 0), update, lambda: tf.constant(0))
            return [i + 1]

        return tf.while_loop(lambda i: i < n, body, [tf.constant(0)], name="tf_ipu_device_loop")

    specs = [tf.TensorSpec([], tf.int32), tf.TensorSpec([8, 64, 256]), tf.TensorSpec([8, 64, 256])]
    lowered = lower_function(loop, specs, "device_loop")
    kinds = {n: {"arg": "argument", "var": "variable", "const": "constant"}[p["kind"]]
             for n, p in enumerate(json.loads(lowered.signature)["params"])}
    return _staged(lowered.module, {"d0": 0, "d1": 1}), kinds


def test_a_device_loop_runs_its_micro_batches_as_weight_updates(device_loop) -> None:
    module, kinds = device_loop
    est = estimate_module(module, None, IPU2, param_kinds=kinds, pipeline_stages=2, micro_batches=4)
    assert est.micro_batches_per_call == 8 and est.weight_updates_per_call == 2
    for s in est.stages:   # the update (in the conditional) once per 4 micro-batches
        assert s["forward_cycles"] > 0 and s["backward_cycles"] > 0 and s["update_cycles"] > 0
    assert [d["bytes_by_category"]["variables"] for d in est.ipus] == [2 * 256 * 256 * 4] * 2
    extra = est.device_cycles - 2 * est.pipeline_cycles_per_update
    assert -2 <= extra < 0.05 * est.device_cycles   # the call's own steps around the loop
    one = estimate_module(module, None, IPU2, param_kinds=kinds)
    assert one.pipeline_stages == 1 and one.loops[0]["trips"] == 8


# ------------------------------------------------------------------ errors and the compiler


def test_a_stage_mapped_to_an_ipu_the_replica_lacks_is_a_value_error(mlp) -> None:
    with pytest.raises(ValueError, match=r"stage 1 is mapped to IPU 2 of its replica, but a "
                                         r"replica has 2 IPUs \(ipus_per_replica=2\)"):
        _estimate(mlp, stage_ipus=(0, 2), ipus_per_replica=2)
    with pytest.raises(ValueError, match=r"one IPU per pipeline stage: 3 IPU\(s\) \[0, 1, 1\] for 2"):
        _estimate(mlp, stage_ipus=(0, 1, 1))
    with pytest.raises(ValueError, match=r"2 replica\(s\) of 4 IPUs need 8 IPUs, but system "
                                         r"'bow2000' has 4"):
        _estimate(mlp, target=get_target("bow"), system="bow2000", replicas=2, stage_ipus=(0, 3))
    with pytest.raises(ValueError, match=r"ipu_ids must name 2 IPU\(s\) per replica \(2 for 1 "
                                         r"replica\(s\)\), or each replica's first IPU. Received 3"):
        _estimate(mlp, ipu_ids=(3, 4, 5))
    with pytest.raises(ValueError, match=r"ipu_ids \[4\] are not IPUs of system '4xipu2'"):
        _estimate(mlp, ipu_ids=(3,), system=hardware.plain_system(4, "ipu2"))
    with pytest.raises(ValueError, match="pipeline_schedule must be one of"):
        _estimate(mlp, pipeline_schedule="zigzag")


def test_an_instruction_in_a_stage_beyond_the_count_is_a_value_error(mlp) -> None:
    module, kinds = mlp
    three = _staged(module, {"d0": 0, "d1": 1, "d2": 2, "d3": 2, "head": 2})
    with pytest.raises(ValueError, match=r"is in pipeline stage 2, but the program has 2 stages"):
        estimate_module(three, None, IPU2, param_kinds=kinds, pipeline_stages=2)
    est = estimate_module(three, None, IPU2, param_kinds=kinds, pipeline_stages=3, micro_batches=6)
    assert [s["in_flight"] for s in est.stages] == [5, 3, 1]
    assert [d["stages"] for d in est.ipus] == [[0], [1], [2]] and est.ipus_per_replica == 4


def test_compile_module_estimates_the_pipeline_its_options_describe(mlp) -> None:
    module, _ = mlp
    opts = CompileOptions(pipeline_stages=2, stage_ipus=(0, 1), ipus_per_replica=2,
                          pipeline_schedule="interleaved", micro_batches=4, recomputation=True)
    est = compile_module(module, IPU2, opts).estimate
    assert (est.pipeline_stages, est.pipeline_schedule, est.micro_batches, est.recomputation,
            est.ipus_per_replica) == (2, "interleaved", 4, True, 2)
    with pytest.raises(ValueError, match="stage 1 is mapped to IPU 1 of its replica"):
        compile_module(module, IPU2, CompileOptions(pipeline_stages=2, ipus_per_replica=1))


def test_out_of_memory_names_the_ipu_the_tile_the_stage_and_the_layer(tf) -> None:
    """A narrow stage 0 and a 7000 x 7000 FP32 Dense in stage 1: only IPU 1 overflows a GC2."""
    import keras

    from tf_ipu.lowering.program import lower_function

    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(7000, name="narrow"),
                              keras.layers.Dense(7000, name="huge_dense")])
    model.compile(optimizer="sgd", loss="mse")

    def step(x, y):
        return model.train_step((x, y))

    lowered = lower_function(step, [tf.TensorSpec([4, 8]), tf.TensorSpec([4, 7000])], "oom")
    kinds = {n: {"arg": "argument", "var": "variable", "const": "constant"}[p["kind"]]
             for n, p in enumerate(json.loads(lowered.signature)["params"])}
    module = _staged(lowered.module, {"narrow": 0, "huge_dense": 1})
    gc2 = get_target("ipu1")
    est = estimate_module(module, None, gc2, param_kinds=kinds, pipeline_stages=2, micro_batches=2)
    assert not est.fits and est.peak_ipu == 1
    assert _ipu(est, 0)["fits"] and not _ipu(est, 1)["fits"]
    message = est.oom_message()
    assert message.startswith(f"Out of memory on IPU 1 of the replica (IPU id 1, pipeline stage 1), "
                              f"tile {est.peak_tile}: {est.peak_tile_bytes} bytes")
    assert "stage 1, Keras layer 'huge_dense'" in message
    with pytest.raises(OutOfMemoryError, match=r"IPU 1 .*pipeline stage 1.*huge_dense"):
        compile_module(module, gc2, CompileOptions(pipeline_stages=2, ipus_per_replica=2,
                                                   micro_batches=2))
