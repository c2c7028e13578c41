"""Attention backends. ``torch`` is the readable reference (CPU and CUDA)."""

from minivllm.attention.backends.torch_ref import TorchAttentionBackend

BACKENDS = {"torch": TorchAttentionBackend}


def get_attention_backend(name: str):
    if name not in BACKENDS:
        raise ValueError(f"Unknown attention backend {name!r}; allowed: {', '.join(BACKENDS)}")
    return BACKENDS[name]()
