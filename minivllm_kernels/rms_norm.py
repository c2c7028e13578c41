"""RMSNorm and fused residual-add + RMSNorm (Triton), batch-invariant by construction.

RMSNorm (Zhang & Sennrich 2019, arXiv:1910.07467) as HF Llama computes it:
``y = weight * (x / sqrt(mean(x^2) + eps)).to(dtype)``, statistics in float32.

The fused form is vLLM's ``fused_add_rms_norm`` (``csrc/layernorm_kernels.cu``): it
adds the residual branch to the residual stream and normalises the sum in one pass,
``residual = x + residual; out = rms_norm(residual)``. Here the sum is rounded to the
activation dtype *before* its statistics are taken, as the unfused model does
(``h = x + attn``, then ``norm(h)``), so fused and unfused give the same numbers.

One program normalises one row with the whole row in registers, summing in a fixed
order; no other row takes part, so a row's output never depends on how many rows are in
the batch (the property :mod:`minivllm_kernels.batch_invariant` needs).
"""

from __future__ import annotations

import torch

from minivllm_kernels._quant import cast_rne
from minivllm_kernels._triton import device_ok, next_pow2, tl, triton
from minivllm_kernels.reference import rms_norm_ref  # the engine's RMSNorm (HF LlamaRMSNorm)


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, n_cols, stride_x, stride_r,
                     stride_o, stride_ro, eps, BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK)
    mask = c < n_cols
    x = tl.load(x_ptr + row * stride_x + c, mask=mask, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + c, mask=mask, other=0.0).to(tl.float32)
        xr = cast_rne(x + r, dtype)  # the residual stream, in the activation dtype
        tl.store(res_out_ptr + row * stride_ro + c, xr, mask=mask)
        x = xr.to(tl.float32)
    var = tl.sum(x * x, axis=0) / n_cols
    rstd = tl.div_rn(1.0, tl.sqrt_rn(var + eps))
    h = cast_rne(x * rstd, dtype).to(tl.float32)
    w = tl.load(w_ptr + c, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + c, cast_rne(w * h, dtype), mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim (Triton).

    Args:
        x: [..., hidden] float32/float16/bfloat16.
        weight: [hidden], same dtype as x.
        eps: added to the mean square.
    Returns:
        [..., hidden] in x's dtype.
    Raises:
        ValueError: shape or dtype mismatch.
    """
    device_ok(x, weight)
    if weight.shape != (x.shape[-1],) or weight.dtype != x.dtype:
        raise ValueError(f"weight must be [{x.shape[-1]}] in {x.dtype}, got "
                         f"{tuple(weight.shape)} in {weight.dtype}")
    x2 = _rows(x)
    out = torch.empty_like(x2)
    if x2.shape[0]:
        _rms_norm_kernel[(x2.shape[0],)](x2, x2, weight, out, out, x2.shape[1], x2.stride(0),
                                         x2.stride(0), out.stride(0), out.stride(0), float(eps),
                                         BLOCK=next_pow2(x2.shape[1]), HAS_RESIDUAL=False)
    return out.view(x.shape)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``residual = x + residual`` (rounded to x's dtype), then RMSNorm of it (Triton).

    Args:
        x, residual: [..., hidden], same shape and dtype.
        weight: [hidden], same dtype.
    Returns:
        ``(normed, new_residual)``, both [..., hidden] in x's dtype (new tensors; the
        inputs are not modified).
    Raises:
        ValueError: shape or dtype mismatch.
    """
    device_ok(x, residual, weight)
    if residual.shape != x.shape or residual.dtype != x.dtype:
        raise ValueError(f"residual must match x ({tuple(x.shape)}, {x.dtype}), got "
                         f"{tuple(residual.shape)}, {residual.dtype}")
    if weight.shape != (x.shape[-1],) or weight.dtype != x.dtype:
        raise ValueError(f"weight must be [{x.shape[-1]}] in {x.dtype}, got "
                         f"{tuple(weight.shape)} in {weight.dtype}")
    x2, r2 = _rows(x), _rows(residual)
    out, res_out = torch.empty_like(x2), torch.empty_like(x2)
    if x2.shape[0]:
        _rms_norm_kernel[(x2.shape[0],)](x2, r2, weight, out, res_out, x2.shape[1], x2.stride(0),
                                         r2.stride(0), out.stride(0), res_out.stride(0),
                                         float(eps), BLOCK=next_pow2(x2.shape[1]),
                                         HAS_RESIDUAL=True)
    return out.view(x.shape), res_out.view(x.shape)


def fused_add_rms_norm_ref(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference of :func:`fused_add_rms_norm`: the two unfused steps."""
    new_residual = x + residual
    return rms_norm_ref(new_residual, weight, eps), new_residual

