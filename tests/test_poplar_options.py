"""PopLibs' planner knobs in Graphcore's spelling: ``IPUConfig.matmuls.poplar_options`` and
``IPUConfig.convolutions.poplar_options`` with ``availableMemoryProportion`` (the share of a
tile a product's plan may use for temporaries) and ``partialsType`` (the accumulator of FP16
products; ``partials_type`` is its alias).

What Poplar documents for the proportion (poplin's matMul / convolution options): lower means
less temporary memory per tile, at the cost of more cycles; a plan that cannot meet it is
planned again with the bound doubled ("unable to meet memory target"); 0 plans for the least
temporary memory. The tile model is checked for that direction on a matmul and a ResNet-like
convolution, then end to end (IPUConfig -> client -> server -> plan -> compile report).
"""

from __future__ import annotations

import emulator_util as eu
import numpy as np
import pytest

from device_server.emulator import CompileOptions, compile_module, get_target
from device_server.emulator.tiles import estimate_module, plan_module

GC200 = get_target("ipu2")


def _dot_module(n: int) -> eu.ir_pb2.Module:
    b = eu.IRBuilder("dot")
    x = b.parameter(np.float16, [n, n])
    y = b.parameter(np.float16, [n, n])
    b.root(b.op("dot", [x, y], np.float16, [n, n], source_op="model/dense/MatMul",
                lhs_contracting_dimensions=[1], rhs_contracting_dimensions=[0],
                lhs_batch_dimensions=[], rhs_batch_dimensions=[]))
    return b.module()


def _conv_module(batch: int, size: int, c_in: int, c_out: int) -> eu.ir_pb2.Module:
    """A 3x3 'SAME' convolution, NHWC, FP16 (a ResNet block's)."""
    b = eu.IRBuilder("conv")
    x = b.parameter(np.float16, [batch, size, size, c_in])
    w = b.parameter(np.float16, [3, 3, c_in, c_out])
    b.root(b.op("convolution", [x, w], np.float16, [batch, size, size, c_out],
                source_op="model/conv/Conv2D", input_batch_dimension=0, input_feature_dimension=3,
                input_spatial_dimensions=[1, 2], kernel_input_feature_dimension=2,
                kernel_output_feature_dimension=3, kernel_spatial_dimensions=[0, 1],
                output_batch_dimension=0, output_feature_dimension=3,
                output_spatial_dimensions=[1, 2], window_strides=[1, 1], padding_low=[1, 1],
                padding_high=[1, 1], window_dilation=[1, 1], lhs_dilation=[1, 1],
                feature_group_count=1, batch_group_count=1))
    return b.module()


def _product(module: eu.ir_pb2.Module, opcode: str, proportion: float | None):
    plan = plan_module(module, GC200, memory_proportions={} if proportion is None else {opcode: proportion})
    (rec,) = [r for r in plan.ops.values() if r.opcode == opcode]
    return rec, plan.notes


@pytest.mark.parametrize("opcode,module", [
    ("dot", _dot_module(2048)),                        # 2048 x 2048 x 2048 FP16
    ("convolution", _conv_module(16, 56, 256, 256)),   # 3x3, 256 -> 256 channels, batch 16
], ids=["matmul-2048", "conv3x3-b16"])
def test_lower_proportion_means_less_temporary_memory_and_more_cycles(opcode, module) -> None:
    sram = GC200.sram_bytes_per_tile
    plans = {p: _product(module, opcode, p)[0] for p in (0.9, 0.6, 0.1)}
    temps = [plans[p].temp_bytes_per_tile for p in (0.9, 0.6, 0.1)]
    cycles = [plans[p].cycles for p in (0.9, 0.6, 0.1)]
    assert temps[0] >= temps[1] >= temps[2], temps
    assert cycles[0] <= cycles[1] <= cycles[2], cycles
    assert temps[2] < temps[1] and cycles[2] > cycles[1], (temps, cycles)  # 0.1 really binds
    for p, rec in plans.items():
        assert rec.temp_bytes_per_tile <= p * sram, (p, rec.temp_bytes_per_tile, rec.plan)
    assert "serial" in plans[0.1].plan and "serial" not in plans[0.6].plan, plans[0.1].plan
    # Unset is the preset's 0.6; the proportion of the other kind of product changes nothing.
    default, _ = _product(module, opcode, None)
    assert (default.plan, default.cycles) == (plans[0.6].plan, plans[0.6].cycles)
    other = "convolution" if opcode == "dot" else "dot"
    plan = plan_module(module, GC200, memory_proportions={other: 0.1})
    (rec,) = [r for r in plan.ops.values() if r.opcode == opcode]
    assert rec.plan == plans[0.6].plan


