"""The emulator alone on Keras training loops: ``Executable.run`` vs TF on CPU, same steps.

For each model, the device program that tf_ipu's Keras integration lowers for
``steps_per_execution=32`` (a ``tf.while_loop`` of ``model.train_step`` over stacked
batches, see ``tf_ipu/keras_integration.py``) is lowered here the same way, compiled with
``device_server.emulator.compile_module`` and run warm (best of several calls; updated
variables are fed back, as the server keeps them resident). Side by side, TF on CPU runs
the same 32-step loop in a ``tf.function`` without XLA and with ``jit_compile=True``.
No device server, no gRPC, no host-side op: only the interpreter and its kernels.

Models: the MLP of ``bench_keras_step`` (32 -> 64 relu -> 64 relu -> 10 softmax, Adam,
sparse CE, accuracy, batch 32) and ``tests/keras_util.small_cnn`` (batch 16).

    .venv/bin/python bench/bench_emulator.py [--quick] [--profile mlp|cnn]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

STEPS = 32


def _mlp() -> keras.Model:
    """The model of bench_keras_step, so that both benches measure the same program."""
    from bench.bench_keras_step import _model

    return _model()


def _cnn() -> keras.Model:
    from tests.keras_util import small_cnn

    return small_cnn()


def _data(name: str) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    if name == "mlp":
        x = rng.standard_normal((STEPS, 32, 32)).astype("float32")
        y = rng.integers(0, 10, (STEPS, 32)).astype("int64")
    else:
        x = rng.standard_normal((STEPS, 16, 8, 8, 4)).astype("float32")
        y = rng.integers(0, 4, (STEPS, 16)).astype("int64")
    return x, y


def _compile(model: keras.Model) -> None:
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy",
                  metrics=["accuracy"], steps_per_execution=STEPS)


def _train_loop(model: keras.Model, strategy: Any = None) -> Callable[..., Any]:
    """The device loop of ``IPUStepFunction._lower`` for kind "train"."""

    def one_step(x: tf.Tensor, y: tf.Tensor, i: Any) -> Any:
        batch = (x[i], y[i])
        if strategy is None:
            return model.train_step(batch)
        return strategy.extended.call_for_each_replica(model.train_step, args=(batch,))

    def loop(n_steps: tf.Tensor, x: tf.Tensor, y: tf.Tensor) -> Any:
        out0 = one_step(x, y, 0)
        flat_logs = tf.nest.flatten(out0)

        def body(i: Any, *logs: Any) -> Any:
            return (i + 1, *tf.nest.flatten(one_step(x, y, i)))

        _, *final = tf.while_loop(
            lambda i, *_: tf.less(i, n_steps), body, (tf.constant(1), *flat_logs)
        )
        return tf.nest.pack_sequence_as(out0, final)

    if strategy is None:
        return loop

    def device_loop(n_steps: tf.Tensor, x: tf.Tensor, y: tf.Tensor) -> Any:
        with strategy.lowering():
            return loop(n_steps, x, y)

    return device_loop


class EmulatorCase:
    """One model's 32-step train program, compiled for the emulator, with its arguments."""

    def __init__(self, name: str) -> None:
        import tf_ipu
        from device_server.emulator import compile_module, get_target
        from tf_ipu.lowering.program import lower_function

        self.name = name
        build = _mlp if name == "mlp" else _cnn
        self.x, self.y = _data(name)
        strategy = tf_ipu.IPUStrategy()
        keras.utils.set_random_seed(0)
        with strategy.scope():
            model = build()
            _compile(model)
            model._symbolic_build(data_batch=(self.x[0], self.y[0]))
        specs = [tf.TensorSpec([], tf.int32), tf.TensorSpec(self.x.shape, tf.float32),
                 tf.TensorSpec(self.y.shape, tf.int64)]
        t0 = time.perf_counter()
        lowered = lower_function(_train_loop(model, strategy), specs,
                                 f"{name}/train_function[steps={STEPS}]")
        t1 = time.perf_counter()
        self.module = lowered.module
        self.exe = compile_module(lowered.module, get_target("ipu2"))
        t2 = time.perf_counter()
        self.lower_s, self.compile_s = t1 - t0, t2 - t1
        self.weights = model.get_weights()
        self.num_results = lowered.num_results
        args: list[np.ndarray] = [np.asarray(STEPS, np.int32), self.x, self.y]
        vars_iter = iter(lowered.variables)
        consts_iter = iter(lowered.constants)
        for kind in lowered.captured_kinds:
            t = next(vars_iter).read_value() if kind == "var" else next(consts_iter)
            args.append(np.asarray(t.numpy()))
        self.args = args
        self.initial = list(args)

    def first_results(self) -> list[np.ndarray]:
        """The loop's results (the last step's logs) from the initial state."""
        return self.exe.run(list(self.initial))[: self.num_results]

    def run(self) -> list[np.ndarray]:
        outs = self.exe.run(self.args)
        for o, p in self.exe.aliases.items():
            self.args[p] = outs[o]
        return outs


