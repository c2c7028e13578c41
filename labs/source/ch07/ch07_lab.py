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
# # Lab 7: repair a broken slot mapping
#
# In chapter 7 a wrong mapping from token positions to KV-cache slots did not make the
# logits a little less precise: it made the model read another token's K/V. The
# off-by-one fault (the block index taken from `pos - 1`), in decode mode, left every
# sequence exact below one block (16 tokens) and sent KL over 1 nat from the first block
# boundary on (in a prefill it hits every position, the early ones hardest). This lab
# starts from that **broken engine**: the setup cell plants the fault through the step
# registry (`faults.off_by_one_slots`) on a fragmented pool. You write the mapping
# yourself; the last test plugs your `slot_mapping` into the engine as its
# `"slot_mapping"` step on a fragmented pool with prompts you have not seen and checks
# that the logits and the greedy tokens equal the correct engine's **bit for bit**, next
# to the broken engine failing the same check.
#
# You write three functions. The grader calls them on **new** inputs (random
# non-contiguous block tables, other block sizes, batches of tables sharing prefix
# blocks) and compares with the engine's reference bit for bit, so a function that only
# works on the examples here will not pass.
#
# 1. `blocks_for(num_tokens, block_size)`: how many blocks a sequence needs, 2 points;
# 2. `slot_mapping(block_table, positions, block_size)`: the step itself, 4 points;
# 3. `read_slots(block_table, seq_len, block_size)`: what a reader gathers, 2 points;
#    then the restore check, 7 points;
# 4. `KV_CACHE_DTYPE`: the most precise K/V cache that holds a batch in a memory budget,
#    a decision, 2 points.
#
# Run the cells in order. Do not edit the setup and test cells.

# %% nbgrader={"grade": false, "grade_id": "setup", "locked": true, "schema_version": 3, "solution": false, "task": false}
import importlib

import grading.checks as checks  # first import: records the original functions
import torch

from minivllm import LLM, SamplingParams
from minivllm.attention.metadata import slot_mapping_ref
from minivllm.core.kv_cache_manager import KVCacheManager
from minivllm.precision import evalsets, faults, metrics
from minivllm.precision.paging import fragment_pool, record_block_tables

torch.manual_seed(0)
MODEL = "smollm2-135m-instruct"
BS = 16
llm = LLM(MODEL, dtype="float32", max_model_len=256, block_size=BS, num_gpu_blocks_override=24)
tok = llm.get_tokenizer()
_text = evalsets.load_corpus()
example_ids = tok.encode(_text[1000:3000])[:40]


def broken():
    """The fault of chapter 7: the off-by-one slot mapping, for writer and reader. Use it
    as ``with broken(): ...``; outside the block the engine is correct."""
    return faults.off_by_one_slots(llm)


fragment_pool(llm, seed=3)  # free blocks in random order: tables are not [0, 1, 2, ...]
with broken():
    _bad = llm.score(example_ids, output="logits")
with record_block_tables(llm) as _tables:  # the correct engine, noting its block tables
    _good = llm.score(example_ids, output="logits")
print(f"example: {len(example_ids)} tokens, the correct engine ran it on block table "
      f"{_tables[0]} (block size {BS})")
print(f"the broken engine: logits equal to the correct engine's: {torch.equal(_bad, _good)}; "
      f"mean KL {metrics.mean_kl(_good, _bad):.2f} nats")

# %% [markdown] nbgrader={"grade": false, "grade_id": "task1", "locked": true, "schema_version": 3, "solution": false, "task": false}
# ## Task 1: how many blocks does a sequence need? (2 points)
#
# A sequence of `num_tokens` tokens (an `int >= 0`) occupies whole blocks of `block_size`
# tokens (an `int >= 1`): return the number of blocks (an `int`), the least number whose
# slots hold every token. 0 tokens need 0 blocks; 16 tokens with `block_size=16` need 1,
# 17 need 2. (The engine asks the block manager for this many blocks before it runs a
# step; one too few and the last token's slot lies in a block the sequence does not own.)

