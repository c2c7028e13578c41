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
# # Lab 9: attention that cannot overflow
#
# In chapter 9 the embedded model ran in float16 under an exact reparametrization that
# makes the raw scores `q.k` 1024 times larger (the query rows of `qkv_proj` times 1024,
# the softmax scale divided by 1024: the same function). The engine's own attention was
# unaffected, since it accumulates `q.k` in float32 and scales before anything is rounded
# to fp16. An attention in transformers' eager order (`q @ k^T` in fp16, *then* times the
# scale) overflowed to inf, the softmax turned inf into NaN, and every request came back
# corrupted: the "!!!!" / "GGGG" of vllm #14126 and llama.cpp #7805.
#
# This lab starts from that **broken engine**: `broken()` below plants the
# reparametrization and the eager attention (`faults.qk_scale_reparam`,
# `faults.eager_kq_attention`) in a float16 engine. You write the attention numerics
# yourself; the last test plugs your functions into that engine as its attention steps,
# on text you have not seen, and checks the restored number (no corrupted request, KL
# against a float32 engine at most 1e-3 nats), next to the broken engine failing the same
# check.
#
# You write three functions. The grader calls them on **new** inputs (scores up to
# +-3e4, rows with nothing to attend to, tiles that do not divide the length, float16
# inputs whose raw `q.k` passes 65504) and compares with a float64 or float32 reference
# within a tolerance stated per test:
#
# 1. `safe_softmax(scores, mask)`: a masked softmax that never overflows and gives 0 for
#    a fully masked row, 3 points;
# 2. `online_softmax_attention(q, k, v, mask, scale, tile)`: attention over keys in tiles
#    with a running max and sum (FlashAttention's loop), 3 points;
# 3. `attention_fp16_safe(q, k, v, mask, scale)`: one-pass attention that is safe for
#    float16 inputs, 2 points;
#    then the restore check, 6 points.
#
# Run the cells in order. Do not edit the setup and test cells.

# %% nbgrader={"grade": false, "grade_id": "setup", "locked": true, "schema_version": 3, "solution": false, "task": false}
import contextlib
import importlib
import math

import grading.checks as checks  # first import: records the original functions
import torch

from minivllm import LLM, SamplingParams
from minivllm.attention.metadata import chunk_causal_mask
from minivllm.precision import evalsets, faults, metrics

torch.manual_seed(0)
MODEL = "smollm2-135m-instruct"
C = 1024.0   # the reparametrization's factor (exact: a power of two)
TILE = 16    # keys per tile when your online attention runs in the engine

_ENGINES = {}


def engines():
    """(float16 engine, float32 engine), built on first use (a few seconds each)."""
    if not _ENGINES:
        kw = dict(max_model_len=256, num_gpu_blocks_override=48, seed=0)
        _ENGINES["fp16"] = LLM(MODEL, dtype="float16", **kw)
        _ENGINES["fp32"] = LLM(MODEL, dtype="float32", **kw)
    return _ENGINES["fp16"], _ENGINES["fp32"]


@contextlib.contextmanager
def broken(llm):
    """The broken configuration of chapter 9 on a float16 engine: the exact q/k
    reparametrization (c = 1024, every layer) and attention in eager order."""
    with faults.qk_scale_reparam(llm, C), faults.eager_kq_attention(llm):
        yield


def as_decode_step(attention):
    """The engine's "attention.decode" step built from a one-sequence attention
    ``attention(q [n, H, D], k [L, Hkv, D], v [L, Hkv, D], mask [n, L], scale)``: each
    sequence attends to its first ``seq_lens[b]`` keys; the result is cast to q's dtype."""
    def step(q, k, v, seq_lens, scale):
        out = torch.empty_like(q)
        for b, n in enumerate(seq_lens.tolist()):
            mask = torch.ones(1, n, dtype=torch.bool)
            out[b] = attention(q[b:b + 1], k[b, :n], v[b, :n], mask, scale)[0].to(q.dtype)
        return out
    return step


