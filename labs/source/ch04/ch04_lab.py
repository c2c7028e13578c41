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
# # Lab 4: tell noise from an anomaly, and restore the LM head's accuracy
#
# In chapter 4 you measured the incident of vllm #18352 on the embedded model: the engine
# served in bf16 (`dtype="auto"`) gives log-probs that differ from float32 by a few
# hundredths of a nat RMS and up to about two tenths, and a good part of that comes from the
# **bf16 LM head**, whose rounded outputs are the logits themselves. This lab starts from
# that **broken configuration** (the bf16 engine with its bf16 LM head). You build two
# measuring tools and the fix:
#
# 1. `topk_overlap(ref, cand, k)`: the top-k overlap metric, 2 points;
# 2. `is_anomaly(base_rows, cand_rows, noise_rows, groups)`: the chapter's decision rule
#    with a cluster bootstrap, 3 points;
# 3. `fp32_logits(hidden, weight)`: the fp32 LM head, 3 points;
#    then the restore check, 7 points: your LM head goes into the bf16 engine through
#    `swap_step("lm_head", ...)` on text you have not seen;
# 4. `VERDICTS`: four changes a team proposes to ship, each judged noise or anomaly by
#    measuring it, 2 points.
#
# The grader calls your functions on **new** inputs and compares with the engine's own
# references, so a function that only works on the examples here will not pass.
# Run the cells in order. Do not edit the setup and test cells.

# %% nbgrader={"grade": false, "grade_id": "setup", "locked": true, "schema_version": 3, "solution": false, "task": false}
import importlib

import grading.checks as checks  # first import: records the original functions
import numpy as np
import torch
import torch.nn.functional as F

from minivllm import LLM
from minivllm.precision import evalsets, metrics

torch.manual_seed(0)
MODEL = "smollm2-135m-instruct"
PRACTICAL_KL = 1e-4  # nats: the chapter's practical threshold
KW = dict(max_model_len=256, kv_cache_memory_bytes=16 << 20, enable_prefix_caching=False)
fp32 = LLM(MODEL, dtype="float32", **KW)   # the reference engine
broken = LLM(MODEL, dtype="auto", **KW)    # bf16 engine, bf16 LM head: where this lab starts
tok = fp32.get_tokenizer()
windows = evalsets.corpus_sequences(tok, seq_len=24)
example_seqs = windows[:4]
print("broken engine runs in", broken.llm_engine.model_config.dtype, "; example:",
      len(example_seqs), "windows of", len(example_seqs[0]), "tokens")

# %% [markdown] nbgrader={"grade": false, "grade_id": "task1", "locked": true, "schema_version": 3, "solution": false, "task": false}
# ## Task 1: top-k overlap (2 points)
#
# `ref` and `cand` are `[T, vocab]` tensors (logits or log-probs: the top k is the same
# either way) for the same T positions. For each position, take the k most likely tokens
# of each and count how many of the reference's k are also among the candidate's; divide
# by k. Return the mean over positions as a Python float. A position where either row holds
# NaN or +inf scores 0 (−inf is a legitimate zero probability). Raise `ValueError` unless k
# is an int in [1, vocab].

# %% nbgrader={"grade": false, "grade_id": "topk", "locked": false, "schema_version": 3, "solution": true, "task": false}
def topk_overlap(ref: torch.Tensor, cand: torch.Tensor, k: int = 5) -> float:
    ### BEGIN SOLUTION
    r, c = ref.double(), cand.double()
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= r.shape[1]:
        raise ValueError(f"k must be an int in [1, {r.shape[1]}], got {k!r}")
    tr = r.topk(k, dim=-1).indices
    tc = c.topk(k, dim=-1).indices
    hits = (tr[:, :, None] == tc[:, None, :]).any(-1).double().sum(-1)
    valid = ~((r.isnan() | r.isposinf()).any(-1) | (c.isnan() | c.isposinf()).any(-1))
    hits = torch.where(valid, hits, torch.zeros_like(hits))
    return float((hits / k).mean())
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "test_topk_visible", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
_r = torch.tensor([[4.0, 3.0, 2.0, 1.0], [1.0, 2.0, 3.0, 4.0]])
_c = torch.tensor([[4.0, 1.0, 3.0, 2.0], [4.0, 3.0, 2.0, 1.0]])
# top-2: row 0 {0, 1} vs {0, 2}: 1 of 2; row 1 {3, 2} vs {0, 1}: 0 of 2 -> mean 0.25
checks.close("topk_overlap on the worked example, k=2", topk_overlap(_r, _c, 2), 0.25, rtol=1e-12)
checks.close("topk_overlap(x, x, k=4)", topk_overlap(_r, _r, 4), 1.0, rtol=1e-12)
print("visible test passed")

