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
and may be cited by that name. Nor do they cite the project's own issue tracker ("issue 25,
item 4"): a public issue is cited with its repository and ``#`` number (``vllm #16832``,
``issue #39972``), which the check lets through. The site's other pages (``docs/``, the
README) get the same check, except that the word "syllabus" is theirs: the site has a
public syllabus page.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = sorted([*(ROOT / "course").glob("ch*/ch*.py"), *(ROOT / "labs" / "source").glob("ch*/ch*_lab.py")])
STRAY_HEADING = re.compile(r"^#\s+#[^ #]")
# tags and the project's issue numbers, in any case
_INTERNAL_TAGS = r"planning notes|\[(?:syllabus )?est\.?\]|\[RESULTS\]|\bissues? \d"
INTERNAL_REFERENCE = re.compile(rf"INCIDENTS|incidents\.md|(?i:syllabus|{_INTERNAL_TAGS})")
# the site's pages and the README: the same, but "syllabus" (the site's own page) is allowed
DOCS = sorted([*(ROOT / "docs").rglob("*.md"), ROOT / "README.md"])
DOC_INTERNAL_REFERENCE = re.compile(
    rf"INCIDENTS|incidents\.md|SYLLABUS\.md|shared/SYLLABUS|(?i:{_INTERNAL_TAGS})")


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


def internal_references(text: str, pattern: re.Pattern = INTERNAL_REFERENCE) -> list[str]:
    return [f"line {i}: {line.strip()[:80]}" for i, line in enumerate(text.split("\n"), 1)
            if pattern.search(line)]


def test_internal_reference_detector():
    assert internal_references("#   bfloat16 (INCIDENTS.md #13). Large RMSNorm weights")
    assert internal_references('    ("SYLLABUS: a drift monitor detects a penalty default",')
    assert internal_references("# ~1e-11 nats): far below the 1e-6 the syllabus asks for")
    assert internal_references('print("| bf16: may flip [syllabus est.] | not on this CPU")')
    assert internal_references('    ("greedy speculative == plain in fp32 [est]",')
    assert internal_references("# The planning notes for this chapter listed three expectations.")
    assert internal_references("# nats (the [RESULTS] anchor for bf16 weights is 1.07e-3)")
    assert internal_references("# **Greedy QA against KL (issue 25, item 4).** Chapter 15")
    assert internal_references("# comes from two H200s when available (Issue 28).")
    assert not internal_references("# clamps the residual adds, issue #39972; vllm #16832")
    assert internal_references("see SYLLABUS.md section 3", DOC_INTERNAL_REFERENCE)
    assert internal_references("as issues 38 and 40 say", DOC_INTERNAL_REFERENCE)
    assert not internal_references("The [syllabus](syllabus.md) lists the thirty chapters.",
                                   DOC_INTERNAL_REFERENCE)
    assert not internal_references(
        "# **The incidents.** vllm #5543 (2024-06-14): the incident, from public sources\n"
        '    ("course plan estimate: bf16 may flip", f"{kl:.3g} (benchmarks/RESULTS.md)")\n'
        "# estimated from the course plan; RESULTS = {} # a variable, not the tag")


@pytest.mark.parametrize("path", SOURCES, ids=[p.stem for p in SOURCES])
def test_no_internal_planning_references(path):
    bad = internal_references(path.read_text())
    assert not bad, (f"{path.relative_to(ROOT)}: mentions internal planning files or tags "
                     f"(cite the public source, or say 'course plan'): {bad}")


@pytest.mark.parametrize("path", DOCS, ids=[str(p.relative_to(ROOT)) for p in DOCS])
def test_site_pages_cite_no_internal_planning(path):
    bad = internal_references(path.read_text(), DOC_INTERNAL_REFERENCE)
    assert not bad, (f"{path.relative_to(ROOT)}: mentions internal planning files, tags or "
                     f"the project's issue numbers (cite the public source): {bad}")


# Every chapter ends with what to use on a real vLLM deployment (flags, environment
# variables, metrics, the version checked and what this engine does differently).
ON_REAL_VLLM = re.compile(r"^# ## On real vLLM\s*$", re.M)
BOXED = [p for p in SOURCES if p.parent.parent.name == "course"]


