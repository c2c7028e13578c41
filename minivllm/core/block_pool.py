"""The block pool: every KV-cache block, its reference count, and the prefix-cache index.

Mirrors vLLM v1's ``vllm/v1/core/block_pool.py``:

* A block is a fixed number (``block_size``) of token slots in every layer's K and V cache.
* ``ref_cnt`` counts the running requests using a block. A block with ``ref_cnt == 0`` is
  in the free queue. It may still hold a *cached* prefix (it keeps its ``block_hash``) and
  be revived by a later request with the same prefix, until it is reused for new data.
* The free queue is ordered least-recently-freed first, so the LRU cached block is
  evicted first. Requests free their blocks tail first, so a prefix's last block is
  evicted before its first.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Iterable, Optional


@dataclass(eq=False)
class KVCacheBlock:
    """One block of the paged KV cache.

    Attributes:
        block_id: index into the cache tensors (slot = block_id * block_size + offset).
        ref_cnt: number of requests using the block.
        block_hash: prefix-cache key of the block's full contents, or None.
    """

    block_id: int
    ref_cnt: int = 0
    block_hash: Optional[bytes] = None


class BlockPool:
    """Allocates, shares and frees KV-cache blocks; keeps the prefix-cache map.

    Args:
        num_blocks: total blocks (> 0).
        enable_caching: keep freed full blocks findable by hash.
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_block_queue: OrderedDict[int, KVCacheBlock] = OrderedDict(
            (b.block_id, b) for b in self.blocks)
        self.cached_block_hash_to_block: dict[bytes, KVCacheBlock] = {}
        self.num_evictions = 0

    # --- queries ------------------------------------------------------------------
    def get_num_free_blocks(self) -> int:
        """Blocks with ref_cnt 0 (cached-but-unused blocks count as free)."""
        return len(self.free_block_queue)

    def get_usage(self) -> float:
        """Fraction of blocks in use by requests, in [0, 1]."""
        return 1.0 - self.get_num_free_blocks() / self.num_blocks

    def get_cached_block(self, block_hash: bytes) -> Optional[KVCacheBlock]:
        return self.cached_block_hash_to_block.get(block_hash)

    # --- allocation ---------------------------------------------------------------
    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take ``num_blocks`` blocks from the front of the free queue (LRU first).

        A taken block that still held a cached prefix is evicted from the cache index.
        Raises:
            ValueError: fewer free blocks than requested (callers check first).
        """
        if num_blocks > self.get_num_free_blocks():
            raise ValueError(f"Cannot get {num_blocks} free blocks from the pool "
                             f"({self.get_num_free_blocks()} free)")
        out = []
        for _ in range(num_blocks):
            _, block = self.free_block_queue.popitem(last=False)
            self._maybe_evict(block)
            assert block.ref_cnt == 0
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on blocks found in the prefix cache (reviving free ones)."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self.free_block_queue[block.block_id]
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference from each block; blocks reaching 0 join the free queue's
        tail in the given order (callers pass a request's blocks tail first)."""
        for block in ordered_blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"double free of block {block.block_id}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_block_queue[block.block_id] = block

    def cache_block(self, block: KVCacheBlock, block_hash: bytes) -> None:
        """Register a full block under its hash. If the hash is already cached by another
        block (two requests computed the same prefix at once) the first one stays."""
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash in self.cached_block_hash_to_block:
            return
        block.block_hash = block_hash
        self.cached_block_hash_to_block[block_hash] = block

    def uncache_block(self, block: KVCacheBlock) -> None:
        """Remove a block from the prefix cache (its contents must not be reused); not
        counted as an eviction."""
        if block.block_hash is not None \
                and self.cached_block_hash_to_block.get(block.block_hash) is block:
            del self.cached_block_hash_to_block[block.block_hash]
        block.block_hash = None

    def _maybe_evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is None:
            return
        if self.cached_block_hash_to_block.get(block.block_hash) is block:
            del self.cached_block_hash_to_block[block.block_hash]
            self.num_evictions += 1
        block.block_hash = None

    def reset_prefix_cache(self) -> bool:
        """Forget all cached prefixes; only allowed when no block is in use."""
        if self.get_num_free_blocks() != self.num_blocks:
            return False
        for block in self.blocks:
            block.block_hash = None
        self.cached_block_hash_to_block.clear()
        return True
