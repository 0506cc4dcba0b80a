"""``keras.ipu.optimizers.ALSOptimizer`` and ``ALSGradientAccumulationOptimizer`` (automatic
loss scaling, Graphcore's algorithm) against a numpy reference of the rule, on the CPU
(eagerly and jit-compiled) and under ``IPUStrategy``.

- crafted gradient sequences: each step's scaled gradients are ``float16(g * LSF)`` for given
  float16-exact ``g`` (a power-of-two LSF keeps them exact), so the optimizer and the
  reference see the same values; the LSF, the previous LSF, the histogram, the update
  counter and the weights must equal the reference's after every step (exactly: the values
  are integers and powers of two, and the weight update is the same float32 operations);
- Graphcore's own cap tests (LSF capped below ``max_loss_scaling_factor``, never below 1);
- a small model with a float16 layer trained by ``fit`` with ALS under ``IPUStrategy`` against
  the same training in float64 (numpy, the rule's reference fed the float64 gradients scaled
  and rounded to float16): the LSF goes up and down, its trajectory and the final ALS state
  must be the same; the weights and epoch losses within bounds stated there (a float64
  reference rounds alike on every host, XLA's float16 arithmetic on the CPU does not);
- accumulation (SUM) against Keras's ``gradient_accumulation_steps`` (a mean) at twice the
  learning rate; configs round trip (``get_config``/``from_config``, Keras's serialization,
  a ``.keras`` file); Graphcore's argument checks.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_ipu
from tests.keras_util import rel_l2
from tf_ipu.graphcore.keras_ipu.optimizers import ALSGradientAccumulationOptimizer, ALSOptimizer

F16_MAX = float(np.finfo(np.float16).max)


# -- the reference ------------------------------------------------------------------------


class ReferenceALS:
    """The scale-update rule in numpy, as Graphcore's documentation and tests state it."""

    def __init__(self, initial_loss_scaling_factor=1, update_frequency=8, increase_factor=2,
                 max_loss_scaling_factor=32768, accumulate_statistics_over_update_period=True,
                 ratio_threshold=10e-6, captured_grads_only=False, lpf_alpha=0.0,
                 histogram_bin_edge=2**13, mini_batches=1):
        self.freq, self.inc, self.max = update_frequency, increase_factor, max_loss_scaling_factor
        self.accumulate, self.threshold = accumulate_statistics_over_update_period, ratio_threshold
        self.captured_only, self.alpha, self.edge = captured_grads_only, lpf_alpha, histogram_bin_edge
        self.mini_batches = mini_batches
        self.lsf = self.prev = float(initial_loss_scaling_factor)
        self.hist = np.zeros(2, np.float32)
        self.n = 0  # weight updates since the last LSF update
        self.k = 0  # mini-batch within the weight update

    def due(self) -> bool:
        return self.freq == 1 or (self.n > 0 and self.n % self.freq == 0)

    def step(self, grads: list[np.ndarray], captured: list[np.ndarray] = ()) -> list[np.ndarray]:
        """One call with these scaled gradients; returns them unscaled."""
        due = self.due()
        if self.accumulate or due:
            for g in ([] if self.captured_only else list(grads)) + list(captured):
                if g.dtype == np.float16:
                    a = np.abs(g.astype(np.float32))
                    over = int(np.count_nonzero(~(a < self.edge)))
                    self.hist += np.float32(1 - self.alpha) * np.array([a.size - over, over],
                                                                       np.float32)
        unscaled = [(g.astype(np.float32) / np.float32(self.lsf)).astype(g.dtype) for g in grads]
        last = self.k == self.mini_batches - 1
        self.k = 0 if last else self.k + 1
        if last:
            if due:
                total = self.hist.sum()
                ratio = self.hist[1] / total if total > 0 else np.nan
                new = self.lsf / self.inc if ratio > self.threshold else self.lsf * self.inc
                if np.isfinite(new) and 1 <= new < self.max:
                    self.prev, self.lsf = self.lsf, new
                self.hist = np.zeros(2, np.float32)
                self.n = 0
            else:
                self.n += 1
        return unscaled

    def state(self) -> list[float]:
        return [self.lsf, self.prev, float(self.hist[0]), float(self.hist[1]), float(self.n)]


