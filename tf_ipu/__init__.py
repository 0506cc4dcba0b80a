"""tf_ipu: develop, run and size TensorFlow/Keras models for Graphcore IPUs, emulated.

    user code (Keras fit/evaluate/predict, strategy.run; ONNX models: tf_ipu.onnx)
      tf_ipu         IPUConfig, IPUStrategy, Keras integration, lowering, client
      tf_ipu.onnx    ONNX models onto the same IR (imports no TensorFlow)
      tf_ipu_ops     the IpuExecute op that stands for the device in traced graphs
        ==gRPC==>    device_server: sessions, IPUs, executables, the IPU emulator

The package starts lazily: ``import tf_ipu`` imports no TensorFlow by itself. Its TensorFlow
set-up (the op library loaded and the process's device runtime registered as the handler of
IpuExecute kernels, so graphs and SavedModels holding device calls run here; Graphcore's
import paths, ``from tensorflow.python import ipu``, mapped onto ``tf_ipu.graphcore``) runs
at import when TensorFlow is already loaded, else as soon as it is (``tf_ipu._lazy_start``),
or at the first use of a TensorFlow-facing name (``tf_ipu.IPUStrategy``, ``IPUConfig``,
``estimate``, ...).
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import threading
from types import ModuleType
from typing import Any

from tf_ipu import errors
from tf_ipu._lazy_start import TensorFlowWatch

__version__ = "0.1.0"

#: Names of the TensorFlow-facing API and the module each comes from.
_LAZY_NAMES = {
    "IPUConfig": "tf_ipu.config",
    "IPUStrategy": "tf_ipu.strategy",
    "estimate": "tf_ipu.estimate",          # sizing without a server
    "estimate_sweep": "tf_ipu.estimate",
    "max_batch_size": "tf_ipu.estimate",     # the largest micro-batch that fits
    "TileModelError": "tf_ipu.estimate",     # what estimate raises when the tile model fails
    "suggest_pipeline": "tf_ipu.pipeline_split",  # a split for pipelining
    "get_runtime": "tf_ipu.runtime",
}

class _CallableModule(ModuleType):
    """A module that calls its function of the same name (``tf_ipu.estimate``)."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return getattr(self, self.__name__.rpartition(".")[2])(*args, **kwargs)


_state = {"done": False, "running": False}
_lock = threading.RLock()


def _set_up() -> None:
    """What importing tf_ipu did before it started lazily: the API's names, the IpuExecute
    handler, Graphcore's import paths. Idempotent; imports TensorFlow."""
    with _lock:
        if _state["done"] or _state["running"]:
            return
        _state["running"] = True
        try:
            _watch.remove()
            import tensorflow  # noqa: F401  (first, whole, before the modules that use it)

            here = sys.modules[__name__]
            for name, module in _LAZY_NAMES.items():
                setattr(here, name, getattr(importlib.import_module(module), name))
            # ``tf_ipu.estimate`` is the function, but a first ``import tf_ipu.estimate`` made
            # while TensorFlow was not loaded binds the module there after this runs: the
            # module is made callable as the function, so both spellings keep working.
            sys.modules["tf_ipu.estimate"].__class__ = _CallableModule
            here.get_runtime().ensure_handler()
            from tf_ipu import graphcore as _graphcore

            _graphcore.install()  # `from tensorflow.python import ipu` now finds this project
            from tf_ipu import keras_integration

            # Graphcore's Keras has the model methods (set_gradient_accumulation_options, ...)
            # on every model, built under a strategy or not.
            keras_integration.install()
            _state["done"] = True
        finally:
            _state["running"] = False


def sync_to_host() -> int:
    """Fetches every variable whose newest value is on the device into its host copy (fit
    does this at every epoch end and save); returns how many were fetched.

    Example:
        >>> model.fit(x, y, epochs=1)
        >>> tf_ipu.sync_to_host()  # doctest: +SKIP
    """
    from tf_ipu.runtime import get_runtime

    return get_runtime().sync_to_host()


def __getattr__(name: str) -> Any:
    """The TensorFlow-facing names (set up on first use), and submodules not imported yet
    (``tf_ipu.keras_integration`` after a bare ``import tf_ipu``, as before)."""
    if name in _LAZY_NAMES:
        _set_up()
        if name not in globals():  # asked for while the set-up runs (by a module it imports)
            return getattr(importlib.import_module(_LAZY_NAMES[name]), name)
        return globals()[name]
    if not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        module = importlib.import_module(f"{__name__}.{name}")
        return globals().get(name, module)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY_NAMES})


_watch = TensorFlowWatch(_set_up)
# ``import popdist`` (Graphcore's instance API) works right after ``import tf_ipu``, before
# TensorFlow, as Graphcore's scripts order it; this imports neither TensorFlow nor MPI.
from tf_ipu.distributed import install_popdist as _install_popdist  # noqa: E402

_install_popdist()
if "tensorflow" in sys.modules:
    _set_up()
else:
    _watch.install()

__all__ = ["IPUConfig", "IPUStrategy", "errors", "get_runtime", "sync_to_host", "__version__"]
