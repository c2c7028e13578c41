"""Paged attention for decode (one new query token per sequence), split-KV.

vLLM: ``vllm/attention/ops/paged_attn.py`` / ``csrc/attention/paged_attention_v2.cu``
(PagedAttention, Kwon et al. 2023, arXiv:2309.06180) and the split-KV ("flash decoding")
scheme. Keys and values live in a paged cache ``[num_slots, num_kv_heads, head_dim]``
with ``slot = block_tables[b, pos // block_size] * block_size + pos % block_size``.

A sequence's keys are cut into splits of ``SPLIT_SIZE`` positions. Each split gets its
own online softmax (Milakov & Gimelshein 2018): running max m, sum l and un-normalised
output acc, for all the query heads that share a KV head (GQA: each K/V tile is loaded
once for the group). The splits' results are then merged in split order. Two kernels:

1. ``_decode_split_kernel``: program ``(kv_head, b, chunk)`` reads ``splits_per_program``
   consecutive splits of sequence b in one loop over key tiles. If it covers the whole
   sequence (``splits_per_program == max_splits``, chosen for large batches; the
   ``WHOLE`` variant), it merges the splits as it goes and writes the output; otherwise
   it writes each split's (m, l, acc) as a partial result.
2. ``_decode_reduce_kernel`` (only in the second case): program ``(head, b)`` merges
   the partials of that sequence's splits, in split order, with the same code.

The split *size* is fixed, not the number of splits, and the merge order is always split
order. So the result for a request depends only on its own length: it does not change
with the batch it runs in or with ``splits_per_program`` (batch invariance), and a CUDA
graph captured for the longest context can run any shorter one (extra programs exit at
once). vLLM's v2 kernel makes the same choice (``PARTITION_SIZE = 512``). What may
follow the batch is only what leaves the operation order alone: ``splits_per_program``
and the pipeline depth (:func:`decode_num_stages`); the tile size and warp count are
fixed per cache dtype (``DECODE_CONFIG``). Large batches have enough (sequence, KV head)
pairs to fill the GPU, so one program per pair streams the keys in one pass and skips
the second kernel, as FlashAttention's split-KV heuristic does when it picks one split
(``num_splits_heuristic`` in flash-attention's ``flash_api.cpp``).

Precision: scores, softmax and accumulation in float32; K and V are dequantized
(``stored * scale``) and cast to the query dtype before the dot products, as the
reference does; on GPUs, float32 dot products use IEEE float32, not TF32. The default
kernel for fp8 caches (``fp8_kernel="folded"``) differs, within a tolerance
(``tests/test_kernels.py``, ``FP8_CONTRACT``): the scales multiply the scores and the
output, not the tiles, and with 16-bit queries the products run in float16 (bfloat16
queries scaled into float16 by a power of two, exactly), which every fp8 value is.
"""

from __future__ import annotations

import functools
import numbers
from typing import Optional

import torch

from minivllm_kernels._quant import _INTERPRETED, cast_rne, dot, quant_format
from minivllm_kernels._triton import INTERPRET, device_ok, next_pow2, tl, triton
from minivllm_kernels.reshape_and_cache import _per_head

SPLIT_SIZE = 512  # tokens per split (a multiple of BLOCK_N)
# Launch configuration of the split kernel: keys per tile and warps. Both change the order
# of the floating-point operations (so the bits), so each is fixed per cache kind and never
# chosen per batch. Tuned on an H200 (benchmarks/decode_sweep.py, benchmarks/RESULTS.md):
# float caches stream fastest with 64-key tiles; fp8/int8 caches, whose dequantization
# makes the loop compute-bound, with 128-key tiles. A "num_stages" key here overrides
# decode_num_stages() (the benchmarks' sweeps use it).
DECODE_CONFIG = {"BLOCK_N": 64, "num_warps": 4}
DECODE_CONFIG_QUANT = {"BLOCK_N": 128, "num_warps": 4}
# fp8 caches with fp8_kernel="folded" (the default): scales folded out of the tiles, and
# registers capped at 128 per thread, so that 4 programs share an SM instead of 2 (the
# uncapped kernel takes 168-200): on an H100, batch 64 / 4k context, 254 us against 286 us
# for the exact kernel's best launch (benchmarks/fp8_decode.py, benchmarks/RESULTS.md).
# EVEN: full tiles run without load masks (the last, partial tile with them); EXP2: the
# softmax in base 2 (log2(e) folded into the score scale). Together 1-3 % faster at batch
# >= 64 on an H100 (250.0 against 254.8 us at batch 64 / 4k); both change the rounding,
# not the contract. F16 (16-bit queries, static scales; see _f16_mode): the products in
# float16, the fp8 tiles converted with integer instructions instead of the GPU's
# conversion unit (_fp8_to_f16), with whole sequences per program at large batches
# (FOLDED_WHOLE_PAIRS_PER_SM): 212-213 against 250-252 us at batch 64 / 4k on an H100,
# 83 % of copy bandwidth; 1 = an e4m3 NaN reads as a number, 2 = kept NaN (231-234 us).
# Float caches and the exact kernel ignore all three.
DECODE_CONFIG_FOLDED = {"BLOCK_N": 128, "num_warps": 4, "num_stages": 4, "maxnreg": 128,
                        "EVEN": True, "EXP2": True, "F16": 1}
