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
# # Lab 25: shard a model for tensor parallelism, and make its all-reduce reproducible
#
# In chapter 25 the emulated tp = 3 engine with the **contiguous** `gate_up` layout of
# vllm #3775 (the fused `[gate; up]` weight cut into three contiguous pieces) moved KL
# against tp = 1 by tens of nats in float32, while the right layout stayed at float32's
# noise floor. An all-reduce whose order changes from call to call (the chapter's
# arrival-order thought experiment, standing for an algorithm chosen by message size)
# gave different bits from run to run, vllm #2742's symptom. This lab starts from that
# **broken configuration**:
# `minivllm.parallel.emulated_tp.shard_contiguous` and an arrival-order sum. You write
# the three functions the emulation takes (`emulate_tensor_parallel(llm, tp,
# shard_qkv_fn=..., shard_merged_column_fn=..., all_reduce_fn=...)`).
#
# The grader calls your functions on **new** shapes and compares them with the engine's
# shards exactly; the last test plugs all three into the emulated tp = 3 engine on text
# you have not seen, with partials arriving in random orders, next to the broken
# configuration failing the same check.
#
# 1. `shard_qkv(w, rank, tp, num_heads, num_kv_heads, head_dim)`: 3 points;
# 2. `shard_merged_column(w, sizes, rank, tp)`: 2 points;
# 3. `all_reduce_fixed_order(partials)`: 2 points;
#    then the restore check, 5 points.
#
# Run the cells in order. Do not edit the setup and test cells.

# %% nbgrader={"grade": false, "grade_id": "setup", "locked": true, "schema_version": 3, "solution": false, "task": false}
import importlib

import grading.checks as checks  # first import: records the original functions
import torch

from minivllm import LLM
from minivllm.parallel import emulated_tp
from minivllm.parallel.emulated_tp import emulate_tensor_parallel, shard_contiguous
from minivllm.precision import evalsets, metrics

torch.manual_seed(0)
MODEL = "smollm2-135m-instruct"
_engine = {}


def engine():
    """The float32 embedded model, built on first use (the tests that need it call this)."""
    if "llm" not in _engine:
        _engine["llm"] = LLM(MODEL, dtype="float32", max_model_len=256,
                             num_gpu_blocks_override=24, enable_prefix_caching=False)
    return _engine["llm"]


def arrival_order_sum(partials):
    """The broken all-reduce: partials (a list of (rank, tensor) in arrival order) added
    in the order they arrived."""
    out = partials[0][1].clone()
    for _, p in partials[1:]:
        out = out + p
    return out


# The broken layout, on a labelled fused gate_up weight (gate rows 0..5, up rows 100..105)
_w = torch.cat([torch.arange(6), 100 + torch.arange(6)]).float()[:, None]
for _r in range(3):
    print(f"contiguous shard, rank {_r}: rows {shard_contiguous(_w, [6, 6], _r, 3)[:, 0].int().tolist()}")
print("rank 0 multiplies silu(gate 0, 1) by gate 2, 3: not a unit the model learned")

# %% [markdown] nbgrader={"grade": false, "grade_id": "task1", "locked": true, "schema_version": 3, "solution": false, "task": false}
# ## Task 1: the QKV shard (3 points)
#
# `w` is a fused QKV weight `[(num_heads + 2 * num_kv_heads) * head_dim, in_features]`:
# the Q rows of every query head (head 0's `head_dim` rows first), then the K rows of every
# KV head, then the V rows. Return rank `rank`'s rows (vLLM's `QKVParallelLinear`, a
# 2-D tensor, same dtype), stacked as: its `num_heads / tp` query heads (rank r holds the
# r-th consecutive group), then its K rows, then its V rows.
#
# KV heads: when `num_kv_heads >= tp`, rank r holds the r-th consecutive group of
# `num_kv_heads / tp` KV heads. When `num_kv_heads < tp`, each KV head is **replicated**
# on `tp / num_kv_heads` consecutive ranks: ranks 0 .. tp/num_kv_heads - 1 hold KV head 0,
# the next ones KV head 1, and so on (each rank holds one KV head). You may assume the
# sizes divide as vLLM's checks require.

