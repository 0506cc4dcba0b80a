"""Graphcore names added for ported code: ``ipu.utils.IPUConfig``, ``ipu.cross_replica_ops`` and
``ipu_tensorflow_addons.keras.optimizers``.

References: the cross-replica ops in replicated programs (2 and 4 replicas of the suite's
device server) against the same sums computed with NumPy from the data each replica took
(replica r's step i takes batch i*R + r); the optimizers against Keras's (Adam within 1e-6,
SGD within 1e-7 absolute) and against NumPy float64 implementations of Graphcore's update
(LAMB's trust ratio included) within 1e-5 relative, for several steps; a ``fit`` under
``IPUStrategy`` against the same ``fit`` on the CPU (1e-4 relative, as tests/test_replication.py).
"""

from __future__ import annotations

import numpy as np
import pytest
from keras_util import attached_ipus, rel_l2

RNG = np.random.default_rng(26)
W0 = RNG.normal(size=(5, 3)).astype(np.float32)
GRADS = [RNG.normal(size=(5, 3)).astype(np.float32) for _ in range(6)]


@pytest.fixture(autouse=True, scope="module")
def _graphcore_import_paths():
    """``tensorflow.python.ipu`` and ``ipu_tensorflow_addons``: set up by ``import tf_ipu``
    once TensorFlow is imported."""
    import tensorflow  # noqa: F401

    import tf_ipu  # noqa: F401


# -- names -----------------------------------------------------------------------------------


def test_graphcore_import_paths_resolve():
    import ipu_tensorflow_addons.keras.optimizers as opts
    from ipu_tensorflow_addons.keras.optimizers.adam_optimizer import AdamIpuOptimizer
    from tensorflow.python import ipu
    from tensorflow.python.ipu import cross_replica_ops
    from tensorflow.python.ipu.ops import cross_replica_ops as ops_path

    import tf_ipu

    assert ipu.utils.IPUConfig is ipu.config.IPUConfig is tf_ipu.IPUConfig
    assert ipu.cross_replica_ops is cross_replica_ops is ops_path is ipu.ops.cross_replica_ops
    for name in ("cross_replica_sum", "cross_replica_mean", "assume_equal_across_replicas"):
        assert callable(getattr(cross_replica_ops, name))
    assert opts.AdamIpuOptimizer is AdamIpuOptimizer
    assert {"AdamIpuOptimizer", "LAMBIpuOptimizer", "SGDIpuOptimizer",
            "IpuOptimizerBase"} <= set(opts.__all__)


def test_ipu_utils_ipuconfig_configures_the_system(ipu_system, device_server):
    from tensorflow.python import ipu

    import tf_ipu

    cfg = ipu.utils.IPUConfig()
    assert isinstance(cfg, tf_ipu.IPUConfig)
    cfg.server_address = device_server
    cfg.auto_select_ipus = 2
    cfg.ipu_model.version = "ipu2"
    try:
        cfg.configure_ipu_system()
        assert tf_ipu.IPUStrategy().replication_factor == 2
    finally:
        ipu_system.configure_ipu_system()  # the session's configuration again
    assert tf_ipu.IPUStrategy().replication_factor == 1


# -- cross-replica ops ---------------------------------------------------------------------


def _collectives_model(group):
    import keras
    from tensorflow.python.ipu import cross_replica_ops as cro

    class Collectives(keras.layers.Layer):
        def call(self, x):
            same = cro.assume_equal_across_replicas({"x": x, "pair": (x, 2 * x)})
            return keras.ops.concatenate([
                cro.cross_replica_sum(x, replica_group_size=group),
                cro.cross_replica_mean(x, replica_group_size=group),
                same["x"], same["pair"][1]], axis=-1)

    return keras.Sequential([keras.Input((3,)), Collectives()])


