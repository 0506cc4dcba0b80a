"""tf_ipu_ops: the `IpuExecute` op, the node that stands for the IPU inside a TF graph.

Where this sits::

    Keras traced function (tf.function graph, or eager)
      -> IpuExecute kernel (C++, ops/cc/kernels/ipu_execute_kernel.cc)
        -> ctypes trampolines (this module: raw buffers -> numpy views)
          -> DeviceHandler (the tf_ipu runtime) --gRPC--> device server -> emulated IPUs

The op library is a plain TF custom-op ``.so``; it links no libpython. The tf_ipu runtime
calls :func:`set_device_handler` once at import time, which installs two C callbacks in the
library through ctypes. From then on every `IpuExecute` kernel (eager, in a `tf.function`,
or in a SavedModel reloaded by this process) registers its program with the handler once and
calls ``handler.execute`` with zero-copy numpy views of its input and output buffers.

Not ready yet: no gradient is registered (differentiating through `IpuExecute` raises
`LookupError`: tf_ipu computes gradients on the device, inside the program); outputs must have
fully defined shapes (no dynamic shapes cross the boundary: tf_ipu returns a result of
data-dependent size at its bound, with its run-time dims in an extra output, and slices it
after the op; see tf_ipu.lowering.program).

Example::

    import numpy as np
    import tensorflow as tf
    import tf_ipu_ops

    class Doubler:
        def register_program(self, program: bytes, signature: str) -> int:
            return 0

        def execute(self, program_id, inputs, outputs):
            np.multiply(inputs[0], 2, out=outputs[0])

    tf_ipu_ops.set_device_handler(Doubler())
    (y,) = tf_ipu_ops.ipu_execute(
        [tf.ones([3])], Tout=[tf.float32], output_shapes=[[3]], program=b"", signature="{}"
    )
"""

from __future__ import annotations

import ctypes
import math
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import ml_dtypes
import numpy as np
import tensorflow as tf

__all__ = [
    "DeviceCallError",
    "DeviceHandler",
    "SUPPORTED_DTYPES",
    "get_device_handler",
    "ipu_execute",
    "library_path",
    "op_module",
    "set_device_handler",
]

library_path: Path = Path(__file__).resolve().with_name("_ipu_ops.so")
"""Path of the op library this package loads."""

if not library_path.is_file():
    raise ImportError(
        f"tf_ipu_ops: the op library {library_path} does not exist. Build it: run `make` "
        "(or `make ops`, i.e. `python ops/build.py --out ops/python/_ipu_ops.so`) in the "
        "tf_ipu checkout, or reinstall the package with `pip install .`."
    )

op_module: Any = tf.load_op_library(str(library_path))
"""The generated wrappers of the op library (``op_module.ipu_execute``), unchecked."""

# TF/absl status codes used by this module (the full range 1..16 passes through).
OK, CANCELLED, INTERNAL = 0, 1, 13
_MAX_CODE = 16

# TF DataType enum -> numpy dtype, for every dtype the kernel lets through.
_NP_DTYPES: dict[int, np.dtype] = {
    tf.float16.as_datatype_enum: np.dtype(np.float16),
    tf.bfloat16.as_datatype_enum: np.dtype(ml_dtypes.bfloat16),
    tf.float32.as_datatype_enum: np.dtype(np.float32),
    tf.float64.as_datatype_enum: np.dtype(np.float64),
    tf.int8.as_datatype_enum: np.dtype(np.int8),
    tf.int16.as_datatype_enum: np.dtype(np.int16),
    tf.int32.as_datatype_enum: np.dtype(np.int32),
    tf.int64.as_datatype_enum: np.dtype(np.int64),
    tf.uint8.as_datatype_enum: np.dtype(np.uint8),
    tf.uint16.as_datatype_enum: np.dtype(np.uint16),
    tf.uint32.as_datatype_enum: np.dtype(np.uint32),
    tf.uint64.as_datatype_enum: np.dtype(np.uint64),
    tf.bool.as_datatype_enum: np.dtype(np.bool_),
    tf.complex64.as_datatype_enum: np.dtype(np.complex64),
    tf.complex128.as_datatype_enum: np.dtype(np.complex128),
}

SUPPORTED_DTYPES: frozenset[tf.DType] = frozenset(tf.as_dtype(e) for e in _NP_DTYPES)
"""The dtypes `IpuExecute` accepts for its inputs and outputs."""


