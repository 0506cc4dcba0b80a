"""``fft``: discrete Fourier transforms over the 1 to 3 innermost dimensions.

Attributes: ``fft_type`` (s: ``FFT``, ``IFFT``, ``RFFT``, ``IRFFT``) and ``fft_length`` (ints,
the time-domain lengths of the transformed dimensions, outermost first). Following XLA's
operation semantics:

- ``FFT`` / ``IFFT``: complex to complex, shape unchanged; the inverse divides by the product
  of the lengths;
- ``RFFT``: real to complex; the innermost dimension becomes ``fft_length[-1] // 2 + 1`` (the
  terms up to the Nyquist frequency);
- ``IRFFT``: complex to real; the innermost dimension holds the first ``fft_length[-1] // 2 + 1``
  terms and becomes ``fft_length[-1]``. The rest of the spectrum is taken as the mirrored
  conjugate of those terms, so the imaginary parts of the zero-frequency term (and of the
  Nyquist term for an even length) do not count. In several dimensions the outer dimensions
  are inverted (complex to complex) before the innermost one.

numpy's ``fft`` module computes the transforms in double precision (complex128) and the
result is rounded once to the result type.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from device_server.emulator.kernels import KernelContext, KernelFn, register
from device_server.emulator.kernels.window import attr_ints, invalid

_C128 = np.dtype(np.complex128)
_F64 = np.dtype(np.float64)
_TYPES = ("FFT", "IFFT", "RFFT", "IRFFT")


@register("fft")
def fft(ctx: KernelContext) -> KernelFn:
    """XLA Fft of the given type over the innermost ``len(fft_length)`` dimensions."""
    if len(ctx.operand_shapes) != 1:
        raise invalid(ctx, f"expected one operand, got {len(ctx.operand_shapes)}.")
    kind = str(ctx.attr("fft_type"))
    if kind not in _TYPES:
        raise invalid(ctx, f"fft_type must be one of {', '.join(_TYPES)}, got {kind!r}.")
    lengths = attr_ints(ctx, "fft_length")
    shape = tuple(ctx.operand_shapes[0])
    in_dt, out_dt = ctx.operand_dtypes[0], ctx.out_dtype
    r = len(lengths)
    if not 1 <= r <= 3 or r > len(shape) or any(n < 0 for n in lengths):
        raise invalid(ctx, f"fft_length {list(lengths)} must give 1 to 3 non-negative lengths for "
                      f"the innermost dimensions of {list(shape)}.")
    outer = shape[:-r]
    spectrum = tuple(lengths[:-1]) + (lengths[-1] // 2 + 1,)
    expect_in, expect_out = {
        "FFT": (lengths, lengths), "IFFT": (lengths, lengths),
        "RFFT": (lengths, spectrum), "IRFFT": (spectrum, lengths),
    }[kind]
    if lengths[-1] == 0:  # a zero length: the spectrum's innermost dimension may be 0 or 1
        side = list(shape[-r:] if kind == "IRFFT" else ctx.out_shape[-r:])
        if side and side[-1] in (0, 1):
            spectrum = tuple(lengths[:-1]) + (side[-1],)
            expect_in, expect_out = (spectrum, lengths) if kind == "IRFFT" else (expect_in, spectrum)
    real_in = kind == "RFFT"
    real_out = kind == "IRFFT"
    want_in = "f" if real_in else "c"
    want_out = "f" if real_out else "c"
    if in_dt is None or out_dt is None or in_dt.kind != want_in or out_dt.kind != want_out:
        raise invalid(ctx, f"{kind} maps {'real' if real_in else 'complex'} to "
                      f"{'real' if real_out else 'complex'} values, got {in_dt} -> {out_dt}.")
    if shape[-r:] != tuple(expect_in) or tuple(ctx.out_shape) != outer + tuple(expect_out):
        raise invalid(ctx, f"{kind} with fft_length {list(lengths)} takes [..., "
                      f"{', '.join(map(str, expect_in))}] to [..., {', '.join(map(str, expect_out))}], "
                      f"got {list(shape)} -> {list(ctx.out_shape)}.")
    out_shape = tuple(ctx.out_shape)
    axes = tuple(range(len(shape) - r, len(shape)))
    transform = {
        "FFT": lambda x: np.fft.fftn(x.astype(_C128), axes=axes),
        "IFFT": lambda x: np.fft.ifftn(x.astype(_C128), axes=axes),
        "RFFT": lambda x: np.fft.rfftn(x.astype(_F64), s=lengths, axes=axes),
        "IRFFT": lambda x: np.fft.irfftn(x.astype(_C128), s=lengths, axes=axes),
    }[kind]
    empty = 0 in shape or 0 in out_shape

    def run(ops: Sequence[Any]) -> np.ndarray:
        if empty:  # nothing to transform (or a transform of nothing: zeros)
            return np.zeros(out_shape, out_dt)
        return transform(np.asarray(ops[0])).astype(out_dt)

    return run
