"""``tensorflow.python.ipu.distributed.popdist_strategy``: ``PopDistStrategy`` is
``tf_ipu.distributed.PopDistStrategy``.

    strategy = popdist_strategy.PopDistStrategy()   # under tf-ipu-run: one of N instances
"""

from __future__ import annotations

from tf_ipu.distributed.strategy import PopDistStrategy

__all__ = ["PopDistStrategy"]
