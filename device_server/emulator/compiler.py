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
  goes to the users (``rewrites._lazy_broadcasts``);
* constants, and instructions whose operands are all constants, are evaluated at compile time
  (constant folding);
* every other instruction becomes a step ``(kernel_fn, operand_slots, out_slot)`` whose
  kernel function was built by its factory from the registry
  (``device_server.emulator.kernels``); a kernel may also offer an inline expression
  (``kernels.inline``) and say it is a plain ufunc (``kernels.elementwise_ufunc``), so that a
  ufunc step may write into the buffer of an operand nobody else can see
  (``rewrites._reuse_buffers``);
* the steps become the source of one Python function per computation (``Program.source``,
  ``codegen.py``): values are its locals, constants its globals, big values are deleted after
  their last use; a failing step is found from the traceback's line number, so the hot path
  keeps no counter;
* called computations (``while``, ``call``, ``conditional``, reducers, comparators, ...) are
  compiled the same way, once each, and handed to kernels as plain functions;
* an instruction with a dynamic dimension (bounded dynamic shapes) gets its kernel from
  ``dynamic.plan``: values are arrays of their run-time shape, and the opcode's kernel is
  planned per run-time shape. Forwarding, reshape chains, lazy broadcasts and buffer reuse
  leave such instructions alone (their sizes are not known at compile time).

At run time a program's function binds the arguments to locals and runs its steps: no shared
mutable state (the globals are read-only constants and kernels), so one :class:`Executable`
can run on several threads at once.

Each job has its module; this one plans (``_Compiler``) and keeps the names callers import:

    options.py     CompileOptions                   values.py   IR shapes/literals as numpy
    compiler.py    _Compiler: IR -> steps           rewrites.py IR rewrites, step-list passes
    codegen.py     steps -> one Python function     faults.py   fault injection (a test switch)
    executable.py  Executable: signature, estimate, run; rebuilt from a disk-cache record
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from device_server.emulator import cancel, dynamic, errors, fusion, jit, kernels, numerics
from device_server.emulator.arch import Target
from device_server.emulator.codegen import Program, _Step
from device_server.emulator.errors import (
    EmulatorError,
    InvalidProgramError,
    OutOfMemoryError,
    UnsupportedOpError,
    describe,
)
from device_server.emulator.estimate import estimate_module
from device_server.emulator.executable import Executable, _Signature, executable_from_record
from device_server.emulator.faults import _faulty
from device_server.emulator.options import CompileOptions, _checked_options
from device_server.emulator.rewrites import (
    _RUN_TIME_TARGETS,
    _add_into_slice,
    _broadcast_source,
    _dots_into_fused,
    _host_computations,
    _is_identity,
    _lazy_broadcasts,
    _loop_bodies,
    _mark_donations,
    _reuse_buffers,
    _sliced_operand,
    _talks_to_host,
    _used_steps,
)
from device_server.emulator.values import (
    _fits,
    _freeze,
    _leaves,
    _nbytes,
    _shape_of,
    literal_to_value,
)
from device_server.protocol import dtypes, ir_pb2

__all__ = ["CompileOptions", "Executable", "compile_module", "executable_from_record", "literal_to_value"]

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
_FOLD_LIMIT_BYTES = 16 << 20
# (custom-call targets that talk to the host at run time, never folded, never dead code:
# ``rewrites._RUN_TIME_TARGETS``.)
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
        for _ in range(8):  # through ``call(p0, p1)`` wrappers (xla.reduce with a TF function)
            if root is None or root.opcode != "call" or len(root.called_computations) != 1:
                break
            args = [by_id.get(o) for o in root.operands]
            if [a.parameter_number if a is not None and a.opcode == "parameter" else -1 for a in args] != [0, 1]:
                return None
            comp = self._compiler.computation_ir(root.called_computations[0], self.instr)
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
        self.host_computations = _host_computations(module)

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
            if instr.opcode == "parameter" and instr.operands:  # kept live even when unused
                raise InvalidProgramError(f"{describe(instr)} in computation '{comp.name}': a "
                                          f"parameter takes no operands, it has "
                                          f"{len(instr.operands)}.")
            _check_dims(instr, instr.shape)
            by_id[instr.id] = instr
        if comp.root_id not in by_id:
            raise InvalidProgramError(f"computation '{comp.name}': root {comp.root_id} does not exist.")
        needed = {comp.root_id} | {i.id for i in comp.instructions
                                   if _talks_to_host(i, self.host_computations)}
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
            cancel.checkpoint("compiling the program")  # a Compile's client may cancel it
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
        raw_steps = _used_steps(raw_steps, root_slot, self.host_computations)
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
        # broadcasts only fused steps read are gone now
        return _used_steps(out, root_slot, self.host_computations)

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


def _item(n: int) -> Callable[[Sequence[Any]], Any]:
    """The kernel taking value ``n`` out of a multi-output step's results."""
    return lambda ops: ops[0][n]


def _reshaper(shape: tuple[int, ...]) -> Callable[[Sequence[Any]], Any]:
    return kernels.shapes.reshape_kernel(shape)


def _is_view(value: Any) -> bool:
    return isinstance(value, np.ndarray) and value.base is not None and 0 in value.strides


def compile_module(
    module: ir_pb2.Module, target: Target, options: CompileOptions = CompileOptions()  # noqa: B008 - frozen
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
    cancel.checkpoint("compiling the program")  # between planning phases (cancel.py)
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
                          stage_memory_proportions=options.stage_memory_proportions,
                          partials_types=options.partials_types(),
                          variable_mapping=options.variable_mapping,
                          on_failure="report")
    cancel.checkpoint("planning the tile mapping")
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


_ = errors  # re-exported names live in errors.py
