"""The public API (LLM.generate / LLM.chat) on the tiny random Llama, checked against
transformers' LlamaForCausalLM on the same weights (float32) as the reference.

Expected outputs are never copied from the engine: greedy continuations, log-probs and
chat prompts are computed here with transformers and the tokenizer. Greedy references
assert a top-1/top-2 logit gap of at least 1e-3 at every step, so float32 differences
between the two implementations (~1e-5) cannot flip a token.
"""

from __future__ import annotations

import math

import pytest
import torch

from minivllm import LLM, SamplingParams
from minivllm.config import ALLOWED_DTYPES, ALLOWED_KV_CACHE_DTYPES

MAX_LEN = 96
LOGPROB_TOL = 1e-4  # float32 engine vs float32 transformers


# --- fixtures and references --------------------------------------------------------

@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(model=str(tiny_model_dir), dtype="float32", max_model_len=MAX_LEN)


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def eos(tok):
    assert tok.eos_token == "<|im_end|>"
    return tok.eos_token_id


def hf_logprobs(hf, ids: list[int]) -> torch.Tensor:
    """[len(ids), V] log_softmax of transformers' logits (row i = distribution of token i+1)."""
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0]
    return torch.log_softmax(logits.double(), dim=-1)


def hf_greedy(hf, prompt: list[int], max_tokens: int, stop_ids=(), min_tokens: int = 0,
              gap: float = 1e-3) -> list[int]:
    """Greedy continuation: stop ids are masked while fewer than min_tokens exist, and
    generation ends after a stop id (the reference for EOS / stop_token_ids)."""
    seq, out = list(prompt), []
    for j in range(max_tokens):
        lp = hf_logprobs(hf, seq)[-1].clone()
        if j < min_tokens and stop_ids:
            lp[list(stop_ids)] = -math.inf
        v, i = lp.topk(2)
        assert float(v[0] - v[1]) > gap, f"near-tie at step {j}: the reference is ambiguous"
        t = int(i[0])
        out.append(t)
        seq.append(t)
        if t in stop_ids:
            break
    return out


def eos_prompt(hf, eos) -> list[int]:
    """A one-token prompt whose greedy next token is EOS (searched with transformers)."""
    with torch.no_grad():
        logits = hf(torch.arange(hf.config.vocab_size)[:, None]).logits[:, -1]
    v, i = logits.topk(2, dim=-1)
    gap = torch.where(i[:, 0] == eos, v[:, 0] - v[:, 1], torch.full_like(v[:, 0], -1.0))
    best = int(gap.argmax())
    assert float(gap[best]) > 1e-2, "no prompt of the tiny model predicts EOS next"
    return [best]


def ascii_prefixes(tok, tokens) -> str:
    """Decoded text, asserting every token prefix decodes to a prefix of it (so the
    stop-string reference below is unambiguous)."""
    full = tok.decode(tokens, skip_special_tokens=True)
    for m in range(1, len(tokens) + 1):
        assert full.startswith(tok.decode(tokens[:m], skip_special_tokens=True))
    return full


def pick_stop(full: str, after: int) -> str:
    """A 2-character ASCII string occurring exactly once in `full`, at index >= after."""
    for j in range(after, len(full) - 1):
        s = full[j:j + 2]
        if s.isascii() and full.count(s) == 1 and s.strip():
            return s
    raise AssertionError(f"no unique stop string in {full!r}")


# --- order, prompt ids, greedy parity --------------------------------------------------

def test_outputs_in_input_order_with_prompt_token_ids(llm, tok, tiny_hf_model, eos):
    prompts = ["The quick brown fox", [5, 17, 33, 90, 100, 7], "Once upon a time there was",
               "Floating point numbers"]
    max_tokens = [9, 2, 5, 1]  # the first finishes last
    outs = llm.generate(prompts, [SamplingParams(temperature=0.0, max_tokens=m) for m in max_tokens])
    assert len(outs) == len(prompts)
    assert len({o.request_id for o in outs}) == len(prompts)
    for prompt, m, out in zip(prompts, max_tokens, outs):
        ids = tok.encode(prompt) if isinstance(prompt, str) else prompt
        assert out.prompt_token_ids == ids
        assert out.prompt == (prompt if isinstance(prompt, str) else None)
        assert out.finished and len(out.outputs) == 1
        comp = out.outputs[0]
        assert comp.token_ids == hf_greedy(tiny_hf_model, ids, m, stop_ids=(eos,))
        assert comp.finish_reason == ("stop" if comp.token_ids[-1] == eos else "length")
        assert comp.text == tok.decode(comp.token_ids, skip_special_tokens=True)
        assert comp.logprobs is None and comp.cumulative_logprob is None
        assert out.prompt_logprobs is None


