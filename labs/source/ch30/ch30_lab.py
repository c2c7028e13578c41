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
# # Lab 30: FP4 weights and a batch-invariant matmul
#
# Chapter 30 measured two things this lab makes you build:
#
# - **FP4 weights.** MXFP4 (blocks of 32, a power-of-two E8M0 scale) lost 2 to 3.5 times
#   the KL of NVFP4 (blocks of 16, an E4M3 scale and a float32 tensor scale) at nearly the
#   same bits per weight (chapter 30 prints its own run's ratio on the course's text;
#   `benchmarks/RESULTS.md` records 2.3x on another). You write both formats; then, in
#   a memory budget that NVFP4 everywhere does not fit, you decide which projections get
#   NVFP4, and the engine runs your plan with your quantizers.
# - **Batch invariance.** Torch's float32 GEMM gives a row different bits depending on
#   how many rows share the call, so a request's logits change with the batch. You
#   write a batched matmul whose every row is a function of that row alone, and it goes
#   into the engine as its `"linear"` step.
#
# The grader calls your functions on **new** inputs (zero blocks, outliers, exact ties,
# rounding midpoints, other shapes and batch sizes, bad inputs), compares the formats with
# the engine's bit for bit and the matmul with float64 and with itself across batches,
# then plugs your code into the engine on text you have not seen:
#
# 1. `quantize_mxfp4(w)` and `dequantize_mxfp4(packed, scales)`, 4 points;
# 2. `quantize_nvfp4(w)`, 4 points;
# 3. `batch_invariant_matmul(a, b)`, 4 points;
# 4. `NVFP4_KINDS`, which projections get NVFP4 in a memory budget (a decision), checked
#    in the engine with your quantizers, 5 points;
# 5. your matmul in the engine, 4 points (no code to write: it runs your function).
#
# Run the cells in order. Do not edit the setup, helper and test cells.

# %% nbgrader={"grade": false, "grade_id": "setup", "locked": true, "schema_version": 3, "solution": false, "task": false}
import contextlib
import importlib

import grading.checks as checks  # first import: records the original functions
import torch

from minivllm import LLM
from minivllm.attention.backends.torch_ref import decode_attention_batch_invariant
from minivllm.layers.linear import Linear, linear_ref, rowwise
from minivllm.models.llama import lm_head_ref
from minivllm.models.loader import resolve_model_path
from minivllm.precision import evalsets, metrics
from minivllm.precision.batching import decode_logits_beside
from minivllm.quantization import fp4
from minivllm.tokenizer import get_tokenizer

torch.manual_seed(0)
MODEL = "smollm2-135m-instruct"
COMMON = dict(dtype="float32", max_model_len=256, kv_cache_memory_bytes=16 << 20)
E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # codes 0..7; 8..15 are their negatives
tokenizer = get_tokenizer(str(resolve_model_path(MODEL)))  # the tokenizer only: no engine yet
_ENGINES = {}


def engine() -> LLM:
    """The float32 engine of tasks 4 and 5, built on first use and then reused."""
    if "float32" not in _ENGINES:
        _ENGINES["float32"] = LLM(MODEL, **COMMON)
    return _ENGINES["float32"]


def as_linear(matmul):
    """The engine's "linear" step, ``linear(x [..., K], weight [N, K], bias)``, computed by
    ``matmul(a [M, K], b [K, N])`` on the flattened rows of x."""
    def linear(x, weight, bias):
        y = matmul(x.reshape(-1, x.shape[-1]), weight.t()).reshape(*x.shape[:-1], weight.shape[0])
        return y if bias is None else y + bias
    return linear


def invariant_engine(llm, linear):
    """``with invariant_engine(llm, linear):`` the engine's batch-invariant decode attention
    and a row-at-a-time LM head (what ``batch_invariant=True`` uses on a CPU), and
    ``linear`` as every decoder linear layer."""
    stack = contextlib.ExitStack()
    stack.enter_context(llm.swap_step("attention.decode", decode_attention_batch_invariant))
    stack.enter_context(llm.swap_step("lm_head", lambda h, w: rowwise(lm_head_ref, h, w)))
    stack.enter_context(llm.swap_step("linear", linear))
    return stack


print("E2M1 values of codes 0..7:", E2M1_GRID)


# %% [markdown] nbgrader={"grade": false, "grade_id": "task1", "locked": true, "schema_version": 3, "solution": false, "task": false}
# ## Task 1: MXFP4 (4 points)
#
# **E2M1 codes** (both formats use them). A code is 4 bits, `sign << 3 | magnitude index`,
# the index being the position in `E2M1_GRID` of the value nearest to `|x|`: round to
# nearest, a tie goes to the **even** index (so 0.25 -> 0, 0.75 -> 1.0, 2.5 -> 2.0,
# 5 -> 4.0), and anything above 6 saturates to 6 (index 7). The sign bit is
# `torch.signbit(x)`: a negative value that rounds to 0 gets code 8 (-0). Two codes share
# a byte: the element with the even index in the **low** nibble, `c[0::2] | c[1::2] << 4`.
#
# Write `quantize_mxfp4(w)` for a 2-D float weight `w` `[out, in]` (any float dtype;
# compute in float32; do not modify `w`). `in` must be a multiple of 32, and `w` must be
# finite; otherwise raise `ValueError`. For each block of 32 consecutive inputs of a row:
#
# - `amax` = max |w| over the block; the exponent `e = floor(log2(amax)) - 2` (the OCP MX
#   rule: the block's largest value lands in [4, 8) grid units), or `e = -127` for a block
#   of zeros; clamp `e` to [-127, 127];
# - the codes of `w / 2**e` (divide by the float32 power of two);
# - the scale byte is `e + 127` (E8M0: a biased exponent, no mantissa).
#
# Return `(packed, scales)`: `packed` uint8 `[out, in / 2]`, `scales` uint8
# `[out, in / 32]`. Then `dequantize_mxfp4(packed, scales)`: each code's value times
# `2 ** (byte - 127)` of its block, float32 `[out, in]`. The grader compares with the
# engine's `minivllm.quantization.fp4` bit for bit.

