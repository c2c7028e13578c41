# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown] nbgrader={"grade": false, "grade_id": "intro", "locked": true, "schema_version": 3, "solution": false, "task": false}
# # Lab 3: write the fp8 format from its bits, and repair a KV cache
#
# The engine in this lab stores its KV cache in fp8 e4m3, and someone replaced its
# quantizer with a hand-written one: it keeps the top 3 mantissa bits of each float32
# value and drops the rest. That is truncation, not rounding (chapter 3, §6); the setup
# cell below plants it and the next one measures what it costs. You will rebuild the number format from its
# definition and put correct rounding back into the engine.
#
# You write three functions. The grader calls them on **new** inputs (every bit pattern
# of formats you have not seen, random values, exact ties, subnormals, inf and NaN) and
# compares them **bit for bit** with `minivllm/numerics.py` and torch's own casts, so a
# function that only works on the examples here will not pass.
#
# 1. `decode_bits(bits, fmt)`: bit pattern -> value, 3 points;
# 2. `round_to(x, fmt, saturate)`: round float32 values to the format, 4 points;
# 3. `kv_quantize_e4m3(x, cache_dtype, scale)`: the engine's `"kv.quantize"` step written
#    with your `round_to`, 3 points;
#
# then the restore check, 7 points: your quantizer plugged into the engine.
#
# A format is described by a `minivllm.numerics.FloatFormat`: `fmt.exponent_bits` (E),
# `fmt.mantissa_bits` (M), `fmt.bias`, `fmt.max_normal`, `fmt.has_inf`. A bit pattern is
# `sign | E exponent bits | M mantissa bits`, 1 + E + M bits in all. Run the cells in
# order. Do not edit the setup and test cells.

# %% nbgrader={"grade": false, "grade_id": "setup", "locked": true, "schema_version": 3, "solution": false, "task": false}
import importlib
import math

import grading.checks as checks  # first import: records the original functions
import torch

from minivllm import LLM
from minivllm.numerics import FORMATS, FloatFormat, round_to_format
from minivllm.precision import evalsets, metrics
from minivllm.steps import reference

torch.manual_seed(0)
MODEL = "smollm2-135m-instruct"
FP16, BF16, E4M3, E5M2 = (FORMATS[k] for k in ("float16", "bfloat16", "fp8_e4m3", "fp8_e5m2"))
llm = LLM(MODEL, dtype="float32", kv_cache_dtype="fp8_e4m3", max_model_len=256,
          kv_cache_memory_bytes=16 << 20)
tok = llm.get_tokenizer()


def broken_kv_quantize(x, cache_dtype, scale=1.0):
    """The shipped e4m3 quantizer: clamp to +-448, then keep the top 3 mantissa bits of
    the float32 bit pattern (the cast afterwards is exact for normal e4m3 values)."""
    y = x.float()
    if not (isinstance(scale, float) and scale == 1.0):
        y = y / scale
    y = y.clamp(-448.0, 448.0)
    return (y.view(torch.int32) & ~0xFFFFF).view(torch.float32).to(cache_dtype)


# Plant the fault: from here on the engine's KV quantizer truncates (a swap_step left open;
# the tests swap other quantizers in on top of it, and it comes back after each).
_planted = llm.swap_step("kv.quantize", broken_kv_quantize)
_planted.__enter__()

# %% [markdown] nbgrader={"grade": false, "grade_id": "damage_text", "locked": true, "schema_version": 3, "solution": false, "task": false}
# What the planted quantizer costs, on one conversation: the engine's logits with it,
# against the same engine with its own quantizer swapped back in for a moment.

# %% nbgrader={"grade": false, "grade_id": "damage", "locked": true, "schema_version": 3, "solution": false, "task": false}
example = evalsets.conversation_sequences(tok, max_conversations=1, max_tokens=64)
with llm.swap_step("kv.quantize", reference("kv.quantize")):
    _builtin = torch.cat(llm.score(example, output="logits"))
_broken = torch.cat(llm.score(example, output="logits"))
print(f"example: {len(example[0])} tokens. Truncating quantizer against the engine's built-in "
      f"e4m3 cache: mean KL {metrics.mean_kl(_builtin, _broken):.2e} nats, top-1 agreement "
      f"{100 * metrics.top1_agreement(_builtin, _broken):.1f}%, "
      f"{int((_builtin != _broken).any(dim=1).sum())}/{len(_builtin)} positions with different "
      f"logits")

