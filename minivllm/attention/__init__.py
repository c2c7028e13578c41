"""Attention over the paged KV cache: the per-layer cache (:mod:`.kv_cache`), metadata built
once per step (:mod:`.metadata`), and backends behind one protocol
(:mod:`.backends.abstract`)."""

from minivllm.attention.metadata import (AttentionMetadata, CommonAttentionMetadata,
                                         DecodeGroup, PrefillSeq)

__all__ = ["AttentionMetadata", "CommonAttentionMetadata", "DecodeGroup", "PrefillSeq"]
