"""Per-step attention metadata, built by the model runner and shared by every layer.

vLLM: ``vllm/v1/attention/backends/*`` (``*AttentionMetadata``). The flat token batch is
``[num_tokens]``; ``slot_mapping[t]`` is where token t's K/V is written
(``block_id * block_size + offset``). Reads go through per-sequence slot lists derived
from the block tables.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class PrefillSeq:
    """One sequence with more than one new token in this step (a prompt or a chunk).

    Attributes:
        start, end: its query rows in the flat batch.
        kv_slots: [seq_len] int64, cache slots of all its tokens so far (context + new).
        mask: [num_new, seq_len] bool (True = attend), or None when the chunk is the
            whole sequence and plain causal masking applies.
    """

    start: int
    end: int
    kv_slots: torch.Tensor
    mask: torch.Tensor | None


@dataclass
class DecodeGroup:
    """Single-token (decode) queries of sequences with similar lengths, batched.

    Attributes:
        rows: [B] int64 query rows in the flat batch.
        kv_slots: [B, max_seq_len] int64 read slots (padded with slot 0).
        mask: [B, 1, 1, max_seq_len] bool, True for real keys.
    """

    rows: torch.Tensor
    kv_slots: torch.Tensor
    mask: torch.Tensor


@dataclass
class AttentionMetadata:
    """Everything attention needs for one step.

    Attributes:
        slot_mapping: [num_tokens] int64 write slots.
        decodes: decode queries, grouped by sequence length so that one long sequence
            does not make every short one pad to its length.
        prefills: sequences with several new tokens.
    """

    slot_mapping: torch.Tensor
    decodes: list[DecodeGroup] = field(default_factory=list)
    prefills: list[PrefillSeq] = field(default_factory=list)
