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
# # Lab 21: speculative decoding, the drafter and the verifier
#
# In chapter 21 a verifier that accepted the first draft token without checking it
# (lattice #243) changed greedy output on "1 1 1 1 ..." prompts, and the rejection rule
# kept the target distribution only when it was exactly Leviathan et al.'s.
#
# This lab starts from that **broken engine** (`broken()` below plants the bug through
# the `"rejection_sampler"` step). You write the three pieces yourself:
#
# 1. `propose_ngram(tokens, min_n, max_n, k)`: prompt lookup, the `"spec_decode.ngram"`
#    step, 3 points;
# 2. `verify_greedy(draft, target_argmax)`: greedy verification, 2 points;
# 3. `rejection_sample(draft, draft_probs, target_probs, generator)`: the random path,
#    3 points;
#
# then the restore check, 6 points: your drafter and verifier are swapped into a
# float32 engine with `speculative_config={"method": "ngram", ...}`, fresh prompts run
# greedily, and every output must equal plain decoding's, next to the broken engine
# failing the same check.
#
# The grader calls your functions on **new** inputs and compares with the engine's
# references. Run the cells in order. Do not edit the setup and test cells.

# %% nbgrader={"grade": false, "grade_id": "setup", "locked": true, "schema_version": 3, "solution": false, "task": false}
import grading.checks as checks  # first import: records the original functions
import torch

from minivllm import LLM, SamplingParams
from minivllm.precision import faults, metrics
from minivllm.spec_decode import ngram_proposer as ref_ngram
from minivllm.spec_decode import rejection_sampler as ref_rs

MODEL = "smollm2-135m-instruct"
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3}
_engines = {}


def engines():
    """(plain, speculative) float32 engines, built on first use."""
    if not _engines:
        _engines["plain"] = LLM(MODEL, dtype="float32", max_model_len=128, max_num_seqs=4)
        _engines["spec"] = LLM(MODEL, dtype="float32", max_model_len=128, max_num_seqs=4,
                               speculative_config=NGRAM)
    return _engines["plain"], _engines["spec"]


def chat(text: str) -> list:
    tok = engines()[0].get_tokenizer()
    conv = [{"role": "user", "content": text}]
    return tok.encode(tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=True),
                      add_special_tokens=False)


def broken():
    """The chapter's planted bug, on the speculative engine: ``with broken(): ...``."""
    return faults.spec_accept_first_unverified(engines()[1])


def run(llm, prompts, n=16):
    """Greedy, n tokens: one token list per prompt."""
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=n), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


# %% [markdown] nbgrader={"grade": false, "grade_id": "task1", "locked": true, "schema_version": 3, "solution": false, "task": false}
# ## Task 1: prompt lookup (3 points)
#
# `tokens`: a list of ints; `1 <= min_n <= max_n`; `k >= 0`. For the **largest** n in
# `[min_n, max_n]` (and n < len(tokens)) whose last n tokens occur earlier in the list,
# starting at some i with `i + n < len(tokens)` (the suffix itself does not count; an
# occurrence may overlap it), take the **earliest** such i and return
# `tokens[i + n : i + n + k]` (fewer than k if the list ends). No match: `[]`.
# vLLM's rule (`tests/v1/spec_decode/test_ngram.py`).
#
# Do not call `minivllm.spec_decode.ngram_proposer.propose_ngram`.

# %% nbgrader={"grade": false, "grade_id": "propose_ngram", "locked": false, "schema_version": 3, "solution": true, "task": false}
def propose_ngram(tokens, min_n, max_n, k):
    ### BEGIN SOLUTION
    tokens = list(tokens)
    L = len(tokens)
    if k <= 0:
        return []
    for n in range(min(max_n, L - 1), min_n - 1, -1):
        suffix = tokens[L - n:]
        for i in range(L - n):
            if tokens[i:i + n] == suffix:
                return tokens[i + n:i + n + k]
    return []
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "test_propose_ngram_visible", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
checks.equal("[1,2,3,4,1,2,3], n=2, k=3", propose_ngram([1, 2, 3, 4, 1, 2, 3], 2, 2, 3), [4, 1, 2])
checks.equal("the earliest occurrence: [1,2,3,100,1,2,3,200,1,2,3], n=3, k=2",
             propose_ngram([1, 2, 3, 100, 1, 2, 3, 200, 1, 2, 3], 3, 3, 2), [100, 1])