def as_prefill_step(attention):
    """The engine's "attention.prefill" step built from a one-sequence attention (the
    causal mask of the new tokens over all keys)."""
    def step(q, k, v, scale):
        mask = chunk_causal_mask(q.shape[0], k.shape[0])
        return attention(q, k, v, mask, scale).to(q.dtype)
    return step


def attention64(q, k, v, mask, scale):
    """float64 reference: q [n, H, D], k/v [L, Hkv, D], mask [n, L] bool or None; a row
    with no True key is 0. Returns [n, H, D] float64."""
    g = q.shape[1] // k.shape[1]
    s = torch.einsum("nhd,lhd->hnl", q.double(), k.double().repeat_interleave(g, 1)) * scale
    if mask is not None:
        s = s.masked_fill(~mask[None], float("-inf"))
    p = torch.softmax(s, -1).nan_to_num(0.0)
    return torch.einsum("hnl,lhd->nhd", p, v.double().repeat_interleave(g, 1))


_text = evalsets.load_corpus()
print(f"c = {C:g}; float16 max = {torch.finfo(torch.float16).max:g}; "
      f"ln(float16 max) = {math.log(torch.finfo(torch.float16).max):.2f}")

# %% [markdown] nbgrader={"grade": false, "grade_id": "task1", "locked": true, "schema_version": 3, "solution": false, "task": false}
# ## Task 1: a safe softmax (3 points)
#
# `scores` is a float tensor `[..., L]` (float32, float16 or bfloat16; values up to
# +-3e4), `mask` a bool tensor of the same shape (`True`: this key may be attended to) or
# `None` (all may). Return the softmax over the last dimension as a **float32** tensor
# of the same shape: masked entries get probability 0, every row with at least one
# allowed key sums to 1, and a row with **no** allowed key is all 0 (not NaN: what
# FlashAttention and the engine give a fully masked row).
#
# Subtract the row's largest allowed score before `exp` (without it, `exp(89)` is inf in
# float32 and `exp(12)` in float16), and mind the fully masked row, whose max is -inf
# (`-inf - -inf` is NaN). Write it with `torch.exp` and sums; do not call
# `torch.softmax`.