class DeviceCallError(Exception):
    """An error a :class:`DeviceHandler` raises to fail the op with a given status code.

    The op fails with the TF exception of that code (3 -> `tf.errors.InvalidArgumentError`,
    14 -> `tf.errors.UnavailableError`, ...) carrying ``message``.

    Args:
        code: a TF/absl status code, 1..16 (not 0: an error is not OK).
        message: what went wrong, in the user's terms.

    Example:
        >>> raise DeviceCallError(8, "IPU 0 is out of tile memory")  # doctest: +SKIP
    """

    def __init__(self, code: int, message: str) -> None:
        if not isinstance(code, int) or not 1 <= code <= _MAX_CODE:
            raise ValueError(f"DeviceCallError code must be an int in 1..16. Received: {code!r}")
        super().__init__(message)
        self.code = code
        self.message = message

    def __repr__(self) -> str:
        return f"DeviceCallError(code={self.code}, message={self.message!r})"


@runtime_checkable
class DeviceHandler(Protocol):
    """What the op library calls to run programs: implemented by the tf_ipu runtime.

    Both methods are called with the GIL held, from whichever thread runs the kernel (the
    main thread eagerly, TF's executor threads in a graph), possibly from several at once.
    Raise :class:`DeviceCallError` (or any exception with an int ``grpc_code``/``code``,
    e.g. a `grpc.RpcError`) to fail the op with that status; any other exception fails it
    with INTERNAL and ``"<type>: <message>"``.
    """

    def register_program(self, program: bytes, signature: str) -> int:
        """Registers a program; called once per kernel instance.

        Args:
            program: the serialized IR module (the op's ``program`` attr).
            signature: the op's ``signature`` attr (UTF-8 JSON).

        Returns:
            A program id >= 0, later passed to :meth:`execute`.
        """
        ...

    def execute(self, program_id: int, inputs: list[np.ndarray], outputs: list[np.ndarray]) -> None:
        """Runs a registered program; called on every run of the op.

        Args:
            program_id: an id returned by :meth:`register_program`.
            inputs: read-only zero-copy views of the op's input tensors.
            outputs: writable zero-copy views of its freshly allocated (uninitialized) output
                tensors, to be filled in place (e.g. ``outputs[0][...] = y``).

        The views are valid only during the call: do not keep them.
        """
        ...


def _status_of(exc: BaseException) -> tuple[int, str]:
    """Maps an exception raised by a handler to (status code, message)."""
    if isinstance(exc, KeyboardInterrupt):
        return CANCELLED, "interrupted (KeyboardInterrupt) while the device was running"
    code: Any = getattr(exc, "grpc_code", None)
    if code is None:
        code = getattr(exc, "code", None)
    if callable(code):  # grpc.RpcError.code() -> grpc.StatusCode
        try:
            code = code()
        except Exception:
            code = None
    value = getattr(code, "value", code)  # grpc.StatusCode.value == (int, name)
    if isinstance(value, tuple) and value:
        value = value[0]
    if isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= _MAX_CODE:
        if isinstance(exc, DeviceCallError):
            return value, exc.message
        details = getattr(exc, "details", None)
        if callable(details):  # grpc.RpcError.details() is the server's message.
            try:
                return value, str(details())
            except Exception:
                pass
        return value, str(exc)
    return INTERNAL, f"{type(exc).__name__}: {exc}"


def _write_error(err: int | None, err_len: int, message: str) -> None:
    """Copies ``message`` NUL-terminated into the kernel's error buffer, truncated."""
    if not err or err_len <= 0:
        return
    data = message.encode("utf-8", "replace")[: err_len - 1]
    data = data.decode("utf-8", "ignore").encode("utf-8")  # No half character at the cut.
    ctypes.memmove(err, data, len(data))
    ctypes.memset(err + len(data), 0, 1)


def _report(exc: BaseException, err: int | None, err_len: int) -> int:
    """Writes ``exc``'s message into the error buffer and returns its status code (never 0).

    Must not raise: an exception escaping a ctypes callback is printed and the callback
    returns 0, which the kernel would take for success (or for program id 0).
    """
    try:
        code, message = _status_of(exc)
    except BaseException:
        code, message = INTERNAL, f"{type(exc).__name__} (its message could not be read)"
    try:
        _write_error(err, err_len, message)
    except BaseException:
        pass
    return code


