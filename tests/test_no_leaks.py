"""Every way a request can end gives all of its KV blocks back and leaves no state
behind: finished (length, stop string, stop token), aborted mid-run, preempted and
resumed, failed inside a step, rejected in a batch."""

from __future__ import annotations

import pytest
import torch

from minivllm import LLM, SamplingParams

BLOCK = 4


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def prompts(tiny_hf_model):
    g = torch.Generator().manual_seed(5)
    vocab = tiny_hf_model.config.vocab_size
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (9, 23, 4, 31, 14, 17)]


def make_llm(model_dir, **kw) -> LLM:
    kw.setdefault("block_size", BLOCK)
    kw.setdefault("max_model_len", 64)
    kw.setdefault("num_gpu_blocks_override", 64)
    kw.setdefault("dtype", "float32")
    return LLM(model=str(model_dir), **kw)


def assert_no_leaks(llm: LLM, *, outputs_too: bool = True) -> None:
    engine = llm.llm_engine
    st = llm.stats
    assert st.num_free_blocks == st.num_total_blocks, \
        f"{st.num_total_blocks - st.num_free_blocks} of {st.num_total_blocks} blocks still held"
    assert engine.scheduler.requests == {}
    assert not engine.scheduler.running and not engine.scheduler.waiting
    assert engine.kv_cache_manager.req_to_blocks == {}
    assert all(b.ref_cnt == 0 for b in engine.kv_cache_manager.block_pool.blocks)
    assert st.kv_cache_usage == 0.0
    if outputs_too:
        kept = sorted(engine.finished_outputs)
        assert kept == [], f"outputs of requests {kept} are kept in engine.finished_outputs"