# %% nbgrader={"grade": false, "grade_id": "safe_softmax", "locked": false, "schema_version": 3, "solution": true, "task": false}
def safe_softmax(scores: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    ### BEGIN SOLUTION
    s = scores.float()
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    m = s.amax(dim=-1, keepdim=True)
    m = torch.where(m == float("-inf"), torch.zeros_like(m), m)
    e = torch.exp(s - m)
    total = e.sum(dim=-1, keepdim=True)
    return torch.where(total > 0, e / torch.where(total > 0, total, torch.ones_like(total)),
                       torch.zeros_like(e))
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "test_safe_softmax_visible", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
_s = torch.tensor([[1.0, 2.0, 3.0], [0.5, -1.0, 2.0], [4.0, 4.0, 4.0]])
_m = torch.tensor([[True, True, True], [True, False, True], [False, False, False]])
_got = safe_softmax(_s, _m)
checks.equal("safe_softmax returns a torch.Tensor", isinstance(_got, torch.Tensor), True)
checks.equal("safe_softmax dtype", _got.dtype, torch.float32)
checks.equal("safe_softmax shape", tuple(_got.shape), (3, 3))
_want = torch.softmax(_s.double().masked_fill(~_m, float("-inf")), -1).nan_to_num(0.0)
for _i in range(3):
    for _j in range(3):
        checks.close(f"safe_softmax row {_i} entry {_j}", _got[_i, _j], _want[_i, _j], atol=1e-6)
print("visible test passed")

# %% nbgrader={"grade": true, "grade_id": "test_safe_softmax_hidden", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
### BEGIN HIDDEN TESTS
_g = torch.Generator().manual_seed(9001)
for _dtype, _amp in ((torch.float32, 3e4), (torch.float16, 3e4), (torch.bfloat16, 3e4),
                     (torch.float32, 50.0), (torch.float16, 11.5)):
    _shape = (3, 5, int(torch.randint(2, 40, (), generator=_g)))
    _s = ((torch.rand(_shape, generator=_g) * 2 - 1) * _amp).to(_dtype)
    _m = torch.rand(_shape, generator=_g) < 0.7
    _m[0, 1] = False                    # a fully masked row
    _m[1, 2] = True                     # and an unmasked one
    for _mask in (_m, None):
        _got = safe_softmax(_s, _mask)
        _ref = _s.double() if _mask is None else _s.double().masked_fill(~_mask, float("-inf"))
        _want = torch.softmax(_ref, -1).nan_to_num(0.0)
        checks.equal(f"safe_softmax dtype ({_dtype} input)", _got.dtype, torch.float32)
        checks.equal(f"safe_softmax shape ({_dtype} input)", tuple(_got.shape), _shape)
        _bad = int((~torch.isfinite(_got)).sum())
        checks.equal(f"non-finite outputs ({_dtype} scores up to +-{_amp:g}, mask "
                     f"{'given' if _mask is not None else 'None'})", _bad, 0)
        checks.at_most(f"max |safe_softmax - float64 softmax| ({_dtype}, +-{_amp:g})",
                       (_got.double() - _want).abs().max(), 1e-6)
    checks.equal("a fully masked row is all 0", bool((safe_softmax(_s, _m)[0, 1] == 0).all()),
                 True)
# masked entries get probability 0 whatever the allowed scores are: a row whose allowed
# scores are all far below zero (a large finite fill such as -1e4 would win there)
_got = safe_softmax(torch.tensor([[-20000.0, -20001.0, 5.0]]),
                    torch.tensor([[True, True, False]]))
_want = torch.softmax(torch.tensor([[-20000.0, -20001.0]], dtype=torch.float64), -1)
checks.at_most("safe_softmax([-20000, -20001, 5 (masked)]): max |p - [0.731, 0.269, 0]|",
               float((_got.double() - torch.cat([_want, torch.zeros(1, 1, dtype=torch.float64)],
                                                 1)).abs().max()), 1e-6)
# float32 scores: .float() hands back the caller's own tensor, which must stay as it was
_s32 = torch.randn(4, 9, generator=_g)
_m32 = torch.rand(4, 9, generator=_g) < 0.5
_ = checks.call("safe_softmax(float32 scores, mask)", safe_softmax, _s32, _m32)
### END HIDDEN TESTS

# %% [markdown] nbgrader={"grade": false, "grade_id": "task2", "locked": true, "schema_version": 3, "solution": false, "task": false}
# ## Task 2: online softmax attention (3 points)
#
# Attention for one sequence, reading the keys `tile` at a time, as FlashAttention and
# the engine's Triton kernels do (Milakov & Gimelshein 2018, arXiv:1805.02867):
#
# - `q`: `[n, H, D]` queries; `k`, `v`: `[L, Hkv, D]` keys and values, with `H` a
#   multiple of `Hkv` (grouped-query attention: query head `h` reads KV head
#   `h // (H // Hkv)`); any float dtype;
# - `mask`: `[n, L]` bool (`True`: query `i` may attend to key `j`) or `None`;
# - `scale`: the softmax scale; `tile`: keys per tile (an `int >= 1`, need not divide L).
#
# Return `[n, H, D]` **float32**: `softmax(q k^T * scale) v` over each query's allowed
# keys, 0 for a query with none. Compute in float32; for each tile, update a running max
# `m`, a running sum `l` and an unnormalised output `acc` (rescaled by `exp(m_old -
# m_new)` whenever the max grows), and divide by `l` at the end. A query may see no key
# in its first tiles and some later (left padding): its `m` is still -inf then, and must
# not turn into NaN. Do not call `torch.softmax` or the engine's attention functions.

# %% nbgrader={"grade": false, "grade_id": "online_attention", "locked": false, "schema_version": 3, "solution": true, "task": false}
def online_softmax_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             mask: torch.Tensor | None, scale: float,
                             tile: int) -> torch.Tensor:
    ### BEGIN SOLUTION
    n, H, D = q.shape
    L, Hkv = k.shape[0], k.shape[1]
    g = H // Hkv
    qs = q.float() * scale
    m = torch.full((H, n), float("-inf"))
    l = torch.zeros(H, n)
    acc = torch.zeros(H, n, D)
    for t0 in range(0, L, tile):
        kt = k[t0:t0 + tile].float().repeat_interleave(g, dim=1)
        vt = v[t0:t0 + tile].float().repeat_interleave(g, dim=1)
        s = torch.einsum("nhd,thd->hnt", qs, kt)
        if mask is not None:
            s = s.masked_fill(~mask[None, :, t0:t0 + tile], float("-inf"))
        m_new = torch.maximum(m, s.amax(dim=-1))
        m_use = torch.where(m_new == float("-inf"), torch.zeros_like(m_new), m_new)
        alpha = torch.exp(m - m_use)
        p = torch.exp(s - m_use[..., None])
        l = l * alpha + p.sum(dim=-1)
        acc = acc * alpha[..., None] + torch.einsum("hnt,thd->hnd", p, vt)
        m = m_new
    out = acc / torch.where(l > 0, l, torch.ones_like(l))[..., None]
    return out.transpose(0, 1).contiguous()
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "test_online_visible", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
torch.manual_seed(1)
_q, _k, _v = torch.randn(4, 6, 8), torch.randn(20, 2, 8), torch.randn(20, 2, 8)
_mask = chunk_causal_mask(4, 20)
_got = online_softmax_attention(_q, _k, _v, _mask, 8 ** -0.5, 8)
checks.equal("online_softmax_attention dtype", _got.dtype, torch.float32)
checks.equal("online_softmax_attention shape", tuple(_got.shape), (4, 6, 8))
checks.at_most("max |online - float64 attention| (20 keys, tiles of 8, causal)",
               (_got.double() - attention64(_q, _k, _v, _mask, 8 ** -0.5)).abs().max(), 1e-5)
