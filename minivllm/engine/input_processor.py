"""Prompt validation and tokenization before a request enters the scheduler (vLLM:
``InputProcessor.process_inputs`` in ``vllm/v1/engine/input_processor.py``, earlier
``Processor`` in ``processor.py``).

Everything a caller can get wrong is checked here, so that a request the scheduler sees
is valid: the prompt (text, token ids or vLLM's prompt dicts), the sampling parameters
against this model (vocabulary, tokenizer), ``truncate_prompt_tokens`` (the
"prompt.truncate" step) and the length against ``max_model_len``; and, for
``LLM.score``, the sequence, mode and positions. The engine then gives the request an id.
"""

from __future__ import annotations

import numbers
import operator
from typing import Optional, Sequence, Union

import numpy as np
import torch

from minivllm.config import ModelConfig
from minivllm.request import ScoreState
from minivllm.sampling_params import SamplingParams
from minivllm.tokenizer import render_chat_ref, resolve_truncate_prompt_tokens, truncate_prompt_ref
from minivllm.utils import check_valid_unicode

PROMPT_DICT_KEYS = ("prompt", "prompt_token_ids", "cache_salt")


class InputProcessor:
    """Checks and tokenizes prompts for one model.

    Args:
        model_config: vocabulary size and max_model_len.
        tokenizer: the model's tokenizer, or None (``skip_tokenizer_init``: token-id
            prompts only).

    Attributes:
        render_chat, truncate_prompt: the "prompt.chat_template" and "prompt.truncate"
            steps (:mod:`minivllm.steps`), swappable like the numeric ones.
    """

    def __init__(self, model_config: ModelConfig, tokenizer=None):
        self.model_config = model_config
        self.tokenizer = tokenizer
        self.render_chat = render_chat_ref
        self.truncate_prompt = truncate_prompt_ref

    def process_inputs(self, prompt: Union[str, list[int], dict], params: SamplingParams,
                       request_id: Optional[str] = None
                       ) -> tuple[list[int], Optional[str], Optional[str]]:
        """Check one generate request (see ``LLMEngine.add_request``).

        Returns:
            ``(prompt_token_ids, prompt_text, cache_salt)``; ``prompt_text`` is None for a
            token-id prompt.
        Raises:
            ValueError, TypeError: as listed in ``LLMEngine.add_request``.
        """
        cache_salt = None
        if isinstance(prompt, dict):
            prompt, cache_salt = parse_prompt_dict(prompt)
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling params must be SamplingParams, got {type(params).__name__}")
        if request_id is not None and not isinstance(request_id, str):
            raise TypeError(f"request_id must be a string or None, got {type(request_id).__name__}")
        params.validate()  # fields may have been changed since the object was built
        vocab = self.model_config.vocab_size
        for name in ("logprobs", "prompt_logprobs"):
            n = getattr(params, name)
            if n is not None and n > vocab:
                raise ValueError(f"{name}={n} is more than the vocabulary size ({vocab}); "
                                 f"allowed: None or 0..{vocab}")
        if params.stop_strings and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer (skip_tokenizer_init=True); use "
                             "stop_token_ids instead")
        for t in params.stop_token_ids or ():
            if t >= vocab:
                raise ValueError(f"stop_token_ids must be token ids in [0, {vocab}), got {t}")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("skip_tokenizer_init=True: there is no tokenizer, so prompts "
                                 "must be lists of token ids, not text")
            text: Optional[str] = prompt
            check_valid_unicode(prompt, "prompt")
            token_ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, (list, tuple)):
            text = None
            token_ids = self.check_token_ids(prompt, "prompt token ids")
        else:
            raise TypeError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")
        if not token_ids:
            raise ValueError("prompt is empty (0 tokens); give at least one token")
        if params.truncate_prompt_tokens is not None:
            token_ids = self.truncate_prompt_tokens(token_ids, params.truncate_prompt_tokens)
        max_len = self.model_config.max_model_len
        if len(token_ids) >= max_len:
            raise ValueError(
                f"The prompt is {len(token_ids)} tokens long, but max_model_len is {max_len} "
                f"(the prompt plus at least one generated token must fit); shorten the prompt "
                f"or raise max_model_len.")
        return token_ids, text, cache_salt

    def truncate_prompt_tokens(self, token_ids: list[int],
                               truncate_prompt_tokens: Optional[int]) -> list[int]:
        """Apply ``SamplingParams.truncate_prompt_tokens`` to a tokenized prompt: keep the
        last k ids (the "prompt.truncate" step); -1 keeps max_model_len - 1. None returns
        the ids unchanged. ``process_inputs`` calls this; the server calls it before its
        context-length check, so usage.prompt_tokens is the truncated length.

        Raises:
            ValueError: k > max_model_len (vLLM's message), an invalid k, or a swapped
                step that returned more than k ids, no ids, or ids outside the vocabulary.
        """
        k = resolve_truncate_prompt_tokens(truncate_prompt_tokens,
                                           self.model_config.max_model_len)
        if k is None:
            return token_ids
        out = self.truncate_prompt(list(token_ids), k)
        if isinstance(out, (str, bytes)) or not isinstance(out, (list, tuple)):
            raise ValueError(f"the prompt.truncate step must return a list of token ids, "
                             f"got {type(out).__name__}")
        out = self.check_token_ids(out, "truncated prompt token ids")
        if not 0 < len(out) <= k:
            raise ValueError(f"the prompt.truncate step returned {len(out)} tokens for "
                             f"truncate_prompt_tokens={k}; expected 1..{k}")
        return out

    def process_score_inputs(self, token_ids: list[int], mode: str, logits: bool,
                             request_id: Optional[str], positions: Optional[Sequence[int]],
                             use_prefix_cache: bool
                             ) -> tuple[list[int], SamplingParams, ScoreState]:
        """Check one ``LLM.score`` sequence (see ``LLMEngine.add_score_request``).

        Returns:
            ``(prompt_token_ids, params, score_state)``: in "prefill" mode the prompt is
            the whole sequence; in "decode" mode its first token, the rest being forced
            one per step (``score_state.forced_token_ids``). ``params`` is greedy with
            ``max_tokens = T``, which only sizes the request's bookkeeping: a score
            request finishes when it has all T rows, never by length.
        Raises:
            ValueError, TypeError: as listed in ``LLMEngine.add_score_request``.
        """
        if mode not in ("prefill", "decode"):
            raise ValueError(f"mode must be 'prefill' or 'decode', got {mode!r}")
        if not isinstance(logits, bool):
            raise TypeError(f"logits must be True or False, got {logits!r}")
        if not isinstance(use_prefix_cache, bool):
            raise TypeError(f"use_prefix_cache must be True or False, got {use_prefix_cache!r}")
        if request_id is not None and not isinstance(request_id, str):
            raise TypeError(f"request_id must be a string or None, got {type(request_id).__name__}")
        ids = self.check_token_ids(token_ids, "token ids")
        if not ids:
            raise ValueError("cannot score an empty token sequence")
        max_len = self.model_config.max_model_len
        if len(ids) > max_len:
            raise ValueError(f"The sequence to score is {len(ids)} tokens long, but "
                             f"max_model_len is {max_len}; shorten it or raise max_model_len.")
        if mode == "prefill":
            prompt, forced = ids, []
        else:
            prompt, forced = ids[:1], ids[1:]
        wanted = None if positions is None else check_score_positions(positions, len(ids))
        state = ScoreState(num_positions=len(ids), forced_token_ids=forced, logits=logits,
                           positions=wanted, vocab_size=self.model_config.vocab_size,
                           use_prefix_cache=use_prefix_cache)
        return prompt, SamplingParams(temperature=0.0, max_tokens=len(ids)), state

    def check_token_ids(self, tokens, what: str) -> list[int]:
        """Plain ints in [0, vocab) (numpy integer scalars accepted, bools rejected).

        Raises:
            ValueError: another value, naming ``what``.
        """
        vocab = self.model_config.vocab_size
        ids = []
        for t in tokens:
            if isinstance(t, numbers.Integral) and not isinstance(t, (bool, int)):
                t = operator.index(t)  # numpy integer scalars
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
                raise ValueError(f"{what} must be integers in [0, {vocab}), got {t!r}")
            ids.append(int(t))
        return ids


