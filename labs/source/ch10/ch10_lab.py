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
# # Lab 10: keep the residual stream finite in float16
#
# Chapter 10 broke a float16 engine two ways, both on the embedded SmolLM2-135M:
#
# - **an RMSNorm that forgets to upcast** (`faults.rmsnorm_no_upcast`: the mean square
#   taken in float16). A square past 65504 (any |x| > 255.9) is inf, the row's variance
#   is inf, and the row normalises to zeros. This model's residual stream passes 255.9 on
#   its first token in most layers (chapter 10: about 770 after layer 2, about 25,000 from
#   layer 11 on), so the fault is natural here: chapter 10 measured a mean KL of about 7
#   nats against the float32 engine; float32 does not change at all.
# - **a residual stream past float16's range.** The unmodified model peaks at ~25k
#   (chapter 10: 24,926, 38 % of 65504, on the first token of its text), so it never
#   overflows on its own. `faults.residual_scale_reparam(llm, c)`
#   scales the stream by `c` and compensates exactly (float32 logits unchanged). The
#   peak sits on the first token; a sequence that starts with `<|im_start|>` (as every
#   chat prompt does) peaks at ~24.9k, so with `c = 2.75` it reaches ~68k: the MLP output
#   of layer 11 becomes inf in float16, and from there every logit is NaN, as Gemma 3
#   (transformers #36822) and T5 did in float16.
#
# This lab starts from those **broken engines**. You write three functions, the fixes
# the chapter measured, and make one decision:
#
# 1. `rms_norm(x, weight, eps)`: RMSNorm with its statistics in float32, 2 points;
# 2. `clamp_for_dtype(x, dtype)`: the clamp of transformers' T5/Gemma fixes, 2 points;
# 3. `fused_add_rms_norm(x, residual, weight, eps)`: vLLM's residual add + RMSNorm, with
#    the new residual clamped into the activation dtype's range, 2 points;
#
# then two restore checks (3 points each) plug them into the engine through the step
# registry (`llm.swap_step("rms_norm", ...)`, `llm.swap_step("fused_add_rms_norm", ...)`),
# score token sequences you have not seen, and compare with a float32 engine, next to
# the broken engine failing the same check;
#
# 4. `DEPLOY_DTYPE`: float16 or bfloat16 for each model, 2 points. Your fixes make
#    float16 finite; whether float16 is then the better 16-bit type is a measurement,
#    not a given.
#
# The grader also calls your functions on new tensors (other shapes, dtypes, magnitudes),
# so code that only fits the examples here will not pass.
#
# Run the cells in order. Do not edit the setup and test cells.

# %% nbgrader={"grade": false, "grade_id": "setup", "locked": true, "schema_version": 3, "solution": false, "task": false}
import importlib

import grading.checks as checks  # first import: records the original functions
import torch

from minivllm import LLM
from minivllm.layers.rms_norm import fused_add_rms_norm_ref, rms_norm_ref
from minivllm.precision import evalsets, faults, metrics

torch.manual_seed(0)
MODEL = "smollm2-135m-instruct"
FP16_MAX = torch.finfo(torch.float16).max  # 65504.0
_text = evalsets.load_corpus()
_ENGINES = {}


def engine(dtype):
    """The embedded model in ``dtype`` ("float32", "float16" or "bfloat16"), built on
    first use and kept (the restore checks build them; nothing here does)."""
    if dtype not in _ENGINES:
        _ENGINES[dtype] = LLM(MODEL, dtype=dtype, max_model_len=256)
    return _ENGINES[dtype]


_FRESH = {}


def _fresh_reference():
    """Two fresh token sequences (<|im_start|>, id 1, then 23 and 31 corpus tokens from
    random places, drawn when first asked) and their float32 log-probs: the grader's
    reference for both restore checks, computed once."""
    if not _FRESH:
        import random
        rng = random.Random(10004)
        tok = engine("float32").get_tokenizer()
        seqs = []
        for n in (24, 32):
            s = rng.randrange(0, len(_text) - 1500)
            seqs.append([1] + tok.encode(_text[s:s + 1500])[:n - 1])
        _FRESH["seqs"], _FRESH["ref"] = seqs, engine("float32").score(seqs)
    return _FRESH["seqs"], _FRESH["ref"]


