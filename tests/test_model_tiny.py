"""End-to-end parity on the tiny random Llama: our engine against transformers'
LlamaForCausalLM on the same weights (float32 is the reference).

Tolerances (absolute, on natural-log probabilities / logits):

* float32 weights and float32 KV cache: <= 1e-4. Both sides run the same float32 ops
  in a different order (fused qkv, paged gathers, SDPA vs eager attention), so only
  rounding-level differences (~1e-6) are expected.
* kv_cache_dtype float16: <= 5e-3 (10 mantissa bits, relative rounding 2^-11 ~ 4.9e-4
  per stored K/V element);
* bfloat16: <= 5e-2 (7 bits, 2^-8 ~ 3.9e-3);
* fp8_e4m3: <= 0.5 (3 bits, 2^-4 ~ 6.3e-2); fp8_e5m2: <= 1.0 (2 bits, 2^-3 ~ 0.125).
  The tiny model's K/V values are O(1), so scale 1.0 keeps them inside fp8's normal
  range, and the error is the rounding of the format.
Each low-precision cache must also show a non-zero error (the dtype is really used),
growing with coarser formats.
"""

from __future__ import annotations

import pytest
import torch

from minivllm import LLM, SamplingParams

FP32_TOL = 1e-4
KV_TOL = {"float16": 5e-3, "bfloat16": 5e-2, "fp8_e4m3": 0.5, "fp8_e5m2": 1.0}


pytestmark = pytest.mark.usefixtures("one_thread")


# --- references -----------------------------------------------------------------------

@pytest.fixture(scope="module")
def hf(tiny_hf_model):
    model = tiny_hf_model

    @torch.no_grad()
    def logits(ids: list[int]) -> torch.Tensor:
        """[len(ids), V] float32 logits of transformers on the whole sequence."""
        return model(torch.tensor([ids])).logits[0].float()

    def logprobs(ids: list[int]) -> torch.Tensor:
        return torch.log_softmax(logits(ids), dim=-1)

    def greedy(prompt: list[int], n: int) -> list[int]:
        """A plain greedy loop: full forward each step, argmax of the last row."""
        ids = list(prompt)
        for _ in range(n):
            ids.append(int(logits(ids)[-1].argmax()))
        return ids[len(prompt):]

    logits.logprobs = logprobs
    logits.greedy = greedy
    logits.vocab_size = model.config.vocab_size
    return logits


@pytest.fixture(scope="module")
def prompts(hf):
    """Random token prompts of different lengths (no special ids 0-2)."""
    g = torch.Generator().manual_seed(1234)
    return [torch.randint(3, hf.vocab_size, (n,), generator=g).tolist()
            for n in (37, 5, 61, 18, 1)]


def make_llm(model_dir, **kw) -> LLM:
    kw.setdefault("max_model_len", 256)
    kw.setdefault("seed", 0)
    kw.setdefault("dtype", "float32")  # dtype="auto" would serve the fp32 checkpoint in bf16
    return LLM(model=str(model_dir), **kw)


def prompt_lp_error(out, ref_lp: torch.Tensor) -> float:
    """Max |ours - ref| over every returned prompt log-prob (actual token + top-N)."""
    plp = out.prompt_logprobs
    assert plp is not None
    n_entries, n_tokens = len(plp), len(out.prompt_token_ids)
    assert n_entries == n_tokens, f"{n_entries} prompt log-prob entries for {n_tokens} tokens"
    assert plp[0] is None
    err = 0.0
    for pos in range(1, len(plp)):
        d = plp[pos]
        assert out.prompt_token_ids[pos] in d
        for tok, lp in d.items():
            err = max(err, abs(lp.logprob - float(ref_lp[pos - 1, tok])))
    return err