checks.equal("the longest n wins: [2,3,4,5,1,2,3,4,1,2,3,4], n in [3,4], k=2",
             propose_ngram([2, 3, 4, 5, 1, 2, 3, 4, 1, 2, 3, 4], 3, 4, 2), [1, 2])
checks.equal("no match", propose_ngram([1, 2, 3, 4, 5], 1, 3, 2), [])
print("visible test passed")

# %% nbgrader={"grade": true, "grade_id": "test_propose_ngram_hidden", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
### BEGIN HIDDEN TESTS
_g = torch.Generator().manual_seed(21001)
for _case in range(300):
    _L = int(torch.randint(1, 30, (), generator=_g))
    _voc = int(torch.randint(2, 6, (), generator=_g))
    _t = torch.randint(0, _voc, (_L,), generator=_g).tolist()
    _lo = int(torch.randint(1, 4, (), generator=_g))
    _hi = _lo + int(torch.randint(0, 3, (), generator=_g))
    _k = int(torch.randint(0, 6, (), generator=_g))
    checks.equal(f"propose_ngram({_t}, {_lo}, {_hi}, {_k})", list(propose_ngram(list(_t), _lo, _hi, _k)),
                 ref_ngram.propose_ngram(_t, _lo, _hi, _k))
### END HIDDEN TESTS

# %% [markdown] nbgrader={"grade": false, "grade_id": "task2", "locked": true, "schema_version": 3, "solution": false, "task": false}
# ## Task 2: greedy verification (2 points)
#
# `draft`: k ints; `target_argmax`: k + 1 ints, the target's argmax at each verified
# position (position j scores the sequence extended by drafts 0..j-1). Return the
# accepted drafts (the longest prefix with `draft[j] == target_argmax[j]`) followed by
# one target token: `target_argmax[j]` at the first mismatch j, or the bonus
# `target_argmax[k]` when all are accepted. **Every** draft is checked, draft 0 too.

# %% nbgrader={"grade": false, "grade_id": "verify_greedy", "locked": false, "schema_version": 3, "solution": true, "task": false}
def verify_greedy(draft, target_argmax):
    ### BEGIN SOLUTION
    out = []
    for d, t in zip(draft, target_argmax):
        if d != t:
            return out + [t]
        out.append(d)
    return out + [target_argmax[len(draft)]]
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "test_verify_greedy_visible", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
checks.equal("all accepted, then the bonus", list(verify_greedy([4, 5, 6], [4, 5, 6, 7])), [4, 5, 6, 7])
checks.equal("draft 1 rejected", list(verify_greedy([4, 5, 6], [4, 9, 6, 7])), [4, 9])
checks.equal("draft 0 rejected", list(verify_greedy([1, 1, 1], [2, 1, 1, 1])), [2])
print("visible test passed")

# %% nbgrader={"grade": true, "grade_id": "test_verify_greedy_hidden", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
### BEGIN HIDDEN TESTS
_g = torch.Generator().manual_seed(21002)
for _case in range(300):
    _k = int(torch.randint(0, 6, (), generator=_g))
    _d = torch.randint(0, 3, (_k,), generator=_g).tolist()
    _t = torch.randint(0, 3, (_k + 1,), generator=_g).tolist()
    checks.equal(f"verify_greedy({_d}, {_t})", list(verify_greedy(list(_d), list(_t))),
                 ref_rs.verify_greedy(_d, _t))
### END HIDDEN TESTS

# %% [markdown] nbgrader={"grade": false, "grade_id": "task3", "locked": true, "schema_version": 3, "solution": false, "task": false}
# ## Task 3: the random path (3 points)
#
# `draft`: k ints; `draft_probs`: float32 `[k, V]`, the draft distribution q each draft
# was sampled from, or None for n-gram drafts (a point mass: q = one-hot(draft));
# `target_probs`: float32 `[k + 1, V]`, the target p at each verified position;
# `generator`: a `torch.Generator`. Return 1 to k + 1 tokens: the accepted drafts, then
# one token from the target. The contract is speculative sampling's (Leviathan et al.
# 2023, arXiv:2211.17192, Algorithm 1; chapter 21, section 3):
#
# - **Distribution**: whatever q is, each emitted token is distributed as the target p
#   at its position: a draft `d` is accepted with probability `min(1, p(d) / q(d))`
#   (a draft that q gives probability 0 is never accepted), and the first rejected
#   draft is replaced by a draw from what is left of p once q's share is taken out;
#   if all k are accepted, the bonus token is a draw from `p[k]`. If nothing is left
#   (p equal to q), draw from p.
# - **The random stream**, so that equal generators give the reference's tokens: each
#   accept-or-reject test uses one `u = float(torch.rand(1, generator=generator))` and
#   accepts when the ratio is at least `u`; each token drawn from a distribution is one
#   `torch.multinomial(weights, 1, generator=generator)` call; the draws come in the order
#   the tokens are emitted.
#
# Do not call anything in `minivllm.spec_decode.rejection_sampler`.

