"""Writes the seed corpora of the fuzz targets (``tests/fuzz/corpus/<target>/``).

    .venv/bin/python tests/fuzz/make_corpus.py            # all targets
    .venv/bin/python tests/fuzz/make_corpus.py onnx hlo   # some

Each seed is a small valid input (plus a few interesting ones: edge sizes, options, empty
tensors), named after what it holds. The compile and hlo seeds are lowered from small TF
functions (TensorFlow is imported; XLA gives the HLO), the onnx seeds built with
``onnx.helper``, the disk_cache seeds from ``cache_record`` of the modules the harness
knows, the framing seeds from the protocol's own encoders. Files already there are
replaced; others (e.g. ones a fuzzing run found worth keeping) are left alone.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402

CORPUS = _common.FUZZ_DIR / "corpus"
MAX_SEED_BYTES = 20 << 10


def _write(target: str, name: str, data: bytes) -> None:
    if len(data) > MAX_SEED_BYTES:
        raise ValueError(f"seed {target}/{name} is {len(data)} bytes, over {MAX_SEED_BYTES}")
    folder = CORPUS / target
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_bytes(data)


def _tf_functions() -> dict[str, tuple[Callable[..., object], tuple[object, ...]]]:
    import numpy as np
    import tensorflow as tf

    f32 = np.float32
    x4 = np.arange(4, dtype=f32)
    x23 = np.arange(6, dtype=f32).reshape(2, 3)

    def while_sum(x: tf.Tensor) -> tf.Tensor:
        return tf.while_loop(lambda i, s: i < 3, lambda i, s: (i + 1, s + x),
                             (tf.constant(0), tf.zeros_like(x)))[1]

    return {
        "relu": (lambda x: tf.nn.relu(x), (x4,)),
        "dense": (lambda x, w, b: tf.matmul(x, w) + b,
                  (x23, np.ones((3, 4), f32), np.ones(4, f32))),
        "conv2d": (lambda x, k: tf.nn.conv2d(x, k, 1, "SAME"),
                   (np.ones((1, 4, 4, 2), f32), np.ones((3, 3, 2, 2), f32))),
        "softmax_sum": (lambda x: tf.reduce_sum(tf.nn.softmax(x), axis=0), (x23,)),
        "while": (while_sum, (x4,)),
        "gather": (lambda x, i: tf.gather(x, i), (x4, np.array([3, 0, 1], np.int32))),
        "sort": (lambda x: tf.sort(x, direction="DESCENDING"), (x4[::-1].copy(),)),
        "cond": (lambda p, x: tf.cond(p, lambda: x * 2.0, lambda: x - 1.0), (np.array(True), x4)),
        "cast_concat_pad": (lambda x: tf.pad(tf.concat([tf.cast(x, tf.int32), tf.range(2)], 0),
                                             [[1, 2]]), (x4,)),
        "transpose_reverse": (lambda x: tf.reverse(tf.transpose(x), [0]), (x23,)),
        "slice_update": (lambda x: tf.tensor_scatter_nd_update(x, [[1]], [5.0])[1:3], (x4,)),
        "half_math": (lambda x: tf.exp(tf.cast(x, tf.float16)) / 3, (x4,)),
        "argmax_onehot": (lambda x: tf.one_hot(tf.argmax(x, axis=1), 3), (x23,)),
        "batch_norm": (lambda x: tf.nn.batch_normalization(x, 0.5, 2.0, 0.1, 1.1, 1e-3), (x23,)),
    }


def hlo_and_compile() -> None:
    """The hlo seeds (serialized HloModuleProtos) and the compile seeds (CompileRequests of
    their IR, some with options)."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import emulator_util as eu
    from fuzz_disk_cache import modules

    from device_server.protocol import device_pb2

    requests: dict[str, device_pb2.CompileRequest] = {}
    for name, (fn, args) in _tf_functions().items():
        hlo = eu.hlo_of(fn, *args)
        _write("hlo", name + ".pb", hlo)
        requests[name] = device_pb2.CompileRequest(module=eu.hlo_module_to_ir(hlo))
    for module in modules():
        requests["hand_" + module.name] = device_pb2.CompileRequest(module=module)
    options = {
        "fp_checks": device_pb2.CompileOptions(
            floating_point_behaviour=device_pb2.FloatingPointBehaviour(
                inv=True, div0=True, oflo=True, esr=True, nanoo=True),
            matmul_partials_type="half", convolution_partials_type="half",
            stochastic_rounding_seed=7),
        "memory_proportion": device_pb2.CompileOptions(
            matmul_available_memory_proportion=0.1, convolution_available_memory_proportion=1.0),
        "replicas": device_pb2.CompileOptions(replicas=2),
        "pipeline": device_pb2.CompileOptions(
            pipeline_stages=2, stage_ipus=[0, 1], ipus_per_replica=2, micro_batches=4,
            pipeline_schedule="interleaved", recomputation=True, optimizer_state_offload="on",
            optimizer_state_sharding=True),
        "oom_allowed": device_pb2.CompileOptions(allow_out_of_memory=True),
    }
    for (opt_name, opts), base in zip(options.items(), ["dense", "conv2d", "dense", "dense",
                                                        "while"], strict=True):
        requests[f"{base}+{opt_name}"] = device_pb2.CompileRequest(
            module=requests[base].module, options=opts)
    for name, request in requests.items():
        request.session_id = "0123456789abcdef"
        _write("compile", name + ".pb", request.SerializeToString(deterministic=True))