def gen_lp_error(out, ref_lp: torch.Tensor) -> float:
    """Max |ours - ref| over the generated tokens' returned log-probs; ref_lp is HF on
    prompt + generated tokens."""
    comp = out.outputs[0]
    n_prompt = len(out.prompt_token_ids)
    assert comp.logprobs is not None and len(comp.logprobs) == len(comp.token_ids)
    err = 0.0
    for i, (tok, d) in enumerate(zip(comp.token_ids, comp.logprobs)):
        assert tok in d
        for t, lp in d.items():
            err = max(err, abs(lp.logprob - float(ref_lp[n_prompt - 1 + i, t])))
    return err


def check_against_hf(hf, outs, *, tol=FP32_TOL, greedy=True, what=""):
    """Tokens equal HF's greedy loop (when greedy) and log-probs within tol."""
    worst = 0.0
    for out in outs:
        comp = out.outputs[0]
        if greedy:
            want = hf.greedy(out.prompt_token_ids, len(comp.token_ids))
            assert comp.token_ids == want, f"{what}: ours {comp.token_ids} != HF greedy {want}"
        ref = hf.logprobs(out.prompt_token_ids + comp.token_ids)
        if comp.logprobs is not None:
            worst = max(worst, gen_lp_error(out, ref))
        if out.prompt_logprobs is not None:
            worst = max(worst, prompt_lp_error(out, ref))
    assert worst <= tol, f"{what}: max |log-prob diff| vs transformers = {worst:.3e} > {tol:.0e}"
    return worst


# --- float32 parity -------------------------------------------------------------------

def test_final_logits_equal_transformers(tiny_model_dir, hf, prompts, monkeypatch):
    """Spy on the engine's compute_logits: every sampled row equals HF's logits."""
    llm = make_llm(tiny_model_dir)
    model = llm.llm_engine.model_runner.model
    seen = []
    real = model.compute_logits

    def spy(hidden):
        out = real(hidden)
        seen.append(out.detach().clone())
        return out

    monkeypatch.setattr(model, "compute_logits", spy)
    prompt = prompts[0]
    (out,) = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    toks = out.outputs[0].token_ids
    assert len(seen) == 6 and all(s.shape == (1, hf.vocab_size) for s in seen)
    ref = hf(prompt + toks)
    err = max((s[0] - ref[len(prompt) - 1 + i]).abs().max().item() for i, s in enumerate(seen))
    assert err <= FP32_TOL, f"max |logit diff| vs transformers = {err:.3e}"
    print(f"float32 logits: max |diff| = {err:.3e}")


def test_prompt_and_sample_logprobs_equal_transformers(tiny_model_dir, hf, prompts):
    llm = make_llm(tiny_model_dir, enable_prefix_caching=False)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=10,
                            prompt_logprobs=10)
    outs = llm.generate(prompts, params)
    err = check_against_hf(hf, outs, what="float32")
    print(f"float32 prompt+sample log-probs: max |diff| = {err:.3e}")
    # Ranks and top-N order of the raw distribution agree with HF's.
    for out in outs:
        ref = hf.logprobs(out.prompt_token_ids + out.outputs[0].token_ids)
        n_prompt = len(out.prompt_token_ids)
        for i, (tok, d) in enumerate(zip(out.outputs[0].token_ids, out.outputs[0].logprobs)):
            assert d[tok].rank == 1  # greedy picks the argmax
            top = ref[n_prompt - 1 + i].topk(10).indices.tolist()
            assert set(d) == set(top) | {tok}


def test_greedy_batch_matches_hf_greedy_loop(tiny_model_dir, hf, prompts):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    text = "Paged attention stores keys and values in fixed-size blocks."
    llm = make_llm(tiny_model_dir)
    batch = prompts + [text]
    params = [SamplingParams(temperature=0, max_tokens=12 + i, ignore_eos=True)
              for i in range(len(batch))]
    outs = llm.generate(batch, params)
    assert outs[-1].prompt_token_ids == tok.encode(text)
    for i, out in enumerate(outs):
        assert len(out.outputs[0].token_ids) == 12 + i
        assert out.outputs[0].finish_reason == "length"
    check_against_hf(hf, outs, what="greedy batch")
    # The text is the detokenized tokens.
    comp = outs[-1].outputs[0]
    assert comp.text == tok.decode(comp.token_ids, skip_special_tokens=True)


