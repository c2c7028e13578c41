"""Scheduler driven directly: token budget, max_num_seqs, chunked prefill, FCFS order,
running-before-waiting, recompute preemption. A fake "model step" advances
num_computed_tokens (update_after_step) and appends one token to every request whose
whole sequence is computed, as the engine does."""

from __future__ import annotations

import pytest

from minivllm.config import SchedulerConfig
from minivllm.core.kv_cache_manager import KVCacheManager
from minivllm.core.scheduler import Scheduler, SchedulerOutput
from minivllm.request import Request, RequestStatus
from minivllm.sampling_params import SamplingParams

BS = 4


def make_sched(*, num_blocks=64, budget=32, max_num_seqs=8, chunked=True, caching=False,
               max_model_len=256) -> Scheduler:
    cfg = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                          max_model_len=max_model_len, enable_chunked_prefill=chunked)
    return Scheduler(cfg, KVCacheManager(num_blocks, BS, enable_caching=caching))


def make_req(rid: str, prompt_len: int, max_tokens: int = 4, first: int = 1) -> Request:
    tokens = [(first + i) % 1000 + 1 for i in range(prompt_len)]
    return Request(rid, tokens, SamplingParams(max_tokens=max_tokens), max_model_len=256)


def check_invariants(s: Scheduler, out: SchedulerOutput) -> None:
    kv = s.kv_cache_manager
    budget = s.config.max_num_batched_tokens
    assert out.num_batched_tokens == sum(n for _, n in out.scheduled)
    assert out.num_batched_tokens <= budget, (out.num_batched_tokens, budget)
    assert len(s.running) <= s.config.max_num_seqs
    ids = [r.request_id for r, _ in out.scheduled]
    assert len(ids) == len(set(ids)), ids
    for req, n in out.scheduled:
        assert n > 0
        assert req in s.running and req.status == RequestStatus.RUNNING
        assert req.num_computed_tokens + n <= req.num_tokens
        # Blocks cover every token that will have K/V after this step.
        assert len(kv.req_to_blocks[req.request_id]) * BS >= req.num_computed_tokens + n
    for req in s.waiting:
        assert req.request_id not in kv.req_to_blocks, req  # waiting requests hold no blocks
        assert req.num_computed_tokens == 0
    # Ref counts equal the number of tables holding each block.
    counts = {b.block_id: 0 for b in kv.block_pool.blocks}
    for blocks in kv.req_to_blocks.values():
        for b in blocks:
            counts[b.block_id] += 1
    assert {b.block_id: b.ref_cnt for b in kv.block_pool.blocks} == counts


def step(s: Scheduler, finished: list[Request] | None = None) -> SchedulerOutput:
    """One scheduler step plus a fake model: returns the schedule."""
    out = s.schedule()
    check_invariants(s, out)
    s.update_after_step(out.scheduled)
    for req, _ in out.scheduled:
        if req.num_computed_tokens == req.num_tokens:  # a token is sampled
            req.append_output_token(500 + req.num_output_tokens)
            if req.num_output_tokens >= req.params.max_tokens:
                s.finish_request(req, RequestStatus.FINISHED_LENGTH)
                if finished is not None:
                    finished.append(req)
    return out


def run_to_completion(s: Scheduler, max_steps: int = 1000) -> tuple[list[SchedulerOutput], list[Request]]:
    outs, finished = [], []
    for _ in range(max_steps):
        if not s.has_unfinished_requests():
            break
        outs.append(step(s, finished))
    assert not s.has_unfinished_requests(), "did not finish"
    return outs, finished


def assert_all_free(s: Scheduler) -> None:
    kv = s.kv_cache_manager
    assert kv.block_pool.get_num_free_blocks() == kv.block_pool.num_blocks
    assert kv.req_to_blocks == {}
    assert s.requests == {} and not s.running and not s.waiting


# --- budget and limits ----------------------------------------------------------------

def test_token_budget_is_never_exceeded_and_all_tokens_are_computed():
    s = make_sched(budget=16, max_num_seqs=6, num_blocks=128)
    reqs = [make_req(str(i), plen, max_tokens=mt, first=10 * i)
            for i, (plen, mt) in enumerate([(3, 5), (40, 3), (7, 8), (17, 2), (1, 6), (29, 4)])]
    for r in reqs:
        s.add_request(r)
    outs, finished = run_to_completion(s)
    assert max(o.num_batched_tokens for o in outs) == 16  # the budget was the binding limit
    per_req = {r.request_id: 0 for r in reqs}
    for o in outs:
        for r, n in o.scheduled:
            per_req[r.request_id] += n
    for r in reqs:
        assert r.num_output_tokens == r.params.max_tokens
        # Each token computed exactly once (no preemption here): prompt + outputs but
        # the last sampled token, which never needs K/V.
        assert per_req[r.request_id] == r.num_prompt_tokens + r.params.max_tokens - 1
    assert s.num_preemptions == 0
    assert_all_free(s)


