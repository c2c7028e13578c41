"""dtype="auto" (vLLM's rule), TF32 emulation in the engine, and NaN/inf handling:
overflowing requests finish with "error" and are counted; per-layer NaN/inf counts."""

from __future__ import annotations

import logging

import pytest
import torch

from minivllm import LLM, SamplingParams
from minivllm.config import parse_dtype, resolve_auto_dtype, supported_dtypes
from minivllm.layers.linear import PACK_CPU_WEIGHTS, Linear, clear_weight_caches, float_linear
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


def _assert_f32_linear_close(got, x, w, b, what):
    """float32, another summation order: |err| <= 2 K eps (|x| |w|^T + |b|)."""
    w, b = w.detach(), b.detach()
    want = torch.nn.functional.linear(x.double(), w.double(), b.double())
    bound = 2 * x.shape[-1] * 2.0 ** -24 * (torch.nn.functional.linear(
        x.abs().double(), w.abs().double(), b.abs().double()))
    ratio = float(((got.double() - want).abs() / bound).max())
    assert got.shape == want.shape and got.dtype == torch.float32
    assert ratio <= 1.0, f"{what}: error is {ratio:.2f}x the float32 bound"


@pytest.mark.skipif(not PACK_CPU_WEIGHTS, reason="no oneDNN in this torch build")
def test_packed_cpu_linear_is_float32_accurate_and_follows_weight_edits():
    g = torch.Generator().manual_seed(2)
    lin = Linear(96, 40, bias=True)
    lin.weight.data = torch.randn(40, 96, generator=g)
    lin.bias.data = torch.randn(40, generator=g)
    for shape in [(1, 96), (7, 96), (3, 5, 96), (130, 96)]:
        x = torch.randn(*shape, generator=g)
        with torch.inference_mode():
            got = lin(x)
        _assert_f32_linear_close(got, x, lin.weight, lin.bias, f"packed, x {shape}")
    assert hasattr(lin.weight, "_packed_cache"), "the packed weight is kept between calls"
    x = torch.randn(6, 96, generator=g)
    with torch.inference_mode():
        before = lin(x)
    with torch.no_grad():
        lin.weight.mul_(2.0)  # in place, version bumped: packed again
    with torch.inference_mode():
        got = lin(x)
    _assert_f32_linear_close(got, x, lin.weight, lin.bias, "after an in-place edit")
    assert not torch.allclose(got, before)
    lin.weight.data.mul_(0.5)  # through .data: invisible until the caches are cleared
    clear_weight_caches(lin)
    with torch.inference_mode():
        got = lin(x)
    _assert_f32_linear_close(got, x, lin.weight, lin.bias, "after clear_weight_caches")
    # with autograd on (training, gradients) it is plain F.linear, bit for bit
    assert torch.equal(lin(x), torch.nn.functional.linear(x, lin.weight, lin.bias))


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


def test_nan_kv_from_a_failed_request_does_not_reach_later_requests(tiny_model_dir, one_thread):
    """A failed request leaves NaN K/V in blocks that go back to the pool (and, with
    prefix caching, into the cache): later clean requests must not read them, neither
    through decode padding (which reads slot 0) nor through a prefix-cache hit."""
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    prompt = [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17]
    for caching in (False, True):
        llm = LLM(str(tiny_model_dir), dtype="float32", max_model_len=32, block_size=4,
                  num_gpu_blocks_override=12, enable_prefix_caching=caching)
        clean = [o.outputs[0].token_ids for o in llm.generate([[5], [5, 6, 7]], params)]
        qkv = llm.llm_engine.model_runner.model.layers[0].self_attn.qkv_proj
        handle = qkv.register_forward_hook(lambda m, a, out: torch.full_like(out, float("nan")))
        try:
            bad = llm.generate([prompt] * 3, params)
        finally:
            handle.remove()
        assert all(o.outputs[0].finish_reason == "error" for o in bad)
        again = llm.generate([[5], [5, 6, 7], prompt], params)
        assert [o.outputs[0].finish_reason for o in again] == ["length"] * 3, caching
        assert [o.outputs[0].token_ids for o in again[:2]] == clean
        assert llm.stats.num_free_blocks == 12


