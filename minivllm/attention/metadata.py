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
class AttentionMetadata:
    """Everything attention needs for one step.

    Attributes:
        slot_mapping: [num_tokens] int64 write slots.
        decode_rows: [num_decodes] int64 rows of single-token (decode) queries.
        decode_kv_slots: [num_decodes, max_seq_len] int64 read slots (padded with 0).
        decode_mask: [num_decodes, 1, 1, max_seq_len] bool, True for real keys.
        prefills: sequences with several new tokens.
    """

    slot_mapping: torch.Tensor
    decode_rows: torch.Tensor | None = None
    decode_kv_slots: torch.Tensor | None = None
    decode_mask: torch.Tensor | None = None
    prefills: list[PrefillSeq] = field(default_factory=list)