def test_max_num_seqs_is_respected():
    s = make_sched(budget=64, max_num_seqs=2)
    reqs = [make_req(str(i), 3, max_tokens=3, first=10 * i) for i in range(5)]
    for r in reqs:
        s.add_request(r)
    out = step(s)
    assert [r.request_id for r, _ in out.scheduled] == ["0", "1"]
    assert s.num_running == 2 and s.num_waiting == 3
    outs, _ = run_to_completion(s)
    assert all(len(o.scheduled) <= 2 for o in outs)
    assert_all_free(s)


# --- chunked prefill ------------------------------------------------------------------

def test_chunked_prefill_splits_prompt_into_budget_sized_chunks():
    s = make_sched(budget=16, chunked=True)
    r = make_req("long", 50, max_tokens=3)
    s.add_request(r)
    chunks = []
    for _ in range(4):
        out = step(s)
        (req, n), = out.scheduled
        chunks.append(n)
        if n != 2:
            assert r.num_output_tokens == 0  # a partial prefill samples nothing
    assert chunks == [16, 16, 16, 2]
    assert r.num_computed_tokens == 50 and r.num_output_tokens == 1
    out = step(s)
    assert [n for _, n in out.scheduled] == [1]  # then decodes
    run_to_completion(s)
    assert_all_free(s)


def test_chunked_prefill_fills_the_leftover_budget():
    s = make_sched(budget=10, chunked=True)
    a, b = make_req("a", 6, max_tokens=5), make_req("b", 20, max_tokens=2, first=100)
    s.add_request(a)
    s.add_request(b)
    out = step(s)
    assert [(r.request_id, n) for r, n in out.scheduled] == [("a", 6), ("b", 4)]
    out = step(s)
    assert [(r.request_id, n) for r, n in out.scheduled] == [("a", 1), ("b", 9)]
    run_to_completion(s)
    assert_all_free(s)


def test_without_chunking_a_long_prompt_waits():
    s = make_sched(budget=16, chunked=False)
    r = make_req("long", 20)
    s.add_request(r)
    out = step(s)
    assert out.is_empty and out.num_batched_tokens == 0
    assert list(s.waiting) == [r] and r.status == RequestStatus.WAITING
    assert r.request_id not in s.kv_cache_manager.req_to_blocks


def test_without_chunking_a_prompt_waits_for_budget_then_runs_whole():
    s = make_sched(budget=16, chunked=False)
    a = make_req("a", 4, max_tokens=3)
    b = make_req("b", 16, max_tokens=2, first=100)
    s.add_request(a)
    s.add_request(b)
    out = step(s)  # a's 4 tokens; b (16) does not fit in the 12 left and is not chunked
    assert [(r.request_id, n) for r, n in out.scheduled] == [("a", 4)]
    out = step(s)  # a's decode takes 1: still no room for 16
    assert [(r.request_id, n) for r, n in out.scheduled] == [("a", 1)]
    out = step(s)  # a finishes on this decode ...
    assert [(r.request_id, n) for r, n in out.scheduled] == [("a", 1)]
    out = step(s)  # ... so b runs whole
    assert [(r.request_id, n) for r, n in out.scheduled] == [("b", 16)]
    run_to_completion(s)
    assert_all_free(s)


def test_prefix_cache_counters_count_an_admission_once():
    """A request that waits a step for budget (chunking off) is counted in
    prefix_cache_queries/hits once, when it is admitted, not once per step it waited."""
    s = make_sched(budget=16, chunked=False, caching=True)
    kv = s.kv_cache_manager
    shared = list(range(1, 9))  # two full blocks
    p = Request("p", shared + [40], SamplingParams(max_tokens=1), max_model_len=256)
    s.add_request(p)
    run_to_completion(s)  # caches the shared prefix
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (9, 0)
    a = make_req("a", 6, max_tokens=3, first=300)
    b = Request("b", shared + list(range(60, 72)), SamplingParams(max_tokens=2),
                max_model_len=256)  # 20 tokens, 8 cached: 12 to compute
    s.add_request(a)
    s.add_request(b)
    out = step(s)  # a takes 6; b's 12 do not fit in the 10 left
    assert [r.request_id for r, _ in out.scheduled] == ["a"]
    out = step(s)  # a's decode takes 1; b's 12 fit in 15
    assert [(r.request_id, n) for r, n in out.scheduled] == [("a", 1), ("b", 12)]
    run_to_completion(s)
    assert kv.prefix_cache_queries == 9 + 6 + 20
    assert kv.prefix_cache_hits == 8


# --- order ----------------------------------------------------------------------------

def test_running_requests_are_scheduled_before_waiting_ones():
    s = make_sched(budget=8, chunked=True)
    a = make_req("a", 20, max_tokens=2)
    s.add_request(a)
    step(s)  # a: 8 of 20
    b = make_req("b", 3, first=100)
    s.add_request(b)
    out = step(s)  # the running chunked prefill keeps the whole budget
    assert [(r.request_id, n) for r, n in out.scheduled] == [("a", 8)]
    out = step(s)  # a's last 4, then b gets the rest
    assert [(r.request_id, n) for r, n in out.scheduled] == [("a", 4), ("b", 3)]
    out = step(s)  # a decodes first, b decodes after it
    assert [r.request_id for r, _ in out.scheduled] == ["a", "b"]