def reference_run(config: dict, g_true: np.ndarray, lr: float, w0: np.ndarray,
                  n_weight: int, mini_batches: int = 1):
    """The reference over ``g_true`` (steps x values): per step the state, and the weights
    (float32, SGD with ``lr``) at the end. Values past ``n_weight`` are captured gradients."""
    ref = ReferenceALS(**config, mini_batches=mini_batches)
    w = w0.astype(np.float32).copy()
    acc = np.zeros_like(w)
    states = []
    for g in g_true:
        with np.errstate(over="ignore", invalid="ignore"):
            scaled = (g * np.float32(ref.lsf)).astype(np.float16)
        last = ref.k == mini_batches - 1
        (unscaled,) = ref.step([scaled[:n_weight]],
                               [scaled[n_weight:]] if len(g) > n_weight else [])
        with np.errstate(invalid="ignore"):
            acc = acc + unscaled.astype(np.float32)
            if last:
                w = w - acc * np.float32(lr)
                acc = np.zeros_like(w)
        states.append(ref.state())
    return np.array(states, np.float32), w


def crafted(rng: np.random.Generator, steps: int, n: int, phases: list[tuple[int, float]],
            specials: dict[int, float] | None = None) -> np.ndarray:
    """float16-exact gradients (as float32): each phase (steps, largest magnitude) draws
    magnitudes from [2^-10, largest); ``specials`` puts inf / NaN / a value at a step's
    first element."""
    out = []
    for count, largest in phases:
        for _ in range(count):
            g = rng.uniform(2.0**-10, largest, n) * rng.choice([-1.0, 1.0], n)
            out.append(np.float16(g).astype(np.float32))
    out = np.array(out[:steps])
    for step, value in (specials or {}).items():
        out[step, 0] = value
    return out


