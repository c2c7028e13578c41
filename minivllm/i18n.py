"""Sentences computed from measurements, in English and Chinese, from one execution.

A chapter notebook prints what it measured; where a sentence is a verdict computed in
code ("holds here" / "does NOT hold here", a claims row's measured text), the course's
Chinese edition must show the same verdict in Chinese, with the same numbers, without
executing the chapter twice. ``say(en, zh)`` prints ``en`` and carries ``zh`` with it:

    say(f"{n} of {m} prompts change their greedy text",
        f"{m} 个提示词中有 {n} 个的贪心输出改变")

- In a Jupyter kernel it emits one ``display_data`` output whose ``text/plain`` is the
  English (what JupyterLab, the English site and ``docs/claims.py`` read) and whose
  metadata ``minivllm/zh`` is the Chinese (what the Chinese site shows in its place:
  ``docs/i18n.py``, ``localize``).
- Elsewhere (a script, a test) it prints the English.
- Both texts must carry the same numbers: the multiset of numeric tokens ("3", "0.25",
  "1e-05", "4.8e-5", the 16 of "bf16") of ``en`` and of ``zh`` must be equal, or
  ``say`` raises ``ValueError`` naming the difference. A translation that drops,
  changes or invents a number fails the chapter's execution instead of being published.

``claims_table(rows)`` says a claims table (``| claim | measured |`` in Markdown, the
format ``docs/claims.py`` reads) in both languages; a row's cells are ``Bi`` pairs, or
plain strings for text that is the same in both (numbers, code).
"""

from __future__ import annotations

import re
import sys
from collections import Counter
from dataclasses import dataclass
from typing import Sequence, Union

ZH_KEY = "minivllm/zh"  # the display_data metadata key that carries the Chinese text

# A numeric token: digits with an optional fraction and exponent, not part of a longer
# identifier's letters ("e4m3" gives 4 and 3; "1e-05" is one token; "3.0x" gives 3.0).
NUMBER = re.compile(r"(?<![\d.])\d+(?:\.\d+)?(?:[eE][-+]?\d+)?")


def numbers(text: str) -> Counter:
    """The multiset of numeric tokens of ``text`` (see ``NUMBER``)."""
    return Counter(NUMBER.findall(text))


@dataclass(frozen=True)
class Bi:
    """A text in English and in Chinese (``en``, ``zh``: str, the same numbers)."""

    en: str
    zh: str

    def __post_init__(self):
        check_numbers(self.en, self.zh)


Text = Union[Bi, str]


def check_numbers(en: str, zh: str) -> None:
    """ValueError unless ``en`` and ``zh`` carry the same numeric tokens (as multisets)."""
    a, b = numbers(en), numbers(zh)
    if a != b:
        raise ValueError(
            "the Chinese text must carry the same numbers as the English: "
            f"only in English {dict(a - b)}, only in Chinese {dict(b - a)}\n"
            f"  en: {en[:300]!r}\n  zh: {zh[:300]!r}")


def _in_kernel() -> bool:
    ip = sys.modules.get("IPython")
    if ip is None:
        return False
    try:
        shell = ip.get_ipython()
    except AttributeError:
        return False
    return shell is not None and getattr(shell, "kernel", None) is not None


def say(en: Text, zh: str | None = None) -> None:
    """Print ``en``, carrying its Chinese ``zh`` (``say(Bi(...))`` works too).

    Raises ValueError when the two carry different numbers (``check_numbers``) or when
    ``zh`` is missing for a str ``en``."""
    if isinstance(en, Bi):
        if zh is not None:
            raise ValueError("say(Bi(...)) takes no second text")
        text = en
    elif zh is None:
        raise ValueError("say(en, zh): the Chinese text is missing")
    else:
        text = Bi(en, zh)  # checks the numbers
    if _in_kernel():
        from IPython.display import display

        display({"text/plain": text.en}, raw=True, metadata={ZH_KEY: text.zh})
    else:
        print(text.en)


def _cell(t: Text, lang: str) -> str:
    s = t if isinstance(t, str) else getattr(t, lang)
    return " ".join(s.split())  # one line per row


def claims_table(rows: Sequence[tuple[Text, Text]], *,
                 header: tuple[Bi, Bi] = (Bi("claim", "论断"),
                                         Bi("measured here", "本次实测"))) -> None:
    """Say a claims table: ``| claim | measured here |`` and one row per (claim,
    measured) pair, in English and in Chinese (``docs/claims.py`` reads both)."""
    tables = {}
    for lang in ("en", "zh"):
        lines = [f"| {_cell(header[0], lang)} | {_cell(header[1], lang)} |", "|---|---|"]
        lines += [f"| {_cell(c, lang)} | {_cell(m, lang)} |" for c, m in rows]
        tables[lang] = "\n".join(lines)
    say(tables["en"], tables["zh"])
