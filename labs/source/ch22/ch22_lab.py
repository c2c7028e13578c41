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
# # Lab 22: repair the prefix-cache key
#
# In chapter 22 a block hash that ignored its parent block made the engine reuse K/V
# computed at other positions after other text: two prompts with the same passages in a
# different order shared every passage block, the prefix-cache hit count went *up*, and
# the answer drifted (KL far above the exactly-0 of a correct hit). This lab starts from
# that **broken engine**: the setup cell plants the fault through the step registry
# (`faults.unchained_block_hash`). You write the three functions that decide what the
# cache reuses; the last test plugs them into the engine as its `"block_hash"`,
# `"block_hash.extra_keys"` and `"prefix_cache.lookup"` steps on fresh prompts and checks
# that the cached engine gives the no-cache engine's numbers and the reference's hit
# counts, next to the broken engine failing the same check.
#
# 1. `hash_block(parent_hash, token_ids, extra_keys)`: the chained block key, 3 points;
# 2. `extra_keys(cache_salt, block_index)`: what else goes into a block's key, 2 points;
# 3. `num_cached_blocks(block_hashes, cached, num_tokens, block_size)`: the lookup,
#    3 points; then the restore check, 6 points.
#
# The grader calls your functions on **new** inputs, so a function that only works on
# the examples here will not pass. Run the cells in order. Do not edit the setup and test
# cells.

# %% nbgrader={"grade": false, "grade_id": "setup", "locked": true, "schema_version": 3, "solution": false, "task": false}
import hashlib
import random

import grading.checks as checks  # first import: records the original functions
import torch

from minivllm import LLM, SamplingParams
from minivllm.core.kv_cache_manager import block_extra_keys, find_longest_cache_hit
from minivllm.precision import evalsets, faults, metrics

torch.manual_seed(0)
MODEL = "smollm2-135m-instruct"
BS = 16
llm = LLM(MODEL, dtype="float32", max_model_len=256, block_size=BS)
tok = llm.get_tokenizer()
_text = evalsets.load_corpus()


def snippet(start: int, n: int) -> list[int]:
    return tok.encode(_text[start:start + 12 * n])[:n]


def broken():
    """The fault of chapter 22: each block hashed on its own tokens only. Use it as
    ``with broken(): ...``; outside the block the engine is correct."""
    return faults.unchained_block_hash(llm)


def hit_tokens(fn):
    """(fn(), prefix-cache hit tokens fn added)."""
    before = llm.stats.prefix_cache_hits
    out = fn()
    return out, llm.stats.prefix_cache_hits - before


head, p1, p2, p3 = (snippet(s, BS) for s in (500, 2500, 4500, 6500))
question = tok.encode(" Which passage was first?")
A = head + p1 + p2 + p3 + question
B = head + p3 + p1 + p2 + question  # the same passages, another order
q_rows = list(range(len(B) - len(question), len(B)))
llm.reset_prefix_cache()
truth = llm.score(B, positions=q_rows)  # no cache lookup (B's blocks are written, though)
llm.reset_prefix_cache()
llm.score(A)
ok, ok_hits = hit_tokens(lambda: llm.score(B, positions=q_rows, use_prefix_cache=True))
with broken():
    llm.score(A)
    bad, bad_hits = hit_tokens(lambda: llm.score(B, positions=q_rows, use_prefix_cache=True))
print(f"correct engine: B reused {ok_hits} tokens (the shared head), KL of the question rows "
      f"{metrics.mean_kl(truth, ok):.3g} nats")
print(f"broken engine:  B reused {bad_hits} tokens, KL {metrics.mean_kl(truth, bad):.3g} nats")

# %% [markdown] nbgrader={"grade": false, "grade_id": "task1", "locked": true, "schema_version": 3, "solution": false, "task": false}
# ## Task 1: the chained block key (3 points)
#
# Return a key for one full block: `parent_hash` is the key of the block before it
# (`None` for a request's first block), `token_ids` the block's token ids (a list of
# ints), `extra_keys` a tuple of other things that change the block's K/V (strings here).
# The key must be hashable (bytes are best), the same for the same inputs every time,
# and different whenever any of the three differs: equal keys must mean equal whole
# prefixes. Use a cryptographic hash (`hashlib.sha256`), not Python's `hash()`; make
# sure `[1, 23]` and `[12, 3]` do not give the same bytes to it. Do not call the engine's
# `hash_block_tokens`.

