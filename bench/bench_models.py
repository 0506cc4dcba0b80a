"""Real models at full size: the emulator's ``Executable.run`` vs XLA on CPU, same function.

- ResNet50 (``keras.applications``, weights=None) inference, batch 8, 224x224;
- a ResNet50 training step (``model.train_step``: SGD with momentum, sparse categorical
  cross-entropy), batch 4, 224x224;
- BERT-base encoder (``tf_ipu.models.bert_encoder()``: 12 layers, hidden 768, 12 heads)
  inference, batch 4, sequence 128.

Each function is lowered once with the project's path (``tf_ipu.lowering.program
.lower_function``: ``tf.function(jit_compile=True)`` -> HLO -> IR), compiled with
``device_server.emulator.compile_module`` for ipu2 and run with ``Executable.run`` on the
host values of its arguments, variables and constants (always the same values: timing only).
Side by side, the same ``tf.function(jit_compile=True)`` runs on CPU (the training step
updates the model's variables each call; its cost does not depend on their values). Both
are warmed up (XLA compiles on its first call), their first results are compared (relative
L2 norm), then calls alternate between the two sides and the best of a few is kept.
Printed per model: times, ratio emulator/XLA (target: at most 2x), and the one-off costs
(lowering, XLA's first call, the emulator's compilation). After the three targets, an LSTM
training step (two layers of 256, 100 steps, batch 32) is measured the same way, without a
target: its while loops run one step at a time.

numpy's OpenBLAS threads spin-wait; on a loaded 2-core machine they slow everything down,
and the device server caps them to one thread per process there. Measure like the server
runs: ``OPENBLAS_NUM_THREADS=1`` (printed in the header); the emulator then uses its own
threads (``emulator/parallel.py``, one per CPU unless ``TF_IPU_EMULATOR_THREADS`` says
otherwise) for big convolutions, products and fused element-wise chains. XLA keeps TensorFlow's thread pool
(one thread per CPU); ``TF_NUM_INTRAOP_THREADS=1`` gives it one thread too, for a comparison
at equal resources. ``TF_IPU_EMULATOR_JIT=0`` runs fused chains as numpy calls instead of
compiled loops (``emulator/jit.py``), to see what the loops gain.

    OPENBLAS_NUM_THREADS=1 .venv/bin/python bench/run.py --only models [--quick]
    OPENBLAS_NUM_THREADS=1 .venv/bin/python bench/bench_models.py [--quick] [--only NAME ...]

``--quick``: best of 2 instead of 3.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402


def _resnet50_inference() -> tuple[Callable[..., Any], list[Any]]:
    import keras
    import tensorflow as tf

    keras.utils.set_random_seed(0)
    model = keras.applications.ResNet50(weights=None)
    x = tf.constant(np.random.default_rng(0).standard_normal((8, 224, 224, 3)).astype(np.float32))
    return (lambda x: model(x, training=False)), [x]


def _resnet50_train_step() -> tuple[Callable[..., Any], list[Any]]:
    import keras
    import tensorflow as tf

    keras.utils.set_random_seed(0)
    model = keras.applications.ResNet50(weights=None)
    optimizer = keras.optimizers.SGD(1e-3, momentum=0.9)
    model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy())
    optimizer.build(model.trainable_variables)
    rng = np.random.default_rng(0)
    x = tf.constant(rng.standard_normal((4, 224, 224, 3)).astype(np.float32))
    y = tf.constant(rng.integers(0, 1000, 4).astype(np.int32))
    return (lambda x, y: model.train_step((x, y))), [x, y]


def _bert_base_inference() -> tuple[Callable[..., Any], list[Any]]:
    import keras
    import tensorflow as tf

    from tf_ipu.models import bert_encoder

    keras.utils.set_random_seed(0)
    model = bert_encoder()
    ids = tf.constant(np.random.default_rng(0).integers(0, 30522, (4, 128)).astype(np.int32))
    return (lambda ids: model(ids, training=False)), [ids]


def _lstm_train_step() -> tuple[Callable[..., Any], list[Any]]:
    import keras
    import tensorflow as tf

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((100, 64)), keras.layers.LSTM(256, return_sequences=True),
                              keras.layers.LSTM(256), keras.layers.Dense(10)])
    optimizer = keras.optimizers.SGD(1e-3, momentum=0.9)
    model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    optimizer.build(model.trainable_variables)
    rng = np.random.default_rng(0)
    x = tf.constant(rng.standard_normal((32, 100, 64)).astype(np.float32))
    y = tf.constant(rng.integers(0, 10, 32).astype(np.int32))
    return (lambda x, y: model.train_step((x, y))), [x, y]


MODELS: dict[str, tuple[str, Callable[[], tuple[Callable[..., Any], list[Any]]]]] = {
    "resnet50_inference": ("ResNet50 inference, batch 8, 224x224", _resnet50_inference),
    "resnet50_train_step": ("ResNet50 training step, batch 4, 224x224", _resnet50_train_step),
    "bert_base_inference": ("BERT-base inference, batch 4, seq 128", _bert_base_inference),
}
# Measured too, without a target: a recurrent model (while loops run step by step).
EXTRA: dict[str, tuple[str, Callable[[], tuple[Callable[..., Any], list[Any]]]]] = {
    "lstm_train_step": ("LSTM training step, 2x256, T=100, batch 32", _lstm_train_step),
}


def _rel(a: np.ndarray, e: np.ndarray) -> float:
    a = np.asarray(a, np.float64)
    e = np.asarray(e, np.float64)
    n = float(np.linalg.norm(e))
    return float(np.linalg.norm(a - e)) / n if n else float(np.linalg.norm(a))


def bench_model(name: str, quick: bool) -> float:
    """Prints one model's line; returns the ratio emulator/XLA."""
    import tensorflow as tf

    from device_server.emulator import CompileOptions, compile_module, get_target
    from tf_ipu.lowering.program import lower_function

    title, make = {**MODELS, **EXTRA}[name]
    fn, args = make()
    t0 = time.perf_counter()
    lowered = lower_function(fn, [tf.TensorSpec(a.shape, a.dtype) for a in args], name)
    lower_s = time.perf_counter() - t0
    assert lowered.module is not None
    params = [np.asarray(a.numpy(), order="C") for a in args]
    variables, constants = iter(lowered.variables), iter(lowered.constants)
    for kind in lowered.captured_kinds:
        value = next(variables).read_value() if kind == "var" else next(constants)
        params.append(np.asarray(value.numpy(), order="C"))
    t0 = time.perf_counter()
    exe = compile_module(lowered.module, get_target("ipu2"), CompileOptions(allow_out_of_memory=True))
    compile_s = time.perf_counter() - t0

    xla = tf.function(fn, jit_compile=True, autograph=False)

    def run_xla() -> list[np.ndarray]:
        return [t.numpy() for t in tf.nest.flatten(xla(*args))]

    def run_emu() -> list[np.ndarray]:
        return exe.run(params)

    got = run_emu()  # before XLA's first call: a training step updates the variables
    t0 = time.perf_counter()
    ref = run_xla()
    first_xla_s = time.perf_counter() - t0
    err = max(_rel(g, r) for g, r in zip(got[: len(ref)], ref, strict=True))
    t_emu, t_xla = [], []
    for _ in range(2 if quick else 3):
        for times, run in ((t_emu, run_emu), (t_xla, run_xla)):
            t0 = time.perf_counter()
            run()
            times.append(time.perf_counter() - t0)
    ratio = min(t_emu) / min(t_xla)
    print(f"  {title:42} emulator {min(t_emu) * 1e3:8.1f} ms   XLA {min(t_xla) * 1e3:8.1f} ms   "
          f"ratio {ratio:5.2f}x   (results rel. L2 {err:.1e})")
    print(f"  {'':42} one-off: lowering {lower_s:.1f} s, XLA first call {first_xla_s:.1f} s, "
          f"emulator compile {compile_s:.1f} s")
    return ratio


def main(quick: bool = False, only: list[str] | None = None) -> None:
    import tensorflow as tf

    threads = (os.environ.get("TF_NUM_INTRAOP_THREADS") or tf.config.threading.get_intra_op_parallelism_threads()
               or "one per CPU")
    from device_server.emulator import jit, parallel

    print(f"  {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}; emulator: "
          f"OPENBLAS_NUM_THREADS={os.environ.get('OPENBLAS_NUM_THREADS', 'unset')}, "
          f"{parallel.threads()} threads, compiled loops {'on' if jit.enabled() else 'off'}; "
          f"XLA: TF intra-op threads {threads}")
    targets = [name for name in only or MODELS if name in MODELS]
    ratios = [bench_model(name, quick) for name in targets]
    if ratios:
        print(f"  geometric mean ratio: {float(np.exp(np.mean(np.log(ratios)))):.2f}x (target: at most 2x)")
    for name in [n for n in only or EXTRA if n in EXTRA]:
        bench_model(name, quick)


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--only", nargs="*", choices=sorted({**MODELS, **EXTRA}))
    a = parser.parse_args()
    main(a.quick, a.only)
