"""``tensorflow.python.ipu.ipu_outfeed_queue``: values the device hands to the host.

    outfeed = ipu.ipu_outfeed_queue.IPUOutfeedQueue()
    def loop(iterator, n):                      # run by strategy.run on the device
        for _ in tf.range(n):
            ...; outfeed.enqueue(loss)          # -> custom-call tf_ipu_outfeed
    strategy.run(loop, args=[iterator, 100])
    losses = outfeed.dequeue()                  # on the host: [100] (mode ALL) or the last

``enqueue`` is for device functions (``strategy.run``); ``dequeue`` returns what every call
since the last dequeue enqueued, stacked (``IPUOutfeedMode.ALL``), or only the last enqueued
value (``LAST``), in the structure given to ``enqueue``, and empties the queue.
"""

from __future__ import annotations

import enum
import itertools
from typing import Any

import numpy as np
import tensorflow as tf

from tf_ipu import feeds

_names = itertools.count()


class IPUOutfeedMode(enum.Enum):
    """What ``dequeue`` returns: every enqueued value (ALL) or the last one (LAST)."""

    ALL = 1
    LAST = 2


class IPUOutfeedQueue:
    """A queue from the device to the host (see the module docstring). ``feed_name`` names
    it on the device server (one is made up if not given); Graphcore's other arguments
    (``device_ordinal``, ``buffer_depth``, ...) change nothing with one emulated IPU."""

    def __init__(self, outfeed_mode: IPUOutfeedMode | None = None, device_ordinal: int = 0,
                 buffer_depth: int = 3, feed_name: str | None = None, **kwargs: Any) -> None:
        self.outfeed_mode = outfeed_mode or IPUOutfeedMode.ALL
        if not isinstance(self.outfeed_mode, IPUOutfeedMode):
            raise ValueError(f"outfeed_mode must be an IPUOutfeedMode. Received: {outfeed_mode!r}")
        self.feed_name = feed_name or f"outfeed{next(_names)}"
        self._structure: Any = None
        self._specs: list[tf.TensorSpec] = []
        self.enqueued = False  # Graphcore's flag: an enqueue is in a device program

    def enqueue(self, tensors: Any) -> None:
        """Inside a device function: hands ``tensors`` (a tensor or a nest) to the host."""
        flat = [tf.convert_to_tensor(t) for t in tf.nest.flatten(tensors)]
        specs = [tf.TensorSpec(t.shape, t.dtype) for t in flat]
        if self._structure is not None and (
                specs != self._specs or not _same_structure(tensors, self._structure)):
            raise ValueError(
                f"IPUOutfeedQueue {self.feed_name!r} was given {self._specs} before and now "
                f"{specs}: a queue carries values of one structure, shapes and dtypes "
                f"(use another queue for these)."
            )
        self._structure = tensors
        self._specs = specs
        feeds.enqueue_outfeed(self.feed_name, flat)
        if not feeds.in_scratch_trace():  # a trace thrown away enqueues nothing
            self.enqueued = True

    def dequeue(self) -> Any:
        """On the host: what was enqueued since the last dequeue (see the module docstring)."""
        items = feeds.take(self.feed_name)
        if self._structure is None:
            return []
        if self.outfeed_mode is IPUOutfeedMode.LAST:
            last = next((values for count, values in reversed(items) if count), None)
            if last is None:
                return tf.nest.pack_sequence_as(
                    self._structure, [tf.zeros(s.shape, s.dtype) for s in self._specs])
            return tf.nest.pack_sequence_as(self._structure, [tf.constant(v[-1]) for v in last])
        leaves = []
        for k, spec in enumerate(self._specs):
            parts = [values[k] for count, values in items if count]
            stacked = (np.concatenate(parts) if parts
                       else np.zeros((0, *spec.shape), spec.dtype.as_numpy_dtype))
            leaves.append(tf.constant(stacked))
        return tf.nest.pack_sequence_as(self._structure, leaves)


def _same_structure(a: Any, b: Any) -> bool:
    try:
        tf.nest.assert_same_structure(a, b)
    except (TypeError, ValueError):
        return False
    return True


__all__ = ["IPUOutfeedMode", "IPUOutfeedQueue"]
