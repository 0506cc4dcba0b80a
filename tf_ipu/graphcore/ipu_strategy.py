"""``tensorflow.python.ipu.ipu_strategy``: the strategy whose replica runs on the IPU.

    strategy = ipu.ipu_strategy.IPUStrategy()
    with strategy.scope(): model = ...; model.fit(...)

``IPUStrategy`` (and Graphcore's ``IPUStrategyV1``) is ``tf_ipu.IPUStrategy``.
"""

from __future__ import annotations

from tf_ipu.strategy import IPUStrategy

IPUStrategyV1 = IPUStrategy

__all__ = ["IPUStrategy", "IPUStrategyV1"]
