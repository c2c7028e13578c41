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
# # Lab 19: K outlier channels and an int8 KV cache
#
# In chapter 19 one pair of K channels, made 64 times larger by an exact
# reparametrization (`faults.k_outlier_reparam`: the model computes the same function),
# broke an int8 KV cache with per-tensor scales: the planted channels set the layer's
# scale, and 94 % of the other values of their head were stored as 0. The KL against a
# float32 KV cache rose about thirtyfold. Per-head scales rescued the other heads only,
# dynamic per-token scales lost inside the head, and per-channel K scales (KIVI) gave
# bit-identical logits with and without the outliers. That is the pattern behind
# reports such as verl PR #4435 (Qwen2.5-Math-7B with an fp8 KV cache answering "????")
# and the model-dependent collapses of vllm #38652 and sglang #22671.
#
# This lab starts from that **broken configuration**: `kv_cache_dtype="int8"`,
# per-tensor scales calibrated on a model with planted K outlier channels. You write
#
# 1. `find_outlier_channels(k_samples, factor)`: which K channels are outliers, 3 points;
# 2. `per_channel_k_scales(k_amax, qmax)`: one static scale per (KV head, channel), 2 points;
# 3. `quantize_int8(x, scale)`: the int8 cache's write step with any scale shape, 2 points;
# 4. `choose_kv_config(measurements, budget)`: the cheapest cache within a KL budget, 2 points;
# 5. `KV_SCALE_GRANULARITY`: which scales the int8 cache gets with the outliers planted,
#    a decision, checked in the engine with your scales and quantizer, 8 points.
#
# The grader plants **fresh** outliers (a random layer, KV head and dimension) and calls
# your functions on them and on new tensors; then it calibrates your scales, at the
# granularity you chose, on text you have not seen, plugs your quantizer into the engine
# (`llm.swap_step("kv.quantize", ...)`) and checks the KL against a float32 KV cache; it
# measures every granularity the same way and requires yours to be the cheapest that
# meets the limit, next to per-tensor int8 (where this lab starts) failing the same check.
#
# Run the cells in order. Do not edit the setup and test cells. The engine is built the
# first time a cell calls `get_llm()` (a few seconds).

# %% nbgrader={"grade": false, "grade_id": "setup", "locked": true, "schema_version": 3, "solution": false, "task": false}
import importlib

import grading.checks as checks  # first import: records the original functions
import torch

from minivllm import LLM
from minivllm.precision import evalsets, faults, metrics
from minivllm.quantization.calibration import calibration_forward

torch.manual_seed(0)
MODEL = "smollm2-135m-instruct"
COMMON = dict(dtype="float32", max_model_len=256, num_gpu_blocks_override=24)
_LLM = {}


def get_llm():
    """The lab's engine: int8 KV cache, static scales (set by the caller; built once)."""
    if "int8" not in _LLM:
        _LLM["int8"] = LLM(MODEL, kv_cache_dtype="int8", kv_scale=(1.0, 1.0), **COMMON)
    return _LLM["int8"]


def capture_k(llm, token_ids):
    """The K every layer stores for one prefill of ``token_ids`` (after rotary, through
    ``llm``'s model, planted faults included): float32 [layers, tokens, kv_heads, head_dim]."""
    model = llm.llm_engine.model_runner.model
    got = []
    calibration_forward(model, [token_ids], after_sequence=lambda: got.append(
        torch.stack([layer.self_attn.kv_cache.key.clone() for layer in model.layers])))
    return got[0]


_text = evalsets.load_corpus()

# %% [markdown] nbgrader={"grade": false, "grade_id": "task1", "locked": true, "schema_version": 3, "solution": false, "task": false}
# ## Task 1: find the outlier channels (3 points)
#
# `k_samples` is what a calibration pass stores in K: a float tensor
# `[layers, tokens, kv_heads, head_dim]`. A *channel* is one (layer, KV head, dimension);
# its amax is its largest |K| over the tokens. A channel is an **outlier** when its amax
# is more than `factor` times the median of the amaxes of all channels of its layer
# (`kv_heads × head_dim` of them; any median convention passes the tests), compared in
# float32 whatever the dtype of `k_samples`.
#
# Return the outliers as a list of `(layer, kv_head, dim)` tuples of Python ints, sorted.
# On the unmodified model the largest channel of any layer is at most about 6 times its
# layer's median (chapter 19, section 1), so with `factor=10` nothing is found; with a
# planted pair, exactly the two planted channels (`j` and its rotary partner `j ± 32`).

