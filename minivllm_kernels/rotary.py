"""Rotary position embedding applied in place to q and k (Triton), HF "rotate_half" layout.

``out = x * cos + rotate_half(x) * sin`` with ``rotate_half([x1, x2]) = [-x2, x1]`` (RoPE,
Su et al. 2021, arXiv:2104.09864; vLLM ``rotary_embedding`` in ``csrc/pos_encoding_kernels.cu``).
cos/sin rows are gathered by position from float32 tables and cast to x's dtype, and
each product is rounded to x's dtype before the sum, exactly as the PyTorch reference
(and HF) computes it in 16-bit dtypes, so the kernel and the reference agree bit for bit.
One launch (q's and k's heads together) replaces the ~10 elementwise kernels of the
reference: at batch 1 a decode step is made of small kernels, and their count is what
costs time.
"""

from __future__ import annotations

import torch

from minivllm_kernels._quant import cast_rne
from minivllm_kernels._triton import device_ok, next_pow2, tl, triton


@triton.jit
def _rotate_head(base, cos_row, sin_row, HALF: tl.constexpr, HALF_PAD: tl.constexpr):
    """Rotate one head vector [2 * HALF] at ``base`` in place."""
    i = tl.arange(0, HALF_PAD)
    mask = i < HALF
    x1 = tl.load(base + i, mask=mask, other=0.0)
    x2 = tl.load(base + HALF + i, mask=mask, other=0.0)
    dt = x1.dtype
    # the reference casts the float32 table to x's dtype first
    c1 = cast_rne(tl.load(cos_row + i, mask=mask, other=0.0), dt)
    c2 = cast_rne(tl.load(cos_row + HALF + i, mask=mask, other=0.0), dt)
    s1 = cast_rne(tl.load(sin_row + i, mask=mask, other=0.0), dt)
    s2 = cast_rne(tl.load(sin_row + HALF + i, mask=mask, other=0.0), dt)
    # first half: x1*c1 + (-x2)*s1; second half: x2*c2 + x1*s2 (each product rounded)
    a1 = cast_rne(x1.to(tl.float32) * c1.to(tl.float32), dt).to(tl.float32)
    b1 = cast_rne(-x2.to(tl.float32) * s1.to(tl.float32), dt).to(tl.float32)
    a2 = cast_rne(x2.to(tl.float32) * c2.to(tl.float32), dt).to(tl.float32)
    b2 = cast_rne(x1.to(tl.float32) * s2.to(tl.float32), dt).to(tl.float32)
    tl.store(base + i, cast_rne(a1 + b1, dt), mask=mask)
    tl.store(base + HALF + i, cast_rne(a2 + b2, dt), mask=mask)


@triton.jit
def _rotary_kernel(q_ptr, k_ptr, pos_ptr, cos_ptr, sin_ptr, stride_qt, stride_qh, stride_kt,
                   stride_kh, stride_c, NUM_Q_HEADS: tl.constexpr, HALF: tl.constexpr,
                   HALF_PAD: tl.constexpr):
    # one program: one token x one head; heads [0, NUM_Q_HEADS) are q's, the rest k's
    t = tl.program_id(0)
    h = tl.program_id(1)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    cos_row = cos_ptr + pos * stride_c
    sin_row = sin_ptr + pos * stride_c
    if h < NUM_Q_HEADS:
        _rotate_head(q_ptr + t.to(tl.int64) * stride_qt + h * stride_qh, cos_row, sin_row,
                     HALF, HALF_PAD)
    else:
        _rotate_head(k_ptr + t.to(tl.int64) * stride_kt + (h - NUM_Q_HEADS) * stride_kh,
                     cos_row, sin_row, HALF, HALF_PAD)


def rotary_embedding(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                     cos_cache: torch.Tensor, sin_cache: torch.Tensor) -> tuple[torch.Tensor,
                                                                                torch.Tensor]:
    """Rotate q and k in place (Triton).

    Args:
        positions: [T] int64 token positions.
        q: [T, num_heads, head_dim]; k: [T, num_kv_heads, head_dim]; float32/float16/
            bfloat16, last dim contiguous (views into a fused qkv tensor are fine).
        cos_cache, sin_cache: [max_position, head_dim] float32 tables.
    Returns:
        (q, k), the same tensors, rotated.
    Raises:
        ValueError: shapes or dtypes that do not match.
    """
    device_ok(positions, q, k, cos_cache, sin_cache)
    T, _, D = q.shape
    if k.shape[0] != T or k.shape[2] != D or positions.shape != (T,) or D % 2 \
            or cos_cache.shape[1] != D or sin_cache.shape != cos_cache.shape \
            or cos_cache.dtype != torch.float32 or q.dtype != k.dtype:
        raise ValueError(f"rotary_embedding: q {tuple(q.shape)} {q.dtype}, k {tuple(k.shape)} "
                         f"{k.dtype}, positions {tuple(positions.shape)}, tables "
                         f"{tuple(cos_cache.shape)} {cos_cache.dtype} do not fit")
    if T == 0:
        return q, k
    if q.stride(-1) != 1 or k.stride(-1) != 1:
        raise ValueError("rotary_embedding: the last dim of q and k must be contiguous")
    num_q_heads = q.shape[1]
    _rotary_kernel[(T, num_q_heads + k.shape[1])](
        q, k, positions, cos_cache, sin_cache, q.stride(0), q.stride(1), k.stride(0),
        k.stride(1), cos_cache.stride(0), NUM_Q_HEADS=num_q_heads, HALF=D // 2,
        HALF_PAD=next_pow2(D // 2))
    return q, k


def rotary_embedding_ref(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                         cos_cache: torch.Tensor, sin_cache: torch.Tensor) -> tuple[torch.Tensor,
                                                                                    torch.Tensor]:
    """Reference of :func:`rotary_embedding` (same arguments; also in place)."""
    cos = cos_cache[positions].to(q.dtype)[:, None, :]
    sin = sin_cache[positions].to(q.dtype)[:, None, :]
    for x in (q, k):
        x1, x2 = x.chunk(2, dim=-1)
        x.copy_(x * cos + torch.cat((-x2, x1), dim=-1) * sin)
    return q, k
