"""IPU numerics on the emulator (docs/user_guide.md, "Numerics"; device_server/emulator/numerics.py):
FP32/FP16 partials of FP16 matrix products and convolutions, stochastic rounding, the
floating-point exception checks (inv, div0, oflo) with nanoo, and FP16 Keras models.

References: float64 (numpy, or the same Keras model built under the float64 policy) for
anything computed in FP16: XLA on the CPU rounds float16 differently depending on the host's
instruction set (native FP16 arithmetic on AVX512-FP16 hosts), float64 rounds alike on every
host. XLA (``jit_compile=True``) is the reference only for float32 programs and integers.
FP16 has a unit roundoff of u = 2^-11 ~ 4.9e-4 (one ulp is 2u relative); tolerances below
are stated in those terms.
"""

from __future__ import annotations

import emulator_util as eu
import keras
import numpy as np
import pytest
import tensorflow as tf

from device_server.emulator import (
    CompileOptions,
    FloatingPointExceptionError,
    compile_module,
    get_target,
)
from tests.keras_util import classification_data, mlp, rel_l2, small_cnn

TARGET = get_target("ipu2")
U16 = 2.0 ** -11  # FP16 unit roundoff


def _exe(module, **options):
    return compile_module(module, TARGET, CompileOptions(**options))


def _ulp16(x: np.ndarray) -> np.ndarray:
    return np.spacing(np.abs(np.asarray(x, np.float16))).astype(np.float64)


@pytest.fixture
def policy():
    """Sets a Keras global dtype policy for one test and always resets it to float32."""
    def set_policy(name: str) -> None:
        keras.mixed_precision.set_global_policy(name)

    try:
        yield set_policy
    finally:
        keras.mixed_precision.set_global_policy("float32")


# --------------------------------------------------------------------------------- partials


def test_fp16_dot_partials_float_is_rounded_once_half_loses_precision():
    """A dot of 4096 positive FP16 products (sums ~1000, where one FP16 ulp is 0.5-1): the
    IPU's AMP accumulating FP16 products in FP32 partials (the default) or FP16 ones.
    FP32 partials round once: within 1 ulp of the float64 value rounded to FP16, element by
    element (the FP32 sum of K = 4096 exact products is within K * 2^-24 = 2.4e-4 relative
    of the exact sum, at most half an FP16 ulp, whatever the order of the additions; then
    one rounding, at most half an ulp). FP16 partials round the accumulator after every 16
    products (Target.amp_fp16_partials_chunk), 256 roundings of up to half an ulp each: the
    error must be several times larger (measured ~10x). (XLA's own FP16 dot is no reference:
    how it accumulates depends on the host's instruction set.)"""
    rng = np.random.default_rng(0)
    a = rng.random((8, 4096)).astype(np.float16)
    b = rng.random((4096, 4)).astype(np.float16)
    module, _ = eu.lower(lambda x, y: tf.matmul(x, y), a, b)
    exact = a.astype(np.float64) @ b.astype(np.float64)
    (f32p,) = _exe(module).run([a, b])
    (f16p,) = _exe(module, partials_type="half").run([a, b])
    (f16m,) = _exe(module, matmul_partials_type="half", convolution_partials_type="float").run([a, b])
    assert f32p.dtype == f16p.dtype == np.float16
    rounded = exact.astype(np.float16)
    assert np.all(np.abs(f32p.astype(np.float64) - rounded) <= _ulp16(rounded))
    err_float = np.abs(f32p - exact).max()
    err_half = np.abs(f16p - exact).max()
    assert err_float <= _ulp16(exact).max()
    assert err_half > 3 * err_float, (err_half, err_float)
    np.testing.assert_array_equal(f16m, f16p)  # the per-kind option reaches the dot
    (f32c,) = _exe(module, convolution_partials_type="half").run([a, b])
    np.testing.assert_array_equal(f32c, f32p)  # ... and the convolution one does not