# %% nbgrader={"grade": false, "grade_id": "shard_qkv", "locked": false, "schema_version": 3, "solution": true, "task": false}
def shard_qkv(w: torch.Tensor, rank: int, tp: int, num_heads: int, num_kv_heads: int,
              head_dim: int) -> torch.Tensor:
    ### BEGIN SOLUTION
    q_rows, kv_rows = num_heads * head_dim, num_kv_heads * head_dim
    q, k, v = w[:q_rows], w[q_rows:q_rows + kv_rows], w[q_rows + kv_rows:]
    nq = num_heads // tp * head_dim
    if num_kv_heads >= tp:
        nk = num_kv_heads // tp * head_dim
        start = rank * nk
    else:
        nk = head_dim
        start = rank // (tp // num_kv_heads) * head_dim
    return torch.cat([q[rank * nq:(rank + 1) * nq], k[start:start + nk], v[start:start + nk]])
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "test_shard_qkv_visible", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
# 4 query heads, 2 KV heads, head_dim 2, tp 2; row i holds i
_w = torch.arange((4 + 2 * 2) * 2, dtype=torch.float32)[:, None]
_got = shard_qkv(_w, 1, 2, 4, 2, 2)
checks.equal("shard_qkv returns a torch.Tensor", isinstance(_got, torch.Tensor), True)
checks.equal("shard_qkv(rows 0..15, rank=1, tp=2, heads=4, kv_heads=2, head_dim=2)",
             _got[:, 0].int().tolist(), [4, 5, 6, 7, 10, 11, 14, 15])
print("visible test passed")

# %% nbgrader={"grade": true, "grade_id": "test_shard_qkv_hidden", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
### BEGIN HIDDEN TESTS
_g = torch.Generator().manual_seed(25001)
# (heads, kv_heads, head_dim, tp): even KV split, one KV head per rank, replicated KV heads
for _H, _Hkv, _D, _tp in ((9, 3, 4, 3), (8, 4, 3, 2), (12, 4, 5, 4), (8, 2, 4, 8), (6, 1, 3, 3),
                          (16, 4, 2, 8), (15, 5, 3, 5)):
    _w = torch.randn((_H + 2 * _Hkv) * _D, 7, generator=_g)
    for _r in range(_tp):
        _got = shard_qkv(_w, _r, _tp, _H, _Hkv, _D)
        _want = emulated_tp.shard_qkv(_w, _r, _tp, _H, _Hkv, _D)
        checks.equal(f"shard_qkv shape (heads={_H}, kv_heads={_Hkv}, head_dim={_D}, tp={_tp}, "
                     f"rank={_r})", tuple(_got.shape), tuple(_want.shape))
        checks.equal(f"shard_qkv(heads={_H}, kv_heads={_Hkv}, head_dim={_D}, tp={_tp}, "
                     f"rank={_r}) equal to vLLM's layout", torch.equal(_got, _want), True)
### END HIDDEN TESTS

# %% [markdown] nbgrader={"grade": false, "grade_id": "task2", "locked": true, "schema_version": 3, "solution": false, "task": false}
# ## Task 2: the merged column shard (2 points)
#
# `w` stacks several matrices along its rows: `sizes[0]` rows of the first, then
# `sizes[1]` rows of the second, ... (`gate_up_proj`: `sizes = [I, I]`, gate then up).
# Return rank `rank`'s rows (vLLM's `MergedColumnParallelLinear`): the rank-th of `tp`
# equal consecutive slices **of each matrix**, stacked in the same order. Each size is
# divisible by `tp`. The broken configuration cuts `w` as a whole instead.

# %% nbgrader={"grade": false, "grade_id": "shard_merged_column", "locked": false, "schema_version": 3, "solution": true, "task": false}
def shard_merged_column(w: torch.Tensor, sizes, rank: int, tp: int) -> torch.Tensor:
    ### BEGIN SOLUTION
    out, start = [], 0
    for size in sizes:
        n = size // tp
        out.append(w[start + rank * n:start + (rank + 1) * n])
        start += size
    return torch.cat(out)
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "test_shard_merged_column_visible", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
_w = torch.cat([torch.arange(4), 50 + torch.arange(4)]).float()[:, None]
_got = shard_merged_column(_w, [4, 4], 0, 2)
checks.equal("shard_merged_column returns a torch.Tensor", isinstance(_got, torch.Tensor), True)
checks.equal("shard_merged_column([0..3; 50..53], [4, 4], rank=0, tp=2)",
             _got[:, 0].int().tolist(), [0, 1, 50, 51])
