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
# # Lab 18: deliver the KV-cache scales
#
# In chapter 18 the value of an fp8 KV scale hardly mattered (1.0, 4.0 and calibrated
# scales gave the same KL), but a scale that the writer used and the reader dropped
# turned the model into noise: KL over 20 nats, the greedy answer gone. That is
# TensorRT-LLM PR #16916 (GSM8K 96.44 → 74.45 until the scale buffers were delivered)
# and flashinfer #1023 (the reader ignored `k_scale` / `v_scale`).
#
# This lab starts from that **broken engine**: `fp8_e4m3` KV cache, calibrated per-layer
# scales, and the reader dropping them (`faults.kv_scale_dropped(llm, "read")`, planted
# on the `"kv.dequantize"` step). You write the cache's two steps and the calibration
# formula yourself. The grader calls them on **new** tensors (other formats, scale
# shapes, input dtypes, values past the format's range, exact ties) and compares with the
# engine's reference bit for bit. Then you choose the cache format for a memory budget
# (which of the caches that fit loses least), and the grader plugs your functions into an
# engine with that cache and the broken engine's fault (`llm.swap_step("kv.quantize",
# ...)` and `"kv.dequantize"`), with scales that your calibration computes on text you
# have not seen, and checks that your format is the best that fits and that the KL
# against a float32 KV cache is back at the calibrated engine's, next to the broken
# engine failing the same check.
#
# 1. `quantize_kv(x, cache_dtype, scale)`: what the writer stores, 3 points;
# 2. `dequantize_kv(stored, dtype, scale)`: what the reader gets back, 2 points;
# 3. `calibrate_kv_scales(amax, cache_dtype, granularity)`: the static scales, 2 points;
# 4. `KV_CACHE_DTYPE`: the cache format for a budget, and the engine with your three
#    functions, 5 points.
#
# Run the cells in order. Do not edit the setup and test cells.

# %% nbgrader={"grade": false, "grade_id": "setup", "locked": true, "schema_version": 3, "solution": false, "task": false}
import importlib

import grading.checks as checks  # first import: records the original functions
import torch

from minivllm import LLM
from minivllm.precision import evalsets, faults, metrics

torch.manual_seed(0)
MODEL = "smollm2-135m-instruct"
COMMON = dict(dtype="float32", max_model_len=256, num_gpu_blocks_override=24)
llm = LLM(MODEL, kv_cache_dtype="fp8_e4m3", **COMMON)
tok = llm.get_tokenizer()
_text = evalsets.load_corpus()
llm.llm_engine.calibrate_kv_scales([tok.encode(_text[:1600])[:256]])  # per-layer amax / 448
example_ids = tok.encode(_text[5000:6500])[:48]


def broken():
    """The fault of chapter 18: the reader drops the scales (the "kv.dequantize" step).
    Use it as ``with broken(): ...``; outside the block the engine is correct."""
    return faults.kv_scale_dropped(llm, "read")


_scales = llm.kv_cache_scales()
with broken():
    _bad = llm.score(example_ids, output="logits")
_good = llm.score(example_ids, output="logits")
print(f"calibrated scales: layer 0 k_scale {_scales['k_scale'][0]:.4f}, v_scale "
      f"{_scales['v_scale'][0]:.5f}; layer 29 k_scale {_scales['k_scale'][29]:.4f}")
print(f"example ({len(example_ids)} tokens): the broken engine's next-token distributions are "
      f"{metrics.mean_kl(_good, _bad):.1f} nats (mean KL) away from the correct engine's")