class TFCase:
    """The same 32-step loop in TF on CPU (no strategy), with or without XLA."""

    def __init__(self, name: str, weights: list[np.ndarray], jit: bool) -> None:
        build = _mlp if name == "mlp" else _cnn
        self.x, self.y = (tf.constant(a) for a in _data(name))
        keras.utils.set_random_seed(0)
        model = build()
        _compile(model)
        model._symbolic_build(data_batch=(self.x[0], self.y[0]))
        model.set_weights(weights)
        self.fn = tf.function(_train_loop(model), jit_compile=jit, autograph=False)
        self.n = tf.constant(STEPS, tf.int32)

    def run(self) -> Any:
        out = self.fn(self.n, self.x, self.y)
        float(tf.nest.flatten(out)[0])  # wait for the result
        return out


def _best(fn: Callable[[], Any], calls: int, rounds: int) -> float:
    time.sleep(0.05)  # let TF's thread pools stop spinning after the previous measurement
    fn()
    fn()
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t0) / calls)
    return best


def _agreement(emu: EmulatorCase, tf_xla: TFCase) -> float:
    """Largest relative difference of the logs of one 32-step call from the same state
    (run before any timing, so both start from the initial weights)."""
    got = emu.first_results()
    want = [np.asarray(t) for t in tf.nest.flatten(tf_xla.run())]
    worst = 0.0
    for g, w in zip(got, want, strict=True):
        g64, w64 = np.asarray(g, np.float64), np.asarray(w, np.float64)
        worst = max(worst, float(np.max(np.abs(g64 - w64) / np.maximum(np.abs(w64), 1e-6))))
    return worst


def bench_model(name: str, quick: bool) -> dict[str, float]:
    emu = EmulatorCase(name)
    tf_graph = TFCase(name, emu.weights, jit=False)
    tf_xla = TFCase(name, emu.weights, jit=True)
    agree = _agreement(emu, tf_xla)
    calls, rounds = (3, 3) if quick else (5, 5)
    t: dict[str, list[float]] = {"emu": [], "tf": [], "xla": []}
    for _ in range(2 if quick else 3):  # interleaved, so drift hits all three
        t["emu"].append(_best(emu.run, calls, rounds))
        t["tf"].append(_best(tf_graph.run, calls, rounds))
        t["xla"].append(_best(tf_xla.run, calls, rounds))
    e, g, x = min(t["emu"]), min(t["tf"]), min(t["xla"])
    print(
        f"{name} train loop of {STEPS} steps ({emu.exe.step_count} entry steps, "
        f"{emu.exe.instruction_count} live instrs; lower {emu.lower_s:.2f} s, compile "
        f"{emu.compile_s * 1e3:.0f} ms): emulator {e * 1e3:.2f} ms, TF graph {g * 1e3:.2f} ms, "
        f"TF XLA {x * 1e3:.2f} ms; emulator/TF {e / g:.2f}x, emulator/XLA {e / x:.2f}x; "
        f"logs vs XLA max rel diff {agree:.1e}"
    )
    return {"emulator_s": e, "tf_s": g, "xla_s": x, "max_rel_diff": agree}


def profile(name: str, calls: int = 20) -> None:
    import cProfile
    import pstats

    emu = EmulatorCase(name)
    emu.run()
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(calls):
        emu.run()
    pr.disable()
    pstats.Stats(pr).sort_stats("tottime").print_stats(30)


def main(quick: bool = False) -> None:
    for name in ("mlp", "cnn"):
        bench_model(name, quick)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--profile", choices=("mlp", "cnn"))
    parser.add_argument("--only", choices=("mlp", "cnn"))
    a = parser.parse_args()
    if a.profile:
        profile(a.profile)
    elif a.only:
        bench_model(a.only, a.quick)
    else:
        main(a.quick)
