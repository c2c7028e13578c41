"""Chapter 8: state that must survive preemption by recompute, on the tiny random Llama.

The correct engine gives every request the tokens of its unpreempted solo run (fp32,
greedy and seeded sampling with repetition/frequency/presence penalties), and each of
chapter 8's planted faults (faults.drop_outputs_on_resume, double_append_on_resume,
penalty_prompt_accounting) is found by the chapter's metric (first divergence against
the solo run) on preempted requests only. Expected tokens come from the engine's own
solo runs, never from the code under test.
"""

from __future__ import annotations

import pytest
import torch

from minivllm import LLM, SamplingParams
from minivllm.core.scheduler import preempt_request_ref
from minivllm.request import Request, RequestStatus
from minivllm.precision import faults
from minivllm.precision.metrics import first_divergence

pytestmark = pytest.mark.usefixtures("one_thread")

N = 6


def _llm(tiny_model_dir, blocks=None):
    kw = {} if blocks is None else {"num_gpu_blocks_override": blocks}
    return LLM(str(tiny_model_dir), dtype="float32", block_size=4, max_model_len=64, seed=0, **kw)


@pytest.fixture(scope="module")
def workload(tiny_model_dir):
    """Six prompts (10-15 tokens), 24 new tokens each: 16 blocks of 4 hold about two."""
    g = torch.Generator().manual_seed(8)
    alone = _llm(tiny_model_dir)
    vocab = alone.llm_engine.model_config.vocab_size
    prompts = [torch.randint(3, vocab, (10 + i,), generator=g).tolist() for i in range(N)]
    params = {
        "greedy": [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)] * N,
        "penalties": [SamplingParams(temperature=1.0, seed=40 + i, max_tokens=24, ignore_eos=True,
                                     repetition_penalty=1.3, frequency_penalty=0.8,
                                     presence_penalty=0.5) for i in range(N)],
        "repetition_only": [SamplingParams(temperature=1.0, seed=40 + i, max_tokens=24,
                                           ignore_eos=True, repetition_penalty=1.3)
                            for i in range(N)],
    }
    solo = {k: [alone.generate([p], sp)[0].outputs[0].token_ids for p, sp in zip(prompts, ps)]
            for k, ps in params.items()}
    return prompts, params, solo


def _tight_run(tiny_model_dir, workload, kind, fault=None):
    prompts, params, solo = workload
    llm = _llm(tiny_model_dir, blocks=16)
    if fault is None:
        outs = llm.generate(prompts, params[kind])
    else:
        with fault(llm):
            outs = llm.generate(prompts, params[kind])
    assert llm.stats.num_preemptions > 0, "the workload must force preemption"
    assert llm.llm_engine.kv_cache_manager.block_pool.get_num_free_blocks() == 16  # no leak
    pre = [o.metrics["num_preemptions"] > 0 for o in outs]
    div = [first_divergence(s, o.outputs[0].token_ids) for s, o in zip(solo[kind], outs)]
    print(f"{kind} {getattr(fault, '__name__', 'correct')}: preempted {pre}, first divergence {div}")
    return pre, div, outs


@pytest.mark.parametrize("kind", ["greedy", "penalties"])
def test_correct_engine_keeps_every_token_under_preemption(tiny_model_dir, workload, kind):
    pre, div, _ = _tight_run(tiny_model_dir, workload, kind)
    assert any(pre)
    assert div == [None] * N  # fp32: recompute changes the logits at noise level only


@pytest.mark.parametrize("fault,kind", [
    (faults.drop_outputs_on_resume, "greedy"),
    (faults.double_append_on_resume, "greedy"),
    (faults.penalty_prompt_accounting, "penalties"),
])
def test_each_fault_is_found_on_preempted_requests_only(tiny_model_dir, workload, fault, kind):
    pre, div, _ = _tight_run(tiny_model_dir, workload, fault=fault, kind=kind)
    assert any(d is not None for d, p in zip(div, pre) if p), "the fault went unseen"
    assert all(d is None for d, p in zip(div, pre) if not p), "an unpreempted request changed"


