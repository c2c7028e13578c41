"""Calibration passes: run the float model on calibration text and observe activations.

Each sequence runs as one prefill through our own model with a temporary float32 KV
cache (so what is observed is not itself disturbed by a quantized cache). Observers are
forward hooks; the statistics they keep are small (running amax, running Hessian
``X^T X``, a bounded sample of input rows), never every activation.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator

import torch
from torch import nn

from minivllm.attention.metadata import single_prefill_metadata as _prefill_meta
from minivllm.quantization.kv_cache import LayerKVCache


@contextmanager
def _scratch_kv_caches(attns: list, n: int, device) -> Iterator[None]:
    """Bind fresh float32 caches of n slots to the given attention layers, restore after."""
    saved = [a.kv_cache for a in attns]
    one = torch.ones((), device=device)
    try:
        for a in attns:
            shape = (n, a.num_kv_heads, a.head_dim)
            a.kv_cache = LayerKVCache(torch.zeros(shape, device=device),
                                      torch.zeros(shape, device=device), one, one)
        yield
    finally:
        for a, kv in zip(attns, saved):
            a.kv_cache = kv


@torch.inference_mode()
def calibration_forward(model, token_id_lists: list[list[int]], device="cpu",
                        after_sequence: Callable[[], None] | None = None) -> None:
    """Run each sequence through ``model`` as one causal prefill.

    Args:
        model: our LlamaForCausalLM (any dtype; hooks see its activations).
        token_id_lists: calibration sequences, each of >= 1 token.
        after_sequence: called after each sequence, while its scratch KV cache is still
            bound (the KV-scale calibration reads the stored K/V there).
    Raises:
        ValueError: no sequences, or an empty one.
    """
    if not token_id_lists or any(len(t) == 0 for t in token_id_lists):
        raise ValueError("calibration needs at least one non-empty token sequence")
    attns = [layer.self_attn for layer in model.layers]
    for ids in token_id_lists:
        meta = _prefill_meta(len(ids), device)
        with _scratch_kv_caches(attns, len(ids), device):
            model(torch.tensor(ids, device=device), meta.slot_mapping, meta)
            if after_sequence is not None:
                after_sequence()


@torch.inference_mode()
def layer_forward(layer, hidden: torch.Tensor) -> torch.Tensor:
    """Run one decoder layer on one sequence's hidden states ``[n, hidden]`` as a causal
    prefill with a scratch float32 KV cache (for layer-by-layer calibration)."""
    n, device = hidden.shape[0], hidden.device
    meta = _prefill_meta(n, device)
    with _scratch_kv_caches([layer.self_attn], n, device):
        return layer(meta.slot_mapping, hidden, meta)


class InputObserver:
    """Statistics of a linear layer's input rows x ([tokens, in_features]).

    Attributes:
        amax: running max |x| (a 0-d float32 tensor), for static activation scales.
        channel_amax: running max |x_j| per input channel (float32 [in]), for
            SmoothQuant's scales, when ``keep_channel_amax``; else None.
        hessian: ``2/n * sum x^T x`` over all n rows seen (float64 [in, in]), for GPTQ,
            when ``keep_hessian``.
        sample: up to ``max_rows`` input rows (float32), for AWQ's searches.
    """

    def __init__(self, keep_hessian: bool = False, max_rows: int = 0,
                 keep_channel_amax: bool = False):
        self.keep_hessian = keep_hessian
        self.keep_channel_amax = keep_channel_amax
        self.max_rows = max_rows
        self.amax = torch.zeros(())
        self.channel_amax: torch.Tensor | None = None
        self.hessian: torch.Tensor | None = None
        self.num_rows = 0
        self.rows: list[torch.Tensor] = []
        self._kept = 0

    def __call__(self, module: nn.Module, args, output=None) -> None:
        x = args[0].detach().reshape(-1, args[0].shape[-1]).float().cpu()
        self.amax = torch.maximum(self.amax, x.abs().max())
        if self.keep_channel_amax:
            col = x.abs().amax(dim=0)
            self.channel_amax = col if self.channel_amax is None else torch.maximum(self.channel_amax, col)
        if self.keep_hessian:
            x64 = x.double()
            h = x64.T @ x64
            self.hessian = h if self.hessian is None else self.hessian + h
        self.num_rows += x.shape[0]
        if self._kept < self.max_rows:
            take = x[: self.max_rows - self._kept]
            self.rows.append(take.clone())
            self._kept += take.shape[0]

    @property
    def sample(self) -> torch.Tensor:
        return torch.cat(self.rows) if self.rows else torch.empty(0)

    def hessian_matrix(self) -> torch.Tensor:
        """``H = 2/n X^T X`` (float32), as the GPTQ reference accumulates it."""
        if self.hessian is None or self.num_rows == 0:
            raise ValueError("no calibration rows were observed for this layer")
        return (2.0 / self.num_rows * self.hessian).float()


@contextmanager
def observe_inputs(modules: dict[str, nn.Module], **observer_kwargs) -> Iterator[dict[str, InputObserver]]:
    """Attach an :class:`InputObserver` to each named module for the duration."""
    observers = {name: InputObserver(**observer_kwargs) for name in modules}
    handles = [m.register_forward_pre_hook(observers[name]) for name, m in modules.items()]
    try:
        yield observers
    finally:
        for h in handles:
            h.remove()


def calibration_sequences(tokenizer, name: str, max_tokens: int | None,
                          max_model_len: int) -> list[list[int]]:
    """Calibration token sequences from a bundled set (what an engine calibrates on).

    Args:
        tokenizer: the model's tokenizer (the chat template renders the conversations).
        name: ``"conversations"`` (the bundled chats) or ``"corpus"`` (the prose).
        max_tokens: tokens in total; None: up to 2048.
        max_model_len: windows are at most ``min(1024, max_model_len)`` tokens.
    Returns:
        Token-id lists, the set cut into windows and truncated to ``max_tokens`` in total.
    Raises:
        ValueError: more tokens asked for than the set holds, or max_model_len < 2.
    """
    from minivllm.precision import evalsets as E

    limit = min(1024, max_model_len)
    if limit < 2:
        raise ValueError(f"calibration needs max_model_len >= 2 (got {max_model_len})")
    if name == "conversations":
        seqs = E.conversation_sequences(tokenizer)
    else:
        seqs = E.corpus_sequences(tokenizer, seq_len=limit)
    # each sequence cut into windows of at most `limit` tokens
    windows = [ids[i:i + limit] for ids in seqs for i in range(0, len(ids), limit)]
    available = sum(map(len, windows))
    if max_tokens is None:
        max_tokens = min(2048, available)
    elif max_tokens > available:
        raise ValueError(f"calibration_tokens={max_tokens} but the {name!r} calibration "
                         f"set holds {available} tokens with this tokenizer; ask for at "
                         f"most {available}")
    out, total = [], 0
    for ids in windows:
        ids = ids[:max_tokens - total]
        if not ids:
            break
        out.append(ids)
        total += len(ids)
    return out
