"""Speculative decoding (chapter 21): config validation, the n-gram proposer, the
rejection sampler (greedy and random paths, a chi-square test of the random path),
and the engine: greedy output equal to plain decoding, exact stop conditions, rollback
of rejected drafts with prefix caching and preemption, no leaked blocks, metrics, the
planted "first draft accepted unverified" fault."""

from __future__ import annotations

import types

import pytest
import torch

from minivllm import LLM, SamplingParams
from minivllm.config import SpeculativeConfig, parse_speculative_config
from minivllm.engine.arg_utils import EngineArgs
from minivllm.precision.faults import (rejection_sampler_first_unverified,
                                       spec_accept_first_unverified)
from minivllm.spec_decode import propose_ngram, rejection_sample_random, verify_greedy

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
         "prompt_lookup_min": 1}
# Prompts with repeats (so prompt lookup finds drafts), as token ids of the tiny model.
PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [1, 1, 1, 1, 1, 1, 1], [10, 20, 30, 40, 50, 10, 20, 30],
           [33, 34, 35, 33, 34, 35, 33], [100, 101, 100, 101, 100, 7, 9, 100, 101],
           [42, 43, 44, 45, 46, 47, 48, 49]]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def _ids(outs):
    return [o.outputs[0].token_ids for o in outs]


def _gen(llm, prompts, params):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


@pytest.fixture(scope="module")
def plain(tiny_model_dir):
    return LLM(str(tiny_model_dir), dtype="float32")


@pytest.fixture(scope="module")
def spec(tiny_model_dir):
    return LLM(str(tiny_model_dir), dtype="float32", speculative_config=NGRAM)


@pytest.fixture(scope="module")
def reference_ids(plain):
    return _ids(_gen(plain, PROMPTS, GREEDY))


# --- configuration ----------------------------------------------------------------------

def test_config_defaults_as_vllm():
    assert parse_speculative_config({"method": "ngram", "num_speculative_tokens": 2}) == \
        SpeculativeConfig("ngram", 2, 5, 5)
    assert parse_speculative_config({"method": "ngram", "num_speculative_tokens": 2,
                                     "prompt_lookup_max": 4}).prompt_lookup_min == 4
    assert parse_speculative_config({"method": "ngram", "num_speculative_tokens": 2,
                                     "prompt_lookup_min": 2}).prompt_lookup_max == 2
    c = parse_speculative_config({"model": "x", "num_speculative_tokens": 1})
    assert (c.method, c.model) == ("draft_model", "x")
    assert parse_speculative_config(None) is None


@pytest.mark.parametrize("value, words", [
    ("ngram", "must be a dict"),
    ({"method": "ngram", "num_speculative_tokens": 2, "foo": 1}, "unknown speculative_config key"),
    ({"method": "eagle", "num_speculative_tokens": 2}, "must be one of ngram, draft_model"),
    ({"method": "ngram"}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "positive integer"),
    ({"method": "ngram", "num_speculative_tokens": True}, "positive integer"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4,
      "prompt_lookup_max": 2}, "larger than prompt_lookup_max"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0}, "positive integer"),
    ({"method": "ngram", "num_speculative_tokens": 2, "model": "x"}, "has no draft model"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "needs 'model'"),
    ({"method": "draft_model", "num_speculative_tokens": 2, "model": "x",
      "prompt_lookup_max": 3}, "apply to method='ngram'"),
    ({"method": "draft_model", "num_speculative_tokens": 2, "model": "x", "dtype": "fp7"},
     "is not a dtype"),
])
def test_config_errors(value, words):
    with pytest.raises(ValueError, match=words):
        EngineArgs(speculative_config=value).validate()


def test_draft_vocab_mismatch_is_refused(tiny_model_dir, tmp_path):
    from tests.tiny_model import make_tiny_llama

    other = make_tiny_llama(tmp_path / "other")
    import json
    cfg = json.loads((other / "config.json").read_text())
    cfg["vocab_size"] += 8
    (other / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="vocab_size"):
        LLM(str(tiny_model_dir), dtype="float32", load_format="auto",
            speculative_config={"model": str(other), "num_speculative_tokens": 2,
                                "dtype": "float32"})


def test_k_larger_than_token_budget_is_refused(tiny_model_dir):
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        LLM(str(tiny_model_dir), max_num_batched_tokens=4, max_model_len=256,
            speculative_config={**NGRAM, "num_speculative_tokens": 4})