# %% nbgrader={"grade": false, "grade_id": "hash_block", "locked": false, "schema_version": 3, "solution": true, "task": false}
def hash_block(parent_hash, token_ids: list[int], extra_keys: tuple = ()):
    ### BEGIN SOLUTION
    h = hashlib.sha256()
    h.update(b"first-block" if parent_hash is None else b"parent:" + parent_hash)
    h.update(repr([int(t) for t in token_ids]).encode())
    h.update(repr(tuple(extra_keys)).encode())
    return h.digest()
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "test_hash_block_visible", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
_k = hash_block(None, [1, 2, 3, 4])
checks.equal("hash_block is hashable", isinstance(hash(_k), int), True)
checks.equal("hash_block(None, [1, 2, 3, 4]) twice gives the same key",
             hash_block(None, [1, 2, 3, 4]) == _k, True)
checks.equal("hash_block(None, [1, 2, 3, 5]) differs from hash_block(None, [1, 2, 3, 4])",
             hash_block(None, [1, 2, 3, 5]) != _k, True)
print("visible test passed")

# %% nbgrader={"grade": true, "grade_id": "test_hash_block_hidden", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
### BEGIN HIDDEN TESTS
_rng = random.Random(22001)
_seen = {}
for _trial in range(40):
    _n = _rng.choice([1, 4, 16])
    _toks = [_rng.randrange(0, 49152) for _ in range(_n)]
    _parent = None if _trial % 4 == 0 else hash_block(None, [_rng.randrange(0, 49152)
                                                            for _ in range(4)])
    _extra = _rng.choice([(), ("salt-a",), ("salt-b",)])
    _key = hash_block(_parent, list(_toks), _extra)
    checks.equal("hash_block gives the same key for the same inputs",
                 hash_block(_parent, list(_toks), _extra) == _key, True)
    _variants = {
        "another parent": (hash_block(None, [7, 7]), _toks, _extra),
        "no parent": (None, _toks, _extra) if _parent is not None else (hash_block(None, [1]), _toks, _extra),
        "one token changed": (_parent, _toks[:-1] + [(_toks[-1] + 1) % 49152], _extra),
        "another extra key": (_parent, _toks, ("other-salt",)),
        "no extra key": (_parent, _toks, ()) if _extra else (_parent, _toks, ("x",)),
    }
    if _n > 1 and _toks[0] != _toks[1]:
        _variants["two tokens swapped"] = (_parent, [_toks[1], _toks[0]] + _toks[2:], _extra)
    for _what, (_p, _t, _e) in _variants.items():
        if hash_block(_p, list(_t), _e) == _key:
            raise checks.CheckFailed(f"hash_block: {_what} gives the same key (parent "
                                     f"{'None' if _parent is None else 'set'}, {_n} tokens, "
                                     f"extra keys {_extra}); equal keys must mean equal "
                                     "parent, tokens and extra keys")
    _seen.setdefault(_key, (_parent, tuple(_toks), _extra))
    if _seen[_key] != (_parent, tuple(_toks), _extra):
        raise checks.CheckFailed("hash_block: two different inputs gave the same key")
for _a, _b in (([1, 23], [12, 3]), ([12, 3, 4], [1, 23, 4]), ([100, 2], [10, 2]), ([5], [5, 0])):
    if hash_block(None, _a) == hash_block(None, _b):
        raise checks.CheckFailed(f"hash_block(None, {_a}) == hash_block(None, {_b}): the token "
                                 "ids are not separated before hashing")
### END HIDDEN TESTS

# %% [markdown] nbgrader={"grade": false, "grade_id": "task2", "locked": true, "schema_version": 3, "solution": false, "task": false}
# ## Task 2: extra keys (2 points)
#
# A request may carry a `cache_salt` (a non-empty string, or `None`): requests with
# different salts must never share a cached block. vLLM puts the salt into the key of
# the request's **first** block only (block index 0); the chain of task 1 carries it into
# every later block. Return the extra keys of block `block_index` (0-based) as a tuple:
# `(cache_salt,)` for the first block of a salted request, `()` otherwise.

