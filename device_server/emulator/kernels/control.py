"""Kernels for values and control flow: parameter, constant, tuple, get-tuple-element, call,
while, conditional, opt-barrier, after-all, add-dependency, get-dimension-size,
set-dimension-size, replica-id, partition-id.

A value with dynamic dimensions is an array of its run-time shape (``emulator/dynamic.py``):
``get-dimension-size`` reads a dynamic dimension's size from the array, ``set-dimension-size``
cuts the array to the new size or pads it with zeros (elements past a size are padding, whose
content XLA leaves unspecified).

``parameter`` and ``constant`` are placed in slots by the compiler itself; their factories
exist so the registry lists them, and run only when fault injection targets them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from device_server.emulator import cancel
from device_server.emulator.kernels import KernelContext, KernelFn, inline, register


@register("parameter")
def _parameter(ctx: KernelContext) -> KernelFn:
    raise ctx.error("a parameter is bound by the compiler, not run")  # type: ignore[attr-defined]


@register("constant")
def _constant(ctx: KernelContext) -> KernelFn:
    value = ctx.attr("value")
    return lambda ops: value


@register("tuple")
def _tuple(ctx: KernelContext) -> KernelFn:
    n = len(ctx.instr.operands)
    return inline(lambda ops: tuple(ops), "(" + "".join(f"{{{i}}}, " for i in range(n)) + ")")


@register("get-tuple-element")
def _gte(ctx: KernelContext) -> KernelFn:
    index = int(ctx.attr("index", 0))
    if ctx.out_dtype is not None and ctx.out_shape == ():
        # A scalar leaves the tuple as a numpy scalar (cheap arithmetic downstream).
        return inline(lambda ops: ops[0][index][()], f"{{0}}[{index}][()]")
    return inline(lambda ops: ops[0][index], f"{{0}}[{index}]")


@register("opt-barrier", "add-dependency")
def _identity(ctx: KernelContext) -> KernelFn:
    return lambda ops: ops[0]


@register("after-all")
def _after_all(ctx: KernelContext) -> KernelFn:
    return lambda ops: ()


@register("get-dimension-size")
def _get_dimension_size(ctx: KernelContext) -> KernelFn:
    """The size of a dimension: its bound if static, the array's size if dynamic."""
    dim = int(ctx.attr("dimension"))
    if not 0 <= dim < len(ctx.operand_shapes[0]):
        raise ValueError(f"dimension {dim} out of range for {list(ctx.operand_shapes[0])}")
    if ctx.operand_dynamic[0][dim]:
        make = np.dtype(ctx.out_dtype).type
        return lambda ops: make(np.shape(ops[0])[dim])
    size = np.asarray(ctx.operand_shapes[0][dim], dtype=ctx.out_dtype)
    size.flags.writeable = False
    return lambda ops: size


@register("set-dimension-size")
def _set_dimension_size(ctx: KernelContext) -> KernelFn:
    """Operand 0 with dimension ``dimension`` of size ``operand 1``: cut to it, or padded with
    zeros up to it. A negative size means 0 (TF computes ``x[1:]`` of an empty ``x`` as size -1;
    XLA on CPU crashes there); a size past the bound is an error, and a dimension the result's
    shape keeps static may only be set to its bound."""
    dim = int(ctx.attr("dimension"))
    bound = ctx.out_shape[dim] if 0 <= dim < len(ctx.out_shape) else -1
    if bound < 0 or tuple(ctx.operand_shapes[0]) != tuple(ctx.out_shape):
        raise ValueError(f"dimension {dim} of {list(ctx.operand_shapes[0])} does not give {list(ctx.out_shape)}")
    dynamic = ctx.out_dynamic[dim]
    keep = (slice(None),) * dim

    def run(ops: Sequence[Any]) -> Any:
        size = max(int(ops[1]), 0)
        if not dynamic and size != bound:
            raise ValueError(
                f"dimension {dim} set to {size}, but the result's shape has it static with size "
                f"{bound} (only dimensions marked dynamic take other sizes: dynamic shapes, "
                f"docs/ir.md)"
            )
        if size > bound:
            raise ValueError(f"dimension {dim} set to {size}, more than its bound {bound}")
        a = np.asarray(ops[0])
        n = a.shape[dim]
        if size == n:
            return ops[0]
        if size < n:
            return a[keep + (slice(0, size),)]
        out = np.zeros(a.shape[:dim] + (size,) + a.shape[dim + 1:], a.dtype)
        out[keep + (slice(0, n),)] = a
        return out

    return run


@register("replica-id", "partition-id")
def _zero_id(ctx: KernelContext) -> KernelFn:
    zero = np.zeros((), ctx.out_dtype)
    zero.flags.writeable = False
    return lambda ops: zero


@register("call")
def _call(ctx: KernelContext) -> KernelFn:
    return ctx.computation(0)


@register("while")
def _while(ctx: KernelContext) -> KernelFn:
    """``called_computations`` = (condition, body), as documented in docs/ir.md. State
    elements the body updates in place (``in_place_slots``) are copied once on entry, so the
    loop owns them and the caller's values stay as they were. A run asked to stop
    (``emulator/cancel.py``) ends a device loop at its next step and abandons other loops at
    their next iteration."""
    owned = ctx.in_place_slots(1)
    cond = ctx.computation(0)
    body = ctx.computation(1)
    device_loop = cancel.is_device_loop(ctx.instr.source_op)
    where = f"{ctx.instr.name} ({ctx.instr.source_op or 'while'})"

    def run(ops: Sequence[Any]) -> Any:
        state = ops[0]
        for path in owned:
            state = _copied_at(state, path)
        token = cancel.current()
        if token is None:
            while cond((state,)):
                state = body((state,))
            return state
        if not device_loop:
            while cond((state,)):
                if token.in_loop():
                    raise token.stopped(where)
                state = body((state,))
            return state
        steps = 0
        with token.device_loop():
            while cond((state,)):
                if token.at_step():
                    token.ended_early(steps)
                    break
                try:
                    state = body((state,))
                except cancel.RunStopped:
                    if owned:  # the step wrote part of the state in place: nothing to keep
                        raise
                    token.ended_early(steps)  # the state before the abandoned step
                    break
                steps += 1
        return state

    return run


def _copied_at(value: Any, path: tuple[int, ...]) -> Any:
    """``value`` (nested tuples) with a copy of the array at ``path``."""
    if not path:
        return np.array(value, copy=True)
    if not isinstance(value, tuple) or not 0 <= path[0] < len(value):
        return value
    k = path[0]
    return (*value[:k], _copied_at(value[k], path[1:]), *value[k + 1:])


@register("conditional")
def _conditional(ctx: KernelContext) -> KernelFn:
    """Operand 0 is a ``pred`` (branch 0 when true, 1 when false) or an ``s32`` index
    (out of range -> the last branch); operand k+1 is branch k's argument."""
    branches = [ctx.computation(k) for k in range(len(ctx.instr.called_computations))]
    n = len(branches)
    if ctx.operand_dtypes[0] == np.bool_:
        if n != 2:
            raise ctx.error(f"a predicated conditional needs 2 branches, has {n}")  # type: ignore[attr-defined]
        then_branch, else_branch = branches

        def run_pred(ops: Sequence[Any]) -> Any:
            if ops[0]:
                return then_branch((ops[1],))
            return else_branch((ops[2],))

        return run_pred

    def run_index(ops: Sequence[Any]) -> Any:
        k = int(ops[0])
        if not 0 <= k < n:
            k = n - 1
        return branches[k]((ops[k + 1],))

    return run_index