def test_fcfs_admission_and_completion_order():
    s = make_sched(budget=64, max_num_seqs=1)
    reqs = [make_req(f"r{i}", 2 + (5 - i), max_tokens=2, first=7 * i) for i in range(5)]
    for r in reqs:
        s.add_request(r)
    admitted = []
    outs, finished = run_to_completion(s)
    for o in outs:
        for r, _ in o.scheduled:
            if r.request_id not in admitted:
                admitted.append(r.request_id)
    assert admitted == [r.request_id for r in reqs]
    assert [r.request_id for r in finished] == [r.request_id for r in reqs]


def test_duplicate_request_id_is_rejected():
    s = make_sched()
    s.add_request(make_req("x", 3))
    with pytest.raises(ValueError, match="already"):
        s.add_request(make_req("x", 3))
    assert s.num_waiting == 1


# --- preemption -----------------------------------------------------------------------

def test_preemption_when_blocks_run_out():
    # 6 blocks of 4 tokens; three 8-token prompts take all of them.
    s = make_sched(num_blocks=6, budget=64)
    a, b, c = (make_req(n, 8, max_tokens=6, first=100 * i) for i, n in enumerate("abc"))
    for r in (a, b, c):
        s.add_request(r)
    out = step(s)  # three prefills, each samples token 9 of its sequence
    assert [r.request_id for r, _ in out.scheduled] == ["a", "b", "c"]
    assert s.kv_cache_manager.block_pool.get_num_free_blocks() == 0
    d = make_req("d", 2, max_tokens=1, first=900)
    s.add_request(d)
    out = step(s)  # a needs a third block: the newest running request (c) is preempted
    assert out.preempted == [c]
    assert [r.request_id for r, _ in out.scheduled] == ["a", "b"]
    assert s.num_preemptions == 1 and c.num_preemptions == 1
    assert c.status == RequestStatus.PREEMPTED and c.num_computed_tokens == 0
    assert list(s.waiting) == [c, d]  # front of the queue, ahead of d
    assert c.request_id not in s.kv_cache_manager.req_to_blocks
    assert c.output_token_ids == [500]  # what it generated is kept
    outs, finished = run_to_completion(s)
    # c resumed: its first schedule after preemption recomputes prompt + output (9 tokens)
    resumed = [n for o in outs for r, n in o.scheduled if r is c]
    assert resumed[0] == 9
    assert all(r.num_output_tokens == r.params.max_tokens for r in (a, b, c, d))
    assert c.output_token_ids == [500 + i for i in range(6)]
    assert s.num_preemptions >= 1
    assert_all_free(s)


def test_no_admission_in_a_step_that_preempted():
    s = make_sched(num_blocks=4, budget=64)
    a, b = make_req("a", 8, max_tokens=4), make_req("b", 8, max_tokens=4, first=50)
    s.add_request(a)
    s.add_request(b)
    step(s)
    s.add_request(make_req("w", 1, first=90))
    out = step(s)
    assert out.preempted == [b]
    assert [r.request_id for r, _ in out.scheduled] == ["a"]
    assert [r.request_id for r in s.waiting] == ["b", "w"]


def test_a_request_can_preempt_itself_when_it_is_the_newest():
    s = make_sched(num_blocks=4, budget=64)
    a, b = make_req("a", 7, max_tokens=3), make_req("b", 8, max_tokens=3, first=50)
    s.add_request(a)
    s.add_request(b)
    step(s)  # a: 7 tokens + 1 sampled (8), b: 8 + 1 (9); 2 blocks each, pool full
    out = step(s)  # a's decode fits its 2 blocks; b needs a third and is the newest
    assert out.preempted == [b] and [r for r, _ in out.scheduled] == [a]
    assert list(s.waiting) == [b] and b.num_computed_tokens == 0
    outs, _ = run_to_completion(s)
    assert s.num_preemptions >= 1
    assert_all_free(s)


def test_many_requests_under_pressure_all_complete_with_caching():
    s = make_sched(num_blocks=12, budget=24, max_num_seqs=6, caching=True)
    shared = list(range(1, 9))
    reqs = []
    for i in range(8):
        tokens = shared + [200 + i] * (3 + i % 4)
        reqs.append(Request(str(i), tokens, SamplingParams(max_tokens=10), max_model_len=256))
    for r in reqs:
        s.add_request(r)
    outs, finished = run_to_completion(s)
    assert s.num_preemptions > 0
    preempted = [r for r in reqs if r.num_preemptions > 0]
    assert preempted
    for r in reqs:
        assert r.output_token_ids == [500 + i for i in range(10)], r
    assert s.kv_cache_manager.prefix_cache_hits > 0
    assert_all_free(s)