def test_single_prompt_forms(llm, tok):
    one = llm.generate("The quick brown fox", SamplingParams(temperature=0.0, max_tokens=2))
    ids = llm.generate([310, 71, 368], SamplingParams(temperature=0.0, max_tokens=2))
    assert len(one) == 1 and one[0].prompt_token_ids == tok.encode("The quick brown fox")
    assert len(ids) == 1 and ids[0].prompt_token_ids == [310, 71, 368]


# --- seeds --------------------------------------------------------------------------

def test_seeded_sampling_reproducible_across_batches(llm):
    prompt = "The quick brown fox"
    sp = SamplingParams(temperature=1.0, seed=1234, max_tokens=12, ignore_eos=True)
    a = llm.generate([prompt], sp)[0].outputs[0].token_ids
    b = llm.generate([prompt], sp)[0].outputs[0].token_ids
    assert a == b and len(a) == 12
    assert len(set(a)) > 3  # really sampled, not a greedy loop

    # other batch compositions: seeded/unseeded/greedy neighbours, different lengths
    batch = llm.generate(
        ["Once upon a time", prompt, [3, 4, 5, 6, 7, 8, 9], prompt, prompt],
        [SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True),
         sp,
         SamplingParams(temperature=0.0, max_tokens=7),
         SamplingParams(temperature=0.7, top_k=20, seed=99, max_tokens=3),
         sp])
    assert batch[1].outputs[0].token_ids == a
    assert batch[4].outputs[0].token_ids == a
    # a different seed gives a different sample (12 draws from a ~flat 384-token vocab)
    c = llm.generate([prompt], SamplingParams(temperature=1.0, seed=1235, max_tokens=12,
                                              ignore_eos=True))[0].outputs[0].token_ids
    assert c != a


def test_seed_is_independent_of_prompt_position_in_time(llm):
    """The seeded request gives the same tokens when it joins a batch that is already
    decoding (continuous batching) as when it runs alone."""
    sp = SamplingParams(temperature=0.9, top_p=0.9, seed=5, max_tokens=8, ignore_eos=True)
    alone = llm.generate(["def add(a, b):"], sp)[0].outputs[0].token_ids
    eng = llm.llm_engine
    eng.add_request("Once upon a time", SamplingParams(temperature=1.0, max_tokens=12,
                                                       ignore_eos=True), request_id="early")
    eng.step()
    eng.step()  # "early" is decoding now
    eng.add_request("def add(a, b):", sp, request_id="late")
    done = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            done[out.request_id] = out
    assert done["late"].outputs[0].token_ids == alone


# --- stop conditions ----------------------------------------------------------------------

def first_step_containing(tok, tokens: list[int], stop: str) -> int:
    """Reference: the number of tokens after which the decoded text first contains stop."""
    return next(m for m in range(1, len(tokens) + 1)
                if stop in tok.decode(tokens[:m], skip_special_tokens=True))


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_ends_text(llm, tok, tiny_hf_model, eos, include):
    prompt = tok.encode("The quick brown fox")
    tokens = hf_greedy(tiny_hf_model, prompt, 20, stop_ids=(eos,))
    full = ascii_prefixes(tok, tokens)
    stop = pick_stop(full, after=3)
    m = first_step_containing(tok, tokens, stop)
    assert m < len(tokens), "the stop string must end generation early"
    idx = full.index(stop)
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=20, stop=stop,
                                                include_stop_str_in_output=include))[0]
    comp = out.outputs[0]
    print(f"stop={stop!r} at char {idx}, token {m}; text={comp.text!r}")
    assert comp.finish_reason == "stop"
    assert comp.stop_reason == stop
    assert comp.token_ids == tokens[:m]
    assert comp.text == (full[:idx + len(stop)] if include else full[:idx])
    assert comp.text.endswith(stop) == include


