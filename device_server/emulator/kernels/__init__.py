"""Kernel registry: one factory per IR opcode.

    compile time:  factory(ctx: KernelContext) -> KernelFn     (parse attrs, plan, precompute)
    execute time:  KernelFn(operands: list[np.ndarray | tuple]) -> np.ndarray | tuple

A factory does all attribute parsing, shape arithmetic and index precomputation once, when
the program is compiled; the function it returns does only arithmetic. Tuple-shaped values
are Python tuples of arrays. Kernels implement XLA's published operation semantics
(https://openxla.org/xla/operation_semantics) with numpy as the building block; they never
hand work to XLA, TensorFlow or JAX.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np

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

    def attr(self, name: str, default: Any = ...) -> Any:
        """The attribute as a Python value (ints -> tuple[int, ...], literal -> np.ndarray).

        Raises the emulator's error naming the instruction if it is missing and no default.
        """

    def computation(self, index: int) -> Callable[[Sequence[Value]], Value]:
        """The instruction's index-th called computation, compiled, as a function."""

    def reducer_ufunc(self, index: int) -> np.ufunc | None:
        """If the index-th called computation is a plain binary op of its two parameters
        (add, multiply, maximum, minimum, and, or, xor), the matching numpy ufunc."""


Factory = Callable[[KernelContext], KernelFn]
REGISTRY: dict[str, Factory] = {}


def register(*opcodes: str) -> Callable[[Factory], Factory]:
    """Registers a kernel factory for one or more opcodes."""

    def deco(factory: Factory) -> Factory:
        for op in opcodes:
            if op in REGISTRY:
                raise RuntimeError(f"opcode {op!r} registered twice")
            REGISTRY[op] = factory
        return factory

    return deco