def test_decode_groups_of_very_different_lengths(tiny_model_dir, hf):
    """Decodes of short and long sequences in one step are split into length groups
    (see TorchAttentionBackend._decode_groups); results must not depend on the grouping."""
    g = torch.Generator().manual_seed(7)
    lengths = (3, 12, 40, 330, 470)
    batch = [torch.randint(3, hf.vocab_size, (n,), generator=g).tolist() for n in lengths]
    llm = make_llm(tiny_model_dir, max_model_len=512)
    runner = llm.llm_engine.model_runner
    seen = []
    original = runner.backend._decode_groups

    def spy(common, rows, tables, lens):
        groups = original(common, rows, tables, lens)
        seen.append(len(groups))
        return groups

    runner.backend._decode_groups = spy
    outs = llm.generate(batch, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True,
                                              logprobs=3))
    assert max(seen) >= 2, f"expected several decode groups, saw at most {max(seen)}"
    check_against_hf(hf, outs, what="decode groups")


# --- scheduling features must not change results --------------------------------------

def test_chunked_prefill_on_and_off_give_identical_results(tiny_model_dir, hf, prompts):
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=5,
                            prompt_logprobs=5)
    chunked = make_llm(tiny_model_dir, enable_chunked_prefill=True, max_num_batched_tokens=8,
                       enable_prefix_caching=False)
    whole = make_llm(tiny_model_dir, enable_chunked_prefill=False, enable_prefix_caching=False)
    out_c = chunked.generate(prompts, params)
    out_w = whole.generate(prompts, params)
    # Chunking really happened: no step over 8 tokens, and prompts of 37/61 tokens.
    steps = [h[4] for h in chunked.stats.history]
    assert max(steps) == 8 and len(steps) >= (37 + 5 + 61 + 18 + 1) // 8
    assert max(h[4] for h in whole.stats.history) >= 61
    for c, w in zip(out_c, out_w):
        assert c.outputs[0].token_ids == w.outputs[0].token_ids
    err_c = check_against_hf(hf, out_c, what="chunked prefill")
    err_w = check_against_hf(hf, out_w, what="whole prefill")
    diff = max(abs(c.prompt_logprobs[p][t].logprob - w.prompt_logprobs[p][t].logprob)
               for c, w in zip(out_c, out_w) for p in range(1, len(c.prompt_token_ids))
               for t in c.prompt_logprobs[p])
    assert diff <= FP32_TOL, f"chunked vs whole prompt log-probs differ by {diff:.3e}"
    print(f"chunked {err_c:.3e}, whole {err_w:.3e}, chunked vs whole {diff:.3e}")


@pytest.mark.parametrize("chunked", [False, True])
def test_prefix_caching_on_and_off_give_identical_results(tiny_model_dir, hf, chunked):
    g = torch.Generator().manual_seed(7)
    shared = torch.randint(3, hf.vocab_size, (24,), generator=g).tolist()  # 6 blocks of 4
    suffixes = [torch.randint(3, hf.vocab_size, (n,), generator=g).tolist() for n in (1, 3, 9)]
    second = [shared + s for s in suffixes] + [shared[:13]]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=5)
    results = {}
    for caching in (True, False):
        llm = make_llm(tiny_model_dir, block_size=4, enable_prefix_caching=caching,
                       enable_chunked_prefill=chunked,
                       max_num_batched_tokens=8 if chunked else None)
        first = llm.generate([shared + [5, 6]], params)
        outs = llm.generate(second, params)
        check_against_hf(hf, first + outs, what=f"prefix caching={caching}")
        results[caching] = outs
        if caching:
            assert llm.stats.prefix_cache_hits > 0
            # shared+[1 token]: 24 cached tokens, only the last token is computed
            assert [o.num_cached_tokens for o in outs] == [24, 24, 24, 12]
        else:
            assert llm.stats.prefix_cache_hits == 0
            assert all(o.num_cached_tokens == 0 for o in outs)
    for a, b in zip(results[True], results[False]):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        diff = max(abs(la[t].logprob - lb[t].logprob)
                   for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs) for t in la)
        assert diff <= FP32_TOL, f"prefix cache hit vs miss log-probs differ by {diff:.3e}"


