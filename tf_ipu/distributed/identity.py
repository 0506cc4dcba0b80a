"""Who this instance is in a ``tf-ipu-run`` (popdist's names), read from the environment.

    tf-ipu-run --num-instances 2 --num-replicas 4 -- python train.py
      launcher  sets  POPDIST_NUM_TOTAL_REPLICAS=4  POPDIST_NUM_IPUS_PER_REPLICA=1
                      POPDIST_NUM_LOCAL_REPLICAS=2  POPDIST_UNIFORM_REPLICAS_PER_INSTANCE=1
      rank k    adds  POPDIST_REPLICA_INDEX_OFFSET=2k  POPDIST_LOCAL_INSTANCE_INDEX=<on its host>
                      TF_IPU_SERVER=127.0.0.1:<its own device server>
      program   reads getInstanceIndex() = offset / local replicas = k,
                      getNumInstances() = total / local = 2

These are the variables Graphcore's poprun passes to each instance (its own launcher log
shows them), so a program reads the same numbers under either launcher. Outside a run they
describe one instance: index 0 of 1, one replica of one IPU. Imports neither TensorFlow nor
MPI.
"""

from __future__ import annotations

import os

TOTAL_REPLICAS = "POPDIST_NUM_TOTAL_REPLICAS"
IPUS_PER_REPLICA = "POPDIST_NUM_IPUS_PER_REPLICA"
LOCAL_REPLICAS = "POPDIST_NUM_LOCAL_REPLICAS"
UNIFORM = "POPDIST_UNIFORM_REPLICAS_PER_INSTANCE"
REPLICA_INDEX_OFFSET = "POPDIST_REPLICA_INDEX_OFFSET"
LOCAL_INSTANCE_INDEX = "POPDIST_LOCAL_INSTANCE_INDEX"
#: What the launcher sets for the whole run; each rank adds the per-instance ones.
RUN_VARIABLES = (TOTAL_REPLICAS, IPUS_PER_REPLICA, LOCAL_REPLICAS, UNIFORM)
INSTANCE_VARIABLES = (REPLICA_INDEX_OFFSET, LOCAL_INSTANCE_INDEX)


def _int(name: str, default: int) -> int:
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"${name} must be an integer. Received: {text!r}") from None
    if value < 0:
        raise ValueError(f"${name} must be >= 0. Received: {value}")
    return value


def isPopdistEnvSet() -> bool:  # noqa: N802  (popdist's name)
    """Whether this process was started by a launcher that describes its instance
    (``tf-ipu-run`` or Graphcore's ``poprun``)."""
    return all(os.environ.get(name, "").strip() for name in (TOTAL_REPLICAS, LOCAL_REPLICAS))


def getNumTotalReplicas() -> int:  # noqa: N802
    """Replicas of the whole run (all instances); 1 outside a run."""
    return max(1, _int(TOTAL_REPLICAS, 1))


def getNumLocalReplicas() -> int:  # noqa: N802
    """Replicas this instance runs; 1 outside a run."""
    return max(1, _int(LOCAL_REPLICAS, 1))


def getNumIpusPerReplica() -> int:  # noqa: N802
    """IPUs each replica spans; 1 outside a run."""
    return max(1, _int(IPUS_PER_REPLICA, 1))


def getReplicaIndexOffset() -> int:  # noqa: N802
    """Index (in the whole run) of this instance's first replica; 0 outside a run."""
    return _int(REPLICA_INDEX_OFFSET, 0)


def getNumInstances() -> int:  # noqa: N802
    """Instances of the run (total replicas / local replicas: every instance runs as many);
    1 outside a run."""
    total, local = getNumTotalReplicas(), getNumLocalReplicas()
    if total % local:
        raise ValueError(
            f"${TOTAL_REPLICAS}={total} is not a multiple of ${LOCAL_REPLICAS}={local}: "
            f"instances must run the same number of replicas each.")
    return total // local


def getInstanceIndex() -> int:  # noqa: N802
    """This instance's index, 0 .. getNumInstances() - 1 (replica offset / local replicas);
    0 outside a run."""
    offset, local = getReplicaIndexOffset(), getNumLocalReplicas()
    if offset % local:
        raise ValueError(
            f"${REPLICA_INDEX_OFFSET}={offset} is not a multiple of ${LOCAL_REPLICAS}={local}.")
    return offset // local


def getLocalInstanceIndex() -> int:  # noqa: N802
    """This instance's index among the instances on its host; 0 outside a run."""
    return _int(LOCAL_INSTANCE_INDEX, 0)


def is_multi_instance() -> bool:
    """Whether this process is one of several instances of a run."""
    return isPopdistEnvSet() and getNumInstances() > 1


def instance_environment(rank: int, local_rank: int) -> dict[str, str]:
    """The per-instance variables of MPI rank ``rank`` (``local_rank`` on its host), given
    the run's variables in this environment."""
    return {REPLICA_INDEX_OFFSET: str(rank * getNumLocalReplicas()),
            LOCAL_INSTANCE_INDEX: str(local_rank)}


__all__ = ["getInstanceIndex", "getLocalInstanceIndex", "getNumInstances", "getNumIpusPerReplica",
           "getNumLocalReplicas", "getNumTotalReplicas", "getReplicaIndexOffset",
           "instance_environment", "isPopdistEnvSet", "is_multi_instance"]
