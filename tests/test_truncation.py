"""``SamplingParams.truncate_prompt_tokens`` (vLLM's semantics: keep the LAST k prompt
tokens; -1: as many as the engine accepts; k > max_model_len is an error), offline and
over HTTP with the ``openai`` client; and that nothing is truncated without it.

Expected prompts are slices of the token ids the test built itself (``ids[-k:]``), and
expected generations come from sending those last k tokens directly, so a wrong side,
an off-by-one or a silent truncation fails.
"""

from __future__ import annotations

import pytest

from minivllm import LLM, SamplingParams

MAX_LEN = 64


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(model=str(tiny_model_dir), dtype="float32", max_model_len=MAX_LEN)


def _ids(n: int, seed: int = 0) -> list[int]:
    return [(37 * i + 11 * seed) % 380 + 3 for i in range(n)]


GREEDY = dict(temperature=0.0, max_tokens=4, ignore_eos=True)


# --- SamplingParams -----------------------------------------------------------------------

@pytest.mark.parametrize("good", [None, -1, 1, 7, 10**6])
def test_sampling_params_accepts(good):
    assert SamplingParams(truncate_prompt_tokens=good).truncate_prompt_tokens == good


@pytest.mark.parametrize("bad", [0, -2, -100, 1.5, 3.0, True, "3", [3]])
def test_sampling_params_refuses(bad):
    with pytest.raises(ValueError) as exc:
        SamplingParams(truncate_prompt_tokens=bad)
    msg = str(exc.value)
    print(msg)
    assert "truncate_prompt_tokens" in msg and ">= 1 or -1" in msg and repr(bad) in msg


def test_changed_after_construction_is_checked_again(llm):
    sp = SamplingParams(**GREEDY)
    sp.truncate_prompt_tokens = 0
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        llm.generate([_ids(10)], sp)


# --- the engine ---------------------------------------------------------------------------

@pytest.mark.parametrize("n,k", [(100, 20), (40, 20), (20, 20), (5, 20), (63, 1)])
def test_keeps_the_last_k_tokens_and_generates_as_the_last_k(llm, n, k):
    ids = _ids(n, seed=n)
    out = llm.generate([ids], SamplingParams(truncate_prompt_tokens=k, **GREEDY))[0]
    assert out.prompt_token_ids == ids[-k:]
    direct = llm.generate([ids[-k:]], SamplingParams(**GREEDY))[0]
    assert out.outputs[0].token_ids == direct.outputs[0].token_ids


def test_text_prompt_is_truncated_after_tokenizing(llm):
    tok = llm.get_tokenizer()
    text = " ".join(f"w{i}" for i in range(80))
    ids = tok.encode(text)
    assert len(ids) > 30
    out = llm.generate(text, SamplingParams(truncate_prompt_tokens=30, **GREEDY))[0]
    assert out.prompt_token_ids == ids[-30:]
    assert out.prompt == text  # as vLLM: the request's prompt text is the one given


def test_minus_one_keeps_max_model_len_minus_one(llm):
    ids = _ids(3 * MAX_LEN)
    out = llm.generate([ids], SamplingParams(truncate_prompt_tokens=-1, **GREEDY))[0]
    assert out.prompt_token_ids == ids[-(MAX_LEN - 1):]
    assert len(out.outputs[0].token_ids) == 1 and out.outputs[0].finish_reason == "length"
    short = _ids(10)
    assert llm.generate([short], SamplingParams(truncate_prompt_tokens=-1, **GREEDY))[0] \
        .prompt_token_ids == short


def test_larger_than_max_model_len_is_an_error_and_leaks_nothing(llm):
    eng = llm.llm_engine
    free = eng.kv_cache_manager.block_pool.get_num_free_blocks()
    with pytest.raises(ValueError) as exc:
        llm.generate([_ids(10), _ids(200)],
                     [SamplingParams(**GREEDY),
                      SamplingParams(truncate_prompt_tokens=MAX_LEN + 1, **GREEDY)])
    msg = str(exc.value)
    print(msg)
    assert f"truncate_prompt_tokens value ({MAX_LEN + 1})" in msg
    assert f"max_model_len ({MAX_LEN})" in msg
    assert not eng.has_unfinished_requests()
    assert eng.kv_cache_manager.block_pool.get_num_free_blocks() == free


def test_k_equal_to_max_model_len_still_needs_room_for_one_token(llm):
    with pytest.raises(ValueError, match="max_model_len is 64"):
        llm.generate([_ids(200)], SamplingParams(truncate_prompt_tokens=MAX_LEN, **GREEDY))


def test_without_the_option_nothing_is_truncated(llm):
    with pytest.raises(ValueError) as exc:
        llm.generate([_ids(MAX_LEN + 5)], SamplingParams(**GREEDY))
    assert f"{MAX_LEN + 5} tokens long" in str(exc.value)
    ids = _ids(MAX_LEN - 1)  # the longest accepted prompt goes in whole
    assert llm.generate([ids], SamplingParams(**GREEDY))[0].prompt_token_ids == ids


