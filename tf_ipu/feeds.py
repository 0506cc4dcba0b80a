"""Infeeds and outfeeds of custom loops: ``strategy.run(fn, args=[iterator, ..., outfeed])``.

    host: strategy.run ──> Feeder thread: next(iterator) ──PushInfeed──> session's infeed
    device fn (lowered once):  for _ in tf.range(n):
                                   x, y = next(iterator)   -> custom-call tf_ipu_infeed
                                   outfeed.enqueue(loss)   -> custom-call tf_ipu_outfeed
    ExecuteReply.outfeeds ──> the runtime ──> deliver() ──> the queue's dequeue() on the host

An iterator argument of ``strategy.run`` is replaced, while ``fn`` is lowered, by a
``DeviceIterator`` whose ``next`` pulls from an infeed of the session named after the
argument's position (an ``IPUInfeedQueue`` that ``fn`` reaches through its closure instead
pulls from an infeed named after the queue, found while lowering: ``collecting_infeeds``); while the call runs, a ``Feeder`` pushes the real iterator's elements
there (a few ahead of what the device has taken; what it pushed and the device did not take
waits for the next call). An outfeed's ``enqueue`` inside ``fn`` hands values to the
session's outfeed of that name; the call's reply carries them, stacked, and ``deliver`` keeps
them until the host dequeues.

An enqueue in a graph (``enqueue_outfeed``) is the custom-call plus an addition to an int32
variable of its queue, and returns that addition as its operation:

    tf.cond(p, lambda: q.enqueue(x), tf.no_op)  ->  branch: done = custom-call(x)
                                                          q.enqueues += done   (an op)
    the variable's new value is an output of the program, so the cond, loop or nested
    tf.function holding the enqueue is never pruned (by TF or by the device)

An enqueue run eagerly delivers its value at once (``deliver_one``).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import tensorflow as tf
from tensorflow.compiler.tf2xla.python import xla

from device_server.protocol import INFEED_TARGET, OUTFEED_TARGET

#: Batches a feeder keeps waiting in the session's infeed ahead of the device.
AHEAD = 8

_lock = threading.Lock()
_outfeeds: dict[str, list[tuple[int, list[np.ndarray]]]] = {}
_lowering = threading.local()  # .found: the infeed queues met while a device fn is lowered


def is_host_iterator(value: Any) -> bool:
    """Whether ``value`` is an iterator over a tf.data dataset (an infeed argument)."""
    return isinstance(value, (tf.data.Iterator, tf.distribute.DistributedIterator)) or (
        hasattr(value, "_tf_ipu_host_iterator"))


def host_iterator(value: Any) -> Any:
    """The tf.data iterator behind an infeed argument (itself, or an infeed queue's)."""
    return value._tf_ipu_host_iterator() if hasattr(value, "_tf_ipu_host_iterator") else value


class DeviceIterator:
    """Stands for an iterator inside a lowered device function: ``next`` pulls the next
    element from infeed ``feed`` (an error on the device once the host's dataset ended)."""

    def __init__(self, feed: str, element_spec: Any) -> None:
        self.feed = feed
        self.element_spec = element_spec
        self._leaves = tf.nest.flatten(element_spec)
        for spec in self._leaves:
            if not isinstance(spec, tf.TensorSpec) or not spec.shape.is_fully_defined():
                raise ValueError(
                    f"An iterator given to strategy.run feeds the IPU, which needs static "
                    f"shapes: its element {spec} is not (batch with drop_remainder=True)."
                )

    def __iter__(self) -> DeviceIterator:
        return self

    def __next__(self) -> Any:
        return self.get_next()

    def get_next(self) -> Any:
        got = xla.custom_call_v2(
            INFEED_TARGET, [tf.constant(0)], [tf.TensorSpec([], tf.bool), *self._leaves],
            backend_config=f"{self.feed}|strict", has_side_effect=True,
        )
        return tf.nest.pack_sequence_as(self.element_spec, list(got[1:]))


@contextlib.contextmanager
def _marked(mark: str) -> Iterator[None]:
    """Counts this thread into the traces marked ``mark`` while the block runs."""
    setattr(_lowering, mark, getattr(_lowering, mark, 0) + 1)
    try:
        yield
    finally:
        setattr(_lowering, mark, getattr(_lowering, mark) - 1)


def scratch_trace() -> contextlib.AbstractContextManager[None]:
    """Marks a trace whose graph is thrown away (one traced to learn a step's output
    structure): what an outfeed queue is given there does not count as enqueued."""
    return _marked("scratch")


def in_scratch_trace() -> bool:
    """Whether the code running is traced into a graph that will be thrown away."""
    return getattr(_lowering, "scratch", 0) > 0


@contextlib.contextmanager
def collecting_infeeds() -> Iterator[dict[str, Any]]:
    """While a device function is lowered: collects the infeed queues its code takes from
    without having been given them as arguments (a queue the function's closure holds), as
    ``{feed: queue}``, so that the call feeds them too."""
    previous = getattr(_lowering, "found", None)
    found: dict[str, Any] = {}
    _lowering.found = found
    try:
        yield found
    finally:
        _lowering.found = previous


def next_while_lowering(queue: Any, feed: str, element_spec: Any) -> Any:
    """``next(queue)`` inside a device function being lowered: the next element of infeed
    ``feed`` (and ``queue`` joins the call's infeeds); None when nothing is being lowered."""
    found = getattr(_lowering, "found", None)
    if found is None:
        return None
    found[feed] = queue
    return DeviceIterator(feed, element_spec).get_next()


def device_program() -> contextlib.AbstractContextManager[None]:
    """Marks the code traced while a function is lowered to a device program
    (``lower_function``): an outfeed enqueue there is refused, naming it, if the device
    cannot send its values (a size that depends on the data)."""
    return _marked("device")


def in_device_program() -> bool:
    """Whether the code running is traced into a device program (see ``device_program``)."""
    return getattr(_lowering, "device", 0) > 0


def enqueue_outfeed(feed: str, values: list[tf.Tensor], enqueues: tf.Variable) -> tf.Operation:
    """In a graph (a device function being lowered, or one that may be): hands ``values``
    to outfeed ``feed``; returns the operation that does it.

    The custom-call's result is added to ``enqueues`` (an int32 variable of the queue), and
    the returned operation is that addition. TF keeps a nested ``tf.function``'s ops only if
    they lead to its outputs or to a stateful op (the custom-call op is not stateful), and the
    device keeps a ``cond`` or ``while`` only if its results are used: a variable's new value
    is an output of the program wherever it was assigned, so every enqueue, in every branch,
    loop body and nested function, stays in the program.

    A ``tf.function`` keeps its traces, and runs one traced outside ``strategy.run`` when
    ``strategy.run`` calls it, so every graph gets this same device form. Run on the host
    (a ``tf.function`` called directly), TF fails on the op, which is named after the queue.
    """
    done = xla.custom_call_v2(OUTFEED_TARGET, values, [tf.TensorSpec([], tf.bool)],
                              backend_config=feed, has_side_effect=True,
                              name=f"IPUOutfeedQueue_{_op_name(feed)}_enqueue")
    # Read, then assigned: a read makes the traced functions list it among their variables.
    return enqueues.assign(enqueues.read_value() + tf.cast(done[0], tf.int32), read_value=False)


def _op_name(feed: str) -> str:
    return "".join(c if c.isalnum() or c in "_-." else "_" for c in feed)


def deliver_one(feed: str, values: list[np.ndarray]) -> None:
    """Keeps one element of outfeed ``feed`` enqueued eagerly (as a device call's would be)."""
    deliver({feed: (1, [np.asarray(v, order="C")[None] for v in values])})


def deliver(outfeeds: dict[str, tuple[int, list[np.ndarray]]]) -> None:
    """Keeps what a device call's reply carried for each outfeed (the runtime calls this)."""
    with _lock:
        for feed, item in outfeeds.items():
            _outfeeds.setdefault(feed, []).append(item)


def take(feed: str) -> list[tuple[int, list[np.ndarray]]]:
    """What outfeed ``feed`` has received since it was last taken, oldest first."""
    with _lock:
        return _outfeeds.pop(feed, [])


class Feeder:
    """Pushes a host iterator's elements to infeed ``feed`` while a device call runs."""

    def __init__(self, client: Any, feed: str, iterator: Any) -> None:
        self.client = client
        self.feed = feed
        self.iterator = iterator
        self.failure: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"tf_ipu-feed-{feed}",
                                        daemon=True)

    def __enter__(self) -> Feeder:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _elements(self) -> Iterator[list[np.ndarray]]:
        for element in self.iterator:
            yield [np.asarray(t) for t in tf.nest.flatten(element)]

    def _run(self) -> None:
        ended = False
        try:
            elements = self._elements()
            while not self._stop.is_set():
                queued = self.client.push_infeed(self.feed, [])
                if queued >= AHEAD:
                    self._stop.wait(0.002)
                    continue
                batch = next(elements, None)
                if batch is None:
                    ended = True
                    break
                self.client.push_infeed(self.feed, [batch])
        except BaseException as e:  # re-raised by strategy.run after the call
            self.failure = e
        finally:
            if ended or self.failure is not None:  # the device stops at its next pull
                try:
                    self.client.push_infeed(self.feed, [], end=True)
                except Exception:
                    pass
