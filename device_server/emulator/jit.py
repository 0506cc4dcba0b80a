"""Compiled loops for fused groups: the members of a fused group (``fusion.py``) whose result
a compiled loop computes exactly as numpy does run as loop nests made by numba, with every
intermediate value in a register; the other members run their own numpy kernels on the block.

    a fused group, one block            numpy blocks (no jit)     with jit
    t1 = multiply(x, c)                 one numpy call and one    kernel A, one pass:
    t2 = negate(t1)                     block temporary per         for i, j: s[i,j] = -(x[i,j]*c)
    e  = exponential(t2)    (numpy)     member                    e = np.exp(s)   (its own kernel)
    r  = add(e, t1)         (root)                                kernel B, one pass:
                                                                    for i, j: out[i,j] = e[i,j] + x[i,j]*c

A value is *materialized* (written to a block array) when a numpy member reads it, or when it is
the group's result; each materialized value gets a kernel of its own that computes its cone of
compiled members from the materialized values it depends on (shared parts are recomputed: one
output per loop keeps the compiler's loop vectorizer free of aliasing checks). Loads and
arithmetic are hoisted to the outermost loop they depend on (a bias broadcast over rows is
loaded once per row, a scalar once per call).

Exact means bit for bit: only members whose IEEE result does not depend on how it is computed
are compiled (float32/float64 add, subtract, multiply, divide, negate, abs, sqrt, maximum,
minimum, clamp, compare, select, conversions between float32, float64 and bool, and boolean logic);
numba does not contract ``a*b+c`` into a fused multiply-add without fastmath, which stays off.
Transcendental functions (exp, log, tanh, ...) and everything in other types run their numpy
kernels. Results therefore do not depend on whether the jit is used (tested bit for bit).

The jit is on when numba can be imported and ``TF_IPU_EMULATOR_JIT`` is not ``0``;
:func:`set_enabled` switches it for tests. Kernels are compiled when a program is compiled and
cached in the process by their source and signature; scalar constants are arguments, so chains
of the same shape share a kernel. Compiled code is never freed (about 1 MB a kernel), so a
process compiles at most :data:`MAX_KERNELS`; after that, new chains run as numpy blocks.
"""

from __future__ import annotations

import logging
import math
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from device_server.emulator.kernels.elementwise import COMPARE_OPERATORS, OPERATORS

__all__ = ["MAX_KERNELS", "Node", "block_function", "enabled", "expression", "set_enabled"]

log = logging.getLogger(__name__)

_lock = threading.Lock()
_numba: Any = None          # the numba module once imported
_state: bool | None = None  # None: not decided yet
_kernels: dict[tuple[str, str], Callable[..., None]] = {}  # by source and signature
# Compiled machine code is never freed (numba keeps it for the life of the process, about 1 MB
# a kernel), so a server compiles at most this many; later fused chains use numpy blocks.
MAX_KERNELS = 1000
_compiled = 0

_FLOATS = (np.dtype(np.float32), np.dtype(np.float64))
_BOOL = np.dtype(np.bool_)
_LOGIC = {"and": "&", "or": "|", "xor": "^"}


def _load_numba() -> bool:
    global _numba
    try:
        import numba  # noqa: PLC0415 (imported on first use: it takes a few tenths of a second)
    except Exception as e:  # not installed, or broken: numpy blocks still work
        log.warning("emulator jit off: numba cannot be imported (%s: %s)", type(e).__name__, e)
        return False
    _numba = numba
    return True


def enabled() -> bool:
    """Whether fused groups use compiled loops."""
    global _state
    if _state is None:
        with _lock:
            if _state is None:
                _state = os.environ.get("TF_IPU_EMULATOR_JIT", "1").strip() != "0" and _load_numba()
    return _state


def set_enabled(flag: bool) -> None:
    """Switches the jit on or off for programs compiled from now on (on: only if numba can be
    imported)."""
    global _state
    with _lock:
        _state = bool(flag) and (_numba is not None or _load_numba())


