"""Store kernel: write this step's K and V into the paged cache, quantizing on the way.

vLLM: ``reshape_and_cache_flash`` (``csrc/cache_kernels.cu``) and its Triton port
``vllm/attention/ops/triton_reshape_and_cache_flash.py``. Token ``t`` goes to cache row
``slot_mapping[t]``; a negative slot means "padding, do not write" (CUDA-graph batches
are padded that way).

Storage (the rules of :mod:`minivllm_kernels.reference`, which the engine's
:mod:`minivllm.quantization.kv_cache` re-exports):

* float caches: ``x.to(cache dtype)`` (round to nearest even);
* fp8 e4m3 / e5m2: ``Q(x / scale)`` saturated to +-448 / +-57344, nearest even;
* int8: ``clamp(round_half_even(x / scale), -127, 127)``.

Scales: static per tensor (shape ``[]``), static per KV head (``[num_kv_heads]``), or
dynamic: ``k_scale_cache``/``v_scale_cache`` ``[num_slots, num_kv_heads]`` float32 are
given, and each (token, head) gets ``amax(|x|) * (1 / qmax)`` (1.0 for an all-zero
row), written beside the cache. It is a multiply by the float32 reciprocal, not a
division, on purpose: PyTorch on CUDA divides by a Python scalar that way, on CPU it
divides, and the cache must store the same bytes on both.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch

from minivllm_kernels._quant import cast_rne, quant_format, quantize
from minivllm_kernels._triton import device_ok, next_pow2, tl, triton
from minivllm_kernels.reference import qmax, quantize_kv, write_kv_slots


@triton.jit
def _store_tile(x_ptr, cache_ptr, slot, ok, t, h, stride_xt, stride_xh, scale_ptr,
                scale_cache_ptr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                D_PAD: tl.constexpr, KIND: tl.constexpr, DYNAMIC: tl.constexpr,
                QMAX: tl.constexpr, MANTISSA_BITS: tl.constexpr, MIN_EXP: tl.constexpr):
    """Store rows x[t, h, :] at cache[slot, h, :] (where ok), quantizing for fp8/int8."""
    d = tl.arange(0, D_PAD)
    mask = ok[:, None] & (d[None, :] < HEAD_DIM)
    x = tl.load(x_ptr + t[:, None].to(tl.int64) * stride_xt + h * stride_xh + d[None, :],
                mask=mask, other=0.0)
    dst = cache_ptr + slot[:, None] * (NUM_KV_HEADS * HEAD_DIM) + h * HEAD_DIM + d[None, :]
    if KIND == 0:
        tl.store(dst, cast_rne(x.to(tl.float32), cache_ptr.dtype.element_ty), mask=mask)
    else:
        y = x.to(tl.float32)
        if DYNAMIC:
            amax = tl.max(tl.abs(y), axis=1)
            s = amax * (1.0 / QMAX)  # as the reference: a multiply, not a division
            s = tl.where(s > 0, s, 1.0)
            tl.store(scale_cache_ptr + slot * NUM_KV_HEADS + h, s, mask=ok)
            y = tl.div_rn(y, s[:, None] + tl.zeros_like(y))
        else:
            s = tl.load(scale_ptr + h)
            y = tl.div_rn(y, s + tl.zeros_like(y))
        y = quantize(y, KIND, QMAX, MANTISSA_BITS, MIN_EXP)
        tl.store(dst, y.to(cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _store_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, k_scale_ptr, v_scale_ptr,
                  k_scale_cache_ptr, v_scale_cache_ptr, num_tokens, stride_kt, stride_kh,
                  stride_vt, stride_vh,
                  NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
                  BLOCK_T: tl.constexpr, KIND: tl.constexpr, DYNAMIC: tl.constexpr,
                  QMAX: tl.constexpr, MANTISSA_BITS: tl.constexpr, MIN_EXP: tl.constexpr):
    # one program: BLOCK_T tokens x one KV head x the whole head_dim, of K (axis 2 = 0)
    # or of V (axis 2 = 1): one launch stores both
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    h = tl.program_id(1)
    slot = tl.load(slot_ptr + t, mask=t < num_tokens, other=-1).to(tl.int64)
    ok = slot >= 0
    if tl.program_id(2) == 0:
        _store_tile(k_ptr, k_cache_ptr, slot, ok, t, h, stride_kt, stride_kh, k_scale_ptr,
                    k_scale_cache_ptr, NUM_KV_HEADS, HEAD_DIM, D_PAD, KIND, DYNAMIC, QMAX,
                    MANTISSA_BITS, MIN_EXP)
    else:
        _store_tile(v_ptr, v_cache_ptr, slot, ok, t, h, stride_vt, stride_vh, v_scale_ptr,
                    v_scale_cache_ptr, NUM_KV_HEADS, HEAD_DIM, D_PAD, KIND, DYNAMIC, QMAX,
                    MANTISSA_BITS, MIN_EXP)


@functools.lru_cache(maxsize=64)
def _constant_scale(value: float, num_kv_heads: int, device: str) -> torch.Tensor:
    return torch.full((num_kv_heads,), value, dtype=torch.float32, device=device)


def _per_head(scale: torch.Tensor | float, num_kv_heads: int, device) -> torch.Tensor:
    """A static scale as a contiguous float32 [num_kv_heads] tensor. Python floats map to
    a cached device tensor: a fresh one would be a host-to-device copy on every call (a
    sync, and not allowed while a CUDA graph is being captured)."""
    if not isinstance(scale, torch.Tensor):
        return _constant_scale(float(scale), num_kv_heads, str(device))
    s = scale.to(device=device, dtype=torch.float32)
    if s.ndim == 0:
        s = s.expand(num_kv_heads)
    if s.shape != (num_kv_heads,):
        raise ValueError(f"a static KV scale must have shape [] or [{num_kv_heads}], "
                         f"got {tuple(s.shape)}")
    return s.contiguous()


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                      value_cache: torch.Tensor, slot_mapping: torch.Tensor,
                      k_scale: torch.Tensor | float = 1.0, v_scale: torch.Tensor | float = 1.0,
                      k_scale_cache: Optional[torch.Tensor] = None,
                      v_scale_cache: Optional[torch.Tensor] = None) -> None:
    """Write K/V rows into the cache (in place), Triton.

    Args:
        key, value: [num_tokens, num_kv_heads, head_dim], float32/float16/bfloat16
            (the last dim contiguous).
        key_cache, value_cache: [num_slots, num_kv_heads, head_dim] contiguous, in
            float32/float16/bfloat16/float8_e4m3fn/float8_e5m2/int8.
        slot_mapping: [num_tokens] int32/int64; row of each token, negative = skip.
            Slots must be < num_slots (not checked: a device sync; the block manager
            guarantees it).
        k_scale, v_scale: static scales (float, [] or [num_kv_heads] float32); used by
            fp8/int8 caches without scale caches.
        k_scale_cache, v_scale_cache: [num_slots, num_kv_heads] float32 for dynamic
            per-token scales (both or neither; quantized caches only).
    Raises:
        ValueError: shape, dtype or device mismatch.
    """
    device_ok(key, value, key_cache, value_cache, slot_mapping)
    if key.ndim != 3 or key.dtype not in (torch.float32, torch.float16, torch.bfloat16) \
            or value.dtype != key.dtype:
        raise ValueError(f"key/value must be [tokens, kv_heads, head_dim] in float32/float16/"
                         f"bfloat16 (one dtype), got {tuple(key.shape)} {key.dtype}/{value.dtype}")
    if slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slot_mapping must be int32/int64, got {slot_mapping.dtype}")
    T, H, D = key.shape
    if value.shape != key.shape or key_cache.shape[1:] != (H, D) \
            or value_cache.shape != key_cache.shape or slot_mapping.shape != (T,):
        raise ValueError(f"shapes do not match: key {tuple(key.shape)}, value "
                         f"{tuple(value.shape)}, caches {tuple(key_cache.shape)}/"
                         f"{tuple(value_cache.shape)}, slot_mapping {tuple(slot_mapping.shape)}")
    if not (key_cache.is_contiguous() and value_cache.is_contiguous()):
        raise ValueError("the caches must be contiguous")
    if value_cache.dtype != key_cache.dtype:
        raise ValueError(f"key_cache is {key_cache.dtype} but value_cache is "
                         f"{value_cache.dtype}; both must use one storage dtype")
    slot_mapping = slot_mapping.contiguous()
    kind, qmax, mbits, min_exp = quant_format(key_cache.dtype)
    dynamic = k_scale_cache is not None
    if dynamic != (v_scale_cache is not None) or (dynamic and kind == 0):
        raise ValueError("k_scale_cache and v_scale_cache come together, and only with a "
                         "quantized (fp8/int8) cache")
    if dynamic:
        assert k_scale_cache is not None and v_scale_cache is not None  # checked just above
        for t in (k_scale_cache, v_scale_cache):
            if t.shape != key_cache.shape[:2] or t.dtype != torch.float32 \
                    or not t.is_contiguous():
                raise ValueError(f"dynamic scale caches must be contiguous float32 "
                                 f"{list(key_cache.shape[:2])}, got {tuple(t.shape)} {t.dtype}")
    if T == 0:
        return
    block_t = 16
    key = key if key.stride(-1) == 1 else key.contiguous()
    value = value if value.stride(-1) == 1 else value.contiguous()
    static = kind and not dynamic
    ks = _per_head(k_scale, H, key.device) if static else key  # unused otherwise
    vs = _per_head(v_scale, H, key.device) if static else key
    _store_kernel[(triton.cdiv(T, block_t), H, 2)](
        key, value, key_cache, value_cache, slot_mapping, ks, vs,
        k_scale_cache if dynamic else ks, v_scale_cache if dynamic else vs, T,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1), NUM_KV_HEADS=H,
        HEAD_DIM=D, D_PAD=next_pow2(D), BLOCK_T=block_t, KIND=kind, DYNAMIC=dynamic,
        QMAX=qmax, MANTISSA_BITS=mbits, MIN_EXP=min_exp)


def reshape_and_cache_ref(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                          value_cache: torch.Tensor, slot_mapping: torch.Tensor,
                          k_scale: torch.Tensor | float = 1.0, v_scale: torch.Tensor | float = 1.0,
                          k_scale_cache: Optional[torch.Tensor] = None,
                          v_scale_cache: Optional[torch.Tensor] = None) -> None:
    """PyTorch reference of :func:`reshape_and_cache` (same arguments, same effect),
    built on the engine's own storage rules (:mod:`minivllm_kernels.reference`)."""

    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    H = key.shape[1]
    for x, cache, scale, scale_cache in ((key, key_cache, k_scale, k_scale_cache),
                                         (value, value_cache, v_scale, v_scale_cache)):
        x = x[keep]
        if scale_cache is not None:
            s = x.float().abs().amax(dim=-1) * (1.0 / qmax(cache.dtype))
            s = torch.where(s > 0, s, torch.ones_like(s))
            scale_cache[slots] = s
            q = quantize_kv(x, cache.dtype, s[..., None])
        else:
            q = quantize_kv(x, cache.dtype, _per_head(scale, H, x.device)[:, None])
        write_kv_slots(cache, slots, q)
