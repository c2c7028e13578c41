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
# # Lab 23: repair chunked prefill
#
# In chapter 23 a correct chunked prefill changed the float32 logits only in the last
# bits, while two wrong ones changed what the model saw: a key length taken from the whole
# sequence (`seqlen_k = num_tokens`, nano-vllm PR #213) read slots not written yet, and
# chunks that ignored earlier chunks (kekzl/imp PRs #114/#117) lost the pass key. This lab
# starts from that **broken engine**: prompts are prefilled in 16-token chunks
# (`max_num_batched_tokens=16`, `enable_chunked_prefill=True`) and the setup cell plants
# the no-past-chunks fault through the step registry (`faults.chunk_no_past_kv`).
#
# You write two functions. The grader calls them on **new** inputs and compares them
# exactly with the engine, then plugs your `chunk_mask_and_slots` into the engine as its
# `"prefill_chunk"` step on fresh passkey prompts:
#
# 1. `chunk_schedule(num_tokens, budget)`: the chunks the scheduler makes, 3 points;
# 2. `chunk_mask_and_slots(block_table, start, n, block_size, num_tokens)`: what one
#    chunk reads and its mask (the step itself), 4 points;
#    then the restore check, 5 points.
#
# Run the cells in order. Do not edit the setup and test cells.

# %% nbgrader={"grade": false, "grade_id": "setup", "locked": true, "schema_version": 3, "solution": false, "task": false}
import contextlib
import dataclasses

import grading.checks as checks  # first import: records the original functions
import torch

from minivllm import LLM, SamplingParams
from minivllm.attention.metadata import prefill_chunk_ref
from minivllm.precision import evalsets, faults
from minivllm.tokenizer import render_chat_ref

torch.manual_seed(0)
MODEL = "smollm2-135m-instruct"
CHUNK = 16
llm = LLM(MODEL, dtype="float32", max_model_len=320, max_num_batched_tokens=CHUNK,
          enable_chunked_prefill=True)
tok = llm.get_tokenizer()
_text = evalsets.load_corpus()


@contextlib.contextmanager
def budget(max_num_batched_tokens: int):
    """Run the block with another token budget per step (``budget(320)``: one step for
    any prompt here, i.e. unchunked)."""
    sch = llm.llm_engine.scheduler
    old = sch.config
    sch.config = dataclasses.replace(old, max_num_batched_tokens=max_num_batched_tokens)
    try:
        yield
    finally:
        sch.config = old


def broken():
    """The fault of this lab: every prefill chunk attends only to itself. Use it as
    ``with broken(): ...``; outside the block the engine is correct."""
    return faults.chunk_no_past_kv(llm)


example = [it for it in evalsets.load_passkey() if it.num_tokens == 243][0]
example_ids = render_chat_ref(tok, [{"role": "user", "content": example.prompt}])
greedy = SamplingParams(temperature=0, max_tokens=12)
with broken():
    _bad = llm.generate([example_ids], greedy)[0].outputs[0].text
print(f"example: a {len(example_ids)}-token passkey prompt (key {example.passkey}) in "
      f"{CHUNK}-token chunks")
print(f"the broken engine answers {_bad!r}; the unchunked reference answered "
      f"{example.reference_output!r}")

# %% [markdown] nbgrader={"grade": false, "grade_id": "task1", "locked": true, "schema_version": 3, "solution": false, "task": false}
# ## Task 1: the chunks of a prompt (3 points)
#
# A request of `num_tokens` prompt tokens (an `int >= 1`) arrives alone at an engine with
# `enable_chunked_prefill=True` and a token budget `budget = max_num_batched_tokens` (an
# `int >= 1`) per step; nothing of it is in the prefix cache. Return the chunks the
# scheduler gives it, in order, as a list of `(start, n)` tuples of ints: the chunk
# computes positions `start .. start + n - 1`. (Read `Scheduler.schedule` in
# `minivllm/core/scheduler.py` if you are unsure; vLLM's v1 scheduler does the same.)
# Raise `ValueError` for `num_tokens < 1` or `budget < 1`.