# %% nbgrader={"grade": false, "grade_id": "rejection_sample", "locked": false, "schema_version": 3, "solution": true, "task": false}
def rejection_sample(draft, draft_probs, target_probs, generator):
    ### BEGIN SOLUTION
    out = []
    for j, d in enumerate(draft):
        p = target_probs[j].float()
        if draft_probs is None:
            q = torch.zeros_like(p)
            q[d] = 1.0
        else:
            q = draft_probs[j].float()
        u = torch.rand(1, generator=generator).item()
        if float(q[d]) > 0 and float(p[d]) / float(q[d]) >= u:
            out.append(d)
            continue
        r = (p - q).clamp_min(0.0)
        if not bool((r > 0).any()):
            r = p
        out.append(int(torch.multinomial(r / r.sum(), 1, generator=generator)))
        return out
    out.append(int(torch.multinomial(target_probs[len(draft)].float(), 1, generator=generator)))
    return out
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "test_rejection_sample_visible", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
_p = torch.zeros(3, 4)
_p[:, 2] = 1.0  # the target puts all its mass on token 2
checks.equal("a point-mass target rejects an n-gram draft of 1 and replaces it with 2",
             list(rejection_sample([1, 1], None, _p, torch.Generator().manual_seed(0))), [2])
checks.equal("a point-mass target accepts drafts of 2 and adds the bonus 2",
             list(rejection_sample([2, 2], None, _p, torch.Generator().manual_seed(0))), [2, 2, 2])
_q = torch.full((2, 4), 0.25)
checks.equal("same generator, same tokens as the reference (uniform p = q: all accepted)",
             list(rejection_sample([0, 3], _q, torch.full((3, 4), 0.25), torch.Generator().manual_seed(5))),
             ref_rs.rejection_sample_random([0, 3], _q, torch.full((3, 4), 0.25),
                                            torch.Generator().manual_seed(5)))
print("visible test passed")

# %% nbgrader={"grade": true, "grade_id": "test_rejection_sample_hidden", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
### BEGIN HIDDEN TESTS
_seed = 21003
_g = torch.Generator().manual_seed(_seed)
_V, _K, _N = 8, 2, 20_000
_P = torch.distributions.Dirichlet(torch.ones(_V)).sample((_K + 1,))
_Q = torch.distributions.Dirichlet(torch.ones(_V) * 0.5).sample((_K,))
# (a) the same tokens as the reference for equal generators, 200 fresh calls
for _i in range(200):
    _d = [int(torch.multinomial(_Q[j], 1, generator=_g)) for j in range(_K)]
    _s = int(torch.randint(0, 2 ** 31 - 1, (), generator=_g))
    _qq = None if _i % 4 == 0 else _Q
    checks.equal(f"rejection_sample call {_i} (seed {_s}) vs the reference",
                 [int(t) for t in rejection_sample(list(_d), _qq, _P.clone(), torch.Generator().manual_seed(_s))],
                 ref_rs.rejection_sample_random(_d, _qq, _P, torch.Generator().manual_seed(_s)))
# (a') the edges: a draft that q gives probability 0 is rejected (and replaced from the
# residual); a ratio exactly equal to u is accepted (u is a multiple of 2**-24, so a
# target p(d) = u against an n-gram draft, q(d) = 1, makes the ratio exactly u)
_q0 = torch.tensor([[0.0, 0.5, 0.5, 0.0]])
_p0 = torch.tensor([[0.7, 0.1, 0.1, 0.1], [0.25, 0.25, 0.25, 0.25]])
for _s in (211, 212, 213):
    checks.equal(f"draft 0 with q(0) = 0 (seed {_s}): rejected, as the reference",
                 [int(t) for t in rejection_sample([0], _q0.clone(), _p0.clone(), torch.Generator().manual_seed(_s))],
                 ref_rs.rejection_sample_random([0], _q0, _p0, torch.Generator().manual_seed(_s)))
