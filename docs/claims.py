"""Every chapter's claim-vs-measurement rows, read from its executed notebook.

Each chapter ends its teaching part with a section headed "Claim vs measurement" (or
"Claims versus / against / and measurements"): a table of what a source (the seed course,
an issue, the syllabus) claims and what the chapter measured when it ran. Some chapters
write the table in Markdown, most print it from a code cell so that its numbers are the
run's. The site's "Claims and measurements" page (docs/hooks.py) gathers the rows of all
chapters from the executed notebooks (docs/notebooks.py), so the page always shows the
numbers of the notebooks the site shows, and nothing is copied by hand.

What a section may hold, all read here:

- a Markdown table in the heading's cell, or printed by the code cells right after it
  (``| claim | [source |] measured |``; a cell's ``|`` that is not a column separator,
  as in ``max |Δ|``, stays in the cell: separators have white space on both sides);
- printed pairs ``claim\\n    -> measured`` or ``- claim\\n    measured: measured``;
- a printed two-column text table whose header starts with ``claim`` (columns padded).

A chapter whose section is missing or yields no row raises ``ClaimsError``: the site
build fails rather than publish a page with a chapter left out.

No mkdocs import here: the tests load this file on its own.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

HEADING = re.compile(
    r"^(#{2,3})\s+((?:\d+\.\s+)?Claims?\s+(?:vs\.?|versus|against|and)\s+measurements?\b.*?)\s*$",
    re.I | re.M)
NEXT_HEADING = re.compile(r"^#{1,3}\s", re.M)
SEPARATOR = re.compile(r"(?<!\S)(?<!\\)\|(?!\S)")  # a column separator: " | "


class ClaimsError(ValueError):
    pass


@dataclass
class Row:
    claim: str
    measured: str
    source: str = ""
    markdown: bool = False  # a Markdown table's cells (keep their markup), or plain text


@dataclass
class Section:
    heading: str  # the section's heading text, e.g. "7. Claim vs measurement"
    rows: list[Row] = field(default_factory=list)


def _outputs_text(cell) -> str:
    out = []
    for o in cell.get("outputs", []):
        kind = o.get("output_type")
        if kind == "stream" and o.get("name") == "stdout":
            out.append(o.get("text", ""))
        elif kind in ("display_data", "execute_result"):
            data = o.get("data", {})
            text = data.get("text/markdown") or data.get("text/plain") or ""
            out.append(text if isinstance(text, str) else "".join(text))
    return "".join(out)


def _cells(line: str) -> list[str]:
    line = line.strip()
    line = line[1:] if line.startswith("|") else line
    line = line[:-1] if line.endswith("|") and not line.endswith("\\|") else line
    return [c.strip() for c in SEPARATOR.split(line)]


def _is_rule(cells: list[str]) -> bool:
    return all(re.fullmatch(r":?-{3,}:?", c) for c in cells)


def _table_rows(lines: list[str]) -> list[Row]:
    rows, header = [], None
    for line in lines:
        if not line.strip().startswith("|"):
            header = None if not line.strip() else header  # a blank line ends a table
            continue
        cells = _cells(line)
        if _is_rule(cells):
            continue
        if header is None:
            header = [c.lower() for c in cells]
            continue
        if len(header) == 3 and "source" in header[1] and len(cells) >= 3:
            rows.append(Row(cells[0], " | ".join(cells[2:]), cells[1], markdown=True))
        elif len(cells) >= 2:
            rows.append(Row(cells[0], " | ".join(cells[1:]), "", markdown=True))
    return rows


def rows_of_text(text: str) -> list[Row]:
    """The claim rows of one piece of text (a Markdown cell or a code cell's output). A
    table's cells are Markdown (whether a Markdown cell has it or a cell printed it);
    the printed pairs and columns are plain text."""
    lines = text.splitlines()
    rows = _table_rows(lines)
    if rows:
        return rows
    for i in range(1, len(lines)):
        m = re.match(r"^\s+(?:->|measured:)\s+(.*)$", lines[i])
        prev = lines[i - 1].strip()
        if m and prev:
            rows.append(Row(re.sub(r"^[-*]\s+", "", prev), m.group(1).strip()))
    if rows:
        return rows
    if lines and (m := re.match(r"^(claim\s{2,})\S", lines[0], re.I)):
        w = len(m.group(1))
        rows = [Row(ln[:w].strip(), ln[w:].strip()) for ln in lines[1:]
                if ln.strip() and ln[w:].strip()]
    return rows


def section_index(nb) -> int | None:
    """The index of the cell that heads the claims section (the last, if several)."""
    at = None
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "markdown" and HEADING.search(cell.source):
            at = i
    return at


def section_of(nb, at: int | None = None) -> Section | None:
    """The claims section of an executed notebook (the last one, if several match):
    its heading cell (after the heading, up to the next heading) and the outputs of the
    code cells right after it, up to the next Markdown cell. ``at``: the heading cell's
    index, found in another copy of the notebook (the English one, for a translation
    whose heading this module's English pattern does not match)."""
    at = section_index(nb) if at is None else at
    if at is None:
        return None
    source = nb.cells[at].source
    # a translated heading does not match HEADING: its cell's first heading, then
    m = HEADING.search(source) or re.search(r"^(#{2,3})\s+(.*?)\s*$", source, re.M)
    if m is None:
        return None
    sec = Section(m.group(2).strip())
    rest = source[m.end():]
    if nxt := NEXT_HEADING.search(rest):
        rest = rest[:nxt.start()]
    sec.rows += rows_of_text(rest)
    for cell in nb.cells[at + 1:]:
        if cell.cell_type != "code":
            break
        sec.rows += rows_of_text(_outputs_text(cell))
    return sec


def chapter_claims(executed: Path, english: Path | None = None) -> Section:
    """The claims section of one executed chapter notebook; ClaimsError if it has none
    or no row could be read. ``english``: for a translated copy of the notebook, the
    English copy, where the section is found (the same cell in both)."""
    import nbformat

    nb = nbformat.read(str(executed), as_version=4)
    at = None
    if english is not None:
        at = section_index(nbformat.read(str(english), as_version=4))
        if at is None:
            raise ClaimsError(f"{Path(english).name}: no 'Claim vs measurement' section")
    sec = section_of(nb, at)
    name = Path(executed).name
    if sec is None:
        raise ClaimsError(f"{name}: no 'Claim vs measurement' section (a heading such as "
                          "'## 7. Claim vs measurement')")
    if not sec.rows:
        raise ClaimsError(f"{name}: section '{sec.heading}' has no row this page can read "
                          "(a '| claim | measured |' table, or the formats docs/claims.py "
                          "lists)")
    return sec


def heading_anchor(heading: str) -> str:
    """The id a chapter page gives a Markdown heading (mkdocs-jupyter: Python-Markdown's
    toc slugify, e.g. "7. Claim vs measurement" -> "7-claim-vs-measurement"). A heading
    with Chinese characters keeps them ("7. 论断与实测" -> "7-论断与实测"): the ASCII slug
    would drop them, leaving "7" or an empty id (docs/hooks.py gives mkdocs-jupyter this
    function for the ids and the table of contents of every chapter page)."""
    import unicodedata

    if not re.search(r"[\u3400-\u9fff]", heading):
        heading = unicodedata.normalize("NFKD", heading).encode("ascii", "ignore").decode("ascii")
    else:
        heading = unicodedata.normalize("NFKC", heading)
    heading = re.sub(r"[^\w\s-]", "", heading).strip().lower()
    return re.sub(r"[-\s]+", "-", heading)


if __name__ == "__main__":  # python docs/claims.py build/notebooks/*.ipynb: rows per chapter
    import sys

    for p in sys.argv[1:]:
        s = chapter_claims(Path(p))
        print(f"{Path(p).stem}: {len(s.rows)} rows ({s.heading})")
