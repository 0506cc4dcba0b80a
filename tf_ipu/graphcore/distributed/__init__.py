"""``tensorflow.python.ipu.distributed``: Graphcore's multi-instance names, on tf_ipu.

    ipu.distributed.PopDistStrategy              -> tf_ipu.distributed.PopDistStrategy
    ipu.distributed.popdist_strategy.PopDistStrategy   (the same class)
    ipu.distributed.host_collective_ops          -> allreduce / broadcast / allgather over MPI
    import popdist; import popdist.tensorflow    -> tf_ipu.distributed.popdist (unless
                                                    Graphcore's popdist is installed)

``install()`` registers these in ``sys.modules``; the graphcore package calls it.
"""

from __future__ import annotations

from typing import Any

from tf_ipu.distributed import install_popdist
from tf_ipu.distributed.strategy import PopDistStrategy
from tf_ipu.graphcore.distributed import host_collective_ops, popdist_strategy

#: Module names under ``tensorflow.python.ipu``.
MODULES = {"distributed.popdist_strategy": popdist_strategy,
           "distributed.host_collective_ops": host_collective_ops}


def install() -> None:
    """popdist's modules, and under a multi-instance run a warning at configure time for a
    configuration not made with ``set_ipu_config`` (the instances then run independently)."""
    install_popdist()
    from tf_ipu.distributed import identity

    if not identity.is_multi_instance():
        return
    from tf_ipu.config import IPUConfig

    configure = IPUConfig.configure_ipu_system
    if getattr(configure, "_tf_ipu_popdist_check", False):
        return

    def configure_ipu_system(self: Any) -> None:
        from tf_ipu.distributed import popdist_api, strategy

        if not popdist_api.is_distributed(self):
            strategy.warn_independent("IPUConfig.configure_ipu_system")
        configure(self)

    configure_ipu_system.__doc__ = configure.__doc__
    configure_ipu_system._tf_ipu_popdist_check = True  # type: ignore[attr-defined]
    IPUConfig.configure_ipu_system = configure_ipu_system


__all__ = ["MODULES", "PopDistStrategy", "host_collective_ops", "install", "install_popdist",
           "popdist_strategy"]
