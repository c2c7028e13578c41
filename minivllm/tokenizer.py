"""Tokenizer loading (transformers' tokenizers; a library, not ours to rewrite), and the
references of the prompt-processing steps ("prompt.chat_template", "prompt.truncate")."""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

# tokenizer_config.json classes that AutoTokenizer itself resolves to the tokenizers-backed
# PreTrainedTokenizerFast (transformers 5: TokenizersBackend). For these the class is
# loaded directly: AutoTokenizer's first call imports the model-config registry (about
# 5 s on a 2-core machine, once per process: every notebook kernel and every grading run
# pays it) and gives the same object (tests/test_api.py compares the two).
_FAST_CLASSES = {"TokenizersBackend", "PreTrainedTokenizerFast"}


def _tokenizer_class(path: str) -> str | None:
    cfg = Path(path) / "tokenizer_config.json"
    if not (Path(path) / "tokenizer.json").is_file() or not cfg.is_file():
        return None
    try:
        return json.loads(cfg.read_text()).get("tokenizer_class")
    except (OSError, ValueError):
        return None


@lru_cache(maxsize=8)
def get_tokenizer(path: str):
    """Load the tokenizer saved with the model folder ``path``.

    Uses ``PreTrainedTokenizerFast`` directly when the folder's tokenizer_config.json names
    it (or transformers 5's ``TokenizersBackend``), else ``AutoTokenizer``.

    Raises:
        ValueError: no tokenizer loads from ``path`` (the message carries the cause).
    """
    try:
        if _tokenizer_class(path) in _FAST_CLASSES:
            from transformers import PreTrainedTokenizerFast

            return PreTrainedTokenizerFast.from_pretrained(path)
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path)
    except Exception as e:
        raise ValueError(f"Could not load a tokenizer from {path!r}: {e}") from e


# --- prompt processing: the "prompt.chat_template" and "prompt.truncate" steps ----------

def render_chat_ref(tokenizer, conversation: list[dict], add_generation_prompt: bool = True,
                    chat_template=None) -> list[int]:
    """The reference of the "prompt.chat_template" step: render the chat template to
    text, then tokenize that text with ``add_special_tokens=False``.

    The template already writes every special token the model was trained with (for
    SmolLM2 ``<|im_start|>``, id 1, which is also its ``bos_token``; for Llama-3
    ``<|begin_of_text|>``). Tokenizing the rendered text with ``add_special_tokens=True``
    lets a tokenizer that adds a BOS (Llama-3's does, SmolLM2's does not) put a second
    one in front: vLLM PR #16976 "Fix doubling of BOS token when BOS already exists";
    sglang PR #888 fixed the same by tokenizing inside apply_chat_template.

    Args:
        tokenizer: a transformers tokenizer with a chat template.
        conversation: [{"role": str, "content": str}, ...].
        add_generation_prompt: end with the assistant header (``<|im_start|>assistant\\n``)
            so the model answers instead of writing the header itself.
        chat_template: a Jinja template to use instead of the tokenizer's.
    Returns:
        token ids, a list of ints.
    Raises:
        whatever ``apply_chat_template`` raises (``LLM.chat`` turns template errors into
        ValueError).
    """
    text = tokenizer.apply_chat_template(conversation, tokenize=False,
                                         add_generation_prompt=add_generation_prompt,
                                         chat_template=chat_template)
    return list(tokenizer.encode(text, add_special_tokens=False))


def truncate_prompt_ref(token_ids: list[int], truncate_prompt_tokens: int) -> list[int]:
    """The reference of the "prompt.truncate" step: keep the **last**
    ``truncate_prompt_tokens`` ids (left truncation, as vLLM's ``truncate_prompt_tokens``;
    ``vllm/entrypoints/openai/serving_engine.py`` tokenizes with truncation_side="left" or
    slices ``ids[-k:]``). A prompt of at most k tokens comes back unchanged.

    Args:
        token_ids: the prompt, a list of ints.
        truncate_prompt_tokens: k >= 1 (already resolved: -1 is turned into a number by
            :func:`resolve_truncate_prompt_tokens`).
    Returns:
        a new list of at most k ints.
    """
    return list(token_ids[-truncate_prompt_tokens:])


def resolve_truncate_prompt_tokens(truncate_prompt_tokens, max_model_len: int):
    """``SamplingParams.truncate_prompt_tokens`` as the number of tokens to keep, or None.

    -1 becomes ``max_model_len - 1`` (the longest prompt this engine accepts: one
    generated token must fit; vLLM resolves -1 to max_model_len). vLLM's
    ``_validate_truncation_size`` refuses k > max_model_len; so does this.

    Raises:
        ValueError: k > max_model_len, or a value that is not None, -1 or an int >= 1.
    """
    k = truncate_prompt_tokens
    if k is None:
        return None
    if isinstance(k, bool) or not isinstance(k, int) or not (k >= 1 or k == -1):
        raise ValueError(f"truncate_prompt_tokens must be an integer >= 1 or -1, or None, "
                         f"got {k!r}")
    if k == -1:
        return max_model_len - 1
    if k > max_model_len:
        raise ValueError(f"truncate_prompt_tokens value ({k}) is greater than max_model_len "
                         f"({max_model_len}). Please, select a smaller truncation size.")
    return k


def truncate_by_turns_ref(conversation: list[dict], render, budget: int):
    """Truncation of a chat by whole turns that keeps the system prompt (chapter 26's fix,
    the reference of lab 26's ``truncate_by_turns``): drop the oldest turns (a user
    message and the assistant's reply), as few as possible, until ``render`` of what is
    kept has at most ``budget`` ids.

    vLLM's ``truncate_prompt_tokens`` cuts the rendered ids on the left instead, which
    drops the system prompt first (:func:`truncate_prompt_ref`).

    Args:
        conversation: an optional system message first, then alternating user/assistant
            messages ending with the user message being asked.
        render: conversation -> token ids (e.g. :func:`render_chat_ref` with a tokenizer).
        budget: the most ids the rendered prompt may have.
    Returns:
        a new list of the kept messages (the same dicts), or None when even the system
        message and the last user message render to more than ``budget`` ids.
    """
    system = [m for m in conversation[:1] if m["role"] == "system"]
    rest = conversation[len(system):]
    for j in range(0, len(rest), 2):
        if len(render(system + rest[j:])) <= budget:
            return system + rest[j:]
    return None