# %% [markdown] nbgrader={"grade": false, "grade_id": "task1", "locked": true, "schema_version": 3, "solution": false, "task": false}
# ## Task 1: what the writer stores (3 points)
#
# `x` is K or V of some tokens, a float tensor `[tokens, kv_heads, head_dim]` (float32,
# float16 or bfloat16). `cache_dtype` is `torch.float8_e4m3fn`, `torch.float8_e5m2` or
# `torch.int8`. `scale` is a Python float or a float32 tensor that broadcasts against `x`:
# `[]` (one per tensor), `[kv_heads, 1]` (one per head) or `[tokens, kv_heads, 1]` (one
# per token and head, the dynamic scales).
#
# Return `x / scale` stored as `cache_dtype`, the way vLLM's cache kernels do it:
#
# - compute in float32: convert `x` first, then **divide** by the scale (multiplying by
#   `1 / scale` rounds differently and is not what the engine does);
# - saturate: clamp to `[-qmax, qmax]`, where qmax is the format's largest value (448 for
#   e4m3, 57344 for e5m2, `torch.finfo` knows both; 127 for int8, whose -128 is unused);
# - round to nearest, ties to even: for fp8 the cast does it; for int8 use `torch.round`
#   (a plain `.to(torch.int8)` truncates toward zero), then cast.
#
# Do not call the engine's `quantize_kv`: that would pass and teach nothing.

# %% nbgrader={"grade": false, "grade_id": "quantize_kv", "locked": false, "schema_version": 3, "solution": true, "task": false}
def quantize_kv(x: torch.Tensor, cache_dtype: torch.dtype, scale=1.0) -> torch.Tensor:
    ### BEGIN SOLUTION
    limit = 127.0 if cache_dtype == torch.int8 else float(torch.finfo(cache_dtype).max)
    y = (x.float() / scale).clamp(-limit, limit)
    if cache_dtype == torch.int8:
        return torch.round(y).to(torch.int8)
    return y.to(cache_dtype)
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "test_quantize_visible", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
_x = torch.tensor([0.5, -3.0, 500.0, 1e-4, 0.25, 0.75]).reshape(1, 1, 6)
_q = quantize_kv(_x, torch.float8_e4m3fn, 1.0)
checks.equal("quantize_kv(x, float8_e4m3fn, 1.0).dtype", _q.dtype, torch.float8_e4m3fn)
checks.equal("quantize_kv(x, float8_e4m3fn, 1.0) as floats (500 saturates at 448, 1e-4 is "
             "below e4m3's smallest subnormal 2^-9 and rounds to 0)",
             _q.float().flatten().tolist(), [0.5, -3.0, 448.0, 0.0, 0.25, 0.75])
_q = quantize_kv(_x, torch.int8, torch.tensor(0.5))
checks.equal("quantize_kv(x, int8, 0.5) (x / 0.5 = 1, -6, 1000 -> 127, 0.0002 -> 0, "
             "0.5 -> 0 and 1.5 -> 2: ties to even)", _q.flatten().tolist(), [1, -6, 127, 0, 0, 2])
print("visible test passed")

# %% nbgrader={"grade": true, "grade_id": "test_quantize_hidden", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
### BEGIN HIDDEN TESTS
from minivllm.quantization.kv_cache import qmax as _qmax, quantize_kv as _quantize_ref

_g = torch.Generator().manual_seed(18001)


def _bits(t):
    return t.view(torch.uint8) if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else t


for _dt in (torch.float8_e4m3fn, torch.float8_e5m2, torch.int8):
    for _in in (torch.float32, torch.bfloat16, torch.float16):
        _T, _H, _D = int(torch.randint(3, 9, (), generator=_g)), 3, 16
        _x = torch.randn(_T, _H, _D, generator=_g) * torch.tensor([0.02, 1.0, 15.0])[:, None]
        _x[0, 1, :4] = torch.tensor([0.0, -0.0, 3.0e4, -9.0e4])  # zeros and values past 448
        _x = _x.to(_in)
        _dyn = _x.float().abs().amax(-1, keepdim=True) * (1.0 / _qmax(_dt))
        _dyn = torch.where(_dyn > 0, _dyn, torch.ones_like(_dyn))
        for _name, _s in (("1.0", 1.0), ("a float", 0.0371), ("a 0-d tensor", torch.tensor(0.013)),
                          ("per head [3, 1]", torch.tensor([[0.002], [0.05], [0.7]])),
                          ("per token [T, 3, 1]", _dyn)):
            _got = quantize_kv(_x.clone(), _dt, _s)        # the learner's function first
            _want = _quantize_ref(_x, _dt, _s)
            checks.equal(f"quantize_kv({_in} x, {_dt}, scale {_name}).dtype", _got.dtype, _dt)
            checks.equal(f"quantize_kv({_in} x, {_dt}, scale {_name}) equal to the engine's, "
                         f"bit for bit", torch.equal(_bits(_got), _bits(_want)), True)