# %% nbgrader={"grade": false, "grade_id": "blocks_for", "locked": false, "schema_version": 3, "solution": true, "task": false}
def blocks_for(num_tokens: int, block_size: int) -> int:
    ### BEGIN SOLUTION
    return -(-num_tokens // block_size)
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "test_blocks_for_visible", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
for _n, _want in ((0, 0), (1, 1), (15, 1), (16, 1), (17, 2), (40, 3), (48, 3)):
    checks.equal(f"blocks_for({_n}, 16)", blocks_for(_n, 16), _want)
print("visible test passed")

# %% nbgrader={"grade": true, "grade_id": "test_blocks_for_hidden", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
### BEGIN HIDDEN TESTS
import random as _random

_rng = _random.Random(7003)
for _bs in (1, 3, 8, 16, 32, 128):
    _mgr = KVCacheManager(num_blocks=1, block_size=_bs)  # the engine's own count
    for _n in [0, 1, _bs - 1, _bs, _bs + 1, 5 * _bs, 5 * _bs + 1] + \
            [_rng.randrange(0, 5000) for _ in range(20)]:
        if _n < 0:
            continue
        _got = blocks_for(_n, _bs)
        checks.equal(f"blocks_for({_n}, {_bs}) is an int", isinstance(_got, int), True)
        checks.equal(f"blocks_for({_n}, {_bs})", _got, _mgr.num_blocks_needed(_n))
### END HIDDEN TESTS

# %% [markdown] nbgrader={"grade": false, "grade_id": "task2", "locked": true, "schema_version": 3, "solution": false, "task": false}
# ## Task 2: the slot mapping (4 points)
#
# Write the engine's `"slot_mapping"` step. Its arguments:
#
# - `block_table`: int64 tensor `[..., num_blocks]`, the physical block ids of one
#   sequence's logical blocks (entry `j` holds positions `j * block_size` to
#   `(j + 1) * block_size - 1`), or a batch of such rows (`[B, num_blocks]`);
# - `positions`: int64 tensor `[..., n]` with the same leading dims, token positions in
#   any order (every position `< num_blocks * block_size`);
# - `block_size`: tokens per block.
#
# Return an int64 tensor `[..., n]`: the pool row (slot) of each position, its physical
# block times `block_size` plus its offset in the block. The engine calls it for the
# slots a step writes (one table, the step's new positions) and for the slots attention
# reads (one table, or a batch of tables for a group of decodes). Do not call the
# reference (`slot_mapping_ref`): that would pass and teach nothing.

# %% nbgrader={"grade": false, "grade_id": "slot_mapping", "locked": false, "schema_version": 3, "solution": true, "task": false}
def slot_mapping(block_table: torch.Tensor, positions: torch.Tensor,
                 block_size: int) -> torch.Tensor:
    ### BEGIN SOLUTION
    block = torch.div(positions, block_size, rounding_mode="floor")
    return block_table.gather(-1, block) * block_size + positions % block_size
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "test_slot_mapping_visible", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
_table = torch.tensor([7, 2, 9])
_pos = torch.tensor([0, 5, 15, 16, 17, 31, 32, 40])
_got = slot_mapping(_table, _pos, 16)
checks.equal("slot_mapping returns a torch.Tensor", isinstance(_got, torch.Tensor), True)
checks.equal("slot_mapping dtype", _got.dtype, torch.int64)
checks.equal("slot_mapping([7, 2, 9], [0, 5, 15, 16, 17, 31, 32, 40], 16)", _got.tolist(),
             [112, 117, 127, 32, 33, 47, 144, 152])
print("visible test passed")

# %% nbgrader={"grade": true, "grade_id": "test_slot_mapping_hidden", "locked": true, "points": 3, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
### BEGIN HIDDEN TESTS
_g = torch.Generator().manual_seed(7001)
for _bs, _nb, _pool in ((1, 9, 40), (4, 6, 50), (16, 5, 64), (32, 3, 20), (7, 8, 100)):
    _table = torch.randperm(_pool, generator=_g)[:_nb]  # non-contiguous, any order
    _pos = torch.randperm(_nb * _bs, generator=_g)[:min(_nb * _bs, 40)]
    _pos = torch.cat([_pos, torch.arange(0, _nb * _bs, _bs)])  # every block's first token
    _got = slot_mapping(_table, _pos, _bs)
    _want = slot_mapping_ref(_table, _pos, _bs)
    checks.equal(f"slot_mapping dtype (block_size {_bs})", _got.dtype, torch.int64)
    checks.equal(f"slot_mapping(table={_table.tolist()}, {len(_pos)} positions, {_bs}) "
                 f"equal to the reference", torch.equal(_got, _want), True)
# a batch of tables (a decode group) whose rows share their first two (prefix) blocks
_B, _nb, _bs = 4, 6, 16
_shared = torch.randperm(200, generator=_g)[:2]
_rows = torch.stack([torch.cat([_shared, torch.randperm(200, generator=_g)[:_nb - 2] + 200])
                     for _ in range(_B)])
_pos = torch.arange(_nb * _bs).expand(_B, _nb * _bs)
_got = slot_mapping(_rows, _pos, _bs)
checks.equal("batched slot_mapping shape", tuple(_got.shape), (_B, _nb * _bs))
checks.equal("batched slot_mapping ([4, 6] tables sharing 2 prefix blocks) equal to the "
             "reference", torch.equal(_got, slot_mapping_ref(_rows, _pos, _bs)), True)
# two leading dimensions ([2, 3, 5] tables: groups of decode batches) and a block size
# above 128 (vLLM's MLA and hybrid models use 256 and more); the inputs are left unchanged
_rows3 = torch.randperm(400, generator=_g)[:30].reshape(2, 3, 5)
_pos3 = torch.randint(0, 5 * 256, (2, 3, 7), generator=_g)
_got = checks.call("slot_mapping(3-D table, 3-D positions, 256)", slot_mapping, _rows3, _pos3, 256)
checks.equal("slot_mapping on [2, 3, 5] tables with block_size 256: shape", tuple(_got.shape),
             (2, 3, 7))
checks.equal("slot_mapping on [2, 3, 5] tables with block_size 256 equal to the reference",
             torch.equal(_got, slot_mapping_ref(_rows3, _pos3, 256)), True)
### END HIDDEN TESTS

# %% [markdown] nbgrader={"grade": false, "grade_id": "task3", "locked": true, "schema_version": 3, "solution": false, "task": false}
# ## Task 3: what a reader gathers (2 points)
#
# Attention for a sequence of `seq_len` tokens gathers the K/V of positions
# `0 .. seq_len - 1`. Return those slots for one sequence: an int64 tensor `[seq_len]`,
# slot of position `p` at index `p`. `block_table` is a 1-D int64 tensor; it may hold
# more blocks than `seq_len` needs (blocks allocated ahead), which must not matter. Write
# it without calling `slot_mapping` or the reference.

# %% nbgrader={"grade": false, "grade_id": "read_slots", "locked": false, "schema_version": 3, "solution": true, "task": false}
def read_slots(block_table: torch.Tensor, seq_len: int, block_size: int) -> torch.Tensor:
    ### BEGIN SOLUTION
    pos = torch.arange(seq_len, dtype=torch.int64)
    return block_table[pos // block_size] * block_size + pos % block_size
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "test_read_slots_visible", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
_got = read_slots(torch.tensor([3, 0, 5]), 6, 2)
checks.equal("read_slots([3, 0, 5], 6, 2)", _got.tolist(), [6, 7, 0, 1, 10, 11])
checks.equal("read_slots dtype", _got.dtype, torch.int64)
print("visible test passed")

# %% nbgrader={"grade": true, "grade_id": "test_read_slots_hidden", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
### BEGIN HIDDEN TESTS
_g = torch.Generator().manual_seed(7002)
for _bs in (1, 5, 16, 32):
    for _ in range(3):
        _nb = int(torch.randint(1, 8, (), generator=_g))
        _table = torch.randperm(300, generator=_g)[:_nb + 2]  # two blocks allocated ahead
        _L = int(torch.randint(1, _nb * _bs + 1, (), generator=_g))
        _got = read_slots(_table, _L, _bs)
        _want = slot_mapping_ref(_table, torch.arange(_L), _bs)
        checks.equal(f"read_slots shape (seq_len {_L})", tuple(_got.shape), (_L,))
        checks.equal(f"read_slots(table={_table.tolist()}, seq_len={_L}, block_size={_bs}) "
                     f"equal to the reference", torch.equal(_got, _want), True)
# one full block of 512, and the table left as it was
_table = torch.randperm(50, generator=_g)[:3]
_got = checks.call("read_slots(table, 512, 512)", read_slots, _table, 512, 512)
checks.equal("read_slots(table, 512, 512): exactly the first block's slots",
             torch.equal(_got, slot_mapping_ref(_table, torch.arange(512), 512)), True)
### END HIDDEN TESTS

# %% [markdown] nbgrader={"grade": false, "grade_id": "restore", "locked": true, "schema_version": 3, "solution": false, "task": false}
# ## Restore check (7 points)
#
# The grader fragments the pool, plugs your `slot_mapping` into the engine
# (`llm.swap_step("slot_mapping", slot_mapping)`: writer and reader), scores three fresh
# token sequences (37, 52 and 45 tokens, so they cross block boundaries) in one batch and
# generates 12 greedy tokens for two fresh prompts (14 and 27 tokens long). The logits
# must equal the correct engine's (`torch.equal`: a mapping is integer arithmetic, so the
# right one reads exactly the same K/V) and the greedy tokens too. The broken engine (the off-by-one) is measured
# by the same check and must fail it, which shows the check can tell them apart.

# %% nbgrader={"grade": true, "grade_id": "test_restore", "locked": true, "points": 7, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
### BEGIN HIDDEN TESTS
import random as _random

_rng = _random.Random(7004)


def _fresh(n):
    _s = _rng.randrange(0, len(_text) - 1500)
    return tok.encode(_text[_s:_s + 1500])[:n]


_seqs = [_fresh(n) for n in (37, 52, 45)]
_prompts = [_fresh(n) for n in (14, 27)]
_greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def _run():
    rows = llm.score(_seqs, output="logits")
    gen = [o.outputs[0].token_ids for o in llm.generate(_prompts, _greedy)]
    return rows, gen


fragment_pool(llm, seed=5)
with record_block_tables(llm, slot_mapping) as _tabs:  # your slot_mapping as the engine's step
    _mine = _run()
_ref = _run()  # the correct engine


def _same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a[0], b[0])) and a[1] == b[1]


