"""Errors raised by the emulator, and the naming of user code in them.

Every error names what the user wrote: the IR instruction and opcode, the framework op it came
from (``source_op``) and, for Keras models, the layer (derived from the op name by
:func:`layer_of`).
"""

from __future__ import annotations

from device_server.protocol import ir_pb2
from device_server.protocol.names import layer_of

__all__ = [
    "EmulatorError",
    "ExecutionError",
    "FloatingPointExceptionError",
    "InvalidProgramError",
    "OutOfMemoryError",
    "UnsupportedOpError",
    "describe",
    "layer_of",
]


class EmulatorError(Exception):
    """Base class of every error the emulator raises."""


class UnsupportedOpError(EmulatorError):
    """An opcode without a kernel, refused by the compile options, or a ``custom-call``
    whose target has no registered kernel. Raised at compile time."""


class OutOfMemoryError(EmulatorError):
    """The program does not fit the target's tile memory (compile time, like Poplar)."""


class ExecutionError(EmulatorError):
    """A failure while running a compiled program (bad arguments, a kernel failure)."""


class FloatingPointExceptionError(ExecutionError):
    """A floating-point exception check (``inv``, ``div0`` or ``oflo``, see ``numerics.py``)
    fired: the run stopped at the instruction the message names. ``flag`` says which."""

    def __init__(self, message: str, flag: str = "") -> None:
        super().__init__(message)
        self.flag = flag


class InvalidProgramError(EmulatorError):
    """A malformed IR module (unknown operand, missing attribute, inconsistent shapes)."""


def describe(instr: ir_pb2.Instruction) -> str:
    """``'add.3' (opcode add) from op 'seq/dense/BiasAdd' (BiasAdd), Keras layer 'dense'``."""
    text = f"instruction '{instr.name}' (opcode {instr.opcode})"
    if instr.source_op:
        kind = f" ({instr.source_type})" if instr.source_type else ""
        text += f" from op '{instr.source_op}'{kind}"
        layer = layer_of(instr.source_op)
        if layer:
            text += f", Keras layer '{layer}'"
    return text
