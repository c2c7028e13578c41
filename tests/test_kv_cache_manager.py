"""KVCacheManager: block tables, prefix-cache hits with chained hashes, LRU, counters."""

from __future__ import annotations

import hashlib
import struct

import pytest

from minivllm.core.kv_cache_manager import KVCacheManager, hash_block_tokens
from minivllm.request import Request
from minivllm.sampling_params import SamplingParams

BS = 4


def make_req(rid: str, tokens: list[int], **params) -> Request:
    return Request(rid, tokens, SamplingParams(**params), max_model_len=1024)


def admit(kv: KVCacheManager, req: Request) -> int:
    """Admit a new request as the scheduler does, compute its whole prompt, register its
    full blocks. Returns the number of prefix-cache hit tokens."""
    hits, n_hit = kv.get_computed_blocks(req)
    assert kv.allocate_slots(req, req.num_tokens - n_hit, hits)
    kv.record_prefix_query(req, n_hit)
    req.num_computed_tokens = req.num_tokens
    kv.cache_blocks(req)
    return n_hit


def refs(kv: KVCacheManager) -> dict[int, int]:
    return {b.block_id: b.ref_cnt for b in kv.block_pool.blocks}


def check_ref_counts(kv: KVCacheManager) -> None:
    """Every block's ref_cnt equals the number of block tables holding it."""
    expected = {b.block_id: 0 for b in kv.block_pool.blocks}
    for blocks in kv.req_to_blocks.values():
        for b in blocks:
            expected[b.block_id] += 1
    assert refs(kv) == expected
    assert kv.block_pool.get_num_free_blocks() == sum(v == 0 for v in expected.values())


# --- hashes ---------------------------------------------------------------------------

def test_hash_is_chained_sha256():
    h1 = hash_block_tokens(None, [1, 2, 3, 4])
    # Independent computation of the documented formula.
    ref = hashlib.sha256(b"minivllm-prefix-root" + struct.pack("<4q", 1, 2, 3, 4)).digest()
    assert h1 == ref and len(h1) == 32
    h2 = hash_block_tokens(h1, [5, 6, 7, 8])
    assert h2 == hashlib.sha256(h1 + struct.pack("<4q", 5, 6, 7, 8)).digest()
    # Same block tokens after a different parent: a different key.
    assert hash_block_tokens(hash_block_tokens(None, [9, 9, 9, 9]), [5, 6, 7, 8]) != h2
    assert hash_block_tokens(None, [1, 2, 3, 5]) != h1
    assert hash_block_tokens(None, [1, 2, 3, 4], extra_keys=("lora",)) != h1


def test_block_hashes_cover_only_full_blocks():
    kv = KVCacheManager(8, BS)
    req = make_req("a", list(range(10)))
    kv.update_block_hashes(req)
    assert len(req.block_hashes) == 2
    assert req.block_hashes[1] == hash_block_tokens(req.block_hashes[0], [4, 5, 6, 7])
    req.append_output_token(10)
    req.append_output_token(11)  # 12 tokens: three full blocks
    kv.update_block_hashes(req)
    assert len(req.block_hashes) == 3


# --- allocation -----------------------------------------------------------------------