# %% nbgrader={"grade": false, "grade_id": "find_outlier_channels", "locked": false, "schema_version": 3, "solution": true, "task": false}
def find_outlier_channels(k_samples: torch.Tensor, factor: float = 10.0) -> list:
    ### BEGIN SOLUTION
    amax = k_samples.abs().amax(dim=1).float()            # [layers, kv_heads, head_dim]
    median = amax.flatten(1).median(dim=1).values        # [layers]
    hits = (amax > factor * median[:, None, None]).nonzero().tolist()
    return sorted(tuple(int(i) for i in hit) for hit in hits)
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "test_find_visible", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
_k = torch.ones(2, 3, 2, 4)           # 2 layers, 3 tokens, 2 heads, 4 dims; every amax 1
_k[0, 1, 1, 2] = -30.0                # layer 0, head 1, dim 2: amax 30 (negative: |K| counts)
_k[1, 2, 0, 0] = 11.0                 # layer 1, head 0, dim 0: 11 > 10 x median 1
_k[1, 0, 0, 3] = 9.0                  # 9 is not more than 10 x 1
_got = find_outlier_channels(_k, 10.0)
checks.equal("find_outlier_channels(example, 10)", _got, [(0, 1, 2), (1, 0, 0)])
checks.equal("find_outlier_channels(example, 5)", find_outlier_channels(_k, 5.0),
             [(0, 1, 2), (1, 0, 0), (1, 0, 3)])
print("visible test passed")

# %% nbgrader={"grade": true, "grade_id": "test_find_hidden", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
### BEGIN HIDDEN TESTS
import random as _random

_rng = _random.Random(19001)
_g = torch.Generator().manual_seed(_rng.randrange(2 ** 31))
# 1. synthetic: layers at different magnitudes, outliers far above or far below the line
for _trial in range(3):
    _Lr, _T, _Hr, _Dr = _rng.randint(2, 5), _rng.randint(4, 9), _rng.randint(1, 4), 8
    _base = torch.rand(_Lr, 1, 1, 1, generator=_g) * 20 + 0.1        # per-layer magnitude
    _ks = (torch.rand(_Lr, _T, _Hr, _Dr, generator=_g) * 2 - 1) * _base
    _ks[:, 0] = _base[:, 0] * torch.where(torch.rand(_Lr, _Hr, _Dr, generator=_g) < 0.5, 1.0, -1.0)
    _want = []
    for _ in range(_rng.randint(0, 2)):   # at most 2 per tensor: fewer than half of any layer
        _o = (_rng.randrange(_Lr), _rng.randrange(_Hr), _rng.randrange(_Dr))
        _ks[_o[0], _rng.randrange(_T), _o[1], _o[2]] = _rng.choice([-1, 1]) * 25 * float(_base[_o[0]])
        _want.append(_o)
    _want = sorted(set(_want))
    _got = find_outlier_channels(_ks.clone(), 10.0)      # the learner's function first
    checks.equal(f"find_outlier_channels on a fresh [{_Lr}, {_T}, {_Hr}, {_Dr}] tensor (layer "
                 f"magnitudes {[round(float(b), 2) for b in _base.flatten()]})", _got, _want)
# 2. the model: a fresh planted pair, found exactly
_llm = get_llm()
_L, _h, _j = _rng.randrange(30), _rng.randrange(3), _rng.randrange(64)
_c = _rng.choice([128.0, 256.0])
_s = _rng.randrange(0, len(_text) - 2000)
_ids = _llm.get_tokenizer().encode(_text[_s:_s + 2000])[:128]
with faults.k_outlier_reparam(_llm, _L, _h, _j, _c) as _planted:
    _K = capture_k(_llm, _ids)
_got = find_outlier_channels(_K.clone(), 10.0)
checks.equal(f"find_outlier_channels(K of the model with a pair planted in layer {_L}, head {_h}, "
             f"c = {_c:g}, 10)", _got, sorted(_planted))
