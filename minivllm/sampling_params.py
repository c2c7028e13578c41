"""``SamplingParams``: per-request decoding settings with vLLM's field names and defaults.

Source: ``vllm/sampling_params.py``. Every value is checked when the object is built;
an invalid value raises ``ValueError`` that says what is allowed (nothing is clamped).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional, Union

# vLLM's _SAMPLING_EPS (vllm/sampling_params.py): a temperature below it is greedy, a min_p
# below it is off. The one threshold the sampler, the runner and spec decoding compare with.
SAMPLING_EPS = 1e-5


@dataclass
class SamplingParams:
    """Decoding settings for one request.

    Attributes:
        n: number of completions; only 1 is supported here.
        temperature: 0 means greedy (argmax); otherwise logits are divided by it.
        top_p: nucleus sampling, keep the smallest set of tokens with mass >= top_p; in (0, 1].
        top_k: keep the k most likely tokens; -1 (or 0) disables it.
        min_p: drop tokens whose probability is below min_p * max probability; in [0, 1].
        presence_penalty: subtracted once from logits of tokens present in the output; [-2, 2].
        frequency_penalty: subtracted per occurrence in the output; [-2, 2].
        repetition_penalty: CTRL-style multiplicative penalty on prompt and output tokens; > 0.
        seed: per-request random seed; the same seed gives the same output.
        stop: strings that end generation; the stop string is not included in the text.
        stop_token_ids: token ids that end generation (included in token_ids, not text).
        ignore_eos: keep generating after EOS.
        max_tokens: maximum number of generated tokens (>= 1).
        min_tokens: EOS and stop_token_ids are masked until this many tokens exist.
        logprobs: number of top log-probs to return per generated token, plus the
            sampled token's (computed from the raw model logits, as in vLLM v1).
        prompt_logprobs: the same for every prompt token (the first has none).
        skip_special_tokens: drop special tokens when detokenizing.
        include_stop_str_in_output: keep the matched stop string in the text.
        truncate_prompt_tokens: None (default): no truncation, and a prompt that does
            not fit max_model_len is refused. An integer k >= 1: keep only the **last**
            k prompt tokens (left truncation, vLLM's semantics: the end of the prompt,
            where the question and the chat template's generation prompt sit, is what
            the model answers). -1: the longest prompt the engine accepts,
            max_model_len - 1 tokens (vLLM resolves -1 to max_model_len; this engine
            needs room for one generated token in the cache, so a prompt of
            max_model_len tokens is refused). k > max_model_len is an error when the
            request is added (vLLM: ``_validate_truncation_size``).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: Optional[int] = None
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: Optional[list[int]] = None
    ignore_eos: bool = False
    max_tokens: Optional[int] = 16
    min_tokens: int = 0
    logprobs: Optional[int] = None
    prompt_logprobs: Optional[int] = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    truncate_prompt_tokens: Optional[int] = None
    _stop_list: list[str] = field(default_factory=list, init=False, repr=False)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Normalise ``stop``/``stop_token_ids`` and check every field (again).

        The engine calls this when a request is added, so fields changed after
        construction are checked too (and a changed ``stop`` takes effect).
        Raises:
            ValueError: naming the field, the value and what is allowed.
        """
        if isinstance(self.stop, str):
            self._stop_list = [self.stop]
        elif self.stop is None:
            self._stop_list = []
        elif isinstance(self.stop, (list, tuple)):
            self._stop_list = list(self.stop)
        else:
            raise ValueError(f"stop must be a string, a list of strings or None, got {self.stop!r}")
        if self.stop_token_ids is not None and not isinstance(self.stop_token_ids, (list, tuple)):
            raise ValueError(f"stop_token_ids must be a list of non-negative integers or None, "
                             f"got {self.stop_token_ids!r}")
        self.stop_token_ids = list(self.stop_token_ids or [])
        self._verify()

    # --- validation -------------------------------------------------------------
    def _verify(self) -> None:
        _check_number("temperature", self.temperature)
        _check_number("top_p", self.top_p)
        _check_number("min_p", self.min_p)
        _check_number("presence_penalty", self.presence_penalty)
        _check_number("frequency_penalty", self.frequency_penalty)
        _check_number("repetition_penalty", self.repetition_penalty)
        if _not_int(self.n) or self.n != 1:
            raise ValueError(f"n must be 1 (parallel sampling is not supported), got {self.n!r}")
        if self.temperature < 0.0:
            raise ValueError(f"temperature must be non-negative (0 = greedy), got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if _not_int(self.top_k) or self.top_k < -1:
            raise ValueError(f"top_k must be an integer >= -1 (-1 or 0 disables), got {self.top_k!r}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
        if not self.repetition_penalty > 0.0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.max_tokens is not None and (_not_int(self.max_tokens) or self.max_tokens < 1):
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if _not_int(self.min_tokens) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})"
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (_not_int(value) or value < 0):
                raise ValueError(f"{name} must be None or an integer >= 0, got {value!r}")
        if self.seed is not None and (_not_int(self.seed) or not _INT64_MIN <= self.seed <= _INT64_MAX):
            raise ValueError(f"seed must be an integer in [-2**63, 2**63 - 1] or None, "
                             f"got {self.seed!r}")
        for s in self._stop_list:
            if not isinstance(s, str) or s == "":
                raise ValueError(f"stop must be non-empty strings, got {s!r}")
            if not _is_valid_unicode(s):
                raise ValueError(f"stop string {s!r} is not valid Unicode (it contains a lone "
                                 "surrogate), so it could never match the generated text")
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise ValueError(f"{name} must be True or False, got {value!r}")
        for t in self.stop_token_ids or ():
            if _not_int(t) or t < 0:
                raise ValueError(f"stop_token_ids must be non-negative integers, got {t!r}")
        k = self.truncate_prompt_tokens
        if k is not None and (_not_int(k) or not (k >= 1 or k == -1)):
            raise ValueError(f"truncate_prompt_tokens must be an integer >= 1 or -1 (keep "
                             f"the last k prompt tokens; -1: as many as max_model_len "
                             f"allows) or None (no truncation), got {k!r}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    @property
    def stop_strings(self) -> list[str]:
        return self._stop_list


# Seeds are int64, as vLLM's API allows. (torch's manual_seed also takes up to 2**64 - 1 but
# maps a negative seed s onto 2**64 + s, so allowing both ranges would alias seeds.)
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


def _is_valid_unicode(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _not_int(value) -> bool:
    return isinstance(value, bool) or not isinstance(value, int)


def _check_number(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
