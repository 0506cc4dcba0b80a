"""Random number kernels: ``rng-bit-generator`` (stateless, explicit state) and ``rng``.

``rng-bit-generator(state)`` returns ``(new_state, bits)``. For a ``u64`` state (what
TensorFlow's stateless random ops and Keras' seeded layers such as Dropout emit) the bits are
XLA's, bit for bit: XLA's CPU and GPU backends expand the instruction into its Philox-4x32-10
or ThreeFry-2x32-20 generator (``xla/hlo/builder/lib/prng.cc``, via
``RngBitGeneratorExpander``; ``default`` is Philox there), and so does this kernel, in numpy:

- ``philox``: key ``state[0]``; a 128-bit counter ``(state[1], state[2])`` (low word
  first; a 2-word state uses ``(state[1], state[0])``). Block ``i`` encrypts counter ``+ i``;
  32-bit outputs take the four words of each block in turn, 64-bit outputs two words each
  (``w0 | w1 << 32``), narrower ones the low bits of a 32-bit output. The new state is the
  counter advanced by the blocks used.
- ``three_fry``: key ``state[0]``, counter ``state[1]``. 32-bit outputs: the shape is split in
  halves along its first even dimension (else its largest); element ``j`` of the half encrypts
  ``counter + j`` and gives its two words to the even and odd positions ``2j``, ``2j + 1`` of
  that dimension. 64-bit outputs encrypt ``counter + j`` for element ``j`` (``w0 | w1 << 32``).

Other states (another dtype, a Philox state of one word) fall back to numpy's Philox-4x64
keyed by the state: repeatable for a state, successive states independent, not XLA's bits.

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


_U32 = np.uint32
_LOW32 = np.uint64(0xFFFFFFFF)
_PHILOX_M = (np.uint64(0xD2511F53), np.uint64(0xCD9E8D57))
_PHILOX_W = (0x9E3779B9, 0xBB67AE85)
_THREEFRY_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))


def _split64(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(low, high) 32-bit words of uint64 values."""
    return (x & _LOW32).astype(_U32), (x >> np.uint64(32)).astype(_U32)


def _join64(low: np.ndarray, high: np.ndarray) -> np.ndarray:
    return low.astype(np.uint64) | (high.astype(np.uint64) << np.uint64(32))


def _threefry2x32(x0: np.ndarray, x1: np.ndarray, key: int) -> tuple[np.ndarray, np.ndarray]:
    """ThreeFry-2x32 with 20 rounds, as XLA's ``ThreeFry2x32``."""
    ks = [_U32(key & 0xFFFFFFFF), _U32(key >> 32)]
    ks.append(_U32(0x1BD11BDA) ^ ks[0] ^ ks[1])
    x0, x1 = x0 + ks[0], x1 + ks[1]
    for block in range(5):
        for r in _THREEFRY_ROTATIONS[block % 2]:
            x0 = x0 + x1
            x1 = (x1 << _U32(r)) | (x1 >> _U32(32 - r))
            x1 = x0 ^ x1
        x0 = x0 + ks[(block + 1) % 3]
        x1 = x1 + ks[(block + 2) % 3] + _U32(block + 1)
    return x0, x1


_PHILOX_CHUNK = 16384  # blocks per pass: the working arrays stay in the cache (~2.5x faster)


def _philox_words(key: int, low: int, high: int, n: int) -> np.ndarray:
    """Philox-4x32-10 (Salmon et al., SC 2011) of the 128-bit counters ``(high, low) + i`` for
    ``i`` in ``[0, n)`` under the 64-bit ``key``: an ``(n, 4)`` uint32 array, as XLA's
    ``Philox4x32`` (counter words low first; each round multiplies words 0 and 2)."""
    out = np.empty((n, 4), np.uint32)
    mult = np.array([[_PHILOX_M[0]], [_PHILOX_M[1]]], np.uint64)
    base = np.uint64(low)
    for s in range(0, n, _PHILOX_CHUNK):
        lo = np.arange(s, min(n, s + _PHILOX_CHUNK), dtype=np.uint64)
        lo += base  # wraps modulo 2**64; the carry goes to the high word
        hi = np.full(lo.size, high, np.uint64)
        hi[lo < base] += np.uint64(1)
        a = np.stack([lo & _LOW32, hi & _LOW32])  # words 0 and 2: multiplied each round
        b = np.stack([lo >> np.uint64(32), hi >> np.uint64(32)])  # words 1 and 3
        p, h = np.empty_like(a), np.empty_like(a)
        k0, k1 = key & 0xFFFFFFFF, key >> 32  # Python ints: numpy scalars warn on wrap-around
        for _ in range(10):
            # (w0, w1, w2, w3) <- (hi(w2*M1) ^ w1 ^ k0, lo(w2*M1), hi(w0*M0) ^ w3 ^ k1, lo(w0*M0))
            np.multiply(a, mult, out=p)
            np.right_shift(p, np.uint64(32), out=h)
            np.bitwise_xor(h[::-1], b, out=a)
            a[0] ^= np.uint64(k0)
            a[1] ^= np.uint64(k1)
            np.bitwise_and(p[::-1], _LOW32, out=b)
            k0, k1 = (k0 + _PHILOX_W[0]) & 0xFFFFFFFF, (k1 + _PHILOX_W[1]) & 0xFFFFFFFF
        block = out[s:s + lo.size]
        block[:, 0], block[:, 1], block[:, 2], block[:, 3] = a[0], b[0], a[1], b[1]
    return out


