"""The chat template and the doubled BOS (chapter 26): what the embedded tokenizer does on
its own, the planted fault on the "prompt.chat_template" step
(``faults.doubled_bos``: vllm PR #16976), and that the chapter's metric finds it.

Expected ids are built here from the tokenizer's own calls (rendered text encoded without
special tokens), not from the code under test.
"""

from __future__ import annotations

import pytest
import torch

from minivllm.precision import evalsets as E
from minivllm.precision import faults, metrics

pytestmark = pytest.mark.usefixtures("one_thread")

CONVS = [
    [{"role": "user", "content": "Hi there"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"},
     {"role": "assistant", "content": "4"}, {"role": "user", "content": "And 3+3?"}],
    [{"role": "user", "content": "text with <|im_start|> and <|im_end|> inside"}],
]


@pytest.fixture(scope="module")
def tok(embedded_model_dir):
    from minivllm.tokenizer import get_tokenizer

    return get_tokenizer(str(embedded_model_dir))


def _expected(tok, conv, gen=True):
    text = tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=gen)
    return tok.encode(text, add_special_tokens=False)


def test_embedded_tokenizer_adds_no_bos_and_template_opens_with_it(tok):
    assert tok.bos_token == "<|im_start|>" and tok.bos_token_id == 1
    assert tok.encode("Hello") == tok.encode("Hello", add_special_tokens=False) == [19556]
    ids = _expected(tok, CONVS[0])
    assert ids[0] == 1 and ids[1] != 1  # one start token, from the template
    text = tok.apply_chat_template(CONVS[0], tokenize=False, add_generation_prompt=True)
    assert "You are a helpful AI assistant named SmolLM" in text  # the default system prompt


@pytest.mark.parametrize("i", range(len(CONVS)))
def test_reference_step_and_fault(tok, i):
    from minivllm.tokenizer import render_chat_ref

    conv = CONVS[i]
    want = _expected(tok, conv)
    assert render_chat_ref(tok, conv, True, None) == want
    assert render_chat_ref(tok, conv, False, None) == _expected(tok, conv, gen=False)
    bad = faults.render_chat_doubled_bos(tok, conv, True, None)
    assert bad == [1] + want  # exactly one extra start token, in front


def test_bos_adding_tokenizer_is_a_copy(tok):
    b = faults.bos_adding_tokenizer(tok)
    assert b.encode("Hello") == [1, 19556]
    assert b.encode("Hello", add_special_tokens=False) == [19556]
    assert tok.encode("Hello") == [19556]  # the shared tokenizer is unchanged
    assert faults.bos_adding_tokenizer(tok) is b


@pytest.fixture(scope="module")
def llm(embedded_model_dir):
    from minivllm import LLM

    return LLM(str(embedded_model_dir), dtype="float32", max_model_len=256)


N_QA = 8


def _answer_rows(llm, prompts, answers):
    seqs = [p + a for p, a in zip(prompts, answers)]
    pos = [list(range(len(p) - 1, len(p) + len(a) - 1)) for p, a in zip(prompts, answers)]
    return llm.score(seqs, positions=pos)


def test_doubled_bos_fault_in_the_engine_and_found_by_kl(llm):
    """LLM.chat's prompts get two start tokens under the fault and one after it; the
    chapter's metric (KL of the next-token distributions over the reference answers of
    QA items, float32) is exactly 0 for the reference and far above the float32 noise
    floor (~1e-11) with the fault (measured: ~7e-3 nats on 30 items)."""
    from minivllm import SamplingParams

    tok = llm.get_tokenizer()
    qa = E.load_qa()[:N_QA]
    convs = [E.qa_prompt(q.question) for q in qa]
    sp = SamplingParams(temperature=0, max_tokens=1)
    with faults.doubled_bos(llm):
        bad_ids = [o.prompt_token_ids for o in llm.chat(convs, sp)]
    good_ids = [o.prompt_token_ids for o in llm.chat(convs, sp)]
    assert good_ids == [_expected(tok, c) for c in convs]
    assert bad_ids == [[1] + g for g in good_ids]

    answers = [tok.encode(q.reference_output, add_special_tokens=False) for q in qa]
    ref = _answer_rows(llm, good_ids, answers)
    again = _answer_rows(llm, good_ids, answers)
    bad = _answer_rows(llm, bad_ids, answers)
    kl_same = max(metrics.mean_kl(r, a) for r, a in zip(ref, again))
    kl_bad = sum(metrics.mean_kl(r, b) for r, b in zip(ref, bad)) / N_QA
    nll = [sum(-float(x.gather(1, torch.tensor(a)[:, None]).mean()) for x, a in
               zip(rows, answers)) / N_QA for rows in (ref, bad)]
    print(f"KL ref/ref {kl_same:.3g}, KL doubled {kl_bad:.3g} nats; "
          f"answer NLL {nll[0]:.4f} -> {nll[1]:.4f}")
    assert kl_same == 0.0
    assert kl_bad > 1e-3
    assert nll[1] > nll[0]
