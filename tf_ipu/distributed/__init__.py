"""tf_ipu.distributed: many instances, each with its own device server, on Open MPI.

    tf-ipu-run --num-instances N --num-replicas R -- python train.py      (launcher.py)
        ├─ mpirun: the servers' job, N device servers (--mpi-world; rank.py --server)
        └─ mpirun: N ranks; rank k waits for server k, then runs train.py (rank.py)
    in train.py, instance k:
        identity     getInstanceIndex(), getNumInstances(), ... (popdist's names; identity.py)
        set_ipu_config(cfg)       cfg asks the instance's own server for its R/N replicas
        PopDistStrategy()         IPUStrategy + instance 0's initial values broadcast to all,
                                  host-side values (strategy.reduce, Keras logs) reduced
                                  over MPI (strategy.py)
        host_collective_ops       allreduce / broadcast / allgather of tensors (host, MPI)
                   ─────────── MPI (mpi4py buffer calls; mpi.py) ───────────
    instance j: the same

The same names are Graphcore's after ``import tf_ipu``: ``popdist``, ``popdist.tensorflow``
(``tf_ipu.distributed.popdist``; ``install_popdist()``),
``tensorflow.python.ipu.distributed`` (``PopDistStrategy``, ``popdist_strategy``,
``host_collective_ops``). Each instance runs its own replicas on its own server; one
replicated program spanning the instances (gradients all-reduced across them every step) is
not done yet: docs/architecture.md, "Many instances".

Importing this package imports neither TensorFlow nor MPI; the strategy and the collectives
of tensors load TensorFlow when first named.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import sys
from typing import Any

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
from tf_ipu.distributed.popdist_api import init, set_ipu_config


def install_popdist() -> bool:
    """Makes ``import popdist`` / ``import popdist.tensorflow`` find ``tf_ipu.distributed.popdist``
    unless a real popdist is installed (or another module is registered under that name);
    True if registered. Imports neither TensorFlow nor MPI."""
    from tf_ipu.distributed import popdist

    current = sys.modules.get("popdist")
    if current is popdist:
        return True
    if current is not None or importlib.machinery.PathFinder.find_spec("popdist") is not None:
        return False
    sys.modules["popdist"] = popdist
    sys.modules["popdist.tensorflow"] = popdist.tensorflow
    return True


def __getattr__(name: str) -> Any:
    """The TensorFlow-facing names, loaded on first use."""
    if name == "PopDistStrategy":
        return importlib.import_module("tf_ipu.distributed.strategy").PopDistStrategy
    if name in ("host_collective_ops", "strategy", "popdist_strategy"):
        return importlib.import_module(
            f"tf_ipu.distributed.{'strategy' if name == 'popdist_strategy' else name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["PopDistStrategy", "getInstanceIndex", "getLocalInstanceIndex", "getNumInstances",
           "getNumIpusPerReplica", "getNumLocalReplicas", "getNumTotalReplicas",
           "getReplicaIndexOffset", "host_collective_ops", "init", "install_popdist", "isPopdistEnvSet",
           "set_ipu_config"]
