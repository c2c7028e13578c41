"""KV-cache quantization: storage round trips within each format's bound, per-head and
dynamic scales, calibration against an independent measurement, and engine behaviour."""

from __future__ import annotations

import pytest
import torch

from minivllm import LLM
from minivllm.quantization.kv_cache import LayerKVCache, qmax
from minivllm.worker.model_runner import kv_cache_bytes_per_block

H, D, SLOTS = 3, 16, 40


def kv_values(seed: int, n: int = 24) -> torch.Tensor:
    """[n, H, D] with heads of very different ranges (head 2 has 30x outliers)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, H, D, generator=g)
    x[:, 0] *= 0.05
    x[:, 2] *= 3.0
    x[3, 2, 5] = 90.0
    return x


def make_cache(dtype, k_scale, v_scale, dynamic=False) -> LayerKVCache:
    z = lambda shape, dt=dtype: torch.zeros(shape, dtype=dt)  # noqa: E731
    return LayerKVCache(z((SLOTS, H, D)), z((SLOTS, H, D)), k_scale, v_scale,
                        z((SLOTS, H), torch.float32) if dynamic else None,
                        z((SLOTS, H), torch.float32) if dynamic else None)


def step_bound(dtype, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Largest rounding error of Q(x / scale) * scale for in-range x.

    int8: half a step, scale / 2. fp8 with m mantissa bits: half an ulp of |x/scale|,
    2^(e - m - 1) for x/scale in [2^e, 2^(e+1)), and at least half the smallest
    subnormal step 2^(emin - m - 1)."""
    if dtype == torch.int8:
        return scale / 2 * torch.ones_like(x)
    m = 3 if dtype == torch.float8_e4m3fn else 2
    emin = -6 if dtype == torch.float8_e4m3fn else -14
    y = (x / scale).abs()
    e = torch.floor(torch.log2(y.clamp(min=2.0 ** emin)))
    return 2.0 ** (e - m - 1) * scale


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2, torch.int8])
@pytest.mark.parametrize("granularity", ["tensor", "head", "dynamic"])
def test_round_trip_within_format_bound(dtype, granularity):
    k, v = kv_values(0), kv_values(1) * 0.5
    slots = torch.randperm(SLOTS, generator=torch.Generator().manual_seed(2))[:k.shape[0]]
    m = qmax(dtype)
    if granularity == "dynamic":
        cache = make_cache(dtype, torch.tensor(1.0), torch.tensor(1.0), dynamic=True)
        k_scale = k.abs().amax(-1, keepdim=True) / m       # per token and head
        v_scale = v.abs().amax(-1, keepdim=True) / m
    elif granularity == "head":
        k_scale, v_scale = k.abs().amax((0, 2)) / m, v.abs().amax((0, 2)) / m
        cache = make_cache(dtype, k_scale, v_scale)
        k_scale, v_scale = k_scale[:, None], v_scale[:, None]
    else:
        k_scale, v_scale = k.abs().max() / m, v.abs().max() / m
        cache = make_cache(dtype, k_scale, v_scale)
    cache.write(slots, k, v)
    k_back, v_back = cache.read(slots, torch.float32)
    for name, x, back, scale in (("K", k, k_back, k_scale), ("V", v, v_back, v_scale)):
        err = (back - x).abs()
        bound = step_bound(dtype, x, scale) * (1 + 1e-5) + 1e-12
        worst = float((err / bound).max())
        assert worst <= 1.0, f"{dtype} {granularity} {name}: error / bound = {worst:.3f}"


def test_per_head_and_dynamic_beat_per_tensor_int8():
    """Head 0 is 60x smaller than head 2's outlier: one tensor scale wastes its grid."""
    k = kv_values(3)
    m = qmax(torch.int8)
    slots = torch.arange(k.shape[0])
    errs = {}
    for kind in ("tensor", "head", "dynamic"):
        if kind == "tensor":
            c = make_cache(torch.int8, k.abs().max() / m, torch.tensor(1.0))
        elif kind == "head":
            c = make_cache(torch.int8, k.abs().amax((0, 2)) / m, torch.tensor(1.0))
        else:
            c = make_cache(torch.int8, torch.tensor(1.0), torch.tensor(1.0), dynamic=True)
        c.write(slots, k, k)
        errs[kind] = float((c.read(slots, torch.float32)[0][:, 0] - k[:, 0]).abs().max())
    assert errs["head"] < errs["tensor"] / 10, errs
    assert errs["dynamic"] <= errs["head"] * 1.01, errs


def test_fp8_saturates_instead_of_overflowing():
    c = make_cache(torch.float8_e4m3fn, torch.tensor(0.1), torch.tensor(0.1))
    x = torch.full((1, H, D), 1000.0)  # 1000 / 0.1 = 10^4 >> 448
    c.write(torch.tensor([0]), x, -x)
    k, v = c.read(torch.tensor([0]), torch.float32)
    assert torch.equal(k, torch.full_like(k, 44.8)) and torch.equal(v, torch.full_like(v, -44.8))


def test_dynamic_scales_cost_cache_bytes(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), dtype="float32", max_model_len=64)
    mc = llm.llm_engine.model_config
    static = kv_cache_bytes_per_block(mc, 16, torch.int8)
    dynamic = kv_cache_bytes_per_block(mc, 16, torch.int8, dynamic_scales=True)
    assert static == 2 * mc.num_layers * 16 * mc.num_kv_heads * mc.head_dim
    assert dynamic - static == 2 * mc.num_layers * 16 * mc.num_kv_heads * 4


