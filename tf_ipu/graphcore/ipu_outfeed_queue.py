"""``tensorflow.python.ipu.ipu_outfeed_queue``: values the device hands to the host.

    outfeed = ipu.ipu_outfeed_queue.IPUOutfeedQueue()
    def loop(iterator, n):                      # run by strategy.run on the device
        for _ in tf.range(n):
            ...; outfeed.enqueue(loss)          # -> custom-call tf_ipu_outfeed
            tf.cond(ok, lambda: outfeed.enqueue(x), lambda: tf.no_op())   # if taken
    strategy.run(loop, args=[iterator, 100])
    losses = outfeed.dequeue()                  # on the host: [100] (mode ALL) or the last

``enqueue`` returns its operation, as Graphcore's does (None eagerly). Every enqueue the
device runs reaches the host: at top level, in ``tf.cond`` branches, ``tf.while_loop``
bodies, nested ``tf.function``s (XLA-compiled or not) and any nest of them
(``feeds.enqueue_outfeed`` says how). Run eagerly, an enqueue keeps its value at once; in a
``tf.function`` run on the host (not given to ``strategy.run``) TF fails on its op, named
``IPUOutfeedQueue_<feed name>_enqueue``, as nothing there can run it. ``dequeue`` returns what
every call since the last dequeue enqueued, stacked (``IPUOutfeedMode.ALL``; a leading
dimension of 0 if nothing was), or only the last enqueued value (``LAST``; an error if none
was, as Graphcore's), in the structure given to ``enqueue``, and empties the queue.
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
        # What every device enqueue adds to (feeds.enqueue_outfeed): made here, outside any
        # function being traced, so that device functions capture it as a variable.
        with tf.init_scope():
            self._enqueues = tf.Variable(0, dtype=tf.int32, trainable=False,
                                         name=f"{self.feed_name}_enqueues")

    def enqueue(self, tensors: Any) -> tf.Operation | None:
        """Hands ``tensors`` (a tensor or a nest) to the host; returns the operation that
        does it, as Graphcore's does (None when run eagerly, as a TF op without outputs).

        In a device function (``strategy.run``, Keras's steps): every enqueue the device runs
        reaches the host, in any ``tf.cond`` branch, ``tf.while_loop`` body or nested
        ``tf.function``. Eagerly: the value is kept at once, as if the device had sent it.
        In a ``tf.function`` run on the host: TF fails on the op (see the module docstring).
        """
        flat = [tf.convert_to_tensor(t) for t in tf.nest.flatten(tensors)]
        specs = [tf.TensorSpec(t.shape, t.dtype) for t in flat]
        where = f"IPUOutfeedQueue({self.feed_name!r}).enqueue"
        if not flat:
            raise ValueError(f"{where} was given {tensors!r}: nothing to enqueue.")
        for spec in specs:
            if not spec.shape.is_fully_defined() and feeds.in_device_program():
                raise ValueError(
                    f"{where} was given a value of shape {spec.shape} (its size depends on "
                    f"the data): values sent from the IPU need static shapes."
                )
        if self._structure is not None and (
                specs != self._specs or not _same_structure(tensors, self._structure)):
            raise ValueError(
                f"{where} was given {specs} where it was given {self._specs} before: a queue "
                f"carries values of one structure, shapes and dtypes (use another queue for "
                f"these)."
            )
        self._structure = tensors
        self._specs = specs
        if tf.executing_eagerly():
            feeds.deliver_one(self.feed_name, [t.numpy() for t in flat])
            self.enqueued = True
            return None
        op = feeds.enqueue_outfeed(self.feed_name, flat, self._enqueues)
        if not feeds.in_scratch_trace():  # a trace thrown away enqueues nothing
            self.enqueued = True
        return op

    def dequeue(self) -> Any:
        """On the host: what was enqueued since the last dequeue (see the module docstring)."""
        items = feeds.take(self.feed_name)
        if self._structure is None:
            return []
        if self.outfeed_mode is IPUOutfeedMode.LAST:
            last = next((values for count, values in reversed(items) if count), None)
            if last is None:  # Graphcore's dequeue fails so too
                raise tf.errors.FailedPreconditionError(
                    None, None,
                    f"IPUOutfeedQueue({self.feed_name!r}, IPUOutfeedMode.LAST).dequeue(): "
                    f"nothing was enqueued since the last dequeue (the device ran no "
                    f"enqueue: e.g. the tf.cond branch holding it was not taken), so there "
                    f"is no last value.")
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
