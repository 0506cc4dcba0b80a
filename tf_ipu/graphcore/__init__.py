"""Graphcore's module layout, mapped onto tf_ipu: ported code keeps its import lines.

    from tensorflow.python import ipu           -> this package (installed by ``import tf_ipu``)
      ipu.config.IPUConfig                      -> tf_ipu.IPUConfig
      ipu.ipu_strategy.IPUStrategy              -> tf_ipu.IPUStrategy
      ipu.utils.reset_ipu_seed(...)             -> seeds of this process (utils.py);
        ipu.utils.IPUConfig is ipu.config.IPUConfig (SDK 3 examples' spelling)
      ipu.ipu_infeed_queue / ipu_outfeed_queue  -> infeeds and outfeeds (tf_ipu.feeds)
      ipu.loops.repeat / while_loop             -> device loops over an infeed (loops.py)
      ipu.serving.export_keras / export_single_step -> SavedModels for serving (tf_ipu.serving)
      ipu.ops.pipelining_ops.PipelineSchedule   -> pipelining's names (tf_ipu.pipelining);
        also ipu.pipelining_ops, with recomputation_checkpoint
      ipu.ops.cross_replica_ops.cross_replica_sum -> all-reduces across replicas (also
        ipu.cross_replica_ops; cross_replica_mean, assume_equal_across_replicas)
    import keras; keras.ipu                     -> keras_ipu/ (also via ``from tensorflow import keras``)
    ipu.keras.PipelineStage (SDK 2's spelling)   -> keras_ipu/ too
    ipu_tensorflow_addons.keras.layers          -> addons/ (Graphcore's IPU Keras layers)
    ipu_tensorflow_addons.keras.optimizers      -> addons/ (Adam, LAMB, SGD IPU optimizers)
    ipu.distributed (PopDistStrategy, popdist_strategy, host_collective_ops), popdist,
      popdist.tensorflow                        -> distributed/, tf_ipu.distributed.popdist

``install()`` registers the package as ``tensorflow.python.ipu`` (and its modules under their
Graphcore names) in ``sys.modules`` and on the ``tensorflow.python`` package, unless Graphcore's
own TensorFlow is the one installed (it then has a real ``tensorflow.python.ipu``, left alone).
Only what these modules define is here: a name Graphcore has and this project does not yet is
an ``AttributeError``, never a placeholder.
"""

from __future__ import annotations

import importlib
import sys

from tf_ipu.graphcore import (
    addons,
    config,
    distributed,
    ipu_infeed_queue,
    ipu_outfeed_queue,
    ipu_strategy,
    keras_ipu,
    loops,
    ops,
    serving,
    utils,
)

#: ``ipu.keras`` (SDK 2's spelling, still in Graphcore's tutorials: ``ipu.keras.PipelineStage``)
#: is ``keras.ipu``.
keras = keras_ipu

#: ``ipu.pipelining_ops`` and ``ipu.cross_replica_ops`` (Graphcore's ``ipu`` package imports
#: them from ``ops`` by name).
pipelining_ops = ops.pipelining_ops
cross_replica_ops = ops.cross_replica_ops

#: Graphcore's module names under ``tensorflow.python.ipu``, and ours.
MODULES = {"config": config, "ipu_strategy": ipu_strategy, "utils": utils,
           "ipu_infeed_queue": ipu_infeed_queue, "ipu_outfeed_queue": ipu_outfeed_queue,
           "loops": loops, "serving": serving, "ops": ops,
           "ops.pipelining_ops": ops.pipelining_ops, "keras": keras_ipu,
           "cross_replica_ops": ops.cross_replica_ops,
           "ops.cross_replica_ops": ops.cross_replica_ops,
           "distributed": distributed, **distributed.MODULES}
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
    _install_keras_ipu()
    addons.install()  # ipu_tensorflow_addons -> tf_ipu.graphcore.addons
    distributed.install()  # popdist, popdist.tensorflow -> tf_ipu.distributed.popdist
    return True


def _install_keras_ipu() -> None:
    """``keras.ipu`` (and ``keras._tf_keras.keras.ipu``, what ``from tensorflow import keras``
    loads) -> ``keras_ipu``, unless the installed Keras has its own."""
    import keras

    if getattr(keras, "ipu", keras_ipu) is not keras_ipu:
        return
    parents = {"keras": keras}
    try:
        parents["keras._tf_keras.keras"] = importlib.import_module("keras._tf_keras.keras")
        # ``from tensorflow.keras import ipu`` (Graphcore's tech notes): TF loads that
        # namespace's __init__ once more as its own module "tensorflow.keras".
        parents["tensorflow.keras"] = importlib.import_module("tensorflow.keras")
    except ImportError:  # a Keras without TF's compatibility namespace
        pass
    for name, parent in parents.items():
        parent.ipu = keras_ipu
        sys.modules[f"{name}.ipu"] = keras_ipu
        sys.modules[f"{name}.ipu.layers"] = keras_ipu.layers
        sys.modules[f"{name}.ipu.optimizers"] = keras_ipu.optimizers
        sys.modules[f"{name}.ipu.optimizers.als_optimizer"] = keras_ipu.optimizers.als_optimizer


__all__ = ["MODULES", "PACKAGE", "addons", "config", "cross_replica_ops", "distributed", "install", "ipu_infeed_queue", "ipu_outfeed_queue",
           "keras",
           "ipu_strategy", "keras_ipu", "loops", "ops", "pipelining_ops", "serving", "utils"]
