"""Paged attention for decode (one new query token per sequence), split-KV.

vLLM: ``vllm/attention/ops/paged_attn.py`` / ``csrc/attention/paged_attention_v2.cu``
(PagedAttention, Kwon et al. 2023, arXiv:2309.06180) and the split-KV ("flash decoding")
scheme. Keys and values live in a paged cache ``[num_slots, num_kv_heads, head_dim]``
with ``slot = block_tables[b, pos // block_size] * block_size + pos % block_size``.

Two kernels:

1. ``_decode_split_kernel``: program ``(kv_head, b, split)`` reads positions
   ``[split * SPLIT_SIZE, (split + 1) * SPLIT_SIZE)`` of sequence b, for all the query
   heads that share that KV head (GQA: the K/V tile is loaded once for the group), and
   keeps an online softmax (Milakov & Gimelshein 2018): running max m, sum l, and
   un-normalised output acc, written as partial results.
2. ``_decode_reduce_kernel``: program ``(b, head)`` merges the partials of that
   sequence's splits, in split order.

The split *size* is fixed (``SPLIT_SIZE`` tokens), not the number of splits. So the
reduction order for a request depends only on its own length: its output does not
change with the batch it runs in (batch invariance), and a CUDA graph captured for the
longest context can run any shorter one (extra split programs exit at once). vLLM's v2
kernel makes the same choice (``PARTITION_SIZE = 512``).

Precision: scores, softmax and accumulation in float32; K and V are dequantized
(``stored * scale``) and cast to the query dtype before the dot products, as the
reference does; on GPUs, float32 dot products use IEEE float32, not TF32.
"""

from __future__ import annotations

from typing import Optional

import torch

from kernels._quant import cast_rne, dot, quant_format
from kernels._triton import INTERPRET, device_ok, next_pow2, tl, triton
from kernels.reshape_and_cache import _per_head

SPLIT_SIZE = 512  # tokens per split (a multiple of BLOCK_N)
# Launch configuration of the split kernel: keys per inner tile, warps, pipeline stages.
# Tuned on an H200 by benchmarks/decode_sweep.py: the lowest mean time over batch 1-256,
# context 256-8k (BLOCK_N 64 / 2 stages ties at batch >= 64 and is 15 % slower at batch 1).
DECODE_CONFIG = {"BLOCK_N": 128, "num_warps": 4, "num_stages": 3}


@triton.jit
def _load_kv_tile(cache_ptr, scale_ptr, scale_cache_ptr, slot, pmask, kvh, d,
                  NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, QUANT: tl.constexpr,
                  DYNAMIC: tl.constexpr, OUT_DTYPE: tl.constexpr):
    """[BLOCK_N, D_PAD] tile of K or V for cache rows ``slot`` (masked rows read as 0),
    dequantized and cast to OUT_DTYPE."""
    mask = pmask[:, None] & (d[None, :] < HEAD_DIM)
    x = tl.load(cache_ptr + slot[:, None] * (NUM_KV_HEADS * HEAD_DIM) + kvh * HEAD_DIM
                + d[None, :], mask=mask, other=0.0)
    if QUANT:
        x = x.to(tl.float32)
        if DYNAMIC:
            s = tl.load(scale_cache_ptr + slot * NUM_KV_HEADS + kvh, mask=pmask, other=0.0)
            x = x * s[:, None]
        else:
            x = x * tl.load(scale_ptr + kvh)
    if x.dtype != OUT_DTYPE:
        x = cast_rne(x.to(tl.float32), OUT_DTYPE)
    return x


@triton.jit
def _attend_tile(q, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, ks_cache_ptr,
                 vs_cache_ptr, slot, pmask, visible, kvh, d, m, l, acc, sm_scale,
                 NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, QUANT: tl.constexpr,
                 DYNAMIC: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """One step of the online softmax: queries q [M, D] against the keys at cache rows
    ``slot`` [N] (``pmask``: rows that exist; ``visible`` [M, N]: which query sees which
    key). Updates the running max m [M], sum l [M] and un-normalised output acc [M, D]."""
    k = _load_kv_tile(k_cache_ptr, k_scale_ptr, ks_cache_ptr, slot, pmask, kvh, d,
                      NUM_KV_HEADS, HEAD_DIM, QUANT, DYNAMIC, q.dtype)
    s = dot(q, tl.trans(k), PRECISION, UPCAST) * sm_scale  # [M, N]
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, axis=1))  # finite once a row has seen one key
    alpha = tl.exp(m - m_new)
    p = tl.exp(s - m_new[:, None])
    l = l * alpha + tl.sum(p, axis=1)
    v = _load_kv_tile(v_cache_ptr, v_scale_ptr, vs_cache_ptr, slot, pmask, kvh, d,
                      NUM_KV_HEADS, HEAD_DIM, QUANT, DYNAMIC, q.dtype)
    acc = acc * alpha[:, None] + dot(cast_rne(p, v.dtype), v, PRECISION, UPCAST)
    return m_new, l, acc


