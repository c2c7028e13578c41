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
# # Lab 1: restore a KV cache's accuracy at the lowest memory cost
#
# In chapter 1 you measured how the KV-cache dtype changes the model's next-token
# distributions, with KL divergence on fixed tokens. The engine in this lab starts in the
# **broken configuration** the chapter found: `kv_cache_dtype="fp8_e4m3"` without scales,
# the cheapest cache (1 byte per element) and the one whose greedy answers drift within a
# few tokens. You build the measurement yourself and use it to pick the cheapest KV cache
# that brings the drift back under a budget; the last test plugs your choice into the engine
# on conversations you have not seen and checks the restored number, next to the broken
# configuration failing the same check.
#
# You write three functions. The grader calls them on **new** inputs (other
# conversations, other tensors) and compares with its own reference, so a function that
# only works on the examples in this notebook will not pass.
#
# 1. `mean_kl(ref, cand)`: mean KL divergence, 2 points;
# 2. `kv_drift(kv_cache_dtype, seqs)`: drift of an engine configuration, 3 points;
# 3. `choose_kv_cache_dtype(seqs, max_kl)`: the cheapest dtype within a KL budget, 3 points;
#    then the restore check, 6 points: the engine with your choice, on fresh conversations.
#
# Run the cells in order. Do not edit the setup and test cells.

# %% nbgrader={"grade": false, "grade_id": "setup", "locked": true, "schema_version": 3, "solution": false, "task": false}
import importlib

import grading.checks as checks  # first import: records the original functions
import torch

from minivllm import LLM
from minivllm.precision import evalsets

torch.manual_seed(0)
MODEL = "smollm2-135m-instruct"
BROKEN = "fp8_e4m3"  # the configuration this lab starts from (chapter 1: KL ~7.5e-3 nats)
# Bytes per stored K/V element: what each choice costs in memory. float16 and bfloat16
# cost the same; which of them is "better" is a measurement, not a name.
KV_BYTES = {"fp8_e4m3": 1, "bfloat16": 2, "float16": 2, "float32": 4}
_ENGINES = {}
_SCORES = {}


def get_engine(kv_cache_dtype: str) -> LLM:
    """A float32 engine with this KV-cache dtype (built once, then reused)."""
    if kv_cache_dtype not in _ENGINES:
        _ENGINES[kv_cache_dtype] = LLM(MODEL, dtype="float32", kv_cache_dtype=kv_cache_dtype,
                                       max_model_len=1024, kv_cache_memory_bytes=64 << 20)
    return _ENGINES[kv_cache_dtype]


def score(kv_cache_dtype: str, seqs: list) -> list:
    """``get_engine(kv_cache_dtype).score(seqs)``: one [T, vocab] log-prob tensor per
    sequence, computed once per (dtype, sequences) and then reused."""
    key = (kv_cache_dtype, tuple(map(tuple, seqs)))
    if key not in _SCORES:
        _SCORES[key] = get_engine(kv_cache_dtype).score(seqs)
    return _SCORES[key]


tok = get_engine("float32").get_tokenizer()
example_seqs = evalsets.conversation_sequences(tok, max_conversations=1, max_tokens=80)
print("example: one conversation,", len(example_seqs[0]), "tokens")

# %% [markdown] nbgrader={"grade": false, "grade_id": "task1", "locked": true, "schema_version": 3, "solution": false, "task": false}
# ## Task 1: mean KL divergence (2 points)
#
# `ref` and `cand` are `[T, vocab]` tensors of **logits or log-probs** for the same T
# positions (normalize them yourself). Return the mean over positions of
# $\mathrm{KL}(P_\mathrm{ref} \,\|\, P_\mathrm{cand}) = \sum_v p_\mathrm{ref}(v)\,(\log p_\mathrm{ref}(v) - \log p_\mathrm{cand}(v))$
# in nats, as a Python float. Compute in float64: the values you will compare are tiny.
# A log-prob may be `-inf` (a token with probability 0, as a sampler's mask leaves it):
# a token the reference gives probability 0 contributes nothing ($0 \log 0 = 0$). Leave
# `ref` and `cand` as they are (the caller reuses them).

