"""BlockPool: allocation, reference counts, the LRU free queue and the prefix-cache map."""

from __future__ import annotations

import pytest

from minivllm.core.block_pool import BlockPool


def free_ids(pool: BlockPool) -> list[int]:
    """Block ids in the free queue, front (next to be taken) first."""
    return list(pool.free_block_queue)


def check_invariants(pool: BlockPool) -> None:
    """The free queue holds exactly the blocks with ref_cnt 0; the map points at blocks
    that carry that hash."""
    in_queue = set(pool.free_block_queue)
    for b in pool.blocks:
        assert b.ref_cnt >= 0, b
        assert (b.ref_cnt == 0) == (b.block_id in in_queue), b
    for h, b in pool.cached_block_hash_to_block.items():
        assert b.block_hash == h, (h, b)
    assert pool.get_num_free_blocks() == sum(b.ref_cnt == 0 for b in pool.blocks)


def test_rejects_empty_pool():
    with pytest.raises(ValueError):
        BlockPool(0)


def test_new_pool_is_all_free():
    pool = BlockPool(5)
    assert pool.get_num_free_blocks() == 5
    assert pool.get_usage() == 0.0
    assert free_ids(pool) == [0, 1, 2, 3, 4]
    assert all(b.ref_cnt == 0 and b.block_hash is None for b in pool.blocks)
    check_invariants(pool)


def test_get_new_blocks_takes_from_front_with_ref_one():
    pool = BlockPool(5)
    got = pool.get_new_blocks(3)
    assert [b.block_id for b in got] == [0, 1, 2]
    assert all(b.ref_cnt == 1 for b in got)
    assert pool.get_num_free_blocks() == 2
    assert free_ids(pool) == [3, 4]
    assert pool.get_usage() == pytest.approx(3 / 5)
    check_invariants(pool)


def test_get_new_blocks_too_many_raises_and_changes_nothing():
    pool = BlockPool(4)
    pool.get_new_blocks(3)
    before = (free_ids(pool), [b.ref_cnt for b in pool.blocks])
    with pytest.raises(ValueError):
        pool.get_new_blocks(2)
    assert (free_ids(pool), [b.ref_cnt for b in pool.blocks]) == before
    check_invariants(pool)


def test_free_returns_blocks_to_tail_in_given_order():
    pool = BlockPool(6)
    a = pool.get_new_blocks(3)  # 0,1,2
    pool.free_blocks(reversed(a))
    # 3,4,5 were never used and stay in front; the freed ones join the tail, 2 first.
    assert free_ids(pool) == [3, 4, 5, 2, 1, 0]
    assert all(b.ref_cnt == 0 for b in a)
    check_invariants(pool)


def test_double_free_raises():
    pool = BlockPool(3)
    (b,) = pool.get_new_blocks(1)
    pool.free_blocks([b])
    n_free = pool.get_num_free_blocks()
    with pytest.raises(RuntimeError, match="double free"):
        pool.free_blocks([b])
    assert b.ref_cnt == 0
    assert pool.get_num_free_blocks() == n_free == 3
    check_invariants(pool)


def test_free_of_never_allocated_block_raises():
    pool = BlockPool(2)
    with pytest.raises(RuntimeError):
        pool.free_blocks([pool.blocks[0]])


def test_shared_block_ref_counts():
    pool = BlockPool(4)
    (b,) = pool.get_new_blocks(1)
    pool.cache_block(b, 1234)
    pool.touch([b])  # a second request shares it
    assert b.ref_cnt == 2
    pool.free_blocks([b])  # the first request leaves
    assert b.ref_cnt == 1
    assert b.block_id not in pool.free_block_queue
    assert pool.get_num_free_blocks() == 3
    pool.free_blocks([b])
    assert b.ref_cnt == 0
    assert pool.get_num_free_blocks() == 4
    # Still findable by hash while it sits in the free queue.
    assert pool.get_cached_block(1234) is b
    check_invariants(pool)


def test_touch_revives_a_free_cached_block():
    pool = BlockPool(4)
    (b,) = pool.get_new_blocks(1)
    pool.cache_block(b, 99)
    pool.free_blocks([b])
    assert pool.get_num_free_blocks() == 4
    pool.touch([pool.get_cached_block(99)])
    assert b.ref_cnt == 1
    assert b.block_id not in pool.free_block_queue
    assert pool.get_num_free_blocks() == 3
    # It is not handed out again while in use.
    others = pool.get_new_blocks(3)
    assert b not in others
    check_invariants(pool)


def test_cache_block_first_writer_wins_and_no_rehash():
    pool = BlockPool(4)
    b1, b2 = pool.get_new_blocks(2)
    pool.cache_block(b1, 7)
    pool.cache_block(b2, 7)  # same content computed twice at once: first stays
    assert pool.get_cached_block(7) is b1
    assert b2.block_hash is None
    pool.cache_block(b1, 8)  # a block is registered once
    assert b1.block_hash == 7
    assert pool.get_cached_block(8) is None
    check_invariants(pool)


def test_caching_disabled_registers_nothing():
    pool = BlockPool(3, enable_caching=False)
    (b,) = pool.get_new_blocks(1)
    pool.cache_block(b, 5)
    assert b.block_hash is None
    assert pool.get_cached_block(5) is None


def test_reusing_a_cached_block_evicts_it():
    pool = BlockPool(2)
    b0, b1 = pool.get_new_blocks(2)
    pool.cache_block(b0, 10)
    pool.cache_block(b1, 11)
    pool.free_blocks([b1, b0])  # free queue: 1, 0
    assert pool.num_evictions == 0
    (x,) = pool.get_new_blocks(1)
    assert x is b1  # least recently freed first
    assert x.block_hash is None
    assert pool.get_cached_block(11) is None
    assert pool.get_cached_block(10) is b0
    assert pool.num_evictions == 1
    check_invariants(pool)


def test_lru_eviction_order_over_several_frees():
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(4)
    for i, b in enumerate(blocks):
        pool.cache_block(b, 100 + i)
    # Free in the order 2, 0, 3, 1: that is the eviction order.
    for i in (2, 0, 3, 1):
        pool.free_blocks([blocks[i]])
    evicted = []
    for _ in range(4):
        still = {h for h in range(100, 104) if pool.get_cached_block(h) is not None}
        pool.get_new_blocks(1)
        now = {h for h in range(100, 104) if pool.get_cached_block(h) is not None}
        (gone,) = still - now
        evicted.append(gone - 100)
    assert evicted == [2, 0, 3, 1]
    assert pool.num_evictions == 4


def test_reset_prefix_cache_only_when_idle():
    pool = BlockPool(3)
    b0, b1 = pool.get_new_blocks(2)
    pool.cache_block(b0, 1)
    pool.free_blocks([b0])
    assert pool.reset_prefix_cache() is False  # b1 is in use
    assert pool.get_cached_block(1) is b0
    pool.free_blocks([b1])
    assert pool.reset_prefix_cache() is True
    assert pool.get_cached_block(1) is None
    assert all(b.block_hash is None for b in pool.blocks)
    check_invariants(pool)
