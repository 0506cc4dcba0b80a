"""``tensorflow.python.ipu.loops``: loops that run on the device, fed by an infeed queue.

    def device_fn():                                   # run by strategy.run: one device call
        return loops.repeat(100, body, [total], infeed_queue=infeed)
    body(total, x, y) -> new total                     # each iteration takes the next element

``repeat(n, body, inputs, infeed_queue)`` runs ``body`` ``n`` times; ``while_loop(condition,
body, inputs, infeed_queue, maximum_iterations)`` while ``condition`` holds. ``body`` takes
the loop-carried values, then the infeed element (a tuple or list: as more positional
arguments; a dict: as keyword arguments; a tensor: one more argument), and returns the new
loop-carried values (same dtypes), optionally followed by operations. With no loop-carried
values, the loop returns an operation (a call to wait for).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import tensorflow as tf


def _as_list(values: Any) -> list:
    if values is None:
        return []
    return list(values) if isinstance(values, (list, tuple)) else [values]


def _element_arguments(element: Any) -> tuple[list, dict]:
    if isinstance(element, dict):
        return [], dict(element)
    if isinstance(element, (tuple, list)):
        return list(element), {}
    return [element], {}


def _check_arity(what: str, fn: Callable, count: int, extra: str) -> None:
    try:
        inspect.signature(fn).bind(*range(count))
    except TypeError as e:
        raise TypeError(f"The loop {what} cannot be called with {count} arguments "
                        f"({extra}): {e}") from None
    except ValueError:  # no signature (a builtin): let the call say
        pass


def while_loop(condition: Callable, body: Callable, inputs: Any = None, infeed_queue: Any = None,
               maximum_iterations: int | None = None, use_while_v1: bool = True) -> Any:
    """Runs ``body`` while ``condition(*loop values)`` holds (at most ``maximum_iterations``
    times); see the module docstring. ``use_while_v1`` is Graphcore's and changes nothing."""
    initial = [tf.convert_to_tensor(v) for v in _as_list(inputs)]
    arity = len(initial)
    _check_arity("condition", condition, arity, f"{arity} loop-carried values")
    dtypes = [v.dtype for v in initial]

    def cond(*values: tf.Tensor) -> tf.Tensor:
        return condition(*values[:arity])

    def step(*values: tf.Tensor) -> list[tf.Tensor]:
        args, kwargs = ([], {}) if infeed_queue is None else _element_arguments(next(infeed_queue))
        out = body(*values[:arity], *args, **kwargs)
        outs = _as_list(out)
        tensors = [o for o in outs if not isinstance(o, tf.Operation)]
        operations = [o for o in outs if isinstance(o, tf.Operation)]
        if outs != tensors + operations:
            raise ValueError("A loop body returns its loop-carried values first, then any "
                             "operations.")
        tensors = [tf.convert_to_tensor(t) for t in tensors]
        if [t.dtype for t in tensors] != dtypes:
            raise TypeError(
                f"The loop body returns {[t.dtype.name for t in tensors]} for loop-carried "
                f"values of {[d.name for d in dtypes]}: they must match."
            )
        if operations:
            with tf.control_dependencies(operations):
                tensors = [tf.identity(t) for t in tensors]
        if arity == 0:
            with tf.control_dependencies(operations):
                return [values[0] + 1]
        return tensors

    loop_values = initial if arity else [tf.constant(0)]
    result = tf.while_loop(cond, step, loop_values, maximum_iterations=maximum_iterations,
                           parallel_iterations=1)
    result = _as_list(result)
    if arity == 0:
        return result[0].op
    return result[0] if arity == 1 else result


def repeat(n: int, body: Callable, inputs: Any = None, infeed_queue: Any = None,
           use_while_v1: bool = True) -> Any:
    """Runs ``body`` ``n`` times (see the module docstring)."""
    return while_loop(lambda *values: tf.constant(True), body, inputs=inputs,
                      infeed_queue=infeed_queue, maximum_iterations=n)


__all__ = ["repeat", "while_loop"]