print("visible test passed")

# %% nbgrader={"grade": true, "grade_id": "test_shard_merged_column_hidden", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
### BEGIN HIDDEN TESTS
_g = torch.Generator().manual_seed(25002)
for _sizes, _tp in (([12, 12], 3), ([8, 8], 4), ([6, 12, 18], 3), ([20, 10], 5), ([7, 7], 1),
                    ([16, 16], 8)):
    _w = torch.randn(sum(_sizes), 5, generator=_g)
    for _r in range(_tp):
        _got = shard_merged_column(_w, _sizes, _r, _tp)
        _want = emulated_tp.shard_merged_column(_w, _sizes, _r, _tp)
        checks.equal(f"shard_merged_column(sizes={_sizes}, rank={_r}, tp={_tp}) shape",
                     tuple(_got.shape), tuple(_want.shape))
        checks.equal(f"shard_merged_column(sizes={_sizes}, rank={_r}, tp={_tp}) equal to "
                     f"vLLM's layout", torch.equal(_got, _want), True)
### END HIDDEN TESTS

# %% [markdown] nbgrader={"grade": false, "grade_id": "task3", "locked": true, "schema_version": 3, "solution": false, "task": false}
# ## Task 3: an all-reduce in a fixed order (2 points)
#
# `partials` is a list of `(rank, tensor)` pairs **in the order they arrived** (any
# order; ranks 0 .. tp - 1, each once; tensors of one shape and dtype). Return their sum,
# added **one at a time in rank order** in the tensors' own dtype:
# `((p_0 + p_1) + p_2) + ...`, a new tensor (do not modify the inputs). The same partials
# must give the same bits whatever order they arrive in; the grader compares with
# the engine's `all_reduce_rank_order` bit for bit, in bfloat16 too.

# %% nbgrader={"grade": false, "grade_id": "all_reduce_fixed_order", "locked": false, "schema_version": 3, "solution": true, "task": false}
def all_reduce_fixed_order(partials) -> torch.Tensor:
    ### BEGIN SOLUTION
    ordered = [p for _, p in sorted(partials, key=lambda rp: rp[0])]
    total = ordered[0].clone()
    for p in ordered[1:]:
        total = total + p
    return total
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "test_all_reduce_visible", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
# bfloat16 has 8 significant bits: 256 + 1 rounds back to 256, but 1 + 1 + 256 is 258
_p = [torch.tensor([256.0], dtype=torch.bfloat16), torch.tensor([1.0], dtype=torch.bfloat16),
      torch.tensor([1.0], dtype=torch.bfloat16)]
_got = all_reduce_fixed_order([(1, _p[1]), (2, _p[2]), (0, _p[0])])
checks.equal("all_reduce_fixed_order dtype", _got.dtype, torch.bfloat16)
checks.equal("all_reduce_fixed_order of 256, 1, 1 (bf16, arriving as ranks 1, 2, 0)",
             _got.item(), 256.0)
print("visible test passed")

# %% nbgrader={"grade": true, "grade_id": "test_all_reduce_hidden", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
### BEGIN HIDDEN TESTS
_g = torch.Generator().manual_seed(25003)
for _dtype, _tp in ((torch.bfloat16, 3), (torch.bfloat16, 4), (torch.float16, 2),
                    (torch.float32, 5), (torch.bfloat16, 8)):
    _parts = [(torch.randn(6, 33, generator=_g) * 4.0 ** _i).to(_dtype) for _i in range(_tp)]
    _copies = [p.clone() for p in _parts]
    _want = emulated_tp.all_reduce_rank_order(_copies)
    for _k in range(4):
        _order = torch.randperm(_tp, generator=_g).tolist()
        _got = all_reduce_fixed_order([(_r, _parts[_r]) for _r in _order])
        checks.equal(f"all_reduce_fixed_order dtype ({_dtype}, tp={_tp})", _got.dtype, _dtype)
        checks.equal(f"all_reduce_fixed_order ({_dtype}, tp={_tp}, arrival {_order}) bit for "
                     f"bit the rank-order sum", torch.equal(_got, _want), True)
    checks.equal(f"the inputs are unchanged ({_dtype}, tp={_tp})",
                 all(torch.equal(a, b) for a, b in zip(_parts, _copies)), True)