for _s in (214, 215, 216):
    _u = float(torch.rand(1, generator=torch.Generator().manual_seed(_s)))
    _pt = torch.zeros(2, 4)
    _pt[0, 1], _pt[0, 2] = _u, 1.0 - _u
    _pt[1, 3] = 1.0
    checks.equal(f"n-gram draft 1 with p(1) = u = {_u!r} exactly (seed {_s}): accepted, then "
                 f"the bonus token 3", [int(t) for t in rejection_sample([1], None, _pt.clone(),
                                                                          torch.Generator().manual_seed(_s))],
                 [1, 3])
# (b) the first emitted token follows p_0: chi-square over V = 8 cells, 20k trials
_counts = torch.zeros(_V)
_gg = torch.Generator().manual_seed(_seed + 1)
for _i in range(_N):
    _d = [int(torch.multinomial(_Q[j], 1, generator=_gg)) for j in range(_K)]
    _counts[int(rejection_sample(_d, _Q, _P, _gg)[0])] += 1
_exp = _P[0].double() * _N
_stat = float(((_counts.double() - _exp) ** 2 / _exp).sum())
_pv = float(torch.special.gammaincc(torch.tensor((_V - 1) / 2, dtype=torch.float64),
                                    torch.tensor(_stat / 2, dtype=torch.float64)))
# p > 1e-6: a correct sampler fails this in about 1 grading in a million, nominally (at 1e-3, 1
# in a thousand); a biased one (resampling from p) is far below it, and (a) catches it too
print(f"chi-square p-value of the first token against p0: {_pv:.3g} (must be > 1e-6)")
checks.equal("first token distributed as the target (chi-square p > 1e-6)", _pv > 1e-6, True)
### END HIDDEN TESTS

# %% [markdown] nbgrader={"grade": false, "grade_id": "restore", "locked": true, "schema_version": 3, "solution": false, "task": false}
# ## Restore check (6 points)
#
# `verifier` (below, do not edit) puts your two verifiers behind the `"rejection_sampler"`
# step's signature. The grader swaps it and your `propose_ngram` (`"spec_decode.ngram"`)
# into the speculative float32 engine, runs three fresh prompts of a repeated digit
# ("4 4 4 4 4 4 4") greedily (16 tokens), and compares with the plain engine: every
# output must be identical. The broken engine (draft 0 unverified) runs the same prompts
# and must fail the same check (the grader draws new prompts, up to three times, until
# it does).

# %% nbgrader={"grade": false, "grade_id": "verifier_step", "locked": true, "schema_version": 3, "solution": false, "task": false}
def verifier(draft_token_ids, draft_probs, target_probs, target_argmax, generator):
    """The "rejection_sampler" step's signature around your functions (do not edit)."""
    if target_argmax is not None:
        return [int(t) for t in verify_greedy(list(draft_token_ids), list(target_argmax))]
    return [int(t) for t in rejection_sample(list(draft_token_ids), draft_probs, target_probs,
                                             generator)]


# %% nbgrader={"grade": true, "grade_id": "test_restore", "locked": true, "points": 6, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
### BEGIN HIDDEN TESTS
import random as _random
# your functions first (a released copy stops here, before any engine is built)
propose_ngram([1, 2, 1, 2], 1, 2, 2), verify_greedy([1], [1, 2])
_rng = _random.Random(21004)
_plain, _spec = engines()
for _attempt in range(3):  # fresh prompts until the broken engine fails on one of them
    _fresh = [chat(" ".join([str(d)] * _rng.randint(6, 10)))
              for d in _rng.sample(range(10), 3)]
    _want = run(_plain, _fresh)
    with broken():
        _bad = run(_spec, _fresh)
    if _bad != _want:
        break
else:
    raise checks.CheckFailed("the check does not discriminate: the broken engine passes it")
with _spec.swap_step("spec_decode.ngram", propose_ngram), \
        _spec.swap_step("rejection_sampler", verifier):
    _mine = run(_spec, _fresh)
print("first divergence from plain decoding: yours",
      [metrics.first_divergence(a, b) for a, b in zip(_want, _mine)], "broken",
      [metrics.first_divergence(a, b) for a, b in zip(_want, _bad)])
for _i, (_a, _b) in enumerate(zip(_want, _mine)):
    checks.equal(f"greedy tokens of fresh prompt {_i} with your drafter and verifier, vs "
                 f"plain decoding", _b, _a)
### END HIDDEN TESTS
