"""Shared helpers for the emulator's differential tests against XLA.

A test writes a small function with plain TF ops or the ops of
``tensorflow.compiler.tf2xla.python.xla``, lowers it with :func:`lower` (or
:func:`lower_step` when it reads or updates variables), runs the IR on the emulator with
:func:`run_ir`, and compares with the XLA run of the same function with :func:`assert_same`.

    module, expected = lower(lambda x: tf.nn.relu(x), x)
    assert_same(run_ir(module, [x]), expected, rtol=1e-6)
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from device_server import emulator  # noqa: E402
from device_server.protocol import dtypes, ir_pb2  # noqa: E402


def _import_converter() -> Any:
    """``tf_ipu.lowering.hlo_to_ir``. Importing ``tf_ipu`` loads its op library
    (``tf_ipu_ops``, installed by ``make build``); the converter itself needs neither, so
    when the package cannot be imported yet the module is loaded on its own."""
    try:
        from tf_ipu.lowering import hlo_to_ir
    except ImportError:
        import importlib.util
        import pathlib
        import sys

        name = "tf_ipu.lowering.hlo_to_ir"
        path = pathlib.Path(__file__).resolve().parents[1] / "tf_ipu" / "lowering" / "hlo_to_ir.py"
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None
        hlo_to_ir = importlib.util.module_from_spec(spec)
        sys.modules[name] = hlo_to_ir
        spec.loader.exec_module(hlo_to_ir)
    return hlo_to_ir


converter = _import_converter()
hlo_module_to_ir = converter.hlo_module_to_ir


def _as_xla_function(fn: Callable[..., Any]) -> Any:
    """``fn`` itself if it is already a ``tf.function`` with jit_compile, else wrapped."""
    if isinstance(fn, tf.types.experimental.PolymorphicFunction):
        return fn
    return tf.function(fn, jit_compile=True, autograph=False)


def _flat_numpy(result: Any) -> list[np.ndarray]:
    return [np.asarray(t.numpy() if hasattr(t, "numpy") else t, order="C") for t in tf.nest.flatten(result)]


def hlo_of(fn: Callable[..., Any], *args: Any) -> bytes:
    """The unoptimized serialized ``HloModuleProto`` of ``fn`` for ``args``."""
    return _as_xla_function(fn).experimental_get_compiler_ir(*args)(stage="hlo_serialized")


def lower(fn: Callable[..., Any], *args: Any) -> tuple[ir_pb2.Module, list[np.ndarray]]:
    """Lowers ``fn(*args)`` to IR and runs it with XLA (CPU, ``jit_compile=True``).

    Returns ``(module, expected)``: ``expected`` is the XLA result flattened like the
    emulator's entry result. Use :func:`lower_step` for functions that touch variables.
    """
    f = _as_xla_function(fn)
    module = hlo_module_to_ir(hlo_of(f, *args))
    expected = _flat_numpy(f(*args))
    return module, expected


_HALF = (np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16))


def float32_reference(fn: Callable[..., Any], args: Sequence[Any], like: Sequence[np.ndarray]) -> list[np.ndarray]:
    """The XLA reference of a 16-bit float program that rounds alike on every CPU: ``fn``
    run by XLA on the arguments with 16-bit floats widened to float32 (exactly), and each
    result that ``like`` (the emulator's outputs) has in a 16-bit type rounded to it once.

    It stands for the IPU's FP16/BF16 arithmetic units, which take 16-bit inputs, accumulate
    in FP32 (partials) and round the result once. XLA's own 16-bit programs are no such
    reference: where and how they round depends on the host's instruction set (native FP16
    arithmetic on AVX512-FP16 hosts, FP32 elsewhere, with or without the intermediate
    roundings), while float32 results differ between hosts only in the order of the
    additions (at most K * 2^-24 relative to the sum of |terms| for K terms), far below a
    16-bit ulp. Meant for programs with one rounding per result (a convolution, a pooling, a
    scatter); a chain of 16-bit ops rounds each op on the emulator (as on the IPU) and only
    the last one here."""
    wide = [np.asarray(a.numpy() if hasattr(a, "numpy") else a) for a in args]
    wide = [a.astype(np.float32) if a.dtype in _HALF else a for a in wide]
    expected = _flat_numpy(_as_xla_function(fn)(*wide))
    return [e.astype(g.dtype) if np.asarray(g).dtype in _HALF and e.dtype == np.float32 else e
            for e, g in zip(expected, like, strict=True)]


def lower_step(
    fn: Callable[..., Any], *args: Any
) -> tuple[ir_pb2.Module, list[np.ndarray], list[np.ndarray]]:
    """Like :func:`lower` for a function that reads/updates variables (e.g. a train step).

    Returns ``(module, params, expected)``: ``params`` are the entry parameters (the
    arguments, then the captured variables' values *before* the XLA run and the captured
    constant tensors, in the order of ``concrete_fn.captured_inputs``); ``expected`` is the
    flattened XLA result followed by the updated variable values for the aliased outputs (so
    it lines up with the emulator's outputs). The XLA run updates the variables, as a real
    step would.
    """
    f = _as_xla_function(fn)
    module = hlo_module_to_ir(hlo_of(f, *args))
    concrete = f.get_concrete_function(*args)
    captured = list(concrete.captured_inputs)
    entry = next(c for c in module.computations if c.id == module.entry_computation_id)
    param_dtypes = {
        i.parameter_number: i.shape.dtype for i in entry.instructions if i.opcode == "parameter"
    }
    n_args = len(args)

    def read(k: int) -> np.ndarray:
        if captured[k].dtype != tf.resource:  # a captured constant (e.g. Normalization's mean)
            return np.asarray(captured[k].numpy(), order="C")
        dt = tf.as_dtype(dtypes.to_numpy(param_dtypes[n_args + k]))
        return np.asarray(tf.raw_ops.ReadVariableOp(resource=captured[k], dtype=dt).numpy(), order="C")

    params = [np.asarray(a.numpy() if hasattr(a, "numpy") else a, order="C") for a in args]
    params += [read(k) for k in range(len(captured))]
    flat = _flat_numpy(f(*args))
    expected: dict[int, np.ndarray] = dict(enumerate(flat))
    for alias in module.aliases:
        if alias.parameter_number >= n_args:
            expected[alias.output_index] = read(alias.parameter_number - n_args)
    return module, params, [expected[i] for i in sorted(expected)]


def run_ir(
    module: ir_pb2.Module,
    args: Sequence[Any],
    *,
    target: str = "ipu2",
    options: emulator.CompileOptions | None = None,
) -> list[np.ndarray]:
    """Compiles ``module`` for ``target`` and runs it once on ``args``."""
    exe = emulator.compile_module(module, emulator.get_target(target), options or emulator.CompileOptions())
    arrays = [np.asarray(a.numpy() if hasattr(a, "numpy") else a, order="C") for a in args]
    return exe.run(arrays)


def assert_same(
    actual: Sequence[np.ndarray],
    expected: Sequence[np.ndarray],
    *,
    rtol: float = 1e-5,
    atol: float = 0.0,
    what: str = "",
) -> None:
    """Compares output lists: same count, dtypes and shapes (for outputs with dynamic
    dimensions, the run-time shapes); floats within ``rtol``/``atol`` (NaN equals NaN,
    infinities must match), everything else exactly."""
    assert len(actual) == len(expected), f"{what}: {len(actual)} outputs, expected {len(expected)}"
    for k, (a, e) in enumerate(zip(actual, expected, strict=True)):
        a = np.asarray(a)
        e = np.asarray(e)
        label = f"{what} output {k}"
        assert a.dtype == e.dtype, f"{label}: dtype {a.dtype}, expected {e.dtype}"
        assert a.shape == e.shape, f"{label}: shape {a.shape}, expected {e.shape}"
        if np.issubdtype(e.dtype, np.inexact) or e.dtype.kind == "V" or e.dtype.name == "bfloat16":
            np.testing.assert_allclose(
                a.astype(np.complex128 if e.dtype.kind == "c" else np.float64),
                e.astype(np.complex128 if e.dtype.kind == "c" else np.float64),
                rtol=rtol, atol=atol, equal_nan=True, err_msg=label,
            )
        else:
            np.testing.assert_array_equal(a, e, err_msg=label)


class Differential:
    """One function lowered once (for the shapes/dtypes of ``example``) and compiled once;
    :meth:`check` then compares XLA and the emulator on new values of the same signature
    (cheap enough for hypothesis)."""

    def __init__(self, fn: Callable[..., Any], *example: Any, target: str = "ipu2",
                 options: emulator.CompileOptions | None = None) -> None:
        self.fn = _as_xla_function(fn)
        self.module = hlo_module_to_ir(hlo_of(self.fn, *example))
        self.exe = emulator.compile_module(
            self.module, emulator.get_target(target), options or emulator.CompileOptions()
        )

    @property
    def opcodes(self) -> set[str]:
        """Every opcode in the lowered module."""
        return {i.opcode for c in self.module.computations for i in c.instructions}

    def run(self, *args: Any) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """(emulator outputs, XLA outputs) for ``args``."""
        arrays = [np.asarray(a.numpy() if hasattr(a, "numpy") else a, order="C") for a in args]
        return self.exe.run(arrays), _flat_numpy(self.fn(*args))

    def check(self, *args: Any, rtol: float = 1e-5, atol: float = 0.0) -> None:
        got, expected = self.run(*args)
        assert_same(got, expected, rtol=rtol, atol=atol, what=self.module.name)


def dynamic_opcodes(module: ir_pb2.Module) -> set[str]:
    """Opcodes of the instructions whose result has a dynamic dimension (bounded dynamic
    shapes; outputs of such functions come back at their run-time shape)."""
    def dynamic(shape: ir_pb2.Shape) -> bool:
        return any(dynamic(s) for s in shape.tuple_shapes) if shape.is_tuple else any(shape.dynamic_dims)

    return {i.opcode for c in module.computations for i in c.instructions if dynamic(i.shape)}


def check(fn: Callable[..., Any], *args: Any, rtol: float = 1e-5, atol: float = 0.0,
          wide: bool = False) -> ir_pb2.Module:
    """Lowers ``fn``, runs it on the emulator and XLA, asserts they agree; returns the IR.
    ``wide``: XLA's reference computed in float32 from 16-bit float arguments and rounded
    once (:func:`float32_reference`), for programs whose 16-bit results XLA's own 16-bit
    arithmetic would round differently on different hosts."""
    module, expected = lower(fn, *args)
    got = run_ir(module, args)
    if wide:
        expected = float32_reference(fn, args, got)
    assert_same(got, expected, rtol=rtol, atol=atol, what=getattr(fn, "__name__", "fn"))
    return module


# ------------------------------------------------------------------ hand-built IR modules


def literal_of(array: np.ndarray) -> ir_pb2.Literal:
    """An IR literal holding ``array``."""
    a = np.asarray(array, order="C")
    return ir_pb2.Literal(
        shape=ir_pb2.Shape(dtype=dtypes.from_numpy(a.dtype), dims=a.shape),
        data=a.astype(a.dtype.newbyteorder("<"), copy=False).tobytes(),
    )


def set_attr(instr: ir_pb2.Instruction, name: str, value: Any) -> None:
    """Stores a Python value as an IR attribute (bool -> flag, int -> i, float -> f,
    str -> s, bytes -> b, list/tuple of ints -> ints, of str -> strings, ndarray -> literal)."""
    a = instr.attrs[name]
    if isinstance(value, bool):
        a.flag = value
    elif isinstance(value, int | np.integer):
        a.i = int(value)
    elif isinstance(value, float):
        a.f = value
    elif isinstance(value, str):
        a.s = value
    elif isinstance(value, bytes):
        a.b = value
    elif isinstance(value, np.ndarray):
        a.literal.CopyFrom(literal_of(value))
    elif all(isinstance(v, str) for v in value):
        a.strings.values.extend(value)
        a.strings.SetInParent()
    else:
        a.ints.values.extend(int(v) for v in value)
        a.ints.SetInParent()


class IRBuilder:
    """Builds one computation by hand, for opcodes no TF op produces (e.g. ``clz``).

        b = IRBuilder()
        x = b.parameter(np.int32, [4])
        b.root(b.op("clz", [x], np.int32, [4]))
        module = b.module()
    """

    def __init__(self, name: str = "built") -> None:
        self._module = ir_pb2.Module(name=name, frontend="test")
        self._comp = self._module.computations.add(id=1, name=name)
        self._module.entry_computation_id = 1
        self._next = 1
        self._params = 0

    def _add(self, opcode: str, operands: Sequence[int], dtype: Any, dims: Sequence[int]) -> ir_pb2.Instruction:
        instr = self._comp.instructions.add(
            id=self._next, name=f"{opcode}.{self._next}", opcode=opcode, operands=list(operands)
        )
        instr.shape.dtype = dtypes.from_numpy(np.dtype(dtype))
        instr.shape.dims.extend(int(d) for d in dims)
        self._next += 1
        return instr

    def parameter(self, dtype: Any, dims: Sequence[int]) -> int:
        instr = self._add("parameter", [], dtype, dims)
        instr.parameter_number = self._params
        self._params += 1
        return instr.id

    def constant(self, value: Any, dtype: Any = None) -> int:
        a = np.asarray(value, dtype=dtype)
        instr = self._add("constant", [], a.dtype, a.shape)
        instr.attrs["value"].literal.CopyFrom(literal_of(a))
        return instr.id

    def op(self, opcode: str, operands: Sequence[int], dtype: Any, dims: Sequence[int],
           source_op: str = "", called: Sequence[int] = (), **attrs: Any) -> int:
        """Adds an instruction; ``dtype=None`` makes a tuple of ``dims`` = instruction ids
        whose shapes form the tuple (e.g. for ``tuple`` or a variadic ``reduce``)."""
        if dtype is None:
            instr = self._add(opcode, operands, np.float32, [])
            instr.shape.Clear()
            instr.shape.is_tuple = True
            for i in dims:
                instr.shape.tuple_shapes.add().CopyFrom(self.shape(i))
        else:
            instr = self._add(opcode, operands, dtype, dims)
        instr.source_op = source_op
        instr.called_computations.extend(called)
        for k, v in attrs.items():
            set_attr(instr, k, v)
        return instr.id

    def tuple(self, elements: Sequence[int]) -> int:
        """A ``tuple`` of the given instructions."""
        return self.op("tuple", elements, None, elements)

    def shape(self, instr_id: int) -> ir_pb2.Shape:
        return next(i.shape for i in self._comp.instructions if i.id == instr_id)

    def dynamic(self, instr_id: int, *dims: int) -> int:
        """Marks dimensions of an instruction's (array) shape dynamic: their sizes become
        bounds. Returns the instruction id."""
        shape = self.shape(instr_id)
        flags = [False] * len(shape.dims)
        for d in dims:
            flags[d] = True
        del shape.dynamic_dims[:]
        shape.dynamic_dims.extend(flags)
        return instr_id

    def computation(self, other: IRBuilder) -> int:
        """Adds ``other``'s computation (with a root set) to this module; returns its id."""
        comp = self._module.computations.add()
        comp.CopyFrom(other._comp)
        comp.id = len(self._module.computations)
        comp.name = f"{other._comp.name}.{comp.id}"
        return comp.id

    def root(self, instr_id: int) -> None:
        self._comp.root_id = instr_id

    def module(self) -> ir_pb2.Module:
        return self._module


def run_in_threads(worker: Callable[[int], None], count: int = 4) -> None:
    """Runs ``worker(k)`` for k in range(count) on that many threads at once; waits for all."""
    import threading

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def widened_reference(fn: Callable[..., Any], args: Sequence[Any], like: Sequence[np.ndarray]) -> list[np.ndarray]:
    """The XLA reference of a float32 or 16-bit float program at the edges of the range:
    ``fn`` run by XLA on the arguments widened exactly (float32 to float64, 16-bit floats to
    float32), each result that ``like`` (the emulator's outputs) has in a narrower float type
    rounded to it once.

    For 16-bit floats this is :func:`float32_reference`. For float32 it stands in for XLA's
    float32 programs, which its CPU backend runs with denormals flushed to zero (subnormal
    arguments read as zero, subnormal results flushed), where the emulator keeps IEEE's
    gradual underflow: in float64 every float32 subnormal is a normal number, so the result,
    rounded once to float32, is IEEE's float32 result (correctly rounded for +, -, *, / and
    sqrt, whose double rounding through float64 is innocuous: 53 >= 2 * 24 + 2 bits), and
    float32 overflow appears at the rounding (beyond the float32 range, +-inf)."""
    wide = []
    for a in args:
        a = np.asarray(a.numpy() if hasattr(a, "numpy") else a)
        if a.dtype == np.float32:
            a = a.astype(np.float64)
        elif a.dtype in _HALF:
            a = a.astype(np.float32)
        wide.append(a)
    expected = _flat_numpy(_as_xla_function(fn)(*wide))
    out = []
    for e, g in zip(expected, like, strict=True):
        g_dtype = np.asarray(g).dtype
        if e.dtype != g_dtype and e.dtype.kind == "f" and (g_dtype.kind == "f" or g_dtype in _HALF):
            with np.errstate(over="ignore"):
                e = e.astype(g_dtype)
        out.append(e)
    return out
