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
# # Lab 5: make decode attention batch-invariant
#
# In chapter 5 the default engine in bfloat16 gave a request different greedy text
# depending on which other requests decoded beside it, at temperature 0. The cause was
# the `"attention.decode"` step: one masked `scaled_dot_product_attention` over keys
# padded to the longest sequence of the decode group, whose bits depend on the padded
# length. This lab starts from the engine's batch-invariant mode (`batch_invariant=True`:
# linears and LM head one row at a time) with that default padded SDPA planted back as
# its decode attention, so attention is the whole problem. (The linears need the mode:
# on a Xeon with AMX bf16 tiles, `amx_bf16`, a bf16 GEMM gives a row different bits from
# 33 rows up, which a prefill chunk beside the decode reaches; there the default engine
# with a correct attention failed 2 of 6 fresh draws of the check below, the
# batch-invariant one 0 of 21.) You write the decode
# attention yourself, the way `minivllm_kernels/paged_attention.py` and vLLM's batch-invariant
# mode do it: **split-KV with a fixed split size, merged in split order**, over each
# sequence's own keys. The last test plugs it into the engine as its `"attention.decode"`
# step and checks, on prompts you have not seen, that a request's logits are **bitwise**
# equal alone and in three batch compositions, next to the planted padded SDPA failing
# the same check.
#
# You write two functions. The grader calls them on **new** inputs (other lengths,
# paddings, batch mates, dtypes, seeds):
#
# 1. `invariant_decode_attention(q, k, v, seq_lens, scale)`: the step, 4 points;
# 2. `seeded_sample(probs, seed)`: one seeded exponential-race draw, 2 points;
#    then the restore check, 6 points.
#
# Run the cells in order. Do not edit the setup and test cells.

# %% nbgrader={"grade": false, "grade_id": "setup", "locked": true, "schema_version": 3, "solution": false, "task": false}
import importlib

import grading.checks as checks  # first import: records the original functions
import torch

from minivllm import LLM, SamplingParams
from minivllm.attention.backends.torch_ref import decode_attention_ref
from minivllm.layers.sampler import random_sample
from minivllm.precision import evalsets

torch.manual_seed(0)
MODEL = "smollm2-135m-instruct"
SPLIT_SIZE = 16  # keys per split: fixed, whatever the sequence length or the batch
# batch_invariant=True: linears and the LM head one row at a time (chapter 5)
llm = LLM(MODEL, dtype="bfloat16", max_model_len=256, kv_cache_memory_bytes=128 * 1024**2,
          batch_invariant=True)
tok = llm.get_tokenizer()
_text = evalsets.load_corpus()


def decode_logits(target, companions):
    """The target's logits [len(target), vocab] (float32), scored one token per engine step
    (decode path), while ``companions`` (token-id prompts) generate greedily beside it."""
    engine = llm.llm_engine
    ids = [engine.add_request(c, SamplingParams(temperature=0, max_tokens=len(target) + 1,
                                                ignore_eos=True)) for c in companions]
    try:
        return llm.score(target, mode="decode", output="logits")
    finally:
        for rid in ids:
            engine.abort_request(rid)
            engine.finished_outputs.pop(rid, None)


example = tok.encode(_text[500:1500])[:10]
example_mates = [tok.encode(_text[3000:4000])[:30]]
# the planted fault: the default engine's padded SDPA as the decode attention
with llm.swap_step("attention.decode", decode_attention_ref):
    _alone = decode_logits(example, [])
    _batched = decode_logits(example, example_mates)
print(f"padded SDPA: a {len(example)}-token sequence alone vs beside a 30-token prompt: "
      f"bitwise equal {torch.equal(_alone, _batched)}, max |dlogit| "
      f"{(_alone - _batched).abs().max():.3g}")