def check_cache_salt(cache_salt) -> Optional[str]:
    """A request's ``cache_salt``: None, or a non-empty string (vLLM's rule, "Parameter
    'cache_salt' must be a non-empty string if provided").

    Raises:
        TypeError: not a string.
        ValueError: the empty string.
    """
    if cache_salt is None:
        return None
    if not isinstance(cache_salt, str):
        raise TypeError(f"cache_salt must be a non-empty string if provided, got "
                        f"{type(cache_salt).__name__}: {cache_salt!r:.40}")
    if not cache_salt:
        raise ValueError("cache_salt must be a non-empty string if provided, got ''")
    check_valid_unicode(cache_salt, "cache_salt")
    return cache_salt


def parse_prompt_dict(prompt: dict) -> tuple[Union[str, list[int]], Optional[str]]:
    """vLLM's ``TextPrompt`` ``{"prompt": str}`` or ``TokensPrompt`` ``{"prompt_token_ids":
    [int, ...]}``, each with an optional ``"cache_salt"``. Returns (prompt, cache_salt).

    Raises:
        ValueError: an unknown key (nothing is silently ignored), neither or both of
            "prompt" and "prompt_token_ids", or an empty cache_salt.
        TypeError: "prompt" not a string, "prompt_token_ids" not a list, or a salt that
            is not a string.
    """
    unknown = sorted(str(k) for k in prompt if k not in PROMPT_DICT_KEYS)
    if unknown:
        raise ValueError(f"unknown prompt key(s) {unknown}; a prompt dict takes 'prompt' (text) "
                         "or 'prompt_token_ids' (a list of ints), and optionally 'cache_salt'")
    if ("prompt" in prompt) == ("prompt_token_ids" in prompt):
        raise ValueError("a prompt dict needs exactly one of 'prompt' (text) and "
                         f"'prompt_token_ids' (a list of ints); got keys {sorted(prompt)}")
    if "prompt" in prompt:
        inner = prompt["prompt"]
        if not isinstance(inner, str):
            raise TypeError(f"'prompt' must be a string, got {type(inner).__name__}; give "
                            "token ids as 'prompt_token_ids'")
    else:
        inner = prompt["prompt_token_ids"]
        if not isinstance(inner, (list, tuple)):
            raise TypeError(f"'prompt_token_ids' must be a list of ints, got "
                            f"{type(inner).__name__}")
        inner = list(inner)
    return inner, check_cache_salt(prompt.get("cache_salt"))