# int8 exact ties at every half-integer: 0.5, 1.5, 2.5, ... must go to the even neighbour
_ties = (torch.arange(-20, 20) + 0.5).reshape(2, 2, 10) * 0.25
checks.equal("quantize_kv(half-integer multiples of 0.25, int8, 0.25): ties to even",
             torch.equal(quantize_kv(_ties, torch.int8, 0.25),
                         _quantize_ref(_ties, torch.int8, 0.25)), True)
# ties at a scale that is not a power of two: x / 0.37 lands on a half-integer where
# x * (1 / 0.37) lands an ulp away, so only the division the task states gives these codes
_s37 = torch.tensor(0.37)
_near = (torch.arange(-300, 300, dtype=torch.float32) + 0.5) * _s37
_mid = _near[torch.round(_near / _s37) != torch.round(_near * (1.0 / _s37))]
checks.equal(f"quantize_kv(x, int8, 0.37) at {_mid.numel()} values where x / 0.37 is a tie: "
             f"equal to the engine's (x divided by the scale, then rounded half to even)",
             torch.equal(quantize_kv(_mid.clone(), torch.int8, _s37),
                         _quantize_ref(_mid, torch.int8, _s37)), True)
### END HIDDEN TESTS

# %% [markdown] nbgrader={"grade": false, "grade_id": "task2", "locked": true, "schema_version": 3, "solution": false, "task": false}
# ## Task 2: what the reader gets back (2 points)
#
# `stored` is what task 1 returns (any shape, `torch.float8_e4m3fn`, `torch.float8_e5m2`
# or `torch.int8`); `scale` broadcasts against it as in task 1; `dtype` is the compute
# dtype attention wants (float32, float16 or bfloat16). Return `stored · scale` in
# `dtype`, multiplied in float32 and cast once at the end. This is the step whose scale
# went missing in the broken engine.

# %% nbgrader={"grade": false, "grade_id": "dequantize_kv", "locked": false, "schema_version": 3, "solution": true, "task": false}
def dequantize_kv(stored: torch.Tensor, dtype: torch.dtype, scale=1.0) -> torch.Tensor:
    ### BEGIN SOLUTION
    return (stored.to(torch.float32) * scale).to(dtype)
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "test_dequantize_visible", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
_s = torch.tensor([1, -6, 127], dtype=torch.int8)
_got = dequantize_kv(_s, torch.float32, torch.tensor(0.5))
checks.equal("dequantize_kv(int8 [1, -6, 127], float32, 0.5)", _got.tolist(), [0.5, -3.0, 63.5])
_s = torch.tensor([0.5, 448.0]).to(torch.float8_e4m3fn)
_got = dequantize_kv(_s, torch.bfloat16, 0.25)
checks.equal("dequantize_kv(e4m3 [0.5, 448], bfloat16, 0.25).dtype", _got.dtype, torch.bfloat16)
checks.equal("dequantize_kv(e4m3 [0.5, 448], bfloat16, 0.25)", _got.float().tolist(), [0.125, 112.0])
print("visible test passed")

# %% nbgrader={"grade": true, "grade_id": "test_dequantize_hidden", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
### BEGIN HIDDEN TESTS
from minivllm.quantization.kv_cache import dequantize_kv as _dequantize_ref
from minivllm.quantization.kv_cache import quantize_kv as _quantize_ref

_g = torch.Generator().manual_seed(18002)
for _dt in (torch.float8_e4m3fn, torch.float8_e5m2, torch.int8):
    _T = int(torch.randint(2, 7, (), generator=_g))
    _stored = _quantize_ref(torch.randn(_T, 3, 8, generator=_g) * 200, _dt, 1.0)
    for _name, _s in (("a float", 0.0123), ("a 0-d tensor", torch.tensor(3.7)),
                      ("per head [3, 1]", torch.tensor([[0.001], [0.02], [5.0]])),
                      ("per token [T, 3, 1]", torch.rand(_T, 3, 1, generator=_g) + 0.01)):
        for _out in (torch.float32, torch.bfloat16, torch.float16):
            _got = dequantize_kv(_stored.clone(), _out, _s)   # the learner's function first
            _want = _dequantize_ref(_stored, _out, _s)
            checks.equal(f"dequantize_kv({_dt}, {_out}, scale {_name}).dtype", _got.dtype, _out)
            checks.equal(f"dequantize_kv({_dt}, {_out}, scale {_name}) equal to the engine's",
                         torch.equal(_got, _want), True)
