"""dtype="auto" (vLLM's rule), TF32 emulation in the engine, and NaN/inf handling:
overflowing requests finish with "error" and are counted; per-layer NaN/inf counts."""

from __future__ import annotations

import logging

import pytest
import torch

from minivllm import LLM, SamplingParams
from minivllm.config import parse_dtype, resolve_auto_dtype, supported_dtypes
from minivllm.layers.linear import Linear, float_linear
from minivllm.numerics import round_to_format, round_to_tf32
from minivllm.precision.overflow import track_nonfinite

CPU = [torch.bfloat16, torch.float16, torch.float32]
PRE_AMPERE = [torch.float16, torch.float32]


@pytest.mark.parametrize("config_dtype,supported,expected", [
    (torch.float32, CPU, torch.bfloat16),         # fp32 checkpoints are downcast
    (torch.float32, PRE_AMPERE, torch.float16),   # ... to fp16 where bf16 is missing
    (torch.float16, CPU, torch.float16),          # 16-bit checkpoints keep their dtype
    (torch.bfloat16, CPU, torch.bfloat16),
    (torch.float16, PRE_AMPERE, torch.float16),
])
def test_auto_dtype_rule(config_dtype, supported, expected):
    assert resolve_auto_dtype(config_dtype, supported) == expected


def test_auto_dtype_falls_back_with_a_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="minivllm"):
        assert resolve_auto_dtype(torch.bfloat16, PRE_AMPERE) == torch.float16
    assert "does not support torch.bfloat16" in caplog.text


def test_cpu_supported_dtypes_and_explicit_names():
    assert supported_dtypes("cpu") == CPU
    for name, want in (("float", torch.float32), ("float32", torch.float32),
                       ("half", torch.float16), ("float16", torch.float16),
                       ("bfloat16", torch.bfloat16)):
        assert parse_dtype(name, torch.float32) == want
    assert parse_dtype("auto", torch.float32, "cpu") == torch.bfloat16


def test_engine_auto_dtype_serves_fp32_checkpoint_in_bf16(tiny_model_dir, one_thread):
    llm = LLM(str(tiny_model_dir), max_model_len=64)  # the tiny checkpoint is float32
    model = llm.llm_engine.model_runner.model
    assert llm.llm_engine.model_config.dtype == torch.bfloat16
    assert model.layers[0].mlp.down_proj.weight.dtype == torch.bfloat16
    assert llm.llm_engine.model_runner.kv_caches[0].key.dtype == torch.bfloat16


# --- TF32 -------------------------------------------------------------------------------

def test_tf32_fast_path_equals_generic_rounding():
    g = torch.Generator().manual_seed(0)
    bits = torch.randint(-2**31, 2**31 - 1, (2**18,), generator=g, dtype=torch.int64)
    x = bits.to(torch.int32).view(torch.float32)
    for sat in (False, True):
        a = round_to_tf32(x, saturate=sat).view(torch.int32)
        b = round_to_format(x, "tf32", saturate=sat).view(torch.int32)
        nan = torch.isnan(a.view(torch.float32))
        assert bool((nan == torch.isnan(b.view(torch.float32))).all())
        bad = (a != b) & ~nan
        assert not bool(bad.any()), f"saturate={sat}: {int(bad.sum())} differ, e.g. x={x[bad][:4]}"


def test_linear_tf32_rounds_both_inputs_and_recomputes_after_a_weight_change():
    g = torch.Generator().manual_seed(1)
    lin = Linear(48, 16, bias=False)
    lin.weight.data = torch.randn(16, 48, generator=g)
    lin.tf32 = True
    x = torch.randn(5, 48, generator=g)
    want = torch.nn.functional.linear(round_to_tf32(x), round_to_tf32(lin.weight))
    assert torch.equal(lin(x), want)
    assert not torch.equal(lin(x), torch.nn.functional.linear(x, lin.weight))
    with torch.no_grad():
        lin.weight.mul_(2.0)  # in place: the cached rounded weight must not be reused
    assert torch.equal(lin(x), torch.nn.functional.linear(round_to_tf32(x),
                                                          round_to_tf32(lin.weight)))
    # bfloat16 data is untouched by TF32 (it only applies to float32 matmuls)
    xb, wb = x.bfloat16(), lin.weight.bfloat16()
    assert torch.equal(float_linear(xb, wb, None, True), torch.nn.functional.linear(xb, wb))


