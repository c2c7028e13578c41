"""Attention over the paged KV cache: metadata built once per step, and backends."""

from minivllm.attention.metadata import AttentionMetadata, DecodeGroup, PrefillSeq

__all__ = ["AttentionMetadata", "DecodeGroup", "PrefillSeq"]
