"""Helpers for looking at the paged KV cache (chapter 7 and its lab).

* :func:`fragment_pool` puts the block pool in the state a busy server leaves it in: the
  free blocks come back in no particular order, so a new request's block table is not
  ``[0, 1, 2, ...]``. A bug in a block table or a slot mapping can hide on a fresh pool
  (the identity table makes several wrong formulas right by accident); test on this one.
* :func:`record_block_tables` notes the block tables the engine builds, without changing
  any number (it runs the reference slot mapping).
"""

from __future__ import annotations

import contextlib

import torch

from minivllm.attention.metadata import slot_mapping_ref


def fragment_pool(llm, seed: int = 0) -> dict[int, int]:
    """Fill every free block of ``llm``'s pool with one-block requests (``block_size - 1``
    random prompt tokens each), compute them in one engine step, then abort them in a
    random order (``seed``), so the pool's free queue holds the block ids shuffled.

    Later allocations take blocks from the front of that queue: the tables of the next
    requests are non-contiguous, and each block still holds the K/V its filler wrote
    (stale data, as after real traffic). Requires an idle engine.

    Returns:
        ``{block_id: filler index}`` for the blocks the fillers held (the order they were
        freed in is the free queue: ``llm.llm_engine.kv_cache_manager.block_pool.
        free_block_queue``).
    Raises:
        ValueError: requests in flight, or a pool with more free blocks than
            ``max_num_seqs`` fillers can hold.
    """
    from minivllm.sampling_params import SamplingParams

    eng = llm.llm_engine
    if eng.has_unfinished_requests():
        raise ValueError("fragment_pool needs an idle engine (requests are in flight)")
    kv = eng.kv_cache_manager
    bs = kv.block_size
    n = kv.block_pool.get_num_free_blocks()
    if n > eng.scheduler_config.max_num_seqs:
        raise ValueError(f"{n} free blocks but max_num_seqs is "
                         f"{eng.scheduler_config.max_num_seqs}: one filler per block does "
                         "not fit in one step")
    g = torch.Generator().manual_seed(seed)
    vocab = eng.model_config.vocab_size
    rids = [eng.add_request(torch.randint(100, vocab, (max(bs - 1, 1),), generator=g).tolist(),
                            SamplingParams(temperature=0, max_tokens=2))
            for _ in range(n)]
    eng.step()
    owner = {b: i for i, r in enumerate(rids) for b in kv.get_block_ids(r)}
    for j in torch.randperm(n, generator=g).tolist():
        eng.abort_request(rids[j])
    for r in rids:
        eng.finished_outputs.pop(r, None)
    return owner


@contextlib.contextmanager
def record_block_tables(llm, fn=slot_mapping_ref):
    """Inside the block, note every one-sequence block table the engine hands to the
    "slot_mapping" step (a list of lists of block ids, in call order, consecutive repeats
    dropped), and compute the slots with ``fn`` (default: the reference, so every number
    is unchanged; pass another mapping to run it and see its tables)."""
    seen: list[list[int]] = []

    def spy(block_table, positions, block_size):
        if block_table.dim() == 1:
            t = block_table.tolist()
            if not seen or seen[-1] != t:
                seen.append(t)
        return fn(block_table, positions, block_size)

    with llm.swap_step("slot_mapping", spy):
        yield seen