def test_fp16_conv_partials():
    """A 3x3 convolution over 64 input channels (576 products per output, positive values):
    FP32 partials within 1 ulp of the float64 value rounded to FP16 (as for the dot:
    576 * 2^-24 relative from the FP32 sum's order, then one rounding); FP16 partials (rounded
    after every 16 channels of one tap) further from the float64 value."""
    rng = np.random.default_rng(1)
    x = rng.random((2, 6, 6, 64)).astype(np.float16)
    k = rng.random((3, 3, 64, 8)).astype(np.float16)
    module, _ = eu.lower(lambda a, b: tf.nn.conv2d(a, b, 1, "VALID"), x, k)
    exact = tf.nn.conv2d(x.astype(np.float64), k.astype(np.float64), 1, "VALID").numpy()
    (f32p,) = _exe(module).run([x, k])
    (f16p,) = _exe(module, convolution_partials_type="half").run([x, k])
    rounded = exact.astype(np.float16)
    assert np.all(np.abs(f32p.astype(np.float64) - rounded) <= _ulp16(rounded))
    err_float = np.abs(f32p - exact).max()
    err_half = np.abs(f16p - exact).max()
    assert err_float <= _ulp16(exact).max()
    assert err_half > 2 * err_float, (err_half, err_float)
    (m_only,) = _exe(module, matmul_partials_type="half").run([x, k])
    np.testing.assert_array_equal(m_only, f32p)


def test_partials_type_is_validated():
    import tf_ipu

    b = eu.IRBuilder()
    b.root(b.parameter(np.float32, [2]))
    with pytest.raises(ValueError, match="partials_type"):
        _exe(b.module(), partials_type="double")
    cfg = tf_ipu.IPUConfig()
    assert cfg.matmuls.partials_type == cfg.convolutions.partials_type == "float"
    cfg.matmuls.partials_type = "HALF"
    assert cfg.compile_numerics()["matmul_partials_type"] == "half"
    with pytest.raises(ValueError, match="IPUConfig.convolutions.partials_type"):
        cfg.convolutions.partials_type = "fp8"


# ----------------------------------------------------------------------- stochastic rounding


def _convert_module(n: int, src=np.float32):
    b = eu.IRBuilder("sr")
    x = b.parameter(src, [n])
    b.root(b.op("convert", [x], np.float16, [n], source_op="m/d/Cast"))
    return b.module()


def test_rounding_to_fp16_is_nearest_even_by_default():
    """Without esr, FP32 -> FP16 is exactly numpy's astype (round to nearest, ties to even),
    including ties, subnormals, overflow to inf, inf and NaN."""
    rng = np.random.default_rng(2)
    one = np.float32(1.0)
    special = np.array([0.5 * (1 + 2.0 ** -10) + 0, one + np.float32(2.0 ** -11),
                        one + np.float32(3 * 2.0 ** -11), 65504, 65519.996, 65520, 1e6, -1e6,
                        2.0 ** -25, 3 * 2.0 ** -26, 1e-8, 0.0, -0.0, np.inf, -np.inf, np.nan],
                       np.float32)
    x = np.concatenate([special, (rng.standard_normal(20000) * 10.0 ** rng.integers(-8, 6, 20000))
                        .astype(np.float32)])
    module = _convert_module(x.size)
    for options in ({}, {"esr": False}):
        (out,) = _exe(module, **options).run([x])
        with np.errstate(over="ignore"):
            expected = x.astype(np.float16)
        np.testing.assert_array_equal(out.view(np.uint16), expected.view(np.uint16))