### END HIDDEN TESTS

# %% [markdown] nbgrader={"grade": false, "grade_id": "task3", "locked": true, "schema_version": 3, "solution": false, "task": false}
# ## Task 3: the calibration formula (2 points)
#
# Calibration runs the float model on some text and records, per layer, the largest |K|
# (and |V|) of each KV head: `amax`, a float32 tensor `[kv_heads]` (>= 0). Return the
# static scales of one layer as a float32 tensor:
#
# - `granularity="tensor"`: one scale for the whole layer (a 0-d tensor) from the largest
#   of the heads' amax; `"head"`: one per head (shape `[kv_heads]`);
# - the scale is `amax / qmax` (qmax of `cache_dtype` as in task 1), so that the largest
#   calibrated value is stored as the format's largest value;
# - a head (or layer) whose amax is 0 stored only zeros: give it scale 1.0, never 0;
# - any other granularity: raise `ValueError`.

# %% nbgrader={"grade": false, "grade_id": "calibrate_kv_scales", "locked": false, "schema_version": 3, "solution": true, "task": false}
def calibrate_kv_scales(amax: torch.Tensor, cache_dtype: torch.dtype,
                        granularity: str = "tensor") -> torch.Tensor:
    ### BEGIN SOLUTION
    if granularity not in ("tensor", "head"):
        raise ValueError(f"granularity must be 'tensor' or 'head', got {granularity!r}")
    limit = 127.0 if cache_dtype == torch.int8 else float(torch.finfo(cache_dtype).max)
    a = amax.float() if granularity == "head" else amax.float().max()
    return torch.where(a > 0, a / limit, torch.ones_like(a))
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "test_calibrate_visible", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
_a = torch.tensor([0.0, 2.24, 4.48])
_got = calibrate_kv_scales(_a, torch.float8_e4m3fn, "head")
checks.equal("calibrate_kv_scales([0, 2.24, 4.48], e4m3, 'head').dtype", _got.dtype, torch.float32)
for _i, _w in enumerate((1.0, 0.005, 0.01)):
    checks.close(f"calibrate_kv_scales([0, 2.24, 4.48], e4m3, 'head')[{_i}]", float(_got[_i]), _w)
_got = calibrate_kv_scales(_a, torch.int8, "tensor")
checks.equal("calibrate_kv_scales(..., int8, 'tensor') shape", tuple(_got.shape), ())
checks.close("calibrate_kv_scales([0, 2.24, 4.48], int8, 'tensor')", float(_got), 4.48 / 127)
print("visible test passed")

# %% nbgrader={"grade": true, "grade_id": "test_calibrate_hidden", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
### BEGIN HIDDEN TESTS
from minivllm.quantization.kv_cache import kv_scales_from_amax as _from_amax, qmax as _qmax

_g = torch.Generator().manual_seed(18003)
for _dt in (torch.float8_e4m3fn, torch.float8_e5m2, torch.int8):
    for _H in (1, 3, 8):
        _amax = torch.rand(_H, generator=_g) * 30
        _amax[torch.rand(_H, generator=_g) < 0.3] = 0.0
        for _gran, _ref_a in (("head", _amax), ("tensor", _amax.max())):
            _got = calibrate_kv_scales(_amax.clone(), _dt, _gran)   # the learner's function first
            _want = _from_amax(_ref_a, _qmax(_dt))
            checks.equal(f"calibrate_kv_scales(amax {_amax.tolist()}, {_dt}, {_gran!r}).dtype",
                         _got.dtype, torch.float32)
            checks.equal(f"calibrate_kv_scales(amax [{_H}], {_dt}, {_gran!r}) shape",
                         tuple(_got.shape), tuple(_want.shape))
            checks.equal(f"calibrate_kv_scales(amax {_amax.tolist()}, {_dt}, {_gran!r}) equal to "
                         f"the engine's {_want.tolist()}", torch.equal(_got, _want), True)