def test_int8_kv_cache_flags_nan_it_cannot_store(tiny_model_dir, one_thread):
    llm = LLM(str(tiny_model_dir), dtype="float32", kv_cache_dtype="int8", max_model_len=32,
              kv_scale_type="dynamic", enable_prefix_caching=False)
    qkv = llm.llm_engine.model_runner.model.layers[1].self_attn.qkv_proj
    kv_cols = slice(qkv.out_features - 8, qkv.out_features)  # part of V

    def hook(m, a, out):
        out = out.clone()
        out[..., kv_cols] = float("nan")  # V only: logits stay finite through int8
        return out

    handle = qkv.register_forward_hook(hook)
    try:
        out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4))[0]
    finally:
        handle.remove()
    assert out.outputs[0].finish_reason == "error"
    assert llm.stats.num_corrupted_requests == 1


def test_nan_prompt_logprobs_are_flagged(nan_llm):
    norm = nan_llm.llm_engine.model_runner.model.norm

    def hook(m, a, out):  # NaN in the first prompt position only
        if out.shape[0] > 1:
            out = out.clone()
            out[0] = float("nan")
        return out

    handle = norm.register_forward_hook(hook)
    try:
        out = nan_llm.generate([[5, 6, 7, 8]], SamplingParams(temperature=0, max_tokens=2,
                                                              prompt_logprobs=1))[0]
    finally:
        handle.remove()
    assert nan_llm.stats.num_corrupted_requests == 1
    assert out.outputs[0].finish_reason == "error"


def test_tf32_with_weight_only_quantization_runs(tiny_model_dir, one_thread):
    ids = [list(range(3, 30))]
    plain = LLM(str(tiny_model_dir), dtype="float32", max_model_len=64, quantization="int8")
    tf32 = LLM(str(tiny_model_dir), dtype="float32", max_model_len=64, quantization="int8",
               float32_matmul_precision="high")
    a, b = plain.score(ids)[0], tf32.score(ids)[0]
    err = float((a - b).abs().max())
    assert 0 < err < 0.05, f"TF32 vs float32 on the int8 model: {err:.3e}"
    out = tf32.generate([[5, 6]], SamplingParams(temperature=0, max_tokens=3))[0]
    assert out.outputs[0].finish_reason in ("length", "stop")


def test_tf32_without_float32_warns(tiny_model_dir, caplog):
    with caplog.at_level(logging.WARNING, logger="minivllm"):
        LLM(str(tiny_model_dir), max_model_len=64, float32_matmul_precision="high")
    assert "has no effect" in caplog.text


def test_numerics_argument_checks():
    from minivllm.numerics import FloatFormat

    x = torch.ones(3)
    with pytest.raises(TypeError, match="saturate must be True or False"):
        round_to_format(x, "float16", saturate="False")
    with pytest.raises(TypeError, match="saturate must be True or False"):
        round_to_tf32(x, saturate=1)
    with pytest.raises(TypeError, match="fmt must be a format name"):
        round_to_format(x, torch.float16)
    with pytest.raises(ValueError, match="max_normal 1000 is not a value"):
        FloatFormat("e3m2", 3, 2, 3, 1000, 0.25, 0.0625, False, "none")
    with pytest.raises(ValueError, match="min_normal must be"):
        FloatFormat("bad", 4, 3, 7, 448.0, 0.5, 2.0 ** -9, False, "S.1111.111")
    e3m2 = FloatFormat("e3m2", 3, 2, 3, 28.0, 0.25, 0.0625, False, "none")
    assert float(round_to_format(torch.tensor([27.0]), e3m2, saturate=True)) == 28.0


def test_float64_checkpoint_under_auto_warns_and_falls_back(caplog):
    with caplog.at_level(logging.WARNING, logger="minivllm"):
        assert parse_dtype("auto", torch.float64, "cpu") == torch.bfloat16
    assert "does not support torch.float64" in caplog.text
    from minivllm.models.loader import checkpoint_dtype

    assert checkpoint_dtype({"torch_dtype": "float64"}) == torch.float64
