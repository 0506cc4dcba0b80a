"""The IPU emulator: compiles IR modules (``device_server/protocol/ir.proto``, attributes in
``docs/ir.md``) for an IPU target and runs them with numpy, with an analytical cost and
memory estimate.

    from device_server.emulator import CompileOptions, compile_module, get_target
    exe = compile_module(module, get_target("ipu2"))
    outputs = exe.run(arrays)      # flattened entry result; thread-safe
    exe.aliases                    # output index -> parameter number (updated variables)
    exe.estimate.to_dict()         # cycles, seconds, bytes per tile, fits, assumptions
    record = exe.cache_record()    # plain JSON data: signature + estimate (the disk cache's)
    again = executable_from_record(module, target, options, record)  # no planning; the
                                   # program is generated from the module at the first run

Targets (``arch.py``): "ipu1" (GC2), "ipu2" (GC200), "bow" (alias "ipu21"); a smaller
``tiles_per_ipu`` may be requested.

Compilation (``compiler.py``) plans the program once: dead code elimination, constant
folding, forwarding of values that need no work (copies, tuple plumbing, identity reshapes,
transposes and converts, reshapes of reshapes, broadcasts into ops that broadcast like
numpy), and one step per remaining instruction holding a kernel function built by the
opcode's factory (``kernels/``). Each computation becomes one generated Python function
whose locals are the values: a step is a kernel call, or an inline expression the kernel
offers (a ufunc call, or plain operators on numpy scalars for scalar arithmetic), with
``out=`` buffers reused along element-wise chains; interpreter work is about 0.1 us per
step. Called computations (while, call, conditional, reducers, comparators) are compiled the
same way. ``bench/bench_emulator.py`` times Keras training loops against TF on CPU.

Errors: :class:`UnsupportedOpError` (compile time; an opcode without a kernel, one listed in
``CompileOptions.refuse_opcodes``, or a ``custom-call`` with an unregistered target),
:class:`OutOfMemoryError` (compile time, when the estimate does not fit the tiles' SRAM and
``allow_out_of_memory`` is not set), :class:`InvalidProgramError` (malformed IR),
:class:`ExecutionError` (bad arguments or a kernel failure at run time),
:class:`FloatingPointExceptionError` (an ExecutionError: a floating-point exception check
fired). Messages name the instruction, its opcode, the framework op and the Keras layer.

Stopping: ``exe.run(arrays, stop=StopToken(deadline))``; ``token.stop(reason)`` from any
thread ends a device loop at its next step, other loops at their next iteration
(``cancel.py``).

Test switch: ``CompileOptions(fault_inject_opcode="dot")`` perturbs every result of that
opcode at run time (floats ``x * 1.01 + 1e-3``, integers ``+1``, booleans negated), so a test
can prove that its comparison would catch a wrong kernel. It is never meant for real runs.

IPU numerics (``numerics.py``, all off by default): FP16 partials for dot/convolution
(``CompileOptions.partials_type="half"``), stochastic rounding (``esr``), floating-point
exception checks (``inv``, ``div0``, ``oflo``) and NaN on FP16 overflow (``nanoo``).

Numerics (vs. XLA on CPU, the reference): results match to float32 rounding. Deliberate
differences: ``maximum``/``minimum`` propagate NaN as XLA's semantics say (TF 2.21's XLA CPU
uses "fast" min/max that can drop a NaN in the second operand); subnormal results are kept
(XLA CPU flushes them to zero). Random bits: ``rng-bit-generator`` with a u64 state (TF's
stateless ops, Keras' Dropout and other seeded layers) gives XLA's Philox/ThreeFry bits exactly;
other states and ``rng`` are repeatable per seed but not XLA's bits.
"""

from device_server.emulator.arch import BOW, GC2, GC200, PRESETS, Target, get_target
from device_server.emulator.cancel import RunStopped, StopToken
from device_server.emulator.compiler import (
    CompileOptions,
    Executable,
    compile_module,
    executable_from_record,
)
from device_server.emulator.errors import (
    EmulatorError,
    ExecutionError,
    FloatingPointExceptionError,
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
    "RunStopped",
    "StopToken",
    "CompileOptions",
    "EmulatorError",
    "Estimate",
    "Executable",
    "ExecutionError",
    "FloatingPointExceptionError",
    "InvalidProgramError",
    "OutOfMemoryError",
    "Target",
    "UnsupportedOpError",
    "compile_module",
    "executable_from_record",
    "get_target",
    "layer_of",
]