def test_earliest_of_several_stop_strings_wins(llm, tok, tiny_hf_model, eos):
    prompt = tok.encode("The quick brown fox")
    tokens = hf_greedy(tiny_hf_model, prompt, 20, stop_ids=(eos,))
    full = ascii_prefixes(tok, tokens)
    early = pick_stop(full, after=3)
    late = pick_stop(full, after=full.index(early) + 3)
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=20,
                                                stop=[late, early]))[0].outputs[0]
    assert out.stop_reason == early and out.text == full[:full.index(early)]


def test_stop_string_before_min_tokens_is_ignored(llm, tok, tiny_hf_model, eos):
    """A stop string completed while fewer than min_tokens exist does not stop the
    request, and is not matched again later (the output keeps its text)."""
    prompt = tok.encode("The quick brown fox")
    tokens = hf_greedy(tiny_hf_model, prompt, 16, stop_ids=(eos,))
    full = ascii_prefixes(tok, tokens)
    stop = pick_stop(full, after=3)
    m = first_step_containing(tok, tokens, stop)
    assert len(tokens) == 16 and m + 2 < 16
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=16, stop=stop,
                                                min_tokens=m + 2))[0].outputs[0]
    assert out.finish_reason == "length" and out.stop_reason is None
    assert out.token_ids == tokens and out.text == full


@pytest.mark.parametrize("include", [False, True])
def test_stop_token_ids(llm, tok, tiny_hf_model, eos, include):
    prompt = tok.encode("Floating point numbers")
    tokens = hf_greedy(tiny_hf_model, prompt, 14, stop_ids=(eos,))
    k = next(k for k in range(1, len(tokens)) if tokens[k] not in tokens[:k])
    stop_id = tokens[k]
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=14,
                                                stop_token_ids=[stop_id],
                                                include_stop_str_in_output=include))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id
    assert out.token_ids == tokens[:k + 1]  # the stop id is in token_ids ...
    # ... but not in the text (vLLM v1), unless include_stop_str_in_output
    assert out.text == tok.decode(tokens[:k + 1] if include else tokens[:k],
                                  skip_special_tokens=True)

    # with min_tokens the stop id is masked until min_tokens tokens exist
    min_tokens = k + 2
    ref = hf_greedy(tiny_hf_model, prompt, 14, stop_ids=(stop_id, eos), min_tokens=min_tokens)
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=14,
                                                stop_token_ids=[stop_id],
                                                min_tokens=min_tokens))[0].outputs[0]
    assert out.token_ids == ref
    assert stop_id not in out.token_ids[:min_tokens]


def test_eos_stops_and_ignore_eos_runs_to_max_tokens(llm, tok, tiny_hf_model, eos):
    prompt = eos_prompt(tiny_hf_model, eos)
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=6))[0].outputs[0]
    assert out.token_ids == [eos]
    assert out.finish_reason == "stop" and out.stop_reason is None and out.text == ""

    # EOS never reaches the text, even when special tokens are kept
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=6,
                                                skip_special_tokens=False))[0].outputs[0]
    assert out.token_ids == [eos] and "<|im_end|>" not in out.text

    for max_tokens in (1, 6):
        out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                    ignore_eos=True))[0].outputs[0]
        assert len(out.token_ids) == max_tokens
        assert out.token_ids[0] == eos  # EOS was generated and did not stop it
        assert out.finish_reason == "length" and out.stop_reason is None
        assert out.token_ids == hf_greedy(tiny_hf_model, prompt, max_tokens)


def test_min_tokens_blocks_eos(llm, tiny_hf_model, eos):
    prompt = eos_prompt(tiny_hf_model, eos)
    ref = hf_greedy(tiny_hf_model, prompt, 8, stop_ids=(eos,), min_tokens=3)
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8,
                                                min_tokens=3))[0].outputs[0]
    assert out.token_ids == ref
    assert len(out.token_ids) >= 3 and eos not in out.token_ids[:3]
    # sampled rows too: EOS is the likeliest first token, yet never drawn before min_tokens
    for seed in range(4):
        out = llm.generate([prompt], SamplingParams(temperature=1.0, seed=seed, max_tokens=4,
                                                    min_tokens=4))[0].outputs[0]
        assert len(out.token_ids) == 4 and eos not in out.token_ids