def broken_norm(llm):
    """Broken engine 1: every RMSNorm takes its mean square in the activation dtype.
    ``with broken_norm(llm): ...``; outside the block the engine is correct."""
    return faults.rmsnorm_no_upcast(llm)


def amplified(llm):
    """The model with its residual stream scaled by 2.75 (exact in float32 up to
    rounding; past 65504 in float16 on a sequence that starts with <|im_start|>).
    ``with amplified(llm): ...``."""
    return faults.residual_scale_reparam(llm, 2.75)


# the fault on one row, no engine needed: a row of the residual stream with a 300 in it
_row = torch.tensor([[300.0, 1.0, -2.0, 4.0]], dtype=torch.float16)
_w = torch.ones(4, dtype=torch.float16)
print("a float16 row:               ", _row.tolist())
print("its square in float16:       ", _row.pow(2).tolist())
print("RMSNorm without the upcast:  ", faults.rms_norm_no_upcast(_row, _w, 1e-5).tolist())
print("RMSNorm of the engine (ref): ", rms_norm_ref(_row, _w, 1e-5).tolist())
_a = torch.tensor([[40000.0, 1.0]], dtype=torch.float16)
print("residual 40000 + sublayer output 40000 in float16:",
      fused_add_rms_norm_ref(_a, _a, torch.ones(2, dtype=torch.float16), 1e-5)[1].tolist())

# %% [markdown] nbgrader={"grade": false, "grade_id": "task1", "locked": true, "schema_version": 3, "solution": false, "task": false}
# ## Task 1: RMSNorm with float32 statistics (2 points)
#
# `x`: a tensor `[..., hidden]` in float16, bfloat16 or float32; `weight`: `[hidden]` in
# the same dtype; `eps`: a float. Return `weight * (x / sqrt(mean(x**2) + eps))` with the
# same shape and dtype as `x`, computed as the engine's reference (HF `LlamaRMSNorm`)
# does: cast `x` to float32, take the mean of squares over the last dimension and
# normalise in float32, cast the result back to `x`'s dtype, **then** multiply by
# `weight`. Rows whose |x| reaches 3e4 in float16 must come out right (that is the bug
# this fixes). Do not call `rms_norm_ref`.

# %% nbgrader={"grade": false, "grade_id": "rms_norm", "locked": false, "schema_version": 3, "solution": true, "task": false}
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    ### BEGIN SOLUTION
    h = x.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    return weight * (h * torch.rsqrt(variance + eps)).to(x.dtype)
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "test_rms_norm_visible", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
_got = rms_norm(_row, _w, 1e-5)
checks.equal("rms_norm returns a torch.Tensor", isinstance(_got, torch.Tensor), True)
checks.equal("rms_norm dtype (float16 in)", _got.dtype, torch.float16)
checks.equal("rms_norm shape", tuple(_got.shape), (1, 4))
# mean square (90000 + 1 + 4 + 16) / 4 = 22505.25, rms 150.017
for _i, _v in enumerate([300.0, 1.0, -2.0, 4.0]):
    checks.close(f"rms_norm([300, 1, -2, 4])[{_i}]", float(_got[0, _i]),
                 _v / (22505.25 + 1e-5) ** 0.5, rtol=2e-3)
print("visible test passed")

