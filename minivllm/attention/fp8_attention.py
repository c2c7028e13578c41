"""FP8 attention as FlashAttention-3's fp8 path computes it, emulated on the CPU.

An fp8 KV cache can be *read* two ways:

* **dequantize** (this engine's TORCH backend, and the fp8-KV paths of vLLM's backends
  whose query stays in bf16/fp16): K and V are read back as ``stored * scale`` in the
  compute dtype, and ``S = Q K^T``, the softmax weights ``P`` and ``P V`` are computed
  there. The scores and the weights are never stored in fp8.
* **fp8 compute** (FlashAttention-3 on Hopper with ``kv_cache_dtype="fp8"``, vLLM's FA3
  backend): the query is also quantized to e4m3 with a scale ``q_scale``, both GEMMs run
  on fp8 tensor cores, and the softmax weights are cast to e4m3 for the ``P V`` GEMM.

:func:`fp8_attention_ref` emulates the second. What it follows, from
Dao-AILab/flash-attention ``hopper/`` (``flash_fwd_kernel_sm90.h``, ``softmax.h``,
``tile_size.h``):

1. ``Q8 = e4m3(Q / q_scale)``; vLLM quantizes the query before the kernel
   (``Attention.forward``: ``self.query_quant(query, self._q_scale)``, a static per-tensor
   scale, 1.0 unless a checkpoint or ``calculate_kv_scales`` sets it). Round to nearest
   even, saturating at 448.
2. ``S = Q8 · K8^T`` from the fp8 values, in float32. The descales are folded into the
   exponent: ``scale_log2 = softmax_scale · log2(e) · q_scale · k_scale``.
3. Online softmax over KV tiles of ``block_n`` keys, the last tile first (FA3 walks
   ``n_block`` downwards): running row max ``m`` of the raw scores,
   ``P = exp2(S · scale_log2 - (m · scale_log2 - max_offset))``, with
   ``max_offset = 8`` for fp8 (``Softmax<..., Max_offset = Is_FP8 ? 8 : 0>``): P lies in
   ``[0, 256]`` rather than ``[0, 1]`` "to use more of the FP8 range ... to reduce
   underflow". The row sum is taken from the float32 P, before the cast.
4. ``P8 = e4m3(P)`` (round to nearest even; nothing saturates, 256 < 448), and
   ``acc = acc · exp2((m_old - m_new) · scale_log2) + P8 · V8`` in float32.
5. ``out = acc · v_scale / row_sum``.

So a weight flushes to zero when ``P <= 2^-10``, i.e. when ``exp(s - m)``, the weight
relative to its row's running maximum, is at most ``2^-(10 + max_offset)`` (``2^-10`` is
half of e4m3's smallest subnormal ``2^-9`` and rounds to even, 0; values between round up
to ``2^-9``). With
``max_offset = 0`` (a kernel that casts ``P`` in ``[0, 1]`` straight to fp8) the
threshold is ``2^-10``.

What is exact and what is not: the two casts to e4m3 are reproduced bit for bit (torch's
saturating round-to-nearest-even cast; the tests check it against
:func:`minivllm.numerics.round_to_fp8_e4m3`), and every product of two e4m3 values is
exact in float32. The sums are float32 in torch's order, not the tensor core's; on
Hopper the fp8 tensor-core accumulator keeps fewer bits than float32 (vllm-project/
flash-attention PR #104, the fix for vllm #23813). ``acc_mantissa_bits`` models that
coarsely: the per-tile ``P8 · V8`` product is rounded to that many mantissa bits and
either kept in a narrow running accumulator (``two_level=False``: the narrow accumulator
also carries the sum across tiles) or added to a float32 accumulator once per tile
(``two_level=True``, the fix's "two-level accumulation"). It is a model of where the
rounding happens, per tile, not of the tensor core's exact adder.
"""

from __future__ import annotations

import math
from typing import Optional, Union

import torch

from minivllm.numerics import FloatFormat, round_to_format

__all__ = ["E4M3_MAX", "fp8_attention_ref", "to_e4m3"]

E4M3_MAX = 448.0
Scale = Union[float, torch.Tensor]


def to_e4m3(x: torch.Tensor) -> torch.Tensor:
    """Round float32 ``x`` to e4m3 (``float8_e4m3fn``): nearest even, saturating at +-448
    (as ``__nv_cvt_float_to_fp8(..., __NV_SATFINITE, ...)`` and cutlass's converters
    do). Returns float32 values on the e4m3 grid. NaN stays NaN."""
    return x.float().clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float()


