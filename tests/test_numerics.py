"""minivllm.numerics: bit-exact rounding against torch's casts and a TF32 reference.

Oracles: torch's own casts (``x.to(dtype).to(torch.float32)``) for float16, bfloat16 and
the two fp8 formats; a pure-Python ``math.frexp``/``round`` model for TF32, which torch
has no dtype for; float64 products for the TF32 matmul. Results are compared as float32
bit patterns (``view(torch.int32)``), so -0.0 differs from +0.0; all NaNs count as equal.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from minivllm.numerics import (FORMATS, round_to_format, round_to_fp8_e4m3, round_to_tf32,
                               tf32_linear, tf32_matmul, ulp)

pytestmark = pytest.mark.usefixtures("one_thread")

TORCH_DTYPES = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
# integer dtype of the same width, to enumerate every encoding of a format
CODE_DTYPES = {torch.float32: torch.int32, torch.float16: torch.int16,
               torch.bfloat16: torch.int16, torch.float8_e4m3fn: torch.uint8,
               torch.float8_e5m2: torch.uint8}

TF32_MAX = (2 - 2.0**-10) * 2.0**127


# ---------------------------------------------------------------- helpers


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int32)


def _hex(value: torch.Tensor) -> str:
    return f"0x{int(_bits(value).item()) & 0xFFFFFFFF:08x}"


def _from_bits(patterns: torch.Tensor) -> torch.Tensor:
    """float32 tensor from int64 tensor of unsigned 32-bit patterns."""
    signed = torch.where(patterns >= 2**31, patterns - 2**32, patterns)
    return signed.to(torch.int32).view(torch.float32)


def _assert_same_bits(got: torch.Tensor, expected: torch.Tensor, inputs: torch.Tensor,
                      what: str) -> None:
    """Bit-for-bit equality (any NaN equals any NaN); on failure, list the first ones."""
    assert got.dtype == torch.float32, got.dtype
    assert got.shape == expected.shape, (got.shape, expected.shape)
    same = (_bits(got) == _bits(expected)) | (got.isnan() & expected.isnan())
    if bool(same.all()):
        return
    bad = (~same).nonzero().flatten()
    lines = [f"  x={inputs[i].item()!r} ({_hex(inputs[i])}): got {got[i].item()!r} "
             f"({_hex(got[i])}), expected {expected[i].item()!r} ({_hex(expected[i])})"
             for i in bad[:8].tolist()]
    header = f"{what}: {bad.numel()} of {same.numel()} differ; first:\n"
    pytest.fail(header + "\n".join(lines))


def _torch_round(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return x.to(dtype).to(torch.float32)


def _torch_e4m3_saturates() -> bool:
    """torch 2.13's float32 -> float8_e4m3fn cast clamps overflow (and inf) to +-448;
    older releases returned NaN (OFP8 non-saturating)."""
    probe = torch.tensor([1e4, math.inf]).to(torch.float8_e4m3fn).to(torch.float32)
    return not bool(probe.isnan().any())


def _random_patterns(n: int, seed: int) -> torch.Tensor:
    """``n`` uniformly random float32 bit patterns: all exponents, NaN, inf, subnormals."""
    g = torch.Generator().manual_seed(seed)
    return _from_bits(torch.randint(0, 2**32, (n,), generator=g, dtype=torch.int64))


def _in_range_sample(name: str, n: int, seed: int) -> torch.Tensor:
    """``n`` float32 values with exponents from below the format's subnormals to just
    above its maximum, random signs and random 23-bit mantissas."""
    fmt = FORMATS[name]
    g = torch.Generator().manual_seed(seed)
    low = max(fmt.emin - fmt.mantissa_bits - 2, -126)
    high = min(fmt.emax + 1, 127)
    exponent = torch.randint(low, high + 1, (n,), generator=g, dtype=torch.int64)
    fraction = torch.randint(0, 2**23, (n,), generator=g, dtype=torch.int64)
    sign = torch.randint(0, 2, (n,), generator=g, dtype=torch.int64)
    return _from_bits((sign << 31) | ((exponent + 127) << 23) | fraction)


def _all_encodings(dtype: torch.dtype) -> torch.Tensor:
    """Every encoding of ``dtype``, decoded by torch to float32."""
    width = torch.iinfo(CODE_DTYPES[dtype]).bits
    codes = torch.arange(2**width, dtype=torch.int64)
    if CODE_DTYPES[dtype].is_signed:
        codes = codes - 2 ** (width - 1)
    return codes.to(CODE_DTYPES[dtype]).view(dtype).to(torch.float32)


def _boundary_values(dtype: torch.dtype) -> torch.Tensor:
    """Every representable value, every tie between neighbours (subnormals and the
    underflow threshold included), the overflow tie above the maximum, and each of
    those +-1 float32 ulp; with specials, and both signs."""
    values = _all_encodings(dtype)
    grid = values[torch.isfinite(values) & (values >= 0)].unique().double()  # sorted, has 0
    beyond = 2 * grid[-1] - grid[-2]  # where the next value would be without the limit
    points = torch.cat([grid, beyond.reshape(1)])
    ties = (points[1:] + points[:-1]) / 2
    core = torch.cat([points, ties]).float()
    patterns = _bits(core).to(torch.int64)
    up, down = _from_bits(patterns + 1), _from_bits((patterns - 1).clamp(min=0))
    specials = torch.tensor([0.0, math.inf, math.nan, torch.finfo(torch.float32).max,
                             torch.finfo(torch.float32).tiny, 2.0**-149])
    positive = torch.cat([core, up, down, specials])
    return torch.cat([positive, -positive])


def _oracle_inputs(name: str) -> torch.Tensor:
    dtype = TORCH_DTYPES[name]
    return torch.cat([_random_patterns(2**20, seed=1),
                      _in_range_sample(name, 2**18, seed=2), _boundary_values(dtype)])


# ---------------------------------------------------------------- 1. torch's casts


@pytest.mark.parametrize("name", list(TORCH_DTYPES))
def test_matches_torch_cast_bit_for_bit(name):
    dtype = TORCH_DTYPES[name]
    x = _oracle_inputs(name)
    # torch's e4m3fn cast is saturating in torch 2.13: compare like with like.
    saturate = name == "fp8_e4m3" and _torch_e4m3_saturates()
    got = round_to_format(x, name, saturate=saturate)
    _assert_same_bits(got, _torch_round(x, dtype), x, f"{name} vs torch cast")


@pytest.mark.parametrize("name", list(TORCH_DTYPES))
def test_every_encoding_round_trips(name):
    values = _all_encodings(TORCH_DTYPES[name])
    _assert_same_bits(round_to_format(values, name), values, values, f"{name} encodings")


def test_float32_format_is_identity_except_nan_payloads():
    x = torch.cat([_random_patterns(2**16, seed=3), _boundary_values(torch.float16)])
    _assert_same_bits(round_to_format(x, "float32"), x, x, "float32 identity")


def test_fp8_e4m3_without_saturation_overflows_to_nan():
    x = torch.cat([_in_range_sample("fp8_e4m3", 2**16, seed=4),
                   _boundary_values(torch.float8_e4m3fn)])
    in_range = _torch_round(x.clamp(-448.0, 448.0), torch.float8_e4m3fn)
    expected = torch.where(x.abs() > 464.0, math.nan, in_range)  # 464 ties down to 448
    _assert_same_bits(round_to_fp8_e4m3(x), expected, x, "e4m3 non-saturating")

    above_tie = torch.nextafter(torch.tensor(464.0), torch.tensor(math.inf))
    spots = torch.stack([torch.tensor(464.0), above_tie, torch.tensor(-math.inf)])
    assert round_to_fp8_e4m3(spots)[0].item() == 448.0
    assert round_to_fp8_e4m3(spots)[1:].isnan().all()


# ---------------------------------------------------------------- 2. saturation


@pytest.mark.parametrize("name", list(TORCH_DTYPES))
def test_saturate_equals_clamp_then_cast(name):
    """saturate=True clamps finite overflow and +-inf to +-max; NaN stays NaN."""
    dtype = TORCH_DTYPES[name]
    x = torch.cat([_in_range_sample(name, 2**16, seed=5), _boundary_values(dtype)])
    top = torch.finfo(dtype).max
    expected = _torch_round(x.clamp(-top, top), dtype)
    got = round_to_format(x, name, saturate=True)
    _assert_same_bits(got, expected, x, f"{name} saturating")
    assert bool(torch.isfinite(got[~x.isnan()]).all())


# ---------------------------------------------------------------- 3. TF32


def _tf32_reference(value: float, saturate: bool) -> float:
    """Round a float32 value to TF32 in float64 arithmetic: scale by the TF32 spacing
    (``math.frexp``), round half to even (Python's ``round``), scale back."""
    if math.isnan(value) or value == 0:
        return value
    if math.isinf(value):
        return math.copysign(TF32_MAX, value) if saturate else value
    _, exponent = math.frexp(abs(value))  # |value| in [2^(exponent-1), 2^exponent)
    quantum = max(exponent - 1, -126) - 10  # 10 mantissa bits; subnormal spacing 2^-136
    rounded = math.ldexp(round(math.ldexp(abs(value), -quantum)), quantum)
    if rounded > TF32_MAX:
        rounded = TF32_MAX if saturate else math.inf
    return math.copysign(rounded, value)


def _tf32_tie_patterns(n: int, seed: int) -> torch.Tensor:
    """Random sign/exponent/top mantissa bits; bit 13 (TF32's last bit) even or odd; low 13
    bits just below, exactly at, and just above the halfway point 0x1000."""
    g = torch.Generator().manual_seed(seed)
    upper = torch.randint(0, 2**32, (n,), generator=g, dtype=torch.int64) & ~0x3FFF
    cases = [upper | last | low for last in (0, 0x2000) for low in (0x0FFF, 0x1000, 0x1001)]
    edges = torch.tensor([
        0x3FFFF000,  # 1.111...1|tie, odd: carries into the exponent, gives 2.0
        0x007FF000,  # largest float32 subnormals: carry to the smallest normal
        0x00001000, 0x00001001, 0x00003000,  # ties on the subnormal grid: 0, 2^-136, 2^-134
        0x7F7FE000, 0x7F7FEFFF,  # TF32 max and just below its overflow tie
        0x7F7FF000, 0x7F7FFFFF,  # overflow tie (rounds to even = 2^128) and float32 max
        0x7F800000, 0x7FC00000, 0x00000000,
    ], dtype=torch.int64)
    return _from_bits(torch.cat([*cases, edges, edges | 0x80000000]))


@pytest.mark.parametrize("saturate", [False, True])
def test_tf32_matches_independent_reference(saturate):
    x = torch.cat([_random_patterns(2**13, seed=6), _in_range_sample("tf32", 2**13, seed=7),
                   _tf32_tie_patterns(2**10, seed=8)])
    expected = torch.tensor([_tf32_reference(v, saturate) for v in x.tolist()],
                            dtype=torch.float32)
    got = round_to_tf32(x, saturate=saturate)
    _assert_same_bits(got, expected, x, f"tf32 (saturate={saturate})")
    finite = torch.isfinite(got)
    assert bool((_bits(got[finite]) & 0x1FFF == 0).all()), "low 13 mantissa bits not zero"


# ---------------------------------------------------------------- 4. TF32 matmul

K = 48  # short reductions keep the float32 accumulation bound well below TF32's error


def _accumulation_bound(abs_sum: torch.Tensor, terms: int) -> torch.Tensor:
    """Higham's ``gamma_n * sum |t_i|`` with ``gamma_n = n u / (1 - n u)``, ``u = 2^-24``
    (Accuracy and Stability of Numerical Algorithms, section 3.1): a float32 sum of ``n``
    exact terms, in any order, errs by at most this much."""
    u = 2.0**-24
    return terms * u / (1 - terms * u) * abs_sum


def test_tf32_matmul_rounds_inputs_and_accumulates_in_float32():
    g = torch.Generator().manual_seed(9)
    a, b = torch.randn(32, K, generator=g), torch.randn(K, 24, generator=g)
    at, bt = round_to_tf32(a), round_to_tf32(b)
    assert bool((_bits(at) & 0x1FFF == 0).all() and (_bits(bt) & 0x1FFF == 0).all())
    out = tf32_matmul(a, b)
    assert torch.equal(_bits(out), _bits(torch.matmul(at, bt)))

    exact = at.double() @ bt.double()  # TF32 products are exact; float64 sums nearly so
    bound = _accumulation_bound(at.abs().double() @ bt.abs().double(), K)
    excess = ((out.double() - exact).abs() - bound).max().item()
    assert excess <= 0, f"tf32_matmul exceeds the accumulation bound by {excess:.3g}"
    # Plain float32 inputs miss that bound almost everywhere: the rounding did happen.
    plain_outside = ((a @ b).double() - exact).abs() > bound
    assert plain_outside.float().mean().item() > 0.9, plain_outside.float().mean().item()


def test_tf32_linear_is_f_linear_on_tf32_inputs():
    g = torch.Generator().manual_seed(10)
    x = torch.randn(2, 5, K, generator=g)
    w = torch.randn(24, K, generator=g)
    bias = torch.randn(24, generator=g)
    xt, wt = round_to_tf32(x), round_to_tf32(w)
    for b in (None, bias):
        out = tf32_linear(x, w, b)
        assert out.shape == (2, 5, 24)
        assert torch.equal(_bits(out), _bits(F.linear(xt, wt, b)))
    exact = xt.double() @ wt.double().T + bias.double()
    err = (tf32_linear(x, w, bias).double() - exact).abs()
    bound = _accumulation_bound(xt.abs().double() @ wt.abs().double().T
                                + bias.abs().double(), K + 1)
    assert bool((err <= bound).all()), (err / bound).max().item()


# ---------------------------------------------------------------- 5. constants, ulp, inputs


@pytest.mark.parametrize("name", ["float32", *TORCH_DTYPES])
def test_format_constants_match_torch_finfo(name):
    dtype = TORCH_DTYPES.get(name, torch.float32)
    fmt, info = FORMATS[name], torch.finfo(dtype)
    code_one = torch.tensor(1, dtype=CODE_DTYPES[dtype])
    smallest_subnormal = code_one.view(dtype).float().item()
    assert fmt.max_normal == info.max
    assert fmt.min_normal == info.tiny == 2.0**fmt.emin
    assert fmt.min_subnormal == smallest_subnormal
    assert fmt.eps == info.eps == 2.0**-fmt.mantissa_bits
    assert 1 + fmt.exponent_bits + fmt.mantissa_bits == info.bits
    if dtype != torch.float32:
        assert fmt.has_inf == bool(_all_encodings(dtype).isinf().any())


def test_tf32_constants_share_float32_exponent():
    fmt, f32 = FORMATS["tf32"], FORMATS["float32"]
    assert (fmt.exponent_bits, fmt.mantissa_bits, fmt.bias) == (8, 10, 127)
    assert (fmt.min_normal, fmt.emax, fmt.has_inf) == (f32.min_normal, f32.emax, True)
    assert (fmt.max_normal, fmt.min_subnormal) == (TF32_MAX, 2.0**-136)


@pytest.mark.parametrize("name", list(TORCH_DTYPES))
def test_ulp_is_the_gap_to_the_next_value(name):
    values = _all_encodings(TORCH_DTYPES[name])
    grid = values[torch.isfinite(values) & (values >= 0)].unique()
    gaps = (grid[1:].double() - grid[:-1].double()).float()
    _assert_same_bits(ulp(grid[:-1], name), gaps, grid[:-1], f"{name} ulp")

    x = _in_range_sample(name, 2**14, seed=11)
    x = x[x.abs() <= FORMATS[name].max_normal]
    err = (round_to_format(x, name).double() - x.double()).abs()
    assert bool((err <= ulp(x, name).double() / 2).all())


def test_input_handling():
    x = torch.tensor([[1.0 + 2.0**-11, -0.0], [-(2.0**-26), math.nan]], dtype=torch.float64)
    got = round_to_format(x, "float16")
    assert got.dtype == torch.float32 and got.shape == (2, 2)
    _assert_same_bits(got.flatten(), _torch_round(x.float(), torch.float16).flatten(),
                      x.float().flatten(), "float64 input")
    assert torch.signbit(got[1, 0]) and got[1, 0] == 0  # tiny negative underflows to -0.0
    assert round_to_format(torch.ones(2, requires_grad=True), "bfloat16").grad_fn is None
    with pytest.raises(TypeError):
        round_to_format(torch.ones(2, dtype=torch.int32), "float16")
    with pytest.raises(ValueError, match="unknown format"):
        round_to_format(torch.ones(2), "fp4")
