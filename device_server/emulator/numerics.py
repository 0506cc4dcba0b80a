"""IPU numerics the emulator models on request: FP16 partials, stochastic rounding, and the
floating-point exception checks (``inv``, ``div0``, ``oflo``) with NaN-on-overflow (``nanoo``).

Everything here is off by default; a program compiled with the default
:class:`~device_server.emulator.CompileOptions` runs exactly the kernels' own arithmetic
(FP16 products accumulated in FP32 and rounded once to nearest-even, IEEE infinities).

**Partials** (``CompileOptions.partials_type`` and its per-kind overrides): with ``"half"``,
an FP16 ``dot`` or ``convolution`` keeps its accumulator in FP16. The contraction is cut into
chunks of ``Target.amp_fp16_partials_chunk`` products (the AMP's accumulation width, 16 on
every preset); each chunk is summed in FP32 (products of FP16 values are exact in FP32), added
to the accumulator and the sum rounded to FP16 (stochastically when ``esr`` is on). numpy has
no FP16 matrix product, so the chunks are FP32 matmuls of the FP16 values.

**Stochastic rounding** (``esr``): a result rounded to FP16 goes to the neighbour below or
above with probability proportional to its distance from each (so the mean is the exact
value). It applies to ``convert`` to FP16 and to the FP16 results of arithmetic (the
element-wise ops in :data:`SR_OPCODES`, ``dot``, ``convolution``), which are then computed in
FP32 and rounded once. Reductions, pooling and other ops round to nearest-even. The random
numbers come from a stream per run: ``numpy.random.default_rng([seed, run_index])`` where
``seed`` is ``CompileOptions.stochastic_rounding_seed`` or, when that is 0, derived from the
module's content, and ``run_index`` counts the runs of the executable (so a fresh executable
repeats its sequence of runs bit for bit). Constants folded at compile time round to nearest.

**Exception checks** (``inv``, ``div0``, ``oflo``): after every floating-point instruction
(any instruction with a floating-point result except the data movement and control ops in
:data:`UNCHECKED_OPCODES`, whose called computations are checked instead) its result is
checked, and the run stops with :class:`~device_server.emulator.errors.FloatingPointExceptionError`
naming the flag, the instruction, its opcode, the framework op and the Keras layer:

- ``inv``: a NaN where no operand is NaN (``0/0``, ``inf - inf``, ``sqrt(-1)``, ...);
- ``div0``: a ``divide`` by zero of a finite non-zero dividend (which gives +-inf), or
  another pole that IEEE 754 also calls division by zero: ``log(0)``, ``log-plus-one(-1)``,
  ``rsqrt(0)``;
- ``oflo``: an infinity where every operand is finite (except those ``div0`` cases).

For element-wise ops "operand" means the elements at the same position; for every other op
(``dot``, ``convolution``, ``reduce``, ...) it means all elements of all operands.

**nanoo**: an FP16 result that overflowed (as ``oflo`` defines it) becomes NaN. With
``nanoo`` off the emulator keeps IEEE's +-inf, as XLA on CPU does and as Keras' dynamic loss
scaling expects; the hardware would clip to +-65504 instead (Graphcore: "the nanoo bit
selects between clipping or generating a NaN when a half-precision number overflows"). This
clipping is not modelled. The checks look at the result before ``nanoo`` turns it into a NaN, so
an overflow is reported as ``oflo`` (and not as ``inv``).
"""

from __future__ import annotations

import hashlib
import itertools
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from device_server.emulator.errors import FloatingPointExceptionError, describe
from device_server.protocol import ir_pb2

__all__ = [
    "CHECKED_FLAGS",
    "SR_OPCODES",
    "UNCHECKED_OPCODES",
    "Numerics",
    "chunked_matmul",
    "round_to_half",
]

_F16 = np.dtype(np.float16)
_F32 = np.dtype(np.float32)
_F64 = np.dtype(np.float64)

CHECKED_FLAGS = ("inv", "div0", "oflo")
_FLAG_NAMES = {"inv": "invalid operation", "div0": "divide by zero", "oflo": "overflow"}