_zero = calibrate_kv_scales(torch.zeros(3), torch.float8_e5m2, "tensor")
checks.equal("calibrate_kv_scales(all zeros, e5m2, 'tensor')", float(_zero), 1.0)
# amax below 1 is an amax like any other (only 0 gets scale 1.0)
_small = torch.tensor([0.0, 0.25, 0.9, 1.0, 7.0])
for _dt in (torch.int8, torch.float8_e4m3fn):
    checks.equal(f"calibrate_kv_scales({_small.tolist()}, {_dt}, 'head') equal to the engine's",
                 torch.equal(calibrate_kv_scales(_small.clone(), _dt, "head"),
                             _from_amax(_small, _qmax(_dt))), True)
for _bad in ("block", "token", None):
    try:
        calibrate_kv_scales(torch.ones(3), torch.int8, _bad)
    except ValueError:
        continue
    raise checks.CheckFailed(f"calibrate_kv_scales(..., granularity={_bad!r}) should raise ValueError")
### END HIDDEN TESTS

# %% [markdown] nbgrader={"grade": false, "grade_id": "task4", "locked": true, "schema_version": 3, "solution": false, "task": false}
# ## Task 4: the cache format, and your steps in the broken engine (5 points)
#
# The server has `KV_BUDGET_BYTES` (48 MiB) for this model's K/V cache (30 layers, 3 K/V
# heads of 64 dimensions, blocks of 16 tokens) and must hold **two requests of 2,048
# tokens at once** (prompt and output; chapter 18's passkey prompts are that long), so
# that neither waits or is preempted. Choose `KV_CACHE_DTYPE` from `KV_OPTIONS`: the
# cache with the lowest KL against a float32 cache whose pool holds both requests.
# Quantized caches get per-tensor scales from calibration. ("auto" is the model dtype,
# float32 here: vLLM's default, and where this task starts.)
#
# `pool_blocks(kv_cache_dtype)` returns the blocks the budget gives that cache (the
# engine's own sizing, `kv_cache_bytes_per_block`); `cache_kl(kv_cache_dtype)` the mean
# KL (nats per position) of that cache, calibrated by the engine, against a float32
# cache on the example window. Work out what you expect first (chapter 18, sections 1-2),
# then measure; `cache_kl` builds an engine per call (a few seconds).
#
# Then the grader calibrates on text you have not seen: it measures each layer's
# per-head amax of K and V and turns them into per-tensor scales with **your**
# `calibrate_kv_scales` for your format. On an engine with your cache, the broken
# engine's fault planted, it plugs your functions in as the cache's steps,
#
#     with broken(), llm.swap_step("kv.quantize", quantize_kv), \
#             llm.swap_step("kv.dequantize", dequantize_kv):
#         ...
#
# (the engine passes each layer's scale to your functions) and scores three fresh token
# sequences. It checks that
#
# - your format's pool holds the two requests, and that among the caches whose pools
#   hold them yours has the lowest mean KL against a float32 KV cache (each measured on
#   the same tokens with the engine's own steps and calibration);
# - with your functions, the mean KL is at most **1.1 times** that of the engine's own
#   calibrated path for your format (chapter 18: about 5e-3 nats for e4m3), and the broken
#   engine (e4m3, the reader dropping its scales: tens of nats) fails the same check. (A
#   KL above 0.5 nats fails at once, before the grader measures the references.)

# %% nbgrader={"grade": false, "grade_id": "kv_helper", "locked": true, "schema_version": 3, "solution": false, "task": false}
import gc

from minivllm.config import parse_kv_cache_dtype
from minivllm.quantization.kv_cache import is_quantized
from minivllm.worker.model_runner import kv_cache_bytes_per_block

KV_BUDGET_BYTES = 48 * 2**20
KV_OPTIONS = ("auto", "float16", "bfloat16", "fp8_e4m3", "fp8_e5m2")
REQUEST_TOKENS = (2048, 2048)   # each: prompt and output; both at once
_helper_ref = {}