@triton.jit
def _decode_split_kernel(
        q_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, ks_cache_ptr, vs_cache_ptr,
        block_tables_ptr, seq_lens_ptr, part_m_ptr, part_l_ptr, part_acc_ptr,
        stride_qb, stride_qh, stride_bt, max_splits, sm_scale,
        QUERY_GROUP: tl.constexpr, G_PAD: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
        HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
        SPLIT: tl.constexpr, BLOCK_N: tl.constexpr, QUANT: tl.constexpr,
        DYNAMIC: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    # KV head fastest: programs that run side by side read the heads of the same tokens,
    # which sit next to each other in memory ([slot, kv_head, head_dim]).
    kvh = tl.program_id(0)
    b = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)
    start = split * SPLIT
    if start < seq_len:
        end = tl.minimum(start + SPLIT, seq_len)
        g = tl.arange(0, G_PAD)
        d = tl.arange(0, D_PAD)
        heads = kvh * QUERY_GROUP + g
        gmask = g < QUERY_GROUP
        q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :],
                    mask=gmask[:, None] & (d[None, :] < HEAD_DIM), other=0.0)
        m = tl.full([G_PAD], float("-inf"), tl.float32)
        l = tl.zeros([G_PAD], tl.float32)
        acc = tl.zeros([G_PAD, D_PAD], tl.float32)
        for n0 in range(start, end, BLOCK_N):
            pos = n0 + tl.arange(0, BLOCK_N)
            pmask = pos < end
            blk = tl.load(block_tables_ptr + b * stride_bt + pos // BLOCK_SIZE, mask=pmask,
                          other=0)
            slot = blk.to(tl.int64) * BLOCK_SIZE + pos % BLOCK_SIZE
            m, l, acc = _attend_tile(
                q, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, ks_cache_ptr,
                vs_cache_ptr, slot, pmask, pmask[None, :], kvh, d, m, l, acc, sm_scale,
                NUM_KV_HEADS, HEAD_DIM, QUANT, DYNAMIC, PRECISION, UPCAST)
        row = (b * (NUM_KV_HEADS * QUERY_GROUP) + heads) * max_splits + split  # [G]
        tl.store(part_m_ptr + row, m, mask=gmask)
        tl.store(part_l_ptr + row, l, mask=gmask)
        tl.store(part_acc_ptr + row[:, None] * D_PAD + d[None, :], acc, mask=gmask[:, None])


@triton.jit
def _decode_reduce_kernel(part_m_ptr, part_l_ptr, part_acc_ptr, seq_lens_ptr, out_ptr,
                          stride_ob, stride_oh, max_splits,
                          NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                          D_PAD: tl.constexpr, SPLIT: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    d = tl.arange(0, D_PAD)
    seq_len = tl.load(seq_lens_ptr + b)
    num_splits = tl.cdiv(seq_len, SPLIT)
    base = (b * NUM_HEADS + h) * max_splits
    m = tl.full([], float("-inf"), tl.float32)
    l = tl.full([], 0.0, tl.float32)
    acc = tl.zeros([D_PAD], tl.float32)
    for s in range(0, num_splits):  # in split order: the result never depends on the batch
        m_s = tl.load(part_m_ptr + base + s)
        l_s = tl.load(part_l_ptr + base + s)
        acc_s = tl.load(part_acc_ptr + (base + s) * D_PAD + d)
        m_new = tl.maximum(m, m_s)
        a = tl.exp(m - m_new)
        a_s = tl.exp(m_s - m_new)
        l = l * a + l_s * a_s
        acc = acc * a + acc_s * a_s
        m = m_new
    # an empty sequence (seq_len 0: CUDA-graph padding) gives zeros, not 0/0
    o = tl.where(l > 0, acc / tl.maximum(l, 1e-38), 0.0)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + d, cast_rne(o, out_ptr.dtype.element_ty),
             mask=d < HEAD_DIM)


_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


def _check_index(name: str, t: torch.Tensor, rows: int, what: str, ndim: int = 1) -> None:
    if t.ndim != ndim or t.shape[0] != rows or t.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{what}: {name} must be an int32/int64 tensor with {ndim} dim(s) "
                         f"and {rows} rows, got {tuple(t.shape)} {t.dtype}")