def _views(
    n: int, ptrs: Any, dtypes: Any, ranks: Any, dims: Any, writable: bool
) -> list[np.ndarray]:
    """Wraps raw tensor buffers in numpy arrays without copying."""
    arrays = []
    offset = 0
    for i in range(n):
        rank = ranks[i]
        shape = tuple(dims[offset + d] for d in range(rank))
        offset += rank
        dtype = _NP_DTYPES[dtypes[i]]
        nbytes = math.prod(shape) * dtype.itemsize
        ptr = ptrs[i]
        if nbytes == 0 or not ptr:
            array = np.empty(shape, dtype)  # Zero-size: nothing to share.
        else:
            buffer = memoryview((ctypes.c_char * nbytes).from_address(ptr)).cast("B")
            if not writable:
                buffer = buffer.toreadonly()
            array = np.frombuffer(buffer, dtype=dtype).reshape(shape)
        if not writable:
            array.flags.writeable = False
        arrays.append(array)
    return arrays


_REGISTER_FN = ctypes.CFUNCTYPE(
    ctypes.c_int64,  # program id, or -code on error
    ctypes.c_void_p, ctypes.c_size_t,  # program bytes
    ctypes.c_void_p, ctypes.c_size_t,  # signature bytes
    ctypes.c_void_p, ctypes.c_size_t,  # error buffer
)  # fmt: skip
_EXECUTE_FN = ctypes.CFUNCTYPE(
    ctypes.c_int,  # status code
    ctypes.c_int64,  # program id
    ctypes.c_int, ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_int),
    ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_int64),  # inputs
    ctypes.c_int, ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_int),
    ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_int64),  # outputs
    ctypes.c_void_p, ctypes.c_size_t,  # error buffer
)  # fmt: skip


def _make_trampolines(handler: DeviceHandler) -> tuple[Any, Any]:
    """Builds the two C callbacks that forward to ``handler``; they never raise."""

    def register(
        program: int | None, program_len: int, sig: int | None, sig_len: int,
        err: int | None, err_len: int,
    ) -> int:  # fmt: skip
        try:
            program_bytes = ctypes.string_at(program, program_len) if program_len else b""
            signature = ctypes.string_at(sig, sig_len).decode("utf-8") if sig_len else ""
            program_id = handler.register_program(program_bytes, signature)
            if isinstance(program_id, bool) or not isinstance(program_id, int | np.integer):
                raise TypeError(
                    f"register_program must return an int program id >= 0. Received: {program_id!r}"
                )
            if program_id < 0:
                raise ValueError(
                    f"register_program must return a program id >= 0. Received: {program_id}"
                )
            return int(program_id)
        except BaseException as exc:  # Nothing may escape into C (ctypes would return 0).
            return -_report(exc, err, err_len)

    def execute(
        program_id: int,
        n_in: int, in_ptrs: Any, in_dtypes: Any, in_ranks: Any, in_dims: Any,
        n_out: int, out_ptrs: Any, out_dtypes: Any, out_ranks: Any, out_dims: Any,
        err: int | None, err_len: int,
    ) -> int:  # fmt: skip
        try:
            inputs = _views(n_in, in_ptrs, in_dtypes, in_ranks, in_dims, writable=False)
            outputs = _views(n_out, out_ptrs, out_dtypes, out_ranks, out_dims, writable=True)
            handler.execute(program_id, inputs, outputs)
            return OK
        except BaseException as exc:  # Nothing may escape into C (ctypes would return 0).
            return _report(exc, err, err_len)

    return _REGISTER_FN(register), _EXECUTE_FN(execute)


_lock = threading.Lock()
_handler: DeviceHandler | None = None
# Every trampoline ever installed stays referenced: a kernel on another thread may still be
# inside an old one when it is replaced, and freeing it under that call would crash.
_trampolines: list[Any] = []
_cdll: ctypes.CDLL | None = None


def _library() -> ctypes.CDLL:
    """The op library opened through ctypes (the same loaded image TF uses)."""
    global _cdll
    if _cdll is None:
        cdll = ctypes.CDLL(str(library_path))
        cdll.tf_ipu_set_device_callbacks.argtypes = [_REGISTER_FN, _EXECUTE_FN]
        cdll.tf_ipu_set_device_callbacks.restype = ctypes.c_int
        _cdll = cdll
    return _cdll


