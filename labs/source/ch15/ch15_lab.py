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
# # Lab 15: restore 4-bit accuracy with AWQ
#
# You start from the broken configuration of chapter 15: int4 round-to-nearest (RTN),
# asymmetric, groups of 128, here on the MLPs (gate_up_proj and down_proj) of decoder
# layers 0-3, everything else float32. RTN spends the 16 levels of each group without
# looking at the activations, and the KL against the float32 engine shows it.
#
# You write three functions. The grader calls them on **new** inputs and compares with
# the engine's own reference; then it registers them as a *calibrated* quantization
# method (`register_quantization_method(..., calibrated=True)`: the engine hands your
# method each layer's calibration input rows) and checks, on text you have not seen,
# that your AWQ cuts RTN's KL by at least a quarter on the same text.
#
# 1. `quantize_int4_group(w, group_size, symmetric)`: int4 codes, scales and zero points
#    per group, 4 points;
# 2. `awq_scale_search(w, x, group_size, n_grid)`: AWQ's activation-aware per-input-channel
#    scale, 3 points;
# 3. `dequantize_awq(q, scale, zero, s, group_size)`: the float weight the layer uses,
#    2 points;
# 4. the engine with your method on fresh text, 6 points (no code to write).
#
# Run the cells in order. Do not edit the setup and test cells.

# %% nbgrader={"grade": false, "grade_id": "setup", "locked": true, "schema_version": 3, "solution": false, "task": false}
import importlib

import grading.checks as checks  # first import: records the original functions
import torch

from minivllm import LLM
from minivllm.layers.linear import LinearMethod
from minivllm.precision import evalsets, metrics
from minivllm.quantization import register_quantization_method

torch.manual_seed(0)
MODEL = "smollm2-135m-instruct"
COMMON = dict(dtype="float32", max_model_len=256, kv_cache_memory_bytes=16 << 20)
GROUP, N_GRID = 128, 10
# quantize only the MLPs of layers 0-3; everything else stays float32
SUBSET = {"ignore": ["re:layers\\.([4-9]|[12][0-9])\\.", "re:layers\\.[0-3]\\.self_attn\\."]}


