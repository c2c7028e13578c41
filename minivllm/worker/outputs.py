"""What one model-runner step returns (vLLM: ``vllm/v1/outputs.py``, ``ModelRunnerOutput``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from minivllm.layers.sampler import SamplerOutput

__all__ = ["ModelRunnerOutput", "PromptLogprobsChunk"]


@dataclass
class PromptLogprobsChunk:
    """Prompt log-probs for prompt positions [first_pos, first_pos + len) (the
    distribution of token p given tokens < p). token_logprobs/ranks: [L]; topk_*: [L, N]."""

    first_pos: int
    token_ids: list[int]
    token_logprobs: torch.Tensor
    ranks: torch.Tensor
    topk_ids: Optional[torch.Tensor]
    topk_logprobs: Optional[torch.Tensor]


@dataclass
class ModelRunnerOutput:
    """sampled_request_ids[i] got token sampled_token_ids[i] (= sampler_output.sampled[i],
    already on the host)."""

    sampled_request_ids: list[str] = field(default_factory=list)
    sampled_token_ids: list[int] = field(default_factory=list)
    sampler_output: Optional[SamplerOutput] = None
    prompt_logprobs: dict[str, PromptLogprobsChunk] = field(default_factory=dict)
    # requests whose logits, prompt log-probs, score rows or int8 K/V held NaN/inf
    nonfinite_request_ids: list[str] = field(default_factory=list)
    # LLM.score requests: (first position, [rows, vocab] float32 log-probs or logits,
    # positions in the chunk, the chosen positions or None: rows for all of them)
    score_rows: dict[str, tuple[int, torch.Tensor, int, Optional[list[int]]]] = \
        field(default_factory=dict)
    # speculative decoding: request id -> the tokens its verification emits (accepted
    # drafts, then one target token), 1 to k + 1 of them; these requests are not in
    # sampled_request_ids
    spec_outputs: dict[str, list[int]] = field(default_factory=dict)