@pytest.mark.parametrize("src", [np.float32, np.float64])
def test_stochastic_rounding_is_unbiased(src):
    """N = 100000 conversions of v between FP16 neighbours lo < v < hi, with p = (v-lo)/(hi-lo):
    each result is lo or hi, hi with probability p, so the mean has standard deviation
    sigma = (hi-lo) * sqrt(p(1-p)/N) (~1.4e-6 for v = 1 + 2^-12). The mean must be within
    5 sigma of v (a false failure has probability ~6e-7, and the stream is fixed anyway);
    round-to-nearest would be off by min(p, 1-p)*(hi-lo), more than 20 sigma for each value
    (180 sigma for 1 + 2^-12)."""
    n = 100_000
    module = _convert_module(n, src)
    exe = _exe(module, esr=True)
    # Values a quarter, 0.3 and 0.6 of the way between neighbours, and an FP16 subnormal.
    for v in (1 + 2.0 ** -12, -(3 + 0.3 * 2.0 ** -9), 1000.3, 3.1e-6):
        x = np.full(n, v, src)
        (out,) = exe.run([x])
        vv = float(x[0])
        near = np.float16(vv)
        lo = float(near)
        hi = float(np.nextafter(near, np.float16(np.inf if vv > lo else -np.inf)))
        assert set(np.unique(out).astype(np.float64)) <= {lo, hi}
        p = (vv - lo) / (hi - lo)
        sigma = abs(hi - lo) * np.sqrt(p * (1 - p) / n)
        mean = out.astype(np.float64).mean()
        assert abs(mean - vv) <= 5 * sigma, (v, mean, sigma)
        assert abs(lo - vv) > 20 * sigma  # round-to-nearest is far outside the bound


def test_stochastic_rounding_of_fp16_arithmetic():
    """FP16 add and dot results are computed in FP32 and rounded stochastically:
    1 + 2^-12 (a quarter ulp above 1) averages to itself (bound as above); every dot result
    is one of the two FP16 neighbours of the FP32 result."""
    n = 100_000
    b = eu.IRBuilder("sr_add")
    x = b.parameter(np.float16, [n])
    y = b.parameter(np.float16, [n])
    b.root(b.op("add", [x, y], np.float16, [n]))
    ones = np.ones(n, np.float16)
    tiny = np.full(n, 2.0 ** -12, np.float16)
    (rne,) = _exe(b.module()).run([ones, tiny])
    assert np.all(rne == 1)
    (out,) = _exe(b.module(), esr=True).run([ones, tiny])
    sigma = 2.0 ** -10 * np.sqrt(0.25 * 0.75 / n)
    assert abs(out.astype(np.float64).mean() - (1 + 2.0 ** -12)) <= 5 * sigma

    rng = np.random.default_rng(3)
    a = rng.standard_normal((64, 32)).astype(np.float16)
    w = rng.standard_normal((32, 16)).astype(np.float16)
    module, _ = eu.lower(lambda p, q: tf.matmul(p, q), a, w)
    (got,) = _exe(module, esr=True).run([a, w])
    f32 = a.astype(np.float32) @ w.astype(np.float32)
    down = np.float16(f32)
    other = np.nextafter(down, np.where(f32 > down, np.float16(np.inf), np.float16(-np.inf)).astype(np.float16))
    assert np.all((got == down) | (got == other))
    assert np.any(got != down)  # some went the other way


def test_stochastic_rounding_is_repeatable_per_program_and_run():
    """The n-th run of a program draws the same bits (a fresh compile repeats the sequence);
    successive runs differ; the seed option selects another stream."""
    module = _convert_module(4096)
    x = np.full(4096, 1 + 2.0 ** -12, np.float32)
    first, second = _exe(module, esr=True), _exe(module, esr=True)
    runs1 = [first.run([x])[0] for _ in range(2)]
    runs2 = [second.run([x])[0] for _ in range(2)]
    for r1, r2 in zip(runs1, runs2, strict=True):
        np.testing.assert_array_equal(r1, r2)
    assert np.any(runs1[0] != runs1[1])
    (seeded,) = _exe(module, esr=True, stochastic_rounding_seed=7).run([x])
    assert np.any(seeded != runs1[0])


# ------------------------------------------------------------------------ exception checks


def _fp16_dense_model():
    return keras.Sequential(
        [keras.Input((8,)), keras.layers.Dense(4, dtype="float16", name="big_dense")], name="fp16net"
    )


