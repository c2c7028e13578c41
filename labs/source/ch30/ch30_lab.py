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
# - **FP4 weights.** MXFP4 (blocks of 32, a power-of-two E8M0 scale) lost about twice the
#   KL of NVFP4 (blocks of 16, an E4M3 scale and a float32 tensor scale) at nearly the same
#   bits per weight. The broken configuration is the engine with MXFP4 weights; you write
#   both formats, and your NVFP4 goes into the engine as a quantization method.
# - **Batch invariance.** Torch's float32 GEMM gives a row different bits depending on
#   how many rows share the call, so a request's logits change with the batch. You
#   write a matmul whose every row is a function of that row alone, and it goes into the
#   engine as its `"linear"` step.
#
# You write four functions; the grader calls them on **new** inputs (zero blocks,
# outliers, exact ties, other shapes and batch sizes) and compares with the engine's
# reference bit for bit, then plugs them into the engine on text you have not seen:
#
# 1. `quantize_mxfp4(w)` and `dequantize_mxfp4(packed, scales)`, 4 points;
# 2. `quantize_nvfp4(w)`, 4 points;
# 3. `batch_invariant_matmul(a, b)`, 3 points;
# 4. your NVFP4 in the engine, 2 points, and your matmul in the engine, 2 points (no code
#    to write: they run your functions).
#
# Run the cells in order. Do not edit the setup and test cells.

# %% nbgrader={"grade": false, "grade_id": "setup", "locked": true, "schema_version": 3, "solution": false, "task": false}
import contextlib
import importlib

import grading.checks as checks  # first import: records the original functions
import torch

from minivllm import LLM
from minivllm.attention.backends.torch_ref import decode_attention_batch_invariant
from minivllm.layers.linear import LinearMethod, rowwise
from minivllm.models.llama import lm_head_ref
from minivllm.models.loader import resolve_model_path
from minivllm.precision import evalsets, metrics
from minivllm.precision.batching import decode_logits_beside
from minivllm.quantization import fp4, register_quantization_method
from minivllm.quantization.checkpoint import cached_quantized
from minivllm.tokenizer import get_tokenizer

torch.manual_seed(0)
MODEL = "smollm2-135m-instruct"
COMMON = dict(dtype="float32", max_model_len=256, kv_cache_memory_bytes=16 << 20)
BLOCK_K = 256  # the K chunk of task 3: fixed, whatever the number of rows
# task 4 quantizes decoder layers 0-9 (10-29 stay float32), to keep the grading short
FP4_CONFIG = {"ignore": [r"re:.*layers\.([1-2][0-9])\."]}
E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # codes 0..7; 8..15 are their negatives
tokenizer = get_tokenizer(str(resolve_model_path(MODEL)))  # the tokenizer only: no engine yet
_ENGINES = {}


def engine() -> LLM:
    """The float32 engine of the last two tests, built on first use and then reused."""
    if "float32" not in _ENGINES:
        _ENGINES["float32"] = LLM(MODEL, **COMMON)
    return _ENGINES["float32"]