# Ops whose FP16 results are computed in FP32 and rounded once (stochastically with esr).
SR_OPCODES = frozenset(
    {
        "add", "subtract", "multiply", "divide", "remainder", "power", "atan2",
        "exponential", "exponential-minus-one", "log", "log-plus-one", "logistic", "sqrt",
        "rsqrt", "cbrt", "tanh", "sine", "cosine", "tan", "erf", "dot", "convolution",
        "convert",
    }
)
# Element-wise ops: the checks compare each result element with the operands' elements at
# the same position (operands broadcast like numpy).
_ELEMENTWISE = SR_OPCODES - {"dot", "convolution"} | {"reduce-precision", "clamp", "select"}
# Floating-point results that need no check: data movement, exact ops, and control flow
# (the computations that while/call/conditional run are checked instruction by instruction).
UNCHECKED_OPCODES = frozenset(
    {
        "parameter", "constant", "tuple", "get-tuple-element", "reshape", "bitcast",
        "bitcast-convert", "transpose", "broadcast", "slice", "dynamic-slice",
        "dynamic-update-slice", "concatenate", "pad", "gather", "reverse", "copy",
        "opt-barrier", "select", "iota", "while", "call", "conditional", "sort",
        "maximum", "minimum", "clamp", "abs", "negate", "sign", "floor", "ceil",
        "round-nearest-afz", "round-nearest-even", "real", "imag", "complex", "rng",
        "rng-bit-generator", "rng-get-and-update-state", "infeed", "outfeed", "after-all",
    }
)


# ------------------------------------------------------------------------ stochastic rounding


class _RunState(threading.local):
    rng: np.random.Generator | None = None


_STATE = _RunState()


def round_to_half(x: Any, stochastic: bool = False) -> Any:
    """``x`` (any real dtype) rounded to float16: to nearest-even, or when ``stochastic`` and a
    run's stream is active (see :meth:`Numerics.run_scope`), down or up with probability
    proportional to the distance. Values beyond the FP16 range become +-inf as with
    nearest-even rounding; a value between 65504 and the rounding threshold stays 65504.
    Numpy scalars stay scalars."""
    a = np.asarray(x)
    if a.dtype == _F16:
        return x
    rng = _STATE.rng if stochastic else None
    if rng is None:
        return a.astype(_F16) if a.ndim else _F16.type(a[()])
    x64 = a.astype(_F64)
    h = x64.astype(_F16)  # nearest-even: the neighbour closer to x
    hf = h.astype(_F64)
    diff = x64 - hf  # exact: x and its nearest FP16 neighbour are close
    toward = np.where(diff > 0, np.inf, -np.inf).astype(_F16)
    other = np.nextafter(h, toward)  # the neighbour on the other side of x
    gap = other.astype(_F64) - hf
    with np.errstate(all="ignore"):
        p_other = np.where(diff != 0, diff / gap, 0.0)  # in [0, 1/2]; 0 next to +-inf
    u = rng.random(a.shape)
    out = np.where((u < p_other) & np.isfinite(h), other, h)
    return out if a.ndim else out[()]


def chunked_matmul(
    a: np.ndarray, b: np.ndarray, width: int, rounder: Callable[[np.ndarray], np.ndarray],
    out: np.ndarray | None = None,
) -> np.ndarray:
    """``a @ b`` with an FP16 accumulator: the contraction (last axis of ``a``) is taken
    ``width`` at a time, each chunk summed in float32 by ``np.matmul`` and added to the
    accumulator, which ``rounder`` rounds to FP16 after every chunk. Returns float32 holding
    FP16 values (written into ``out`` when given)."""
    k = a.shape[-1]
    if k <= width:
        acc = rounder(np.matmul(a, b)).astype(_F32)
    else:
        acc = None
        for k0 in range(0, k, width):
            part = np.matmul(a[..., k0:k0 + width], b[..., k0:k0 + width, :])
            if acc is not None:
                part += acc
            acc = rounder(part).astype(_F32)
    if out is not None:
        out[...] = acc
        return out
    return acc


# ----------------------------------------------------------------------------- the options