_got = find_outlier_channels(capture_k(_llm, _ids), 10.0)
checks.equal("find_outlier_channels(K of the unmodified model, 10)", _got, [])
# 3. the edges: an amax of exactly factor x median is not more than it; bfloat16 samples
# compared in float32 (9.99 x 1 rounds to 10 in bfloat16, and 10 > 9.99)
_e = torch.ones(1, 2, 2, 8)
_e[0, 0, 1, 3], _e[0, 1, 0, 6] = 10.0, -10.5
checks.equal("find_outlier_channels(amax 10 and 10.5 against a median of 1, 10)",
             find_outlier_channels(_e.clone(), 10.0), [(0, 0, 6)])
checks.equal("find_outlier_channels(the same in bfloat16, 9.99)",
             find_outlier_channels(_e.to(torch.bfloat16), 9.99), [(0, 0, 6), (0, 1, 3)])
### END HIDDEN TESTS

# %% [markdown] nbgrader={"grade": false, "grade_id": "task2", "locked": true, "schema_version": 3, "solution": false, "task": false}
# ## Task 2: per-channel K scales (2 points)
#
# `k_amax` is one layer's calibrated K maxima per channel: float32 `[kv_heads, head_dim]`,
# finite and >= 0 (any shape must work: the scale is elementwise). `qmax` is the format's
# largest value (127.0 for int8). Return float32 scales of the same shape,
# `amax / qmax`, so that each channel's largest calibrated value is stored as ±qmax, and
# **1.0 for a channel whose amax is 0** (it stored only zeros; a scale of 0 would divide
# by zero on the next write). Raise `ValueError` if `qmax` is not a positive number.

# %% nbgrader={"grade": false, "grade_id": "per_channel_k_scales", "locked": false, "schema_version": 3, "solution": true, "task": false}
def per_channel_k_scales(k_amax: torch.Tensor, qmax: float) -> torch.Tensor:
    ### BEGIN SOLUTION
    if not float(qmax) > 0:
        raise ValueError(f"qmax must be a positive number, got {qmax!r}")
    a = k_amax.float()
    return torch.where(a > 0, a / float(qmax), torch.ones_like(a))
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "test_scales_visible", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
_a = torch.tensor([[1.27, 0.0, 12.7], [254.0, 2.54, 0.127]])
_got = per_channel_k_scales(_a, 127.0)
checks.equal("per_channel_k_scales(amax [2, 3], 127).shape", tuple(_got.shape), (2, 3))
checks.equal("per_channel_k_scales(...).dtype", _got.dtype, torch.float32)
for (_i, _d), _w in {(0, 0): 0.01, (0, 1): 1.0, (0, 2): 0.1, (1, 0): 2.0, (1, 2): 0.001}.items():
    checks.close(f"per_channel_k_scales(amax, 127)[{_i}, {_d}] (amax {float(_a[_i, _d])})",
                 float(_got[_i, _d]), _w, rtol=1e-6)
print("visible test passed")

# %% nbgrader={"grade": true, "grade_id": "test_scales_hidden", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
### BEGIN HIDDEN TESTS
from minivllm.quantization.kv_cache import kv_scales_from_amax as _from_amax

_g = torch.Generator().manual_seed(19002)
for _shape in ((3, 64), (1, 8), (5,), ()):
    for _qm in (127.0, 448.0, 57344.0):
        _a = torch.rand(_shape, generator=_g) * 900
        if _a.ndim:
            _a[torch.rand(_shape, generator=_g) < 0.25] = 0.0
        _got = per_channel_k_scales(_a.clone(), _qm)        # the learner's function first
        _want = _from_amax(_a, _qm)
        checks.equal(f"per_channel_k_scales(amax of shape {_shape}, {_qm:g}).shape",
                     tuple(_got.shape), tuple(_want.shape))
        checks.equal(f"per_channel_k_scales(amax of shape {_shape}, {_qm:g}) equal to the "
                     f"engine's kv_scales_from_amax", torch.equal(_got.float(), _want), True)