def test_chat_truncates_the_rendered_conversation(llm):
    tok = llm.get_tokenizer()
    conv = [{"role": "system", "content": "Be brief. " * 10},
            {"role": "user", "content": "tell me about the quick brown fox " * 3}]
    text = tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
    full = tok.encode(text, add_special_tokens=False)
    assert len(full) > 40
    out = llm.chat(conv, SamplingParams(truncate_prompt_tokens=40, **GREEDY))[0]
    assert out.prompt_token_ids == full[-40:]
    with pytest.raises(ValueError, match="max_model_len"):  # too long, and not asked to cut
        llm.chat(conv * 3, SamplingParams(**GREEDY))


def test_truncation_goes_through_the_prompt_truncate_step(llm):
    ids = _ids(50)
    right = lambda token_ids, k: list(token_ids[:k])  # noqa: E731  (the wrong side)
    with llm.swap_step("prompt.truncate", right):
        out = llm.generate([ids], SamplingParams(truncate_prompt_tokens=12, **GREEDY))[0]
    assert out.prompt_token_ids == ids[:12]
    assert llm.generate([ids], SamplingParams(truncate_prompt_tokens=12, **GREEDY))[0] \
        .prompt_token_ids == ids[-12:]  # restored on exit
    with llm.swap_step("prompt.truncate", lambda token_ids, k: list(token_ids)):
        with pytest.raises(ValueError, match="returned 50 tokens"):
            llm.generate([ids], SamplingParams(truncate_prompt_tokens=12, **GREEDY))
    assert not llm.llm_engine.has_unfinished_requests()


# --- over HTTP ----------------------------------------------------------------------------

openai_mod = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    from tests.test_server import _start

    proc, base = _start(tiny_model_dir)  # max_model_len 512, model name "tiny"
    yield base
    proc.terminate()
    proc.wait(timeout=30)


@pytest.fixture(scope="module")
def client(server):
    return openai_mod.OpenAI(base_url=f"{server}/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def offline512(tiny_model_dir):
    return LLM(model=str(tiny_model_dir), dtype="float32", max_model_len=512)


def test_http_completion_truncates_to_k(client, offline512):
    ids = _ids(700, seed=3)  # longer than the server's max_model_len (512)
    k = 50
    r = client.completions.create(model="tiny", prompt=ids, max_tokens=6, temperature=0,
                                  extra_body={"truncate_prompt_tokens": k, "ignore_eos": True})
    assert r.usage.prompt_tokens == k
    direct = client.completions.create(model="tiny", prompt=ids[-k:], max_tokens=6,
                                       temperature=0, extra_body={"ignore_eos": True})
    assert direct.usage.prompt_tokens == k
    want = offline512.generate([ids[-k:]], SamplingParams(temperature=0, max_tokens=6,
                                                          ignore_eos=True))[0].outputs[0]
    assert r.choices[0].text == direct.choices[0].text == want.text
    assert r.usage.completion_tokens == 6


def test_http_chat_truncates_to_k(client, offline512):
    tok = offline512.get_tokenizer()
    conv = [{"role": "user", "content": "the quick brown fox jumps " * 60}]
    text = tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
    full = tok.encode(text, add_special_tokens=False)
    k = 64
    assert len(full) > k
    r = client.chat.completions.create(model="tiny", messages=conv, max_tokens=5,
                                       temperature=0,
                                       extra_body={"truncate_prompt_tokens": k,
                                                   "ignore_eos": True})
    assert r.usage.prompt_tokens == k
    want = offline512.generate([full[-k:]], SamplingParams(temperature=0, max_tokens=5,
                                                           ignore_eos=True))[0].outputs[0]
    assert r.choices[0].message.content == want.text


@pytest.mark.parametrize("bad,needle", [(0, ">= 1 or -1"), (-2, ">= 1 or -1"),
                                        (513, "is greater than max_model_len (512)")])
def test_http_bad_values_are_400(client, bad, needle):
    for call in (lambda: client.completions.create(
                     model="tiny", prompt="hello", max_tokens=2,
                     extra_body={"truncate_prompt_tokens": bad}),
                 lambda: client.chat.completions.create(
                     model="tiny", messages=[{"role": "user", "content": "hello"}],
                     max_tokens=2, extra_body={"truncate_prompt_tokens": bad})):
        with pytest.raises(openai_mod.BadRequestError) as exc:
            call()
        msg = exc.value.body["message"] if isinstance(exc.value.body, dict) else str(exc.value)
        print(msg)
        assert "truncate_prompt_tokens" in msg and needle in msg


def test_http_too_long_without_the_option_is_400(client):
    with pytest.raises(openai_mod.BadRequestError) as exc:
        client.completions.create(model="tiny", prompt=_ids(700), max_tokens=2)
    assert "700 tokens" in str(exc.value) and "512" in str(exc.value)


def test_right_truncation_fault_keeps_the_first_k(llm):
    from minivllm.precision import faults

    ids = _ids(30, seed=5)
    sp = SamplingParams(truncate_prompt_tokens=9, **GREEDY)
    with faults.right_truncation(llm):
        assert llm.generate([ids], sp)[0].prompt_token_ids == ids[:9]
        assert llm.generate([ids[:5]], sp)[0].prompt_token_ids == ids[:5]
    assert llm.generate([ids], sp)[0].prompt_token_ids == ids[-9:]