def onnx_models() -> None:
    """Small ONNX models: one per family of operators, a symbolic batch, an old opset."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    def model(name: str, nodes: list, inputs: list, outputs: list, inits: tuple = (),
              opset: int = 17) -> bytes:
        graph = helper.make_graph(nodes, name, inputs, outputs, initializer=list(inits))
        m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)],
                              producer_name="tf_ipu fuzz seeds")
        m.ir_version = 8
        onnx.checker.check_model(m)
        return m.SerializeToString()

    def vi(name: str, shape: list, elem: int = TensorProto.FLOAT) -> onnx.ValueInfoProto:
        return helper.make_tensor_value_info(name, elem, shape)

    f32 = np.float32
    seeds = {
        "add": model("add", [helper.make_node("Add", ["x", "y"], ["z"])],
                     [vi("x", ["N", 4]), vi("y", ["N", 4])], [vi("z", ["N", 4])]),
        "gemm_relu": model(
            "gemm_relu",
            [helper.make_node("Gemm", ["x", "w", "b"], ["h"], transB=1),
             helper.make_node("Relu", ["h"], ["y"])],
            [vi("x", ["N", 3])], [vi("y", ["N", 2])],
            [numpy_helper.from_array(np.ones((2, 3), f32), "w"),
             numpy_helper.from_array(np.zeros(2, f32), "b")]),
        "conv_pool": model(
            "conv_pool",
            [helper.make_node("Conv", ["x", "k"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("MaxPool", ["c"], ["p"], kernel_shape=[2, 2], strides=[2, 2]),
             helper.make_node("GlobalAveragePool", ["p"], ["y"])],
            [vi("x", ["N", 1, 4, 4])], [vi("y", ["N", 2, 1, 1])],
            [numpy_helper.from_array(np.ones((2, 1, 3, 3), f32), "k")]),
        "reshape_shape": model(
            "reshape_shape",
            [helper.make_node("Shape", ["x"], ["s"]),
             helper.make_node("Reshape", ["x", "t"], ["r"]),
             helper.make_node("Transpose", ["r"], ["y"], perm=[1, 0])],
            [vi("x", ["N", 2, 3])], [vi("y", [6, "N"]), ],
            [numpy_helper.from_array(np.array([-1, 6], np.int64), "t")]),
        "softmax_matmul": model(
            "softmax_matmul",
            [helper.make_node("MatMul", ["x", "w"], ["m"]),
             helper.make_node("Softmax", ["m"], ["y"], axis=-1)],
            [vi("x", ["N", 3])], [vi("y", ["N", 3])],
            [numpy_helper.from_array(np.eye(3, dtype=f32), "w")]),
        "concat_slice_cast": model(
            "concat_slice_cast",
            [helper.make_node("Concat", ["x", "x"], ["c"], axis=1),
             helper.make_node("Slice", ["c", "st", "en"], ["s"]),
             helper.make_node("Cast", ["s"], ["y"], to=TensorProto.INT32)],
            [vi("x", ["N", 2])], [vi("y", ["N", 3], TensorProto.INT32)],
            [numpy_helper.from_array(np.array([1], np.int64), "st"),
             numpy_helper.from_array(np.array([4], np.int64), "en")]),
        "reduce_gather": model(
            "reduce_gather",
            [helper.make_node("ReduceSum", ["x", "ax"], ["r"], keepdims=0),
             helper.make_node("Gather", ["r", "i"], ["y"])],
            [vi("x", ["N", 4])], [vi("y", [2])],
            [numpy_helper.from_array(np.array([1], np.int64), "ax"),
             numpy_helper.from_array(np.array([0, 1], np.int64), "i")]),
        "if": model(
            "if",
            [helper.make_node("ReduceSum", ["x"], ["s"], keepdims=0),
             helper.make_node("Greater", ["s", "zero"], ["c"]),
             helper.make_node(
                 "If", ["c"], ["y"],
                 then_branch=helper.make_graph([helper.make_node("Neg", ["x"], ["a"])], "then", [],
                                               [vi("a", ["N", 2])]),
                 else_branch=helper.make_graph([helper.make_node("Abs", ["x"], ["b"])], "else", [],
                                               [vi("b", ["N", 2])]))],
            [vi("x", ["N", 2])], [vi("y", ["N", 2])],
            [numpy_helper.from_array(np.array(0, f32), "zero")]),
        "loop": model(
            "loop",
            [helper.make_node(
                "Loop", ["n", "cond0", "x"], ["y"],
                body=helper.make_graph(
                    [helper.make_node("Identity", ["cond_in"], ["cond_out"]),
                     helper.make_node("Add", ["v", "v"], ["v2"])], "body",
                    [vi("i", [], TensorProto.INT64), vi("cond_in", [], TensorProto.BOOL),
                     vi("v", ["N", 2])],
                    [vi("cond_out", [], TensorProto.BOOL), vi("v2", ["N", 2])]))],
            [vi("x", ["N", 2])], [vi("y", ["N", 2])],
            [numpy_helper.from_array(np.array(3, np.int64), "n"),
             numpy_helper.from_array(np.array(True), "cond0")]),
        "opset6_sum": model("opset6_sum", [helper.make_node("Sum", ["x", "y"], ["z"])],
                            [vi("x", [2, 4]), vi("y", [2, 4])], [vi("z", [2, 4])], opset=6),
        "norm_act": model(
            "norm_act",
            [helper.make_node("BatchNormalization", ["x", "g", "b", "m", "v"], ["n"]),
             helper.make_node("Sigmoid", ["n"], ["s"]),
             helper.make_node("Mul", ["n", "s"], ["y"])],
            [vi("x", ["N", 2, 3])], [vi("y", ["N", 2, 3])],
            [numpy_helper.from_array(np.ones(2, f32), k) for k in ("g", "v")]
            + [numpy_helper.from_array(np.zeros(2, f32), k) for k in ("b", "m")]),
    }
    for name, data in seeds.items():
        _write("onnx", name + ".onnx", data)


def disk_cache() -> None:
    """Entries (mode 0) and records (mode 1) of the harness's modules, and a few damaged."""
    import fuzz_disk_cache as h

    h.load()
    m = h._mods
    from device_server.emulator import compile_module

    for index, module in enumerate(m["modules"]):
        exe = compile_module(module, m["target"], m["options"])
        record = exe.cache_record()
        record_json = json.dumps(record, separators=(",", ":"), allow_nan=True).encode()
        entry = m["disk_cache"].encode_entry(h.KEY, record, created=0.0)
        _write("disk_cache", f"entry_{module.name}", bytes([index, 0]) + entry)
        _write("disk_cache", f"record_{module.name}", bytes([index, 1]) + record_json)
        if index == 0:
            _write("disk_cache", "entry_truncated", bytes([index, 0]) + entry[:-7])
            other = dict(record, instruction_count=-1)
            _write("disk_cache", "record_bad_count",
                   bytes([index, 1]) + json.dumps(other, separators=(",", ":")).encode())
            keys = sorted(record) + sorted(record["estimate"])
            for field, value in (("cycles", 15), ("clock_hz", 0), ("tiles_per_ipu", 0),
                                 ("peak_tile_bytes", 17), ("parameters", 26)):
                _write("disk_cache", f"fields_{field}", bytes([index, 2, keys.index(field), value]))
            est = dict(record["estimate"], cycles=1e300, clock_hz=0.0)
            _write("disk_cache", "record_extreme_estimate", bytes([index, 1]) + json.dumps(
                dict(record, estimate=est), separators=(",", ":")).encode())