# %% [markdown] nbgrader={"grade": false, "grade_id": "task1", "locked": true, "schema_version": 3, "solution": false, "task": false}
# ## Task 1: batch-invariant decode attention (4 points)
#
# Write the engine's `"attention.decode"` step (same signature as `decode_attention_ref`):
#
# - `q`: `[B, H, D]`, one query per sequence (compute dtype: float32 or bfloat16);
# - `k`, `v`: `[B, L, Hkv, D]`, each sequence's keys/values **padded** to a common length
#   `L` (`H % Hkv == 0`: query head `h` reads KV head `h // (H // Hkv)`). Positions
#   `>= seq_lens[b]` are padding and may hold anything finite;
# - `seq_lens`: `[B]` int64, the real lengths; `scale`: the softmax scale.
#
# Return `[B, H, D]` in `q`'s dtype: `softmax(q k^T * scale) v` over each sequence's
# **real** keys. The result for sequence `b` must be **bit for bit** the same whatever
# `L` is and whatever the other sequences are. The way kernels do it: for each sequence,
# walk its keys in splits of `SPLIT_SIZE` starting at position 0 (the last split may be
# shorter), compute each split's scores in float32, and merge the splits **in order**
# with the online-softmax update (running max `m`, running sum `s`, running output
# `acc`; when the max grows from `m` to `m'`, rescale `s` and `acc` by `exp(m - m')`).
# Divide by `s` at the end and cast to `q`'s dtype. A split size derived from `L` or a
# fixed *number* of splits would make the result depend on the batch again.

# %% nbgrader={"grade": false, "grade_id": "invariant_decode_attention", "locked": false, "schema_version": 3, "solution": true, "task": false}
def invariant_decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                               seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    ### BEGIN SOLUTION
    B, H, D = q.shape
    group = H // k.shape[2]
    out = torch.empty_like(q)
    for b in range(B):
        n = int(seq_lens[b])  # this sequence's real keys only
        split = SPLIT_SIZE
        qb = q[b].float()  # [H, D]
        m = torch.full((H,), float("-inf"))
        s = torch.zeros(H)
        acc = torch.zeros(H, D)
        for start in range(0, n, split):
            ks = k[b, start:min(start + split, n)].float().repeat_interleave(group, dim=1)
            vs = v[b, start:min(start + split, n)].float().repeat_interleave(group, dim=1)
            x = torch.einsum("hd,shd->hs", qb, ks) * scale  # [H, split]
            m_new = torch.maximum(m, x.amax(dim=-1))
            alpha = torch.exp(m - m_new)
            p = torch.exp(x - m_new[:, None])
            s = s * alpha + p.sum(dim=-1)
            acc = acc * alpha[:, None] + torch.einsum("hs,shd->hd", p, vs)
            m = m_new
        out[b] = (acc / s[:, None]).to(q.dtype)
    return out
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "test_attention_visible", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
_g = torch.Generator().manual_seed(0)
_q = torch.randn(2, 4, 8, generator=_g)
_k = torch.randn(2, 40, 2, 8, generator=_g)
_v = torch.randn(2, 40, 2, 8, generator=_g)
_sl = torch.tensor([23, 40])
_got = invariant_decode_attention(_q, _k, _v, _sl, 0.35)
checks.equal("output shape", tuple(_got.shape), (2, 4, 8))
checks.equal("output dtype", _got.dtype, torch.float32)
_want = decode_attention_ref(_q.double(), _k.double(), _v.double(), _sl, 0.35)
checks.at_most("max |out - float64 reference| (float32 inputs)",
               float((_got.double() - _want).abs().max()), 1e-5)
print("visible test passed")

