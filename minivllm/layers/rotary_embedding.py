"""Rotary position embedding (RoPE; Su et al. 2021, arXiv:2104.09864), HF "rotate_half" layout.

The cos/sin tables are computed in float32 from ``inv_freq = 1 / theta^(2i/d)`` and cast
to the activation dtype, exactly as HF ``LlamaRotaryEmbedding`` does, so float32 results
match transformers bit for bit. vLLM: ``vllm/model_executor/layers/rotary_embedding``.
"""

from __future__ import annotations

import torch
from torch import nn


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [num_tokens, num_heads, head_dim]; cos, sin: [num_tokens, head_dim] (x's dtype)."""
    return x * cos[:, None, :] + _rotate_half(x) * sin[:, None, :]


def rope_table_ref(head_dim: int, max_position: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The rotary tables (the "rotary.table" step, :mod:`minivllm.steps`).

    ``inv_freq[i] = 1 / base^(2i / head_dim)``, angle ``pos * inv_freq[i]``, both in
    float32 as HF ``LlamaRotaryEmbedding`` computes them; the rotate-half layout repeats
    the angles for both halves of the head.

    Args:
        head_dim: rotary dimension (even).
        max_position: number of positions (rows).
        base: rope_theta.
    Returns:
        (cos, sin): float32 [max_position, head_dim] each.
    """
    # On the CPU even inside a `torch.device("meta")` block (the loader builds the model
    # there): meta arithmetic runs through torch._refs, whose first use imports
    # torch._dynamo (about 2 s per process). The loader moves the tables to the device.
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64,
                                            device="cpu").float() / head_dim))
    t = torch.arange(max_position, dtype=torch.int64, device="cpu").float()
    freqs = torch.outer(t, inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


class RotaryEmbedding(nn.Module):
    """Default (unscaled) RoPE.

    Args:
        head_dim: rotary dimension (the whole head).
        max_position: size of the precomputed table (positions >= it raise IndexError).
        base: rope_theta.
        table_fn: the function that computes the tables (the "rotary.table" step;
            default :func:`rope_table_ref`). Its result is cast to float32.
    """

    def __init__(self, head_dim: int, max_position: int, base: float, table_fn=rope_table_ref):
        super().__init__()
        self.head_dim = head_dim
        self.max_position = max_position
        self.base = base
        self.table_fn = table_fn
        cos, sin = table_fn(head_dim, max_position, base)
        self.register_buffer("cos_cached", cos.float(), persistent=False)
        self.register_buffer("sin_cached", sin.float(), persistent=False)
        self._last: tuple | None = None  # (positions, dtype, cos, sin) of the last call

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype):
        """[T, head_dim] cos and sin for these positions, in ``dtype``. Layers sharing this
        module in one forward pass get the same ``positions`` tensor, so the lookup is
        done once per step and reused (the tensor is held, so identity is reliable)."""
        last = self._last
        if last is not None and last[0] is positions and last[1] == dtype:
            return last[2], last[3]
        cos = self.cos_cached[positions].to(dtype)
        sin = self.sin_cached[positions].to(dtype)
        self._last = (positions, dtype, cos, sin)
        return cos, sin

    kernel = None  # e.g. kernels.rotary.rotary_embedding (in place, same numbers)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """positions: [num_tokens] int64; q: [T, Hq, D]; k: [T, Hkv, D]. Returns (q, k)
        (rotated in place when ``kernel`` is set)."""
        if self.kernel is not None:
            return self.kernel(positions, q, k, self.cos_cached, self.sin_cached)
        cos, sin = self.cos_sin(positions, q.dtype)
        return apply_rotary_ref(q, cos, sin), apply_rotary_ref(k, cos, sin)


def get_rope(head_dim: int, max_position: int, base: float, rope_scaling: dict | None) -> RotaryEmbedding:
    """Build the rotary embedding; only the default (unscaled) type is implemented.

    Raises:
        NotImplementedError: for any rope_scaling other than None / {"rope_type": "default"}.
    """
    if rope_scaling:
        rope_type = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
        if rope_type != "default":
            raise NotImplementedError(
                f"rope_scaling type {rope_type!r} is not supported yet (supported: default); "
                f"got rope_scaling={rope_scaling}")
    return RotaryEmbedding(head_dim, max_position, base)