# %% [markdown] nbgrader={"grade": false, "grade_id": "task1", "locked": true, "schema_version": 3, "solution": false, "task": false}
# ## Task 1: from bit pattern to value (3 points)
#
# `bits` is an integer tensor of patterns in `[0, 2**(1 + E + M))`. Return a float32
# tensor of the same shape holding their values:
#
# - exponent field `e > 0`: normal, $(-1)^s \cdot (1 + m/2^M) \cdot 2^{e - \text{bias}}$;
# - `e == 0`: subnormal (or zero), $(-1)^s \cdot (m/2^M) \cdot 2^{1 - \text{bias}}$: no
#   implicit 1, and the exponent of `e = 1`; the sign is kept, so the pattern
#   `100...0` is `-0.0`;
# - `e` all ones: if `fmt.has_inf` (IEEE style: fp16, bf16, e5m2), `m == 0` is ±inf and
#   every other `m` is NaN; otherwise (e4m3's "fn" style) only `m` all ones is NaN and the
#   other patterns are ordinary normal numbers. Formats may be any width (6-bit, 5-bit:
#   every no-inf format here has that one NaN; OCP's fp4 e2m1, which has none, is not asked).
#
# Every value of a format that fits inside float32 is exactly a float32 number. Compute
# exactly: build powers of two from bits or with integer arithmetic, not with `2.0 **` on
# floats of unknown accuracy, and never round through a narrower type.

# %% nbgrader={"grade": false, "grade_id": "decode", "locked": false, "schema_version": 3, "solution": true, "task": false}
def decode_bits(bits: torch.Tensor, fmt: FloatFormat) -> torch.Tensor:
    ### BEGIN SOLUTION
    E, M, bias = fmt.exponent_bits, fmt.mantissa_bits, fmt.bias
    bits = torch.as_tensor(bits).to(torch.int64)
    sign = (bits >> (E + M)) & 1
    e = (bits >> M) & ((1 << E) - 1)
    m = bits & ((1 << M) - 1)
    sig = torch.where(e > 0, m + (1 << M), m)                   # implicit 1 for normals only
    exp = torch.where(e > 0, e, torch.ones_like(e)) - bias - M  # value = sig * 2^exp
    pow2 = ((exp + 1023) << 52).view(torch.float64)             # 2^exp, built from its bits
    mag = sig.to(torch.float64) * pow2                          # exact
    top = e == (1 << E) - 1
    if fmt.has_inf:
        mag = torch.where(top & (m == 0), torch.inf, mag)
        mag = torch.where(top & (m != 0), torch.nan, mag)
    else:
        mag = torch.where(top & (m == (1 << M) - 1), torch.nan, mag)
    return torch.where(sign == 1, -mag, mag).to(torch.float32)
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "test_decode_visible", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
# e4m3 by hand: 0x38 = 0.0111.000 -> 2^(7-7) = 1; 0x01 = the smallest subnormal 2^-9;
# 0x7E = 0.1111.110 -> 1.75 * 2^8 = 448 (no infinities in e4m3); 0xB4 = 1.0110.100 -> -0.75
_cases = {0x38: 1.0, 0x01: 2.0 ** -9, 0x08: 2.0 ** -6, 0x07: 7 * 2.0 ** -9, 0x7E: 448.0,
          0xB4: -0.75, 0x80: -0.0}
_got = decode_bits(torch.tensor(list(_cases)), E4M3)
checks.equal("decode_bits returns float32", _got.dtype, torch.float32)
for (_p, _want), _v in zip(_cases.items(), _got.tolist()):
    checks.equal(f"decode_bits(0x{_p:02X}, e4m3)", _v, _want)
checks.equal("sign of decode_bits(0x80, e4m3) (-0.0)", math.copysign(1.0, _got[-1].item()), -1.0)
checks.equal("decode_bits(0x7F, e4m3) is NaN",
             math.isnan(decode_bits(torch.tensor([0x7F]), E4M3).item()), True)
# fp16: 0x7C00 = +inf, 0x0001 = 2^-24
checks.equal("decode_bits(0x7C00, float16)", decode_bits(torch.tensor([0x7C00]), FP16).item(),
             math.inf)
checks.equal("decode_bits(0x0001, float16)", decode_bits(torch.tensor([0x0001]), FP16).item(),
             2.0 ** -24)
print("visible test passed")

# %% nbgrader={"grade": true, "grade_id": "test_decode_hidden", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
### BEGIN HIDDEN TESTS
def _oracle(pattern, fmt):
    """Value of one pattern, from the definition, in Python floats."""
    E, M, b = fmt.exponent_bits, fmt.mantissa_bits, fmt.bias
    s, e, m = (pattern >> (E + M)) & 1, (pattern >> M) & ((1 << E) - 1), pattern & ((1 << M) - 1)
    if e == (1 << E) - 1 and fmt.has_inf:
        v = math.inf if m == 0 else math.nan
    elif e == (1 << E) - 1 and m == (1 << M) - 1:
        v = math.nan
    elif e == 0:
        v = math.ldexp(m, 1 - b - M)
    else:
        v = math.ldexp(m + (1 << M), e - b - M)
    return -v if s else v