def expression(
    opcode: str,
    attrs: dict[str, str],
    operand_dtypes: Sequence[np.dtype | None],
    out_dtype: np.dtype | None,
) -> str | None:
    """The compiled form of an element-wise instruction, a template over its operands
    (``"({0} + {1})"``), or None when a compiled loop could not give numpy's exact result.
    ``attrs`` holds ``direction`` and ``compare_type`` for compare."""
    dts = list(operand_dtypes)
    if out_dtype is None or any(d is None for d in dts):
        return None
    if opcode in OPERATORS:
        if out_dtype in _FLOATS and dts == [out_dtype, out_dtype]:
            return f"({{0}} {OPERATORS[opcode]} {{1}})"
        return None
    if opcode in ("negate", "abs", "sqrt"):
        if out_dtype in _FLOATS and dts == [out_dtype]:
            return {"negate": "(-{0})", "abs": "abs({0})", "sqrt": "np.sqrt({0})"}[opcode]
        return None
    if opcode == "clamp":  # clamp(lo, x, hi) = minimum(maximum(x, lo), hi)
        if out_dtype in _FLOATS and dts == [out_dtype] * 3:
            m = "({1} if ({1} > {0} or {1} != {1}) else {0})"
            return f"({m} if ({m} < {{2}} or {m} != {m}) else {{2}})"
        return None
    if opcode in ("maximum", "minimum"):
        if out_dtype in _FLOATS and dts == [out_dtype, out_dtype]:
            # numpy's: NaN propagates; otherwise the larger (smaller) operand.
            rel = ">" if opcode == "maximum" else "<"
            return f"({{0}} if ({{0}} {rel} {{1}} or {{0}} != {{0}}) else {{1}})"
        return None
    if opcode == "compare":
        direction = attrs.get("direction", "")
        if direction not in COMPARE_OPERATORS or attrs.get("compare_type", "") == "TOTALORDER":
            return None
        if out_dtype == _BOOL and len(dts) == 2 and dts[0] == dts[1] and dts[0] in (*_FLOATS, _BOOL):
            return f"({{0}} {COMPARE_OPERATORS[direction]} {{1}})"
        return None
    if opcode == "select":
        if len(dts) == 3 and dts[0] == _BOOL and dts[1] == dts[2] == out_dtype \
                and out_dtype in (*_FLOATS, _BOOL):
            return "({1} if {0} else {2})"
        return None
    if opcode == "convert":
        if len(dts) != 1 or dts[0] not in (*_FLOATS, _BOOL) or out_dtype not in (*_FLOATS, _BOOL):
            return None
        if dts[0] == out_dtype:
            return "{0}"
        if out_dtype == _BOOL:
            return "({0} != 0)"
        return f"np.{out_dtype.name}({{0}})"
    if opcode in _LOGIC:
        if out_dtype == _BOOL and dts == [_BOOL, _BOOL]:
            return f"({{0}} {_LOGIC[opcode]} {{1}})"
        return None
    if opcode == "not" and out_dtype == _BOOL and dts == [_BOOL]:
        return "(not {0})"
    return None


@dataclass(frozen=True)
class Node:
    """One member of a fused group as this module sees it: ``expr`` (its compiled form, or
    None: it runs ``run`` on numpy arrays), ``args`` (indices of the group's values: inputs
    first, then members in order) and ``dtype`` (of its result)."""

    expr: str | None
    args: tuple[int, ...]
    dtype: np.dtype
    run: Callable[[list[Any], Any], Any]  # (numpy arguments, out array or None) -> result


def _collapse(flags: Sequence[tuple[bool, ...]]) -> list[list[int]]:
    """Runs of consecutive loop dimensions along which every array either varies or does not
    (they become one loop); dimensions along which nothing varies are dropped."""
    runs: list[list[int]] = []
    rank = len(flags[0])
    for d in range(rank):
        col = tuple(f[d] for f in flags)
        if d > 0 and not any(col):
            continue  # size 1 everywhere
        if runs and tuple(f[runs[-1][-1]] for f in flags) == col:
            runs[-1].append(d)
        else:
            runs.append([d])
    return runs