# %% nbgrader={"grade": true, "grade_id": "test_attention_hidden", "locked": true, "points": 3, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
### BEGIN HIDDEN TESTS
_g = torch.Generator().manual_seed(5001)
for _dtype, _tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
    for _H, _Hkv, _D in ((9, 3, 64), (4, 4, 16)):
        _lens = [int(x) for x in torch.randint(1, 70, (3,), generator=_g)] + [SPLIT_SIZE]
        _L = max(_lens) + int(torch.randint(0, 9, (), generator=_g))
        _q = torch.randn(4, _H, _D, generator=_g).to(_dtype)
        _k = torch.randn(4, _L, _Hkv, _D, generator=_g).to(_dtype)
        _v = torch.randn(4, _L, _Hkv, _D, generator=_g).to(_dtype)
        _sl = torch.tensor(_lens)
        _got = invariant_decode_attention(_q, _k, _v, _sl, _D ** -0.5)
        checks.equal(f"output dtype ({_dtype})", _got.dtype, _dtype)
        _want = decode_attention_ref(_q.double(), _k.double(), _v.double(), _sl, _D ** -0.5)
        checks.at_most(f"max |out - float64 reference| ({_dtype}, H={_H}, Hkv={_Hkv}, "
                       f"lengths {_lens}, padded to {_L})",
                       float((_got.double() - _want).abs().max()), _tol)
        if _dtype is torch.float32 and _H == 9:
            # scores in the hundreds (a sharp head): exp of a score minus anything but the
            # running max overflows float32
            _kb = _k * 40
            _gotb = invariant_decode_attention(_q, _kb, _v, _sl, _D ** -0.5)
            _wantb = decode_attention_ref(_q.double(), _kb.double(), _v.double(), _sl, _D ** -0.5)
            # (float32 scores of that size carry ~1e-5 of rounding: the solution's error
            # measured 1.1e-5..1.6e-5 over 40 draws; an overflow gives NaN or inf)
            checks.at_most("max |out - float64 reference| with scores in the hundreds",
                           float((_gotb.double() - _wantb).abs().max()), 1e-3)
        if _dtype is torch.bfloat16 and _H == 9:
            # bfloat16 inputs and a sharp head (q x 8): scores rounded to bfloat16 before the
            # softmax move it by ~1e-2 (measured 1.6e-2..8.8e-2 over 30 draws), scores in
            # float32 as the lab says stay at the output's own rounding (at most 9.0e-3)
            _qs = (_q.float() * 8).to(_dtype)
            _gs = invariant_decode_attention(_qs, _k, _v, _sl, _D ** -0.5)
            _ws = decode_attention_ref(_qs.double(), _k.double(), _v.double(), _sl, _D ** -0.5)
            checks.at_most("max |out - float64 reference| (bfloat16, a sharp head: the scores "
                           "must be computed in float32)", float((_gs.double() - _ws).abs().max()),
                           1.25e-2)
        # the same sequence 0, padded differently and with other batch mates
        for _extra, _mates in ((1, 1), (17, 3), (40, 0)):
            _L2 = _lens[0] + _extra
            _k2 = torch.randn(1 + _mates, _L2, _Hkv, _D, generator=_g).to(_dtype) * 3
            _v2 = torch.randn(1 + _mates, _L2, _Hkv, _D, generator=_g).to(_dtype) * 3
            _k2[0, :_lens[0]] = _k[0, :_lens[0]]
            _v2[0, :_lens[0]] = _v[0, :_lens[0]]
            _q2 = torch.cat([_q[:1], torch.randn(_mates, _H, _D, generator=_g).to(_dtype)])
            _sl2 = torch.tensor([_lens[0]] + [int(x) for x in
                                              torch.randint(1, _L2 + 1, (_mates,), generator=_g)])
            _got2 = invariant_decode_attention(_q2, _k2, _v2, _sl2, _D ** -0.5)
            checks.equal(f"sequence of {_lens[0]} keys ({_dtype}): bitwise the same padded to "
                         f"{_L} in a batch of 4 and padded to {_L2} in a batch of {1 + _mates}",
                         torch.equal(_got2[0], _got[0]), True)
### END HIDDEN TESTS

