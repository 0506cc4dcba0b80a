"""The IPU emulator: compiles IR modules (``device_server/protocol/ir.proto``) for an IPU
target and runs them with numpy, with an analytical cost and memory estimate.

    from device_server.emulator import compile_module, get_target
    exe = compile_module(module, get_target("ipu2"))
    outputs = exe.run(arrays)          # thread-safe
    exe.estimate.to_dict()             # cycles, seconds, memory per tile, fits

Targets: "ipu1" (GC2), "ipu2" (GC200), "bow" (alias "ipu21"); see ``arch.py``.
"""

from device_server.emulator.arch import BOW, GC2, GC200, PRESETS, Target, get_target
from device_server.emulator.compiler import CompileOptions, Executable, compile_module
from device_server.emulator.errors import (
    EmulatorError,
    ExecutionError,
    InvalidProgramError,
    OutOfMemoryError,
    UnsupportedOpError,
    layer_of,
)
from device_server.emulator.estimate import Estimate

__all__ = [
    "BOW",
    "GC2",
    "GC200",
    "PRESETS",
    "CompileOptions",
    "EmulatorError",
    "Estimate",
    "Executable",
    "ExecutionError",
    "InvalidProgramError",
    "OutOfMemoryError",
    "Target",
    "UnsupportedOpError",
    "compile_module",
    "get_target",
    "layer_of",
]
