"""Prefix caching: cache_salt, scoring through the cache, the steps of the cache key and
lookup, in-flight hits, and the unchained-hash fault (chapter 22).

Expected hit counts are derived from the prompts' block layout (block size x shared
full blocks, minus the last token rule), not read from the code under test.
"""

from __future__ import annotations

import random

import pytest
import torch

from minivllm import LLM, SamplingParams
from minivllm.core.kv_cache_manager import (block_extra_keys, find_longest_cache_hit,
                                            hash_block_tokens)
from minivllm.precision import faults, metrics
from minivllm.steps import reference

BS = 8
GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_model_dir, one_thread):
    return LLM(model=str(tiny_model_dir), dtype="float32", max_model_len=256, block_size=BS,
               enforce_eager=True)


def _ids(n, seed):
    rng = random.Random(seed)
    return [rng.randrange(3, 300) for _ in range(n)]


def _hits(llm, prompts, params=GREEDY):
    """Prefix-cache hit tokens counted by the engine (vllm:prefix_cache_hits) for one
    generate() call, and its outputs."""
    before = llm.stats.prefix_cache_hits
    outs = llm.generate(prompts, params)
    return llm.stats.prefix_cache_hits - before, outs


def _idle(llm):
    s = llm.stats
    assert s.num_free_blocks == s.num_total_blocks, "blocks leaked"


# --- cache_salt ---------------------------------------------------------------------------

def test_cache_salt_is_in_the_first_block_only():
    assert block_extra_keys("s", 0) == ("s",)
    assert block_extra_keys("s", 1) == ()
    assert block_extra_keys(None, 0) == ()
    a = hash_block_tokens(None, [1, 2, 3], block_extra_keys("a", 0))
    b = hash_block_tokens(None, [1, 2, 3], block_extra_keys("b", 0))
    plain = hash_block_tokens(None, [1, 2, 3])
    assert len({a, b, plain}) == 3
    # the chain carries the salt into later blocks, which have no extra key themselves
    assert hash_block_tokens(a, [4, 5, 6]) != hash_block_tokens(b, [4, 5, 6])


def test_different_salts_share_no_block_same_salt_does(llm):
    llm.reset_prefix_cache()
    ids = _ids(45, 1)  # 5 full blocks; a repeat may reuse 5 blocks (44 = 5*8 + 4 tokens left)
    want = (len(ids) - 1) // BS * BS
    n, _ = _hits(llm, [{"prompt_token_ids": ids, "cache_salt": "alice"}])
    assert n == 0
    n, out_b = _hits(llm, [{"prompt_token_ids": ids, "cache_salt": "bob"}])
    assert n == 0, "another salt hit alice's blocks"
    n, _ = _hits(llm, [ids])
    assert n == 0, "an unsalted request hit a salted request's blocks"
    n, out_a = _hits(llm, [{"prompt_token_ids": ids, "cache_salt": "alice"}])
    assert n == want and out_a[0].num_cached_tokens == want
    n, _ = _hits(llm, [ids])  # the unsalted one cached its own blocks above
    assert n == want
    assert out_a[0].outputs[0].token_ids == out_b[0].outputs[0].token_ids
    _idle(llm)


def test_salted_text_prompt_and_batch(llm):
    llm.reset_prefix_cache()
    text = "prefix caching keys " * 12
    outs = llm.generate([{"prompt": text, "cache_salt": "x"}, {"prompt": text, "cache_salt": "y"},
                         text], GREEDY)
    assert len({tuple(o.outputs[0].token_ids) for o in outs}) == 1
    assert all(o.num_cached_tokens == 0 for o in outs)  # one step: nothing written yet
    n, outs2 = _hits(llm, [{"prompt": text, "cache_salt": "y"}])
    assert n > 0 and outs2[0].prompt_token_ids == outs[0].prompt_token_ids


