"""Chapter 20's sampling faults: faults.top_k_top_p_wrong_order (vllm #718 / PR #1885) and
faults.penalties_prompt_output_mixed (vllm-metal PR #69), as steps and planted into an
engine (the tiny random Llama). Expected values are written out from the definitions
(softmax of two logits, CTRL's division, OpenAI's subtraction), not taken from the code
under test; the engine checks compare a planted run with the engine's own clean run."""

from __future__ import annotations

import math

import pytest
import torch

from minivllm import LLM, SamplingParams
from minivllm.layers.sampler import apply_top_k_top_p, penalties_ref
from minivllm.precision import faults

pytestmark = pytest.mark.usefixtures("one_thread")


def _tv(a, b):
    return float(0.5 * (torch.softmax(a, -1) - torch.softmax(b, -1)).abs().sum())


def test_wrong_order_on_the_worked_example():
    ex = torch.tensor([[0.1, 0.2, 0.3, 0.4]])
    k, p = torch.tensor([2]), torch.tensor([0.5])
    right = torch.softmax(apply_top_k_top_p(ex, k, p), -1)[0]
    wrong = torch.softmax(faults.top_k_top_p_wrong_order(ex, k, p), -1)[0]
    hi = 1 / (1 + math.exp(-0.1))  # softmax of [0.3, 0.4]: 0.525 on the larger
    print("right", right.tolist(), "wrong", wrong.tolist())
    assert right.tolist() == [0.0, 0.0, 0.0, 1.0]
    assert torch.allclose(wrong, torch.tensor([0.0, 0.0, 1 - hi, hi]), atol=1e-6)  # float32


def test_wrong_order_equals_reference_with_one_filter():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 40, generator=g)
    logits[:, 5] = logits[:, 6]  # ties
    k = torch.tensor([3, 0, 5, 40, 1, 7])
    p = torch.tensor([0.3, 0.9, 1.0, 0.5, 0.7, 0.2])
    assert torch.equal(faults.top_k_top_p_wrong_order(logits, k, None), apply_top_k_top_p(logits, k, None))
    assert torch.equal(faults.top_k_top_p_wrong_order(logits, None, p), apply_top_k_top_p(logits, None, p))
    both = [_tv(faults.top_k_top_p_wrong_order(logits[i:i + 1], k[i:i + 1], p[i:i + 1]),
                apply_top_k_top_p(logits[i:i + 1], k[i:i + 1], p[i:i + 1])) for i in range(6)]
    print("TV per row with both filters", both)
    assert max(both) > 0.01


def test_mixed_accounting_first_step_and_later_steps():
    V = 6
    logits = torch.tensor([[2.0, -1.0, 0.5, 1.0, -0.5, 0.0]])
    prompt, one = [[0, 1]], torch.ones(1)
    rep = 2.0 * one
    good = penalties_ref(logits, prompt, [[]], None, None, rep)
    bad = faults.penalties_prompt_output_mixed(logits, prompt, [[]], None, None, rep)
    assert good[0, :2].tolist() == [1.0, -2.0]  # CTRL: 2/2, -1*2
    assert torch.equal(bad, logits)  # step 1: the prompt is not seen
    # a later step: frequency 0.5 and presence 0.25 on output [3, 3]; the prompt must not count
    good = penalties_ref(logits, prompt, [[3, 3]], 0.25 * one, 0.5 * one, None)
    bad = faults.penalties_prompt_output_mixed(logits, prompt, [[3, 3]], 0.25 * one, 0.5 * one, None)
    want = logits.clone()
    want[0, 3] -= 2 * 0.5 + 0.25
    assert torch.equal(good, want)
    want_bad = want.clone()
    want_bad[0, 0] -= 0.5 + 0.25
    want_bad[0, 1] -= 0.5 + 0.25
    assert torch.equal(bad, want_bad)
    assert bad.shape == (1, V)


def test_planted_faults_change_the_engine_only_where_they_should(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), dtype="float32", max_model_len=48, seed=0)
    prompt = {"prompt_token_ids": [5, 9, 9, 9, 12, 30, 9, 9]}
    both = [SamplingParams(temperature=1.0, top_k=8, top_p=0.3, seed=s, max_tokens=12, ignore_eos=True)
            for s in range(4)]
    konly = [SamplingParams(temperature=1.0, top_k=8, seed=s, max_tokens=12, ignore_eos=True) for s in range(4)]

    def greedy1(ids):
        return llm.generate([{"prompt_token_ids": ids}], SamplingParams(
            temperature=0.0, max_tokens=1), use_tqdm=False)[0].outputs[0].token_ids[0]

    ids = [5, 9, 12, 30]
    for _ in range(12):  # a prompt whose greedy next token is already in it
        g0 = greedy1(ids)
        if g0 in ids:
            break
        ids = ids + [g0]
    assert g0 in ids
    # repetition 10 must push the repeated token down on the first step; the bug does not
    pens = [SamplingParams(temperature=0.0, max_tokens=1, repetition_penalty=10.0)]
    sps = both + konly + pens

    def run():
        return [o.outputs[0].token_ids for o in llm.generate(
            [prompt] * 8 + [{"prompt_token_ids": ids}], sps, use_tqdm=False)]

    clean = run()
    assert run() == clean  # seeded and greedy: reproducible
    with faults.top_p_before_top_k(llm):
        order = run()
    with faults.penalty_accounting_mixed(llm):
        mixed = run()
    assert run() == clean  # both restored on exit
    print("order fault changed", [a != b for a, b in zip(clean, order)])
    assert order[4:] == clean[4:]  # top_k only, and the greedy penalised request
    assert order[:4] != clean[:4]
    assert mixed[:8] == clean[:8]  # no penalties: unchanged
    print("repeated token", g0, "clean", clean[8], "mixed", mixed[8])
    assert mixed[8] == [g0] and clean[8] != [g0]
