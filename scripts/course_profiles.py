"""Compare the chapters' executed copies under the two CPU profiles.

`tests/test_course.py` writes an executed copy of each chapter to `reports/course/` (the
machine's own CPU) and, under `make course-isa`, to `reports/course-avx2/` (the same machine
run as an AVX2 CPU). This script answers two questions a reviewer of the chapters asks:

    python scripts/course_profiles.py stale    # which copies no longer match their source
    python scripts/course_profiles.py claims   # which claims rows read differently

``stale`` compares each copy's code cells with the chapter's jupytext source (Markdown edits
do not change outputs, so they do not count) and lists the chapters to execute again, per
folder. ``claims`` reads both copies' claims tables (`docs/claims.py`) and prints each row
whose measured text differs between the profiles once numbers are masked: the rows whose
verdict words differ by CPU, to read beside their numbers. Exit status 0 either way.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = {"native": ROOT / "reports" / "course", "avx2": ROOT / "reports" / "course-avx2"}
_NUMBER = re.compile(r"[-+]?\d[\d,]*\.?\d*(?:e[-+]?\d+)?%?|\[[^\]]*\]")


def _code_cells(cells) -> list[str]:
    return [c.source.strip() for c in cells if c.cell_type == "code"]


def stale() -> dict[str, list[str]]:
    """Folder name -> chapters (``chNN``) whose copy is missing or whose code cells differ
    from the source."""
    import jupytext
    import nbformat

    out: dict[str, list[str]] = {name: [] for name in FOLDERS}
    for src in sorted((ROOT / "course").glob("ch*/ch*.py")):
        code = _code_cells(jupytext.read(src).cells)
        for name, folder in FOLDERS.items():
            copy = folder / f"{src.stem}.ipynb"
            if not copy.exists() or _code_cells(nbformat.read(copy, as_version=4).cells) != code:
                out[name].append(src.stem.split("_")[0])
    return out


def _words(text: str) -> str:
    return " ".join(_NUMBER.sub("#", text).split())


def claim_differences() -> list[tuple[str, str, str, str]]:
    """(chapter, claim, native measured, avx2 measured) for each row whose words differ."""
    sys.path.insert(0, str(ROOT))
    from docs.claims import chapter_claims

    out = []
    for native in sorted(FOLDERS["native"].glob("ch*.ipynb")):
        avx2 = FOLDERS["avx2"] / native.name
        if not avx2.exists():
            out.append((native.stem, "(no AVX2 copy)", "", ""))
            continue
        a, b = chapter_claims(native).rows, chapter_claims(avx2).rows
        if len(a) != len(b):
            out.append((native.stem, f"(row count {len(a)} vs {len(b)})", "", ""))
        for ra, rb in zip(a, b):
            if _words(ra.measured) != _words(rb.measured):
                out.append((native.stem, ra.claim, ra.measured, rb.measured))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=("stale", "claims"))
    args = ap.parse_args(argv)
    if args.what == "stale":
        for name, chapters in stale().items():
            print(f"{name} ({FOLDERS[name].relative_to(ROOT)}): "
                  f"{', '.join(chapters) or 'every copy matches its source'}")
    else:
        rows = claim_differences()
        for chapter, claim, a, b in rows:
            print(f"== {chapter}: {claim}\n  native: {a}\n  avx2:   {b}")
        print(f"{len(rows)} rows read differently between the profiles")
    return 0


if __name__ == "__main__":
    sys.exit(main())
