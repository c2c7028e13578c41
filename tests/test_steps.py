"""The step registry (minivllm/steps.py): every step swappable, bit-identical with its
reference, and restored after the block (also after an exception).

The workload below reaches every step on the tiny random Llama: prompts longer than a
block with prefix caching on (block hashes), a pool small enough to preempt, greedy and
seeded sampled requests with top-k/top-p and penalties, and teacher-forced scoring in
prefill and decode mode. Outputs are compared bit for bit (token ids, their log-probs,
score rows), so "bit-identical" means torch.equal, no tolerance.
"""

from __future__ import annotations

import pytest
import torch

from minivllm import LLM, SamplingParams
from minivllm.steps import STEPS, reference, site_names

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = [[5 + i % 50 for i in range(k, k + n)] for k, n in ((0, 13), (7, 11), (3, 17))]
CHAT = [{"role": "user", "content": "a chat longer than sixteen tokens"}]


def _params() -> list[SamplingParams]:
    return [
        SamplingParams(temperature=0, max_tokens=14, repetition_penalty=1.3, logprobs=0),
        SamplingParams(temperature=0.9, top_k=20, top_p=0.9, seed=11, max_tokens=14,
                       frequency_penalty=0.5, presence_penalty=0.3, logprobs=0),
        SamplingParams(temperature=0.7, top_p=0.8, seed=5, max_tokens=14, logprobs=0),
    ]


def workload(llm: LLM) -> dict:
    """Everything the engine computes for a fixed set of requests, to compare exactly.
    The prefix cache starts empty (a hit computes a prompt in a different order than a
    miss, which is chapter 22's subject, not this test's)."""
    assert llm.llm_engine.kv_cache_manager.reset_prefix_cache()
    before = llm.stats.num_preemptions
    outs = llm.generate(PROMPTS, _params())
    gen = [(o.outputs[0].token_ids, [lp[t].logprob for lp, t in
                                     zip(o.outputs[0].logprobs, o.outputs[0].token_ids)])
           for o in outs]
    # a chat cut to its last 16 tokens reaches "prompt.chat_template" and "prompt.truncate"
    chat = llm.chat(CHAT, SamplingParams(temperature=0, max_tokens=4, truncate_prompt_tokens=16))
    gen.append((chat[0].prompt_token_ids, chat[0].outputs[0].token_ids))
    rows = llm.score(PROMPTS[:2], mode="decode") + llm.score(PROMPTS[2:], mode="prefill")
    return {"gen": gen, "rows": rows, "preempted": llm.stats.num_preemptions - before}


def same(a: dict, b: dict) -> bool:
    return a["gen"] == b["gen"] and all(torch.equal(x, y) for x, y in zip(a["rows"], b["rows"]))


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    # 12 blocks of 4 tokens: three 13-17-token prompts growing by 14 tokens each need more
    # than that at once, so the scheduler preempts.
    return LLM(str(tiny_model_dir), dtype="float32", block_size=4, num_gpu_blocks_override=12,
               max_model_len=40, enable_prefix_caching=True, seed=0)


@pytest.fixture(scope="module")
def baseline(llm):
    base = workload(llm)
    assert base["preempted"] > 0, "the workload must preempt (scheduler.preempt is a step)"
    assert same(base, workload(llm)), "the workload itself must be reproducible"
    return base


# Speculative-decoding steps (chapter 21) run only in an engine built with
# speculative_config, on requests it speculates for (no logprobs or penalties).
SPEC_STEPS = ("rejection_sampler", "spec_decode.ngram")
SPEC_PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [1, 1, 1, 1, 1, 1, 1], [10, 20, 30, 10, 20, 30]]


def spec_workload(llm: LLM) -> dict:
    assert llm.llm_engine.kv_cache_manager.reset_prefix_cache()
    before = llm.stats.spec_decode_num_drafts
    outs = llm.generate(SPEC_PROMPTS, [SamplingParams(temperature=0, max_tokens=14),
                                       SamplingParams(temperature=0.8, seed=3, max_tokens=14),
                                       SamplingParams(temperature=0, max_tokens=14)])
    assert llm.stats.spec_decode_num_drafts > before
    return {"gen": [o.outputs[0].token_ids for o in outs], "rows": []}


@pytest.fixture(scope="module")
def spec_llm(tiny_model_dir):
    return LLM(str(tiny_model_dir), dtype="float32", block_size=4, num_gpu_blocks_override=12,
               max_model_len=40, seed=0,
               speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                   "prompt_lookup_min": 1, "prompt_lookup_max": 3})


@pytest.fixture(scope="module")
def spec_baseline(spec_llm):
    base = spec_workload(spec_llm)
    assert same(base, spec_workload(spec_llm))
    return base