def _check_paged_args(q, key_cache, value_cache, block_tables, what):
    """Host-side checks (shapes, dtypes, devices). Not checked, because it would need a
    device sync: that block ids are < num_slots / block_size and that seq_lens fit the
    block tables; callers (the engine's block manager) guarantee it."""
    device_ok(q, key_cache, value_cache, block_tables)
    if q.ndim != 3 or q.dtype not in _FLOATS:
        raise ValueError(f"{what}: q must be [tokens, num_heads, head_dim] in float32/float16/"
                         f"bfloat16, got {tuple(q.shape)} {q.dtype}")
    if value_cache.dtype != key_cache.dtype:
        raise ValueError(f"{what}: key_cache is {key_cache.dtype} but value_cache is "
                         f"{value_cache.dtype}; both must use one storage dtype")
    if key_cache.shape != value_cache.shape or key_cache.ndim != 3:
        raise ValueError(f"{what}: key_cache and value_cache must both be [num_slots, "
                         f"num_kv_heads, head_dim], got {tuple(key_cache.shape)} and "
                         f"{tuple(value_cache.shape)}")
    num_heads, head_dim = q.shape[-2:]
    num_kv_heads = key_cache.shape[1]
    if key_cache.shape[2] != head_dim or num_heads % num_kv_heads:
        raise ValueError(f"{what}: q has {num_heads} heads of size {head_dim}; the cache "
                         f"has {num_kv_heads} KV heads of size {key_cache.shape[2]} (the "
                         "head count must be a multiple of the KV-head count)")
    if not (key_cache.is_contiguous() and value_cache.is_contiguous()):
        raise ValueError(f"{what}: the caches must be contiguous")
    if q.stride(-1) != 1:
        raise ValueError(f"{what}: q's last dim must be contiguous")
    return num_heads, num_kv_heads, head_dim


def _check_out_and_scales(q, out, k_scale_cache, v_scale_cache, key_cache, what) -> None:
    """``out`` must be shaped and typed like q; dynamic scale caches come in pairs."""
    if out is not None and (out.shape != q.shape or out.dtype != q.dtype
                            or out.device != q.device or out.stride(-1) != 1):
        raise ValueError(f"{what}: out must match q ({tuple(q.shape)}, {q.dtype}, last dim "
                         f"contiguous), got {tuple(out.shape)}, {out.dtype}")
    if (k_scale_cache is None) != (v_scale_cache is None):
        raise ValueError(f"{what}: k_scale_cache and v_scale_cache come together")
    if k_scale_cache is not None:
        want = (key_cache.shape[0], key_cache.shape[1])
        for t in (k_scale_cache, v_scale_cache):
            if t.shape != want or t.dtype != torch.float32 or not t.is_contiguous():
                raise ValueError(f"{what}: dynamic scale caches must be contiguous float32 "
                                 f"{list(want)}, got {tuple(t.shape)} {t.dtype}")


def _upcast(dtype: torch.dtype) -> bool:
    return INTERPRET and dtype == torch.bfloat16


def _dot_precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"  # tf32 is ignored for 16-bit inputs