# %% nbgrader={"grade": false, "grade_id": "mxfp4", "locked": false, "schema_version": 3, "solution": true, "task": false}
def quantize_mxfp4(w: torch.Tensor):
    ### BEGIN SOLUTION
    if w.ndim != 2 or not w.is_floating_point() or w.shape[1] % 32:
        raise ValueError(f"w must be a 2-D float [out, in] with in a multiple of 32, got "
                         f"{tuple(w.shape)} {w.dtype}")
    if not bool(torch.isfinite(w).all()):
        raise ValueError("w has NaN or infinite values")
    wb = w.detach().float().reshape(w.shape[0], -1, 32)
    amax = wb.abs().amax(-1)
    e = torch.where(amax > 0, torch.floor(torch.log2(amax.clamp_min(2.0 ** -126))) - 2,
                    torch.full_like(amax, -127.0)).clamp(-127, 127)
    x = wb / torch.exp2(e)[..., None]
    a = x.abs()
    # the grid's steps are 0.5 below 2, 1 below 4, 2 above: index = round(a / step) + offset,
    # and torch.round's half-to-even lands every tie on the even index
    idx = torch.where(a < 2, torch.round(a * 2),
                      torch.where(a < 4, torch.round(a) + 2, torch.round(a / 2) + 4)).clamp(max=7)
    codes = (idx.to(torch.uint8) | (torch.signbit(x).to(torch.uint8) << 3)).reshape(w.shape)
    return codes[:, 0::2] | (codes[:, 1::2] << 4), (e + 127).to(torch.uint8)
    ### END SOLUTION


def dequantize_mxfp4(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    ### BEGIN SOLUTION
    codes = torch.stack((packed & 15, packed >> 4), -1).reshape(packed.shape[0], -1).long()
    grid = torch.tensor(E2M1_GRID)
    v = torch.cat([grid, -grid])[codes]
    out, n = v.shape
    scale = torch.exp2(scales.float() - 127)
    return (v.reshape(out, scale.shape[1], -1) * scale[..., None]).reshape(out, n)
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "test_mxfp4_visible", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
_w = torch.zeros(2, 32)
_w[0, :4] = torch.tensor([1.0, -0.5, 6.0, 0.0])  # amax 6: e = 0, byte 127
_p, _s = quantize_mxfp4(_w.clone())
checks.equal("scales dtype and shape", (_s.dtype, tuple(_s.shape)), (torch.uint8, (2, 1)))
checks.equal("scale bytes (amax 6; a zero block)", _s.flatten().tolist(), [127, 0])
checks.equal("packed dtype and shape", (_p.dtype, tuple(_p.shape)), (torch.uint8, (2, 16)))
checks.equal("first two bytes of row 0: codes (2, 9) and (7, 0)", _p[0, :2].tolist(), [0x92, 0x07])
_back = dequantize_mxfp4(_p, _s)
checks.equal("dequantized row 0, first four", _back[0, :4].tolist(), [1.0, -0.5, 6.0, 0.0])
checks.equal("dequantized dtype", _back.dtype, torch.float32)
print("visible test passed")

# %% nbgrader={"grade": true, "grade_id": "test_mxfp4_hidden", "locked": true, "points": 3, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
### BEGIN HIDDEN TESTS
def _fp4_cases(block):
    g = torch.Generator().manual_seed(3030 + block)
    a = torch.randn(37, 6 * block, generator=g) * 0.05
    a[2, :block] = 0                                          # a zero block
    a[5, 3] = 40.0                                            # an outlier
    a[7, block:2 * block] = torch.randn(block, generator=g) * 1e-8   # a tiny block
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.75, -1.25, -1.75,
                         -2.5, -3.5, -5.0, -0.1, 7.9])
    a[9, :16] = ties                                         # amax 7.9: e = 0 (MXFP4), ties
    a[9, 16:block] = 0.5
    # exact ties after NVFP4 scaling: tensor amax 2.625 gives weight_scale_2 = 2^-10, block
    # scales 448 and 8 (exact in E4M3), so w / scale lands on the midpoints exactly
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.1])
    exact = torch.zeros(2, 2 * block)
    exact[0, :8], exact[0, 8] = mids * 448 * 2.0 ** -10, 2.625
    exact[0, 16:24], exact[0, 24] = -mids * 8 * 2.0 ** -10, 6 * 8 * 2.0 ** -10
    big = torch.randn(128, 256, generator=g) * torch.exp(torch.randn(128, 1, generator=g))
    half = (torch.randn(24, 2 * block, generator=g) * 0.02).to(torch.bfloat16)
    # a tensor scale that is not a power of two (amax 1.0: weight_scale_2 = 1 / 2688):
    # blocks 1-2 have amax / 6 / weight_scale_2 within an ulp of the E4M3 midpoints 15.5
    # and 9.5, blocks 3-4 (E4M3 scales 36 and 44) hold values whose w / scale is an E2M1
    # midpoint: each rounds one way computed as specified, the other way with a reciprocal
    recip = torch.zeros(1, 96)
    recip[0, [0, 16, 32, 48, 64]] = torch.tensor([1.0, 0.0345982126891613, 0.02120535634458065,
                                                  36 * 6 / 2688, 44 * 6 / 2688])
    recip[0, 49:54] = torch.tensor([0.00334821455180645, 0.010044642724096775, 0.01674107275903225,
                                    0.0334821455180645, 0.066964291036129])
    recip[0, 65:67] = torch.tensor([0.02864583395421505, 0.0572916679084301])
    # NVFP4: a block whose E4M3 scale (0.0029) is a subnormal and rounds down to 2^-9, so
    # its largest |w| / scale is 8.9 and saturates to 6
    sub = torch.zeros(2, 32)
    sub[0, 0], sub[1, :16] = 2688.0, torch.linspace(-0.0174, 0.0174, 16)
    # MXFP4: a block whose amax is near the smallest float32 normal (e clamps at -127)
    low = torch.zeros(2, 64)
    low[0, :32], low[0, 5], low[0, 32], low[1, 32] = 2.0 ** -126, -1.5 * 2.0 ** -126, 3.0, 1.0
    # float64 input a hair above the midpoints: float32 rounds them onto the midpoints
    eps = 2.0 ** -30
    f64 = torch.tensor([[7.9, 1.25 + eps, 0.75 + eps, 2.5 + eps, 5.0 + eps, -(1.75 + eps),
                         3.5 + eps, 0.25 + eps] * 4], dtype=torch.float64)
    return {"random, zero/tiny blocks, an outlier, exact ties": a, "rows of very different "
            "size": big, "bfloat16 input": half, "all zeros": torch.zeros(3, block),
            "exact ties after NVFP4 scaling": exact, "rounding midpoints with a tensor scale "
            "that is not a power of two": recip, "an E4M3 block scale in the subnormals": sub,
            "a block amax near the smallest normal": low,
            "float64 input (computed in float32)": f64}