# Each case: the ALS arguments, the gradients, the number of weight values (the rest is
# passed as captured gradients) and the mini-batches of accumulation (1: ALSOptimizer).
N = 64
CASES = {
    # small gradients: the LSF doubles every update_frequency + 1 steps up to below the max
    "grows_to_cap": ({"update_frequency": 3, "max_loss_scaling_factor": 64},
                     [(24, 0.5)], N, 1),
    # gradients at or over the edge at every scale: the LSF halves down to 1 and stays
    "shrinks_to_one": ({"initial_loss_scaling_factor": 256, "update_frequency": 1},
                       [(12, 9000.0)], N, 1),
    # up while small, down once LSF x gradient reaches the edge, with an overflow to inf
    # and a NaN: the weight update is not skipped (Graphcore's rule), the weights follow
    "up_and_down": ({"initial_loss_scaling_factor": 128, "update_frequency": 2,
                     "increase_factor": 4},
                    [(9, 4.0), (9, 60.0), (9, 1.0)], N, 1),
    # ratio_threshold: 1 value in 64 over the edge is under 1/32, 3 in 64 over it
    "ratio_threshold": ({"initial_loss_scaling_factor": 16, "update_frequency": 1,
                         "ratio_threshold": 1 / 32, "histogram_bin_edge": 1024.0},
                        [(12, 8.0)], N, 1),
    # statistics of the update step only
    "no_accumulation": ({"initial_loss_scaling_factor": 64, "update_frequency": 2,
                         "accumulate_statistics_over_update_period": False},
                        [(6, 2.0), (9, 500.0)], N, 1),
    # lpf_alpha weighs the counts; captured gradients counted with the weights'
    "lpf_and_captured": ({"initial_loss_scaling_factor": 32, "update_frequency": 2,
                          "lpf_alpha": 0.5},
                         [(6, 1.0), (9, 600.0)], N // 2, 1),
    # only the captured gradients count (the weights' are large, the captured small)
    "captured_only": ({"initial_loss_scaling_factor": 32, "update_frequency": 2,
                       "captured_grads_only": True},
                      [(12, 1.0)], N // 2, 1),
    # Graphcore's older bin edge (SDK 3.0): the float16 maximum
    "fp16_max_edge": ({"initial_loss_scaling_factor": 256, "update_frequency": 1,
                       "histogram_bin_edge": F16_MAX - 2 * float(np.finfo(np.float16).eps)},
                      [(10, 200.0)], N, 1),
    # accumulation: counts of both mini-batches, the counter moves per weight update
    "accumulation": ({"initial_loss_scaling_factor": 64, "update_frequency": 2},
                     [(12, 4.0), (12, 300.0)], N, 2),
}
SPECIALS = {"up_and_down": {12: np.inf, 14: np.nan}}


def _case_grads(name: str) -> np.ndarray:
    config, phases, n_weight, _ = CASES[name]
    rng = np.random.default_rng(sum(map(ord, name)))
    steps = sum(c for c, _ in phases)
    g = crafted(rng, steps, N, phases, SPECIALS.get(name))
    if name == "ratio_threshold":  # steps alternate 1 and 3 values over the edge (8 x 16 x 8)
        g = np.float16(rng.uniform(2.0**-10, 4.0, (steps, N))).astype(np.float32)
        for s in range(steps):
            g[s, : (1 if s % 2 == 0 else 3)] = 100.0
    if name == "captured_only":  # weights' gradients overflow, captured ones do not
        g[:, :n_weight] *= 1000.0
    return g


def _make(name: str, lr: float = 0.01):
    config, _, n_weight, mini_batches = CASES[name]
    opt = ALSOptimizer(keras.optimizers.SGD(lr), **config)
    if mini_batches > 1:
        opt = ALSGradientAccumulationOptimizer(opt, mini_batches)
    w = keras.Variable(np.linspace(-1, 1, n_weight).astype(np.float32), name="w")
    opt.build([w])
    return opt, w


def _steps(opt, w, g_true: tf.Tensor, steps: int, n_weight: int) -> tf.Tensor:
    """The crafted steps (unrolled): scaled = float16(g x LSF); returns the state per step."""
    states = []
    for i in range(steps):
        scaled = tf.cast(g_true[i] * opt.loss_scaling_factor, tf.float16)
        captured = {"act": scaled[n_weight:]} if n_weight < N else None
        opt.apply_gradients([(scaled[:n_weight], w)], captured_grads=captured)
        h = opt.histogram
        states.append(tf.stack([opt.loss_scaling_factor, opt.previous_loss_scaling_factor,
                                h[0], h[1], tf.cast(opt.update_counter, tf.float32)]))
    return tf.stack(states)


def _check(name: str, states: np.ndarray, w: np.ndarray, g: np.ndarray, lr: float = 0.01,
           exact: bool = True):
    """The states equal the reference's; the weights too (eagerly: the same float32
    operations), or within 1e-6 relative (compiled: XLA may fuse w - lr g, one rounding)."""
    config, _, n_weight, mini_batches = CASES[name]
    w0 = np.linspace(-1, 1, n_weight).astype(np.float32)
    want, want_w = reference_run(config, g, lr, w0, n_weight, mini_batches)
    for step, (got_s, want_s) in enumerate(zip(states, want, strict=True)):
        assert got_s.tolist() == want_s.tolist(), (
            f"step {step}: [lsf, prev, hist0, hist1, counter] {got_s.tolist()} against the "
            f"reference's {want_s.tolist()}")
    if exact:
        np.testing.assert_array_equal(w, want_w)
    else:
        np.testing.assert_allclose(w, want_w, rtol=1e-6)  # NaN where the reference has NaN


def test_cases_exercise_what_they_say():
    """The crafted sequences do what their names say (on the reference)."""
    lsf = {name: reference_run(CASES[name][0], _case_grads(name), 0.01,
                               np.zeros(CASES[name][2], np.float32), CASES[name][2],
                               CASES[name][3])[0][:, 0] for name in CASES}
    assert lsf["grows_to_cap"].tolist() == [1] * 3 + [2] * 4 + [4] * 4 + [8] * 4 + [16] * 4 + [32] * 5
    assert lsf["shrinks_to_one"].tolist()[-3:] == [1, 1, 1] and max(lsf["shrinks_to_one"]) == 128
    d = np.diff(lsf["up_and_down"])
    assert (d > 0).any() and (d < 0).any()
    assert lsf["ratio_threshold"].tolist()[:4] == [32, 16, 32, 16]
    assert lsf["no_accumulation"][-1] < lsf["no_accumulation"].max()
    assert lsf["captured_only"][-1] > 32
    # the counter moves per weight update (2 calls): the first update is at call 5
    assert lsf["accumulation"].tolist()[:6] == [64] * 5 + [128]


@pytest.mark.parametrize("name", list(CASES))
def test_matches_reference_eagerly(name):
    g = _case_grads(name)
    opt, w = _make(name)
    states = _steps(opt, w, tf.constant(g), len(g), CASES[name][2])
    _check(name, states.numpy(), w.numpy(), g)


@pytest.mark.parametrize("name", ["up_and_down", "no_accumulation", "accumulation"])
def test_matches_reference_jit_compiled(name):
    g = _case_grads(name)
    opt, w = _make(name)
    run = tf.function(lambda g_: _steps(opt, w, g_, len(g), CASES[name][2]), jit_compile=True)
    _check(name, run(tf.constant(g)).numpy(), w.numpy(), g, exact=False)


@pytest.fixture(scope="module")
def strategy(ipu_system):
    return tf_ipu.IPUStrategy()


@pytest.mark.parametrize("name", ["up_and_down", "lpf_and_captured", "accumulation"])
def test_matches_reference_on_the_device(strategy, name):
    """All the steps in one device program (the optimizer's state is device-resident)."""
    g = _case_grads(name)
    with strategy.scope():
        opt, w = _make(name)
    run = tf.function(lambda g_: _steps(opt, w, g_, len(g), CASES[name][2]), jit_compile=True)
    states = strategy.run(run, args=[g])
    _check(name, np.asarray(states), w.numpy(), g, exact=False)


# -- Graphcore's cap tests (loss-driven, through minimize) ----------------------------------


@pytest.mark.parametrize("start,expected", [
    (1.0, [2, 4, 8, 8]),  # testUpperLSFCap: max 16, so 8 is the largest
    (F16_MAX, None),      # testLowerLSFCap: the loss overflows, down to 1 and not below
])
def test_caps(start, expected):
    if expected is None:
        opt = ALSOptimizer(keras.optimizers.SGD(0.01), increase_factor=2,
                           initial_loss_scaling_factor=16, update_frequency=1)
        expected = [8, 4, 2, 1, 1]
    else:
        opt = ALSOptimizer(keras.optimizers.SGD(0.01), increase_factor=2,
                           initial_loss_scaling_factor=1, max_loss_scaling_factor=16,
                           update_frequency=1)
    v = keras.Variable(np.float16(start), dtype="float16")

    @tf.function(jit_compile=True)
    def f():
        with tf.GradientTape() as tape:
            y = 3 * v
            loss = tf.reduce_mean(tf.square(tf.ones_like(y) - y))
        opt.minimize(loss, [v], tape=tape)

    for want in expected:
        f()
        assert float(opt.loss_scaling_factor) == want
        v.assign(np.float16(start))


def test_float32_gradients_are_not_counted():
    """Only float16 gradients are counted: with float32 ones the histogram stays empty and
    the LSF grows at each update (Graphcore's rule), which changes nothing in float32."""
    opt = ALSOptimizer(keras.optimizers.SGD(0.1), update_frequency=1, max_loss_scaling_factor=8)
    v = keras.Variable(np.ones(3, np.float32))
    for want in (2, 4, 4):
        opt.apply_gradients([(tf.constant([1e30, 0.0, 1.0]), v)])
        assert opt.histogram.numpy().tolist() == [0, 0]
        assert float(opt.loss_scaling_factor) == want


def test_get_gradients_scales_in_a_graph():
    """Graphcore's ``opt.get_gradients(loss, params)`` (its examples call it): the gradients
    of the scaled loss, inside a tf.function; eagerly, an error saying what to do."""
    opt = ALSOptimizer(keras.optimizers.SGD(0.1), initial_loss_scaling_factor=4)
    v = keras.Variable(np.float32(3.0))

    @tf.function
    def grads():
        return opt.get_gradients(v * v, [v])[0]

    assert float(grads()) == 4 * 2 * 3.0
    with pytest.raises(RuntimeError, match="tf.function"):
        opt.get_gradients(v * v, [v])


# -- a float16 model, fit on the device against float64 --------------------------------------


def _fp16_model() -> keras.Model:
    return keras.Sequential([
        keras.Input((8,)),
        keras.layers.Dense(32, activation="relu", dtype="float16", name="h16"),
        keras.layers.Dense(4, dtype="float32", name="out32"),
    ])


class _LSF(keras.callbacks.Callback):
    def __init__(self) -> None:
        super().__init__()
        self.values: list[float] = []

    def on_train_batch_end(self, batch, logs=None) -> None:
        self.values.append(float(self.model.optimizer.loss_scaling_factor))


def _float64_fit(weights: list[np.ndarray], x: np.ndarray, y: np.ndarray, epochs: int, batch: int,
                 lr: float, config: dict) -> tuple[list[float], list[float], list[float], list[np.ndarray], list[float]]:
    """``_fp16_model`` trained like ``fit`` (shuffle off, SGD, mean squared error) in float64
    numpy, with ``ReferenceALS`` fed the float16 layer's gradients scaled by the LSF and
    rounded to float16. Returns the LSF after each step, the epoch losses, the final state
    (``ReferenceALS.state``), the final weights, and per LSF decision its margin: how far
    (log2) the update period's largest scaled float16 gradient is from the histogram's bin
    edge. float64 rounds alike on every CPU (numpy's float64 products differ between hosts
    in the last bits only, ~1e-16, far below the bounds the test uses)."""
    w1, b1, w2, b2 = (np.asarray(w, np.float64) for w in weights)
    als = ReferenceALS(**config)
    lsf, losses, margins, largest = [], [], [], 0.0
    for _ in range(epochs):
        epoch = []
        for s in range(0, len(x), batch):
            xb, yb = x[s:s + batch].astype(np.float64), y[s:s + batch].astype(np.float64)
            z = xb @ w1 + b1
            h = np.maximum(z, 0.0)
            p = h @ w2 + b2
            epoch.append(float(np.mean((p - yb) ** 2)))
            dp = 2.0 * (p - yb) / p.size
            dz = (dp @ w2.T) * (z > 0)
            g = [xb.T @ dz, dz.sum(0), h.T @ dp, dp.sum(0)]
            largest = max(largest, max(float(np.abs(v).max()) for v in g[:2]) * als.lsf / als.edge)
            if als.due():
                margins.append(abs(float(np.log2(largest))))
                largest = 0.0
            with np.errstate(over="ignore"):
                als.step([(v * als.lsf).astype(np.float16) for v in g[:2]] + [v.astype(np.float32) for v in g[2:]])
            lsf.append(als.lsf)
            w1, b1, w2, b2 = (w - lr * v for w, v in zip((w1, b1, w2, b2), g, strict=True))
        losses.append(float(np.mean(epoch)))
    return lsf, losses, als.state(), [w1, b1, w2, b2], margins


def test_fit_float16_model_matches_float64(strategy):
    """ALS under ``IPUStrategy`` trains a float16 layer as the rule says: ``fit`` of
    ``_fp16_model`` (3 epochs of 8 steps, SGD(0.01), LSF from 1024, updated every 2 steps)
    against the same training in float64 (``_float64_fit``). It stands for the IPU computing
    the float16 layer in FP16 (FP16 weights and activations, FP32 partials in the matrix
    products, every result rounded to FP16) with the LSF chosen from the FP16 gradients'
    histogram. (XLA on the CPU is no reference: how it rounds float16 depends on the host's
    instruction set. On an AVX512-FP16/AMX host 71 of XLA's 256 float16 kernel weights were
    up to 2.5% away from the emulator's, which equal XLA's bit for bit on other hosts.)

    - The LSF after every device call and the final ALS state (LSF, previous LSF, histogram,
      counter) equal the reference's, and the LSF went up and down. Each decision compares
      the period's largest scaled FP16 gradient with the bin edge (2^13); in the reference
      every one is at least 2^0.1 (7%) from it (measured: 2^0.146, 10.6%), while the
      emulator's FP16 gradients are within a few FP16 roundings (~1e-3, see below) of the
      float64 ones: the same decisions on any host.
    - Epoch losses within 2u = 2^-10 relative (u = 2^-11, FP16's unit roundoff: the hidden
      activations are rounded to FP16, u each, relative; measured 3e-5).
    - float16 weights within T*u relative L2, T = 24 updates: each update rounds every weight
      to FP16 (at most u relative; the gradients' own roundings move an update, ~1/40 of a
      weight, by far less); measured 1.3e-3 (kernel) and 3.0e-3 (bias), as XLA's on the
      development host, which equal the emulator's bit for bit.
    - float32 weights within 2u relative L2: their gradients carry the FP16 activations'
      rounding (u relative) and their 24 updates move them by less than their norm;
      measured 2.9e-4 and 6.9e-5."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 8)).astype("float32")
    y = (10 * np.tanh(x @ rng.standard_normal((8, 4)))).astype("float32")
    config = dict(initial_loss_scaling_factor=1024, update_frequency=2, max_loss_scaling_factor=2**14)
    epochs, batch, updates, u = 3, 8, 24, 2.0 ** -11

    keras.utils.set_random_seed(3)
    with strategy.scope():
        ipu = _fp16_model()
        ipu.compile(optimizer=ALSOptimizer(keras.optimizers.SGD(0.01), **config), loss="mse",
                    steps_per_execution=4)
    assert isinstance(ipu.optimizer, ALSOptimizer)
    lsf, losses, state, weights, margins = _float64_fit(ipu.get_weights(), x, y, epochs, batch, 0.01, config)
    ipu_lsf = _LSF()
    h_ipu = ipu.fit(x, y, batch_size=batch, epochs=epochs, shuffle=False, verbose=0, callbacks=[ipu_lsf])

    steps = np.diff(lsf)
    assert (steps > 0).any() and (steps < 0).any(), lsf  # it went up and down
    assert min(margins) >= 0.1, margins
    assert ipu_lsf.values == lsf[3::4]  # callbacks run once per device call
    opt = ipu.optimizer
    assert [float(opt.loss_scaling_factor), float(opt.previous_loss_scaling_factor),
            *np.asarray(opt.histogram).tolist(), float(opt.update_counter)] == state
    for a, b in zip(h_ipu.history["loss"], losses, strict=True):
        assert abs(a - b) <= 2 * u * abs(b), (h_ipu.history["loss"], losses)
    for w_ipu, w_ref, v in zip(ipu.get_weights(), weights, ipu.weights, strict=True):
        bound = updates * u if w_ipu.dtype == np.float16 else 2 * u
        assert rel_l2(w_ipu.astype(np.float64), w_ref) <= bound, (v.path, rel_l2(w_ipu.astype(np.float64), w_ref))


def test_mixed_float16_compile_keeps_als():
    """ALSOptimizer is a LossScaleOptimizer: compile under mixed_float16 does not wrap it in
    Keras's dynamic loss scaling (the loss would be scaled twice)."""
    before = keras.config.dtype_policy()
    keras.config.set_dtype_policy("mixed_float16")
    try:
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
        opt = ALSOptimizer(keras.optimizers.SGD(0.1))
        model.compile(optimizer=opt, loss="mse")
        assert model.dtype_policy.name == "mixed_float16" and model.optimizer is opt
        plain = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
        plain.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        assert isinstance(plain.optimizer, keras.optimizers.LossScaleOptimizer)  # Keras's
    finally:
        keras.config.set_dtype_policy(before)


# -- accumulation -----------------------------------------------------------------------------


def test_accumulation_sum_matches_keras_accumulation():
    """SUM over 2 mini-batches is Keras's gradient_accumulation_steps=2 (a mean) at twice
    the learning rate; MEAN and RUNNING_MEAN at the same rate."""
    rng = np.random.default_rng(1)
    grads = rng.standard_normal((6, 5)).astype(np.float32)
    w0 = rng.standard_normal(5).astype(np.float32)

    def run(opt):
        w = keras.Variable(w0.copy())
        for g in grads:
            opt.apply_gradients([(opt.scale_loss(tf.constant(1.0)) * g, w)])
        return w.numpy()

    for method, lr in (("SUM", 0.2), ("MEAN", 0.1), ("RUNNING_MEAN", 0.1)):
        ga = ALSGradientAccumulationOptimizer(
            ALSOptimizer(keras.optimizers.SGD(0.1), initial_loss_scaling_factor=4), 2,
            reduction_method=method)
        keras_ga = keras.optimizers.SGD(lr, gradient_accumulation_steps=2)
        np.testing.assert_allclose(run(ga), run(keras_ga), rtol=1e-6, atol=1e-7,
                                   err_msg=method)
        assert int(ga.iterations) == 3


def test_keras_accumulation_inside_counts_weight_updates():
    """ALSOptimizer around an optimizer with Keras's gradient_accumulation_steps (what
    set_gradient_accumulation_options sets): the ALS state moves per weight update, as with
    ALSGradientAccumulationOptimizer (MEAN: Keras's reduction), to the reference's states."""
    name = "accumulation"
    g = _case_grads(name)
    config = CASES[name][0]
    want, _ = reference_run(config, g, 0.01, np.zeros(N, np.float32), N, mini_batches=2)
    weights = []
    for opt in (ALSOptimizer(keras.optimizers.SGD(0.01, gradient_accumulation_steps=2), **config),
                ALSGradientAccumulationOptimizer(ALSOptimizer(keras.optimizers.SGD(0.01), **config),
                                                 2, reduction_method="MEAN")):
        w = keras.Variable(np.linspace(-1, 1, N).astype(np.float16), dtype="float16")
        opt.build([w])  # (Keras's accumulators take gradients of the variable's dtype)
        states = _steps(opt, w, tf.constant(g), len(g), N).numpy()
        assert states.tolist() == want.tolist()
        weights.append(w.numpy().astype(np.float32))
    finite = np.isfinite(weights[1])
    np.testing.assert_array_equal(np.isfinite(weights[0]), finite)
    np.testing.assert_allclose(weights[0][finite], weights[1][finite], rtol=2e-3)  # float16


def test_accumulation_of_one_is_the_als_optimizer():
    als = ALSOptimizer(keras.optimizers.SGD(0.1))
    assert ALSGradientAccumulationOptimizer(als, num_mini_batches=1) is als
    with pytest.raises(ValueError, match="can only be used with instances of ALSOptimizer"):
        ALSGradientAccumulationOptimizer(keras.optimizers.SGD(0.1), 2)


# -- configs and checks ------------------------------------------------------------------------


def _als_config():
    return dict(initial_loss_scaling_factor=8, update_frequency=3, increase_factor=4,
                max_loss_scaling_factor=1024, accumulate_statistics_over_update_period=False,
                ratio_threshold=0.01, captured_grads_only=True, lpf_alpha=0.25,
                histogram_bin_edge=4096.0)


def test_config_round_trip():
    opt = ALSOptimizer(keras.optimizers.Adam(0.003, beta_1=0.8), name="als", **_als_config())
    config = opt.get_config()
    assert {k: config[k] for k in _als_config()} == _als_config()
    again = ALSOptimizer.from_config(config)
    assert again.get_config() == config
    assert isinstance(again.inner_optimizer, keras.optimizers.Adam)
    assert float(again.inner_optimizer.beta_1) == 0.8
    # Keras's serialization (what a .keras file holds), by the registered name
    restored = keras.optimizers.deserialize(keras.optimizers.serialize(opt))
    assert type(restored) is ALSOptimizer and restored.get_config() == config
    # Graphcore's form: the wrapped optimizer's class and config
    graphcore = {k: v for k, v in config.items() if k != "inner_optimizer"}
    graphcore.update(inner_optimizer_type=keras.optimizers.Adam,
                     inner_optimizer_config=opt.inner_optimizer.get_config())
    assert ALSOptimizer.from_config(graphcore).get_config() == config

    ga = ALSGradientAccumulationOptimizer(opt, 4, dtype="float32", reduction_method="MEAN")
    ga_again = keras.optimizers.deserialize(keras.optimizers.serialize(ga))
    assert type(ga_again) is ALSGradientAccumulationOptimizer
    assert ga_again.get_config() == ga.get_config()
    assert (ga_again.num_mini_batches, ga_again.reduction_method) == (4, "MEAN")


def test_model_file_keeps_the_loss_scale(tmp_path):
    """A .keras file restores the optimizer and its state (the LSF reached)."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2, dtype="float16")])
    model.compile(optimizer=ALSOptimizer(keras.optimizers.SGD(0.01), update_frequency=1),
                  loss="mse")
    x = np.ones((8, 4), np.float32)
    model.fit(x, np.zeros((8, 2), np.float32), epochs=3, batch_size=8, verbose=0)
    assert float(model.optimizer.loss_scaling_factor) == 8
    model.save(tmp_path / "m.keras")
    loaded = keras.models.load_model(tmp_path / "m.keras")
    assert type(loaded.optimizer) is ALSOptimizer
    assert float(loaded.optimizer.loss_scaling_factor) == 8
    assert loaded.optimizer.get_config() == model.optimizer.get_config()


@pytest.mark.parametrize("kwargs,message", [
    ({"initial_loss_scaling_factor": 5}, "initial_loss_scaling_factor must be a power of two"),
    ({"update_frequency": 0}, "update_frequency must be nonzero and positive"),
    ({"increase_factor": 3}, "increase_factor must be a power of two"),
    ({"max_loss_scaling_factor": 5}, "max_loss_scaling_factor must be a power of two"),
    ({"ratio_threshold": -1}, "ratio_threshold must be greater than zero and less than one"),
    ({"ratio_threshold": 2}, "ratio_threshold must be greater than zero and less than one"),
    ({"initial_loss_scaling_factor": 4, "max_loss_scaling_factor": 2},
     "initial_loss_scaling_factor must be less than max_loss_scaling_factor"),
    ({"initial_loss_scaling_factor": 1, "increase_factor": 4, "max_loss_scaling_factor": 4},
     "initial_loss_scaling_factor x increase_factor must be less than max_loss_scaling_factor"),
    ({"lpf_alpha": 1.5}, "lpf_alpha must be in"),
])
def test_graphcore_argument_checks(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ALSOptimizer(keras.optimizers.SGD(0.1), **kwargs)


def test_read_only_state_and_names():
    opt = ALSOptimizer(keras.optimizers.SGD(0.1), increase_factor=4)
    for name in ("histogram", "normalized_histogram", "loss_scaling_factor",
                 "previous_loss_scaling_factor", "update_counter", "decrease_factor"):
        with pytest.raises(ValueError, match=f"{name} is a read only property"):
            setattr(opt, name, 1)
    assert opt.decrease_factor == 0.25 and opt.supports_captured_grads
    import keras.ipu.optimizers as graphcore  # Graphcore's import path (import tf_ipu installs it)

    assert graphcore.ALSOptimizer is ALSOptimizer
    assert graphcore.ALSGradientAccumulationOptimizer is ALSGradientAccumulationOptimizer
    assert keras.ipu.ALSOptimizer is ALSOptimizer  # SDK 3.0's top-level names
    assert keras.ipu.ALSOptimizerGradientAccumulationWrapper is ALSGradientAccumulationOptimizer
    from keras.ipu.optimizers.als_optimizer import ALSOptimizer as same
    from tensorflow import keras as tf_keras

    assert same is ALSOptimizer and tf_keras.ipu.optimizers.ALSOptimizer is ALSOptimizer