# %% nbgrader={"grade": true, "grade_id": "test_rms_norm_hidden", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
### BEGIN HIDDEN TESTS
_g = torch.Generator().manual_seed(10001)
# per-dtype tolerance on the output, relative to max |weight|: about 1 ulp of the dtype
_TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
for _dt in (torch.float16, torch.bfloat16, torch.float32):
    for _hidden in (7, 64, 576):
        _scale = torch.tensor([1e-3, 1.0, 30.0, 700.0, 3e4])[torch.randint(0, 5, (6, 1), generator=_g)]
        _x = (torch.randn(6, _hidden, generator=_g) * _scale).clamp(-6e4, 6e4).to(_dt)
        _wt = (torch.rand(_hidden, generator=_g) * 2).to(_dt)
        _eps = float([1e-6, 1e-5][int(torch.randint(0, 2, (), generator=_g))])
        _got = rms_norm(_x, _wt, _eps)
        _want = rms_norm_ref(_x, _wt, _eps)
        checks.equal(f"rms_norm dtype ({_dt}, hidden {_hidden})", _got.dtype, _dt)
        checks.equal(f"rms_norm shape ({_dt}, hidden {_hidden})", tuple(_got.shape), (6, _hidden))
        _err = float((_got.float() - _want.float()).abs().max())
        checks.at_most(f"max |rms_norm - reference| ({_dt}, hidden {_hidden}, rows up to "
                       f"|x| = {float(_x.float().abs().max()):.3g})", _err,
                       _TOL[_dt] * float(_wt.float().abs().max()))
# a batch with leading dimensions [2, 3, hidden]
_x = torch.randn(2, 3, 64, generator=_g).to(torch.float16) * 500
_got = rms_norm(_x, torch.ones(64, dtype=torch.float16), 1e-5)
checks.equal("rms_norm shape with leading dims [2, 3, 64]", tuple(_got.shape), (2, 3, 64))
checks.at_most("max |rms_norm - reference| on [2, 3, 64] float16 (|x| ~ 500)",
               float((_got.float() - rms_norm_ref(_x, torch.ones(64, dtype=torch.float16), 1e-5).float()).abs().max()),
               2e-3)
# the precision of the computation itself: the statistics in float32, as the engine's and
# vLLM's kernels keep them (no float64 anywhere, and float32 tensors for the 16-bit input)
for _dt in (torch.float16, torch.bfloat16):
    _, _seen = checks.op_dtypes(rms_norm, _x.to(_dt), torch.ones(64, dtype=_dt), 1e-5)
    checks.equal(f"float64 tensors computed inside rms_norm ({_dt} input; dtypes seen: "
                 f"{sorted(map(str, _seen))})", torch.float64 in _seen, False)
    checks.equal(f"float32 statistics inside rms_norm on {_dt} input", torch.float32 in _seen, True)
### END HIDDEN TESTS

# %% [markdown] nbgrader={"grade": false, "grade_id": "task2", "locked": true, "schema_version": 3, "solution": false, "task": false}
# ## Task 2: clamp into a dtype's range (2 points)
#
# `x`: a float tensor (any float dtype, often float32: a sum computed in float32 before
# it is stored in float16); `dtype`: the dtype the values are about to be stored in.
# Return a tensor of `x`'s shape and **`x`'s dtype** in which every value greater than
# `torch.finfo(dtype).max` (including +inf) is `torch.finfo(dtype).max`, every value below
# `-torch.finfo(dtype).max` (including -inf) is `-torch.finfo(dtype).max`, every other
# number is unchanged, and **NaN stays NaN**: a NaN means something already went wrong
# (0 * inf, inf - inf), and turning it into a number would hide a corrupted request.
# Return a new tensor and leave `x` as it is (the caller still uses it).
# (transformers clamps the same way in T5, PR #9487; the same clamp was proposed for
# Gemma 3 in PR #36832, closed without being merged, and in issue #39972.)

# %% nbgrader={"grade": false, "grade_id": "clamp_for_dtype", "locked": false, "schema_version": 3, "solution": true, "task": false}
def clamp_for_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    ### BEGIN SOLUTION
    limit = torch.finfo(dtype).max
    return x.clamp(min=-limit, max=limit)
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "test_clamp_visible", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
_got = clamp_for_dtype(torch.tensor([70000.0, -1.0, float("inf"), -float("inf")]), torch.float16)
checks.equal("clamp_for_dtype returns a torch.Tensor", isinstance(_got, torch.Tensor), True)
checks.equal("clamp_for_dtype keeps x's dtype (float32 in)", _got.dtype, torch.float32)
checks.equal("clamp_for_dtype([70000, -1, inf, -inf], float16)", _got.tolist(),
             [65504.0, -1.0, 65504.0, -65504.0])
print("visible test passed")

