"""Prefill and chunked-prefill attention over the paged KV cache (causal, variable length).

vLLM: ``vllm/attention/ops/prefix_prefill.py`` / the unified Triton attention
(``vllm/attention/ops/triton_unified_attention.py``), FlashAttention-2's loop (Dao 2023,
arXiv:2307.08691). Sequence b has ``query_lens[b]`` new tokens, stored at rows
``query_starts[b] ...`` of q, and ``seq_lens[b]`` keys in the cache (its earlier context
*and* the new tokens, already written by the store kernel). New token i sits at position
``ctx + i`` with ``ctx = seq_lens[b] - query_lens[b]`` and attends to keys ``0 .. ctx + i``:
a prompt (ctx = 0), a later chunk of a chunked prefill, or a prompt whose first blocks
came from the prefix cache all take the same path.

Program ``(query tile, b, head)``: BLOCK_M query rows of one head, an online softmax over
key tiles of BLOCK_N read through the block table. Tiles start at key 0 for every
sequence, so a row's result does not depend on what else is in the batch.
"""

from __future__ import annotations

from typing import Optional

import torch

from minivllm_kernels._quant import cast_rne, quant_format
from minivllm_kernels._triton import next_pow2, tl, triton
from minivllm_kernels.paged_attention import (_attend_tile, _check_index, _check_out_and_scales,
                                     _check_paged_args, _dot_precision, _upcast, attention_ref,
                                     gather_kv)
from minivllm_kernels.reshape_and_cache import _per_head

_BLOCK_M = 16
_BLOCK_N = 32