_a = torch.rand(3, 8, generator=_g).to(torch.bfloat16) * 100
_got = per_channel_k_scales(_a.clone(), 127.0)
checks.equal("per_channel_k_scales(bfloat16 amax, 127).dtype", _got.dtype, torch.float32)
checks.equal("per_channel_k_scales(bfloat16 amax, 127) equal to the engine's",
             torch.equal(_got, _from_amax(_a.float(), 127.0)), True)
checks.equal("per_channel_k_scales(amax, 0.5): a qmax below 1 is still a positive number",
             torch.equal(per_channel_k_scales(torch.tensor([2.0, 0.0]), 0.5), torch.tensor([4.0, 1.0])), True)
for _bad in (0.0, -127.0):
    try:
        per_channel_k_scales(torch.ones(3, 4), _bad)
    except ValueError:
        continue
    raise checks.CheckFailed(f"per_channel_k_scales(..., qmax={_bad}) should raise ValueError")
### END HIDDEN TESTS

# %% [markdown] nbgrader={"grade": false, "grade_id": "task3", "locked": true, "schema_version": 3, "solution": false, "task": false}
# ## Task 3: the int8 write step (2 points)
#
# `x` is K or V of some tokens, `[tokens, kv_heads, head_dim]` (float32, float16 or
# bfloat16); `scale` is a float32 tensor that broadcasts against it: `[]` (per tensor),
# `[kv_heads, 1]` (per head), `[kv_heads, head_dim]` (your per-channel K scales) or
# `[tokens, kv_heads, 1]` (dynamic), or a Python float. Return `x / scale` stored as
# int8, the way the engine's `kv.quantize` step does it: convert to float32 first,
# **divide** by the scale, clamp to `[-127, 127]` (-128 unused, symmetric), round half to
# even (`torch.round`; `.to(torch.int8)` alone truncates), then cast.

# %% nbgrader={"grade": false, "grade_id": "quantize_int8", "locked": false, "schema_version": 3, "solution": true, "task": false}
def quantize_int8(x: torch.Tensor, scale) -> torch.Tensor:
    ### BEGIN SOLUTION
    return torch.round((x.float() / scale).clamp(-127.0, 127.0)).to(torch.int8)
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "test_quantize_visible", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
_x = torch.tensor([[[1.0, 10.0, 500.0, -0.25]]])               # [1 token, 1 head, 4 dims]
_s = torch.tensor([[0.5, 4.0, 2.0, 0.1]])                      # per channel [1, 4]
_got = quantize_int8(_x, _s)
checks.equal("quantize_int8(x, per-channel scale).dtype", _got.dtype, torch.int8)
checks.equal("quantize_int8([1, 10, 500, -0.25] / [0.5, 4, 2, 0.1]) (2, 2.5 -> 2 ties to even, "
             "250 -> 127 saturates, -2.5 -> -2)", _got.flatten().tolist(), [2, 2, 127, -2])
print("visible test passed")

# %% nbgrader={"grade": true, "grade_id": "test_quantize_hidden", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
### BEGIN HIDDEN TESTS
from minivllm.quantization.kv_cache import quantize_kv as _quantize_ref

_g = torch.Generator().manual_seed(19003)
for _in in (torch.float32, torch.bfloat16, torch.float16):
    _T, _H, _D = int(torch.randint(2, 7, (), generator=_g)), 3, 16
    _x = (torch.randn(_T, _H, _D, generator=_g) * 4)
    _x[:, 1, 5] *= 100                                       # an outlier channel
    _x = _x.to(_in)
    _amax = _x.float().abs().amax(0)
    _dyn = _x.float().abs().amax(-1, keepdim=True) / 127.0
    for _name, _sc in (("a float", 0.0371), ("per tensor []", torch.tensor(float(_amax.max()) / 127)),
                       ("per head [3, 1]", (_amax.amax(-1) / 127)[:, None]),
                       ("per channel [3, 16]", _amax / 127),
                       ("per token [T, 3, 1]", torch.where(_dyn > 0, _dyn, torch.ones_like(_dyn))),
                       ("a scale that saturates", torch.tensor(0.01))):
        _got = quantize_int8(_x.clone(), _sc)               # the learner's function first
        _want = _quantize_ref(_x, torch.int8, _sc)
        checks.equal(f"quantize_int8({_in} x, scale {_name}).dtype", _got.dtype, torch.int8)
        checks.equal(f"quantize_int8({_in} x, scale {_name}) equal to the engine's, bit for bit",
                     torch.equal(_got, _want), True)
