"""Element-wise kernels: unary, binary and ternary arithmetic, logic, comparison, conversion.

Semantics follow XLA's operation semantics, including its integer corner cases (division
truncates toward zero; ``x / 0 = -1``, ``x % 0 = x``, ``INT_MIN / -1 = INT_MIN``,
``INT_MIN % -1 = 0``; out-of-range shifts), NaN-propagating ``maximum``/``minimum``,
saturating float->int ``convert`` with NaN -> 0, and total-order comparison. 16-bit floats
are computed in float32 and rounded once where numpy has no native loop, as XLA's CPU
backend does. Kernels never write into their operands.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import ml_dtypes
import numpy as np

from device_server.emulator.kernels import (
    KernelContext,
    KernelFn,
    elementwise_ufunc,
    inline,
    register,
)

_BF16 = np.dtype(ml_dtypes.bfloat16)


def _is_float(dt: np.dtype | None) -> bool:
    return dt is not None and (dt.kind == "f" or dt == _BF16)


def _is_16bit_float(dt: np.dtype | None) -> bool:
    return dt is not None and dt in (np.dtype(np.float16), _BF16)


def _native(dt: np.dtype | None) -> bool:
    """Types whose numpy scalars do arithmetic exactly as the ufuncs do (float32/64 and
    integers): Python operators on them may stand in for ufunc calls."""
    return dt is not None and (dt.kind in "iu" or (dt.kind == "f" and dt.itemsize in (4, 8)))


def _ufunc_kernel(fn: Any, arity: int) -> KernelFn:
    """A kernel that is just ``fn(*ops)``, marked so the compiler calls ``fn`` directly (and,
    for a numpy ufunc, may hand it an ``out=`` buffer: see ``kernels.elementwise_ufunc``)."""
    if arity == 1:
        kernel: KernelFn = lambda ops: fn(ops[0])  # noqa: E731
        kernel = inline(kernel, "{f}({0})", f=fn)
    elif arity == 2:
        kernel = lambda ops: fn(ops[0], ops[1])  # noqa: E731
        kernel = inline(kernel, "{f}({0}, {1})", f=fn)
    else:
        kernel = lambda ops: fn(ops[0], ops[1], ops[2])  # noqa: E731
        kernel = inline(kernel, "{f}({0}, {1}, {2})", f=fn)
    if isinstance(fn, np.ufunc) and fn.nin == arity and fn.nout == 1:
        elementwise_ufunc(kernel, fn)
    return kernel


def _via_f32(fn: Callable[[np.ndarray], Any], dt: np.dtype) -> Callable[[np.ndarray], Any]:
    """``fn`` computed in float32 (for 16-bit inputs) and rounded once to ``dt``."""
    if not _is_16bit_float(dt):
        return fn
    return lambda x: np.asarray(fn(np.asarray(x, np.float32))).astype(dt)


def _unsigned(dt: np.dtype) -> np.dtype:
    return np.dtype(f"u{dt.itemsize}")


def _signed(dt: np.dtype) -> np.dtype:
    return np.dtype(f"i{dt.itemsize}")


# ------------------------------------------------------------------------------ special math


def _erf64(x: np.ndarray) -> np.ndarray:
    """erf in float64: Maclaurin series for |x| <= 3, continued fraction of erfc beyond."""
    x = np.asarray(x, np.float64)
    ax = np.abs(x)
    small = ax <= 3.0
    # Series: erf(x) = 2/sqrt(pi) * sum_n (-1)^n x^(2n+1) / (n! (2n+1)).
    xs = np.where(small, x, 0.0)
    x2 = xs * xs
    term = xs.copy()
    total = xs.copy()
    for n in range(1, 64):
        term = term * (-x2) / n
        total = total + term / (2 * n + 1)
    series = total * (2.0 / np.sqrt(np.pi))
    # erfc(x) = exp(-x^2)/sqrt(pi) / (x + (1/2)/(x + 1/(x + (3/2)/(x + 2/(x + ...))))).
    xl = np.where(small, 4.0, ax)
    frac = xl.copy()
    for k in range(80, 0, -1):
        frac = xl + (k / 2.0) / frac
    erfc = np.exp(-xl * xl) / np.sqrt(np.pi) / frac
    large = np.copysign(1.0 - erfc, x)
    out = np.where(small, series, large)
    return np.where(np.isnan(x), np.nan, out)


def _logistic(x: np.ndarray) -> np.ndarray:
    e = np.exp(-np.abs(x))
    one = np.ones((), e.dtype)
    return np.where(x >= 0, one / (one + e), e / (one + e))


def _round_afz(x: np.ndarray) -> np.ndarray:
    t = np.trunc(x)
    frac = x - t  # exact
    half = np.asarray(0.5, dtype=np.asarray(x).dtype)
    return np.where(np.abs(frac) >= half, t + np.sign(x), t)


def _sign(x: np.ndarray) -> np.ndarray:
    return np.where(x == 0, x, np.sign(x))


def _rsqrt(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x)
    return np.ones((), x.dtype) / np.sqrt(x)


def _complex_sign(x: np.ndarray) -> np.ndarray:
    a = np.abs(x)
    return np.where(a == 0, x, x / np.where(a == 0, 1, a))


_FLOAT_UNARY: dict[str, Callable[[np.ndarray], Any]] = {
    "abs": np.abs,
    "negate": np.negative,
    "exponential": np.exp,
    "exponential-minus-one": np.expm1,
    "log": np.log,
    "log-plus-one": np.log1p,
    "logistic": _logistic,
    "sqrt": np.sqrt,
    "rsqrt": _rsqrt,
    "cbrt": np.cbrt,
    "tanh": np.tanh,
    "sine": np.sin,
    "cosine": np.cos,
    "tan": np.tan,
    "floor": np.floor,
    "ceil": np.ceil,
    "round-nearest-afz": _round_afz,
    "round-nearest-even": np.rint,
    "sign": _sign,
    "erf": lambda x: _erf64(x).astype(np.asarray(x).dtype),
}
# numpy has no native 16-bit loops (or no loops at all) for these: compute in float32.
_F32_FOR_16BIT = {"logistic", "rsqrt", "cbrt", "erf", "round-nearest-afz", "sign", "exponential-minus-one"}


def _clz(x: np.ndarray, dt: np.dtype) -> np.ndarray:
    width = dt.itemsize * 8
    u = np.asarray(x).astype(dt, copy=False).view(_unsigned(dt)) if dt.kind == "i" else np.asarray(x, dt)
    n = np.zeros(u.shape, np.int64)
    shift = width // 2
    while shift >= 1:
        big = u >= (np.asarray(1, u.dtype) << np.asarray(shift, u.dtype))
        n += big * shift
        u = np.where(big, u >> np.asarray(shift, u.dtype), u)
        shift //= 2
    n += u > 0
    return (width - n).astype(dt)


@register(
    "abs", "negate", "exponential", "exponential-minus-one", "log", "log-plus-one", "logistic",
    "sqrt", "rsqrt", "cbrt", "tanh", "sine", "cosine", "tan", "floor", "ceil",
    "round-nearest-afz", "round-nearest-even", "sign", "erf",
)
def _unary(ctx: KernelContext) -> KernelFn:
    op = ctx.instr.opcode
    dt = ctx.operand_dtypes[0]
    if dt is None:
        raise ValueError(f"{op} needs an array operand")
    if dt.kind in "iub":
        if op == "abs":
            return lambda ops: np.abs(ops[0])
        if op == "negate":
            return lambda ops: np.negative(ops[0])
        if op == "sign":
            return lambda ops: np.sign(ops[0])
        raise ValueError(f"{op} is not defined for {dt}")
    if dt.kind == "c":
        if op == "sign":
            return lambda ops: _complex_sign(ops[0])
        if op in ("logistic", "erf", "cbrt", "floor", "ceil", "round-nearest-afz", "round-nearest-even"):
            raise ValueError(f"{op} is not defined for {dt}")
    fn = _FLOAT_UNARY[op]
    if _is_16bit_float(dt) and (op in _F32_FOR_16BIT or dt == _BF16):
        fn = _via_f32(fn, dt)
    if op == "negate" and _native(dt):
        return inline(lambda ops: fn(ops[0]), "(-{0})")
    return _ufunc_kernel(fn, 1)


@register("is-finite")
def _is_finite(ctx: KernelContext) -> KernelFn:
    return lambda ops: np.isfinite(ops[0])


@register("not")
def _not(ctx: KernelContext) -> KernelFn:
    if ctx.operand_dtypes[0] == np.bool_:
        return lambda ops: np.logical_not(ops[0])
    return lambda ops: np.invert(ops[0])


@register("popcnt")
def _popcnt(ctx: KernelContext) -> KernelFn:
    dt = ctx.out_dtype
    src = ctx.operand_dtypes[0]
    if src is None or src.kind not in "iu":
        raise ValueError(f"popcnt needs integers, got {src}")
    udt = _unsigned(src)  # numpy counts the bits of |x| for signed types
    return lambda ops: np.bitwise_count(np.asarray(ops[0]).astype(src, copy=False).view(udt)).astype(dt)


@register("count-leading-zeros")
def _clz_kernel(ctx: KernelContext) -> KernelFn:
    dt = ctx.operand_dtypes[0]
    return lambda ops: _clz(ops[0], dt)


@register("real", "imag")
def _real_imag(ctx: KernelContext) -> KernelFn:
    fn = np.real if ctx.instr.opcode == "real" else np.imag
    dt = ctx.out_dtype
    return lambda ops: np.asarray(fn(ops[0])).astype(dt, copy=False)


@register("complex")
def _complex(ctx: KernelContext) -> KernelFn:
    dt = ctx.out_dtype
    shape = ctx.out_shape

    def run(ops: Sequence[Any]) -> np.ndarray:
        out = np.empty(shape, dt)
        out.real = ops[0]
        out.imag = ops[1]
        return out

    return run


# ------------------------------------------------------------------------------------ binary


def _int_divide(a: np.ndarray, b: np.ndarray, signed: bool) -> np.ndarray:
    zero = b == 0
    if signed:
        minus_one = b == -1
        safe = np.where(zero | minus_one, np.ones((), b.dtype), b)
        q = np.floor_divide(a, safe)
        r = a - q * safe
        q = q + ((r != 0) & ((a < 0) ^ (safe < 0))).astype(q.dtype)
        q = np.where(minus_one, np.negative(a), q)
    else:
        safe = np.where(zero, np.ones((), b.dtype), b)
        q = np.floor_divide(a, safe)
    return np.where(zero, np.asarray(-1).astype(q.dtype) if signed else ~np.zeros((), q.dtype), q)


def _int_remainder(a: np.ndarray, b: np.ndarray, signed: bool) -> np.ndarray:
    zero = b == 0
    bad = (zero | (b == -1)) if signed else zero
    safe = np.where(bad, np.ones((), b.dtype), b)
    r = np.fmod(a, safe)
    return np.where(zero, a, r)


def _int_power(a: np.ndarray, b: np.ndarray, signed: bool) -> np.ndarray:
    a = np.asarray(a)
    b = np.asarray(b)
    if not signed:
        return np.power(a, b)
    neg = b < 0
    e = np.where(neg, np.zeros((), b.dtype), b)
    r = np.power(a, e)
    one = np.ones((), a.dtype)
    odd = (b % 2) != 0
    special = np.where(a == 1, one, np.where(a == -1, np.where(odd, -one, one), np.zeros((), a.dtype)))
    return np.where(neg, special, r)


def _shift(op: str, dt: np.dtype) -> Callable[[np.ndarray, np.ndarray], np.ndarray]:
    width = dt.itemsize * 8
    udt = _unsigned(dt)
    sdt = _signed(dt)
    w = np.asarray(width, udt)

    def amounts(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        ub = np.asarray(b).astype(dt, copy=False).view(udt) if dt.kind == "i" else np.asarray(b, udt)
        ok = ub < w
        return ok, np.where(ok, ub, np.zeros((), udt))

    if op == "shift-left":
        def left(a: np.ndarray, b: np.ndarray) -> np.ndarray:
            ok, s = amounts(b)
            r = np.left_shift(np.asarray(a).astype(dt, copy=False).view(udt), s)
            return np.where(ok, r, np.zeros((), udt)).view(dt)
        return left
    if op == "shift-right-logical":
        def logical(a: np.ndarray, b: np.ndarray) -> np.ndarray:
            ok, s = amounts(b)
            r = np.right_shift(np.asarray(a).astype(dt, copy=False).view(udt), s)
            return np.where(ok, r, np.zeros((), udt)).view(dt)
        return logical

    def arithmetic(a: np.ndarray, b: np.ndarray) -> np.ndarray:
        ok, s = amounts(b)
        s = np.where(ok, s, np.asarray(width - 1, udt)).astype(sdt)
        return np.right_shift(np.asarray(a).astype(dt, copy=False).view(sdt), s).view(dt)
    return arithmetic


_FLOAT_BINARY: dict[str, Callable[[np.ndarray, np.ndarray], Any]] = {
    "add": np.add,
    "subtract": np.subtract,
    "multiply": np.multiply,
    "divide": np.divide,
    "remainder": np.fmod,
    "power": np.power,
    "maximum": np.maximum,
    "minimum": np.minimum,
    "atan2": np.arctan2,
}


@register("add", "subtract", "multiply", "divide", "remainder", "power", "maximum", "minimum", "atan2")
def _binary(ctx: KernelContext) -> KernelFn:
    op = ctx.instr.opcode
    dt = ctx.operand_dtypes[0]
    if dt is None:
        raise ValueError(f"{op} needs array operands")
    if dt.kind in "iu":
        signed = dt.kind == "i"
        if op == "divide":
            return lambda ops: _int_divide(ops[0], ops[1], signed)
        if op == "remainder":
            return lambda ops: _int_remainder(ops[0], ops[1], signed)
        if op == "power":
            return lambda ops: _int_power(ops[0], ops[1], signed)
        if op == "atan2":
            raise ValueError(f"atan2 is not defined for {dt}")
    if dt == np.bool_ and op in ("add", "multiply", "maximum", "minimum"):
        fn_b = {"add": np.logical_or, "multiply": np.logical_and,
                "maximum": np.logical_or, "minimum": np.logical_and}[op]
        return lambda ops: fn_b(ops[0], ops[1])
    if dt.kind == "c" and op in ("maximum", "minimum", "atan2", "remainder"):
        raise ValueError(f"{op} is not defined for {dt}")
    fn = _FLOAT_BINARY[op]
    if dt == _BF16 and op in ("remainder", "atan2", "power"):
        def via32(ops: Sequence[Any]) -> np.ndarray:
            return np.asarray(fn(np.asarray(ops[0], np.float32), np.asarray(ops[1], np.float32))).astype(dt)
        return via32
    symbol = OPERATORS.get(op)
    if symbol is not None and _native(dt) and ctx.out_shape == () and (dt.kind == "f" or op != "divide"):
        # Scalars: numpy scalar arithmetic is the ufunc's, without the ufunc call.
        return inline(lambda ops: fn(ops[0], ops[1]), f"({{0}} {symbol} {{1}})")
    return _ufunc_kernel(fn, 2)


# Python operators that compute these opcodes as numpy does (also used by emulator/jit.py).
OPERATORS = {"add": "+", "subtract": "-", "multiply": "*", "divide": "/"}
COMPARE_OPERATORS = {"EQ": "==", "NE": "!=", "LT": "<", "LE": "<=", "GT": ">", "GE": ">="}


@register("and", "or", "xor")
def _bitwise(ctx: KernelContext) -> KernelFn:
    fn = {"and": np.bitwise_and, "or": np.bitwise_or, "xor": np.bitwise_xor}[ctx.instr.opcode]
    return _ufunc_kernel(fn, 2)


@register("shift-left", "shift-right-logical", "shift-right-arithmetic")
def _shifts(ctx: KernelContext) -> KernelFn:
    dt = ctx.operand_dtypes[0]
    if dt is None or dt.kind not in "iu":
        raise ValueError(f"{ctx.instr.opcode} needs integer operands, got {dt}")
    fn = _shift(ctx.instr.opcode, dt)
    return lambda ops: fn(ops[0], ops[1])


# ----------------------------------------------------------------------------------- compare

_COMPARE: dict[str, np.ufunc] = {
    "EQ": np.equal, "NE": np.not_equal, "LT": np.less, "LE": np.less_equal,
    "GT": np.greater, "GE": np.greater_equal,
}


def total_order_key(x: np.ndarray, dt: np.dtype) -> np.ndarray:
    """Signed integers ordered as XLA's total order of floats:
    -NaN < -inf < ... < -0 < +0 < ... < +inf < +NaN."""
    sdt = _signed(dt)
    bits = np.asarray(x).astype(dt, copy=False).view(sdt)
    flip = np.asarray(np.iinfo(sdt).max, sdt)
    return np.where(bits < 0, bits ^ flip, bits)


@register("compare")
def _compare_kernel(ctx: KernelContext) -> KernelFn:
    direction = ctx.attr("direction")
    if direction not in _COMPARE:
        raise ValueError(f"unknown comparison direction {direction!r}")
    fn = _COMPARE[direction]
    dt = ctx.operand_dtypes[0]
    kind = ctx.attr("compare_type", "")
    if kind == "TOTALORDER" and _is_float(dt):
        return lambda ops: fn(total_order_key(ops[0], dt), total_order_key(ops[1], dt))
    if dt is not None and dt.kind == "c" and direction not in ("EQ", "NE"):
        raise ValueError(f"complex numbers have no order ({direction})")
    if _native(dt) and ctx.out_shape == ():
        symbol = COMPARE_OPERATORS[direction]
        return inline(lambda ops: fn(ops[0], ops[1]), f"({{0}} {symbol} {{1}})")
    return _ufunc_kernel(fn, 2)


# --------------------------------------------------------------------------------- ternary


@register("select")
def _select(ctx: KernelContext) -> KernelFn:
    if ctx.out_dtype is None:  # tuple select (old HLO): pick a whole operand
        return lambda ops: ops[1] if ops[0] else ops[2]
    if ctx.out_shape == ():
        # A numpy bool scalar picks an operand as it is; anything else (a 0-d array, or
        # whole arrays when the computation is applied element-wise) goes to np.where.
        return inline(
            lambda ops: np.where(ops[0], ops[1], ops[2]),
            "({1} if {0} is {t} else {2} if {0} is {f} else {w}({0}, {1}, {2}))",
            t=np.True_, f=np.False_, w=np.where,
        )
    fn = _bitwise_select(ctx.out_dtype, ctx.out_shape)
    if fn is None:
        return _ufunc_kernel(np.where, 3)
    return inline(lambda ops: fn(ops[0], ops[1], ops[2]), "{f}({0}, {1}, {2})", f=fn)


# Selects of at least this many elements pick bits with integer masks (np.where branches per
# element: slow on unpredictable masks); of at least _ZERO_SELECT_MIN when the "false" value
# is a scalar +0 (ReLU gradients), which needs a single AND.
_BITWISE_SELECT_MIN = 4096
_ZERO_SELECT_MIN = 256


def _bitwise_select(dt: np.dtype, shape: tuple[int, ...]) -> Callable[[Any, Any, Any], Any] | None:
    """``np.where(p, a, b)`` computed on the bit patterns, bit for bit the same result:
    ``b ^ ((a ^ b) & m)`` with ``m`` all ones where ``p``; ``a & m`` when ``b`` is +0."""
    size = int(np.prod(shape, dtype=np.int64))
    if dt.itemsize not in (1, 2, 4, 8) or dt.kind == "c" or size < _ZERO_SELECT_MIN:
        return None
    bits = np.dtype(f"i{dt.itemsize}")
    general = size >= _BITWISE_SELECT_MIN
    where = np.where
    xor, band, neg = np.bitwise_xor, np.bitwise_and, np.negative

    def run(p: Any, a: Any, b: Any) -> Any:
        b = np.asarray(b)
        zero = b.ndim == 0 and not b.view(bits)
        if not (zero or general):
            return where(p, a, b)
        m = np.asarray(p).astype(bits)
        a = np.asarray(a).view(bits)
        if m.shape != shape:
            m = neg(m)
            out = band(a, m) if zero else xor(b.view(bits), band(xor(a, b.view(bits)), m))
            return np.asarray(out).view(dt)
        neg(m, out=m)
        if zero:
            band(m, a, out=m)
        else:
            bb = b.view(bits)
            band(m, xor(a, bb), out=m)
            xor(m, bb, out=m)
        return m.view(dt)

    return run


@register("clamp")
def _clamp(ctx: KernelContext) -> KernelFn:
    return lambda ops: np.minimum(np.maximum(ops[1], ops[0]), ops[2])


# -------------------------------------------------------------------------------- conversion


_min_of = np.minimum.reduce
_max_of = np.maximum.reduce


def _float_to_int(src: np.dtype, dst: np.dtype) -> Callable[[np.ndarray], np.ndarray]:
    info = np.iinfo(dst)
    lo = float(info.min)
    hi_exclusive = float(info.max) + 1.0  # a power of two, exact in float64
    top = np.asarray(info.max, dst)
    bottom = np.asarray(info.min, dst)
    plain = src.kind == "f"  # numpy's own float types: a C cast truncates toward zero

    def run(x: np.ndarray) -> np.ndarray:
        if plain:
            a = np.asarray(x)
            if a.size and a.dtype == src:
                # All in range (NaN fails both tests): the cast alone is exact.
                if float(_min_of(a, axis=None)) >= lo and float(_max_of(a, axis=None)) < hi_exclusive:
                    return a.astype(dst)
        x64 = np.asarray(x, np.float64)
        nan = np.isnan(x64)
        t = np.trunc(np.where(nan, 0.0, x64))
        over = t >= hi_exclusive
        under = t < lo
        inside = np.where(over | under, 0.0, t)
        out = inside.astype(dst)
        out = np.where(over, top, out)
        return np.where(under, bottom, out)

    return run


def _float_to_int_scalar(
    src: np.dtype, dst: np.dtype, vectorized: Callable[[np.ndarray], np.ndarray]
) -> Callable[[Any], Any]:
    """``_float_to_int`` for one numpy scalar, in Python floats (exact: a float32/64 value is
    a Python float, ``math.trunc`` is exact); anything else goes to the vectorized form."""
    import math

    info = np.iinfo(dst)
    lo, hi = int(info.min), int(info.max)
    make = dst.type
    stype = src.type

    def run(x: Any) -> Any:
        if type(x) is not stype:
            return vectorized(x)
        f = float(x)
        if f != f:
            return make(0)
        if math.isinf(f):
            return make(hi if f > 0 else lo)
        t = math.trunc(f)
        return make(hi if t > hi else lo if t < lo else t)

    return run


@register("convert")
def _convert(ctx: KernelContext) -> KernelFn:
    src = ctx.operand_dtypes[0]
    dst = ctx.out_dtype
    if src is None or dst is None:
        raise ValueError("convert needs array operands")
    if src == dst:
        return inline(lambda ops: ops[0], "{0}")
    if dst == np.bool_:
        zero = np.zeros((), src)
        return inline(lambda ops: np.not_equal(ops[0], zero), "{f}({0}, {z})", f=np.not_equal, z=zero)
    if src.kind == "c":
        if dst.kind == "c":
            return lambda ops: np.asarray(ops[0]).astype(dst)
        return lambda ops: np.asarray(np.real(ops[0])).astype(dst)
    if _is_float(src) and dst.kind in "iu":
        fn = _float_to_int(src, dst)
        if ctx.out_shape == () and _native(src):
            scalar = _float_to_int_scalar(src, dst, fn)
            return inline(lambda ops: fn(ops[0]), "{f}({0})", f=scalar)
        return lambda ops: fn(ops[0])
    if src == _BF16 or dst == _BF16:
        if src.kind in "iub" and dst == _BF16:
            return lambda ops: np.asarray(ops[0]).astype(np.float32).astype(dst) \
                if src.itemsize <= 2 else np.asarray(ops[0]).astype(np.float64).astype(dst)
    if src.kind in "biuf" and dst.kind in "iuf" and src != _BF16 and dst != _BF16:
        # ``.astype`` of an array or numpy scalar is the same C cast as np.asarray(x).astype.
        return inline(lambda ops: np.asarray(ops[0]).astype(dst), "{0}.astype({t})", t=dst)
    return lambda ops: np.asarray(ops[0]).astype(dst)


@register("bitcast-convert")
def _bitcast_convert(ctx: KernelContext) -> KernelFn:
    dst = ctx.out_dtype
    shape = ctx.out_shape
    src = ctx.operand_dtypes[0]
    if src is None or dst is None:
        raise ValueError("bitcast-convert needs array operands")

    if src.itemsize == dst.itemsize:
        return lambda ops: np.array(ops[0], dtype=src, order="C", copy=True).view(dst)

    def run(ops: Sequence[Any]) -> np.ndarray:
        a = np.array(ops[0], dtype=src, order="C", copy=True)
        return a.reshape(-1).view(dst).reshape(shape) if a.size else np.zeros(shape, dst)

    return run


# --------------------------------------------------------------------------- reduce-precision

_FORMATS = {  # float dtype -> (uint view, exponent bits, mantissa bits)
    np.dtype(np.float32): (np.dtype(np.uint32), 8, 23),
    np.dtype(np.float64): (np.dtype(np.uint64), 11, 52),
    np.dtype(np.float16): (np.dtype(np.uint16), 5, 10),
    _BF16: (np.dtype(np.uint16), 8, 7),
}


def _reduce_precision_bits(x: np.ndarray, dt: np.dtype, exp_bits: int, man_bits: int,
                           src_exp_bits: int) -> np.ndarray:
    udt, src_e, src_m = _FORMATS[dt]
    one = udt.type(1)
    bits = np.asarray(x, dt).view(udt)
    if man_bits < src_m:
        drop = src_m - man_bits
        last = udt.type(1 << drop)
        bias = udt.type((1 << (drop - 1)) - 1)
        lsb = (bits & last) >> udt.type(drop)
        mask = ~udt.type((1 << drop) - 1)
        bits = (bits + lsb + bias) & mask
    if exp_bits < src_exp_bits:
        exp_mask = udt.type(((1 << src_e) - 1) << src_m)
        sign_mask = one << udt.type(src_e + src_m)
        bias_src = (1 << (src_e - 1)) - 1
        bias_dst = (1 << (exp_bits - 1)) - 1
        max_exp = udt.type((bias_src + bias_dst) << src_m)
        min_exp = udt.type((bias_src - bias_dst) << src_m)
        e = bits & exp_mask
        signed_zero = bits & sign_mask
        signed_inf = signed_zero | exp_mask
        bits = np.where(e > max_exp, signed_inf, np.where(e <= min_exp, signed_zero, bits))
    out = np.asarray(bits, udt).view(dt)
    return np.where(np.isnan(x), x, out)  # a NaN stays itself (XLA), also with 0 mantissa bits


@register("reduce-precision")
def _reduce_precision(ctx: KernelContext) -> KernelFn:
    dt = ctx.out_dtype
    exp_bits = int(ctx.attr("exponent_bits"))
    man_bits = int(ctx.attr("mantissa_bits"))
    if dt not in _FORMATS:
        raise ValueError(f"reduce-precision needs a float operand, got {dt}")
    _, src_e, src_m = _FORMATS[dt]
    if exp_bits < 1 or man_bits < 0:
        raise ValueError(f"invalid reduce-precision format e{exp_bits}m{man_bits}")
    if exp_bits >= src_e and man_bits >= src_m:
        return lambda ops: ops[0]
    if dt == _BF16:  # exact detour through float32: the same exponent field, subnormals alike
        def run16(ops: Sequence[Any]) -> np.ndarray:
            x = np.asarray(ops[0], np.float32)
            return _reduce_precision_bits(x, np.dtype(np.float32), exp_bits, man_bits, src_e).astype(dt)
        return run16
    return lambda ops: _reduce_precision_bits(ops[0], dt, exp_bits, man_bits, src_e)
