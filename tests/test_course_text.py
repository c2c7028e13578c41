"""Learner-facing text of the chapters and labs, read as the site renders it.

A Markdown line whose first non-blank character is ``#`` followed by something other than
a space or another ``#`` (``#7805** (2024-06 ...``) is a heading for Python-Markdown, which
needs no space after the ``#``: an issue number wrapped onto the start of a line turns
into a large heading on the course site. In the jupytext sources a Markdown line is a
comment line, so the rendered line starts after the ``# `` prefix.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = sorted([*(ROOT / "course").glob("ch*/ch*.py"), *(ROOT / "labs" / "source").glob("ch*/ch*_lab.py")])
STRAY_HEADING = re.compile(r"^#\s+#[^ #]")


def stray_headings(text: str) -> list[str]:
    return [f"line {i}: {line[:70]}" for i, line in enumerate(text.split("\n"), 1)
            if STRAY_HEADING.match(line)]


def test_stray_heading_detector():
    assert stray_headings("# see vllm\n#   #7805** (2024-06)")
    assert stray_headings("# #12).")
    assert not stray_headings("# ## Task 1: a heading\n# # Lab 3\n#   see vllm #7805")


@pytest.mark.parametrize("path", SOURCES, ids=[p.stem for p in SOURCES])
def test_no_line_renders_as_a_stray_heading(path):
    bad = stray_headings(path.read_text())
    assert not bad, f"{path.relative_to(ROOT)}: lines the site renders as headings: {bad}"