# --- the n-gram proposer: vLLM's own cases (tests/v1/spec_decode/test_ngram.py) -----------

@pytest.mark.parametrize("tokens, lo, hi, k, want", [
    ([1, 2, 3, 4, 1, 2, 3, 5, 6], 2, 2, 2, []),
    ([1, 2, 3, 4, 1, 2, 3], 2, 2, 3, [4, 1, 2]),
    ([1, 2, 3, 4, 1, 2, 3], 2, 2, 2, [4, 1]),
    ([1, 2, 3, 4, 1, 2, 3], 1, 1, 3, [4, 1, 2]),
    ([1, 3, 6, 2, 3, 4, 1, 2, 3], 2, 2, 3, [4, 1, 2]),
    ([1, 3, 6, 2, 3, 4, 1, 2, 3], 1, 1, 2, [6, 2]),  # the first occurrence
    ([1, 2, 3, 4, 5], 2, 2, 2, []),
    ([1, 2, 3, 4, 1, 2, 3], 4, 4, 2, []),
    ([1, 2, 3, 4, 1, 2, 3], 3, 4, 2, [4, 1]),
    ([2, 3, 4, 5, 1, 2, 3, 4, 1, 2, 3, 4], 3, 4, 2, [1, 2]),  # the 4-gram wins
    ([3, 4, 5, 2, 3, 4, 1, 2, 3, 4], 2, 4, 2, [1, 2]),
    ([1, 2, 3, 100, 1, 2, 3, 200, 1, 2, 3, 300, 1, 2, 3], 3, 3, 2, [100, 1]),
    ([1, 1, 1, 1], 1, 3, 3, [1]),  # overlapping occurrence; the sequence ends
    ([7], 1, 3, 3, []),
])
def test_propose_ngram(tokens, lo, hi, k, want):
    assert propose_ngram(tokens, lo, hi, k) == want


def test_propose_ngram_rejects_bad_sizes():
    with pytest.raises(ValueError, match="min_n"):
        propose_ngram([1, 2], 3, 2, 1)


# --- the rejection sampler ----------------------------------------------------------------

def test_verify_greedy_cases():
    assert verify_greedy([4, 5, 6], [4, 5, 6, 7]) == [4, 5, 6, 7]  # all accepted + bonus
    assert verify_greedy([4, 5, 6], [4, 9, 6, 7]) == [4, 9]  # correction at the mismatch
    assert verify_greedy([4, 5, 6], [8, 5, 6, 7]) == [8]
    assert verify_greedy([], [3]) == [3]
    with pytest.raises(ValueError, match="k \\+ 1"):
        verify_greedy([1, 2], [1, 2])


