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
# # Lab 2: size the engine so a workload never preempts
#
# In chapter 2 a KV pool that was too small for the running requests forced preemptions
# (evict, then recompute). In float32 the recomputed requests came back with the same
# tokens, and chapter 8 measured why: recompute moves the logits by ~1e-11 nats. In
# bfloat16 it moves them by up to a few 1e-3 nats, about as much as a change of batch does, and in
# chapter 8's bfloat16 run (40 requests, 24 greedy tokens, `recompute_rates.json`) 1 of 7
# preempted requests but 15 of 33 **never**-preempted ones changed their tokens (their
# batch changed when others were preempted). A bfloat16 token check could not tell a
# preempting sizing from a batch that merely changed. What
# made vLLM's answers wrong under preemption was lost state. The engine build in this
# lab carries such a **preemption bug** (#16832: outputs wrong after a RECOMPUTE
# preemption; PR #5349, vllm-gaudi PR #524): a preempted request forgets the tokens it
# had generated, starts its answer again, and its output holds the first part twice. It
# is planted through the step registry (`faults.drop_outputs_on_resume`, the
# "scheduler.preempt" step); chapter 8 shows how to keep the state right. Here, the way to
# keep every answer right is a sizing that never preempts: a sizing that preempts loses
# the accuracy points below, because its answers change.
#
# You size the engine as vLLM does, from first principles: how many bytes a block costs,
# how many blocks a workload needs at worst, and, from a device's memory, the KV pool
# vLLM allocates and the most concurrency it holds with **zero** preemptions. The pool
# is what is left of the device after the weights and activations, so the seed course's
# advice (lower `gpu_memory_utilization` from 0.90 to 0.85 to "relieve memory pressure")
# shrinks it: the accuracy test runs your sizing at 0.90, then runs the seed's 0.85 pool
# with the same concurrency, which must fail.
#
# 1. `kv_bytes_per_block(...)`: 3 points;
# 2. `blocks_needed(prompt_lens, max_tokens, block_size, max_num_seqs)`: 3 points;
# 3. `size_engine(prompt_lens, max_tokens, block_size, total_memory_bytes,
#    gpu_memory_utilization, non_kv_bytes)`: 8 points (2 for the sizing, 6 for accuracy),
#    checked by running the buggy engine with your sizing on a workload you have not
#    seen: every answer must equal the answer of an engine with ample memory, with the
#    most concurrency the pool allows, and the seed's smaller pool must fail that check.
#
# Run the cells in order. Do not edit the setup and test cells.

# %% nbgrader={"grade": false, "grade_id": "setup", "locked": true, "schema_version": 3, "solution": false, "task": false}
import importlib
import math

import grading.checks as checks  # first import: records the original functions
import torch

from minivllm import LLM, SamplingParams
from minivllm.precision import faults

MODEL = "smollm2-135m-instruct"
PREEMPTION_BUG = faults.drop_outputs_on_resume  # planted in every engine the grader sizes
_ref_engine = LLM(MODEL, dtype="float32", num_gpu_blocks_override=512, max_model_len=1024)
CFG = _ref_engine.llm_engine.model_config  # num_layers, num_kv_heads, head_dim
tok = _ref_engine.get_tokenizer()
print(f"{CFG.num_layers} layers, {CFG.num_kv_heads} KV heads of dimension {CFG.head_dim}")


def make_workload(n: int, seed: int) -> list:
    """n chat prompts of different lengths (token ids)."""
    g = torch.Generator().manual_seed(seed)
    words = "paged attention stores keys and values in blocks of token slots".split()
    prompts = []
    for i in range(n):
        k = int(torch.randint(3, 40, (1,), generator=g))
        text = " ".join(words[int(j)] for j in torch.randint(0, len(words), (k,), generator=g))
        conv = [{"role": "user", "content": f"Repeat after me: {text}"}]
        prompts.append(tok.encode(tok.apply_chat_template(conv, tokenize=False,
                                                          add_generation_prompt=True),
                                  add_special_tokens=False))
    return prompts

