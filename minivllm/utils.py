"""Small input checks shared by the entry points."""

from __future__ import annotations


def check_valid_unicode(text: str, what: str) -> None:
    """Raise ValueError if ``text`` cannot be encoded as UTF-8 (a lone surrogate), naming
    ``what`` it is, the reason and the character position."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{what} is not valid Unicode: {e.reason} at character {e.start} "
                         f"({text[e.start:e.end]!r})") from None