# The fp8 W8A8 linear step (chapter 17) runs only in an engine with fp8 weights (static
# activation scales, so the step receives a scale).
FP8_STEPS = ("fp8.linear",)


@pytest.fixture(scope="module")
def fp8_llm(tiny_model_dir):
    return LLM(str(tiny_model_dir), dtype="float32", block_size=4, num_gpu_blocks_override=12,
               max_model_len=40, enable_prefix_caching=True, seed=0, quantization="fp8",
               quantization_config={"activation_scheme": "static", "calibration": "corpus",
                                    "calibration_tokens": 128})


@pytest.fixture(scope="module")
def fp8_baseline(fp8_llm):
    base = workload(fp8_llm)
    assert same(base, workload(fp8_llm))
    return base


def _engine_for(name, request, llm, baseline):
    if name in SPEC_STEPS:
        return request.getfixturevalue("spec_llm"), request.getfixturevalue("spec_baseline"), \
            spec_workload
    if name in FP8_STEPS:
        return request.getfixturevalue("fp8_llm"), request.getfixturevalue("fp8_baseline"), \
            workload
    return llm, baseline, workload


def counting(fn):
    def wrapper(*args, **kwargs):
        wrapper.calls += 1
        return fn(*args, **kwargs)
    wrapper.calls = 0
    return wrapper


@pytest.mark.parametrize("name", list(STEPS))
def test_reference_swap_is_bit_identical_and_restored(llm, baseline, name, request):
    llm, baseline, workload = _engine_for(name, request, llm, baseline)
    spy = counting(reference(name))
    with llm.swap_step(name, spy):
        got = workload(llm)
    assert spy.calls > 0, f"{name}: the engine never called the swapped function"
    assert same(got, baseline), f"{name}: swapping in the reference changed the outputs"
    calls = spy.calls
    assert same(workload(llm), baseline)
    assert spy.calls == calls, f"{name}: still called after the with block"


@pytest.mark.parametrize("name", list(STEPS))
def test_restored_after_an_exception(llm, baseline, name, request):
    llm, baseline, workload = _engine_for(name, request, llm, baseline)
    spy = counting(reference(name))
    with pytest.raises(RuntimeError, match="inside"):
        with llm.swap_step(name, spy):
            raise RuntimeError("inside")
    calls = spy.calls  # rotary.table calls it once, on entry, to build the table
    got = workload(llm)
    assert spy.calls == calls, f"{name}: the swapped function survived an exception"
    assert same(got, baseline)


def test_a_wrong_step_changes_the_outputs_and_only_inside(llm, baseline):
    """The swap really reaches the computation: a wrong RMSNorm changes every number."""
    def bad(x, weight, eps):
        return reference("rms_norm")(x, weight, eps) * 1.01

    with llm.swap_step("rms_norm", bad):
        got = workload(llm)
    assert not torch.equal(got["rows"][0], baseline["rows"][0])
    assert same(workload(llm), baseline)


def test_where_picks_layers_and_modules(llm):
    sites = site_names(llm.llm_engine, "rms_norm")
    assert sites == ["layers.0.input_layernorm", "layers.0.post_attention_layernorm",
                     "layers.1.input_layernorm", "layers.1.post_attention_layernorm", "norm"]
    ids = PROMPTS[0]
    spy = counting(reference("rms_norm"))
    with llm.swap_step("rms_norm", spy, where=1):
        llm.score(ids)
    assert spy.calls == 2  # one prefill through layer 1's two norms
    spy = counting(reference("rms_norm"))
    with llm.swap_step("rms_norm", spy, where="*.post_attention_layernorm"):
        llm.score(ids)
    assert spy.calls == 2
    spy = counting(reference("rms_norm"))
    with llm.swap_step("rms_norm", spy, where="norm"):
        llm.score(ids)
    assert spy.calls == 1


def test_rotary_table_swap_for_one_layer_keeps_the_others(llm):
    model = llm.llm_engine.model_runner.model
    shared = model.layers[0].self_attn.rotary_emb
    assert model.layers[1].self_attn.rotary_emb is shared
    with llm.swap_step("rotary.table", reference("rotary.table"), where=1):
        assert model.layers[0].self_attn.rotary_emb is shared
        assert model.layers[1].self_attn.rotary_emb is not shared
    assert model.layers[1].self_attn.rotary_emb is shared
    with pytest.raises(RuntimeError):
        with llm.swap_step("rotary.table", reference("rotary.table")):
            assert model.layers[0].self_attn.rotary_emb is not shared
            raise RuntimeError
    assert all(layer.self_attn.rotary_emb is shared for layer in model.layers)
    with pytest.raises(ValueError, match="shape"):
        with llm.swap_step("rotary.table", lambda d, m, b: reference("rotary.table")(d, m - 1, b)):
            pass
    assert model.layers[0].self_attn.rotary_emb is shared


