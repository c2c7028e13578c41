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
# # Lab 20: the sampler's filters and penalties, in vLLM's order and accounting
#
# In chapter 20 two planted bugs changed what a seeded request samples: top-p applied
# before top-k (vllm #718, fixed by vllm PR #1885) and vllm-metal's penalty accounting
# before its PR #69 (the repetition penalty blind to the prompt on the first step,
# frequency and presence counting the prompt's tokens).
#
# This lab starts from that **broken engine** (`broken()` below plants both bugs through
# the step registry). You write the two steps yourself:
#
# 1. `apply_top_k_top_p(logits, k, p)`: the `"sampler.top_k_top_p"` step, 4 points;
# 2. `apply_penalties(logits, prompt_ids, output_ids, rep, freq, pres)`: the
#    `"sampler.penalties"` step, 3 points;
#
# then the restore check, 5 points: your two functions are swapped into the engine,
# four fresh prompts with fresh seeds run with top-k, top-p and all three penalties, and every
# request must give exactly the tokens of the reference sampler, next to the broken engine
# failing the same check.
#
# The grader calls your functions on **new** inputs (with ties) and compares with the
# engine's reference exactly. Run the cells in order. Do not edit the setup and test cells.

# %% nbgrader={"grade": false, "grade_id": "setup", "locked": true, "schema_version": 3, "solution": false, "task": false}
import contextlib

import grading.checks as checks  # first import: records the original functions
import torch

from minivllm import LLM, SamplingParams
from minivllm.layers import sampler as ref_sampler
from minivllm.precision import faults, metrics

MODEL = "smollm2-135m-instruct"
llm = LLM(MODEL, dtype="float32", max_model_len=128)
tok = llm.get_tokenizer()
VOCAB = llm.llm_engine.model_config.vocab_size


def chat(text: str) -> list:
    conv = [{"role": "user", "content": text}]
    return tok.encode(tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=True),
                      add_special_tokens=False)


def params(seed: int, n: int = 16) -> SamplingParams:
    """Seeded sampling with top-k, top-p and all three penalties."""
    return SamplingParams(temperature=1.0, top_k=5, top_p=0.6, seed=seed, max_tokens=n,
                          ignore_eos=True, repetition_penalty=1.3, frequency_penalty=1.0,
                          presence_penalty=1.0)


def broken():
    """Both bugs of chapter 20, planted: ``with broken(): ...``."""
    stack = contextlib.ExitStack()
    stack.enter_context(faults.top_p_before_top_k(llm))
    stack.enter_context(faults.penalty_accounting_mixed(llm))
    return stack


def run(prompts, seeds):
    """Generate all prompts together: one token list per prompt."""
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], [params(s) for s in seeds],
                        use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


example = [chat(t) for t in ("Describe a lighthouse at night.", "What is the capital of France?")]
_want = run(example, [1, 2])
with broken():
    _bad = run(example, [1, 2])
print("first divergence, broken vs reference:",
      [metrics.first_divergence(a, b) for a, b in zip(_want, _bad)])
print("reference:", tok.decode(_want[1]))
print("broken   :", tok.decode(_bad[1]))

# %% [markdown] nbgrader={"grade": false, "grade_id": "task1", "locked": true, "schema_version": 3, "solution": false, "task": false}
# ## Task 1: top-k, then top-p (4 points)
#
# `logits`: float32 `[B, V]` (already divided by the temperature); `k`: int64 `[B]` or
# None (a row's `k <= 0` or `k >= V` means no limit); `p`: float32 `[B]` or None (a row's
# `p = 1.0` means no limit). Return a new `[B, V]` tensor with the dropped tokens set to
# `-inf`, the kept ones unchanged:
#
# - **top-k first**: keep every logit `>=` the k-th largest (ties at the k-th are kept);
# - **then top-p** on the distribution renormalised over the survivors: sort the row
#   descending with `sort(dim=-1, descending=True, stable=True)` (equal logits in token-id
#   order), and drop a token when the probability mass of the tokens **before** it in
#   that order is `>= p`; the first token always survives.
#
# Do not call `minivllm.layers.sampler.apply_top_k_top_p`.

# %% nbgrader={"grade": false, "grade_id": "top_k_top_p", "locked": false, "schema_version": 3, "solution": true, "task": false}
def apply_top_k_top_p(logits, k, p):
    ### BEGIN SOLUTION
    if k is None and p is None:
        return logits.clone()
    V = logits.shape[1]
    s, order = logits.sort(dim=-1, descending=True, stable=True)
    if k is not None:
        kk = torch.where(k <= 0, torch.full_like(k, V), k.clamp(max=V))
        kth = s.gather(1, (kk - 1)[:, None])
        s = s.masked_fill(s < kth, float("-inf"))
    if p is not None:
        probs = torch.softmax(s, dim=-1)
        before = torch.cumsum(probs, dim=-1) - probs
        drop = (before >= p[:, None]) & (p[:, None] < 1.0)
        drop[:, 0] = False
        s = s.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, s)
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "test_top_k_top_p_visible", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
_out = apply_top_k_top_p(torch.tensor([[0.1, 0.2, 0.3, 0.4]]), torch.tensor([2]), torch.tensor([0.5]))
checks.equal("PR #1885's example, k=2, p=0.5: kept tokens", torch.isfinite(_out).tolist(),
             [[False, False, False, True]])