for _name, _w in _fp4_cases(32).items():
    _inp = _w.clone()
    _got_p, _got_s = quantize_mxfp4(_inp)                    # the learner's function first
    _ref_p, _ref_s = fp4.quantize_mxfp4(_w)
    checks.equal(f"{_name}: w left unchanged", bool(torch.equal(_inp, _w)), True)
    checks.equal(f"{_name}: dtypes and shapes", (_got_p.dtype, tuple(_got_p.shape), _got_s.dtype,
                 tuple(_got_s.shape)), (torch.uint8, tuple(_ref_p.shape), torch.uint8, tuple(_ref_s.shape)))
    _bad_s = (_got_s != _ref_s).nonzero()
    if len(_bad_s):
        _i, _j = _bad_s[0].tolist()
        raise checks.CheckFailed(f"{_name}: {len(_bad_s)} scale bytes differ; block [{_i}, {_j}] "
                                 f"(amax {float(_w[_i, 32 * _j:32 * _j + 32].float().abs().max()):.6g}): "
                                 f"expected {int(_ref_s[_i, _j])}, got {int(_got_s[_i, _j])}")
    _gc, _rc = fp4.unpack_fp4(_got_p), fp4.unpack_fp4(_ref_p)
    _bad = (_gc != _rc).nonzero()
    if len(_bad):
        _ex = "; ".join(f"w[{i},{j}] = {float(_w[i, j]):.6g}: expected code {int(_rc[i, j])}, got "
                        f"{int(_gc[i, j])}" for i, j in _bad[:3].tolist())
        raise checks.CheckFailed(f"{_name}: {len(_bad)} of {_w.numel()} codes differ from the "
                                 f"engine's quantize_mxfp4. {_ex}")
    _deq = dequantize_mxfp4(_ref_p.clone(), _ref_s.clone())
    checks.equal(f"{_name}: dequantize_mxfp4 dtype", _deq.dtype, torch.float32)
    checks.equal(f"{_name}: dequantize_mxfp4 bit-equal to the engine's", bool(
        torch.equal(_deq, fp4.dequantize_mxfp4(_ref_p, _ref_s))), True)
_g = torch.Generator().manual_seed(30301)
_rp = torch.randint(0, 256, (5, 48), generator=_g).to(torch.uint8)   # every code appears
_rs = torch.randint(100, 150, (5, 3), generator=_g).to(torch.uint8)
checks.equal("dequantize_mxfp4 of random bytes and scales, bit-equal to the engine's",
             bool(torch.equal(dequantize_mxfp4(_rp, _rs), fp4.dequantize_mxfp4(_rp, _rs))), True)
_g = torch.Generator().manual_seed(30001)
_one_nan, _one_inf = torch.randn(3, 64, generator=_g), torch.randn(3, 64, generator=_g)
_one_nan[1, 17], _one_inf[2, 63] = float("nan"), -float("inf")
for _what, _bad_w in (("in = 48, not a multiple of 32", torch.randn(4, 48, generator=_g)),
                      ("every value inf", torch.full((2, 32), float("inf"))),
                      ("one NaN among finite values", _one_nan), ("one -inf", _one_inf),
                      ("one dimension", torch.randn(64, generator=_g)),
                      ("an integer dtype", torch.ones(2, 32, dtype=torch.int32))):
    checks.call(f"quantize_mxfp4 of a weight with {_what}", quantize_mxfp4, _bad_w, raises=ValueError)
### END HIDDEN TESTS

# %% [markdown] nbgrader={"grade": false, "grade_id": "task2", "locked": true, "schema_version": 3, "solution": false, "task": false}
# ## Task 2: NVFP4 (4 points)
#
# Write `quantize_nvfp4(w)` (ModelOpt's recipe, vLLM's `modelopt_fp4` tensors): `w` 2-D
# float `[out, in]`, `in` a multiple of **16**, finite (else `ValueError`); compute in
# float32; do not modify `w`.
#
# - the tensor scale `weight_scale_2 = amax(|w|) / (6 * 448)`, a float32 tensor of shape
#   `[]` (1.0 for an all-zero `w`);
# - for each block of 16: `weight_scale = (amax_block / 6 / weight_scale_2)` cast with
#   `.to(torch.float8_e4m3fn)` (divide in that order);
# - the codes (task 1's rules) of `w / (weight_scale.float() * weight_scale_2)`, and code
#   0 for a block whose scale product is 0 (a zero block, or one so small next to the
#   tensor's largest value that its E4M3 scale underflows to 0).
#
# Return `(packed uint8 [out, in / 2], weight_scale float8_e4m3fn [out, in / 16],
# weight_scale_2 float32 [])`. The grader compares with the engine's bit for bit.