print("visible test passed")

# %% nbgrader={"grade": true, "grade_id": "test_online_hidden", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
### BEGIN HIDDEN TESTS
_g = torch.Generator().manual_seed(9002)
for _dtype, (_n, _L, _H, _Hkv, _D, _tile), _amp in (
        (torch.float32, (5, 37, 6, 3, 16, 8), 1.0),     # tiles do not divide L
        (torch.float32, (3, 50, 4, 1, 8, 7), 30.0),     # large scores
        (torch.float16, (6, 33, 9, 3, 64, 16), 1.0),
        (torch.bfloat16, (2, 70, 4, 2, 32, 64), 3.0),
        (torch.float32, (4, 9, 2, 2, 8, 32), 1.0)):     # one tile longer than L
    _q = (torch.randn(_n, _H, _D, generator=_g) * _amp).to(_dtype)
    _k = (torch.randn(_L, _Hkv, _D, generator=_g) * _amp).to(_dtype)
    _v = torch.randn(_L, _Hkv, _D, generator=_g).to(_dtype)
    _mask = torch.rand(_n, _L, generator=_g) < 0.6
    _mask[0] = False                                  # nothing to attend to
    _mask[1, :min(_L, 2 * _tile)] = False             # nothing in its first two tiles
    _mask[1, -1] = True
    for _m in (_mask, None):
        _got = online_softmax_attention(_q, _k, _v, _m, _D ** -0.5, _tile)
        _want = attention64(_q, _k, _v, _m, _D ** -0.5)
        _what = f"{_dtype}, n={_n}, L={_L}, H={_H}/{_Hkv}, tile={_tile}, mask " \
                f"{'given' if _m is not None else 'None'}"
        checks.equal(f"dtype ({_what})", _got.dtype, torch.float32)
        checks.equal(f"non-finite outputs ({_what})", int((~torch.isfinite(_got)).sum()), 0)
        # the large-scores case: scores of ~1e3, which float32 rounds by ~1e-4 before exp, so
        # a correct float32 kernel is off by up to 2.1e-4 (solution over 1000 draws: 6 % above
        # 2e-5); the no_rescale fixture is off by 1.3-3.9 there, 0.3-1.9 on the first case
        checks.at_most(f"max |online - float64 attention| ({_what})",
                       (_got.double() - _want).abs().max(), 1e-3 if _amp == 30.0 else 2e-5)
    checks.equal("a query with no allowed key gives 0",
                 bool((online_softmax_attention(_q, _k, _v, _mask, _D ** -0.5, _tile)[0] == 0)
                      .all()), True)
