"""The attention-backend interface: what the model runner and every attention layer may
call on a backend (vLLM: ``vllm/attention/backends/abstract.py``, ``AttentionBackend``,
``AttentionImpl``, ``AttentionMetadataBuilder``; one class here plays all three).

Per step, the model runner calls ``build_metadata`` once on layer 0's backend (the
metadata is shared by every layer); then each layer's attention calls ``store`` (write
this step's K/V into its cache) and ``forward`` (attend over the cache). Two backends
implement it: TORCH (:mod:`.torch_ref`) and TRITON (:mod:`.triton_attn`).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from minivllm.attention.metadata import AttentionMetadata, CommonAttentionMetadata
from minivllm.quantization.kv_cache import LayerKVCache


@runtime_checkable
class AttentionBackend(Protocol):
    """An attention backend.

    Attributes:
        name: the ``EngineArgs.attention_backend`` name ("TORCH", "TRITON").
        needs_paged_metadata: its metadata is the block-table form
            (``AttentionMetadata.paged``), fixed-shape per batch size, which is what CUDA
            graphs capture; False: per-sequence read slots whose shapes change per step.
    """

    name: str
    needs_paged_metadata: bool

    def build_metadata(self, common: CommonAttentionMetadata) -> AttentionMetadata:
        """This backend's metadata for one step (vLLM: ``AttentionMetadataBuilder.build``).

        Args:
            common: the step's requests (rows, lengths, block tables, write slots).
        Returns:
            an :class:`AttentionMetadata` with ``slot_mapping = common.slot_mapping`` and
            this backend's read form filled in, on ``common.device``.
        """
        ...

    def store(self, kv: LayerKVCache, slot_mapping: torch.Tensor, k: torch.Tensor,
              v: torch.Tensor) -> None:
        """Write this step's K/V ([T, num_kv_heads, head_dim], compute dtype) at
        ``slot_mapping`` [T] int64 into ``kv`` (quantizing for an fp8/int8 cache); a
        negative slot is padding and is not written."""
        ...

    def forward(self, q: torch.Tensor, kv: LayerKVCache, meta: AttentionMetadata,
                scale: float) -> torch.Tensor:
        """Attention of q [T, num_heads, head_dim] (rotary applied) over ``kv``, which
        already holds this step's K/V: [T, num_heads, head_dim] in q's dtype."""
        ...

    def set_batch_invariant(self, on: bool) -> None:
        """Make a request's result independent of its batch (``EngineArgs.batch_invariant``)."""
        ...
