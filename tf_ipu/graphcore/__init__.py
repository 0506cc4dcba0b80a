"""Graphcore's module layout, mapped onto tf_ipu: ported code keeps its import lines.

    from tensorflow.python import ipu           -> this package (installed by ``import tf_ipu``)
      ipu.config.IPUConfig                      -> tf_ipu.IPUConfig
      ipu.ipu_strategy.IPUStrategy              -> tf_ipu.IPUStrategy
      ipu.utils.reset_ipu_seed(...)             -> seeds of this process (utils.py)
      ipu.ipu_infeed_queue / ipu_outfeed_queue  -> infeeds and outfeeds (tf_ipu.feeds)

``install()`` registers the package as ``tensorflow.python.ipu`` (and its modules under their
Graphcore names) in ``sys.modules`` and on the ``tensorflow.python`` package, unless Graphcore's
own TensorFlow is the one installed (it then has a real ``tensorflow.python.ipu``, left alone).
Only what these modules define is here: a name Graphcore has and this project does not yet is
an ``AttributeError``, never a placeholder.
"""

from __future__ import annotations

import importlib
import sys

from tf_ipu.graphcore import config, ipu_infeed_queue, ipu_outfeed_queue, ipu_strategy, utils

#: Graphcore's module names under ``tensorflow.python.ipu``, and ours.
MODULES = {"config": config, "ipu_strategy": ipu_strategy, "utils": utils,
           "ipu_infeed_queue": ipu_infeed_queue, "ipu_outfeed_queue": ipu_outfeed_queue}
PACKAGE = "tensorflow.python.ipu"


def install() -> bool:
    """Makes ``tensorflow.python.ipu`` resolve to this package; False if another
    ``tensorflow.python.ipu`` (Graphcore's own wheel) is there already."""
    tf_python = importlib.import_module("tensorflow.python")
    here = sys.modules[__name__]
    current = sys.modules.get(PACKAGE) or getattr(tf_python, "ipu", None)
    if current is not None and current is not here:
        return False
    sys.modules[PACKAGE] = here
    for name, module in MODULES.items():
        sys.modules[f"{PACKAGE}.{name}"] = module
    tf_python.ipu = here
    return True


__all__ = ["MODULES", "PACKAGE", "config", "install", "ipu_infeed_queue", "ipu_outfeed_queue",
           "ipu_strategy", "utils"]