def pool_blocks(kv_cache_dtype: str) -> int:
    """Blocks of 16 tokens that KV_BUDGET_BYTES gives a cache of ``kv_cache_dtype``."""
    if kv_cache_dtype not in KV_OPTIONS:
        raise ValueError(f"kv_cache_dtype must be one of {KV_OPTIONS}, got {kv_cache_dtype!r}")
    per_block = kv_cache_bytes_per_block(llm.llm_engine.model_config, 16,
                                         parse_kv_cache_dtype(kv_cache_dtype, torch.float32), False)
    return KV_BUDGET_BYTES // per_block


def cache_kl(kv_cache_dtype: str, ids=None) -> float:
    """Mean KL (nats per position) of a ``kv_cache_dtype`` cache against a float32 cache
    on ``ids`` (default: example_ids); quantized caches get per-tensor scales calibrated
    by the engine on the setup's calibration text."""
    if kv_cache_dtype not in KV_OPTIONS:
        raise ValueError(f"kv_cache_dtype must be one of {KV_OPTIONS}, got {kv_cache_dtype!r}")
    ids = ids or example_ids
    if "float32" not in _helper_ref:
        _helper_ref["float32"] = LLM(MODEL, kv_cache_dtype="float32", **COMMON)
    want = _helper_ref["float32"].score(ids, output="logits")
    eng = LLM(MODEL, kv_cache_dtype=kv_cache_dtype, **COMMON)
    if is_quantized(eng.llm_engine.cache_config.kv_cache_torch_dtype):
        eng.llm_engine.calibrate_kv_scales([tok.encode(_text[:1600])[:256]])
    got = eng.score(ids, output="logits")
    del eng
    gc.collect()
    return metrics.mean_kl(want, got)


print(f"budget {KV_BUDGET_BYTES:,} bytes; two requests of {REQUEST_TOKENS[0]} tokens need "
      f"{sum(-(-n // 16) for n in REQUEST_TOKENS)} blocks of 16 tokens")

# %% nbgrader={"grade": false, "grade_id": "kv_cache_dtype", "locked": false, "schema_version": 3, "solution": true, "task": false}
KV_CACHE_DTYPE = "auto"  # vLLM's default, the model dtype: where this task starts
### BEGIN SOLUTION
KV_CACHE_DTYPE = "fp8_e4m3"
### END SOLUTION

# %% nbgrader={"grade": true, "grade_id": "test_restore", "locked": true, "points": 5, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
### BEGIN HIDDEN TESTS
import gc as _gc
import random as _random

from minivllm.config import parse_kv_cache_dtype as _parse
from minivllm.quantization.kv_calibration import calibrate_kv_amax as _calibrate_amax
from minivllm.quantization.kv_cache import kv_scales_from_amax as _from_amax, qmax as _qmax
from minivllm.worker.model_runner import kv_cache_bytes_per_block as _per_block

