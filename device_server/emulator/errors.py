"""Errors raised by the emulator, and the naming of user code in them.

Every error names what the user wrote: the IR instruction and opcode, the framework op it came
from (``source_op``) and, for Keras models, the layer (derived from the op name by
:func:`layer_of`).
"""

from __future__ import annotations

import re

from device_server.protocol import ir_pb2

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


# Leading op-name scopes that say "this is the backward pass of what follows".
_BACKWARD_SCOPES = ("gradient_tape",)
# Scopes that are not layers (optimizers, loss and metric bookkeeping, TF internals).
_NON_LAYER_SCOPES = {
    "XLA_Args", "XLA_Retvals", "while", "cond", "StatefulPartitionedCall",
    "PartitionedCall",
}


_UNIQUIFIED = re.compile(r"^(.+)_\d+$")
# Leading scopes of control flow around the model's ops (the device loop's ``while``).
_CONTROL_SCOPES = re.compile(r"^(while|cond|body)(_\d+)?$")


def layer_of(source_op: str) -> str:
    """Best-effort Keras layer name of a TF op name, ``""`` when there is none.

    ``sequential/dense_1/MatMul`` -> ``dense_1``;
    ``gradient_tape/sequential/conv2d/Conv2DBackpropFilter`` -> ``conv2d (backward)``.
    The first scope is taken to be the model and the second the layer, as Keras names ops
    ``<model>/<layer>/<op>``; names with fewer scopes have no layer.

    Measured on Keras 3.15 / TF 2.21: inside a traced ``tf.function`` Keras enters each scope
    twice, so TF uniquifies every component once (layer ``dense`` of model ``sequential``
    gives ``sequential_1/dense_1/MatMul``; layer ``dense_1`` gives ``dense_1_1``). When the
    model scope carries such a ``_<n>`` suffix, one suffix is removed from the layer scope.
    """
    parts = [p for p in source_op.split("/") if p]
    while len(parts) > 1 and _CONTROL_SCOPES.match(parts[0]):
        parts = parts[1:]  # ``while/sequential/dense/MatMul``: a step in the device loop
    backward = bool(parts) and parts[0] in _BACKWARD_SCOPES
    if backward:
        parts = parts[1:]
    if len(parts) < 3 or parts[0] in _NON_LAYER_SCOPES or parts[1] in _NON_LAYER_SCOPES:
        return ""
    layer = parts[1]
    if _UNIQUIFIED.match(parts[0]):
        m = _UNIQUIFIED.match(layer)
        if m:
            layer = m.group(1)
    return f"{layer} (backward)" if backward else layer


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