# %% nbgrader={"grade": false, "grade_id": "nvfp4", "locked": false, "schema_version": 3, "solution": true, "task": false}
def quantize_nvfp4(w: torch.Tensor):
    ### BEGIN SOLUTION
    if w.ndim != 2 or not w.is_floating_point() or w.shape[1] % 16:
        raise ValueError(f"w must be a 2-D float [out, in] with in a multiple of 16, got "
                         f"{tuple(w.shape)} {w.dtype}")
    if not bool(torch.isfinite(w).all()):
        raise ValueError("w has NaN or infinite values")
    wb = w.detach().float().reshape(w.shape[0], -1, 16)
    amax = wb.abs().amax()
    global_scale = amax / (6 * 448) if amax > 0 else torch.tensor(1.0)
    block_scale = (wb.abs().amax(-1) / 6 / global_scale).to(torch.float8_e4m3fn)
    denom = block_scale.float()[..., None] * global_scale
    x = torch.where(denom > 0, wb / torch.where(denom > 0, denom, 1.0), 0.0)
    a = x.abs()
    idx = torch.where(a < 2, torch.round(a * 2),
                      torch.where(a < 4, torch.round(a) + 2, torch.round(a / 2) + 4)).clamp(max=7)
    codes = (idx.to(torch.uint8) | (torch.signbit(x).to(torch.uint8) << 3)).reshape(w.shape)
    return codes[:, 0::2] | (codes[:, 1::2] << 4), block_scale, global_scale.float().reshape(())
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "test_nvfp4_visible", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
_w = torch.zeros(1, 32)
_w[0, :2] = torch.tensor([6.0, 3.0])      # block 0: the tensor's amax
_w[0, 16:18] = torch.tensor([0.6, -0.3])  # block 1: amax 0.6 -> E4M3 scale 44 (not 44.8)
_p, _b, _t = quantize_nvfp4(_w.clone())
checks.close("weight_scale_2 = 6 / 2688", float(_t), 6 / 2688, rtol=1e-6)
checks.equal("weight_scale_2 shape", tuple(torch.as_tensor(_t).shape), ())
checks.equal("weight_scale dtype and shape", (_b.dtype, tuple(_b.shape)), (torch.float8_e4m3fn, (1, 2)))
checks.equal("weight_scale values", _b.float().flatten().tolist(), [448.0, 44.0])
checks.equal("codes of 6, 3 (block 0) and 0.6, -0.3 (block 1: 6.11 -> 6, -3.05 -> -3)",
             fp4.unpack_fp4(_p)[0, [0, 1, 16, 17]].tolist(), [7, 5, 7, 13])
print("visible test passed")

# %% nbgrader={"grade": true, "grade_id": "test_nvfp4_hidden", "locked": true, "points": 3, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
### BEGIN HIDDEN TESTS
for _name, _w in _fp4_cases(16).items():
    _inp = _w.clone()
    _got = quantize_nvfp4(_inp)                              # the learner's function first
    _ref = fp4.quantize_nvfp4(_w)
    checks.equal(f"{_name}: w left unchanged", bool(torch.equal(_inp, _w)), True)
    _gp, _gb, _gt = _got[0], _got[1], torch.as_tensor(_got[2])
    checks.equal(f"{_name}: dtypes and shapes", (_gp.dtype, tuple(_gp.shape), _gb.dtype,
                 tuple(_gb.shape), _gt.dtype, tuple(_gt.shape)),
                 (torch.uint8, tuple(_ref[0].shape), torch.float8_e4m3fn, tuple(_ref[1].shape),
                  torch.float32, ()))
    checks.equal(f"{_name}: weight_scale_2 (bit-equal)", float(_gt), float(_ref[2]))
    _bad_b = (_gb.view(torch.uint8) != _ref[1].view(torch.uint8)).nonzero()
    if len(_bad_b):
        _i, _j = _bad_b[0].tolist()
        raise checks.CheckFailed(f"{_name}: {len(_bad_b)} E4M3 block scales differ; block "
                                 f"[{_i}, {_j}]: expected {float(_ref[1][_i, _j].float()):.6g}, "
                                 f"got {float(_gb[_i, _j].float()):.6g}")
    _gc, _rc = fp4.unpack_fp4(_gp), fp4.unpack_fp4(_ref[0])
    _bad = (_gc != _rc).nonzero()
    if len(_bad):
        _ex = "; ".join(f"w[{i},{j}] = {float(_w[i, j]):.6g}: expected code {int(_rc[i, j])}, got "
                        f"{int(_gc[i, j])}" for i, j in _bad[:3].tolist())
        raise checks.CheckFailed(f"{_name}: {len(_bad)} of {_w.numel()} codes differ from the "
                                 f"engine's quantize_nvfp4. {_ex}")
_g = torch.Generator().manual_seed(30002)
_one_nan, _one_inf = torch.randn(3, 32, generator=_g), torch.randn(3, 32, generator=_g)
_one_nan[0, 30], _one_inf[1, 2] = float("nan"), float("inf")
for _what, _bad_w in (("in = 40, not a multiple of 16", torch.randn(4, 40, generator=_g)),
                      ("every value NaN", torch.full((2, 16), float("nan"))),
                      ("one NaN among finite values", _one_nan), ("one inf", _one_inf),
                      ("one dimension", torch.randn(32, generator=_g)),
                      ("an integer dtype", torch.ones(2, 16, dtype=torch.int64))):
    checks.call(f"quantize_nvfp4 of a weight with {_what}", quantize_nvfp4, _bad_w, raises=ValueError)