checks.equal("the kept logit is unchanged", float(_out[0, 3]), float(torch.tensor(0.4)))
print("visible test passed")

# %% nbgrader={"grade": true, "grade_id": "test_top_k_top_p_hidden", "locked": true, "points": 3, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
### BEGIN HIDDEN TESTS
_g = torch.Generator().manual_seed(20001)
_B, _V = 8, 60
_L = (torch.randn(_B, _V, generator=_g) * 2).round(decimals=1)  # rounded: many ties
_L[:, 7] = _L[:, 3]
_k = torch.randint(-1, _V + 3, (_B,), generator=_g)
_k[0], _k[1], _k[3] = 0, _V, _V + 2
_p = torch.rand(_B, generator=_g) * 0.9 + 0.05
_p[2] = 1.0
for _kk, _pp, _what in [(_k, _p, "k and p"), (_k, None, "k only"), (None, _p, "p only"),
                        (None, None, "neither")]:
    _args = (_L.clone(), None if _kk is None else _kk.clone(), None if _pp is None else _pp.clone())
    _got = apply_top_k_top_p(*_args)
    checks.equal(f"apply_top_k_top_p ({_what}): logits, k and p left unchanged",
                 [a is None or bool(torch.equal(a, b)) for a, b in zip(_args, (_L, _kk, _pp))],
                 [True, True, True])
    checks.equal(f"apply_top_k_top_p ({_what}): a new tensor, not the input logits",
                 _got.data_ptr() != _args[0].data_ptr(), True)
    _want = ref_sampler.apply_top_k_top_p(_L, _kk, _pp)
    checks.equal(f"apply_top_k_top_p shape ({_what})", tuple(_got.shape), (_B, _V))
    checks.equal(f"apply_top_k_top_p on 8 fresh rows with ties ({_what}): equal to the "
                 f"reference, bit for bit", torch.equal(_got, _want), True)
# the edges: 4 equal logits (0.25 each) and p = 0.5, so exactly p of the mass comes before
# the third token; k = 1; p = 1.0 where the tail's probabilities are so small that the mass
# before them rounds to exactly 1.0 (p = 1.0 is no limit, so all four stay)
_E = torch.tensor([[0.0, 0.0, 0.0, 0.0], [3.0, 1.0, 2.0, 0.5], [100.0, 0.0, -1.0, 0.0]])
_got = apply_top_k_top_p(_E.clone(), torch.tensor([0, 1, 0]), torch.tensor([0.5, 1.0, 1.0]))
checks.equal("kept tokens: [0]*4 with p = 0.5; k = 1; [100, 0, -1, 0] with p = 1.0",
             torch.isfinite(_got).tolist(),
             [[True, True, False, False], [True, False, False, False], [True, True, True, True]])
### END HIDDEN TESTS

# %% [markdown] nbgrader={"grade": false, "grade_id": "task2", "locked": true, "schema_version": 3, "solution": false, "task": false}
# ## Task 2: the penalties (3 points)
#
# `logits`: float32 `[B, V]` (raw, before temperature); `prompt_ids`, `output_ids`: per
# row, lists of ints (either may be empty); `rep`, `freq`, `pres`: float32 `[B]` or None
# (None: no row uses it). Return a new `[B, V]` tensor, in this order:
#
# 1. **repetition** (CTRL): for every token seen in the row's prompt **or** output,
#    divide a positive logit by `rep`, multiply a non-positive one by `rep`;
# 2. **frequency**: subtract `freq * count`, `count` = occurrences in the **output** only;
# 3. **presence**: subtract `pres` once for every token present in the **output** only.
#
# Do not call `minivllm.layers.sampler.penalties_ref`.

# %% nbgrader={"grade": false, "grade_id": "penalties", "locked": false, "schema_version": 3, "solution": true, "task": false}
def apply_penalties(logits, prompt_ids, output_ids, rep, freq, pres):
    ### BEGIN SOLUTION
    B, V = logits.shape
    out = logits.clone()
    counts = torch.zeros(B, V)
    seen = torch.zeros(B, V, dtype=torch.bool)
    for r in range(B):
        if output_ids[r]:
            counts[r].index_add_(0, torch.tensor(list(output_ids[r]), dtype=torch.int64),
                                 torch.ones(len(output_ids[r])))
        if prompt_ids[r]:
            seen[r, torch.tensor(list(prompt_ids[r]), dtype=torch.int64)] = True
    seen |= counts > 0
    if rep is not None:
        r_ = rep[:, None].expand_as(out)
        out = torch.where(seen, torch.where(out > 0, out / r_, out * r_), out)
    if freq is not None:
        out -= freq[:, None] * counts
    if pres is not None:
        out -= pres[:, None] * (counts > 0).float()
    return out
    ### END SOLUTION