# %% nbgrader={"grade": true, "grade_id": "test_clamp_hidden", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
### BEGIN HIDDEN TESTS
_g = torch.Generator().manual_seed(10002)
_special = [float("inf"), -float("inf"), float("nan"), 65504.0, 65519.0, 65520.0, -65536.0,
            3.0e38, -3.3e38, 1.0, -0.0, 1e-30]
# (x's dtype, the target dtype): every pair where x's dtype can hold the target's limit
for _xdt, _dt in ((torch.float32, torch.float16), (torch.float32, torch.bfloat16),
                  (torch.float32, torch.float32), (torch.float64, torch.float16),
                  (torch.float64, torch.bfloat16), (torch.float64, torch.float32),
                  (torch.float16, torch.float16), (torch.bfloat16, torch.bfloat16)):
    if True:
        _x = torch.cat([torch.tensor(_special, dtype=torch.float64),
                        torch.randn(50, generator=_g, dtype=torch.float64) * 10.0 ** float(torch.randint(0, 39, (), generator=_g))]).to(_xdt)
        _got = clamp_for_dtype(_x, _dt)
        _lim = torch.finfo(_dt).max
        _want = torch.where(torch.isnan(_x), _x, _x.double().clamp(-_lim, _lim).to(_xdt))
        checks.equal(f"clamp_for_dtype dtype (x {_xdt}, into {_dt})", _got.dtype, _xdt)
        checks.equal(f"clamp_for_dtype shape (x {_xdt}, into {_dt})", tuple(_got.shape), tuple(_x.shape))
        checks.equal(f"clamp_for_dtype: NaN stays NaN, and only there (x {_xdt}, into {_dt})",
                     torch.isnan(_got).tolist(), torch.isnan(_x).tolist())
        _ok = torch.isnan(_want) | (_got == _want)
        checks.equal(f"clamp_for_dtype(x {_xdt}, {_dt}) equal to the clamp elementwise "
                     f"(first wrong values: {_x[~_ok][:3].tolist()} -> {_got[~_ok][:3].tolist()})",
                     bool(_ok.all()), True)
        checks.equal(f"clamp_for_dtype(x {_xdt}, {_dt}) is finite in {_dt} wherever x is not NaN",
                     bool(torch.isfinite(_got.to(_dt)[~torch.isnan(_x)]).all()), True)
# x is the caller's sum, still in use: returned as a new tensor, x left as it was
_x = torch.tensor([7e4, -1.0, float("inf"), float("nan"), -7e4])
_got = checks.call("clamp_for_dtype(x, float16)", clamp_for_dtype, _x, torch.float16)
checks.new_object("clamp_for_dtype(x, float16)", _got, _x)
### END HIDDEN TESTS

# %% [markdown] nbgrader={"grade": false, "grade_id": "task3", "locked": true, "schema_version": 3, "solution": false, "task": false}
# ## Task 3: the residual add, kept in range (2 points)
#
# vLLM's `fused_add_rms_norm` adds a sublayer's output `x` (attention or MLP, `[..., hidden]`)
# to the residual stream `residual` (same shape and dtype) and normalises the sum, in
# one kernel; the engine's `"fused_add_rms_norm"` step does the same for every residual
# add of the model. Write it so that the stream cannot leave the dtype's range:
#
# 1. the new residual: `residual + x` computed in float32, clamped into the range of
#    `residual`'s dtype (your `clamp_for_dtype`), then cast to `residual`'s dtype;
# 2. `normed`: RMSNorm (float32 statistics, your `rms_norm`) of that stored residual,
#    with `weight` and `eps`.
#
# Return the tuple `(normed, new_residual)`, both in `x`'s dtype and shape, as new tensors:
# leave `x` and `residual` as they are (vLLM's kernel overwrites `residual` in place; the
# engine's step returns the new residual instead). Where nothing
# passes the range this must equal the engine's reference `fused_add_rms_norm_ref`
# (which adds in the activation dtype and lets an fp16 sum past 65504 become inf).