# %% [markdown] nbgrader={"grade": false, "grade_id": "task2", "locked": true, "schema_version": 3, "solution": false, "task": false}
# ## Task 2: a seeded draw (2 points)
#
# The engine samples with an *exponential race*: draw `E ~ Exp(1)` for every token of
# the vocabulary and pick `argmax(p / E)`, which picks token `i` with probability
# `p[i]` (`minivllm/layers/sampler.py:random_sample`). A request with
# `SamplingParams(seed=...)` draws its `E` from its own `torch.Generator` seeded with
# that seed, so its draws do not depend on the other requests.
#
# Write `seeded_sample(probs, seed)`: `probs` is a float32 `[V]` probability vector of
# one request, `seed` an int. Make a CPU `torch.Generator`, seed it with `seed`, fill a
# tensor like `probs` with exponentials from it (`Tensor.exponential_(generator=...)`) and
# return the index of the largest `probs / E` as a Python `int`. Same seed and same
# probabilities must give the engine's token. Leave `probs` and torch's global generator
# as they were (a seeded request must not move the other requests' draws).

# %% nbgrader={"grade": false, "grade_id": "seeded_sample", "locked": false, "schema_version": 3, "solution": true, "task": false}
def seeded_sample(probs: torch.Tensor, seed: int) -> int:
    ### BEGIN SOLUTION
    gen = torch.Generator()
    gen.manual_seed(seed)
    e = torch.empty_like(probs).exponential_(generator=gen)
    return int((probs / e).argmax())
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "test_seeded_visible", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
_p = torch.softmax(torch.randn(1000, generator=torch.Generator().manual_seed(0)), dim=0)
_got = seeded_sample(_p, 7)
checks.equal("seeded_sample returns an int", isinstance(_got, int), True)
checks.equal("the same seed gives the same token", seeded_sample(_p, 7), _got)
_gen = torch.Generator()
_gen.manual_seed(7)
checks.equal("seeded_sample(p, 7) equals the engine's draw", _got,
             int(random_sample(_p[None], {0: _gen}, None)[0]))
print("visible test passed")

# %% nbgrader={"grade": true, "grade_id": "test_seeded_hidden", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
### BEGIN HIDDEN TESTS
_g = torch.Generator().manual_seed(5002)
for _i in range(20):
    _V = int(torch.randint(2, 50000, (), generator=_g))
    _p = torch.softmax(torch.randn(_V, generator=_g) * 3, dim=0)
    _seed = int(torch.randint(0, 2 ** 62, (), generator=_g))
    _got = seeded_sample(_p, _seed)
    _gen = torch.Generator()
    _gen.manual_seed(_seed)
    # the engine's draw for this row, in a batch of 3 whose other rows are unseeded
    _batch = torch.stack([torch.softmax(torch.randn(_V, generator=_g), 0), _p,
                          torch.softmax(torch.randn(_V, generator=_g), 0)])
    _want = int(random_sample(_batch, {1: _gen}, torch.Generator().manual_seed(_i))[1])
    checks.equal(f"seeded_sample(probs of {_V} tokens, seed {_seed}) vs the engine", _got, _want)
# near ties, built so that p / E and p * (1 / E) (an ulp apart now and then) pick
# different tokens: the engine divides, and the same seed must give its token
_cases = []
for _seed in range(5000, 5400):
    _gen = torch.Generator()
    _gen.manual_seed(_seed)
    _e = torch.empty(2).exponential_(generator=_gen)
    _a = torch.tensor(0.5)
    _b = (_a * _e[1] / _e[0]).float()
    for _step in range(6):
        _p = torch.stack([_a, _b])
        if int((_p / _e).argmax()) != int((_p * (1.0 / _e)).argmax()):
            _cases.append((_seed, _p))
            break
        _b = torch.nextafter(_b, torch.tensor(1.0))
    if len(_cases) == 6:
        break