# %% nbgrader={"grade": false, "grade_id": "mean_kl", "locked": false, "schema_version": 3, "solution": true, "task": false}
def mean_kl(ref: torch.Tensor, cand: torch.Tensor) -> float:
    ### BEGIN SOLUTION
    lr = torch.log_softmax(ref.to(torch.float64), dim=-1)
    lc = torch.log_softmax(cand.to(torch.float64), dim=-1)
    p = lr.exp()
    kl = torch.where(p > 0, p * (lr - lc), torch.zeros_like(p)).sum(dim=-1)
    return float(kl.mean())
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "test_mean_kl_visible", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
# KL([.5, .5] || [.25, .75]) = .5 ln 2 + .5 ln(2/3), by hand
_ref = torch.log(torch.tensor([[0.5, 0.5]], dtype=torch.float64))
_cand = torch.log(torch.tensor([[0.25, 0.75]], dtype=torch.float64))
checks.close("mean_kl on the worked example", mean_kl(_ref, _cand), 0.14384103622589045,
             rtol=1e-9)
print("visible test passed")

# %% nbgrader={"grade": true, "grade_id": "test_mean_kl_hidden", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
### BEGIN HIDDEN TESTS
from minivllm.precision import metrics as _m

_g = torch.Generator().manual_seed(1234)
for _t, _v in [(1, 3), (7, 50), (33, 1000)]:
    _a = torch.randn(_t, _v, generator=_g, dtype=torch.float64) * 3 + 5  # unnormalized logits
    _b = _a + 0.3 * torch.randn(_t, _v, generator=_g, dtype=torch.float64)
    checks.close(f"mean_kl on random logits [{_t}, {_v}]", mean_kl(_a, _b), _m.mean_kl(_a, _b),
                 rtol=1e-6)
    checks.close(f"mean_kl of identical inputs [{_t}, {_v}]", mean_kl(_a, _a), 0.0, atol=1e-12)
_a32 = torch.randn(5, 20, generator=_g).float()
checks.close("mean_kl on float32 input", mean_kl(_a32, _a32 * 1.5), _m.mean_kl(_a32, _a32 * 1.5),
             rtol=1e-6)
# log-probs with -inf entries (tokens a sampler masked out: probability exactly 0 on both
# sides). 0 * log(0 / 0) counts as 0; a term computed where p_ref == 0 is 0 * (-inf) = NaN.
_a = torch.log_softmax(torch.randn(6, 40, generator=_g, dtype=torch.float64), dim=-1)
_b = torch.log_softmax(_a + 0.2 * torch.randn(6, 40, generator=_g, dtype=torch.float64), dim=-1)
_mask = torch.rand(6, 40, generator=_g) < 0.25
_a, _b = _a.masked_fill(_mask, float("-inf")), _b.masked_fill(_mask, float("-inf"))
checks.close("mean_kl with -inf log-probs (masked tokens) on both sides", mean_kl(_a, _b),
             _m.mean_kl(_a, _b), rtol=1e-6)
# tiny drift, as a 16-bit cache gives: float32 arithmetic rounds it away (the lab says
# float64), and the caller's tensors stay as they were; the result is a Python float
_a = torch.randn(4, 3000, generator=_g) * 4
_b = (_a.double() + 1e-5 * torch.randn(4, 3000, generator=_g, dtype=torch.float64)).float()
_want = _m.mean_kl(_a.double(), _b.double())
_got = checks.call("mean_kl(ref, cand)", mean_kl, _a, _b)
checks.equal("type of mean_kl's result", type(_got), float)
checks.close("mean_kl of a tiny float32 drift (computed in float64)", _got, _want, rtol=1e-3)
### END HIDDEN TESTS

