"""Planted faults: known, local numerical bugs to put into a running engine.

Chapters use them to show what a bug looks like in the metrics, tests use them to check
that the layer diff finds the right layer, and labs hide one for the learner to find.
Each is a context manager built on the step registry (:mod:`minivllm.steps`): it swaps
one step of one layer (or of the whole engine) for a faulty function and restores it on
exit. While one is active the engine runs every step eagerly (a CUDA graph captured
before would replay the unpatched step).
"""

from __future__ import annotations

import contextlib

import torch

from minivllm.layers.rotary_embedding import rope_table_ref


def _check_llm(llm, layer: int):
    from minivllm.llm import LLM

    if not isinstance(llm, LLM):
        raise TypeError(f"faults are planted into an LLM, got {type(llm).__name__}")
    n = len(llm.llm_engine.model_runner.model.layers)
    if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < n:
        raise ValueError(f"layer must be in [0, {n}), got {layer}")


def rms_norm_fp16(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed entirely in float16 (input, sum of squares, scale): the classic
    "forgot to upcast" bug. Same signature as ``rms_norm_ref``."""
    h = x.to(torch.float16)
    variance = h.pow(2).mean(-1, keepdim=True)
    out = h * torch.rsqrt(variance + eps)
    return (weight.to(torch.float16) * out).to(x.dtype)


@contextlib.contextmanager
def fp16_rmsnorm(llm, layer: int, which: str = "input_layernorm"):
    """Compute one layer's RMSNorm in float16 (the "rms_norm" step of that module).

    Args:
        which: "input_layernorm" (before attention) or "post_attention_layernorm".
    """
    if which not in ("input_layernorm", "post_attention_layernorm"):
        raise ValueError(f"which must be 'input_layernorm' or 'post_attention_layernorm', "
                         f"got {which!r}")
    _check_llm(llm, layer)
    with llm.swap_step("rms_norm", rms_norm_fp16, where=f"layers.{layer}.{which}"):
        yield


@contextlib.contextmanager
def wrong_rope_theta(llm, layer: int, theta: float):
    """Give one layer's attention a rotary table with base ``theta`` (the model's other
    layers keep theirs; the "rotary.table" step of that layer): a config bug where one
    module reads the wrong field."""
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not 0 < theta < float("inf"):
        raise ValueError(f"theta must be > 0, got {theta}")
    _check_llm(llm, layer)

    def table(head_dim, max_position, base):
        return rope_table_ref(head_dim, max_position, theta)

    with llm.swap_step("rotary.table", table, where=layer):
        yield


@contextlib.contextmanager
def drop_outputs_on_resume(llm):
    """Preemption by recompute that forgets what the request generated (the
    "scheduler.preempt" step): the resumed request re-prefills its prompt only, so it
    generates its answer again from the start and its output holds the first part twice.
    vLLM had bugs of this family: #16832 (outputs truncated after a RECOMPUTE preemption),
    PR #5349 (inconsistent state after recompute), vllm-gaudi PR #524. Only requests that
    are preempted change."""
    from minivllm.core.scheduler import preempt_request_ref

    block_size = llm.llm_engine.cache_config.block_size

    def preempt(request):
        preempt_request_ref(request)
        del request.all_token_ids[request.num_prompt_tokens:]  # the bug: context lost
        del request.block_hashes[request.num_prompt_tokens // block_size:]

    with llm.swap_step("scheduler.preempt", preempt):
        yield