@pytest.mark.parametrize("min_tokens", [1, 4])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_min_tokens_masks_every_stop_token_id(llm, tok, tiny_hf_model, min_tokens, temperature):
    """Every token but one is a stop id: the first min_tokens tokens must all be that one,
    and the next token (any stop id) ends the request, so the length is exact."""
    prompt = tok.encode("Paged attention stores")
    V = tiny_hf_model.config.vocab_size
    keep = 100
    stops = [t for t in range(V) if t != keep]
    out = llm.generate([prompt], SamplingParams(temperature=temperature, seed=11, max_tokens=10,
                                                stop_token_ids=stops,
                                                min_tokens=min_tokens))[0].outputs[0]
    assert out.token_ids[:min_tokens] == [keep] * min_tokens
    assert len(out.token_ids) == min_tokens + 1
    assert out.finish_reason == "stop" and out.token_ids[-1] != keep
    if temperature == 0.0:
        ref = hf_greedy(tiny_hf_model, prompt, 10, stop_ids=set(stops), min_tokens=min_tokens)
        assert out.token_ids == ref


def test_max_model_len_caps_prompt_plus_output(llm):
    prompt = [(7 * i) % 300 + 3 for i in range(MAX_LEN - 3)]
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=50,
                                                ignore_eos=True))[0].outputs[0]
    assert len(out.token_ids) == 3 and out.finish_reason == "length"


# --- logprobs -----------------------------------------------------------------------------

def _check_logprob_entry(d, tok_id, ref_row, n, errors):
    """One position: d (token id -> Logprob) against the reference log-probs ref_row.
    Near-ties are judged by value (within LOGPROB_TOL), not by id, so a float32 swap of
    two almost equal tokens is not a failure but a wrong rank or value is."""
    ref_sorted = torch.sort(ref_row, descending=True).values
    top = sorted((lp.rank, t) for t, lp in d.items() if lp.rank <= n)
    assert [r for r, _ in top] == list(range(1, n + 1)), f"ranks of the top {n}: {top}"
    for r, t in top:  # the token at rank r has the r-th largest reference log-prob
        assert abs(float(ref_row[t]) - float(ref_sorted[r - 1])) < LOGPROB_TOL
    top_ids = [t for _, t in top]
    assert tok_id in d
    assert len(d) == (n if tok_id in top_ids else n + 1)
    lp_tok = float(ref_row[tok_id])
    if n and lp_tok > float(ref_sorted[n - 1]) + LOGPROB_TOL:
        assert tok_id in top_ids
    if n and lp_tok < float(ref_sorted[n - 1]) - LOGPROB_TOL:
        assert tok_id not in top_ids
    lower = 1 + int((ref_row > lp_tok + LOGPROB_TOL).sum())
    upper = 1 + int((ref_row > lp_tok - LOGPROB_TOL).sum())
    assert lower <= d[tok_id].rank <= upper
    for t, lp in d.items():
        errors.append(abs(lp.logprob - float(ref_row[t])))
        assert lp.decoded_token is not None


@pytest.mark.parametrize("n", [0, 1, 3])
def test_logprobs_match_transformers(llm, tok, tiny_hf_model, n):
    prompt = tok.encode("Once upon a time there was")
    params = [
        SamplingParams(temperature=1.0, seed=3, max_tokens=10, logprobs=n, ignore_eos=True,
                       repetition_penalty=1.3, top_k=50),  # logprobs stay raw (vLLM v1)
        SamplingParams(temperature=0.0, max_tokens=10, logprobs=n, ignore_eos=True),
    ]
    outs = llm.generate([prompt, prompt], params)
    errors: list[float] = []
    for which, out in zip(("sampled", "greedy"), outs):
        comp = out.outputs[0]
        assert len(comp.logprobs) == len(comp.token_ids) == 10
        ref = hf_logprobs(tiny_hf_model, prompt + comp.token_ids)[len(prompt) - 1:-1]
        for j, (t, d) in enumerate(zip(comp.token_ids, comp.logprobs)):
            _check_logprob_entry(d, t, ref[j], n, errors)
            if which == "greedy":
                assert d[t].rank == 1 and len(d) == max(n, 1)
        cum = sum(d[t].logprob for t, d in zip(comp.token_ids, comp.logprobs))
        assert comp.cumulative_logprob == pytest.approx(cum, abs=1e-9)
        ref_cum = float(sum(ref[j, t] for j, t in enumerate(comp.token_ids)))
        assert abs(comp.cumulative_logprob - ref_cum) < LOGPROB_TOL * len(comp.token_ids)
    sampled = outs[0].outputs[0]
    assert any(d[t].rank > max(n, 1) for t, d in zip(sampled.token_ids, sampled.logprobs)), \
        "the sampled run never left the top N: the N+1 case went untested"
    print(f"logprobs={n}: max |engine - transformers| = {max(errors):.2e} over {len(errors)} values")
    assert max(errors) < LOGPROB_TOL


