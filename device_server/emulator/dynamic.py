"""Bounded dynamic shapes: how kernels run on values whose dynamic dimensions have a run-time size.

An IR shape may mark dimensions dynamic (``Shape.dynamic_dims``): ``dims[i]`` is then a bound
and the value's size along ``i`` is known only at run time. The emulator keeps such a value as
a numpy array of its *run-time* shape (every dynamic size at most its bound), which is what XLA
returns to TensorFlow; elements past a dynamic size (XLA's padding) do not exist.

Kernel factories plan for static shapes. For an instruction with a dynamic dimension in its
shape or an operand's, the compiler asks :func:`plan` for its kernel:

* opcodes that only pass values on (``tuple``, ``while``, ``call``, ...) and those whose kernels
  read sizes at run time themselves (``get-dimension-size``, ``set-dimension-size``,
  ``dynamic-reshape``) keep their kernel;
* every other opcode with a :class:`Rule` runs the kernel its factory plans for the run-time
  shapes, planned on first use of a shape and cached. Before the call, operand dimensions that
  must agree (an element-wise op's operands, a dot's contracting dimensions, ...) are brought
  to the largest run-time size among the dynamic ones, as XLA's dynamic padder does: a static
  operand loses the elements past it, a shorter dynamic operand is padded with zeros (XLA
  reads its padding there). Operand dimensions the op reads past the run-time size (a gather
  or a dynamic-slice clamps its start against the bound) are padded with zeros to the bound.
  The rule also gives the result's run-time shape; a static result dimension that comes out
  smaller is padded with zeros to its size, a dynamic one that comes out of the padded region
  is cut;
* opcodes without a rule, or attributes a rule cannot follow (a convolution over a dynamic
  spatial dimension), raise :class:`UnsupportedOpError` naming the instruction.

When every size equals its bound, the kernel planned at compile time for the bounds runs.
Instructions without dynamic dimensions never come here: static programs run as before.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from device_server.emulator.errors import UnsupportedOpError, describe
from device_server.emulator.kernels import KernelContext, KernelFn
from device_server.protocol import ir_pb2

__all__ = ["Rule", "dynamic_flags", "handles", "has_dynamic", "plan", "resize"]

Shape = tuple[int, ...]
# (operand shapes, result leaf shapes, attribute overrides) -> a kernel for those shapes
Specializer = Callable[[Sequence[Shape], Sequence[Shape], dict[str, tuple[int, ...]]], KernelFn]

# Opcodes whose kernels take dynamic values as they are: they pass values on, or read sizes.
PASS_THROUGH = frozenset({
    "parameter", "constant", "tuple", "get-tuple-element", "copy", "opt-barrier",
    "add-dependency", "after-all", "while", "call", "conditional",
    "get-dimension-size", "set-dimension-size", "dynamic-reshape",
})
# Opcodes whose result has the shape of their operands (scalars aside), element by element or
# along one dimension.
_SAME_SHAPE = frozenset({
    "abs", "negate", "exponential", "exponential-minus-one", "log", "log-plus-one", "logistic",
    "sqrt", "rsqrt", "cbrt", "tanh", "sine", "cosine", "tan", "floor", "ceil",
    "round-nearest-afz", "round-nearest-even", "sign", "erf", "is-finite", "not", "popcnt",
    "count-leading-zeros", "real", "imag", "complex", "add", "subtract", "multiply", "divide",
    "remainder", "power", "maximum", "minimum", "atan2", "and", "or", "xor", "shift-left",
    "shift-right-logical", "shift-right-arithmetic", "compare", "select", "clamp", "convert",
    "reduce-precision", "map", "reverse", "sort",
})
_CACHE_LIMIT = 256  # run-time shapes planned per instruction before the cache starts over


def dynamic_flags(shape: ir_pb2.Shape) -> tuple[bool, ...]:
    """Which dimensions of an array shape are dynamic (``()`` for tuples and tokens)."""
    if shape.is_tuple or shape.dtype == ir_pb2.TOKEN:
        return ()
    flags = tuple(bool(b) for b in shape.dynamic_dims)
    return flags + (False,) * (len(shape.dims) - len(flags))


def has_dynamic(shape: ir_pb2.Shape) -> bool:
    """Whether a shape (or a leaf of a tuple shape) has a dynamic dimension."""
    if shape.is_tuple:
        return any(has_dynamic(s) for s in shape.tuple_shapes)
    return any(shape.dynamic_dims)


def handles(opcode: str) -> bool:
    """Whether instructions of ``opcode`` may have dynamic dimensions on the emulator."""
    return opcode in PASS_THROUGH or opcode in _RULES


def _leaves(shape: ir_pb2.Shape) -> list[ir_pb2.Shape]:
    if shape.is_tuple:
        return [leaf for s in shape.tuple_shapes for leaf in _leaves(s)]
    return [shape]


def resize(a: Any, shape: Shape) -> np.ndarray:
    """``a`` cut or padded with zeros (at the end of each dimension) to ``shape``."""
    a = np.asarray(a)
    if a.shape == shape:
        return a
    a = a[tuple(slice(0, n) for n in shape)]
    if a.shape == shape:
        return a
    out = np.zeros(shape, a.dtype)
    out[tuple(slice(0, n) for n in a.shape)] = a
    return out


# ------------------------------------------------------------------------------------- rules


@dataclass(frozen=True)
class Rule:
    """How an opcode's kernel follows run-time sizes.

    ``out``: operand shapes -> the result's leaf shapes (what the op gives for operands of
    those shapes); ``agree``: groups of (operand, dimension, dynamic) brought to the largest
    size among the group's dynamic dimensions;
    ``whole``: (operand, dimension) padded with zeros to the bound before the kernel runs;
    ``attrs``: operand shapes -> attribute values the kernel must be planned with."""

    out: Callable[[Sequence[Shape]], list[Shape]]
    agree: tuple[tuple[tuple[int, int, bool], ...], ...] = ()
    whole: tuple[tuple[int, int], ...] = ()
    attrs: Callable[[Sequence[Shape]], dict[str, tuple[int, ...]]] | None = None


def _unsupported(ctx: KernelContext, why: str) -> UnsupportedOpError:
    return UnsupportedOpError(f"Unsupported op on the IPU emulator: {describe(ctx.instr)}: {why}")


def _ints(ctx: KernelContext, name: str, default: tuple[int, ...] = ()) -> tuple[int, ...]:
    return tuple(int(v) for v in ctx.attr(name, default))


def _int(ctx: KernelContext, name: str, default: int = 0) -> int:
    return int(ctx.attr(name, default))


def _groups(ctx: KernelContext, groups: Sequence[Sequence[tuple[int, int]]]) -> tuple[tuple[tuple[int, int, bool], ...], ...]:
    """The groups that may disagree at run time (two members or more, one of them dynamic),
    each member marked dynamic or not."""
    out = []
    for g in groups:
        members = tuple((k, d, ctx.operand_dynamic[k][d]) for k, d in g)
        if len(members) > 1 and any(dy for _, _, dy in members):
            out.append(members)
    return tuple(out)


def _n_leaves(ctx: KernelContext) -> int:
    return len(_leaves(ctx.instr.shape))


def _same_shape(ctx: KernelContext) -> Rule:
    leaves = _leaves(ctx.instr.shape)
    rank = len(leaves[0].dims)
    full = [k for k, (dt, s) in enumerate(zip(ctx.operand_dtypes, ctx.operand_shapes, strict=True))
            if dt is not None and len(s) == rank]
    if not full:
        raise _unsupported(ctx, "no operand has the result's rank")
    first = full[0]
    n = len(leaves)
    return Rule(lambda s: [s[first]] * n, _groups(ctx, [[(k, d) for k in full] for d in range(rank)]))


def _bitcast_convert(ctx: KernelContext) -> Rule:
    rank_in, rank_out = len(ctx.operand_shapes[0]), len(ctx.out_shape)
    if rank_in == rank_out:
        return Rule(lambda s: [s[0]])
    last = ctx.out_shape[-1:] if rank_out > rank_in else ()
    if rank_out < rank_in and ctx.operand_dynamic[0][-1]:
        raise _unsupported(ctx, "the dimension a bitcast-convert folds into wider elements is dynamic")
    return Rule(lambda s: [tuple(s[0][:rank_out]) + last])


def _transpose(ctx: KernelContext) -> Rule:
    perm = _ints(ctx, "permutation")
    return Rule(lambda s: [tuple(s[0][p] for p in perm)])


def _broadcast(ctx: KernelContext) -> Rule:
    dims = _ints(ctx, "dimensions")
    bounds = ctx.out_shape
    follow = [(i, d) for i, d in enumerate(dims) if ctx.operand_shapes[0][i] == bounds[d]]

    def out(s: Sequence[Shape]) -> list[Shape]:
        r = list(bounds)
        for i, d in follow:
            r[d] = s[0][i]
        return [tuple(r)]

    return Rule(out)


def _factor_groups(a: Shape, b: Shape) -> list[tuple[range, range]]:
    """Consecutive dimension ranges of ``a`` and ``b`` with equal products (a reshape moves
    elements only within such a group)."""
    groups = []
    i = j = 0
    while i < len(a) or j < len(b):
        si, sj = i, j
        pa = pb = 1
        while not (pa == pb and (i > si or j > sj)) and (i < len(a) or j < len(b)):
            if i < len(a) and (pa <= pb or j == len(b)):
                pa *= a[i]
                i += 1
            else:
                pb *= b[j]
                j += 1
        groups.append((range(si, i), range(sj, j)))
    return groups


def _reshape(ctx: KernelContext) -> Rule:
    """Within each group of dimensions a reshape keeps together, a dynamic result dimension
    gets the group's run-time element count over the other dimensions' sizes; a group with
    dynamic operand dimensions but only static result dimensions reshapes the operand padded
    to its bounds (XLA's padded layout)."""
    src, dst = ctx.operand_shapes[0], ctx.out_shape
    src_dyn, dst_dyn = ctx.operand_dynamic[0], ctx.out_dynamic
    plans: list[tuple[range, int, int]] = []  # (operand dims, dynamic result dim, static product)
    whole = []
    for sd, dd in _factor_groups(src, dst):
        dyn_out = [d for d in dd if dst_dyn[d]]
        dyn_in = [d for d in sd if src_dyn[d]]
        if len(dyn_out) > 1:
            raise _unsupported(ctx, f"reshape of {list(src)} to {list(dst)} leaves dimensions "
                                    f"{dyn_out} dynamic together: their sizes are ambiguous")
        if dyn_out and dyn_in:
            rest = int(np.prod([dst[d] for d in dd if d != dyn_out[0]], dtype=np.int64))
            plans.append((sd, dyn_out[0], rest))
        elif dyn_in:
            whole.extend((0, d) for d in dyn_in)

    def out(s: Sequence[Shape]) -> list[Shape]:
        r = list(dst)
        for sd, d, rest in plans:
            count = int(np.prod([s[0][k] for k in sd], dtype=np.int64))
            if rest == 0 or count % rest:
                raise ValueError(f"{count} elements do not reshape to dimension {d} of {list(dst)}")
            r[d] = count // rest
        return [tuple(r)]

    return Rule(out, whole=tuple(whole))


def _slice(ctx: KernelContext) -> Rule:
    starts, limits = _ints(ctx, "start_indices"), _ints(ctx, "limit_indices")
    strides = _ints(ctx, "strides", (1,) * len(starts))
    dims = list(zip(starts, limits, strides, strict=True))
    return Rule(lambda s: [tuple(len(range(a, min(b, n), c)) for (a, b, c), n in zip(dims, s[0], strict=True))])


def _pad(ctx: KernelContext) -> Rule:
    lo, hi = _ints(ctx, "edge_padding_low"), _ints(ctx, "edge_padding_high")
    inner = _ints(ctx, "interior_padding", (0,) * len(lo))
    dims = list(zip(lo, hi, inner, strict=True))
    return Rule(lambda s: [tuple(max(0, a + b + n + max(n - 1, 0) * c) for (a, b, c), n in zip(dims, s[0], strict=True))])


def _concatenate(ctx: KernelContext) -> Rule:
    axis = _int(ctx, "dimension")
    rank = len(ctx.out_shape)
    k_all = range(len(ctx.operand_shapes))

    def out(s: Sequence[Shape]) -> list[Shape]:
        r = list(s[0])
        r[axis] = sum(x[axis] for x in s)
        return [tuple(r)]

    return Rule(out, _groups(ctx, [[(k, d) for k in k_all] for d in range(rank) if d != axis]))


def _reduce(ctx: KernelContext) -> Rule:
    n = len(ctx.operand_shapes) // 2
    dims = set(_ints(ctx, "dimensions"))
    rank = len(ctx.operand_shapes[0])
    kept = [d for d in range(rank) if d not in dims]
    leaves = _n_leaves(ctx)
    return Rule(lambda s: [tuple(s[0][d] for d in kept)] * leaves,
                _groups(ctx, [[(k, d) for k in range(n)] for d in range(rank)]))


def _dot(ctx: KernelContext) -> Rule:
    lb, rb = _ints(ctx, "lhs_batch_dimensions"), _ints(ctx, "rhs_batch_dimensions")
    lc, rc = _ints(ctx, "lhs_contracting_dimensions"), _ints(ctx, "rhs_contracting_dimensions")
    lf = [d for d in range(len(ctx.operand_shapes[0])) if d not in lb and d not in lc]
    rf = [d for d in range(len(ctx.operand_shapes[1])) if d not in rb and d not in rc]
    pairs = [[(0, a), (1, b)] for a, b in zip(lb + lc, rb + rc, strict=False)]
    return Rule(lambda s: [tuple(s[0][d] for d in lb) + tuple(s[0][d] for d in lf) + tuple(s[1][d] for d in rf)],
                _groups(ctx, pairs))


def _index_batch_dims(rank: int, ivd: int, exclude: Sequence[int] = ()) -> list[int]:
    return [d for d in range(rank) if d != ivd and d not in exclude]


def _gather(ctx: KernelContext) -> Rule:
    """A window that spans a whole dynamic operand dimension follows its size (the slice size
    becomes the run-time size); other dynamic operand dimensions are padded to the bound, so
    start indices clamp as against the bound."""
    bounds, dyn = ctx.operand_shapes[0], ctx.operand_dynamic[0]
    offset_dims = _ints(ctx, "offset_dims")
    collapsed = _ints(ctx, "collapsed_slice_dims")
    op_batch = _ints(ctx, "operand_batching_dims")
    idx_batch = _ints(ctx, "start_indices_batching_dims")
    ivd = _int(ctx, "index_vector_dim")
    sizes = _ints(ctx, "slice_sizes")
    window = [d for d in range(len(bounds)) if d not in collapsed and d not in op_batch]
    follow = {d for d in window if dyn[d] and sizes[d] == bounds[d]}
    whole = tuple((0, d) for d in range(len(bounds)) if dyn[d] and d not in follow and d not in op_batch)
    batch = _index_batch_dims(len(ctx.operand_shapes[1]), ivd)
    out_rank = len(batch) + len(offset_dims)
    batch_pos = [a for a in range(out_rank) if a not in offset_dims]

    def out(s: Sequence[Shape]) -> list[Shape]:
        r = [0] * out_rank
        for a, d in zip(batch_pos, batch, strict=True):
            r[a] = s[1][d]
        for a, d in zip(offset_dims, window, strict=True):
            r[a] = s[0][d] if d in follow else sizes[d]
        return [tuple(r)]

    def attrs(s: Sequence[Shape]) -> dict[str, tuple[int, ...]]:
        return {"slice_sizes": tuple(s[0][d] if d in follow else sizes[d] for d in range(len(sizes)))}

    agree = _groups(ctx, [[(0, a), (1, b)] for a, b in zip(op_batch, idx_batch, strict=False)])
    return Rule(out, agree, whole, attrs if follow else None)


def _scatter(ctx: KernelContext) -> Rule:
    """Dynamic operand dimensions are padded to the bound (a window that fits the bound is
    applied, as XLA does) and the result cut back to the operand's size."""
    n = (len(ctx.operand_shapes) - 1) // 2
    rank = len(ctx.operand_shapes[0])
    urank = len(ctx.operand_shapes[n + 1])
    uwd = _ints(ctx, "update_window_dims")
    in_batch = _ints(ctx, "input_batching_dims")
    idx_batch = _ints(ctx, "scatter_indices_batching_dims")
    ivd = _int(ctx, "index_vector_dim")
    scatter_dims = [d for d in range(urank) if d not in uwd]
    batch = _index_batch_dims(len(ctx.operand_shapes[n]), ivd)
    groups = [[(k, d) for k in range(n)] for d in range(rank)]
    groups += [[(n + 1 + k, d) for k in range(n)] for d in range(urank)]
    groups += [[(n + 1, u), (n, b)] for u, b in zip(scatter_dims, batch, strict=False)]
    groups += [[(0, a), (n, b)] for a, b in zip(in_batch, idx_batch, strict=False)]
    whole = tuple((k, d) for k in range(n) for d in range(rank)
                  if ctx.operand_dynamic[k][d] and d not in in_batch)
    return Rule(lambda s: [s[0]] * n, _groups(ctx, groups), whole)


def _dynamic_slice(ctx: KernelContext) -> Rule:
    sizes = _ints(ctx, "slice_sizes", tuple(ctx.out_shape))
    rank = len(sizes)
    whole = tuple((0, d) for d in range(rank) if ctx.operand_dynamic[0][d])
    return Rule(lambda s: [tuple(min(z, n) for z, n in zip(sizes, s[0], strict=True))], whole=whole)


def _dynamic_update_slice(ctx: KernelContext) -> Rule:
    rank = len(ctx.operand_shapes[0])
    whole = tuple((0, d) for d in range(rank) if ctx.operand_dynamic[0][d])
    return Rule(lambda s: [s[0]], whole=whole)


def _no_operand_dims(ctx: KernelContext) -> Rule:
    bounds = [tuple(int(d) for d in leaf.dims) for leaf in _leaves(ctx.instr.shape)]
    return Rule(lambda s: list(bounds))


def _trivial_window(ctx: KernelContext, rank: int) -> list[bool]:
    """Per dimension: the window is 1 wide with unit stride, no padding and no dilation."""
    def get(name: str, default: int) -> tuple[int, ...]:
        v = _ints(ctx, name, (default,) * rank)
        return v if len(v) == rank else (default,) * rank
    fields = zip(get("window_size", 1), get("window_strides", 1), get("padding_low", 0),
                 get("padding_high", 0), get("base_dilation", 1), get("window_dilation", 1), strict=True)
    return [f == (1, 1, 0, 0, 1, 1) for f in fields]


def _reduce_window(ctx: KernelContext) -> Rule:
    n = len(ctx.operand_shapes) // 2
    rank = len(ctx.operand_shapes[0])
    trivial = _trivial_window(ctx, rank)
    moving = [d for d in range(rank) if not trivial[d] and any(ctx.operand_dynamic[k][d] for k in range(n))]
    if moving:
        raise _unsupported(ctx, f"the window moves along dynamic dimensions {moving}; only "
                                f"dimensions the window does not span may be dynamic")
    leaves = _n_leaves(ctx)
    bounds = tuple(int(d) for d in _leaves(ctx.instr.shape)[0].dims)
    return Rule(lambda s: [tuple(s[0][d] if trivial[d] else bounds[d] for d in range(rank))] * leaves,
                _groups(ctx, [[(k, d) for k in range(n)] for d in range(rank)]))


def _select_and_scatter(ctx: KernelContext) -> Rule:
    rank = len(ctx.operand_shapes[0])
    trivial = _trivial_window(ctx, rank)
    moving = [d for d in range(rank) if not trivial[d] and (ctx.operand_dynamic[0][d] or ctx.operand_dynamic[1][d])]
    if moving:
        raise _unsupported(ctx, f"the window moves along dynamic dimensions {moving}; only "
                                f"dimensions the window does not span may be dynamic")
    return Rule(lambda s: [s[0]], _groups(ctx, [[(0, d), (1, d)] for d in range(rank)]))


def _convolution(ctx: KernelContext) -> Rule:
    """Only the batch dimension may be dynamic (without batch groups)."""
    ib, ob = _int(ctx, "input_batch_dimension"), _int(ctx, "output_batch_dimension")
    allowed = _int(ctx, "batch_group_count", 1) == 1
    other = [d for d, dy in enumerate(ctx.operand_dynamic[0]) if dy and d != ib]
    if not allowed or other or any(ctx.operand_dynamic[1]) or \
            any(dy and d != ob for d, dy in enumerate(ctx.out_dynamic)):
        raise _unsupported(ctx, "a convolution may only have a dynamic batch dimension (no batch "
                                "groups); its features, spatial dimensions and kernel must be static")
    bounds = tuple(ctx.out_shape)

    def out(s: Sequence[Shape]) -> list[Shape]:
        r = list(bounds)
        r[ob] = s[0][ib]
        return [tuple(r)]

    return Rule(out)


_RULES: dict[str, Callable[[KernelContext], Rule]] = {
    **dict.fromkeys(_SAME_SHAPE, _same_shape),
    "bitcast-convert": _bitcast_convert,
    "transpose": _transpose,
    "broadcast": _broadcast,
    "reshape": _reshape,
    "bitcast": _reshape,
    "slice": _slice,
    "pad": _pad,
    "concatenate": _concatenate,
    "reduce": _reduce,
    "dot": _dot,
    "gather": _gather,
    "scatter": _scatter,
    "dynamic-slice": _dynamic_slice,
    "dynamic-update-slice": _dynamic_update_slice,
    "iota": _no_operand_dims,
    "rng": _no_operand_dims,
    "rng-bit-generator": _no_operand_dims,
    "reduce-window": _reduce_window,
    "select-and-scatter": _select_and_scatter,
    "convolution": _convolution,
}


# ---------------------------------------------------------------------------------- planning


def _agree(ops: Sequence[Any], groups: tuple[tuple[tuple[int, int, bool], ...], ...]) -> list[Any]:
    ops = list(ops)
    for group in groups:
        n = max(ops[k].shape[d] for k, d, dy in group if dy)
        for k, d, _ in group:
            if ops[k].shape[d] != n:
                shape = list(ops[k].shape)
                shape[d] = n
                ops[k] = resize(ops[k], tuple(shape))
    return ops


def plan(ctx: KernelContext, factory: Callable[[KernelContext], KernelFn], specialize: Specializer) -> KernelFn:
    """The kernel of an instruction with dynamic dimensions (see the module docstring).

    ``factory`` is the opcode's kernel factory; ``specialize(operand_shapes, result_shapes,
    attrs)`` plans the same instruction for other shapes (the compiler provides it)."""
    op = ctx.instr.opcode
    if op in PASS_THROUGH:
        return factory(ctx)
    builder = _RULES.get(op)
    if builder is None:
        raise _unsupported(ctx, f"opcode '{op}' has no emulator kernel for dynamic dimensions")
    rule = builder(ctx)
    bound_fn = factory(ctx)  # checks the instruction once, for its bounds
    in_bounds = tuple(tuple(int(d) for d in s) for s in ctx.operand_shapes)
    leaves = [(tuple(int(d) for d in leaf.dims), dynamic_flags(leaf)) for leaf in _leaves(ctx.instr.shape)]
    out_bounds = [b for b, _ in leaves]
    tuple_out = ctx.instr.shape.is_tuple
    agree, whole = rule.agree, rule.whole
    cache: dict[tuple[Shape, ...], tuple[KernelFn, Any, Any]] = {}

    def build(key: tuple[Shape, ...]) -> tuple[KernelFn, Any, Any]:
        padded = [list(s) for s in key]
        for k, d in whole:
            padded[k][d] = in_bounds[k][d]
        padded_t = [tuple(s) for s in padded]
        made = rule.out(padded_t)
        wanted = []
        for (bound, dyn), got in zip(leaves, rule.out(key), strict=True):
            for d, (b, n) in enumerate(zip(bound, got, strict=True)):
                if dyn[d] and n > b:
                    raise ValueError(f"dimension {d} would have {n} elements, more than its bound {b}")
            wanted.append(tuple(n if dy else b for b, n, dy in zip(bound, got, dyn, strict=True)))
        if tuple(padded_t) == in_bounds and made == out_bounds:
            fn = bound_fn
        else:
            fn = specialize(padded_t, made, rule.attrs(padded_t) if rule.attrs else {})
        pads = None if tuple(padded_t) == key else padded_t
        fix = None if made == wanted else wanted
        return fn, pads, fix

    def run(ops: Sequence[Any]) -> Any:
        if agree:
            ops = _agree(ops, agree)
        key = tuple(np.shape(o) for o in ops)
        entry = cache.get(key)
        if entry is None:
            if len(cache) >= _CACHE_LIMIT:
                cache.clear()
            entry = cache[key] = build(key)
        fn, pads, fix = entry
        if pads is not None:
            ops = [resize(o, p) if np.shape(o) != p else o for o, p in zip(ops, pads, strict=True)]
        out = fn(ops)
        if fix is None:
            return out
        if tuple_out:
            return tuple(resize(v, s) for v, s in zip(out, fix, strict=True))
        return resize(out, fix[0])

    return run