# The decode kernels for fp8 caches (``fp8_kernel``): "folded", the default, a tolerance
# contract (tests/test_kernels.py, FP8_CONTRACT); "exact", the kernel int8 caches use
# (each tile dequantized and rounded to the query dtype), whose bits earlier releases gave.
FP8_KERNELS = ("folded", "exact")
# fp8 "folded" launches read at most this many splits per program (with bfloat16 products,
# at batch 64 / 4k on an H100, two splits per program took 254 us, whole sequences 262 us)
# ... unless the batch has FOLDED_WHOLE_PAIRS_PER_SM (sequence, KV head) pairs per SM or
# more: then whole sequences, about one wave of 4 programs per SM. On an H100 with float16
# products (F16, integer conversion two values at a time): batch 64 / 4k (3.9 pairs per
# SM) 217-218 us whole, 236-237 us with 2 splits per program; batch 128 / 4k 410-411
# against 442-445 us. Batch 32 / 4k (1.9 pairs per SM; e4m3 NaNs kept): 148-149 us whole,
# 135-136 us with 1-4 splits. Any value gives the same bits.
FOLDED_MAX_SPLITS_PER_PROGRAM = 2
FOLDED_WHOLE_PAIRS_PER_SM = 3.5
# A launch gives each (sequence, KV head) one program that reads all its splits once there
# are at least this many such pairs per streaming multiprocessor (SM); otherwise one
# program per split. Tuned on an H200 (132 SMs) by benchmarks/decode_sweep.py.
WHOLE_SEQUENCE_PAIRS_PER_SM = 1.9
# Whole-sequence programs per SM above which the float kernel's pipeline is kept short
# (3 stages, 39 KB of shared memory: 4 programs fit on an SM) rather than deep (5 stages,
# 72 KB: 3 fit). Measured on an H200, see decode_num_stages().
DEEP_PIPELINE_MAX_PROGRAMS_PER_SM = 3


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 1  # the interpreter runs one program at a time
    return torch.cuda.get_device_properties(device).multi_processor_count


def default_splits_per_program(batch: int, num_kv_heads: int, max_splits: int,
                               device: torch.device) -> int:
    """Splits per program for a decode launch: ``max_splits`` (one program per sequence
    and KV head, which merges its splits itself: no second kernel) when the batch has at
    least ``WHOLE_SEQUENCE_PAIRS_PER_SM`` (sequence, KV head) pairs per SM; else 1 (one
    program per split, then the reduce kernel).

    Measured on an H200 (``benchmarks/decode_sweep.py``, bf16 KV): whole sequences save
    the reduce kernel and stream in one pass at batch >= 32 (8 KV heads); at smaller
    batches they leave SMs idle, and 2-8 splits per program were no faster than 1. Any
    value gives the same bits."""
    if batch * num_kv_heads >= WHOLE_SEQUENCE_PAIRS_PER_SM * _num_sms(device):
        return max_splits
    return 1


def decode_config(cache_dtype: torch.dtype, fp8_kernel: str = "folded") -> dict:
    """The launch configuration dict for a cache dtype: ``DECODE_CONFIG_FOLDED`` for
    fp8 caches with ``fp8_kernel="folded"``, ``DECODE_CONFIG_QUANT`` for other fp8 and
    int8 caches, ``DECODE_CONFIG`` for float caches (the module-level dict itself, so a
    benchmark or test can set ``"num_stages"`` in it)."""
    kind = quant_format(cache_dtype)[0]
    if kind == 1 and fp8_kernel == "folded":
        return DECODE_CONFIG_FOLDED
    return DECODE_CONFIG_QUANT if kind else DECODE_CONFIG


def decode_num_stages(programs: int, whole: bool, quantized: bool,
                      device: torch.device) -> int:
    """Software-pipeline depth (Triton ``num_stages``: key/value tiles loaded ahead) for
    a launch of ``programs`` split-kernel programs. Unlike the tile size it does not
    change the bits, so it may follow the batch.

    Measured on an H200 (bf16 KV, 64-key tiles, speed against SDPA): a deep pipeline (5)
    keeps more bytes in flight per program, which is what few programs per SM need
    (whole sequences at batch 32: 0.971x against 0.853x with 3; one split per program:
    20.7 against 25.8 us at batch 1 / 4k). But its 72 KB of shared memory lets only 3
    programs share an SM, and whole-sequence programs all run equally long, so when more
    than 3 per SM are launched the last ones run as a second, mostly empty wave (batch 64:
    0.78x against 0.98x with 3 stages). fp8/int8 caches (128-key tiles): 2 (285 against
    323 us with 3 at batch 64 / 4k)."""
    if quantized:
        return 2
    if whole and programs > DEEP_PIPELINE_MAX_PROGRAMS_PER_SM * _num_sms(device):
        return 3
    return 5


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
    # A row that has seen no key yet keeps m_new = -inf; exp(-inf - -inf) would be NaN,
    # so it uses 0 as its max (p = exp(-inf) = 0, alpha = 0 * nothing): FlashAttention-2's
    # Check_inf (csrc/flash_attn/src/softmax.h). Its l stays 0 and its output is 0.
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m - m_use)
    p = tl.exp(s - m_use[:, None])
    l = l * alpha + tl.sum(p, axis=1)
    v = _load_kv_tile(v_cache_ptr, v_scale_ptr, vs_cache_ptr, slot, pmask, kvh, d,
                      NUM_KV_HEADS, HEAD_DIM, QUANT, DYNAMIC, q.dtype)
    acc = acc * alpha[:, None] + dot(cast_rne(p, v.dtype), v, PRECISION, UPCAST)
    return m_new, l, acc


