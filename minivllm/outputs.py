"""Request outputs with vLLM's names (``vllm/outputs.py``, ``vllm/sequence.py``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass
class Logprob:
    """Log-probability of one token.

    Attributes:
        logprob: natural-log probability under the raw model distribution (float, nats),
            or what the engine's ``logprobs_mode`` asks for instead (raw logits, or the
            processed log-probs / logits the sampler drew from).
        rank: 1-based rank of the token among those values.
        decoded_token: the token's text.
    """

    logprob: float
    rank: Optional[int] = None
    decoded_token: Optional[str] = None


# One dict per position: token id -> Logprob (top-N plus the sampled/actual token).
SampleLogprobs = list[dict[int, Logprob]]
PromptLogprobs = list[Optional[dict[int, Logprob]]]


@dataclass
class CompletionOutput:
    """One completion of a request.

    Attributes:
        index: completion index (always 0; n > 1 is not supported).
        text: generated text (stop string removed unless include_stop_str_in_output).
        token_ids: generated token ids, including a stop token id / EOS that ended it.
        cumulative_logprob: sum of the sampled tokens' raw log-probs, or None when
            logprobs were not requested (as in vLLM).
        logprobs: per generated token, a dict token id -> Logprob, or None.
        finish_reason: "stop" (EOS, stop string or stop token), "length", "abort",
            "error" (the logits held NaN/inf; generation stopped there), or None.
        stop_reason: the stop string or stop token id that ended it, else None.
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: Optional[float]
    logprobs: Optional[SampleLogprobs]
    finish_reason: Optional[str] = None
    stop_reason: Optional[object] = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """The output of one request, as returned by ``LLM.generate``.

    Attributes:
        request_id: engine request id (a string).
        prompt: the prompt text, or None when token ids were given.
        prompt_token_ids: token ids of the prompt.
        prompt_logprobs: per prompt position a dict, or None (first position is None).
        outputs: list with one CompletionOutput.
        finished: whether the request has finished.
        num_cached_tokens: prompt tokens served from the prefix cache.
        metrics: "arrival_time", "first_token_time", "finish_time" (time.monotonic()
            seconds or None), "num_preemptions" (int), and "spec_decode": this request's
            speculative-decoding counts {"num_drafts": verifications, "num_draft_tokens":
            draft tokens verified, "num_accepted_tokens": drafts accepted} (all 0 without
            speculative decoding; vLLM reports per-request acceptance, in its own fields,
            with ``--per-request-spec-decode-metrics``, under ``metrics.speculative_decoding``).
            Acceptance rate = accepted / draft tokens; mean acceptance length = 1 +
            accepted / drafts.
    """

    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    prompt_logprobs: Optional[PromptLogprobs]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: dict = field(default_factory=dict)