def test_overflow_names_op_and_layer_and_nanoo():
    """A float16 Dense fed 1e4: its matmul overflows FP16 (max 65504). With oflo the run stops
    naming the opcode, the TF op and the Keras layer; without checks the result is inf (IEEE,
    as XLA); with nanoo it is NaN."""
    keras.utils.set_random_seed(0)
    model = _fp16_dense_model()
    model.set_weights([np.ones((8, 4), np.float16), np.zeros(4, np.float16)])
    x = np.full((2, 8), 1e4, np.float16)
    module, params, (expected,) = eu.lower_step(lambda v: model(v), x)
    assert np.all(np.isposinf(expected))
    (out,) = _exe(module).run(params)
    assert np.all(np.isposinf(out))
    with pytest.raises(FloatingPointExceptionError) as info:
        _exe(module, oflo=True).run(params)
    msg = str(info.value)
    assert info.value.flag == "oflo"
    assert "oflo: overflow" in msg and "opcode dot" in msg, msg
    assert "Keras layer 'big_dense'" in msg and "MatMul" in msg, msg
    (nan_out,) = _exe(module, nanoo=True).run(params)
    assert np.all(np.isnan(nan_out))
    # Checks off for inv/div0 do not see an overflow.
    (out,) = _exe(module, inv=True, div0=True).run(params)
    assert np.all(np.isposinf(out))
    # A program that does not overflow runs with every check on.
    (fine,) = _exe(module, inv=True, div0=True, oflo=True, nanoo=True).run(
        [np.ones((2, 8), np.float16), *params[1:]])
    np.testing.assert_array_equal(fine, np.full((2, 4), 8, np.float16))


def test_div0_and_inv():
    """div0: x / 0 for finite x != 0 (inf; 0/0 is inv, not div0) and log(0); inv: NaN from
    operands that are not NaN (0/0, sqrt(-1), inf - inf). NaN operands propagate silently.
    With the checks off the results are IEEE's."""
    def f(x, y):
        return x / y, tf.sqrt(x), x - y, tf.math.log(y + 1)

    x = np.array([1.0, 4.0], np.float32)
    y = np.array([0.5, 2.0], np.float32)
    module, expected = eu.lower(f, x, y)
    clean = _exe(module, inv=True, div0=True, oflo=True)
    eu.assert_same(clean.run([x, y]), expected)

    def run(xv, yv, **flags):
        return _exe(module, **flags).run([np.array(xv, np.float32), np.array(yv, np.float32)])

    div = run([1.0, 4.0], [0.0, 2.0])
    assert np.isposinf(div[0][0])
    with pytest.raises(FloatingPointExceptionError, match=r"div0: divide by zero.*opcode divide") as info:
        run([1.0, 4.0], [0.0, 2.0], div0=True)
    assert info.value.flag == "div0"
    with pytest.raises(FloatingPointExceptionError, match=r"div0.*opcode log"):
        run([1.0, 4.0], [-1.0, 2.0], div0=True)
    assert np.isneginf(run([1.0, 4.0], [-1.0, 2.0])[3][0])
    run([1.0, 4.0], [0.0, 2.0], inv=True, oflo=True)  # not an invalid op, not an overflow

    with pytest.raises(FloatingPointExceptionError, match=r"inv: invalid operation.*opcode sqrt"):
        run([-1.0, 4.0], [1.0, 2.0], inv=True)
    assert np.isnan(run([-1.0, 4.0], [1.0, 2.0])[1][0])
    with pytest.raises(FloatingPointExceptionError, match=r"inv.*opcode divide"):
        run([0.0, 4.0], [0.0, 2.0], inv=True, div0=True)
    with pytest.raises(FloatingPointExceptionError, match=r"inv.*opcode (divide|subtract)"):
        run([np.inf, 4.0], [np.inf, 2.0], inv=True)
    out = run([np.nan, 4.0], [1.0, 2.0], inv=True, div0=True, oflo=True)  # NaN in, NaN out
    assert np.isnan(out[0][0]) and np.isnan(out[2][0])


# ------------------------------------------------------------------------------ FP16 models


def _train_step(model):
    def step(x, y):
        with tf.GradientTape() as tape:
            p = model(x, training=True)
            loss = model.compute_loss(x, y, p)
            scaled = model.optimizer.scale_loss(loss)
        grads = tape.gradient(scaled, model.trainable_variables)
        model.optimizer.apply(grads, model.trainable_variables)
        return loss
    return step