# %% nbgrader={"grade": false, "grade_id": "fused_add_rms_norm", "locked": false, "schema_version": 3, "solution": true, "task": false}
def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float):
    ### BEGIN SOLUTION
    h = residual.to(torch.float32) + x.to(torch.float32)
    new_residual = clamp_for_dtype(h, residual.dtype).to(residual.dtype)
    return rms_norm(new_residual, weight, eps), new_residual
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "test_fused_visible", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
_x = torch.tensor([[40000.0, 1.0, float("inf"), -3.0]], dtype=torch.float16)
_r = torch.tensor([[40000.0, 2.0, 5.0, -60000.0]], dtype=torch.float16)
_out = fused_add_rms_norm(_x, _r, torch.ones(4, dtype=torch.float16), 1e-5)
checks.equal("fused_add_rms_norm returns a tuple of 2", isinstance(_out, tuple) and len(_out) == 2, True)
_normed, _res = _out
checks.equal("new residual dtype", _res.dtype, torch.float16)
checks.equal("new residual of [40000+40000, 2+1, 5+inf, -60000-3]", _res.tolist(),
             [[65504.0, 3.0, 65504.0, -60000.0]])
checks.equal("normed is finite", bool(torch.isfinite(_normed).all()), True)
checks.at_most("max |normed - RMSNorm(new residual)|",
               float((_normed.float() - rms_norm_ref(_res, torch.ones(4, dtype=torch.float16), 1e-5).float()).abs().max()),
               2e-3)
print("visible test passed")

# %% nbgrader={"grade": true, "grade_id": "test_fused_hidden", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
### BEGIN HIDDEN TESTS
_g = torch.Generator().manual_seed(10003)
_TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
for _dt in (torch.float16, torch.bfloat16, torch.float32):  # nothing passes the range
    _hidden = int(torch.randint(5, 600, (), generator=_g))
    _x = (torch.randn(5, _hidden, generator=_g) * 300).to(_dt)
    _r = (torch.randn(5, _hidden, generator=_g) * 3000).to(_dt)
    _wt = (torch.rand(_hidden, generator=_g) + 0.5).to(_dt)
    _n, _res = fused_add_rms_norm(_x, _r, _wt, 1e-6)
    _wn, _wres = fused_add_rms_norm_ref(_x, _r, _wt, 1e-6)
    checks.equal(f"dtypes ({_dt})", (_n.dtype, _res.dtype), (_dt, _dt))
    checks.equal(f"new residual equal to the reference's ({_dt}, hidden {_hidden}, in range)",
                 torch.equal(_res, _wres), True)
    checks.at_most(f"max |normed - reference| ({_dt}, hidden {_hidden})",
                   float((_n.float() - _wn.float()).abs().max()), _TOL[_dt] * 1.5)
# float16 past the range: sums beyond +-65504 and inf inputs (a sublayer that overflowed)
_hidden = 64
_x = (torch.randn(6, _hidden, generator=_g) * 100).to(torch.float16)
_r = (torch.randn(6, _hidden, generator=_g) * 100).to(torch.float16)
_cols = torch.randint(0, _hidden, (6,), generator=_g)
_rows = torch.arange(6)
_r[_rows, _cols] = torch.tensor([60000.0, -60000.0, 50000.0, 30000.0, -65504.0, 1.0], dtype=torch.float16)
_x[_rows, _cols] = torch.tensor([30000.0, -8000.0, float("inf"), 40000.0, -1000.0, -float("inf")], dtype=torch.float16)
_n, _res = fused_add_rms_norm(_x, _r, torch.ones(_hidden, dtype=torch.float16), 1e-5)
checks.equal("new residual is finite (float16 sums past 65504, inf inputs)",
             bool(torch.isfinite(_res).all()), True)
checks.equal("the clamped entries", _res[_rows, _cols].tolist(),
             [65504.0, -65504.0, 65504.0, 65504.0, -65504.0, -65504.0])
_other = torch.ones_like(_res, dtype=torch.bool)
_other[_rows, _cols] = False
checks.equal("entries in range equal to the float16 sum",
             torch.equal(_res[_other], (_r + _x)[_other]), True)