# tp = 1: the sum is the one partial, still as a new tensor (a caller may change either)
_one = torch.randn(4, 5, generator=_g).to(torch.bfloat16)
_got1 = all_reduce_fixed_order([(0, _one)])
checks.equal("all_reduce_fixed_order([(0, p)]) (tp = 1) equals p", torch.equal(_got1, _one), True)
checks.new_object("all_reduce_fixed_order([(0, p)]) (tp = 1)", _got1, _one)
### END HIDDEN TESTS

# %% [markdown] nbgrader={"grade": false, "grade_id": "restore", "locked": true, "schema_version": 3, "solution": false, "task": false}
# ## Restore check (5 points)
#
# The grader builds the float32 embedded model, scores two fresh pieces of text (about 40
# tokens each) at tp = 1, then emulates tp = 3 with **your** `shard_qkv`,
# `shard_merged_column` and `all_reduce_fixed_order`, the partials of every all-reduce
# handed to you in a random arrival order, twice (two different streams of arrival
# orders). It checks: the mean KL against tp = 1 is at most 1e-9 nats (float32's noise
# floor for this cut; the contiguous layout is tens of nats away), and the two runs give
# the same logits bit for bit. The broken configuration (`shard_contiguous` with the
# arrival-order sum) is measured by the same check and must fail it.

# %% nbgrader={"grade": true, "grade_id": "test_restore", "locked": true, "points": 5, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
### BEGIN HIDDEN TESTS
import random as _random

_rng = _random.Random(25004)


def _arriving(fn, seed):
    """fn(list of (rank, partial)) called with the partials in a random order per call."""
    _gen = _random.Random(seed)

    def reduce(ps):
        pairs = list(enumerate(ps))
        _gen.shuffle(pairs)
        return fn(pairs)
    return reduce


def _tp3_logits(qkv_fn, merged_fn, reduce_fn, seed):
    with emulate_tensor_parallel(_llm, 3, shard_qkv_fn=qkv_fn, shard_merged_column_fn=merged_fn,
                                 all_reduce_fn=_arriving(reduce_fn, seed)):
        return torch.cat(_llm.score(_seqs, output="logits"))


# your functions first, on a toy input (an unfinished one fails here, before the engine is built)
shard_qkv(torch.zeros(15, 2), 0, 3, 3, 1, 3)
shard_merged_column(torch.zeros(6, 2), [3, 3], 0, 3)
all_reduce_fixed_order([(1, torch.ones(2)), (0, torch.ones(2))])
_llm = engine()
_text = evalsets.load_corpus()
_tok = _llm.get_tokenizer()
_seqs = []
for _n in (41, 38):
    _s = _rng.randrange(0, len(_text) - 1200)
    _seqs.append(_tok.encode(_text[_s:_s + 1200])[:_n])
_s1, _s2 = _rng.randrange(10 ** 6), 10 ** 6 + _rng.randrange(10 ** 6)  # two arrival streams
# your functions first (a broken one fails here, before any reference is computed)
_mine = [_tp3_logits(shard_qkv, shard_merged_column, all_reduce_fixed_order, _s)
         for _s in (_s1, _s2)]
_ref = torch.cat(_llm.score(_seqs, output="logits"))  # tp = 1
_bad = [_tp3_logits(emulated_tp.shard_qkv, shard_contiguous, arrival_order_sum, _s)
        for _s in (_s1, _s2)]
_mine_kl, _mine_stable = metrics.mean_kl(_ref, _mine[0]), torch.equal(_mine[0], _mine[1])
_bad_kl, _bad_stable = metrics.mean_kl(_ref, _bad[0]), torch.equal(_bad[0], _bad[1])


def _passes(kl, stable):
    return kl <= 1e-9 and stable


print(f"tp=3 vs tp=1 (float32, 2 fresh sequences of {[len(s) for s in _seqs]} tokens): "
      f"yours: KL {_mine_kl:.3g} nats, same bits under two arrival streams {_mine_stable}; "
      f"broken configuration: KL {_bad_kl:.3g} nats, same bits {_bad_stable}")
if _passes(_bad_kl, _bad_stable):
    raise checks.CheckFailed("the check does not discriminate: the broken configuration passes it")
checks.at_most("mean KL (nats) of your tp=3 against tp=1, float32", _mine_kl, 1e-9)
checks.equal("your tp=3 logits equal bit for bit under different arrival orders",
             _mine_stable, True)
### END HIDDEN TESTS
