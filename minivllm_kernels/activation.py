"""SwiGLU's activation: ``silu(gate) * up`` in one kernel (Triton).

The MLP's fused ``gate_up_proj`` returns ``[T, 2 * I]`` (gate in the first half, up in
the second); this kernel reads both halves and writes ``silu(gate) * up`` ``[T, I]``.
The PyTorch reference takes two kernels (``F.silu``, then the multiply) and a
``[T, I]`` intermediate. vLLM: ``silu_and_mul`` (``csrc/activation_kernels.cu``,
``SiluAndMul`` in ``vllm/model_executor/layers/activation.py``).

Rounding follows the reference: ``silu(g) = g / (1 + exp(-g))`` in float32, rounded to
the activation dtype, then the product in float32, rounded again. The division is
IEEE (``div_rn``) and, compiled for CUDA, ``exp`` is CUDA's ``expf``, as in PyTorch's
kernel. In the interpreter ``exp`` is NumPy's, which can differ from PyTorch's CPU exp
by an ulp; an output can then differ by an ulp of its dtype (rare; the tests bound it).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from minivllm_kernels._quant import cast_rne
from minivllm_kernels._triton import INTERPRET, device_ok, tl, triton

BLOCK = 1024
_INTERPRETED = tl.constexpr(INTERPRET)
if not INTERPRET:
    from triton.language.extra import libdevice


@triton.jit
def _exp(x):
    """float32 exp: compiled, CUDA's ``expf`` (libdevice), which PyTorch's silu calls
    (``tl.exp`` would be the faster ``ex2.approx``, up to ~10 ulp off for |x| ~ 10); the
    interpreter has no libdevice and uses NumPy's exp."""
    if _INTERPRETED:
        y = tl.exp(x)
    else:
        y = libdevice.exp(x)
    return y


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, n_cols, stride_x, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = c < n_cols
    g = tl.load(x_ptr + row * stride_x + c, mask=mask, other=0.0)
    u = tl.load(x_ptr + row * stride_x + n_cols + c, mask=mask, other=0.0)
    dt = g.dtype
    g32 = g.to(tl.float32)
    s = cast_rne(tl.div_rn(g32, 1.0 + _exp(-g32)), dt)
    tl.store(out_ptr + row * stride_o + c, cast_rne(s.to(tl.float32) * u.to(tl.float32), dt),
             mask=mask)


def silu_and_mul(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``silu(x[:, :I]) * x[:, I:]`` (Triton).

    Args:
        x: [T, 2 * I] float32/float16/bfloat16, last dim contiguous.
        out: optional [T, I] output in x's dtype (last dim contiguous).
    Returns:
        [T, I] in x's dtype.
    Raises:
        ValueError: not 2-D, odd last dim, unsupported dtype, a strided last dim, or an
            ``out`` of another shape or dtype.
    """
    device_ok(x)
    if x.ndim != 2 or x.shape[1] % 2 or x.dtype not in (torch.float32, torch.float16,
                                                        torch.bfloat16):
        raise ValueError(f"silu_and_mul: x must be [tokens, 2 * intermediate] in float32/"
                         f"float16/bfloat16, got {tuple(x.shape)} {x.dtype}")
    if x.stride(1) != 1:
        raise ValueError("silu_and_mul: the last dim of x must be contiguous")
    T, n = x.shape[0], x.shape[1] // 2
    if out is None:
        out = torch.empty(T, n, dtype=x.dtype, device=x.device)
    elif out.shape != (T, n) or out.dtype != x.dtype or out.stride(1) != 1:
        raise ValueError(f"silu_and_mul: out must be [{T}, {n}] {x.dtype} with a contiguous "
                         f"last dim, got {tuple(out.shape)} {out.dtype}")
    if T:
        _silu_and_mul_kernel[(T, triton.cdiv(n, BLOCK))](x, out, n, x.stride(0), out.stride(0),
                                                         BLOCK=BLOCK)
    return out


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """Reference of :func:`silu_and_mul` (what ``LlamaMLP`` computes without kernels)."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