def _philox_bits(key: int, low: int, high: int, count: int, bits: int) -> tuple[np.ndarray, int, int]:
    """XLA's ``PhiloxBitGenerator``: ``count`` values of ``bits`` bits (as unsigned ints) and
    the counter advanced by the blocks used."""
    n = -(-count // (2 if bits == 64 else 4))
    w = _philox_words(key, low, high, n)
    new_low = (low + n) & _MASK64
    new_high = (high + (1 if new_low < low else 0)) & _MASK64
    if bits == 64:
        out = np.stack([_join64(w[:, 0], w[:, 1]), _join64(w[:, 2], w[:, 3])], axis=1).reshape(-1)[:count]
    else:
        out = w.reshape(-1)[:count]
        out = out if bits == 32 else out.astype(f"u{bits // 8}")  # the low bits, like XLA
    return out, new_low, new_high


def _threefry_bits(key: int, counter: int, shape: tuple[int, ...], bits: int) -> tuple[np.ndarray, int]:
    """XLA's ``ThreeFryBitGenerator``: bits of ``shape`` (as unsigned ints), new counter."""
    base = np.uint64(counter)
    if bits == 64:
        n = int(np.prod(shape, dtype=np.int64))
        x0, x1 = _threefry2x32(*_split64(base + np.arange(n, dtype=np.uint64)), key)
        return _join64(x0, x1).reshape(shape), (counter + n) & _MASK64
    if not shape:
        x0, _ = _threefry2x32(*_split64(np.full(1, base)), key)
        out, used = x0.reshape(()), 1
    else:
        even = [i for i, d in enumerate(shape) if d % 2 == 0]
        split = even[0] if even else int(np.argmax(shape))
        half = list(shape)
        half[split] = -(-shape[split] // 2)
        used = int(np.prod(half, dtype=np.int64))
        x0, x1 = _threefry2x32(*_split64(base + np.arange(used, dtype=np.uint64)), key)
        pair = np.stack([x0.reshape(half), x1.reshape(half)], axis=split + 1)
        merged = list(shape)
        merged[split] = 2 * half[split]
        out = pair.reshape(merged)[tuple(slice(0, d) for d in shape)]
    out = out if bits == 32 else out.astype(f"u{bits // 8}")
    return np.ascontiguousarray(out), (counter + used) & _MASK64


@register("rng-bit-generator")
def _rng_bit_generator(ctx: KernelContext) -> KernelFn:
    shape = ctx.instr.shape
    if not shape.is_tuple or len(shape.tuple_shapes) != 2:
        raise ValueError("rng-bit-generator must return (state, bits)")
    state_dt = dtypes.to_numpy(shape.tuple_shapes[0].dtype)
    state_len = int(np.prod(shape.tuple_shapes[0].dims, dtype=np.int64))
    out_dt = dtypes.to_numpy(shape.tuple_shapes[1].dtype)
    out_shape = tuple(int(d) for d in shape.tuple_shapes[1].dims)
    count = int(np.prod(out_shape, dtype=np.int64))
    bits = out_dt.itemsize * 8
    algorithm = ctx.attr("algorithm", "default")
    if algorithm == "default":
        algorithm = "philox"  # XLA's CPU and GPU backends
    exact = (state_dt == np.uint64 and state_len >= 2 and bits in (8, 16, 32, 64)
             and algorithm in ("philox", "three_fry"))

    def run_exact(ops: Sequence[Any]) -> tuple[np.ndarray, np.ndarray]:
        state = np.asarray(ops[0]).reshape(-1)
        key = int(state[0])
        new_state = state.copy()
        if algorithm == "philox":
            low, high = (int(state[1]), int(state[2])) if state.size >= 3 else (int(state[1]), key)
            out, new_low, new_high = _philox_bits(key, low, high, count, bits)
            new_state[1] = new_low
            if state.size >= 3:
                new_state[2] = new_high
        else:
            out, new_state[1] = _threefry_bits(key, int(state[1]), out_shape, bits)
        return new_state.reshape(np.shape(ops[0])), out.view(out_dt).reshape(out_shape)

    if exact:
        return run_exact
    nbytes = count * out_dt.itemsize
    nwords = -(-nbytes // 8)
    salt = {"three_fry": 1, "philox": 2}.get(algorithm, 3)

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
