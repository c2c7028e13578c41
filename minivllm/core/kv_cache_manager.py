"""KV-cache manager: which blocks each request owns, prefix-cache lookups, block hashes.

Mirrors vLLM v1's ``vllm/v1/core/kv_cache_manager.py`` (one attention type, so vLLM's
"coordinator" layer is folded in here) and the hashing of ``vllm/v1/core/kv_cache_utils.py``.
The scheduler asks it for a request's cached prefix (:meth:`KVCacheManager.get_computed_blocks`),
for slots for the tokens it schedules (:meth:`KVCacheManager.allocate_slots`), to register
computed blocks (:meth:`KVCacheManager.cache_blocks`) and to free them; the blocks come
from :class:`~minivllm.core.block_pool.BlockPool`.

A full block is found by its *chained* hash, ``hash(parent hash, token ids, extra keys)``,
so equal hashes mean equal whole prefixes (:func:`hash_block_tokens`); what goes into the
key: :func:`block_extra_keys`; who may read the cache: :meth:`KVCacheManager.cache_hit_limit`.
Steps of :mod:`minivllm.steps` here: "block_hash", "block_hash.extra_keys",
"prefix_cache.lookup" (:func:`find_longest_cache_hit`).
"""

from __future__ import annotations

import hashlib
import struct
from typing import Optional

from minivllm.core.block_pool import BlockPool, KVCacheBlock
from minivllm.request import Request
from minivllm.utils import cdiv

BlockHash = bytes
_ROOT_HASH = b"minivllm-prefix-root"


def hash_block_tokens(parent_hash: Optional[BlockHash], token_ids: list[int],
                      extra_keys: tuple = ()) -> BlockHash:
    """Chained sha256 of (parent hash, token ids, extra keys). 32 bytes.

    The "block_hash" step's reference (:mod:`minivllm.steps`). ``parent_hash`` is None
    for a request's first block. vLLM: ``vllm/v1/core/kv_cache_utils.py:hash_block_tokens``."""
    h = hashlib.sha256()
    h.update(parent_hash if parent_hash is not None else _ROOT_HASH)
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    if extra_keys:
        h.update(repr(extra_keys).encode())
    return h.digest()


def block_extra_keys(cache_salt: Optional[str], block_index: int) -> tuple:
    """Extra keys of block ``block_index`` (0-based) of a request: ``(cache_salt,)`` for
    its first block when it has a salt, else ``()``.

    The "block_hash.extra_keys" step's reference (:mod:`minivllm.steps`). Only the first
    block needs the salt: every later hash is chained to it. vLLM:
    ``vllm/v1/core/kv_cache_utils.py:generate_block_hash_extra_keys`` (which also adds
    LoRA names and multimodal hashes; minivllm has neither).

    Anything that changes the K/V numbers of a block must be part of its key. Engine-wide
    settings (model, dtype, kv_cache_dtype) are the same for every request of one engine,
    so only per-request inputs matter, and the one here is ``cache_salt`` (vLLM's request
    field): requests with different salts never share a block."""
    return (cache_salt,) if block_index == 0 and cache_salt is not None else ()


def find_longest_cache_hit(block_hashes: list, cached, num_tokens: int,
                           block_size: int) -> int:
    """How many leading blocks of a request the prefix cache can serve.

    The "prefix_cache.lookup" step's reference (:mod:`minivllm.steps`).

    Args:
        block_hashes: the request's full-block hashes, first block first.
        cached: the cache's hashes (supports ``in``; it holds only blocks whose K/V has
            been written).
        num_tokens: tokens the lookup may cover plus one: at least the last of them is
            left to compute (its logits are needed), so at most
            ``(num_tokens - 1) // block_size`` blocks are served.
        block_size: tokens per block.
    Returns:
        the number of leading hashes that are all in ``cached`` (it stops at the first
        miss: a block is only valid after all of its prefix), capped as above.
    vLLM: ``find_longest_cache_hit`` in ``vllm/v1/core/single_type_kv_cache_manager.py``
    with ``max_cache_hit_length = num_tokens - 1`` (``kv_cache_manager.py``)."""
    max_blocks = max(num_tokens - 1, 0) // block_size
    n = 0
    for block_hash in block_hashes[:max_blocks]:
        if block_hash not in cached:
            break
        n += 1
    return n