# %% [markdown] nbgrader={"grade": false, "grade_id": "task1", "locked": true, "schema_version": 3, "solution": false, "task": false}
# ## Task 1: bytes per KV block (3 points)
#
# A block holds `block_size` token slots of **K and V**, for **every layer**, each slot
# `num_kv_heads * head_dim` elements of `bytes_per_element` bytes (4 for float32, 2 for
# float16/bfloat16, 1 for fp8).

# %% nbgrader={"grade": false, "grade_id": "kv_bytes", "locked": false, "schema_version": 3, "solution": true, "task": false}
def kv_bytes_per_block(num_layers: int, num_kv_heads: int, head_dim: int, block_size: int,
                       bytes_per_element: int) -> int:
    ### BEGIN SOLUTION
    return 2 * num_layers * block_size * num_kv_heads * head_dim * bytes_per_element
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "test_kv_bytes_visible", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
# SmolLM2-135M, 16-token blocks, float32: 2 * 30 * 16 * 3 * 64 * 4
checks.equal("kv_bytes_per_block(30, 3, 64, 16, 4)", kv_bytes_per_block(30, 3, 64, 16, 4), 737280)
print("visible test passed")

# %% nbgrader={"grade": true, "grade_id": "test_kv_bytes_hidden", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
### BEGIN HIDDEN TESTS
from minivllm.worker.model_runner import kv_cache_bytes_per_block as _ref_bytes

for _bs, _dt in ((16, torch.float16), (32, torch.float8_e4m3fn), (8, torch.bfloat16), (1, torch.float32)):
    _want = _ref_bytes(CFG, _bs, _dt)
    _got = kv_bytes_per_block(CFG.num_layers, CFG.num_kv_heads, CFG.head_dim, _bs,
                              torch.empty((), dtype=_dt).element_size())
    checks.equal(f"kv_bytes_per_block(block_size={_bs}, {_dt})", _got, _want)
checks.equal("kv_bytes_per_block(80, 8, 128, 16, 2) (a Llama-3-70B-shaped model)",
             kv_bytes_per_block(80, 8, 128, 16, 2), 2 * 80 * 16 * 8 * 128 * 2)
### END HIDDEN TESTS

# %% [markdown] nbgrader={"grade": false, "grade_id": "task2", "locked": true, "schema_version": 3, "solution": false, "task": false}
# ## Task 2: blocks needed at worst (3 points)
#
# Every request generates exactly `max_tokens` tokens, so at its end it holds
# `ceil((prompt_len + max_tokens) / block_size)` blocks. At most `max_num_seqs` requests
# run at once. Return the number of blocks that guarantees no preemption whichever
# requests happen to run together: the sum of the `max_num_seqs` largest per-request
# needs (all of them if there are fewer requests).

# %% nbgrader={"grade": false, "grade_id": "blocks_needed", "locked": false, "schema_version": 3, "solution": true, "task": false}
def blocks_needed(prompt_lens: list, max_tokens: int, block_size: int, max_num_seqs: int) -> int:
    ### BEGIN SOLUTION
    needs = sorted((math.ceil((n + max_tokens) / block_size) for n in prompt_lens), reverse=True)
    return sum(needs[:max_num_seqs])
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "test_blocks_visible", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
# needs: ceil(26/16)=2, ceil(40/16)=3, ceil(17/16)=2; two at once: 3 + 2
checks.equal("blocks_needed([10, 24, 1], 16, 16, 2)", blocks_needed([10, 24, 1], 16, 16, 2), 5)
checks.equal("blocks_needed([10, 24, 1], 16, 16, 8)", blocks_needed([10, 24, 1], 16, 16, 8), 7)
print("visible test passed")

