"""Shared by the layers of ``ipu_tensorflow_addons.keras.layers``: Keras registration, the
once-per-process notice for Graphcore arguments that change nothing here, and seeds given in
Graphcore's two-integer form."""

from __future__ import annotations

from typing import Any, TypeVar

import keras
import numpy as np

from tf_ipu import notices

PACKAGE = "ipu_tensorflow_addons"
_T = TypeVar("_T", bound=type)


def register(cls: _T) -> _T:
    """Registers a layer class for Keras serialization as ``ipu_tensorflow_addons>Name``."""
    return keras.saving.register_keras_serializable(package=PACKAGE)(cls)


def no_effect(layer: str, argument: str, value: Any, default: Any, reason: str) -> None:
    """Warns once per process about ``layer(argument=...)`` if ``value`` is not ``default``:
    the argument is accepted, kept in the config, and changes nothing on the emulated IPU."""
    if _same(value, default):
        return
    notices.once(f"{PACKAGE}.keras.layers.{layer}({argument})",
                 f"has no effect on the emulated IPU: {reason} (received {argument}={value!r})")


def _same(value: Any, default: Any) -> bool:
    if value is default:
        return True
    try:
        return bool(value == default)
    except Exception:  # arrays, tensors: compare as given
        return False


def seed_pair(seed: Any, argument: str) -> list[int] | None:
    """Graphcore's seed, a pair of 32-bit integers (list, tuple, array or eager tensor), as a
    list of two Python ints; None stays None."""
    if seed is None:
        return None
    value = np.asarray(seed.numpy() if hasattr(seed, "numpy") else seed)
    if value.shape != (2,) or not np.issubdtype(value.dtype, np.integer):
        raise ValueError(f"Expected `{argument}` to be a pair of integers (shape [2]). "
                         f"Received: {argument}={seed!r}")
    return [int(v) for v in value]


def start_seed_generator(generator: keras.random.SeedGenerator, pair: list[int]) -> None:
    """Sets the state of a Keras ``SeedGenerator`` to Graphcore's seed pair ``[a, b]``: the
    masks it draws then depend on the pair alone (the same pair, the same masks)."""
    generator.state.assign(np.asarray(pair, dtype=generator.state.dtype))


def initializer(identifier: Any, seed: int | None) -> Any:
    """``keras.initializers.get(identifier)``, seeded with ``seed`` when it was given and the
    initializer takes a seed it does not have yet (Graphcore's RNN ``seed``)."""
    init = keras.initializers.get(identifier)
    if seed is None or init is None:
        return init
    config = init.get_config()
    if "seed" not in config or config["seed"] is not None:
        return init
    return type(init).from_config({**config, "seed": seed})


__all__ = ["PACKAGE", "initializer", "no_effect", "register", "seed_pair", "start_seed_generator"]
