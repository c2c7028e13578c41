"""The batch-invariant mode (``EngineArgs.batch_invariant`` / ``VLLM_BATCH_INVARIANT=1``,
chapter 5): a request's logits do not depend on the other requests of its batch.

Every equality here is bitwise (``torch.equal``), in bfloat16 and float32, on the
embedded model on CPU. The controls show that the same checks fail without the mode
(so they can fail).
"""

from __future__ import annotations

import pytest
import torch

from minivllm import LLM, SamplingParams
from minivllm.attention.backends.torch_ref import (decode_attention_batch_invariant,
                                                   decode_attention_ref)
from minivllm.engine.arg_utils import EngineArgs, batch_invariant_enabled
from minivllm.layers.linear import float_linear, rowwise
from minivllm.layers.rms_norm import rms_norm_ref
from minivllm.precision.batching import decode_logits_beside

pytestmark = pytest.mark.usefixtures("embedded_model_dir")

# The known defect (default mode, bfloat16, CPU): a 5-token prompt decoded next to a
# 30-token one reads keys padded to the longer sequence, and its greedy text changes.
SHORT = "Dear diary, today I"
LONG = ("Summarize the plot of a famous novel about a whale and a captain who hunts "
        "it across the oceans of the world, in three short sentences.")
# The target: the first 16 tokens of this text, scored teacher-forced.
TARGET_TEXT = ("The capital of France is Paris. It is a city of art, food and history, with "
               "many museums along the river Seine and a famous tower.")
# Three batch compositions for the target: companion prompts (token ids) of other lengths,
# which decode beside it (they are 3..60 tokens ahead, so the target's keys get padded).
COMPOSITIONS = {
    "one 30-token companion": [[100 + i for i in range(30)]],
    "three companions (7, 20, 45 tokens)": [[200 + i for i in range(7)],
                                            [300 + i for i in range(20)],
                                            [400 + (7 * i) % 900 for i in range(45)]],
    "two companions (3, 60 tokens)": [[900 + i for i in range(3)],
                                      [1000 + (3 * i) % 700 for i in range(60)]],
}


decode_logits = decode_logits_beside  # the target's logits [T, vocab] beside companions


@pytest.fixture(scope="module", params=["bfloat16", "float32"])
def engines(request, one_thread):
    dtype = request.param
    return dtype, LLM(dtype=dtype, batch_invariant=True), LLM(dtype=dtype)


def test_logits_bitwise_equal_alone_and_in_three_compositions(engines):
    dtype, inv, default = engines
    TARGET = inv.get_tokenizer().encode(TARGET_TEXT)[:16]
    assert len(TARGET) == 16
    alone = decode_logits(inv, TARGET, [])
    assert alone.shape == (len(TARGET), inv.llm_engine.model_config.vocab_size)
    # the mode reproduces the default engine's solo run bit for bit (same calls at B=1)
    assert torch.equal(alone, decode_logits(default, TARGET, []))
    for name, companions in COMPOSITIONS.items():
        got = decode_logits(inv, TARGET, companions)
        diff = (got - alone).abs().max().item()
        print(f"{dtype} batch_invariant, {name}: max |dlogit| {diff:.3g}")
        assert torch.equal(got, alone), f"{dtype} {name}: max |dlogit| {diff:.3g}"
    # control: the default engine fails the same check (the check has power)
    name, companions = next(iter(COMPOSITIONS.items()))
    diff = (decode_logits(default, TARGET, companions) - alone).abs().max().item()
    print(f"{dtype} default mode, {name}: max |dlogit| {diff:.3g}")
    assert diff > 0, f"{dtype}: the default engine was batch-invariant here"


def test_known_defect_short_prompt_beside_long_one_bfloat16(one_thread):
    """5-token prompt alone vs beside a 30-token prompt, greedy, 24 tokens, bfloat16."""
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    for batch_invariant, must_match in ((False, False), (True, True)):
        llm = LLM(dtype="bfloat16", batch_invariant=batch_invariant)
        tok = llm.get_tokenizer()
        assert len(tok.encode(SHORT)) == 5 and len(tok.encode(LONG)) == 30
        alone = llm.generate([SHORT], sp)[0].outputs[0].token_ids
        batched = llm.generate([SHORT, LONG], sp)[0].outputs[0].token_ids
        first = next((i for i, (a, b) in enumerate(zip(alone, batched)) if a != b), None)
        print(f"batch_invariant={batch_invariant}: first differing token {first} of 24")
        assert (alone == batched) == must_match, (batch_invariant, first)


