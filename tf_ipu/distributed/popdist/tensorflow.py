"""``popdist.tensorflow``: ``set_ipu_config(config, ipus_per_replica=None,
configure_device=True)`` configures an ``IPUConfig`` for this instance of the run.

    cfg = ipu.config.IPUConfig(); popdist.tensorflow.set_ipu_config(cfg, ipus_per_replica=1)
"""

from __future__ import annotations

from tf_ipu.distributed.popdist_api import set_ipu_config

__all__ = ["set_ipu_config"]