def _chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson chi-square p-value of counts against probs (cells with p > 0)."""
    keep = probs > 0
    n = counts.sum()
    exp = probs[keep].double() * n
    stat = float((((counts[keep].double() - exp) ** 2) / exp).sum())
    df = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


P_THRESHOLD = 1e-3
TRIALS = 20_000


def _first_token_counts(fn, draft_probs_on: bool, seed: int):
    """Counts of the first emitted token over TRIALS calls, V = 8, k = 2: drafts drawn
    from q (or a fixed n-gram draft), verified against p."""
    g = torch.Generator().manual_seed(seed)
    V, k = 8, 2
    p = torch.distributions.Dirichlet(torch.ones(V)).sample((k + 1,))
    q = torch.distributions.Dirichlet(torch.ones(V)).sample((k,))
    counts = torch.zeros(V)
    for _ in range(TRIALS):
        if draft_probs_on:
            draft = [int(torch.multinomial(q[j], 1, generator=g)) for j in range(k)]
            out = fn(draft, q, p, None, g)
        else:
            out = fn([3, 5], None, p, None, g)
        counts[out[0]] += 1
    return counts, p[0]


@pytest.mark.parametrize("with_q", [True, False], ids=["draft-model-q", "ngram-point-mass"])
def test_random_path_preserves_target_distribution(with_q):
    """The first emitted token must be distributed as p_0 whatever q is (Leviathan et al.
    2023, Theorem 1). Chi-square over V = 8 cells, 20k seeded trials: p-value above 1e-3;
    the planted fault (draft 0 accepted unverified) must fail the same check."""
    from minivllm.spec_decode import rejection_sampler_ref

    torch.manual_seed(0)
    counts, p0 = _first_token_counts(rejection_sampler_ref, with_q, seed=1)
    pv = _chi2_pvalue(counts, p0)
    print(f"chi-square p-value {pv:.3g} (threshold {P_THRESHOLD}); counts {counts.tolist()}")
    assert pv > P_THRESHOLD
    torch.manual_seed(0)
    bad_counts, _ = _first_token_counts(rejection_sampler_first_unverified, with_q, seed=1)
    bad_pv = _chi2_pvalue(bad_counts, p0)
    print(f"fault: p-value {bad_pv:.3g}")
    assert bad_pv < P_THRESHOLD


def test_random_path_same_generator_same_tokens():
    p = torch.softmax(torch.randn(4, 16, generator=torch.Generator().manual_seed(2)), -1)
    q = torch.softmax(torch.randn(3, 16, generator=torch.Generator().manual_seed(3)), -1)
    a = rejection_sample_random([1, 2, 3], q, p, torch.Generator().manual_seed(7))
    b = rejection_sample_random([1, 2, 3], q, p, torch.Generator().manual_seed(7))
    assert a == b and 1 <= len(a) <= 4


def test_random_path_point_masses():
    """p equal to q: every draft is accepted; p with no mass on the draft: rejected and
    the replacement comes from p (here a point mass)."""
    V = 6
    q = torch.full((2, V), 1 / V)
    p = torch.full((3, V), 1 / V)
    g = torch.Generator().manual_seed(0)
    assert len(rejection_sample_random([1, 4], q, p, g)) == 3
    p2 = torch.zeros(3, V)
    p2[:, 2] = 1.0
    assert rejection_sample_random([1, 4], None, p2, g) == [2]


# --- the engine ---------------------------------------------------------------------------

def test_greedy_equals_plain_decoding(spec, reference_ids):
    before = spec.llm_engine.stats.spec_decode_num_accepted_tokens
    got = _ids(_gen(spec, PROMPTS, GREEDY))
    st = spec.llm_engine.stats
    print("drafts", st.spec_decode_num_drafts, "draft tokens", st.spec_decode_num_draft_tokens,
          "accepted", st.spec_decode_num_accepted_tokens)
    assert got == reference_ids
    assert st.spec_decode_num_accepted_tokens > before  # drafts were really accepted


def test_max_tokens_never_passed(spec, plain):
    for m in (1, 2, 3, 5, 7):
        sp = SamplingParams(temperature=0, max_tokens=m, ignore_eos=True)
        got = _ids(_gen(spec, PROMPTS[:3], sp))
        assert got == _ids(_gen(plain, PROMPTS[:3], sp))
        assert all(len(g) == m for g in got)


def test_stop_token_ids_and_strings_exact(spec, plain, reference_ids):
    """Stop conditions chosen from the plain output itself, at a position inside a step
    where several tokens are accepted: the speculative output must stop at the same
    token (and, for stop strings, the same text)."""
    tok = plain.get_tokenizer()
    for prompt, ref in zip(PROMPTS, reference_ids):
        stop = ref[len(ref) // 2]
        sp = SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[stop], ignore_eos=True)
        a, b = _gen(plain, [prompt], sp)[0], _gen(spec, [prompt], sp)[0]
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert b.outputs[0].finish_reason == "stop"
        text = tok.decode(ref)
        s = text[len(text) // 2: len(text) // 2 + 2]
        if s.strip():
            sp = SamplingParams(temperature=0, max_tokens=24, stop=[s], ignore_eos=True)
            a, b = _gen(plain, [prompt], sp)[0], _gen(spec, [prompt], sp)[0]
            assert (a.outputs[0].text, a.outputs[0].token_ids) == \
                (b.outputs[0].text, b.outputs[0].token_ids)


def test_eos_stops_exactly(tiny_model_dir, plain, reference_ids):
    """Declare a token of the reference output as EOS (a tokenizer-free engine reads the
    EOS id from config.json): both engines must end at its first occurrence."""
    eos = reference_ids[2][5]
    sp = SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[eos])
    a = _ids(_gen(plain, PROMPTS[2:3], sp))
    llm = LLM(str(tiny_model_dir), dtype="float32", speculative_config=NGRAM)
    b = _ids(_gen(llm, PROMPTS[2:3], sp))
    assert a == b and a[0][-1] == eos


def test_draft_model_greedy_equals_plain(tiny_model_dir, tmp_path_factory, plain, reference_ids):
    """Two drafts: the target itself in bfloat16 (self-speculation: most drafts accepted)
    and a different random model (most rejected). Both must give the plain output."""
    from tests.tiny_model import make_tiny_llama

    other = make_tiny_llama(tmp_path_factory.mktemp("draft"), seed=1)
    for draft, dtype in ((str(tiny_model_dir), "bfloat16"), (str(other), "float32")):
        llm = LLM(str(tiny_model_dir), dtype="float32",
                  speculative_config={"method": "draft_model", "model": draft,
                                      "num_speculative_tokens": 3, "dtype": dtype})
        got = _ids(_gen(llm, PROMPTS, GREEDY))
        st = llm.llm_engine.stats
        rate = st.spec_decode_num_accepted_tokens / st.spec_decode_num_draft_tokens
        print(draft, dtype, "acceptance", round(rate, 3))
        assert got == reference_ids
        assert st.spec_decode_num_drafts > 0
        if draft == str(tiny_model_dir):
            assert rate > 0.8
        eng = llm.llm_engine
        assert not eng.proposer.states  # draft state released with the requests
        pool = eng.proposer.engine.kv_cache_manager.block_pool
        assert pool.get_num_free_blocks() == pool.num_blocks


def test_random_sampling_runs_and_is_seeded(tiny_model_dir, spec):
    sp = SamplingParams(temperature=0.8, top_k=50, top_p=0.95, max_tokens=20, seed=11,
                        ignore_eos=True)
    a = _ids(_gen(spec, PROMPTS, sp))
    b = _ids(_gen(spec, PROMPTS, sp))
    assert a == b and all(len(x) == 20 for x in a)
    llm = LLM(str(tiny_model_dir), dtype="float32",
              speculative_config={"method": "draft_model", "model": str(tiny_model_dir),
                                  "num_speculative_tokens": 2, "dtype": "bfloat16"})
    c = _ids(_gen(llm, PROMPTS, sp))
    assert all(len(x) == 20 for x in c)


def test_unsupported_params_decode_plainly(spec, plain):
    """Penalties, min_p and logprobs: no drafts for such requests (vLLM's rule)."""
    for sp in (SamplingParams(temperature=0, max_tokens=10, repetition_penalty=1.3),
               SamplingParams(temperature=0, max_tokens=10, logprobs=2)):
        before = spec.llm_engine.stats.spec_decode_num_drafts
        assert _ids(_gen(spec, PROMPTS[:2], sp)) == _ids(_gen(plain, PROMPTS[:2], sp))
        assert spec.llm_engine.stats.spec_decode_num_drafts == before


def test_min_tokens_with_drafts(spec, plain, reference_ids):
    eos = reference_ids[1][3]
    sp = SamplingParams(temperature=0, max_tokens=20, min_tokens=8, stop_token_ids=[eos])
    assert _ids(_gen(spec, PROMPTS, sp)) == _ids(_gen(plain, PROMPTS, sp))


def test_rejected_drafts_never_reach_the_prefix_cache(tiny_model_dir, spec, reference_ids):
    """After speculative generation (with rejections), a prompt equal to a whole generated
    sequence hits the blocks it cached; the continuation must equal a cache-free plain
    engine's. A block holding a rejected draft's K/V would change it."""
    st = spec.llm_engine.stats
    assert st.spec_decode_num_draft_tokens > st.spec_decode_num_accepted_tokens  # rejections
    spec.llm_engine.reset_prefix_cache()
    _gen(spec, PROMPTS, GREEDY)
    seqs = [p + r for p, r in zip(PROMPTS, reference_ids)]
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    hit = _gen(spec, seqs, sp)
    assert all(o.num_cached_tokens >= 16 for o in hit)
    fresh = LLM(str(tiny_model_dir), dtype="float32", enable_prefix_caching=False)
    assert _ids(hit) == _ids(_gen(fresh, seqs, sp))


def test_preemption_and_no_leaks(tiny_model_dir, reference_ids):
    """A cache of 8 blocks x 16 tokens for 6 requests: requests are preempted (their
    drafts dropped and proposed again); the output is the plain one and every block is
    free at the end."""
    llm = LLM(str(tiny_model_dir), dtype="float32", num_gpu_blocks_override=8,
              max_model_len=128, speculative_config=NGRAM)
    got = _ids(_gen(llm, PROMPTS, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)))
    st = llm.llm_engine.stats
    print("preemptions", st.num_preemptions)
    assert st.num_preemptions > 0
    assert got == reference_ids
    assert st.num_free_blocks == st.num_total_blocks