def test_unmeetable_proportion_is_planned_again_and_said_and_zero_is_least_memory() -> None:
    module = _dot_module(4096)
    sram = GC200.sram_bytes_per_tile
    tiny, notes = _product(module, "dot", 0.001)  # 640 bytes: no split of 4096^3 gets there
    assert tiny.temp_bytes_per_tile > 0.001 * sram
    assert len(notes) == 1 and "no split keeps its temporaries within availableMemoryProportion " \
        "0.001 of a tile" in notes[0] and "bound doubled, within 0.002 of a tile" in notes[0], notes
    least, notes = _product(module, "dot", 0.0)
    assert least.temp_bytes_per_tile <= tiny.temp_bytes_per_tile and least.cycles > tiny.cycles
    assert "planned for the least temporary memory" in notes[0], notes
    _, notes = _product(module, "dot", 0.6)
    assert notes == []


def test_compile_options_carry_the_proportion_into_the_estimate() -> None:
    module = _dot_module(2048)
    low = compile_module(module, GC200, CompileOptions(matmul_available_memory_proportion=0.1)).estimate
    high = compile_module(module, GC200, CompileOptions(matmul_available_memory_proportion=0.9)).estimate
    plain = compile_module(module, GC200).estimate
    assert low.context["available_memory_proportion"] == {"dot": 0.1}
    assert "available_memory_proportion" not in plain.context
    assert low.device_cycles > high.device_cycles == plain.device_cycles
    assert low.peak_temporary_bytes < high.peak_temporary_bytes
    # The convolution's proportion leaves a matmul's plan alone.
    conv_only = compile_module(module, GC200, CompileOptions(convolution_available_memory_proportion=0.1))
    assert conv_only.estimate.device_cycles == plain.device_cycles
    with pytest.raises(ValueError, match=r"matmul_available_memory_proportion must be a number in "
                       r"\[0, 1\].*not 1.5"):
        compile_module(module, GC200, CompileOptions(matmul_available_memory_proportion=1.5))
    html = estimate_module(module, None, GC200, memory_proportions={"dot": 0.1})._repr_html_()
    assert "<td>availableMemoryProportion</td><td>dot 0.1</td>" in html
    assert "availableMemoryProportion" not in plain._repr_html_()


def test_half_partials_halve_the_partial_sums_of_fp16_products_only() -> None:
    """partialsType half: an FP16 product split over K holds and exchanges FP16 partial sums
    (2 bytes, not 4); FP32 products keep FP32 partials; compile options carry it per kind."""
    from device_server.emulator.tiles.matmul import MatmulProblem, plan_matmul

    fp16 = MatmulProblem(1, 64, 64, 65536, 1, 64 * 65536 * 2, 65536 * 64 * 2, 0.0, 2, 2, True)
    full, half = plan_matmul(fp16, GC200), plan_matmul(
        MatmulProblem(**{**fp16.__dict__, "partials_bytes": 2}), GC200)
    assert full.pk > 1 and half.reduce_recv_bytes_per_tile < full.reduce_recv_bytes_per_tile
    assert half.temp_bytes_per_tile < full.temp_bytes_per_tile
    module = _conv_module(16, 56, 256, 256)
    plain, _ = _product(module, "convolution", 0.1)
    plan = plan_module(module, GC200, memory_proportions={"convolution": 0.1},
                       partials_types={"convolution": "half"})
    (rec,) = [r for r in plan.ops.values() if r.opcode == "convolution"]
    assert rec.temp_bytes_per_tile <= plain.temp_bytes_per_tile
    assert rec.cycles <= plain.cycles  # fewer bytes to keep and to exchange: no worse a plan
    plan = plan_module(module, GC200, memory_proportions={"convolution": 0.1}, partials_types={"dot": "half"})
    (other,) = [r for r in plan.ops.values() if r.opcode == "convolution"]
    assert (other.plan, other.temp_bytes_per_tile) == (plain.plan, plain.temp_bytes_per_tile)
    b = eu.IRBuilder("dot32")  # FP32 operands: partialsType half changes nothing
    x, y = b.parameter(np.float32, [2048, 2048]), b.parameter(np.float32, [2048, 2048])
    b.root(b.op("dot", [x, y], np.float32, [2048, 2048], lhs_contracting_dimensions=[1],
                rhs_contracting_dimensions=[0], lhs_batch_dimensions=[], rhs_batch_dimensions=[]))
    fp32 = [compile_module(b.module(), GC200, CompileOptions(partials_type=p)).estimate for p in ("float", "half")]
    assert fp32[0].peak_tile_bytes == fp32[1].peak_tile_bytes
    dot = _dot_module(2048)
    est = [compile_module(dot, GC200, CompileOptions(matmul_available_memory_proportion=0.1, matmul_partials_type=p)
                          ).estimate for p in ("float", "half")]
    assert est[1].peak_temporary_bytes <= est[0].peak_temporary_bytes
    assert est[1].context["half_partials"] == ["dot"]
    assert "partialsType half" in est[1]._repr_html_() and "half_partials" not in est[0].context
    with pytest.raises(ValueError, match="partialsType"):
        plan_module(module, GC200, partials_types={"dot": "double"})


