"""Generated source: a computation's step list becomes one Python function.

    [_Step(fn, ins, out, template), ...] --_generate--> def run(args, d=()):
                                                            p0, p1, = args
                                                            try:
                                                                v0 = k0([p0, c3])      # a kernel call
                                                                v1 = (v0 + s4)         # an inline template
                                                                ...
                                                            except Exception as e: ... fail(e)
                                                            return v1

Values are locals, constants and kernels are the function's globals, and a failing step is
found from the traceback's line number (``_FIRST_STEP_LINE``), so the hot path keeps no
counter. Only names made here (``_GENERATED``, ``_SAFE_WORDS``) and kernels' templates become
code; nothing from the program's text does (checked before ``exec``). :class:`Program` wraps
the function.
"""

from __future__ import annotations

import keyword
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from device_server.emulator import cancel
from device_server.emulator.errors import (
    EmulatorError,
    ExecutionError,
    InvalidProgramError,
    describe,
)
from device_server.protocol import ir_pb2

__all__ = ["Program"]

# Words the generated code may contain besides names it defines and its globals.
_SAFE_WORDS = frozenset(keyword.kwlist) | {"run", "args", "e", "x", "Exception", "out", "d"}
_GENERATED = re.compile(r"(p|v|u|k|s)[0-9]+|g[0-9]+_[A-Za-z0-9_]+|[0-9][A-Za-z0-9_]*")


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
