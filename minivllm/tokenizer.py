"""Tokenizer loading (transformers' tokenizers; a library, not ours to rewrite)."""

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
