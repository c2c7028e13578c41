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
# # Lab 6: find and fix a decode-only fault
#
# In chapter 6 you scored the same tokens through the engine's two paths, prefill and
# decode, and found them within float32 noise of each other (KL ~1e-11 nats), flat along
# the output. Then a planted fault, one layer's decode attention computing its softmax in
# bfloat16, left prefill bit-identical and raised the prefill/decode KL by orders of
# magnitude. This lab starts from that **broken engine**: the setup cell plants the fault
# (through the step registry) in one layer. You build the measurement, find the layer,
# and write the fixed decode attention step; the last test plugs your step into the faulty
# engine on text you have not seen and checks the restored number, next to the faulty
# engine failing the same check.
#
# You write three functions. The grader calls them on **new** inputs (other token
# sequences, the fault in other layers, random tensors of other shapes) and compares with
# its own reference, so a function that only works on the examples here will not pass.
#
# 1. `position_kl(llm, ids)`: per-position KL between prefill and decode, 2 points;
# 2. `locate_decode_fault(llm, ids)`: the faulty layer, 3 points;
# 3. `decode_attention_fp32(q, k, v, seq_lens, scale)`: the fixed decode step, 3 points;
#    then the restore check, 6 points.
#
# Run the cells in order. Do not edit the setup and test cells.

# %% nbgrader={"grade": false, "grade_id": "setup", "locked": true, "schema_version": 3, "solution": false, "task": false}
import importlib

import grading.checks as checks  # first import: records the original functions
import torch

from minivllm import LLM
from minivllm.attention.backends.torch_ref import decode_attention_ref
from minivllm.precision import evalsets, faults, metrics
from minivllm.precision.layer_diff import capture_hidden_states, relative_error

torch.manual_seed(0)
MODEL = "smollm2-135m-instruct"
FAULT_LAYER = 17  # where this notebook's fault sits (the grader plants others)

llm = LLM(MODEL, dtype="float32", max_model_len=512, kv_cache_memory_bytes=32 << 20)
tok = llm.get_tokenizer()
NUM_LAYERS = len(llm.llm_engine.model_runner.model.layers)
_text = evalsets.load_corpus()
example_ids = tok.encode(_text[:2000])[:16]
print(f"example: {len(example_ids)} tokens; the model has {NUM_LAYERS} layers")


def broken(layer: int = FAULT_LAYER):
    """The fault of chapter 6: ``layer``'s decode softmax in bfloat16 (prefill untouched).
    Use it as ``with broken(): ...``; outside the block the engine is clean."""
    return faults.decode_softmax_low_precision(llm, layer, dtype=torch.bfloat16)


with broken():
    _p = llm.score(example_ids, mode="prefill")
    _d = llm.score(example_ids, mode="decode")
print(f"the broken engine: prefill vs decode mean KL {metrics.mean_kl(_p, _d):.2e} nats "
      f"(chapter 6: a clean float32 engine ~1e-11)")

# %% [markdown] nbgrader={"grade": false, "grade_id": "task1", "locked": true, "schema_version": 3, "solution": false, "task": false}
# ## Task 1: KL between prefill and decode, per position (2 points)
#
# Score the fixed token sequence `ids` with `llm.score(ids, mode="prefill")` and with
# `llm.score(ids, mode="decode")` (each returns `[T, vocab]` float32 log-probs), and return
# a `[T]` tensor of $\mathrm{KL}(P_\mathrm{prefill} \,\|\, P_\mathrm{decode})$ at each
# position, in nats, computed in float64 (the values are tiny: float32 would round them
# away). Row t is the distribution of the token after position t.

# %% nbgrader={"grade": false, "grade_id": "position_kl", "locked": false, "schema_version": 3, "solution": true, "task": false}
def position_kl(llm: LLM, ids: list) -> torch.Tensor:
    ### BEGIN SOLUTION
    lp = torch.log_softmax(llm.score(ids, mode="prefill").to(torch.float64), dim=-1)
    ld = torch.log_softmax(llm.score(ids, mode="decode").to(torch.float64), dim=-1)
    return (lp.exp() * (lp - ld)).sum(dim=-1)
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "test_position_kl_visible", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
with broken():
    _kl = position_kl(llm, example_ids)