@triton.jit
def _prefill_kernel(
        q_ptr, out_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, ks_cache_ptr,
        vs_cache_ptr, block_tables_ptr, query_starts_ptr, query_lens_ptr, seq_lens_ptr,
        stride_qt, stride_qh, stride_ot, stride_oh, stride_bt, sm_scale,
        QUERY_GROUP: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
        D_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr, QUANT: tl.constexpr, DYNAMIC: tl.constexpr,
        PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    tile = tl.program_id(0)
    b = tl.program_id(1)
    h = tl.program_id(2)
    q_len = tl.load(query_lens_ptr + b)
    m0 = tile * BLOCK_M
    if m0 < q_len:
        q_start = tl.load(query_starts_ptr + b).to(tl.int64)
        ctx = tl.load(seq_lens_ptr + b) - q_len
        kvh = h // QUERY_GROUP
        rows = m0 + tl.arange(0, BLOCK_M)
        rmask = rows < q_len
        d = tl.arange(0, D_PAD)
        q = tl.load(q_ptr + (q_start + rows[:, None]) * stride_qt + h * stride_qh + d[None, :],
                    mask=rmask[:, None] & (d[None, :] < HEAD_DIM), other=0.0)
        m = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
        kv_end = ctx + tl.minimum(m0 + BLOCK_M, q_len)  # keys this tile can see
        for n0 in range(0, kv_end, BLOCK_N):
            pos = n0 + tl.arange(0, BLOCK_N)
            pmask = pos < kv_end
            blk = tl.load(block_tables_ptr + b * stride_bt + pos // BLOCK_SIZE, mask=pmask,
                          other=0)
            slot = blk.to(tl.int64) * BLOCK_SIZE + pos % BLOCK_SIZE
            # causal; with seq_lens >= query_lens every row sees key 0 in the first tile
            visible = (pos[None, :] <= (ctx + rows)[:, None]) & pmask[None, :]
            m, l, acc = _attend_tile(
                q, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, ks_cache_ptr,
                vs_cache_ptr, slot, pmask, visible, kvh, d, m, l, acc, sm_scale,
                NUM_KV_HEADS, HEAD_DIM, QUANT, DYNAMIC, PRECISION, UPCAST)
        # a row that saw no key (l == 0: only when seq_lens[b] < query_lens[b], i.e. rows
        # before the first key, as left padding has) gets zeros, not 0/0
        o = tl.where((l > 0)[:, None], acc / tl.where(l > 0, l, 1.0)[:, None], 0.0)
        tl.store(out_ptr + (q_start + rows[:, None]) * stride_ot + h * stride_oh + d[None, :],
                 cast_rne(o, out_ptr.dtype.element_ty),
                 mask=rmask[:, None] & (d[None, :] < HEAD_DIM))


def paged_prefill_attention(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                            block_tables: torch.Tensor, query_starts: torch.Tensor,
                            query_lens: torch.Tensor, seq_lens: torch.Tensor, block_size: int,
                            scale: float, k_scale: torch.Tensor | float = 1.0,
                            v_scale: torch.Tensor | float = 1.0,
                            k_scale_cache: Optional[torch.Tensor] = None,
                            v_scale_cache: Optional[torch.Tensor] = None,
                            max_query_len: Optional[int] = None,
                            out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Causal attention of new tokens over their sequences' paged K/V (Triton).

    Args:
        q: [num_tokens, num_heads, head_dim] float32/float16/bfloat16 (rotary applied).
        key_cache, value_cache: [num_slots, num_kv_heads, head_dim], already holding the
            new tokens' K/V; any cache dtype.
        block_tables: [S, max_blocks] int32/int64 for the S sequences.
        query_starts: [S] int32, first row of each sequence's new tokens in q.
        query_lens: [S] int32 (>= 1), new tokens per sequence.
        seq_lens: [S] int32, keys per sequence including the new ones (>= query_lens in
            the engine). A smaller value leaves the first ``query_lens - seq_lens`` rows of
            the sequence with no key to attend to (as left padding does); those rows get
            zeros, not NaN (the fully-masked-row guard, FlashAttention-2's convention).
        block_size: tokens per cache block.
        scale: softmax scale.
        k_scale, v_scale, k_scale_cache, v_scale_cache: as in
            :func:`minivllm_kernels.paged_attention.paged_attention_decode`.
        max_query_len: an upper bound of query_lens (default: query_lens.max(), a sync).
        out: optional output buffer shaped like q. Rows of q that belong to no sequence
            are left untouched. ``query_starts + query_lens`` must stay within q's rows
            (not checked on the device: the caller's contract, like vLLM's).
    Returns:
        ``out`` (or a new tensor like q) with the S sequences' rows filled.
    Raises:
        ValueError: shape, device or layout mismatch.
    """
    num_heads, num_kv_heads, head_dim = _check_paged_args(q, key_cache, value_cache,
                                                         block_tables, "paged_prefill_attention")
    _check_out_and_scales(q, out, k_scale_cache, v_scale_cache, key_cache,
                          "paged_prefill_attention")
    S = query_lens.shape[0]
    for name, t in (("query_starts", query_starts), ("query_lens", query_lens),
                    ("seq_lens", seq_lens)):
        _check_index(name, t, S, "paged_prefill_attention")
    _check_index("block_tables", block_tables, S, "paged_prefill_attention", ndim=2)
    block_tables, query_starts, query_lens, seq_lens = (
        t.contiguous() for t in (block_tables, query_starts, query_lens, seq_lens))
    if out is None:
        out = torch.empty_like(q)
    if S == 0:
        return out
    if max_query_len is None:
        max_query_len = int(query_lens.max())
    kind = quant_format(key_cache.dtype)[0]
    # float caches use no scale: skip making the [H] tensors (two small kernels)
    ks = _per_head(k_scale, num_kv_heads, q.device) if kind else q
    vs = _per_head(v_scale, num_kv_heads, q.device) if kind else q
    dynamic = k_scale_cache is not None
    grid = (triton.cdiv(max_query_len, _BLOCK_M), S, num_heads)
    _prefill_kernel[grid](
        q, out, key_cache, value_cache, ks, vs, k_scale_cache if dynamic else ks,
        v_scale_cache if dynamic else vs, block_tables, query_starts, query_lens, seq_lens,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        float(scale), QUERY_GROUP=num_heads // num_kv_heads, NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim, D_PAD=next_pow2(head_dim), BLOCK_SIZE=block_size,
        BLOCK_M=_BLOCK_M, BLOCK_N=_BLOCK_N, QUANT=kind != 0, DYNAMIC=dynamic,
        PRECISION=_dot_precision(q.dtype), UPCAST=_upcast(q.dtype))
    return out


def paged_prefill_attention_ref(q: torch.Tensor, key_cache: torch.Tensor,
                                value_cache: torch.Tensor, block_tables: torch.Tensor,
                                query_starts: torch.Tensor, query_lens: torch.Tensor,
                                seq_lens: torch.Tensor, block_size: int, scale: float,
                                k_scale: torch.Tensor | float = 1.0,
                                v_scale: torch.Tensor | float = 1.0,
                                k_scale_cache: Optional[torch.Tensor] = None,
                                v_scale_cache: Optional[torch.Tensor] = None,
                                max_query_len: Optional[int] = None,
                                out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """PyTorch reference of :func:`paged_prefill_attention` (same arguments)."""
    if out is None:
        out = torch.empty_like(q)
    for b in range(query_lens.shape[0]):
        n, total, r0 = int(query_lens[b]), int(seq_lens[b]), int(query_starts[b])
        k = gather_kv(key_cache, block_tables[b], block_size, total, q.dtype, k_scale,
                      k_scale_cache)
        v = gather_kv(value_cache, block_tables[b], block_size, total, q.dtype, v_scale,
                      v_scale_cache)
        ctx = total - n
        mask = torch.arange(total, device=q.device)[None, :] \
            <= (ctx + torch.arange(n, device=q.device))[:, None]
        out[r0:r0 + n] = attention_ref(q[r0:r0 + n], k, v, scale, mask).to(q.dtype)
    return out