def _mismatch(name, got, want, inputs):
    """Bit-for-bit comparison (NaN payloads aside); the first few differences, for the message."""
    checks.equal(f"{name}: result dtype", got.dtype, torch.float32)
    checks.equal(f"{name}: result shape", tuple(got.shape), tuple(want.shape))
    gn, wn = torch.isnan(got), torch.isnan(want)
    bad = (gn != wn) | (~wn & (got.view(torch.int32) != want.view(torch.int32)))
    n = int(bad.sum())
    if n:
        idx = bad.nonzero()[:4, 0].tolist()
        ex = "; ".join(f"input {inputs[i]!r}: expected {want[i].item()!r}, got {got[i].item()!r}"
                       for i in idx)
        raise checks.CheckFailed(f"{name}: {n} of {want.numel()} results differ bit for bit "
                                 f"(a -0.0 for 0.0 counts). First ones: {ex}")


# Formats torch has: every bit pattern, against torch's own reinterpretation of the bits.
for _f, _it, _dt in ((FP16, torch.int16, torch.float16), (BF16, torch.int16, torch.bfloat16),
                     (E4M3, torch.uint8, torch.float8_e4m3fn),
                     (E5M2, torch.uint8, torch.float8_e5m2)):
    _n = 1 + _f.exponent_bits + _f.mantissa_bits
    _pats = torch.arange(2 ** _n)
    _raw = _pats.to(torch.int32).to(_it) if _it is torch.int16 else _pats.to(_it)
    _want = _raw.view(_dt).float()
    _mismatch(f"decode_bits(every pattern, {_f.name})", decode_bits(_pats, _f).reshape(-1),
              _want, [hex(p) for p in _pats.tolist()])
# Formats you have not seen (the oracle is the definition above; it agrees with torch on
# the four formats torch has, checked here too).
_unseen = [FloatFormat("e3m2", 3, 2, 3, 14.0, 2.0 ** -2, 2.0 ** -4, True, "IEEE style"),
           FloatFormat("e3m4fn", 3, 4, 3, 30.0, 2.0 ** -2, 2.0 ** -6, False, "S.111.1111 only"),
           FloatFormat("e4m3b11", 4, 3, 11, 28.0, 2.0 ** -10, 2.0 ** -13, False, "S.1111.111 only"),
           FloatFormat("e6m9", 6, 9, 31, (2 - 2.0 ** -9) * 2.0 ** 32, 2.0 ** -30, 2.0 ** -39,
                       True, "IEEE style"),
           # "fn" formats narrower than a byte (FP6- and FP5-sized): NaN is S.111.11 there
           FloatFormat("e3m2fn", 3, 2, 3, 24.0, 2.0 ** -2, 2.0 ** -4, False, "S.111.11 only"),
           FloatFormat("e2m2fn", 2, 2, 1, 6.0, 1.0, 0.25, False, "S.11.11 only")]
for _f in [E4M3, E5M2] + _unseen:
    _n = 1 + _f.exponent_bits + _f.mantissa_bits
    _pats = torch.arange(2 ** _n)
    _want = torch.tensor([_oracle(p, _f) for p in _pats.tolist()], dtype=torch.float64).float()
    _mismatch(f"decode_bits(every pattern, {_f.name})", decode_bits(_pats, _f).reshape(-1),
              _want, [hex(p) for p in _pats.tolist()])
# any shape, any integer dtype
_p2 = torch.randint(0, 256, (7, 5), generator=torch.Generator().manual_seed(99), dtype=torch.int32)
_mismatch("decode_bits on a [7, 5] int32 tensor (e5m2)", decode_bits(_p2, E5M2).reshape(-1),
          _p2.to(torch.uint8).view(torch.float8_e5m2).float().reshape(-1), _p2.reshape(-1).tolist())
checks.equal("decode_bits keeps the input's shape", tuple(decode_bits(_p2, E5M2).shape), (7, 5))
### END HIDDEN TESTS

