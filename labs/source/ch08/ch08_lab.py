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
# # Lab 8: make a preempted request come back whole
#
# In chapter 8 a KV pool too small for the running requests forced the scheduler to
# preempt: it frees a request's blocks and later recomputes the request's prompt **and**
# the tokens it had already generated in one prefill (preemption by recompute, as vLLM
# v1 does). In float32 the correct engine gave every preempted request exactly the tokens
# of its unpreempted run, with seeded sampling and penalties too. Two planted bugs of the
# kind vLLM and vllm-gaudi shipped broke that: a resume that appends the generated tokens
# to a sequence that already holds them (vllm-gaudi PR #524; outputs cut short as in
# vllm #16832), and penalties that count the re-prefilled output as prompt (the review of
# vllm PR #5349), so frequency and presence penalties forget what was generated before
# the preemption.
#
# This lab starts from that **broken engine** (`broken()` below plants both bugs through
# the step registry). You write the two steps yourself:
#
# 1. `preempt(request)`: the `"scheduler.preempt"` step, what to reset and what to keep,
#    4 points;
# 2. `penalty_counts(prompt_ids, output_ids, vocab_size)`: what the penalties count,
#    3 points;
#
# then the restore check, 6 points: your two functions are swapped into the engine, fresh
# prompts with fresh seeds and penalties run on a pool that forces preemption, and every
# request must give exactly the tokens of its unpreempted run, next to the broken engine
# failing the same check;
#
# 3. `MAX_NUM_SEQS`: a decision for a bfloat16 deployment, where even a correct resume
#    is not exact, 2 points, measured by the engine.
#
# The grader calls your functions on **new** inputs and compares with the engine's
# reference. Run the cells in order. Do not edit the setup and test cells.

# %% nbgrader={"grade": false, "grade_id": "setup", "locked": true, "schema_version": 3, "solution": false, "task": false}
import contextlib
import copy
import importlib

import grading.checks as checks  # first import: records the original functions
import torch

from minivllm import LLM, SamplingParams
from minivllm.core.scheduler import preempt_request_ref
from minivllm.engine.request import Request, RequestStatus
from minivllm.layers.sampler import penalties_ref
from minivllm.precision import faults, metrics

MODEL = "smollm2-135m-instruct"
BS, BLOCKS = 8, 9  # 9 blocks x 8 tokens: with the shared chat prefix, two of these requests fit
llm = LLM(MODEL, dtype="float32", block_size=BS, max_model_len=72, num_gpu_blocks_override=BLOCKS)
tok = llm.get_tokenizer()
VOCAB = llm.llm_engine.model_config.vocab_size
ample = LLM(MODEL, dtype="float32", block_size=BS, max_model_len=72, num_gpu_blocks_override=64)


def chat(text: str) -> list:
    conv = [{"role": "user", "content": text}]
    return tok.encode(tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=True),
                      add_special_tokens=False)


def params(seed: int, n: int = 16) -> SamplingParams:
    """Seeded sampling with all three penalties, as in chapter 8."""
    return SamplingParams(temperature=1.0, seed=seed, max_tokens=n, ignore_eos=True,
                          repetition_penalty=1.2, frequency_penalty=1.0, presence_penalty=0.5)


def broken():
    """Both bugs of chapter 8, planted: ``with broken(): ...``. Outside the block the
    engine is correct."""
    preempt_bug, penalties_bug = faults.penalty_prompt_accounting_steps(
        llm, preempt=faults.preempt_double_append)
    stack = contextlib.ExitStack()
    stack.enter_context(llm.swap_step("scheduler.preempt", preempt_bug))
    stack.enter_context(llm.swap_step("sampler.penalties", penalties_bug))
    return stack


def run(prompts, seeds):
    """Generate all prompts together on the tight pool: (token lists, preemptions)."""
    before = llm.llm_engine.scheduler.num_preemptions
    outs = llm.generate(prompts, [params(s) for s in seeds])
    return [o.outputs[0].token_ids for o in outs], llm.llm_engine.scheduler.num_preemptions - before