def test_failing_verifier_leaks_no_blocks(spec):
    def broken(*args):
        return [10**9]

    eng = spec.llm_engine
    with spec.swap_step("rejection_sampler", broken):
        with pytest.raises(ValueError, match="rejection_sampler step returned"):
            _gen(spec, PROMPTS, GREEDY)
    st = eng.stats
    assert not eng.has_unfinished_requests()
    assert st.num_free_blocks == st.num_total_blocks


def test_planted_first_draft_unverified_is_caught(spec, reference_ids):
    """The planted verifier bug (INCIDENTS.md #23) accepts draft 0 unchecked: on these
    prompts the output leaves the plain one; the reference does not."""
    with spec_accept_first_unverified(spec):
        bad = _ids(_gen(spec, PROMPTS, GREEDY))
    diverged = sum(b != r for b, r in zip(bad, reference_ids))
    print("prompts diverged under the fault:", diverged, "of", len(PROMPTS))
    assert diverged >= 1
    assert _ids(_gen(spec, PROMPTS, GREEDY)) == reference_ids


def test_swap_ngram_step(spec, reference_ids):
    """The "spec_decode.ngram" step: a drafter that proposes nothing turns speculation off
    (no drafts counted) and leaves the output unchanged."""
    before = spec.llm_engine.stats.spec_decode_num_drafts
    with spec.swap_step("spec_decode.ngram", lambda tokens, lo, hi, k: []):
        assert _ids(_gen(spec, PROMPTS, GREEDY)) == reference_ids
    assert spec.llm_engine.stats.spec_decode_num_drafts == before


