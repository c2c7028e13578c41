"""KV-cache scale calibration (``calculate_kv_scales``, ``LLMEngine.calibrate_kv_scales``):
run the float model on calibration sequences, record the largest |K| and |V| per layer
(and KV head, or K channel), and set the static scales ``amax / qmax``. The storage
format and the scale rules are in :mod:`minivllm.quantization.kv_cache`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Optional

import torch

from minivllm.quantization.calibration import calibration_forward
from minivllm.quantization.kv_cache import is_quantized


def calibrate_kv_amax(model, token_id_lists: list[list[int]],
                      device: str | torch.device = "cpu", per_channel: bool = False
                      ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Largest |K| and |V| per layer and KV head (K per channel too) over calibration
    sequences.

    Each sequence runs as one prefill with a temporary float32 cache
    (:func:`minivllm.quantization.calibration.calibration_forward`); the stored K (after
    rotary) and V are read back from it.

    Args:
        model: our LlamaForCausalLM.
        token_id_lists: calibration sequences (each >= 1 token).
        per_channel: K's amax per (KV head, channel), ``[num_kv_heads, head_dim]``.
    Returns:
        per layer ``(k_amax, v_amax)``, float32 tensors of shape [num_kv_heads] (CPU);
        k_amax [num_kv_heads, head_dim] with ``per_channel``.
    Raises:
        ValueError: no sequences or an empty one.
    """
    attns = [layer.self_attn for layer in model.layers]
    amax = [(torch.zeros((a.num_kv_heads, a.head_dim) if per_channel else a.num_kv_heads),
             torch.zeros(a.num_kv_heads)) for a in attns]
    k_dims = (0,) if per_channel else (0, 2)

    def observe() -> None:
        for (k_amax, v_amax), a in zip(amax, attns):
            torch.maximum(k_amax, a.kv_cache.key.abs().amax(dim=k_dims).float().cpu(), out=k_amax)
            torch.maximum(v_amax, a.kv_cache.value.abs().amax(dim=(0, 2)).float().cpu(), out=v_amax)

    calibration_forward(model, token_id_lists, device, after_sequence=observe)
    return amax


def calibrate_kv_scales(engine, token_id_lists: Optional[list[list[int]]] = None) -> dict:
    """Calibrate an engine's static K/V scales (``amax / qmax`` per layer: per tensor, per
    KV head, or K per (head, channel) with V per tensor, ``kv_scale_granularity``);
    ``LLMEngine.calibrate_kv_scales`` calls this.

    Args:
        engine: an ``LLMEngine`` with a quantized KV cache and static scales.
        token_id_lists: calibration sequences; default: the engine's calibration data
            (``LLM`` gives the first 2048 tokens of the bundled prose corpus,
            ``minivllm/precision/evalsets/corpus.txt``, in windows of up to 1024 tokens:
            not the passkey filler or the QA set used for evaluation).
    Returns:
        ``engine.kv_cache_scales()`` after calibration.
    Raises:
        ValueError: a float KV cache, dynamic scales, running requests (scales must not
            change under a request whose K/V is already stored), tensor parallelism, or
            sequences that are not lists of 1..max_model_len token ids.
    """
    if engine.model_executor is not None:
        raise ValueError("calibrate_kv_scales with tensor_parallel_size > 1 would set rank "
                         "0's scales only; calibrate with tensor_parallel_size=1")
    cc = engine.cache_config
    if cc.kv_scale_type != "static" or not is_quantized(cc.kv_cache_torch_dtype):
        raise ValueError(f"calibrate_kv_scales needs a quantized KV cache with static "
                         f"scales; kv_cache_dtype={cc.kv_cache_dtype!r}, "
                         f"kv_scale_type={cc.kv_scale_type!r}")
    if engine.has_unfinished_requests():
        raise ValueError("calibrate_kv_scales cannot run while requests are in flight")
    if token_id_lists is None:
        token_id_lists = engine.calibration_sequences("corpus", None)
    if isinstance(token_id_lists, (str, bytes)) or not isinstance(token_id_lists, Iterable):
        raise ValueError("calibrate_kv_scales takes a list of token-id sequences, got "
                         f"{type(token_id_lists).__name__}")
    token_id_lists = list(token_id_lists)
    if any(isinstance(t, (str, bytes)) or not isinstance(t, Iterable) for t in token_id_lists):
        raise ValueError("calibrate_kv_scales takes a list of token-id sequences (a list of "
                         "lists of ints); got a flat sequence or a non-sequence item")
    check = engine.input_processor.check_token_ids
    seqs = [check(ids, "calibration token ids") for ids in token_id_lists]
    max_len = engine.model_config.max_model_len
    for ids in seqs:
        if not 0 < len(ids) <= max_len:
            raise ValueError(f"calibration sequences need 1 to max_model_len="
                             f"{max_len} tokens, got {len(ids)}")
    if not seqs:
        raise ValueError("calibrate_kv_scales needs at least one sequence")
    engine.model_runner.calibrate_kv_scales(seqs)
    engine.kv_cache_manager.reset_prefix_cache()  # cached blocks used the old scales
    return engine.kv_cache_scales()
