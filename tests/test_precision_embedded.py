"""Precision toolkit on the embedded SmolLM2-135M (integration).

Tolerances, float32: LLM.score decode mode against prefill mode 1e-3 absolute on
log-probs (two different attention paths and reduction orders over 30 layers); engine
against HF reference 1e-3 (the engine-core parity bound).
"""

from __future__ import annotations

import pytest

from minivllm import LLM
from minivllm.precision import evalsets, faults, layer_diff, metrics
from minivllm.precision.reference import ReferenceModel

pytestmark = [pytest.mark.embedded]
TOL = 1e-3


@pytest.fixture(scope="module")
def llm(embedded_model_dir):
    return LLM(str(embedded_model_dir), dtype="float32", kv_cache_dtype="float32",
               max_model_len=1024, kv_cache_memory_bytes=128 << 20)


@pytest.fixture(scope="module")
def ref(embedded_model_dir):
    return ReferenceModel(str(embedded_model_dir))


@pytest.fixture(scope="module")
def window(llm):
    return evalsets.corpus_sequences(llm.get_tokenizer(), seq_len=160, max_sequences=1)[0]


def test_decode_score_equals_prefill_score(llm, ref, window):
    a = llm.score(window, mode="prefill")
    b = llm.score(window, mode="decode")
    r = ref.score(window)
    err_mode = (a - b).abs().max().item()
    err_ref = (a - r).abs().max().item()
    print(f"decode vs prefill {err_mode:.2e}, prefill vs HF {err_ref:.2e}, "
          f"KL(HF || engine) {metrics.mean_kl(r, a):.2e}")
    assert err_mode <= TOL, f"decode vs prefill max |logprob diff| {err_mode:.3e} > {TOL}"
    assert err_ref <= TOL, f"engine vs HF max |logprob diff| {err_ref:.3e} > {TOL}"
    assert metrics.top1_agreement(r, b) == 1.0


def test_layer_diff_finds_planted_fp16_rmsnorm(llm, ref, window):
    ids = window[:96]
    clean = layer_diff(llm, ref, ids)
    assert clean.first_jump_layer is None, clean.to_markdown()
    with faults.fp16_rmsnorm(llm, 17):
        d = layer_diff(llm, ref, ids)
    print(d.to_markdown())
    assert (d.first_jump_layer, d.first_jump_block) == (17, "self_attn"), d.to_markdown()


def test_layer_diff_finds_wrong_rope_theta(llm, ref, window):
    with faults.wrong_rope_theta(llm, 9, theta=10_000.0):
        d = layer_diff(llm, ref, window[:96])
    assert (d.first_jump_layer, d.first_jump_block) == (9, "self_attn"), d.to_markdown()