# %% [markdown] nbgrader={"grade": false, "grade_id": "task2", "locked": true, "schema_version": 3, "solution": false, "task": false}
# ## Task 2: drift of a KV-cache dtype (3 points)
#
# Score `seqs` (a list of token-id lists) with the float32 cache and with
# `kv_cache_dtype` (use `score(kv_cache_dtype, seqs)` from the setup cell: it runs
# `LLM.score` on the right engine once and reuses the result), and return the mean KL of
# the candidate against float32 **pooled over all positions of all sequences** (every
# position counts once; do not average per-sequence means).

# %% nbgrader={"grade": false, "grade_id": "kv_drift", "locked": false, "schema_version": 3, "solution": true, "task": false}
def kv_drift(kv_cache_dtype: str, seqs: list) -> float:
    ### BEGIN SOLUTION
    base = score("float32", seqs)
    cand = score(kv_cache_dtype, seqs)
    return mean_kl(torch.cat(base), torch.cat(cand))
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "test_kv_drift_visible", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
from minivllm.precision import metrics as _m

_got = kv_drift("float16", example_seqs)  # the learner's function first: a stub fails at once
_b = get_engine("float32").score(example_seqs)
_c = get_engine("float16").score(example_seqs)
_want = float(sum(_m.kl_divergence(x, y).sum() for x, y in zip(_b, _c)) / sum(len(s) for s in example_seqs))
checks.close("kv_drift('float16', example_seqs)", _got, _want, rtol=1e-6)
checks.close("kv_drift('float32', example_seqs)", kv_drift("float32", example_seqs), 0.0, atol=1e-15)
print("visible test passed")

# %% nbgrader={"grade": true, "grade_id": "test_kv_drift_hidden", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
### BEGIN HIDDEN TESTS
from minivllm.precision import metrics as _m

# unseen sequences of different lengths: pooling must weight every position equally
_seqs = [s[:n] for s, n in zip(evalsets.conversation_sequences(tok, max_conversations=9)[7:9],
                               (24, 64))]
for _kv in ("fp8_e4m3", "bfloat16"):
    _got = kv_drift(_kv, _seqs)  # the learner's function first: a stub fails before the references run
    _b = get_engine("float32").score(_seqs)
    _c = get_engine(_kv).score(_seqs)
    _want = float(sum(_m.kl_divergence(x, y).sum() for x, y in zip(_b, _c)) / sum(len(s) for s in _seqs))
    checks.close(f"kv_drift({_kv!r}) on unseen sequences", _got, _want, rtol=1e-6)
### END HIDDEN TESTS

# %% [markdown] nbgrader={"grade": false, "grade_id": "task3", "locked": true, "schema_version": 3, "solution": false, "task": false}
# ## Task 3: the cheapest KV cache within a KL budget (3 points)
#
# Return the dtype of `KV_BYTES` with the fewest bytes per element whose `kv_drift` on
# `seqs` is at most `max_kl`; among dtypes of equal cost (float16 and bfloat16), the one
# with the smaller drift. float32 always qualifies (its drift is 0).

# %% nbgrader={"grade": false, "grade_id": "choose", "locked": false, "schema_version": 3, "solution": true, "task": false}
def choose_kv_cache_dtype(seqs: list, max_kl: float) -> str:
    ### BEGIN SOLUTION
    drift = {kv: kv_drift(kv, seqs) for kv in KV_BYTES}
    ok = [kv for kv in KV_BYTES if drift[kv] <= max_kl]
    return min(ok, key=lambda kv: (KV_BYTES[kv], drift[kv]))
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "test_choose_visible", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
# fp8 without scales moves distributions a lot; 16-bit formats far less
checks.equal("choose_kv_cache_dtype(example_seqs, max_kl=1.0)",
             choose_kv_cache_dtype(example_seqs, 1.0), "fp8_e4m3")
checks.equal("choose_kv_cache_dtype(example_seqs, max_kl=0.0)",
             choose_kv_cache_dtype(example_seqs, 0.0), "float32")
print("visible test passed")

# %% nbgrader={"grade": true, "grade_id": "test_choose_hidden", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
### BEGIN HIDDEN TESTS
from minivllm.precision import metrics as _m