@pytest.mark.parametrize("caching", [False, True])
def test_forced_preemption_gives_identical_results(tiny_model_dir, hf, caching):
    g = torch.Generator().manual_seed(3)
    shared = torch.randint(3, hf.vocab_size, (8,), generator=g).tolist()
    batch = [(shared if i % 2 else []) + torch.randint(3, hf.vocab_size, (6 + 2 * i,),
                                                      generator=g).tolist() for i in range(6)]
    # Even requests also ask for prompt log-probs (those skip the prefix cache), so a
    # request whose prompt log-probs were already returned gets preempted and recomputed.
    params = [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=3,
                             prompt_logprobs=2 if i % 2 == 0 else None) for i in range(6)]
    # 16 blocks x 4 tokens = 64 slots for six requests of up to 40 tokens each.
    small = make_llm(tiny_model_dir, block_size=4, max_model_len=64, num_gpu_blocks_override=16,
                     enable_prefix_caching=caching)
    big = make_llm(tiny_model_dir, block_size=4, max_model_len=64, enable_prefix_caching=caching)
    out_s = small.generate(batch, params)
    out_b = big.generate(batch, params)
    assert small.stats.num_preemptions > 0
    assert big.stats.num_preemptions == 0
    assert any(o.metrics["num_preemptions"] > 0 and o.prompt_logprobs is not None
               for o in out_s)
    for s, b in zip(out_s, out_b):
        assert s.outputs[0].token_ids == b.outputs[0].token_ids
    err = check_against_hf(hf, out_s, what="under preemption")
    print(f"preemption (caching={caching}): max |diff| vs HF = {err:.3e}")


def test_seeded_sampling_survives_preemption(tiny_model_dir, hf):
    g = torch.Generator().manual_seed(11)
    batch = [torch.randint(3, hf.vocab_size, (10 + i,), generator=g).tolist() for i in range(6)]
    params = [SamplingParams(temperature=1.0, seed=100 + i, max_tokens=16, ignore_eos=True)
              for i in range(6)]
    small = make_llm(tiny_model_dir, block_size=4, max_model_len=64, num_gpu_blocks_override=16)
    alone = make_llm(tiny_model_dir, block_size=4, max_model_len=64)
    out_s = small.generate(batch, params)
    assert small.stats.num_preemptions > 0
    # Reference: each request alone (no batch, no preemption) with the same seed.
    for prompt, p, s in zip(batch, params, out_s):
        (a,) = alone.generate([prompt], p)
        assert s.outputs[0].token_ids == a.outputs[0].token_ids


# --- KV-cache storage dtypes ----------------------------------------------------------

def test_kv_cache_dtypes_against_float32(tiny_model_dir, hf, prompts):
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=5,
                            prompt_logprobs=5)
    errors = {}
    expected_storage = {"float16": torch.float16, "bfloat16": torch.bfloat16,
                        "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
    for name, tol in KV_TOL.items():
        llm = make_llm(tiny_model_dir, kv_cache_dtype=name, enable_prefix_caching=False)
        assert llm.llm_engine.model_runner.kv_caches[0].key.dtype == expected_storage[name]
        outs = llm.generate(prompts[:3], params)
        # Tokens may diverge under coarse caches; log-probs are compared on whatever
        # tokens were generated, with HF float32 (float32 K/V) on the same tokens.
        errors[name] = check_against_hf(hf, outs, tol=tol, greedy=False,
                                        what=f"kv_cache_dtype={name}")
    print("max |log-prob diff| vs float32:", {k: f"{v:.3e}" for k, v in errors.items()})
    assert all(v > 0 for v in errors.values()), errors
    assert errors["float16"] < errors["bfloat16"] < errors["fp8_e4m3"], errors
    assert errors["bfloat16"] < errors["fp8_e5m2"], errors
