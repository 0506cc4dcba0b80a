"""The emulator's convolution kernel and lowered conv/pool gradients against TensorFlow on CPU.

1. ``convolution`` kernel alone (kernels/conv.py, called directly with an NHWC/HWIO
   instruction context) vs ``tf.nn.conv2d`` (eager, oneDNN), float32, "SAME" padding, over
   the shapes of common CNN layers (plain, strided, the 7x7 stem, grouped and depthwise).
2. Lowered gradients of conv2d and max_pool2d run as whole emulator programs (the spatial
   kernels plus the glue around them) vs the same functions run by TF on CPU without XLA.

Each line: best of 5 warm calls per side, ratio emulator/TF (lower is better). The results
are checked against TF before timing.

    .venv/bin/python bench/run.py --only conv [--quick]
    .venv/bin/python bench/bench_conv.py [--quick]

``--quick`` runs a few shapes with 3 repetitions.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

# (batch, image, in channels, kernel, out channels, stride, groups)
SHAPES = [
    (32, 56, 64, 3, 64, 1, 1), (32, 28, 128, 3, 128, 1, 1), (32, 14, 256, 3, 256, 1, 1),
    (32, 7, 256, 3, 256, 1, 1), (32, 28, 128, 1, 256, 1, 1), (8, 56, 64, 3, 128, 2, 1),
    (1, 224, 32, 3, 32, 1, 1), (4, 112, 64, 3, 64, 1, 1), (8, 224, 3, 7, 64, 2, 1),
    (16, 28, 128, 3, 128, 1, 128), (16, 28, 128, 3, 128, 1, 4),
]
QUICK_SHAPES = [SHAPES[1], SHAPES[5], SHAPES[8], SHAPES[9]]


def _best(fn: Callable[[], Any], reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def _rand(rng: np.random.Generator, shape: Sequence[int]) -> np.ndarray:
    return rng.standard_normal(shape).astype(np.float32)


class _ConvCtx:
    """The KernelContext of one NHWC/HWIO ``convolution`` with TF's "SAME" padding."""

    def __init__(self, x_shape: tuple[int, ...], w_shape: tuple[int, ...], stride: int, groups: int) -> None:
        from device_server.protocol import ir_pb2

        n, h, _, _ = x_shape
        k = w_shape[0]
        oh = -(-h // stride)
        total = max((oh - 1) * stride + k - h, 0)
        pad = (total // 2, total - total // 2)
        self.instr = ir_pb2.Instruction(name="convolution.1", opcode="convolution")
        self.operand_shapes = [tuple(x_shape), tuple(w_shape)]
        self.operand_dtypes = [np.dtype(np.float32)] * 2
        self.out_shape = (n, oh, oh, w_shape[3])
        self.out_dtype = np.dtype(np.float32)
        self.attrs = dict(
            input_batch_dimension=0, input_feature_dimension=3, input_spatial_dimensions=(1, 2),
            kernel_input_feature_dimension=2, kernel_output_feature_dimension=3,
            kernel_spatial_dimensions=(0, 1), output_batch_dimension=0, output_feature_dimension=3,
            output_spatial_dimensions=(1, 2), window_size=(k, k), window_strides=(stride, stride),
            padding_low=(pad[0],) * 2, padding_high=(pad[1],) * 2, feature_group_count=groups,
            batch_group_count=1,
        )

    def attr(self, name: str, default: Any = ...) -> Any:
        if name in self.attrs:
            return self.attrs[name]
        if default is ...:
            raise KeyError(name)
        return default

    def computation(self, index: int) -> Any:
        raise NotImplementedError

    def reducer_ufunc(self, index: int) -> None:
        return None


def bench_kernel(quick: bool) -> None:
    from device_server.emulator.kernels import REGISTRY

    reps = 3 if quick else 5
    rng = np.random.default_rng(0)
    ratios = []
    print("convolution kernel vs tf.nn.conv2d (float32, SAME)")
    print(f"  {'shape (N,H,C,K,O,stride,groups)':36} {'kernel ms':>9}   {'tf.nn.conv2d ms':>15}   ratio")
    for n, h, c, k, o, s, g in QUICK_SHAPES if quick else SHAPES:
        x, w = _rand(rng, (n, h, h, c)), _rand(rng, (k, k, c // g, o))
        kern = REGISTRY["convolution"](_ConvCtx(x.shape, w.shape, s, g))
        xt, wt = tf.constant(x), tf.constant(w)
        ref = tf.nn.conv2d(xt, wt, s, "SAME").numpy()
        np.testing.assert_allclose(kern([x, w]), ref, rtol=2e-3, atol=2e-3 * float(np.abs(ref).max()))
        ours = _best(lambda x=x, w=w, kern=kern: kern([x, w]), reps)
        theirs = _best(lambda xt=xt, wt=wt, s=s: tf.nn.conv2d(xt, wt, s, "SAME").numpy(), reps)
        ratios.append(ours / theirs)
        print(f"  {(n, h, c, k, o, s, g)!s:36} {ours * 1e3:9.1f}   {theirs * 1e3:15.1f}   {ours / theirs:5.2f}x")
    print(f"  geometric mean ratio: {float(np.exp(np.mean(np.log(ratios)))):.2f}x")


def _conv_grads(x: tf.Tensor, w: tf.Tensor, dy: tf.Tensor) -> Any:
    with tf.GradientTape() as tape:
        tape.watch([x, w])
        y = tf.nn.conv2d(x, w, 1, "SAME")
    return tape.gradient(y, [x, w], output_gradients=dy)


def _pool_grads(x: tf.Tensor, dy: tf.Tensor) -> Any:
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = tf.nn.max_pool2d(x, 3, 2, "SAME")
    return y, tape.gradient(y, x, output_gradients=dy)


def bench_training_ops(quick: bool) -> None:
    from device_server.emulator import CompileOptions, compile_module, get_target
    from tf_ipu.lowering.hlo_to_ir import hlo_module_to_ir

    reps = 3 if quick else 5
    rng = np.random.default_rng(0)
    cases = [
        ("conv2d 3x3 fwd+grads (32,28,28,128)->128", _conv_grads,
         [_rand(rng, (32, 28, 28, 128)), _rand(rng, (3, 3, 128, 128)), _rand(rng, (32, 28, 28, 128))]),
        ("conv2d 3x3 fwd+grads (8,56,56,64)->64", _conv_grads,
         [_rand(rng, (8, 56, 56, 64)), _rand(rng, (3, 3, 64, 64)), _rand(rng, (8, 56, 56, 64))]),
        ("max_pool 3x3/2 SAME fwd+grad (32,112,112,64)", _pool_grads,
         [_rand(rng, (32, 112, 112, 64)), _rand(rng, (32, 56, 56, 64))]),
    ]
    if quick:
        cases = cases[1:]
    print("lowered gradients on the emulator vs TF on CPU (no XLA)")
    print(f"  {'case':48} {'emulator ms':>11}   {'TF (no XLA) ms':>14}   ratio")
    for name, fn, args in cases:
        targs = [tf.constant(a) for a in args]
        xla_fn = tf.function(fn, jit_compile=True, autograph=False)
        module = hlo_module_to_ir(xla_fn.experimental_get_compiler_ir(*targs)(stage="hlo_serialized"))
        expected = [t.numpy() for t in tf.nest.flatten(xla_fn(*targs))]
        exe = compile_module(module, get_target("ipu2"), CompileOptions(allow_out_of_memory=True))
        for g, e in zip(exe.run(args), expected, strict=True):
            np.testing.assert_allclose(g, e, rtol=1e-3, atol=1e-3 * float(np.abs(e).max()))
        plain = tf.function(fn, autograph=False)
        ours = _best(lambda exe=exe, args=args: exe.run(args), reps)
        theirs = _best(lambda plain=plain, targs=targs: [t.numpy() for t in tf.nest.flatten(plain(*targs))], reps)
        print(f"  {name:48} {ours * 1e3:11.1f}   {theirs * 1e3:14.1f}   {ours / theirs:5.2f}x")


def main(quick: bool = False) -> None:
    bench_kernel(quick)
    bench_training_ops(quick)


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    main(parser.parse_args().quick)