def _float64_reference(build, model, x, y, lr: float) -> tuple[np.ndarray, float, dict[str, np.ndarray]]:
    """``build()`` under the float64 policy with ``model``'s weights: the forward output
    (inference), the loss and every variable's value after one SGD(``lr``) step (new weights;
    BatchNormalization's moving statistics), by the name of ``model``'s variable's TF variable
    (``Variable.value.name``). float64 (TF's own kernels) rounds alike on every CPU; no loss
    scaling (a power of two: exact)."""
    before = keras.mixed_precision.global_policy().name
    keras.mixed_precision.set_global_policy("float64")
    try:
        twin = build()
    finally:
        keras.mixed_precision.set_global_policy(before)
    twin.set_weights([np.asarray(w, np.float64) for w in model.get_weights()])
    twin.compile(loss="sparse_categorical_crossentropy")
    x64 = tf.constant(np.asarray(x, np.float64))
    out = twin(x64, training=False).numpy()
    with tf.GradientTape() as tape:
        loss = twin.compute_loss(x64, y, twin(x64, training=True))
    grads = tape.gradient(loss, twin.trainable_variables)
    name_of = {id(t): v.value.name for v, t in zip(model.variables, twin.variables, strict=True)}
    new = {name_of[id(t)]: np.asarray(t.numpy()) for t in twin.variables}
    for t, g in zip(twin.trainable_variables, grads, strict=True):
        new[name_of[id(t)]] = t.numpy() - lr * g.numpy()
    return out, float(loss), new


@pytest.mark.parametrize("build,shape,name", [(mlp, (16,), "mixed_float16"),
                                              (small_cnn, (8, 8, 4), "mixed_float16"),
                                              (mlp, (16,), "float16")],
                         ids=["mlp-mixed", "cnn-mixed", "mlp-float16"])
