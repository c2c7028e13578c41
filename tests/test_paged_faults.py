"""Chapter 7's paged-attention faults and helpers, on the tiny random Llama:
the "slot_mapping.read" step changes the reader only; faults.off_by_one_slots is exact
below one block in decode mode and wrong from the first boundary; faults.zeroed_block_tables
(vllm #5543 / PR #7018) hits the rows without a prefix hit only when a row with one shares
their step; faults.reader_block_size is invisible on an identity table; paging.fragment_pool
leaves the pool free with non-contiguous tables for the next request. Expected values come
from the engine's own clean runs (and from slot arithmetic written out here), not from the
code under test."""

from __future__ import annotations

import pytest
import torch

from minivllm import LLM, SamplingParams
from minivllm.attention.metadata import slot_mapping_ref
from minivllm.precision import faults
from minivllm.precision.paging import fragment_pool, record_block_tables

pytestmark = pytest.mark.usefixtures("one_thread")

BS = 4
IDS = [5 + (7 * i) % 90 for i in range(14)]  # 14 tokens: boundaries at 4, 8, 12


def _llm(tiny_model_dir, blocks=16):
    return LLM(str(tiny_model_dir), dtype="float32", max_model_len=48, block_size=BS,
               num_gpu_blocks_override=blocks, seed=0)


def test_read_step_swaps_the_reader_only(tiny_model_dir):
    llm = _llm(tiny_model_dir)
    runner = llm.llm_engine.model_runner
    calls = []

    def spy(table, positions, block_size):
        calls.append(table.dim())
        return slot_mapping_ref(table, positions, block_size)

    want = [llm.score(IDS, mode=m, output="logits") for m in ("prefill", "decode")]
    with llm.swap_step("slot_mapping.read", spy):
        assert runner.slot_mapping is slot_mapping_ref and runner.read_slot_mapping is spy
        got = [llm.score(IDS, mode=m, output="logits") for m in ("prefill", "decode")]
    assert runner.read_slot_mapping is slot_mapping_ref
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert 1 in calls and 2 in calls  # a prefill read (one table) and decode reads (a batch)


def test_off_by_one_is_exact_below_one_block_in_decode_then_wrong(tiny_model_dir):
    llm = _llm(tiny_model_dir)
    clean = llm.score(IDS, mode="decode", output="logits")
    with faults.off_by_one_slots(llm):
        bad = llm.score(IDS, mode="decode", output="logits")
    assert torch.equal(bad[:BS], clean[:BS])
    assert not torch.equal(bad[BS], clean[BS])  # position 4 overwrote position 0's K/V
    assert torch.equal(llm.score(IDS, mode="decode", output="logits"), clean)  # restored
    # the formula, written out: only the first token of blocks after the first moves
    table = torch.tensor([9, 2, 7, 4])
    pos = torch.arange(14)
    slots = faults.slot_mapping_off_by_one(table, pos, BS)
    right = torch.tensor([9 * 4 + p % 4 if p < 4 else [9, 2, 7, 4][p // 4] * 4 + p % 4
                          for p in range(14)])
    moved = [p for p in range(14) if slots[p] != right[p]]
    assert moved == [4, 8, 12]
    assert slots[4] == right[0] and slots[8] == right[4]


def test_zeroed_block_tables_needs_a_hit_in_the_same_step(tiny_model_dir):
    llm = _llm(tiny_model_dir, blocks=24)
    eng = llm.llm_engine
    prefix = [11 + i for i in range(8)]  # two full blocks
    hit_req = prefix + [60, 61, 62]
    fresh = [30 + (5 * i) % 40 for i in range(10)]

    def fresh_rows_beside(warm: bool):
        if warm:
            llm.generate([prefix + [70]], SamplingParams(temperature=0, max_tokens=1))
        eng.add_request(hit_req, SamplingParams(temperature=0, max_tokens=1))
        req = eng.add_score_request(fresh, logits=True)
        hits = eng.kv_cache_manager.prefix_cache_hits
        while eng.has_unfinished_requests():
            eng.step()
        eng.finished_outputs.clear()
        return req.score.result(), eng.kv_cache_manager.prefix_cache_hits - hits

    warm_ok, hits_ok = fresh_rows_beside(True)
    assert eng.reset_prefix_cache()
    cold_ok, _ = fresh_rows_beside(False)
    with faults.zeroed_block_tables(llm):
        cold_bad, hits_cold = fresh_rows_beside(False)
        warm_bad, hits_bad = fresh_rows_beside(True)
    assert hits_ok == hits_bad == 8 and hits_cold == 0
    assert torch.equal(cold_bad, cold_ok)  # no hit in the step: no bug
    assert not torch.equal(warm_bad[0], warm_ok[0])  # wrong from the first position


def test_reader_block_size_is_invisible_on_an_identity_table(tiny_model_dir):
    llm = _llm(tiny_model_dir)
    with record_block_tables(llm) as seen, faults.reader_block_size(llm, 2 * BS):
        first = llm.score(IDS, output="logits")  # a fresh pool: table [0, 1, 2, 3]
    assert seen[0] == [0, 1, 2, 3]
    want = llm.score(IDS, output="logits")
    assert torch.equal(first, want)
    fragment_pool(llm, seed=1)
    try:
        with faults.reader_block_size(llm, 2 * BS):
            second = llm.score(IDS, output="logits")
        assert not torch.equal(second, want)
    except IndexError:
        pass  # past the end of the pool: also a failure, the loud kind
    assert not llm.llm_engine.has_unfinished_requests()


def test_fragment_pool_scatters_the_next_tables_and_frees_everything(tiny_model_dir):
    llm = _llm(tiny_model_dir)
    want = llm.score(IDS, output="logits")
    owner = fragment_pool(llm, seed=0)
    pool = llm.llm_engine.kv_cache_manager.block_pool
    assert sorted(owner) == list(range(16)) and pool.get_num_free_blocks() == 16
    with record_block_tables(llm) as seen:
        got = llm.score(IDS, output="logits")
    table = seen[0]
    assert len(table) == 4 and any(b - a != 1 for a, b in zip(table, table[1:]))
    assert torch.equal(got, want)  # the correct mapping does not care where blocks are
    rid = llm.llm_engine.add_request(IDS, SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match="idle"):
        fragment_pool(llm)
    llm.llm_engine.abort_request(rid)
