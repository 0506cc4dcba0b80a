"""``tensorflow.python.ipu.ipu_infeed_queue``: a dataset the device pulls from.

    infeed = ipu.ipu_infeed_queue.IPUInfeedQueue(dataset)
    strategy.run(loop, args=[infeed, 100])      # in loop: x, y = next(infeed)

Passed to ``strategy.run``, the queue (like any iterator over a dataset) becomes an infeed of
the device: each ``next`` inside the device function takes the next element, which the host
pushes while the call runs (``tf_ipu.feeds``). One host iterator over the dataset serves
every call, so successive calls go on where the last one stopped.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf


class IPUInfeedQueue:
    """An infeed over ``dataset`` (elements of static shapes: batch with
    ``drop_remainder=True``). Graphcore's other arguments change nothing here."""

    def __init__(self, dataset: tf.data.Dataset, device_ordinal: int = 0,
                 prefetch_depth: int | None = None, **kwargs: Any) -> None:
        self._dataset = dataset
        self._iterator: Any = None

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
        return next(self._tf_ipu_host_iterator())

    def initializer(self) -> None:
        """Graphcore's TF1 initializer: nothing to do (the host iterator starts on use)."""


__all__ = ["IPUInfeedQueue"]
