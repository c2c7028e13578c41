"""RMSNorm (Zhang & Sennrich 2019, arXiv:1910.07467), computed as HF Llama does.

``y = weight * (x / sqrt(mean(x^2) + eps))`` with the mean and the normalisation in
float32 whatever the input dtype, then cast back before the weight multiply (HF
``LlamaRMSNorm``; vLLM ``vllm/model_executor/layers/layernorm.py``).
"""

from __future__ import annotations

import torch
from torch import nn


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Reference RMSNorm. x: [..., hidden] (any float dtype); weight: [hidden]. Same dtype out."""
    input_dtype = x.dtype
    h = x.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + eps)
    return weight * h.to(input_dtype)


class RMSNorm(nn.Module):
    """RMSNorm layer. ``impl`` may be swapped (a function with rms_norm_ref's signature)
    to plant a fault or hand the step to a learner."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.impl = rms_norm_ref
        self.fused_add_impl = None  # (x, residual, weight, eps) -> (normed, x + residual)
        self._kernel_impl = None  # the impl fused_add_impl belongs to

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.impl(x, self.weight, self.eps)

    def use_kernels(self, impl, fused_add_impl) -> None:
        """Run ``impl`` (e.g. ``kernels.rms_norm.rms_norm``) and, in :meth:`add_and_norm`,
        the fused residual-add version."""
        self.impl = self._kernel_impl = impl
        self.fused_add_impl = fused_add_impl

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor):
        """``h = residual + x; return self(h), h``, in one fused kernel when kernels are in
        use and ``impl`` has not been swapped since (a planted fault still runs).
        Forward hooks on this module do not see the fused call."""
        if self.fused_add_impl is not None and self.impl is self._kernel_impl:
            return self.fused_add_impl(x, residual, self.weight, self.eps)
        h = residual + x
        return self(h), h
