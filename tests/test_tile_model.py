"""The tile model (device_server/emulator/tiles) checked against its own physics.

Hand-built IR (tests/emulator_util.IRBuilder) where possible, so that every test plans in
milliseconds; a tiny Keras model for ``tf_ipu.estimate``. Full-size models are in
``bench/bench_estimate.py``.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import xml.etree.ElementTree as ET

import emulator_util as eu
import numpy as np
import pytest

from device_server.emulator import CompileOptions, OutOfMemoryError, compile_module, get_target
from device_server.emulator.tiles import TileMapping, estimate_module, plan_module
from device_server.emulator.tiles.matmul import MatmulProblem, plan_matmul

IPU2 = get_target("ipu2")


def _dot_module(n: int, dtype: type, variables: bool = False) -> eu.ir_pb2.Module:
    b = eu.IRBuilder("dot")
    x = b.parameter(dtype, [n, n])
    y = b.parameter(dtype, [n, n])
    d = b.op("dot", [x, y], dtype, [n, n], source_op="model/dense/MatMul",
             lhs_contracting_dimensions=[1], rhs_contracting_dimensions=[0],
             lhs_batch_dimensions=[], rhs_batch_dimensions=[])
    b.root(b.op("add", [d, y], dtype, [n, n], source_op="model/dense/BiasAdd"))
    module = b.module()
    if variables:
        for instr in module.computations[0].instructions:
            if instr.opcode == "parameter":
                instr.source_type = "variable"
    return module


def _binary(opcode: str, n: int, dtype: type = np.float32) -> eu.ir_pb2.Module:
    b = eu.IRBuilder(opcode)
    x = b.parameter(dtype, [n])
    y = b.parameter(dtype, [n])
    b.root(b.op(opcode, [x, y], dtype, [n], source_op="model/layer/op"))
    return b.module()


def test_large_fp16_dot_is_below_but_near_the_amp_peak() -> None:
    n = 4096
    for name in ("ipu2", "bow", "ipu1"):
        t = get_target(name)
        est = estimate_module(_dot_module(n, np.float16), None, t)
        peak_per_cycle = t.amp_fp16_flops_per_cycle_per_tile * t.tiles_per_ipu
        ideal = 2 * n**3 / peak_per_cycle
        plan = plan_module(_dot_module(n, np.float16), t)
        dot = next(r for r in plan.ops.values() if r.opcode == "dot")
        share = ideal / dot.cycles
        assert 0.30 <= share <= 0.85, (name, share, dot.plan)
        assert est.device_cycles >= ideal
        assert est.flops >= 2 * n**3
        assert dot.temp_bytes_per_tile <= t.sram_bytes_per_tile


def test_matmul_search_respects_the_memory_budget() -> None:
    p = MatmulProblem(1, 4096, 4096, 4096, 1, 4096 * 4096 * 2, 4096 * 4096 * 2, 0.0, 2, 2, True)
    gc2 = get_target("ipu1")
    plan = plan_matmul(p, gc2)
    assert plan.fits_budget and plan.passes > 1
    assert plan.temp_bytes_per_tile <= gc2.available_memory_proportion * gc2.sram_bytes_per_tile
    # FP32 runs at the FP32 AMP rate: four times the cycles of the FP16 compute.
    p32 = MatmulProblem(1, 1024, 1024, 1024, 1, 4 << 20, 4 << 20, 0.0, 4, 4, True)
    p16 = MatmulProblem(1, 1024, 1024, 1024, 1, 2 << 20, 2 << 20, 0.0, 2, 2, True)
    c32, c16 = plan_matmul(p32, IPU2), plan_matmul(p16, IPU2)
    assert c32.compute_cycles > 2.5 * c16.compute_cycles


def test_elementwise_is_bound_by_tile_memory_bandwidth() -> None:
    t = IPU2
    n = t.tiles_per_ipu * 4096
    plan = plan_module(_binary("add", n), t)
    rec = plan.op("add.3")
    (step,) = rec.steps
    per_tile_bytes = 3 * 4096 * 4  # two operands read, one result written
    floor = per_tile_bytes / (t.memory_bytes_per_cycle_per_tile * t.library_memory_efficiency)
    compute_only = 4096 / t.vector_fp32_flops_per_cycle_per_tile
    assert floor > compute_only  # the op is memory-bound on this preset
    assert floor <= step.compute <= floor + t.vertex_overhead_cycles + 1
    assert step.exchange == 0  # operands laid out like the result: nothing moves


def test_all_to_all_exchange_is_bound_by_the_exchange_rate() -> None:
    t = IPU2
    n = 2944  # 2944 x 2944 float32: every tile sends and receives ~23.5 KB
    b = eu.IRBuilder("transpose")
    x = b.parameter(np.float32, [n, n])
    b.root(b.op("transpose", [x], np.float32, [n, n], permutation=[1, 0]))
    plan = plan_module(b.module(), t)
    (step,) = plan.op("transpose.2").steps
    per_tile = -(-n * n // t.tiles_per_ipu) * 4
    floor = per_tile / t.exchange_bytes_per_cycle_per_tile
    assert floor <= step.exchange <= floor + t.exchange_overhead_cycles + 1


def test_same_cycles_on_bow_and_gc200_less_time_by_the_clock() -> None:
    module = _dot_module(512, np.float16, variables=True)
    gc200, bow = get_target("ipu2"), get_target("bow")
    a = estimate_module(module, None, gc200)
    b = estimate_module(module, None, bow)
    assert a.device_cycles == b.device_cycles > 0
    assert b.device_seconds == pytest.approx(a.device_seconds * gc200.clock_hz / bow.clock_hz)
    # The result still streams to the host over the same link: the same seconds for that part.
    host_a, host_b = a.host_cycles / gc200.clock_hz, b.host_cycles / bow.clock_hz
    assert host_a == pytest.approx(host_b, rel=1e-5) and a.host_bytes_in == 0
    assert b.seconds < a.seconds


def test_unbalanced_mapping_costs_more_cycles() -> None:
    t = IPU2
    T = t.tiles_per_ipu
    n = T * 1024
    module = _binary("multiply", n)
    balanced = plan_module(module, t).op("multiply.3").cycles
    counts = np.full(T, (n // 2) // (T - 1), np.int64)
    counts[0] = n - int(counts[1:].sum())  # half of the elements on tile 0
    skewed = {"parameter.1": TileMapping(0, T, n, T, counts)}
    unbalanced = plan_module(module, t, mappings=skewed).op("multiply.3").cycles
    assert unbalanced > 10 * balanced


def test_a_tensor_on_one_tile_runs_that_tile_out_of_memory() -> None:
    t = IPU2
    n = 300_000  # 1.2 MB: nothing for the chip, twice a tile
    module = _binary("add", n)
    one_tile = {"parameter.1": TileMapping(7, 1, n, t.tiles_per_ipu)}
    est = estimate_module(module, None, t, mappings=one_tile)
    assert not est.fits and est.peak_tile == 7
    assert est.peak_tile_bytes > t.sram_bytes_per_tile
    assert est.total_bytes < 0.01 * t.sram_bytes_per_ipu
    assert "Out of memory on tile 7:" in est.oom_message()
    assert estimate_module(module, None, t).fits  # the same program, laid out linearly


def test_sort_row_on_one_tile_fails_to_compile_out_of_memory() -> None:
    cmp = eu.IRBuilder("less")
    p0, p1 = cmp.parameter(np.float32, []), cmp.parameter(np.float32, [])
    cmp.root(cmp.op("compare", [p0, p1], np.bool_, [], direction="LT", compare_type="FLOAT"))
    b = eu.IRBuilder("sort")
    x = b.parameter(np.float32, [200_000])
    b.root(b.op("sort", [x], np.float32, [200_000], called=[b.computation(cmp)],
                source_op="model/top_k/Sort", dimension=0, is_stable=False))
    module = b.module()
    with pytest.raises(OutOfMemoryError, match=r"Out of memory on tile \d+: \d+ bytes used but "
                                               r"tiles only have 638976 bytes"):
        compile_module(module, IPU2)
    exe = compile_module(module, IPU2, CompileOptions(allow_out_of_memory=True))
    assert not exe.estimate.fits
    assert exe.estimate.total_bytes < 0.01 * IPU2.sram_bytes_per_ipu
    assert "top_k" in exe.estimate.oom_message()


def _huge_dense() -> eu.ir_pb2.Module:
    """A 11000 x 11000 float32 Dense layer (484 MB of weights): more than a GC2 holds
    (256 KiB x 1216 tiles), less than a GC200 (624 KiB x 1472)."""
    b = eu.IRBuilder("huge")
    x = b.parameter(np.float32, [4, 11000])
    w = b.parameter(np.float32, [11000, 11000])
    d = b.op("dot", [x, w], np.float32, [4, 11000], source_op="sequential/huge_dense/MatMul",
             lhs_contracting_dimensions=[1], rhs_contracting_dimensions=[0],
             lhs_batch_dimensions=[], rhs_batch_dimensions=[])
    b.root(d)
    module = b.module()
    params = [i for i in module.computations[0].instructions if i.opcode == "parameter"]
    params[0].source_type = "argument"
    params[1].source_type, params[1].source_op = "variable", "sequential/huge_dense/kernel"
    return module


def test_model_too_large_for_gc2_fits_gc200() -> None:
    module = _huge_dense()
    with pytest.raises(OutOfMemoryError) as info:
        compile_module(module, get_target("ipu1"))
    msg = str(info.value)
    assert "Out of memory on tile " in msg
    assert " bytes used but tiles only have 262144 bytes" in msg
    assert "huge_dense" in msg and "Keras layer" in msg
    exe = compile_module(module, IPU2)
    est = exe.estimate
    assert est.fits and est.peak_tile_bytes <= IPU2.sram_bytes_per_tile
    assert est.total_bytes > get_target("ipu1").sram_bytes_per_ipu


def test_loops_repeat_their_body() -> None:
    import tensorflow as tf

    from tf_ipu.lowering.program import lower_function

    w = tf.Variable(np.ones((64, 64), np.float32))

    def device_loop(n: tf.Tensor, xs: tf.Tensor) -> tf.Tensor:  # the Keras device loop's shape
        def body(i: tf.Tensor, acc: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
            return i + 1, acc + tf.reduce_sum(tf.matmul(xs[i], w))

        first = tf.reduce_sum(tf.matmul(xs[0], w))
        return tf.while_loop(lambda i, *_: i < n, body, (tf.constant(1), first))[1]

    lowered = lower_function(device_loop, [tf.TensorSpec([], tf.int32), tf.TensorSpec([6, 32, 64], tf.float32)],
                             "loop")
    est = estimate_module(lowered.module, None, IPU2)
    (loop,) = est.loops
    assert loop["kind"] == "parameter-bound" and loop["trips"] == 5
    one = loop["cycles_per_trip"]
    assert est.device_cycles >= 5 * one
    assert est.per_iteration_loops == 0 and any("trip" in a for a in est.assumptions)


def test_reductions_run_in_stages() -> None:
    add = eu.IRBuilder("add")
    a, c = add.parameter(np.float32, []), add.parameter(np.float32, [])
    add.root(add.op("add", [a, c], np.float32, []))
    b = eu.IRBuilder("sum")
    x = b.parameter(np.float32, [IPU2.tiles_per_ipu * 1000])
    zero = b.constant(np.float32(0))
    b.root(b.op("reduce", [x, zero], np.float32, [], called=[b.computation(add)], dimensions=[0]))
    rec = plan_module(b.module(), IPU2).op("reduce.3")
    assert len(rec.steps) == 3  # on each tile, then two exchange stages to one result
    assert all(s.exchange > 0 for s in rec.steps[1:])


def test_estimate_dict_keeps_the_compile_fields_and_is_json() -> None:
    exe = compile_module(_dot_module(256, np.float32), IPU2)
    d = json.loads(json.dumps(exe.estimate.to_dict()))
    for key in ("ipu_version", "tiles_per_ipu", "clock_hz", "cycles", "seconds", "peak_tile_bytes",
                "tile_bytes_limit", "total_bytes", "fits", "assumptions", "memory", "top_ops",
                "timeline", "latency_s", "throughput"):
        assert key in d, key
    assert len(d["memory"]["variables"]) == IPU2.tiles_per_ipu
    assert d["top_ops"][0]["layer"] == "dense"
    plan = plan_module(_dot_module(256, np.float32), IPU2)
    for instr in plan.entry.comp.instructions:  # every instruction has a record and a mapping
        assert plan.op(instr.name).mapping is not None, instr.name


def test_tf_ipu_estimate_without_a_server(tmp_path) -> None:
    import keras

    import tf_ipu

    runtime = tf_ipu.get_runtime()
    configured = runtime.configured
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(128, activation="relu", name="hidden"),
                              keras.layers.Dense(10, name="logits")], name="tiny")
    r = tf_ipu.estimate(model, batch_size=16, ipu_version="bow")
    assert r.fits and r.latency_s > 0 and r.cycles > 0 and r.peak_tile_bytes > 0
    assert r.throughput == pytest.approx(16 / r.latency_s)
    assert r.host_bytes_in == 16 * 64 * 4 and r.host_bytes_out == 16 * 10 * 4  # weights stay
    assert json.loads(r.to_json())["context"]["model"] == "tiny"
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    before = [v.numpy().copy() for v in model.weights]
    t = tf_ipu.estimate(model, batch_size=16, training=True)
    assert t.fits and t.flops > 2.5 * r.flops  # forward, backward, update
    assert any(o["layer"] == "hidden (backward)" for o in t.top_ops)
    assert all(np.array_equal(a, v.numpy()) for a, v in zip(before, model.weights, strict=True))
    sweep = tf_ipu.estimate_sweep(model, [1, 4, 32])
    lat = [p["latency_s"] for p in sweep.points]
    thr = [p["throughput"] for p in sweep.points]
    assert lat[0] <= lat[-1] and thr[0] < thr[-1]
    path = sweep.save_html(str(tmp_path / "sweep.html"))
    root = ET.parse(path).getroot()
    assert runtime.configured == configured  # no server was started for any of this
    assert "polyline" in ET.tostring(root, encoding="unicode")


def test_report_html_is_self_contained_and_parses(tmp_path) -> None:
    est = estimate_module(_huge_dense(), None, get_target("ipu1"))
    est.sweep = [{"batch_size": b, "latency_s": 1e-3 * b, "throughput": 1e3, "fits": b < 4,
                  "peak_tile_bytes": 1000 * b, "cycles": 1} for b in (1, 2, 4)]
    path = est.save_html(str(tmp_path / "report.html"))
    text = open(path, encoding="utf-8").read()
    root = ET.fromstring(text.split("\n", 1)[1])  # after the doctype line
    ns = "{http://www.w3.org/2000/svg}"
    svgs = root.findall(f".//{ns}svg")
    assert len(svgs) >= 6  # memory, top ops, layers, timeline, latency, throughput
    assert len(root.findall(f".//{ns}polygon")) >= 3  # stacked memory categories
    for needle in ("Memory per tile", "Top operations by cycles", "BSP timeline",
                   "Batch-size sweep", "Assumptions", "DOES NOT FIT", "huge_dense"):
        assert needle in text, needle
    assert "http://" not in text.replace("http://www.w3.org/", "")  # no external assets
    from tf_ipu import report as tf_report
    from tf_ipu.runtime import CompileReport

    rep = CompileReport("p", "d", "ipu1", 1216, est.cycles, est.seconds, est.peak_tile_bytes,
                        est.tile_bytes_limit, est.total_bytes, est.fits, False, 0.0, est.to_dict())
    assert ET.parse(rep.save_html(str(tmp_path / "compile.html"))) is not None
    assert tf_report.render_html(est).count("<svg") == len(svgs)
    chromium = shutil.which("chromium") or shutil.which("chromium-headless-shell")
    if chromium:  # render it for real when a browser is installed
        png = tmp_path / "report.png"
        subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", f"--screenshot={png}",
                        "--window-size=1000,3000", f"file://{path}"], check=True, timeout=60,
                       capture_output=True)
        assert png.stat().st_size > 10_000
