"""faults.decode_softmax_low_precision: a decode-only fault on the "attention.decode" step
(chapter 6). Prefill is untouched bit for bit, decode drifts, the layer diff between the
two paths names the layer, the float32 variant matches the reference within float32
rounding, and the engine is restored after the block (also after an exception)."""

from __future__ import annotations

import pytest
import torch

from minivllm import LLM
from minivllm.attention.backends.torch_ref import decode_attention_ref
from minivllm.precision import faults, metrics
from minivllm.precision.layer_diff import capture_hidden_states, find_first_jump, relative_error

pytestmark = pytest.mark.usefixtures("one_thread")

IDS = [5 + (7 * i) % 90 for i in range(24)]


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(str(tiny_model_dir), dtype="float32", max_model_len=64, seed=0)


@pytest.fixture(scope="module")
def clean(llm):
    return {m: llm.score(IDS, mode=m, output="logits") for m in ("prefill", "decode")}


def _random_decode_inputs(gen, B, H, Hkv, D, L):
    q = torch.randn(B, H, D, generator=gen) * 2
    k = torch.randn(B, L, Hkv, D, generator=gen) * 2
    v = torch.randn(B, L, Hkv, D, generator=gen)
    seq_lens = torch.randint(1, L + 1, (B,), generator=gen)
    seq_lens[0] = L
    for b in range(B):  # padding: large finite values that must get weight 0
        k[b, seq_lens[b]:] = 1e4
        v[b, seq_lens[b]:] = -1e4
    return q, k, v, seq_lens, D ** -0.5


@pytest.mark.parametrize("shape", [(1, 4, 4, 16, 1), (3, 8, 2, 32, 75), (2, 9, 3, 64, 200)])
def test_softmax_dtype_step_against_reference(shape):
    args = _random_decode_inputs(torch.Generator().manual_seed(0), *shape)
    ref = decode_attention_ref(*args)
    fp32 = faults.decode_attention_softmax_dtype(*args, softmax_dtype=torch.float32)
    bf16 = faults.decode_attention_softmax_dtype(*args, softmax_dtype=torch.bfloat16)
    assert fp32.shape == ref.shape and fp32.dtype == ref.dtype
    assert (fp32 - ref).abs().max() <= 5e-5
    if shape[-1] > 1:  # one key: softmax is exactly 1 in any dtype
        assert (bf16 - ref).abs().max() > 1e-3


@pytest.mark.parametrize("layer", [0, 1])
def test_decode_only_and_restored(llm, clean, layer):
    with faults.decode_softmax_low_precision(llm, layer):
        pre = llm.score(IDS, mode="prefill", output="logits")
        dec = llm.score(IDS, mode="decode", output="logits")
    assert torch.equal(pre, clean["prefill"]), "the fault must leave prefill bit-identical"
    kl_clean = float(metrics.kl_divergence(clean["prefill"], clean["decode"]).mean())
    kl_fault = float(metrics.kl_divergence(pre, dec).mean())
    assert kl_fault > 100 * max(kl_clean, 1e-12), (kl_clean, kl_fault)
    assert torch.equal(llm.score(IDS, mode="decode", output="logits"), clean["decode"]), \
        "the engine must be restored after the block"


@pytest.mark.parametrize("layer", [0, 1])
def test_layer_diff_between_modes_names_the_layer(llm, layer):
    a = capture_hidden_states(llm, IDS, "prefill")
    with faults.decode_softmax_low_precision(llm, layer):
        b = capture_hidden_states(llm, IDS, "decode")
    errors = {p: relative_error(b[p], a[p]) for p in a}
    assert find_first_jump(errors, 2) == (layer, "self_attn")
    clean_b = capture_hidden_states(llm, IDS, "decode")
    assert find_first_jump({p: relative_error(clean_b[p], a[p]) for p in a}, 2) == (None, None)


def test_float32_softmax_is_the_fix(llm, clean):
    with faults.decode_softmax_low_precision(llm, 1, dtype=torch.float32):
        dec = llm.score(IDS, mode="decode", output="logits")
    kl_clean = float(metrics.kl_divergence(clean["prefill"], clean["decode"]).mean())
    kl_fixed = float(metrics.kl_divergence(clean["prefill"], dec).mean())
    assert kl_fixed <= max(10 * kl_clean, 1e-9)


def test_restored_after_an_exception(llm, clean):
    with pytest.raises(RuntimeError, match="inside"):
        with faults.decode_softmax_low_precision(llm, 0):
            raise RuntimeError("inside")
    assert torch.equal(llm.score(IDS, mode="decode", output="logits"), clean["decode"])


def test_bad_arguments(llm):
    with pytest.raises(ValueError, match="layer must be in"):
        faults.decode_softmax_low_precision(llm, 2).__enter__()
    with pytest.raises(ValueError, match="dtype must be"):
        faults.decode_softmax_low_precision(llm, 0, dtype=torch.int8).__enter__()
    with pytest.raises(TypeError, match="planted into an LLM"):
        faults.decode_softmax_low_precision(object(), 0).__enter__()
