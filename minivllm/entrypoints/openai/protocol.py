"""Request bodies of the OpenAI-compatible API (pydantic), and their SamplingParams.

Field names follow the OpenAI API (``max_tokens``, ``stop``, ``logprobs``...) plus vLLM's
sampling extensions (``top_k``, ``min_p``, ``repetition_penalty``, ``ignore_eos``,
``min_tokens``, ``stop_token_ids``, ``skip_special_tokens``,
``include_stop_str_in_output``, ``truncate_prompt_tokens``). Unknown fields are refused (400), so a misspelled
parameter is never silently ignored. Values are range-checked by
:class:`~minivllm.sampling_params.SamplingParams`; its ValueError becomes a 400.
"""

from __future__ import annotations

import dataclasses
from typing import Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator

from minivllm.sampling_params import SamplingParams


# The defaults of the fields a generation config may set, used when neither the request
# nor the model sets them: SamplingParams' own (vLLM's ChatCompletionRequest.
# _DEFAULT_SAMPLING_PARAMS plays this part there).
_SAMPLING_DEFAULTS = {f.name: f.default for f in dataclasses.fields(SamplingParams)
                      if f.name in ("temperature", "top_p", "top_k", "min_p",
                                    "repetition_penalty")}


class _Base(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Base):
    include_usage: bool = False


class _SamplingFields(_Base):
    model: str
    max_tokens: Optional[int] = None
    # None (not sent): the model's generation-config default, else _SAMPLING_DEFAULTS
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    n: int = 1
    seed: Optional[int] = None
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: Optional[list[int]] = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: Optional[float] = None
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    user: Optional[str] = None
    # vLLM's extension: keep the last k prompt tokens (-1: as many as fit); None: refuse
    # a prompt that does not fit (see SamplingParams.truncate_prompt_tokens)
    truncate_prompt_tokens: Optional[int] = None
    # vLLM's prefix-cache salt: requests with different salts share no cached block.
    cache_salt: Optional[str] = None

    @field_validator("cache_salt", mode="before")
    @classmethod
    def _check_cache_salt(cls, v):
        if v is not None and (not isinstance(v, str) or not v):
            raise ValueError(f"Parameter 'cache_salt' must be a non-empty string if provided, "
                             f"got {v!r:.40}")
        return v

    def engine_prompt(self, token_ids: list[int]):
        """The prompt the engine gets: the token ids, or vLLM's TokensPrompt dict with the
        request's ``cache_salt``."""
        if self.cache_salt is None:
            return token_ids
        key = "prompt" if isinstance(token_ids, str) else "prompt_token_ids"
        return {key: token_ids, "cache_salt": self.cache_salt}

    def sampling_params(self, default_max_tokens: Optional[int], logprobs: Optional[int],
                        defaults: Optional[dict] = None) -> SamplingParams:
        """The request's SamplingParams. A sampling field the request does not send takes
        ``defaults`` (the engine's ``default_sampling_params``, from the model's generation
        config), else :data:`_SAMPLING_DEFAULTS`; a generation-config ``max_tokens`` caps
        the request's, as vLLM's ``get_max_tokens`` (``vllm/entrypoints/utils.py``).

        Raises ValueError for values SamplingParams does not allow, or n != 1."""
        if self.n != 1:
            raise ValueError(f"n={self.n} is not supported (only n=1)")
        defaults = defaults or {}

        def pick(name):
            value = getattr(self, name)
            return value if value is not None else defaults.get(name, _SAMPLING_DEFAULTS[name])

        max_tokens = self.max_tokens if self.max_tokens is not None else default_max_tokens
        if defaults.get("max_tokens") is not None:
            max_tokens = defaults["max_tokens"] if max_tokens is None \
                else min(max_tokens, defaults["max_tokens"])
        stop = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=pick("temperature"), top_p=pick("top_p"), top_k=pick("top_k"),
            min_p=pick("min_p"), seed=self.seed, stop=stop,
            stop_token_ids=list(self.stop_token_ids or []),
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            repetition_penalty=pick("repetition_penalty"), ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens, skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output, logprobs=logprobs,
            truncate_prompt_tokens=self.truncate_prompt_tokens)


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions``. ``prompt``: text, or a list of token ids (a list with one
    text is accepted too). OpenAI's default ``max_tokens`` is 16."""

    prompt: Union[str, list[int], list[str]]
    logprobs: Optional[int] = Field(default=None, ge=0)
    echo: bool = False
    suffix: Optional[str] = None


class ChatMessage(_Base):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: Union[str, list[dict]]
    name: Optional[str] = None


class ChatCompletionRequest(_SamplingFields):
    """``POST /v1/chat/completions``. ``max_completion_tokens`` is OpenAI's newer name for
    ``max_tokens``; without either, the rest of the context (max_model_len - prompt) is
    allowed, as vLLM does."""

    messages: list[ChatMessage]
    max_completion_tokens: Optional[int] = None
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(default=None, ge=0)
    add_generation_prompt: bool = True


class TokenizeRequest(_Base):
    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list[ChatMessage]] = None
    add_special_tokens: bool = True


class DetokenizeRequest(_Base):
    model: Optional[str] = None
    tokens: list[int]


def message_text(m: ChatMessage) -> str:
    """A message's text: a string, or OpenAI content parts of type "text" joined.

    Raises:
        ValueError: a part that is not text (images and audio are not supported).
    """
    if isinstance(m.content, str):
        return m.content
    texts = []
    for part in m.content:
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise ValueError(f"only text content parts are supported, got {part!r:.80}")
        texts.append(part["text"])
    return "".join(texts)