def test_allocate_whole_blocks_and_grow_on_boundary():
    kv = KVCacheManager(8, BS)
    req = make_req("a", list(range(6)))
    assert kv.allocate_slots(req, 6)
    ids = kv.get_block_ids("a")
    assert len(ids) == 2 and len(set(ids)) == 2
    assert kv.block_pool.get_num_free_blocks() == 6
    req.num_computed_tokens = 6
    for want_blocks in (2, 2, 3):  # the sequence grows to 7, 8, 9 tokens
        req.append_output_token(100 + req.num_tokens)
        assert kv.allocate_slots(req, 1)
        req.num_computed_tokens += 1
        assert len(kv.get_block_ids("a")) == -(-req.num_computed_tokens // BS) == want_blocks
        assert kv.get_block_ids("a")[:2] == ids  # existing blocks are kept in place
    check_ref_counts(kv)


def test_free_returns_everything():
    kv = KVCacheManager(6, BS)
    a, b = make_req("a", list(range(9))), make_req("b", list(range(50, 57)))
    admit(kv, a)
    admit(kv, b)
    assert kv.block_pool.get_num_free_blocks() == 6 - 3 - 2
    kv.free(a)
    kv.free(b)
    assert kv.block_pool.get_num_free_blocks() == 6
    assert kv.req_to_blocks == {}
    check_ref_counts(kv)


def test_allocate_slots_false_changes_nothing_when_short():
    kv = KVCacheManager(4, BS)
    a = make_req("a", list(range(12)))  # 3 blocks
    admit(kv, a)
    b = make_req("b", list(range(100, 108)))  # needs 2, only 1 free
    before = (refs(kv), list(kv.block_pool.free_block_queue), dict(kv.req_to_blocks))
    assert kv.allocate_slots(b, 8) is False
    assert (refs(kv), list(kv.block_pool.free_block_queue), dict(kv.req_to_blocks)) == before
    assert "b" not in kv.req_to_blocks
    # Growing a running request past the pool also fails cleanly.
    a.append_output_token(5)
    a.append_output_token(6)
    a.append_output_token(7)
    a.append_output_token(8)
    a.append_output_token(9)  # 17 tokens -> 5 blocks > 4
    assert kv.allocate_slots(a, 5) is False
    assert (refs(kv), list(kv.block_pool.free_block_queue)) == before[:2]
    assert len(kv.get_block_ids("a")) == 3
    check_ref_counts(kv)


def test_allocate_counts_revived_cached_blocks_against_the_free_pool():
    """Cached hits that sit in the free queue must come out of it too: when free blocks
    cover the new blocks but not new + revived, allocation fails and changes nothing."""
    kv = KVCacheManager(5, BS)
    prefix = list(range(8))  # two full blocks
    a = make_req("a", prefix + [50])  # 3 blocks: 0, 1 (cached) and 2
    admit(kv, a)
    kv.free(a)  # free queue: 3, 4, 2, 1, 0
    c = make_req("c", list(range(200, 208)))
    admit(kv, c)  # takes the two never-used blocks 3, 4
    assert sorted(kv.get_block_ids("c")) == [3, 4]
    assert kv.block_pool.get_num_free_blocks() == 3
    b = make_req("b", prefix + [60, 61, 62, 63, 64])  # 13 tokens: 4 blocks, 2 hits
    hits, n_hit = kv.get_computed_blocks(b)
    assert n_hit == 8 and [h.ref_cnt for h in hits] == [0, 0]
    before = (refs(kv), list(kv.block_pool.free_block_queue),
              dict(kv.block_pool.cached_block_hash_to_block))
    assert kv.allocate_slots(b, b.num_tokens - n_hit, hits) is False  # 2 new + 2 revived > 3
    assert (refs(kv), list(kv.block_pool.free_block_queue),
            dict(kv.block_pool.cached_block_hash_to_block)) == before
    assert "b" not in kv.req_to_blocks
    check_ref_counts(kv)


def test_free_twice_is_harmless_for_shared_blocks():
    kv = KVCacheManager(8, BS)
    prefix = list(range(8))
    a, b = make_req("a", prefix + [1]), make_req("b", prefix + [2])
    admit(kv, a)
    admit(kv, b)
    shared = kv.get_block_ids("a")[:2]
    kv.free(a)
    kv.free(a)  # a second free of the same request must not drop b's references
    assert [kv.block_pool.blocks[i].ref_cnt for i in shared] == [1, 1]
    check_ref_counts(kv)


# --- prefix caching -------------------------------------------------------------------

def test_prefix_hit_shares_blocks_and_ref_counts():
    kv = KVCacheManager(10, BS)
    prefix = list(range(1, 9))  # two full blocks
    a = make_req("a", prefix + [20, 21])
    assert admit(kv, a) == 0
    a_ids = kv.get_block_ids("a")
    b = make_req("b", prefix + [30, 31, 32])
    assert admit(kv, b) == 8
    assert b.num_tokens - 8 == 3  # the rest is computed
    b_ids = kv.get_block_ids("b")
    assert b_ids[:2] == a_ids[:2]  # shared, not copied
    assert b_ids[2] not in a_ids
    assert [kv.block_pool.blocks[i].ref_cnt for i in a_ids[:2]] == [2, 2]
    check_ref_counts(kv)
    kv.free(a)
    # a's private block is free, the shared ones are still held by b.
    assert [kv.block_pool.blocks[i].ref_cnt for i in a_ids[:2]] == [1, 1]
    assert kv.block_pool.blocks[a_ids[2]].ref_cnt == 0
    assert a_ids[0] not in kv.block_pool.free_block_queue
    check_ref_counts(kv)
    kv.free(b)
    assert kv.block_pool.get_num_free_blocks() == 10


def test_prefix_hit_is_whole_blocks_and_never_the_last_token():
    kv = KVCacheManager(10, BS)
    prompt = list(range(1, 13))  # exactly three full blocks
    admit(kv, make_req("a", prompt))
    # Identical prompt: the last token must be recomputed for its logits, so only the
    # first two blocks hit (the third holds the last token).
    b = make_req("b", prompt)
    hits, n = kv.get_computed_blocks(b)
    assert n == 8 and len(hits) == 2
    # One extra token: all three blocks hit.
    c = make_req("c", prompt + [99])
    assert kv.get_computed_blocks(c)[1] == 12
    # Shares 6 tokens: only one whole block.
    d = make_req("d", prompt[:6] + [77, 78, 79])
    assert kv.get_computed_blocks(d)[1] == 4
    # Prompt of one block plus nothing: no hit at all (its last token is in block 0).
    e = make_req("e", prompt[:4])
    assert kv.get_computed_blocks(e)[1] == 0


def test_same_block_after_different_prefix_does_not_hit():
    kv = KVCacheManager(10, BS)
    admit(kv, make_req("a", [1, 2, 3, 4, 5, 6, 7, 8, 9]))
    # Block 1 tokens [5..8] equal a's block 1, but block 0 differs: no hit anywhere.
    b = make_req("b", [1, 2, 3, 0, 5, 6, 7, 8, 9])
    hits, n = kv.get_computed_blocks(b)
    assert (hits, n) == ([], 0)
    # A hit stops at the first miss even if a later block's hash were cached.
    c = make_req("c", [1, 2, 3, 4, 0, 6, 7, 8, 9])
    assert kv.get_computed_blocks(c)[1] == 4


def test_partially_computed_blocks_are_not_cached():
    kv = KVCacheManager(10, BS)
    a = make_req("a", list(range(1, 14)))  # 13 tokens
    assert kv.allocate_slots(a, 6)  # a chunk of 6 tokens
    a.num_computed_tokens = 6
    kv.cache_blocks(a)
    assert len(kv.block_pool.cached_block_hash_to_block) == 1  # only block 0 is full+computed
    b = make_req("b", list(range(1, 14)))
    assert kv.get_computed_blocks(b)[1] == 4


def test_hit_revives_freed_blocks():
    kv = KVCacheManager(6, BS)
    prompt = list(range(1, 10))
    a = make_req("a", prompt)
    admit(kv, a)
    a_ids = kv.get_block_ids("a")
    kv.free(a)
    assert kv.block_pool.get_num_free_blocks() == 6
    b = make_req("b", prompt)
    assert admit(kv, b) == 8
    assert kv.get_block_ids("b")[:2] == a_ids[:2]
    assert kv.block_pool.get_num_free_blocks() == 3
    check_ref_counts(kv)


def test_prompt_logprobs_and_disabled_caching_skip_the_cache():
    kv = KVCacheManager(10, BS)
    prompt = list(range(1, 10))
    admit(kv, make_req("a", prompt))
    assert kv.get_computed_blocks(make_req("b", prompt, prompt_logprobs=0)) == ([], 0)
    off = KVCacheManager(10, BS, enable_caching=False)
    admit(off, make_req("a", prompt))
    assert off.block_pool.cached_block_hash_to_block == {}
    assert off.get_computed_blocks(make_req("b", prompt)) == ([], 0)


def test_hit_and_query_counters_in_tokens():
    kv = KVCacheManager(16, BS)
    prefix = list(range(1, 9))
    admit(kv, make_req("a", prefix + [1, 2]))  # 10 tokens, 0 hits
    admit(kv, make_req("b", prefix + [3, 4, 5]))  # 11 tokens, 8 hits
    admit(kv, make_req("c", [9] * 6))  # 6 tokens, 0 hits
    assert kv.prefix_cache_queries == 10 + 11 + 6
    assert kv.prefix_cache_hits == 8


def test_counters_never_negative_without_caching():
    # Regression: a retried admission used to be "undone" even when never counted.
    kv = KVCacheManager(2, BS, enable_caching=False)
    req = make_req("a", list(range(1, 40)))  # needs 5 blocks, only 2 exist
    hits, n_hit = kv.get_computed_blocks(req)
    assert not kv.allocate_slots(req, req.num_tokens - n_hit, hits)
    assert kv.prefix_cache_queries == 0 and kv.prefix_cache_hits == 0
    kv.record_prefix_query(req, 0)  # caching off: not counted
    assert kv.prefix_cache_queries == 0


def test_lru_evicts_least_recently_freed_prefix_first():
    # 4 blocks; two 2-block prompts (one full block each + a partial block).
    kv = KVCacheManager(4, BS)
    p1, p2 = [1, 2, 3, 4, 5], [6, 7, 8, 9, 10]
    a, b = make_req("a", p1), make_req("b", p2)
    admit(kv, a)
    admit(kv, b)
    kv.free(a)  # a's blocks become the LRU ones
    kv.free(b)
    # Need two blocks: the free queue front is a's partial block, then a's cached block.
    admit(kv, make_req("x", [50, 51, 52, 53, 54]))
    assert kv.get_computed_blocks(make_req("a2", p1))[1] == 0  # p1 evicted
    assert kv.get_computed_blocks(make_req("b2", p2))[1] == 4  # p2 still cached
    assert kv.block_pool.num_evictions == 1


def test_lru_evicts_a_prefix_tail_before_its_head():
    kv = KVCacheManager(4, BS)
    prompt = list(range(1, 14))  # 13 tokens: 3 full cached blocks + 1 partial
    a = make_req("a", prompt)
    admit(kv, a)
    assert len(kv.block_pool.cached_block_hash_to_block) == 3
    kv.free(a)
    # Take two blocks: the uncached partial block, then the prefix's LAST full block.
    y = make_req("y", [90, 91, 92, 93, 94])
    admit(kv, y)
    assert kv.block_pool.num_evictions == 1
    probe = make_req("p", prompt)
    assert kv.get_computed_blocks(probe)[1] == 8  # head blocks survive
    kv.free(y)
    z = make_req("z", [80] * 16)  # all 4 blocks
    admit(kv, z)
    assert kv.get_computed_blocks(make_req("p2", prompt))[1] == 0


@pytest.mark.parametrize("caching", [True, False])
def test_many_requests_ref_counts_stay_consistent(caching):
    kv = KVCacheManager(32, BS, enable_caching=caching)
    prefix = list(range(1, 13))
    reqs = [make_req(str(i), prefix[: 4 + 4 * (i % 3)] + [100 + i] * (i + 1)) for i in range(6)]
    for r in reqs:
        admit(kv, r)
        check_ref_counts(kv)
    for r in reqs[::2] + reqs[1::2]:
        kv.free(r)
        check_ref_counts(kv)
    assert kv.block_pool.get_num_free_blocks() == 32
