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
from minivllm.quantization.kv_cache import dequantize_kv, read_kv_slots


class TorchAttentionBackend:
    name = "torch"

    def forward(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float, k_scale: float = 1.0,
                v_scale: float = 1.0) -> torch.Tensor:
        """Attention for a flat batch.

        Args:
            q: [num_tokens, num_heads, head_dim], compute dtype, rotary applied.
            k_cache, v_cache: [num_slots, num_kv_heads, head_dim], storage dtype, already
                holding this step's keys and values.
            meta: slots and masks for this step.
            scale: softmax scale (head_dim ** -0.5).
        Returns:
            [num_tokens, num_heads, head_dim] in q's dtype.
        """
        dtype = q.dtype
        if not meta.prefills and len(meta.decodes) == 1 \
                and meta.decodes[0].rows.numel() == q.shape[0]:
            return self._decode(q, k_cache, v_cache, meta.decodes[0], scale, k_scale, v_scale)
        out = torch.empty_like(q)
        for g in meta.decodes:
            out[g.rows] = self._decode(q[g.rows], k_cache, v_cache, g, scale, k_scale, v_scale)
        for p in meta.prefills:
            qp = q[p.start:p.end].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
            k = dequantize_kv(read_kv_slots(k_cache, p.kv_slots), dtype, k_scale)
            v = dequantize_kv(read_kv_slots(v_cache, p.kv_slots), dtype, v_scale)
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
    def _decode(q, k_cache, v_cache, g, scale, k_scale, v_scale) -> torch.Tensor:
        """One decode group: q [B, H, D] (rows of g, in g's order) -> [B, H, D]."""
        k = dequantize_kv(read_kv_slots(k_cache, g.kv_slots), q.dtype, k_scale)
        v = dequantize_kv(read_kv_slots(v_cache, g.kv_slots), q.dtype, v_scale)
        o = F.scaled_dot_product_attention(
            q.unsqueeze(2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=g.mask,
            scale=scale, enable_gqa=True)  # [B, H, 1, D]
        return o.squeeze(2)