def test_fp16_models_match_float64(policy, build, shape, name):
    """Forward pass and one SGD step of FP16 Keras models on the emulator vs the same model,
    weights and step in float64 (``_float64_reference``): the emulator stands for the IPU
    computing in FP16 (FP32 partials in matrix products and convolutions, every op's result
    rounded to FP16). A float64 reference rounds alike on every host; XLA's float16 on the
    CPU does not (where the rounding happens depends on the host's instruction set), so XLA's
    results are printed beside the emulator's, not asserted on.

    Bounds in u = 2^-11 (FP16's unit roundoff): the forward outputs (FP16) within 8u relative
    L2 (a handful of FP16 roundings per output value along three layers, each at most u
    relative; measured <= 4.6e-4). The loss within 8u relative (measured <= 4.8e-5). The
    weight update (new - old) within 8u relative L2 per variable with FP32 weights (mixed:
    the gradients are FP16 values, a few roundings each; measured <= 1.4e-3). With FP16
    weights (pure float16) the new weight is rounded to FP16 (the reference's too): its ulp
    at |w| ~ 0.3 (2^-12) is ~1/40 of an update, and where the gradients' roundings move
    ``w - lr * g`` across a rounding boundary (3-5% of the kernels' weights) the update moves
    by that ulp: ~sqrt(0.05)/40 = 6e-3 relative L2; bound 1e-2 (measured <= 7.0e-3, as XLA's
    on the development host, equal to the emulator's). The iteration counters equal XLA's
    (integers: no rounding). The initial loss scale is 128 so that the step is applied
    (Keras's default 2^15 overflows on purpose and skips the first steps), and it stays 128
    (nothing overflowed); with the checks inv/div0/oflo on."""
    u = 2.0 ** -11
    lr = 0.1
    policy(name)
    keras.utils.set_random_seed(0)
    model = build()
    x, y = classification_data(32, shape)
    inner = keras.optimizers.SGD(lr)
    opt = keras.mixed_precision.LossScaleOptimizer(inner, initial_scale=128.0) \
        if name == "mixed_float16" else inner
    model.compile(optimizer=opt, loss="sparse_categorical_crossentropy")
    model.optimizer.build(model.trainable_variables)
    x16 = x.astype(np.float16) if name == "float16" else x
    ref_out, ref_loss, ref_new = _float64_reference(build, model, x16, y, lr)

    fwd, fwd_params, (fwd_xla,) = eu.lower_step(lambda v: model(v, training=False), x16)
    (fwd_out,) = _exe(fwd).run(fwd_params)
    assert fwd_out.dtype == np.float16
    errors = {"forward": rel_l2(fwd_out, ref_out)}
    xla_errors = {"forward": rel_l2(fwd_xla, ref_out)}

    step = tf.function(_train_step(model), jit_compile=True, autograph=False)
    module, params, expected = eu.lower_step(step, x16, y)
    concrete = step.get_concrete_function(x16, y)
    by_handle = {id(v.handle): v.name for v in concrete.variables}
    names = [by_handle.get(id(c)) for c in concrete.captured_inputs]
    got = _exe(module, inv=True, div0=True, oflo=True).run(params)
    errors["loss"] = abs(float(got[0]) - ref_loss) / abs(ref_loss)
    xla_errors["loss"] = abs(float(expected[0]) - ref_loss) / abs(ref_loss)
    updated = 0
    for alias in module.aliases:
        o, p = alias.output_index, alias.parameter_number
        g, e, before = got[o], expected[o], params[p]
        var = names[p - 2]
        if var not in ref_new:  # the optimizer's: counters (as XLA's), the loss scale (as before)
            np.testing.assert_array_equal(g, before if g.dtype.kind == "f" else e, err_msg=f"output {o}")
            continue
        want = ref_new[var]
        if g.dtype == np.float16:
            want = want.astype(np.float16)  # the new weight rounded to FP16, as the IPU's
        if not np.any(want != before):
            np.testing.assert_array_equal(g, before, err_msg=var)
            continue
        updated += 1
        d = rel_l2(g.astype(np.float64) - before, want.astype(np.float64) - before)
        errors[var] = d
        xla_errors[var] = rel_l2(e.astype(np.float64) - before, want.astype(np.float64) - before)
    print(f"\n{name}: relative errors from float64, emulator: "
          + ", ".join(f"{k} {v:.1e}" for k, v in errors.items())
          + "; XLA's: " + ", ".join(f"{k} {v:.1e}" for k, v in xla_errors.items()))
    assert errors["forward"] <= 8 * u and errors["loss"] <= 8 * u, errors
    for path, d in errors.items():
        if path not in ("forward", "loss"):
            assert d <= (1e-2 if name == "float16" else 8 * u), f"{path}: update rel L2 {d}"
    assert updated >= 4  # the step was applied


# ------------------------------------------------------------------ Keras under IPUStrategy


def test_keras_fit_mixed_float16_under_ipu_strategy(ipu_system, policy):
    """fit() of a mixed_float16 MLP under IPUStrategy (8 steps of SGD(0.05)), with Keras's
    dynamic loss scaling (initial scale 2^15), against the same model, weights and fit in
    float64 on the CPU (TF's kernels; a float64 reference rounds alike on every host, TF's
    float16 kernels do not: AVX512-FP16 hosts compute FP16 natively). It stands for the IPU
    computing the layers in FP16 (FP32 partials, every op's result rounded to FP16) with FP32
    weights. Bounds in u = 2^-11 (FP16's unit roundoff): per-epoch losses within 8u relative
    (the forward pass's few FP16 roundings per value; measured 4.5e-5) and final weights
    within 8u relative L2 (each of the 8 updates carries its FP16 gradient's few roundings,
    relative; measured <= 5.6e-4), while a wrong kernel or a skipped step would move them by
    much more. No scaled FP16 gradient overflowed: the loss scale is still 2^15 (every step
    applied, as in the float64 fit, which scales nothing)."""
    import tf_ipu

    u = 2.0 ** -11
    policy("mixed_float16")
    strategy = tf_ipu.IPUStrategy()
    x, y = classification_data(64, (16,))
    keras.utils.set_random_seed(1)
    with strategy.scope():
        ipu = mlp()
        ipu.compile(optimizer=keras.optimizers.SGD(0.05), loss="sparse_categorical_crossentropy",
                    steps_per_execution=4)
    policy("float64")
    ref = mlp()
    ref.set_weights([np.asarray(w, np.float64) for w in ipu.get_weights()])
    ref.compile(optimizer=keras.optimizers.SGD(0.05), loss="sparse_categorical_crossentropy")
    h_ref = ref.fit(x.astype(np.float64), y, batch_size=16, epochs=2, shuffle=False, verbose=0).history["loss"]
    policy("mixed_float16")
    h_ipu = ipu.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0).history["loss"]
    np.testing.assert_allclose(h_ipu, h_ref, rtol=8 * u)
    for w_ipu, w_ref in zip(ipu.get_weights(), ref.get_weights(), strict=True):
        assert rel_l2(w_ipu, w_ref) <= 8 * u, rel_l2(w_ipu, w_ref)
    assert float(ipu.optimizer.dynamic_scale) == 2.0 ** 15
    assert ipu.layers[0].compute_dtype == "float16"