fragment_pool(llm, seed=5)
with broken():
    _bad = _run()
print(f"your slot_mapping ran on block tables {_tabs[:3]}")
print(f"logits and greedy tokens equal to the correct engine: yours {_same(_mine, _ref)}, "
      f"the broken engine {_same(_bad, _ref)}")
if _same(_bad, _ref):
    raise checks.CheckFailed("the check does not discriminate: the broken engine passes it")
for _i, (_x, _y) in enumerate(zip(_mine[0], _ref[0])):
    checks.equal(f"torch.equal(logits, correct engine's) for fresh sequence {_i} "
                 f"({len(_seqs[_i])} tokens)", torch.equal(_x, _y), True)
checks.equal("greedy tokens (2 fresh prompts x 12) equal to the correct engine's", _mine[1],
             _ref[1])
### END HIDDEN TESTS


# %% [markdown] nbgrader={"grade": false, "grade_id": "task4", "locked": true, "schema_version": 3, "solution": false, "task": false}
# ## Task 4: the most precise cache that fits (2 points)
#
# The pool is memory, and its size in blocks depends on the bytes of one K/V element.
# A server has `KV_BUDGET_BYTES` for the K/V cache of this model (30 layers, 3 K/V heads
# of 64 dimensions, blocks of 16 tokens) and must hold the K/V of the three requests of
# `BATCH` **at once** (each its prompt plus the 8 tokens it generates, in whole blocks:
# your `blocks_for`), so that none waits or is preempted. Choose `KV_CACHE_DTYPE` from
# `KV_OPTIONS`: the most precise cache (the lowest KL against the float32 cache) whose
# pool holds the batch. ("auto" is the model dtype, float32 here.)
#
# `pool_blocks(kv_cache_dtype)` builds the engine with that budget and returns its
# number of blocks; `cache_kl(kv_cache_dtype)` returns the mean KL (nats per position)
# of that cache against the float32 cache on one example window. Work out what you
# expect first, then measure.
#
# The grader builds each option with the budget, reads its pool size, checks your choice
# holds the batch, scores a fresh window with every option that holds it, and requires
# yours to have the lowest KL among them.