### END HIDDEN TESTS


# %% [markdown] nbgrader={"grade": false, "grade_id": "task3", "locked": true, "schema_version": 3, "solution": false, "task": false}
# ## Task 3: a batch-invariant matmul (4 points)
#
# A server that promises the same answer to the same request, whatever else it is
# serving, needs linear layers whose rows do not see each other. Write
# `batch_invariant_matmul(a, b)` with this contract:
#
# - **Inputs.** `a` float32 `[M, K]`, any M >= 0, in any memory layout (a slice of a
#   bigger tensor, a transposed copy); `b` float32 `[K, N]` (the engine passes
#   `weight.t()`, a transposed view). Anything else (not 2-D, another dtype, a K that
#   differs) raises `ValueError`. Neither input is changed.
# - **Output.** A new float32 `[M, N]` tensor, `a @ b`, computed in float32 (no float64
#   and no 16-bit tensors along the way), within **`1e-5 * (|a| @ |b|)`** of the exact
#   product, elementwise, for finite inputs. (Measured on the graded shapes, as a
#   fraction of `|a| @ |b|`: float32 sums over fixed K tiles stay below 3e-6; TF32 or
#   float16 inputs reach about 3e-4; bfloat16 inputs or a bfloat16 accumulator 2e-3 and
#   more.) A row holding NaN or inf gives what IEEE arithmetic gives, in that row only.
# - **Batch-invariant.** Row i of the result is a function of row i of `a` (and of `b`)
#   alone, **bit for bit**: the same for M = 1 and M = 300, at any position in the batch,
#   whatever the other rows hold, however `a` is laid out in memory.
# - **Batched.** Every operation takes all rows at once: the number of tensor operations
#   your function runs may depend on K and N, not on M. (A loop over rows is invariant
#   too, but it reads `b` once per row: that is what the engine's CPU mode does today,
#   and the price chapter 30's section 2 measured.)
#
# What you are up against: one GEMM, `a @ b`, is accurate but not invariant on this CPU
# (the chapter measured `F.linear` giving rows other bits at M >= 2), and neither is a
# BLAS call on a slice of K: try `a[:, :32] @ b[:32]` for a row alone and inside a batch
# before you build on it. The behaviour to reproduce is that of the engine's GPU kernel
# `minivllm_kernels.batch_invariant.matmul_batch_invariant`: K split into tiles of a
# fixed size, the tiles accumulated in a fixed order in float32, and inside a tile a
# summation order that nothing chooses from M. Which torch operations round every element
# on its own, whatever the shape, and which reduce in an order that follows the shape and
# the strides of what they are given? Measure, then build.

# %% nbgrader={"grade": false, "grade_id": "matmul", "locked": false, "schema_version": 3, "solution": true, "task": false}
def batch_invariant_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    ### BEGIN SOLUTION
    if a.ndim != 2 or b.ndim != 2 or a.dtype != torch.float32 or b.dtype != torch.float32 \
            or a.shape[1] != b.shape[0]:
        raise ValueError(f"need float32 a [M, K] and b [K, N], got {a.dtype} {tuple(a.shape)} "
                         f"and {b.dtype} {tuple(b.shape)}")
    # one memory layout whatever the caller's: the sum below reduces in an order that
    # follows the layout of the products, which follows a's
    a = a.contiguous()
    out = torch.zeros(a.shape[0], b.shape[1])
    tile = 64
    for k0 in range(0, a.shape[1], tile):  # fixed tiles, in order, for every row at once
        # float32 products, each rounded on its own, summed over the tile's k in an order
        # fixed by the tile's shape (the rows are an outer dimension of the reduction)
        out += (a[:, k0:k0 + tile, None] * b[None, k0:k0 + tile, :]).sum(1)
    return out
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "test_matmul_visible", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
_g = torch.Generator().manual_seed(0)
_a, _b = torch.randn(4, 576, generator=_g), (torch.randn(96, 576, generator=_g) * 0.05).t()
_c = batch_invariant_matmul(_a, _b)
checks.equal("dtype and shape", (_c.dtype, tuple(_c.shape)), (torch.float32, (4, 96)))
checks.at_most("max |a @ b - float64 product| / (|a| @ |b|)", float(
    ((_c.double() - _a.double() @ _b.double()).abs() / (_a.double().abs() @ _b.double().abs())).max()),
    1e-5)
checks.same("row 2 alone vs row 2 of the batch of 4", batch_invariant_matmul(_a[2:3].clone(), _b)[0],
            _c[2])
print("visible test passed")

