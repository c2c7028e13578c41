"""Chapter 23's chunked prefill: the "prefill_chunk" step (read slots and mask of one
chunk), its reference written out, the default path equal bit for bit to the reference
swapped in, chunked vs unchunked prefill at the float32 noise level, and the two planted
faults (faults.chunk_seqlen_k_full: nano-vllm PR #213; faults.chunk_no_past_kv:
kekzl/imp PRs #114/#117) found by KL vs the unchunked engine and, on the embedded model,
by passkey recall. Expected values are written out here or come from the engine's clean
unchunked runs, not from the code under test."""

from __future__ import annotations

import pytest
import torch

from minivllm import LLM, SamplingParams
from minivllm.attention.metadata import chunk_causal_mask, prefill_chunk_ref
from minivllm.precision import evalsets, faults, metrics

pytestmark = pytest.mark.usefixtures("one_thread")

IDS = [5 + (7 * i) % 90 for i in range(30)]  # 30 tokens: chunks of 8 -> 8, 8, 8, 6


def _llm(model_dir, budget, max_len=48, **kw):
    return LLM(str(model_dir), dtype="float32", max_model_len=max_len, block_size=4,
               max_num_batched_tokens=budget, enable_chunked_prefill=True, seed=0, **kw)


def test_reference_slots_and_mask_written_out():
    table = torch.tensor([3, 1, 6])  # block size 4: positions 0-3 -> 12-15, 4-7 -> 4-7
    slots, mask = prefill_chunk_ref(table, 5, 3, 4, num_tokens=10)
    assert slots.dtype == torch.int64 and slots.tolist() == [12, 13, 14, 15, 4, 5, 6, 7]
    assert mask.dtype == torch.bool and mask.int().tolist() == [
        [1, 1, 1, 1, 1, 1, 0, 0],   # position 5 sees 0..5
        [1, 1, 1, 1, 1, 1, 1, 0],   # position 6 sees 0..6
        [1, 1, 1, 1, 1, 1, 1, 1]]   # position 7 sees 0..7
    assert torch.equal(chunk_causal_mask(3, 3), torch.ones(3, 3, dtype=torch.bool).tril())
    for bad in (dict(start=0, n=0), dict(start=-1, n=2), dict(start=8, n=3)):
        with pytest.raises(ValueError, match="start"):
            prefill_chunk_ref(table, bad["start"], bad["n"], 4, num_tokens=10)
    with pytest.raises(ValueError, match="block table"):
        prefill_chunk_ref(table[:1], 2, 3, 4, num_tokens=10)  # 4 slots, 5 needed


def test_default_path_equals_the_reference_swapped_in(tiny_model_dir):
    llm = _llm(tiny_model_dir, budget=8)
    seen = []

    def ref_copy(block_table, start, n, block_size, num_tokens):
        seen.append((start, n, num_tokens))
        return prefill_chunk_ref(block_table, start, n, block_size, num_tokens)

    want = llm.score(IDS, output="logits")
    with llm.swap_step("prefill_chunk", ref_copy):
        got = llm.score(IDS, output="logits")
    assert llm.llm_engine.model_runner.prefill_chunk is prefill_chunk_ref  # restored
    assert seen == [(0, 8, 30), (8, 8, 30), (16, 8, 30), (24, 6, 30)]
    assert torch.equal(got, want)


def test_chunked_equals_unchunked_at_the_float32_noise_level(tiny_model_dir):
    whole = _llm(tiny_model_dir, budget=48).score(IDS, output="logits")
    for budget in (4, 8, 16):
        chunked = _llm(tiny_model_dir, budget=budget).score(IDS, output="logits")
        kl = metrics.mean_kl(whole, chunked)
        diff = float((whole - chunked).abs().max())
        print(f"chunks of {budget}: mean KL {kl:.2e}, max |dlogit| {diff:.2e}")
        assert kl < 1e-9 and diff < 1e-4  # float32: explicit mask vs is_causal SDPA only
        assert torch.equal(whole.argmax(-1), chunked.argmax(-1))