def unpreempted(prompts, seeds):
    """The same batch on an engine with room for all of it (it never preempts), correct."""
    outs = ample.generate(prompts, [params(s) for s in seeds])
    assert ample.stats.num_preemptions == 0
    return [o.outputs[0].token_ids for o in outs]


example = [chat(f"Write a short story about {t}.") for t in ("a lighthouse", "a red kite", "an old clock")]
_want = unpreempted(example, [1, 2, 3])
with broken():
    _bad, _n = run(example, [1, 2, 3])
print(f"broken engine: {_n} preemptions; first divergence from the unpreempted runs: "
      f"{[metrics.first_divergence(a, b) for a, b in zip(_want, _bad)]}")
print("unpreempted :", tok.decode(_want[2]))
print("broken      :", tok.decode(_bad[2]))

# %% [markdown] nbgrader={"grade": false, "grade_id": "task1", "locked": true, "schema_version": 3, "solution": false, "task": false}
# ## Task 1: preempt a request (4 points)
#
# The scheduler has already freed the request's KV blocks when it calls this step. Your
# function gets the `Request` (see `minivllm/engine/request.py`) and changes it in place
# so that, when it is admitted again, the engine recomputes exactly the tokens it had:
#
# - reset: `num_computed_tokens` (no K/V is left) and `status`
#   (`RequestStatus.PREEMPTED`); count it: `num_preemptions` goes up by one;
# - keep: `all_token_ids` must be exactly `prompt_token_ids + output_token_ids` (it
#   already is: do not append the outputs again, do not drop them); `output_token_ids`,
#   the seeded `generator` (the same object, in the same state: a resumed request must
#   continue its random stream, not restart it), log-probs and the prefix-cache
#   `block_hashes` stay as they are.
#
# Return None. Do not call `preempt_request_ref`.

# %% nbgrader={"grade": false, "grade_id": "preempt", "locked": false, "schema_version": 3, "solution": true, "task": false}
def preempt(request) -> None:
    ### BEGIN SOLUTION
    request.status = RequestStatus.PREEMPTED
    request.num_computed_tokens = 0
    request.num_preemptions += 1
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "test_preempt_visible", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
_r = Request("v", [1, 2, 3], SamplingParams(max_tokens=8), max_model_len=64)
for _t in (7, 8):
    _r.append_output_token(_t)
_r.num_computed_tokens, _r.status = 4, RequestStatus.RUNNING
checks.equal("preempt(...) returns", preempt(_r), None)
checks.equal("all_token_ids after preempt", _r.all_token_ids, [1, 2, 3, 7, 8])
checks.equal("output_token_ids after preempt", _r.output_token_ids, [7, 8])
checks.equal("num_computed_tokens after preempt", _r.num_computed_tokens, 0)
checks.equal("status after preempt", _r.status, RequestStatus.PREEMPTED)
checks.equal("num_preemptions after preempt", _r.num_preemptions, 1)
print("visible test passed")