# %% nbgrader={"grade": false, "grade_id": "kv_helper", "locked": true, "schema_version": 3, "solution": false, "task": false}
import gc

KV_BUDGET_BYTES = 7_741_440
KV_OPTIONS = ("auto", "float16", "bfloat16", "fp8_e4m3")
_corpus100 = evalsets.corpus_sequences(tok, seq_len=100)
BATCH = [_corpus100[k][:n] for k, n in ((5, 100), (9, 90), (13, 80))]  # prompts; 8 tokens each


def kv_engine(kv_cache_dtype: str):
    """The model with a K/V cache of ``kv_cache_dtype`` in KV_BUDGET_BYTES (block size 16)."""
    if kv_cache_dtype not in KV_OPTIONS:
        raise ValueError(f"kv_cache_dtype must be one of {KV_OPTIONS}, got {kv_cache_dtype!r}")
    return LLM(MODEL, dtype="float32", max_model_len=128, block_size=BS,
               kv_cache_memory_bytes=KV_BUDGET_BYTES, kv_cache_dtype=kv_cache_dtype,
               enable_prefix_caching=False)


def pool_blocks(kv_cache_dtype: str) -> int:
    """Blocks of BS tokens in the pool of :func:`kv_engine` (``kv_cache_dtype``)."""
    return kv_engine(kv_cache_dtype).llm_engine.cache_config.num_gpu_blocks


