"""Triton paged attention (default on CUDA; on CPU it runs in Triton's interpreter).

The same three steps as the TORCH reference, each a kernel from :mod:`minivllm_kernels`:

* store: :func:`minivllm_kernels.reshape_and_cache.reshape_and_cache` writes (and quantizes) this
  step's K/V into the cache;
* decode rows: :func:`minivllm_kernels.paged_attention.paged_attention_decode` (split-KV with a
  fixed split size, so a request's result does not depend on its batch);
* prefill rows (whole prompts, chunks, prompts after prefix-cache hits):
  :func:`minivllm_kernels.prefill_attention.paged_prefill_attention`.

Kernels read K/V straight through the block tables (``AttentionMetadata.paged``); no
gathered copy of the keys is made. vLLM: ``vllm/v1/attention/backends/triton_attn.py``.
"""

from __future__ import annotations

import torch

from minivllm.attention.metadata import (AttentionMetadata, CommonAttentionMetadata,
                                         PagedMetadata)
from minivllm.quantization.kv_cache import LayerKVCache


class TritonAttentionBackend:
    """The paged-kernel backend; an
    :class:`~minivllm.attention.backends.abstract.AttentionBackend`."""

    name = "TRITON"
    needs_paged_metadata = True

    def __init__(self):
        # Imported here: kernels sets TRITON_INTERPRET=1 on machines without CUDA, which
        # must happen before Triton is first imported.
        from minivllm_kernels.paged_attention import paged_attention_decode
        from minivllm_kernels.prefill_attention import paged_prefill_attention
        from minivllm_kernels.reshape_and_cache import reshape_and_cache

        self._decode = paged_attention_decode
        self._prefill = paged_prefill_attention
        self._store = reshape_and_cache

    def set_batch_invariant(self, on: bool) -> None:
        """Nothing to change: the decode kernel is already batch-invariant (fixed split
        size, splits merged in order) and prefills run one sequence per program."""

    def build_metadata(self, common: CommonAttentionMetadata) -> AttentionMetadata:
        """The block-table form of one step (``AttentionMetadata.paged``): padded int32
        block tables and lengths of the decodes and of the prefills, on the device.
        vLLM: ``TritonAttentionMetadataBuilder.build``."""
        c, dev = common, common.device

        def i32(values):
            return torch.tensor(values, dtype=torch.int32, device=dev)

        def tables(rows):
            width = max(len(t) for t in rows)
            return i32([t + [0] * (width - len(t)) for t in rows])

        p = PagedMetadata(block_size=c.block_size)
        dec, pre = c.decodes(), c.prefills()
        if dec:
            decode_lens = [c.seq_lens[i] for i in dec]
            all_rows = len(dec) == c.num_actual_tokens  # then rows are 0..B-1 in order
            p.decode_rows = None if all_rows else \
                torch.tensor([c.query_starts[i] for i in dec], device=dev)
            p.decode_block_tables = tables([c.block_tables[i] for i in dec])
            p.decode_seq_lens = i32(decode_lens)
            p.decode_max_seq_len = max(decode_lens)
        if pre:
            prefill_ns = [c.query_lens[i] for i in pre]
            p.prefill_query_starts = i32([c.query_starts[i] for i in pre])
            p.prefill_query_lens = i32(prefill_ns)
            p.prefill_seq_lens = i32([c.seq_lens[i] for i in pre])
            p.prefill_block_tables = tables([c.block_tables[i] for i in pre])
            p.prefill_max_query_len = max(prefill_ns)
        return AttentionMetadata(slot_mapping=c.slot_mapping, paged=p)

    def store(self, kv: LayerKVCache, slot_mapping: torch.Tensor, k: torch.Tensor,
              v: torch.Tensor) -> None:
        """Write this step's K/V ([T, kv_heads, head_dim]) at slot_mapping [T]."""
        kv.note_nonfinite(k, v)
        self._store(k, v, kv.key, kv.value, slot_mapping, kv.k_scale, kv.v_scale,
                    kv.k_scale_cache, kv.v_scale_cache)

    def forward(self, q: torch.Tensor, kv: LayerKVCache, meta: AttentionMetadata,
                scale: float) -> torch.Tensor:
        """Same contract as :meth:`TorchAttentionBackend.forward`; needs ``meta.paged``.

        Raises:
            ValueError: the metadata has no block-table form.
        """
        p = meta.paged
        if p is None:
            raise ValueError("the TRITON attention backend needs AttentionMetadata.paged "
                             "(block tables); this metadata only has the TORCH form")
        scales = (kv.k_scale, kv.v_scale, kv.k_scale_cache, kv.v_scale_cache)
        out = torch.empty_like(q)
        if p.num_decodes:
            assert p.decode_block_tables is not None and p.decode_seq_lens is not None
            rows = p.decode_rows
            qd = q if rows is None else q.index_select(0, rows)
            od = self._decode(qd, kv.key, kv.value, p.decode_block_tables, p.decode_seq_lens,
                              p.block_size, scale, *scales, max_seq_len=p.decode_max_seq_len,
                              out=out if rows is None else None)
            if rows is not None:
                out.index_copy_(0, rows, od)
        if p.num_prefills:
            assert (p.prefill_block_tables is not None and p.prefill_query_starts is not None
                    and p.prefill_query_lens is not None and p.prefill_seq_lens is not None)
            self._prefill(q, kv.key, kv.value, p.prefill_block_tables, p.prefill_query_starts,
                          p.prefill_query_lens, p.prefill_seq_lens, p.block_size, scale,
                          *scales, max_query_len=p.prefill_max_query_len, out=out)
        return out