def test_server_metrics(spec):
    from prometheus_client import generate_latest

    from minivllm.engine.async_llm import StepRecord
    from minivllm.entrypoints.openai.metrics import ServerMetrics

    _gen(spec, PROMPTS[:2], GREEDY)
    m = ServerMetrics("tiny", None)
    m.on_step(types.SimpleNamespace(engine=spec.llm_engine), StepRecord(now=0.0, outputs=[]))
    text = generate_latest(m.registry).decode()
    st = spec.llm_engine.stats
    for name, value in (("drafts", st.spec_decode_num_drafts),
                        ("draft_tokens", st.spec_decode_num_draft_tokens),
                        ("accepted_tokens", st.spec_decode_num_accepted_tokens)):
        line = f'vllm:spec_decode_num_{name}_total{{model_name="tiny"}} {float(value)}'
        assert line in text, (line, text[-600:])
    plain_m = ServerMetrics("tiny", None)
    assert "spec_decode" not in generate_latest(plain_m.registry).decode()


@pytest.mark.embedded
def test_embedded_float32_greedy_equality_20_prompts(embedded_model_dir):
    """Issue 26: greedy speculative output token-identical to plain decoding in float32 on
    the embedded model, 20 prompts (n-gram drafts, k = 3)."""
    topics = ["the ocean", "a red bicycle", "prime numbers", "the moon", "bread", "winter",
              "a lighthouse", "trains", "music", "a garden", "volcanoes", "chess", "rain",
              "a library", "coffee", "mountains", "the alphabet", "clocks", "bees", "rivers"]
    prompts = [f"Write three short sentences about {t}, repeating the words {t} often."
               for t in topics]
    sp = SamplingParams(temperature=0, max_tokens=32)
    llm = LLM(embedded_model_dir, dtype="float32", max_model_len=256,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                  "prompt_lookup_max": 3, "prompt_lookup_min": 1})
    tok = llm.get_tokenizer()
    prompts = [{"prompt": tok.apply_chat_template(
        [{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False)}
        for p in prompts]
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    st = llm.llm_engine.stats
    del llm
    plain = LLM(embedded_model_dir, dtype="float32", max_model_len=256)
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, sp, use_tqdm=False)]
    print("accepted", st.spec_decode_num_accepted_tokens, "of", st.spec_decode_num_draft_tokens,
          "lengths", sorted(len(w) for w in want))
    assert st.spec_decode_num_accepted_tokens > 0 and min(len(w) for w in want) >= 8
    assert sum(a == b for a, b in zip(got, want)) == 20
