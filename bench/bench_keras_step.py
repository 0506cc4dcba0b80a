"""Per-step wall time of a small MLP: IPUStrategy (emulated IPU) over plain TF on CPU.

Both sides train the same model with the same steps_per_execution (1 and 32), warm (the
first epoch, which compiles, is not timed), interleaved in one run so drift hits both.
Target (issue 2): ratio at most 1.5x at steps_per_execution=32.
"""

from __future__ import annotations

import time

import keras
import numpy as np

import tf_ipu


def _model() -> keras.Model:
    return keras.Sequential(
        [
            keras.Input((32,)),
            keras.layers.Dense(64, activation="relu"),
            keras.layers.Dense(64, activation="relu"),
            keras.layers.Dense(10, activation="softmax"),
        ]
    )


def _time_epochs(model: keras.Model, x: np.ndarray, y: np.ndarray, epochs: int) -> float:
    t0 = time.perf_counter()
    model.fit(x, y, batch_size=32, epochs=epochs, verbose=0, shuffle=False)
    return time.perf_counter() - t0


def main(quick: bool = False) -> None:
    cfg = tf_ipu.IPUConfig()
    cfg.configure_ipu_system()
    strategy = tf_ipu.IPUStrategy()
    steps = 64 if quick else 256
    rng = np.random.default_rng(0)
    x = rng.standard_normal((32 * steps, 32)).astype("float32")
    y = rng.integers(0, 10, 32 * steps)
    rounds = 2 if quick else 3
    for spe in (1, 32):
        keras.utils.set_random_seed(0)
        cpu = _model()
        cpu.compile(optimizer="adam", loss="sparse_categorical_crossentropy",
                    metrics=["accuracy"], steps_per_execution=spe)
        with strategy.scope():
            ipu = _model()
            ipu.compile(optimizer="adam", loss="sparse_categorical_crossentropy",
                        metrics=["accuracy"], steps_per_execution=spe)
        ipu.set_weights(cpu.get_weights())
        _time_epochs(cpu, x, y, 1)  # warm-up: traces / lowers and compiles
        _time_epochs(ipu, x, y, 1)
        t_cpu: list[float] = []
        t_ipu: list[float] = []
        for _ in range(rounds):
            t_cpu.append(_time_epochs(cpu, x, y, 1))
            t_ipu.append(_time_epochs(ipu, x, y, 1))
        c = min(t_cpu) / steps
        i = min(t_ipu) / steps
        print(
            f"mlp 32-64-64-10 batch 32, steps_per_execution={spe:>2}: "
            f"CPU {c * 1e3:.3f} ms/step, IPUStrategy {i * 1e3:.3f} ms/step, "
            f"ratio {i / c:.2f}x"
        )
