"""``tensorflow.python.ipu.utils``: helpers ported code calls.

- ``move_variable_initialization_to_cpu()``: variables of this project are always created and
  initialized on the host (their newest values move to the device with the first call), so
  there is nothing to move; it returns at once.
- ``IPUConfig``, ``DeviceConnectionType`` and ``configure_ipu_system(cfg)``: ``ipu.config``'s
  (the same class, enum and function), which ported code still reaches through ``ipu.utils``
  (``cfg = ipu.utils.IPUConfig()`` in Graphcore's SDK 3 examples).
- ``reset_ipu_seed(seed)``: seeds the random numbers of this process (Python's, numpy's,
  TensorFlow's and Keras's global seed), so that a model built after it draws the same
  weights and the same dropout masks as any other built after the same call.
"""

from __future__ import annotations

from typing import Any

from tf_ipu.config import DeviceConnectionType, IPUConfig
from tf_ipu.graphcore.config import configure_ipu_system


def move_variable_initialization_to_cpu(graph: Any = None) -> None:
    """Nothing to do: variables are initialized on the host here (see the module docstring)."""


def reset_ipu_seed(seed: int, device: str = "/device:IPU:0", cpu_seed: int | None = None,
                   experimental_identical_replicas: bool = False) -> None:
    """Seeds this process's random numbers with ``seed`` (``cpu_seed`` if given); the other
    arguments are Graphcore's and change nothing with one emulated IPU."""
    import keras

    keras.utils.set_random_seed(int(seed if cpu_seed is None else cpu_seed))


__all__ = ["DeviceConnectionType", "IPUConfig", "configure_ipu_system", "move_variable_initialization_to_cpu",
           "reset_ipu_seed"]