_ties = (torch.arange(-24, 24) + 0.5).reshape(2, 3, 8) * 0.5
checks.equal("quantize_int8(half-integer multiples of 0.5, 0.5): ties to even",
             torch.equal(quantize_int8(_ties, 0.5), _quantize_ref(_ties, torch.int8, 0.5)), True)
# near the rounding midpoints with per-channel scales that are not powers of two: x / s
# and x * (1 / s) differ by an ulp, which moves about one value in eight across a midpoint
_sc = torch.rand(3, 16, generator=_g) * 0.2 + 0.001
_xm = (torch.randint(-120, 120, (4, 3, 16), generator=_g) + 0.5) * _sc
checks.equal("quantize_int8(x near the midpoints of x / s, per-channel s): divided, bit for bit",
             torch.equal(quantize_int8(_xm.clone(), _sc.clone()), _quantize_ref(_xm, torch.int8, _sc)), True)
### END HIDDEN TESTS

# %% [markdown] nbgrader={"grade": false, "grade_id": "task4", "locked": true, "schema_version": 3, "solution": false, "task": false}
# ## Task 4: choose a configuration (2 points)
#
# `measurements` maps a configuration's name to what was measured for it, a dict
# `{"kl": mean KL in nats, "kl_hi": the upper end of its 95 % CI, "bytes_per_token":
# cache bytes per token and layer}`. `budget` is the KL the deployment accepts (nats).
# Return the **name** of the configuration to deploy:
#
# - only configurations whose `kl_hi` is at most `budget` qualify (a mean within budget
#   whose interval is not, is not good enough);
# - among them, the fewest `bytes_per_token`; on a tie, the lower `kl`; on a tie of
#   both, the name that sorts first;
# - if none qualifies, raise `ValueError` (say which came closest, if you like).

# %% nbgrader={"grade": false, "grade_id": "choose_kv_config", "locked": false, "schema_version": 3, "solution": true, "task": false}
def choose_kv_config(measurements: dict, budget: float) -> str:
    ### BEGIN SOLUTION
    ok = [name for name, m in measurements.items() if m["kl_hi"] <= budget]
    if not ok:
        best = min(measurements, key=lambda n: measurements[n]["kl_hi"], default=None)
        raise ValueError(f"no configuration within {budget:.3g} nats (closest: {best!r})")
    return min(ok, key=lambda n: (measurements[n]["bytes_per_token"], measurements[n]["kl"], n))
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "test_choose_visible", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
_m = {"float16": {"kl": 4e-7, "kl_hi": 5e-7, "bytes_per_token": 768},
      "int8 per tensor": {"kl": 0.086, "kl_hi": 0.115, "bytes_per_token": 384},
      "int8 per channel": {"kl": 0.0022, "kl_hi": 0.0024, "bytes_per_token": 384},
      "int8 dynamic": {"kl": 0.0107, "kl_hi": 0.0136, "bytes_per_token": 408}}
checks.equal("choose_kv_config(m, 0.005)", choose_kv_config(_m, 0.005), "int8 per channel")
checks.equal("choose_kv_config(m, 1e-4)", choose_kv_config(_m, 1e-4), "float16")
print("visible test passed")

# %% nbgrader={"grade": true, "grade_id": "test_choose_hidden", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
### BEGIN HIDDEN TESTS
import random as _random

_rng = _random.Random(19004)
for _trial in range(200):
    _m = {}
    for _i in range(_rng.randint(1, 7)):
        _kl = _rng.choice([1e-3, 2e-3, 4e-3, 8e-3, _rng.uniform(1e-4, 1e-2)])
        _m[f"cfg{_rng.randrange(100):02d}"] = {
            "kl": _kl, "kl_hi": _kl * _rng.choice([1.0, 1.3, 2.5]),
            "bytes_per_token": _rng.choice([384, 408, 768])}
    _budget = _rng.choice([2e-3, 5e-3, 1e-2, _rng.uniform(1e-4, 2e-2)])
    _ok = sorted((v["bytes_per_token"], v["kl"], k) for k, v in _m.items() if v["kl_hi"] <= _budget)
    try:
        _got = choose_kv_config({k: dict(v) for k, v in _m.items()}, _budget)   # the learner's first
    except ValueError:
        _got = ValueError
    _want = _ok[0][2] if _ok else ValueError
    checks.equal(f"choose_kv_config({_m}, {_budget:.3g})", _got, _want)
