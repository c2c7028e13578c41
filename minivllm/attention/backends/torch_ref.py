"""Reference paged attention with ``torch.nn.functional.scaled_dot_product_attention``.

The TORCH backend: one of vLLM's ``vllm/v1/attention/backends/*`` in role (store, then
attend over the paged cache), written for reading rather than speed; vLLM has no
pure-PyTorch counterpart. K/V are always read back from the paged cache (also in prefill,
as vLLM v1's FlashAttention backend does), so the cache's storage dtype affects every
token. Decodes are batched (keys gathered into a padded ``[B, heads, max_len, D]`` tensor
and masked, one batch per group of similar lengths); prefills run one sequence at a time
(causal, or with an explicit mask when earlier chunks or cached prefix blocks precede).

The attention math is two swappable steps (:mod:`minivllm.steps`), plain functions on
dense tensors with their references here: ``"attention.decode"``
(:func:`decode_attention_ref`) and ``"attention.prefill"`` (:func:`prefill_attention_ref`).
Fully masked rows give zeros, never NaN (:func:`zero_empty_rows`; course chapter 9).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from minivllm.attention.metadata import (AttentionMetadata, CommonAttentionMetadata,
                                         DecodeGroup, PrefillSeq, chunk_causal_mask,
                                         prefill_chunk_ref)
from minivllm.quantization.kv_cache import LayerKVCache
from minivllm.utils import cdiv


def zero_empty_rows(out: torch.Tensor, empty: torch.Tensor) -> torch.Tensor:
    """The fully-masked-row guard: ``out`` with the rows where ``empty`` is True set to
    exactly 0 (whatever they held: NaN, inf, or the 0 some SDPA kernels already give).

    Fully masked rows (a query with no key it may attend to: a padding row with
    ``seq_lens[b] == 0``, or a mask row with no True) give **zeros**, never NaN, on both
    backends. That is FlashAttention-2's convention (``csrc/flash_attn/src/softmax.h``: a
    row whose running max stays -inf uses 0 as its max, and a row whose sum is 0 is
    normalised by 1, so its output is 0), which vLLM's backends inherit for their padded
    rows; ``minivllm_kernels/paged_attention.py`` and ``minivllm_kernels/prefill_attention.py`` do the same.
    Here it is an explicit guard rather than a property of
    ``scaled_dot_product_attention``: recent PyTorch CPU builds return 0 for such a row, but
    older math kernels and other backends return NaN, and any backend returns NaN when the
    masked keys themselves hold NaN (0 * NaN). Course chapter 9.

    Args:
        out: [R, ...] attention output (any float dtype).
        empty: [R] bool, True for a query row that had no key to attend to.
    Returns:
        ``out`` (changed in place; one elementwise pass, no device sync).
    """
    return out.masked_fill_(empty.view(-1, *([1] * (out.dim() - 1))), 0)


def decode_attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """Decode attention of a padded batch (the "attention.decode" step).

    Args:
        q: [B, H, D] one query per sequence, rotary applied, compute dtype.
        k, v: [B, L, Hkv, D] each sequence's keys/values, padded to a common length L
            (H % Hkv == 0: grouped-query attention, query head h reads KV head
            h // (H // Hkv)). Keys at positions >= seq_lens[b] are padding; they hold
            finite values.
        seq_lens: [B] int64 real lengths (0 <= seq_lens[b] <= L; 0 is a padding row, as
            a CUDA graph's padded batch has).
        scale: softmax scale (head_dim ** -0.5).
    Returns:
        [B, H, D] in q's dtype: ``softmax(q k^T * scale) v`` over each sequence's real keys;
        exactly 0 for a row with seq_lens[b] == 0 (the fully-masked-row guard, module
        docstring).

    One masked ``scaled_dot_product_attention`` over the padded batch. Its bits depend on
    L (the padded length), not only on the real keys: batch composition changes a
    sequence's result (chapter 5).
    """
    L = k.shape[1]
    mask = (torch.arange(L, device=q.device)[None, :] < seq_lens[:, None])[:, None, None, :]
    o = F.scaled_dot_product_attention(
        q.unsqueeze(2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
        scale=scale, enable_gqa=True)  # [B, H, 1, D]
    o = o.squeeze(2)
    if seq_lens.device.type == "cpu" and int(seq_lens.min()) > 0:
        return o  # no padding row (every engine step on CPU): skip the guard's two ops
    return zero_empty_rows(o, seq_lens == 0)  # on a GPU: no host sync, always applied


def decode_attention_batch_invariant(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                     seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """Decode attention whose result for a sequence depends on that sequence alone (the
    "attention.decode" step of the batch-invariant mode, ``EngineArgs.batch_invariant``).

    Same arguments and result as :func:`decode_attention_ref`, computed one sequence at a
    time: sequence b attends over a fresh contiguous copy of its own ``seq_lens[b]`` keys
    and values (no padding, no other sequence), through :func:`decode_attention_ref`
    with B = 1. That is the very call the default engine makes when the sequence decodes
    alone, so this mode reproduces the default engine's solo results, whatever the batch.

    Why not the padded batch: ``scaled_dot_product_attention``'s result depends on the
    padded length L even though the padded keys are masked (course chapter 5; measured
    in ``tests/test_batch_invariant.py``), and L is the longest sequence of the decode
    group, i.e. it depends on the other requests. vLLM's batch-invariant mode and
    ``minivllm_kernels/paged_attention.py`` get the same property differently: split-KV with a
    fixed split size (not a fixed number of splits), merged in split order.
    Cost: one SDPA call per sequence instead of one per decode group.
    """
    out = torch.empty_like(q)
    lens = seq_lens.tolist()
    for b, n in enumerate(lens):
        if n == 0:  # a padding row: the fully-masked-row guard
            out[b] = 0
            continue
        out[b:b + 1] = decode_attention_ref(q[b:b + 1], k[b:b + 1, :n].contiguous(),
                                            v[b:b + 1, :n].contiguous(),
                                            seq_lens[b:b + 1], scale)
    return out


def prefill_attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          scale: float) -> torch.Tensor:
    """Causal attention of one sequence's new tokens (the "attention.prefill" step).

    Args:
        q: [n, H, D] queries of the last n positions of the sequence.
        k, v: [L, Hkv, D] keys/values of all L >= n positions (earlier chunks or cached
            prefix blocks first, then the n new tokens).
        scale: softmax scale.
    Returns:
        [n, H, D] in q's dtype; query i (position L - n + i) attends to keys 0..L - n + i.
    """
    n, L = q.shape[0], k.shape[0]
    qp = q.transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
    kp = k.transpose(0, 1).unsqueeze(0)
    vp = v.transpose(0, 1).unsqueeze(0)
    if n == L:
        o = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, scale=scale,
                                           enable_gqa=True)
    else:
        pos = torch.arange(L - n, L, device=q.device)
        mask = torch.arange(L, device=q.device)[None, :] <= pos[:, None]
        o = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask, scale=scale,
                                           enable_gqa=True)
    return o.squeeze(0).transpose(0, 1)


def prefill_attention_masked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             mask: torch.Tensor, scale: float) -> torch.Tensor:
    """Prefill attention of one sequence's new tokens under an explicit mask (used when a
    swapped "prefill_chunk" step returns a mask other than the standard chunk mask; the
    "attention.prefill" step, whose signature has no mask, is not called then).

    Args:
        q: [n, H, D]; k, v: [L, Hkv, D]; mask: [n, L] bool (True: may attend); scale.
    Returns:
        [n, H, D] in q's dtype. A row with no True key is exactly 0 (the fully-masked-row
        guard, module docstring), not NaN.
    """
    qp = q.transpose(0, 1).unsqueeze(0)
    kp = k.transpose(0, 1).unsqueeze(0)
    vp = v.transpose(0, 1).unsqueeze(0)
    mask = mask.to(q.device)
    o = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask, scale=scale,
                                       enable_gqa=True)
    return zero_empty_rows(o.squeeze(0).transpose(0, 1), ~mask.any(-1))


class TorchAttentionBackend:
    """The reference backend (default on CPU); an
    :class:`~minivllm.attention.backends.abstract.AttentionBackend`.

    ``decode_attention`` and ``prefill_attention`` are this layer's "attention.decode" and
    "attention.prefill" steps (swap them with ``LLM.swap_step``)."""

    name = "TORCH"
    needs_paged_metadata = False

    def __init__(self):
        self.decode_attention = decode_attention_ref
        self.prefill_attention = prefill_attention_ref

    def set_batch_invariant(self, on: bool) -> None:
        """Batch-invariant mode: the decode step becomes
        :func:`decode_attention_batch_invariant` (a swapped step still wins inside its
        ``with`` block). Prefills already run one sequence at a time."""
        self.decode_attention = decode_attention_batch_invariant if on else decode_attention_ref

    # --- metadata (vLLM: AttentionMetadataBuilder.build) --------------------------
    def build_metadata(self, common: CommonAttentionMetadata) -> AttentionMetadata:
        """The read slots of one step: decode queries batched in groups of similar
        length (:meth:`_decode_groups`), each prefill on its own (:meth:`_prefill_seq`).
        Both read through ``common.read_slot_mapping`` (the "slot_mapping.read" step)."""
        c = common
        dec, pre = c.decodes(), c.prefills()
        return AttentionMetadata(
            slot_mapping=c.slot_mapping,
            decodes=self._decode_groups(c, [c.query_starts[i] for i in dec],
                                        [c.block_tables[i] for i in dec],
                                        [c.seq_lens[i] for i in dec]),
            prefills=[self._prefill_seq(c, c.query_starts[i], c.block_tables[i],
                                        c.query_lens[i], c.seq_lens[i], c.num_tokens[i])
                      for i in pre])

    def _prefill_seq(self, c: CommonAttentionMetadata, row: int, table: list[int], n: int,
                     seq_len: int, num_tokens: int) -> PrefillSeq:
        """The read slots (and mask) of a sequence with n new tokens (positions seq_len - n
        .. seq_len - 1 of a request of num_tokens tokens): the "prefill_chunk" step.

        The default step (:func:`~minivllm.attention.metadata.prefill_chunk_ref`) reads
        the slots of all seq_len tokens through the "slot_mapping.read" step and leaves
        the mask to the "attention.prefill" step (query i attends to keys 0..seq_len - n
        + i), so no mask is built here. A swapped step returns ``(kv_slots, mask)``; a
        mask equal to that standard one is dropped (the same attention call as the
        default path, bit for bit), any other is kept and :meth:`forward` attends under it.

        Raises:
            ValueError: a swapped step returned something else than an int64 vector of
                slots inside the cache and a bool [n, len(kv_slots)] mask.
        """
        table_t = torch.tensor(table, dtype=torch.int64)
        if c.prefill_chunk is prefill_chunk_ref:
            kv_slots = c.read_slot_mapping(table_t, torch.arange(seq_len), c.block_size)
            return PrefillSeq(row, row + n, kv_slots.to(c.device))
        got = c.prefill_chunk(table_t, seq_len - n, n, c.block_size, num_tokens)
        if not (isinstance(got, (tuple, list)) and len(got) == 2):
            raise ValueError("the prefill_chunk step must return (kv_slots, mask), got "
                             f"{type(got).__name__}")
        kv_slots, mask = got
        if not (isinstance(kv_slots, torch.Tensor) and kv_slots.dim() == 1
                and kv_slots.dtype == torch.int64 and kv_slots.numel() >= 1):
            raise ValueError("prefill_chunk: kv_slots must be a non-empty 1-D int64 tensor, "
                             f"got {getattr(kv_slots, 'dtype', type(kv_slots).__name__)} "
                             f"of shape {tuple(getattr(kv_slots, 'shape', ()))}")
        L = kv_slots.numel()
        if not (isinstance(mask, torch.Tensor) and mask.dtype == torch.bool
                and tuple(mask.shape) == (n, L)):
            raise ValueError(f"prefill_chunk: mask must be a bool tensor of shape [n, "
                             f"len(kv_slots)] = [{n}, {L}], got "
                             f"{getattr(mask, 'dtype', type(mask).__name__)} of shape "
                             f"{tuple(getattr(mask, 'shape', ()))}")
        if c.num_slots is not None and bool(((kv_slots < 0) | (kv_slots >= c.num_slots)).any()):
            raise ValueError(f"prefill_chunk: kv_slots outside the pool [0, {c.num_slots})")
        if L >= n and torch.equal(mask.cpu(), chunk_causal_mask(n, L)):
            mask = None  # the standard mask: the default attention call
        else:
            mask = mask.to(c.device)
        return PrefillSeq(row, row + n, kv_slots.to(c.device), mask)

    def _decode_groups(self, c: CommonAttentionMetadata, rows: list[int],
                       tables: list[list[int]], lens: list[int]) -> list[DecodeGroup]:
        """Batch decode queries (query rows ``rows``, sequence lengths ``lens``) in groups
        of similar length: sorted by length, a new group starts when a sequence is both
        1.5x and 256 tokens longer than the group's shortest, which bounds padding waste
        while keeping the number of groups small."""
        if not rows:
            return []
        bs, dev = c.block_size, c.device
        order = sorted(range(len(rows)), key=lambda i: lens[i])
        groups: list[list[int]] = [[order[0]]]
        for i in order[1:]:
            first = lens[groups[-1][0]]
            if lens[i] > 1.5 * first and lens[i] > first + 256:
                groups.append([i])
            else:
                groups[-1].append(i)
        out = []
        for members in groups:
            members.sort(key=lambda i: rows[i])  # keep batch order inside a group
            max_len = max(lens[i] for i in members)
            max_blocks = cdiv(max_len, bs)
            table = torch.zeros(len(members), max_blocks, dtype=torch.int64)
            for r, i in enumerate(members):
                t = tables[i][:max_blocks]
                table[r, :len(t)] = torch.tensor(t, dtype=torch.int64)
            j = torch.arange(max_len)
            seq_lens = torch.tensor([lens[i] for i in members])
            out.append(DecodeGroup(
                rows=torch.tensor([rows[i] for i in members], dtype=torch.int64, device=dev),
                kv_slots=c.read_slot_mapping(table, j.expand(len(members), max_len),
                                             bs).to(dev),
                seq_lens=seq_lens.to(dev),
                mask=(j[None, :] < seq_lens[:, None])[:, None, None, :].to(dev)))
        return out

    # --- attention ------------------------------------------------------------------
    def store(self, kv: LayerKVCache, slot_mapping: torch.Tensor, k: torch.Tensor,
              v: torch.Tensor) -> None:
        """Write this step's K/V ([T, kv_heads, head_dim]) at slot_mapping [T], and note
        (sticky, per layer) whether a NaN/inf ever went into this cache."""
        kv.write(slot_mapping, k, v)
        # NaN/inf propagate into a sum, so this never misses one; a sum of finite values
        # that overflows only turns the (harmless) zeroing on early.
        if not kv.may_hold_nonfinite and not bool(torch.isfinite(k.sum() + v.sum())):
            kv.may_hold_nonfinite = True

    def forward(self, q: torch.Tensor, kv: LayerKVCache, meta: AttentionMetadata,
                scale: float) -> torch.Tensor:
        """Attention for a flat batch.

        Args:
            q: [num_tokens, num_heads, head_dim], compute dtype, rotary applied.
            kv: this layer's cache (storage [num_slots, num_kv_heads, head_dim] and
                scales), already holding this step's keys and values.
            meta: slots and masks for this step.
            scale: softmax scale (head_dim ** -0.5).
        Returns:
            [num_tokens, num_heads, head_dim] in q's dtype.
        """
        dtype = q.dtype
        if not meta.prefills and len(meta.decodes) == 1 \
                and meta.decodes[0].rows.numel() == q.shape[0]:
            return self._decode(q, kv, meta.decodes[0], scale)
        out = torch.empty_like(q)
        for g in meta.decodes:
            out[g.rows] = self._decode(q[g.rows], kv, g, scale)
        for p in meta.prefills:
            k, v = kv.read(p.kv_slots, dtype)
            if p.mask is None:
                out[p.start:p.end] = self.prefill_attention(q[p.start:p.end], k, v, scale)
            else:  # a swapped "prefill_chunk" step with its own mask (chapter 23)
                out[p.start:p.end] = prefill_attention_masked(q[p.start:p.end], k, v,
                                                              p.mask, scale)
        return out

    def _decode(self, q, kv: LayerKVCache, g, scale) -> torch.Tensor:
        """One decode group: q [B, H, D] (rows of g, in g's order) -> [B, H, D]."""
        k, v = kv.read(g.kv_slots, q.dtype)
        # Padded positions read slot 0, which may hold anything (even NaN from a failed
        # request): the mask gives them weight 0, but 0 * NaN = NaN, so once a NaN/inf
        # was ever stored in this cache the values themselves are zeroed first (two
        # passes over K/V, skipped otherwise; a paged kernel would never load them).
        if kv.may_hold_nonfinite and not bool(g.mask.all()):
            keep = g.mask[:, 0, 0, :, None, None]
            k = k.masked_fill(~keep, 0)
            v = v.masked_fill(~keep, 0)
        return self.decode_attention(q, k, v, g.seq_lens, scale)
