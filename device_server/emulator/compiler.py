"""Compiles an IR module into a flat list of steps that an interpreter runs with numpy.

Planning happens once, in :func:`compile_module`:

* dead code elimination (only what the root of each computation needs is kept);
* one slot per live value; ``get-tuple-element`` of a ``tuple``, ``copy``, ``opt-barrier``
  and ops that return their operand unchanged (same-shape ``reshape``/``bitcast``/
  ``convert``/``concatenate``/``slice``, identity ``transpose``/``broadcast``) reuse their
  operand's slot instead of running; a reshape of a reshape reshapes the first one's operand;
  a slice that takes one operand of a concatenate whole is that operand;
* a ``broadcast`` whose users are all element-wise ops that broadcast like numpy (and have
  another operand of the full shape) is not expanded: its operand, or a reshaped view of it,
  goes to the users (``_lazy_broadcasts``);
* constants, and instructions whose operands are all constants, are evaluated at compile time
  (constant folding);
* every other instruction becomes a step ``(kernel_fn, operand_slots, out_slot)`` whose
  kernel function was built by its factory from the registry
  (``device_server.emulator.kernels``); a kernel may also offer an inline expression
  (``kernels.inline``) and say it is a plain ufunc (``kernels.elementwise_ufunc``), so that a
  ufunc step may write into the buffer of an operand nobody else can see (``_reuse_buffers``);
* the steps become the source of one Python function per computation (``Program.source``):
  values are its locals, constants its globals, big values are deleted after their last use;
  a failing step is found from the traceback's line number, so the hot path keeps no counter;
* called computations (``while``, ``call``, ``conditional``, reducers, comparators, ...) are
  compiled the same way, once each, and handed to kernels as plain functions;
* an instruction with a dynamic dimension (bounded dynamic shapes) gets its kernel from
  ``dynamic.plan``: values are arrays of their run-time shape, and the opcode's kernel is
  planned per run-time shape. Forwarding, reshape chains, lazy broadcasts and buffer reuse
  leave such instructions alone (their sizes are not known at compile time).

At run time a program's function binds the arguments to locals and runs its steps: no shared
mutable state (the globals are read-only constants and kernels), so one :class:`Executable`
can run on several threads at once.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import keyword
import logging
import math
import re
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from device_server.emulator import cancel, dynamic, errors, fusion, jit, kernels, numerics, parallel
from device_server.emulator.arch import Target
from device_server.emulator.errors import (
    EmulatorError,
    ExecutionError,
    InvalidProgramError,
    OutOfMemoryError,
    UnsupportedOpError,
    describe,
)
from device_server.emulator.estimate import Estimate, estimate_module
from device_server.protocol import HOST_TARGETS, REPLICA_TARGETS, dtypes, ir_pb2

_FIXED_ARITY = {
    **dict.fromkeys(
        ("abs", "negate", "exponential", "exponential-minus-one", "log", "log-plus-one",
         "logistic", "sqrt", "rsqrt", "cbrt", "tanh", "sine", "cosine", "tan", "floor", "ceil",
         "round-nearest-afz", "round-nearest-even", "sign", "is-finite", "not", "popcnt",
         "count-leading-zeros", "erf", "real", "imag", "convert", "bitcast-convert",
         "reduce-precision", "copy", "reshape", "bitcast", "broadcast", "transpose", "slice",
         "reverse", "get-tuple-element", "get-dimension-size"),
        1,
    ),
    **dict.fromkeys(
        ("add", "subtract", "multiply", "divide", "remainder", "power", "maximum", "minimum",
         "atan2", "and", "or", "xor", "shift-left", "shift-right-logical",
         "shift-right-arithmetic", "compare", "complex", "dot", "pad", "convolution",
         "set-dimension-size"),
        2,
    ),
    **dict.fromkeys(("select", "clamp"), 3),
    **dict.fromkeys(("parameter", "constant", "iota"), 0),
}


def _arity(opcode: str) -> int | None:
    """The operand count an opcode must have, or None if it varies."""
    return _FIXED_ARITY.get(opcode)


# Words the generated code may contain besides names it defines and its globals.
_SAFE_WORDS = frozenset(keyword.kwlist) | {"run", "args", "e", "x", "Exception", "out", "d"}
_GENERATED = re.compile(r"(p|v|u|k|s)[0-9]+|g[0-9]+_[A-Za-z0-9_]+|[0-9][A-Za-z0-9_]*")

__all__ = ["CompileOptions", "Executable", "compile_module", "executable_from_record", "literal_to_value"]

_log = logging.getLogger(__name__)

# Kernel modules. The spatial ones (conv, window, indexing) are written separately and may be
# absent from a checkout; the rest are required.
_KERNEL_MODULES = ("elementwise", "shapes", "dot", "reduce", "control", "rng", "linalg", "norm", "fft",
                   "custom_linalg", "infeed", "collectives")
_OPTIONAL_KERNEL_MODULES = ("conv", "window", "indexing")


def _load_kernels() -> None:
    for name in _KERNEL_MODULES:
        importlib.import_module(f"device_server.emulator.kernels.{name}")
    for name in _OPTIONAL_KERNEL_MODULES:
        full = f"device_server.emulator.kernels.{name}"
        if importlib.util.find_spec(full) is not None:
            importlib.import_module(full)


_load_kernels()

# Opcodes never run, whatever the options say (none today). A ``custom-call`` runs only when
# its target is registered (``kernels.CUSTOM_CALLS``); any other target is refused.
ALWAYS_REFUSED: frozenset[str] = frozenset()
# Opcodes that are evaluated at compile time when all their operands are constants.
_NOT_FOLDABLE = frozenset({"rng", "rng-bit-generator", "rng-get-and-update-state", "infeed", "outfeed"})
# custom-call targets that talk to the host at run time (never folded, never dead code).
_RUN_TIME_TARGETS = HOST_TARGETS | REPLICA_TARGETS
_FOLD_LIMIT_BYTES = 16 << 20
# Ops that only pass their operand on (the value is immutable, so no copy is needed).
_FORWARDING = frozenset({"copy", "opt-barrier"})
# Binary ops of two parameters that a reducer may be, and their ufuncs.
_REDUCER_UFUNCS: dict[str, np.ufunc] = {
    "add": np.add,
    "multiply": np.multiply,
    "maximum": np.maximum,
    "minimum": np.minimum,
    "and": np.bitwise_and,
    "or": np.bitwise_or,
    "xor": np.bitwise_xor,
}
# Opcodes whose kernels work on any shape the same way (so a computation made only of these,
# written for scalars, may be called on whole arrays at once).
ELEMENTWISE_SAFE = frozenset(
    {
        "parameter", "constant", "tuple", "get-tuple-element", "abs", "add", "subtract",
        "multiply", "divide", "remainder", "power", "maximum", "minimum", "negate",
        "exponential", "exponential-minus-one", "log", "log-plus-one", "logistic", "sqrt",
        "rsqrt", "cbrt", "tanh", "sine", "cosine", "tan", "atan2", "floor", "ceil",
        "round-nearest-afz", "round-nearest-even", "sign", "is-finite", "not", "and", "or",
        "xor", "shift-left", "shift-right-logical", "shift-right-arithmetic", "popcnt", "count-leading-zeros",
        "erf", "select", "clamp", "compare", "convert", "copy", "real", "imag", "complex",
        "reduce-precision", "opt-barrier",
    }
)
# Opcodes whose result depends only on their operands, attributes and shape, and whose kernels
# never write into an operand: two such instructions with the same operands (slots) compute
# the same value, so the second uses the first's (common subexpressions, e.g. the optimizer's
# bias corrections, computed again for every variable an optimizer updates).
_CSE_OPCODES = (ELEMENTWISE_SAFE - {"parameter", "constant", "tuple", "get-tuple-element", "copy",
                                    "opt-barrier"}) | {"broadcast", "reshape", "transpose"}
# Constants up to this size are shared between instructions that hold the same value.
_CSE_CONST_BYTES = 1 << 12
# Element-wise opcodes a fused step may contain (fusion.py).
_FUSIBLE = ELEMENTWISE_SAFE - {"parameter", "constant", "tuple", "get-tuple-element", "copy", "opt-barrier"}


@dataclass(frozen=True)
class CompileOptions:
    """Options of :func:`compile_module`.

    ``refuse_opcodes``: opcodes to treat as unsupported (raises :class:`UnsupportedOpError`
    at compile time, as a real backend lacking them would).
    ``fault_inject_opcode``: a *test switch*: every result of this opcode is perturbed at
    run time (floats ``x * (1 + 1e-2) + 1e-3``, integers ``x + 1``, booleans negated), so
    tests can prove a comparison would catch a wrong kernel. Never set it in production.
    ``allow_out_of_memory``: compile even if the estimate does not fit the tile memory
    (Poplar's ``allowOutOfMemory``), so the estimate can be inspected.

    Numerics (``numerics.py``; all off by default):
    ``partials_type``: ``"float"`` (FP16 dot/convolution accumulate in FP32, the default) or
    ``"half"`` (an FP16 accumulator, rounded after every ``Target.amp_fp16_partials_chunk``
    products); ``matmul_partials_type`` / ``convolution_partials_type`` override it for
    ``dot`` / ``convolution`` ("" = ``partials_type``).
    ``esr``: stochastic rounding of FP32 -> FP16; ``stochastic_rounding_seed``: its seed
    (0: derived from the module).
    ``inv``, ``div0``, ``oflo``: floating-point exception checks after every floating-point
    instruction (:class:`FloatingPointExceptionError`); ``nanoo``: an FP16 overflow gives NaN.

    Planning (the estimate only): ``matmul_available_memory_proportion`` /
    ``convolution_available_memory_proportion``: PopLibs' availableMemoryProportion of the
    ``dot`` / ``convolution`` plans, 0 .. 1 (None: the preset's, 0.6); lower plans hold fewer
    temporaries per tile and cost as many cycles or more (``tiles/matmul.py``).

    Replication (``emulator/replicas.py``): ``replicas``: how many replicas run the program
    at once (1: not replicated); ``system``: the ``protocol.hardware.System`` whose IPUs run
    them (None: the target's IPUs without links), ``ipu_ids``: which of its IPUs, one per
    replica (empty: the first ``replicas``). The estimate charges the collectives over the
    system's IPU-Links and the host transfers over its shared host links.

    Pipelining (docs/tile_model.md): ``pipeline_stages`` S (1: not pipelined), the stage of
    each instruction in its ``pipeline_stage`` attribute; ``stage_ipus``: the IPU within a
    replica of each stage (Graphcore's device_mapping; empty: stage i on IPU i);
    ``ipus_per_replica``: the IPUs a replica spans; ``pipeline_schedule``: "grouped",
    "interleaved" or "sequential"; ``micro_batches``: the micro-batches of one weight
    update (gradient accumulation); ``recomputation``: the backward pass recomputes the
    forward activations. They change the estimate only: the program computes the same.
    """

    refuse_opcodes: frozenset[str] = frozenset()
    fault_inject_opcode: str = ""
    allow_out_of_memory: bool = False
    partials_type: str = "float"
    matmul_partials_type: str = ""
    convolution_partials_type: str = ""
    esr: bool = False
    stochastic_rounding_seed: int = 0
    inv: bool = False
    div0: bool = False
    oflo: bool = False
    nanoo: bool = False
    matmul_available_memory_proportion: float | None = None
    convolution_available_memory_proportion: float | None = None
    replicas: int = 1
    system: Any = None
    ipu_ids: tuple[int, ...] = ()
    pipeline_stages: int = 1
    stage_ipus: tuple[int, ...] = ()
    ipus_per_replica: int = 1
    pipeline_schedule: str = "grouped"
    micro_batches: int = 1
    recomputation: bool = False
    optimizer_state_offload: str = "auto"    # "auto" | "on" | "off" (pipeline.placement)
    optimizer_state_sharding: bool = False

    def memory_proportions(self) -> dict[str, float]:
        """Opcode -> availableMemoryProportion of the options that set one (checked)."""
        out = {}
        for opcode, name in (("dot", "matmul_available_memory_proportion"),
                             ("convolution", "convolution_available_memory_proportion")):
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
                raise ValueError(f"CompileOptions.{name} must be a number in [0, 1] (PopLibs' "
                                 f"availableMemoryProportion), not {value!r}.")
            out[opcode] = float(value)
        return out

    def partials_types(self) -> dict[str, str]:
        """Opcode -> the partialsType its products are planned with ("float" or "half")."""
        return {"dot": self.matmul_partials_type or self.partials_type,
                "convolution": self.convolution_partials_type or self.partials_type}

    def numerics(self, target: Target) -> numerics.Numerics:
        """The numerics these options ask for on ``target``."""
        kinds = {}
        for name, value in (("partials_type", self.partials_type),
                            ("matmul_partials_type", self.matmul_partials_type or self.partials_type),
                            ("convolution_partials_type", self.convolution_partials_type or self.partials_type)):
            if value not in ("float", "half"):
                raise ValueError(f"CompileOptions.{name} must be 'float' or 'half', not {value!r}.")
            kinds[name] = value
        return numerics.Numerics(
            matmul_partials=kinds["matmul_partials_type"],
            conv_partials=kinds["convolution_partials_type"],
            partials_chunk=target.amp_fp16_partials_chunk,
            esr=bool(self.esr), inv=bool(self.inv), div0=bool(self.div0), oflo=bool(self.oflo),
            nanoo=bool(self.nanoo), seed=int(self.stochastic_rounding_seed),
        )


# ------------------------------------------------------------------------------ values


def _shape_of(shape: ir_pb2.Shape) -> tuple[np.dtype | None, tuple[int, ...]]:
    if shape.is_tuple or shape.dtype == ir_pb2.TOKEN:
        return None, ()
    return dtypes.to_numpy(shape.dtype), tuple(int(d) for d in shape.dims)


def _leaves(shape: ir_pb2.Shape) -> list[ir_pb2.Shape]:
    if shape.is_tuple:
        return [leaf for s in shape.tuple_shapes for leaf in _leaves(s)]
    return [shape]


def _fits(shape: tuple[int, ...], bounds: tuple[int, ...], flags: tuple[bool, ...]) -> bool:
    """Whether an array of ``shape`` is a value of a shape with these bounds and dynamic
    dimensions (a dynamic dimension's size is at most its bound, a static one's is equal)."""
    return len(shape) == len(bounds) and all(
        n == b or (dy and n <= b) for n, b, dy in zip(shape, bounds, flags, strict=True)
    )


def literal_to_value(lit: ir_pb2.Literal, what: str = "literal") -> Any:
    """A read-only numpy array (or a tuple of them) holding an IR literal's value."""
    if lit.shape.is_tuple:
        return tuple(literal_to_value(e, what) for e in lit.tuple_elements)
    if lit.shape.dtype == ir_pb2.TOKEN:
        return ()
    dt = dtypes.to_numpy(lit.shape.dtype)
    dims = tuple(int(d) for d in lit.shape.dims)
    count = int(np.prod(dims, dtype=np.int64))
    if len(lit.data) != count * dt.itemsize:
        raise InvalidProgramError(
            f"{what}: {dtypes.dtype_name(lit.shape.dtype)}{list(dims)} needs "
            f"{count * dt.itemsize} bytes, literal has {len(lit.data)}."
        )
    arr = np.frombuffer(lit.data, dtype=dt.newbyteorder("<")).astype(dt, copy=False).reshape(dims)
    arr.flags.writeable = False
    return arr


def _freeze(value: Any) -> Any:
    if isinstance(value, np.ndarray) and value.flags.writeable:
        value = value.view()
        value.flags.writeable = False
    elif isinstance(value, tuple):
        value = tuple(_freeze(v) for v in value)
    return value


def _nbytes(value: Any) -> int:
    if isinstance(value, tuple):
        return sum(_nbytes(v) for v in value)
    return int(getattr(value, "nbytes", 0))


# --------------------------------------------------------------------------- fault injection


def _perturb(value: Any) -> Any:
    if isinstance(value, tuple):
        return tuple(_perturb(v) for v in value)
    a = np.asarray(value)
    if a.dtype == np.bool_:
        return np.logical_not(a)
    if a.dtype.kind in "iu":
        return (a + np.ones((), a.dtype)).astype(a.dtype)
    if a.dtype.kind in "fcV" or a.dtype.name == "bfloat16":
        return (a * a.dtype.type(1.01) + a.dtype.type(1e-3)).astype(a.dtype)
    return a


def _faulty(fn: Callable[[Sequence[Any]], Any]) -> Callable[[Sequence[Any]], Any]:
    def run(ops: Sequence[Any]) -> Any:
        return _perturb(fn(ops))

    return run


# ---------------------------------------------------------------------------- the program


class Program:
    """One compiled computation: call it with its parameters' values.

    The steps are turned into the source of one Python function (``source``): every value
    is a local variable, constants are globals of that function, and a step is either a
    call of its kernel function (``v7 = k7([v3, c5])``) or, when the kernel offers one
    (see ``kernels.inline``), an expression (``v7 = (v3 + s5)``). A failing step is found
    from the line number of the traceback, so the hot path carries no bookkeeping.
    """

    __slots__ = ("name", "steps", "instrs", "source", "root_slot", "_call")

    def __init__(
        self,
        name: str,
        steps: list[_Step],
        instrs: list[ir_pb2.Instruction],
        consts: dict[int, Any],
        param_slots: list[int],
        root_slot: int,
        big_slots: frozenset[int] = frozenset(),
        scalar_params: frozenset[int] = frozenset(),
    ) -> None:
        self.name = name
        self.steps = tuple(steps)
        self.instrs = instrs  # instrs[k] made steps[k]; for error messages
        self.root_slot = root_slot
        self.source, self._call = _generate(name, self.steps, instrs, consts, param_slots,
                                            root_slot, big_slots, scalar_params)

    def __call__(self, args: Sequence[Any], donated: frozenset[int] = frozenset()) -> Any:
        """Runs the computation; ``donated``: entry parameters whose buffers it may write
        its aliased outputs into (``mark_donations``)."""
        return self._call(args, donated)


@dataclass
class _Step:
    """One step: ``out = fn(ops)``, or ``out = <template formatted with the operands>``."""

    fn: Callable[[Sequence[Any]], Any]
    ins: tuple[int, ...]
    out: int
    template: str | None = None          # an inline expression, see kernels.inline
    names: dict[str, Any] | None = None  # globals the template refers to
    into: int = -1                       # >= 0: ``fn.ufunc(*ops, out=ops[into])``
    # >= 0: a fused step writing the value of an entry parameter that the caller donates
    # (an aliased variable) may write into that operand's buffer: ``fn(ops, ops[donate])``.
    donate: int = -1
    donate_param: int = -1                # the entry parameter number of ops[donate]


_FIRST_STEP_LINE = 4  # line of the first step in the generated source (1-based)


def _generate(
    name: str,
    steps: tuple[_Step, ...],
    instrs: list[ir_pb2.Instruction],
    consts: dict[int, Any],
    param_slots: list[int],
    root_slot: int,
    big_slots: frozenset[int],
    scalar_params: frozenset[int],
) -> tuple[str, Callable[[Sequence[Any]], Any]]:
    g: dict[str, Any] = {}
    var: dict[int, str] = {}
    scalar_var: dict[int, str] = {}
    for slot, value in consts.items():
        var[slot] = f"c{slot}"
        g[var[slot]] = value
        if isinstance(value, np.ndarray) and value.ndim == 0 and value.dtype.kind in "biufc":
            scalar_var[slot] = f"s{slot}"
            g[scalar_var[slot]] = value[()]
    for n, slot in enumerate(param_slots):
        var[slot] = f"p{n}"
    for k, st in enumerate(steps):
        var[st.out] = f"v{k}"

    # Big values are dropped after their last use (the others live until the call ends).
    last_use: dict[int, int] = {}
    for k, st in enumerate(steps):
        for s in st.ins:
            if s in big_slots:
                last_use[s] = k
    dels: list[list[str]] = [[] for _ in steps]
    for s, k in last_use.items():
        if s != root_slot and s not in consts:
            dels[k].append(var[s])

    lines = ["def run(args, d=()):"]
    if param_slots:
        # Scalar parameters become numpy scalars: arithmetic on 0-d arrays is much slower.
        unpack = ", ".join(var[s] for s in param_slots) + ", = args"
        scalars = [var[s] for s in param_slots if s in scalar_params]
        if scalars:
            unpack += "; " + "; ".join(f"{v} = {v}[()]" for v in scalars)
        lines.append("    " + unpack)
    else:
        lines.append("    () = args")
    lines.append("    try:")
    assert len(lines) == _FIRST_STEP_LINE - 1
    for k, st in enumerate(steps):
        if st.into >= 0:
            g[f"u{k}"] = st.fn.ufunc  # type: ignore[attr-defined]
            ops = [var[s] for s in st.ins]
            expr = f"u{k}({', '.join(ops)}, out={ops[st.into]})"
        elif st.template is not None:
            ops = [scalar_var.get(s, var[s]) for s in st.ins]
            names = {}
            for key, value in (st.names or {}).items():
                names[key] = f"g{k}_{key}"
                g[names[key]] = value
            expr = st.template.format(*ops, **names)
        elif st.donate >= 0:
            g[f"k{k}"] = st.fn
            ops = [var[s] for s in st.ins]
            expr = (f"k{k}([{', '.join(ops)}], {ops[st.donate]} if {st.donate_param} in d "
                    f"else None)")
        else:
            g[f"k{k}"] = st.fn
            expr = f"k{k}([{', '.join(var[s] for s in st.ins)}])"
        line = f"        {var[st.out]} = {expr}"
        if dels[k]:
            line += "; del " + ", ".join(dels[k])
        lines.append(line)
    if not steps:
        lines.append("        pass")
    lines.append("    except Exception as e:")
    lines.append("        x = fail(e)")
    lines.append("        if x is None:")
    lines.append("            raise")
    lines.append("        raise x from e")
    lines.append(f"    return {var[root_slot]}")
    source = "\n".join(lines) + "\n"

    def fail(e: Exception) -> Exception | None:
        tb = e.__traceback__
        k = -1 if tb is None else tb.tb_lineno - _FIRST_STEP_LINE
        if not 0 <= k < len(instrs) or isinstance(e, cancel.RunStopped):
            return None
        if isinstance(e, EmulatorError):
            if "while running" not in str(e):
                return type(e)(f"{e} (while running {describe(instrs[k])})")
            return None
        return ExecutionError(
            f"{describe(instrs[k])} in computation '{name}' failed: {type(e).__name__}: {e}"
        )

    g["fail"] = fail
    # The generated source holds only names we made (p0, v12, u3, g4_axis) and templates
    # written in the kernels: no text from the program (names, attributes, constants) ever
    # becomes code; values reach the function through its globals. Guard that here.
    for ident in re.findall(r"(?<![.\w])[A-Za-z_]\w*", re.sub(r"\b\w+=(?!=)", "", source)):
        if ident not in _SAFE_WORDS and not _GENERATED.fullmatch(ident) and ident not in g:
            raise InvalidProgramError(f"internal: unexpected name {ident!r} in generated code")
    code = compile(source, f"<emulator computation '{name}'>", "exec")
    exec(code, g)
    return source, g["run"]


class _Context:
    """The ``KernelContext`` handed to kernel factories (see ``kernels/__init__.py``)."""

    def __init__(self, compiler: _Compiler, instr: ir_pb2.Instruction, operands: list[ir_pb2.Instruction]) -> None:
        self._compiler = compiler
        self.instr = instr
        self.out_dtype, self.out_shape = _shape_of(instr.shape)
        self.operand_dtypes = []
        self.operand_shapes = []
        for op in operands:
            dt, shape = _shape_of(op.shape)
            self.operand_dtypes.append(dt)
            self.operand_shapes.append(shape)
        self.operand_ir_shapes = [op.shape for op in operands]
        self.operand_instrs = operands
        self.numerics = compiler.numerics
        self.out_dynamic = dynamic.dynamic_flags(instr.shape)
        self.operand_dynamic = [dynamic.dynamic_flags(op.shape) for op in operands]
        # Whether a dimension of the result or of an operand is dynamic (see dynamic.py).
        self.dynamic = dynamic.has_dynamic(instr.shape) or any(dynamic.has_dynamic(op.shape) for op in operands)
        self.in_place = instr.id in compiler.in_place

    def error(self, message: str) -> InvalidProgramError:
        """An :class:`InvalidProgramError` naming this instruction."""
        return InvalidProgramError(f"{describe(self.instr)}: {message}")

    def attr(self, name: str, default: Any = ...) -> Any:
        if name not in self.instr.attrs:
            if default is ...:
                raise self.error(f"missing attribute '{name}'.")
            return default
        v = self.instr.attrs[name]
        kind = v.WhichOneof("value")
        if kind == "ints":
            return tuple(int(x) for x in v.ints.values)
        if kind == "floats":
            return tuple(float(x) for x in v.floats.values)
        if kind == "strings":
            return tuple(v.strings.values)
        if kind == "literal":
            return literal_to_value(v.literal, describe(self.instr))
        if kind is None:
            if default is ...:
                raise self.error(f"attribute '{name}' has no value.")
            return default
        return getattr(v, kind)

    def _callee(self, index: int) -> ir_pb2.Computation:
        if not 0 <= index < len(self.instr.called_computations):
            raise self.error(f"has no called computation #{index}.")
        return self._compiler.computation_ir(self.instr.called_computations[index], self.instr)

    def computation(self, index: int) -> Callable[[Sequence[Any]], Any]:
        comp = self._callee(index)
        return self._compiler.program(comp.id, self.instr)._call  # skip one call level

    def computation_ir(self, index: int) -> ir_pb2.Computation:
        """The IR of the index-th called computation (for kernels that pattern-match it)."""
        return self._callee(index)

    def in_place_slots(self, index: int) -> tuple[tuple[int, ...], ...]:
        return self._compiler.mark_in_place(self._callee(index))

    def is_elementwise(self, index: int) -> bool:
        """Whether the index-th called computation only uses shape-agnostic element-wise
        ops, so that it may be called on whole arrays instead of scalars."""
        comp = self._callee(index)
        return all(
            i.opcode in ELEMENTWISE_SAFE and not i.called_computations
            and (i.opcode != "constant" or not i.shape.dims)
            for i in comp.instructions
        )

    def reducer_ufunc(self, index: int) -> np.ufunc | None:
        comp = self._callee(index)
        by_id = {i.id: i for i in comp.instructions}
        root = by_id.get(comp.root_id)
        if root is None or root.opcode not in _REDUCER_UFUNCS or len(root.operands) != 2:
            return None
        if self._compiler.options.fault_inject_opcode == root.opcode:
            return None
        ops = [by_id.get(o) for o in root.operands]
        if any(o is None or o.opcode != "parameter" for o in ops):
            return None
        if sorted(o.parameter_number for o in ops) != [0, 1]:
            return None
        return _REDUCER_UFUNCS[root.opcode]


class _Compiler:
    def __init__(self, module: ir_pb2.Module, options: CompileOptions,
                 numerics_: numerics.Numerics | None = None) -> None:
        self.module = module
        self.options = options
        self.numerics = numerics_ or numerics.Numerics()
        self.comps = {c.id: c for c in module.computations}
        if not self.numerics.checks and options.fault_inject_opcode not in (
                "add", "dynamic-update-slice", "dynamic-slice"):
            next_id = [1 + max((i.id for c in module.computations for i in c.instructions), default=0)]
            self.comps = {k: _add_into_slice(c, next_id) for k, c in self.comps.items()}
        self.programs: dict[int, Program] = {}
        self.in_progress: set[int] = set()
        self.live: dict[int, list[ir_pb2.Instruction]] = {}
        # dynamic-update-slice instructions that write into their operand (mark_in_place).
        self.in_place: set[int] = set()
        self.in_place_paths: dict[int, tuple[tuple[int, ...], ...]] = {}  # body id -> paths
        self.callers: dict[int, int] = {}  # computation id -> instructions that call it
        for c in module.computations:
            for i in c.instructions:
                for callee in i.called_computations:
                    self.callers[callee] = self.callers.get(callee, 0) + 1
        self.repeated = _loop_bodies(module)

    def mark_in_place(self, body: ir_pb2.Computation) -> tuple[tuple[int, ...], ...]:
        """The loop-state elements (paths of tuple indices: a TensorList is itself a tuple of
        buffer and size) that ``body`` reads once, only to update them with a
        dynamic-update-slice whose result goes back to the same place in its result and
        nowhere else (a TensorArray written one step per iteration). Those updates are marked
        to write in place: XLA updates such buffers in place too, and copying them each
        iteration makes a loop of n steps cost n^2. Only for a body that this loop alone
        calls and that is not compiled yet. The same answer every time it is asked (a loop
        planned again for run-time shapes must copy what the compiled body updates)."""
        if body.id not in self.in_place_paths:
            self.in_place_paths[body.id] = () if body.id in self.programs else self._find_in_place(body)
        return self.in_place_paths[body.id]

    def _find_in_place(self, body: ir_pb2.Computation) -> tuple[tuple[int, ...], ...]:
        if self.callers.get(body.id, 0) != 1 \
                or self.options.fault_inject_opcode in ("dynamic-update-slice", "get-tuple-element", "tuple"):
            return ()
        live = self.live_instructions(body)
        by_id = {i.id: i for i in live}
        params = [i for i in live if i.opcode == "parameter"]
        root = by_id.get(body.root_id)
        if len(params) != 1 or not params[0].shape.is_tuple or root is None or root.opcode != "tuple":
            return ()
        users: dict[int, list[ir_pb2.Instruction]] = {}
        for i in live:
            for o in i.operands:
                users.setdefault(o, []).append(i)

        def index(g: ir_pb2.Instruction) -> int:
            return int(g.attrs["index"].i) if "index" in g.attrs else 0

        paths: list[tuple[int, ...]] = []
        order = {i.id: n for n, i in enumerate(live)}  # the order the steps run in

        def walk(value: ir_pb2.Instruction, path: tuple[int, ...]) -> None:
            """Follows the tuple-shaped ``value`` (read at ``path`` of the state) to its
            elements; marks the updates that qualify."""
            reads = users.get(value.id, [])
            if any(u.opcode != "get-tuple-element" for u in reads):
                return  # the whole tuple is read: its buffers are seen elsewhere
            by_index: dict[int, list[ir_pb2.Instruction]] = {}
            for g in reads:
                by_index.setdefault(index(g), []).append(g)
            for k, gs in sorted(by_index.items()):
                where = (*path, k)
                if any(g.shape.is_tuple for g in gs):
                    if len(gs) == 1:
                        walk(gs[0], where)
                    continue
                ids = {g.id for g in gs}
                us = [u for g in gs for u in users.get(g.id, [])]
                upd = [u for u in us if u.opcode == "dynamic-update-slice" and u.operands[0] in ids]
                if len(upd) != 1 or sum(o in ids for o in upd[0].operands) != 1 \
                        or dynamic.has_dynamic(upd[0].shape):
                    continue
                # Other readers may only be dynamic slices (copies) that run before the update
                # (steps run in program order).
                if any(u is not upd[0] and (u.opcode != "dynamic-slice" or u.operands[0] not in ids
                                            or sum(o in ids for o in u.operands) != 1
                                            or order[u.id] > order[upd[0].id]) for u in us):
                    continue
                if self._returns_to(upd[0], where, root, users):
                    self.in_place.add(upd[0].id)
                    paths.append(where)

        walk(params[0], ())
        return tuple(paths)

    @staticmethod
    def _returns_to(value: ir_pb2.Instruction, path: tuple[int, ...], root: ir_pb2.Instruction,
                    users: dict[int, list[ir_pb2.Instruction]]) -> bool:
        """Whether ``value`` reaches the body's result at ``path`` through tuples (and
        reshapes to the same shape) only, once, and is read by nothing else on the way."""
        for depth in range(len(path) - 1, -1, -1):
            us = users.get(value.id, [])
            while len(us) == 1 and us[0].opcode in ("reshape", "bitcast") \
                    and us[0].shape.SerializeToString() == value.shape.SerializeToString():
                value, us = us[0], users.get(us[0].id, [])  # a reshape to the same shape
            if len(us) != 1 or us[0].opcode != "tuple":
                return False
            if [j for j, o in enumerate(us[0].operands) if o == value.id] != [path[depth]]:
                return False
            value = us[0]
            if depth == 0:
                return value is root
        return False

    def computation_ir(self, comp_id: int, user: ir_pb2.Instruction | None = None) -> ir_pb2.Computation:
        comp = self.comps.get(comp_id)
        if comp is None:
            where = describe(user) if user is not None else f"module '{self.module.name}'"
            raise InvalidProgramError(f"{where}: computation {comp_id} does not exist.")
        return comp

    def live_instructions(self, comp: ir_pb2.Computation) -> list[ir_pb2.Instruction]:
        """Instructions the root depends on, in program order (dead code removed)."""
        if comp.id in self.live:
            return self.live[comp.id]
        by_id: dict[int, ir_pb2.Instruction] = {}
        for instr in comp.instructions:
            for op in instr.operands:
                if op not in by_id:
                    raise InvalidProgramError(
                        f"{describe(instr)} in computation '{comp.name}': operand {op} is not "
                        f"an earlier instruction of the computation."
                    )
            if instr.id in by_id:
                raise InvalidProgramError(f"computation '{comp.name}': duplicate instruction id {instr.id}.")
            _check_dims(instr, instr.shape)
            by_id[instr.id] = instr
        if comp.root_id not in by_id:
            raise InvalidProgramError(f"computation '{comp.name}': root {comp.root_id} does not exist.")
        needed = {comp.root_id} | {i.id for i in comp.instructions if _talks_to_host(i)}
        for instr in reversed(comp.instructions):
            if instr.id in needed:
                needed.update(instr.operands)
        # Parameters stay even when unused: they fix the computation's arity.
        live = [i for i in comp.instructions if i.id in needed or i.opcode == "parameter"]
        self.live[comp.id] = live
        return live

    def check_supported(self, entry: ir_pb2.Computation) -> None:
        """Raises one UnsupportedOpError listing every live instruction nobody can run."""
        bad: list[str] = []
        seen: set[int] = set()
        stack = [entry.id]
        while stack:
            cid = stack.pop()
            if cid in seen:
                continue
            seen.add(cid)
            live = self.live_instructions(self.computation_ir(cid))
            shapes = {i.id: i.shape for i in live}
            for instr in live:
                op = instr.opcode
                if op in ALWAYS_REFUSED:
                    why = "never runs on the device"
                elif op in self.options.refuse_opcodes:
                    why = "refused by the compile options"
                elif op not in kernels.REGISTRY:
                    why = "has no emulator kernel"
                elif op == "custom-call" and not kernels.custom_call_supported(instr):
                    why = f"target '{kernels.custom_call_target(instr)}' has no emulator kernel"
                elif not dynamic.handles(op) and (
                    dynamic.has_dynamic(instr.shape)
                    or any(dynamic.has_dynamic(shapes[o]) for o in instr.operands)
                ):
                    why = "has no emulator kernel for dynamic dimensions"
                else:
                    stack.extend(instr.called_computations)
                    continue
                bad.append(f"opcode '{op}' ({why}): {describe(instr)}")
        if bad:
            more = f" (and {len(bad) - 10} more)" if len(bad) > 10 else ""
            raise UnsupportedOpError(
                f"Unsupported op on the IPU emulator: {bad[0]}"
                + ("" if len(bad) == 1 else "; also " + "; ".join(bad[1:10]) + more)
            )

    def program(self, comp_id: int, user: ir_pb2.Instruction | None = None) -> Program:
        if comp_id in self.programs:
            return self.programs[comp_id]
        comp = self.computation_ir(comp_id, user)
        if comp_id in self.in_progress:
            raise InvalidProgramError(f"computation '{comp.name}' calls itself.")
        self.in_progress.add(comp_id)
        prog = self._compile(comp)
        self.in_progress.discard(comp_id)
        self.programs[comp_id] = prog
        return prog

    def _compile(self, comp: ir_pb2.Computation) -> Program:
        live = self.live_instructions(comp)
        by_id = {i.id: i for i in live}
        slot_of: dict[int, int] = {}
        template: list[Any] = []
        is_const: list[bool] = []
        params: dict[int, int] = {}
        raw_steps: list[tuple[_Step, ir_pb2.Instruction]] = []
        fault = self.options.fault_inject_opcode
        lazy = _lazy_broadcasts(live, by_id, comp.root_id, fault)
        reshaped: dict[int, tuple[int, tuple[int, ...]]] = {}  # reshape id -> (source slot, dims)
        slot_dims: dict[int, tuple[int, ...] | None] = {}  # slot -> its value's shape (None: tuple)
        slot_dtypes: dict[int, np.dtype | None] = {}  # slot -> its value's dtype (None: tuple)
        # Common subexpressions (_CSE_OPCODES) and equal small constants share one slot. Not
        # with instrumented numerics (stochastic rounding draws per instruction) or a fault
        # injected (it targets instructions, not values).
        cse = not self.numerics.active and not fault
        seen_values: dict[tuple, int] = {}

        def const_slot(value: Any) -> int:
            key = None
            if cse and isinstance(value, np.ndarray) and value.nbytes <= _CSE_CONST_BYTES \
                    and value.dtype.kind in "biufc":
                key = ("const", value.dtype.str, value.shape, value.tobytes())
                if key in seen_values:
                    return seen_values[key]
            slot = new_slot(value, const=True)
            if key is not None:
                seen_values[key] = slot
            return slot

        def new_slot(value: Any = None, const: bool = False, shape: ir_pb2.Shape | None = None) -> int:
            template.append(value)
            is_const.append(const)
            slot = len(template) - 1
            if shape is not None:  # None: a tuple, or run-time sizes (never fused)
                slot_dims[slot] = None if shape.is_tuple or dynamic.has_dynamic(shape) else _shape_of(shape)[1]
                slot_dtypes[slot] = None if shape.is_tuple else _shape_of(shape)[0]
            else:
                slot_dims[slot] = None if isinstance(value, tuple) else tuple(np.shape(value))
                slot_dtypes[slot] = None if isinstance(value, tuple) else np.asarray(value).dtype
            return slot

        for instr in live:
            op = instr.opcode
            operands = [by_id[o] for o in instr.operands]
            expected = _arity(op)
            if expected is not None and len(operands) != expected:
                raise InvalidProgramError(
                    f"{describe(instr)}: opcode '{op}' takes {expected} operand(s), "
                    f"received {len(operands)}."
                )
            in_slots = tuple(slot_of[o] for o in instr.operands)
            fold_fn = None
            dyn = dynamic.has_dynamic(instr.shape) or any(dynamic.has_dynamic(o.shape) for o in operands)
            if op == "parameter":
                n = instr.parameter_number
                if n in params:
                    raise InvalidProgramError(f"computation '{comp.name}': two parameters numbered {n}.")
                params[n] = slot_of[instr.id] = new_slot(shape=instr.shape)
                continue
            if op == "constant" and op != fault:
                if "value" not in instr.attrs:
                    raise InvalidProgramError(f"{describe(instr)}: constant without a 'value' attribute.")
                value = literal_to_value(instr.attrs["value"].literal, describe(instr))
                self._check_shape(instr, value)
                slot_of[instr.id] = const_slot(value)
                continue
            if op != fault:
                if (op in _FORWARDING and len(in_slots) == 1) or _is_identity(instr, operands):
                    slot_of[instr.id] = in_slots[0]
                    continue
                if op == "slice" and operands[0].opcode == "concatenate" \
                        and operands[0].opcode != fault:
                    # A slice that takes one operand of a concatenate whole is that operand
                    # (XLA's simplifier does the same): the index vectors a dynamic-slice's
                    # starts are built into and taken out of again in every loop step.
                    picked = _sliced_operand(instr, operands[0], by_id)
                    if picked is not None:
                        slot_of[instr.id] = slot_of[picked]
                        if picked in reshaped:
                            reshaped[instr.id] = reshaped[picked]
                        continue
                if op == "get-tuple-element" and operands[0].opcode == "tuple" \
                        and operands[0].opcode != fault:
                    idx = int(instr.attrs["index"].i) if "index" in instr.attrs else 0
                    src = operands[0].operands
                    if not 0 <= idx < len(src):
                        raise InvalidProgramError(f"{describe(instr)}: tuple index {idx} out of range.")
                    slot_of[instr.id] = slot_of[src[idx]]
                    continue
            if op in ("reshape", "bitcast") and op != fault and not instr.shape.is_tuple and not dyn \
                    and operands[0].id in reshaped and operands[0].shape.dtype == instr.shape.dtype:
                # A reshape of a reshape: one reshape of the first one's operand (or nothing).
                src_slot, src_dims = reshaped[operands[0].id]
                dims = tuple(int(d) for d in instr.shape.dims)
                reshaped[instr.id] = (src_slot, src_dims)
                if dims == src_dims:
                    slot_of[instr.id] = src_slot
                    continue
                in_slots = (src_slot,)
                fn = _reshaper(dims)
            elif instr.id in lazy:
                # Broadcast only into element-wise ops that broadcast like numpy: pass the
                # operand on (trailing dimensions), or a reshaped view of it.
                expanded = lazy[instr.id]
                if expanded is None:
                    slot_of[instr.id] = in_slots[0]
                    continue
                fn = _reshaper(expanded)
            else:
                if op in ("reshape", "bitcast") and op != fault and not instr.shape.is_tuple \
                        and not operands[0].shape.is_tuple and not dyn \
                        and operands[0].shape.dtype == instr.shape.dtype:
                    reshaped[instr.id] = (in_slots[0], tuple(int(d) for d in operands[0].shape.dims))
                ctx = _Context(self, instr, operands)
                try:
                    fn = self._kernel(ctx)
                except EmulatorError:
                    raise
                except Exception as e:
                    raise InvalidProgramError(f"{describe(instr)}: cannot compile: {type(e).__name__}: {e}") from e
                if self.numerics.active:
                    fold_fn = fn  # constants are folded with the default numerics
                    fn = self.numerics.instrument(
                        instr, fn, ctx.out_dtype, ctx.operand_dtypes, ctx.operand_shapes,
                        ctx.out_shape, lambda i=instr, o=operands: self._f32_kernel(i, o),
                    )
            if op == fault:
                fn = _faulty(fn)
            foldable = (
                op != fault and op not in _NOT_FOLDABLE and all(is_const[s] for s in in_slots)
                and op not in ("while", "conditional", "call")  # keep loops out of compile time
                and not (op == "custom-call"
                         and kernels.custom_call_target(instr) in _RUN_TIME_TARGETS)
            )
            if foldable:
                try:
                    with np.errstate(all="ignore"):
                        value = (fold_fn or fn)([template[s] for s in in_slots])
                except Exception as e:
                    raise InvalidProgramError(
                        f"{describe(instr)}: failed on constant operands: {type(e).__name__}: {e}"
                    ) from e
                if _nbytes(value) <= _FOLD_LIMIT_BYTES or _is_view(value):
                    if instr.id in lazy:
                        value = np.asarray(value)
                    else:
                        self._check_shape(instr, value)
                    slot_of[instr.id] = const_slot(_freeze(value))
                    continue
            key = None
            if cse and op in _CSE_OPCODES and instr.id not in lazy and not dyn:
                key = (op, in_slots, instr.shape.SerializeToString(deterministic=True),
                       tuple(sorted((k, v.SerializeToString(deterministic=True))
                                    for k, v in instr.attrs.items())))
                if key in seen_values:
                    slot_of[instr.id] = seen_values[key]
                    continue
            out = new_slot(shape=instr.shape)
            if key is not None:
                seen_values[key] = out
            if instr.id in lazy and lazy[instr.id] is not None:
                slot_dims[out] = lazy[instr.id]
            slot_of[instr.id] = out
            inline = getattr(fn, "inline", None)
            step = _Step(fn, in_slots, out, *(inline if inline is not None else (None, None)))
            raw_steps.append((step, instr))

        if comp.root_id not in slot_of:
            raise InvalidProgramError(f"computation '{comp.name}': root was not compiled.")
        root_slot = slot_of[comp.root_id]
        n_params = len(params)
        if sorted(params) != list(range(n_params)):
            raise InvalidProgramError(
                f"computation '{comp.name}': parameter numbers {sorted(params)} are not 0..{n_params - 1}."
            )
        # Steps that rewriting (reshape chains) left without users.
        raw_steps = _used_steps(raw_steps, root_slot)
        consts_now = {s: v for s, (v, c) in enumerate(zip(template, is_const, strict=True)) if c}
        raw_steps = self._fuse(raw_steps, slot_dims, slot_dtypes, consts_now, root_slot,
                               small=comp.id in self.repeated, new_slot=new_slot)
        raw_steps = _dots_into_fused(raw_steps, root_slot, slot_dims, slot_dtypes)
        _reuse_buffers(raw_steps, root_slot)
        # A program with a loop may be stopped inside it (cancel.py): it then must not have
        # written into its donated buffers already.
        if (comp.id == self.module.entry_computation_id and self.module.aliases
                and not any(i.opcode == "while" for _, i in raw_steps)):
            _mark_donations(raw_steps, by_id[comp.root_id], root_slot, params, slot_dims,
                            {int(a.output_index): int(a.parameter_number)
                             for a in self.module.aliases})
        param_instrs = [i for i in live if i.opcode == "parameter"]
        big = frozenset(
            step.out for step, instr in raw_steps if _static_nbytes(instr.shape) >= _DROP_BYTES
        ) | frozenset(
            params[i.parameter_number] for i in param_instrs if _static_nbytes(i.shape) >= _DROP_BYTES
        )
        consts = {s: v for s, (v, c) in enumerate(zip(template, is_const, strict=True)) if c}
        scalar_params = frozenset(
            params[i.parameter_number] for i in param_instrs
            if not i.shape.is_tuple and i.shape.dtype != ir_pb2.TOKEN and not i.shape.dims
        )
        return Program(
            comp.name, [st for st, _ in raw_steps], [i for _, i in raw_steps], consts,
            [params[n] for n in range(n_params)], root_slot, big, scalar_params,
        )

    def _fuse(self, steps: list[tuple[_Step, ir_pb2.Instruction]], dims: dict[int, tuple[int, ...] | None],
              slot_dtypes: dict[int, np.dtype | None], consts: dict[int, Any],
              root_slot: int, small: bool = False,
              new_slot: Callable[[], int] | None = None) -> list[tuple[_Step, ir_pb2.Instruction]]:
        """Replaces groups of element-wise steps over big arrays by one fused step each
        (``fusion.py``); with ``small`` (a loop body, whose steps run once per iteration),
        also groups of compiled element-wise steps over small arrays (``_fuse_small``).
        Not with numerics on (their checks follow each instruction)."""
        if self.numerics.active:
            return steps
        fault = self.options.fault_inject_opcode
        use_jit = jit.enabled()
        exprs: list[str | None] = []  # each step's compiled form (jit.py), if it has one
        for st, i in steps:
            ok = use_jit and i.opcode in _FUSIBLE and i.opcode != fault and not i.shape.is_tuple
            exprs.append(jit.expression(
                i.opcode, {k: i.attrs[k].s for k in ("direction", "compare_type") if k in i.attrs},
                [slot_dtypes.get(s) for s in st.ins], _shape_of(i.shape)[0],
            ) if ok else None)
        fusible = [
            i.opcode in _FUSIBLE and i.opcode != fault and not i.shape.is_tuple
            and (st.template is not None or getattr(st.fn, "ufunc", None) is not None
                 or expr is not None)
            for (st, i), expr in zip(steps, exprs, strict=True)
        ]
        groups = fusion.plan_groups([st.ins for st, _ in steps], [st.out for st, _ in steps],
                                    fusible, dims, {root_slot})
        small_at: dict[int, list[tuple[_Step, ir_pb2.Instruction]]] = {}
        if small and new_slot is not None and use_jit:
            small_at = self._fuse_small(steps, exprs, {m for g in groups for m in g.members},
                                        dims, slot_dtypes, consts, root_slot, new_slot)
        if not groups and not small_at:
            return steps
        roots = {g.members[-1]: g for g in groups}
        absorbed = {m for g in groups for m in g.members[:-1]}
        absorbed |= {k for k, made in small_at.items() if not made}
        producer = {st.out: (st, i) for st, i in steps}
        out: list[tuple[_Step, ir_pb2.Instruction]] = []
        for k, (st, instr) in enumerate(steps):
            if k in absorbed:
                continue
            if k in small_at:
                out.extend(small_at[k])
                continue
            g = roots.get(k)
            if g is None:
                out.append((st, instr))
                continue
            # An input that an expanded broadcast made is read from the broadcast's operand
            # instead, with ones where it broadcasts (no full-size copy, fewer loads).
            in_slots, in_dims = [], []
            for s in g.inputs:
                src = _broadcast_source(producer.get(s), dims) if fault != "broadcast" else None
                in_slots.append(src[0] if src else s)
                in_dims.append(src[1] if src else dims[s])
            index = {s: j for j, s in enumerate(g.inputs)}
            members = []
            for n, m in enumerate(g.members):
                mst, minstr = steps[m]
                members.append(fusion.Member(mst.fn, getattr(mst.fn, "ufunc", None),
                                             tuple(index[s] for s in mst.ins),
                                             _shape_of(minstr.shape)[0], exprs[m]))
                index[mst.out] = len(g.inputs) + n
            dt, shape = _shape_of(instr.shape)
            in_dtypes = [slot_dtypes.get(s) for s in in_slots]
            jit_inputs = None
            if use_jit and all(d is not None for d in in_dtypes):  # (dtype == None is float64)
                jit_inputs = [(d, consts[s] if s in consts and np.size(consts[s]) == 1 else None)
                              for d, s in zip(in_dtypes, in_slots, strict=True)]
            fn = fusion.fused_kernel(shape, dt, in_dims, members, jit_inputs)
            out.append((_Step(fn, tuple(in_slots), st.out), instr))
        return _used_steps(out, root_slot)  # broadcasts only fused steps read are gone now

    @staticmethod
    def _fuse_small(steps: list[tuple[_Step, ir_pb2.Instruction]], exprs: list[str | None],
                    taken: set[int], dims: dict[int, tuple[int, ...] | None],
                    slot_dtypes: dict[int, np.dtype | None], consts: dict[int, Any],
                    root_slot: int, new_slot: Callable[[], int],
                    ) -> dict[int, list[tuple[_Step, ir_pb2.Instruction]]]:
        """Groups of element-wise steps over small arrays (below ``fusion.MIN_ELEMENTS``)
        that all have a compiled form, as one compiled loop each (``fusion.small_kernel``):
        in a loop body each numpy call costs about a microsecond whatever its size, and an
        optimizer's update of a small variable is a dozen of them. Maps each group's last
        step to the steps that replace the group there (the loop, then one step taking
        each exported value out of its results), and its other members to ``[]``."""
        fusible = []
        for k, ((st, _), expr) in enumerate(zip(steps, exprs, strict=True)):
            d = dims.get(st.out)
            fusible.append(expr is not None and k not in taken and d is not None and len(d) > 0
                           and 0 < math.prod(d) < fusion.MIN_ELEMENTS)
        groups = fusion.plan_small_groups([st.ins for st, _ in steps], [st.out for st, _ in steps],
                                          fusible, dims, {root_slot})
        producer = {st.out: (st, i) for st, i in steps}
        made: dict[int, list[tuple[_Step, ir_pb2.Instruction]]] = {}
        for g in groups:
            # An input that a broadcast made is read from the broadcast's operand when numpy
            # would broadcast that operand the same way (trailing dimensions).
            in_slots: list[int] = []
            in_dims: list[tuple[int, ...]] = []
            for s in g.inputs:
                src = _broadcast_source(producer.get(s), dims)
                if src is not None:
                    d = dims.get(src[0])
                    if d is not None and tuple(src[1]) == (1,) * (len(src[1]) - len(d)) + tuple(d):
                        s = src[0]
                d = dims.get(s)
                in_slots.append(s)
                in_dims.append(d if d is not None else ())
            in_dtypes = [slot_dtypes.get(s) for s in in_slots]
            if any(d is None for d in in_dtypes) or any(dims.get(s) is None for s in in_slots):
                continue
            index = {s: j for j, s in enumerate(in_slots)}
            for s, t in zip(g.inputs, in_slots, strict=True):
                index[s] = index[t]
            members = []
            for n, m in enumerate(g.members):
                mst, minstr = steps[m]
                members.append(fusion.Member(mst.fn, getattr(mst.fn, "ufunc", None),
                                             tuple(index[s] for s in mst.ins),
                                             _shape_of(minstr.shape)[0], exprs[m]))
                index[mst.out] = len(in_slots) + n
            jit_inputs = [(d, consts[s] if s in consts and np.size(consts[s]) == 1 else None)
                          for d, s in zip(in_dtypes, in_slots, strict=True)]
            last = steps[g.members[-1]][1]
            shape = _shape_of(last.shape)[1]
            fn = fusion.small_kernel(shape, in_dims, members, jit_inputs,
                                     [g.members.index(e) for e in g.exports])
            if fn is None:
                continue
            if len(g.exports) == 1:
                e_st, e_instr = steps[g.exports[0]]
                replaced = [(_Step(fn, tuple(in_slots), e_st.out), e_instr)]
            else:
                results = new_slot()
                dims[results] = None
                slot_dtypes[results] = None
                replaced = [(_Step(fn, tuple(in_slots), results), last)]
                for n, e in enumerate(g.exports):
                    e_st, e_instr = steps[e]
                    replaced.append((_Step(_item(n), (results,), e_st.out, f"{{0}}[{n}]"), e_instr))
            for m in g.members:
                made[m] = []
            made[g.members[-1]] = replaced
        return made

    def _kernel(self, ctx: _Context) -> Callable[[Sequence[Any]], Any]:
        """The kernel of ``ctx.instr`` from its factory; with dynamic dimensions, one that
        follows run-time sizes (``dynamic.plan``)."""
        factory = kernels.REGISTRY[ctx.instr.opcode]
        if not ctx.dynamic:
            return factory(ctx)

        def specialize(shapes: Sequence[tuple[int, ...]], outs: Sequence[tuple[int, ...]],
                       attrs: dict[str, tuple[int, ...]]) -> Callable[[Sequence[Any]], Any]:
            instr = _with_dims(ctx.instr, outs)
            for name, values in attrs.items():
                del instr.attrs[name].ints.values[:]
                instr.attrs[name].ints.values.extend(values)
            ops = [_with_dims(o, [s]) for o, s in zip(ctx.operand_instrs, shapes, strict=True)]
            return factory(_Context(self, instr, ops))

        return dynamic.plan(ctx, factory, specialize)

    def _f32_kernel(self, instr: ir_pb2.Instruction, operands: list[ir_pb2.Instruction]) -> Callable[[Sequence[Any]], Any]:
        """The kernel of ``instr`` with every FP16 operand and result made FP32 (stochastic
        rounding computes FP16 arithmetic in FP32, then rounds)."""
        def widened(i: ir_pb2.Instruction) -> ir_pb2.Instruction:
            w = ir_pb2.Instruction()
            w.CopyFrom(i)
            if not w.shape.is_tuple and w.shape.dtype == ir_pb2.F16:
                w.shape.dtype = ir_pb2.F32
            return w

        return self._kernel(_Context(self, widened(instr), [widened(o) for o in operands]))

    @staticmethod
    def _check_shape(instr: ir_pb2.Instruction, value: Any) -> None:
        dt, shape = _shape_of(instr.shape)
        if dt is None:
            return
        a = np.asarray(value)
        if a.dtype != dt or (a.shape != shape and not _fits(a.shape, shape, dynamic.dynamic_flags(instr.shape))):
            raise InvalidProgramError(
                f"{describe(instr)}: produced {a.dtype}{list(a.shape)}, its shape says "
                f"{dt}{list(shape)}."
            )


# Values at least this big are dropped after their last use inside a computation.
_DROP_BYTES = 1 << 16
# Element-wise opcodes whose kernels broadcast operands like numpy (and whose results do not
# depend on the operands' memory layout), so a broadcast operand may stay unexpanded.
_NUMPY_BROADCASTING = frozenset(
    {"add", "subtract", "multiply", "divide", "maximum", "minimum", "compare", "select",
     "and", "or", "xor"}
)


def _static_nbytes(shape: ir_pb2.Shape) -> int:
    if shape.is_tuple:
        return sum(_static_nbytes(s) for s in shape.tuple_shapes)
    if shape.dtype == ir_pb2.TOKEN:
        return 0
    return math.prod(shape.dims) * dtypes.to_numpy(shape.dtype).itemsize


def _with_dims(instr: ir_pb2.Instruction, leaf_dims: Sequence[tuple[int, ...]]) -> ir_pb2.Instruction:
    """A copy of ``instr`` whose shape's leaves have these (static) dimensions."""
    out = ir_pb2.Instruction()
    out.CopyFrom(instr)
    for leaf, dims in zip(_leaves(out.shape), leaf_dims, strict=True):
        del leaf.dims[:]
        leaf.dims.extend(dims)
        del leaf.dynamic_dims[:]
    return out


def _is_identity(instr: ir_pb2.Instruction, operands: list[ir_pb2.Instruction]) -> bool:
    """Whether ``instr`` returns its only operand unchanged (same shape and type)."""
    if len(operands) != 1 or instr.shape.is_tuple or operands[0].shape.is_tuple:
        return False
    src = operands[0].shape
    if src.dtype != instr.shape.dtype or tuple(src.dims) != tuple(instr.shape.dims):
        return False
    if dynamic.dynamic_flags(src) != dynamic.dynamic_flags(instr.shape):
        return False  # a run-time size becomes a bound, or the other way round
    op = instr.opcode
    if op in ("reshape", "bitcast", "convert", "concatenate"):
        return True
    if op == "slice":
        strides = instr.attrs["strides"].ints.values if "strides" in instr.attrs else ()
        return all(int(s) == 1 for s in strides)
    if op == "transpose":
        perm = tuple(instr.attrs["permutation"].ints.values) if "permutation" in instr.attrs else ()
        return perm == tuple(range(len(perm)))
    if op == "broadcast":
        dims = tuple(instr.attrs["dimensions"].ints.values) if "dimensions" in instr.attrs else ()
        return dims == tuple(range(len(dims)))
    return False


def _sliced_operand(instr: ir_pb2.Instruction, concat: ir_pb2.Instruction,
                    by_id: dict[int, ir_pb2.Instruction]) -> int | None:
    """The id of the operand of ``concat`` that the slice ``instr`` takes whole (the same
    dtype and shape), or None."""
    shapes = [instr.shape, concat.shape] + [by_id[o].shape for o in concat.operands]
    if any(s.is_tuple or dynamic.has_dynamic(s) or s.dtype != instr.shape.dtype for s in shapes):
        return None
    if not all(k in instr.attrs for k in ("start_indices", "limit_indices")) \
            or "dimension" not in concat.attrs:
        return None
    starts = tuple(int(v) for v in instr.attrs["start_indices"].ints.values)
    limits = tuple(int(v) for v in instr.attrs["limit_indices"].ints.values)
    strides = tuple(int(v) for v in instr.attrs["strides"].ints.values) \
        if "strides" in instr.attrs else (1,) * len(starts)
    axis = int(concat.attrs["dimension"].i)
    dims = tuple(int(d) for d in instr.shape.dims)
    if any(st != 1 for st in strides) or not 0 <= axis < len(dims) or len(starts) != len(dims):
        return None
    offset = 0
    for o in concat.operands:
        od = tuple(int(d) for d in by_id[o].shape.dims)
        if od == dims and starts[axis] == offset and all(
                (a, b) == (0, d) for k, (a, b, d) in enumerate(zip(starts, limits, od, strict=True))
                if k != axis):
            return o
        if len(od) != len(dims):
            return None
        offset += od[axis]
    return None


def _element(instr: ir_pb2.Instruction | None,
             by_id: dict[int, ir_pb2.Instruction]) -> ir_pb2.Instruction | None:
    """``instr``, or what a get-tuple-element of a tuple made in the same computation reads."""
    for _ in range(16):
        if instr is None or instr.opcode != "get-tuple-element" or not instr.operands:
            return instr
        src = by_id.get(instr.operands[0])
        if src is None or src.opcode != "tuple":
            return instr
        k = int(instr.attrs["index"].i) if "index" in instr.attrs else 0
        if not 0 <= k < len(src.operands):
            return None
        instr = by_id.get(src.operands[k])
    return instr


def _is_zeros(instr: ir_pb2.Instruction, by_id: dict[int, ir_pb2.Instruction]) -> bool:
    """A constant of zeros, or a broadcast of one (also taken out of a tuple just made)."""
    found = _element(instr, by_id)
    if found is not None and found.opcode == "broadcast" and len(found.operands) == 1:
        found = _element(by_id.get(found.operands[0]), by_id)
    if found is None:
        return False
    instr = found
    if instr.opcode != "constant" or "value" not in instr.attrs or instr.shape.is_tuple:
        return False
    try:
        value = literal_to_value(instr.attrs["value"].literal)
    except Exception:  # noqa: BLE001 - a bad literal is reported when the constant compiles
        return False
    return isinstance(value, np.ndarray) and value.dtype.kind in "biufc" and not np.any(value)


def _add_into_slice(comp: ir_pb2.Computation, next_id: list[int]) -> ir_pb2.Computation:
    """``add(x, dynamic-update-slice(zeros, u, i...))`` becomes ``dynamic-update-slice(x,
    add(dynamic-slice(x, i...), u), i...)`` (as XLA's simplifier does): the gradient of a
    TensorArray read, added into the accumulated gradient every iteration of a backward loop,
    then touches one slice instead of the whole buffer, and can be done in place
    (``mark_in_place``). Equal except that ``-0 + 0`` stays ``-0`` outside the slice. Returns
    ``comp`` itself when nothing matches."""
    by_id = {i.id: i for i in comp.instructions}
    plan: dict[int, tuple[int, ir_pb2.Instruction]] = {}  # add id -> (x id, the update)
    for i in comp.instructions:
        if i.opcode != "add" or len(i.operands) != 2 or i.shape.is_tuple or dynamic.has_dynamic(i.shape):
            continue
        for side in (0, 1):
            d, x = _element(by_id.get(i.operands[side]), by_id), by_id.get(i.operands[1 - side])
            if d is None or x is None or d.opcode != "dynamic-update-slice" \
                    or len(d.operands) < 3 or not all(o in by_id for o in d.operands):
                continue
            u = by_id[d.operands[1]]
            if not _is_zeros(by_id[d.operands[0]], by_id) or u.shape.is_tuple or dynamic.has_dynamic(u.shape) \
                    or x.shape.dtype != i.shape.dtype or u.shape.dtype != i.shape.dtype \
                    or list(x.shape.dims) != list(i.shape.dims) or len(u.shape.dims) != len(i.shape.dims):
                continue
            plan[i.id] = (x.id, d)
            break
    if not plan:
        return comp
    out = ir_pb2.Computation()
    out.CopyFrom(comp)
    del out.instructions[:]
    for i in comp.instructions:
        if i.id not in plan:
            out.instructions.add().CopyFrom(i)
            continue
        x_id, d = plan[i.id]
        index = list(d.operands[2:])
        ds = out.instructions.add(id=next_id[0], name=f"{i.name}.slice", opcode="dynamic-slice",
                                  operands=[x_id, *index], source_op=i.source_op)
        ds.shape.CopyFrom(by_id[d.operands[1]].shape)
        ds.attrs["slice_sizes"].ints.values.extend(int(v) for v in ds.shape.dims)
        total = out.instructions.add(id=next_id[0] + 1, name=f"{i.name}.sum", opcode="add",
                                     operands=[ds.id, d.operands[1]], source_op=i.source_op)
        total.shape.CopyFrom(ds.shape)
        next_id[0] += 2
        new = out.instructions.add()
        new.CopyFrom(i)
        new.opcode = "dynamic-update-slice"
        del new.operands[:]
        new.operands.extend([x_id, total.id, *index])
    return out


def _loop_bodies(module: ir_pb2.Module) -> set[int]:
    """The computations that run once per iteration of a ``while``: its bodies, and what
    they call (``call``, ``conditional``, nested loops)."""
    comps = {c.id: c for c in module.computations}
    stack = [i.called_computations[1] for c in module.computations for i in c.instructions
             if i.opcode == "while" and len(i.called_computations) == 2]
    found: set[int] = set()
    while stack:
        cid = stack.pop()
        if cid in found or cid not in comps:
            continue
        found.add(cid)
        stack.extend(callee for i in comps[cid].instructions
                     if i.opcode in ("call", "conditional", "while") for callee in i.called_computations)
    return found


def _item(n: int) -> Callable[[Sequence[Any]], Any]:
    """The kernel taking value ``n`` out of a multi-output step's results."""
    return lambda ops: ops[0][n]


def _used_steps(
    steps: list[tuple[_Step, ir_pb2.Instruction]], root_slot: int
) -> list[tuple[_Step, ir_pb2.Instruction]]:
    """``steps`` without those whose value the result does not need."""
    needed = {root_slot}
    kept: list[tuple[_Step, ir_pb2.Instruction]] = []
    for step, instr in reversed(steps):
        if step.out in needed or _talks_to_host(instr):
            needed.update(step.ins)
            kept.append((step, instr))
    return kept[::-1]


def _talks_to_host(instr: ir_pb2.Instruction) -> bool:
    """An infeed or outfeed custom-call: kept even when nothing reads its result."""
    return instr.opcode == "custom-call" and kernels.custom_call_target(instr) in _RUN_TIME_TARGETS


def _broadcast_source(
    made: tuple[_Step, ir_pb2.Instruction] | None, dims: dict[int, tuple[int, ...] | None]
) -> tuple[int, tuple[int, ...]] | None:
    """For a value made by an (expanded) ``broadcast`` that does not transpose: its operand's
    slot and the operand's shape with ones inserted where the broadcast adds dimensions."""
    if made is None or made[1].opcode != "broadcast" or len(made[0].ins) != 1:
        return None
    step, instr = made
    bdims = tuple(int(d) for d in instr.attrs["dimensions"].ints.values) \
        if "dimensions" in instr.attrs else ()
    src_dims = dims.get(step.ins[0])
    out_dims = dims.get(step.out)
    if src_dims is None or out_dims is None or len(bdims) != len(src_dims) \
            or list(bdims) != sorted(set(bdims)):
        return None
    if any(not 0 <= d < len(out_dims) or src_dims[i] != out_dims[d] for i, d in enumerate(bdims)):
        return None
    expanded = [1] * len(out_dims)
    for i, d in enumerate(bdims):
        expanded[d] = src_dims[i]
    return step.ins[0], tuple(expanded)


def _lazy_broadcasts(
    live: list[ir_pb2.Instruction], by_id: dict[int, ir_pb2.Instruction], root_id: int, fault: str
) -> dict[int, tuple[int, ...] | None]:
    """Broadcasts that need not be expanded: every user is an element-wise op that
    broadcasts like numpy and has another operand of the full shape (not a broadcast, or an
    earlier broadcast that is expanded).
    Maps the broadcast's id to None (its operand can be used as it is: it lines up with the
    trailing dimensions) or to the shape to reshape its operand to."""
    users: dict[int, list[ir_pb2.Instruction]] = {}
    for instr in live:
        for o in instr.operands:
            users.setdefault(o, []).append(instr)
    out: dict[int, tuple[int, ...] | None] = {}
    expanded_ids: set[int] = set()  # broadcasts decided to be expanded (full-shaped values)
    for instr in live:
        if instr.opcode != "broadcast":
            continue
        expanded_ids.add(instr.id)  # until it qualifies below
        if instr.opcode == fault or instr.id == root_id:
            continue
        if instr.shape.is_tuple or len(instr.operands) != 1:
            continue
        if dynamic.has_dynamic(instr.shape) or any(
            dynamic.has_dynamic(u.shape) or any(dynamic.has_dynamic(by_id[o].shape) for o in u.operands)
            for u in users.get(instr.id, [])
        ):
            continue  # users with run-time sizes get whole operands (see dynamic.py)
        dims = tuple(int(d) for d in instr.attrs["dimensions"].ints.values) \
            if "dimensions" in instr.attrs else ()
        src = by_id[instr.operands[0]].shape
        out_dims = tuple(int(d) for d in instr.shape.dims)
        in_dims = tuple(int(d) for d in src.dims)
        if src.is_tuple or src.dtype != instr.shape.dtype or len(dims) != len(in_dims):
            continue
        if list(dims) != sorted(dims) or len(set(dims)) != len(dims):
            continue  # a transposing broadcast
        if any(not 0 <= d < len(out_dims) or in_dims[i] != out_dims[d] for i, d in enumerate(dims)):
            continue
        us = users.get(instr.id, [])
        if not us:
            continue
        ok = True
        for u in us:
            if u.opcode not in _NUMPY_BROADCASTING or u.shape.is_tuple:
                ok = False
                break
            full = tuple(u.shape.dims)
            if not any(
                o != instr.id and (by_id[o].opcode != "broadcast" or o in expanded_ids)
                and not by_id[o].shape.is_tuple and tuple(by_id[o].shape.dims) == full
                for o in u.operands
            ):
                ok = False
                break
        if not ok:
            continue
        expanded_ids.discard(instr.id)
        if dims == tuple(range(len(out_dims) - len(dims), len(out_dims))):
            out[instr.id] = None
        else:
            expanded = [1] * len(out_dims)
            for i, d in enumerate(dims):
                expanded[d] = in_dims[i]
            out[instr.id] = tuple(expanded)
    return out


def _reuse_buffers(steps: list[tuple[_Step, ir_pb2.Instruction]], root_slot: int) -> None:
    """Lets a plain-ufunc step write into an operand's buffer when that operand is a new
    array made by another plain-ufunc step (same dtype and shape) and this step is its only
    user, so no other value can see the buffer (sets ``_Step.into``)."""
    producer: dict[int, ir_pb2.Instruction] = {}
    users: dict[int, set[int]] = {}
    for k, (step, instr) in enumerate(steps):
        for s in step.ins:
            users.setdefault(s, set()).add(k)
        if getattr(step.fn, "ufunc", None) is not None and not instr.shape.is_tuple \
                and len(instr.shape.dims) > 0:
            producer[step.out] = instr
    for k, (step, instr) in enumerate(steps):
        if getattr(step.fn, "ufunc", None) is None or instr.shape.is_tuple or not instr.shape.dims:
            continue
        for j, s in enumerate(step.ins):
            made = producer.get(s)
            if made is None or s == root_slot or users.get(s) != {k}:
                continue
            if made.shape.dtype == instr.shape.dtype and tuple(made.shape.dims) == tuple(instr.shape.dims):
                step.into = j
                break


def _dots_into_fused(steps: list[tuple[_Step, ir_pb2.Instruction]], root_slot: int,
                     dims: dict[int, Any], dtypes_: dict[int, Any]) -> list[tuple[_Step, ir_pb2.Instruction]]:
    """A matrix product read only by one fused element-wise step, at the step's own index
    (a full-shaped input of a step whose blocks are rows of a 2-D result), is computed there
    a block of rows at a time instead of whole: ``w - lr * x.T @ dy`` never makes the
    gradient of ``w`` (XLA's CPU backend fuses a dot into its consumer the same way). The
    product's rows come from the same BLAS call on row ranges that ``parallel.matmul``
    makes when it cuts by rows."""
    users: dict[int, int] = {}
    for st, _ in steps:
        for slot in st.ins:
            users[slot] = users.get(slot, 0) + 1
    producer = {st.out: k for k, (st, _) in enumerate(steps)}
    dropped: set[int] = set()
    for k, (st, instr) in enumerate(steps):
        fused = getattr(st.fn, "fused_inputs", None)
        out_dims = dims.get(st.out)
        lead = getattr(st.fn, "block_lead", 0)
        if fused is None or out_dims is None or len(out_dims) != 2 or st.donate >= 0:
            continue
        # Blocks are rows of the result (lead 1), or runs of elements that are whole rows.
        if not (lead == 1 or (lead == 2 and getattr(st.fn, "block_rows", 1) % out_dims[1] == 0)):
            continue
        for j, slot in enumerate(st.ins):
            d = producer.get(slot)
            if not fused[j] or d is None or d in dropped or users.get(slot) != 1 \
                    or slot == root_slot or st.ins.count(slot) != 1:
                continue
            dot = steps[d][0]
            rows = getattr(dot.fn, "rows", None)
            if rows is None or dims.get(slot) != out_dims or dtypes_.get(slot) is None:
                continue
            n_cols, dt, n_ins = out_dims[1], np.dtype(dtypes_[slot]), len(st.ins)

            def fn(ops: Sequence[Any], into: np.ndarray | None = None, _f: Any = st.fn,
                   _rows: Any = rows, _j: int = j, _n: int = n_ins, _c: int = n_cols,
                   _dt: np.dtype = dt, _flat: bool = lead == 2) -> np.ndarray:
                lhs, rhs = ops[_j], ops[_n]

                def rows_of(a: int, b: int) -> np.ndarray:
                    if _flat:  # a run of elements: whole rows a // c to b // c
                        a, b = a // _c, b // _c
                    buf = parallel.scratch((b - a) * _c, _dt).reshape(b - a, _c)
                    out = _rows([lhs, rhs], a, b, buf)
                    return out.reshape(-1) if _flat else out

                return _f(ops[:_n], into, lazy={_j: rows_of})

            fn.fused_inputs = tuple(f and i != j for i, f in enumerate(fused)) + (False,)  # type: ignore[attr-defined]
            fn.block_lead = lead  # type: ignore[attr-defined]
            fn.block_rows = getattr(st.fn, "block_rows", 1)  # type: ignore[attr-defined]
            ins = list(st.ins)
            ins[j] = dot.ins[0]
            ins.append(dot.ins[1])
            steps[k] = (_Step(fn, tuple(ins), st.out), instr)
            dropped.add(d)
            break
    return [s for k, s in enumerate(steps) if k not in dropped]


def _mark_donations(steps: list[tuple[_Step, ir_pb2.Instruction]], root: ir_pb2.Instruction,
                    root_slot: int, params: dict[int, int], dims: dict[int, Any],
                    aliases: dict[int, int]) -> None:
    """Lets the fused step that makes an aliased output write it into its parameter's buffer
    when the caller donates that parameter (a resident variable: XLA's donated buffers).

    Safe when the step reads the parameter element by element at the output's own index (a
    full-shaped input of an element-wise fused group), no later step reads the parameter, and
    the parameter is not itself an output. Sets ``_Step.donate``; nothing changes for
    callers that donate nothing."""
    if root.opcode != "tuple" or not root.shape.is_tuple:
        return
    root_step = next((st for st, _ in steps if st.out == root_slot), None)
    if root_step is None:
        return
    outputs = root_step.ins
    if any(leaf.is_tuple for leaf in root.shape.tuple_shapes):
        return  # nested tuples: flat output indices do not map to the root's operands
    position = {st.out: k for k, (st, _) in enumerate(steps)}
    last_read: dict[int, int] = {}
    for k, (st, _) in enumerate(steps):
        for slot in st.ins:
            last_read[slot] = k
    for out_index, number in aliases.items():
        if not 0 <= out_index < len(outputs) or number not in params:
            continue
        p_slot, out_slot = params[number], outputs[out_index]
        k = position.get(out_slot)
        if k is None or p_slot in outputs:
            continue
        st = steps[k][0]
        fused = getattr(st.fn, "fused_inputs", None)
        if fused is None or st.ins.count(p_slot) != 1:
            continue
        j = st.ins.index(p_slot)
        if not fused[j] or dims.get(p_slot) != dims.get(out_slot):
            continue
        if any(p_slot in other.ins for other, _ in steps[k + 1:] if other is not root_step):
            continue
        st.donate, st.donate_param = j, number


def _reshaper(shape: tuple[int, ...]) -> Callable[[Sequence[Any]], Any]:
    return kernels.shapes.reshape_kernel(shape)


def _is_view(value: Any) -> bool:
    return isinstance(value, np.ndarray) and value.base is not None and 0 in value.strides


# -------------------------------------------------------------------------- the executable


def _spelling(dtype: np.dtype, shape: tuple[int, ...], flags: Sequence[bool] = ()) -> str:
    """``float32[2,3]``; a dynamic dimension is spelled by its bound, ``float32[<=8,3]``."""
    dyn = tuple(flags) + (False,) * (len(shape) - len(flags))
    return f"{dtype}[{','.join(('<=' if dy else '') + str(d) for d, dy in zip(shape, dyn, strict=True))}]"


class Executable:
    """A compiled module for one target.

    ``parameters``/``outputs``: ``(dtype, shape)`` of each entry parameter and of each leaf
    of the flattened entry result; ``parameter_dynamic``/``output_dynamic``: which of their
    dimensions are dynamic (``shape`` then holds the bound; such an argument or output may be
    smaller there); ``aliases``: output index -> parameter number (the output is the
    parameter's new value); ``estimate``: the cost/memory estimate. ``run`` is thread-safe.

    ``cache_record()`` describes it as plain JSON data (its signature, the estimate) for the
    executable cache on disk; :func:`executable_from_record` makes it again from that record
    and the module without planning it again. The Python program that runs it is never
    stored: such an executable generates it from the module at its first run
    (``ensure_program``).
    """

    def __init__(
        self,
        module: ir_pb2.Module,
        target: Target,
        options: CompileOptions,
        program: Program,
        parameters: list[tuple[np.dtype, tuple[int, ...]]],
        param_names: list[str],
        outputs: list[tuple[np.dtype, tuple[int, ...]]],
        root_is_tuple: bool,
        aliases: dict[int, int],
        estimate: Estimate,
        instruction_count: int,
        parameter_dynamic: list[tuple[bool, ...]] | None = None,
        output_dynamic: list[tuple[bool, ...]] | None = None,
        build: Callable[[], Program] | None = None,
    ) -> None:
        if (program is None) == (build is None):
            raise ValueError("Executable needs either a program or a function that builds it.")
        self.name = module.name
        self.target = target
        self.options = options
        self.parameters = parameters
        self.outputs = outputs
        self.aliases = aliases
        self.estimate = estimate
        self.parameter_dynamic = parameter_dynamic or [(False,) * len(s) for _, s in parameters]
        self.output_dynamic = output_dynamic or [(False,) * len(s) for _, s in outputs]
        self.instruction_count = instruction_count  # live instructions over all computations
        self._program = program
        self._build = build  # makes the program at the first run (executable_from_record)
        self._build_lock = threading.Lock()
        # Stochastic rounding: each run draws from its own stream (numerics.py).
        self._runner = options.numerics(target).runner(module) if options.esr else None
        self._param_names = param_names
        self._root_is_tuple = root_is_tuple

    @property
    def step_count(self) -> int:
        """Steps the entry computation runs per call (after folding and forwarding)."""
        return len(self.ensure_program().steps)

    @property
    def program_ready(self) -> bool:
        """Whether the program that runs it exists (False for an executable made from a
        cache record until its first run or ``ensure_program``)."""
        return self._program is not None

    def ensure_program(self) -> Program:
        """The program that runs it; made now (once, thread-safe) from the module for an
        executable that ``executable_from_record`` made."""
        program = self._program
        if program is not None:
            return program
        with self._build_lock:
            if self._program is None:
                assert self._build is not None
                self._program = self._build()
                self._build = None  # lets the module go
            return self._program

    def cache_record(self) -> dict[str, Any]:
        """What the executable cache on disk keeps of it: plain JSON data (no code, nothing
        that runs), from which ``executable_from_record`` makes it again with the module.

        Returns:
            ``{"name", "parameters", "parameter_names", "outputs", "aliases",
            "instruction_count", "estimate"}``; arrays are spelled ``float32[<=8,3]``.
        """
        estimate = dataclasses.asdict(self.estimate)
        estimate["assumptions"] = list(self.estimate.assumptions)
        return {
            "name": self.name,
            "parameters": [_spelling(dt, shape, dyn) for (dt, shape), dyn
                           in zip(self.parameters, self.parameter_dynamic, strict=True)],
            "parameter_names": list(self._param_names),
            "outputs": [_spelling(dt, shape, dyn) for (dt, shape), dyn
                        in zip(self.outputs, self.output_dynamic, strict=True)],
            "aliases": [[o, p] for o, p in sorted(self.aliases.items())],
            "instruction_count": self.instruction_count,
            "estimate": estimate,
        }

    def _check_args(self, args: Sequence[np.ndarray]) -> list[np.ndarray]:
        if len(args) != len(self.parameters):
            raise ExecutionError(
                f"'{self.name}' takes {len(self.parameters)} arguments, received {len(args)}."
            )
        out = []
        for n, (a, (dt, shape)) in enumerate(zip(args, self.parameters, strict=True)):
            if not isinstance(a, np.ndarray):
                a = np.asarray(a)
            if a.dtype != dt or (a.shape != shape and not _fits(a.shape, shape, self.parameter_dynamic[n])):
                raise ExecutionError(
                    f"'{self.name}': parameter {n} ('{self._param_names[n]}') expects "
                    f"{_spelling(dt, shape, self.parameter_dynamic[n])}, received {_spelling(a.dtype, a.shape)}."
                )
            out.append(a)
        return out

    def run(self, args: Sequence[np.ndarray], donated: Iterable[int] = (),
            stop: cancel.StopToken | None = None) -> list[np.ndarray]:
        """Runs the program; returns the flattened entry result as C-contiguous arrays.

        ``stop``: a token that can ask the run to stop (``cancel.py``): a device loop then
        ends early (``stop.steps_completed`` says after how many steps) and the results are
        those of its last completed step; else ``cancel.RunStopped`` is raised.

        ``donated``: entry parameters (aliased to outputs) whose buffers the caller gives
        up, as XLA's donated buffers: the program may write the aliased output into the
        parameter's array (then that output *is* the array). Each must be a writable,
        C-contiguous array not passed for any other parameter.
        """
        checked = self._check_args(args)
        give: frozenset[int] = frozenset()
        if donated:
            seen: dict[int, int] = {}
            for a in checked:
                seen[id(a)] = seen.get(id(a), 0) + 1
            aliased = set(self.aliases.values())
            give = frozenset(
                n for n in donated
                if n in aliased and checked[n].flags.writeable and checked[n].flags.c_contiguous
                and seen[id(checked[n])] == 1
            )
        program = self.ensure_program()
        with np.errstate(all="ignore"), cancel.running(stop):
            if self._runner is None:
                result = program(checked, give)
            else:
                result = self._runner(lambda: program(checked, give))
        flat = _flatten(result) if self._root_is_tuple else [result]
        outs = []
        given: set[int] = set()  # one array for two outputs (equal values share a step) is copied
        for k, (value, (dt, shape)) in enumerate(zip(flat, self.outputs, strict=True)):
            a = np.asarray(value)
            if a.dtype != dt or (a.shape != shape and not _fits(a.shape, shape, self.output_dynamic[k])):
                raise ExecutionError(
                    f"'{self.name}': output {k} came out as {_spelling(a.dtype, a.shape)}, "
                    f"expected {_spelling(dt, shape, self.output_dynamic[k])} (emulator kernel bug)."
                )
            if not (a.flags.c_contiguous and a.flags.writeable) or id(a) in given:
                a = a.copy()
            given.add(id(a))
            outs.append(a)
        return outs


def _flatten(value: Any) -> list[Any]:
    if isinstance(value, tuple):
        return [leaf for v in value for leaf in _flatten(v)]
    return [value]


def compile_module(
    module: ir_pb2.Module, target: Target, options: CompileOptions = CompileOptions()
) -> Executable:
    """Compiles ``module`` for ``target``.

    Raises :class:`UnsupportedOpError` for an opcode without a kernel, refused by
    ``options.refuse_opcodes`` or a ``custom-call`` whose target has no registered kernel
    (``kernels.CUSTOM_CALLS``); :class:`InvalidProgramError` for a
    malformed module; :class:`OutOfMemoryError` when the estimate's fullest tile is over its
    memory by more than the tile model's margin (``tiles.report.MEMORY_MARGIN``; unless
    ``options.allow_out_of_memory``); ``ValueError`` for a bad numerics option
    (``partials_type``).

    Over capacity within the margin, it compiles with a warning (logged, and in the
    estimate's notes) naming the fullest tile and the bytes over. A failure of the tile model
    never stops the compile: the estimate's fit is then unknown (``fits`` None, no figures)
    and a warning names the instruction it failed on.
    """
    options = _checked_options(options)
    compiler, program = _build_program(module, target, options)
    sig = _Signature.of(module)
    est = estimate_module(module, compiler.live_instructions, target, replicas=options.replicas,
                          system=options.system, ipu_ids=options.ipu_ids,
                          pipeline_stages=options.pipeline_stages, stage_ipus=options.stage_ipus,
                          ipus_per_replica=options.ipus_per_replica,
                          pipeline_schedule=options.pipeline_schedule,
                          micro_batches=options.micro_batches, recomputation=options.recomputation,
                          optimizer_state_offload=options.optimizer_state_offload,
                          optimizer_state_sharding=options.optimizer_state_sharding,
                          memory_proportions=options.memory_proportions(),
                          partials_types=options.partials_types(),
                          on_failure="report")
    if est.refused and not options.allow_out_of_memory:
        raise OutOfMemoryError(est.oom_message())
    if est.fits is None:  # estimate_module logged the traceback; this says what it means here
        _log.warning("compiling %r with its fit unknown: %s", module.name, est.failure)
    elif est.within_margin:
        _log.warning("%s", est.margin_message())
    count = sum(len(v) for v in compiler.live.values())
    return Executable(
        module, target, options, program, sig.parameters, sig.param_names, sig.outputs,
        sig.root_is_tuple, sig.aliases, est, count, sig.parameter_dynamic, sig.output_dynamic,
    )


def executable_from_record(
    module: ir_pb2.Module, target: Target, options: CompileOptions, record: Any
) -> Executable:
    """The executable that ``compile_module(module, target, options)`` made when it wrote
    ``record`` (``Executable.cache_record``), made again without planning the module: the
    signature is read off the module (and must be the record's), the estimate is the
    record's, and the program is generated from the module at the first run. The caller
    must know the record belongs to this module, target and options (the disk cache's key
    says so).

    Raises:
        ValueError: the record is malformed or does not describe this module and target.
        InvalidProgramError: a malformed module (its entry's signature).
    """
    options = _checked_options(options)
    if not isinstance(record, dict):
        raise ValueError(f"the record must be a JSON object, not {type(record).__name__}")
    sig = _Signature.of(module)
    spelled = {
        "name": module.name,
        "parameters": [_spelling(dt, shape, dyn) for (dt, shape), dyn
                       in zip(sig.parameters, sig.parameter_dynamic, strict=True)],
        "parameter_names": sig.param_names,
        "outputs": [_spelling(dt, shape, dyn) for (dt, shape), dyn
                    in zip(sig.outputs, sig.output_dynamic, strict=True)],
        "aliases": [[o, p] for o, p in sorted(sig.aliases.items())],
    }
    for name, value in spelled.items():
        if record.get(name) != value:
            raise ValueError(f"its {name!r} is not the module's ({str(record.get(name))[:80]} "
                             f"vs {str(value)[:80]})")
    count = record.get("instruction_count")
    if not isinstance(count, int) or isinstance(count, bool) or count < 0:
        raise ValueError(f"'instruction_count' must be a count. Received: {count!r}")
    est = Estimate.from_dict(record.get("estimate"))
    if (est.ipu_version, est.tiles_per_ipu) != (target.ipu_version, target.tiles_per_ipu):
        raise ValueError(f"its estimate is for {est.ipu_version} with {est.tiles_per_ipu} tiles, "
                         f"not {target.ipu_version} with {target.tiles_per_ipu}")
    if est.refused and not options.allow_out_of_memory:
        raise ValueError("its estimate does not fit, and the options do not allow that")

    def build() -> Program:
        return _build_program(module, target, options)[1]

    return Executable(
        module, target, options, None, sig.parameters, sig.param_names, sig.outputs,
        sig.root_is_tuple, sig.aliases, est, count, sig.parameter_dynamic, sig.output_dynamic,
        build=build,
    )


def _checked_options(options: CompileOptions) -> CompileOptions:
    if not isinstance(options, CompileOptions):
        raise TypeError(f"options must be CompileOptions, got {type(options).__name__}.")
    options.memory_proportions()  # ValueError: a proportion outside [0, 1]
    return dataclasses.replace(options, refuse_opcodes=frozenset(options.refuse_opcodes))


def _build_program(module: ir_pb2.Module, target: Target,
                   options: CompileOptions) -> tuple[_Compiler, Program]:
    """The entry computation's program (and the compiler that made it)."""
    compiler = _Compiler(module, options, options.numerics(target))  # ValueError: bad option
    entry = compiler.computation_ir(module.entry_computation_id)
    compiler.check_supported(entry)
    return compiler, compiler.program(entry.id)



# The most elements an array may have (2^48, 256 TiB of bytes): beyond it an element count
# overflows the tile model's and numpy's 64-bit arithmetic long before anything could run.
_MAX_ELEMENTS = 1 << 48


def _check_dims(instr: ir_pb2.Instruction, shape: ir_pb2.Shape, depth: int = 0) -> None:
    """Refuses a shape no program can hold: a negative dimension or more than
    ``_MAX_ELEMENTS`` elements, naming the instruction and the dimension."""
    if shape.is_tuple:
        if depth > 64:
            raise InvalidProgramError(f"{describe(instr)}: tuple shapes nested deeper than 64.")
        for t in shape.tuple_shapes:
            _check_dims(instr, t, depth + 1)
        return
    count = 1
    for k, d in enumerate(shape.dims):
        if d < 0:
            raise InvalidProgramError(f"{describe(instr)}: dimension {k} of its shape is {d}; "
                                      f"dimensions are 0 or more.")
        count *= d
    if count > _MAX_ELEMENTS:
        raise InvalidProgramError(f"{describe(instr)}: its shape {list(shape.dims)} has {count:,} "
                                  f"elements, over the {_MAX_ELEMENTS:,} an array may have.")

@dataclass
class _Signature:
    """The entry computation's parameters, outputs and aliases (checked)."""

    parameters: list[tuple[np.dtype, tuple[int, ...]]]
    param_names: list[str]
    parameter_dynamic: list[tuple[bool, ...]]
    outputs: list[tuple[np.dtype, tuple[int, ...]]]
    output_dynamic: list[tuple[bool, ...]]
    root_is_tuple: bool
    aliases: dict[int, int]

    @classmethod
    def of(cls, module: ir_pb2.Module) -> _Signature:
        entry = next((c for c in module.computations if c.id == module.entry_computation_id), None)
        if entry is None:
            raise InvalidProgramError(
                f"module '{module.name}': computation {module.entry_computation_id} does not exist.")
        param_instrs = sorted(
            (i for i in entry.instructions if i.opcode == "parameter"), key=lambda i: i.parameter_number
        )
        if [i.parameter_number for i in param_instrs] != list(range(len(param_instrs))):
            raise InvalidProgramError(
                f"module '{module.name}': entry parameter numbers are not 0..{len(param_instrs) - 1}."
            )
        parameters = []
        for p in param_instrs:
            dt, shape = _shape_of(p.shape)
            if dt is None:
                raise InvalidProgramError(f"module '{module.name}': entry {describe(p)} must be an array, not a tuple.")
            parameters.append((dt, shape))

        root = next((i for i in entry.instructions if i.id == entry.root_id), None)
        if root is None:
            raise InvalidProgramError(f"computation '{entry.name}': root {entry.root_id} does not exist.")
        outputs = []
        for leaf in _leaves(root.shape):
            dt, shape = _shape_of(leaf)
            if dt is None:
                raise InvalidProgramError(f"module '{module.name}': token outputs are not supported.")
            outputs.append((dt, shape))
        output_dynamic = [dynamic.dynamic_flags(leaf) for leaf in _leaves(root.shape)]
        aliases: dict[int, int] = {}
        for a in module.aliases:
            o, p = int(a.output_index), int(a.parameter_number)
            if not 0 <= o < len(outputs) or not 0 <= p < len(parameters):
                raise InvalidProgramError(f"module '{module.name}': alias output {o} -> parameter {p} is out of range.")
            if outputs[o] != parameters[p] or output_dynamic[o] != dynamic.dynamic_flags(param_instrs[p].shape):
                raise InvalidProgramError(
                    f"module '{module.name}': output {o} ({_spelling(*outputs[o])}) cannot replace "
                    f"parameter {p} ({_spelling(*parameters[p])})."
                )
            aliases[o] = p
        return cls(parameters, [p.name for p in param_instrs],
                   [dynamic.dynamic_flags(p.shape) for p in param_instrs], outputs,
                   output_dynamic, root.shape.is_tuple, aliases)


_ = errors  # re-exported names live in errors.py
