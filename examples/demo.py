"""Demo: train a small Keras CNN on an emulated IPU and print the emulator's estimates.

Run with `make demo` (it sets everything up), or `python examples/demo.py` in the venv.
No server is configured, so configure_ipu_system() starts a local device server.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile
import time
from collections.abc import Iterator

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

# What TensorFlow's C++ start-up writes to stderr on a machine without a GPU, whatever
# TF_CPP_MIN_LOG_LEVEL says (absl logs before its logging is initialised).
_START_UP_NOISE = re.compile(
    r"WARNING: All log messages before absl::InitializeLog\(\)"
    r"|^[IWE]\d{4} .*(port\.cc|cudart_stub\.cc|cuda_platform\.cc|cpu_feature_guard\.cc)"
    r"|^To enable the following instructions:"
)


@contextlib.contextmanager
def quiet_start_up() -> Iterator[None]:
    """Holds back TensorFlow's start-up lines on stderr (file descriptor 2, where C++ logs
    go) while the body runs; every other line written meanwhile is passed on after it."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as held:
        os.dup2(held.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            held.seek(0)
            for line in held.read().decode(errors="replace").splitlines():
                if not _START_UP_NOISE.search(line):
                    print(line, file=sys.stderr)


with quiet_start_up():
    import keras
    import numpy as np

    import tf_ipu


def make_data(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Images of 16x16x3 whose class (of 4) is the quadrant holding a bright square."""
    rng = np.random.default_rng(seed)
    x = rng.normal(0.0, 0.3, (n, 16, 16, 3)).astype("float32")
    y = rng.integers(0, 4, n)
    for i, c in enumerate(y):
        r, q = divmod(int(c), 2)
        x[i, r * 8 + 2 : r * 8 + 6, q * 8 + 2 : q * 8 + 6, :] += 1.5
    return x, y.astype("int64")


def main() -> None:
    cfg = tf_ipu.IPUConfig()
    cfg.auto_select_ipus = 1
    cfg.ipu_model.version = os.environ.get("TF_IPU_DEMO_VERSION", "ipu2")
    with quiet_start_up():  # the first device enumeration logs too
        cfg.configure_ipu_system()

    quick = os.environ.get("TF_IPU_DEMO_QUICK") == "1"  # the test suite's shorter run
    x, y = make_data(256 if quick else 2048)
    x_test, y_test = make_data(64 if quick else 256, seed=1)
    strategy = tf_ipu.IPUStrategy()
    with strategy.scope():
        model = keras.Sequential(
            [
                keras.Input((16, 16, 3)),
                keras.layers.Conv2D(16, 3, padding="same", use_bias=False),
                keras.layers.BatchNormalization(),
                keras.layers.ReLU(),
                keras.layers.MaxPooling2D(2),
                keras.layers.Conv2D(32, 3, padding="same", groups=2, activation="relu"),
                keras.layers.GlobalAveragePooling2D(),
                keras.layers.Dense(4, activation="softmax"),
            ],
            name="demo_cnn",
        )
        model.compile(
            optimizer=keras.optimizers.Adam(3e-3),
            loss="sparse_categorical_crossentropy",
            metrics=["accuracy"],
            steps_per_execution=16,
        )
    t0 = time.time()
    model.fit(x, y, epochs=1 if quick else 3, batch_size=32, verbose=2)
    result = model.evaluate(x_test, y_test, batch_size=32, verbose=0, return_dict=True)
    print(f"\ntest loss {result['loss']:.4f}, accuracy {result['accuracy']:.3f} "
          f"({time.time() - t0:.1f} s wall on the emulator)")
    model.predict(x_test[:64], batch_size=32, verbose=0)

    print(f"\nEmulator estimates ({cfg.ipu_model.version}; tile model, see docs/tile_model.md):")
    for report in strategy.reports:
        print("  " + report.summary())
    train = [r for r in strategy.reports if "train_function" in r.name][0]
    steps = 16
    per_step = train.seconds / steps
    print(f"\nTraining: ~{per_step * 1e6:.1f} us per step of 32 images on the IPU "
          f"=> ~{32 / per_step:,.0f} images/s (estimate).")


if __name__ == "__main__":
    main()