# %% nbgrader={"grade": true, "grade_id": "test_topk_hidden", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
### BEGIN HIDDEN TESTS
from minivllm.precision import metrics as _m

_g = torch.Generator().manual_seed(4242)
for _t, _v, _k in [(1, 7, 1), (13, 100, 5), (40, 2000, 20), (6, 9, 9)]:
    _a = torch.randn(_t, _v, generator=_g, dtype=torch.float64) * 2
    _b = _a + 0.7 * torch.randn(_t, _v, generator=_g, dtype=torch.float64)
    checks.close(f"topk_overlap on fresh logits [{_t}, {_v}], k={_k}", topk_overlap(_a, _b, _k),
                 _m.topk_overlap(_a, _b, _k), rtol=1e-12)
_a = torch.randn(8, 300, generator=_g)  # float32, with a NaN row and a +inf row
_b = _a + 0.5 * torch.randn(8, 300, generator=_g)
_a[2, 5] = float("nan")
_b[6, 7] = float("inf")
_b[4, 0] = float("-inf")
checks.close("topk_overlap with NaN / +inf / -inf entries", topk_overlap(_a, _b, 5),
             _m.topk_overlap(_a, _b, 5), rtol=1e-12)
checks.call("topk_overlap(ref, cand, 5)", topk_overlap, _a, _b, 5)  # inputs left as they were
for _bad in (0, 301, 2.0):
    try:
        topk_overlap(_a, _b, _bad)
    except ValueError:
        pass
    else:
        raise checks.CheckFailed(f"topk_overlap(..., k={_bad!r}) must raise ValueError "
                                 "(k must be an int in [1, vocab])")
### END HIDDEN TESTS

# %% [markdown] nbgrader={"grade": false, "grade_id": "task2", "locked": true, "schema_version": 3, "solution": false, "task": false}
# ## Task 2: noise or anomaly? (3 points)
#
# The chapter's decision rule. Inputs, all for the same N positions:
#
# * `base_rows`: `[N, vocab]` log-probs (or logits) of the reference;
# * `cand_rows`: the candidate's;
# * `noise_rows`: the reference with a benign change (a reordered sum): the noise floor;
# * `groups`: N integers, the sequence (cluster) each position belongs to.
#
# Compute the per-position KL divergence `KL(base || cand)` and `KL(base || noise)`
# (`metrics.kl_divergence`). Split each by group (groups in increasing order of their id,
# positions in their original order) and take a **cluster-bootstrap** 95 % interval of the
# mean with `metrics.bootstrap_ci(list_of_per_group_arrays)` (its defaults: 2000
# resamples, seed 0). Return `"anomaly"` when the candidate's interval lies entirely above
# the noise floor's (its low end above the noise's high end) **and** the candidate's mean KL
# is above `PRACTICAL_KL` (both strictly: equal is not above); otherwise `"noise"`. Leave
# the inputs as they are.

# %% nbgrader={"grade": false, "grade_id": "is_anomaly", "locked": false, "schema_version": 3, "solution": true, "task": false}
def is_anomaly(base_rows, cand_rows, noise_rows, groups) -> str:
    ### BEGIN SOLUTION
    g = np.asarray(groups)
    kl_c = metrics.kl_divergence(base_rows, cand_rows).numpy()
    kl_n = metrics.kl_divergence(base_rows, noise_rows).numpy()
    ids = np.unique(g)
    lo_c, _ = metrics.bootstrap_ci([kl_c[g == i] for i in ids])
    _, hi_n = metrics.bootstrap_ci([kl_n[g == i] for i in ids])
    return "anomaly" if lo_c > hi_n and kl_c.mean() > PRACTICAL_KL else "noise"
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "test_is_anomaly_visible", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
from minivllm.precision.noise import permuted_mlp_reduction

