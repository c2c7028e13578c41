"""RMSNorm (Zhang & Sennrich 2019, arXiv:1910.07467), computed as HF Llama does.

``y = weight * (x / sqrt(mean(x^2) + eps))`` with the mean and the normalisation in
float32 whatever the input dtype, then cast back before the weight multiply (HF
``LlamaRMSNorm``; vLLM ``vllm/model_executor/layers/layernorm.py``).
"""

from __future__ import annotations

import torch
from torch import nn

from minivllm_kernels.reference import rms_norm_ref  # the engine's RMSNorm (minivllm_kernels/reference.py)


def fused_add_rms_norm_ref(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The "fused_add_rms_norm" step's reference (:mod:`minivllm.steps`): add a sublayer's
    output to the residual stream and normalise the sum, vLLM's ``fused_add_rms_norm``
    (``csrc/layernorm_kernels.cu``; ``RMSNorm.forward_native(x, residual)`` in
    ``vllm/model_executor/layers/layernorm.py``).

    Args:
        x: [..., hidden] the sublayer's output (attention or MLP), activation dtype.
        residual: [..., hidden] the residual stream before the add, same dtype.
        weight: [hidden]; eps: the norm's epsilon.
    Returns:
        ``(normed, residual)``: ``residual = residual + x`` rounded to the activation
        dtype (where an fp16 stream past 65504 becomes inf), ``normed =
        rms_norm_ref(residual, weight, eps)``. vLLM's native path adds in float32 and
        normalises the unrounded sum; here the rounded sum is normalised, as the unfused
        model does (``h = x + attn``, then ``norm(h)``), so fused and unfused agree bit
        for bit (``minivllm_kernels/rms_norm.py`` does the same).
    """
    h = residual + x
    return rms_norm_ref(h, weight, eps), h


class RMSNorm(nn.Module):
    """RMSNorm layer. ``impl`` may be swapped (a function with rms_norm_ref's signature)
    to plant a fault or hand the step to a learner."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.impl = rms_norm_ref
        self.fused_add_impl = None  # (x, residual, weight, eps) -> (normed, x + residual)
        # the "fused_add_rms_norm" step when swapped (minivllm.steps); None: the add,
        # then this norm's impl (or the fused kernel)
        self.add_impl = None
        self._kernel_impl = None  # the impl fused_add_impl belongs to

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.impl(x, self.weight, self.eps)

    def use_kernels(self, impl, fused_add_impl) -> None:
        """Run ``impl`` (e.g. ``minivllm_kernels.rms_norm.rms_norm``) and, in :meth:`add_and_norm`,
        the fused residual-add version."""
        self.impl = self._kernel_impl = impl
        self.fused_add_impl = fused_add_impl

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor):
        """``h = residual + x; return self(h), h``, in one fused kernel when kernels are in
        use and ``impl`` has not been swapped since (a planted fault still runs).
        Forward hooks on this module do not see the fused call. A swapped
        "fused_add_rms_norm" step (``add_impl``) runs instead of both."""
        if self.add_impl is not None:
            return self.add_impl(x, residual, self.weight, self.eps)
        if self.fused_add_impl is not None and self.impl is self._kernel_impl:
            return self.fused_add_impl(x, residual, self.weight, self.eps)
        h = residual + x
        return self(h), h