_probe = torch.randn(4, 3, 8, generator=torch.Generator().manual_seed(18004)) * 5                          # the learner's functions first: a
dequantize_kv(quantize_kv(_probe, torch.float8_e4m3fn, 0.05), torch.float32, 0.05)  # stub fails
calibrate_kv_scales(torch.rand(3, generator=torch.Generator().manual_seed(18099)), torch.float8_e4m3fn, "tensor")                     # at once
_options = ["auto", "float16", "bfloat16", "fp8_e4m3", "fp8_e5m2"]
checks.one_of("KV_CACHE_DTYPE", KV_CACHE_DTYPE, _options)
_eng = llm.llm_engine
_need = 2 * -(-2048 // 16)                     # two requests of 2,048 tokens, blocks of 16
_blocks = {_d: (48 * 2**20) // _per_block(_eng.model_config, 16, _parse(_d, torch.float32), False)
           for _d in _options}
_fits = [_d for _d in _options if _blocks[_d] >= _need]
print(f"the two requests need {_need} blocks; pool blocks in 48 MiB: {_blocks}")
checks.equal(f"the pool of KV_CACHE_DTYPE={KV_CACHE_DTYPE!r} ({_blocks[KV_CACHE_DTYPE]} blocks) "
             f"holds the two requests ({_need} blocks)", KV_CACHE_DTYPE in _fits, True)
_rng = _random.Random(18005)


def _fresh(n):
    _s = _rng.randrange(0, len(_text) - 2000)
    return tok.encode(_text[_s:_s + 2000])[:n]


_calib, _seqs = _fresh(160), [_fresh(n) for n in (61, 70, 57)]
_amax = _calibrate_amax(_eng.model_runner.model, [_calib])  # per layer: (K amax [3], V amax [3])
_engines = {"fp8_e4m3": llm}                                # one engine per format, built once
for _d in _fits:
    if _d not in _engines:
        _engines[_d] = LLM(MODEL, kv_cache_dtype=_d, **COMMON)


def _set(engine, scales):
    for _c, (_k, _v) in zip(engine.llm_engine.model_runner.kv_caches, scales):
        _c.set_scales(torch.as_tensor(_k, dtype=torch.float32), torch.as_tensor(_v, dtype=torch.float32))
    engine.llm_engine.kv_cache_manager.reset_prefix_cache()


_yours = _engines[KV_CACHE_DTYPE]
_dt = _yours.llm_engine.cache_config.kv_cache_torch_dtype
_set(_yours, [(calibrate_kv_scales(_k.clone(), _dt, "tensor"),
               calibrate_kv_scales(_v.clone(), _dt, "tensor")) for _k, _v in _amax])
with faults.kv_scale_dropped(_yours, "read"), _yours.swap_step("kv.quantize", quantize_kv), \
        _yours.swap_step("kv.dequantize", dequantize_kv):
    _mine = _yours.score(_seqs, output="logits")
_f32 = LLM(MODEL, kv_cache_dtype="float32", **COMMON)
_want = _f32.score(_seqs, output="logits")
del _f32
_gc.collect()


def _kl(rows):
    return float(torch.cat([metrics.kl_divergence(a, b) for a, b in zip(_want, rows)]).mean())


_kl_mine = _kl(_mine)
if not _kl_mine <= 0.5:  # 100x an fp8 cache's KL: no need to measure the references
    raise checks.CheckFailed(f"mean KL of the engine with your quantize/dequantize/calibration "
                             f"({KV_CACHE_DTYPE}) against a float32 KV cache: {_kl_mine:.3g} nats; "
                             f"a calibrated e4m3 cache gives about 5e-3 (chapter 18), the broken "
                             f"engine ~20")
_kl_opt = {}
for _d, _e in _engines.items():           # the engine's own steps and calibration rule
    _q = _qmax(_e.llm_engine.cache_config.kv_cache_torch_dtype)
    _set(_e, [(_from_amax(_k.max(), _q), _from_amax(_v.max(), _q)) for _k, _v in _amax])
    _kl_opt[_d] = _kl(_e.score(_seqs, output="logits"))
with broken():                            # llm: e4m3 with its calibrated scales
    _kl_bad = _kl(llm.score(_seqs, output="logits"))
for _d in [_d for _d in _engines if _d != "fp8_e4m3"]:
    del _engines[_d]
_gc.collect()
_best = min(_fits, key=_kl_opt.get)
_limit = 1.1 * _kl_opt[KV_CACHE_DTYPE]
print(f"{sum(map(len, _seqs))} fresh positions; mean KL against a float32 KV cache (nats) of "
      f"the caches that hold the requests, the engine's calibrated path: "
      + ", ".join(f"{_d} {_k:.3g}" for _d, _k in _kl_opt.items())
      + f"; your steps ({KV_CACHE_DTYPE}) {_kl_mine:.3g} (limit {_limit:.3g}); the broken "
      f"engine {_kl_bad:.3g}")
if not _kl_bad > 1.1 * _kl_opt["fp8_e4m3"]:
    raise checks.CheckFailed("the check does not discriminate: the broken engine passes it")
checks.equal(f"KV_CACHE_DTYPE: the lowest KL among the caches that hold the requests ({_best}, "
             f"{_kl_opt[_best]:.3g} nats; yours {_kl_opt[KV_CACHE_DTYPE]:.3g})", KV_CACHE_DTYPE, _best)
checks.at_most(f"mean KL of the engine ({KV_CACHE_DTYPE}) with your quantize/dequantize/calibration",
               _kl_mine, _limit)
### END HIDDEN TESTS