def paged_attention_decode(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int,
                           scale: float, k_scale: torch.Tensor | float = 1.0,
                           v_scale: torch.Tensor | float = 1.0,
                           k_scale_cache: Optional[torch.Tensor] = None,
                           v_scale_cache: Optional[torch.Tensor] = None,
                           max_seq_len: Optional[int] = None,
                           out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Decode attention over a paged KV cache (Triton, split-KV).

    Args:
        q: [B, num_heads, head_dim], float32/float16/bfloat16; the query of each
            sequence's newest token (rotary applied).
        key_cache, value_cache: [num_slots, num_kv_heads, head_dim] (slot = block *
            block_size + offset), any cache dtype (float, fp8, int8).
        block_tables: [B, max_blocks] int32/int64; entry j is the block holding
            positions [j * block_size, (j + 1) * block_size).
        seq_lens: [B] int32, keys per sequence (including the newest token). 0 is
            allowed (a padding row; its output is 0).
        block_size: tokens per cache block.
        scale: softmax scale, usually head_dim ** -0.5.
        k_scale, v_scale: static dequantization scales ([] or [num_kv_heads]) for
            fp8/int8 caches.
        k_scale_cache, v_scale_cache: dynamic per-token scales [num_slots, num_kv_heads].
        max_seq_len: an upper bound of seq_lens (sets the number of split programs; a
            CUDA graph passes max_model_len). Default: seq_lens.max() (a device sync).
            A value below the true maximum is the caller's bug (not checked: it would
            need a sync) and reads outside the partial-result buffers.
        out: optional [B, num_heads, head_dim] output buffer.
    Returns:
        [B, num_heads, head_dim] in q's dtype.
    Raises:
        ValueError: shape, device or layout mismatch.
    """
    num_heads, num_kv_heads, head_dim = _check_paged_args(q, key_cache, value_cache,
                                                         block_tables, "paged_attention_decode")
    _check_out_and_scales(q, out, k_scale_cache, v_scale_cache, key_cache,
                          "paged_attention_decode")
    B = q.shape[0]
    _check_index("seq_lens", seq_lens, B, "paged_attention_decode")
    _check_index("block_tables", block_tables, B, "paged_attention_decode", ndim=2)
    block_tables, seq_lens = block_tables.contiguous(), seq_lens.contiguous()
    if out is None:
        out = torch.empty_like(q)
    if B == 0:
        return out
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max())
    max_splits = max(1, triton.cdiv(max_seq_len, SPLIT_SIZE))
    group = num_heads // num_kv_heads
    d_pad = next_pow2(head_dim)
    part_m = torch.empty(B, num_heads, max_splits, dtype=torch.float32, device=q.device)
    part_l = torch.empty_like(part_m)
    part_acc = torch.empty(B, num_heads, max_splits, d_pad, dtype=torch.float32, device=q.device)
    kind = quant_format(key_cache.dtype)[0]
    # float caches use no scale: skip making the [H] tensors (two small kernels)
    ks = _per_head(k_scale, num_kv_heads, q.device) if kind else q
    vs = _per_head(v_scale, num_kv_heads, q.device) if kind else q
    dynamic = k_scale_cache is not None
    _decode_split_kernel[(num_kv_heads, B, max_splits)](
        q, key_cache, value_cache, ks, vs, k_scale_cache if dynamic else ks,
        v_scale_cache if dynamic else vs, block_tables, seq_lens, part_m, part_l, part_acc,
        q.stride(0), q.stride(1), block_tables.stride(0), max_splits, float(scale),
        QUERY_GROUP=group, G_PAD=max(16, next_pow2(group)), NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim, D_PAD=d_pad, BLOCK_SIZE=block_size, SPLIT=SPLIT_SIZE,
        QUANT=kind != 0, DYNAMIC=dynamic, PRECISION=_dot_precision(q.dtype),
        UPCAST=_upcast(q.dtype), **DECODE_CONFIG)
    _decode_reduce_kernel[(B, num_heads)](
        part_m, part_l, part_acc, seq_lens, out, out.stride(0), out.stride(1), max_splits,
        NUM_HEADS=num_heads, HEAD_DIM=head_dim, D_PAD=d_pad, SPLIT=SPLIT_SIZE)
    return out


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, block_size: int, length: int,
              dtype: torch.dtype, scale: torch.Tensor | float = 1.0,
              scale_cache: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Reference helper: positions [0, length) of one sequence from a paged cache,
    dequantized (``stored * scale`` in float32) and cast to ``dtype``: [length, H, D]."""
    pos = torch.arange(length, device=cache.device)
    slots = block_table.long()[pos // block_size] * block_size + pos % block_size
    raw = cache.view(torch.uint8)[slots].view(cache.dtype) if cache.element_size() == 1 \
        and cache.dtype != torch.int8 else cache[slots]
    if quant_format(cache.dtype)[0] == 0:
        return raw.to(dtype)
    if scale_cache is not None:
        s = scale_cache[slots][..., None]
    else:
        s = _per_head(scale, cache.shape[1], cache.device)[:, None]
    return (raw.to(torch.float32) * s).to(dtype)


def attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                  mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Reference attention for one sequence in float32: q [n, H, D], k/v [L, H_kv, D],
    mask [n, L] bool (True = attend) or None. Returns [n, H, D] float32."""
    group = q.shape[1] // k.shape[1]
    k = k.float().repeat_interleave(group, dim=1)
    v = v.float().repeat_interleave(group, dim=1)
    s = torch.einsum("nhd,lhd->hnl", q.float(), k) * scale
    if mask is not None:
        s = s.masked_fill(~mask[None], float("-inf"))
    return torch.einsum("hnl,lhd->nhd", torch.softmax(s, dim=-1), v)


def paged_attention_decode_ref(q: torch.Tensor, key_cache: torch.Tensor,
                               value_cache: torch.Tensor, block_tables: torch.Tensor,
                               seq_lens: torch.Tensor, block_size: int, scale: float,
                               k_scale: torch.Tensor | float = 1.0,
                               v_scale: torch.Tensor | float = 1.0,
                               k_scale_cache: Optional[torch.Tensor] = None,
                               v_scale_cache: Optional[torch.Tensor] = None,
                               max_seq_len: Optional[int] = None,
                               out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """PyTorch reference of :func:`paged_attention_decode` (same arguments): gather each
    sequence's keys through its block table, dequantize, softmax in float32."""
    if out is None:
        out = torch.empty_like(q)
    for b in range(q.shape[0]):
        n = int(seq_lens[b])
        if n == 0:
            out[b] = 0
            continue
        k = gather_kv(key_cache, block_tables[b], block_size, n, q.dtype, k_scale, k_scale_cache)
        v = gather_kv(value_cache, block_tables[b], block_size, n, q.dtype, v_scale,
                      v_scale_cache)
        out[b] = attention_ref(q[b:b + 1], k, v, scale)[0].to(q.dtype)
    return out