# %% nbgrader={"grade": false, "grade_id": "extra_keys", "locked": false, "schema_version": 3, "solution": true, "task": false}
def extra_keys(cache_salt, block_index: int) -> tuple:
    ### BEGIN SOLUTION
    if block_index == 0 and cache_salt is not None:
        return (cache_salt,)
    return ()
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "test_extra_keys_visible", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
checks.equal("extra_keys('tenant-7', 0)", extra_keys("tenant-7", 0), ("tenant-7",))
checks.equal("extra_keys('tenant-7', 1)", extra_keys("tenant-7", 1), ())
checks.equal("extra_keys(None, 0)", extra_keys(None, 0), ())
print("visible test passed")

# %% nbgrader={"grade": true, "grade_id": "test_extra_keys_hidden", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
### BEGIN HIDDEN TESTS
_rng = random.Random(22002)
checks.equal("extra_keys('x', 0)", extra_keys("x", 0), ("x",))
for _ in range(30):
    _salt = _rng.choice([None, "s", f"salt-{_rng.randrange(10 ** 9)}", "0"])
    _i = _rng.choice([0, 0, 1, 2, _rng.randrange(3, 200)])
    checks.equal(f"extra_keys({_salt!r}, {_i})", extra_keys(_salt, _i), block_extra_keys(_salt, _i))
### END HIDDEN TESTS

# %% [markdown] nbgrader={"grade": false, "grade_id": "task3", "locked": true, "schema_version": 3, "solution": false, "task": false}
# ## Task 3: the lookup (3 points)
#
# A new request arrives with the keys of its full blocks, `block_hashes` (first block
# first). `cached` holds the keys of the blocks in the prefix cache (it supports `in`;
# the engine passes its dict of key -> block; only blocks whose K/V have been written are
# in it). Return how many **leading** blocks the request can reuse, an `int`:
#
# - count from the first block and stop at the first one that is not cached (a block is
#   only valid after all of its prefix);
# - leave at least one of the request's `num_tokens` tokens to compute (the engine needs
#   the last token's logits): at most `(num_tokens - 1) // block_size` blocks.

# %% nbgrader={"grade": false, "grade_id": "num_cached_blocks", "locked": false, "schema_version": 3, "solution": true, "task": false}
def num_cached_blocks(block_hashes: list, cached, num_tokens: int, block_size: int) -> int:
    ### BEGIN SOLUTION
    limit = (num_tokens - 1) // block_size
    count = 0
    for key in block_hashes[:limit]:
        if key not in cached:
            break
        count += 1
    return count
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "test_num_cached_blocks_visible", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
checks.equal("num_cached_blocks(['a', 'b', 'c', 'd'], {'a', 'b', 'd'}, 100, 16)",
             num_cached_blocks(["a", "b", "c", "d"], {"a", "b", "d"}, 100, 16), 2)
checks.equal("num_cached_blocks(['a', 'b'], set(), 40, 16)",
             num_cached_blocks(["a", "b"], set(), 40, 16), 0)
print("visible test passed")

# %% nbgrader={"grade": true, "grade_id": "test_num_cached_blocks_hidden", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
### BEGIN HIDDEN TESTS
_rng = random.Random(22003)
_k = [b"k0", b"k1", b"k2", b"k3"]
for _keys, _cached, _n, _bs in ((_k[:3], set(_k), 48, 16),   # 3 full blocks: keep one token
                                (_k[:3], set(_k), 49, 16),
                                (_k, {b"k0", b"k1", b"k3"}, 200, 16),  # a miss, then a hit
                                ([], set(_k), 1, 16), (_k, set(), 80, 16), (_k, set(_k), 4, 1)):
    checks.equal(f"num_cached_blocks({len(_keys)} keys, {len(_cached)} cached, num_tokens={_n}, "
                 f"block_size={_bs})", num_cached_blocks(list(_keys), set(_cached), _n, _bs),
                 find_longest_cache_hit(list(_keys), set(_cached), _n, _bs))
