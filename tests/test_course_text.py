"""Learner-facing text of the chapters and labs, read as the site renders it.

A Markdown line whose first non-blank character is ``#`` followed by something other than
a space or another ``#`` (``#7805** (2024-06 ...``) is a heading for Python-Markdown, which
needs no space after the ``#``: an issue number wrapped onto the start of a line turns
into a large heading on the course site. In the jupytext sources a Markdown line is a
comment line, so the rendered line starts after the ``# `` prefix.

The chapters and labs are published, so they cite public sources only: never the project's
internal planning files or their numbering (``INCIDENTS.md #13``, ``SYLLABUS``, "the
syllabus" for that file, "planning notes", the estimate tags ``[est]`` / ``[syllabus est.]``
or the evidence tag ``[RESULTS]``). A claim from the course's plan is labelled "course plan"
(or "course plan estimate"); ``benchmarks/RESULTS.md`` is a public file of the repository
and may be cited by that name. The site's own syllabus page lives in ``docs/`` and is not
checked here.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = sorted([*(ROOT / "course").glob("ch*/ch*.py"), *(ROOT / "labs" / "source").glob("ch*/ch*_lab.py")])
STRAY_HEADING = re.compile(r"^#\s+#[^ #]")
INTERNAL_REFERENCE = re.compile(
    r"INCIDENTS|incidents\.md|(?i:syllabus|planning notes|\[(?:syllabus )?est\.?\]|\[RESULTS\])")


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


def internal_references(text: str) -> list[str]:
    return [f"line {i}: {line.strip()[:80]}" for i, line in enumerate(text.split("\n"), 1)
            if INTERNAL_REFERENCE.search(line)]


def test_internal_reference_detector():
    assert internal_references("#   bfloat16 (INCIDENTS.md #13). Large RMSNorm weights")
    assert internal_references('    ("SYLLABUS: a drift monitor detects a penalty default",')
    assert internal_references("# ~1e-11 nats): far below the 1e-6 the syllabus asks for")
    assert internal_references('print("| bf16: may flip [syllabus est.] | not on this CPU")')
    assert internal_references('    ("greedy speculative == plain in fp32 [est]",')
    assert internal_references("# The planning notes for this chapter listed three expectations.")
    assert internal_references("# nats (the [RESULTS] anchor for bf16 weights is 1.07e-3)")
    assert not internal_references(
        "# **The incidents.** vllm #5543 (2024-06-14): the incident, from public sources\n"
        '    ("course plan estimate: bf16 may flip", f"{kl:.3g} (benchmarks/RESULTS.md)")\n'
        "# estimated from the course plan; RESULTS = {} # a variable, not the tag")


@pytest.mark.parametrize("path", SOURCES, ids=[p.stem for p in SOURCES])
def test_no_internal_planning_references(path):
    bad = internal_references(path.read_text())
    assert not bad, (f"{path.relative_to(ROOT)}: mentions internal planning files or tags "
                     f"(cite the public source, or say 'course plan'): {bad}")
