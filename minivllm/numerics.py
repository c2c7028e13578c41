"""Number-format emulation: round float32 values to narrower floating-point formats.

Every format here is a binary floating-point format in the IEEE 754 mould: a sign bit,
``E`` exponent bits stored with a bias, and ``M`` explicit mantissa (trailing significand)
bits. A normal number is ``(-1)^s * 1.m * 2^(e - bias)``; when the stored exponent field is
zero the number is *subnormal*, ``(-1)^s * 0.m * 2^(1 - bias)``, which fills the gap between
zero and the smallest normal number with evenly spaced values ("gradual underflow").

==========  ===  ===  ====  ===========  ===========  ===========  =====================
format       E    M   bias  max normal   min normal   min subnorm  specials
==========  ===  ===  ====  ===========  ===========  ===========  =====================
float32      8   23   127   ~3.40e38     2^-126       2^-149       inf, NaN (IEEE)
tf32         8   10   127   ~3.40e38     2^-126       2^-136       inf, NaN (IEEE)
float16      5   10    15   65504        2^-14        2^-24        inf, NaN (IEEE)
bfloat16     8    7   127   ~3.39e38     2^-126       2^-133       inf, NaN (IEEE)
fp8_e4m3     4    3     7   448          2^-6         2^-9         NaN only: S.1111.111
fp8_e5m2     5    2    15   57344        2^-14        2^-16        inf, NaN (IEEE)
==========  ===  ===  ====  ===========  ===========  ===========  =====================

Sources:

* IEEE 754-2008, *Standard for Floating-Point Arithmetic*: binary32 and binary16,
  subnormals, roundTiesToEven (section 4.3.1) and overflow (section 7.4: the result is
  rounded as if the exponent range were unbounded, and overflows when that rounded value
  exceeds the largest finite number).
* bfloat16: float32's sign and exponent with the top 7 mantissa bits (Google Brain's format;
  Intel, *BFLOAT16 - Hardware Numerics Definition*, 2018).
* TF32: NVIDIA's "TensorFloat-32" (A100 whitepaper, 2020; PTX ISA ``.tf32``): float32's
  8-bit exponent with a 10-bit mantissa, used by tensor cores for float32 matmuls. It is a
  compute format, stored in 32-bit registers whose low 13 mantissa bits are ignored.
* OCP 8-bit Floating Point Specification (OFP8), revision 1.0, 2023: E4M3 and E5M2.
  E5M2 follows IEEE conventions (inf at S.11111.00, NaN at S.11111.{01,10,11}). E4M3 is
  the "fn" variant (torch's ``float8_e4m3fn``): no infinities, and only S.1111.111 is NaN,
  so the top exponent holds finite values and the maximum is 1.75 * 2^8 = 448.

Every function here returns float32 tensors holding values that the target format can
represent exactly, so they can be fed to ordinary float32 arithmetic (the usual way to
emulate low-precision hardware on a CPU). Rounding is done with integer arithmetic on the
float32 bit pattern, for any exponent and mantissa width, and never calls torch's own
casts (the tests use those casts as an independent oracle).
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from typing import Optional, Union

import torch
import torch.nn.functional as F

__all__ = [
    "FORMATS", "FloatFormat", "round_to_bf16", "round_to_format", "round_to_fp16",
    "round_to_fp8_e4m3", "round_to_fp8_e5m2", "round_to_tf32", "tf32_linear", "tf32_matmul",
    "ulp",
]


@dataclass(frozen=True)
class FloatFormat:
    """A binary floating-point format: sign bit, ``exponent_bits``, ``mantissa_bits``.

    Attributes:
        name: key in :data:`FORMATS`.
        exponent_bits: width of the stored exponent field.
        mantissa_bits: explicit mantissa (trailing significand) bits; the leading 1 of a
            normal number is implicit, so the precision is ``mantissa_bits + 1`` bits.
        bias: stored exponent minus true exponent for normal numbers.
        max_normal: largest finite magnitude.
        min_normal: smallest positive normal magnitude, ``2^(1 - bias)``.
        min_subnormal: smallest positive magnitude, ``2^(1 - bias - mantissa_bits)``.
        has_inf: whether the format encodes infinities.
        nan_encoding: which bit patterns are NaN, for readers.
    """

    name: str
    exponent_bits: int
    mantissa_bits: int
    bias: int
    max_normal: float
    min_normal: float
    min_subnormal: float
    has_inf: bool
    nan_encoding: str

    def __post_init__(self) -> None:
        """Check that the fields describe one consistent format.

        Raises:
            ValueError: a non-integer bit count or bias, or limits that do not follow from
                them (``min_normal = 2^(1-bias)``, ``min_subnormal = 2^(1-bias-m)``,
                ``max_normal`` a positive value on the format's grid whose exponent fits
                the exponent field).
        """
        for field_name in ("exponent_bits", "mantissa_bits", "bias"):
            v = getattr(self, field_name)
            if isinstance(v, bool) or not isinstance(v, int):
                raise ValueError(f"FloatFormat.{field_name} must be an int, got {v!r}")
        if self.exponent_bits < 1 or self.mantissa_bits < 0:
            raise ValueError("FloatFormat needs exponent_bits >= 1 and mantissa_bits >= 0")
        m, emin = self.mantissa_bits, 1 - self.bias
        if self.min_normal != 2.0 ** emin or self.min_subnormal != 2.0 ** (emin - m):
            raise ValueError(f"FloatFormat {self.name!r}: min_normal must be 2^(1-bias) = "
                             f"{2.0 ** emin!r} and min_subnormal 2^(1-bias-mantissa_bits) = "
                             f"{2.0 ** (emin - m)!r}")
        if not (isinstance(self.max_normal, (int, float)) and math.isfinite(self.max_normal)
                and self.max_normal >= self.min_normal):
            raise ValueError(f"FloatFormat {self.name!r}: max_normal must be a finite number "
                             f">= min_normal, got {self.max_normal!r}")
        emax = math.frexp(self.max_normal)[1] - 1
        steps = self.max_normal / 2.0 ** (emax - m)
        top = 2 ** self.exponent_bits - 1 - self.bias  # largest exponent field value
        if steps != int(steps) or emax > top:
            raise ValueError(f"FloatFormat {self.name!r}: max_normal {self.max_normal!r} is not "
                             f"a value of a format with {self.exponent_bits} exponent and {m} "
                             f"mantissa bits (bias {self.bias})")

    @property
    def emin(self) -> int:
        """Exponent of the smallest normal number (also the exponent of the subnormals)."""
        return 1 - self.bias

    @property
    def emax(self) -> int:
        """Exponent of the largest finite number."""
        return math.frexp(self.max_normal)[1] - 1

    @property
    def eps(self) -> float:
        """Machine epsilon, ``2^-mantissa_bits``: the gap from 1.0 to the next value."""
        return 2.0 ** -self.mantissa_bits


_IEEE_NAN = "exponent all ones, mantissa non-zero (all ones, mantissa zero is inf)"

FORMATS: dict[str, FloatFormat] = {
    "float32": FloatFormat("float32", 8, 23, 127, (2 - 2.0**-23) * 2.0**127, 2.0**-126,
                           2.0**-149, True, _IEEE_NAN),
    "tf32": FloatFormat("tf32", 8, 10, 127, (2 - 2.0**-10) * 2.0**127, 2.0**-126,
                        2.0**-136, True, _IEEE_NAN),
    "float16": FloatFormat("float16", 5, 10, 15, (2 - 2.0**-10) * 2.0**15, 2.0**-14,
                           2.0**-24, True, _IEEE_NAN),
    "bfloat16": FloatFormat("bfloat16", 8, 7, 127, (2 - 2.0**-7) * 2.0**127, 2.0**-126,
                            2.0**-133, True, _IEEE_NAN),
    # e4m3fn: the top exponent 1111 holds finite values except mantissa 111 (NaN), so the
    # largest finite value is 1.110b * 2^(15 - 7) = 448.
    "fp8_e4m3": FloatFormat("fp8_e4m3", 4, 3, 7, 1.75 * 2.0**8, 2.0**-6, 2.0**-9, False,
                            "S.1111.111 only (no infinities)"),
    "fp8_e5m2": FloatFormat("fp8_e5m2", 5, 2, 15, 1.75 * 2.0**15, 2.0**-14, 2.0**-16, True,
                            _IEEE_NAN),
    # OCP MX E2M1 (the elements of MXFP4 and NVFP4; minivllm.quantization.fp4): values
    # +-{0, 0.5, 1, 1.5, 2, 3, 4, 6}; no infinities and no NaN.
    "fp4_e2m1": FloatFormat("fp4_e2m1", 2, 1, 1, 6.0, 1.0, 0.5, False,
                            "none (no NaN, no infinities)"),
}

# float32 bit-pattern constants (magnitudes, sign bit clear).
_F32_MANTISSA_BITS = 23
_F32_BIAS = 127
_F32_EMIN = -126
_F32_FRACTION_MASK = (1 << _F32_MANTISSA_BITS) - 1
_F32_IMPLICIT_ONE = 1 << _F32_MANTISSA_BITS
_F32_INF = 0x7F800000
_F32_QUIET_NAN = 0x7FC00000
_MAGNITUDE_MASK = 0x7FFFFFFF
_SIGN_MASK = -(2**31)  # 0x80000000 as a signed int32


def _float32_bits(value: float) -> int:
    """The float32 bit pattern of ``value`` (which must be exactly representable)."""
    return struct.unpack("<I", struct.pack("<f", value))[0]


def _resolve(fmt: Union[str, FloatFormat]) -> FloatFormat:
    """The :class:`FloatFormat` named by ``fmt``, checked to fit inside float32.

    Raises:
        ValueError: unknown name, or a custom format that float32 cannot hold (more than 23
            mantissa bits, or an exponent range wider than float32's).
    """
    if isinstance(fmt, str):
        if fmt not in FORMATS:
            raise ValueError(f"unknown format {fmt!r}; known: {sorted(FORMATS)}")
        return FORMATS[fmt]
    if not isinstance(fmt, FloatFormat):
        raise TypeError(f"fmt must be a format name ({sorted(FORMATS)}) or a FloatFormat, "
                        f"got {fmt!r}")
    if not (0 <= fmt.mantissa_bits <= _F32_MANTISSA_BITS and fmt.emin >= _F32_EMIN
            and fmt.max_normal <= FORMATS["float32"].max_normal):
        raise ValueError(f"format {fmt.name!r} does not fit inside float32")
    return fmt


def _check_saturate(saturate) -> None:
    if not isinstance(saturate, bool):
        raise TypeError(f"saturate must be True or False, got {saturate!r}")


def _as_float32(x: torch.Tensor) -> torch.Tensor:
    """``x`` detached and converted to float32 (float64 rounds to nearest, ties to even).

    Raises:
        TypeError: ``x`` is not a real floating-point tensor.
    """
    if not isinstance(x, torch.Tensor) or not x.dtype.is_floating_point:
        raise TypeError(f"expected a floating-point tensor, got "
                        f"{x.dtype if isinstance(x, torch.Tensor) else type(x).__name__}")
    return x.detach().to(torch.float32)


def _bit_length(n: torch.Tensor) -> torch.Tensor:
    """Number of binary digits of each non-negative int64 ``n`` below ``2^32`` (0 for 0)."""
    length = torch.zeros_like(n)
    for step in (16, 8, 4, 2, 1):
        big = (n >> step) > 0
        n = torch.where(big, n >> step, n)
        length += big * step
    return length + (n > 0)


def _shift_right_round_half_even(n: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """``n / 2^shift`` rounded to the nearest integer, ties to even (int64, ``shift >= 0``).

    The bits shifted out are compared with one half: more rounds up, less rounds down, and
    exactly one half rounds to whichever neighbour is even (IEEE 754 roundTiesToEven).
    """
    truncated = n >> shift
    twice_remainder = (n - (truncated << shift)) << 1
    one = torch.ones_like(n) << shift
    odd = (truncated & 1) == 1
    round_up = (twice_remainder > one) | ((twice_remainder == one) & odd)
    return truncated + round_up


def _compose_float32_bits(units: torch.Tensor, quantum_exp: torch.Tensor) -> torch.Tensor:
    """float32 magnitude bits of ``units * 2^quantum_exp`` (int64 tensors).

    ``units`` must be below ``2^24`` and the value a float32 number
    (``quantum_exp >= -149``), except that exactly ``2^128`` gives the bit pattern of
    infinity.
    """
    length = _bit_length(units)
    exponent = quantum_exp + length - 1  # exponent of the leading 1
    fraction = (units << (24 - length).clamp(0, 24)) & _F32_FRACTION_MASK
    normal = ((exponent + _F32_BIAS) << _F32_MANTISSA_BITS) | fraction
    # float32 subnormals are integer multiples of 2^-149 stored as-is in the mantissa field.
    subnormal = units << (quantum_exp - (_F32_EMIN - _F32_MANTISSA_BITS)).clamp(0, 23)
    bits = torch.where(exponent >= _F32_EMIN, normal, subnormal)
    return torch.where(units == 0, torch.zeros_like(bits), bits)


def _decompose(magnitude: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Split finite float32 magnitude bits into ``(significand, exponent)`` (int64).

    The value is ``significand * 2^(exponent - 23)``, with the implicit leading 1 made
    explicit for normal numbers; float32 subnormals have exponent -126 and no leading 1.
    """
    biased = magnitude >> _F32_MANTISSA_BITS
    fraction = magnitude & _F32_FRACTION_MASK
    is_normal = biased > 0
    significand = torch.where(is_normal, fraction | _F32_IMPLICIT_ONE, fraction)
    exponent = torch.where(is_normal, biased, torch.ones_like(biased)) - _F32_BIAS
    return significand, exponent


def _round_magnitude(magnitude: torch.Tensor, fmt: FloatFormat) -> torch.Tensor:
    """Round finite float32 magnitude bits to ``fmt``'s grid with an unbounded exponent.

    The grid spacing (quantum) at exponent ``e`` is ``2^(max(e, emin) - mantissa_bits)``:
    the ``max`` is gradual underflow, every value below ``2^emin`` sharing the subnormal
    spacing. Overflow is left to the caller (the result may exceed ``fmt.max_normal``).
    """
    significand, exponent = _decompose(magnitude)
    quantum_exp = exponent.clamp(min=fmt.emin) - fmt.mantissa_bits
    # Bits to drop; past 25, any 24-bit significand is under half a quantum and becomes 0.
    shift = (quantum_exp - (exponent - _F32_MANTISSA_BITS)).clamp(max=25)
    units = _shift_right_round_half_even(significand, shift)
    return _compose_float32_bits(units, quantum_exp)


def round_to_format(x: torch.Tensor, fmt: Union[str, FloatFormat],
                    saturate: bool = False) -> torch.Tensor:
    """Round every element of ``x`` to the nearest value of ``fmt``, ties to even.

    Args:
        x: tensor of any shape and any floating dtype. It is first converted to float32, so
            float64 inputs are rounded twice (to float32, then to ``fmt``), exactly like
            ``x.to(torch.float32).to(dtype)``; that can differ from a direct float64 cast
            when the float32 rounding lands on a tie of ``fmt``.
        fmt: a key of :data:`FORMATS` or a :class:`FloatFormat` that fits inside float32.
        saturate: how values beyond the format's range are treated (below).

    Returns:
        A float32 tensor of ``x``'s shape and device (no autograd graph) whose values are
        exactly representable in ``fmt``.

    Rounding (IEEE 754-2008 roundTiesToEven, sections 4.3.1 and 7.4):

    * nearest representable value; an exact tie goes to the neighbour whose last mantissa
      bit is 0, on the normal grid and on the subnormal grid alike (gradual underflow);
      magnitudes up to half the smallest subnormal become zero;
    * signs are kept, including on zero (-0.0 stays -0.0; tiny negatives give -0.0);
    * NaN inputs give a quiet NaN (``0x7FC00000`` with the input's sign; payloads are not
      kept, as no narrow format can hold them).

    Overflow, i.e. the magnitude rounded on an unbounded exponent range exceeds
    ``fmt.max_normal``, and infinite inputs:

    * ``saturate=False`` (OFP8 "non-saturating" mode, NVIDIA's ``__NV_NOSAT``): +-inf in
      formats that have infinities; NaN in ``fp8_e4m3``, which has none. For e4m3 the
      threshold is 464 (the midpoint of 448 and the would-be 480): 464 itself ties to 448.
    * ``saturate=True`` (NVIDIA's ``__NV_SATFINITE``, PTX ``cvt .satfinite``): +-max_normal,
      for infinite inputs too, in every format, so only NaN is non-finite in the result.
      This follows CUDA's ``cuda_fp8.hpp`` reference conversion and the PTX ISA ("if the
      absolute value of input is greater than MAX_NORM, the result is sign-preserved
      MAX_NORM"); it equals ``x.clamp(-max_normal, max_normal)`` followed by the
      non-saturating rounding.

    Raises:
        TypeError: ``x`` is not a floating-point tensor.
        ValueError: ``fmt`` is unknown or does not fit inside float32.
    """
    _check_saturate(saturate)
    spec = _resolve(fmt)
    bits = _as_float32(x).view(torch.int32)
    sign = bits & _SIGN_MASK
    magnitude = (bits & _MAGNITUDE_MASK).to(torch.int64)

    is_nan = magnitude > _F32_INF
    rounded = _round_magnitude(magnitude, spec)
    too_big = rounded > _float32_bits(spec.max_normal)
    overflow = ~is_nan & ((magnitude == _F32_INF) | too_big)
    if saturate:
        overflow_bits = _float32_bits(spec.max_normal)
    else:
        overflow_bits = _F32_INF if spec.has_inf else _F32_QUIET_NAN

    out = torch.where(overflow, overflow_bits, rounded)
    out = torch.where(is_nan, _F32_QUIET_NAN, out)
    return (out.to(torch.int32) | sign).view(torch.float32)


def round_to_tf32(x: torch.Tensor, saturate: bool = False) -> torch.Tensor:
    """Round to TF32 (8 exponent bits, 10 mantissa bits), ties to even; float32 result.

    The low 13 mantissa bits of every result are zero. NVIDIA hardware converts with
    different rules depending on the path: ``cvt.rna.tf32.f32`` rounds ties *away* from
    zero, and tensor-core MMAs fed raw float32 registers ignore (truncate) the low 13
    bits; this emulation uses IEEE ties-to-even throughout. See :func:`round_to_format`.

    Fast path (the engine calls this on every matmul input when emulating TF32): TF32
    has float32's exponent, so only the 13 low mantissa bits go. Adding ``0xFFF`` plus
    the lowest kept bit and clearing the 13 bits is round-half-to-even on the bit
    pattern; a carry out of the mantissa bumps the exponent (up to inf at the top).
    Inf and NaN patterns (exponent all ones) pass through. Equal, bit for bit, to
    ``round_to_format(x, "tf32")`` (tested), about 10x faster.
    """
    _check_saturate(saturate)
    bits = _as_float32(x).contiguous().view(torch.int32)
    rounded = (bits + 0xFFF + ((bits >> 13) & 1)) & ~0x1FFF
    special = (bits & 0x7F800000) == 0x7F800000
    out = torch.where(special, bits, rounded).view(torch.float32)
    if saturate:
        tf32_max = FORMATS["tf32"].max_normal
        out = torch.where(torch.isnan(out), out, out.clamp(-tf32_max, tf32_max))
    return out


def round_to_fp16(x: torch.Tensor, saturate: bool = False) -> torch.Tensor:
    """Round to IEEE binary16 (float16), ties to even; float32 result.

    Matches ``x.to(torch.float16).to(torch.float32)`` when ``saturate=False``.
    See :func:`round_to_format`.
    """
    return round_to_format(x, "float16", saturate=saturate)


def round_to_bf16(x: torch.Tensor, saturate: bool = False) -> torch.Tensor:
    """Round to bfloat16, ties to even; float32 result.

    Matches ``x.to(torch.bfloat16).to(torch.float32)`` when ``saturate=False``.
    See :func:`round_to_format`.
    """
    return round_to_format(x, "bfloat16", saturate=saturate)


def round_to_fp8_e4m3(x: torch.Tensor, saturate: bool = False) -> torch.Tensor:
    """Round to OFP8 E4M3 (e4m3fn: max 448, no inf), ties to even; float32 result.

    ``saturate=False`` turns overflow and +-inf into NaN (OFP8 non-saturating mode);
    ``saturate=True`` clamps them to +-448. torch 2.13's ``.to(torch.float8_e4m3fn)``
    saturates (older releases gave NaN). See :func:`round_to_format`.
    """
    return round_to_format(x, "fp8_e4m3", saturate=saturate)


def round_to_fp8_e5m2(x: torch.Tensor, saturate: bool = False) -> torch.Tensor:
    """Round to OFP8 E5M2 (IEEE-like: max 57344, inf and NaN), ties to even; float32 result.

    Matches ``x.to(torch.float8_e5m2).to(torch.float32)`` when ``saturate=False``.
    See :func:`round_to_format`.
    """
    return round_to_format(x, "fp8_e5m2", saturate=saturate)


def tf32_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Emulate a TF32 tensor-core matmul: inputs rounded to TF32, float32 accumulation.

    Args:
        a, b: floating tensors with ``torch.matmul`` shapes (broadcast batch dimensions
            allowed); converted to float32 first.

    Returns:
        ``torch.matmul(round_to_tf32(a), round_to_tf32(b))``, float32. A product of two
        TF32 numbers (11-bit significands) is exact in float32 unless it under- or
        overflows, so only the sums round.

    The *input rounding* is reproduced bit for bit (ties to even, see :func:`round_to_tf32`
    for how hardware converters differ at ties). The sums are not: a GPU accumulates in
    its own order and blocking (split-K, tensor-core tiles), so results agree with real
    hardware only up to float32 accumulation error.
    """
    return torch.matmul(round_to_tf32(a), round_to_tf32(b))


def tf32_linear(x: torch.Tensor, weight: torch.Tensor,
                bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``F.linear`` with TF32 inputs: ``round_to_tf32(x) @ round_to_tf32(weight).T + bias``.

    Args:
        x: ``[..., in_features]`` floating tensor.
        weight: ``[out_features, in_features]`` floating tensor.
        bias: optional ``[out_features]``; added in float32 without TF32 rounding, as a
            GEMM epilogue does.

    Returns:
        ``[..., out_features]`` float32. Same accumulation caveat as :func:`tf32_matmul`.
    """
    bias32 = None if bias is None else _as_float32(bias)
    return F.linear(round_to_tf32(x), round_to_tf32(weight), bias32)


def ulp(x: torch.Tensor, fmt: Union[str, FloatFormat]) -> torch.Tensor:
    """Spacing of ``fmt``'s values at ``x``: ``2^(clamp(floor(log2|x|), emin, emax) - M)``.

    Args:
        x: floating tensor (converted to float32).
        fmt: a key of :data:`FORMATS` or a :class:`FloatFormat`.

    Returns:
        Positive float32 tensor of ``x``'s shape: the gap between consecutive values of the
        binade holding ``|x|`` (the subnormal spacing below ``min_normal``, including at
        zero; the top binade's spacing above ``max_normal``); NaN for inf and NaN inputs.
        Round-to-nearest errs by at most ``ulp(x, fmt) / 2`` for ``|x| <= max_normal``.

    Raises:
        TypeError, ValueError: as :func:`round_to_format`.
    """
    spec = _resolve(fmt)
    x32 = _as_float32(x)
    magnitude = (x32.view(torch.int32) & _MAGNITUDE_MASK).to(torch.int64)
    _, exponent = _decompose(magnitude)
    quantum_exp = exponent.clamp(spec.emin, spec.emax) - spec.mantissa_bits
    spacing = _compose_float32_bits(torch.ones_like(quantum_exp), quantum_exp)
    spacing = torch.where(magnitude >= _F32_INF, _F32_QUIET_NAN, spacing)
    return spacing.to(torch.int32).view(torch.float32)
