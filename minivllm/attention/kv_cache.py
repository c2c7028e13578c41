"""The paged KV cache of the attention layers: one :class:`LayerKVCache` per layer, its
size, its allocation and the scales stored with it (vLLM: ``GPUModelRunner.
initialize_kv_cache`` / ``_allocate_kv_cache_tensors`` in
``vllm/v1/worker/gpu_model_runner.py``, ``vllm/v1/kv_cache_interface.py`` for the size).

The storage formats (fp8/int8 quantization, scales) are in
:mod:`minivllm.quantization.kv_cache`, where :class:`LayerKVCache` is defined; the
calibration pass in :mod:`minivllm.quantization.kv_calibration`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch

from minivllm.quantization.kv_cache import (LayerKVCache, is_quantized,
                                            kv_scale_bytes_per_token, kv_scales_from_amax,
                                            qmax)

if TYPE_CHECKING:
    from minivllm.config import CacheConfig, ModelConfig

__all__ = ["LayerKVCache", "kv_cache_bytes_per_block", "allocate_kv_caches",
           "set_kv_scales_from_amax", "kv_cache_scales", "nonfinite_kv_requests"]


def kv_cache_bytes_per_block(model_config: ModelConfig, block_size: int,
                             cache_dtype: torch.dtype, dynamic_scales: bool = False) -> int:
    """K and V, all layers, one block (plus per-token scales when they are dynamic)."""
    elem = torch.empty((), dtype=cache_dtype).element_size()
    per_token = 2 * model_config.num_kv_heads * model_config.head_dim * elem \
        + kv_scale_bytes_per_token(model_config.num_kv_heads, dynamic_scales)
    return model_config.num_layers * block_size * per_token


def allocate_kv_caches(model, cache_config: CacheConfig, head_dim: int, num_slots: int,
                       device: torch.device) -> list[LayerKVCache]:
    """One zero-filled cache per decoder layer of ``model``, bound to its attention
    (``layer.self_attn.kv_cache``): K and V [num_slots, num_kv_heads, head_dim] in
    ``cache_config.kv_cache_torch_dtype`` (this rank's KV heads under tensor parallelism), static
    scales from ``cache_config.k_scale``/``v_scale``, and float32 [num_slots,
    num_kv_heads] per-token scales when ``kv_scale_type == "dynamic"``. Zero-filled:
    padded (masked) reads then never meet NaN garbage."""
    shape = (num_slots, model.layers[0].self_attn.num_kv_heads, head_dim)
    dynamic = cache_config.kv_scale_type == "dynamic"

    def zeros(shape_, dtype=cache_config.kv_cache_torch_dtype):
        return torch.zeros(shape_, dtype=dtype, device=device)

    caches = []
    for layer in model.layers:
        kv = LayerKVCache(
            zeros(shape), zeros(shape),
            torch.tensor(cache_config.k_scale, device=device),
            torch.tensor(cache_config.v_scale, device=device),
            zeros(shape[:2], torch.float32) if dynamic else None,
            zeros(shape[:2], torch.float32) if dynamic else None)
        layer.self_attn.kv_cache = kv
        caches.append(kv)
    return caches


def set_kv_scales_from_amax(kv_caches: list[LayerKVCache], amaxes: list, cache_config: CacheConfig,
                            device: torch.device) -> None:
    """Set every layer's static K/V scales to ``amax / qmax`` from calibrated amaxes
    (per layer ``(k_amax, v_amax)``, as
    :func:`~minivllm.quantization.kv_calibration.calibrate_kv_amax` returns them), at
    ``cache_config.kv_scale_granularity``: per tensor, per KV head, or K per (KV head,
    channel) with V per tensor ("channel").

    Raises:
        ValueError: NaN/inf K or V amax (scales unchanged)."""
    m = qmax(cache_config.kv_cache_torch_dtype)
    granularity = cache_config.kv_scale_granularity
    for layer, (k_amax, v_amax) in enumerate(amaxes):
        if not bool(torch.isfinite(k_amax).all() & torch.isfinite(v_amax).all()):
            raise ValueError(f"KV-scale calibration saw NaN/inf keys or values in layer "
                             f"{layer} (K amax {k_amax.tolist()}, V amax {v_amax.tolist()}); "
                             "the model overflows on the calibration data, so no scale "
                             "would be meaningful. Scales are unchanged.")
    for kv, (k_amax, v_amax) in zip(kv_caches, amaxes):
        if granularity == "tensor":
            k_amax, v_amax = k_amax.max(), v_amax.max()
        elif granularity == "channel":
            v_amax = v_amax.max()
        kv.set_scales(kv_scales_from_amax(k_amax, m).to(device),
                      kv_scales_from_amax(v_amax, m).to(device))


def kv_cache_scales(kv_caches: list[LayerKVCache], cache_config: CacheConfig) -> dict:
    """The scales stored with the cache: ``{"type", "granularity", "k_scale", "v_scale"}``
    where k_scale/v_scale are per-layer lists (floats, per-head lists, or for K per
    channel [num_kv_heads][head_dim] nested lists); None for a float cache, and the
    string "dynamic" for per-token scales."""
    cc = cache_config
    if not is_quantized(cc.kv_cache_torch_dtype):
        return {"type": None, "granularity": None, "k_scale": None, "v_scale": None}
    if cc.kv_scale_type == "dynamic":
        return {"type": "dynamic", "granularity": "token", "k_scale": "dynamic",
                "v_scale": "dynamic"}
    return {"type": "static", "granularity": cc.kv_scale_granularity,
            "k_scale": [kv.k_scale.tolist() for kv in kv_caches],
            "v_scale": [kv.v_scale.tolist() for kv in kv_caches]}


def nonfinite_kv_requests(kv_caches: list[LayerKVCache], request_ids: list[str],
                          query_lens: list[int]) -> set[str]:
    """The requests (``request_ids[i]`` wrote ``query_lens[i]`` rows this step, in batch
    order) with a token whose K/V was not finite in an int8 cache, which cannot store
    NaN/inf (see ``LayerKVCache.write``). Reads and clears each layer's record."""
    bad_rows: Optional[torch.Tensor] = None
    for kv in kv_caches:
        if kv.nonfinite_rows is not None:
            bad_rows = kv.nonfinite_rows if bad_rows is None else bad_rows | kv.nonfinite_rows
            kv.nonfinite_rows = None
    if bad_rows is None:
        return set()
    bad, row = set(), 0
    flags = bad_rows.tolist()
    for rid, n in zip(request_ids, query_lens):
        if any(flags[row:row + n]):
            bad.add(rid)
        row += n
    return bad