# %% [markdown] nbgrader={"grade": false, "grade_id": "task2", "locked": true, "schema_version": 3, "solution": false, "task": false}
# ## Task 2: round to nearest, ties to even (4 points)
#
# Return `x` (any float tensor; convert it to float32 first) rounded to the nearest value
# of `fmt`, as a float32 tensor of the same shape, bit for bit what
# `round_to_format(x, fmt, saturate)` gives (do not call it, nor torch's casts). Work on
# the float32 bit pattern, `x.float().view(torch.int32)`:
#
# 1. split it into sign, exponent field and fraction; the significand is the fraction
#    with the implicit 1 (bit 23) added for normal float32 numbers, so that
#    $|x| = \text{sig} \cdot 2^{e - 23}$ (float32 subnormals: no implicit 1, $e = -126$);
# 2. the spacing of `fmt` at $|x|$ is $2^q$ with $q = \max(e, e_\min) - M$,
#    $e_\min = 1 - \text{bias}$: the `max` is what makes subnormals (below $2^{e_\min}$
#    the spacing stops shrinking);
# 3. drop the low `shift = q - (e - 23)` bits of `sig`, rounding to nearest: up if the
#    dropped part is more than half, down if less, and **on an exact half, to the even
#    neighbour** (the kept part's last bit 0). Never just drop the bits: that is the bug in
#    this engine;
# 4. the result is `units * 2^q` (exact in float32; make $2^q$ from bits);
# 5. a result above `fmt.max_normal` (and ±inf input) is ±`max_normal` when `saturate`,
#    else ±inf if `fmt.has_inf`, else NaN; NaN stays NaN (any NaN bit pattern will do);
#    the sign is kept, also on 0.
#
# Use `int32` tensors (the float32 bits fit) and keep shifts in 0..30.

# %% nbgrader={"grade": false, "grade_id": "round_to", "locked": false, "schema_version": 3, "solution": true, "task": false}
def round_to(x: torch.Tensor, fmt: FloatFormat, saturate: bool = False) -> torch.Tensor:
    ### BEGIN SOLUTION
    M, emin = fmt.mantissa_bits, 1 - fmt.bias
    bits = x.detach().to(torch.float32).contiguous().view(torch.int32)
    mag = bits & 0x7FFFFFFF
    efield, frac = mag >> 23, mag & 0x7FFFFF
    normal = efield > 0
    sig = torch.where(normal, frac | 0x800000, frac)               # |x| = sig * 2^(e - 23)
    e = torch.where(normal, efield, torch.ones_like(efield)) - 127
    q = e.clamp(min=emin) - M                                     # spacing 2^q
    shift = (q - (e - 23)).clamp(0, 30)
    keep = sig >> shift
    rem = sig - (keep << shift)
    half = (torch.ones_like(shift) << shift) >> 1
    up = (rem > half) | ((rem == half) & (half > 0) & ((keep & 1) == 1))
    units = keep + up.to(torch.int32)
    pow2 = torch.where(q >= -126, (q + 127).clamp(min=1) << 23,       # 2^q from its bits
                       torch.ones_like(q) << (q + 149).clamp(0, 22)).view(torch.float32)
    val = units.to(torch.float32) * pow2                          # exact: a value of fmt
    over = fmt.max_normal if saturate else (math.inf if fmt.has_inf else math.nan)
    val = torch.where((val > fmt.max_normal) | (mag == 0x7F800000),
                      torch.tensor(over, dtype=torch.float32), val)
    val = torch.where(mag > 0x7F800000, torch.tensor(math.nan, dtype=torch.float32), val)
    return torch.where(bits < 0, -val, val)
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "test_round_visible", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
# e4m3 near 1 has spacing 1/8: 1.1 -> 1.125 (nearest, not 1.0); 1.0625 is a tie between
# 1.0 (mantissa 000, even) and 1.125 (001) -> 1.0; 1.1875 ties 1.125 / 1.25 -> 1.25 (even);
# 3 * 2^-10 is a tie between the subnormals 2^-9 and 2^-8 -> 2^-8 (even);
# 0.0153 is just under 2^-6 -> the subnormal 8 * 2^-9 = 2^-6; 5e-4 < 2^-10 -> 0;
# 460 -> 448; 464 ties 448 / 480 -> 448; 470 overflows -> NaN (no inf) or 448 (saturate)
_x = torch.tensor([1.1, 1.0625, 1.1875, -1.1, 3 * 2.0 ** -10, 0.0153, 0.011, 5e-4, -5e-4,
                   460.0, 464.0, 470.0, -1e6])
_want = [1.125, 1.0, 1.25, -1.125, 2.0 ** -8, 2.0 ** -6, 6 * 2.0 ** -9, 0.0, -0.0, 448.0,
         448.0, math.nan, math.nan]