def cache_kl(kv_cache_dtype: str, seqs=None) -> float:
    """Mean KL (nats per position) of the cache ``kv_cache_dtype`` against the float32
    cache, on ``seqs`` (default: one 32-token example window)."""
    seqs = seqs or evalsets.corpus_sequences(tok, seq_len=32)[3:4]
    ref = llm.score(seqs)
    eng = kv_engine(kv_cache_dtype)
    rows = eng.score(seqs)
    del eng
    gc.collect()
    return sum(metrics.mean_kl(a, b) for a, b in zip(ref, rows)) / len(seqs)


print("the batch's prompts:", [len(p) for p in BATCH], "tokens, 8 more each; budget",
      KV_BUDGET_BYTES, "bytes")

# %% nbgrader={"grade": false, "grade_id": "kv_cache_dtype", "locked": false, "schema_version": 3, "solution": true, "task": false}
KV_CACHE_DTYPE = "auto"  # the model dtype: where this task starts
### BEGIN SOLUTION
KV_CACHE_DTYPE = "float16"
### END SOLUTION

# %% nbgrader={"grade": true, "grade_id": "test_kv_cache_dtype", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
### BEGIN HIDDEN TESTS
checks.one_of("KV_CACHE_DTYPE", KV_CACHE_DTYPE, list(KV_OPTIONS))
_mgr = KVCacheManager(num_blocks=1, block_size=BS)
_need = sum(_mgr.num_blocks_needed(len(p) + 8) for p in BATCH)  # the engine's own count
_win = evalsets.corpus_sequences(tok, seq_len=32)[21:23]  # fresh windows
_ref = llm.score(_win)
_blocks, _kl = {}, {}
for _d in KV_OPTIONS:  # one engine per option: its pool size, and its KL where it holds the batch
    _eng = kv_engine(_d)
    _blocks[_d] = _eng.llm_engine.cache_config.num_gpu_blocks
    if _blocks[_d] >= _need:
        _kl[_d] = sum(metrics.mean_kl(a, b) for a, b in zip(_ref, _eng.score(_win))) / len(_win)
    del _eng
    gc.collect()
_fits = list(_kl)
print(f"the batch needs {_need} blocks; pool blocks in {KV_BUDGET_BYTES} bytes: {_blocks}; "
      f"mean KL vs the float32 cache of those that hold it: "
      + ", ".join(f"{d} {k:.2e}" for d, k in _kl.items()))
checks.equal(f"the pool of KV_CACHE_DTYPE={KV_CACHE_DTYPE!r} ({_blocks[KV_CACHE_DTYPE]} blocks) "
             f"holds the batch ({_need} blocks)", KV_CACHE_DTYPE in _fits, True)
_best = min(_fits, key=_kl.get)
checks.equal(f"KV_CACHE_DTYPE: the lowest KL among the caches that hold the batch ({_best}, "
             f"{_kl[_best]:.2e} nats; yours {_kl[KV_CACHE_DTYPE]:.2e})", KV_CACHE_DTYPE, _best)
### END HIDDEN TESTS
