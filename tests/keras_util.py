"""Models and comparison helpers shared by the Keras end-to-end tests."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import keras
import numpy as np
import tensorflow as tf


@contextlib.contextmanager
def attached_ipus(cfg, count: int, recompute: bool = False) -> Iterator[None]:
    """The process's IPU system (``cfg``, the suite's IPUConfig) with ``count`` IPUs (and
    ``allow_recompute``) for the block; one IPU, no recomputation after it."""
    cfg.auto_select_ipus = count
    cfg.allow_recompute = recompute
    cfg.configure_ipu_system()
    try:
        yield
    finally:
        cfg.auto_select_ipus = 1
        cfg.allow_recompute = False
        cfg.configure_ipu_system()


def rel_l2(a: np.ndarray, b: np.ndarray) -> float:
    """Relative L2 distance of a from the reference b (0 when both are zero)."""
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    denom = np.linalg.norm(b)
    return float(np.linalg.norm(a - b) / (denom if denom > 0 else 1.0))


@contextlib.contextmanager
def float64_policy() -> Iterator[None]:
    """Layers made in the block compute and keep their variables in float64: ``floatx`` and
    the global dtype policy both float64, restored after. (``set_floatx`` alone is not
    enough: Keras caches the global policy, made from ``floatx``, when the first layer is
    built, and later layers follow the cached policy.)"""
    floatx, policy = keras.config.floatx(), keras.config.dtype_policy()
    keras.config.set_floatx("float64")
    keras.config.set_dtype_policy("float64")
    try:
        yield
    finally:
        keras.config.set_dtype_policy(policy)
        keras.config.set_floatx(floatx)


def float64_twin(build, model: keras.Model) -> keras.Model:
    """``build()`` made under :func:`float64_policy` with ``model``'s weights: a reference that
    rounds alike on every CPU (float32 references depend on the host's instruction set)."""
    with float64_policy():
        twin = build()
    assert all(w.dtype == "float64" for w in twin.weights if "float" in str(w.dtype)), twin.name
    twin.set_weights([np.asarray(w, np.float64) for w in model.get_weights()])
    return twin


def mlp(n_in: int = 16, n_out: int = 4, dropout: float = 0.0) -> keras.Model:
    return keras.Sequential(
        [
            keras.Input((n_in,)),
            keras.layers.Dense(32, activation="relu", name="dense_in"),
            keras.layers.Dropout(dropout),
            keras.layers.Dense(16, activation="tanh", name="dense_mid"),
            keras.layers.Dense(n_out, activation="softmax", name="dense_out"),
        ],
        name="mlp",
    )


def small_cnn(n_out: int = 4) -> keras.Model:
    """Grouped conv without bias before BatchNorm, pooling, depthwise conv, dense head."""
    return keras.Sequential(
        [
            keras.Input((8, 8, 4)),
            keras.layers.Conv2D(8, 3, padding="same", groups=2, use_bias=False, name="gconv"),
            keras.layers.BatchNormalization(name="bn"),
            keras.layers.ReLU(),
            keras.layers.MaxPooling2D(2, name="maxpool"),
            keras.layers.DepthwiseConv2D(3, padding="same", name="dwconv"),
            keras.layers.AveragePooling2D(2, name="avgpool"),
            keras.layers.Conv2D(8, 1, activation="relu", name="pwconv"),
            keras.layers.GlobalAveragePooling2D(),
            keras.layers.Dense(n_out, activation="softmax", name="head"),
        ],
        name="small_cnn",
    )


def classification_data(
    n: int, shape: tuple[int, ...], n_classes: int = 4, seed: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """A learnable synthetic task: the class is the argmax of fixed random projections."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, *shape)).astype("float32")
    w = rng.standard_normal((int(np.prod(shape)), n_classes)).astype("float32")
    y = np.argmax(x.reshape(n, -1) @ w, axis=1).astype("int64")
    return x, y


class Stall(keras.layers.Layer):
    """Identity; in training, from its call number ``stall_at`` on, it spins in a ``while``
    that never ends (a step that never completes). Its non-trainable ``calls`` counts calls."""

    def __init__(self, stall_at: int, **kwargs) -> None:
        super().__init__(**kwargs)
        self.stall_at = stall_at

    def build(self, shape) -> None:
        self.calls = self.add_weight(shape=(), dtype="int32", initializer="zeros",
                                     trainable=False, name="calls")

    def call(self, x, training=False):
        import tensorflow as tf

        if not training:
            return x
        c = tf.identity(self.calls.value)  # read before the increment
        self.calls.assign_add(1)
        j = tf.while_loop(lambda j: tf.logical_or(j < 5, c >= self.stall_at),
                          lambda j: j + 1, [tf.constant(0)])[0]
        return x + tf.cast(j - 5, x.dtype)  # + 0 once the loop has ended


def stall_model(stall_at: int) -> keras.Model:
    """Dense -> Stall -> Dense, seeded: the same weights every time it is built."""
    keras.utils.set_random_seed(1)
    inp = keras.Input((8,))
    h = keras.layers.Dense(16, activation="relu", name="dense_in")(inp)
    h = Stall(stall_at, name="stall")(h)
    return keras.Model(inp, keras.layers.Dense(1, name="dense_out")(h), name="stall_model")


def imdb_like_dataset(seed: int, max_features: int, batch: int, maxlen: int) -> tf.data.Dataset:
    """Generated stand-in for the IMDB reviews Graphcore's embedding examples download: 8
    batches of padded token-id sequences with 0/1 labels (int32), repeated."""
    from tensorflow.keras.preprocessing import sequence

    rng = np.random.default_rng(seed)
    reviews = [list(rng.integers(1, max_features, rng.integers(3, 2 * maxlen)))
               for _ in range(8 * batch)]
    x = sequence.pad_sequences(reviews, maxlen=maxlen)
    y = rng.integers(0, 2, len(reviews))
    ds = tf.data.Dataset.from_tensor_slices((x, y)).repeat()
    ds = ds.map(lambda x, y: (x, tf.cast(y, tf.int32)))
    return ds.batch(batch, drop_remainder=True)
