"""Compiles an IR module into a flat list of steps that an interpreter runs with numpy.

Planning happens once, in :func:`compile_module`:

* dead code elimination (only what the root of each computation needs is kept);
* one slot per live value; ``get-tuple-element`` of a ``tuple``, ``copy``, same-shape
  ``reshape`` and ``opt-barrier`` reuse their operand's slot instead of running;
* constants, and instructions whose operands are all constants, are evaluated at compile time
  and stored in a per-program template (constant folding);
* every other instruction becomes a step ``(kernel_fn, operand_slots, out_slot, dead_slots)``
  whose kernel function was built by its factory from the registry
  (``device_server.emulator.kernels``); ``dead_slots`` drops values after their last use;
* called computations (``while``, ``call``, ``conditional``, reducers, comparators, ...) are
  compiled the same way, once each, and handed to kernels as plain functions.

At run time a program copies its template (a list), stores the arguments and runs its steps:
no shared mutable state, so one :class:`Executable` can run on several threads at once.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from device_server.emulator import errors, kernels
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
from device_server.protocol import dtypes, ir_pb2

__all__ = ["CompileOptions", "Executable", "compile_module", "literal_to_value"]

# Kernel modules. The spatial ones (conv, window, indexing) are written separately and may be
# absent from a checkout; the rest are required.
_KERNEL_MODULES = ("elementwise", "shapes", "dot", "reduce", "control", "rng")
_OPTIONAL_KERNEL_MODULES = ("conv", "window", "indexing")


def _load_kernels() -> None:
    for name in _KERNEL_MODULES:
        importlib.import_module(f"device_server.emulator.kernels.{name}")
    for name in _OPTIONAL_KERNEL_MODULES:
        full = f"device_server.emulator.kernels.{name}"
        if importlib.util.find_spec(full) is not None:
            importlib.import_module(full)


_load_kernels()

# Opcodes never run, whatever the options say.
ALWAYS_REFUSED = frozenset({"custom-call"})
# Opcodes that are evaluated at compile time when all their operands are constants.
_NOT_FOLDABLE = frozenset({"rng", "rng-bit-generator", "rng-get-and-update-state", "infeed", "outfeed"})
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
    """

    refuse_opcodes: frozenset[str] = frozenset()
    fault_inject_opcode: str = ""
    allow_out_of_memory: bool = False


# ------------------------------------------------------------------------------ values


def _shape_of(shape: ir_pb2.Shape) -> tuple[np.dtype | None, tuple[int, ...]]:
    if shape.is_tuple or shape.dtype == ir_pb2.TOKEN:
        return None, ()
    return dtypes.to_numpy(shape.dtype), tuple(int(d) for d in shape.dims)