# your function first, on a tiny input: an unwritten one stops here, before the scoring
_tiny = torch.randn(4, 8, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
is_anomaly(_tiny, _tiny, _tiny, [0, 0, 1, 1])
_base = torch.cat(fp32.score(example_seqs))
_groups = [i for i, s in enumerate(example_seqs) for _ in s]
with permuted_mlp_reduction(fp32, seed=0):
    _noise = torch.cat(fp32.score(example_seqs))
_bf16 = torch.cat(broken.score(example_seqs))
checks.equal("is_anomaly(base, the bf16 engine, noise floor, groups)",
             is_anomaly(_base, _bf16, _noise, _groups), "anomaly")
checks.equal("is_anomaly(base, the noise floor itself, noise floor, groups)",
             is_anomaly(_base, _noise, _noise, _groups), "noise")
print("visible test passed")

# %% nbgrader={"grade": true, "grade_id": "test_is_anomaly_hidden", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
### BEGIN HIDDEN TESTS
from minivllm.precision import faults as _faults
from minivllm.precision.noise import permuted_mlp_reduction
from minivllm.quantization.kv_cache import quantize_kv as _quantize_kv

# synthetic candidates that need the clusters and both conditions
_g = torch.Generator().manual_seed(77)
_sb = torch.randn(8 * 24, 64, generator=_g, dtype=torch.float64) * 3
_sg = [i // 24 for i in range(8 * 24)]
_sn = _sb + 1e-6 * torch.randn(_sb.shape, generator=_g, dtype=torch.float64)
_one = _sb.clone()
_one[3 * 24:4 * 24] += 0.6 * torch.randn(24, 64, generator=_g, dtype=torch.float64)
_bign = _sb + 0.05 * torch.randn(_sb.shape, generator=_g, dtype=torch.float64)
_bigc = _sb + 0.052 * torch.randn(_sb.shape, generator=_g, dtype=torch.float64)
_synth = {
    "large drift in one sequence of 8 only (resample whole sequences!)": (
        "noise", _sb, _one, _sn, _sg),
    "the same drift with the groups listed in another order": (
        "noise", _sb, _one, _sn, [(i * 5) % 8 for i in _sg]),
    "drift in every sequence": ("anomaly", _sb, _sb + 0.3 * torch.randn(
        _sb.shape, generator=_g, dtype=torch.float64), _sn, _sg),
    "above the threshold but inside a large noise floor": ("noise", _sb, _bigc, _bign, _sg),
}
for _name, (_want, _b, _c, _n, _gr) in _synth.items():  # cheap, and the learner's first
    checks.equal(f"is_anomaly: {_name}", is_anomaly(_b, _c, _n, _gr), _want)

# the rule's two boundaries, where "above" means strictly above. 8 positions of identical
# rows give every position the same KL k, so every interval is exactly [k, k] and any mean
# of them is exactly k.
_row = torch.randn(1, 64, generator=_g, dtype=torch.float64) * 3
_b8 = _row.repeat(8, 1)
_c8 = (_row + 0.5 * torch.randn(1, 64, generator=_g, dtype=torch.float64)).repeat(8, 1)
_g8 = [0, 0, 1, 1, 2, 2, 3, 3]
_k = float(metrics.kl_divergence(_b8[:1], _c8[:1])[0])
checks.equal(f"is_anomaly when the candidate's interval [{_k:.4g}, {_k:.4g}] touches the noise "
             "floor's (low end equal to the noise's high end: not above it)",
             is_anomaly(_b8, _c8, _c8.clone(), _g8), "noise")
_saved = PRACTICAL_KL
try:
    PRACTICAL_KL = _k  # the threshold exactly at the candidate's mean KL: not above it
    _verdict = is_anomaly(_b8, _c8, _b8.clone(), _g8)
finally:
    PRACTICAL_KL = _saved
checks.equal(f"is_anomaly when the candidate's mean KL equals PRACTICAL_KL ({_k:.4g}) and the "
             "noise floor is 0", _verdict, "noise")
checks.equal(f"is_anomaly with the same rows at the lab's threshold ({PRACTICAL_KL:g} < {_k:.4g})",
             is_anomaly(_b8, _c8, _b8.clone(), _g8), "anomaly")
# the caller's tensors and group list are left as they were
checks.call("is_anomaly(base, cand, noise, groups)", is_anomaly, _sb, _one, _sn, list(_sg))

# fresh windows, engine candidates: their expected verdicts were measured in chapter 4
_seqs = windows[30:34]
_groups = [i for i, s in enumerate(_seqs) for _ in s]
_base = torch.cat(fp32.score(_seqs))
with permuted_mlp_reduction(fp32, seed=11):
    _noise = torch.cat(fp32.score(_seqs))


def _kv16(x, cache_dtype, scale):
    return _quantize_kv(x.half().to(x.dtype), cache_dtype, scale)


def _head16(hidden, weight):
    return F.linear(hidden.bfloat16(), weight.bfloat16()).float()


_cands = {}
with permuted_mlp_reduction(fp32, seed=12):
    _cands["another benign reorder"] = ("noise", torch.cat(fp32.score(_seqs)))
with fp32.swap_step("kv.quantize", _kv16):  # above the floor, below the practical threshold
    _cands["fp16 K/V"] = ("noise", torch.cat(fp32.score(_seqs)))
with fp32.swap_step("lm_head", _head16):
    _cands["bf16 LM head on the float32 body"] = ("anomaly", torch.cat(fp32.score(_seqs)))
with _faults.wrong_rope_theta(fp32, layer=20, theta=10_000.0):
    _cands["planted fault: rope theta 1e4 in layer 20"] = ("anomaly", torch.cat(fp32.score(_seqs)))

for _name, (_want, _c) in _cands.items():
    checks.equal(f"is_anomaly on fresh windows: {_name} (mean KL "
                 f"{metrics.mean_kl(_base, _c):.2e} nats)",
                 is_anomaly(_base, _c, _noise, _groups), _want)
### END HIDDEN TESTS

# %% [markdown] nbgrader={"grade": false, "grade_id": "task3", "locked": true, "schema_version": 3, "solution": false, "task": false}
# ## Task 3: the fp32 LM head (3 points)
#
# `fp32_logits(hidden, weight)` has the signature of the engine's "lm_head" step:
# `hidden` is `[rows, hidden_size]` (the final-norm hidden states, in the model's dtype),
# `weight` is `[vocab, hidden_size]` (the tied embedding, model dtype). Return the logits
# `[rows, vocab]` in **float32**, computed the way open-instruct #1387 and prime-rl #2438 do
# it: both inputs in float32 *before* the product (`F.linear`), so no 16-bit rounding
# touches the logits. (The engine's reference for this step computes in the model dtype and
# casts the result: that is the broken configuration.)

# %% nbgrader={"grade": false, "grade_id": "fp32_logits", "locked": false, "schema_version": 3, "solution": true, "task": false}
def fp32_logits(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    ### BEGIN SOLUTION
    return F.linear(hidden.float(), weight.float())
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "test_fp32_logits_visible", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
# 1 + 2^-8 is exact in float32 but not in bf16 (8 significant bits): it rounds to 1.0
_h = torch.tensor([[1.0, 2.0 ** -8]], dtype=torch.bfloat16)
_w = torch.tensor([[1.0, 1.0], [2.0, 0.0]], dtype=torch.bfloat16)
_out = fp32_logits(_h, _w)
checks.equal("fp32_logits(...).dtype", _out.dtype, torch.float32)
checks.equal("fp32_logits(...).shape", tuple(_out.shape), (1, 2))
checks.close("logit 0 of the worked example (1 + 2^-8)", _out[0, 0].item(), 1.00390625, rtol=0)
print("visible test passed")

# %% nbgrader={"grade": true, "grade_id": "test_fp32_logits_hidden", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
### BEGIN HIDDEN TESTS
from minivllm.models.llama import lm_head_fp32 as _ref_head

_g = torch.Generator().manual_seed(9)
for _rows, _hid, _voc, _dt in [(1, 576, 4096, torch.bfloat16), (37, 64, 1000, torch.bfloat16),
                               (5, 96, 300, torch.float16), (9, 48, 200, torch.float32)]:
    _h = (torch.randn(_rows, _hid, generator=_g) * 4).to(_dt)
    _w = (torch.randn(_voc, _hid, generator=_g) * 0.1).to(_dt)
    _got, _want = fp32_logits(_h, _w), _ref_head(_h, _w)
    checks.equal(f"fp32_logits dtype on {_dt} inputs", _got.dtype, torch.float32)
    checks.equal(f"fp32_logits shape [{_rows}, {_hid}] x [{_voc}, {_hid}]", tuple(_got.shape),
                 (_rows, _voc))
    checks.close(f"fp32_logits on fresh {_dt} inputs: max |diff| from the engine's fp32 head",
                 (_got - _want).abs().max().item(), 0.0, atol=1e-5 * _want.abs().max().item())
# the engine's own configured fp32 head (lm_head_dtype="float32") on the real weight
_model = broken.llm_engine.model_runner.model
_hs = (torch.randn(3, 576, generator=_g) * 3).to(torch.bfloat16)
_wt = _model.embed_tokens.weight
checks.close("fp32_logits on the model's tied weight vs the engine's fp32 head",
             (fp32_logits(_hs, _wt) - _ref_head(_hs, _wt)).abs().max().item(), 0.0, atol=1e-4)
### END HIDDEN TESTS

# %% [markdown] nbgrader={"grade": false, "grade_id": "restore", "locked": true, "schema_version": 3, "solution": false, "task": false}
# ## Restore check (7 points)
#
# The grader plugs your `fp32_logits` into the broken bf16 engine with
# `broken.swap_step("lm_head", fp32_logits)` and scores corpus windows you have not seen.
# It measures the RMS |Δ log p| of the target tokens against the **exact LM head on the
# same hidden states** (the head in float64; the bf16 body is the same in every run, since
# the head does not feed back on fixed tokens). Chapter 4 measured the bf16 head's own
# rounding at ~0.026 nats RMS; an fp32 head leaves ~1e-6. The limit is 1e-3 nats. The
# broken configuration (the bf16 head) is measured by the same check and must fail it.
# For information, the cell also prints both against the float32 engine: there the fix
# removes the head's share only, as the chapter showed (errors add in quadrature).

# %% nbgrader={"grade": true, "grade_id": "test_restore", "locked": true, "points": 7, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
### BEGIN HIDDEN TESTS
_limit = 1e-3
_seqs = windows[40:42]
_tgt = [torch.tensor(s[1:]) for s in _seqs]


def _tgt_lp(rows):
    return torch.cat([r[:-1].double().gather(1, t[:, None]).squeeze(1) for r, t in zip(rows, _tgt)])


def _exact_head(hidden, weight):
    return F.linear(hidden.double(), weight.double())


def _rms(a, b):
    return float((_tgt_lp(a) - _tgt_lp(b)).pow(2).mean().sqrt())


with broken.swap_step("lm_head", fp32_logits):
    _restored = broken.score(_seqs)  # the learner's step first: a stub fails at once
with broken.swap_step("lm_head", _exact_head):
    _exact = broken.score(_seqs, output="logits")
_exact = [torch.log_softmax(r.double(), -1) for r in _exact]
_broken = broken.score(_seqs)  # the bf16 head, as configured
_ref32 = fp32.score(_seqs)
_rms_broken, _rms_restored = _rms(_broken, _exact), _rms(_restored, _exact)
print(f"RMS |Δ log p(target)| vs the exact head, {sum(map(len, _tgt))} fresh positions: "
      f"broken bf16 head {_rms_broken:.2e}, your fp32 head {_rms_restored:.2e} nats "
      f"(limit {_limit:g})")
print(f"for information, vs the float32 engine: broken {_rms(_broken, _ref32):.4f}, "
      f"yours {_rms(_restored, _ref32):.4f} nats")
if _rms_broken <= _limit:
    raise checks.CheckFailed(f"the check does not discriminate: the broken bf16 head passes it "
                             f"({_rms_broken:.3g} <= {_limit:g})")
checks.at_most("RMS |Δ log p| of your fp32 LM head in the bf16 engine", _rms_restored, _limit)
### END HIDDEN TESTS


# %% [markdown] nbgrader={"grade": false, "grade_id": "task4", "locked": true, "schema_version": 3, "solution": false, "task": false}
# ## Task 4: what may ship? (2 points)
#
# A team proposes four changes to the **float32** engine, each to save memory or time,
# and asks whether any of them changes what the model says. Decide each one with the
# chapter's rule, not with a rule of thumb: your `is_anomaly`, the float32 engine as the
# reference, and as the noise floor the same float32 engine with a benign reorder
# (`permuted_mlp_reduction(fp32, seed=...)`, imported below; each candidate changes the
# float32 engine, so its noise floor is float32's). Set `VERDICTS[name]` to `"noise"` or
# `"anomaly"`. `score_candidate(name, seqs)` below scores token sequences with the
# float32 engine and that one change swapped in.
#
# The grader measures all four on windows you have not seen with the rule of task 2 and
# requires your four verdicts to be its four.

# %% nbgrader={"grade": false, "grade_id": "candidates_helper", "locked": true, "schema_version": 3, "solution": false, "task": false}
from minivllm.numerics import tf32_linear
from minivllm.precision.noise import permuted_mlp_reduction
from minivllm.quantization.kv_cache import quantize_kv


def _kv_bf16(x, cache_dtype, scale):
    return quantize_kv(x.bfloat16().to(x.dtype), cache_dtype, scale)


def _kv_fp8(x, cache_dtype, scale):
    s = x.detach().abs().amax().clamp(min=1e-12) / 448.0  # one scale per write: amax / 448
    return quantize_kv((x / s).to(torch.float8_e4m3fn).to(x.dtype) * s, cache_dtype, scale)


def _head_bf16(hidden, weight):
    return F.linear(hidden.bfloat16(), weight.bfloat16()).float()


CANDIDATES = {
    "K/V stored in bfloat16": ("kv.quantize", _kv_bf16),
    "K/V stored in fp8 e4m3, one scale per write": ("kv.quantize", _kv_fp8),
    "TF32 inputs to every linear layer": ("linear", tf32_linear),
    "the LM head in bfloat16": ("lm_head", _head_bf16),
}


def score_candidate(name: str, seqs) -> torch.Tensor:
    """Log-probs [sum of lengths, vocab] of the float32 engine with the change ``name``
    (a key of CANDIDATES) swapped in, the rows of all ``seqs`` concatenated."""
    step, fn = CANDIDATES[name]
    with fp32.swap_step(step, fn):
        return torch.cat(fp32.score(seqs))


# %% nbgrader={"grade": false, "grade_id": "verdicts", "locked": false, "schema_version": 3, "solution": true, "task": false}
VERDICTS = {name: None for name in CANDIDATES}  # "noise" or "anomaly" for each
### BEGIN SOLUTION
VERDICTS = {
    "K/V stored in bfloat16": "noise",
    "K/V stored in fp8 e4m3, one scale per write": "anomaly",
    "TF32 inputs to every linear layer": "noise",
    "the LM head in bfloat16": "anomaly",
}
### END SOLUTION

# %% nbgrader={"grade": true, "grade_id": "test_verdicts", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
### BEGIN HIDDEN TESTS
from minivllm.precision.noise import permuted_mlp_reduction

checks.equal("VERDICTS' keys", sorted(VERDICTS) if isinstance(VERDICTS, dict) else VERDICTS,
             sorted(CANDIDATES))
for _name in CANDIDATES:
    checks.one_of(f"VERDICTS[{_name!r}]", VERDICTS[_name], ["noise", "anomaly"])
_seqs = windows[44:48]
_g = np.asarray([i for i, s in enumerate(_seqs) for _ in s])
_base = torch.cat(fp32.score(_seqs))
with permuted_mlp_reduction(fp32, seed=21):
    _noise = torch.cat(fp32.score(_seqs))
_kl_n = metrics.kl_divergence(_base, _noise).numpy()
_hi_n = metrics.bootstrap_ci([_kl_n[_g == i] for i in np.unique(_g)])[1]
_measured = {}
for _name in CANDIDATES:
    _kl_c = metrics.kl_divergence(_base, score_candidate(_name, _seqs)).numpy()
    _lo_c = metrics.bootstrap_ci([_kl_c[_g == i] for i in np.unique(_g)])[0]
    _measured[_name] = ("anomaly" if _lo_c > _hi_n and _kl_c.mean() > PRACTICAL_KL else "noise",
                        float(_kl_c.mean()))
for _name, (_v, _kl) in _measured.items():
    print(f"{_name}: mean KL {_kl:.2e} nats -> {_v}")
for _name, (_v, _kl) in _measured.items():
    checks.equal(f"VERDICTS[{_name!r}] (measured on fresh windows: mean KL {_kl:.2e} nats, "
                 f"noise floor up to {_hi_n:.1e}, threshold {PRACTICAL_KL:g})", VERDICTS[_name], _v)
### END HIDDEN TESTS