# %% nbgrader={"grade": true, "grade_id": "test_blocks_hidden", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
### BEGIN HIDDEN TESTS
_g = torch.Generator().manual_seed(7)
for _case in range(5):
    _lens = torch.randint(1, 300, (int(torch.randint(1, 30, (1,), generator=_g)),), generator=_g).tolist()
    _mt, _bs, _ms = int(torch.randint(1, 200, (1,), generator=_g)), [1, 8, 16, 32, 16][_case], int(torch.randint(1, 12, (1,), generator=_g))
    _want = sum(sorted((-(-(n + _mt) // _bs) for n in _lens), reverse=True)[:_ms])
    checks.equal(f"blocks_needed({len(_lens)} prompts, max_tokens={_mt}, block_size={_bs}, "
                 f"max_num_seqs={_ms})", blocks_needed(_lens, _mt, _bs, _ms), _want)
# block sizes that are not powers of two, with lengths that fill whole blocks exactly: in
# floating point 273 * (1 / 91) is just above 3, so a ceil of it asks for a 4th block
checks.equal("blocks_needed([263, 536, 100], 10, 91, 3) (273 and 546 tokens fill exactly 3 "
             "and 6 blocks of 91)", blocks_needed([263, 536, 100], 10, 91, 3), 3 + 6 + 2)
checks.equal("blocks_needed([500], 25, 75, 1) (525 tokens: exactly 7 blocks of 75)",
             blocks_needed([500], 25, 75, 1), 7)
# the prompt list is the caller's: left as it was (the engine still needs its order)
_lens = [40, 3, 17, 200, 9]
_ = checks.call("blocks_needed(lens, 5, 16, 2)", blocks_needed, _lens, 5, 16, 2)
### END HIDDEN TESTS

# %% [markdown] nbgrader={"grade": false, "grade_id": "task3", "locked": true, "schema_version": 3, "solution": false, "task": false}
# ## Task 3: size the engine on a device (2 points, and 6 for accuracy)
#
# vLLM (v1, `Worker.determine_available_memory`) gives the KV cache what is left of the
# share of the device it may use: `ceil(total_memory_bytes * gpu_memory_utilization)`
# bytes (vLLM rounds this share **up**), less `non_kv_bytes` (weights, activation peak,
# memory outside PyTorch). The pool is every **whole** block (float32 KV cache) that
# fits in those bytes, and vLLM allocates all of it. Return
# `{"num_gpu_blocks_override": B, "max_num_seqs": S}`: `B` the number of blocks in that
# pool, `S` the **largest** concurrency (at most the number of prompts) whose worst-case
# need, `blocks_needed(...)`, fits in `B` blocks.
#
# Raise `ValueError` when `gpu_memory_utilization` is not in (0, 1], when nothing is left
# for the cache, or when not even one request fits. Do not change `prompt_lens`, and do
# not call `minivllm.engine.arg_utils.kv_cache_budget_bytes` (write the rule yourself).
#
# The grader runs the engine with your numbers and the preemption bug planted: it must
# not preempt and must give the same greedy tokens as an engine with ample memory. It
# then runs the pool that `gpu_memory_utilization=0.85` leaves, with the same
# `max_num_seqs`, and checks that it fails (so the check can tell a right sizing from a
# wrong one, and you see what the seed's advice does).

# %% nbgrader={"grade": false, "grade_id": "size_engine", "locked": false, "schema_version": 3, "solution": true, "task": false}
def size_engine(prompt_lens: list, max_tokens: int, block_size: int, total_memory_bytes: int,
                gpu_memory_utilization: float, non_kv_bytes: int) -> dict:
    ### BEGIN SOLUTION
    if not 0.0 < gpu_memory_utilization <= 1.0:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
    budget = math.ceil(total_memory_bytes * gpu_memory_utilization) - non_kv_bytes
    per_block = kv_bytes_per_block(CFG.num_layers, CFG.num_kv_heads, CFG.head_dim, block_size, 4)
    pool = budget // per_block  # 0 or negative when nothing is left: no request fits
    best = None
    for s in range(1, len(prompt_lens) + 1):
        if blocks_needed(prompt_lens, max_tokens, block_size, s) <= pool:
            best = {"num_gpu_blocks_override": pool, "max_num_seqs": s}
    if best is None:
        raise ValueError("the pool does not hold even one request")
    return best
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "test_size_visible", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
# a 10-block device (737,280 bytes a block) at 0.9: 9 blocks' bytes, less 3 for the
# weights: a pool of 6 blocks; needs 3, 2, 2: two requests at once need 5 <= 6
checks.equal("size_engine([10, 24, 1], 16, 16, 10 blocks of memory, 0.9, 3 blocks)",
             size_engine([10, 24, 1], 16, 16, 10 * 737280, 0.9, 3 * 737280),
             {"num_gpu_blocks_override": 6, "max_num_seqs": 2})
print("visible test passed")

# %% nbgrader={"grade": true, "grade_id": "test_size_hidden", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
### BEGIN HIDDEN TESTS
from minivllm.engine.arg_utils import kv_cache_budget_bytes as _budget_ref

_prompts = make_workload(10, seed=2024)
_lens = [len(p) for p in _prompts]
_mt, _bs = 12, 16
_per = 2 * CFG.num_layers * _bs * CFG.num_kv_heads * CFG.head_dim * 4
_needs = sorted((-(-(n + _mt) // _bs) for n in _lens), reverse=True)


def _want(total, util, non_kv, lens=_lens, mt=_mt, bs=_bs):
    per = 2 * CFG.num_layers * bs * CFG.num_kv_heads * CFG.head_dim * 4
    pool = _budget_ref(total, util, non_kv) // per
    needs = sorted((-(-(n + mt) // bs) for n in lens), reverse=True)
    s = max(k for k in range(1, len(lens) + 1) if sum(needs[:k]) <= pool)
    return {"num_gpu_blocks_override": pool, "max_num_seqs": s}


# pools exactly at a boundary (utilization 1: the budget is total - non_kv, to the byte):
# one request, four, all, and plenty (the pool is all of it); then one byte short
_nk = 5 * _per + 12345  # weights and activations: not a whole number of blocks
for _room in (_needs[0], sum(_needs[:4]), sum(_needs), sum(_needs) + 50):
    for _short in (0, 1):
        if _room == _needs[0] and _short:
            continue  # no request fits: the ValueError case below
        _total = _room * _per + _nk - _short
        checks.equal(f"size_engine(..., {'one byte short of ' if _short else ''}a pool of "
                     f"{_room} blocks at 1.0)",
                     size_engine(_lens, _mt, _bs, _total, 1.0, _nk), _want(_total, 1.0, _nk))
# the share is rounded up: total x 0.5 ends in half a byte, and that half byte completes
# the 7th block; rounding it down leaves 6
_nk = 3 * _per
_total = 2 * (7 * _per + _nk) - 1
checks.equal("size_engine(..., total x 0.5 = 7 blocks + weights - half a byte)",
             size_engine(_lens, _mt, _bs, _total, 0.5, _nk), _want(_total, 0.5, _nk))
# the seed's 0.85 against 0.90 on one device: a smaller pool, less concurrency
_total, _nk = 60 * _per, 34 * _per
for _u in (0.85, 0.9, 0.95, 1.0):
    checks.equal(f"size_engine(..., 60-block device, gpu_memory_utilization={_u}, 34 blocks "
                 f"of weights)", size_engine(_lens, _mt, _bs, _total, _u, _nk),
                 _want(_total, _u, _nk))
# another block size: 32-token blocks cost twice the bytes of 16-token ones
_per32 = 2 * CFG.num_layers * 32 * CFG.num_kv_heads * CFG.head_dim * 4
checks.equal("size_engine([10, 24, 1], 16, 32, exactly 2 blocks of 32 tokens left at 1.0)",
             size_engine([10, 24, 1], 16, 32, 2 * _per32 + 1000, 1.0, 1000),
             {"num_gpu_blocks_override": 2, "max_num_seqs": 1})
# a workload whose requests fill whole blocks (32, 48, 16, 64 tokens: 2, 3, 1, 4 blocks)
checks.equal("size_engine([20, 36, 4, 52], 12, 16, exactly 7 blocks left at 1.0)",
             size_engine([20, 36, 4, 52], 12, 16, 7 * _per, 1.0, 0),
             {"num_gpu_blocks_override": 7, "max_num_seqs": 2})
# the caller's list is left as it was (the engine still needs its order)
_ = checks.call("size_engine([10, 60, 24, 1, 33], 16, 16, 60-block device, 0.9, 34 blocks)",
                size_engine, [10, 60, 24, 1, 33], 16, 16, 60 * _per, 0.9, 34 * _per)
for _args, _why in (((_needs[0] * _per - 1, 1.0, 0), "one byte short of the largest request"),
                    ((60 * _per, 0.85, 51 * _per), "weights take the whole share"),
                    ((60 * _per, 0.85, 52 * _per), "weights take more than the share"),
                    ((60 * _per, 0.0, 0), "gpu_memory_utilization 0"),
                    ((60 * _per, 1.5, 0), "gpu_memory_utilization 1.5")):
    try:
        size_engine(_lens, _mt, _bs, *_args)
    except ValueError:
        pass
    else:
        raise checks.CheckFailed(f"size_engine must raise ValueError: {_why}")
checks.equal("size_engine on the unseen workload, 60-block device at 0.9",
             size_engine(_lens, _mt, _bs, 60 * _per, 0.9, 34 * _per), _want(60 * _per, 0.9, 34 * _per))
### END HIDDEN TESTS

# %% [markdown] nbgrader={"grade": false, "grade_id": "accuracy", "locked": true, "schema_version": 3, "solution": false, "task": false}
# ## Accuracy under your sizing (6 points)
#
# The grader sizes the engine with your `size_engine` for an unseen workload (10 prompts,
# 12 greedy tokens each) on a device scaled to it (memory for 64 blocks, most of it taken
# by weights and activations) at `gpu_memory_utilization=0.90`, runs it with the
# preemption bug planted, and compares every answer with an engine with ample memory. A
# sizing that preempts changes answers here and loses these points. To show that the
# check can fail, it then runs the pool that the seed's 0.85 leaves on the same device,
# with your `max_num_seqs`, which must fail it.

# %% nbgrader={"grade": true, "grade_id": "test_size_accuracy", "locked": true, "points": 6, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
### BEGIN HIDDEN TESTS
from minivllm.engine.arg_utils import kv_cache_budget_bytes as _budget_ref

_prompts = make_workload(10, seed=2024)
_lens = [len(p) for p in _prompts]
_mt, _bs = 12, 16
_per = 2 * CFG.num_layers * _bs * CFG.num_kv_heads * CFG.head_dim * 4
_needs = sorted((-(-(n + _mt) // _bs) for n in _lens), reverse=True)
_total = 64 * _per  # a device scaled to this workload
# weights and activations that leave a pool of the four largest needs + 3 blocks: four
# at once at worst, not five (the fifth largest needs more than 3); sized by the average
# request instead, five would seem to fit
_nk = math.ceil(0.9 * _total) - (sum(_needs[:4]) + 3) * _per
_pool90 = _budget_ref(_total, 0.9, _nk) // _per
_pool85 = _budget_ref(_total, 0.85, _nk) // _per
_cfg = size_engine(list(_lens), _mt, _bs, _total, 0.9, _nk)
_p = SamplingParams(temperature=0.0, max_tokens=_mt, ignore_eos=True)
_want = [o.outputs[0].token_ids for o in _ref_engine.generate(_prompts, _p)]


def _run_with_bug(cfg):
    """(preemptions, requests whose greedy tokens differ from the ample engine)"""
    e = LLM(MODEL, dtype="float32", block_size=_bs, max_model_len=128, **cfg)
    with PREEMPTION_BUG(e):
        got = [o.outputs[0].token_ids for o in e.generate(_prompts, _p)]
    return e.stats.num_preemptions, sum(a != b for a, b in zip(got, _want))


checks.equal("num_gpu_blocks_override: the whole pool that 0.90 leaves",
             _cfg.get("num_gpu_blocks_override"), _pool90)
_pre, _bad = _run_with_bug(_cfg)
_seed = dict(_cfg, num_gpu_blocks_override=_pool85)
_pre_seed, _bad_seed = _run_with_bug(_seed)
print(f"your sizing {_cfg}: {_pre} preemptions, {_bad} of {len(_prompts)} answers wrong; "
      f"the seed's 0.85 ({_pool85} blocks, same max_num_seqs): {_pre_seed} preemptions, "
      f"{_bad_seed} wrong")
if _bad_seed == 0:
    raise checks.CheckFailed("the check does not discriminate: the seed's smaller pool gave "
                             "every answer right")
checks.equal("requests whose greedy tokens differ from the ample-memory engine", _bad, 0)
checks.equal("preemptions with your sizing", _pre, 0)
_ = checks.equal("max_num_seqs: the most requests at once that this pool holds with no "
                 "preemption", _cfg["max_num_seqs"], 4)
### END HIDDEN TESTS