@pytest.mark.parametrize("replicas, group", [(2, None), (4, None), (4, 2)])
def test_cross_replica_ops_in_a_replicated_predict(ipu_system, replicas, group):
    """Every replica's result comes back from predict: batch b = i*R + r is replica r's
    step i, whose sum runs over the batches its group of replicas took in step i."""
    import tf_ipu

    k = group or replicas
    x = RNG.normal(size=(2 * replicas * 2, 3)).astype(np.float32)  # 2 steps of batch 2
    batches = x.reshape(-1, 2, 3)
    want_sum = np.empty_like(batches)
    for b in range(len(batches)):
        step, r = divmod(b, replicas)
        first = step * replicas + (r // k) * k
        want_sum[b] = batches[first:first + k].astype(np.float64).sum(0)
    want = np.concatenate([want_sum.reshape(-1, 3), want_sum.reshape(-1, 3) / k, x, 2 * x], 1)
    with attached_ipus(ipu_system, replicas):
        with tf_ipu.IPUStrategy().scope():
            model = _collectives_model(group)
            model.compile(steps_per_execution=2 * replicas)
        got = model.predict(x, batch_size=2, verbose=0)
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    # Built on the host (one replica) the layer is the identity for the sums.
    cpu = _collectives_model(group).predict(x, batch_size=2, verbose=0)
    np.testing.assert_allclose(cpu, np.concatenate([x, x, x, 2 * x], 1), rtol=1e-6)


def test_cross_replica_ops_in_strategy_run_and_a_conditional(ipu_system):
    """strategy.run on 4 replicas: the sum of the replicas' infeed elements, a group mean,
    a cross-replica sum inside a tf.cond on a flag marked equal across replicas, and the
    gradient of a cross-replica sum."""
    import tensorflow as tf
    from tensorflow.python.ipu import cross_replica_ops as cro

    import tf_ipu

    data = tf.data.Dataset.from_tensor_slices(np.arange(1, 9, dtype=np.float32).reshape(8, 1))
    with attached_ipus(ipu_system, 4):
        strategy = tf_ipu.IPUStrategy()
        with strategy.scope():
            iterator = iter(data)

            def step(it):
                value = next(it)
                total = cro.cross_replica_sum(value)
                flag = cro.assume_equal_across_replicas(total > 5.0)
                branch = tf.cond(flag[0], lambda: cro.cross_replica_sum(value * 10.0),
                                 lambda: tf.zeros_like(value))
                with tf.GradientTape() as tape:
                    tape.watch(value)
                    y = cro.cross_replica_sum(value * value)
                grad = tape.gradient(y, value)
                return total, cro.cross_replica_mean(value, replica_group_size=2), branch, grad

            total, mean, branch, grad = strategy.run(step, args=(iterator,))
            with pytest.raises(ValueError, match="replica_group_size=3"):
                strategy.run(lambda v: cro.cross_replica_sum(v, replica_group_size=3),
                             args=(tf.constant([1.0]),))
    # The result is replica 0's: it took element 0 (1.0), replicas 1..3 elements 1..3.
    assert float(total.numpy()[0]) == 1 + 2 + 3 + 4
    assert float(mean.numpy()[0]) == pytest.approx((1 + 2) / 2)
    assert float(branch.numpy()[0]) == pytest.approx(10 * (1 + 2 + 3 + 4))
    # d/dx of the sum of all replicas' outputs: 2 x, once per replica (the upstream summed).
    assert float(grad.numpy()[0]) == pytest.approx(2 * 1.0 * 4)


# -- optimizers against their references ---------------------------------------------------


def _steps(opt, w0=W0, grads=GRADS, names=("kernel",)):
    """``opt`` applied to variables starting at ``w0`` (one per name) for the given grads."""
    import keras
    import tensorflow as tf

    variables = [keras.Variable(w0, name=n) for n in names]
    for g in grads:
        opt.apply_gradients([(tf.constant(g), v) for v in variables])
    return [v.numpy() for v in variables], opt


def _adam_numpy(w, grads, lr, b1=0.9, b2=0.999, eps=1e-7, debiasing=True, amsgrad=False,
                dtype=np.float64):
    """Graphcore's Adam (adam_optimizer.py's docstring): the update computed in ``dtype``, the
    weights kept in float64 (float32 when ``dtype`` is narrower, as the variable is); ``lr`` a
    float or one per step."""
    f = dtype
    w = w.astype(np.float64 if f == np.float64 else np.float32)
    m = np.zeros(w.shape, f)
    v = np.zeros(w.shape, f)
    vmax = np.zeros(w.shape, f)
    for t, g in enumerate(grads, 1):
        g = g.astype(f)
        m = m * f(b1) + g * (f(1) - f(b1))
        v = v * f(b2) + g * g * (f(1) - f(b2))
        if debiasing:
            mh, vh = m / (f(1) - f(b1) ** f(t)), v / (f(1) - f(b2) ** f(t))
        else:
            mh, vh = m, v
        if amsgrad:
            vmax = np.maximum(vmax, vh)
            vh = vmax
        step_lr = lr[t - 1] if isinstance(lr, list) else lr
        w = w - (f(step_lr) * (mh / (np.sqrt(vh) + f(eps)))).astype(w.dtype)
    return w


def _lamb_numpy(w, grads, lr, b1=0.9, b2=0.999, eps=1e-6, wd=0.0, clip=None, decay=True,
                adapt=True):
    """The published LAMB update with Graphcore's trust ratio, in float64."""
    w = w.astype(np.float64)
    m = np.zeros_like(w)
    v = np.zeros_like(w)
    for t, g in enumerate(grads, 1):
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g.astype(np.float64) ** 2
        u = (m / (1 - b1 ** t)) / (np.sqrt(v / (1 - b2 ** t)) + eps)
        if decay:
            u = u + wd * w
        ratio = 1.0
        if adapt:
            w_norm, u_norm = np.linalg.norm(w), np.linalg.norm(u)
            if clip is not None:
                w_norm = min(w_norm, clip)
            ratio = w_norm / u_norm if w_norm > 0 and u_norm > 0 else 1.0
        w = w - lr * ratio * u
    return w


def test_adam_ipu_optimizer_matches_keras_adam():
    import keras
    from ipu_tensorflow_addons.keras.optimizers import AdamIpuOptimizer

    (got,), opt = _steps(AdamIpuOptimizer(0.01))
    (want,), _ = _steps(keras.optimizers.Adam(0.01))
    assert isinstance(opt, keras.optimizers.Adam)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
    np.testing.assert_allclose(got, _adam_numpy(W0, GRADS, 0.01), rtol=1e-5)
    assert int(opt.iterations.numpy()) == len(GRADS)


@pytest.mark.parametrize("debiasing, amsgrad", [(False, False), (True, True), (False, True)])
def test_adam_variants_match_graphcores_update(debiasing, amsgrad):
    """Graphcore's AMSGrad keeps the maximum of the bias-corrected v (Keras's of v)."""
    from ipu_tensorflow_addons.keras.optimizers import AdamIpuOptimizer

    (got,), _ = _steps(AdamIpuOptimizer(0.01, debiasing=debiasing, amsgrad=amsgrad))
    want = _adam_numpy(W0, GRADS, 0.01, debiasing=debiasing, amsgrad=amsgrad)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("momentum, nesterov", [(0.0, False), (0.9, False), (0.9, True)])
def test_sgd_ipu_optimizer_matches_keras_sgd(momentum, nesterov):
    import keras
    from ipu_tensorflow_addons.keras.optimizers import SGDIpuOptimizer

    (got,), opt = _steps(SGDIpuOptimizer(0.05, momentum=momentum, nesterov=nesterov))
    (want,), _ = _steps(keras.optimizers.SGD(0.05, momentum=momentum, nesterov=nesterov))
    assert isinstance(opt, keras.optimizers.SGD)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-7)