checks.equal("normed is finite", bool(torch.isfinite(_n).all()), True)
checks.at_most("max |normed - RMSNorm(new residual)| (float16)",
               float((_n.float() - rms_norm_ref(_res, torch.ones(_hidden, dtype=torch.float16), 1e-5).float()).abs().max()),
               2e-3)
# the range is the residual's own dtype: a bfloat16 sum of 80000 and a float32 one of 2e5
# are in range there and stay (only float16's range ends at 65504)
for _dt, _a, _b in ((torch.bfloat16, 70000.0, 10000.0), (torch.float32, 1e5, 1e5)):
    _xx = torch.tensor([[_a, 1.0, -2.0, 3.0]], dtype=_dt)
    _rr = torch.tensor([[_b, 2.0, 5.0, -1.0]], dtype=_dt)
    _n2, _res2 = fused_add_rms_norm(_xx, _rr, torch.ones(4, dtype=_dt), 1e-5)
    checks.equal(f"new residual of [{_a:g} + {_b:g}, ...] in {_dt} (in that dtype's range)",
                 _res2.tolist(), (_rr.float() + _xx.float()).to(_dt).tolist())
# the sum in float32 (not float64): watched on the operations' dtypes; inputs unchanged
_x, _r = _x[:2].clone(), _r[:2].clone()
_, _seen = checks.op_dtypes(fused_add_rms_norm, _x, _r, torch.ones(_hidden, dtype=torch.float16), 1e-5)
checks.equal(f"float64 tensors computed inside fused_add_rms_norm (dtypes seen: "
             f"{sorted(map(str, _seen))})", torch.float64 in _seen, False)
_ = checks.call("fused_add_rms_norm(x, residual, weight, eps)", fused_add_rms_norm, _x, _r,
                torch.ones(_hidden, dtype=torch.float16), 1e-5)
### END HIDDEN TESTS

# %% [markdown] nbgrader={"grade": false, "grade_id": "restore", "locked": true, "schema_version": 3, "solution": false, "task": false}
# ## Restore checks (3 points each)
#
# The checks score two fresh token sequences (`<|im_start|>` followed by 23 and 31
# tokens of the corpus, from random places) with a float32 engine (the reference) and with a float16 engine, and
# compares with the mean KL divergence per position (nats).
#
# 1. **The norm.** Your `rms_norm` replaces every RMSNorm of the float16 engine
#    (`"rms_norm"` step). Pass: KL at most 1e-4 nats (the correct float16 engine measures
#    2e-5 to 5e-5 against float32), or at most twice the correct float16 engine's KL on
#    the same sequences where that is higher (about 2 % of draws hit a near tie that
#    float16 flips: up to 2.8e-3 measured). The broken engine (`broken_norm`) is measured
#    by the same check and must fail it.
# 2. **The overflow.** The float16 engine with its residual stream scaled by 2.75
#    (`amplified`) runs your `fused_add_rms_norm` as its `"fused_add_rms_norm"` step (every
#    residual add). Pass: every log-prob finite (no NaN row) and KL at most 1e-2 nats
#    (the clamp is not free: chapter 10 measured its cost). The amplified engine with the
#    engine's own add must fail the same check.

# %% nbgrader={"grade": true, "grade_id": "test_restore_norm", "locked": true, "points": 3, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
### BEGIN HIDDEN TESTS
_probe = rms_norm(_row, _w, 1e-5)  # your function first: a stub fails here, before any engine


def _kl(ref_rows, rows):
    if not all(bool(torch.isfinite(r).all()) for r in rows):
        return float("nan")
    return sum(metrics.mean_kl(a, b) for a, b in zip(ref_rows, rows)) / len(rows)


_seqs, _ref = _fresh_reference()
_f16 = engine("float16")
with _f16.swap_step("rms_norm", rms_norm):
    _mine = _kl(_ref, _f16.score(_seqs))
_correct = _kl(_ref, _f16.score(_seqs))  # the engine's own (upcasting) RMSNorm
with broken_norm(_f16):
    _bad = _kl(_ref, _f16.score(_seqs))