@pytest.mark.parametrize("prompt, exc, words", [
    ({"prompt_token_ids": [1, 2, 3], "cache_salt": 5}, TypeError, "non-empty string"),
    ({"prompt_token_ids": [1, 2, 3], "cache_salt": ""}, ValueError, "non-empty string"),
    ({"prompt_token_ids": [1, 2, 3], "cache_salt": ["a"]}, TypeError, "non-empty string"),
    ({"prompt_token_ids": [1, 2, 3], "salt": "a"}, ValueError, "unknown prompt key"),
    ({"prompt": "a b", "prompt_token_ids": [1]}, ValueError, "exactly one"),
    ({"cache_salt": "a"}, ValueError, "exactly one"),
    ({"prompt": [1, 2]}, TypeError, "'prompt' must be a string"),
    ({"prompt_token_ids": "1 2"}, TypeError, "must be a list of ints"),
])
def test_bad_prompt_dicts_are_refused_and_leak_nothing(llm, prompt, exc, words):
    good = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    with pytest.raises(exc, match=words):
        llm.generate([good, prompt], GREEDY)  # the good one is not left queued
    assert not llm.llm_engine.has_unfinished_requests()
    _idle(llm)


# --- scoring and prompt_logprobs through the cache ---------------------------------------

def test_score_hits_only_before_the_first_wanted_row(llm):
    llm.reset_prefix_cache()
    ids = _ids(50, 2)
    full = llm.score(ids)  # all rows computed; writes 6 full blocks
    st = llm.stats
    q0, h0 = st.prefix_cache_queries, st.prefix_cache_hits
    assert llm.score(ids, use_prefix_cache=True).equal(full)  # row 0 wanted: nothing hits
    tail = list(range(20, 50))
    rows = llm.score(ids, positions=tail, use_prefix_cache=True)  # hits blocks 0-1 (16 tokens)
    last = llm.score(ids, positions=[49], use_prefix_cache=True)  # hits 6 blocks (48 tokens)
    st = llm.stats
    assert st.prefix_cache_hits - h0 == 16 + 48
    assert st.prefix_cache_queries - q0 == 3 * len(ids)
    err = (rows - full[20:]).abs().max().item()
    kl = metrics.mean_kl(full[20:], rows)
    print(f"fp32 score hit vs miss: max |diff| {err:.3g}, mean KL {kl:.3g}")
    assert err < 1e-4 and kl < 1e-9  # fp32: the two attention paths differ by rounding
    assert (last - full[49:]).abs().max().item() < 1e-4
    _idle(llm)


def test_score_without_use_prefix_cache_and_prompt_logprobs_never_read_the_cache(llm):
    llm.reset_prefix_cache()
    ids = _ids(40, 3)
    llm.generate([ids], GREEDY)
    h0 = llm.stats.prefix_cache_hits
    llm.score(ids, positions=[39])
    out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=1))
    assert llm.stats.prefix_cache_hits == h0
    assert out[0].num_cached_tokens == 0 and len(out[0].prompt_logprobs) == len(ids)
    n, _ = _hits(llm, [ids])  # ... but they wrote their blocks
    assert n == (len(ids) - 1) // BS * BS


@pytest.mark.parametrize("bad", ["yes", 1, None])
def test_use_prefix_cache_must_be_bool(llm, bad):
    with pytest.raises(TypeError, match="use_prefix_cache"):
        llm.score([1, 2, 3], use_prefix_cache=bad)


def test_no_in_flight_hits_within_one_step(llm):
    """nano-vllm PR #209: two identical prompts admitted in one step must not hit each
    other's blocks (they are written only after the step ran)."""
    llm.reset_prefix_cache()
    ids = _ids(33, 4)
    n, outs = _hits(llm, [ids, ids])
    assert n == 0 and [o.num_cached_tokens for o in outs] == [0, 0]
    assert outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids
    n, _ = _hits(llm, [ids])
    assert n == 32


# --- the steps ------------------------------------------------------------------------------

def test_lookup_reference_stops_at_first_miss_and_leaves_a_token():
    cached = {b"a", b"b", b"d"}
    assert find_longest_cache_hit([b"a", b"b", b"c", b"d"], cached, 100, 4) == 2
    assert find_longest_cache_hit([b"a", b"b"], cached, 8, 4) == 1  # 8 tokens: keep one
    assert find_longest_cache_hit([b"a", b"b"], cached, 9, 4) == 2
    assert find_longest_cache_hit([], cached, 1, 4) == 0
    assert reference("prefix_cache.lookup") is find_longest_cache_hit
    assert reference("block_hash.extra_keys") is block_extra_keys


def test_swapped_extra_keys_that_drop_the_salt_share_blocks(llm):
    llm.reset_prefix_cache()
    ids = _ids(30, 5)
    with llm.swap_step("block_hash.extra_keys", lambda salt, i: ()):
        _hits(llm, [{"prompt_token_ids": ids, "cache_salt": "a"}])
        n, _ = _hits(llm, [{"prompt_token_ids": ids, "cache_salt": "b"}])
    assert n == 24  # the salt is ignored: b reads a's blocks