# %% nbgrader={"grade": true, "grade_id": "test_matmul_hidden", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
### BEGIN HIDDEN TESTS
_g = torch.Generator().manual_seed(30003)
for _K, _N in ((576, 960), (1536, 576), (70, 9), (300, 37), (5, 3)):
    _b = (torch.randn(_N, _K, generator=_g) * 0.05).t()     # a transposed view, as the engine's
    _x = torch.randn(24, _K, generator=_g)
    _x[3] = 0                                                # a zero row
    _x[5, _K // 2] = 3e3                                     # an outlier
    _at = f"K={_K}, N={_N}"
    _full = checks.call(f"{_at}: batch_invariant_matmul", batch_invariant_matmul, _x, _b)
    checks.equal(f"{_at}: type, dtype and shape", (type(_full), _full.dtype, tuple(_full.shape)),
                 (torch.Tensor, torch.float32, (24, _N)))
    checks.new_object(f"{_at}: the result", _full, _x, _b)
    _exact = _x.double() @ _b.double()
    _scale = _x.double().abs() @ _b.double().abs()
    checks.at_most(f"{_at}: max |error| / (|a| @ |b|) against float64", float(
        ((_full.double() - _exact).abs() / _scale.clamp_min(1e-300)).max()), 1e-5)
    for _M in ((1, 2, 3, 7, 16, 64) if _K * _N > 30000 else (1, 2, 3, 7, 16, 64, 300)):
        _i = int(torch.randint(0, 24, (), generator=_g))
        _batch = torch.randn(_M, _K, generator=_g) * 2
        _pos = int(torch.randint(0, _M, (), generator=_g))
        _batch[_pos] = _x[_i]
        checks.same(f"{_at}: row {_i} at position {_pos} of a batch of {_M} vs the same row in "
                    "the batch of 24", batch_invariant_matmul(_batch, _b)[_pos], _full[_i])
    _perm = torch.randperm(24, generator=_g)
    checks.same(f"{_at}: the 24 rows permuted vs unpermuted", batch_invariant_matmul(_x[_perm], _b),
                _full[_perm])
    checks.same(f"{_at}: a stored column-major (a.t().contiguous().t()) vs row-major",
                batch_invariant_matmul(_x.t().contiguous().t(), _b), _full)
    checks.same(f"{_at}: row 7 as a view into the batch (x[7:8]) vs inside it",
                batch_invariant_matmul(_x[7:8], _b)[0], _full[7])
    _y = _x.clone()
    _y[0, 1], _y[1, 2], _y[2, 0], _y[2, _K - 1] = float("nan"), float("inf"), -float("inf"), float("inf")
    _got = batch_invariant_matmul(_y, _b)
    checks.same(f"{_at}: rows 3-23 beside rows holding NaN and inf", _got[3:], _full[3:])
    _want = _y[:3].double() @ _b.double()
    checks.equal(f"{_at}: where rows 0-2 (NaN, inf, -inf and inf) are NaN, +inf, -inf",
                 [_f(_got[:3]).tolist() for _f in (torch.isnan, torch.isposinf, torch.isneginf)],
                 [_f(_want).tolist() for _f in (torch.isnan, torch.isposinf, torch.isneginf)])
### END HIDDEN TESTS

# %% nbgrader={"grade": true, "grade_id": "test_matmul_contract", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
### BEGIN HIDDEN TESTS
_g = torch.Generator().manual_seed(30005)
_a, _b = torch.randn(16, 200, generator=_g), torch.randn(37, 200, generator=_g).t()
for _what, _args in (("a 1-D a", (_a[0], _b)), ("a 3-D a", (_a[None], _b)), ("a 1-D b", (_a, _b[:, 0])),
                     ("a bfloat16 a", (_a.bfloat16(), _b)), ("a float64 b", (_a, _b.double())),
                     ("an int64 a", (_a.long(), _b)), ("a K that differs", (_a[:, :199], _b))):
    checks.call(f"batch_invariant_matmul with {_what}", batch_invariant_matmul, *_args, raises=ValueError)
_e = checks.call("batch_invariant_matmul with M = 0", batch_invariant_matmul, _a[:0], _b)
checks.equal("M = 0: type, dtype and shape", (type(_e), _e.dtype, tuple(_e.shape)),
             (torch.Tensor, torch.float32, (0, 37)))
_, _seen2 = checks.op_dtypes(batch_invariant_matmul, _a[:2].clone(), _b)
_, _seen16 = checks.op_dtypes(batch_invariant_matmul, _a.clone(), _b)
checks.equal("dtypes of the floating-point tensors your function computes (float32 only)",
             sorted(map(str, set(_seen2) | set(_seen16))), ["torch.float32"])
checks.equal("floating-point tensors your function computes for M = 16 (the same number as "
             f"for M = 2, {sum(_seen2.values())}: every operation takes all rows at once)",
             sum(_seen16.values()), sum(_seen2.values()))
### END HIDDEN TESTS

# %% [markdown] nbgrader={"grade": false, "grade_id": "task4", "locked": true, "schema_version": 3, "solution": false, "task": false}
# ## Task 4: an FP4 plan in a memory budget (a decision, 5 points)
#
# The weights of decoder layers 0-4 (`FP4_LAYERS`; layers 5-29 stay float32, to keep the
# grading short) are stored in FP4 within **`FP4_BUDGET_BYTES`**, codes and scales as
# stored: MXFP4 takes half a byte per weight plus an E8M0 byte per 32, NVFP4 half a byte
# per weight plus an E4M3 byte per 16 and a float32 tensor scale per layer. MXFP4
# everywhere fits, and is the broken configuration; NVFP4 everywhere does not fit. A
# mixed checkpoint (compressed-tensors and ModelOpt both give each layer its own format)
# can store some projection kinds of `KINDS` (`qkv_proj`, `o_proj`, `gate_up_proj`,
# `down_proj`, in all five layers) in NVFP4 and the others in MXFP4.
#
# Choose **`NVFP4_KINDS`**, the set of kinds stored in NVFP4: the plan with the lowest KL
# against the float32 model among the plans that fit the budget. `plan_bytes(kinds)`
# gives a plan's bytes; `plan_kl(kinds)` measures its mean KL (nats per position) on two
# example windows, with the engine's quantizers (a few seconds a plan). Work out what
# you expect first, then measure.
#
# The grader measures every plan that fits on fresh windows with the engine's
# quantizers and requires yours to have the lowest KL; then it runs your plan with
# **your** `quantize_mxfp4`, `dequantize_mxfp4` and `quantize_nvfp4` (the engine's
# `dequantize_nvfp4`): the KL must be at most **1.02x** the engine's for the same plan,
# a bar that MXFP4 everywhere must fail.

# %% nbgrader={"grade": false, "grade_id": "fp4_helper", "locked": true, "schema_version": 3, "solution": false, "task": false}
import json

FP4_LAYERS = range(5)
KINDS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
FP4_BUDGET_BYTES = 9_560_000
_cfg = json.loads((resolve_model_path(MODEL) / "config.json").read_text())
_hd = _cfg["hidden_size"] // _cfg["num_attention_heads"]
KIND_SHAPES = {"qkv_proj": (_cfg["hidden_size"] + 2 * _cfg["num_key_value_heads"] * _hd, _cfg["hidden_size"]),
               "o_proj": (_cfg["hidden_size"], _cfg["hidden_size"]),
               "gate_up_proj": (2 * _cfg["intermediate_size"], _cfg["hidden_size"]),
               "down_proj": (_cfg["hidden_size"], _cfg["intermediate_size"])}  # [out, in]


def fp4_bytes(out_features: int, in_features: int, nvfp4: bool) -> int:
    """Bytes of one layer's FP4 weight as stored (codes, block scales, tensor scale)."""
    n = out_features * in_features
    return n // 2 + (n // 16 + 4 if nvfp4 else n // 32)


def plan_bytes(kinds) -> int:
    """Bytes of the FP4 weights of FP4_LAYERS with the kinds in ``kinds`` in NVFP4 and the
    others in MXFP4."""
    return len(FP4_LAYERS) * sum(fp4_bytes(*KIND_SHAPES[k], k in kinds) for k in KINDS)


def fp4_linears(llm) -> dict:
    """{module name: Linear} of the decoder linears of FP4_LAYERS in ``llm``'s model; a
    name ends in its kind (``layers.3.mlp.down_proj``)."""
    return {n: m for n, m in llm.llm_engine.model_runner.model.named_modules()
            if isinstance(m, Linear) and n.startswith("layers.") and int(n.split(".")[1]) in FP4_LAYERS}


def fp4_plan(llm, kinds, quantizers=None, cache=None):
    """The engine's "linear" step with the weights of FP4_LAYERS quantized and dequantized:
    NVFP4 for the kinds in ``kinds``, MXFP4 for the others (``with llm.swap_step("linear",
    fp4_plan(llm, kinds)): ...``). ``quantizers``: (quantize_mxfp4, dequantize_mxfp4,
    quantize_nvfp4), the engine's by default; NVFP4 is always dequantized by the engine's
    ``fp4.dequantize_nvfp4``. ``cache``: a dict that keeps the dequantized weights between
    plans built with the same quantizers."""
    q_mx, dq_mx, q_nv = quantizers or (fp4.quantize_mxfp4, fp4.dequantize_mxfp4, fp4.quantize_nvfp4)
    cache = {} if cache is None else cache
    weights = {}
    for name, m in fp4_linears(llm).items():
        nv = name.split(".")[-1] in kinds
        if (name, nv) not in cache:
            w = m.weight.detach()
            if nv:
                p, s, t = q_nv(w)
                cache[name, nv] = fp4.dequantize_nvfp4(p, s, torch.as_tensor(t, dtype=torch.float32))
            else:
                cache[name, nv] = dq_mx(*q_mx(w))
        weights[m.weight.data_ptr()] = cache[name, nv]
    return lambda x, weight, bias: linear_ref(x, weights.get(weight.data_ptr(), weight), bias)


def plan_mean_kl(llm, seqs, ref_rows, linear) -> float:
    """Mean KL (nats per position) of ``llm`` with the "linear" step ``linear`` on ``seqs``
    against ``ref_rows`` (the float32 logits of the same sequences)."""
    with llm.swap_step("linear", linear):
        rows = llm.score(seqs, output="logits")
    return float(torch.cat([metrics.kl_divergence(r, c) for r, c in zip(ref_rows, rows)]).mean())


_EXAMPLE = {}


def plan_kl(kinds) -> float:
    """Mean KL of the plan (NVFP4 for ``kinds``, MXFP4 for the others; the engine's
    quantizers) against the float32 engine, on two example conversation windows."""
    if not _EXAMPLE:
        seqs = [s[100:140] for s in evalsets.conversation_sequences(tokenizer, max_conversations=2)]
        _EXAMPLE.update(seqs=seqs, ref=engine().score(seqs, output="logits"), cache={})
    return plan_mean_kl(engine(), _EXAMPLE["seqs"], _EXAMPLE["ref"],
                        fp4_plan(engine(), set(kinds), cache=_EXAMPLE["cache"]))


print(f"budget {FP4_BUDGET_BYTES} bytes; MXFP4 everywhere {plan_bytes(())}, NVFP4 everywhere "
      f"{plan_bytes(KINDS)}; each kind in NVFP4 adds "
      + ", ".join(f"{k} {plan_bytes((k,)) - plan_bytes(())}" for k in KINDS))

# %% nbgrader={"grade": false, "grade_id": "nvfp4_kinds", "locked": false, "schema_version": 3, "solution": true, "task": false}
NVFP4_KINDS = set()  # MXFP4 everywhere: where this task starts
### BEGIN SOLUTION
NVFP4_KINDS = {"down_proj"}
### END SOLUTION

# %% nbgrader={"grade": true, "grade_id": "test_engine_nvfp4", "locked": true, "points": 5, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
### BEGIN HIDDEN TESTS
import itertools as _it

if isinstance(NVFP4_KINDS, str) or not hasattr(NVFP4_KINDS, "__iter__"):
    raise checks.CheckFailed(f"NVFP4_KINDS must be a set of kinds, like {{'o_proj'}}, got "
                             f"{NVFP4_KINDS!r}")
for _k in NVFP4_KINDS:
    checks.one_of("a kind in NVFP4_KINDS", _k, list(KINDS))
_plan = frozenset(NVFP4_KINDS)
_probe = torch.randn(4, 64, generator=torch.Generator().manual_seed(30006))
dequantize_mxfp4(*quantize_mxfp4(_probe.clone()))              # a stub fails here,
quantize_nvfp4(_probe.clone())                                 # before the engine
_llm = engine()
_lin = fp4_linears(_llm)
checks.equal("FP4 linears found in the engine", len(_lin), 4 * len(FP4_LAYERS))


def _bytes(kinds):  # from the engine's own layers
    return sum(fp4_bytes(*m.weight.shape, n.split(".")[-1] in kinds) for n, m in _lin.items())


_fits = [frozenset(c) for _r in range(len(KINDS) + 1) for c in _it.combinations(KINDS, _r)
         if _bytes(c) <= FP4_BUDGET_BYTES]
checks.equal(f"NVFP4_KINDS = {sorted(_plan)} ({_bytes(_plan)} bytes) fits in FP4_BUDGET_BYTES "
             f"({FP4_BUDGET_BYTES})", _plan in _fits, True)
_seqs = [s[300:340] for s in evalsets.conversation_sequences(tokenizer, max_conversations=8)[6:8]]
_ref = _llm.score(_seqs, output="logits")
_cache = {}
_kl = {_p: plan_mean_kl(_llm, _seqs, _ref, fp4_plan(_llm, _p, cache=_cache)) for _p in _fits}
del _cache
_best = min(_fits, key=_kl.get)
_LIMIT = 1.02 * _kl[_best]
print(f"{sum(map(len, _seqs))} fresh positions; mean KL against float32 (nats) of the plans that "
      "fit, engine quantizers: " + ", ".join(f"{'+'.join(sorted(_p)) or 'MXFP4 everywhere'} "
                                            f"{_kl[_p]:.4g}" for _p in _fits))
assert _kl[frozenset()] > _LIMIT, f"MXFP4 everywhere ({_kl[frozenset()]:.3g}) should fail {_LIMIT:.3g}"
checks.equal(f"NVFP4_KINDS: the plan with the lowest KL among those that fit ({sorted(_best)}, "
             f"{_kl[_best]:.4g} nats; yours {_kl[_plan]:.4g})", sorted(_plan), sorted(_best))
_mine = plan_mean_kl(_llm, _seqs, _ref, fp4_plan(_llm, _plan, (quantize_mxfp4, dequantize_mxfp4,
                                                               quantize_nvfp4)))
print(f"your plan with your quantizers: {_mine:.4g}; limit 1.02 x {_kl[_best]:.4g} = {_LIMIT:.4g}")
checks.at_most(f"KL of your plan with your quantizers (MXFP4 everywhere: {_kl[frozenset()]:.3g})",
               _mine, _LIMIT)
### END HIDDEN TESTS

# %% [markdown] nbgrader={"grade": false, "grade_id": "task5", "locked": true, "schema_version": 3, "solution": false, "task": false}
# ## Task 5: your matmul in the engine (4 points)
#
# Nothing to write. Your matmul becomes the engine's `"linear"` step, beside the engine's
# batch-invariant decode attention and a row-at-a-time LM head (`invariant_engine` in the
# setup cell): a fresh sequence is scored through the decode path alone and in three
# fresh batch compositions (other prompts decoding beside it), and its logits must be
# `torch.equal` every time. Torch's own float32 GEMM (`torch.nn.functional.linear`, a
# BLAS call) in the same place must fail.

# %% nbgrader={"grade": true, "grade_id": "test_engine_matmul", "locked": true, "points": 4, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
### BEGIN HIDDEN TESTS
import random as _random

import torch.nn.functional as _F

_probe = torch.randn(3, 40, generator=torch.Generator().manual_seed(5))
batch_invariant_matmul(_probe, _probe.t())                # a stub fails here, before the engine
_rng = _random.Random(30004)
_text = evalsets.load_corpus()


def _fresh(n):
    _s = _rng.randrange(0, len(_text) - 1500)
    return tokenizer.encode(_text[_s:_s + 1500])[:n]


_target = _fresh(4)
_comps = [[_fresh(_rng.randrange(3, 6))],
          [_fresh(3), _fresh(_rng.randrange(4, 7))],
          [_fresh(_rng.randrange(3, 5)), _fresh(3), _fresh(_rng.randrange(4, 8))]]


def _check(linear, stop_at_first_failure=False):
    """(all equal, worst max |dlogit|) of the target alone vs in each composition."""
    llm = engine()
    with invariant_engine(llm, linear):
        alone = decode_logits_beside(llm, _target, [])
        ok, worst = True, 0.0
        for _c in _comps:
            _b = decode_logits_beside(llm, _target, _c)
            ok &= torch.equal(alone, _b)
            worst = max(worst, float((alone - _b).abs().max()))
            if stop_at_first_failure and not ok:
                break
    return ok, worst


_mine = _check(as_linear(batch_invariant_matmul))
_bad = _check(_F.linear, stop_at_first_failure=True)     # torch's float32 GEMM (BLAS)
print(f"a fresh {len(_target)}-token sequence alone and in 3 compositions, logits bitwise equal: "
      f"your matmul {_mine[0]} (max |dlogit| {_mine[1]:.3g}), torch's F.linear {_bad[0]} "
      f"(max |dlogit| {_bad[1]:.3g})")
if _bad[0]:
    raise checks.CheckFailed("the check does not discriminate: torch's F.linear passes it")
checks.equal("torch.equal(logits alone, logits in a batch) in every composition, with your "
             "matmul", _mine[0], True)
### END HIDDEN TESTS
