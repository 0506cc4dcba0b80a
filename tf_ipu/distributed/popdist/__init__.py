"""``popdist`` (Graphcore's PopDist) after ``import tf_ipu``, unless the real one is installed.

    import popdist, popdist.tensorflow
    popdist.getInstanceIndex() ... (tf_ipu.distributed.identity)  popdist.init()
    popdist.tensorflow.set_ipu_config(cfg, ipus_per_replica=1)   (tf_ipu.distributed.popdist_api)

Outside ``tf-ipu-run`` the functions describe one instance: index 0 of 1. Imports neither
TensorFlow nor MPI (``tf_ipu.distributed.install_popdist()`` registers it as ``popdist``).
"""

from __future__ import annotations

from tf_ipu.distributed.identity import (
    getInstanceIndex,
    getLocalInstanceIndex,
    getNumInstances,
    getNumIpusPerReplica,
    getNumLocalReplicas,
    getNumTotalReplicas,
    getReplicaIndexOffset,
    isPopdistEnvSet,
)
from tf_ipu.distributed.popdist import tensorflow
from tf_ipu.distributed.popdist_api import init

__all__ = ["getInstanceIndex", "getLocalInstanceIndex", "getNumInstances", "getNumIpusPerReplica",
           "getNumLocalReplicas", "getNumTotalReplicas", "getReplicaIndexOffset", "init",
           "isPopdistEnvSet", "tensorflow"]