def test_a_lookup_that_overcounts_is_refused(llm):
    llm.reset_prefix_cache()
    ids = _ids(24, 6)
    llm.generate([ids], GREEDY)
    with llm.swap_step("prefix_cache.lookup", lambda h, c, n, bs: len(h)):  # no token left
        with pytest.raises(ValueError, match="prefix_cache.lookup step returned 3"):
            llm.generate([ids], GREEDY)
    assert not llm.llm_engine.has_unfinished_requests()
    _idle(llm)


# --- the unchained-hash fault ---------------------------------------------------------------

def test_unchained_hash_reuses_blocks_from_other_positions(llm):
    """Two prompts: the same first block and the same two passages in the other order.
    The chained hash shares only the first block; the unchained one serves the
    reordered passages from K/V computed at other positions, which the score's KL shows
    (the chapter's metric)."""
    head, p1, p2 = _ids(BS, 7), _ids(2 * BS, 8), _ids(2 * BS, 9)
    a, b = head + p1 + p2 + [5], head + p2 + p1 + [5]
    tail = list(range(BS, len(b)))
    llm.reset_prefix_cache()
    ref = llm.score(b, positions=tail)  # no lookup: every position computed
    llm.reset_prefix_cache()
    llm.score(a)
    h0 = llm.stats.prefix_cache_hits
    ok = llm.score(b, positions=tail, use_prefix_cache=True)
    good_hits = llm.stats.prefix_cache_hits - h0
    with faults.unchained_block_hash(llm):
        llm.score(a)
        h0 = llm.stats.prefix_cache_hits
        bad = llm.score(b, positions=[len(b) - 1], use_prefix_cache=True)
        bad_hits = llm.stats.prefix_cache_hits - h0
    kl_ok, kl_bad = metrics.mean_kl(ref, ok), metrics.mean_kl(ref[-1:], bad)
    print(f"hits chained {good_hits}, unchained {bad_hits}; KL chained {kl_ok:.3g}, "
          f"unchained {kl_bad:.3g}")
    assert good_hits == BS and bad_hits == 5 * BS
    assert kl_ok < 1e-9 and kl_bad > 1e-3
    _idle(llm)
    # after the fault: the cache was reset and the chained key is back
    llm.score(a)
    h0 = llm.stats.prefix_cache_hits
    llm.score(b, positions=[len(b) - 1], use_prefix_cache=True)
    assert llm.stats.prefix_cache_hits - h0 == BS


def test_skipped_reset_after_rescale_reuses_stale_blocks(tiny_model_dir, one_thread):
    """K/V scales are engine-wide, so recalibrating them must empty the cache: with the
    reset skipped, blocks quantized with scale 1.0 are read back with the new scales."""
    def engine():
        return LLM(model=str(tiny_model_dir), dtype="float32", max_model_len=128,
                   block_size=BS, kv_cache_dtype="fp8_e4m3", enforce_eager=True)

    ids, cal, rows = _ids(40, 10), [_ids(64, 11)], list(range(32, 40))
    ok = engine()
    ok.score(ids)  # blocks stored with scale 1.0
    ok.llm_engine.calibrate_kv_scales(cal)
    h0 = ok.stats.prefix_cache_hits
    good = ok.score(ids, positions=rows, use_prefix_cache=True)
    assert ok.stats.prefix_cache_hits == h0  # the reset emptied the cache
    ok.reset_prefix_cache()
    truth = ok.score(ids, positions=rows)
    assert torch.equal(good, truth)

    bad = engine()
    bad.score(ids)
    with faults.skip_prefix_reset_on_rescale(bad):
        bad.llm_engine.calibrate_kv_scales(cal)
    assert "reset_prefix_cache" not in vars(bad.llm_engine.kv_cache_manager)  # restored
    assert bad.llm_engine.kv_cache_scales() == ok.llm_engine.kv_cache_scales()
    h0 = bad.stats.prefix_cache_hits
    stale = bad.score(ids, positions=rows, use_prefix_cache=True)
    stale_hits = bad.stats.prefix_cache_hits - h0
    kl = metrics.mean_kl(truth, stale)
    print(f"stale blocks after recalibration: {stale_hits} hit tokens, KL {kl:.3g} nats")
    assert stale_hits == 4 * BS and kl > 1e-3
