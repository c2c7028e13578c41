"""Per-channel K scales for the KV cache (``kv_scale_granularity="channel"``; beyond vLLM,
KIVI-style): K gets one static scale per (KV head, channel), V one per tensor.

Checked against computations written out here (not the code under test): the scales
equal amax / qmax per channel of the K that a float32 engine stores; a stored K with a
few outlier channels keeps the other channels' precision per channel and loses it per
tensor; the engine refuses the setting where it cannot honour it."""

from __future__ import annotations

import pytest
import torch

from minivllm import LLM
from minivllm.quantization.kv_cache import LayerKVCache

pytestmark = pytest.mark.usefixtures("one_thread")

H, D, SLOTS = 2, 16, 24


def _cache(dtype, k_scale, v_scale):
    z = lambda shape: torch.zeros(shape, dtype=dtype)  # noqa: E731
    return LayerKVCache(z((SLOTS, H, D)), z((SLOTS, H, D)), k_scale, v_scale)


def _float_k_amax(model_dir, ids):
    """Per-layer max |K| per (head, channel) from a float32 engine's cache after a prefill."""
    llm = LLM(str(model_dir), dtype="float32", kv_cache_dtype="float32", max_model_len=128,
              enable_prefix_caching=False, num_gpu_blocks_override=8, block_size=16)
    for kv in llm.llm_engine.model_runner.kv_caches:
        kv.key.fill_(0), kv.value.fill_(0)
    llm.score([ids])
    return [(kv.key.abs().amax(0), kv.value.abs().amax()) for kv in
            llm.llm_engine.model_runner.kv_caches]


@pytest.mark.parametrize("dtype", ["fp8_e4m3", "int8"])
def test_channel_scales_are_amax_over_qmax_per_channel(tiny_model_dir, dtype):
    ids = list(range(3, 70))
    llm = LLM(str(tiny_model_dir), dtype="float32", kv_cache_dtype=dtype, max_model_len=128,
              calculate_kv_scales=True, kv_scale_granularity="channel")
    scales = llm.llm_engine.calibrate_kv_scales([ids])
    assert scales["granularity"] == "channel"
    m = 448.0 if dtype == "fp8_e4m3" else 127.0
    mc = llm.llm_engine.model_config
    for layer, (k_amax, v_amax) in enumerate(_float_k_amax(tiny_model_dir, ids)):
        k = torch.tensor(scales["k_scale"][layer])
        assert k.shape == (mc.num_kv_heads, mc.head_dim)
        torch.testing.assert_close(k, torch.where(k_amax > 0, k_amax / m, torch.ones_like(k_amax)),
                                   rtol=1e-6, atol=0)
        torch.testing.assert_close(torch.tensor(scales["v_scale"][layer]), v_amax / m,
                                   rtol=1e-6, atol=0)


def test_outlier_channels_cost_the_others_nothing_per_channel():
    """int8 K with two outlier channels (x50): per tensor, every other channel's step is
    set by the outliers; per channel, each channel's error stays within its own half step."""
    g = torch.Generator().manual_seed(0)
    k = torch.randn(SLOTS, H, D, generator=g)
    k[:, 0, 3] *= 50
    k[:, 1, 11] *= 50
    v = torch.randn(SLOTS, H, D, generator=g)
    slots = torch.arange(SLOTS)
    amax = k.abs().amax(0)                           # [H, D]
    per_channel = _cache(torch.int8, amax / 127, v.abs().amax() / 127)
    per_tensor = _cache(torch.int8, amax.max() / 127, v.abs().amax() / 127)
    errs = {}
    for name, c in (("channel", per_channel), ("tensor", per_tensor)):
        c.write(slots, k, v)
        got, _ = c.read(slots, torch.float32)
        errs[name] = (got - k).abs()
    # per channel: within half a step of that channel's own scale (fp32 rounding slack)
    assert bool((errs["channel"] <= (amax / 127) / 2 * (1 + 1e-5) + 1e-7).all())
    normal = torch.ones(H, D, dtype=torch.bool)
    normal[0, 3] = normal[1, 11] = False
    ratio = float(errs["tensor"][:, normal].mean() / errs["channel"][:, normal].mean())
    print(f"int8 K, mean |error| on the non-outlier channels: per tensor / per channel = {ratio:.1f}")
    assert ratio > 10


def test_channel_scales_need_calibration_and_the_torch_backend(tiny_model_dir):
    with pytest.raises(ValueError, match="needs calculate_kv_scales=True"):
        LLM(str(tiny_model_dir), dtype="float32", kv_cache_dtype="fp8", max_model_len=64,
            kv_scale_granularity="channel")
    with pytest.raises(ValueError, match="TORCH attention backend only"):
        LLM(str(tiny_model_dir), dtype="float32", kv_cache_dtype="fp8", max_model_len=64,
            calculate_kv_scales=True, kv_scale_granularity="channel", attention_backend="TRITON")
    with pytest.raises(ValueError, match="'tensor', 'head' or 'channel'"):
        LLM(str(tiny_model_dir), dtype="float32", kv_cache_dtype="fp8", max_model_len=64,
            calculate_kv_scales=True, kv_scale_granularity="token")


def test_channel_scales_run_prefill_and_decode_alike(tiny_model_dir):
    """The [H, D] K scale broadcasts the same way on the prefill and the decode path."""
    ids = list(range(5, 37))
    llm = LLM(str(tiny_model_dir), dtype="float32", kv_cache_dtype="int8", max_model_len=64,
              calculate_kv_scales=True, kv_scale_granularity="channel",
              enable_prefix_caching=False)
    ref = LLM(str(tiny_model_dir), dtype="float32", max_model_len=64).score(ids, output="logits")
    pre = llm.score(ids, output="logits")
    dec = llm.score(ids, mode="decode", output="logits")
    for rows in (pre, dec):
        kl = float((torch.log_softmax(ref, -1).exp() * (torch.log_softmax(ref, -1)
                                                       - torch.log_softmax(rows, -1))).sum(-1).mean())
        assert 0 <= kl < 1e-2, kl
    torch.testing.assert_close(pre, dec, rtol=0, atol=1e-3)
