"""``tensorflow.python.ipu.config``: the IPU system's configuration, as Graphcore names it.

    cfg = ipu.config.IPUConfig(); cfg.auto_select_ipus = 1; cfg.configure_ipu_system()

``IPUConfig`` is ``tf_ipu.IPUConfig`` itself (the same class: options set through either name
are the same options). ``configure_ipu_system(cfg)`` is the older function spelling of
``cfg.configure_ipu_system()``. ``DeviceConnectionType`` (``cfg.device_connection.type``):
ALWAYS, ON_DEMAND, PRE_COMPILE (compile and size, answer zeros), NEVER (compile and size only).
The enums of the other options (``SelectionOrder``, ``StochasticRoundingBehaviour``,
``MergeRemoteBuffersBehaviour``, ``SchedulingAlgorithm``) are ``tf_ipu.config``'s.
"""

from __future__ import annotations

from tf_ipu.config import (
    DeviceConnectionType,
    IPUConfig,
    MergeRemoteBuffersBehaviour,
    SchedulingAlgorithm,
    SelectionOrder,
    StochasticRoundingBehaviour,
)


def configure_ipu_system(config: IPUConfig, device: str = "cpu", reset_configuration: bool = True) -> None:
    """Configures the IPU system as ``config`` says (``device`` and ``reset_configuration``
    are Graphcore's arguments; here the system is always configured afresh)."""
    config.configure_ipu_system()


def running_on_ipu_model() -> bool:
    """Graphcore's test for its IPU Model (``--use_ipu_model`` in ``$TF_POPLAR_FLAGS``): here
    every IPU is emulated, so True."""
    return True


__all__ = ["DeviceConnectionType", "IPUConfig", "MergeRemoteBuffersBehaviour",
           "SchedulingAlgorithm", "SelectionOrder", "StochasticRoundingBehaviour",
           "configure_ipu_system", "running_on_ipu_model"]
