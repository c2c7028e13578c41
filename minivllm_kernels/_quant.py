"""Rounding helpers shared by the kernels (Triton ``@jit`` functions).

Quantizing stores ``Q(x / scale)`` where ``Q`` rounds to nearest, ties to even, on the
target grid. Triton's own float->fp8 conversion is round-to-nearest-even on GPUs but not
in the interpreter (it truncates some values), so the rounding is written out here with
integer bit arithmetic (the same method as ``minivllm.numerics.round_to_format``); the
final cast then only converts values that are already on the grid, which is exact on
every backend.
"""

from __future__ import annotations

import torch

from minivllm_kernels._triton import INTERPRET, tl, triton


@triton.jit
def round_half_even(y):
    """Round float32 ``y`` (|y| < 2**22) to the nearest integer, ties to even."""
    r = tl.floor(y + 0.5)
    tie = (r - y) == 0.5
    odd = (r - 2.0 * tl.floor(r * 0.5)) != 0.0
    return tl.where(tie & odd, r - 1.0, r)


@triton.jit
def round_to_fp8_grid(y, MANTISSA_BITS: tl.constexpr, MIN_EXP: tl.constexpr):
    """Round float32 ``y`` (already clamped to the format's range) to the nearest value
    with MANTISSA_BITS explicit mantissa bits and exponents >= MIN_EXP (the smallest
    normal exponent; below it the spacing stays 2**(MIN_EXP - MANTISSA_BITS), which is
    how subnormals work). Ties to even."""
    sign = y.to(tl.int32, bitcast=True) & -2147483648  # the sign bit (set for -0.0 too)
    a = tl.abs(y)
    bits = a.to(tl.int32, bitcast=True)
    e = ((bits >> 23) & 0xFF) - 127
    e = tl.maximum(e, MIN_EXP)
    inv_ulp = ((127 - (e - MANTISSA_BITS)) << 23).to(tl.float32, bitcast=True)
    ulp = ((e - MANTISSA_BITS + 127) << 23).to(tl.float32, bitcast=True)
    r = round_half_even(a * inv_ulp) * ulp  # >= 0
    # put the sign bit back (not -r: some Triton versions compile that as 0 - r, which
    # turns -0.0 into +0.0); negatives that round to zero stay -0.0, as in a cast
    return (r.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


# storage dtype -> (kind, qmax, mantissa bits, min normal exponent)
_FORMATS = {
    torch.float8_e4m3fn: (1, 448.0, 3, -6),
    torch.float8_e5m2: (1, 57344.0, 2, -14),
    torch.int8: (2, 127.0, 0, 0),
}


def quant_format(dtype: torch.dtype) -> tuple[int, float, int, int]:
    """``(kind, qmax, mantissa_bits, min_exp)`` for a cache dtype; kind 0 = float cache
    (plain cast), 1 = fp8, 2 = int8."""
    return _FORMATS.get(dtype, (0, 1.0, 0, 0))


@triton.jit
def quantize(y, KIND: tl.constexpr, QMAX: tl.constexpr, MANTISSA_BITS: tl.constexpr,
             MIN_EXP: tl.constexpr):
    """float32 ``y = x / scale`` -> the value the cache stores (still float32, on the
    grid): clamp to +-QMAX, then round (fp8 grid or integers)."""
    y = tl.minimum(tl.maximum(y, -QMAX), QMAX)
    if KIND == 1:
        y = round_to_fp8_grid(y, MANTISSA_BITS, MIN_EXP)
    else:
        y = round_half_even(y)
    return y


_INTERPRETED = tl.constexpr(INTERPRET)


@triton.jit
def cast_rne(x, DTYPE: tl.constexpr):
    """float32 ``x`` -> DTYPE, rounding to nearest even. GPUs round this cast to nearest
    even; Triton's interpreter truncates float32 -> bfloat16, so there the rounding is
    done on the bits first: the kernels mean the same thing everywhere."""
    if DTYPE == tl.bfloat16 and _INTERPRETED:
        bits = x.to(tl.float32).to(tl.int32, bitcast=True)
        bits = (bits + (((bits >> 16) & 1) + 0x7FFF)) & -65536  # -65536 = 0xFFFF0000
        x = bits.to(tl.float32, bitcast=True)
    return x.to(DTYPE)


@triton.jit
def dot(a, b, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """``tl.dot`` with float32 accumulation. UPCAST (set in the interpreter for bfloat16
    inputs, where its dot is wrong) multiplies in float32 instead, which is exact for
    16-bit inputs, so only the summation order can differ from a GPU."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b, input_precision=PRECISION)
