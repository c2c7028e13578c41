"""The numerics the kernels implement, in PyTorch: RMSNorm and the KV-cache storage rules.

Torch only (importing this module does not import Triton), at the bottom of the import
graph: the kernels' references (``minivllm_kernels/rms_norm.py``, ``minivllm_kernels/reshape_and_cache.py``)
and the engine's CPU path (``minivllm.layers.rms_norm``, ``minivllm.quantization.kv_cache``,
which re-export these names) run the same functions, so a kernel is checked against
exactly what the engine computes, and ``minivllm_kernels/`` imports nothing from ``minivllm``.

* :func:`rms_norm_ref`: RMSNorm as HF ``LlamaRMSNorm`` computes it (vLLM:
  ``RMSNorm.forward_native``, ``vllm/model_executor/layers/layernorm.py``).
* KV storage (``minivllm/quantization/kv_cache.py`` explains the formats and scales):
  :func:`quantize_kv` / :func:`dequantize_kv` (``Q(x / scale)`` and ``q * scale``; fp8
  saturates to the format's largest finite value as vLLM's ``__NV_SATFINITE`` cache
  kernels do, int8 rounds half to even and clamps to +-127), :func:`write_kv_slots` /
  :func:`read_kv_slots` (fp8 through a uint8 view: CPU torch lacks fp8 index kernels).
"""

from __future__ import annotations

import torch


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Reference RMSNorm. x: [..., hidden] (any float dtype); weight: [hidden]. Same dtype out."""
    input_dtype = x.dtype
    h = x.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + eps)
    return weight * h.to(input_dtype)


FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
QUANTIZED_KV_DTYPES = FP8_DTYPES + (torch.int8,)


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_DTYPES


def is_quantized(dtype: torch.dtype) -> bool:
    """True for storage dtypes that use scales (fp8, int8)."""
    return dtype in QUANTIZED_KV_DTYPES


def qmax(dtype: torch.dtype) -> float:
    """Largest magnitude a quantized KV dtype stores: 448 (e4m3), 57344 (e5m2), 127 (int8).

    Raises:
        ValueError: a float cache dtype (no scale applies).
    """
    if is_fp8(dtype):
        return float(torch.finfo(dtype).max)
    if dtype == torch.int8:
        return 127.0
    raise ValueError(f"{dtype} is not a quantized KV-cache dtype")


def quantize_kv(x: torch.Tensor, cache_dtype: torch.dtype,
                scale: torch.Tensor | float = 1.0) -> torch.Tensor:
    """K or V ``[tokens, kv_heads, head_dim]`` (compute dtype) -> storage dtype.

    ``scale`` broadcasts against x: a float, a 0-d tensor, ``[kv_heads, 1]`` (per head),
    ``[kv_heads, head_dim]`` (per channel) or ``[tokens, kv_heads, 1]`` (dynamic). Ignored
    for float caches.
    """
    if not is_quantized(cache_dtype):
        return x.to(cache_dtype)
    y = x.float()
    if not (isinstance(scale, float) and scale == 1.0):
        y = y / scale
    m = qmax(cache_dtype)
    y = y.clamp(-m, m)
    if cache_dtype == torch.int8:
        return torch.round(y).to(torch.int8)
    return y.to(cache_dtype)


def dequantize_kv(x: torch.Tensor, dtype: torch.dtype,
                  scale: torch.Tensor | float = 1.0) -> torch.Tensor:
    """Stored K or V back to the compute dtype (``stored * scale``, in float32)."""
    if not is_quantized(x.dtype):
        return x.to(dtype)
    y = x.to(torch.float32)
    if not (isinstance(scale, float) and scale == 1.0):
        y = y * scale
    return y.to(dtype)


def write_kv_slots(cache: torch.Tensor, slots: torch.Tensor, values: torch.Tensor) -> None:
    """cache: [num_slots, ...]; slots: [T] int64; values: [T, ...] already in cache's dtype."""
    if is_fp8(cache.dtype):
        cache.view(torch.uint8)[slots] = values.view(torch.uint8)
    else:
        cache[slots] = values


def read_kv_slots(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Gather slots (any shape [...]) -> [..., *cache.shape[1:]] in the storage dtype.

    Uses ``index_select`` on a [num_slots, -1] view: on CPU it is several times faster
    than advanced indexing (``cache[slots]``) for the same copy."""
    raw = cache.view(torch.uint8) if is_fp8(cache.dtype) else cache
    rows = raw.reshape(raw.shape[0], -1).index_select(0, slots.reshape(-1))
    return rows.view(*slots.shape, *cache.shape[1:]).view(cache.dtype)