# %% nbgrader={"grade": false, "grade_id": "penalties_step", "locked": true, "schema_version": 3, "solution": false, "task": false}
def penalties_step(logits, prompt_token_ids, output_token_ids, presence_penalty,
                   frequency_penalty, repetition_penalty):
    """The "sampler.penalties" step's signature around your ``apply_penalties`` (do not edit)."""
    return apply_penalties(logits, [list(x) for x in prompt_token_ids],
                           [list(x) for x in output_token_ids], repetition_penalty,
                           frequency_penalty, presence_penalty)


# %% nbgrader={"grade": true, "grade_id": "test_penalties_visible", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
_l = torch.tensor([[2.0, -1.0, 0.5, 1.0]])
_o = torch.ones(1)
checks.equal("repetition 2 on prompt [0, 1], no output yet",
             apply_penalties(_l, [[0, 1]], [[]], 2 * _o, None, None).tolist(), [[1.0, -2.0, 0.5, 1.0]])
checks.equal("frequency 0.5 and presence 0.25, prompt [0, 1], output [3, 3]",
             apply_penalties(_l, [[0, 1]], [[3, 3]], None, 0.5 * _o, 0.25 * _o).tolist(),
             [[2.0, -1.0, 0.5, -0.25]])
print("visible test passed")

# %% nbgrader={"grade": true, "grade_id": "test_penalties_hidden", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
### BEGIN HIDDEN TESTS
_g = torch.Generator().manual_seed(20002)
_B, _V = 6, 50
_P = [torch.randint(0, _V, (int(torch.randint(0, 15, (), generator=_g)),), generator=_g).tolist() for _ in range(_B)]
_O = [torch.randint(0, _V, (int(torch.randint(0, 15, (), generator=_g)),), generator=_g).tolist() for _ in range(_B)]
_O[0] = []
_L = torch.randn(_B, _V, generator=_g) * 3
_pp, _fp, _rp = torch.rand(_B, generator=_g), torch.rand(_B, generator=_g) * 2, 1 + torch.rand(_B, generator=_g)
for _args, _what in [((_rp, _fp, _pp), "all three"), ((_rp, None, None), "repetition only"),
                     ((None, _fp, _pp), "frequency and presence")]:
    _Lin = _L.clone()
    _got = apply_penalties(_Lin, [list(x) for x in _P], [list(x) for x in _O], *_args)
    checks.equal(f"apply_penalties ({_what}): the input logits left unchanged",
                 bool(torch.equal(_Lin, _L)), True)
    _want = ref_sampler.penalties_ref(_L, _P, _O, _args[2], _args[1], _args[0])
    checks.equal(f"apply_penalties shape ({_what})", tuple(_got.shape), (_B, _V))
    checks.at_most(f"max |apply_penalties - penalties_ref| (6 fresh rows, {_what})",
                   float((_got - _want).abs().max()), 1e-5)
### END HIDDEN TESTS

# %% [markdown] nbgrader={"grade": false, "grade_id": "restore", "locked": true, "schema_version": 3, "solution": false, "task": false}
# ## Restore check (5 points)
#
# The grader swaps your `apply_top_k_top_p` (`"sampler.top_k_top_p"`) and `apply_penalties`
# (through `penalties_step`, `"sampler.penalties"`) into the engine, runs four fresh
# prompts with fresh seeds together (16 tokens each, top_k 5, top_p 0.6, all three
# penalties), and compares each with the reference sampler's run:
# every token must be equal (the same float32 arithmetic gives the same race). The broken
# engine runs the same prompts and must fail the same check.

# %% nbgrader={"grade": true, "grade_id": "test_restore", "locked": true, "points": 5, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
### BEGIN HIDDEN TESTS
import random as _random
_rng = _random.Random(20003)
_things = ["a glass bridge", "a tired owl", "the salt mine", "a copper kettle", "a snow fox",
           "the night train", "a paper boat", "a coral reef", "the wind mill", "a lost map"]
_fresh = [chat(f"Write a short story about {t}.") for t in _rng.sample(_things, 4)]
_seeds = [_rng.randrange(1000, 10 ** 6) for _ in _fresh]
with llm.swap_step("sampler.top_k_top_p", apply_top_k_top_p), \
        llm.swap_step("sampler.penalties", penalties_step):
    _mine = run(_fresh, _seeds)
_want = run(_fresh, _seeds)
with broken():
    _bad = run(_fresh, _seeds)
print("first divergence from the reference sampler: yours",
      [metrics.first_divergence(a, b) for a, b in zip(_want, _mine)], "broken",
      [metrics.first_divergence(a, b) for a, b in zip(_want, _bad)])
if _bad == _want:
    raise checks.CheckFailed("the check does not discriminate: the broken engine passes it")
for _i, (_a, _b) in enumerate(zip(_want, _mine)):
    checks.equal(f"tokens of fresh request {_i} (seed {_seeds[_i]}) with your sampler steps, "
                 f"vs the reference sampler", _b, _a)
### END HIDDEN TESTS