# The bound: 1e-4, or twice the correct float16 engine's KL on the same sequences where
# that is higher. Measured over 325 draws: the correct engine gives 2e-5..5e-5 on most
# draws, but 1e-4..2.8e-3 on about 2 % (a position where float16 flips a near tie), and a
# fixed 1e-4 failed the reference solution there. The broken engine: 6-7.4 nats.
_bound = max(1e-4, 2 * _correct)
print(f"mean KL vs float32, fresh sequences of {[len(s) for s in _seqs]} tokens: "
      f"your rms_norm {_mine:.3g} nats, the correct float16 engine {_correct:.3g}, the "
      f"broken engine {_bad:.3g} nats; pass: at most {_bound:.3g}")
if _bad == _bad and _bad <= _bound:
    raise checks.CheckFailed("the check does not discriminate: the broken engine passes it")
checks.at_most("mean KL vs float32 with your rms_norm in every layer (float16)", _mine, _bound)
### END HIDDEN TESTS

# %% nbgrader={"grade": true, "grade_id": "test_restore_overflow", "locked": true, "points": 3, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
### BEGIN HIDDEN TESTS
_probe = fused_add_rms_norm(_row, _row, _w, 1e-5)  # your function first


def _measure(rows, ref_rows):
    nan_rows = sum(int((~torch.isfinite(r)).any(-1).sum()) for r in rows)
    if nan_rows:
        return nan_rows, float("nan")
    return 0, sum(metrics.mean_kl(a, b) for a, b in zip(ref_rows, rows)) / len(rows)


_seqs, _ref = _fresh_reference()
_f16 = engine("float16")
with amplified(_f16):
    with _f16.swap_step("fused_add_rms_norm", fused_add_rms_norm):
        _mine = _measure(_f16.score(_seqs), _ref)
    _bad = _measure(_f16.score(_seqs), _ref)
print(f"amplified float16 engine, fresh sequences of {[len(s) for s in _seqs]} tokens: "
      f"your fused_add_rms_norm: {_mine[0]} non-finite rows, mean KL vs float32 "
      f"{_mine[1]:.3g} nats; the engine's own add: {_bad[0]} non-finite rows, KL {_bad[1]:.3g}")
if _bad[0] == 0 and _bad[1] <= 1e-2:
    raise checks.CheckFailed("the check does not discriminate: the broken engine passes it")
checks.equal("non-finite rows with your fused_add_rms_norm", _mine[0], 0)
checks.at_most("mean KL vs float32 with your fused_add_rms_norm (amplified, float16)",
               _mine[1], 1e-2)
### END HIDDEN TESTS


# %% [markdown] nbgrader={"grade": false, "grade_id": "task4", "locked": true, "schema_version": 3, "solution": false, "task": false}
# ## Task 4: float16 or bfloat16? (2 points)
#
# Two teams serve this model in 16 bits, one the unmodified model, one the amplified one
# (residual stream scaled by 2.75, as `amplified` above). Both run float16 with your
# fixes, because "float16 has 3 more significand bits". Decide, for each model, which
# 16-bit dtype to serve it in: `"float16"` (with the engine's upcasting RMSNorm and the
# clamped residual add of task 3) or `"bfloat16"` (the engine as it is: bfloat16 has
# float32's range, so it needs no clamp). The right one is the one whose log-probs are
# closer to float32's. Measure before you decide: `deploy_kl(dtype, amplified_model)`
# below (`amplified_model` True or False) scores two example sequences of chapter 10's
# kind and returns the mean KL against float32 (it runs your `rms_norm` and
# `fused_add_rms_norm` in float16, so fix those first: a NaN means they are not right).
#
# The grader scores sequences you have not seen with both dtypes for each model (its own
# float16 fixes, so only your decision counts) and requires your choice to be the dtype
# with the lower mean KL against float32. Serving float16 for both, where this task
# starts, must fail that check.