class KVCacheManager:
    """Owns the BlockPool and the request -> blocks table.

    Args:
        num_blocks: total KV blocks.
        block_size: tokens per block.
        enable_caching: prefix caching on/off.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True):
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.hash_block_tokens = hash_block_tokens  # the "block_hash" step
        self.block_extra_keys = block_extra_keys  # the "block_hash.extra_keys" step
        self.find_longest_cache_hit = find_longest_cache_hit  # "prefix_cache.lookup"
        self.block_pool = BlockPool(num_blocks, enable_caching)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # Prefix-cache statistics in tokens (vLLM's prefix_cache_queries / hits).
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    # --- hashing ------------------------------------------------------------------
    def update_block_hashes(self, request: Request) -> None:
        """Extend ``request.block_hashes`` to cover all of its full blocks."""
        bs = self.block_size
        tokens = request.all_token_ids
        hashes = request.block_hashes
        while (len(hashes) + 1) * bs <= len(tokens):
            i = len(hashes)
            parent = hashes[-1] if hashes else None
            extra = self.block_extra_keys(request.cache_salt, i)
            hashes.append(self.hash_block_tokens(parent, tokens[i * bs:(i + 1) * bs], extra))

    # --- lookups ------------------------------------------------------------------
    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest cached prefix of a request that has no blocks yet.

        Returns (blocks, num_computed_tokens). At most :meth:`cache_hit_limit` tokens:
        at least the last token is always left to compute, because the engine needs its
        logits; requests with prompt_logprobs, and scoring requests without
        ``use_prefix_cache``, skip the lookup (see the module docstring).

        Raises:
            ValueError: a swapped "prefix_cache.lookup" step returned something other
                than a count in [0, what the limit allows] of cached leading blocks.
        """
        if not self._uses_cache(request):
            return [], 0
        self.update_block_hashes(request)
        limit = self.cache_hit_limit(request)
        hashes = request.block_hashes
        pool = self.block_pool
        n = self.find_longest_cache_hit(hashes, pool.cached_block_hash_to_block, limit + 1,
                                        self.block_size)
        max_blocks = limit // self.block_size
        if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= max_blocks:
            raise ValueError(f"the prefix_cache.lookup step returned {n!r}; expected an int in "
                             f"[0, {max_blocks}] (this request may reuse at most {limit} of "
                             f"its {request.num_tokens} tokens, block size {self.block_size})")
        hits = []
        for i, block_hash in enumerate(hashes[:n]):
            block = pool.get_cached_block(block_hash)
            if block is None:
                raise ValueError(f"the prefix_cache.lookup step counted {n} leading blocks as "
                                 f"cached, but block {i} of the request is not in the cache")
            hits.append(block)
        return hits, n * self.block_size

    def cache_hit_limit(self, request: Request) -> int:
        """The most tokens of ``request`` the prefix cache may serve (0: no lookup).

        ``num_tokens - 1`` for generation (the last token's logits are needed); for a
        score request with ``use_prefix_cache=True`` also at most its first wanted row that
        it does not hold yet (a row served from the cache is never computed). Requests
        with ``prompt_logprobs`` never read it (as vLLM v1, ``skip_reading_prefix_cache``:
        a position served from the cache is never run, so its prompt log-prob could not be
        computed), nor ``LLM.score`` requests without ``use_prefix_cache=True``."""
        if not self._uses_cache(request):
            return 0
        limit = request.num_tokens - 1
        if request.score is not None:
            limit = min(limit, request.score.first_needed())
        return max(limit, 0)

    def _uses_cache(self, request: Request) -> bool:
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return False
        return request.score is None or request.score.use_prefix_cache

    def record_prefix_query(self, request: Request, num_hit_tokens: int) -> None:
        """Count one (re)admission's lookup, in tokens (vLLM's prefix_cache_queries /
        hits). Called by the scheduler once the request is admitted, so a lookup that is
        retried next step is counted once; requests that skip the cache are not counted."""
        if self._uses_cache(request):
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += num_hit_tokens

    # --- allocation ---------------------------------------------------------------
    def num_blocks_needed(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: Optional[list[KVCacheBlock]] = None) -> bool:
        """Make room for ``num_new_tokens`` more tokens of ``request``.

        ``new_computed_blocks`` are prefix-cache hits for a newly admitted request; they
        are shared (ref count +1), not copied. Returns False, changing nothing, when the
        pool has too few free blocks.
        """
        new_computed_blocks = new_computed_blocks or []
        blocks = self.req_to_blocks.get(request.request_id, [])
        num_computed = request.num_computed_tokens + len(new_computed_blocks) * self.block_size
        total_needed = self.num_blocks_needed(num_computed + num_new_tokens)
        num_new_blocks = total_needed - len(blocks) - len(new_computed_blocks)
        # Cached hits that sit in the free queue must also come out of it.
        num_revived = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if num_new_blocks + num_revived > self.block_pool.get_num_free_blocks():
            return False
        if new_computed_blocks:
            self.block_pool.touch(new_computed_blocks)
        blocks = blocks + new_computed_blocks
        if num_new_blocks > 0:
            blocks = blocks + self.block_pool.get_new_blocks(num_new_blocks)
        self.req_to_blocks[request.request_id] = blocks
        return True

    def cache_blocks(self, request: Request) -> None:
        """Register the request's full, computed blocks in the prefix cache.

        Every request writes its full blocks once they are computed (called after the
        step, from the scheduler), never before: a block is findable only after the model
        wrote its K/V, so two requests of one step cannot hit each other's unwritten
        blocks (nano-vllm PR #209, vllm PR #7822)."""
        if not self.enable_caching:
            return
        self.update_block_hashes(request)
        blocks = self.req_to_blocks.get(request.request_id, [])
        num_full = min(request.num_computed_tokens // self.block_size, len(request.block_hashes))
        for i in range(num_full):
            self.block_pool.cache_block(blocks[i], request.block_hashes[i])

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first (so prefix heads are evicted last).

        A request whose logits held NaN/inf (``request.corrupted``) may have written NaN
        K/V: the blocks only it holds leave the prefix cache, so no later request with
        the same prefix reuses them."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        if request.corrupted:
            for block in blocks:
                if block.ref_cnt == 1:
                    self.block_pool.uncache_block(block)
        self.block_pool.free_blocks(reversed(blocks))

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, [])]

    @property
    def usage(self) -> float:
        return self.block_pool.get_usage()

    def reset_prefix_cache(self) -> bool:
        return self.block_pool.reset_prefix_cache()