_seqs = [s[:40] for s in evalsets.conversation_sequences(tok, max_conversations=11)[9:11]]
checks.equal("choose_kv_cache_dtype(unseen, max_kl=1.0)",  # learner first (see kv_drift's test)
             choose_kv_cache_dtype(_seqs, 1.0), "fp8_e4m3")
_b = get_engine("float32").score(_seqs)


def _drift(kv):
    _c = get_engine(kv).score(_seqs)
    return float(sum(_m.kl_divergence(x, y).sum() for x, y in zip(_b, _c)) / sum(len(s) for s in _seqs))


_d = {kv: _drift(kv) for kv in KV_BYTES}
_lo16, _hi16 = sorted(("float16", "bfloat16"), key=lambda k: _d[k])
# budgets between the measured drifts, so that each answer is a different dtype: fp8; the
# 2-byte tie (both qualify: the smaller drift wins); only one 2-byte dtype qualifies;
# nothing cheaper than float32 qualifies
for _budget, _want in ((_d["fp8_e4m3"], "fp8_e4m3"),  # exactly at the budget: "at most"
                      (_d[_hi16] * 1.01, _lo16), (_d[_hi16], _lo16),
                       ((_d[_lo16] * _d[_hi16]) ** 0.5, _lo16), (_d[_lo16] * 0.5, "float32")):
    checks.equal(f"choose_kv_cache_dtype(unseen, max_kl={_budget:.3g}) "
                 f"[measured drifts: {', '.join(f'{k} {v:.3g}' for k, v in _d.items())}]",
                 choose_kv_cache_dtype(_seqs, _budget), _want)
### END HIDDEN TESTS

# %% [markdown] nbgrader={"grade": false, "grade_id": "restore", "locked": true, "schema_version": 3, "solution": false, "task": false}
# ## Restore check (6 points)
#
# The grader takes a budget of 1e-5 nats (between the 16-bit caches that chapter 1
# measured), lets your `choose_kv_cache_dtype` pick a cache on conversations you have not
# seen, builds the engine with it, and measures KL against the float32 cache on other
# fresh conversations with its own metric. The restored engine must be within budget and
# cost less than float32; the broken configuration (`fp8_e4m3`) is measured by the same
# check and must fail it, which shows the check can tell them apart.

# %% nbgrader={"grade": true, "grade_id": "test_restore", "locked": true, "points": 6, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
### BEGIN HIDDEN TESTS
from minivllm.precision import metrics as _m

_budget = 1e-5
_convs = evalsets.conversation_sequences(tok, max_conversations=8)
_pick_seqs = [s[:48] for s in _convs[5:7]]
_eval_seqs = [_convs[7][:96]]
_chosen = choose_kv_cache_dtype(_pick_seqs, _budget)
checks.equal(f"the chosen KV cache is one of {list(KV_BYTES)}", _chosen in KV_BYTES, True)


_b = get_engine("float32").score(_eval_seqs)


def _restored_kl(kv):
    _c = get_engine(kv).score(_eval_seqs)
    return float(sum(_m.kl_divergence(x, y).sum() for x, y in zip(_b, _c)) / sum(len(s) for s in _eval_seqs))


_kl_broken, _kl_chosen = _restored_kl(BROKEN), _restored_kl(_chosen)
print(f"KL vs float32 on a fresh conversation: broken {BROKEN} {_kl_broken:.3g} nats, "
      f"your {_chosen} {_kl_chosen:.3g} nats (budget {_budget:g})")
if _kl_broken <= _budget:
    raise checks.CheckFailed(f"the check does not discriminate: the broken {BROKEN} cache "
                             f"passes it ({_kl_broken:.3g} <= {_budget:g})")
checks.at_most(f"KL of the restored engine ({_chosen})", _kl_chosen, _budget)
checks.equal(f"bytes per element of {_chosen} < float32's", KV_BYTES[_chosen] < 4, True)
### END HIDDEN TESTS