def test_decode_attention_batch_invariant_unit():
    """Per-sequence decode attention: close to a float64 reference, and bitwise the same
    whatever the padded length and the other sequences are (the padded SDPA is not)."""
    g = torch.Generator().manual_seed(5)
    H, Hkv, D, scale = 9, 3, 64, 0.125
    lens = [6, 19, 33]
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        L = max(lens)
        q = torch.randn(3, H, D, generator=g).to(dtype)
        k = torch.randn(3, L, Hkv, D, generator=g).to(dtype)
        v = torch.randn(3, L, Hkv, D, generator=g).to(dtype)
        sl = torch.tensor(lens)
        out = decode_attention_batch_invariant(q, k, v, sl, scale)
        for b, n in enumerate(lens):  # float64 reference
            kk = k[b, :n].double().repeat_interleave(H // Hkv, dim=1)  # [n, H, D]
            vv = v[b, :n].double().repeat_interleave(H // Hkv, dim=1)
            p = torch.softmax(torch.einsum("hd,nhd->hn", q[b].double(), kk) * scale, -1)
            ref = torch.einsum("hn,nhd->hd", p, vv)
            err = (out[b].double() - ref).abs().max().item()
            print(f"{dtype} seq {b}: max error vs float64 {err:.3g} (tolerance {tol})")
            assert err <= tol
        padded_changes = 0
        for extra in range(1, 40):  # more padding, other companions
            k2 = torch.cat([k, torch.randn(3, extra, Hkv, D, generator=g).to(dtype)], 1)
            v2 = torch.cat([v, torch.randn(3, extra, Hkv, D, generator=g).to(dtype)], 1)
            alone = decode_attention_batch_invariant(q[:1], k2[:1, :lens[0]], v2[:1, :lens[0]],
                                                     sl[:1], scale)
            assert torch.equal(decode_attention_batch_invariant(q, k2, v2, sl, scale)[:1], alone)
            padded_changes += not torch.equal(decode_attention_ref(q, k2, v2, sl, scale)[:1],
                                              decode_attention_ref(q[:1], k2[:1, :lens[0]],
                                                                   v2[:1, :lens[0]], sl[:1],
                                                                   scale))
        print(f"{dtype}: padded SDPA differs from solo at {padded_changes} of 39 paddings")
        if dtype == torch.float32:
            assert padded_changes > 0  # the defect the mode removes, on random tensors


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rowwise_linear_and_rms_norm_do_not_depend_on_rows(dtype, one_thread):
    """Model shapes: a row's result is the same for every row count M (rowwise linear by
    construction; RMSNorm's torch reduction checked), while the float32 GEMM is not."""
    g = torch.Generator().manual_seed(0)
    gemm_changes = 0
    for K, N in ((576, 960), (576, 3072), (1536, 576)):
        w = (torch.randn(N, K, generator=g) * 0.05).to(dtype)
        x = torch.randn(40, K, generator=g).to(dtype)

        def lin(r):
            return float_linear(r, w, None, False, owner=w)
        solo = [lin(x[i:i + 1].clone()) for i in range(40)]
        for M in (2, 3, 8, 40):
            y = rowwise(lin, x[:M])
            assert all(torch.equal(y[i:i + 1], solo[i]) for i in range(M)), (K, N, M)
            gemm_changes += sum(not torch.equal(lin(x[:M])[i:i + 1], solo[i]) for i in range(M))
    print(f"{dtype}: plain GEMM rows that differ from the same row alone: {gemm_changes}")
    if dtype == torch.float32:
        assert gemm_changes > 0  # oneDNN's float32 GEMM: why the mode computes rows alone
    h = torch.randn(64, 576, generator=g).to(dtype) * 3
    wn = torch.randn(576, generator=g).to(dtype)
    y = rms_norm_ref(h, wn, 1e-5)
    assert all(torch.equal(y[i], rms_norm_ref(h[i:i + 1].clone(), wn, 1e-5)[0]) for i in range(64))


def test_env_alias_and_validation(monkeypatch):
    monkeypatch.delenv("VLLM_BATCH_INVARIANT", raising=False)
    assert batch_invariant_enabled(EngineArgs()) is False
    assert batch_invariant_enabled(EngineArgs(batch_invariant=True)) is True
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")
    assert batch_invariant_enabled(EngineArgs()) is True
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "0")
    assert batch_invariant_enabled(EngineArgs()) is False
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "yes")
    with pytest.raises(ValueError, match="VLLM_BATCH_INVARIANT"):
        batch_invariant_enabled(EngineArgs())
    with pytest.raises(ValueError, match="batch_invariant must be True or False"):
        EngineArgs(batch_invariant="1").validate()


def test_env_alias_turns_the_engine_mode_on(monkeypatch):
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")
    llm = LLM(dtype="bfloat16", max_model_len=64)
    runner = llm.llm_engine.model_runner
    assert runner.batch_invariant
    assert runner.model.layers[0].self_attn.backend.decode_attention \
        is decode_attention_batch_invariant
    # a swapped step still wins inside its block, and the mode comes back after it
    with llm.swap_step("attention.decode", decode_attention_ref):
        assert runner.model.layers[0].self_attn.backend.decode_attention is decode_attention_ref
    assert runner.model.layers[0].self_attn.backend.decode_attention \
        is decode_attention_batch_invariant