@dataclass(frozen=True)
class Numerics:
    """The numerics one compile asks for (built by the compiler from ``CompileOptions`` and
    the target; kernels read it as ``ctx.numerics``)."""

    matmul_partials: str = "float"     # "float" or "half"
    conv_partials: str = "float"
    partials_chunk: int = 16           # Target.amp_fp16_partials_chunk
    esr: bool = False
    inv: bool = False
    div0: bool = False
    oflo: bool = False
    nanoo: bool = False
    seed: int = 0

    @property
    def checks(self) -> bool:
        return self.inv or self.div0 or self.oflo or self.nanoo

    @property
    def active(self) -> bool:
        """Whether anything differs from the kernels' default arithmetic."""
        return self.checks or self.esr or "half" in (self.matmul_partials, self.conv_partials)

    def half_partials_chunk(self, opcode: str, operand_dtypes: Sequence[np.dtype | None]) -> int:
        """The FP16 accumulation width for this ``dot``/``convolution``, or 0 when it uses
        FP32 partials (the default, and always unless both operands are FP16)."""
        kind = self.matmul_partials if opcode == "dot" else self.conv_partials
        if kind != "half" or len(operand_dtypes) < 2 or any(d != _F16 for d in operand_dtypes[:2]):
            return 0
        return max(1, int(self.partials_chunk))

    def round_half(self, x: Any) -> Any:
        """``x`` rounded to FP16 as this program rounds (stochastically with ``esr``)."""
        return round_to_half(x, self.esr)

    def chunked_matmul(self, a: np.ndarray, b: np.ndarray, chunk: int, out: np.ndarray | None = None) -> np.ndarray:
        """:func:`chunked_matmul` rounding as this program rounds (for kernels)."""
        return chunked_matmul(a, b, chunk, self.round_half, out)

    # -- run scope ---------------------------------------------------------------------

    def program_seed(self, module: ir_pb2.Module) -> int:
        if self.seed:
            return int(self.seed) & ((1 << 64) - 1)
        digest = hashlib.sha256(module.SerializeToString(deterministic=True)).digest()
        return int.from_bytes(digest[:8], "little")

    def runner(self, module: ir_pb2.Module) -> Callable[[Callable[[], Any]], Any] | None:
        """``None`` without ``esr``; else a function that runs ``thunk()`` with this
        thread's stochastic-rounding stream set to the next run's."""
        if not self.esr:
            return None
        seed = self.program_seed(module)
        counter = itertools.count()

        def run(thunk: Callable[[], Any]) -> Any:
            previous = _STATE.rng
            _STATE.rng = np.random.default_rng([seed, next(counter)])
            try:
                return thunk()
            finally:
                _STATE.rng = previous

        return run

    # -- instrumentation ---------------------------------------------------------------

    def instrument(
        self,
        instr: ir_pb2.Instruction,
        fn: Callable[[Sequence[Any]], Any],
        out_dtype: np.dtype | None,
        operand_dtypes: Sequence[np.dtype | None],
        operand_shapes: Sequence[tuple[int, ...]],
        out_shape: tuple[int, ...],
        build_f32: Callable[[], Callable[[Sequence[Any]], Any]] | None,
    ) -> Callable[[Sequence[Any]], Any]:
        """``fn`` (the kernel of ``instr``) with this program's numerics around it: FP16
        results rounded stochastically (``build_f32`` makes the same kernel for FP32
        operands and result), then the exception checks and ``nanoo``. Returns ``fn`` itself
        when nothing applies."""
        op = instr.opcode
        if self.esr and out_dtype == _F16 and op in SR_OPCODES and build_f32 is not None \
                and not (op in ("dot", "convolution") and self.half_partials_chunk(op, operand_dtypes)):
            fn = _stochastic(op, fn, build_f32, operand_dtypes)
        if self.checks and op not in UNCHECKED_OPCODES and _has_float_result(instr.shape):
            elementwise = op in _ELEMENTWISE and all(
                _broadcasts(s, out_shape) for s, d in zip(operand_shapes, operand_dtypes, strict=False)
                if d is not None
            )
            fn = _checked(self, instr, fn, elementwise)
        return fn


def _stochastic(
    op: str, fn: Callable[[Sequence[Any]], Any], build_f32: Callable[[], Callable[[Sequence[Any]], Any]],
    operand_dtypes: Sequence[np.dtype | None],
) -> Callable[[Sequence[Any]], Any]:
    if op == "convert":
        def convert(ops: Sequence[Any]) -> Any:
            return round_to_half(ops[0], True)
        return convert
    wide = build_f32()
    upcast = [d == _F16 for d in operand_dtypes]

    def run(ops: Sequence[Any]) -> Any:
        if _STATE.rng is None:  # constant folding at compile time: nearest-even
            return fn(ops)
        args = [np.asarray(o, _F32) if up else o for o, up in zip(ops, upcast, strict=True)]
        return round_to_half(wide(args), True)

    return run


def _has_float_result(shape: ir_pb2.Shape) -> bool:
    if shape.is_tuple:
        return any(_has_float_result(s) for s in shape.tuple_shapes)
    return shape.dtype in (ir_pb2.F16, ir_pb2.F32, ir_pb2.F64, ir_pb2.BF16)