@pytest.mark.parametrize("fault", ["chunk_seqlen_k_full", "chunk_no_past_kv"])
def test_faults_break_chunked_prefill_only(tiny_model_dir, fault):
    plant = getattr(faults, fault)
    whole_llm, chunk_llm = _llm(tiny_model_dir, budget=48), _llm(tiny_model_dir, budget=8)
    clean = whole_llm.score(IDS, output="logits")
    with plant(whole_llm):  # one chunk: start + n == num_tokens, nothing to get wrong
        assert torch.equal(whole_llm.score(IDS, output="logits"), clean)
    clean_chunked = chunk_llm.score(IDS, output="logits")
    with plant(chunk_llm):
        bad = chunk_llm.score(IDS, output="logits")
    kl = metrics.mean_kl(clean, bad)
    print(f"{fault}: mean KL vs unchunked {kl:.3f} nats")
    assert kl > 1e-3
    if fault == "chunk_no_past_kv":  # chunk 0 has no past: exact; chunk 1 on: wrong
        assert torch.equal(bad[:8], clean_chunked[:8])
        assert not torch.allclose(bad[8:], clean_chunked[8:])
    else:  # chunk 0 reads 30 keys (22 unwritten) and its mask is shifted: wrong at once
        assert not torch.allclose(bad[:8], clean_chunked[:8])
    # restored after the block, and the whole-sequence allocation is undone
    assert torch.equal(chunk_llm.score(IDS, output="logits"), clean_chunked)
    assert "allocate_slots" not in vars(chunk_llm.llm_engine.kv_cache_manager)


def test_a_swapped_mask_is_used_and_bad_returns_are_refused(tiny_model_dir):
    llm = _llm(tiny_model_dir, budget=8)
    clean = llm.score(IDS, output="logits")

    def top_left(block_table, start, n, block_size, num_tokens):
        slots, _ = prefill_chunk_ref(block_table, start, n, block_size, num_tokens)
        return slots, torch.ones(n, start + n, dtype=torch.bool).tril()  # offset forgotten

    with llm.swap_step("prefill_chunk", top_left):
        bad = llm.score(IDS, output="logits")
    assert torch.equal(bad[:8], clean[:8]) and not torch.allclose(bad[8:], clean[8:])

    def wrong_shape(block_table, start, n, block_size, num_tokens):
        slots, mask = prefill_chunk_ref(block_table, start, n, block_size, num_tokens)
        return slots, mask[:, :-1]

    def float_slots(block_table, start, n, block_size, num_tokens):
        slots, mask = prefill_chunk_ref(block_table, start, n, block_size, num_tokens)
        return slots.float(), mask

    for fn, msg in ((wrong_shape, "mask must be a bool tensor of shape"),
                    (float_slots, "kv_slots must be a non-empty 1-D int64")):
        with llm.swap_step("prefill_chunk", fn):
            with pytest.raises(ValueError, match=msg):
                llm.score(IDS, output="logits")
    assert not llm.llm_engine.has_unfinished_requests()  # the failed request was dropped


def test_passkey_recall_on_the_embedded_model(embedded_model_dir):
    """A 243-token passkey prompt in 16-token chunks: the correct chunked engine answers
    like the unchunked one and finds the key; both faults lose it."""
    item = [it for it in evalsets.load_passkey() if it.num_tokens == 243][0]
    msgs = [{"role": "user", "content": item.prompt}]
    greedy = SamplingParams(temperature=0, max_tokens=12)
    whole = LLM(str(embedded_model_dir), dtype="float32", max_model_len=320,
                max_num_batched_tokens=320, enable_chunked_prefill=True)
    chunked = LLM(str(embedded_model_dir), dtype="float32", max_model_len=320,
                  max_num_batched_tokens=16, enable_chunked_prefill=True)
    want = whole.chat(msgs, greedy)[0].outputs[0]
    got = chunked.chat(msgs, greedy)[0].outputs[0]
    print(f"unchunked {want.text!r}, chunked {got.text!r}")
    assert evalsets.passkey_correct(want.text, item.passkey)
    assert got.token_ids == want.token_ids
    for plant in (faults.chunk_seqlen_k_full, faults.chunk_no_past_kv):
        with plant(chunked):
            bad = chunked.chat(msgs, greedy)[0].outputs[0].text
        print(f"{plant.__name__}: {bad!r}")
        assert not evalsets.passkey_correct(bad, item.passkey)
