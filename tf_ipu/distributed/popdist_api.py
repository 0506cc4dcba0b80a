"""popdist's set-up calls: ``init()`` and ``popdist.tensorflow.set_ipu_config``.

    cfg = IPUConfig()
    popdist.tensorflow.set_ipu_config(cfg, ipus_per_replica=1)
        cfg.auto_select_ipus = local replicas x IPUs per replica   (its own server's IPUs)
        cfg.experimental.multi_replica_distribution.process_count/index = N, k
    cfg.configure_ipu_system()   -> $TF_IPU_SERVER, the instance's server (tf-ipu-run)

A configuration made this way marks the program as one run of N instances: PopDistStrategy
then broadcasts and reduces across them. Imports neither TensorFlow nor MPI.
"""

from __future__ import annotations

import weakref
from typing import Any

from tf_ipu.distributed import identity

_last: list[Any] = []  # a weak reference to the config set_ipu_config made last


def init() -> None:
    """Joins the run's host network (MPI) when there is one; nothing outside a run.

    Raises:
        RuntimeError: MPI's ranks do not match the run's instances.
    """
    if identity.is_multi_instance():
        from tf_ipu.distributed import mpi

        mpi.comm()


def _mark(config: Any) -> None:
    """Sets Graphcore's ``multi_replica_distribution`` fields (what ``update_ipu_config``
    does); set directly: the option's note (kept, no effect) predates this module."""
    section = config.experimental.multi_replica_distribution
    object.__setattr__(section, "process_count", identity.getNumInstances())
    object.__setattr__(section, "process_index", identity.getInstanceIndex())
    section.__dict__.setdefault("_set_by_user", set()).update({"process_count", "process_index"})
    _last[:] = [weakref.ref(config)]


def last_configured() -> Any:
    """The configuration ``set_ipu_config`` (or ``update_ipu_config``) made last, if alive."""
    return _last[0]() if _last else None


def is_distributed(config: Any) -> bool:
    """Whether ``config`` was made for this run's instances (``set_ipu_config`` or
    ``PopDistStrategy.update_ipu_config``)."""
    if config is None:
        return False
    section = config.experimental.multi_replica_distribution
    return (section.process_count == identity.getNumInstances()
            and section.process_index == identity.getInstanceIndex())


def set_ipu_config(config: Any, ipus_per_replica: int | None = None,
                   configure_device: bool = True) -> Any:
    """Configures ``config`` for this instance of the run (popdist.tensorflow's call).

    Args:
        config: an ``IPUConfig``.
        ipus_per_replica: IPUs each replica spans; None: the run's
            (``POPDIST_NUM_IPUS_PER_REPLICA``, 1 outside a run).
        configure_device: also ask for this instance's IPUs (``auto_select_ipus`` = its
            local replicas x ``ipus_per_replica``); False leaves the device choice as it is.

    Returns:
        ``config``.

    Raises:
        ValueError: ``ipus_per_replica`` differs from the run's.
    """
    run_ipus = identity.getNumIpusPerReplica()
    if ipus_per_replica is None:
        ipus_per_replica = run_ipus
    if not isinstance(ipus_per_replica, int) or isinstance(ipus_per_replica, bool) \
            or ipus_per_replica < 1:
        raise ValueError(f"ipus_per_replica must be an int >= 1. Received: {ipus_per_replica!r}")
    if identity.isPopdistEnvSet() and ipus_per_replica != run_ipus:
        raise ValueError(
            f"set_ipu_config(ipus_per_replica={ipus_per_replica}) but the run was started "
            f"with --ipus-per-replica {run_ipus}: make them agree.")
    if configure_device:
        config.auto_select_ipus = identity.getNumLocalReplicas() * ipus_per_replica
    _mark(config)
    return config


__all__ = ["init", "is_distributed", "last_configured", "set_ipu_config"]