def _broadcasts(shape: tuple[int, ...], to: tuple[int, ...]) -> bool:
    try:
        return np.broadcast_shapes(shape, to) == to
    except ValueError:
        return False


def _float_leaves(value: Any) -> list[np.ndarray]:
    if isinstance(value, tuple):
        return [leaf for v in value for leaf in _float_leaves(v)]
    a = np.asarray(value)
    return [a] if a.dtype.kind == "f" or a.dtype.name == "bfloat16" else []


# Ops whose infinities from finite operands are poles (IEEE's divide-by-zero), not overflows.
_POLES = frozenset({"log", "log-plus-one", "rsqrt"})


def _checked(
    numerics: Numerics, instr: ir_pb2.Instruction, fn: Callable[[Sequence[Any]], Any], elementwise: bool
) -> Callable[[Sequence[Any]], Any]:
    is_divide = instr.opcode == "divide" or instr.opcode in _POLES
    tuple_result = instr.shape.is_tuple
    half = (not tuple_result) and instr.shape.dtype == ir_pb2.F16

    def run(ops: Sequence[Any]) -> Any:
        result = fn(ops)
        if tuple_result:
            for r in _float_leaves(result):
                if r.size and not np.isfinite(r).all():
                    _check(numerics, instr, r, ops, False, False)
            return result
        r = np.asarray(result)
        if not r.size or np.isfinite(r).all():
            return result
        overflow = _check(numerics, instr, r, ops, elementwise, is_divide)
        if half and numerics.nanoo and np.any(overflow):
            out = np.where(overflow, np.asarray(np.nan, r.dtype), r)
            return out if r.ndim else out[()]
        return result

    return run


def _check(
    numerics: Numerics, instr: ir_pb2.Instruction, r: np.ndarray, ops: Sequence[Any],
    elementwise: bool, is_divide: bool,
) -> Any:
    """Raises for the first flag that is set and raised; returns the overflow mask."""
    inputs = [leaf for o in ops for leaf in _float_leaves(o)]
    nan_in: Any = False
    finite_in: Any = True
    if elementwise:
        try:
            for a in inputs:
                nan_in = nan_in | np.isnan(a)
                finite_in = finite_in & np.isfinite(a)
            np.broadcast_shapes(np.shape(nan_in), r.shape)
        except ValueError:
            elementwise = False
    if not elementwise:
        nan_in = any(bool(np.isnan(a).any()) for a in inputs)
        finite_in = all(bool(np.isfinite(a).all()) for a in inputs)
    inf = np.isinf(r)
    by_zero: Any = False
    if is_divide and instr.opcode in _POLES:
        by_zero = inf & finite_in
        what_zero = f"took {instr.opcode} at its pole (IEEE's division by zero)"
    elif is_divide and len(ops) == 2:
        num, den = np.asarray(ops[0]), np.asarray(ops[1])
        by_zero = inf & (den == 0) & np.isfinite(num) & (num != 0)
        what_zero = "divided a finite non-zero value by zero"
    overflow = inf & finite_in & ~np.asarray(by_zero)
    if numerics.inv:
        bad = np.isnan(r) & ~np.asarray(nan_in)
        if np.any(bad):
            _raise(instr, "inv", f"produced NaN from operands that are not NaN "
                   f"({_count(bad, r)}{_where(bad, r)})")
    if numerics.div0 and np.any(by_zero):
        _raise(instr, "div0", f"{what_zero} ({_count(by_zero, r)}{_where(by_zero, r)})")
    if numerics.oflo and np.any(overflow):
        limit = f"; the largest {r.dtype} is {float(np.finfo(r.dtype).max):g}" if r.dtype.kind == "f" else ""
        _raise(instr, "oflo", f"produced +-inf from finite operands ({_count(overflow, r)}"
               f"{_where(overflow, r)}){limit}")
    return overflow


def _count(mask: Any, r: np.ndarray) -> str:
    n = int(np.count_nonzero(np.broadcast_to(mask, r.shape)))
    return f"{n} of {r.size} elements"


def _where(mask: Any, r: np.ndarray) -> str:
    if not r.ndim:
        return ""
    first = np.argwhere(np.broadcast_to(mask, r.shape))
    return f", first at index {list(int(i) for i in first[0])}" if len(first) else ""


def _raise(instr: ir_pb2.Instruction, flag: str, what: str) -> None:
    raise FloatingPointExceptionError(
        f"Floating-point exception ({flag}: {_FLAG_NAMES[flag]}) while running "
        f"{describe(instr)}: it {what}.",
        flag=flag,
    )
