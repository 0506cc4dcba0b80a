"""Kernel registry: one factory per IR opcode.

    compile time:  factory(ctx: KernelContext) -> KernelFn     (parse attrs, plan, precompute)
    execute time:  KernelFn(operands: list[np.ndarray | tuple]) -> np.ndarray | tuple

A factory does all attribute parsing, shape arithmetic and index precomputation once, when
the program is compiled; the function it returns does only arithmetic. It may also mark the
function with an equivalent Python expression (:func:`inline`), which the compiler writes into
the generated program instead of a call, and as a plain ufunc (:func:`elementwise_ufunc`).
Values may be numpy scalars as well as arrays (scalar arithmetic stays in numpy scalars);
tuple-shaped values are Python tuples of them. Kernels implement XLA's published operation
semantics (https://openxla.org/xla/operation_semantics) with numpy as the building block;
they never hand work to XLA, TensorFlow or JAX.

``custom-call`` is one opcode with many meanings, chosen by its ``custom_call_target``
attribute. Its factory looks the target up in :data:`CUSTOM_CALLS` (filled by
:func:`register_custom_call`) and hands the instruction to that target's factory; a target not
in the table is refused (:class:`UnsupportedOpError`). Only targets whose semantics are public
and fixed belong in the table (e.g. XLA's ``Qr``, the LAPACK ``geqrf`` factorization). The
target string is only ever a key: nothing from the wire becomes code.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np

from device_server.emulator.errors import UnsupportedOpError, describe
from device_server.protocol import ir_pb2

Value = Any  # np.ndarray, or a tuple of Values for tuple shapes
KernelFn = Callable[[Sequence[Value]], Value]


class KernelContext(Protocol):
    """What a kernel factory may ask about the instruction it compiles."""

    instr: ir_pb2.Instruction
    out_dtype: np.dtype | None          # None for tuple-shaped results
    out_shape: tuple[int, ...]          # () for tuple-shaped results
    operand_dtypes: list[np.dtype | None]
    operand_shapes: list[tuple[int, ...]]
    # Which dimensions are dynamic (the shapes above then hold bounds; see emulator/dynamic.py).
    # Only the factories of dynamic.PASS_THROUGH opcodes need to look: the others are planned
    # once for the bounds and again, by the compiler, for each run-time shape.
    out_dynamic: tuple[bool, ...]       # () for tuple-shaped results
    operand_dynamic: list[tuple[bool, ...]]
    numerics: Any                       # emulator.numerics.Numerics: partials, rounding
    # For a dynamic-update-slice: its operand is a buffer that nothing else reads, owned by the
    # loop that runs this computation (see in_place_slots), so it may be written in place.
    in_place: bool

    def attr(self, name: str, default: Any = ...) -> Any:
        """The attribute as a Python value (ints -> tuple[int, ...], literal -> np.ndarray).

        Raises the emulator's error naming the instruction if it is missing and no default.
        """

    def computation(self, index: int) -> Callable[[Sequence[Value]], Value]:
        """The instruction's index-th called computation, compiled, as a function."""

    def in_place_slots(self, index: int) -> tuple[tuple[int, ...], ...]:
        """For a ``while``: the elements of the loop state (paths of tuple indices) that its
        body (the index-th called computation) only updates with a dynamic-update-slice,
        which then writes in place. The loop must hand the body buffers of its own for them
        (copies made once per loop). Call it before :meth:`computation` compiles the body."""

    def reducer_ufunc(self, index: int) -> np.ufunc | None:
        """If the index-th called computation is a plain binary op of its two parameters
        (add, multiply, maximum, minimum, and, or, xor), the matching numpy ufunc."""


def inline(fn: KernelFn, template: str, **names: Any) -> KernelFn:
    """Marks ``fn`` as computable by a Python expression, which the compiler writes into the
    program's generated code instead of a call of ``fn`` (saving a call and a list).

    ``template`` is a ``str.format`` pattern: ``{0}``, ``{1}``... are the operands, other
    fields are ``names`` (any Python objects, e.g. ufuncs or shapes). It must compute exactly
    what ``fn`` computes for any operands the kernel accepts, including numpy scalars, 0-d
    arrays and, when the op may sit in a computation called element-wise, whole arrays.
    Example: ``inline(lambda ops: np.add(ops[0], ops[1]), "{f}({0}, {1})", f=np.add)``.
    """
    fn.inline = (template, names)  # type: ignore[attr-defined]
    return fn


def elementwise_ufunc(fn: KernelFn, ufunc: np.ufunc) -> KernelFn:
    """Marks ``fn`` as exactly ``ufunc(*ops)`` (numpy broadcasting, a new array), so the
    compiler may pass ``out=`` an operand's buffer when nothing else can see that buffer."""
    fn.ufunc = ufunc  # type: ignore[attr-defined]
    return fn


Factory = Callable[[KernelContext], KernelFn]
REGISTRY: dict[str, Factory] = {}


def _registrar(table: dict[str, Factory], what: str, keys: Sequence[str]) -> Callable[[Factory], Factory]:
    def deco(factory: Factory) -> Factory:
        for key in keys:
            if key in table:
                raise RuntimeError(f"{what} {key!r} registered twice")
            table[key] = factory
        return factory

    return deco


def register(*opcodes: str) -> Callable[[Factory], Factory]:
    """Registers a kernel factory for one or more opcodes."""
    return _registrar(REGISTRY, "opcode", opcodes)


# ------------------------------------------------------------------------------ custom-call

CUSTOM_CALL_TARGET = "custom_call_target"  # the IR attribute naming a custom-call's target
CUSTOM_CALLS: dict[str, Factory] = {}


def register_custom_call(*targets: str) -> Callable[[Factory], Factory]:
    """Registers a kernel factory for one or more ``custom-call`` targets (exact strings, as
    XLA spells them, e.g. ``"Qr"``). The factory gets the ``custom-call`` instruction's
    context, like any opcode's factory."""
    return _registrar(CUSTOM_CALLS, "custom-call target", targets)


def custom_call_target(instr: ir_pb2.Instruction) -> str:
    """The ``custom_call_target`` of an instruction ("" if it has none)."""
    if CUSTOM_CALL_TARGET not in instr.attrs:
        return ""
    v = instr.attrs[CUSTOM_CALL_TARGET]
    return v.s if v.WhichOneof("value") == "s" else ""


def custom_call_supported(instr: ir_pb2.Instruction) -> bool:
    """Whether a ``custom-call``'s target has a registered kernel."""
    return custom_call_target(instr) in CUSTOM_CALLS


@register("custom-call")
def custom_call(ctx: KernelContext) -> KernelFn:
    """Dispatches on ``custom_call_target`` to the target's registered factory."""
    target = custom_call_target(ctx.instr)
    factory = CUSTOM_CALLS.get(target)
    if factory is None:
        raise UnsupportedOpError(
            f"Unsupported op on the IPU emulator: custom-call target '{target}' has no emulator "
            f"kernel: {describe(ctx.instr)}"
        )
    return factory(ctx)