### END HIDDEN TESTS


# %% [markdown] nbgrader={"grade": false, "grade_id": "task5", "locked": true, "schema_version": 3, "solution": false, "task": false}
# ## Task 5: which scales? Your int8 cache in the broken engine (8 points)
#
# The engine's int8 cache can scale K and V at four granularities (`GRANULARITIES`,
# cheapest first; chapter 19, sections 2 and 6):
#
# | granularity | K scales | V scales | what it costs |
# |---|---|---|---|
# | `"tensor"` | one per layer | one per layer | 2 static scales per layer (where this lab starts) |
# | `"head"` | one per KV head | one per KV head | 6 static scales per layer |
# | `"channel"` | one per (KV head, dimension) | one per layer | 193 static scales per layer, and more calibration text |
# | `"dynamic"` | one per token and KV head, from the values written | the same | 24 bytes per token and layer beside the 384 of K and V |
#
# Set `KV_SCALE_GRANULARITY` to the **cheapest** of them (the earliest in that order)
# whose int8 cache, with K outlier pairs planted, keeps the mean KL against a float32 KV
# cache within the limit below. `granularity_kl(granularity)` measures one granularity
# on an example (chapter 19's pair in layer 3 at c = 64, one 96-token window) with the
# engine's own scales and write step, and returns its KL and the example's limit. Work
# out what you expect first, then measure.
#
# The grader plants a fresh outlier pair in two random layers of the int8 engine
# (`faults.k_outlier_reparam`, c = 64, each in a random KV head, on the pair holding that
# head's largest |K|) and calibrates on 512 tokens of text you have not seen (per-channel
# scales fit 192 maxima per layer and need that much; chapter 19). Your cache: K scales
# from **your** `per_channel_k_scales`, given the calibrated K maxima reduced to your
# granularity (the layer's largest for `"tensor"`, each head's for `"head"`, every
# channel's for `"channel"`; V gets the engine's scale at that granularity, one per layer
# for `"channel"` as the engine's `kv_scale_granularity="channel"` does), or the engine's
# per-token scales for `"dynamic"`; and **your** `quantize_int8` as the cache's write
# step:
#
#     with llm.swap_step("kv.quantize", lambda x, dtype, scale: quantize_int8(x, scale)):
#         ...
#
# It scores three fresh token sequences. Your cache's mean KL against a float32 KV cache
# must be at most **1.5 times** what the int8 cache with per-tensor scales gives on the
# **unmodified** model (chapter 19: about 3e-3 nats, so the limit is about 4.5e-3). The
# grader measures every granularity the same way with the engine's own scales and write
# step, and yours must be the cheapest within the limit. The broken configuration
# (per-tensor scales with the outliers planted: 0.07-0.3 nats in trial runs) must fail
# the same check.

# %% nbgrader={"grade": false, "grade_id": "granularity_helper", "locked": true, "schema_version": 3, "solution": false, "task": false}
from minivllm.quantization.kv_calibration import calibrate_kv_amax
from minivllm.quantization.kv_cache import kv_scales_from_amax

GRANULARITIES = ("tensor", "head", "channel", "dynamic")  # cheapest first


def granularity_engine(granularity: str):
    """The int8 engine for ``granularity``: the lab's engine (static scales, set by the
    caller) or, for "dynamic", one with per-token scales (each built once)."""
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity must be one of {GRANULARITIES}, got {granularity!r}")
    if granularity != "dynamic":
        return get_llm()
    if "dynamic" not in _LLM:
        _LLM["dynamic"] = LLM(MODEL, kv_cache_dtype="int8", kv_scale_type="dynamic", **COMMON)
    return _LLM["dynamic"]


