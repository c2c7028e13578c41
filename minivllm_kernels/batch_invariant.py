"""Batch-invariant matmul and RMSNorm: a row's result does not depend on the batch size.

Why this exists (course chapter 30, and Thinking Machines' "Defeating Nondeterminism in
LLM Inference", 2025, with its ``batch_invariant_ops`` library): at temperature 0 the
same prompt can give different text depending on what else the server is batching,
because libraries pick matmul tilings, split-K factors and reduction trees *by shape*.
Floating-point addition is not associative, so a different M (number of rows) can change
every row's low bits, and after enough tokens a greedy argmax flips.

The fix is to make the reduction order a function of the row alone:

* :func:`matmul_batch_invariant`: fixed BLOCK_M/N/K whatever M is, no split-K; each
  output element sums its K products tile by tile in the same order, so row i of
  ``a @ b`` is bit-identical for every M.
* :func:`rms_norm_batch_invariant`: one program per row, whole row at once (the plain
  :func:`minivllm_kernels.rms_norm.rms_norm` kernel already is).

They trade speed for that property (no shape-tuned tiling, no split-K for small M).

In Triton's interpreter (CPU) the matmul kernel does not use ``tl.dot`` for its tiles;
see :func:`_tile_dot_interpreted` for why (the interpreter's ``tl.dot`` is
``numpy.matmul``, i.e. BLAS, whose summation order for an element depends on where its
row sits inside the tile). Compiled for a GPU the kernel is unchanged: ``tl.dot``.
"""

from __future__ import annotations

from typing import Optional

import torch

from minivllm_kernels._quant import cast_rne
from minivllm_kernels._triton import INTERPRET, device_ok, tl, triton
from minivllm_kernels.rms_norm import rms_norm, rms_norm_ref

BLOCK_M, BLOCK_N, BLOCK_K = 32, 64, 32  # fixed: never chosen from the shape


@triton.jit
def _tile_dot_interpreted(a, b):
    """``a @ b`` for one [BLOCK_M, BLOCK_K] x [BLOCK_K, BLOCK_N] tile, float32, with the
    same summation order for every row: only ever used in Triton's interpreter.

    Why not ``tl.dot`` there: the interpreter evaluates ``tl.dot`` as ``numpy.matmul``,
    i.e. BLAS sgemm, and BLAS kernels sum an element's K products in an order that depends
    on where the element sits in their register blocking. OpenBLAS's Haswell sgemm
    kernel (numpy 2.4's OpenBLAS 0.3.31 DYNAMIC_ARCH picks it on an AMD EPYC, also with
    OPENBLAS_CORETYPE=Zen) sums tile rows 6-11 and 18-23 as one sequential FMA chain,
    rows 24-31 as two interleaved (even k / odd k) FMA chains added at the end, and row
    0 one way or the other depending on the column. A row of ``a`` is at tile
    row ``i % BLOCK_M`` in a batch but at tile row 0 alone, so its low bits changed with
    the batch (test_matmul_batch_invariant: "row 40 alone: 16 of 80 elements differ").
    Evidence, with a [32, 32] @ [32, 64] tile: the same row placed at tile row 0..31
    (other rows random) gives 86788 of 409600 elements (200 rows x 32 positions x 64
    columns) whose bits differ from the row-0 result with ``numpy.matmul``, and 0 with
    the form below. OpenBLAS's Sandybridge kernel happens to be invariant; other BLAS
    builds need not be, so BLAS is taken out of the reduction altogether.

    The form used instead: products ``a[m, k] * b[k, n]`` as an elementwise float32
    multiply (correctly rounded per element, no FMA contraction in NumPy, so SIMD width
    and alignment cannot change a result), summed over k by ``tl.sum`` (the interpreter
    calls ``numpy.sum(..., axis=1)``, which adds the k-slices of the
    [BLOCK_M, BLOCK_K, BLOCK_N] block the same way for every (m, n)). An element's result
    therefore depends on its own row and column only. 16-bit inputs are upcast first,
    so their products are exact (this also replaces the bfloat16 UPCAST of
    :func:`minivllm_kernels._quant.dot`: the interpreter's bfloat16 ``tl.dot`` is wrong).
    """
    prod = a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :]
    return tl.sum(prod, axis=1)