for _trial in range(60):
    _bs = _rng.choice([1, 4, 16, 32])
    _nb = _rng.randrange(0, 8)
    _keys = [bytes([_rng.randrange(256) for _ in range(8)]) for _ in range(_nb)]
    _cached = {k: object() for k in _keys if _rng.random() < 0.8}
    _cached.update({bytes([_rng.randrange(256)] * 8): object() for _ in range(3)})
    # the request's length: its full blocks plus 0 .. block_size - 1 more tokens
    _n = max(1, _nb * _bs + _rng.choice([0, 0, 1, _bs - 1]))
    _want = find_longest_cache_hit(list(_keys), dict(_cached), _n, _bs)
    _got = num_cached_blocks(list(_keys), dict(_cached), _n, _bs)
    checks.equal(f"num_cached_blocks({_nb} keys, {len(_cached)} cached, num_tokens={_n}, "
                 f"block_size={_bs})", _got, _want)
### END HIDDEN TESTS

# %% [markdown] nbgrader={"grade": false, "grade_id": "restore", "locked": true, "schema_version": 3, "solution": false, "task": false}
# ## Restore check (6 points)
#
# The grader builds fresh prompts from random places of the corpus: a head, three
# 16-token passages, a question; request A has them in one order, request B in another.
# With your three functions as the engine's steps, it caches A, scores B's question rows
# through the cache (`use_prefix_cache=True`), sends A's first four blocks alone (a
# prompt of whole blocks), and A with one salt, then another, then the first again. B's rows must equal the no-cache rows (mean KL under 1e-9 nats
# in float32; a correct hit is bit-identical on this CPU) and every hit count must equal
# the engine reference's. The broken engine (the unchained key) is measured by the same
# check and must fail it.

# %% nbgrader={"grade": true, "grade_id": "test_restore", "locked": true, "points": 6, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
### BEGIN HIDDEN TESTS
import contextlib as _contextlib

_rng = random.Random(22004)


def _fresh(n):
    return snippet(_rng.randrange(0, len(_text) - 16 * n), n)


_head, _ps, _q = _fresh(BS), [_fresh(BS) for _ in range(3)], _fresh(6)
_A = _head + _ps[0] + _ps[1] + _ps[2] + _q
_B = _head + _ps[2] + _ps[0] + _ps[1] + _q
_rows = list(range(len(_B) - len(_q), len(_B)))
_one = SamplingParams(temperature=0, max_tokens=1)


def _run():
    """(B's question rows through the cache, hit tokens of: B after A, A's first 4
    blocks alone, A with salt s1, with s2, with s1 again)."""
    llm.reset_prefix_cache()
    llm.score(_A)
    rows, n_b = hit_tokens(lambda: llm.score(_B, positions=_rows, use_prefix_cache=True))
    hits = [n_b, hit_tokens(lambda: llm.generate([_A[:4 * BS]], _one))[1]]  # whole blocks
    for salt in ("s1", "s2", "s1"):
        hits.append(hit_tokens(lambda: llm.generate([{"prompt_token_ids": _A,
                                                      "cache_salt": salt}], _one))[1])
    return rows, hits


def _mine():
    stack = _contextlib.ExitStack()
    stack.enter_context(llm.swap_step("block_hash", hash_block))
    stack.enter_context(llm.swap_step("block_hash.extra_keys", extra_keys))
    stack.enter_context(llm.swap_step("prefix_cache.lookup", num_cached_blocks))
    return stack


with _mine():  # your functions first
    _m_rows, _m_hits = _run()
_r_rows, _r_hits = _run()  # the engine's reference
llm.reset_prefix_cache()
_truth = llm.score(_B, positions=_rows)  # no lookup: every position computed
with broken():
    _b_rows, _b_hits = _run()


def _verdict(rows, hits):
    return metrics.mean_kl(_truth, rows), hits == _r_hits


_kl_m, _same_m = _verdict(_m_rows, _m_hits)
_kl_b, _same_b = _verdict(_b_rows, _b_hits)
print(f"hit tokens (B after A; A's 4 blocks; A with salts s1, s2, s1): reference {_r_hits}, yours {_m_hits}, "
      f"broken {_b_hits}")
print(f"B's question rows vs no cache, mean KL: yours {_kl_m:.3g}, broken {_kl_b:.3g} nats")
if _kl_b < 1e-9 and _same_b:
    raise checks.CheckFailed("the check does not discriminate: the broken engine passes it")
checks.equal("hit tokens (B after A; A's 4 blocks; A with salts s1, s2, s1) equal to the "
             "reference's",
             _m_hits, _r_hits)
checks.at_most("mean KL of B's question rows through the cache vs no cache (nats)", _kl_m, 1e-9)
### END HIDDEN TESTS
