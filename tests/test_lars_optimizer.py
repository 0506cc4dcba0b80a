"""``tf_ipu.optimizers.LARS`` against a numpy reference of the MLPerf ResNet-50 reference's LARS
(mlcommons/training image_classification/tensorflow2/lars_optimizer.py; Graphcore's v1.1/v2.0
submissions' lars_optimizer.py is the same rule), over several steps with random gradients:

- float32 variables, eagerly, jit-compiled (XLA on the CPU) and on the device (``IPUStrategy``,
  all steps in one device program): weights and momentum within rtol 1e-5 of the float64
  reference (float32 rounding over 6 steps);
- a variable in the skip list (no trust ratio, no weight decay), a zero variable and a zero
  gradient (trust ratio 1), Nesterov momentum, epsilon > 0;
- float16 variables against the reference run in float16 with float32 norms (rtol 2e-3: a few
  float16 ulps);
- config round trip and argument errors.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_ipu
from tf_ipu.optimizers import LARS

STEPS = 6
SHAPES = {"conv_kernel": (3, 3, 4, 8), "bn_gamma": (8,), "dense_bias": (5,), "zero_kernel": (6, 4),
          "still_kernel": (4, 4)}


def reference(ws: dict[str, np.ndarray], grads: list[dict[str, np.ndarray]], *, lr: float,
              momentum: float, weight_decay: float, eeta: float, epsilon: float,
              skip: tuple[str, ...], nesterov: bool = False, dtype=np.float64) -> tuple[dict, dict]:
    """The reference's LARS in numpy (norms in float64 at least); returns weights and momenta."""
    w = {k: v.astype(dtype) for k, v in ws.items()}
    m = {k: np.zeros_like(v) for k, v in w.items()}
    for step in grads:
        for k in w:
            g = step[k].astype(dtype)
            lr_w = dtype(lr)
            if not any(s in k for s in skip):
                wn = np.sqrt(np.sum(np.square(w[k].astype(np.float64))))
                gn = np.sqrt(np.sum(np.square(g.astype(np.float64))))
                trust = eeta * wn / (gn + weight_decay * wn + epsilon) if wn > 0 and gn > 0 else 1.0
                g = g + dtype(weight_decay) * w[k]
                lr_w = dtype(lr) * dtype(trust)
            m[k] = dtype(momentum) * m[k] - lr_w * g
            w[k] = w[k] + (dtype(momentum) * m[k] - lr_w * g if nesterov else m[k])
    return w, m


def _data(seed: int = 0) -> tuple[dict[str, np.ndarray], list[dict[str, np.ndarray]]]:
    rng = np.random.default_rng(seed)
    ws = {k: rng.normal(0, 0.5, s).astype(np.float32) for k, s in SHAPES.items()}
    ws["zero_kernel"][:] = 0.0
    grads = []
    for _ in range(STEPS):
        step = {k: rng.normal(0, 0.05, s).astype(np.float32) for k, s in SHAPES.items()}
        step["still_kernel"][:] = 0.0
        grads.append(step)
    return ws, grads


ARGS = {"plain": {"lr": 0.5, "momentum": 0.9, "weight_decay": 1e-4, "eeta": 0.001, "epsilon": 0.0},
        "nesterov_eps": {"lr": 2.0, "momentum": 0.8, "weight_decay": 5e-5, "eeta": 0.01,
                         "epsilon": 1e-3, "nesterov": True}}


def _optimizer(args: dict) -> LARS:
    a = dict(args)
    return LARS(a.pop("lr"), skip_list=("gamma", "bias"), **a)


def _variables(ws: dict[str, np.ndarray], dtype: str = "float32") -> dict[str, keras.Variable]:
    return {k: keras.Variable(v.astype(dtype), name=k, dtype=dtype) for k, v in ws.items()}


def _run(opt: LARS, vs: dict[str, keras.Variable], grads: tf.Tensor) -> None:
    names = list(vs)
    for s in range(STEPS):
        opt.apply_gradients([(tf.reshape(tf.cast(grads[s][i][: int(np.prod(vs[k].shape))],
                                                 vs[k].dtype), vs[k].shape), vs[k])
                             for i, k in enumerate(names)])


def _packed(grads: list[dict[str, np.ndarray]]) -> np.ndarray:
    """[steps, variables, max size] with each gradient flattened (one tensor for a device call)."""
    size = max(int(np.prod(s)) for s in SHAPES.values())
    out = np.zeros((STEPS, len(SHAPES), size), np.float32)
    for s, step in enumerate(grads):
        for i, k in enumerate(SHAPES):
            out[s, i, : step[k].size] = step[k].ravel()
    return out