_got = round_to(_x, E4M3).tolist()
for _xi, _w, _g in zip(_x.tolist(), _want, _got):
    if math.isnan(_w):
        checks.equal(f"round_to({_xi!r}, e4m3) is NaN (overflow, no inf)", math.isnan(_g), True)
    else:
        checks.equal(f"round_to({_xi!r}, e4m3)", _g, _w)
        checks.equal(f"sign of round_to({_xi!r}, e4m3)", math.copysign(1, _g), math.copysign(1, _w))
checks.equal("round_to(470, e4m3, saturate=True)",
             round_to(torch.tensor([470.0]), E4M3, True).item(), 448.0)
checks.equal("round_to(70000, float16)", round_to(torch.tensor([7e4]), FP16).item(), math.inf)
# and against the engine's reference on a few hundred values
_v = torch.randn(500, generator=torch.Generator().manual_seed(3)) * 8
for _f in (E4M3, E5M2, FP16, BF16):
    _g, _r = round_to(_v, _f), round_to_format(_v, _f)
    checks.equal(f"round_to(randn * 8, {_f.name}): values different from round_to_format",
                 int((_g.view(torch.int32) != _r.view(torch.int32)).sum()), 0)
print("visible test passed")

# %% nbgrader={"grade": true, "grade_id": "test_round_hidden", "locked": true, "points": 3, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
### BEGIN HIDDEN TESTS
def _mismatch(name, got, want, inputs):
    checks.equal(f"{name}: result dtype", got.dtype, torch.float32)
    checks.equal(f"{name}: result shape", tuple(got.shape), tuple(want.shape))
    got, want, inputs = got.reshape(-1), want.reshape(-1), inputs.reshape(-1)
    gn, wn = torch.isnan(got), torch.isnan(want)
    bad = (gn != wn) | (~wn & (got.view(torch.int32) != want.view(torch.int32)))
    n = int(bad.sum())
    if n:
        idx = bad.nonzero()[:4, 0].tolist()
        ex = "; ".join(f"x = {inputs[i].item()!r}: expected {want[i].item()!r}, got "
                       f"{got[i].item()!r}" for i in idx)
        raise checks.CheckFailed(f"{name}: {n} of {want.numel()} results differ bit for bit "
                                 f"from numerics.round_to_format (-0.0 vs 0.0 counts). First "
                                 f"ones: {ex}")


def _midpoints(fmt, n, g):
    """n exact midpoints between neighbouring values of fmt (for formats too wide to list),
    the ones float32 can hold: a random value of fmt plus half its spacing."""
    M, emin = fmt.mantissa_bits, 1 - fmt.bias
    v = round_to_format(2.0 ** torch.empty(n).uniform_(math.log2(fmt.min_subnormal),
                                                        math.log2(fmt.max_normal) - 1,
                                                        generator=g), fmt).double()
    ex = torch.floor(torch.log2(v)).clamp(min=emin)
    mid = v + 2.0 ** (ex - M) / 2
    return mid[mid.float().double() == mid].float()


def _grid(fmt):
    """Every finite non-negative value of fmt (positive patterns through the reference)."""
    E, M = fmt.exponent_bits, fmt.mantissa_bits
    e = torch.arange(0, 2 ** E, dtype=torch.float64)[:, None]
    m = torch.arange(0, 2 ** M, dtype=torch.float64)[None, :]
    v = torch.where(e > 0, (1 + m / 2 ** M) * 2.0 ** (e - fmt.bias),
                    m / 2 ** M * 2.0 ** (1 - fmt.bias))
    v = v.reshape(-1)
    return v[v <= fmt.max_normal].float().unique()


_g = torch.Generator().manual_seed(20261201)
_fmts = [FP16, BF16, E4M3, E5M2, FORMATS["tf32"],
         FloatFormat("e3m2", 3, 2, 3, 14.0, 2.0 ** -2, 2.0 ** -4, True, "IEEE style"),
         FloatFormat("e3m4fn", 3, 4, 3, 30.0, 2.0 ** -2, 2.0 ** -6, False, "S.111.1111 only"),
         FloatFormat("e4m3b11", 4, 3, 11, 28.0, 2.0 ** -10, 2.0 ** -13, False, "S.1111.111 only"),
         # the widest formats float32 holds: a shift of 1 (ties at half = 1) and of 0 (no
         # bit dropped: float32 itself, every float32 value is its own rounding)
         FloatFormat("e8m22", 8, 22, 127, (2 - 2.0 ** -22) * 2.0 ** 127, 2.0 ** -126,
                     2.0 ** -148, True, "IEEE style"),
         FORMATS["float32"]]