class LabNvfp4(LinearMethod):
    """NVFP4 weight-only whose weights come from YOUR quantize_nvfp4 (looked up by name
    when a layer is quantized); stores what the engine's modelopt_fp4 stores (qweight,
    weight_scale, weight_scale_2) and dequantizes them with the engine's code."""

    def quantize(self, weight, stats=None):
        packed, block_scale, global_scale = globals()["quantize_nvfp4"](weight)
        return {"qweight": packed, "weight_scale": block_scale,
                "weight_scale_2": torch.as_tensor(global_scale, dtype=torch.float32).reshape(())}

    def dequantize(self, t):
        return fp4.dequantize_nvfp4(t["qweight"], t["weight_scale"], t["weight_scale_2"])

    def expected(self, out_features, in_features):
        return {"qweight": (torch.uint8, (out_features, in_features // 2)),
                "weight_scale": (torch.float8_e4m3fn, (out_features, in_features // 16)),
                "weight_scale_2": (torch.float32, ())}


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
    return {"random, zero/tiny blocks, an outlier, exact ties": a, "rows of very different "
            "size": big, "bfloat16 input": half, "all zeros": torch.zeros(3, block),
            "exact ties after NVFP4 scaling": exact}


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
for _bad_w in (torch.randn(4, 48, generator=torch.Generator().manual_seed(30001)), torch.full((2, 32), float("inf"))):
    try:
        quantize_mxfp4(_bad_w)
    except ValueError:
        continue
    raise checks.CheckFailed(f"quantize_mxfp4 of a {tuple(_bad_w.shape)} weight "
                             f"({'not a multiple of 32' if _bad_w.shape[1] % 32 else 'inf'}) "
                             "should raise ValueError")
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
for _bad_w in (torch.randn(4, 40, generator=torch.Generator().manual_seed(30002)), torch.full((2, 16), float("nan"))):
    try:
        quantize_nvfp4(_bad_w)
    except ValueError:
        continue
    raise checks.CheckFailed(f"quantize_nvfp4 of a {tuple(_bad_w.shape)} weight "
                             f"({'not a multiple of 16' if _bad_w.shape[1] % 16 else 'NaN'}) "
                             "should raise ValueError")
### END HIDDEN TESTS

# %% [markdown] nbgrader={"grade": false, "grade_id": "task3", "locked": true, "schema_version": 3, "solution": false, "task": false}
# ## Task 3: a batch-invariant matmul (3 points)
#
# Write `batch_invariant_matmul(a, b)`: `a` float32 `[M, K]`, `b` float32 `[K, N]` (it
# may be a transposed view); return `a @ b` as float32 `[M, N]` such that **row i of the
# result is bit for bit the same whatever M is, wherever the row sits and whatever the
# other rows hold**, and within float32 rounding of the exact product.
#
# A BLAS call does not promise that (chapter 30 measures `torch.nn.functional.linear`
# giving a row other bits at M >= 2 than alone), and GPU libraries pick their split-K
# factor from M. Make the
# reduction order a function of the row alone, the way batch-invariant kernels do:
#
# - work on one row at a time, as a fresh `[1, K]` copy (so every call sees the same
#   memory layout, whatever the row's position);
# - split K into chunks of **`BLOCK_K`** columns starting at 0 (the last may be shorter),
#   multiply each chunk of the row by the same rows of `b` (a `[1, k] @ [k, N]` product),
#   and add the partial results **in chunk order** in float32.
#
# Choosing the number of chunks from M (more splits for few rows, as a GPU library does
# to keep its cores busy) is exactly what breaks invariance.

# %% nbgrader={"grade": false, "grade_id": "matmul", "locked": false, "schema_version": 3, "solution": true, "task": false}
def batch_invariant_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    ### BEGIN SOLUTION
    M, K = a.shape
    out = torch.empty(M, b.shape[1], dtype=torch.float32)
    chunk = BLOCK_K
    for i in range(M):
        acc = None
        for k0 in range(0, K, chunk):
            part = a[i:i + 1, k0:k0 + chunk].float().clone() @ b[k0:k0 + chunk].float()
            acc = part if acc is None else acc + part
        out[i] = acc[0]
    return out
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "test_matmul_visible", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
_g = torch.Generator().manual_seed(0)
_a, _b = torch.randn(3, 600, generator=_g), torch.randn(600, 5, generator=_g)
_c = batch_invariant_matmul(_a, _b)
checks.equal("dtype and shape", (_c.dtype, tuple(_c.shape)), (torch.float32, (3, 5)))
checks.at_most("max |a @ b - float64 product|", float((_c.double() - _a.double() @ _b.double()).abs().max()),
               1e-4)
checks.equal("row 1 alone == row 1 of the batch of 3",
             torch.equal(batch_invariant_matmul(_a[1:2].clone(), _b)[0], _c[1]), True)
print("visible test passed")

# %% nbgrader={"grade": true, "grade_id": "test_matmul_hidden", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
### BEGIN HIDDEN TESTS
_g = torch.Generator().manual_seed(30003)
for _K, _N in ((576, 960), (1536, 576), (70, 9), (300, 37)):
    _w = torch.randn(_N, _K, generator=_g) * 0.05
    _x = torch.randn(24, _K, generator=_g)
    _x[3] = 0                                                # a zero row
    _x[5, 7] = 3e3                                           # an outlier
    _full = batch_invariant_matmul(_x, _w.t())               # the learner's function first
    _exact = _x.double() @ _w.t().double()
    _scale = _x.double().abs() @ _w.t().double().abs()
    checks.at_most(f"K={_K}, N={_N}: max |error| / (|a| @ |b|) against float64",
                   float(((_full.double() - _exact).abs() / _scale.clamp_min(1e-30)).max()), 1e-5)
    for _M in (1, 2, 3, 7, 16):
        _i = int(torch.randint(0, 24, (), generator=_g))
        _others = torch.randn(_M, _K, generator=_g) * 2
        _pos = int(torch.randint(0, _M, (), generator=_g))
        _others[_pos] = _x[_i]
        _got = batch_invariant_matmul(_others, _w.t())
        checks.equal(f"K={_K}, N={_N}: row {_i} at position {_pos} of a batch of {_M} == the "
                     f"same row in the batch of 24", torch.equal(_got[_pos], _full[_i]), True)
_perm = torch.randperm(24, generator=_g)
checks.equal("rows permuted: each row bit-equal to itself unpermuted",
             torch.equal(batch_invariant_matmul(_x[_perm], _w.t()), _full[_perm]), True)
### END HIDDEN TESTS

# %% [markdown] nbgrader={"grade": false, "grade_id": "task4", "locked": true, "schema_version": 3, "solution": false, "task": false}
# ## Task 4: your code in the engine (4 points)
#
# Nothing to write. Two checks, each measuring the broken configuration the same way:
#
# - **Your NVFP4 as a quantization method** (`LabNvfp4` in the setup cell registers your
#   `quantize_nvfp4` as `quantization="lab_nvfp4"`, applied to decoder layers 0-9 as
#   `FP4_CONFIG` says, for time): the mean KL against the float32
#   engine, teacher-forced on conversation windows you have not seen, must be at most
#   **1.05x** the engine's own NVFP4 (`modelopt_fp4`, same layers) on the same windows;
#   the engine's MXFP4 must fail that bar (chapter 30: about twice the KL). 2 points.
# - **Your matmul as the engine's `"linear"` step**, with the engine's batch-invariant
#   decode attention and a row-at-a-time LM head (`invariant_engine` in the setup cell): a
#   fresh sequence is scored through the decode path alone and in three fresh batch
#   compositions (other prompts decoding beside it), and its logits must be
#   `torch.equal` every time. Torch's own float32 GEMM (`torch.nn.functional.linear`, a
#   BLAS call) in the same place must fail. 2 points.

# %% nbgrader={"grade": true, "grade_id": "test_engine_nvfp4", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
### BEGIN HIDDEN TESTS
import gc as _gc

quantize_nvfp4(torch.randn(6, 32, generator=torch.Generator().manual_seed(7)))  # a stub fails here
register_quantization_method("lab_nvfp4", LabNvfp4, replace=True)
_seqs = [s[300:340] for s in evalsets.conversation_sequences(tokenizer, max_conversations=8)[6:8]]
try:  # the learner's engine first: a method the engine refuses fails before the others
    _yours = LLM(MODEL, **COMMON, quantization="lab_nvfp4", quantization_config=FP4_CONFIG)
except Exception as _e:
    raise checks.CheckFailed(f"the engine could not load with your NVFP4: {type(_e).__name__}: "
                             f"{_e}") from None
_ref = engine().score(_seqs, output="logits")


def _kl(llm):
    rows = llm.score(_seqs, output="logits")
    return float(torch.cat([metrics.kl_divergence(a, b) for a, b in zip(_ref, rows)]).mean())


_mine = _kl(_yours)
del _yours
_kls = {}
for _m in ("modelopt_fp4", "mxfp4"):
    _kls[_m] = _kl(LLM(str(cached_quantized(MODEL, _m, FP4_CONFIG, verbose=False)), **COMMON))
    _gc.collect()
_LIMIT = 1.05 * _kls["modelopt_fp4"]
print(f"{sum(map(len, _seqs))} fresh positions; mean KL against float32 (nats): engine NVFP4 "
      f"{_kls['modelopt_fp4']:.4g}, engine MXFP4 (the broken configuration) {_kls['mxfp4']:.4g}, "
      f"your NVFP4 {_mine:.4g}; limit 1.05 x NVFP4 = {_LIMIT:.4g}")
assert _kls["mxfp4"] > _LIMIT, f"MXFP4 ({_kls['mxfp4']:.3g}) should fail the limit {_LIMIT:.3g}"
checks.at_most(f"KL of the engine with your NVFP4 (MXFP4: {_kls['mxfp4']:.3g})", _mine, _LIMIT)
### END HIDDEN TESTS

# %% nbgrader={"grade": true, "grade_id": "test_engine_matmul", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
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