def block_function(
    inner: tuple[int, ...],
    input_shapes: Sequence[tuple[int, ...] | None],
    inputs: Sequence[tuple[np.dtype, Any]],
    nodes: Sequence[Node],
) -> Callable[[list[Any], np.ndarray], None] | None:
    """The function computing one block of a fused group with compiled loops:
    ``fn(blocks, dst)``, where ``dst`` is the block of the output (``(n, *inner)``) and
    ``blocks`` the inputs' blocks as the numpy path cuts them (C-ordered): ``input_shapes[j]``
    is ``(rows, *padded_inner)`` for an input cut into rows (its block is ``(n,
    *padded_inner)``), the padded inner shape for one broadcast over the rows, or None for a
    scalar. ``inputs[j]`` is the input's dtype and, for a one-element constant, its value
    (compiled into the loops). None when no member compiles, or the jit is off."""
    if not enabled() or not any(n.expr is not None for n in nodes):
        return None
    n_in = len(input_shapes)
    rank = 1 + len(inner)
    # Which loop dimensions (rows, then the inner ones) each array varies along.
    vary_in: list[tuple[bool, ...]] = []
    for s in input_shapes:
        if s is None:
            vary_in.append((False,) * rank)
        elif len(s) == rank:
            vary_in.append((True, *(v != 1 for v in s[1:])))
        else:
            vary_in.append((False, *(v != 1 for v in s)))
    vary_full = (True, *(v != 1 for v in inner))
    runs = _collapse([*vary_in, vary_full])
    sizes = [math.prod(inner[d - 1] for d in run if d > 0) for run in runs]  # run 0: times n
    vary = [tuple(any(v[d] for d in run) for run in runs) for v in vary_in]
    vary += [tuple(any(vary_full[d] for d in run) for run in runs)] * len(nodes)
    dtypes = [np.dtype(d) for d, _ in inputs] + [n.dtype for n in nodes]
    consts = {j: np.asarray(c, dtypes[j]).reshape(-1)[0] for j, (_, c) in enumerate(inputs)
              if c is not None and not any(vary[j])}

    # Which values are materialized (block arrays), and in what order things run.
    root = n_in + len(nodes) - 1
    materialized = set(range(n_in))
    plan: list[tuple[bool, int]] = []  # (compiled?, value)
    for k, node in enumerate(nodes):
        if node.expr is None:
            for a in node.args:
                if a not in materialized:
                    materialized.add(a)
                    plan.append((True, a))
            materialized.add(n_in + k)
            plan.append((False, n_in + k))
    if root not in materialized:
        plan.append((True, root))
    if not any(c for c, _ in plan):
        return None

    def shape_of(v: int) -> tuple[int, ...]:  # in the collapsed loops; -1 where n goes
        return tuple((-1 if c == 0 else sizes[c]) for c in range(len(runs)) if vary[v][c])

    # Each step: (value, kernel or None, [(value, shape or None for a scalar)], constants).
    steps: list[tuple[int, Callable[..., None] | None, list[tuple[int, tuple[int, ...] | None]],
                      list[np.ndarray]]] = []
    for compiled, v in plan:
        if not compiled:
            steps.append((v, None, [], []))
            continue
        try:
            fn, used, extra = _make_kernel(v, n_in, nodes, dtypes, materialized - {v}, vary, consts)
        except _Full:
            return None
        except Exception as e:  # a numba failure must not fail the program: numpy blocks
            log.warning("emulator jit: a fused loop did not compile (%s: %s); numpy runs it",
                        type(e).__name__, str(e).splitlines()[0] if str(e) else "")
            return None
        steps.append((v, fn, [(a, shape_of(a) if any(vary[a]) else None) for a in used], extra))
    out_shape = shape_of(root)
    rest = sizes[1:]

    def run(blocks: list[Any], dst: np.ndarray) -> None:
        n = dst.shape[0]
        vals: list[Any] = [*blocks, *([None] * len(nodes))]
        block = (n, *inner)
        d0 = sizes[0] * n
        for v, fn, used, extra in steps:
            if fn is None:
                node = nodes[v - n_in]
                args = [vals[a] for a in node.args]
                if v == root:
                    node.run(args, dst)
                    return
                r = np.asarray(node.run(args, None))
                if r.shape != block or r.dtype != dtypes[v] or not r.flags.c_contiguous:
                    r = np.ascontiguousarray(np.broadcast_to(r.astype(dtypes[v], copy=False), block))
                vals[v] = r
                continue
            args = []
            for a, shape in used:
                x = vals[a]
                if shape is None:
                    args.append(np.asarray(x).reshape(-1)[0])
                else:
                    args.append(x.reshape(tuple(d0 if d < 0 else d for d in shape)))
            out = dst if v == root else np.empty(block, dtypes[v])
            fn(d0, *rest, *args, *extra, out.reshape(tuple(d0 if d < 0 else d for d in out_shape)))
            vals[v] = out

    return run