for _f in _fmts:
    if _f.exponent_bits + _f.mantissa_bits <= 18:
        _grid_v = _grid(_f)
        _ties = (_grid_v[:-1] + _grid_v[1:]) / 2                   # exact midpoints
    else:
        _ties = _midpoints(_f, 80_000, _g)
    _lo, _hi = math.log2(_f.min_subnormal / 8), min(math.log2(_f.max_normal * 4), 127.5)
    _mag = 2.0 ** torch.empty(40_000).uniform_(_lo, _hi, generator=_g)
    _raw = torch.randint(-2 ** 31, 2 ** 31, (40_000,), generator=_g,  # any float32 pattern,
                         dtype=torch.int64).to(torch.int32).view(torch.float32)  # NaN/inf too
    _special = torch.tensor([0.0, -0.0, math.inf, -math.inf, math.nan, _f.max_normal,
                             -_f.max_normal, _f.min_subnormal / 2, -_f.min_subnormal / 2,
                             _f.min_subnormal * 0.5000001, _f.min_normal, 1e-45, 3.4e38,
                             -3.4028234663852886e38])
    # NaNs with the smallest and the largest payloads, either sign (0x7F800001 is NaN too)
    _nans = torch.tensor([0x7F800001, 0x7FFFFFFF, 0x7FC00000, -0x7FFFFFFF, -1],
                         dtype=torch.int64).to(torch.int32).view(torch.float32)
    _special = torch.cat([_special, _nans])
    _x = torch.cat([_mag, -_mag[:10_000], _ties[-20_000:], -_ties[:20_000], _raw, _special])
    _x = _x[torch.randperm(_x.numel(), generator=_g)]
    for _sat in (False, True):
        _mismatch(f"round_to(x, {_f.name}, saturate={_sat}) on {_x.numel()} fresh values "
                  f"(random, exact ties, subnormals, inf, NaN)",
                  round_to(_x, _f, _sat), round_to_format(_x, _f, saturate=_sat), _x)
# other input dtypes and shapes
_x64 = torch.randn(6, 9, generator=_g, dtype=torch.float64)
_mismatch("round_to(float64 [6, 9], e5m2)", round_to(_x64, E5M2), round_to_format(_x64, E5M2), _x64)
_xb = torch.randn(4, 4, 4, generator=_g).to(torch.bfloat16)
_mismatch("round_to(bfloat16 [4, 4, 4], e4m3)", round_to(_xb, E4M3), round_to_format(_xb, E4M3),
          _xb)
# a tensor that requires grad (activations captured in a training loop) rounds the same,
# and the caller's tensor is left as it was
_xg = (torch.randn(64, generator=_g) * 20).requires_grad_()
_mismatch("round_to(x with requires_grad=True, e4m3)", checks.call("round_to", round_to, _xg, E4M3),
          round_to_format(_xg.detach(), E4M3), _xg.detach())
### END HIDDEN TESTS

# %% [markdown] nbgrader={"grade": false, "grade_id": "task3", "locked": true, "schema_version": 3, "solution": false, "task": false}
# ## Task 3: repair the engine's KV quantizer (3 points, then the restore check: 7)
#
# Write the `"kv.quantize"` step for an fp8 e4m3 cache with your `round_to`:
# `kv_quantize_e4m3(x, cache_dtype, scale)` gets K or V as `[tokens, kv_heads, head_dim]`
# float32, the cache's dtype (`torch.float8_e4m3fn`) and the scale (a float, or a tensor
# that broadcasts against `x`: per head `[kv_heads, 1]`, per token `[tokens, kv_heads,
# 1]`). It returns `x / scale` rounded to e4m3, **saturating** (vLLM's cache kernels
# clamp to ±448), as a tensor of dtype `cache_dtype`. Divide exactly as written
# (`x / scale`); the engine's reference is `quantize_kv` in
# `minivllm/quantization/kv_cache.py` (do not call it).
#
# The grader plugs your function into the engine with
# `llm.swap_step("kv.quantize", kv_quantize_e4m3)` on conversations you have not seen.
# Accuracy is restored when the logits are **bit-identical** to the engine's built-in
# e4m3 cache (mean KL exactly 0); the same check is run on the planted quantizer, which
# must fail it.

# %% nbgrader={"grade": false, "grade_id": "kv_quantize", "locked": false, "schema_version": 3, "solution": true, "task": false}
def kv_quantize_e4m3(x: torch.Tensor, cache_dtype: torch.dtype, scale=1.0) -> torch.Tensor:
    ### BEGIN SOLUTION
    return round_to(x.float() / scale, E4M3, saturate=True).to(cache_dtype)
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "test_kv_quantize_visible", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
from minivllm.quantization.kv_cache import quantize_kv as _ref_q