def float32_engine():
    """The reference: the same model with a float32 KV cache (built once)."""
    if "float32" not in _LLM:
        _LLM["float32"] = LLM(MODEL, kv_cache_dtype="float32", **COMMON)
    return _LLM["float32"]


def set_static_scales(granularity: str, amax) -> None:
    """The lab engine's scales at a static granularity from calibrated maxima (per layer
    ``(k_amax [kv_heads, head_dim], v_amax [kv_heads])``), with the engine's formula."""
    for cache, (k, v) in zip(get_llm().llm_engine.model_runner.kv_caches, amax):
        k, v = {"tensor": (k.max(), v.max()), "head": (k.amax(-1), v),
                "channel": (k, v.max())}[granularity]
        cache.set_scales(kv_scales_from_amax(k, 127.0), kv_scales_from_amax(v, 127.0))
    get_llm().llm_engine.kv_cache_manager.reset_prefix_cache()  # nothing stored under old scales


def granularity_kl(granularity: str) -> tuple:
    """``(mean KL, limit)`` on the example: the int8 cache at ``granularity`` (the
    engine's scales and write step) with chapter 19's outlier pair planted (layer 3, its
    KV head with the largest K, that head's largest pair, c = 64), calibrated on the
    corpus's first 512 tokens, against a float32 KV cache on one 96-token window; the
    limit is 1.5x the per-tensor cache's KL on the unmodified model, on that window."""
    llm, ref = granularity_engine(granularity), float32_engine()
    ids = ref.get_tokenizer().encode(_text[:30000], add_special_tokens=False)
    calib, window = [ids[:256], ids[256:512]], [ids[2048:2144]]
    model = get_llm().llm_engine.model_runner.model
    amax = calibrate_kv_amax(model, calib, per_channel=True)
    h = int(amax[3][0].amax(-1).argmax())
    j = int(amax[3][0][h].argmax()) % 32
    want = ref.score(window, output="logits")[0]

    def kl(engine):
        return float(metrics.kl_divergence(want, engine.score(window, output="logits")[0]).mean())

    set_static_scales("tensor", amax)
    limit = 1.5 * kl(get_llm())
    with faults.k_outlier_reparam(get_llm(), 3, h, j, 64.0):
        amax = calibrate_kv_amax(model, calib, per_channel=True)  # what calibration sees now
    with faults.k_outlier_reparam(llm, 3, h, j, 64.0):
        if granularity != "dynamic":
            set_static_scales(granularity, amax)
        return kl(llm), limit


# %% nbgrader={"grade": false, "grade_id": "kv_scale_granularity", "locked": false, "schema_version": 3, "solution": true, "task": false}
KV_SCALE_GRANULARITY = "tensor"  # the broken configuration: where this task starts
### BEGIN SOLUTION
KV_SCALE_GRANULARITY = "channel"
### END SOLUTION

# %% nbgrader={"grade": true, "grade_id": "test_restore", "locked": true, "points": 8, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
### BEGIN HIDDEN TESTS
import contextlib as _contextlib
import random as _random

from minivllm.quantization.kv_calibration import calibrate_kv_amax as _calibrate_amax
from minivllm.quantization.kv_cache import kv_scales_from_amax as _from_amax

_GRANS = ("tensor", "head", "channel", "dynamic")  # cheapest first
checks.one_of("KV_SCALE_GRANULARITY", KV_SCALE_GRANULARITY, list(_GRANS))
_probe = torch.rand(3, 64, generator=torch.Generator().manual_seed(19005)) * 20                                 # the learner's functions first:
quantize_int8(torch.randn(4, 3, 64, generator=torch.Generator().manual_seed(19099)), per_channel_k_scales(_probe, 127.0))  # a stub fails at once
_rng = _random.Random(19006)
_llm = get_llm()
_dyn = granularity_engine("dynamic")
_tok = _llm.get_tokenizer()


def _fresh(n):
    _s = _rng.randrange(0, len(_text) - 2000)
    return _tok.encode(_text[_s:_s + 2000])[:n]


