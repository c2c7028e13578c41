"""KV-cache storage formats: how K and V are written to and read from the paged cache.

A float cache (float32/float16/bfloat16) stores ``x.to(cache_dtype)``: round to nearest
even, overflow to inf in float16 (there is no scale).

An fp8 cache stores ``saturate(x / scale).to(fp8)`` with a per-tensor scale (1.0 unless
given) and reads back ``stored.to(dtype) * scale``. Values beyond the format's largest
finite number (448 for e4m3, 57344 for e5m2) saturate to it, as vLLM's CUDA cache
kernels do (``__nv_cvt_float_to_fp8(..., __NV_SATFINITE, ...)`` in
``csrc/quantization/fp8``); torch's plain cast would give NaN (e4m3fn) or inf (e5m2).
fp8 tensors are indexed through a uint8 view because CPU torch lacks fp8 index kernels.
"""

from __future__ import annotations

import torch

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_DTYPES


def quantize_kv(x: torch.Tensor, cache_dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """Convert K or V ([tokens, kv_heads, head_dim], compute dtype) to the storage dtype."""
    if is_fp8(cache_dtype):
        fmax = torch.finfo(cache_dtype).max
        y = x.float() if scale == 1.0 else x.float() / scale
        return y.clamp(-fmax, fmax).to(cache_dtype)
    return x.to(cache_dtype)


def dequantize_kv(x: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """Stored K or V back to the compute dtype."""
    if is_fp8(x.dtype):
        y = x.to(torch.float32)
        if scale != 1.0:
            y = y * scale
        return y.to(dtype)
    return x.to(dtype)


def write_kv_slots(cache: torch.Tensor, slots: torch.Tensor, values: torch.Tensor) -> None:
    """cache: [num_slots, kv_heads, head_dim]; slots: [T] int64; values: already quantized."""
    if is_fp8(cache.dtype):
        cache.view(torch.uint8)[slots] = values.view(torch.uint8)
    else:
        cache[slots] = values


def read_kv_slots(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Gather slots (any shape [...]) -> [..., kv_heads, head_dim] in the storage dtype.

    Uses ``index_select`` on a [num_slots, kv_heads * head_dim] view: on CPU it is several
    times faster than advanced indexing (``cache[slots]``) for the same copy."""
    raw = cache.view(torch.uint8) if is_fp8(cache.dtype) else cache
    rows = raw.view(raw.shape[0], -1).index_select(0, slots.reshape(-1))
    return rows.view(*slots.shape, *cache.shape[1:]).view(cache.dtype)
