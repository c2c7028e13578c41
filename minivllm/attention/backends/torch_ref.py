"""Reference paged attention with ``torch.nn.functional.scaled_dot_product_attention``.

K/V are always read back from the paged cache (also in prefill, as vLLM v1's
FlashAttention backend does), so the cache's storage dtype affects every token.
Decodes are batched: their keys are gathered into a padded ``[B, heads, max_len, D]``
tensor and masked (one such batch per group of similar lengths). Prefills run one sequence at a time (causal, or with an explicit mask
when earlier chunks / cached prefix blocks precede the new tokens).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from minivllm.attention.metadata import AttentionMetadata
from minivllm.quantization.kv_cache import LayerKVCache


class TorchAttentionBackend:
    """The reference backend (default on CPU)."""

    name = "TORCH"
    needs_paged_metadata = False

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
            qp = q[p.start:p.end].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
            k, v = kv.read(p.kv_slots, dtype)
            k = k.transpose(0, 1).unsqueeze(0)
            v = v.transpose(0, 1).unsqueeze(0)
            if p.mask is None:
                o = F.scaled_dot_product_attention(qp, k, v, is_causal=True, scale=scale,
                                                   enable_gqa=True)
            else:
                o = F.scaled_dot_product_attention(qp, k, v, attn_mask=p.mask, scale=scale,
                                                   enable_gqa=True)
            out[p.start:p.end] = o.squeeze(0).transpose(0, 1)
        return out

    @staticmethod
    def _decode(q, kv: LayerKVCache, g, scale) -> torch.Tensor:
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
        o = F.scaled_dot_product_attention(
            q.unsqueeze(2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=g.mask,
            scale=scale, enable_gqa=True)  # [B, H, 1, D]
        return o.squeeze(2)