def greedy(max_tokens=8, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


@pytest.mark.parametrize("caching", [True, False])
def test_finished_by_length(tiny_model_dir, prompts, caching):
    llm = make_llm(tiny_model_dir, enable_prefix_caching=caching, max_num_batched_tokens=16)
    outs = llm.generate(prompts, greedy(max_tokens=7))
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
    assert all(len(o.outputs[0].token_ids) == 7 for o in outs)
    assert_no_leaks(llm)


def test_finished_by_max_model_len(tiny_model_dir, prompts):
    llm = make_llm(tiny_model_dir, max_model_len=40, num_gpu_blocks_override=12)
    (out,) = llm.generate([prompts[3]], SamplingParams(temperature=0, max_tokens=None,
                                                       ignore_eos=True))
    assert out.outputs[0].finish_reason == "length"
    assert len(prompts[3]) + len(out.outputs[0].token_ids) == 40
    assert_no_leaks(llm)


def test_stopped_by_stop_token_and_stop_string(tiny_model_dir, prompts):
    llm = make_llm(tiny_model_dir)
    tok = llm.get_tokenizer()
    free_run = llm.generate(prompts, greedy(max_tokens=10))
    # Stop on a token each request generates at step 4 (first occurrence may be earlier).
    params = [greedy(max_tokens=10, stop_token_ids=[o.outputs[0].token_ids[3]]) for o in free_run]
    outs = llm.generate(prompts, params)
    for o, p in zip(outs, params):
        assert o.outputs[0].finish_reason == "stop"
        assert o.outputs[0].stop_reason == p.stop_token_ids[0]
        assert len(o.outputs[0].token_ids) <= 4
    assert_no_leaks(llm)
    # Stop strings: a piece of text the free run produced.
    runnable = []
    for p, o in zip(prompts, free_run):
        text = tok.decode(o.outputs[0].token_ids, skip_special_tokens=True)
        s = text.strip()[:2] or text[:1]
        if s:
            runnable.append((p, s))
    assert runnable, "no request produced text to stop on"
    outs = llm.generate([p for p, _ in runnable],
                        [greedy(max_tokens=10, stop=s) for _, s in runnable])
    for o, (_, s) in zip(outs, runnable):
        assert o.outputs[0].finish_reason == "stop"
        assert o.outputs[0].stop_reason == s
        assert s not in o.outputs[0].text
    assert_no_leaks(llm)


def test_aborted_mid_run(tiny_model_dir, prompts):
    llm = make_llm(tiny_model_dir, max_num_seqs=3, max_num_batched_tokens=8)
    engine = llm.llm_engine
    ids = [engine.add_request(p, greedy(max_tokens=12)) for p in prompts]
    for _ in range(3):
        engine.step()
    sched = engine.scheduler
    running = [r.request_id for r in sched.running]
    waiting = [r.request_id for r in sched.waiting]
    assert running and waiting
    # One mid chunked-prefill or decoding, one still waiting.
    assert engine.kv_cache_manager.get_block_ids(running[0])
    engine.abort_request(running[0])
    engine.abort_request(waiting[-1])
    assert engine.finished_outputs[running[0]].outputs[0].finish_reason == "abort"
    engine.abort_request(running[0])  # aborting twice is a no-op
    engine.abort_request("no-such-request")
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            done[out.request_id] = out
    assert set(done) == set(ids) - {running[0], waiting[-1]}
    engine.finished_outputs.clear()  # aborted outputs are kept for the caller to collect
    assert_no_leaks(llm)


def test_aborted_everything_mid_run(tiny_model_dir, prompts):
    llm = make_llm(tiny_model_dir, max_num_batched_tokens=8, enable_prefix_caching=True)
    engine = llm.llm_engine
    ids = [engine.add_request(p, greedy(max_tokens=12)) for p in prompts]
    for _ in range(4):
        engine.step()
    assert llm.stats.num_free_blocks < llm.stats.num_total_blocks
    for rid in ids:
        engine.abort_request(rid)
    assert not engine.has_unfinished_requests()
    engine.finished_outputs.clear()
    assert_no_leaks(llm)


@pytest.mark.parametrize("caching", [True, False])
def test_preempted_and_resumed(tiny_model_dir, prompts, caching):
    # 16 blocks x 4 = 64 token slots for six requests of up to 31 + 20 tokens.
    llm = make_llm(tiny_model_dir, num_gpu_blocks_override=16, enable_prefix_caching=caching)
    outs = llm.generate(prompts, greedy(max_tokens=20))
    assert llm.stats.num_preemptions > 0
    assert all(len(o.outputs[0].token_ids) == 20 for o in outs)
    assert_no_leaks(llm)


class Boom(RuntimeError):
    pass


def fail_once_at(obj, attr: str, monkeypatch, call: int):
    """Make obj.attr raise Boom on its call-th call (1-based), then behave normally."""
    real = getattr(obj, attr)
    calls = {"n": 0}

    def wrapper(*a, **k):
        calls["n"] += 1
        if calls["n"] == call:
            raise Boom(f"injected failure in {attr}")
        return real(*a, **k)

    monkeypatch.setattr(obj, attr, wrapper)
    return calls


def _where(llm, where):
    runner = llm.llm_engine.model_runner
    if where == "execute_model":
        return runner, "execute_model"
    # Inside the model, after layer 0 already wrote this step's K/V into the cache.
    return runner.model.layers[1].mlp, "forward"


@pytest.mark.parametrize("where", ["execute_model", "model_forward"])
def test_failed_step_in_engine_frees_scheduled_requests(tiny_model_dir, prompts, monkeypatch,
                                                        where):
    llm = make_llm(tiny_model_dir, max_num_seqs=3, max_num_batched_tokens=16)
    engine = llm.llm_engine
    ids = [engine.add_request(p, greedy(max_tokens=6)) for p in prompts]
    obj, attr = _where(llm, where)
    fail_once_at(obj, attr, monkeypatch, call=3)
    engine.step()
    engine.step()
    with pytest.raises(Boom):
        engine.step()
    sched = engine.scheduler
    # The requests of the failed step are gone with their blocks; the rest (still
    # waiting, max_num_seqs=3) are untouched and hold no blocks.
    assert not sched.running
    left = set(sched.requests)
    assert left and left == {r.request_id for r in sched.waiting}
    assert llm.stats.num_free_blocks == llm.stats.num_total_blocks
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            done[out.request_id] = out
    assert set(done) == left
    assert_no_leaks(llm)
    assert set(ids) > left


@pytest.mark.parametrize("where", ["execute_model", "model_forward"])
def test_failed_generate_frees_everything(tiny_model_dir, prompts, monkeypatch, where):
    llm = make_llm(tiny_model_dir, max_num_seqs=3, max_num_batched_tokens=16)
    obj, attr = _where(llm, where)
    fail_once_at(obj, attr, monkeypatch, call=4)
    with pytest.raises(Boom):
        llm.generate(prompts, greedy(max_tokens=6))
    assert_no_leaks(llm)
    # The engine is usable afterwards and gives the same tokens as a fresh engine.
    outs = llm.generate(prompts[:2], greedy(max_tokens=6))
    fresh = make_llm(tiny_model_dir).generate(prompts[:2], greedy(max_tokens=6))
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in fresh]
    assert_no_leaks(llm)


def test_invalid_prompt_in_batch_holds_nothing(tiny_model_dir, prompts):
    llm = make_llm(tiny_model_dir, max_model_len=32, num_gpu_blocks_override=16)
    too_long = list(range(3, 3 + 40))
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([prompts[0], prompts[1], too_long, prompts[2]], greedy())
    assert_no_leaks(llm)
    assert llm.stats.num_steps == 0  # nothing ran
    outs = llm.generate([prompts[0], prompts[2]], greedy())
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
    assert_no_leaks(llm)