@triton.jit
def _exp(x, EXP2: tl.constexpr):
    """2**x when the softmax runs in base 2 (EXP2: log2(e) already folded into the
    scores), else e**x."""
    if EXP2:
        return tl.exp2(x)
    return tl.exp(x)


@triton.jit
def _fp8_to_f16(x, E4M3: tl.constexpr, KEEP_NAN: tl.constexpr):
    """fp8 tensor -> float16 tensor, exactly, with integer instructions. The cast
    (``cvt.rn.f16x2.e4m3x2``, the GPU's conversion unit, one per two values) is what
    limited the folded kernel on an H100: with it, float16 products took 248-255 us at
    batch 64 / 4k; with this, 212-213 us (benchmarks/RESULTS.md).

    - e5m2 is float16 with its low byte cut off: each byte moves to the top of a 16-bit
      word (``prmt``), and that is the value, NaN and inf included.
    - e4m3 (bits s eeee mmm) becomes s 0eeee mmm 0000000, which read as float16
      (exponent bias 15, not 7) is **x * 2**-8**, subnormals included; the caller's
      scales undo the 2**-8. Four values at a time: the high bytes s 0eeee mm (sign kept,
      magnitude shifted right by one) and the low bytes m 0000000, interleaved by two
      ``prmt``: 7 instructions per 4 values.
    - An e4m3 NaN (magnitude 0x7F; a cache holds one only if a NaN was written to it)
      reads as -+480 x 2**-8, a number. KEEP_NAN keeps it NaN (the magnitude plus one
      carries into float16's top exponent bit only then), two values at a time: 12
      instructions per 4 values, 231-234 against 212-213 us at batch 64 / 4k (H100).

    The interpreter (no inline PTX) runs the same bit operations one value at a time;
    ``tests/test_kernels.py::test_fp8_to_f16_every_byte`` checks all 256 bytes both ways."""
    if _INTERPRETED:
        u = x.to(tl.uint8, bitcast=True).to(tl.uint16)
        if E4M3:
            h = ((u & 0x80) << 8) | ((u & 0x7F) << 7)
            if KEEP_NAN:
                h = tl.where((u & 0x7F) == 0x7F, h | 0x4000, h)
        else:
            h = u << 8
        return h.to(tl.float16, bitcast=True)
    u8 = x.to(tl.uint8, bitcast=True)
    if not E4M3:
        return tl.inline_asm_elementwise(
            asm="""{
            prmt.b32 $0, $2, 0, 0x1404;
            prmt.b32 $1, $2, 0, 0x3424;
            }""", constraints="=r,=r,r", args=[u8], dtype=tl.float16, is_pure=True, pack=4)
    if not KEEP_NAN:
        return tl.inline_asm_elementwise(
            asm="""{
            .reg .b32 h, l, t;
            and.b32 t, $2, 0x7F7F7F7F;
            shr.b32 t, t, 1;
            lop3.b32 h, $2, 0x80808080, t, 0xE2;
            shl.b32 l, $2, 7;
            and.b32 l, l, 0x80808080;
            prmt.b32 $0, l, h, 0x5140;
            prmt.b32 $1, l, h, 0x7362;
            }""", constraints="=r,=r,r", args=[u8], dtype=tl.float16, is_pure=True, pack=4)
    return tl.inline_asm_elementwise(
        asm="""{
        .reg .b32 a, b, t, u;
        prmt.b32 a, $2, 0, 0x1404;
        prmt.b32 b, $2, 0, 0x3424;
        and.b32 t, a, 0x7F007F00;
        shr.b32 t, t, 1;
        add.u32 u, t, 0x00800080;
        lop3.b32 t, a, 0x80008000, t, 0xEA;
        lop3.b32 $0, u, 0x40004000, t, 0xEA;
        and.b32 t, b, 0x7F007F00;
        shr.b32 t, t, 1;
        add.u32 u, t, 0x00800080;
        lop3.b32 t, b, 0x80008000, t, 0xEA;
        lop3.b32 $1, u, 0x40004000, t, 0xEA;
        }""", constraints="=r,=r,r", args=[u8], dtype=tl.float16, is_pure=True, pack=4)


@triton.jit
def _load_raw_tile(cache_ptr, slot, pmask, kvh, d, NUM_KV_HEADS: tl.constexpr,
                   HEAD_DIM: tl.constexpr, OUT_DTYPE: tl.constexpr, MASKED: tl.constexpr,
                   F16: tl.constexpr = 0):
    """[BLOCK_N, D_PAD] tile of an fp8 cache's stored values, cast to OUT_DTYPE without
    the scale: exact (every fp8 e4m3/e5m2 value is a bfloat16, float16 and float32
    value). Not MASKED: every row exists and HEAD_DIM == D_PAD (a full tile), so the
    load takes no mask. F16 (OUT_DTYPE float16): converted by :func:`_fp8_to_f16` (an
    e4m3 tile then holds the values times 2**-8, which the caller's scales undo); 2: NaN
    kept."""
    ptr = cache_ptr + slot[:, None] * (NUM_KV_HEADS * HEAD_DIM) + kvh * HEAD_DIM + d[None, :]
    if MASKED:
        x = tl.load(ptr, mask=pmask[:, None] & (d[None, :] < HEAD_DIM), other=0.0)
    else:
        x = tl.load(ptr)
    if F16:
        return _fp8_to_f16(x, x.dtype == tl.float8e4nv, F16 == 2)
    return x.to(OUT_DTYPE)


