"""Variables of models built under IPUStrategy: resident on the device, copied to the host on demand.

    with strategy.scope(): tf.Variable(...)   (Keras creates its weights this way)
        -> IPUStrategy's extended._create_variable -> an IPUVariable (a ResourceVariable)

    host read  (numpy(), get_weights(), save_weights(), a checkpoint, convert_to_tensor)
        -> IPUVariable._read_variable_op -> runtime.refresh([self]) if the device holds a
           newer value (one ReadVariables call), then TF's own read of the host buffer
    host write (assign*, scatter*, set_weights, a checkpoint restore)
        -> TF's own write, then runtime.note_host_write(self): uploaded before the next
           device call that uses it

The host buffer stays an ordinary TF resource variable, so everything TF and Keras do with
variables (tracking, checkpoints, SavedModel export, distribution checks) works unchanged;
this class only adds the two hooks above. Inside a device program being lowered
(``IPUStrategy.lowering``) reads and writes are the program's own (they become parameters
and aliased outputs), so the hooks do nothing there.

Not covered: a ``tf.function`` traced outside the strategy (run on the CPU) reads the host
copy as it is when the function runs; the copy is brought up to date when the function is
traced and at every epoch end and checkpoint, and ``tf_ipu.sync_to_host()`` does it on
demand. A variable such a function writes is watched by content from its trace on (the
runtime compares its bytes before each device call: the ``host_bytes_compared`` counter).
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf
from tensorflow.python.eager import context
from tensorflow.python.ops import resource_variable_ops

from tf_ipu.lowering.program import variable_key


def _runtime() -> Any:
    from tf_ipu import runtime

    return runtime.get_runtime()


def _lowering() -> bool:
    from tf_ipu.strategy import _lowering_depth

    return _lowering_depth() > 0


class IPUVariable(resource_variable_ops.ResourceVariable):
    """A ResourceVariable whose newest value may be on the device (module docstring).

    Made by ``IPUStrategy`` for every variable created in its scope; user code never
    constructs one. ``device_key`` names it on the device.
    """

    @property
    def device_key(self) -> str:
        return variable_key(self)

    def _before_read(self) -> None:
        if _lowering():
            return
        if context.executing_eagerly():
            _runtime().refresh([self])
        else:
            # Traced into a graph (a CPU tf.function, or Keras's symbolic shape inference):
            # bring the host copy up to date now.
            with tf.init_scope():
                _runtime().refresh([self])

    def _after_write(self) -> None:
        if _lowering():
            return
        if context.executing_eagerly():
            _runtime().note_host_write(self)
        else:
            _runtime().watch(self)

    # -- reads --------------------------------------------------------------------------
    def _read_variable_op(self, no_copy: bool = False) -> Any:
        self._before_read()
        return super()._read_variable_op(no_copy=no_copy)

    def sparse_read(self, indices: Any, name: Any = None) -> Any:
        self._before_read()
        return super().sparse_read(indices, name=name)

    def gather_nd(self, indices: Any, name: Any = None) -> Any:
        self._before_read()
        return super().gather_nd(indices, name=name)

    # -- writes -------------------------------------------------------------------------
    def assign(self, value: Any, use_locking: Any = None, name: Any = None,
               read_value: bool = True) -> Any:
        # A whole new value: the device's newer one, if any, is not needed first (a write
        # traced into a graph happens later: until then reads still fetch).
        if not _lowering() and context.executing_eagerly():
            _runtime().forget_device_value(self)
        out = super().assign(value, use_locking=use_locking, name=name, read_value=read_value)
        self._after_write()
        return out

    def _restore_from_tensors(self, restored_tensors: Any) -> Any:
        if not _lowering() and context.executing_eagerly():
            _runtime().forget_device_value(self)
        out = super()._restore_from_tensors(restored_tensors)
        self._after_write()
        return out


def _read_modify_write(name: str) -> Any:
    """``assign_add``, ``scatter_update``, ...: they read the old value, so the host copy is
    refreshed first, and the result is a host write."""
    base = getattr(resource_variable_ops.ResourceVariable, name)

    def method(self: IPUVariable, *args: Any, **kwargs: Any) -> Any:
        self._before_read()
        out = base(self, *args, **kwargs)
        self._after_write()
        return out

    method.__name__ = name
    method.__doc__ = base.__doc__
    return method


for _name in (
    "assign_add", "assign_sub", "scatter_sub", "scatter_add", "scatter_max", "scatter_min",
    "scatter_mul", "scatter_div", "scatter_update", "batch_scatter_update", "scatter_nd_sub",
    "scatter_nd_add", "scatter_nd_update", "scatter_nd_max", "scatter_nd_min",
):
    setattr(IPUVariable, _name, _read_modify_write(_name))


def make_ipu_variable(var: Any) -> Any:
    """Turns a ResourceVariable just created in IPUStrategy's scope into an IPUVariable (the
    same object, the same buffer: only its class changes) and tells the runtime about it.
    Other kinds of variables are returned as they are."""
    if type(var) is resource_variable_ops.ResourceVariable:
        var.__class__ = IPUVariable
        _runtime().track(var)
    return var