# every score far below zero (about -200): exp(score - m) with any m but the running max
# (0, say) underflows to 0 everywhere, and the output is not the weighted average it is
_k = torch.randn(20, 2, 8, generator=_g) * 0.3
_k[..., 0] = 1.0
_q = torch.randn(3, 4, 8, generator=_g) * 0.3
_q[..., 0] = -200.0  # q.k = -200 +- ~1
_v = torch.randn(20, 2, 8, generator=_g)
_got = online_softmax_attention(_q, _k, _v, None, 1.0, 8)
_want = attention64(_q, _k, _v, None, 1.0)
checks.at_most("max |online - float64 attention| with every scaled score near -200",
               (_got.double() - _want).abs().max(), 1e-3)
### END HIDDEN TESTS

# %% [markdown] nbgrader={"grade": false, "grade_id": "task3", "locked": true, "schema_version": 3, "solution": false, "task": false}
# ## Task 3: one-pass attention safe for float16 (2 points)
#
# The same contract as task 2 without tiles: `q [n, H, D]`, `k`, `v [L, Hkv, D]`,
# `mask [n, L]` bool or `None`, `scale`. Return `[n, H, D]` in **q's dtype**.
#
# The inputs may be float16 whose raw products `q.k` pass 65504 although the scaled
# scores `q.k * scale` are small (that is what the reparametrization does). The eager
# order, `(q @ k^T) * scale` in float16, turns them into inf. Make sure nothing is
# rounded to float16 before the scale is applied (accumulate the products in float32, or
# scale q first in float32), and give a fully masked row 0. Do not call the engine's
# attention functions or `torch.nn.functional.scaled_dot_product_attention`.

