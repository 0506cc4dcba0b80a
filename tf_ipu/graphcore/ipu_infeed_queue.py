"""``tensorflow.python.ipu.ipu_infeed_queue``: a dataset the device pulls from.

    infeed = ipu.ipu_infeed_queue.IPUInfeedQueue(dataset)
    strategy.run(loop, args=[infeed, 100])      # in loop: x, y = next(infeed)

Passed to ``strategy.run`` (or reached through the device function's closure, as
``loops.repeat(n, body, infeed_queue=infeed)`` does), the queue becomes an infeed of the device: each ``next`` inside the device function takes the next element, which the host
pushes while the call runs (``tf_ipu.feeds``). One host iterator over the dataset serves
every call, so successive calls go on where the last one stopped.
"""

from __future__ import annotations

import itertools
from typing import Any

import tensorflow as tf

from tf_ipu import feeds

_names = itertools.count()


class IPUInfeedQueue:
    """An infeed over ``dataset`` (elements of static shapes: batch with
    ``drop_remainder=True``). Graphcore's other arguments change nothing here."""

    def __init__(self, dataset: tf.data.Dataset, device_ordinal: int = 0,
                 prefetch_depth: int | None = None, **kwargs: Any) -> None:
        if not isinstance(dataset, tf.data.Dataset):
            raise TypeError(f"IPUInfeedQueue takes a tf.data.Dataset. Received: "
                            f"{type(dataset).__name__}")
        self._dataset = dataset
        self._iterator: Any = None
        self._feed = f"queue:infeed{next(_names)}"
        self.dequeued = False

    def _tf_ipu_host_iterator(self) -> Any:
        if self._iterator is None:
            self._iterator = iter(self._dataset)
        return self._iterator

    @property
    def element_spec(self) -> Any:
        return self._dataset.element_spec

    def __iter__(self) -> IPUInfeedQueue:
        return self

    def __next__(self) -> Any:
        element = feeds.next_while_lowering(self, self._feed, self.element_spec)
        if element is not None:  # inside a device function: the device pulls it
            self.dequeued = True
            return element
        return next(self._tf_ipu_host_iterator())

    def _dequeue(self) -> Any:
        """Graphcore's name for taking the next element inside a device loop."""
        return next(self)

    @property
    def number_of_tuple_elements(self) -> int:
        """How many tensors an element has (Graphcore's attribute)."""
        return len(tf.nest.flatten(self.element_spec))

    def initializer(self) -> None:
        """Graphcore's TF1 initializer: nothing to do (the host iterator starts on use)."""


__all__ = ["IPUInfeedQueue"]