checks.at_most("near-tie cases found (the check needs some)", -len(_cases), -6)
# the caller's probabilities and torch's global generator are left as they were (a
# seeded request must not move the draws of the unseeded ones)
_ = checks.call("seeded_sample(p, 7)", seeded_sample, torch.softmax(torch.randn(50, generator=_g), 0), 7)
for _seed, _p in _cases:
    _gen = torch.Generator()
    _gen.manual_seed(_seed)
    _want = int(random_sample(_p[None], {0: _gen}, None)[0])
    checks.equal(f"seeded_sample({_p.tolist()}, seed {_seed}) (a near tie) vs the engine",
                 seeded_sample(_p, _seed), _want)
### END HIDDEN TESTS

# %% [markdown] nbgrader={"grade": false, "grade_id": "restore", "locked": true, "schema_version": 3, "solution": false, "task": false}
# ## Restore check (6 points)
#
# The grader plugs your attention into the engine (`llm.swap_step("attention.decode",
# invariant_decode_attention)`), takes two fresh 6-token sequences from the corpus and
# scores each one in decode mode alone and in three fresh batch compositions (other
# prompts of 3 to 45 tokens generating beside it). Every composition's logits must be
# `torch.equal` to the sequence's logits alone. First it checks your function directly
# (fresh float32 tensors, two paddings). The planted fault (the default engine's padded
# SDPA, `decode_attention_ref`) is measured by the same engine check and must fail it,
# which shows the check can tell them apart.

# %% nbgrader={"grade": true, "grade_id": "test_restore", "locked": true, "points": 6, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
### BEGIN HIDDEN TESTS
import random as _random

_rng = _random.Random(5003)
_g = torch.Generator().manual_seed(_rng.randrange(2 ** 31))
_n = _rng.randrange(20, 60)
_q, _k, _v = (torch.randn(1, 9, 64, generator=_g), torch.randn(1, 90, 3, 64, generator=_g),
              torch.randn(1, 90, 3, 64, generator=_g))
checks.equal(f"your attention on {_n} keys: bitwise the same padded to {_n} and to 90",
             torch.equal(invariant_decode_attention(_q, _k[:, :_n], _v[:, :_n],
                                                    torch.tensor([_n]), 0.125),
                         invariant_decode_attention(_q, _k, _v, torch.tensor([_n]), 0.125)),
             True)


def _fresh(n):
    _s = _rng.randrange(0, len(_text) - 1500)
    return tok.encode(_text[_s:_s + 1500])[:n]


_targets = [_fresh(6) for _ in range(2)]
_comps = [[_fresh(_rng.randrange(20, 35))],
          [_fresh(3), _fresh(_rng.randrange(25, 45))],
          [_fresh(_rng.randrange(8, 16)), _fresh(5), _fresh(_rng.randrange(30, 45))]]


def _check(stop_at_first_failure=False):
    """(all equal, worst max |dlogit| seen) over the targets and compositions."""
    ok, worst = True, 0.0
    for _t in _targets:
        _a = decode_logits(_t, [])
        for _c in _comps:
            _b = decode_logits(_t, _c)
            ok &= torch.equal(_a, _b)
            worst = max(worst, float((_a - _b).abs().max()))
            if stop_at_first_failure and not ok:
                return ok, worst
    return ok, worst


with llm.swap_step("attention.decode", invariant_decode_attention):
    _mine = _check()
with llm.swap_step("attention.decode", decode_attention_ref):  # the planted padded SDPA
    _bad = _check(stop_at_first_failure=True)
print(f"logits bitwise equal alone and in 3 compositions (2 fresh sequences): yours "
      f"{_mine[0]} (max |dlogit| {_mine[1]:.3g}), the padded SDPA {_bad[0]} "
      f"(max |dlogit| {_bad[1]:.3g})")
if _bad[0]:
    raise checks.CheckFailed("the check does not discriminate: the padded SDPA passes it")
checks.equal("torch.equal(logits alone, logits in a batch) for every fresh sequence and "
             "composition, with your attention", _mine[0], True)
### END HIDDEN TESTS