# %% nbgrader={"grade": false, "grade_id": "fp16_attention", "locked": false, "schema_version": 3, "solution": true, "task": false}
def attention_fp16_safe(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    ### BEGIN SOLUTION
    g = q.shape[1] // k.shape[1]
    kk = k.float().repeat_interleave(g, dim=1)
    vv = v.float().repeat_interleave(g, dim=1)
    s = torch.einsum("nhd,lhd->hnl", q.float() * scale, kk)
    if mask is not None:
        s = s.masked_fill(~mask[None], float("-inf"))
    m = s.amax(dim=-1, keepdim=True)
    m = torch.where(m == float("-inf"), torch.zeros_like(m), m)
    e = torch.exp(s - m)
    total = e.sum(dim=-1, keepdim=True)
    p = e / torch.where(total > 0, total, torch.ones_like(total))
    return torch.einsum("hnl,lhd->nhd", p, vv).to(q.dtype)
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "test_fp16_visible", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
torch.manual_seed(2)
_q, _k, _v = torch.randn(3, 4, 16), torch.randn(10, 2, 16), torch.randn(10, 2, 16)
_mask = chunk_causal_mask(3, 10)
_got = attention_fp16_safe(_q.half(), _k.half(), _v.half(), _mask, 0.25)
checks.equal("attention_fp16_safe dtype (float16 inputs)", _got.dtype, torch.float16)
checks.equal("attention_fp16_safe shape", tuple(_got.shape), (3, 4, 16))
checks.at_most("max |attention_fp16_safe - float64 attention| (float16, small values)",
               (_got.double() - attention64(_q.half(), _k.half(), _v.half(), _mask, 0.25))
               .abs().max(), 4e-3)
print("visible test passed")

# %% nbgrader={"grade": true, "grade_id": "test_fp16_hidden", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
### BEGIN HIDDEN TESTS
_g = torch.Generator().manual_seed(9003)
for _n, _L, _H, _Hkv, _D in ((4, 12, 6, 2, 64), (1, 30, 9, 3, 64), (7, 7, 4, 4, 32)):
    # raw products q.k of tens of thousands (c = 1024 times a model's ~60); scaled ~10
    _q = (torch.randn(_n, _H, _D, generator=_g) * 90).half()
    _k = (torch.randn(_L, _Hkv, _D, generator=_g) * 90).half()
    _v = torch.randn(_L, _Hkv, _D, generator=_g).half()
    _scale = 10.0 / float((_q.float()[:, :1] @ _k.float()[:, 0].T).abs().max())
    _mask = chunk_causal_mask(_n, _L)
    if _n > 1:
        _mask[0] = False  # a query with nothing to attend to
    _got = attention_fp16_safe(_q, _k, _v, _mask, _scale)
    _want = attention64(_q, _k, _v, _mask, _scale)
    _what = f"float16, n={_n}, L={_L}, largest raw |q.k| " \
            f"{float((_q.float()[:, :1] @ _k.float()[:, 0].T).abs().max()):.0f}"
    checks.equal(f"dtype ({_what})", _got.dtype, torch.float16)
    checks.equal(f"non-finite outputs ({_what})", int((~torch.isfinite(_got)).sum()), 0)
    checks.at_most(f"max |attention_fp16_safe - float64 attention| ({_what})",
                   (_got.double() - _want).abs().max(), 4e-3)
# mask=None (every key allowed), which the contract allows
_q = (torch.randn(3, 4, 16, generator=_g)).half()
_k, _v = (torch.randn(6, 2, 16, generator=_g)).half(), (torch.randn(6, 2, 16, generator=_g)).half()
checks.at_most("max |attention_fp16_safe - float64 attention| (mask=None)",
               (attention_fp16_safe(_q, _k, _v, None, 0.25).double()
                - attention64(_q, _k, _v, None, 0.25)).abs().max(), 4e-3)
# a sharp head: scaled scores spread over +-150, where exp of a score minus anything but
# the row's max overflows float32
_q = (torch.randn(5, 4, 32, generator=_g) * 3).half()
_k = (torch.randn(11, 2, 32, generator=_g) * 3).half()
_v = torch.randn(11, 2, 32, generator=_g).half()
_scale = 150.0 / float((_q.float() @ _k.float()[:, 0].T.unsqueeze(0)).abs().max())
_mask = chunk_causal_mask(5, 11)
_got = attention_fp16_safe(_q, _k, _v, _mask, _scale)
checks.equal("non-finite outputs (float16, scaled scores up to +-150)",
             int((~torch.isfinite(_got)).sum()), 0)
checks.at_most("max |attention_fp16_safe - float64 attention| (scaled scores up to +-150)",
               (_got.double() - attention64(_q, _k, _v, _mask, _scale)).abs().max(), 4e-3)
### END HIDDEN TESTS

# %% [markdown] nbgrader={"grade": false, "grade_id": "restore", "locked": true, "schema_version": 3, "solution": false, "task": false}
# ## Restore check (6 points)
#
# The grader builds a float16 and a float32 engine, plants the reparametrization
# (c = 1024, every layer) in the float16 one, and swaps in your functions as its
# attention steps: `attention_fp16_safe` for prefill (`as_prefill_step`) and
# `online_softmax_attention` with tiles of 16 keys for decode (`as_decode_step`). On a
# fresh passage it scores the tokens teacher-forced in prefill mode and in decode mode
# (token by token through the decode step), and it generates 4 greedy tokens for two
# fresh prompts. Restored means: every logit finite, no corrupted request
# (`llm.llm_engine.stats.num_corrupted_requests` unchanged) and mean KL against the
# float32 engine at most 1e-3 nats in both modes (the unmodified float16 engine measures
# about 2e-5). The broken engine (`broken()`: eager
# attention under the same reparametrization) is measured by the same check and must
# fail it.

# %% nbgrader={"grade": true, "grade_id": "test_restore", "locked": true, "points": 6, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
### BEGIN HIDDEN TESTS
import random as _random

torch.manual_seed(3)
# your functions first, on a small input (a function that raises fails here, at once)
_probe = [online_softmax_attention(torch.randn(1, 4, 8), torch.randn(5, 2, 8),
                                   torch.randn(5, 2, 8), None, 0.3, 2),
          attention_fp16_safe(torch.randn(2, 4, 8).half(), torch.randn(5, 2, 8).half(),
                              torch.randn(5, 2, 8).half(), None, 0.3)]
_llm16, _llm32 = engines()
_tok = _llm16.get_tokenizer()
_rng = _random.Random(9004)


def _fresh(n):
    _s = _rng.randrange(0, len(_text) - 1500)
    return _tok.encode(_text[_s:_s + 1500])[:n]


_ids = _fresh(24)  # decode mode: positions 17-24 read two tiles of 16 keys
_prompts = [_fresh(n) for n in (9, 17)]
_greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
_ref = {m: _llm32.score(_ids, mode=m, output="logits") for m in ("prefill", "decode")}


def _measure():
    """(logits finite, corrupted requests, {mode: mean KL vs float32}); stops at the
    first non-finite score (the check has failed then)."""
    stats = _llm16.llm_engine.stats
    before = stats.num_corrupted_requests
    _llm16.generate(_prompts, _greedy)
    corrupted = stats.num_corrupted_requests - before
    kl = {"prefill": float("nan"), "decode": float("nan")}
    for m in kl:
        rows = _llm16.score(_ids, mode=m, output="logits")
        if not bool(torch.isfinite(rows).all()):
            return False, corrupted, kl
        kl[m] = metrics.mean_kl(_ref[m], rows)
    return True, corrupted, kl


def _passes(r):
    finite, corrupted, kl = r
    return finite and corrupted == 0 and all(x <= 1e-3 for x in kl.values())


with faults.qk_scale_reparam(_llm16, C), \
        _llm16.swap_step("attention.prefill", as_prefill_step(attention_fp16_safe)), \
        _llm16.swap_step("attention.decode", as_decode_step(
            lambda q, k, v, mask, scale: online_softmax_attention(q, k, v, mask, scale, TILE))):
    _mine = _measure()
with broken(_llm16):
    _bad = _measure()
for _name, (_f, _c, _kl) in (("yours", _mine), ("broken", _bad)):
    print(f"{_name}: logits finite {_f}, corrupted requests {_c}, mean KL vs float32 "
          f"prefill {_kl['prefill']:.2e}, decode {_kl['decode']:.2e}")
if _passes(_bad):
    raise checks.CheckFailed("the check does not discriminate: the broken engine passes it")
checks.equal("every logit finite with your attention steps", _mine[0], True)
checks.equal("corrupted requests with your attention steps", _mine[1], 0)
for _m in ("prefill", "decode"):
    checks.at_most(f"mean KL vs the float32 engine, {_m} mode, your steps", _mine[2][_m], 1e-3)
### END HIDDEN TESTS
