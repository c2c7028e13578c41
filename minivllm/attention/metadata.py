"""Per-step attention metadata: what the model runner knows (:class:`CommonAttentionMetadata`)
and what each backend builds from it (:class:`AttentionMetadata`), shared by every layer.

vLLM: ``vllm/v1/attention/backends/*`` (``*AttentionMetadata``). The flat token batch is
``[num_tokens]``; ``slot_mapping[t]`` is where token t's K/V is written
(``block_id * block_size + offset``; negative = padding, not written).

Two read forms, one per backend:

* TORCH (reference): per-sequence read slots (``decodes``, ``prefills``),
  gathered into dense tensors for ``scaled_dot_product_attention``;
* TRITON: block tables and lengths (``paged``), walked by the kernels in
  :mod:`minivllm_kernels`, which never materialise the gathered keys.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import torch


@dataclass
class PrefillSeq:
    """One sequence with more than one new token in this step (a prompt or a chunk).

    Attributes:
        start, end: its query rows in the flat batch (the last end - start positions of
            the sequence; earlier chunks or cached prefix blocks precede them).
        kv_slots: [L] int64, the cache slots its queries read (the reference: all its
            tokens so far, context + new, L = seq_len).
        mask: None for the standard chunk mask (query i attends to keys 0..L - n + i,
            the "attention.prefill" step's own convention), else [n, L] bool, True where
            query i may attend to key j (set only when a swapped "prefill_chunk" step
            returns another mask; the TORCH backend then runs
            :func:`~minivllm.attention.backends.torch_ref.prefill_attention_masked`).
    """

    start: int
    end: int
    kv_slots: torch.Tensor
    mask: Optional[torch.Tensor] = None


@dataclass
class DecodeGroup:
    """Single-token (decode) queries of sequences with similar lengths, batched.

    Attributes:
        rows: [B] int64 query rows in the flat batch.
        kv_slots: [B, max_seq_len] int64 read slots (padding positions read whatever
            slot the padded block table gives them).
        seq_lens: [B] int64 real lengths (keys at positions >= seq_lens[b] are padding).
        mask: [B, 1, 1, max_seq_len] bool, True for real keys.
    """

    rows: torch.Tensor
    kv_slots: torch.Tensor
    seq_lens: torch.Tensor
    mask: torch.Tensor


@dataclass
class PagedMetadata:
    """Block-table form of a step (TRITON backend). int32 tensors on the device.

    Attributes:
        block_size: tokens per cache block.
        decode_rows: [Bd] int64 rows of the single-token queries in the flat batch, or
            None when every row is a decode, in order (pure-decode steps, CUDA graphs).
        decode_block_tables: [Bd, max_blocks]; decode_seq_lens: [Bd] (0 = padding row).
        decode_max_seq_len: an upper bound of decode_seq_lens (host int: no sync).
        prefill_query_starts, prefill_query_lens, prefill_seq_lens: [Bp] for the
            sequences with several new tokens; prefill_block_tables: [Bp, max_blocks].
        prefill_max_query_len: host int.
    """

    block_size: int
    decode_rows: Optional[torch.Tensor] = None
    decode_block_tables: Optional[torch.Tensor] = None
    decode_seq_lens: Optional[torch.Tensor] = None
    decode_max_seq_len: int = 0
    prefill_query_starts: Optional[torch.Tensor] = None
    prefill_query_lens: Optional[torch.Tensor] = None
    prefill_seq_lens: Optional[torch.Tensor] = None
    prefill_block_tables: Optional[torch.Tensor] = None
    prefill_max_query_len: int = 0

    @property
    def num_decodes(self) -> int:
        return 0 if self.decode_seq_lens is None else self.decode_seq_lens.shape[0]

    @property
    def num_prefills(self) -> int:
        return 0 if self.prefill_query_lens is None else self.prefill_query_lens.shape[0]


@dataclass
class AttentionMetadata:
    """Everything attention needs for one step.

    Attributes:
        slot_mapping: [num_tokens] int64 write slots.
        decodes: decode queries, grouped by sequence length so that one long sequence
            does not make every short one pad to its length.
        prefills: sequences with several new tokens.
        paged: the block-table form (built when the backend asks for it).
    """

    slot_mapping: torch.Tensor
    decodes: list[DecodeGroup] = field(default_factory=list)
    prefills: list[PrefillSeq] = field(default_factory=list)
    paged: Optional[PagedMetadata] = None


def slot_mapping_ref(block_table: torch.Tensor, positions: torch.Tensor,
                     block_size: int) -> torch.Tensor:
    """Cache slot of each position: ``block_table[pos // block_size] * block_size + pos %
    block_size`` (the "slot_mapping" step, :mod:`minivllm.steps`).

    Args:
        block_table: [..., num_blocks] int64, the physical block ids of one sequence's
            logical blocks (or a batch of such rows).
        positions: [..., n] int64 token positions, the same leading dims as block_table
            (every position < num_blocks * block_size).
        block_size: tokens per block.
    Returns:
        [..., n] int64 slots. The model runner uses it for the slots a step writes and for
        the slots the TORCH backend reads. vLLM: ``BlockTable.compute_slot_mapping``
        (``vllm/v1/worker/block_table.py``).
    """
    return block_table.gather(-1, positions // block_size) * block_size + positions % block_size


def chunk_causal_mask(n: int, seq_len: int, device=None) -> torch.Tensor:
    """The causal mask of a prefill chunk: [n, seq_len] bool, row i (the chunk's query at
    position ``seq_len - n + i``) True for keys ``0 .. seq_len - n + i``. This is the
    "bottom-right aligned" causal mask of FlashAttention's varlen kernel when
    ``seqlen_k > seqlen_q``; with ``n == seq_len`` it is the lower triangle."""
    if n < 1 or seq_len < n:
        raise ValueError(f"a chunk needs 1 <= n <= seq_len, got n={n}, seq_len={seq_len}")
    q_pos = torch.arange(seq_len - n, seq_len, device=device)
    return torch.arange(seq_len, device=device)[None, :] <= q_pos[:, None]


def prefill_chunk_ref(block_table: torch.Tensor, start: int, n: int, block_size: int,
                      num_tokens: int, slot_mapping=slot_mapping_ref
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """What one prefill chunk attends to (the "prefill_chunk" step, :mod:`minivllm.steps`;
    course chapter 23).

    A request whose ``num_tokens`` tokens are prefilled in chunks (``enable_chunked_prefill``,
    chunks of at most ``max_num_batched_tokens``) computes positions ``start .. start + n -
    1`` in this step; positions ``0 .. start - 1`` (earlier chunks, or prefix-cache hits)
    are already in the cache, positions ``>= start + n`` are not written yet.

    Args:
        block_table: [num_blocks] int64, the request's physical blocks (at least
            ``ceil((start + n) / block_size)`` of them; more may be allocated ahead).
        start: the first new position (``num_computed_tokens``), >= 0.
        n: new tokens in this chunk, >= 1.
        block_size: tokens per block.
        num_tokens: the request's whole length (prompt and output so far),
            ``>= start + n``. The reference does not use it beyond this check: the key
            length is ``seqlen_k = start + n``, never ``num_tokens`` (nano-vllm PR #213).
        slot_mapping: the position -> slot function (the engine passes its
            "slot_mapping.read" step; a swapped step is called without it).
    Returns:
        ``(kv_slots, mask)``: kv_slots [start + n] int64, the slots of positions
        ``0 .. start + n - 1`` (every earlier chunk and this one, in position order);
        mask [n, start + n] bool, :func:`chunk_causal_mask` (query i, at position
        ``start + i``, attends to keys ``0 .. start + i``).
    Raises:
        ValueError: ``n < 1``, ``start < 0``, ``start + n > num_tokens``, or a block
            table too short for ``start + n`` tokens.

    vLLM: ``CommonAttentionMetadata`` (``query_start_loc``, ``seq_lens = num_computed +
    num_scheduled``) built in ``vllm/v1/worker/gpu_model_runner.py``; FlashAttention's
    varlen kernel takes ``cu_seqlens_k`` from those ``seq_lens`` and aligns the causal
    mask bottom-right.
    """
    if n < 1 or start < 0 or start + n > num_tokens:
        raise ValueError(f"a prefill chunk needs n >= 1, start >= 0 and start + n <= "
                         f"num_tokens; got start={start}, n={n}, num_tokens={num_tokens}")
    seq_len = start + n
    if block_table.shape[-1] * block_size < seq_len:
        raise ValueError(f"block table of {block_table.shape[-1]} blocks x {block_size} "
                         f"holds {block_table.shape[-1] * block_size} tokens; the chunk "
                         f"needs {seq_len}")
    kv_slots = slot_mapping(block_table, torch.arange(seq_len), block_size)
    return kv_slots, chunk_causal_mask(n, seq_len, block_table.device)


@dataclass
class CommonAttentionMetadata:
    """What the model runner knows about one step's requests, before any backend has
    shaped it: each backend's ``build_metadata``
    (:class:`~minivllm.attention.backends.abstract.AttentionBackend`) turns it into its
    own :class:`AttentionMetadata`. vLLM: ``CommonAttentionMetadata``
    (``vllm/v1/attention/backends/utils.py``), which ``AttentionMetadataBuilder.build``
    takes.

    Request i (in batch order) has ``query_lens[i]`` new tokens at rows
    ``query_starts[i] ..`` of the flat batch, positions ``seq_lens[i] - query_lens[i] ..
    seq_lens[i] - 1``. A request with one new token is a decode, any other a prefill
    (a prompt, a chunk, or a speculative verification).

    Attributes:
        slot_mapping: [num_actual_tokens] int64 write slots, on the device (the
            "slot_mapping" step).
        query_starts, query_lens, seq_lens: host ints per request (vLLM:
            ``query_start_loc[:-1]``, its differences, ``seq_lens``).
        num_tokens: host ints per request, its whole length (prompt + output so far +
            drafts), ``>= seq_lens[i]`` (the "prefill_chunk" step's ``num_tokens``).
        block_tables: per request its physical block ids (long enough for seq_lens).
        num_actual_tokens: the rows of the flat batch (``sum(query_lens)``).
        block_size: tokens per cache block; device: where the metadata lives.
        num_slots: slots in each layer's cache (None: unknown; bounds a swapped
            "prefill_chunk" step's slots).
        read_slot_mapping, prefill_chunk: the model runner's current "slot_mapping.read"
            and "prefill_chunk" steps (:mod:`minivllm.steps`), through which the TORCH
            backend finds the slots it reads; the TRITON kernels walk the block tables.
    """

    slot_mapping: torch.Tensor
    query_starts: list[int]
    query_lens: list[int]
    seq_lens: list[int]
    num_tokens: list[int]
    block_tables: list[list[int]]
    num_actual_tokens: int
    block_size: int
    device: torch.device
    num_slots: Optional[int] = None
    read_slot_mapping: Callable = slot_mapping_ref
    prefill_chunk: Callable = prefill_chunk_ref

    def decodes(self) -> list[int]:
        """Indices of the requests with one new token, in batch order."""
        return [i for i, n in enumerate(self.query_lens) if n == 1]

    def prefills(self) -> list[int]:
        """Indices of the requests with several new tokens, in batch order."""
        return [i for i, n in enumerate(self.query_lens) if n != 1]


def single_prefill_metadata(n: int, device) -> AttentionMetadata:
    """One causal prefill of n tokens stored in slots 0..n-1 (a scratch cache of n slots,
    seen as one block of n tokens), in both read forms."""
    slots = torch.arange(n, device=device)
    one = torch.tensor([n], dtype=torch.int32, device=device)
    paged = PagedMetadata(
        block_size=n, prefill_query_starts=torch.zeros(1, dtype=torch.int32, device=device),
        prefill_query_lens=one, prefill_seq_lens=one,
        prefill_block_tables=torch.zeros(1, 1, dtype=torch.int32, device=device),
        prefill_max_query_len=n)
    return AttentionMetadata(slot_mapping=slots, prefills=[PrefillSeq(0, n, slots)],
                             paged=paged)