_calib, _seqs = [_fresh(256), _fresh(256)], [_fresh(n) for n in (61, 70, 57)]
_model = _llm.llm_engine.model_runner.model
_caches = _llm.llm_engine.model_runner.kv_caches
_amax0 = _calibrate_amax(_model, _calib, per_channel=True)   # per layer: K [3, 64], V [3]
_layers = sorted(_rng.sample(range(30), 2))
_plants = []
for _L in _layers:
    _hh = _rng.randrange(3)
    _plants.append((_L, _hh, int(_amax0[_L][0][_hh].argmax()) % 32))


def _planted(engine):
    _stack = _contextlib.ExitStack()
    for _L, _hh, _jj in _plants:
        _stack.enter_context(faults.k_outlier_reparam(engine, _L, _hh, _jj, 64.0))
    return _stack


def _set(gran, amax, k_scales):
    """Static scales at ``gran``: K from ``k_scales(reduced amax, 127)``, V the engine's."""
    for _c, (_k, _v) in zip(_caches, amax):
        _k, _v = {"tensor": (_k.max(), _v.max()), "head": (_k.amax(-1), _v),
                  "channel": (_k, _v.max())}[gran]
        _c.set_scales(torch.as_tensor(k_scales(_k.clone(), 127.0), dtype=torch.float32),
                      _from_amax(_v, 127.0))
    _llm.llm_engine.kv_cache_manager.reset_prefix_cache()


# What calibration under the fault measures (c = 64 is a power of two, so the planted
# channels' maxima are exactly 64x and nothing else moves; tests/test_kv_outliers.py).
_amax1 = [(_k.clone(), _v) for _k, _v in _amax0]
for _L, _hh, _jj in _plants:
    _amax1[_L][0][_hh, [_jj, _jj + 32]] *= 64.0


def _with_outliers(gran, k_scales, quantize=None):
    """Logits of the fresh sequences through the int8 cache at ``gran`` with the outliers
    planted (``quantize``: the write step, None for the engine's own)."""
    _e = _dyn if gran == "dynamic" else _llm
    with _planted(_e):
        if gran != "dynamic":
            _set(gran, _amax1, k_scales)
        with (_e.swap_step("kv.quantize", quantize) if quantize else _contextlib.nullcontext()):
            return _e.score(_seqs, output="logits")


_mine = _with_outliers(KV_SCALE_GRANULARITY, per_channel_k_scales,  # your scales, your write step
                       lambda x, dtype, scale: quantize_int8(x, scale))  # (run first)
_want = float32_engine().score(_seqs, output="logits")


def _kl(rows):
    return float(torch.cat([metrics.kl_divergence(a, b) for a, b in zip(_want, rows)]).mean())


_kl_mine = _kl(_mine)
_set("tensor", _amax0, _from_amax)
_limit = 1.5 * _kl(_llm.score(_seqs, output="logits"))        # per tensor, no outliers
_kls = {_g: _kl(_with_outliers(_g, _from_amax)) for _g in _GRANS}  # the engine's own, each
_best = next((_g for _g in _GRANS if _kls[_g] <= _limit), None)
print(f"outlier pairs planted (layer, KV head, j): {_plants}, c = 64; {sum(map(len, _seqs))} fresh "
      f"positions; mean KL against a float32 KV cache (nats), limit {_limit:.3g} (1.5x int8 per "
      f"tensor, unmodified); with the outliers, the engine's scales: "
      + ", ".join(f"{_g} {_k:.3g}" for _g, _k in _kls.items())
      + f"; yours ({KV_SCALE_GRANULARITY}, your scales and quantizer) {_kl_mine:.3g}")
if not _kls["tensor"] > _limit:
    raise checks.CheckFailed("the check does not discriminate: the broken configuration passes it")
_yours = "the engine's per-token scales" if KV_SCALE_GRANULARITY == "dynamic" else \
    f"{KV_SCALE_GRANULARITY!r} scales from your per_channel_k_scales"
checks.at_most(f"mean KL of your int8 cache with the outliers ({_yours}, your quantize_int8)",
               _kl_mine, _limit)
checks.equal(f"KV_SCALE_GRANULARITY: the cheapest granularity within the limit ({_best}, "
             f"{_kls.get(_best, float('nan')):.3g} nats of {_limit:.3g})", KV_SCALE_GRANULARITY,
             _best)
### END HIDDEN TESTS