def test_engine_tf32_changes_scores_by_tf32_sized_amounts(tiny_model_dir, one_thread):
    ids = list(range(3, 40))
    exact = LLM(str(tiny_model_dir), dtype="float32", max_model_len=64).score([ids])[0]
    tf32 = LLM(str(tiny_model_dir), dtype="float32", max_model_len=64,
               float32_matmul_precision="high")
    model = tf32.llm_engine.model_runner.model
    assert model.tf32 and all(l.tf32 for l in model.modules() if isinstance(l, Linear))
    got = tf32.score([ids])[0]
    err = float((got - exact).abs().max())
    # TF32 keeps 11 significant bits (relative rounding 2^-11 ~ 4.9e-4 per input): the
    # log-probs move, but by far less than a unit
    assert 0 < err < 0.05, f"max |log-prob diff| TF32 vs float32 = {err:.3e}"


# --- NaN / inf ----------------------------------------------------------------------------

@pytest.fixture
def nan_llm(tiny_model_dir, one_thread):
    return LLM(str(tiny_model_dir), dtype="float32", max_model_len=64,
               num_gpu_blocks_override=16, block_size=8)


def _poison_layer(llm, layer: int):
    """Forward hook that turns one layer's MLP output to inf on every call."""
    mlp = llm.llm_engine.model_runner.model.layers[layer].mlp
    return mlp.register_forward_hook(lambda m, a, out: torch.full_like(out, float("inf")))


def test_nonfinite_logits_finish_with_error_and_are_counted(nan_llm):
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    ok = nan_llm.generate([[5, 6, 7]], params)[0]
    assert ok.outputs[0].finish_reason == "length" and len(ok.outputs[0].token_ids) == 8
    handle = _poison_layer(nan_llm, 1)
    try:
        outs = nan_llm.generate([[5, 6, 7], [9, 10, 11, 12]], params)
    finally:
        handle.remove()
    for o in outs:
        assert o.outputs[0].finish_reason == "error", o.outputs[0]
        assert o.outputs[0].token_ids == []  # the NaN step's "sample" is not emitted
    st = nan_llm.stats
    assert st.num_corrupted_requests == 2
    assert st.num_free_blocks == 16  # no leaked blocks
    again = nan_llm.generate([[5, 6, 7]], params)[0]  # the engine keeps working
    assert again.outputs[0].token_ids == ok.outputs[0].token_ids


def test_nonfinite_scores_are_counted(nan_llm):
    handle = _poison_layer(nan_llm, 0)
    try:
        rows = nan_llm.score([[5, 6, 7, 8]])[0]
    finally:
        handle.remove()
    assert bool(torch.isnan(rows).all())
    assert nan_llm.stats.num_corrupted_requests == 1


def test_track_nonfinite_names_the_first_layer(nan_llm):
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    with track_nonfinite(nan_llm) as clean:
        nan_llm.generate([[5, 6, 7]], params)
    assert clean.first() is None and clean.total() == 0
    assert clean.elements["layers.0.mlp"] > 0
    handle = _poison_layer(nan_llm, 1)
    try:
        with track_nonfinite(nan_llm) as counts:
            nan_llm.generate([[5, 6, 7]], params)
    finally:
        handle.remove()
    assert counts.first() == "layers.1.mlp"
    assert counts.inf["layers.1.mlp"] > 0 and counts.nan["layers.0.mlp"] == 0
    assert counts.nan["layers.0.self_attn"] == counts.inf["layers.0.self_attn"] == 0
    assert [r["module"] for r in counts.rows()][:3] == ["embed_tokens", "layers.0.self_attn",
                                                         "layers.0.mlp"]
