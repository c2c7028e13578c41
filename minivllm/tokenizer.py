"""Tokenizer loading (transformers' AutoTokenizer; a library, not ours to rewrite)."""

from __future__ import annotations

from functools import lru_cache


@lru_cache(maxsize=8)
def get_tokenizer(path: str):
    """Load the tokenizer saved with the model folder. Raises ValueError if none loads."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception as e:
        raise ValueError(f"Could not load a tokenizer from {path!r}: {e}") from e