@pytest.mark.parametrize("chunked", [False, True])
def test_prompt_logprobs_match_transformers(llm, tiny_model_dir, tok, tiny_hf_model, chunked):
    text = ("Once upon a time there was a tiny language model that liked numbers. "
            "Paged attention stores keys and values in fixed-size blocks.")
    prompt = tok.encode(text)
    assert len(prompt) > 32
    engine = llm
    if chunked:  # the prompt is computed in 16-token chunks over several steps
        engine = LLM(model=str(tiny_model_dir), dtype="float32", max_model_len=MAX_LEN, max_num_batched_tokens=16,
                     enable_chunked_prefill=True)
    # warm the prefix cache: prompt_logprobs must still cover every position
    engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1))
    out = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=2,
                                                   prompt_logprobs=3, logprobs=1))[0]
    plp = out.prompt_logprobs
    assert len(plp) == len(prompt) and plp[0] is None
    ref = hf_logprobs(tiny_hf_model, prompt)
    errors: list[float] = []
    for i in range(1, len(prompt)):
        _check_logprob_entry(plp[i], prompt[i], ref[i - 1], 3, errors)
    print(f"prompt_logprobs (chunked={chunked}): max error {max(errors):.2e} over {len(errors)}")
    assert max(errors) < LOGPROB_TOL
    # the generated tokens' logprobs continue where the prompt ends
    full = hf_logprobs(tiny_hf_model, prompt + out.outputs[0].token_ids)
    first = out.outputs[0].token_ids[0]
    assert abs(out.outputs[0].logprobs[0][first].logprob - float(full[len(prompt) - 1, first])) \
        < LOGPROB_TOL


# --- chat ---------------------------------------------------------------------------------

def _template_ids(tok, conv, add_generation_prompt=True):
    ids = tok.apply_chat_template(conv, add_generation_prompt=add_generation_prompt, tokenize=True)
    if not isinstance(ids, list):  # transformers 5 returns a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)


def test_chat_applies_template(llm, tok, tiny_hf_model, eos):
    conv1 = [{"role": "system", "content": "Be brief."},
             {"role": "user", "content": "What is 2+2?"}]
    conv2 = [{"role": "user", "content": "The quick brown fox"}]
    sp = SamplingParams(temperature=0.0, max_tokens=3)
    out = llm.chat(conv1, sp)
    assert len(out) == 1
    ref = _template_ids(tok, conv1)
    assert out[0].prompt_token_ids == ref
    gen_prompt = tok.encode("<|im_start|>assistant\n")
    assert ref[-len(gen_prompt):] == gen_prompt  # the generation prompt is there
    assert out[0].outputs[0].token_ids == hf_greedy(tiny_hf_model, ref, 3, stop_ids=(eos,))

    outs = llm.chat([conv2, conv1], sp)
    assert [o.prompt_token_ids for o in outs] == [_template_ids(tok, conv2), ref]
    no_gen = llm.chat(conv2, sp, add_generation_prompt=False)[0]
    assert no_gen.prompt_token_ids == _template_ids(tok, conv2, add_generation_prompt=False)
    with pytest.raises(ValueError):
        llm.chat([[]], sp)


# --- errors -------------------------------------------------------------------------------

def test_prompt_longer_than_max_model_len(llm, tok):
    too_long = [5] * (MAX_LEN + 7)
    with pytest.raises(ValueError) as exc:
        llm.generate([too_long], SamplingParams(max_tokens=2))
    msg = str(exc.value)
    assert str(MAX_LEN + 7) in msg and str(MAX_LEN) in msg and "max_model_len" in msg
    # nothing half-queued: the next call works and returns only its own output
    with pytest.raises(ValueError):
        llm.generate(["fine prompt", too_long], SamplingParams(max_tokens=2))
    assert not llm.llm_engine.has_unfinished_requests()
    outs = llm.generate(["fine prompt"], SamplingParams(temperature=0.0, max_tokens=2))
    assert len(outs) == 1 and outs[0].prompt_token_ids == tok.encode("fine prompt")