class LabAWQ(LinearMethod):
    """AWQ computed by YOUR functions (looked up by name when a layer is quantized, so a
    later fix of yours is used): for each layer, s = awq_scale_search(W, x) on that
    layer's calibration input rows x, then quantize_int4_group(W * s) (asymmetric); the
    layer computes x @ dequantize_awq(...).T. Stores what the engine's awq stores:
    qweight uint8 [out, in], scales float32 and zeros uint8 [out, groups], awq_scale [in]."""

    def quantize(self, weight, stats=None):
        s = globals()["awq_scale_search"](weight, stats.sample, GROUP, N_GRID)
        q, scale, zero = globals()["quantize_int4_group"](weight * s, GROUP, False)
        return {"qweight": q, "scales": scale, "zeros": zero,
                "awq_scale": torch.as_tensor(s).float()}

    def dequantize(self, t):
        return globals()["dequantize_awq"](t["qweight"], t["scales"], t["zeros"],
                                           t["awq_scale"], GROUP)

    def expected(self, out_features, in_features):
        g = -(-in_features // GROUP)
        return {"qweight": (torch.uint8, (out_features, in_features)),
                "scales": (torch.float32, (out_features, g)),
                "zeros": (torch.uint8, (out_features, g)),
                "awq_scale": (torch.float32, (in_features,))}


def register():
    register_quantization_method("lab_awq", LabAWQ, options={"group_size": GROUP,
                                                             "symmetric": False},
                                 calibrated=True, replace=True)


def measure(n_tokens: int = 64) -> dict:
    """For you, before you submit (three engines, ~30 s): KL (nats) against float32 on one
    prose window, of RTN on the subset and of YOUR AWQ on the subset."""
    register()
    seq = evalsets.corpus_sequences(tokenizer, seq_len=n_tokens, max_sequences=1)
    ref = LLM(MODEL, **COMMON).score(seq, output="logits")
    out = {}
    for name, kw in (("RTN asym g128 (engine)", dict(quantization="int4", quantization_config={
                          "group_size": GROUP, "symmetric": False, **SUBSET})),
                     ("your AWQ", dict(quantization="lab_awq", quantization_config={
                          "calibration_tokens": 256, **SUBSET}))):
        rows = LLM(MODEL, **COMMON, **kw).score(seq, output="logits")
        out[name] = float(torch.cat([metrics.kl_divergence(a, b) for a, b in zip(ref, rows)]).mean())
    return out


from minivllm.models.loader import resolve_model_path  # noqa: E402
from minivllm.tokenizer import get_tokenizer  # noqa: E402

tokenizer = get_tokenizer(str(resolve_model_path(MODEL)))   # the tokenizer only: no engine yet
example = torch.tensor([[0.0, 1.5, 3.0, -1.5, 0.25, 0.55, 0.75, 1.0]])
print("example weight [1, 8] (two groups of 4):", example.tolist())

# %% [markdown] nbgrader={"grade": false, "grade_id": "task1", "locked": true, "schema_version": 3, "solution": false, "task": false}
# ## Task 1: int4 codes, scales and zero points per group (4 points)
#
# Write `quantize_int4_group(w, group_size, symmetric)` for a 2-D float weight `w`
# `[out, in]` (any float dtype; compute in float32). Columns `[k·g, (k+1)·g)` of a row
# form group `k`; when `g` does not divide `in`, the last group is shorter (SmolLM2's
# 576 = 4·128 + 64). Return `(q, scale, zero)`: `q` uint8 `[out, in]` holding 0..15,
# `scale` float32 and `zero` uint8, both `[out, ceil(in / g)]`. Per group:
#
# - **asymmetric** (`symmetric=False`): `lo = min(min(w), 0)`, `hi = max(max(w), 0)`
#   (the range always contains 0), `scale = (hi - lo) / 15`,
#   `zero = clamp(round(-lo / scale), 0, 15)`, `q = clamp(round(w / scale) + zero, 0, 15)`;
# - **symmetric**: `scale = amax / 7`, `zero = 8`, `q = clamp(round(w / scale), -8, 7) + 8`;
# - a group whose scale would be 0 (all zeros) gets scale 1.0.
#
# Rounding is `torch.round` (half to even). Do not modify `w`. The grader compares with
# the engine's `minivllm.quantization.weight_quant.quantize_int4` bit for bit.

# %% nbgrader={"grade": false, "grade_id": "quantize_int4_group", "locked": false, "schema_version": 3, "solution": true, "task": false}
def quantize_int4_group(w: torch.Tensor, group_size: int = 128, symmetric: bool = False):
    ### BEGIN SOLUTION
    w32 = w.detach().to(torch.float32)
    out_f, in_f = w32.shape
    pad = -in_f % group_size
    wp = torch.cat([w32, w32[:, -1:].expand(out_f, pad)], dim=1) if pad else w32
    wg = wp.reshape(out_f, -1, group_size)
    if symmetric:
        scale = wg.abs().amax(-1) / 7
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        zero = torch.full_like(scale, 8.0)
    else:
        lo = wg.amin(-1).clamp(max=0)
        hi = wg.amax(-1).clamp(min=0)
        scale = (hi - lo) / 15
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        zero = torch.round(-lo / scale).clamp(0, 15)
    s_col = scale.repeat_interleave(group_size, dim=1)[:, :in_f]
    z_col = zero.repeat_interleave(group_size, dim=1)[:, :in_f]
    q = (torch.round(w32 / s_col) + z_col).clamp(0, 15)
    return q.to(torch.uint8), scale, zero.to(torch.uint8)
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "test_quantize_visible", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
_q, _s, _z = quantize_int4_group(example.clone(), 4, False)
checks.equal("shapes (q, scale, zero)", (tuple(_q.shape), tuple(_s.shape), tuple(_z.shape)),
             ((1, 8), (1, 2), (1, 2)))
checks.equal("dtypes (q, scale, zero)", (_q.dtype, _s.dtype, _z.dtype),
             (torch.uint8, torch.float32, torch.uint8))
# group 0: lo -1.5, hi 3.0 -> scale 0.3, zero 5; group 1: lo 0 (the range contains 0), hi 1.0
checks.close("group 0 scale", float(_s[0, 0]), 0.3, rtol=1e-6)
checks.equal("group 0 zero and codes", (int(_z[0, 0]), _q[0, :4].tolist()), (5, [5, 10, 15, 0]))
checks.equal("group 1 zero and codes", (int(_z[0, 1]), _q[0, 4:].tolist()), (0, [4, 8, 11, 15]))
print("visible test passed")

# %% nbgrader={"grade": true, "grade_id": "test_quantize_hidden", "locked": true, "points": 3, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
### BEGIN HIDDEN TESTS
from minivllm.quantization import weight_quant as _wq


def _fresh_cases():
    g = torch.Generator().manual_seed(1515)
    a = torch.randn(40, 576, generator=g) * 0.04            # 576 = 4 x 128 + 64: a short group
    a[5, 128:256] = 0                                        # an all-zero group
    a[9, :128] = a[9, :128].abs() + 0.01                     # a one-sign group (lo clamps to 0)
    a[11, 300] = 0.9                                         # one outlier in a group
    b = (torch.randn(24, 96, generator=g) * 0.02).to(torch.bfloat16)
    c = torch.randn(7, 50, generator=g) * torch.exp(torch.randn(7, 1, generator=g))
    a[13, 256:384] = -(a[13, 256:384].abs() + 0.01)         # an all-negative group (hi clamps to 0)
    # exact ties at scales that are not powers of two, groups of 16: lo = -(2z + 1) t and
    # hi = (29 - 2z) t put -lo / scale on z + 0.5, and the other entries sit on (m + 0.5)
    # scale; kept where w / scale is exactly the midpoint and w * (1 / scale), an ulp off
    # now and then, rounds to the other code (where not, the entry is 0)
    n = 40 * 4
    t = torch.rand(n, 1, generator=g) * 0.01 + 1e-3
    z = torch.randint(0, 15, (n, 1), generator=g).float()
    lo, hi = -(2 * z + 1) * t, (29 - 2 * z) * t
    sc = (hi - lo) / 15
    m = torch.randint(-7, 7, (n, 14), generator=g).float() + 0.5
    w = m * sc
    tie = (w / sc == m) & (torch.round(w * (1.0 / sc)) != torch.round(w / sc)) & (w >= lo) & (w <= hi)
    ties = torch.cat([lo, hi, torch.where(tie, w, torch.zeros_like(w))], dim=1).reshape(40, 64)
    zt = (-lo / sc == z + 0.5) & (torch.round(-lo * (1.0 / sc)) != torch.round(-lo / sc))
    assert int(tie.sum()) >= 20 and int(zt.sum()) >= 5, "too few tie cases for the check"
    return {"[40, 576] with zero, one-sign and outlier groups": (a, 128),
            "exact ties of codes and zero points at scales that are not powers of two, g16":
                (ties, 16),
            "bfloat16 [24, 96], g32": (b, 32), "rows of very different size [7, 50], g64": (c, 64),
            "all zeros [3, 8], g4": (torch.zeros(3, 8), 4)}


for _name, (_w, _g) in _fresh_cases().items():
    for _sym in (False, True):
        _inp = _w.clone()
        _got = quantize_int4_group(_inp, _g, _sym)            # the learner's function first
        _ref = _wq.quantize_int4(_w, _g, _sym)
        _lab = f"{_name}, {'symmetric' if _sym else 'asymmetric'}"
        checks.equal(f"{_lab}: w left unchanged", bool(torch.equal(_inp, _w)), True)
        for _k, _a, _b in zip(("q", "scale", "zero"), _got, _ref):
            checks.equal(f"{_lab}: {_k} dtype and shape", (_a.dtype, tuple(_a.shape)),
                         (_b.dtype, tuple(_b.shape)))
            _bad = int((_a != _b).sum())
            if _bad:
                _i = (_a != _b).nonzero()[0].tolist()
                raise checks.CheckFailed(f"{_lab}: {_bad} of {_b.numel()} {_k} values differ from the "
                                         f"engine's quantize_int4, e.g. at {_i}: expected "
                                         f"{float(_b[tuple(_i)]):.6g}, got {float(_a[tuple(_i)]):.6g}")
### END HIDDEN TESTS

# %% [markdown] nbgrader={"grade": false, "grade_id": "task2", "locked": true, "schema_version": 3, "solution": false, "task": false}
# ## Task 2: AWQ's scale search (3 points)
#
# Write `awq_scale_search(w, x, group_size, n_grid)`: `w` `[out, in]`, calibration
# inputs `x` `[tokens, in]`; return `s`, float32 `[in]`, one positive scale per input
# channel, for the **asymmetric** grid. As in AWQ (Lin et al. 2023, AutoAWQ's
# `_search_best_scale`):
#
# - `x_mean = mean over tokens of |x|` (per input channel: how large the activations
#   that meet column `j` are);
# - for each `k = 0 .. n_grid - 1`, `α = k / n_grid`: `s = clamp(x_mean ** α, min=1e-4)`,
#   then `s = s / sqrt(max(s) · min(s))`;
# - its loss: `mean((x @ w.T - (x / s) @ Q(w · s).T) ** 2)`, where `Q` quantizes with
#   your `quantize_int4_group` (asymmetric) and dequantizes, `(q - zero) · scale` per group
#   (write that here: your `dequantize_awq` of task 3 is defined after this task's tests);
# - return the `s` of the smallest loss (the first one on ties). `α = 0` gives `s = 1`,
#   plain RTN, so the search can only improve on RTN on `x`.
#
# The grader checks, on fresh layers with a few planted "salient" input channels (large
# activations), that your `s` cuts the output error of RTN by at least 20 %, comes
# within 5 % of the engine's `weight_quant.awq_search_scale`, and is the formula's `s`
# (normalisation included) for a ratio whose loss is the smallest.

# %% nbgrader={"grade": false, "grade_id": "awq_scale_search", "locked": false, "schema_version": 3, "solution": true, "task": false}
def awq_scale_search(w: torch.Tensor, x: torch.Tensor, group_size: int = 128,
                     n_grid: int = 20) -> torch.Tensor:
    ### BEGIN SOLUTION
    w32, x32 = w.detach().float(), x.detach().float()
    x_mean = x32.abs().mean(dim=0)
    ref = x32 @ w32.T
    best, best_loss = None, float("inf")
    for k in range(n_grid):
        s = x_mean.pow(k / n_grid).clamp(min=1e-4)
        s = s / (s.max() * s.min()).sqrt()
        q, scale, zero = quantize_int4_group(w32 * s, group_size, False)
        per_col = lambda t: t.repeat_interleave(group_size, dim=1)[:, :w32.shape[1]]
        deq = (q.float() - per_col(zero.float())) * per_col(scale)
        loss = float(((x32 / s) @ deq.T - ref).pow(2).mean())
        if loss < best_loss:
            best, best_loss = s, loss
    return best
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "test_awq_visible", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
_gen = torch.Generator().manual_seed(0)
_w = torch.randn(16, 64, generator=_gen) * 0.05
_x = torch.randn(32, 64, generator=_gen)
_s = awq_scale_search(_w, _x, 32, 4)
checks.equal("s: dtype and shape", (_s.dtype, tuple(_s.shape)), (torch.float32, (64,)))
checks.equal("s: positive and finite", bool((_s > 0).all() and torch.isfinite(_s).all()), True)
_s1 = awq_scale_search(_w, torch.ones(8, 64), 32, 4)      # equal activations: x_mean = 1
checks.close("all-equal activations give s = 1 everywhere", float((_s1 - 1).abs().max()), 0.0,
             atol=1e-6)
print("visible test passed")

# %% nbgrader={"grade": true, "grade_id": "test_awq_hidden", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
### BEGIN HIDDEN TESTS
from minivllm.quantization import weight_quant as _wq


def _layer(seed, out_f, in_f, n_salient):
    """A layer whose inputs have a few salient channels (activations 20-50x the rest)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out_f, in_f, generator=g) * 0.03
    x = torch.randn(256, in_f, generator=g) * 0.5
    idx = torch.randperm(in_f, generator=g)[:n_salient]
    x[:, idx] *= torch.empty(n_salient).uniform_(20, 50, generator=g)
    if seed == 152:
        x[:, torch.randperm(in_f, generator=g)[:2]] = 0  # dead input channels: x_mean = 0
    return w, x


def _out_err(w, x, s):
    deq = _wq.dequantize_int4(*_wq.quantize_int4(w * s, 128, False), 128)
    return float(((x / s) @ deq.T - x @ w.T).pow(2).mean())


for _seed, (_o, _i, _k) in zip((151, 152, 153), ((96, 576, 6), (64, 384, 3), (128, 256, 8))):
    _w, _x = _layer(_seed, _o, _i, _k)
    _s = awq_scale_search(_w.clone(), _x.clone(), 128, 10)   # the learner's function first
    _ref_s, _info = _wq.awq_search_scale([_w], _x, 128, False, n_grid=10)
    _s = torch.as_tensor(_s).float()
    checks.equal(f"layer {_seed}: s shape", tuple(_s.shape), (_i,))
    _mine, _rtn, _best = _out_err(_w, _x, _s), _info["rtn_loss"], _info["best_loss"]
    print(f"layer {_seed} [{_o}, {_i}], {_k} salient channels: output MSE RTN {_rtn:.4g}, "
          f"engine AWQ {_best:.4g}, yours {_mine:.4g}")
    checks.at_most(f"layer {_seed}: your AWQ's output error / RTN's", _mine / _rtn, 0.8)
    checks.at_most(f"layer {_seed}: your AWQ's output error / the engine's AWQ", _mine / _best, 1.05)
    # the scale itself, not only its error: s must be the formula's s for a ratio whose
    # loss is the smallest (up to 1e-6 relative, a float tie), normalisation included
    _xm = _x.abs().mean(0)
    _rel = []
    for _r in range(10):
        _c = (_xm ** (_r / 10)).clamp(min=1e-4)
        _c = _c / (_c.max() * _c.min()).sqrt()
        _rel.append(float(((_s - _c).abs() / _c).max()))
    _r = min(range(10), key=lambda r: _rel[r])
    checks.at_most(f"layer {_seed}: max relative |s - the formula's s| at the closest ratio "
                   f"({_r}/10)", _rel[_r], 1e-5)
    checks.at_most(f"layer {_seed}: loss of your ratio {_r}/10 / the smallest loss (ratio "
                   f"{_info['best_ratio']:g})", _info["losses"][_r] / _best, 1 + 1e-6)
# exact ties: a zero weight has loss 0 at every ratio, and "the first one on ties" is ratio
# 0, s = 1 everywhere
_xt = torch.tensor([[1.0, 4.0, 0.25, 2.0]]).repeat(3, 1)
checks.close("awq_scale_search(zero weight, ...): the first ratio wins an exact tie, so max |s - 1|",
             float((torch.as_tensor(awq_scale_search(torch.zeros(2, 4), _xt, 4, 4)) - 1).abs().max()),
             0.0, atol=1e-7)
# a grid of n_grid = 2 (ratios 0 and 1/2 only): the ratio 1 is not on it, even where it
# would have the smallest loss
_g2 = torch.Generator().manual_seed(46)
_w2 = torch.randn(8, 16, generator=_g2) * 0.05
_x2 = torch.randn(32, 16, generator=_g2)
_x2[:, :2] *= 30
_want2, _ = _wq.awq_search_scale([_w2], _x2, 8, False, n_grid=2)
checks.at_most("awq_scale_search(w, x, 8, n_grid=2): max relative |s - the engine's s|",
               float(((torch.as_tensor(awq_scale_search(_w2, _x2, 8, 2)) - _want2).abs()
                      / _want2).max()), 1e-5)
### END HIDDEN TESTS

# %% [markdown] nbgrader={"grade": false, "grade_id": "task3", "locked": true, "schema_version": 3, "solution": false, "task": false}
# ## Task 3: the weight the layer computes with (2 points)
#
# An AWQ checkpoint stores the int4 codes of `w · s` and the scale `s`; the layer
# computes `(x / s) @ ((q - zero) · scale).T`, which is `x @ W_eff.T` with
# `W_eff = ((q - zero) · scale) / s` (column `j` divided by `s_j`). Write
# `dequantize_awq(q, scale, zero, s, group_size)` returning `W_eff`, float32 `[out, in]`:
# dequantize per group (`(q - zero) · scale`, in float32), then divide column `j` by `s[j]`.
# Bit for bit the engine's `weight_quant.dequantize_int4(q, scale, zero, group_size) / s`.

# %% nbgrader={"grade": false, "grade_id": "dequantize_awq", "locked": false, "schema_version": 3, "solution": true, "task": false}
def dequantize_awq(q, scale, zero, s, group_size: int = 128) -> torch.Tensor:
    ### BEGIN SOLUTION
    in_f = q.shape[1]
    per_col = lambda t: t.repeat_interleave(group_size, dim=1)[:, :in_f]
    deq = (q.to(torch.float32) - per_col(zero.to(torch.float32))) * per_col(scale.to(torch.float32))
    return deq / s.to(torch.float32)
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "test_dequantize", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
_d = dequantize_awq(torch.tensor([[5, 10, 15, 0]], dtype=torch.uint8), torch.tensor([[0.5]]),
                    torch.tensor([[5]], dtype=torch.uint8), torch.tensor([1.0, 2.0, 0.5, 4.0]), 4)
checks.equal("visible: codes [5, 10, 15, 0], scale 0.5, zero 5, s [1, 2, 0.5, 4]",
             _d.tolist(), [[0.0, 1.25, 10.0, -0.625]])
### BEGIN HIDDEN TESTS
from minivllm.quantization import weight_quant as _wq

_g = torch.Generator().manual_seed(2015)
for _o, _i, _gs in ((48, 576, 128), (8, 100, 32), (1, 7, 4)):
    _n = -(-_i // _gs)
    _q = torch.randint(0, 16, (_o, _i), generator=_g).to(torch.uint8)
    _sc = torch.rand(_o, _n, generator=_g) * 0.1 + 1e-3
    _z = torch.randint(0, 16, (_o, _n), generator=_g).to(torch.uint8)
    _sv = torch.exp(torch.randn(_i, generator=_g))
    _got = dequantize_awq(_q.clone(), _sc.clone(), _z.clone(), _sv.clone(), _gs)  # learner first
    _ref = _wq.dequantize_int4(_q, _sc, _z, _gs) / _sv
    checks.equal(f"dequantize_awq [{_o}, {_i}], g{_gs}: dtype and shape", (_got.dtype, tuple(_got.shape)),
                 (torch.float32, (_o, _i)))
    checks.equal(f"dequantize_awq [{_o}, {_i}], g{_gs}: bit-equal to the engine's",
                 bool(torch.equal(_got, _ref)), True)
### END HIDDEN TESTS

# %% [markdown] nbgrader={"grade": false, "grade_id": "task4", "locked": true, "schema_version": 3, "solution": false, "task": false}
# ## Task 4: your AWQ in the engine (6 points)
#
# Nothing to write. The grader registers your functions as a calibrated method
# (`register()` in the setup cell), builds
#
#     LLM(MODEL, quantization="lab_awq",
#         quantization_config=dict(calibration_tokens=256, **SUBSET))
#
# (the engine runs 256 tokens of its bundled chat conversations through the model layer
# by layer and gives each MLP layer's input rows to your `awq_scale_search`), scores six
# windows of text you have not seen (480 positions) with it and with RTN on the same
# layers (`quantization="int4"`, asymmetric, g128: the broken configuration), and requires
# your mean KL against float32 to be **at most 0.75 x RTN's** on the same positions.
# Paired on the same text, the ratio hardly moves with the text: the reference AWQ (no
# clip search, 10 grid points) gives 0.5-0.7 of RTN's KL on every 3-window set we tried,
# and RTN itself is the 1.0 the limit is measured against. `measure()` (setup cell) prints
# both on a prose window.

# %% nbgrader={"grade": true, "grade_id": "test_engine", "locked": true, "points": 6, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
### BEGIN HIDDEN TESTS
import gc as _gc

_pg = torch.Generator().manual_seed(7)
_pw, _px = torch.randn(6, 16, generator=_pg), torch.randn(5, 16, generator=_pg)
_ps = awq_scale_search(_pw, _px, 8, 2)                     # the learner's functions first: a
_pq = quantize_int4_group(_pw * _ps, 8, False)             # stub fails before any engine
dequantize_awq(*_pq, _ps, 8)
_RATIO = 0.75  # your KL at most this share of RTN's, on the same positions
register()
_convs = evalsets.conversation_sequences(tokenizer, max_conversations=12)
_seqs = ([_convs[i][:80] for i in (9, 10, 11)]              # not the calibration text
         + evalsets.corpus_sequences(tokenizer, seq_len=80, max_sequences=3))


def _kl(ref, llm):
    rows = llm.score(_seqs, output="logits")
    return float(torch.cat([metrics.kl_divergence(a, b) for a, b in zip(ref, rows)]).mean())


try:  # the learner's engine first: a method the engine refuses fails before the others
    _yours = LLM(MODEL, **COMMON, quantization="lab_awq",
                 quantization_config={"calibration_tokens": 256, **SUBSET})
except Exception as _e:
    raise checks.CheckFailed(f"the engine could not load with your method: {type(_e).__name__}: "
                             f"{_e}") from None
_ref = LLM(MODEL, **COMMON).score(_seqs, output="logits")
_gc.collect()
_broken = _kl(_ref, LLM(MODEL, **COMMON, quantization="int4", quantization_config={
    "group_size": GROUP, "symmetric": False, **SUBSET}))
_gc.collect()
_restored = _kl(_ref, _yours)
print(f"{sum(map(len, _seqs))} fresh positions; mean KL against float32 (nats): RTN asym g128 "
      f"on the MLPs of layers 0-3 (the broken configuration) {_broken:.3g}; your AWQ {_restored:.3g} "
      f"= {_restored / _broken:.2f} x RTN; limit {_RATIO} x RTN = {_RATIO * _broken:.3g}")
# the check must discriminate: the broken configuration (1.0 x itself) fails it
assert _broken > _RATIO * _broken > 0, f"RTN's KL ({_broken:.3g}) must be positive and finite"
checks.at_most(f"KL of the engine with your AWQ, nats (0.75 x RTN's {_broken:.3g})", _restored,
               _RATIO * _broken)
### END HIDDEN TESTS