def set_device_handler(handler: DeviceHandler | None) -> None:
    """Makes ``handler`` the runtime that runs every `IpuExecute` op in this process.

    Replaces any earlier handler; kernels then register their programs again with the new
    one on their next run. ``None`` removes the handler: the op then fails with
    `tf.errors.FailedPreconditionError`.

    Args:
        handler: an object with ``register_program`` and ``execute`` (see
            :class:`DeviceHandler`), or ``None``.

    Example:
        >>> tf_ipu_ops.set_device_handler(my_runtime)  # doctest: +SKIP
    """
    global _handler
    if handler is not None and not isinstance(handler, DeviceHandler):
        raise TypeError(
            "set_device_handler needs an object with register_program(program, signature) "
            f"and execute(program_id, inputs, outputs) methods, or None. Received: {handler!r}"
        )
    with _lock:
        lib = _library()
        if handler is None:
            status = lib.tf_ipu_set_device_callbacks(
                ctypes.cast(None, _REGISTER_FN), ctypes.cast(None, _EXECUTE_FN)
            )
        else:
            register, execute = _make_trampolines(handler)
            _trampolines.append((register, execute))
            status = lib.tf_ipu_set_device_callbacks(register, execute)
        if status != 0:
            raise RuntimeError(f"tf_ipu_set_device_callbacks failed with status {status}")
        _handler = handler


def get_device_handler() -> DeviceHandler | None:
    """Returns the handler installed by :func:`set_device_handler`, or ``None``."""
    return _handler


def _check_shape(i: int, shape: Any) -> tf.TensorShape:
    try:
        tensor_shape = tf.TensorShape(shape)
    except (TypeError, ValueError) as e:
        raise ValueError(
            f"ipu_execute: output_shapes[{i}] is not a shape. Received: {shape!r}"
        ) from e
    if not tensor_shape.is_fully_defined():
        raise ValueError(
            "ipu_execute allocates outputs before the device runs, so output shapes must be "
            f"fully defined. Received: output_shapes[{i}]={tensor_shape}"
        )
    return tensor_shape


def ipu_execute(
    inputs: Sequence[Any],
    Tout: Sequence[tf.DType],  # noqa: N803 - the op's attr name.
    output_shapes: Sequence[Any],
    program: bytes,
    signature: str,
    name: str | None = None,
) -> list[tf.Tensor]:
    """Runs a device program on ``inputs``: one `IpuExecute` node in a graph, or one eager run.

    Args:
        inputs: tensors (or values convertible to tensors) fed to the program.
        Tout: dtype of each output.
        output_shapes: fully defined shape of each output (``[]`` for a scalar).
        program: the serialized IR module.
        signature: UTF-8 JSON the host runtime interprets.
        name: optional name of the op.

    Returns:
        The outputs, one tensor per ``Tout`` entry (``[]`` if there are none).

    Raises:
        ValueError: if the dtypes or shapes are unsupported or do not match.
        tf.errors.OpError: when run, as the handler reports (see :class:`DeviceCallError`), or
            `tf.errors.FailedPreconditionError` if no handler is installed.

    Example:
        >>> y, = ipu_execute([x], [tf.float32], [[2, 3]], program=b"...", signature="{}")  # doctest: +SKIP
    """
    tout = [tf.as_dtype(t) for t in Tout]
    if len(tout) != len(output_shapes):
        raise ValueError(
            "ipu_execute needs one output shape per output dtype. Received: "
            f"Tout={[t.name for t in tout]}, output_shapes={list(output_shapes)}"
        )
    shapes = [_check_shape(i, s) for i, s in enumerate(output_shapes)]
    for i, t in enumerate(tout):
        if t not in SUPPORTED_DTYPES:
            raise ValueError(
                f"ipu_execute cannot return dtype {t.name}. Received: Tout[{i}]={t.name}"
            )
    tensors = [tf.convert_to_tensor(x) for x in inputs]
    for i, x in enumerate(tensors):
        if x.dtype not in SUPPORTED_DTYPES:
            raise ValueError(
                f"ipu_execute cannot send dtype {x.dtype.name} to the device. "
                f"Received: inputs[{i}] of dtype {x.dtype.name}"
            )
    if not isinstance(program, bytes | bytearray):
        raise TypeError(f"ipu_execute: program must be bytes. Received: {type(program).__name__}")
    if not isinstance(signature, str):
        raise TypeError(f"ipu_execute: signature must be str. Received: {type(signature).__name__}")
    result = op_module.ipu_execute(
        inputs=tensors,
        Tout=tout,
        output_shapes=shapes,
        program=bytes(program),
        signature=signature,
        name=name,
    )
    if not tout:
        return []  # Graph mode returns the Operation when there are no outputs.
    return list(result)