@pytest.mark.parametrize("bad", [[384], [1, 2, -1], [3, 1.5], [3, "4"], [True, 2], [10**9]])
def test_token_ids_outside_vocab(llm, bad):
    with pytest.raises(ValueError) as exc:
        llm.generate([bad], SamplingParams(max_tokens=1))
    assert "384" in str(exc.value)  # names the vocabulary bound


@pytest.mark.parametrize("empty", ["", [[]]])
def test_empty_prompt_raises(llm, empty):
    with pytest.raises(ValueError, match="empty"):
        llm.generate(empty, SamplingParams(max_tokens=1))


def test_sampling_params_list_of_wrong_length(llm):
    with pytest.raises(ValueError, match="2 sampling_params for 3 prompts"):
        llm.generate(["a", "b", "c"], [SamplingParams(), SamplingParams()])


@pytest.mark.parametrize("model", ["smollm2-999m-typo", "/nonexistent/folder/for-minivllm"])
def test_unknown_model_lists_aliases(model):
    from minivllm.models.loader import ALIASES

    with pytest.raises(ValueError) as exc:
        LLM(model=model)
    msg = str(exc.value)
    assert model in msg
    assert ALIASES and all(alias in msg for alias in ALIASES)


def test_model_folder_without_config(tmp_path):
    with pytest.raises(ValueError, match="config.json"):
        LLM(model=str(tmp_path))


@pytest.mark.parametrize("value", ["int4", "fp8_e4m3fn", "FP8", "half-ish"])
def test_unsupported_kv_cache_dtype(tiny_model_dir, value):
    with pytest.raises(ValueError) as exc:
        LLM(model=str(tiny_model_dir), kv_cache_dtype=value)
    msg = str(exc.value)
    assert value in msg and "kv_cache_dtype" in msg
    assert all(a in msg for a in ALLOWED_KV_CACHE_DTYPES)


@pytest.mark.parametrize("value", ["float64", "int8", "fp16", torch.float64])
def test_unsupported_dtype(tiny_model_dir, value):
    with pytest.raises(ValueError) as exc:
        LLM(model=str(tiny_model_dir), dtype=value)
    msg = str(exc.value)
    assert "dtype" in msg and str(value).replace("torch.", "") in msg
    assert all(a in msg for a in ALLOWED_DTYPES)


def test_unknown_llm_kwarg(tiny_model_dir):
    with pytest.raises(TypeError) as exc:
        LLM(model=str(tiny_model_dir), max_model_length=64)
    assert "max_model_length" in str(exc.value) and "max_model_len" in str(exc.value)


# --- tokenizer loading --------------------------------------------------------------

TOKENIZER_TEXTS = ["Hello world", "  spaces\tand\nnewlines ", "émoji 🙂 and 日本語",
                   "<|im_start|>user\nhi<|im_end|>", ""]


@pytest.mark.parametrize("which", ["tiny", pytest.param("embedded", marks=pytest.mark.embedded)])
def test_direct_tokenizer_load_equals_autotokenizer(which, request):
    """minivllm.tokenizer loads PreTrainedTokenizerFast directly when tokenizer_config.json
    names it (skipping AutoTokenizer's config registry, ~5 s per process): it must give
    the same ids, decoded text, special tokens and chat prompt as AutoTokenizer."""
    from transformers import AutoTokenizer

    from minivllm.tokenizer import _FAST_CLASSES, _tokenizer_class, get_tokenizer

    path = str(request.getfixturevalue(
        "tiny_model_dir" if which == "tiny" else "embedded_model_dir"))
    assert _tokenizer_class(path) in _FAST_CLASSES  # the direct path is the one under test
    ours, auto = get_tokenizer(path), AutoTokenizer.from_pretrained(path)
    assert type(ours) is type(auto)
    for text in TOKENIZER_TEXTS:
        ids = ours(text).input_ids
        assert ids == auto(text).input_ids, text
        assert ours.decode(ids) == auto.decode(ids)
    assert (ours.bos_token, ours.eos_token, ours.all_special_ids) == \
        (auto.bos_token, auto.eos_token, auto.all_special_ids)
    if auto.chat_template:
        msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]
        assert ours.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == \
            auto.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)


def test_tokenizer_load_error_names_the_folder(tmp_path):
    from minivllm.tokenizer import get_tokenizer

    with pytest.raises(ValueError, match=str(tmp_path)):
        get_tokenizer(str(tmp_path))