# %% nbgrader={"grade": false, "grade_id": "chunk_schedule", "locked": false, "schema_version": 3, "solution": true, "task": false}
def chunk_schedule(num_tokens: int, budget: int) -> list:
    ### BEGIN SOLUTION
    if num_tokens < 1 or budget < 1:
        raise ValueError(f"need num_tokens >= 1 and budget >= 1, got {num_tokens}, {budget}")
    return [(start, min(budget, num_tokens - start)) for start in range(0, num_tokens, budget)]
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "test_chunk_schedule_visible", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
checks.equal("chunk_schedule(300, 64)", chunk_schedule(300, 64),
             [(0, 64), (64, 64), (128, 64), (192, 64), (256, 44)])
checks.equal("chunk_schedule(10, 16)", chunk_schedule(10, 16), [(0, 10)])
checks.equal("chunk_schedule(32, 16)", chunk_schedule(32, 16), [(0, 16), (16, 16)])
print("visible test passed")

# %% nbgrader={"grade": true, "grade_id": "test_chunk_schedule_hidden", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
### BEGIN HIDDEN TESTS
import random as _random

from minivllm.config import SchedulerConfig
from minivllm.core.kv_cache_manager import KVCacheManager
from minivllm.core.scheduler import Scheduler
from minivllm.engine.request import Request

_rng = _random.Random(23001)
_cases = [(1, 1), (1, 7), (5, 1), (17, 16), (64, 64), (65, 64)] + \
    [(_rng.randrange(1, 3000), _rng.randrange(1, 700)) for _ in range(12)]
_got = {c: chunk_schedule(*c) for c in _cases}  # yours first


def _engine_chunks(num_tokens, budget_):
    """The engine's scheduler alone (no model): schedule, count as computed, repeat."""
    kv = KVCacheManager(num_blocks=num_tokens // 16 + 2, block_size=16)
    sch = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=budget_,
                                    max_model_len=num_tokens + 1,
                                    enable_chunked_prefill=True), kv)
    req = Request("r", [1] * num_tokens, SamplingParams(max_tokens=1),
                  max_model_len=num_tokens + 1)
    sch.add_request(req)
    out = []
    while req.num_computed_tokens < num_tokens:
        step = sch.schedule()
        ((r, n),) = step.scheduled
        out.append((r.num_computed_tokens, n))
        sch.update_after_step(step.scheduled)
    return out


for (_n, _b), _mine in _got.items():
    checks.equal(f"chunk_schedule({_n}, {_b}) is a list of (int, int) tuples",
                 isinstance(_mine, list) and all(isinstance(c, tuple) and len(c) == 2 and
                                                 all(type(v) is int for v in c) for c in _mine),
                 True)
    checks.equal(f"chunk_schedule({_n}, {_b}) equal to the engine's chunks", _mine,
                 _engine_chunks(_n, _b))
for _bad in ((0, 16), (10, 0), (-3, 4)):
    try:
        chunk_schedule(*_bad)
        _raised = False
    except ValueError:
        _raised = True
    checks.equal(f"chunk_schedule{_bad} raises ValueError", _raised, True)
### END HIDDEN TESTS

# %% [markdown] nbgrader={"grade": false, "grade_id": "task2", "locked": true, "schema_version": 3, "solution": false, "task": false}
# ## Task 2: what a chunk reads, and its mask (4 points)
#
# Write the engine's `"prefill_chunk"` step. A chunk computes positions `start .. start +
# n - 1` of a request of `num_tokens` tokens; positions `0 .. start - 1` are already in the
# cache (earlier chunks), positions `>= start + n` are not written yet. Arguments:
#
# - `block_table`: 1-D int64 tensor, the request's physical blocks (entry `j` holds
#   positions `j * block_size .. (j + 1) * block_size - 1`; it may hold more blocks than
#   this chunk needs);
# - `start` (`int >= 0`), `n` (`int >= 1`), `block_size` (`int >= 1`), `num_tokens`
#   (`int >= start + n`, the request's whole length).
#
# Return `(kv_slots, mask)`:
#
# - `kv_slots`: int64 tensor `[start + n]`, the cache slot of every key the chunk attends
#   to, in position order (slot = physical block times `block_size` plus the offset in the
#   block);
# - `mask`: bool tensor `[n, start + n]`, `mask[i, j]` True when the chunk's query `i`
#   (position `start + i`) may attend to key `j`.
#
# Do not call the reference (`prefill_chunk_ref`): that would pass and teach nothing.

