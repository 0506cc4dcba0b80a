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
minimum, clamp, compare (also of integers), select, conversions between float32, float64 and
bool, and boolean logic); numba does not contract ``a*b+c`` into a fused multiply-add without
fastmath, which stays off. Transcendental functions (exp, log, tanh, ...) and everything in
other types run their numpy kernels. Results therefore do not depend on whether the jit is used
(tested bit for bit).

Small arrays in loop bodies (:func:`group_function`): a group of ``fusion.plan_small_groups``
runs as one loop nest over the whole result, without blocks or threads, and writes every
member that is read outside the group (an Adam update: the new moments and the new weights in
one pass), because there a numpy call costs about a microsecond whatever its size. Such a loop
is compiled once its group has run :data:`HOT_RUNS` times (or at once when the process has
compiled the same loop before): a program run a few times does not pay a few tenths of a
second per loop for microseconds. :func:`row_sum` is the float32 sum over the rows of a small
matrix (a bias gradient), in numpy's float64 order.

The jit is on when numba can be imported and ``TF_IPU_EMULATOR_JIT`` is not ``0``;
:func:`set_enabled` switches it for tests. Kernels are compiled when a program is compiled (a
small group's when it is hot) and cached in the process by their source and signature; scalar
constants and sizes are arguments, so chains of the same shape share a kernel. Compiled code is
never freed (about 1 MB a kernel), so a process compiles at most :data:`MAX_KERNELS`; after
that, new chains run as numpy blocks.
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

__all__ = ["HOT_RUNS", "MAX_KERNELS", "Node", "block_function", "enabled", "expression", "group_function",
           "row_sum", "set_enabled"]

log = logging.getLogger(__name__)

_lock = threading.Lock()
_numba: Any = None          # the numba module once imported
_state: bool | None = None  # None: not decided yet
_kernels: dict[tuple[str, str], Callable[..., None]] = {}  # by source and signature
# Compiled machine code is never freed (numba keeps it for the life of the process, about 1 MB
# a kernel), so a server compiles at most this many; later fused chains use numpy blocks.
MAX_KERNELS = 1000
# A small group's loop that this process has not compiled yet is compiled once the group has
# run this many times (group_function); until then its members run their numpy kernels.
HOT_RUNS = 100
_compiled = 0

_FLOATS = (np.dtype(np.float32), np.dtype(np.float64))
_BOOL = np.dtype(np.bool_)
_INTS = tuple(np.dtype(t) for t in (np.int8, np.int16, np.int32, np.int64,
                                     np.uint8, np.uint16, np.uint32, np.uint64))
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
        # (integers compare exactly too: labels against a one-hot iota)
        if out_dtype == _BOOL and len(dts) == 2 and dts[0] == dts[1] \
                and (dts[0] in (*_FLOATS, _BOOL) or dts[0] in _INTS):
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
    extra = _constant_params(nb, constants, params, sig_args)
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


def _constant_params(nb: Any, constants: dict[str, list[Any]], params: list[str],
                     sig_args: list[Any]) -> list[np.ndarray]:
    """A kernel's scalar constants, one read-only array per dtype: appends their parameter
    names and numba types; returns the arrays to pass."""
    extra = []
    for name in sorted(constants):
        params.append(f"k_{name}")
        sig_args.append(nb.types.Array(nb.from_dtype(np.dtype(name)), 1, "C", readonly=True))
        array = np.array(constants[name], np.dtype(name))
        array.flags.writeable = False
        extra.append(array)
    return extra


def group_function(
    shape: tuple[int, ...],
    inputs: Sequence[tuple[np.dtype, tuple[int, ...], Any]],
    nodes: Sequence[Node],
    exports: Sequence[int],
    fallback: Callable[[Sequence[Any]], Any],
) -> Callable[[Sequence[Any]], Any] | None:
    """A whole fused group of small arrays as one compiled loop nest (no blocks, no threads):
    ``fn(ops)`` takes the group's inputs and returns the values of the members ``exports``
    (indices into ``nodes``), one array each of ``shape`` (a tuple of them when there are
    several). Every node must have a compiled form; ``inputs[j]`` is the input's dtype, its
    shape (numpy-broadcast to ``shape``; ``()`` for a scalar) and, for a one-element
    constant, its value. ``fallback(ops)`` (the members' numpy kernels) computes the same.

    Compiling a loop costs a few tenths of a second and saves microseconds a run, so a loop
    that this process has not compiled yet is compiled only once the group has run
    :data:`HOT_RUNS` times (a loop body of a training that goes on); until then, and for
    inputs the loop cannot take (a value of another type), ``fallback`` runs. None when the
    jit is off or the group does not fit a loop nest."""
    if not enabled() or not nodes or any(n.expr is None for n in nodes) or not exports:
        return None
    rank = len(shape)
    dtypes = [np.dtype(d) for d, _, _ in inputs] + [n.dtype for n in nodes]
    # Along which dimensions of the result each input varies (numpy's broadcasting).
    vary: list[tuple[bool, ...]] = []
    for _, dims, _ in inputs:
        if len(dims) > rank:
            return None
        padded = (1,) * (rank - len(dims)) + tuple(dims)
        if any(v not in (1, s) for v, s in zip(padded, shape, strict=True)):
            return None
        vary.append(tuple(v != 1 for v in padded))
    consts = {j: np.asarray(c, dtypes[j]).reshape(-1)[0] for j, (_, dims, c) in enumerate(inputs)
              if c is not None and not any(vary[j])}
    source, sig, takes, extra = _group_kernel_source(shape, inputs, nodes, exports, dtypes, vary,
                                                     consts)

    def make() -> Callable[[Sequence[Any]], Any] | None:
        """The call of the compiled loop, or None (the process's kernels are all used, or
        numba failed: numpy goes on)."""
        try:
            kernel = _compile(source, sig)
        except _Full:
            return None
        except Exception as e:  # a numba failure must not fail the program
            log.warning("emulator jit: a fused loop did not compile (%s: %s); numpy runs it",
                        type(e).__name__, str(e).splitlines()[0] if str(e) else "")
            return None
        return _group_call(kernel, shape, takes, extra, [dtypes[len(inputs) + e] for e in exports],
                           len(inputs), fallback)

    with _lock:
        ready = (source, str(sig)) in _kernels
    if ready:
        return make()
    runs = [0]
    impl: list[Callable[[Sequence[Any]], Any]] = []

    def counting(ops: Sequence[Any]) -> Any:
        runs[0] += 1  # (threads may miss a count: a run more or less before compiling)
        if runs[0] >= HOT_RUNS and impl[0] is counting:
            impl[0] = make() or fallback
        return fallback(ops)

    impl.append(counting)

    def run(ops: Sequence[Any]) -> Any:
        return impl[0](ops)

    run.compiled = lambda: impl[0] is not counting and impl[0] is not fallback  # type: ignore[attr-defined]
    return run


def _group_call(kernel: Callable[..., None], shape: tuple[int, ...], takes: list[tuple[int, bool]],
                extra: list[np.ndarray], out_dtypes: list[np.dtype], n_in: int,
                fallback: Callable[[Sequence[Any]], Any]) -> Callable[[Sequence[Any]], Any]:
    """The call of a group's compiled loop, as Python source of our own making: the inputs
    unpacked, arrays C-ordered (a no-op for almost all of them; a transposed view is
    copied), scalars as numpy scalars (``x[()]`` of a 0-d array or of a numpy scalar), the
    results allocated here; inputs numba refuses go to ``fallback``."""
    names: dict[str, Any] = {"kern": kernel, "empty": np.empty, "shape": tuple(shape),
                             "c_order": np.ascontiguousarray, "fallback": fallback,
                             "Mismatch": (TypeError, ValueError)}
    args = [str(int(d)) for d in shape]
    for j, scalar in takes:
        args.append(f"x{j}[()]" if scalar else f"c_order(x{j})")
    for n, array in enumerate(extra):
        names[f"k{n}"] = array
        args.append(f"k{n}")
    lines = ["def run(ops):", "    " + "".join(f"x{j}, " for j in range(n_in)) + "= ops"]
    for n, dt in enumerate(out_dtypes):
        names[f"t{n}"] = dt
        lines.append(f"    o{n} = empty(shape, t{n})")
        args.append(f"o{n}")
    lines += ["    try:", f"        kern({', '.join(args)})", "    except Mismatch:",
              "        return fallback(ops)",
              "    return " + (", ".join(f"o{n}" for n in range(len(out_dtypes)))
                             if len(out_dtypes) > 1 else "o0")]
    exec(compile("\n".join(lines) + "\n", "<emulator jit call>", "exec"), names)
    run = names["run"]
    run.compiled = lambda: True
    return run


def _group_kernel_source(
    shape: tuple[int, ...],
    inputs: Sequence[tuple[np.dtype, tuple[int, ...], Any]],
    nodes: Sequence[Node],
    exports: Sequence[int],
    dtypes: Sequence[np.dtype],
    vary: Sequence[tuple[bool, ...]],
    consts: dict[int, Any],
) -> tuple[str, Any, list[tuple[int, bool]], list[np.ndarray]]:
    """The loop nest of :func:`group_function`: one loop per dimension of the result (sizes
    are arguments), every input read in its own shape at the loop level of the last
    dimension it varies along, every member computed at the level of its operands, and the
    exported members written at the innermost level. Returns its source and numba
    signature, the inputs it takes (index, whether as a scalar) and the arrays of constants
    (one per dtype) after them."""
    nb = _numba
    rank = len(shape)
    n_in = len(inputs)
    stmts: list[list[str]] = [[] for _ in range(rank + 1)]
    level: dict[int, int] = {}
    names: dict[int, str] = {}
    params: list[str] = []
    sig_args: list[Any] = []
    takes: list[tuple[int, bool]] = []
    constants: dict[str, list[Any]] = {}  # dtype name -> values, read at the top
    for j, (_, dims, _) in enumerate(inputs):
        names[j] = f"v{j}"
        if j in consts:
            values = constants.setdefault(dtypes[j].name, [])
            stmts[0].append(f"v{j} = k_{dtypes[j].name}[{len(values)}]")
            values.append(consts[j])
            level[j] = 0
            continue
        if not dims:
            params.append(f"v{j}")
            sig_args.append(nb.from_dtype(dtypes[j]))
            takes.append((j, True))
            level[j] = 0
            continue
        params.append(f"a{j}")
        # C-ordered (the call makes a view C-ordered first); read-only: a writable array
        # converts to it.
        sig_args.append(nb.types.Array(nb.from_dtype(dtypes[j]), len(dims), "C", readonly=True))
        takes.append((j, False))
        lead = rank - len(dims)
        idx = [f"i{lead + e}" if d != 1 else "0" for e, d in enumerate(dims)]
        level[j] = max((c + 1 for c in range(rank) if vary[j][c]), default=0)
        stmts[level[j]].append(f"v{j} = a{j}[{', '.join(idx)}]")
    for k, node in enumerate(nodes):
        v = n_in + k
        assert node.expr is not None
        names[v] = f"t{v}"
        level[v] = max((level[a] for a in node.args), default=0)
        # The cast pins the type the loop computes in (a no-op for every template above).
        value = node.expr.format(*(names[a] for a in node.args))
        stmts[level[v]].append(f"t{v} = np.{node.dtype.name}({value})")
    extra = _constant_params(nb, constants, params, sig_args)
    out_idx = ", ".join(f"i{c}" for c in range(rank))
    for n, e in enumerate(exports):
        params.append(f"o{n}")
        sig_args.append(nb.types.Array(nb.from_dtype(dtypes[n_in + e]), rank, "C"))
        stmts[rank].append(f"o{n}[{out_idx}] = {names[n_in + e]}")
    lines = [f"def kernel({', '.join([*(f'd{c}' for c in range(rank)), *params])}):"]
    indent = "    "
    for c in range(rank + 1):
        lines += [indent + s for s in stmts[c]]
        if c < rank:
            lines.append(f"{indent}for i{c} in range(d{c}):")
            indent += "    "
    source = "\n".join(lines) + "\n"
    sig = nb.void(*([nb.intp] * rank), *sig_args)
    return source, sig, takes, extra


_ROW_SUM = """
def kernel(x, init, out):
    n0, n1 = x.shape
    acc = np.zeros(n1, np.float64)
    for i in range(n0):
        for j in range(n1):
            acc[j] += np.float64(x[i, j])
    for j in range(n1):
        out[j] = np.float32(acc[j] + init)
"""


def row_sum() -> Callable[[np.ndarray, float, np.ndarray], None] | None:
    """``fn(x, init, out)``: the float32 sum of the rows of a C-ordered 2-D float32 ``x``,
    accumulated in float64 and rounded once, written into ``out`` (float32, one value per
    column): ``np.add(np.add.reduce(x, axis=0, dtype=np.float64), init)`` bit for bit (numpy
    starts from 0.0 and adds the rows one after another when the summed axis is not the
    innermost one; with one column it is, and numpy sums pairwise, so use numpy then).
    None when the jit is off or the kernel does not compile."""
    if not enabled():
        return None
    nb = _numba
    f32 = nb.float32
    sig = nb.void(nb.types.Array(f32, 2, "C", readonly=True), nb.float64,
                  nb.types.Array(f32, 1, "C"))
    try:
        return _compile(_ROW_SUM, sig)
    except _Full:
        return None
    except Exception as e:  # a numba failure must not fail the program: numpy runs it
        log.warning("emulator jit: the row sum did not compile (%s: %s); numpy runs it",
                    type(e).__name__, str(e).splitlines()[0] if str(e) else "")
        return None


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
