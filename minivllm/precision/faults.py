"""Planted faults: known, local numerical bugs to put into a running engine.

Chapters use them to show what a bug looks like in the metrics, tests use them to check
that the layer diff finds the right layer, and labs hide one for the learner to find.
Each is a context manager that patches one layer of an ``LLM``'s model and restores it.
While one is active, the engine runs every step eagerly: a CUDA graph captured before
would replay the unpatched layer.
"""

from __future__ import annotations

import contextlib

import torch

from minivllm.layers.rms_norm import rms_norm_ref
from minivllm.layers.rotary_embedding import RotaryEmbedding


def _layer(llm, layer: int):
    from minivllm.llm import LLM

    if not isinstance(llm, LLM):
        raise TypeError(f"faults are planted into an LLM, got {type(llm).__name__}")
    layers = llm.llm_engine.model_runner.model.layers
    if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < len(layers):
        raise ValueError(f"layer must be in [0, {len(layers)}), got {layer}")
    return layers[layer]


@contextlib.contextmanager
def _without_cuda_graphs(llm):
    """Eager steps while a fault is planted (CUDA graphs replay what they captured)."""
    graphs = llm.llm_engine.model_runner.cuda_graphs
    with graphs.suspended() if graphs is not None else contextlib.nullcontext():
        yield


def rms_norm_fp16(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed entirely in float16 (input, sum of squares, scale): the classic
    "forgot to upcast" bug. Same signature as ``rms_norm_ref``."""
    h = x.to(torch.float16)
    variance = h.pow(2).mean(-1, keepdim=True)
    out = h * torch.rsqrt(variance + eps)
    return (weight.to(torch.float16) * out).to(x.dtype)


@contextlib.contextmanager
def fp16_rmsnorm(llm, layer: int, which: str = "input_layernorm"):
    """Compute one layer's RMSNorm in float16.

    Args:
        which: "input_layernorm" (before attention) or "post_attention_layernorm".
    """
    if which not in ("input_layernorm", "post_attention_layernorm"):
        raise ValueError(f"which must be 'input_layernorm' or 'post_attention_layernorm', "
                         f"got {which!r}")
    norm = getattr(_layer(llm, layer), which)
    old = norm.impl
    norm.impl = rms_norm_fp16
    try:
        with _without_cuda_graphs(llm):
            yield
    finally:
        norm.impl = old if old is not None else rms_norm_ref


@contextlib.contextmanager
def wrong_rope_theta(llm, layer: int, theta: float):
    """Give one layer's attention a rotary embedding with base ``theta`` (the model's
    other layers keep theirs): a config bug where one module reads the wrong field."""
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not 0 < theta < float("inf"):
        raise ValueError(f"theta must be > 0, got {theta}")
    attn = _layer(llm, layer).self_attn
    old = attn.rotary_emb
    attn.rotary_emb = RotaryEmbedding(old.head_dim, old.cos_cached.shape[0], theta).to(
        old.cos_cached.device)
    try:
        with _without_cuda_graphs(llm):
            yield
    finally:
        attn.rotary_emb = old