_k = torch.randn(24, 3, 64, generator=torch.Generator().manual_seed(5)) * 3
_k[0, 0, :4] = torch.tensor([600.0, -1000.0, 0.004, -0.0007])  # saturates; subnormals
for _s in (1.0, 0.05):
    _got = kv_quantize_e4m3(_k, torch.float8_e4m3fn, _s)
    checks.equal(f"kv_quantize_e4m3(..., scale={_s}) dtype", _got.dtype, torch.float8_e4m3fn)
    _want = _ref_q(_k, torch.float8_e4m3fn, _s)
    _bad = (_got.view(torch.uint8) != _want.view(torch.uint8)).reshape(-1)
    if bool(_bad.any()):
        _i = int(_bad.nonzero()[0, 0])
        raise checks.CheckFailed(
            f"kv_quantize_e4m3(x, float8_e4m3fn, scale={_s}): {int(_bad.sum())} of {_bad.numel()} "
            f"stored values differ from the engine's reference; e.g. x = "
            f"{_k.reshape(-1)[_i].item()!r}: expected {_want.reshape(-1)[_i].float().item()!r}, "
            f"got {_got.reshape(-1)[_i].float().item()!r}")
print("visible test passed")

# %% nbgrader={"grade": true, "grade_id": "test_kv_quantize_hidden", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
### BEGIN HIDDEN TESTS
from minivllm.quantization.kv_cache import quantize_kv as _ref_q

# unit: per-head and per-token scales, every e4m3 value and its ties, values past 448
_g = torch.Generator().manual_seed(77)
_k = torch.randn(40, 3, 64, generator=_g) * torch.logspace(-4, 3, 64)  # magnitudes 1e-4..1e3
for _s in (torch.tensor([[0.5], [0.01], [2.0]]), torch.rand(40, 3, 1, generator=_g) * 0.1 + 1e-3):
    _got = kv_quantize_e4m3(_k, torch.float8_e4m3fn, _s)
    checks.equal("kv_quantize_e4m3 dtype", _got.dtype, torch.float8_e4m3fn)
    checks.equal(f"kv_quantize_e4m3 with a tensor scale of shape {tuple(_s.shape)}: stored bytes "
                 f"different from the reference",
                 int((_got.view(torch.uint8)
                      != _ref_q(_k, torch.float8_e4m3fn, _s).view(torch.uint8)).sum()), 0)
# "Divide exactly as written": x / s and x * (1 / s) differ by an ulp now and then, and
# where x / s is a midpoint between two e4m3 values, that ulp picks the other neighbour.
# Inputs built to land there, one scale per token ([tokens, 1, 1]), kept where the two
# computations store different bytes (the check shows it can tell them apart).
_mids = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()
_mids = _mids[torch.isfinite(_mids) & (_mids > 0)].unique()
_mids = (_mids[:-1] + _mids[1:]) / 2
_sc = torch.rand(20_000, generator=_g) * 0.2 + 1e-3
_t = _mids[torch.randint(0, len(_mids), (20_000,), generator=_g)]
_xm = (_t.double() * _sc.double()).float()
_sc, _xm = _sc.reshape(-1, 1, 1), _xm.reshape(-1, 1, 1)
_by_div = _ref_q(_xm, torch.float8_e4m3fn, _sc).view(torch.uint8)
_by_mul = _ref_q(_xm * (1.0 / _sc), torch.float8_e4m3fn, 1.0).view(torch.uint8)
_sel = (_by_div != _by_mul).reshape(-1)
checks.at_most("inputs where x / s and x * (1 / s) round apart (the check needs some)",
               -int(_sel.sum()), -20)
checks.equal(f"kv_quantize_e4m3 on {int(_sel.sum())} values whose x / scale lands on a "
             f"midpoint between e4m3 neighbours: stored bytes different from the reference",
             int((kv_quantize_e4m3(_xm[_sel], torch.float8_e4m3fn, _sc[_sel]).view(torch.uint8)
                  != _by_div[_sel]).sum()), 0)
# a Python float scale: x / scale divides the float32 x by the scale as float32; dividing
# in float64 (x.double() / scale) uses another divisor, and next to a tie that stores the
# other byte. Inputs within 3 ulps of (midpoint x scale), one scale per call (a scale of 4
# decimals, like 0.05, is not a float32 number).
_hits = 0
for _s in [round(float(v), 4) for v in torch.rand(40, generator=_g) * 0.2 + 0.01]:  # 4 decimals
    _base = (_mids.double() * _s).float()
    _xs = torch.cat([_base.view(torch.int32) + _d for _d in range(-3, 4)]).view(torch.float32)
    _xs = _xs.reshape(-1, 1, 1)
    _want = _ref_q(_xs, torch.float8_e4m3fn, _s).view(torch.uint8)
    _hits += int((_ref_q((_xs.double() / _s).float(), torch.float8_e4m3fn, 1.0)
                  .view(torch.uint8) != _want).sum())
    checks.equal(f"kv_quantize_e4m3 at scale={_s!r} (a Python float) on {len(_xs)} values next "
                 f"to (e4m3 midpoint x scale): stored bytes different from the reference",
                 int((kv_quantize_e4m3(_xs, torch.float8_e4m3fn, _s).view(torch.uint8)
                      != _want).sum()), 0)