# ------------------------------------------------------------------ IPUConfig: values checked


@pytest.mark.parametrize("group", ["matmuls", "convolutions"])
def test_bad_poplar_options_name_the_key_the_value_and_what_is_accepted(group: str) -> None:
    import tf_ipu

    options = getattr(tf_ipu.IPUConfig(), group)
    path = rf"IPUConfig\.{group}\.poplar_options"
    for value in ("1.5", "abc", -0.1, True):
        with pytest.raises(ValueError, match=rf"{path}\['availableMemoryProportion'\] must be a "
                           rf"number in \[0, 1\].*Received: {value!r}".replace("(", r"\(")):
            options.poplar_options = {"availableMemoryProportion": value}
    with pytest.raises(ValueError, match=rf"{path}\['partialsType'\] must be 'float' or 'half'. "
                       r"Received: 'double'"):
        options.poplar_options = {"partialsType": "double"}
    kind = "matMul" if group == "matmuls" else "convolution"
    with pytest.raises(ValueError, match=rf"{path}: 'availableMemoryProportions' is not a PopLibs "
                       rf"{kind} option. Did you mean 'availableMemoryProportion'\? Accepted: "
                       r"availableMemoryProportion, partialsType, "):
        options.poplar_options = {"availableMemoryProportions": "0.3"}
    with pytest.raises(ValueError, match=rf"{path}: 'frobnicate' is not a PopLibs {kind} option. "
                       r"Accepted: .*planConstraints"):
        options.poplar_options = {"frobnicate": "true"}
    assert options.poplar_options == {}  # nothing refused was kept
    # Graphcore's string values, and floats, are taken; the bounds are PopLibs' (inclusive).
    for value, amp in (("0.2", 0.2), (0.75, 0.75), ("0", 0.0), ("1.0", 1.0)):
        options.poplar_options = {"availableMemoryProportion": value}
        assert options.available_memory_proportion == amp
    # partials_type is the alias of partialsType: both given must agree.
    options.poplar_options = {"partialsType": "half"}
    options.partials_type = "HALF"
    with pytest.raises(ValueError, match=rf"{path}\['partialsType'\] is 'half' but "
                       rf"IPUConfig\.{group}\.partials_type is 'float'"):
        options.partials_type = "float"
    fresh = getattr(tf_ipu.IPUConfig(), group)
    fresh.partials_type = "float"
    with pytest.raises(ValueError, match=r"\['partialsType'\] is 'half' but .*partials_type is 'float'"):
        fresh.poplar_options = {"partialsType": "half"}


def test_honoured_options_do_not_warn_other_poplibs_options_are_kept_and_named(caplog) -> None:
    import logging

    import tf_ipu
    from tf_ipu import config, notices

    notices._forget()
    cfg = tf_ipu.IPUConfig()
    assert cfg.matmuls.effect("poplar_options") is config.Effect.HONOURED
    with caplog.at_level(logging.WARNING, logger="tf_ipu"):
        cfg.matmuls.poplar_options = {"availableMemoryProportion": "0.2", "partialsType": "half"}
        assert caplog.records == []
        cfg.convolutions.poplar_options = {"availableMemoryProportion": 0.3, "pass": "TRAINING_FWD"}
    (said,) = [r.getMessage() for r in caplog.records]
    assert "IPUConfig.convolutions.poplar_options" in said and "(pass)" in said, said
    numerics = cfg.compile_numerics()
    assert numerics["matmul_available_memory_proportion"] == 0.2
    assert numerics["convolution_available_memory_proportion"] == 0.3
    assert numerics["matmul_partials_type"] == "half" and numerics["convolution_partials_type"] == "float"
    assert tf_ipu.IPUConfig().compile_numerics()["matmul_available_memory_proportion"] is None


# ------------------------------------------------------------------------------ end to end


def test_server_keys_checks_and_reports_the_proportion(device_server) -> None:
    from tf_ipu import errors
    from tf_ipu.client import DeviceClient

    module = _dot_module(1024)
    with DeviceClient(device_server) as c:
        c.open_session()
        c.attach(1, "ipu2")
        plain = c.compile(module)
        low = c.compile(module, matmul_available_memory_proportion=0.05)
        zero = c.compile(module, matmul_available_memory_proportion=0.0)
        assert len({plain.executable_id, low.executable_id, zero.executable_id}) == 3
        assert low.estimate.cycles > plain.estimate.cycles
        assert zero.estimate.cycles > low.estimate.cycles  # the least-memory plan
        assert c.compile(module, matmul_available_memory_proportion=0.05).cache_hit
        with pytest.raises(errors.InvalidArgumentError,
                           match=r"matmul_available_memory_proportion must be in \[0, 1\].*1.5"):
            c.compile(module, matmul_available_memory_proportion=1.5)