@pytest.mark.parametrize("wd, clip", [(0.0, None), (0.01, None), (0.01, 1.5)])
def test_lamb_ipu_optimizer_matches_the_published_update(wd, clip):
    import keras
    from ipu_tensorflow_addons.keras.optimizers import LAMBIpuOptimizer

    opt = LAMBIpuOptimizer(0.02, weight_decay_rate=wd, weight_norm_clip=clip,
                           exclude_from_weight_decay=["bias"],
                           exclude_from_layer_adaptation=["bias"])
    (kernel, bias), _ = _steps(opt, names=("kernel", "bias"))
    assert isinstance(opt, keras.optimizers.Lamb)
    np.testing.assert_allclose(kernel, _lamb_numpy(W0, GRADS, 0.02, wd=wd, clip=clip),
                               rtol=1e-5, atol=1e-6)
    # The bias is excluded from both: Adam's step at the learning rate, no decay.
    np.testing.assert_allclose(bias, _lamb_numpy(W0, GRADS, 0.02, decay=False, adapt=False),
                               rtol=1e-5, atol=1e-6)
    if wd == 0.0 and clip is None:  # Keras's Lamb is the same update
        (want,), _ = _steps(keras.optimizers.Lamb(0.02, epsilon=1e-6))
        np.testing.assert_allclose(kernel, want, rtol=0, atol=1e-6)


def test_state_dtypes_follow_m_dtype_and_v_dtype():
    from ipu_tensorflow_addons.keras.optimizers import (
        AdamIpuOptimizer,
        LAMBIpuOptimizer,
        SGDIpuOptimizer,
    )

    def slots(opt):
        _, opt = _steps(opt, grads=GRADS[:2])
        return {v.name.rsplit("_", 1)[-1]: str(v.dtype) for v in opt.variables[2:]}

    assert slots(AdamIpuOptimizer(m_dtype="float16", v_dtype="float32")) == {
        "m": "float16", "v": "float32"}
    assert slots(AdamIpuOptimizer(amsgrad=True, vhat_dtype="float16")) == {
        "m": "float32", "v": "float32", "vhat": "float16"}
    assert slots(LAMBIpuOptimizer(m_dtype="float16", v_dtype="float16")) == {
        "m": "float16", "v": "float16"}
    assert slots(SGDIpuOptimizer(momentum=0.9, momentum_accum_dtype="float16")) == {
        "momentum": "float16"}
    # The state is rounded to its dtype; the step stays close to float32 state's.
    (half,), opt = _steps(AdamIpuOptimizer(0.01, m_dtype="float16", v_dtype="float16"))
    (full,), _ = _steps(AdamIpuOptimizer(0.01))
    assert 0 < np.abs(half - full).max() < 1e-3
    assert opt.get_slot(opt._trainable_variables[0], "m").dtype == "float16"


