"""Tests of the `IpuExecute` op library (tf_ipu_ops) with Python test handlers, no server.

Covers the op eagerly and in `tf.function`, zero inputs/outputs, scalars and zero-size
tensors, dtypes, error-code mapping, the missing-runtime error, stateful semantics (never
folded, runs every call), XLA refusal, and a SavedModel reloaded in a fresh process.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
import threading
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf

REPO_ROOT = Path(__file__).resolve().parents[1]
OPS_PYTHON = REPO_ROOT / "ops" / "python"


def _load_tf_ipu_ops():
    """Imports tf_ipu_ops: installed if it is, else the in-tree `ops/python` by path."""
    if "tf_ipu_ops" in sys.modules:
        return sys.modules["tf_ipu_ops"]
    if importlib.util.find_spec("tf_ipu_ops") is not None:
        import tf_ipu_ops

        return tf_ipu_ops
    spec = importlib.util.spec_from_file_location(
        "tf_ipu_ops", OPS_PYTHON / "__init__.py", submodule_search_locations=[str(OPS_PYTHON)]
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules["tf_ipu_ops"] = module
    spec.loader.exec_module(module)
    return module


ops = _load_tf_ipu_ops()

Fn = Callable[[list[np.ndarray], list[np.ndarray]], None]


def axpy(inputs: list[np.ndarray], outputs: list[np.ndarray]) -> None:
    """out0 = in0 * 2 + in1."""
    outputs[0][...] = inputs[0] * 2 + inputs[1]


def copy_all(inputs: list[np.ndarray], outputs: list[np.ndarray]) -> None:
    """out_i = in_i."""
    for x, y in zip(inputs, outputs, strict=True):
        y[...] = x


class RecordingHandler:
    """A DeviceHandler that runs `fn` and records what it was given."""

    def __init__(self, fn: Fn = axpy) -> None:
        self.fn = fn
        self.programs: list[tuple[bytes, str]] = []
        self.calls: list[int] = []
        self.seen: list[tuple[list, list]] = []
        self.threads: set[int] = set()
        self._lock = threading.Lock()

    def register_program(self, program: bytes, signature: str) -> int:
        with self._lock:
            self.programs.append((program, signature))
            return 100 + len(self.programs) - 1

    def execute(self, program_id: int, inputs: list[np.ndarray], outputs: list[np.ndarray]):
        with self._lock:
            self.calls.append(program_id)
            self.threads.add(threading.get_ident())
            self.seen.append(
                (
                    [(a.dtype, a.shape, a.flags.writeable) for a in inputs],
                    [(a.dtype, a.shape, a.flags.writeable) for a in outputs],
                )
            )
        self.fn(inputs, outputs)


class RaisingHandler:
    """A DeviceHandler whose execute (or register) raises `exc`."""

    def __init__(self, exc: BaseException, on_register: bool = False) -> None:
        self.exc = exc
        self.on_register = on_register

    def register_program(self, program: bytes, signature: str) -> int:
        if self.on_register:
            raise self.exc
        return 0

    def execute(self, program_id, inputs, outputs) -> None:
        raise self.exc


@pytest.fixture(autouse=True)
def restore_handler_after():
    """Each test installs its own handler; the process's handler (tf_ipu's runtime, when
    other test modules imported it) is put back afterwards."""
    previous = ops.get_device_handler()
    yield
    ops.set_device_handler(previous)


@pytest.fixture
def handler() -> RecordingHandler:
    h = RecordingHandler()
    ops.set_device_handler(h)
    return h


def run_axpy(a, b, program: bytes = b"prog", signature: str = '{"k": 1}') -> tf.Tensor:
    a = tf.convert_to_tensor(a)
    (y,) = ops.ipu_execute([a, b], [a.dtype], [a.shape], program, signature)
    return y


# --- running ----------------------------------------------------------------------------


def test_eager(handler: RecordingHandler) -> None:
    a = tf.reshape(tf.range(6, dtype=tf.float32), [2, 3])
    b = tf.ones([2, 3])
    y = run_axpy(a, b)
    np.testing.assert_allclose(y.numpy(), a.numpy() * 2 + 1)
    assert handler.programs == [(b"prog", '{"k": 1}')]
    assert handler.calls == [100]
    ins, outs = handler.seen[0]
    assert ins == [(np.float32, (2, 3), False)] * 2
    assert outs == [(np.float32, (2, 3), True)]


def test_program_bytes_pass_through_unchanged(handler: RecordingHandler) -> None:
    program = bytes(range(256)) * 3  # NULs and high bytes included.
    signature = '{"name": "stép", "nul": "\\u0000"}'
    run_axpy([1.0], [2.0], program, signature)
    assert handler.programs == [(program, signature)]


def test_tf_function_registers_once_and_runs_every_call(handler: RecordingHandler) -> None:
    @tf.function
    def step(a, b):
        return run_axpy(a, b) + 1.0

    for i in range(3):
        y = step(tf.constant([1.0, 2.0]), tf.constant([float(i), 0.0]))
        np.testing.assert_allclose(y.numpy(), [3.0 + i, 5.0])
    assert len(handler.programs) == 1
    assert handler.calls == [100] * 3


def test_constant_inputs_are_not_folded(handler: RecordingHandler) -> None:
    @tf.function
    def step():
        return run_axpy(tf.constant([1.0]), tf.constant([1.0]))

    for _ in range(4):
        assert step().numpy().tolist() == [3.0]
    assert len(handler.calls) == 4


def test_unused_outputs_still_run(handler: RecordingHandler) -> None:
    @tf.function
    def step(a):
        run_axpy(a, a)  # Output dropped: the op must run anyway (it is stateful).
        return a + 1.0

    step(tf.constant([1.0]))
    step(tf.constant([2.0]))
    assert len(handler.calls) == 2


def test_zero_inputs_and_outputs(handler: RecordingHandler) -> None:
    handler.fn = copy_all
    assert ops.ipu_execute([], [], [], b"", "") == []

    @tf.function
    def step():
        ops.ipu_execute([], [], [], b"p", "{}")
        return tf.constant(0)

    step()
    step()
    assert len(handler.calls) == 3
    assert handler.seen[0] == ([], [])


def test_outputs_without_inputs(handler: RecordingHandler) -> None:
    def fill(inputs, outputs):
        outputs[0][...] = 7
        outputs[1].fill(True)

    handler.fn = fill
    y, z = ops.ipu_execute([], [tf.int32, tf.bool], [[2, 2], [3]], b"", "")
    assert y.numpy().tolist() == [[7, 7], [7, 7]]
    assert z.numpy().tolist() == [True] * 3


def test_scalars(handler: RecordingHandler) -> None:
    y = run_axpy(tf.constant(3.0), tf.constant(0.5))
    assert y.shape == ()
    assert y.numpy() == 6.5
    assert handler.seen[0][0] == [(np.float32, (), False)] * 2
    assert handler.seen[0][1] == [(np.float32, (), True)]


def test_zero_size_tensors(handler: RecordingHandler) -> None:
    handler.fn = lambda inputs, outputs: None
    y, z = ops.ipu_execute(
        [tf.zeros([0, 3]), tf.constant(1.0)], [tf.float32, tf.int64], [[2, 0], [0]], b"", ""
    )
    assert y.shape == (2, 0) and z.shape == (0,)
    assert handler.seen[0][0] == [(np.float32, (0, 3), False), (np.float32, (), False)]
    assert handler.seen[0][1] == [(np.float32, (2, 0), True), (np.int64, (0,), True)]


@pytest.mark.parametrize(
    "dtype",
    [
        tf.float16,
        tf.bfloat16,
        tf.float32,
        tf.float64,
        tf.int8,
        tf.int16,
        tf.int32,
        tf.int64,
        tf.uint8,
        tf.uint16,
        tf.uint32,
        tf.uint64,
        tf.bool,
        tf.complex64,
        tf.complex128,
    ],
    ids=lambda d: d.name,
)
def test_dtypes_round_trip(handler: RecordingHandler, dtype: tf.DType) -> None:
    handler.fn = copy_all
    if dtype == tf.bool:
        x = tf.constant([[True, False, True], [False, False, True]])
    elif dtype.is_complex:
        x = tf.complex(
            tf.ones([2, 3], dtype.real_dtype), tf.fill([2, 3], tf.constant(-2, dtype.real_dtype))
        )
    else:
        x = tf.cast(tf.reshape(tf.range(6), [2, 3]) - (0 if dtype.is_unsigned else 2), dtype)
    big = tf.constant(2**40, tf.int64)
    (y, z) = ops.ipu_execute([x, big], [dtype, tf.int64], [[2, 3], []], b"", "")
    assert y.dtype == dtype
    np.testing.assert_array_equal(y.numpy(), x.numpy())
    assert z.numpy() == 2**40
    assert handler.seen[0][0][0] == (dtype.as_numpy_dtype, (2, 3), False)


def test_inputs_are_zero_copy_and_read_only(handler: RecordingHandler) -> None:
    x = tf.range(4, dtype=tf.float32)
    addresses = []

    def probe(inputs, outputs):
        addresses.append(inputs[0].ctypes.data)
        inputs[0][0] = 42.0  # Must fail: inputs are read-only.

    handler.fn = probe
    with pytest.raises(tf.errors.InternalError, match="ValueError: .*read-only"):
        ops.ipu_execute([x], [], [], b"", "")
    assert addresses == [x._numpy().ctypes.data]  # The TF buffer itself, not a copy.
    assert x.numpy().tolist() == [0.0, 1.0, 2.0, 3.0]


def test_kernel_runs_on_executor_threads(handler: RecordingHandler) -> None:
    """Two independent ops in one graph: both run, whatever threads TF picks."""

    @tf.function
    def step(a):
        return run_axpy(a, a), run_axpy(a + 1.0, a)

    y, z = step(tf.constant([1.0]))
    assert (y.numpy().tolist(), z.numpy().tolist()) == ([3.0], [5.0])
    assert len(handler.calls) == 2 and len(handler.programs) == 2


def test_concurrent_eager_calls_from_threads(handler: RecordingHandler) -> None:
    results: dict[int, list[float]] = {}

    def worker(k: int) -> None:
        results[k] = [float(run_axpy([float(k)], [float(i)])[0]) for i in range(10)]

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == {k: [2.0 * k + i for i in range(10)] for k in range(4)}
    assert len(handler.calls) == 40
    assert len(handler.programs) <= 4  # One kernel instance (cached eagerly) per thread at most.


def test_replacing_the_handler_registers_again(handler: RecordingHandler) -> None:
    @tf.function
    def step(a):
        return run_axpy(a, a)

    step(tf.constant([1.0]))
    other = RecordingHandler()
    ops.set_device_handler(other)
    step(tf.constant([1.0]))
    assert len(handler.programs) == 1 and len(handler.calls) == 1
    assert len(other.programs) == 1 and other.calls == [100]
    assert ops.get_device_handler() is other


# --- errors -----------------------------------------------------------------------------


def test_without_handler_fails_with_import_hint() -> None:
    ops.set_device_handler(None)
    with pytest.raises(tf.errors.FailedPreconditionError, match="`import tf_ipu`"):
        run_axpy([1.0], [1.0])

    @tf.function
    def step(a):
        return run_axpy(a, a)

    with pytest.raises(tf.errors.FailedPreconditionError, match="not loaded in this process"):
        step(tf.constant([1.0]))


@pytest.mark.parametrize(
    ("code", "tf_error"),
    [
        (1, tf.errors.CancelledError),
        (3, tf.errors.InvalidArgumentError),
        (4, tf.errors.DeadlineExceededError),
        (5, tf.errors.NotFoundError),
        (8, tf.errors.ResourceExhaustedError),
        (9, tf.errors.FailedPreconditionError),
        (10, tf.errors.AbortedError),
        (12, tf.errors.UnimplementedError),
        (13, tf.errors.InternalError),
        (14, tf.errors.UnavailableError),
    ],
)
def test_device_call_error_codes(code: int, tf_error: type) -> None:
    ops.set_device_handler(RaisingHandler(ops.DeviceCallError(code, f"tile 17 said no ({code})")))
    with pytest.raises(tf_error, match=rf"tile 17 said no \({code}\)"):
        run_axpy([1.0], [1.0])


@pytest.mark.parametrize(
    ("code", "tf_error"),
    [
        (8, tf.errors.ResourceExhaustedError),
        (10, tf.errors.AbortedError),  # TF's executor would turn these two into INTERNAL
        (14, tf.errors.UnavailableError),  # for an op not marked as communication.
    ],
)
def test_errors_in_a_tf_function_keep_code_and_message(code: int, tf_error: type) -> None:
    ops.set_device_handler(RaisingHandler(ops.DeviceCallError(code, "IPU 0: out of tile memory")))

    @tf.function
    def step(a):
        return run_axpy(a, a) * 2.0

    with pytest.raises(tf_error, match="IPU 0: out of tile memory"):
        step(tf.constant([1.0]))


def test_other_exceptions_are_internal_with_type() -> None:
    ops.set_device_handler(RaisingHandler(KeyError("no such program")))
    with pytest.raises(tf.errors.InternalError, match="KeyError: 'no such program'"):
        run_axpy([1.0], [1.0])


def test_unprintable_exceptions_and_interrupts_still_fail_the_op() -> None:
    class Unprintable(Exception):
        def __str__(self) -> str:
            raise RuntimeError("no")

    ops.set_device_handler(RaisingHandler(Unprintable()))
    with pytest.raises(tf.errors.InternalError, match="Unprintable .*could not be read"):
        run_axpy([1.0], [1.0])
    ops.set_device_handler(RaisingHandler(KeyboardInterrupt()))
    with pytest.raises(tf.errors.CancelledError, match="interrupted"):
        run_axpy([1.0], [1.0])


def test_exceptions_with_grpc_code_attributes() -> None:
    class ServerError(Exception):
        grpc_code = 12

    ops.set_device_handler(RaisingHandler(ServerError("opcode 'sort' is not emulated")))
    with pytest.raises(tf.errors.UnimplementedError, match="opcode 'sort' is not emulated"):
        run_axpy([1.0], [1.0])


def test_grpc_rpc_errors_keep_their_status() -> None:
    grpc = pytest.importorskip("grpc")

    class FakeRpcError(grpc.RpcError):
        def code(self):
            return grpc.StatusCode.UNAVAILABLE

        def details(self):
            return "device server at localhost:1 is not answering"

    ops.set_device_handler(RaisingHandler(FakeRpcError()))
    with pytest.raises(tf.errors.UnavailableError, match="localhost:1 is not answering"):
        run_axpy([1.0], [1.0])


def test_long_error_messages_are_truncated_not_overflowed() -> None:
    ops.set_device_handler(RaisingHandler(ops.DeviceCallError(3, "é" * 10_000)))
    with pytest.raises(tf.errors.InvalidArgumentError) as info:
        run_axpy([1.0], [1.0])
    assert 1000 < len(info.value.message) < 4200


def test_registration_errors_map_codes_and_are_retried() -> None:
    h = RaisingHandler(ops.DeviceCallError(14, "server down"), on_register=True)
    ops.set_device_handler(h)

    @tf.function
    def step(a):
        return run_axpy(a, a)

    with pytest.raises(tf.errors.UnavailableError, match="could not register.*server down"):
        step(tf.constant([1.0]))
    h.on_register = False
    ops.set_device_handler(h)  # Same handler again.
    h.exc = ops.DeviceCallError(5, "ran")
    with pytest.raises(tf.errors.NotFoundError, match="ran"):
        step(tf.constant([1.0]))


def test_bad_program_ids_are_internal_errors() -> None:
    class BadIds(RecordingHandler):
        def register_program(self, program, signature):
            return -3

    ops.set_device_handler(BadIds())
    with pytest.raises(tf.errors.InternalError, match="program id >= 0. Received: -3"):
        run_axpy([1.0], [1.0])


def test_kernel_refuses_strings_resources_and_partial_shapes(handler: RecordingHandler) -> None:
    raw = ops.op_module.ipu_execute
    with pytest.raises(tf.errors.InvalidArgumentError, match="input 0 of dtype string"):
        raw(inputs=[tf.constant(["a"])], Tout=[], output_shapes=[], program=b"", signature="")
    with pytest.raises(tf.errors.InvalidArgumentError, match="output 0 of dtype string"):
        raw(inputs=[], Tout=[tf.string], output_shapes=[[]], program=b"", signature="")
    v = tf.Variable(1.0)
    with pytest.raises(tf.errors.InvalidArgumentError, match="dtype resource"):
        raw(inputs=[v.handle], Tout=[], output_shapes=[], program=b"", signature="")
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"fully defined.*\[\?,2\]"):
        raw(inputs=[], Tout=[tf.float32], output_shapes=[[None, 2]], program=b"", signature="")
    with pytest.raises(tf.errors.InvalidArgumentError, match="one output shape per output"):
        raw(inputs=[], Tout=[tf.float32], output_shapes=[], program=b"", signature="")
    assert handler.calls == []


def test_wrapper_validates_at_the_door() -> None:
    with pytest.raises(ValueError, match="one output shape per output dtype"):
        ops.ipu_execute([], [tf.float32], [], b"", "")
    with pytest.raises(ValueError, match=r"fully defined. Received: output_shapes\[0\]"):
        ops.ipu_execute([], [tf.float32], [[None]], b"", "")
    with pytest.raises(ValueError, match="cannot send dtype string"):
        ops.ipu_execute([tf.constant("x")], [], [], b"", "")
    with pytest.raises(ValueError, match="cannot return dtype string"):
        ops.ipu_execute([], [tf.string], [[]], b"", "")
    with pytest.raises(TypeError, match="program must be bytes"):
        ops.ipu_execute([], [], [], "text", "")
    with pytest.raises(TypeError, match="register_program"):
        ops.set_device_handler(object())
    with pytest.raises(ValueError, match="1..16"):
        ops.DeviceCallError(0, "ok is not an error")


def test_shape_inference_from_output_shapes() -> None:
    @tf.function
    def step(a):
        y, z = ops.ipu_execute([a], [tf.float32, tf.int32], [[4, 5], []], b"", "")
        assert y.shape == (4, 5) and z.shape == ()
        return y

    step.get_concrete_function(tf.TensorSpec([None], tf.float32))


def test_xla_jit_compile_is_refused(handler: RecordingHandler) -> None:
    @tf.function(jit_compile=True)
    def step(a):
        return run_axpy(a, a) + 1.0

    with pytest.raises(
        tf.errors.InvalidArgumentError, match="No registered 'IpuExecute' OpKernel for XLA"
    ):
        step(tf.constant([1.0]))
    assert handler.calls == []


def test_no_gradient_is_registered(handler: RecordingHandler) -> None:
    x = tf.Variable([1.0])
    with tf.GradientTape() as tape:
        y = run_axpy(x, x)
    with pytest.raises(LookupError, match="IpuExecute"):
        tape.gradient(y, x)


# --- SavedModel in a fresh process ------------------------------------------------------

_FRESH_PROCESS = textwrap.dedent(
    """
    import importlib.util, json, sys
    import numpy as np
    import tensorflow as tf

    ops_python, saved = sys.argv[1], sys.argv[2]
    if importlib.util.find_spec("tf_ipu_ops") is None:
        spec = importlib.util.spec_from_file_location(
            "tf_ipu_ops", ops_python + "/__init__.py", submodule_search_locations=[ops_python])
        module = importlib.util.module_from_spec(spec)
        sys.modules["tf_ipu_ops"] = module
        spec.loader.exec_module(module)
    import tf_ipu_ops

    report = {}
    loaded = tf.saved_model.load(saved)
    try:
        loaded.step(tf.constant([1.0, 2.0, 3.0]))
    except tf.errors.FailedPreconditionError as e:
        report["before"] = e.message

    class Handler:
        def register_program(self, program, signature):
            report["registered"] = [program.hex(), signature]
            return 5

        def execute(self, program_id, inputs, outputs):
            outputs[0][...] = inputs[0] * 2 + inputs[1]

    tf_ipu_ops.set_device_handler(Handler())
    report["after"] = loaded.step(tf.constant([1.0, 2.0, 3.0])).numpy().tolist()
    print("REPORT " + json.dumps(report))
    """
)


def test_saved_model_runs_in_a_fresh_process(tmp_path: Path, handler: RecordingHandler) -> None:
    class Module(tf.Module):
        @tf.function(input_signature=[tf.TensorSpec([3], tf.float32)])
        def step(self, x):
            return run_axpy(x, tf.ones([3]), program=b"\x00ir", signature='{"v": 2}') + 0.5

    saved = tmp_path / "saved"
    tf.saved_model.save(Module(), str(saved))
    result = subprocess.run(
        [sys.executable, "-c", _FRESH_PROCESS, str(OPS_PYTHON), str(saved)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"},
    )
    lines = [line for line in result.stdout.splitlines() if line.startswith("REPORT ")]
    assert result.returncode == 0 and lines, result.stderr[-3000:]
    report = json.loads(lines[0][len("REPORT ") :])
    assert "import tf_ipu" in report["before"]
    assert report["registered"] == [b"\x00ir".hex(), '{"v": 2}']
    assert report["after"] == [3.5, 5.5, 7.5]