def test_penalty_fault_needs_output_count_penalties(tiny_model_dir, workload):
    """Repetition looks at prompt or output alike, so moving outputs to the prompt side
    changes nothing: the fault is exact with repetition_penalty alone."""
    pre, div, _ = _tight_run(tiny_model_dir, workload, fault=faults.penalty_prompt_accounting,
                             kind="repetition_only")
    assert any(pre) and div == [None] * N


def _request(prompt, outputs):
    r = Request("x", prompt, SamplingParams(max_tokens=20, seed=3), max_model_len=64)
    for t in outputs:
        r.append_output_token(t)
    r.num_computed_tokens = r.num_tokens - 1
    r.status = RequestStatus.RUNNING
    r.generator = torch.Generator().manual_seed(3)
    return r


@pytest.mark.parametrize("fault,want_tail", [
    (None, [7, 8, 9]),
    (faults.drop_outputs_on_resume, []),
    (faults.double_append_on_resume, [7, 8, 9, 7, 8, 9]),
])
def test_preempt_step_state(tiny_model_dir, fault, want_tail):
    """What each preempt step leaves on the request (the tokens the resume re-prefills)."""
    llm = _llm(tiny_model_dir)
    r = _request([1, 2, 3, 4, 5], [7, 8, 9])
    gen = r.generator
    ctx = fault(llm) if fault is not None else llm.swap_step("scheduler.preempt", preempt_request_ref)
    with ctx:
        llm.llm_engine.scheduler.preempt_request(r)
    assert llm.llm_engine.scheduler.preempt_request is preempt_request_ref  # restored
    assert r.all_token_ids == [1, 2, 3, 4, 5] + want_tail
    assert r.output_token_ids == [7, 8, 9] and r.generator is gen
    assert r.num_computed_tokens == 0 and r.status == RequestStatus.PREEMPTED
    assert r.num_preemptions == 1


def test_penalty_fault_moves_recomputed_outputs_to_the_prompt():
    pre, pen = faults.penalty_prompt_accounting_steps(None)
    from minivllm.layers.sampler import penalties_ref
    r = _request([1, 2], [5, 5, 6])
    pre(r)
    r.append_output_token(5)
    logits = torch.zeros(1, 10)
    f = torch.tensor([1.0])
    got = pen(logits, [r.prompt_token_ids], [r.output_token_ids], None, f, None)
    want = penalties_ref(logits, [[1, 2, 5, 5, 6]], [[5]], None, f, None)
    right = penalties_ref(logits, [[1, 2]], [[5, 5, 6, 5]], None, f, None)
    assert torch.equal(got, want) and not torch.equal(got, right)


def test_chapter_recorder_marks_the_resumed_rows(tiny_model_dir, workload):
    """course/ch08_preemption/measure_recompute.py (the chapter's probe): one row per
    sampled token, resumed rows only on preempted requests, and KL 0 against itself."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "course/ch08_preemption/measure_recompute.py"
    spec = importlib.util.spec_from_file_location("measure_recompute", path)
    mr = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mr)
    prompts, params, solo = workload
    llm = _llm(tiny_model_dir, blocks=16)
    tokens, rows, resumed, npre = mr.batch_run(llm, prompts, params["penalties"])
    assert tokens == solo["penalties"]
    assert [len(r) for r in rows] == [len(t) for t in tokens]
    assert [bool(r) for r in resumed] == [n > 0 for n in npre] and any(npre)
    assert all(len(r) == n for r, n in zip(resumed, npre))
    recs = mr.compare((tokens, rows), (tokens, rows, resumed, npre))
    assert all(r["first_divergence"] is None and max(r["kl_resumed"] + r["kl_other"]) == 0
               for r in recs)
    lo, hi = mr.wilson(5, 10)  # the 95 % Wilson interval for 5/10 is 0.2366-0.7634
    assert abs(lo - 0.2366) < 1e-3 and abs(hi - 0.7634) < 1e-3 and mr.wilson(0, 10)[0] == 0
