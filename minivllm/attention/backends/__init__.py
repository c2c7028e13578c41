"""Attention backends, by the name ``EngineArgs.attention_backend`` takes (vLLM:
``vllm/attention/selector.py`` picks one, ``VLLM_ATTENTION_BACKEND`` overrides it).

* ``TORCH``: the readable reference (``scaled_dot_product_attention`` on gathered K/V);
  the default on CPU.
* ``TRITON``: paged kernels from :mod:`minivllm_kernels`; the default on CUDA, and the one CUDA
  graphs capture. On CPU it runs in Triton's interpreter (slow, for learning and tests).

Each implements :class:`~minivllm.attention.backends.abstract.AttentionBackend`:
``build_metadata(common)`` (its own metadata of a step), ``store(kv, slot_mapping, k,
v)``, ``forward(q, kv, meta, scale)``, ``set_batch_invariant(on)`` and
``needs_paged_metadata`` (its metadata is the block-table form CUDA graphs capture).
"""

from __future__ import annotations

from typing import Optional


def _torch():
    from minivllm.attention.backends.torch_ref import TorchAttentionBackend
    return TorchAttentionBackend


def _triton():
    from minivllm.attention.backends.triton_attn import TritonAttentionBackend
    return TritonAttentionBackend


BACKENDS = {"TORCH": _torch, "TRITON": _triton}


def resolve_attention_backend(name: Optional[str], device: str) -> str:
    """``None`` -> TORCH on CPU, TRITON on CUDA; names are case-insensitive.

    Raises:
        ValueError: an unknown name (the message lists the allowed ones).
    """
    if name is None:
        return "TRITON" if str(device).startswith("cuda") else "TORCH"
    if not isinstance(name, str) or name.upper() not in BACKENDS:
        raise ValueError(f"Unknown attention_backend {name!r}; allowed: "
                         f"{', '.join(BACKENDS)} (or None for the device's default)")
    return name.upper()


def get_attention_backend(name: str):
    """A backend instance by name (see :func:`resolve_attention_backend`)."""
    return BACKENDS[resolve_attention_backend(name, "cpu")]()()  # the class, then an instance