def check_score_positions(positions, num_tokens: int) -> list[int]:
    """``LLM.score(..., positions=)`` for one sequence of ``num_tokens`` tokens: distinct
    ints in [0, num_tokens), as a list in the given order (numpy/torch 1-D integer arrays
    and ``range`` accepted).

    Raises:
        TypeError: not a sequence of ints (a bool, a float, a string...).
        ValueError: a position outside [0, num_tokens), or one that appears twice.
    """
    if isinstance(positions, (torch.Tensor, np.ndarray)):
        if positions.ndim != 1:
            raise ValueError(f"positions must be 1-D (the rows of one sequence), got shape "
                             f"{tuple(positions.shape)}")
        positions = positions.tolist()
    if isinstance(positions, (str, bytes, dict, set, frozenset)) \
            or not isinstance(positions, (list, tuple, range)):
        raise TypeError(f"positions must be a list of ints (rows of the sequence), got "
                        f"{type(positions).__name__}: {positions!r:.80}")
    out = []
    for p in positions:
        if isinstance(p, (bool, np.bool_)) or not isinstance(p, numbers.Integral):
            raise TypeError(f"positions must be ints, got {type(p).__name__}: {p!r:.40}")
        p = int(p)
        if not 0 <= p < num_tokens:
            raise ValueError(f"position {p} is outside the sequence: a sequence of "
                             f"{num_tokens} tokens has rows 0..{num_tokens - 1} (negative "
                             "positions are not accepted)")
        out.append(p)
    if len(set(out)) != len(out):
        seen, dup = set(), None
        for p in out:
            if p in seen:
                dup = p
                break
            seen.add(p)
        raise ValueError(f"position {dup} appears more than once in positions; give each "
                         "row once (index the result to repeat a row)")
    return out