if _hits < 5:
    raise checks.CheckFailed(f"only {_hits} inputs where float64 division stores another byte: "
                             "the check cannot tell; tell the course staff")
_vals = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()
_vals = _vals[torch.isfinite(_vals)].unique()
_x = torch.cat([_vals, (_vals[:-1] + _vals[1:]) / 2, torch.tensor([449.0, 464.0, 500.0, -1e4])])
_x = _x.reshape(-1, 1, 1)  # [tokens, heads, head_dim] = [N, 1, 1]
checks.equal("kv_quantize_e4m3 on every e4m3 value, every tie between neighbours and values "
             "past 448: stored bytes different from the reference",
             int((kv_quantize_e4m3(_x, torch.float8_e4m3fn, 1.0).view(torch.uint8)
                  != _ref_q(_x, torch.float8_e4m3fn, 1.0).view(torch.uint8)).sum()), 0)
### END HIDDEN TESTS

# %% [markdown] nbgrader={"grade": false, "grade_id": "restore_text", "locked": true, "schema_version": 3, "solution": false, "task": false}
# ## Restore check (7 points)
#
# Your quantizer in the engine, on conversations you have not seen: the logits must be
# bit-identical to the built-in e4m3 cache's, and the planted truncation must fail the
# same check.

# %% nbgrader={"grade": true, "grade_id": "test_restore", "locked": true, "points": 7, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
### BEGIN HIDDEN TESTS
from minivllm.quantization.kv_cache import quantize_kv as _ref_q

# integration: the engine, fresh conversations, the learner's quantizer against the built-in
checks.equal("kv_quantize_e4m3(x, torch.float8_e4m3fn) dtype (what the cache stores)",
             kv_quantize_e4m3(torch.ones(2, 3, 64), torch.float8_e4m3fn, 1.0).dtype,
             torch.float8_e4m3fn)
_seqs = [s[:64] for s in evalsets.conversation_sequences(tok, max_conversations=7)[5:7]]
with llm.swap_step("kv.quantize", reference("kv.quantize")):
    _want = torch.cat(llm.score(_seqs, output="logits"))
with llm.swap_step("kv.quantize", kv_quantize_e4m3):
    _got = torch.cat(llm.score(_seqs, output="logits"))
_bad = torch.cat(llm.score(_seqs, output="logits"))  # the planted truncation, still in place


def _report(rows):
    diff = (rows != _want).any(dim=1)
    finite = bool(torch.isfinite(rows).all())
    return (int(diff.sum()), metrics.mean_kl(_want, rows) if finite else math.nan,
            float((rows - _want).abs().max()) if finite else math.nan)


_nb, _klb, _db = _report(_bad)
_ng, _klg, _dg = _report(_got)
print(f"{len(_want)} positions of 2 unseen conversations, against the built-in e4m3 cache:\n"
      f"  planted (truncating) quantizer: {_nb} positions differ, mean KL {_klb:.3e} nats, "
      f"max |logit diff| {_db:.3g}\n"
      f"  your kv_quantize_e4m3:          {_ng} positions differ, mean KL {_klg:.3e} nats, "
      f"max |logit diff| {_dg:.3g}")
# the check must discriminate: the planted quantizer fails it
if _nb == 0:
    raise checks.CheckFailed("the planted quantizer passes the check, so it cannot tell a fix "
                             "from the fault; tell the course staff")
if _ng:
    raise checks.CheckFailed(
        f"the engine with your quantizer: expected logits bit-identical to the built-in fp8 "
        f"e4m3 cache (mean KL exactly 0) at all {len(_want)} positions; measured {_ng} "
        f"positions differ, mean KL {_klg:.3e} nats, max |logit diff| {_dg:.3g} (the planted "
        f"truncation: KL {_klb:.3e}). Look for values your rounding sends to a different "
        f"neighbour: ties, subnormals, saturation.")
checks.equal("mean KL of your quantizer against the built-in cache (nats)", _klg, 0.0)
### END HIDDEN TESTS