def _make_kernel(
    target: int,
    n_in: int,
    nodes: Sequence[Node],
    dtypes: Sequence[np.dtype],
    sources: set[int],
    vary: Sequence[tuple[bool, ...]],
    consts: dict[int, Any],
) -> tuple[Callable[..., None], list[int], list[np.ndarray]]:
    """A loop nest writing value ``target`` from the values in ``sources`` (materialized;
    those in ``consts`` are scalar constants); the values it takes as arguments, in order;
    and the arrays of constants (one per dtype) that follow them. Constants are arguments,
    not compiled in, so that chains of the same shape share one kernel whatever their
    constants (each compiled kernel keeps about 1 MB of machine code for good)."""
    loops = len(vary[target])
    cone: list[int] = []
    seen: set[int] = set()

    def visit(v: int) -> None:
        if v in seen:
            return
        seen.add(v)
        if v in sources:
            return
        for a in nodes[v - n_in].args:
            visit(a)
        cone.append(v)

    visit(target)
    names: dict[int, str] = {}
    level: dict[int, int] = {}
    stmts: list[list[str]] = [[] for _ in range(loops + 1)]
    params: list[str] = []
    used: list[int] = []
    nb = _numba
    sig_args: list[Any] = []
    constants: dict[str, list[Any]] = {}  # dtype name -> values, read at the top
    for v in sorted(v for v in seen if v in sources):
        idx = [f"i{c}" for c in range(loops) if vary[v][c]]
        names[v] = f"v{v}"
        if v in consts:
            values = constants.setdefault(dtypes[v].name, [])
            stmts[0].append(f"v{v} = k_{dtypes[v].name}[{len(values)}]")
            values.append(consts[v])
            level[v] = 0
            continue
        used.append(v)
        if not idx:
            params.append(f"v{v}")
            sig_args.append(nb.from_dtype(dtypes[v]))
            level[v] = 0
        else:
            params.append(f"a{v}")
            # read-only: a writable array converts to it; frozen constants are read-only
            sig_args.append(nb.types.Array(nb.from_dtype(dtypes[v]), len(idx), "C", readonly=True))
            level[v] = max(c for c in range(loops) if vary[v][c]) + 1
            stmts[level[v]].append(f"v{v} = a{v}[{', '.join(idx)}]")
    for v in cone:
        node = nodes[v - n_in]
        assert node.expr is not None
        names[v] = f"t{v}"
        level[v] = max((level[a] for a in node.args), default=0)
        # The cast is a no-op when numba's type is already the member's (it is for every
        # template above); it pins the type the loop computes in.
        value = node.expr.format(*(names[a] for a in node.args))
        stmts[level[v]].append(f"t{v} = np.{node.dtype.name}({value})")
    extra = []
    for name in sorted(constants):
        params.append(f"k_{name}")
        sig_args.append(nb.types.Array(nb.from_dtype(np.dtype(name)), 1, "C", readonly=True))
        array = np.array(constants[name], np.dtype(name))
        array.flags.writeable = False
        extra.append(array)
    out_idx = ", ".join(f"i{c}" for c in range(loops) if vary[target][c])
    lines = [f"def kernel({', '.join([*(f'd{c}' for c in range(loops)), *params, 'out'])}):"]
    indent = "    "
    for c in range(loops + 1):
        lines += [indent + s for s in stmts[c]]
        if c < loops:
            lines.append(f"{indent}for i{c} in range(d{c}):")
            indent += "    "
    lines.append(f"{indent}out[{out_idx}] = {names[target]}")
    source = "\n".join(lines) + "\n"
    sig = nb.void(*([nb.intp] * loops), *sig_args,
                  nb.types.Array(nb.from_dtype(dtypes[target]), sum(vary[target]), "C"))
    return _compile(source, sig), used, extra


class _Full(Exception):
    """This process has compiled as many kernels as it may (:data:`MAX_KERNELS`)."""


def _compile(source: str, sig: Any) -> Callable[..., None]:
    """``kernel`` of ``source`` compiled for ``sig`` (cached by both)."""
    global _compiled
    key = (source, str(sig))
    with _lock:
        fn = _kernels.get(key)
        if fn is None:
            if _compiled >= MAX_KERNELS:
                if _compiled == MAX_KERNELS:
                    log.warning("emulator jit: %d kernels compiled in this process (about 1 MB "
                                "each); new fused chains run as numpy calls", MAX_KERNELS)
                    _compiled += 1
                raise _Full()
            scope: dict[str, Any] = {"np": np}
            exec(compile(source, "<emulator jit>", "exec"), scope)  # our own generated source
            fn = _numba.njit(sig, nogil=True, error_model="numpy", cache=False)(scope["kernel"])
            _compiled += 1
            _kernels[key] = fn
    return fn