_want = metrics.kl_divergence(_p, _d)  # the setup cell's scores of the broken engine
checks.equal("position_kl returns a torch.Tensor", isinstance(_kl, torch.Tensor), True)
checks.equal("position_kl shape", tuple(_kl.shape), (len(example_ids),))
for _t in (1, len(example_ids) // 2, len(example_ids) - 1):
    checks.close(f"position_kl at position {_t} (broken engine)", _kl[_t], _want[_t], rtol=1e-4)
print(f"visible test passed: mean KL {float(_kl.mean()):.2e} nats")

# %% nbgrader={"grade": true, "grade_id": "test_position_kl_hidden", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
### BEGIN HIDDEN TESTS
import random as _random

_layer = _random.Random(6002).randrange(NUM_LAYERS)
_ids = tok.encode(_text[3000:5500])[:16]
with broken(_layer):
    _kl = position_kl(llm, _ids)
    _want = metrics.kl_divergence(llm.score(_ids, mode="prefill"), llm.score(_ids, mode="decode"))
checks.equal(f"position_kl shape on a fresh {len(_ids)}-token sequence", tuple(_kl.shape),
             (len(_ids),))
for _t in range(1, len(_ids)):
    checks.close(f"position_kl at position {_t}, fault in layer {_layer}", _kl[_t], _want[_t],
                 rtol=1e-4)
checks.close("mean of position_kl", _kl.mean(), _want.mean(), rtol=1e-4)
### END HIDDEN TESTS

# %% [markdown] nbgrader={"grade": false, "grade_id": "task2", "locked": true, "schema_version": 3, "solution": false, "task": false}
# ## Task 2: which layer breaks the decode path? (3 points)
#
# The fault is in decode only, so the prefill path is a fault-free reference computed by
# the same engine on the same tokens. `capture_hidden_states(llm, ids, mode)` returns
# `{point: [T, hidden] float64}` for every capture point; the residual stream after layer
# i is the point `f"layers.{i}"`, and `relative_error(a, b)` is `||a - b|| / ||b||`.
# Compare decode against prefill layer by layer and return the index (an `int`) of the
# **first layer whose residual-stream error jumps**: the first layer whose error exceeds
# both `2e-6` and 10 times the largest error of every layer before it. Return `None` when
# no layer jumps (a clean engine: float32 noise is 4e-8 to 1.5e-6 here). Do not look for
# the largest error: the error of the broken layer propagates and usually grows downstream.
# (Why 2e-6 and not layer_diff's default 1e-5: from layer 11 on, this model's residual
# stream is large, up to ~22,000, so one layer's attention error is a small *relative*
# error of the stream, ~2e-5 for this fault.)

# %% nbgrader={"grade": false, "grade_id": "locate", "locked": false, "schema_version": 3, "solution": true, "task": false}
def locate_decode_fault(llm: LLM, ids: list):
    ### BEGIN SOLUTION
    a = capture_hidden_states(llm, ids, "prefill")
    b = capture_hidden_states(llm, ids, "decode")
    n = len(llm.llm_engine.model_runner.model.layers)
    worst = 0.0
    for i in range(n):
        e = relative_error(b[f"layers.{i}"], a[f"layers.{i}"])
        if e > 2e-6 and e > 10 * worst:
            return i
        worst = max(worst, e)
    return None
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "test_locate_visible", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
with broken():
    _found = locate_decode_fault(llm, example_ids)
checks.equal(f"locate_decode_fault with the fault in layer {FAULT_LAYER}", _found, FAULT_LAYER)
print("visible test passed")

# %% nbgrader={"grade": true, "grade_id": "test_locate_hidden", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
### BEGIN HIDDEN TESTS
import random as _random

_ids = tok.encode(_text[6000:8500])[:20]
# one layer drawn at random, and layer 9, where the largest error is not the faulty layer
for _layer in (_random.Random(6003).randrange(NUM_LAYERS), 9):
    with broken(_layer):
        _found = locate_decode_fault(llm, _ids)
    checks.equal(f"locate_decode_fault on a fresh sequence, fault planted in layer {_layer}",
                 _found, _layer)
checks.equal("locate_decode_fault on the clean engine (nothing to find)",
             locate_decode_fault(llm, _ids[:12]), None)

# The rule at its edges, on error profiles built exactly: capture_hidden_states is
# replaced for a moment by one whose decode residual after layer i is [1, e_i] against
# prefill's [1, 0], so relative_error is e_i to the bit. Powers of two make "10 times the
# largest before" exact too. Profiles that go up and down, and keys in the engine's order.
_W = 2.0 ** -19  # 1.9e-6, just under 2e-6
_cases = [
    ("error exactly 2e-6 (not above it), then a jump at 8", {5: 2e-6, 8: 3e-5}, 8),
    ("error exactly 10x the largest before (not above it), then a jump at 7",
     {2: _W, 6: 10 * _W, 7: 101 * _W}, 7),
    ("a first error above 2e-6 that is not 10x the largest before, a jump at 3 after it",
     {1: 1.5e-6, 2: 1e-5, 3: 2e-4}, 3),
    ("3e-6 after 1e-7 everywhere before: a jump", {0: 1e-7, 1: 1e-7, 4: 3e-6}, 4),
    ("1.5e-6 after 1e-8: below 2e-6, no jump anywhere", {0: 1e-8, 3: 1.5e-6}, None),
    ("a large error that falls again (non-monotone): the jump is the first layer",
     {10: 5e-4, 11: 1e-6, 12: 4e-4, 20: 3e-3}, 10),
]
_real_capture = capture_hidden_states
_keys = list(_real_capture(llm, _ids[:4], "prefill"))


def _profile_capture(profile):
    def fake(llm_, ids_, mode):
        out = {}
        for key in _keys:
            e = 0.0
            if key.startswith("layers.") and key.count(".") == 1:
                e = profile.get(int(key.split(".")[1]), 0.0)
            out[key] = torch.tensor([[1.0, 0.0 if mode == "prefill" else e]], dtype=torch.float64)
        return out
    return fake


try:
    for _name, _prof, _want in _cases:
        capture_hidden_states = _profile_capture(_prof)
        _a, _b = capture_hidden_states(llm, _ids, "prefill"), capture_hidden_states(llm, _ids, "decode")
        for _i, _e in _prof.items():  # the construction is exact, or the test is wrong
            assert relative_error(_b[f"layers.{_i}"], _a[f"layers.{_i}"]) == _e, (_i, _e)
        _found = locate_decode_fault(llm, _ids)
        checks.equal(f"locate_decode_fault on a built error profile: {_name}", _found, _want)
finally:
    capture_hidden_states = _real_capture
### END HIDDEN TESTS

# %% [markdown] nbgrader={"grade": false, "grade_id": "task3", "locked": true, "schema_version": 3, "solution": false, "task": false}
# ## Task 3: the fixed decode attention step (3 points)
#
# Write the "attention.decode" step with its softmax in float32. Signature and layout are
# those of the reference, `decode_attention_ref` (read its docstring: `help(decode_attention_ref)`):
#
# - `q`: `[B, H, D]`, one query per sequence; `k`, `v`: `[B, L, Hkv, D]`, padded to a
#   common length L; query head h reads KV head `h // (H // Hkv)`;
# - `seq_lens`: `[B]`, keys at positions `>= seq_lens[b]` are padding (finite values that
#   must get zero weight);
# - return `[B, H, D]` in q's dtype: `softmax(q k^T * scale) v` over the real keys.
#
# Compute the scores, the softmax and the weighted sum in float32 whatever the input
# dtype. Write the math yourself (scores, mask, softmax, weighted sum: the step a kernel
# author writes; calling the reference would pass and teach nothing). Tolerance against the reference on
# float32 inputs: max |difference| <= 5e-5 (the two sum in different orders; a bf16
# softmax is off by ~1e-2, an fp16 one by ~1e-3).

# %% nbgrader={"grade": false, "grade_id": "decode_step", "locked": false, "schema_version": 3, "solution": true, "task": false}
def decode_attention_fp32(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    ### BEGIN SOLUTION
    B, H, D = q.shape
    L, hkv = k.shape[1], k.shape[2]
    group = H // hkv
    kk = k.to(torch.float32).repeat_interleave(group, dim=2)  # [B, L, H, D]
    vv = v.to(torch.float32).repeat_interleave(group, dim=2)
    scores = torch.einsum("bhd,blhd->bhl", q.to(torch.float32), kk) * scale
    mask = torch.arange(L, device=q.device)[None, :] < seq_lens[:, None]  # [B, L]
    scores = scores.masked_fill(~mask[:, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("bhl,blhd->bhd", probs, vv).to(q.dtype)
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "test_decode_step_visible", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
_g = torch.Generator().manual_seed(6)
_q = torch.randn(2, 9, 64, generator=_g)
_k = torch.randn(2, 40, 3, 64, generator=_g)
_v = torch.randn(2, 40, 3, 64, generator=_g)
_sl = torch.tensor([40, 17])
_out = decode_attention_fp32(_q, _k, _v, _sl, 64 ** -0.5)
_ref = decode_attention_ref(_q, _k, _v, _sl, 64 ** -0.5)
checks.equal("output shape", tuple(_out.shape), tuple(_ref.shape))
checks.equal("output dtype", _out.dtype, _ref.dtype)
checks.at_most("max |decode_attention_fp32 - decode_attention_ref| (B=2, H=9, Hkv=3, D=64)",
               (_out - _ref).abs().max(), 5e-5)
print("visible test passed")

# %% nbgrader={"grade": true, "grade_id": "test_decode_step_hidden", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
### BEGIN HIDDEN TESTS
import torch.nn.functional as _F

_g = torch.Generator().manual_seed(6001)
for _B, _H, _Hkv, _D, _L in [(1, 4, 4, 16, 1), (3, 8, 2, 32, 75), (4, 12, 4, 128, 300),
                             (5, 6, 1, 48, 33)]:
    _q = torch.randn(_B, _H, _D, generator=_g) * 2
    _k = torch.randn(_B, _L, _Hkv, _D, generator=_g) * 2
    _v = torch.randn(_B, _L, _Hkv, _D, generator=_g)
    _sl = torch.randint(1, _L + 1, (_B,), generator=_g)
    _sl[0] = _L
    for _b in range(_B):  # padding holds large finite values: they must get weight 0
        _k[_b, _sl[_b]:] = 1e4
        _v[_b, _sl[_b]:] = -1e4
    _out = decode_attention_fp32(_q, _k, _v, _sl, _D ** -0.5)
    _ref = decode_attention_ref(_q, _k, _v, _sl, _D ** -0.5)
    checks.equal(f"output shape (B={_B}, H={_H}, Hkv={_Hkv}, D={_D}, L={_L})",
                 tuple(_out.shape), tuple(_ref.shape))
    checks.at_most(f"max |decode_attention_fp32 - decode_attention_ref| (B={_B}, H={_H}, "
                   f"Hkv={_Hkv}, D={_D}, L={_L}, seq_lens={_sl.tolist()})",
                   (_out - _ref).abs().max(), 5e-5)
# bf16 inputs: the softmax must still be float32 (compare with a float64 computation)
_q = torch.randn(2, 6, 32, generator=_g).to(torch.bfloat16)
_k = torch.randn(2, 50, 2, 32, generator=_g).to(torch.bfloat16)
_v = torch.randn(2, 50, 2, 32, generator=_g).to(torch.bfloat16)
_sl = torch.tensor([50, 21])
_out = decode_attention_fp32(_q, _k, _v, _sl, 32 ** -0.5)
checks.equal("output dtype for bfloat16 inputs", _out.dtype, torch.bfloat16)
_s = torch.einsum("bhd,blhd->bhl", _q.double(), _k.double().repeat_interleave(3, dim=2)) * 32 ** -0.5
_s = _s.masked_fill(~(torch.arange(50)[None, :] < _sl[:, None])[:, None, :], float("-inf"))
_exact = torch.einsum("bhl,blhd->bhd", _s.softmax(-1), _v.double().repeat_interleave(3, dim=2))
checks.at_most("max |result - float64 attention| on bfloat16 inputs (one bf16 rounding of "
               "the output allowed)", (_out.double() - _exact).abs().max(), 1.6e-2)
### END HIDDEN TESTS

# %% [markdown] nbgrader={"grade": false, "grade_id": "restore", "locked": true, "schema_version": 3, "solution": false, "task": false}
# ## Restore check (6 points)
#
# The grader plants the fault in a layer drawn at random, plugs your
# `decode_attention_fp32` into the faulty engine at that layer
# (`llm.swap_step("attention.decode", decode_attention_fp32, where=layer)`), scores fresh
# text in both modes and measures the mean KL(prefill || decode) with its own metric. The
# restored engine must be at most 1e-9 nats (a clean float32 engine measures ~1e-11 to
# 3e-11 here; the bf16 fault ~2e-7 to a few 1e-6). The faulty engine is measured by the same
# check and must fail it, which shows the check can tell them apart.

# %% nbgrader={"grade": true, "grade_id": "test_restore", "locked": true, "points": 6, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
### BEGIN HIDDEN TESTS
import random as _random

_budget = 1e-9
_layer = _random.Random(6004).randrange(NUM_LAYERS)
_ids = tok.encode(_text[9000:12000])[:16]


def _mode_kl():
    return float(metrics.mean_kl(llm.score(_ids, mode="prefill"), llm.score(_ids, mode="decode")))


with broken(_layer):
    with llm.swap_step("attention.decode", decode_attention_fp32, where=_layer):
        _kl_fixed = _mode_kl()  # the learner's step first: a stub fails at once
    _kl_broken = _mode_kl()
print(f"prefill vs decode on fresh text, fault in layer {_layer}: broken {_kl_broken:.3g} nats, "
      f"with your decode step {_kl_fixed:.3g} nats (budget {_budget:g})")
if _kl_broken <= _budget:
    raise checks.CheckFailed(f"the check does not discriminate: the broken engine passes it "
                             f"({_kl_broken:.3g} <= {_budget:g})")
checks.at_most(f"KL(prefill || decode) with your decode step in layer {_layer}", _kl_fixed,
               _budget)
### END HIDDEN TESTS