def _float_kv_amax(model_dir, ids: list[int]):
    """Per-layer, per-head max |K| and |V| read from a float32 engine's cache after a
    prefill of ``ids`` (independent of the calibration code path)."""
    llm = LLM(str(model_dir), dtype="float32", kv_cache_dtype="float32", max_model_len=128,
              enable_prefix_caching=False, num_gpu_blocks_override=8, block_size=16)
    eng = llm.llm_engine
    for kv in eng.model_runner.kv_caches:
        kv.key.fill_(0), kv.value.fill_(0)
    llm.score([ids])
    return [(kv.key.abs().amax((0, 2)), kv.value.abs().amax((0, 2)))
            for kv in eng.model_runner.kv_caches]


@pytest.mark.parametrize("dtype", ["fp8_e4m3", "int8"])
@pytest.mark.parametrize("granularity", ["tensor", "head"])
def test_calibrated_scales_equal_amax_over_qmax(tiny_model_dir, one_thread, dtype, granularity):
    ids = list(range(3, 70))
    llm = LLM(str(tiny_model_dir), dtype="float32", kv_cache_dtype=dtype, max_model_len=128,
              calculate_kv_scales=True, kv_scale_granularity=granularity)
    scales = llm.llm_engine.calibrate_kv_scales([ids])
    assert scales == llm.kv_cache_scales()
    assert scales["type"] == "static" and scales["granularity"] == granularity
    m = 448.0 if dtype == "fp8_e4m3" else 127.0
    for layer, (k_amax, v_amax) in enumerate(_float_kv_amax(tiny_model_dir, ids)):
        for got, amax in ((scales["k_scale"][layer], k_amax), (scales["v_scale"][layer], v_amax)):
            want = amax / m if granularity == "head" else amax.max() / m
            torch.testing.assert_close(torch.tensor(got), want, rtol=1e-6, atol=0)


def test_calibration_lowers_int8_error_against_a_bad_fixed_scale(tiny_model_dir, one_thread):
    ids = list(range(5, 60))
    ref = LLM(str(tiny_model_dir), dtype="float32", max_model_len=128).score([ids])[0]

    def kl(**kw):
        rows = LLM(str(tiny_model_dir), dtype="float32", kv_cache_dtype="int8",
                   max_model_len=128, **kw).score([ids])[0]
        return float((ref.exp() * (ref - rows)).sum(-1).mean())

    coarse = kl(kv_scale=(0.5, 0.5))  # a step of 0.5: far too coarse for these K/V
    calibrated = kl(calculate_kv_scales=True, kv_scale_granularity="head")
    dynamic = kl(kv_scale_type="dynamic")
    assert calibrated < coarse / 10 and dynamic < coarse / 10, (coarse, calibrated, dynamic)


def test_scale_reporting_and_misuse(tiny_model_dir):
    f32 = LLM(str(tiny_model_dir), dtype="float32", max_model_len=64)
    assert f32.kv_cache_scales()["type"] is None
    with pytest.raises(ValueError, match="needs a quantized KV cache with static scales"):
        f32.llm_engine.calibrate_kv_scales()
    dyn = LLM(str(tiny_model_dir), dtype="float32", kv_cache_dtype="int8", max_model_len=64,
              kv_scale_type="dynamic")
    assert dyn.kv_cache_scales()["k_scale"] == "dynamic"
    fixed = LLM(str(tiny_model_dir), dtype="float32", kv_cache_dtype="fp8", max_model_len=64,
                kv_scale=(0.25, 0.5))
    s = fixed.kv_cache_scales()
    assert s["k_scale"] == [0.25] * 2 and s["v_scale"] == [0.5] * 2
    with pytest.raises(ValueError, match="calibration sequences need 1 to max_model_len"):
        fixed.llm_engine.calibrate_kv_scales([list(range(3, 200))])
    with pytest.raises(ValueError, match="calibration token ids must be integers"):
        fixed.llm_engine.calibrate_kv_scales([[1, -4]])
    assert fixed.kv_cache_scales() == s  # a failed calibration changes nothing


def test_calibration_refuses_nan_and_flat_lists(tiny_model_dir, one_thread):
    llm = LLM(str(tiny_model_dir), dtype="float32", kv_cache_dtype="int8", max_model_len=64,
              kv_scale=(0.1, 0.1))
    before = llm.kv_cache_scales()
    with pytest.raises(ValueError, match="a list of token-id sequences"):
        llm.llm_engine.calibrate_kv_scales([1, 2, 3])
    qkv = llm.llm_engine.model_runner.model.layers[0].self_attn.qkv_proj
    handle = qkv.register_forward_hook(lambda m, a, out: torch.full_like(out, float("inf")))
    try:
        with pytest.raises(ValueError, match="NaN/inf keys or values in layer 0"):
            llm.llm_engine.calibrate_kv_scales([[5, 6, 7, 8]])
    finally:
        handle.remove()
    assert llm.kv_cache_scales() == before


def test_calibration_set_size_is_checked(tiny_model_dir):
    with pytest.raises(ValueError, match=r"calibration_tokens=1000000 but the 'corpus'"):
        LLM(str(tiny_model_dir), dtype="float32", max_model_len=64, quantization="gptq",
            quantization_config={"calibration": "corpus", "calibration_tokens": 10**6})