@pytest.mark.parametrize("path", BOXED, ids=[p.stem for p in BOXED])
def test_chapter_has_an_on_real_vllm_box(path):
    text = path.read_text()
    heading = ON_REAL_VLLM.search(text)
    assert heading, f"{path.relative_to(ROOT)}: no '## On real vLLM' section"
    box = text[heading.end():].split("# %%")[0]
    assert "vllm" in box.lower() and box.count("\n# - ") >= 3, (
        f"{path.relative_to(ROOT)}: the 'On real vLLM' box needs at least three bullets")


# A claims row's measured text that opens with a verdict written as a literal ("yes: ...",
# f"confirmed: {n} ..."): the verdict must come from the measurement (an expression on a
# boolean), since the same code prints under other CPUs. A row that states a fact of
# arithmetic or cites another chapter's measurement keeps its literal with the comment
# "# fact, not a measurement" on that source line.
LITERAL_VERDICT = re.compile(
    r"""^\s*(?:\(\s*)?(?:(?:Bi|say)\(\s*)?\+?\s*f?["'](yes|no|confirmed|reproduced|refuted|true|false|wrong|right|holds|"""
    r"""same order(?: here)?|reversed(?: here)?|both|not on this (?:model|CPU))\b\s*[:,(]""", re.I)
# ... or a printed Markdown table row whose measured cell opens with one: '| claim | yes: ...'
LITERAL_ROW = re.compile(
    r"""^\s*(?:print\(|say\(|Bi\()?\s*f?["']\|[^|"']*\|\s*(yes|no|confirmed|reproduced|refuted|"""
    r"""true|false|wrong|right|holds)\b\s*[:,(]""", re.I)
FACT_MARK = "# fact, not a measurement"
CHAPTERS = sorted((ROOT / "course").glob("ch*/ch*.py"))


def literal_verdicts(text: str) -> list[str]:
    """Lines that open a string with a verdict word, unless the string is a branch of a
    conditional expression (``a if ok else b`` over this line and its neighbours) or is
    marked as a fact."""
    lines = text.split("\n")
    out = []
    for i, line in enumerate(lines):
        if not (LITERAL_VERDICT.match(line) or LITERAL_ROW.match(line)) or FACT_MARK in line:
            continue
        before = lines[i - 1].rstrip() if i else ""
        after = lines[i + 1] if i + 1 < len(lines) else ""
        if before.endswith("else") or " if " in line + after:
            continue
        out.append(f"line {i + 1}: {line.strip()[:80]}")
    return out


def test_literal_verdict_detector():
    assert literal_verdicts('     f"confirmed: {n}/{N} identical"),')
    assert literal_verdicts('      "yes: prefill equal")')
    assert literal_verdicts('     f"same order here: KL {a:.3g}",')
    assert literal_verdicts('     Bi(f"yes: {n} equal", f"是：{n} 相等")),')  # the bilingual form
    assert not literal_verdicts('     ("confirmed" if ok else "not confirmed") + f": {n}"')
    assert not literal_verdicts('     "no: converts exactly"  # fact, not a measurement')
    assert not literal_verdicts('# yes: a Markdown line')
    assert literal_verdicts('print(f"| its template adds BOS | yes: encode gives {ids} |")')
    assert literal_verdicts('     Bi(f"yes: {n} equal", f"是：{n} 相等")),')  # bilingual
    assert not literal_verdicts('     f"{\'yes\' if ok else \'no\'}: {n}"')
    assert not literal_verdicts('     + ("same" if ok else\n        f"NO: differs at {k}"))')


@pytest.mark.parametrize("path", CHAPTERS, ids=[p.stem for p in CHAPTERS])
def test_claims_verdicts_are_computed(path):
    bad = literal_verdicts(path.read_text())
    assert not bad, (f"{path.relative_to(ROOT)}: verdicts written as literals (compute them "
                     f"from the measurement, or mark a fact with '{FACT_MARK}'): {bad}")
