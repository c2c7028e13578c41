"""Triton kernels, each beside its PyTorch reference with the same signature.

Module map:

* ``reshape_and_cache``: store K/V into the paged cache (float, fp8, int8; static or
  dynamic scales) -- ``reshape_and_cache`` / ``reshape_and_cache_ref``.
* ``paged_attention``: decode attention, split-KV with a fixed split size --
  ``paged_attention_decode`` / ``paged_attention_decode_ref``.
* ``prefill_attention``: causal prefill / chunked prefill over the paged cache --
  ``paged_prefill_attention`` / ``paged_prefill_attention_ref``.
* ``rms_norm``: RMSNorm and fused residual add + RMSNorm -- ``rms_norm``,
  ``fused_add_rms_norm`` and their ``*_ref``.
* ``batch_invariant``: matmul and RMSNorm whose per-row results do not depend on the
  batch size -- ``matmul_batch_invariant`` / ``matmul_ref``, ``rms_norm_batch_invariant``.
* ``reference``: the numerics the kernels implement, in PyTorch only (RMSNorm, the KV
  storage rules); the engine's CPU path imports them from here, so ``minivllm_kernels/`` imports
  nothing from ``minivllm``.
* ``_triton``: imports Triton (interpreter on machines without CUDA); ``_quant``: the
  rounding helpers the kernels share.

On a machine without CUDA the kernels run in Triton's interpreter. Importing this package
sets ``TRITON_INTERPRET=1`` there; it must happen before Triton is first imported (torch's
compiler and transformers import it), so import ``minivllm`` or ``minivllm_kernels`` first, or set
``TRITON_INTERPRET=1`` in the environment.
"""

import os as _os

if "TRITON_INTERPRET" not in _os.environ:
    import torch as _torch

    if not _torch.cuda.is_available():
        _os.environ["TRITON_INTERPRET"] = "1"