def _leaves(shape: ir_pb2.Shape) -> list[ir_pb2.Shape]:
    if shape.is_tuple:
        return [leaf for s in shape.tuple_shapes for leaf in _leaves(s)]
    return [shape]


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
    """One compiled computation: call it with its parameters' values."""

    __slots__ = ("name", "steps", "template", "param_slots", "root_slot", "instrs", "_call")

    def __init__(
        self,
        name: str,
        steps: list[tuple[Callable[[Sequence[Any]], Any], tuple[int, ...], int, tuple[int, ...]]],
        instrs: list[ir_pb2.Instruction],
        template: list[Any],
        param_slots: list[int],
        root_slot: int,
    ) -> None:
        self.name = name
        self.steps = tuple(steps)
        self.instrs = instrs  # instrs[k] made steps[k]; for error messages
        self.template = template
        self.param_slots = tuple(param_slots)
        self.root_slot = root_slot
        self._call = self._build()

    def _build(self) -> Callable[[Sequence[Any]], Any]:
        steps = self.steps
        template = self.template
        params = self.param_slots
        root = self.root_slot
        instrs = self.instrs
        name = self.name

        def call(args: Sequence[Any]) -> Any:
            env = template.copy()
            for slot, value in zip(params, args, strict=True):
                env[slot] = value
            k = 0
            try:
                for fn, ins, out, dead in steps:
                    env[out] = fn([env[i] for i in ins])
                    if dead:
                        for d in dead:
                            env[d] = None
                    k += 1
            except EmulatorError as e:
                if k < len(instrs) and "while running" not in str(e):
                    raise type(e)(f"{e} (while running {describe(instrs[k])})") from e
                raise
            except Exception as e:  # a kernel failed: name the instruction
                raise ExecutionError(
                    f"{describe(instrs[k])} in computation '{name}' failed: "
                    f"{type(e).__name__}: {e}"
                ) from e
            return env[root]

        return call

    def __call__(self, args: Sequence[Any]) -> Any:
        return self._call(args)


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
    def __init__(self, module: ir_pb2.Module, options: CompileOptions) -> None:
        self.module = module
        self.options = options
        self.comps = {c.id: c for c in module.computations}
        self.programs: dict[int, Program] = {}
        self.in_progress: set[int] = set()
        self.live: dict[int, list[ir_pb2.Instruction]] = {}

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
            by_id[instr.id] = instr
        if comp.root_id not in by_id:
            raise InvalidProgramError(f"computation '{comp.name}': root {comp.root_id} does not exist.")
        needed = {comp.root_id}
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
            for instr in self.live_instructions(self.computation_ir(cid)):
                op = instr.opcode
                if op in ALWAYS_REFUSED:
                    why = "never runs on the device"
                elif op in self.options.refuse_opcodes:
                    why = "refused by the compile options"
                elif op not in kernels.REGISTRY:
                    why = "has no emulator kernel"
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
        raw_steps: list[tuple[Callable[[Sequence[Any]], Any], tuple[int, ...], int, ir_pb2.Instruction]] = []
        fault = self.options.fault_inject_opcode

        def new_slot(value: Any = None, const: bool = False) -> int:
            template.append(value)
            is_const.append(const)
            return len(template) - 1

        for instr in live:
            op = instr.opcode
            operands = [by_id[o] for o in instr.operands]
            in_slots = tuple(slot_of[o] for o in instr.operands)
            if op == "parameter":
                n = instr.parameter_number
                if n in params:
                    raise InvalidProgramError(f"computation '{comp.name}': two parameters numbered {n}.")
                params[n] = slot_of[instr.id] = new_slot()
                continue
            if op == "constant" and op != fault:
                if "value" not in instr.attrs:
                    raise InvalidProgramError(f"{describe(instr)}: constant without a 'value' attribute.")
                value = literal_to_value(instr.attrs["value"].literal, describe(instr))
                self._check_shape(instr, value)
                slot_of[instr.id] = new_slot(value, const=True)
                continue
            if op != fault:
                if op in _FORWARDING and len(in_slots) == 1:
                    slot_of[instr.id] = in_slots[0]
                    continue
                if op == "reshape" and tuple(operands[0].shape.dims) == tuple(instr.shape.dims) \
                        and operands[0].shape.dtype == instr.shape.dtype:
                    slot_of[instr.id] = in_slots[0]
                    continue
                if op == "get-tuple-element" and operands[0].opcode == "tuple" \
                        and operands[0].opcode != fault:
                    idx = int(instr.attrs["index"].i) if "index" in instr.attrs else 0
                    src = operands[0].operands
                    if not 0 <= idx < len(src):
                        raise InvalidProgramError(f"{describe(instr)}: tuple index {idx} out of range.")
                    slot_of[instr.id] = slot_of[src[idx]]
                    continue
            ctx = _Context(self, instr, operands)
            try:
                fn = kernels.REGISTRY[op](ctx)
            except EmulatorError:
                raise
            except Exception as e:
                raise InvalidProgramError(f"{describe(instr)}: cannot compile: {type(e).__name__}: {e}") from e
            if op == fault:
                fn = _faulty(fn)
            foldable = (
                op != fault and op not in _NOT_FOLDABLE and all(is_const[s] for s in in_slots)
                and op not in ("while", "conditional", "call")  # keep loops out of compile time
            )
            if foldable:
                try:
                    with np.errstate(all="ignore"):
                        value = fn([template[s] for s in in_slots])
                except Exception as e:
                    raise InvalidProgramError(
                        f"{describe(instr)}: failed on constant operands: {type(e).__name__}: {e}"
                    ) from e
                if _nbytes(value) <= _FOLD_LIMIT_BYTES or _is_view(value):
                    self._check_shape(instr, value)
                    slot_of[instr.id] = new_slot(_freeze(value), const=True)
                    continue
            out = new_slot()
            slot_of[instr.id] = out
            raw_steps.append((fn, in_slots, out, instr))

        if comp.root_id not in slot_of:
            raise InvalidProgramError(f"computation '{comp.name}': root was not compiled.")
        root_slot = slot_of[comp.root_id]
        n_params = len(params)
        if sorted(params) != list(range(n_params)):
            raise InvalidProgramError(
                f"computation '{comp.name}': parameter numbers {sorted(params)} are not 0..{n_params - 1}."
            )
        # Liveness: drop a non-constant value after its last use (never the root).
        last_use: dict[int, int] = {}
        for k, (_, ins, _, _) in enumerate(raw_steps):
            for s in ins:
                if not is_const[s]:
                    last_use[s] = k
        dead_at: list[list[int]] = [[] for _ in raw_steps]
        for s, k in last_use.items():
            if s != root_slot:
                dead_at[k].append(s)
        steps = [(fn, ins, out, tuple(dead_at[k])) for k, (fn, ins, out, _) in enumerate(raw_steps)]
        return Program(
            comp.name, steps, [i for *_, i in raw_steps], template,
            [params[n] for n in range(n_params)], root_slot,
        )

    @staticmethod
    def _check_shape(instr: ir_pb2.Instruction, value: Any) -> None:
        dt, shape = _shape_of(instr.shape)
        if dt is None:
            return
        a = np.asarray(value)
        if a.dtype != dt or a.shape != shape:
            raise InvalidProgramError(
                f"{describe(instr)}: produced {a.dtype}{list(a.shape)}, its shape says "
                f"{dt}{list(shape)}."
            )


