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
    "TileModelError",
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


class TileModelError(EmulatorError):
    """The tile model (``device_server/emulator/tiles/``) failed while estimating a program: a
    bug of the model, or an IR shape it does not handle. Nothing was counted, so there is no
    verdict and no figure. The message names the program and the IR instruction being planned
    (name, opcode, framework op, Keras layer); the original exception is chained
    (``__cause__``). ``tf_ipu.estimate`` raises it; ``compile_module`` compiles anyway, with the
    fit unknown (``Estimate.fits`` None) and a warning.

    Attributes:
        program: the module's name.
        instruction: the IR instruction being planned ("" if the failure came outside one).
        opcode: its opcode ("" likewise).
        layer: its Keras layer, where its ``source_op`` names one (else "").
    """

    def __init__(self, message: str, program: str = "", instruction: str = "", opcode: str = "",
                 layer: str = "") -> None:
        super().__init__(message)
        self.program = program
        self.instruction = instruction
        self.opcode = opcode
        self.layer = layer


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