# %% nbgrader={"grade": true, "grade_id": "test_preempt_hidden", "locked": true, "points": 3, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
### BEGIN HIDDEN TESTS
_g = torch.Generator().manual_seed(8001)
for _case in range(6):
    _np, _no = int(torch.randint(1, 40, (), generator=_g)), int(torch.randint(0, 30, (), generator=_g))
    _prompt = torch.randint(0, VOCAB, (_np,), generator=_g).tolist()
    _outs = torch.randint(0, VOCAB, (_no,), generator=_g).tolist()
    _r = Request(f"h{_case}", _prompt, SamplingParams(max_tokens=64, seed=_case), max_model_len=256)
    for _t in _outs:
        _r.append_output_token(_t)
    _r.num_computed_tokens = max(_r.num_tokens - 1, 0)
    _r.status = RequestStatus.RUNNING
    _r.num_preemptions = int(torch.randint(0, 3, (), generator=_g))
    _r.block_hashes = [int(x) for x in torch.randint(0, 2 ** 30, (_r.num_tokens // 16,), generator=_g)]
    _r.generator = torch.Generator().manual_seed(_case)
    torch.empty(5).exponential_(generator=_r.generator)  # some draws already taken
    _gen, _state = _r.generator, _r.generator.get_state().clone()
    _ref = copy.deepcopy(_r)
    _ref.generator = None
    preempt_request_ref(_ref)  # the engine's reference, on a copy
    preempt(_r)
    _what = f"preempt on a request with {_np} prompt and {_no} output tokens"
    for _field in ("all_token_ids", "prompt_token_ids", "output_token_ids", "num_computed_tokens",
                   "status", "num_preemptions", "block_hashes"):
        checks.equal(f"{_what}: {_field}", getattr(_r, _field), getattr(_ref, _field))
    checks.equal(f"{_what}: the same generator object", _r.generator is _gen, True)
    checks.equal(f"{_what}: the generator's state unchanged",
                 torch.equal(_r.generator.get_state(), _state), True)
### END HIDDEN TESTS

# %% [markdown] nbgrader={"grade": false, "grade_id": "task2", "locked": true, "schema_version": 3, "solution": false, "task": false}
# ## Task 2: what the penalties count (3 points)
#
# vLLM's penalties (`layers/sampler.py:penalties_ref`): the **repetition** penalty
# applies to every token seen in the prompt **or** the output; **frequency** subtracts
# `frequency_penalty * count` where `count` is how often the token occurs in the
# **output** only, and **presence** subtracts `presence_penalty` once for every token
# present in the output. After a preemption the engine recomputes the output tokens in
# a prefill, but they are still output: they must be counted as output.
#
# Return `(seen, counts)`: `seen` a bool tensor `[vocab_size]`, True for tokens in the
# prompt or the output; `counts` a float32 tensor `[vocab_size]`, occurrences in the
# output. `prompt_ids` and `output_ids` are lists of ints (either may be empty).

# %% nbgrader={"grade": false, "grade_id": "penalty_counts", "locked": false, "schema_version": 3, "solution": true, "task": false}
def penalty_counts(prompt_ids: list, output_ids: list, vocab_size: int):
    ### BEGIN SOLUTION
    counts = torch.zeros(vocab_size, dtype=torch.float32)
    if output_ids:
        counts.index_add_(0, torch.tensor(output_ids, dtype=torch.int64),
                          torch.ones(len(output_ids)))
    seen = counts > 0
    if prompt_ids:
        seen[torch.tensor(prompt_ids, dtype=torch.int64)] = True
    return seen, counts
    ### END SOLUTION


# %% nbgrader={"grade": false, "grade_id": "penalties_step", "locked": true, "schema_version": 3, "solution": false, "task": false}
def penalties(logits, prompt_token_ids, output_token_ids, presence_penalty,
              frequency_penalty, repetition_penalty):
    """The "sampler.penalties" step built on your ``penalty_counts`` (same signature as
    ``penalties_ref``; do not edit)."""
    rows = [penalty_counts(list(p), list(o), logits.shape[1])
            for p, o in zip(prompt_token_ids, output_token_ids)]
    seen = torch.stack([s for s, _ in rows]).to(logits.device)
    counts = torch.stack([c for _, c in rows]).to(logits.device)
    logits = logits.clone()
    if repetition_penalty is not None:
        rp = repetition_penalty[:, None].expand_as(logits)
        logits = torch.where(seen, torch.where(logits > 0, logits / rp, logits * rp), logits)
    if frequency_penalty is not None:
        logits -= frequency_penalty[:, None] * counts
    if presence_penalty is not None:
        logits -= presence_penalty[:, None] * (counts > 0).float()
    return logits


# %% nbgrader={"grade": true, "grade_id": "test_penalty_counts_visible", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
_seen, _counts = penalty_counts([1, 2], [2, 5, 5], 8)
checks.equal("seen for prompt [1, 2], output [2, 5, 5]", _seen.tolist(),
             [False, True, True, False, False, True, False, False])
checks.equal("counts for prompt [1, 2], output [2, 5, 5]", _counts.tolist(),
             [0.0, 0.0, 1.0, 0.0, 0.0, 2.0, 0.0, 0.0])
checks.equal("counts dtype", _counts.dtype, torch.float32)
print("visible test passed")

# %% nbgrader={"grade": true, "grade_id": "test_penalty_counts_hidden", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
### BEGIN HIDDEN TESTS
_g = torch.Generator().manual_seed(8002)
_V = 50
_P, _O = [], []
for _case in range(6):
    _P.append(torch.randint(0, _V, (int(torch.randint(0, 20, (), generator=_g)),), generator=_g).tolist())
    _O.append(torch.randint(0, _V, (int(torch.randint(0, 20, (), generator=_g)),), generator=_g).tolist())
_logits = torch.randn(6, _V, generator=_g) * 3
_pp, _fp, _rp = torch.rand(6, generator=_g), torch.rand(6, generator=_g) * 2, 1 + torch.rand(6, generator=_g)
for _i in range(6):
    _s, _c = penalty_counts(list(_P[_i]), list(_O[_i]), _V)
    checks.equal(f"penalty_counts shapes ({len(_P[_i])} prompt, {len(_O[_i])} output ids)",
                 (tuple(_s.shape), tuple(_c.shape)), ((_V,), (_V,)))
_got = penalties(_logits, _P, _O, _pp, _fp, _rp)
_want = penalties_ref(_logits, _P, _O, _pp, _fp, _rp)
checks.equal("penalties built on your penalty_counts return a [6, 50] tensor",
             tuple(_got.shape), (6, _V))
checks.at_most("max |penalised logits - penalties_ref| (6 fresh rows, all three penalties)",
               float((_got - _want).abs().max()), 1e-5)
### END HIDDEN TESTS

# %% [markdown] nbgrader={"grade": false, "grade_id": "restore", "locked": true, "schema_version": 3, "solution": false, "task": false}
# ## Restore check (6 points)
#
# The grader swaps your `preempt` (`"scheduler.preempt"`) and `penalties` (built on your
# `penalty_counts`, `"sampler.penalties"`) into the engine, runs three fresh prompts with
# fresh seeds together on the 9-block pool (it must preempt), and compares each with
# its unpreempted run (the same batch on a correct engine with 64 blocks, which never
# preempts): every token must be equal (float32:
# recompute moves the logits at the noise floor, KL ~1e-11 nats in chapter 8). The
# broken engine runs the same prompts and must fail the same check.

# %% nbgrader={"grade": true, "grade_id": "test_restore", "locked": true, "points": 6, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
### BEGIN HIDDEN TESTS
import random as _random
_rng = _random.Random(8003)
_things = ["a glass bridge", "a tired owl", "the salt mine", "a copper kettle", "a snow fox",
           "the night train", "a paper boat", "a coral reef", "the wind mill", "a lost map"]
_fresh = [chat(f"Write a short story about {t}.") for t in _rng.sample(_things, 3)]
_seeds = [_rng.randrange(1000, 10 ** 6) for _ in _fresh]
_mine_ok = False
with llm.swap_step("scheduler.preempt", preempt), llm.swap_step("sampler.penalties", penalties):
    _mine, _n_mine = run(_fresh, _seeds)
_want = unpreempted(_fresh, _seeds)
with broken():
    _bad, _n_bad = run(_fresh, _seeds)
_div_mine = [metrics.first_divergence(a, b) for a, b in zip(_want, _mine)]
_div_bad = [metrics.first_divergence(a, b) for a, b in zip(_want, _bad)]
print(f"preemptions: yours {_n_mine}, broken {_n_bad}; first divergence from the unpreempted "
      f"runs: yours {_div_mine}, broken {_div_bad}")
if _n_mine == 0 or _n_bad == 0:
    raise checks.CheckFailed("the workload did not preempt: the check would prove nothing")
if _bad == _want:
    raise checks.CheckFailed("the check does not discriminate: the broken engine passes it")
for _i, (_a, _b) in enumerate(zip(_want, _mine)):
    checks.equal(f"tokens of fresh request {_i} (seed {_seeds[_i]}) under preemption, vs its "
                 f"unpreempted run", _b, _a)
### END HIDDEN TESTS


# %% [markdown] nbgrader={"grade": false, "grade_id": "task3", "locked": true, "schema_version": 3, "solution": false, "task": false}
# ## Task 3: no preemption in bfloat16 (2 points)
#
# Your two steps make a preempted request come back whole **in float32**. In bfloat16
# they cannot: the resumed request's K/V and logits come from a prefill over prompt +
# output, its unpreempted twin's from decodes, and in 8 significand bits the two round
# differently (chapter 8, section 4: a resumed request's tokens can change). A bfloat16
# deployment that must give a request the same tokens whether or not the server was busy
# therefore avoids preemption altogether. vLLM's documentation gives the knobs: more KV
# memory, or fewer requests at once (`max_num_seqs`, `max_num_batched_tokens`).
#
# The pool is fixed at `DEPLOY_BLOCKS` blocks of 8 tokens and the traffic is
# `DEPLOY_PROMPTS` (six chat prompts, 16 greedy tokens each, all arriving together).
# Choose `MAX_NUM_SEQS`, the **largest** number of requests running at once for which
# this traffic is served with no preemption: fewer would leave throughput on the table.
# Count blocks if you like (the setup's remark about two requests sharing the chat
# prefix is about its 9-block pool, and sharing depends on when requests are admitted),
# then measure: `preemptions_at(n)` below serves the traffic with `max_num_seqs=n` and
# returns the number of preemptions. (It runs in float32, because which request runs when does not
# depend on the dtype here: every request generates exactly 16 tokens, `ignore_eos`.)
#
# The grader serves the same traffic at `MAX_NUM_SEQS` (no preemption allowed) and at
# `MAX_NUM_SEQS + 1` (which must preempt, or a larger value would have done).

# %% nbgrader={"grade": false, "grade_id": "deploy_helper", "locked": true, "schema_version": 3, "solution": false, "task": false}
DEPLOY_BLOCKS = 24
DEPLOY_PROMPTS = [chat(f"Tell me about {t}.") for t in (
    "a lighthouse keeper who counts ships", "rain",
    "the first snow of a long winter in the mountains", "a cat",
    "two rivers that meet at a mill", "an old map")]


def preemptions_at(max_num_seqs: int) -> int:
    """Serve DEPLOY_PROMPTS (greedy, 16 tokens each, ignore_eos) on a fresh engine with
    DEPLOY_BLOCKS blocks of BS tokens and ``max_num_seqs``; return how many times the
    scheduler preempted a request (a few seconds)."""
    eng = LLM(MODEL, dtype="float32", block_size=BS, max_model_len=72,
              num_gpu_blocks_override=DEPLOY_BLOCKS, max_num_seqs=max_num_seqs)
    eng.generate(DEPLOY_PROMPTS, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
    return eng.stats.num_preemptions


print("prompt lengths:", [len(p) for p in DEPLOY_PROMPTS], "tokens; pool:", DEPLOY_BLOCKS,
      "blocks of", BS)

# %% nbgrader={"grade": false, "grade_id": "max_num_seqs", "locked": false, "schema_version": 3, "solution": true, "task": false}
MAX_NUM_SEQS = 6  # every request at once: where this task starts
### BEGIN SOLUTION
MAX_NUM_SEQS = 3
### END SOLUTION

# %% nbgrader={"grade": true, "grade_id": "test_max_num_seqs", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
### BEGIN HIDDEN TESTS
checks.equal(f"MAX_NUM_SEQS ({MAX_NUM_SEQS!r}) is an int from 1 to {len(DEPLOY_PROMPTS)}",
             isinstance(MAX_NUM_SEQS, int) and not isinstance(MAX_NUM_SEQS, bool)
             and 1 <= MAX_NUM_SEQS <= len(DEPLOY_PROMPTS), True)
_at = preemptions_at(MAX_NUM_SEQS)
_above = preemptions_at(MAX_NUM_SEQS + 1) if MAX_NUM_SEQS < len(DEPLOY_PROMPTS) else None
print(f"preemptions serving the traffic: max_num_seqs={MAX_NUM_SEQS}: {_at}; "
      f"max_num_seqs={MAX_NUM_SEQS + 1}: {_above}")
checks.equal(f"preemptions at max_num_seqs={MAX_NUM_SEQS}", _at, 0)
checks.equal(f"max_num_seqs={MAX_NUM_SEQS + 1} preempts (else a larger value would do)",
             _above is not None and _above > 0, True)
### END HIDDEN TESTS