def _is_view(value: Any) -> bool:
    return isinstance(value, np.ndarray) and value.base is not None and 0 in value.strides


# -------------------------------------------------------------------------- the executable


def _spelling(dtype: np.dtype, shape: tuple[int, ...]) -> str:
    return f"{dtype}[{','.join(str(d) for d in shape)}]"


class Executable:
    """A compiled module for one target.

    ``parameters``/``outputs``: ``(dtype, shape)`` of each entry parameter and of each leaf
    of the flattened entry result; ``aliases``: output index -> parameter number (the output
    is the parameter's new value); ``estimate``: the cost/memory estimate. ``run`` is
    thread-safe.
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
    ) -> None:
        self.name = module.name
        self.target = target
        self.options = options
        self.parameters = parameters
        self.outputs = outputs
        self.aliases = aliases
        self.estimate = estimate
        self.instruction_count = instruction_count  # live instructions over all computations
        self._program = program
        self._param_names = param_names
        self._root_is_tuple = root_is_tuple

    @property
    def step_count(self) -> int:
        """Steps the entry computation runs per call (after folding and forwarding)."""
        return len(self._program.steps)

    def _check_args(self, args: Sequence[np.ndarray]) -> list[np.ndarray]:
        if len(args) != len(self.parameters):
            raise ExecutionError(
                f"'{self.name}' takes {len(self.parameters)} arguments, received {len(args)}."
            )
        out = []
        for n, (a, (dt, shape)) in enumerate(zip(args, self.parameters, strict=True)):
            if not isinstance(a, np.ndarray):
                a = np.asarray(a)
            if a.dtype != dt or a.shape != shape:
                raise ExecutionError(
                    f"'{self.name}': parameter {n} ('{self._param_names[n]}') expects "
                    f"{_spelling(dt, shape)}, received {_spelling(a.dtype, a.shape)}."
                )
            out.append(a)
        return out

    def run(self, args: Sequence[np.ndarray]) -> list[np.ndarray]:
        """Runs the program; returns the flattened entry result as C-contiguous arrays."""
        checked = self._check_args(args)
        with np.errstate(all="ignore"):
            result = self._program(checked)
        flat = _flatten(result) if self._root_is_tuple else [result]
        outs = []
        for k, (value, (dt, shape)) in enumerate(zip(flat, self.outputs, strict=True)):
            a = np.asarray(value)
            if a.dtype != dt or a.shape != shape:
                raise ExecutionError(
                    f"'{self.name}': output {k} came out as {_spelling(a.dtype, a.shape)}, "
                    f"expected {_spelling(dt, shape)} (emulator kernel bug)."
                )
            if not (a.flags.c_contiguous and a.flags.writeable):
                a = a.copy()
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
    ``options.refuse_opcodes`` or a ``custom-call``; :class:`InvalidProgramError` for a
    malformed module; :class:`OutOfMemoryError` when the estimate does not fit the tiles'
    memory (unless ``options.allow_out_of_memory``).
    """
    if not isinstance(options, CompileOptions):
        raise TypeError(f"options must be CompileOptions, got {type(options).__name__}.")
    options = dataclasses.replace(options, refuse_opcodes=frozenset(options.refuse_opcodes))
    compiler = _Compiler(module, options)
    entry = compiler.computation_ir(module.entry_computation_id)
    compiler.check_supported(entry)
    program = compiler.program(entry.id)

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

    root = next(i for i in entry.instructions if i.id == entry.root_id)
    outputs = []
    for leaf in _leaves(root.shape):
        dt, shape = _shape_of(leaf)
        if dt is None:
            raise InvalidProgramError(f"module '{module.name}': token outputs are not supported.")
        outputs.append((dt, shape))
    aliases: dict[int, int] = {}
    for a in module.aliases:
        o, p = int(a.output_index), int(a.parameter_number)
        if not 0 <= o < len(outputs) or not 0 <= p < len(parameters):
            raise InvalidProgramError(f"module '{module.name}': alias output {o} -> parameter {p} is out of range.")
        if outputs[o] != parameters[p]:
            raise InvalidProgramError(
                f"module '{module.name}': output {o} ({_spelling(*outputs[o])}) cannot replace "
                f"parameter {p} ({_spelling(*parameters[p])})."
            )
        aliases[o] = p

    est = estimate_module(module, compiler.live_instructions, target)
    if not est.fits and not options.allow_out_of_memory:
        raise OutOfMemoryError(est.oom_message())
    count = sum(len(v) for v in compiler.live.values())
    return Executable(
        module, target, options, program, parameters, [p.name for p in param_instrs], outputs,
        root.shape.is_tuple, aliases, est, count,
    )


_ = errors  # re-exported names live in errors.py