def test_swaps_nest(llm, baseline):
    outer, inner = counting(reference("linear")), counting(reference("linear"))
    with llm.swap_step("linear", outer):
        with llm.swap_step("linear", inner):
            llm.score(PROMPTS[0])
        assert inner.calls > 0 and outer.calls == 0
        llm.score(PROMPTS[0])
        assert outer.calls > 0
    assert same(workload(llm), baseline)


def test_kv_changing_swap_resets_the_prefix_cache(llm):
    """A cached block computed by one implementation must not be served to the other."""
    prompt = list(range(40, 60))  # 5 full blocks
    sp = SamplingParams(temperature=0, max_tokens=3, logprobs=0)  # (prompt_logprobs skip the cache)
    first = llm.generate([prompt], sp)[0]
    hits = llm.stats.prefix_cache_hits
    again = llm.generate([prompt], sp)[0]
    assert llm.stats.prefix_cache_hits > hits, "the prompt should hit the cache when unchanged"

    def bad(x, weight, eps):
        return reference("rms_norm")(x, weight, eps) * 1.01

    hits = llm.stats.prefix_cache_hits
    with llm.swap_step("rms_norm", bad):
        swapped = llm.generate([prompt], sp)[0]
    assert llm.stats.prefix_cache_hits == hits, "a swap must not reuse blocks cached before it"
    lp = [o.outputs[0].logprobs[0][o.outputs[0].token_ids[0]].logprob
          for o in (first, again, swapped)]
    assert lp[2] != lp[0], "the swapped RMSNorm must change the first token's log-prob"


def test_bad_arguments_say_what_is_allowed(llm, tiny_model_dir):
    with pytest.raises(ValueError, match="unknown step 'rmsnorm'.*rms_norm"):
        llm.swap_step("rmsnorm", reference("rms_norm")).__enter__()
    with pytest.raises(TypeError, match="rms_norm\\(x, weight, eps\\)"):
        llm.swap_step("rms_norm", 3).__enter__()
    with pytest.raises(ValueError, match="no layer \\[7\\]"):
        llm.swap_step("rms_norm", reference("rms_norm"), where=7).__enter__()
    with pytest.raises(ValueError, match="matches no site"):
        llm.swap_step("rms_norm", reference("rms_norm"), where="layers.0.mlp*").__enter__()
    with pytest.raises(ValueError, match="one site"):
        llm.swap_step("slot_mapping", reference("slot_mapping"), where=0).__enter__()
    with pytest.raises(TypeError, match="layer index"):
        llm.swap_step("linear", reference("linear"), where=True).__enter__()
    engine = llm.llm_engine
    rid = engine.add_request(PROMPTS[0], SamplingParams(max_tokens=2))
    try:
        with pytest.raises(ValueError, match="in flight"):
            llm.swap_step("linear", reference("linear")).__enter__()
        with llm.swap_step("sampler.penalties", reference("sampler.penalties")):
            pass  # does not touch K/V: allowed
    finally:
        engine.abort_request(rid)
        engine.finished_outputs.pop(rid, None)
    triton = LLM(str(tiny_model_dir), dtype="float32", attention_backend="TRITON",
                 max_model_len=32)
    with pytest.raises(ValueError, match="inside the TRITON kernels"):
        triton.swap_step("attention.decode", reference("attention.decode")).__enter__()
    with triton.swap_step("rms_norm", reference("rms_norm")):
        pass  # model steps apply to every backend


def test_drop_outputs_on_resume_fault_changes_only_preempted_requests(llm, baseline):
    """The planted preemption bug of lab 2 / chapter 8: requests that were preempted after
    generating come back with their answer's start twice; the pool ends empty (no leak)."""
    from minivllm.precision import faults

    greedy = SamplingParams(temperature=0, max_tokens=14)
    want = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy)]
    with faults.drop_outputs_on_resume(llm):
        outs = llm.generate(PROMPTS, greedy)
    got = [o.outputs[0].token_ids for o in outs]
    resumed = [o.metrics["num_preemptions"] > 0 for o in outs]
    assert any(resumed), "the workload must preempt"
    assert any(g != w for g, w in zip(got, want))
    for g, w, r in zip(got, want, resumed):
        if not r:
            assert g == w, "a request that was never preempted must not change"
    assert llm.stats.num_free_blocks == llm.stats.num_total_blocks
    assert same(workload(llm), baseline), "the fault must be gone after the with block"