def test_optimizer_compute_precisions_are_honoured():
    from ipu_tensorflow_addons.keras.optimizers import AdamIpuOptimizer, LAMBIpuOptimizer

    (half,), _ = _steps(AdamIpuOptimizer(0.01, optimizer_compute_precisions=("float16",)))
    (full,), _ = _steps(AdamIpuOptimizer(0.01))
    want16 = _adam_numpy(W0, GRADS, 0.01, dtype=np.float16).astype(np.float32)
    assert np.abs(half - full).max() > 1e-5  # float16 arithmetic shows
    np.testing.assert_allclose(half, want16, rtol=0, atol=2e-3)
    assert rel_l2(half, want16) < rel_l2(full, want16)
    # LAMB's second stage (lr x ratio x update) in float16.
    (mixed,), _ = _steps(LAMBIpuOptimizer(0.02, optimizer_compute_precisions=("float32",
                                                                              "float16")))
    (lamb32,), _ = _steps(LAMBIpuOptimizer(0.02))
    assert 0 < np.abs(mixed - lamb32).max() < 1e-3
    with pytest.raises(ValueError, match="two dtypes"):
        LAMBIpuOptimizer(optimizer_compute_precisions=("float32",))


def test_keras2_arguments_and_config_round_trip():
    import keras
    from ipu_tensorflow_addons.keras.optimizers import AdamIpuOptimizer, LAMBIpuOptimizer

    opt = AdamIpuOptimizer(lr=0.01, decay=0.5, m_dtype="float16")
    (got,), _ = _steps(AdamIpuOptimizer(lr=0.01, decay=0.5))
    lrs = [0.01 / (1 + 0.5 * k) for k in range(len(GRADS))]  # Keras 2: lr / (1 + decay x it)
    np.testing.assert_allclose(got, _adam_numpy(W0, GRADS, lrs), rtol=1e-5)
    again = AdamIpuOptimizer.from_config(opt.get_config())
    assert again.get_config() == opt.get_config() and again.m_dtype == "float16"
    lamb = LAMBIpuOptimizer(weight_decay_rate=0.1, exclude_from_weight_decay=["bias"])
    restored = keras.optimizers.deserialize(keras.optimizers.serialize(lamb))
    assert type(restored) is LAMBIpuOptimizer and restored.get_config() == lamb.get_config()


def test_a_keras_file_keeps_the_optimizer_and_its_state(tmp_path):
    import keras
    from ipu_tensorflow_addons.keras.optimizers import AdamIpuOptimizer

    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile(optimizer=AdamIpuOptimizer(0.01, m_dtype="float16"), loss="mse")
    model.fit(np.ones((4, 3), np.float32), np.zeros((4, 2), np.float32), verbose=0)
    model.save(tmp_path / "m.keras")
    loaded = keras.models.load_model(tmp_path / "m.keras")
    assert type(loaded.optimizer) is AdamIpuOptimizer and loaded.optimizer.m_dtype == "float16"
    for a, b in zip(loaded.optimizer.variables, model.optimizer.variables, strict=True):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(a.numpy(), b.numpy())


# -- a fit on the IPU -----------------------------------------------------------------------


def test_fit_with_lamb_ipu_optimizer_matches_cpu(ipu_system):
    import keras
    from ipu_tensorflow_addons.keras.optimizers import LAMBIpuOptimizer

    import tf_ipu

    x = RNG.normal(size=(64, 6)).astype(np.float32)
    y = RNG.normal(size=(64, 2)).astype(np.float32)

    def build():
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="tanh"),
                                  keras.layers.Dense(2)])
        model.compile(optimizer=LAMBIpuOptimizer(0.01, weight_decay_rate=0.01,
                                                 exclude_from_weight_decay=["bias"],
                                                 m_dtype="float16"),
                      loss="mse", steps_per_execution=4)
        return model

    keras.utils.set_random_seed(5)
    cpu = build()
    initial = cpu.get_weights()
    cpu_loss = cpu.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0).history["loss"]
    with tf_ipu.IPUStrategy().scope():
        model = build()
        model.set_weights(initial)
    loss = model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0).history["loss"]
    np.testing.assert_allclose(loss, cpu_loss, rtol=1e-4)
    for got, want in zip(model.get_weights(), cpu.get_weights(), strict=True):
        assert rel_l2(got, want) <= 1e-4
    assert [str(v.dtype) for v in model.optimizer.variables[2:4]] == ["float16", "float16"]