def _config(server: str, **options):
    """A fresh IPUConfig on the suite's server (one ipu2), with ``matmuls`` options set."""
    import tf_ipu

    cfg = tf_ipu.IPUConfig()
    cfg.server_address = server
    cfg.auto_select_ipus = 1
    cfg.ipu_model.version = "ipu2"
    for name, value in options.items():
        setattr(cfg.matmuls, name, value)
    return cfg


def _matmul_step(strategy, n: int):
    import tensorflow as tf

    @tf.function
    def step(a, b):
        return strategy.run(lambda x, y: tf.matmul(x, y), args=(a, b))

    return step


def test_ipuconfig_poplar_options_reach_the_plan_and_the_compile_report(ipu_system) -> None:
    import tensorflow as tf

    import tf_ipu

    strategy = tf_ipu.IPUStrategy()
    n = 2048
    a = tf.ones([n, n], tf.float16) / 64
    step = _matmul_step(strategy, n)
    reports = []
    try:
        for options in ({}, {"availableMemoryProportion": "0.2"}):
            _config(ipu_system.server_address, poplar_options=options).configure_ipu_system()
            out = step(a, a).numpy()
            np.testing.assert_array_equal(out, np.full((n, n), n / 64 / 64, np.float16))
            reports.append(tf_ipu.get_runtime().reports[-1])
    finally:
        ipu_system.configure_ipu_system()
    plain, low = reports
    assert low.details["context"]["available_memory_proportion"] == {"dot": 0.2}
    assert "available_memory_proportion" not in plain.details.get("context", {})
    assert low.details["peak_temporary_bytes"] < plain.details["peak_temporary_bytes"], (low, plain)
    assert low.cycles > plain.cycles, (low.cycles, plain.cycles)


def test_partials_type_in_poplar_options_is_the_partials_option(ipu_system) -> None:
    """FP16 products over a long contraction (4096 positive terms): FP16 partials round the
    accumulator every few products, FP32 partials once. ``poplar_options['partialsType']``
    gives bit for bit what ``partials_type`` gives, for "half" and "float"."""
    import tensorflow as tf

    import tf_ipu

    rng = np.random.default_rng(0)
    a = tf.constant(rng.random((8, 4096)).astype(np.float16))
    b = tf.constant(rng.random((4096, 4)).astype(np.float16))
    strategy = tf_ipu.IPUStrategy()
    step = _matmul_step(strategy, 4096)
    results = {}
    try:
        for name, options in (("alias-half", {"partials_type": "half"}),
                              ("poplar-half", {"poplar_options": {"partialsType": "half"}}),
                              ("poplar-float", {"poplar_options": {"partialsType": "float"}}),
                              ("default", {})):
            _config(ipu_system.server_address, **options).configure_ipu_system()
            results[name] = step(a, b).numpy()
    finally:
        ipu_system.configure_ipu_system()
    np.testing.assert_array_equal(results["poplar-half"], results["alias-half"])
    np.testing.assert_array_equal(results["poplar-float"], results["default"])
    exact = a.numpy().astype(np.float64) @ b.numpy().astype(np.float64)
    err_half = np.abs(results["poplar-half"] - exact).max()
    err_float = np.abs(results["poplar-float"] - exact).max()
    assert not np.array_equal(results["poplar-half"], results["poplar-float"])
    assert err_half > 3 * err_float, (err_half, err_float)


def test_estimate_takes_the_proportion() -> None:
    import keras

    import tf_ipu

    model = keras.Sequential([keras.Input((2048,)), keras.layers.Dense(2048, use_bias=False)])
    low = tf_ipu.estimate(model, 2048, available_memory_proportion="0.1")
    high = tf_ipu.estimate(model, 2048, available_memory_proportion=0.9)
    assert low.context["available_memory_proportion"] == {"convolution": 0.1, "dot": 0.1}
    assert low.context["batch_size"] == 2048  # the model's context is kept beside it
    assert low.device_cycles > high.device_cycles
    assert low.peak_temporary_bytes < high.peak_temporary_bytes
    with pytest.raises(ValueError, match=r"available_memory_proportion must be a number in \[0, 1\]"
                       r".*Received: 2"):
        tf_ipu.estimate(model, 2048, available_memory_proportion=2)