# %% nbgrader={"grade": false, "grade_id": "deploy_helper", "locked": true, "schema_version": 3, "solution": false, "task": false}
def deploy_kl(dtype: str, amplified_model: bool) -> float:
    """Mean KL (nats per position) against float32 of the model served in ``dtype``
    ("float16": your rms_norm and fused_add_rms_norm swapped in; "bfloat16": the engine
    as it is) on two example sequences that start with <|im_start|>; the amplified model
    when ``amplified_model``. Builds the bfloat16 engine on first use (~1 s)."""
    import contextlib
    if dtype not in ("float16", "bfloat16"):
        raise ValueError(f"dtype must be 'float16' or 'bfloat16', got {dtype!r}")
    if not isinstance(amplified_model, bool):
        raise TypeError(f"amplified_model must be True or False, got {amplified_model!r}")
    tok = engine("float32").get_tokenizer()
    seqs = [[1] + tok.encode(_text[i:i + 1500])[:n - 1] for i, n in ((2000, 24), (9000, 32))]
    ref = engine("float32").score(seqs)
    llm = engine(dtype)
    with contextlib.ExitStack() as stack:
        if amplified_model:
            stack.enter_context(amplified(llm))
        if dtype == "float16":
            stack.enter_context(llm.swap_step("rms_norm", rms_norm))
            stack.enter_context(llm.swap_step("fused_add_rms_norm", fused_add_rms_norm))
        rows = llm.score(seqs)
    if not all(bool(torch.isfinite(r).all()) for r in rows):
        return float("nan")
    return sum(metrics.mean_kl(a, b) for a, b in zip(ref, rows)) / len(rows)


# %% nbgrader={"grade": false, "grade_id": "deploy", "locked": false, "schema_version": 3, "solution": true, "task": false}
DEPLOY_DTYPE = {"plain": "float16", "amplified": "float16"}  # where the task starts
### BEGIN SOLUTION
DEPLOY_DTYPE = {"plain": "float16", "amplified": "bfloat16"}
### END SOLUTION

# %% nbgrader={"grade": true, "grade_id": "test_deploy", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
### BEGIN HIDDEN TESTS
import contextlib as _contextlib

checks.equal("DEPLOY_DTYPE's keys", sorted(DEPLOY_DTYPE) if isinstance(DEPLOY_DTYPE, dict) else
             DEPLOY_DTYPE, ["amplified", "plain"])
for _m, _d in DEPLOY_DTYPE.items():
    checks.one_of(f"DEPLOY_DTYPE[{_m!r}]", _d, ["float16", "bfloat16"])


def _clamped_add(x, residual, weight, eps):  # the grader's own float16 fix (task 3's contract)
    _lim = torch.finfo(residual.dtype).max
    _res = (residual.float() + x.float()).clamp(-_lim, _lim).to(residual.dtype)
    return rms_norm_ref(_res, weight, eps), _res


_seqs, _ref = _fresh_reference()
_kls = {}
for _m in ("plain", "amplified"):
    for _d in ("float16", "bfloat16"):
        _llm = engine(_d)
        with _contextlib.ExitStack() as _stack:
            if _m == "amplified":
                _stack.enter_context(amplified(_llm))
            if _d == "float16":
                _stack.enter_context(_llm.swap_step("fused_add_rms_norm", _clamped_add))
            _rows = _llm.score(_seqs)
        _kls[_m, _d] = sum(metrics.mean_kl(a, b) for a, b in zip(_ref, _rows)) / len(_rows)
_best = {_m: min(("float16", "bfloat16"), key=lambda d: _kls[_m, d]) for _m in ("plain", "amplified")}
print("mean KL vs float32 on fresh sequences (nats): " + "; ".join(
    f"{_m}: float16 {_kls[_m, 'float16']:.3g}, bfloat16 {_kls[_m, 'bfloat16']:.3g}"
    for _m in ("plain", "amplified")))
if all(_best[_m] == "float16" for _m in _best):
    raise checks.CheckFailed("the check does not discriminate: float16 for both passes it")
for _m in ("plain", "amplified"):
    checks.equal(f"DEPLOY_DTYPE[{_m!r}] (float16 {_kls[_m, 'float16']:.3g} nats, bfloat16 "
                 f"{_kls[_m, 'bfloat16']:.3g} nats on fresh sequences)", DEPLOY_DTYPE[_m], _best[_m])
### END HIDDEN TESTS
