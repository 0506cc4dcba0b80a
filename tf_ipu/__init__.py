"""tf_ipu: develop, run and size TensorFlow/Keras models for Graphcore IPUs, emulated.

    user code (Keras fit/evaluate/predict, strategy.run)
      tf_ipu         IPUConfig, IPUStrategy, Keras integration, lowering, client
      tf_ipu_ops     the IpuExecute op that stands for the device in traced graphs
        ==gRPC==>    device_server: sessions, IPUs, executables, the IPU emulator

Importing tf_ipu loads the op library and registers the process's device runtime as the
handler of IpuExecute kernels, so graphs and SavedModels holding device calls run here. It
also maps Graphcore's import paths (``from tensorflow.python import ipu``) onto this project
(``tf_ipu.graphcore``), so ported code keeps its import lines.
"""

from tf_ipu import errors
from tf_ipu.config import IPUConfig
from tf_ipu.estimate import estimate, estimate_sweep  # noqa: F401  (sizing without a server)
from tf_ipu.pipeline_split import suggest_pipeline  # noqa: F401  (a split for pipelining)
from tf_ipu.runtime import get_runtime
from tf_ipu.strategy import IPUStrategy

__version__ = "0.1.0"


def sync_to_host() -> int:
    """Fetches every variable whose newest value is on the device into its host copy (fit
    does this at every epoch end and save); returns how many were fetched.

    Example:
        >>> model.fit(x, y, epochs=1)
        >>> tf_ipu.sync_to_host()  # doctest: +SKIP
    """
    return get_runtime().sync_to_host()


get_runtime().ensure_handler()

from tf_ipu import graphcore as _graphcore  # noqa: E402  (after the runtime: it imports TF)

_graphcore.install()  # `from tensorflow.python import ipu` now finds this project

__all__ = ["IPUConfig", "IPUStrategy", "errors", "get_runtime", "sync_to_host", "__version__"]