def framing() -> None:
    """Mode 0: PutBlob streams and request tensors; mode 1: reply tensors and GetBlob
    streams; mode 2: AttachSharedMemory requests."""
    import numpy as np

    from device_server.protocol import device_pb2, dtypes, shm
    from device_server.protocol.chunks import serialize_chunk

    join = _common.join_frames
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    raw = a.reshape(-1).view(np.uint8)
    head = device_pb2.BlobChunk(session_id="s", total_bytes=raw.nbytes, dtype=dtypes.from_numpy(a.dtype),
                                dims=a.shape, replaces_variable="w")
    chunks = [serialize_chunk(head, raw[:20]), serialize_chunk(None, raw[20:])]
    blob_tensor = device_pb2.Tensor(dtype=dtypes.from_numpy(a.dtype), dims=a.shape, blob_id="b0")
    off = shm.HEADER_BYTES
    shm_tensor = device_pb2.Tensor(dtype=dtypes.from_numpy(a.dtype), dims=a.shape,
                                   shm=device_pb2.ShmRegion(segment=1, offset=off, nbytes=a.nbytes))
    seeds = {
        "server_inline": bytes([0]) + join([dtypes.to_tensor(a).SerializeToString()]),
        "server_inline_empty": bytes([0]) + join([dtypes.to_tensor(
            np.zeros((0, 3), np.int8)).SerializeToString()]),
        "server_inline_bf16_scalar": bytes([0]) + join([dtypes.to_tensor(
            np.array(1.5, dtype=dtypes.to_numpy(11))).SerializeToString()]),
        "server_blob": bytes([0]) + join([blob_tensor.SerializeToString(), *chunks]),
        "server_blob_untyped": bytes([0]) + join([
            device_pb2.Tensor(dtype=6, dims=[48], blob_id="b0").SerializeToString(),
            serialize_chunk(device_pb2.BlobChunk(total_bytes=48), raw)]),
        "server_shm": bytes([0]) + join([shm_tensor.SerializeToString()]),
        "server_blob_empty": bytes([0]) + join([
            device_pb2.Tensor(dtype=12, dims=[0], blob_id="b0").SerializeToString(),
            device_pb2.BlobChunk(total_bytes=0, dtype=12, dims=[0]).SerializeToString()]),
        "client_inline": bytes([1]) + join([dtypes.to_tensor(a).SerializeToString()]),
        "client_shm": bytes([1]) + join([shm_tensor.SerializeToString()]),
        "client_blob": bytes([1]) + join([blob_tensor.SerializeToString(),
                                          serialize_chunk(device_pb2.BlobChunk(total_bytes=48),
                                                          raw[:16]),
                                          serialize_chunk(None, raw[16:])]),
        "attach": bytes([2]) + join([device_pb2.AttachSharedMemoryRequest(
            session_id="s", name="tf_ipu-1-" + "0" * 32, nbytes=1 << 16,
            nonce=bytes(16)).SerializeToString()]),
    }
    for name, data in seeds.items():
        _write("framing", name, data)


TARGETS = {"compile": hlo_and_compile, "hlo": hlo_and_compile, "onnx": onnx_models,
           "disk_cache": disk_cache, "framing": framing}


if __name__ == "__main__":
    sys.path.insert(1, str(_common.ROOT / "tests"))
    wanted = sys.argv[1:] or list(TARGETS)
    done: set[Callable[[], None]] = set()
    for target in wanted:
        make = TARGETS[target]
        if make not in done:
            make()
            done.add(make)
    for folder in sorted(CORPUS.iterdir()):
        files = list(folder.iterdir())
        print(f"{folder.name}: {len(files)} files, {sum(f.stat().st_size for f in files)} bytes")
