"""Per-request speculative-decoding counts (chapter 21, section 7): each RequestOutput's
metrics["spec_decode"] holds that request's verifications, draft tokens and accepted
drafts; over a batch they add up to the engine's totals, and a request run alone gets
exactly the engine's counts."""

from __future__ import annotations

import pytest

from minivllm import LLM, SamplingParams
from minivllm.precision.faults import spec_accept_first_unverified

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
         "prompt_lookup_min": 1}
PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [1, 1, 1, 1, 1, 1, 1], [10, 20, 30, 40, 50, 10, 20, 30],
           [42, 43, 44, 45, 46, 47, 48, 49]]
GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
KEYS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")


def _totals(llm):
    s = llm.llm_engine.stats
    return (s.spec_decode_num_drafts, s.spec_decode_num_draft_tokens,
            s.spec_decode_num_accepted_tokens)


def _gen(llm, prompts):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)


@pytest.fixture(scope="module")
def spec(tiny_model_dir):
    return LLM(str(tiny_model_dir), dtype="float32", speculative_config=NGRAM)


def test_per_request_counts_add_up_to_engine_totals(spec):
    before = _totals(spec)
    outs = _gen(spec, PROMPTS)
    delta = [a - b for a, b in zip(_totals(spec), before)]
    per = [[o.metrics["spec_decode"][k] for k in KEYS] for o in outs]
    assert delta[0] > 0 and delta[2] > 0  # the batch did verify and accept drafts
    assert [sum(col) for col in zip(*per)] == delta
    for (d, dt, acc), o in zip(per, outs):
        assert 0 <= acc <= dt <= 3 * d
        # every verification emits its accepted drafts plus one target token
        assert d + acc <= len(o.outputs[0].token_ids)


def test_request_alone_gets_the_engine_counts(spec):
    for p in PROMPTS[:2]:
        before = _totals(spec)
        (out,) = _gen(spec, [p])
        delta = [a - b for a, b in zip(_totals(spec), before)]
        assert [out.metrics["spec_decode"][k] for k in KEYS] == delta


def test_planted_fault_accepts_at_least_one_per_verification(spec):
    with spec_accept_first_unverified(spec):
        outs = _gen(spec, PROMPTS)
    for o in outs:
        m = o.metrics["spec_decode"]
        assert m["num_accepted_tokens"] >= m["num_drafts"] > 0


def test_plain_engine_reports_zeros(tiny_model_dir):
    (out,) = _gen(LLM(str(tiny_model_dir), dtype="float32"), PROMPTS[:1])
    assert out.metrics["spec_decode"] == dict.fromkeys(KEYS, 0)
