"""Random number kernels: ``rng-bit-generator`` (stateless, explicit state) and ``rng``.

``rng-bit-generator(state)`` returns ``(new_state, bits)``. The bits come from numpy's
Philox-4x64 keyed by ``state[0]`` (and ``state[2]`` when present) starting at counter
``state[1]``; ``new_state`` advances ``state[1]`` past every block used. The same state
always gives the same bits and successive states give independent streams, which is what
programs rely on; the bits do not match XLA's ThreeFry/Philox implementations bit for bit
(no program may depend on that).

``rng`` (distribution ``uniform`` in ``[a, b)`` or ``normal(mu, sigma)``) has no state operand:
each call of a compiled executable draws from a stream seeded by the instruction and a call
counter, so results are repeatable for a fresh executable and differ from call to call.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import numpy as np

from device_server.emulator.kernels import KernelContext, KernelFn, register
from device_server.protocol import dtypes

_MASK64 = (1 << 64) - 1


@register("rng-bit-generator")
def _rng_bit_generator(ctx: KernelContext) -> KernelFn:
    shape = ctx.instr.shape
    if not shape.is_tuple or len(shape.tuple_shapes) != 2:
        raise ValueError("rng-bit-generator must return (state, bits)")
    state_dt = dtypes.to_numpy(shape.tuple_shapes[0].dtype)
    out_dt = dtypes.to_numpy(shape.tuple_shapes[1].dtype)
    out_shape = tuple(int(d) for d in shape.tuple_shapes[1].dims)
    nbytes = int(np.prod(out_shape, dtype=np.int64)) * out_dt.itemsize
    nwords = -(-nbytes // 8)
    algorithm = ctx.attr("algorithm", "default")
    salt = {"default": 0, "three_fry": 1, "philox": 2}.get(algorithm, 3)

    def run(ops: Sequence[Any]) -> tuple[np.ndarray, np.ndarray]:
        state = np.asarray(ops[0])
        words = np.frombuffer(np.ascontiguousarray(state.reshape(-1)).tobytes() + bytes(24), np.uint64)
        key = [int(words[0]), int(words[2]) if state.nbytes > 16 else salt]
        counter = int(words[1])
        gen = np.random.Philox(key=np.array(key, np.uint64), counter=np.array([counter, 0, 0, 0], np.uint64))
        raw = gen.random_raw(nwords) if nwords else np.zeros(0, np.uint64)
        bits = np.frombuffer(raw.tobytes()[:nbytes], out_dt).reshape(out_shape)
        new_words = np.array(words[: max(1, -(-state.nbytes // 8))], np.uint64)
        if new_words.size > 1:
            new_words[1] = np.uint64((counter + nwords // 4 + 1) & _MASK64)
        else:
            new_words[0] = np.uint64((int(words[0]) + nwords // 4 + 1) & _MASK64)
        new_state = np.frombuffer(new_words.tobytes()[: state.nbytes], state_dt).reshape(state.shape)
        return new_state, bits

    return run


@register("rng")
def _rng(ctx: KernelContext) -> KernelFn:
    distribution = ctx.attr("distribution")
    dt = ctx.out_dtype
    shape = ctx.out_shape
    calls = itertools.count()  # next() is atomic under the GIL: safe from several threads
    seed = int(ctx.instr.id) & _MASK64

    def generator() -> np.random.Generator:
        return np.random.Generator(np.random.Philox(key=np.array([seed, next(calls)], np.uint64)))

    if distribution == "uniform":
        if dt.kind in "iu":
            def uniform_int(ops: Sequence[Any]) -> np.ndarray:
                lo, hi = int(np.asarray(ops[0])), int(np.asarray(ops[1]))
                if hi <= lo:
                    return np.full(shape, lo, dt)
                return generator().integers(lo, hi, size=shape).astype(dt)
            return uniform_int

        def uniform(ops: Sequence[Any]) -> np.ndarray:
            lo = float(np.asarray(ops[0], np.float64))
            hi = float(np.asarray(ops[1], np.float64))
            u = lo + (hi - lo) * generator().random(size=shape)
            out = u.astype(dt)
            return np.where(out >= np.asarray(hi).astype(dt), np.asarray(lo).astype(dt), out) if hi > lo else out
        return uniform
    if distribution == "normal":
        def normal(ops: Sequence[Any]) -> np.ndarray:
            mu = np.asarray(ops[0], np.float64)
            sigma = np.asarray(ops[1], np.float64)
            return (mu + sigma * generator().standard_normal(size=shape)).astype(dt)
        return normal
    raise ValueError(f"unknown rng distribution {distribution!r}")