def test_floating_point_exception_reaches_keras(ipu_system):
    """IPUConfig.floating_point_behaviour.oflo travels runtime -> client -> server -> emulator;
    the overflow comes back as INVALID_ARGUMENT (kind floating-point-exception) and Keras
    raises TF's InvalidArgumentError with the emulator's message. Without the flag the same
    model predicts inf."""
    import tf_ipu

    strategy = tf_ipu.IPUStrategy()
    cfg = tf_ipu.get_runtime().config
    with strategy.scope():
        model = _fp16_dense_model()
    model.set_weights([np.ones((8, 4), np.float16), np.zeros(4, np.float16)])
    x = np.full((2, 8), 1e4, np.float16)
    assert np.all(np.isposinf(model.predict(x, verbose=0)))
    try:
        cfg.floating_point_behaviour.oflo = True
        cfg.configure_ipu_system()
        with pytest.raises(tf.errors.InvalidArgumentError) as info:
            model.predict(x, verbose=0)
        msg = str(info.value)
        assert "Floating-point exception (oflo: overflow)" in msg, msg
        assert "opcode dot" in msg and "Keras layer 'big_dense'" in msg, msg
    finally:
        cfg.floating_point_behaviour.oflo = False
        cfg.configure_ipu_system()


def test_server_maps_numerics_options_and_exceptions(device_server):
    """Over gRPC: the numerics options select their own executable (cache key), an exception
    check fails the call with INVALID_ARGUMENT and kind "floating-point-exception"
    (``tf_ipu.errors.FloatingPointExceptionError``), and a bad partials type is refused."""
    from tf_ipu import errors
    from tf_ipu.client import DeviceClient

    b = eu.IRBuilder("square16")
    x = b.parameter(np.float16, [3])
    b.root(b.op("multiply", [x, x], np.float16, [3], source_op="net/sq/mul"))
    module = b.module()
    arg = np.array([1.0, 300.0, 2.0], np.float16)
    with DeviceClient(device_server) as c:
        c.open_session()
        c.attach(1, "ipu2")
        plain = c.compile(module)
        checked = c.compile(module, floating_point_behaviour={"oflo": True, "inv": False})
        assert checked.executable_id != plain.executable_id
        (out,) = c.execute(plain.executable_id, [arg])
        assert np.isposinf(out[1])
        with pytest.raises(errors.FloatingPointExceptionError) as info:
            c.execute(checked.executable_id, [arg])
        assert info.value.code == "INVALID_ARGUMENT" and info.value.kind == "floating-point-exception"
        assert "opcode multiply" in info.value.message and "net/sq/mul" in info.value.message
        half = c.compile(module, matmul_partials_type="half")
        assert half.executable_id not in (plain.executable_id, checked.executable_id)
        with pytest.raises(errors.InvalidArgumentError, match="partials_type"):
            c.compile(module, convolution_partials_type="double")
