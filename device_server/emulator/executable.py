"""The executable: a compiled module's signature, estimate and program, run on arguments.

    module --_Signature.of--> parameters, outputs, aliases (checked)
                                   |
    compile_module ----------------+--> Executable(program)  --run(args, donated, stop)--> outputs
    executable_from_record(record) +--> Executable(build)    (program generated at the first run)
                                   |
    Executable.cache_record() <----+    plain JSON for the disk cache (no code)

``run`` checks the arguments against the signature, calls the program (thread-safe: it holds
no mutable state) and returns C-contiguous, writable arrays.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from device_server.emulator import cancel, dynamic
from device_server.emulator.arch import Target
from device_server.emulator.codegen import Program
from device_server.emulator.errors import ExecutionError, InvalidProgramError, describe
from device_server.emulator.estimate import Estimate
from device_server.emulator.options import CompileOptions, _checked_options
from device_server.emulator.values import _fits, _leaves, _shape_of
from device_server.protocol import ir_pb2

__all__ = ["Executable", "executable_from_record"]


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
    if (est.ipu_version, est.tiles_per_ipu, est.clock_hz) != (
            target.ipu_version, target.tiles_per_ipu, target.clock_hz):
        raise ValueError(f"its estimate is for {est.ipu_version} with {est.tiles_per_ipu} tiles "
                         f"at {est.clock_hz!r} Hz, not {target.ipu_version} with "
                         f"{target.tiles_per_ipu} at {target.clock_hz!r} Hz")
    if est.refused and not options.allow_out_of_memory:
        raise ValueError("its estimate does not fit, and the options do not allow that")

    def build() -> Program:
        from device_server.emulator.compiler import _build_program  # compiler imports this module

        return _build_program(module, target, options)[1]

    return Executable(
        module, target, options, None, sig.parameters, sig.param_names, sig.outputs,
        sig.root_is_tuple, sig.aliases, est, count, sig.parameter_dynamic, sig.output_dynamic,
        build=build,
    )


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