@triton.jit
def _attend_tile_folded(q, k_cache_ptr, v_cache_ptr, ks_cache_ptr, vs_cache_ptr, slot, pmask,
                        kvh, d, m, l, acc, score_scale, NUM_KV_HEADS: tl.constexpr,
                        HEAD_DIM: tl.constexpr, DYNAMIC: tl.constexpr,
                        PRECISION: tl.constexpr, UPCAST: tl.constexpr, MASKED: tl.constexpr,
                        EXP2: tl.constexpr, F16: tl.constexpr = 0):
    """:func:`_attend_tile` for an fp8 cache with the scales folded out of the tiles. K
    and V enter the products as stored (:func:`_load_raw_tile`: one exact cast); the
    scores are multiplied by ``score_scale`` (softmax scale x k_scale: a scalar, or per
    key with DYNAMIC scales) and the static v_scale multiplies the split's output once
    (the caller). So K * scale, and V * scale with static scales, are never rounded to
    the query dtype, as :func:`_attend_tile` rounds them. DYNAMIC V scales are applied in
    the tile as :func:`_attend_tile` does: folded into the weights instead (p * v_scale),
    they push small weights into float16's subnormals (an fp8_e5m2 scale is amax /
    57344), which measured 6x the float cache's error (benchmarks/fp8_decode.py). The
    sums run in the same order as :func:`_attend_tile`'s, but the products differ: the
    result agrees with it within a tolerance, not in bits. Not MASKED: a full tile
    (:func:`_load_raw_tile`). EXP2: ``score_scale`` includes log2(e), so the scores, m
    and the exponentials are in base 2 (one multiply per score fewer: FlashAttention-2's
    ``scale_softmax_log2``)."""
    k = _load_raw_tile(k_cache_ptr, slot, pmask, kvh, d, NUM_KV_HEADS, HEAD_DIM, q.dtype,
                       MASKED, F16)
    s = dot(q, tl.trans(k), PRECISION, UPCAST)  # [G, N]
    if DYNAMIC:
        ks = tl.load(ks_cache_ptr + slot * NUM_KV_HEADS + kvh, mask=pmask, other=0.0)
        s = s * (score_scale * ks)[None, :]
    else:
        s = s * score_scale
    if MASKED:
        s = tl.where(pmask[None, :], s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, axis=1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # see _attend_tile
    alpha = _exp(m - m_use, EXP2)
    p = _exp(s - m_use[:, None], EXP2)
    l = l * alpha + tl.sum(p, axis=1)
    if DYNAMIC:
        v = _load_kv_tile(v_cache_ptr, vs_cache_ptr, vs_cache_ptr, slot, pmask, kvh, d,
                          NUM_KV_HEADS, HEAD_DIM, True, True, q.dtype)
    else:
        v = _load_raw_tile(v_cache_ptr, slot, pmask, kvh, d, NUM_KV_HEADS, HEAD_DIM, q.dtype,
                           MASKED, F16)
    acc = acc * alpha[:, None] + dot(cast_rne(p, v.dtype), v, PRECISION, UPCAST)
    return m_new, l, acc


@triton.jit
def _query_to_f16(q, score_scale):
    """bfloat16 queries q [G, D] -> float16, scaled by a power of two 2**k so that the
    largest |q| lies in [2**13, 2**14): exact for every element at least 2**-27 times the
    largest (float16 keeps 11 significant bits from 2**-14 up; bfloat16 has 8), and
    smaller ones are off by at most 2**-38 times the largest. ``score_scale`` is
    multiplied by 2**-k (exact unless it falls below 2**-126: only for |q| < 2**-100).
    Inf and NaN stay inf and NaN. Then every fp8 value is a float16 value
    (:func:`_fp8_to_f16`), and the softmax weights are rounded to float16's 11 bits
    instead of bfloat16's 8: the folded kernel's 16-bit rows measure 0.54-0.87 u against
    the float cache's 1.22-2.76 u (benchmarks/RESULTS.md)."""
    qf = q.to(tl.float32)
    amax = tl.max(tl.max(tl.abs(qf), axis=1), axis=0)
    e = ((amax.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127  # floor(log2(amax))
    k = tl.minimum(tl.maximum(13 - e, -126), 126)
    up = ((127 + k) << 23).to(tl.float32, bitcast=True)  # 2**k
    down = ((127 - k) << 23).to(tl.float32, bitcast=True)  # 2**-k
    return (qf * up).to(tl.float16), score_scale * down


@triton.jit
def _merge_split(m, l, acc, m_s, l_s, acc_s, EXP2: tl.constexpr):
    """Fold one split's partial result (m_s [G], l_s [G], acc_s [G, D]) into the running
    (m, l, acc): rescale both to the larger max and add. Explicit FMAs, so the compiler
    cannot contract the two products differently in the two kernels that call this.
    Two empty partials (both maxima -inf) merge to an empty one (the -inf guard of
    :func:`_attend_tile`), not NaN. EXP2: the maxima are in base 2."""
    m_new = tl.maximum(m, m_s)
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    a = _exp(m - m_use, EXP2)
    a_s = _exp(m_s - m_use, EXP2)
    l = tl.fma(l_s, a_s, l * a)
    acc = tl.fma(acc_s, a_s[:, None], acc * a[:, None])
    return m_new, l, acc


@triton.jit
def _store_output(out_ptr, b, heads, gmask, d, l, acc, stride_ob, stride_oh,
                  HEAD_DIM: tl.constexpr):
    """out[b, heads] = acc / l in the output dtype; a row that saw no key (l == 0: a
    seq_len-0 padding row of a CUDA graph) gets zeros, not 0/0."""
    o = tl.where(l[:, None] > 0, acc / tl.maximum(l, 1e-38)[:, None], 0.0)
    tl.store(out_ptr + b * stride_ob + heads[:, None] * stride_oh + d[None, :],
             cast_rne(o, out_ptr.dtype.element_ty), mask=gmask[:, None] & (d[None, :] < HEAD_DIM))


@triton.jit
def _end_split(n0, end, m, l, acc, m_all, l_all, acc_all, v_out_scale, part_m_ptr, part_l_ptr,
               part_acc_ptr, b, heads, gmask, d, max_splits, NUM_KV_HEADS: tl.constexpr,
               QUERY_GROUP: tl.constexpr, D_PAD: tl.constexpr, SPLIT: tl.constexpr,
               BLOCK_N: tl.constexpr, WHOLE: tl.constexpr, EXP2: tl.constexpr):
    """After the tile at n0: if a split ends there (every SPLIT keys, or at ``end``), its
    partial result (acc times ``v_out_scale``, the folded kernel's static v_scale) is
    merged into (m_all, l_all, acc_all) (WHOLE) or written for
    :func:`_decode_reduce_kernel`, and the running (m, l, acc) start again empty."""
    if ((n0 + BLOCK_N) % SPLIT == 0) | (n0 + BLOCK_N >= end):
        acc_s = acc * v_out_scale
        if WHOLE:
            m_all, l_all, acc_all = _merge_split(m_all, l_all, acc_all, m, l, acc_s, EXP2)
        else:
            row = (b * (NUM_KV_HEADS * QUERY_GROUP) + heads) * max_splits + n0 // SPLIT
            tl.store(part_m_ptr + row, m, mask=gmask)
            tl.store(part_l_ptr + row, l, mask=gmask)
            tl.store(part_acc_ptr + row[:, None] * D_PAD + d[None, :], acc_s,
                     mask=gmask[:, None])
        m = tl.full(m.shape, float("-inf"), tl.float32)
        l = tl.zeros(l.shape, tl.float32)
        acc = tl.zeros_like(acc)
    return m, l, acc, m_all, l_all, acc_all


@triton.jit
def _tile_slots(block_tables_ptr, b, stride_bt, n0, end, BLOCK_N: tl.constexpr,
                BLOCK_SIZE: tl.constexpr, MASKED: tl.constexpr):
    """The cache rows (slots, int64 [BLOCK_N]) of sequence b's keys n0 .. n0 + BLOCK_N - 1
    through its block table, and which of them exist (< end). Not MASKED: all do (a full
    tile), so the block-table load takes no mask."""
    pos = n0 + tl.arange(0, BLOCK_N)
    pmask = pos < end
    if MASKED:
        blk = tl.load(block_tables_ptr + b * stride_bt + pos // BLOCK_SIZE, mask=pmask, other=0)
    else:
        blk = tl.load(block_tables_ptr + b * stride_bt + pos // BLOCK_SIZE)
    return pmask, blk.to(tl.int64) * BLOCK_SIZE + pos % BLOCK_SIZE


@triton.jit
def _folded_tiles(lo, hi, end, q, k_cache_ptr, v_cache_ptr, ks_cache_ptr, vs_cache_ptr,
                  block_tables_ptr, b, stride_bt, kvh, d, m, l, acc, m_all, l_all, acc_all,
                  score_scale, v_out_scale, part_m_ptr, part_l_ptr, part_acc_ptr, heads, gmask,
                  max_splits, QUERY_GROUP: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
                  HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                  SPLIT: tl.constexpr, BLOCK_N: tl.constexpr, DYNAMIC: tl.constexpr,
                  PRECISION: tl.constexpr, UPCAST: tl.constexpr, WHOLE: tl.constexpr,
                  EXP2: tl.constexpr, MASKED: tl.constexpr, F16: tl.constexpr):
    """The folded kernel's tiles at keys lo, lo + BLOCK_N, ... < hi (the program's keys
    end at ``end``): :func:`_attend_tile_folded`, then :func:`_end_split`. The split
    kernel calls it for the full tiles (not MASKED) and then the last, partial one."""
    for n0 in range(lo, hi, BLOCK_N):
        pmask, slot = _tile_slots(block_tables_ptr, b, stride_bt, n0, end, BLOCK_N, BLOCK_SIZE,
                                  MASKED)
        m, l, acc = _attend_tile_folded(
            q, k_cache_ptr, v_cache_ptr, ks_cache_ptr, vs_cache_ptr, slot, pmask, kvh, d, m, l,
            acc, score_scale, NUM_KV_HEADS, HEAD_DIM, DYNAMIC, PRECISION, UPCAST, MASKED, EXP2,
            F16)
        m, l, acc, m_all, l_all, acc_all = _end_split(
            n0, end, m, l, acc, m_all, l_all, acc_all, v_out_scale, part_m_ptr, part_l_ptr,
            part_acc_ptr, b, heads, gmask, d, max_splits, NUM_KV_HEADS, QUERY_GROUP, D_PAD,
            SPLIT, BLOCK_N, WHOLE, EXP2)
    return m, l, acc, m_all, l_all, acc_all


@triton.jit
def _decode_split_kernel(
        q_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, ks_cache_ptr, vs_cache_ptr,
        block_tables_ptr, seq_lens_ptr, part_m_ptr, part_l_ptr, part_acc_ptr, out_ptr,
        stride_qb, stride_qh, stride_bt, stride_ob, stride_oh, max_splits, splits_per_program,
        sm_scale,
        QUERY_GROUP: tl.constexpr, G_PAD: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
        HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
        SPLIT: tl.constexpr, BLOCK_N: tl.constexpr, QUANT: tl.constexpr,
        DYNAMIC: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
        WHOLE: tl.constexpr, FOLDED: tl.constexpr, EVEN: tl.constexpr = False,
        EXP2: tl.constexpr = False, F16: tl.constexpr = 0):
    # KV head fastest: programs that run side by side read the heads of the same tokens,
    # which sit next to each other in memory ([slot, kv_head, head_dim]).
    kvh = tl.program_id(0)
    b = tl.program_id(1)
    first = tl.program_id(2) * splits_per_program  # this program's first split
    seq_len = tl.load(seq_lens_ptr + b)
    num_splits = tl.cdiv(seq_len, SPLIT)
    g = tl.arange(0, G_PAD)
    d = tl.arange(0, D_PAD)
    heads = kvh * QUERY_GROUP + g
    gmask = g < QUERY_GROUP
    # WHOLE: one program per (sequence, KV head); it merges its splits itself and writes
    # the output (zeros for a seq_len-0 padding row: the loop does not run). Else it
    # writes each split's partial result for _decode_reduce_kernel.
    if WHOLE or first < num_splits:
        start = first * SPLIT
        end = tl.minimum(start + splits_per_program * SPLIT, seq_len)
        q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :],
                    mask=gmask[:, None] & (d[None, :] < HEAD_DIM), other=0.0)
        m = tl.full([G_PAD], float("-inf"), tl.float32)  # this split's online softmax
        l = tl.zeros([G_PAD], tl.float32)
        acc = tl.zeros([G_PAD, D_PAD], tl.float32)
        score_scale = sm_scale
        v_out_scale = 1.0
        if FOLDED and not DYNAMIC:  # static scales folded out of the tiles
            score_scale = sm_scale * tl.load(k_scale_ptr + kvh)
            v_out_scale = tl.load(v_scale_ptr + kvh)
        if EXP2:
            score_scale = score_scale * 1.4426950408889634  # log2(e)
        if F16:  # float16 products (set by the launcher for 16-bit queries, static scales)
            if q.dtype == tl.bfloat16:
                q, score_scale = _query_to_f16(q, score_scale)
            if k_cache_ptr.dtype.element_ty == tl.float8e4nv:  # tiles hold x * 2**-8
                score_scale = score_scale * 256.0
                v_out_scale = v_out_scale * 256.0
        # splits merged so far (WHOLE)
        m_all = tl.full([G_PAD], float("-inf"), tl.float32)
        l_all = tl.zeros([G_PAD], tl.float32)
        acc_all = tl.zeros([G_PAD, D_PAD], tl.float32)
        # one flat loop over the program's tiles (the pipeline does not drain at split
        # boundaries); a split ends every SPLIT // BLOCK_N tiles. EVEN (folded): the full
        # tiles first, without masks, then the last, partial tile (if any) with them.
        if FOLDED:
            full_end = start
            if EVEN:
                full_end = start + (end - start) // BLOCK_N * BLOCK_N
            for part in tl.static_range(2):  # the full tiles, then the partial one
                lo = start if part == 0 else full_end
                hi = full_end if part == 0 else end
                m, l, acc, m_all, l_all, acc_all = _folded_tiles(
                    lo, hi, end, q, k_cache_ptr, v_cache_ptr, ks_cache_ptr, vs_cache_ptr,
                    block_tables_ptr, b, stride_bt, kvh, d, m, l, acc, m_all, l_all, acc_all,
                    score_scale, v_out_scale, part_m_ptr, part_l_ptr, part_acc_ptr, heads,
                    gmask, max_splits, QUERY_GROUP, NUM_KV_HEADS, HEAD_DIM, D_PAD, BLOCK_SIZE,
                    SPLIT, BLOCK_N, DYNAMIC, PRECISION, UPCAST, WHOLE, EXP2, part == 1,
                    F16)
        else:
            for n0 in range(start, end, BLOCK_N):
                pmask, slot = _tile_slots(block_tables_ptr, b, stride_bt, n0, end, BLOCK_N,
                                          BLOCK_SIZE, True)
                m, l, acc = _attend_tile(
                    q, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, ks_cache_ptr,
                    vs_cache_ptr, slot, pmask, pmask[None, :], kvh, d, m, l, acc, sm_scale,
                    NUM_KV_HEADS, HEAD_DIM, QUANT, DYNAMIC, PRECISION, UPCAST)
                m, l, acc, m_all, l_all, acc_all = _end_split(
                    n0, end, m, l, acc, m_all, l_all, acc_all, 1.0, part_m_ptr,
                    part_l_ptr, part_acc_ptr, b, heads, gmask, d, max_splits, NUM_KV_HEADS,
                    QUERY_GROUP, D_PAD, SPLIT, BLOCK_N, WHOLE, False)
        if WHOLE:
            _store_output(out_ptr, b, heads, gmask, d, l_all, acc_all, stride_ob, stride_oh,
                          HEAD_DIM)


@triton.jit
def _decode_reduce_kernel(part_m_ptr, part_l_ptr, part_acc_ptr, seq_lens_ptr, out_ptr,
                          stride_ob, stride_oh, max_splits, NUM_HEADS: tl.constexpr,
                          HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, SPLIT: tl.constexpr,
                          EXP2: tl.constexpr):
    """Program (query head, b): merges the partial results of sequence b's splits, in
    split order, with the same code as a whole-sequence split program (one head, as a
    [1] tensor: the shapes that code takes), so the result never depends on the batch
    or on splits_per_program."""
    heads = tl.program_id(0) + tl.arange(0, 1)
    b = tl.program_id(1)
    d = tl.arange(0, D_PAD)
    num_splits = tl.cdiv(tl.load(seq_lens_ptr + b), SPLIT)
    rows = (b * NUM_HEADS + heads) * max_splits  # [1]
    m = tl.full([1], float("-inf"), tl.float32)
    l = tl.zeros([1], tl.float32)
    acc = tl.zeros([1, D_PAD], tl.float32)
    for s in tl.range(0, num_splits, num_stages=4):  # loads of later splits in flight
        m_s = tl.load(part_m_ptr + rows + s)
        l_s = tl.load(part_l_ptr + rows + s)
        acc_s = tl.load(part_acc_ptr + (rows + s)[:, None] * D_PAD + d[None, :])
        m, l, acc = _merge_split(m, l, acc, m_s, l_s, acc_s, EXP2)
    _store_output(out_ptr, b, heads, heads < NUM_HEADS, d, l, acc, stride_ob, stride_oh,
                  HEAD_DIM)


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


def _f16_mode(config: dict, folded: bool, dynamic: bool, q_dtype: torch.dtype) -> int:
    """The folded kernel's float16 products (``config["F16"]``): 0 off (bfloat16 queries
    multiply in bfloat16, the tiles converted by the cast); 1 the tiles converted with
    integer instructions (:func:`_fp8_to_f16`; an e4m3 NaN reads as a number); 2 the same
    with e4m3 NaNs kept. Only for 16-bit queries and static scales (dynamic V scales
    dequantize V in the tile, which could take a value past float16's range): else 0."""
    if not (folded and not dynamic and q_dtype in (torch.bfloat16, torch.float16)):
        return 0
    return int(config.get("F16", 0))


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
                           out: Optional[torch.Tensor] = None,
                           splits_per_program: Optional[int] = None,
                           fp8_kernel: str = "folded") -> torch.Tensor:
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
        splits_per_program: how many consecutive ``SPLIT_SIZE`` splits one program
            reads (>= 1; capped at the number of splits). A launch choice only: every
            value gives bit-identical outputs. Default: :func:`default_splits_per_program`.
        fp8_kernel: for fp8 caches, "folded" (default: :func:`_attend_tile_folded`,
            scales folded out of the tiles; its contract is a tolerance against float64,
            ``tests/test_kernels.py::test_fp8_folded_error_against_float64``) or "exact"
            (the int8 path's tiles: each dequantized K/V tile rounded to q's dtype).
            Ignored for other caches. Either is batch invariant.
    Returns:
        [B, num_heads, head_dim] in q's dtype.
    Raises:
        ValueError: shape, device or layout mismatch; splits_per_program not an
            integer >= 1; an unknown fp8_kernel.
    """
    num_heads, num_kv_heads, head_dim = _check_paged_args(q, key_cache, value_cache,
                                                         block_tables, "paged_attention_decode")
    _check_out_and_scales(q, out, k_scale_cache, v_scale_cache, key_cache,
                          "paged_attention_decode")
    if fp8_kernel not in FP8_KERNELS:
        raise ValueError(f"paged_attention_decode: fp8_kernel must be one of {FP8_KERNELS}, "
                         f"got {fp8_kernel!r}")
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
    kind = quant_format(key_cache.dtype)[0]
    folded = kind == 1 and fp8_kernel == "folded"
    if splits_per_program is None:
        splits_per_program = default_splits_per_program(B, num_kv_heads, max_splits, q.device)
        if folded and B * num_kv_heads < FOLDED_WHOLE_PAIRS_PER_SM * _num_sms(q.device):
            splits_per_program = min(splits_per_program, FOLDED_MAX_SPLITS_PER_PROGRAM)
    if (not isinstance(splits_per_program, numbers.Integral)
            or isinstance(splits_per_program, bool) or splits_per_program < 1):
        raise ValueError(f"paged_attention_decode: splits_per_program must be an integer "
                         f">= 1, got {splits_per_program!r}")
    splits_per_program = min(int(splits_per_program), max_splits)
    whole = splits_per_program == max_splits
    group = num_heads // num_kv_heads
    g_pad = max(16, next_pow2(group))
    d_pad = next_pow2(head_dim)
    # partial results, one per (sequence, head, split); not needed when every program
    # covers a whole sequence (an empty buffer then stands in for the pointer)
    n = 0 if whole else B * num_heads * max_splits
    part_m = torch.empty(n, dtype=torch.float32, device=q.device)
    part_l = torch.empty_like(part_m)
    part_acc = torch.empty(n * d_pad, dtype=torch.float32, device=q.device)
    # float caches use no scale: skip making the [H] tensors (two small kernels)
    ks = _per_head(k_scale, num_kv_heads, q.device) if kind else q
    vs = _per_head(v_scale, num_kv_heads, q.device) if kind else q
    dynamic = k_scale_cache is not None
    config = dict(decode_config(key_cache.dtype, fp8_kernel))
    if not folded or head_dim != d_pad:  # unmasked full tiles need HEAD_DIM == D_PAD
        config.pop("EVEN", None)
    if not folded:
        config.pop("EXP2", None)
    config["F16"] = _f16_mode(config, folded, dynamic, q.dtype)
    grid = (num_kv_heads, B, triton.cdiv(max_splits, splits_per_program))
    if "num_stages" not in config:
        config["num_stages"] = decode_num_stages(grid[0] * grid[1] * grid[2], whole, kind != 0,
                                                 q.device)
    _decode_split_kernel[grid](
        q, key_cache, value_cache, ks, vs, k_scale_cache if dynamic else ks,
        v_scale_cache if dynamic else vs, block_tables, seq_lens, part_m, part_l, part_acc,
        out, q.stride(0), q.stride(1), block_tables.stride(0), out.stride(0), out.stride(1),
        max_splits, splits_per_program, float(scale),
        QUERY_GROUP=group, G_PAD=g_pad, NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim, D_PAD=d_pad, BLOCK_SIZE=block_size, SPLIT=SPLIT_SIZE,
        QUANT=kind != 0, DYNAMIC=dynamic, PRECISION=_dot_precision(q.dtype),
        UPCAST=_upcast(q.dtype), WHOLE=whole, FOLDED=folded, **config)
    if not whole:
        _decode_reduce_kernel[(num_heads, B)](
            part_m, part_l, part_acc, seq_lens, out, out.stride(0), out.stride(1), max_splits,
            NUM_HEADS=num_heads, HEAD_DIM=head_dim, D_PAD=d_pad, SPLIT=SPLIT_SIZE,
            EXP2=bool(config.get("EXP2", False)))
    return out


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, block_size: int, length: int,
              dtype: torch.dtype, scale: torch.Tensor | float = 1.0,
              scale_cache: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Reference helper: positions [0, length) of one sequence from a paged cache,
    dequantized (``stored * scale`` in float32, or float64 when ``dtype`` is float64) and
    cast to ``dtype``: [length, H, D]."""
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
    wide = torch.float64 if dtype == torch.float64 else torch.float32
    return (raw.to(wide) * s.to(wide)).to(dtype)


def attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                  mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Reference attention for one sequence in float32: q [n, H, D], k/v [L, H_kv, D],
    mask [n, L] bool (True = attend) or None. Returns [n, H, D] float32; a row with no
    True key is 0 (the kernels' fully-masked-row convention)."""
    group = q.shape[1] // k.shape[1]
    k = k.float().repeat_interleave(group, dim=1)
    v = v.float().repeat_interleave(group, dim=1)
    s = torch.einsum("nhd,lhd->hnl", q.float(), k) * scale
    p = torch.softmax(s, dim=-1) if mask is None else \
        torch.softmax(s.masked_fill(~mask[None], float("-inf")), dim=-1).masked_fill(
            ~mask.any(-1)[None, :, None], 0.0)
    return torch.einsum("hnl,lhd->nhd", p, v)


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


def paged_attention_decode_f64(q: torch.Tensor, key_cache: torch.Tensor,
                               value_cache: torch.Tensor, block_tables: torch.Tensor,
                               seq_lens: torch.Tensor, block_size: int, scale: float,
                               k_scale: torch.Tensor | float = 1.0,
                               v_scale: torch.Tensor | float = 1.0,
                               k_scale_cache: Optional[torch.Tensor] = None,
                               v_scale_cache: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The truth a decode kernel's error is measured against: attention in float64 of
    the dequantized cache (``stored * scale`` in float64, exact) and of q as given.

    Same arguments as :func:`paged_attention_decode`. Returns [B, num_heads, head_dim]
    float64 (0 for a seq_len-0 row), on q's device."""
    out = torch.zeros(q.shape, dtype=torch.float64, device=q.device)
    group = q.shape[1] // key_cache.shape[1]
    for b in range(q.shape[0]):
        n = int(seq_lens[b])
        if n == 0:
            continue
        k, v = (gather_kv(cache, block_tables[b], block_size, n, torch.float64, s, sc)
                .repeat_interleave(group, dim=1)  # [n, H, D]
                for cache, s, sc in ((key_cache, k_scale, k_scale_cache),
                                     (value_cache, v_scale, v_scale_cache)))
        p = torch.softmax(torch.einsum("hd,lhd->hl", q[b].double(), k) * scale, dim=-1)
        out[b] = torch.einsum("hl,lhd->hd", p, v)
    return out