def _check(vs: dict[str, keras.Variable], opt: LARS, ws, grads, args, rtol: float,
           dtype=np.float64) -> None:
    ref_w, ref_m = reference(ws, grads, skip=("gamma", "bias"), dtype=dtype,
                             **{k: v for k, v in args.items()})
    for k, v in vs.items():
        np.testing.assert_allclose(np.asarray(v.numpy(), np.float64), ref_w[k], rtol=rtol,
                                   atol=rtol * 1e-2, err_msg=k)
        m = opt.momentums[opt._get_variable_index(v)]
        np.testing.assert_allclose(np.asarray(m.numpy(), np.float64), ref_m[k], rtol=rtol,
                                   atol=rtol * 1e-2, err_msg=f"momentum of {k}")


def test_cases_exercise_what_they_say():
    """The data hits each branch: trust ratios well away from 1, a zero weight, a zero
    gradient, and a skipped variable that moves."""
    ws, grads = _data()
    opt = _optimizer(ARGS["plain"])
    vs = _variables(ws)
    assert [opt.adapted(v) for v in vs.values()] == [True, False, False, True, True]
    trust = 0.001 * np.linalg.norm(ws["conv_kernel"]) / np.linalg.norm(grads[0]["conv_kernel"])
    assert trust < 0.1
    ref_w, _ = reference(ws, grads, skip=("gamma", "bias"), **ARGS["plain"])
    assert not np.allclose(ref_w["bn_gamma"], ws["bn_gamma"], rtol=1e-2)
    assert not np.allclose(ref_w["zero_kernel"], 0.0)          # trust 1 from zero weights
    assert not np.allclose(ref_w["still_kernel"], ws["still_kernel"], rtol=0, atol=1e-9)  # decay


@pytest.mark.parametrize("name", list(ARGS))
def test_matches_reference_eagerly(name):
    ws, grads = _data()
    opt, vs = _optimizer(ARGS[name]), _variables(ws)
    _run(opt, vs, tf.constant(_packed(grads)))
    _check(vs, opt, ws, grads, ARGS[name], rtol=1e-5)


@pytest.mark.parametrize("name", list(ARGS))
def test_matches_reference_jit_compiled(name):
    ws, grads = _data(1)
    opt, vs = _optimizer(ARGS[name]), _variables(ws)
    opt.build(list(vs.values()))
    tf.function(lambda g: _run(opt, vs, g), jit_compile=True)(tf.constant(_packed(grads)))
    _check(vs, opt, ws, grads, ARGS[name], rtol=1e-5)


def test_float16_variables():
    """float16 weights, gradients and momenta; the norms in float32."""
    ws, grads = _data(2)
    ws16 = {k: v.astype(np.float16) for k, v in ws.items()}
    grads16 = [{k: v.astype(np.float16) for k, v in s.items()} for s in grads]
    opt, vs = _optimizer(ARGS["plain"]), _variables(ws16, "float16")
    _run(opt, vs, tf.constant(_packed(grads16)))
    assert all(m.dtype == "float16" for m in opt.momentums)
    _check(vs, opt, ws16, grads16, ARGS["plain"], rtol=2e-3, dtype=np.float16)


@pytest.fixture(scope="module")
def strategy(ipu_system):
    return tf_ipu.IPUStrategy()


def test_matches_reference_on_the_device(strategy):
    """All the steps in one device program."""
    ws, grads = _data(3)
    with strategy.scope():
        opt, vs = _optimizer(ARGS["plain"]), _variables(ws)
        opt.build(list(vs.values()))
    run = tf.function(lambda g: _run(opt, vs, g), jit_compile=True)
    strategy.run(run, args=[tf.constant(_packed(grads))])
    _check(vs, opt, ws, grads, ARGS["plain"], rtol=1e-5)


def test_config_round_trip():
    opt = LARS(3.0, momentum=0.8, weight_decay=2e-5, eeta=0.002, epsilon=1e-6,
               skip_list=["gamma"], nesterov=True)
    config = opt.get_config()
    again = LARS.from_config(config)
    for key in ("momentum", "weight_decay", "eeta", "epsilon", "skip_list", "nesterov"):
        assert again.get_config()[key] == config[key], key
    assert again.weight_decay is None  # not Keras's decoupled weight decay
    restored = keras.optimizers.deserialize(keras.optimizers.serialize(opt))
    assert isinstance(restored, LARS) and restored.lars_weight_decay == 2e-5


@pytest.mark.parametrize("kwargs,message", [
    ({"momentum": 1.0}, "momentum=1.0"), ({"weight_decay": -1e-4}, "weight_decay=-0.0001"),
    ({"eeta": 0}, "eeta=0"), ({"epsilon": -1.0}, "epsilon=-1.0"),
    ({"skip_list": "bias"}, "skip_list='bias'"), ({"momentum": "0.9"}, "momentum='0.9'")])
def test_argument_errors(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(".", r"\.")):
        LARS(0.1, **kwargs)