@triton.jit
def _matmul_kernel(a_ptr, b_ptr, bias_ptr, c_ptr, M, N, K, stride_am, stride_ak, stride_bk,
                   stride_bn, stride_cm, stride_cn, HAS_BIAS: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   PRECISION: tl.constexpr, INTERPRETED: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):  # the same K order for every row and every M
        kk = k0 + rk
        a = tl.load(a_ptr + rm[:, None].to(tl.int64) * stride_am + kk[None, :] * stride_ak,
                    mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0)
        b = tl.load(b_ptr + kk[:, None] * stride_bk + rn[None, :].to(tl.int64) * stride_bn,
                    mask=(kk[:, None] < K) & (rn[None, :] < N), other=0.0)
        if INTERPRETED:  # constexpr: a compiled (GPU) kernel never contains this branch
            acc += _tile_dot_interpreted(a, b)  # BLAS's order depends on the tile row
        else:
            acc += tl.dot(a, b, input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    tl.store(c_ptr + rm[:, None].to(tl.int64) * stride_cm + rn[None, :] * stride_cn,
             cast_rne(acc, c_ptr.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))


def matmul_batch_invariant(a: torch.Tensor, b: torch.Tensor,
                           bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``a @ b (+ bias)`` with a tiling that never depends on M (Triton).

    Args:
        a: [M, K]; b: [K, N]; bias: [N] or None; all float32/float16/bfloat16, one dtype.
    Returns:
        [M, N] in a's dtype; float32 accumulation (IEEE float32 on GPUs, not TF32; in
        the interpreter, float32 products summed without BLAS, see
        :func:`_tile_dot_interpreted`).
    Raises:
        ValueError: shapes or dtypes that do not match.
    """
    device_ok(a, b, bias)
    if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[0]:
        raise ValueError(f"matmul_batch_invariant needs [M, K] @ [K, N], got "
                         f"{tuple(a.shape)} @ {tuple(b.shape)}")
    if b.dtype != a.dtype or (bias is not None and (bias.dtype != a.dtype
                                                     or bias.shape != (b.shape[1],))):
        raise ValueError("a, b and bias must share one dtype, and bias must be [N]")
    M, K = a.shape
    N = b.shape[1]
    c = torch.empty(M, N, dtype=a.dtype, device=a.device)
    if M == 0 or N == 0:
        return c
    grid = (triton.cdiv(M, BLOCK_M), triton.cdiv(N, BLOCK_N))
    _matmul_kernel[grid](a, b, bias if bias is not None else a, c, M, N, K, a.stride(0),
                         a.stride(1), b.stride(0), b.stride(1), c.stride(0), c.stride(1),
                         HAS_BIAS=bias is not None, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
                         BLOCK_K=BLOCK_K,
                         PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
                         INTERPRETED=INTERPRET)
    return c


def linear_batch_invariant(x: torch.Tensor, weight: torch.Tensor,
                           bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``F.linear`` semantics (x [..., K], weight [N, K]) on :func:`matmul_batch_invariant`."""
    out = matmul_batch_invariant(x.reshape(-1, x.shape[-1]), weight.t(), bias)
    return out.view(*x.shape[:-1], weight.shape[0])


def matmul_ref(a: torch.Tensor, b: torch.Tensor,
               bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Reference of :func:`matmul_batch_invariant`: float32 (float64-exact for 16-bit
    inputs up to summation order) matmul, cast to a's dtype."""
    c = a.float() @ b.float()
    if bias is not None:
        c = c + bias.float()
    return c.to(a.dtype)


def rms_norm_batch_invariant(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Batch-invariant RMSNorm: :func:`minivllm_kernels.rms_norm.rms_norm` (one row per program)."""
    return rms_norm(x, weight, eps)


rms_norm_batch_invariant_ref = rms_norm_ref
