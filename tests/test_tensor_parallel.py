"""Real tensor parallelism: tp worker processes over gloo (minivllm/parallel/
multiproc_executor.py, tensor_parallel.py; course chapter 25).

Tolerance: float32 log-probs within 1e-4 nats of tp = 1. Tensor parallelism changes only
the order of two sums per layer (o_proj, down_proj: tp partial sums, all-reduced), so the
difference is float32 rounding (about 1e-6 here); the wrong gate_up layout moves them by
more than 0.1.
"""

import pytest

from minivllm import LLM, SamplingParams
from minivllm.engine.arg_utils import EngineArgs
from minivllm.precision.faults import tp_gate_up_contiguous

TOL_FP32 = 1e-4


def _greedy(llm, prompts, max_tokens):
    """Per prompt: (greedy tokens, their log-probs, the prompt tokens' teacher-forced
    log-probs)."""
    sp = SamplingParams(max_tokens=max_tokens, temperature=0, logprobs=0, prompt_logprobs=0,
                        ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    first = lambda lps: [next(iter(lp.values())).logprob for lp in lps if lp]  # noqa: E731
    return [(o.outputs[0].token_ids, first(o.outputs[0].logprobs), first(o.prompt_logprobs))
            for o in outs]


def _compare(ref, got):
    """(all greedy tokens equal, max |log-prob difference| over the prompt tokens and the
    generated positions up to the first differing token)."""
    same = all(a[0] == b[0] for a, b in zip(ref, got))
    diff = 0.0
    for (ta, la, pa), (tb, lb, pb) in zip(ref, got):
        diff = max([diff] + [abs(u - v) for u, v in zip(pa, pb)])
        for x, y, u, v in zip(ta, tb, la, lb):
            if x != y:
                break
            diff = max(diff, abs(u - v))
    return same, diff


TINY_PROMPTS = [[1, 5, 9, 20, 33, 7], [3, 4, 5], [10, 11, 12, 13, 14, 15, 16, 17, 18, 2, 40]]


def _tiny(path, tp):
    return LLM(str(path), dtype="float32", tensor_parallel_size=tp,
               num_gpu_blocks_override=64, max_model_len=128)


@pytest.fixture(scope="module")
def tiny_tp1(tiny_model_dir):
    llm = _tiny(tiny_model_dir, 1)
    return _greedy(llm, TINY_PROMPTS, 12)


def test_tiny_tp2_matches_tp1_and_wrong_gate_up_layout_is_caught(tiny_model_dir, tiny_tp1):
    llm = _tiny(tiny_model_dir, 2)
    try:
        assert len(llm.llm_engine.model_executor.procs) == 1
        assert llm.llm_engine.model_executor.procs[0].is_alive()
        # rank 0 holds 2 of 4 query heads and 1 of 2 KV heads; its cache only those
        attn = llm.llm_engine.model_runner.model.layers[0].self_attn
        assert (attn.num_heads, attn.num_kv_heads) == (2, 1)
        assert llm.llm_engine.model_runner.kv_caches[0].key.shape[1] == 1
        same, diff = _compare(tiny_tp1, _greedy(llm, TINY_PROMPTS, 12))
        print(f"tp=2 vs tp=1 (float32): tokens equal {same}, max |dlogprob| {diff:.3g}")
        assert same and diff <= TOL_FP32
        with tp_gate_up_contiguous(llm):
            same_bad, diff_bad = _compare(tiny_tp1, _greedy(llm, TINY_PROMPTS, 12))
        print(f"wrong gate_up layout: tokens equal {same_bad}, max |dlogprob| {diff_bad:.3g}")
        assert not same_bad and diff_bad > 0.1
        # restored on exit
        same, diff = _compare(tiny_tp1, _greedy(llm, TINY_PROMPTS, 12))
        assert same and diff <= TOL_FP32
        with pytest.raises(ValueError, match="rank 0's shard only"):
            llm.swap_step("rms_norm", lambda *a: None)
        with pytest.raises(RuntimeError, match="already running"):
            _tiny(tiny_model_dir, 2)
    finally:
        llm.llm_engine.shutdown()
    assert not llm.llm_engine.model_executor.procs[0].is_alive()
    with pytest.raises(RuntimeError, match="shut down"):
        _greedy(llm, TINY_PROMPTS[:1], 2)


def test_tiny_tp4_replicated_kv_heads_matches_tp1(tiny_model_dir, tiny_tp1):
    # 4 query heads, 2 KV heads: at tp = 4 each KV head is replicated on 2 ranks
    llm = _tiny(tiny_model_dir, 4)
    try:
        attn = llm.llm_engine.model_runner.model.layers[0].self_attn
        assert (attn.num_heads, attn.num_kv_heads) == (1, 1)
        same, diff = _compare(tiny_tp1, _greedy(llm, TINY_PROMPTS, 12))
        print(f"tp=4 vs tp=1 (float32): tokens equal {same}, max |dlogprob| {diff:.3g}")
        assert same and diff <= TOL_FP32
    finally:
        llm.llm_engine.shutdown()


@pytest.mark.embedded
def test_embedded_tp3_matches_tp1(embedded_model_dir):
    prompts = [[1, 504, 3458, 282, 4649, 314], [1, 9690, 198, 2683, 359, 253, 5356, 30],
               [504, 1345, 282], [1, 1780, 314, 29, 33, 29, 33, 45, 1126]]
    ref_llm = LLM(dtype="float32", num_gpu_blocks_override=64, max_model_len=256)
    ref = _greedy(ref_llm, prompts, 16)
    del ref_llm
    llm = LLM(dtype="float32", tensor_parallel_size=3, num_gpu_blocks_override=64,
              max_model_len=256)
    try:
        attn = llm.llm_engine.model_runner.model.layers[0].self_attn
        assert (attn.num_heads, attn.num_kv_heads) == (3, 1)
        same, diff = _compare(ref, _greedy(llm, prompts, 16))
        print(f"embedded tp=3 vs tp=1 (float32): tokens equal {same}, "
              f"max |dlogprob| {diff:.3g}")
        assert same and diff <= TOL_FP32
    finally:
        llm.llm_engine.shutdown()


def test_tp_not_allowed_for_the_model_is_refused_before_loading(tiny_model_dir):
    with pytest.raises(ValueError, match=r"divisible by tensor parallel size \(3\).*\[1, 2, 4\]"):
        _tiny(tiny_model_dir, 3)


@pytest.mark.parametrize("kwargs, match", [
    ({"tensor_parallel_size": 0}, "integer >= 1"),
    ({"tensor_parallel_size": 2.0}, "integer >= 1"),
    ({"distributed_executor_backend": "ray"}, "'mp' or 'uni'"),
    ({"tensor_parallel_size": 2, "distributed_executor_backend": "uni"}, "needs 'mp'"),
    ({"tensor_parallel_size": 2, "quantization": "int8"}, "quantization"),
    ({"tensor_parallel_size": 3, "speculative_config": {"method": "ngram",
      "num_speculative_tokens": 2, "prompt_lookup_max": 2}}, "speculative_config"),
    ({"tensor_parallel_size": 2, "device": "cuda"}, "CPU"),
])
def test_bad_parallel_arguments_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        EngineArgs(**kwargs).validate()