# %% nbgrader={"grade": false, "grade_id": "chunk_mask_and_slots", "locked": false, "schema_version": 3, "solution": true, "task": false}
def chunk_mask_and_slots(block_table: torch.Tensor, start: int, n: int, block_size: int,
                         num_tokens: int):
    ### BEGIN SOLUTION
    seq_len = start + n  # seqlen_k: the keys so far, never num_tokens
    pos = torch.arange(seq_len, dtype=torch.int64)
    kv_slots = block_table[pos // block_size] * block_size + pos % block_size
    q_pos = start + torch.arange(n)
    mask = pos[None, :] <= q_pos[:, None]
    return kv_slots, mask
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "test_chunk_mask_and_slots_visible", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
_slots, _mask = chunk_mask_and_slots(torch.tensor([3, 1, 6]), 5, 3, 4, 10)
checks.equal("kv_slots dtype", _slots.dtype, torch.int64)
checks.equal("kv_slots for table [3, 1, 6], block size 4, start 5, n 3", _slots.tolist(),
             [12, 13, 14, 15, 4, 5, 6, 7])
checks.equal("mask dtype", _mask.dtype, torch.bool)
checks.equal("mask", _mask.int().tolist(), [[1, 1, 1, 1, 1, 1, 0, 0],
                                            [1, 1, 1, 1, 1, 1, 1, 0],
                                            [1, 1, 1, 1, 1, 1, 1, 1]])
print("visible test passed")

# %% nbgrader={"grade": true, "grade_id": "test_chunk_mask_and_slots_hidden", "locked": true, "points": 3, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
### BEGIN HIDDEN TESTS
_g = torch.Generator().manual_seed(23002)
for _bs in (1, 4, 16, 32):
    for _ in range(3):
        _start = int(torch.randint(0, 200, (), generator=_g))
        _n = int(torch.randint(1, 70, (), generator=_g))
        _total = _start + _n + int(torch.randint(0, 300, (), generator=_g))
        _nb = -(-(_start + _n) // _bs) + int(torch.randint(0, 3, (), generator=_g))
        _table = torch.randperm(4096, generator=_g)[:_nb]  # non-contiguous, some ahead
        _got = chunk_mask_and_slots(_table, _start, _n, _bs, _total)
        _want = prefill_chunk_ref(_table, _start, _n, _bs, _total)
        _tag = f"(block size {_bs}, start {_start}, n {_n}, num_tokens {_total})"
        checks.equal(f"returns (kv_slots, mask) {_tag}",
                     isinstance(_got, tuple) and len(_got) == 2, True)
        checks.equal(f"kv_slots equal to the engine's {_tag}",
                     _got[0].dtype == torch.int64 and torch.equal(_got[0], _want[0]), True)
        checks.equal(f"mask equal to the engine's {_tag}",
                     _got[1].dtype == torch.bool and torch.equal(_got[1], _want[1]), True)
# the first chunk (start 0) and a whole prompt in one chunk
for _start, _n, _total in ((0, 16, 100), (0, 37, 37)):
    _table = torch.randperm(64, generator=_g)[:4]
    _got = chunk_mask_and_slots(_table, _start, _n, 16, _total)
    _want = prefill_chunk_ref(_table, _start, _n, 16, _total)
    checks.equal(f"start {_start}, n {_n}, num_tokens {_total}: equal to the engine's",
                 torch.equal(_got[0], _want[0]) and torch.equal(_got[1], _want[1]), True)
### END HIDDEN TESTS

# %% [markdown] nbgrader={"grade": false, "grade_id": "restore", "locked": true, "schema_version": 3, "solution": false, "task": false}
# ## Restore check (5 points)
#
# The grader plugs your `chunk_mask_and_slots` into the engine
# (`llm.swap_step("prefill_chunk", chunk_mask_and_slots)`) and runs, in 16-token chunks:
#
# - a fresh 243-token passkey prompt (a new random key in one of the passkey items) whose
#   key the unchunked engine finds: your greedy tokens must equal the unchunked engine's,
#   and contain the key;
# - a fresh corpus sequence of 48 tokens, teacher-forced: your logits must equal the
#   correct chunked engine's bit for bit (the right slots and mask give the very same
#   attention call).
#
# Both planted bugs (`faults.chunk_seqlen_k_full`, `faults.chunk_no_past_kv`) are measured
# by the same check and must fail it, which shows the check can tell them apart.

# %% nbgrader={"grade": true, "grade_id": "test_restore", "locked": true, "points": 5, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
### BEGIN HIDDEN TESTS
import random as _random

_rng = _random.Random(23003)
_probe = chunk_mask_and_slots(torch.arange(4), 16, 16, 16, 64)  # fails fast if unfinished
checks.equal("chunk_mask_and_slots returns a pair", isinstance(_probe, tuple) and
             len(_probe) == 2, True)
_s = _rng.randrange(0, len(_text) - 800)
_seq = tok.encode(_text[_s:_s + 800])[:48]
_items = [it for it in evalsets.load_passkey() if it.num_tokens == 243]
_cands = []
for _ in range(4):
    _it = _rng.choice(_items)
    _key = str(_rng.randrange(10000, 100000))
    _cands.append((_key, render_chat_ref(tok, [{"role": "user", "content":
                                                _it.prompt.replace(_it.passkey, _key)}])))


def _run(key, ids):
    out = llm.generate([ids], greedy)[0].outputs[0]
    return out.token_ids, evalsets.passkey_correct(out.text, key), out.text


with llm.swap_step("prefill_chunk", chunk_mask_and_slots):  # yours, first
    _mine_rows = llm.score(_seq, output="logits")
    _mine = [_run(k, ids) for k, ids in _cands[:1]]
_ref_rows = llm.score(_seq, output="logits")  # the correct chunked engine
with budget(320):  # unchunked; a fresh prompt whose key the unchunked engine finds
    _refs = [_run(*_cands[0])]
    _i = 0
    while not _refs[-1][1] and _i + 1 < len(_cands):
        _i += 1
        _refs.append(_run(*_cands[_i]))
if _i > 0:  # the first prompt was not answered unchunked: run yours on the one that was
    with llm.swap_step("prefill_chunk", chunk_mask_and_slots):
        _mine = [_run(*_cands[_i])]
_key, _ids = _cands[_i]
if not _refs[-1][1]:
    raise RuntimeError("no fresh passkey prompt the unchunked engine answers (4 tried)")


def _check(rows, run):
    return torch.equal(rows, _ref_rows) and run[0] == _refs[-1][0] and run[1]


_bugs = {}
for _name, _plant in (("seqlen_k = full length", faults.chunk_seqlen_k_full),
                      ("no past chunks", faults.chunk_no_past_kv)):
    with _plant(llm):
        _bugs[_name] = (llm.score(_seq, output="logits"), _run(_key, _ids))
print(f"fresh passkey prompt: {len(_ids)} tokens, key {_key}; unchunked answer "
      f"{_refs[-1][2]!r}")
print(f"yours: {_mine[0][2]!r}; " + "; ".join(f"{k}: {v[1][2]!r}" for k, v in _bugs.items()))
print(f"check passed: yours {_check(_mine_rows, _mine[0])}, " +
      ", ".join(f"{k} {_check(*v)}" for k, v in _bugs.items()))
for _name, _v in _bugs.items():
    if _check(*_v):
        raise checks.CheckFailed(f"the check does not discriminate: the bug '{_name}' passes")
checks.equal("teacher-forced logits (48 fresh tokens, 16-token chunks) equal to the correct "
             "chunked engine's", torch.equal(_mine_rows, _ref_rows), True)
checks.equal("greedy tokens in 16-token chunks equal to the unchunked engine's",
             _mine[0][0], _refs[-1][0])
checks.equal(f"the pass key {_key} found in 16-token chunks", _mine[0][1], True)
### END HIDDEN TESTS
