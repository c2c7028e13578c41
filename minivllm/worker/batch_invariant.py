"""The batch-invariant mode (``EngineArgs.batch_invariant``; course chapter 5): every
step's per-request result independent of the batch (vLLM: ``VLLM_BATCH_INVARIANT=1``,
``vllm/model_executor/layers/batch_invariant.py``; Thinking Machines 2025)."""

from __future__ import annotations

from typing import Any

import torch


def use_batch_invariant(model, device: torch.device) -> None:
    """Switch ``model`` (our LlamaForCausalLM, its layers' attention backends included)
    to the batch-invariant mode:

    * Decode attention (TORCH backend): one sequence at a time over its own keys
      (:func:`~minivllm.attention.backends.torch_ref.decode_attention_batch_invariant`)
      instead of one masked SDPA over keys padded to the decode group's longest
      sequence, whose bits depend on the padded length. The TRITON backend's paged
      kernel is already invariant (fixed split size, splits merged in order).
    * Linear layers: CPU, one row at a time (:func:`~minivllm.layers.linear.rowwise`:
      oneDNN's float32 GEMM gives a row different bits at M >= 2 than alone); CUDA,
      ``minivllm_kernels.batch_invariant.linear_batch_invariant`` (fixed tiles, no split-K).
      Quantized layers: one row at a time on both.
    * LM head: one row at a time (``ModelRunner._compute_logits``).
    * RMSNorm: CPU, unchanged: ``rms_norm_ref`` reduces each row on its own (torch's
      CPU reduction over the contiguous last dimension; checked bitwise in
      ``tests/test_batch_invariant.py``); CUDA, the one-row-per-program Triton kernel
      (``minivllm_kernels.batch_invariant.rms_norm_batch_invariant``).
    * Prefill attention already runs one sequence at a time.
    Swapped steps (``LLM.swap_step``) still replace these inside their ``with`` block.
    """
    from minivllm.layers.linear import Linear, QuantLinear
    from minivllm.layers.rms_norm import RMSNorm

    cuda = device.type == "cuda"
    linear: Any = "rows"
    if cuda:
        from minivllm_kernels.batch_invariant import linear_batch_invariant, rms_norm_batch_invariant

        linear = linear_batch_invariant
    for layer in model.layers:
        layer.self_attn.backend.set_batch_invariant(True)
    for name, m in model.named_modules():
        if isinstance(m, Linear) and name != "lm_head":
            m.batch_invariant = linear
        elif isinstance(m, QuantLinear):
            m.batch_invariant = "rows"  # type: ignore[assignment]
        elif cuda and isinstance(m, RMSNorm):
            if m.fused_add_impl is not None:
                from minivllm_kernels.rms_norm import fused_add_rms_norm

                m.use_kernels(rms_norm_batch_invariant, fused_add_rms_norm)
            else:
                m.impl = rms_norm_batch_invariant