def _per_kv_head(scale: Scale, hkv: int, name: str) -> torch.Tensor:
    t = torch.as_tensor(scale, dtype=torch.float32).flatten()
    if t.numel() == 1:
        t = t.expand(hkv)
    if t.numel() != hkv:
        raise ValueError(f"{name} must be a scalar or have one value per KV head ({hkv}), "
                         f"got {t.numel()} values")
    if not bool(torch.isfinite(t).all()) or bool((t <= 0).any()):
        raise ValueError(f"{name} must be finite and > 0, got {t.tolist()}")
    return t


def fp8_attention_ref(q: torch.Tensor, k_fp8: torch.Tensor, v_fp8: torch.Tensor,
                      k_scale: Scale = 1.0, v_scale: Scale = 1.0, q_scale: Scale = 1.0, *,
                      softmax_scale: Optional[float] = None, causal: bool = True,
                      quantize_q: bool = True, quantize_p: bool = True, max_offset: int = 8,
                      block_n: int = 160, acc_mantissa_bits: Optional[int] = None,
                      two_level: bool = True, return_stats: bool = False):
    """Attention of n queries over L cached keys, computed as FA3's fp8 path does.

    Args:
        q: [n, H, D] float32 (or bf16/fp16) queries, rotary applied: the last n positions
            of the sequence (query i is position L - n + i).
        k_fp8, v_fp8: [L, Hkv, D] ``torch.float8_e4m3fn``: what the cache stores
            (``e4m3(x / scale)``). H % Hkv == 0 (query head h reads KV head h // (H // Hkv)).
        k_scale, v_scale: the cache's descales, a float or a tensor of 1 or Hkv values.
        q_scale: the query's scale (1 or Hkv values: FA3's ``q_descale`` is per batch
            and KV head); ``Q8 = e4m3(q / q_scale)``. Ignored when ``quantize_q`` is False.
        softmax_scale: default ``D ** -0.5``.
        causal: query i attends to keys 0 .. L - n + i; otherwise to all L keys.
        quantize_q: round Q to e4m3 (False: Q stays float32, the dequantize path's query).
        quantize_p: round P to e4m3 before ``P V`` (False: float32 P).
        max_offset: P is computed as ``2^max_offset · exp(s - m)``; 8 is FA3's value for
            fp8, 0 gives P in [0, 1]. An int in [0, 8] (2^8 = 256 < 448: never saturates).
        block_n: keys per tile (FA3 on Hopper, fp8, head_dim <= 64: 160;
            ``hopper/tile_size.h``). Tiles start at multiples of block_n, last tile first.
        acc_mantissa_bits: None (float32 accumulation) or 1..23: round each tile's
            ``P8 V8`` product, and with ``two_level=False`` the running accumulator too,
            to that many mantissa bits (8-bit exponent); a coarse model of a narrow
            tensor-core accumulator.
        two_level: with ``acc_mantissa_bits``: flush each tile's product into a float32
            accumulator (True) or keep the running sum narrow (False).
        return_stats: also return a dict of float32 tensors [n, H]: ``"flushed_mass"``,
            the share of the row's softmax mass (float32 P, normalized by the row sum)
            carried by weights that the e4m3 cast set to 0, and ``"flushed_count"``, how
            many positive weights it set to 0 (both 0 when ``quantize_p`` is False).
    Returns:
        [n, H, D] float32 output (and the stats dict when ``return_stats``). A query row
        with no key gives 0.
    Raises:
        ValueError: shapes, dtypes, scales or parameters out of range.
    """
    if q.dim() != 3 or k_fp8.dim() != 3 or v_fp8.shape != k_fp8.shape:
        raise ValueError(f"q must be [n, H, D] and k_fp8, v_fp8 [L, Hkv, D] of one shape, got "
                         f"{tuple(q.shape)}, {tuple(k_fp8.shape)}, {tuple(v_fp8.shape)}")
    if k_fp8.dtype != torch.float8_e4m3fn or v_fp8.dtype != torch.float8_e4m3fn:
        raise ValueError(f"k_fp8 and v_fp8 must be torch.float8_e4m3fn, got {k_fp8.dtype}, "
                         f"{v_fp8.dtype}")
    n, H, D = q.shape
    L, Hkv, Dk = k_fp8.shape
    if Dk != D or H % Hkv or n > L or n == 0:
        raise ValueError(f"need matching head_dim, H % Hkv == 0 and 0 < n <= L; got q "
                         f"{tuple(q.shape)}, k {tuple(k_fp8.shape)}")
    if not (isinstance(max_offset, int) and 0 <= max_offset <= 8):
        raise ValueError(f"max_offset must be an int in [0, 8], got {max_offset!r}")
    if not (isinstance(block_n, int) and block_n > 0):
        raise ValueError(f"block_n must be a positive int, got {block_n!r}")
    if acc_mantissa_bits is not None and not (isinstance(acc_mantissa_bits, int)
                                              and 1 <= acc_mantissa_bits <= 23):
        raise ValueError(f"acc_mantissa_bits must be None or an int in 1..23, "
                         f"got {acc_mantissa_bits!r}")
    g = H // Hkv
    ks = _per_kv_head(k_scale, Hkv, "k_scale")[:, None, None]            # [Hkv, 1, 1]
    vs = _per_kv_head(v_scale, Hkv, "v_scale")[:, None, None]
    qs = _per_kv_head(q_scale, Hkv, "q_scale")[:, None, None]
    sm = D ** -0.5 if softmax_scale is None else float(softmax_scale)

    # query head h = kv_head * g + j: rows of kv head c are (j, i) pairs, [Hkv, g * n, D]
    qh = q.float().transpose(0, 1).reshape(Hkv, g * n, D)
    if quantize_q:
        qh = to_e4m3(qh / qs)
        descale = qs * ks
    else:
        descale = ks
    k8 = k_fp8.float().transpose(0, 1)                                     # [Hkv, L, D]
    v8 = v_fp8.float().transpose(0, 1)
    scale_log2 = ((sm * math.log2(math.e)) * descale)[..., 0]              # [Hkv, 1]
    narrow = (FloatFormat(f"acc_m{acc_mantissa_bits}", 8, acc_mantissa_bits, 127,
                          (2 - 2.0 ** -acc_mantissa_bits) * 2.0 ** 127, 2.0 ** -126,
                          2.0 ** (-126 - acc_mantissa_bits), True, "IEEE")
              if acc_mantissa_bits is not None else None)

    qpos = torch.arange(L - n, L).repeat(g)                                 # [g * n]
    R = g * n
    m = torch.full((Hkv, R), -math.inf)
    row_sum = torch.zeros(Hkv, R)
    acc = torch.zeros(Hkv, R, D)
    flushed_p = torch.zeros(Hkv, R)         # float32 P (at its tile's max) that became 0
    flushed_count = torch.zeros(Hkv, R)
    num_tiles = -(-L // block_n)
    for t in reversed(range(num_tiles)):
        lo, hi = t * block_n, min(L, (t + 1) * block_n)
        s = torch.bmm(qh, k8[:, lo:hi].transpose(1, 2))                    # [Hkv, R, T] fp32
        if causal and hi - 1 > L - n:                                      # a key after a query
            keep = torch.arange(lo, hi)[None, :] <= qpos[:, None]          # [R, T]
            s = s.masked_fill(~keep, -math.inf)
        m_new = torch.maximum(m, s.amax(-1))
        m_use = torch.where(m_new == -math.inf, torch.zeros_like(m_new), m_new)
        if t == num_tiles - 1:
            alpha = None
        else:
            alpha = torch.exp2((torch.where(m == -math.inf, m_use, m) - m_use) * scale_log2)
        s.mul_(scale_log2[..., None]).sub_((m_use * scale_log2 - max_offset)[..., None])
        p = s.exp2_()                                                      # [Hkv, R, T]
        if alpha is None:
            row_sum = p.sum(-1)
        else:
            row_sum = row_sum * alpha + p.sum(-1)
            flushed_p = flushed_p * alpha
        if quantize_p:
            p8 = to_e4m3(p)
            if return_stats:
                lost = (p8 == 0) & (p > 0)
                flushed_p = flushed_p + (p * lost).sum(-1)
                flushed_count = flushed_count + lost.sum(-1)
        else:
            p8 = p
        pv = torch.bmm(p8, v8[:, lo:hi])                                    # [Hkv, R, D] fp32
        if alpha is not None:
            acc = acc * alpha[..., None]
        if narrow is None:
            acc = acc + pv
        elif two_level:
            acc = acc + round_to_format(pv, narrow)
        else:
            acc = round_to_format(round_to_format(acc, narrow)
                                  + round_to_format(pv, narrow), narrow)
        m = m_new
    empty = row_sum == 0
    inv = torch.where(empty, torch.zeros_like(row_sum), 1.0 / row_sum)
    out = acc * (inv[..., None] * vs)                                       # [Hkv, R, D]
    out = out.reshape(H, n, D).transpose(0, 1)                              # [n, H, D]

    def per_query(x):                                                       # [Hkv, R] -> [n, H]
        return x.reshape(H, n).transpose(0, 1)
    if not return_stats:
        return out
    stats = {"flushed_mass": per_query(flushed_p * inv),
             "flushed_count": per_query(flushed_count)}
    return out, stats
