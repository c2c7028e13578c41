"""Two engine options chapter 4 needs.

* ``EngineArgs.lm_head_dtype="float32"`` (an fp32 LM head on a 16-bit model, the mitigation
  of vllm #18352; not a vLLM flag): the configured path equals the "lm_head" step
  ``lm_head_fp32`` bit for bit, keeps one fp32 weight copy, leaves ``swap_step("lm_head")``
  working, and is validated.
* ``LLM.score(..., positions=)``: only the chosen rows go through the LM head and the
  log-softmax; they equal the same rows of a full score bit for bit, in prefill and decode
  mode, for one sequence and for a batch; bad positions are refused with clear errors.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from minivllm import LLM
from minivllm.engine.arg_utils import EngineArgs
from minivllm.models.llama import lm_head_fp32, lm_head_ref

pytestmark = pytest.mark.usefixtures("one_thread")


def _ids(n, seed=0, vocab=380):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=g).tolist()


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(str(tiny_model_dir), dtype="float32", max_model_len=256)


@pytest.fixture(scope="module")
def llm_bf16(tiny_model_dir):
    return LLM(str(tiny_model_dir), dtype="bfloat16", max_model_len=256)


@pytest.fixture(scope="module")
def llm_bf16_fp32_head(tiny_model_dir):
    return LLM(str(tiny_model_dir), dtype="bfloat16", max_model_len=256,
               lm_head_dtype="float32")


def _free_is_full(llm):
    s = llm.stats
    assert s.num_free_blocks == s.num_total_blocks, s


# ------------------------------------------------------------------ lm_head_dtype

@pytest.mark.parametrize("bad", ["float16", "bfloat16", "fp32", "auto", "", 32, torch.float32])
def test_lm_head_dtype_bad_values_are_refused(bad):
    with pytest.raises(ValueError, match="lm_head_dtype must be None .* or 'float32'"):
        EngineArgs(lm_head_dtype=bad).validate()


def test_lm_head_dtype_default_is_the_model_dtype(llm_bf16):
    assert EngineArgs().lm_head_dtype is None
    model = llm_bf16.llm_engine.model_runner.model
    assert model.lm_head_dtype is None and not hasattr(model, "_lm_head_fp32")


def test_fp32_head_equals_the_fp32_head_step_bit_for_bit(llm_bf16, llm_bf16_fp32_head):
    ids = _ids(40, seed=3)
    configured = llm_bf16_fp32_head.score(ids, output="logits")
    with llm_bf16.swap_step("lm_head", lm_head_fp32):
        swapped = llm_bf16.score(ids, output="logits")
    assert torch.equal(configured, swapped)
    bf16_head = llm_bf16.score(ids, output="logits")  # restored after the block
    assert not torch.equal(bf16_head, configured)
    with llm_bf16.swap_step("lm_head", lm_head_ref):
        assert torch.equal(llm_bf16.score(ids, output="logits"), bf16_head)


def test_fp32_head_keeps_one_fp32_copy_and_the_lookup_in_bf16(llm_bf16_fp32_head):
    model = llm_bf16_fp32_head.llm_engine.model_runner.model
    assert model.embed_tokens.weight.dtype == torch.bfloat16  # the lookup stays bf16
    w32 = model._fp32_head_weight()
    assert w32.dtype == torch.float32
    assert torch.equal(w32, model.embed_tokens.weight.float())
    llm_bf16_fp32_head.score(_ids(20, seed=4))
    assert model._fp32_head_weight() is w32  # kept, not remade per call
    assert not hasattr(w32, "_packed_cache")  # no second (packed) copy


def test_clear_weight_caches_drops_the_fp32_head_copy(tiny_model_dir):
    """An edit through .data is invisible to the copy's key; clear_weight_caches must
    make the next call copy the edited weight."""
    from minivllm.layers.linear import clear_weight_caches

    e = LLM(str(tiny_model_dir), dtype="bfloat16", max_model_len=64, lm_head_dtype="float32")
    model = e.llm_engine.model_runner.model
    before = model._fp32_head_weight()
    model.embed_tokens.weight.data.mul_(2)
    assert model._fp32_head_weight() is before  # stale until cleared
    clear_weight_caches(model)
    assert torch.equal(model._fp32_head_weight(), model.embed_tokens.weight.float())


def test_swap_step_still_wins_over_the_fp32_head(llm_bf16, llm_bf16_fp32_head):
    ids = _ids(30, seed=5)
    want = llm_bf16.score(ids, output="logits")  # the bf16 head
    with llm_bf16_fp32_head.swap_step("lm_head", lm_head_ref):
        got = llm_bf16_fp32_head.score(ids, output="logits")
    assert torch.equal(got, want)
    seen = []

    def spy(hidden, weight):
        seen.append((hidden.dtype, weight.dtype))
        return lm_head_ref(hidden, weight)

    with llm_bf16_fp32_head.swap_step("lm_head", spy):
        llm_bf16_fp32_head.score(ids[:5])
    assert seen and seen[0] == (torch.bfloat16, torch.bfloat16)  # the step gets model dtype


def test_fp32_head_is_closer_to_float32_and_generation_runs(llm, llm_bf16, llm_bf16_fp32_head):
    from minivllm import SamplingParams

    ids = _ids(64, seed=6)
    ref = llm.score(ids)
    err_bf16 = (llm_bf16.score(ids) - ref).abs().max().item()
    err_fp32_head = (llm_bf16_fp32_head.score(ids) - ref).abs().max().item()
    assert err_fp32_head < err_bf16, (err_fp32_head, err_bf16)
    out = llm_bf16_fp32_head.generate([ids[:10]], SamplingParams(temperature=0, max_tokens=8))
    assert len(out[0].outputs[0].token_ids) == 8
    _free_is_full(llm_bf16_fp32_head)


def test_fp32_head_on_a_float32_model_changes_nothing(tiny_model_dir, llm):
    e = LLM(str(tiny_model_dir), dtype="float32", max_model_len=256, lm_head_dtype="float32")
    ids = _ids(33, seed=7)
    assert torch.equal(e.score(ids), llm.score(ids))


# ------------------------------------------------------------------ score(positions=)

@pytest.mark.parametrize("mode", ["prefill", "decode"])
@pytest.mark.parametrize("positions", [[0], [5, 2, 70], list(range(0, 90, 3)), [89, 0],
                                       list(range(90)), []])
def test_positions_equal_full_rows_bit_for_bit(llm, mode, positions):
    ids = _ids(90, seed=11)
    full = llm.score(ids, mode=mode)
    got = llm.score(ids, mode=mode, positions=positions)
    assert got.shape == (len(positions), full.shape[1])
    assert torch.equal(got, full[positions])
    _free_is_full(llm)


@pytest.mark.parametrize("mode", ["prefill", "decode"])
def test_positions_in_a_batch_and_as_logits(llm_bf16, mode):
    seqs = [_ids(50, seed=12), _ids(7, seed=13), _ids(120, seed=14)]
    positions = [[49, 1, 20], None, np.arange(0, 120, 11)]
    full = llm_bf16.score(seqs, mode=mode, output="logits")
    got = llm_bf16.score(seqs, mode=mode, output="logits", positions=positions)
    assert torch.equal(got[0], full[0][[49, 1, 20]])
    assert torch.equal(got[1], full[1])
    assert torch.equal(got[2], full[2][list(range(0, 120, 11))])


def test_positions_with_chunked_prefill(tiny_model_dir):
    e = LLM(str(tiny_model_dir), dtype="float32", max_model_len=256,
            max_num_batched_tokens=32, enable_chunked_prefill=True)
    ids = _ids(100, seed=15)
    full = e.score(ids)
    pos = [0, 31, 32, 33, 63, 64, 99, 50]  # both sides of chunk borders
    assert torch.equal(e.score(ids, positions=pos), full[pos])
    assert torch.equal(e.score(ids, positions=torch.tensor([40])), full[[40]])


@pytest.mark.parametrize("positions, err, match", [
    ([0, 10], ValueError, r"position 10 is outside the sequence: a sequence of 10 tokens"),
    ([-1], ValueError, r"position -1 is outside"),
    ([1, 2, 1], ValueError, r"position 1 appears more than once"),
    ([1.0], TypeError, r"positions must be ints, got float"),
    ([True], TypeError, r"positions must be ints, got bool"),
    ("01", TypeError, r"positions must be a list of ints"),
    (3, TypeError, r"positions must be a list of ints"),
    (np.zeros((2, 2), dtype=int), ValueError, r"must be 1-D"),
])
def test_bad_positions_for_one_sequence(llm, positions, err, match):
    with pytest.raises(err, match=match):
        llm.score(_ids(10), positions=positions)
    assert not llm.llm_engine.has_unfinished_requests()
    _free_is_full(llm)


@pytest.mark.parametrize("positions, err, match", [
    ([0, 1], TypeError, r"one list of ints \(or None\) per sequence, not ints"),
    ([[0]], ValueError, r"positions for 1 sequences but 2 sequences"),
    ([[0], [8]], ValueError, r"position 8 is outside the sequence: a sequence of 5 tokens"),
    ("ab", TypeError, r"must be a list with one list"),
])
def test_bad_positions_for_a_batch(llm, positions, err, match):
    with pytest.raises(err, match=match):
        llm.score([_ids(10), _ids(5, seed=1)], positions=positions)
    assert not llm.llm_engine.has_unfinished_requests()
    _free_is_full(llm)


# ------------------------------------------------------------------ the embedded model

@pytest.mark.embedded
def test_embedded_fp32_head_and_positions(embedded_model_dir):
    """On SmolLM2 (49152 x 576 tied head): oneDNN's packed float32 GEMM gives other bits
    for 1-3, 5-7 and 9-11 rows than inside a larger batch; the chosen rows still equal the
    full score's. The fp32 head removes the head's own rounding: with the bf16 engine's
    hidden states, its logits are float32 sums of exact products, where the bf16 head's
    carry bf16 rounding. (This test used to assert that the fp32 head moves the whole
    log-prob vector towards the float32 engine's; on an AMD EPYC with avx512_bf16,
    2026-12-06, it moved it 2 % further away, RMS 0.0519 against 0.0508: there the bf16
    body's error dominates, so that claim depends on the CPU and is not tested.)"""
    from minivllm.models.llama import lm_head_ref
    from minivllm.precision import evalsets

    fp32 = LLM("smollm2-135m-instruct", dtype="float32", max_model_len=256,
               kv_cache_memory_bytes=16 << 20)
    ids = fp32.get_tokenizer().encode(evalsets.load_corpus()[:400])[:48]
    full = fp32.score(ids)
    for pos in ([7], [3, 40], [0, 1, 2, 3, 4], list(range(0, 48, 5))):
        assert torch.equal(fp32.score(ids, positions=pos), full[pos]), pos
    short = fp32.score(ids[:9])  # a 9-row chunk: its own GEMM, other bits than inside 48
    assert torch.equal(fp32.score(ids[:9], positions=[2, 8]), short[[2, 8]])
    bf16 = LLM("smollm2-135m-instruct", dtype="bfloat16", max_model_len=256,
               kv_cache_memory_bytes=16 << 20)
    seen: dict = {}

    def recording(name, head):
        def step(hidden, weight):
            out = head(hidden, weight)
            seen[name] = (hidden.detach().clone(), weight.detach(), out.detach().clone())
            return out
        return step

    for name, head in (("bf16", lm_head_ref), ("fp32", lm_head_fp32)):
        with bf16.swap_step("lm_head", recording(name, head)):
            bf16.score(ids)
    h, w, _ = seen["fp32"]
    assert h.dtype == torch.bfloat16 and torch.equal(h, seen["bf16"][0])  # the same body
    exact = h.double() @ w.double().T
    err = {k: (seen[k][2].double() - exact).abs().max().item() for k in seen}
    # float32 sums of 576 exact products (bf16 x bf16): at most K eps32 sum |h||w|
    bound32 = (576 * 2.0 ** -24 * (h.double().abs() @ w.double().abs().T)).max().item()
    print(f"head logits, max |error| against float64: bf16 head {err['bf16']:.3g}, "
          f"fp32 head {err['fp32']:.3g} (float32 bound {bound32:.3g})")
    assert err["fp32"] <= bound32, err
    assert err["bf16"] > 100 * err["fp32"], err  # the bf16 head rounds its logits
