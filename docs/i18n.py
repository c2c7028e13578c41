"""The Chinese edition of the chapters and labs: translations stored as data, tied to the
English cell each one translates.

Each chapter (``course/chNN_*/chNN_*.py``) and each lab (``labs/source/chNN/*.py``) has
its translation beside it, ``<stem>.zh.md``: one block per Markdown cell,

    <!-- cell 12 en=3f2a9c1b7d4e -->
    ## 3. 中文标题
    ...

where ``cell 12`` is the cell's index in the notebook (jupytext's reading of the source,
the same cells as the executed copy) and ``en=`` the first 12 hex digits of the sha256 of
the English cell it translates. Code cells, their outputs and plots are not translated:
they are shared. Sentences that code prints from measurements carry their own Chinese
(``minivllm.i18n.say``), which ``localize`` puts in place of the English.

A block is **stale** when the English cell at its index no longer has its digest (the
English changed since it was translated), **missing** when a Markdown cell has no block,
an **orphan** when its index is not a Markdown cell. ``tests/test_translations.py`` fails
on any of them, so main has none; a site built from a working tree that has some shows
the English cell under a visible "not yet translated" mark (``localize``), so an author
who edits English can still build and see what is left. A translation that contradicts
its chapter's numbers is worse than none: hence the test, not a silent fallback.

``python docs/i18n.py status`` lists stale, missing and orphan blocks; ``python
docs/i18n.py sync [SRC...]`` moves blocks whose English moved to another index (a cell
inserted above) and adds a block holding the English text for each missing cell (to be
replaced by its translation: until it is, ``status`` reports it as having no Chinese);
``python docs/i18n.py accept SRC INDEX...`` records that the blocks of those cells now
translate the current English (after updating a stale block); ``python docs/i18n.py show
SRC INDEX`` prints a cell's English, its Chinese and their digests.

No mkdocs import here: the tests and grading load this file on their own.
"""

from __future__ import annotations

import copy
import hashlib
import re
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LANGS = ("en", "zh")  # the languages a chapter page or a lab is made in
ZH_KEY = "minivllm/zh"  # minivllm.i18n.ZH_KEY (not imported: this file runs without torch)
MARK = re.compile(r"^<!-- cell (\d+) en=([0-9a-f]{12}) -->[ \t]*\n", re.M)
HEADER = ("<!-- The Chinese translation of {src}: one block per Markdown cell. \"cell N\" is "
          "the cell's index in the notebook, \"en=\" the first 12 hex digits of the sha256 "
          "of the English cell it translates. `python docs/i18n.py status` lists what is "
          "stale or missing (docs/i18n.py). -->\n")
UNTRANSLATED = {"zh": "!!! warning \"尚未翻译\"\n    此单元的英文原文在翻译后有改动（或尚无译文），下面显示英文原文。\n\n"}
NUMBER = re.compile(r"(?<![\d.])\d+(?:\.\d+)?(?:[eE][-+]?\d+)?")  # minivllm.i18n.NUMBER
CJK = re.compile(r"[\u3400-\u9fff]")


class TranslationError(ValueError):
    pass


@dataclass
class Block:
    index: int
    digest: str
    text: str


@dataclass
class Status:
    source: Path
    missing: list[int] = field(default_factory=list)
    stale: list[int] = field(default_factory=list)
    orphans: list[int] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)  # check_pair's findings

    @property
    def ok(self) -> bool:
        return not (self.missing or self.stale or self.orphans or self.problems)


# ------------------------------------------------------------------ files

def chapter_sources() -> list[Path]:
    return sorted((ROOT / "course").glob("ch*/ch*.py"))


def lab_sources() -> list[Path]:
    return sorted(p for d in sorted((ROOT / "labs" / "source").glob("ch*")) if d.is_dir()
                  for p in sorted(d.glob("*.py")))


def sources() -> list[Path]:
    return chapter_sources() + lab_sources()


def translation_path(src: Path, lang: str = "zh") -> Path:
    src = Path(src)
    return src.with_name(f"{src.stem}.{lang}.md")


def digest(text: str) -> str:
    """The first 12 hex digits of the sha256 of a cell's text (trailing white space of
    each line and of the cell ignored)."""
    norm = "\n".join(line.rstrip() for line in text.strip("\n").split("\n"))
    return hashlib.sha256(norm.encode()).hexdigest()[:12]


def read_notebook(src: Path):
    import jupytext

    return jupytext.read(src)


def markdown_cells(nb) -> dict[int, str]:
    return {i: c.source for i, c in enumerate(nb.cells) if c.cell_type == "markdown"}


def read(path: Path) -> dict[int, Block]:
    """The blocks of a translation file (empty if there is none). TranslationError on a
    block given twice."""
    path = Path(path)
    if not path.is_file():
        return {}
    text = path.read_text(encoding="utf-8")
    marks = list(MARK.finditer(text))
    out: dict[int, Block] = {}
    for m, nxt in zip(marks, marks[1:] + [None]):
        body = text[m.end():nxt.start() if nxt else len(text)]
        i = int(m.group(1))
        if i in out:
            raise TranslationError(f"{path}: cell {i} is translated twice")
        out[i] = Block(i, m.group(2), body.strip("\n"))
    return out


def write(path: Path, src: Path, blocks: dict[int, Block]) -> None:
    rel = Path(src).resolve().relative_to(ROOT)
    parts = [HEADER.format(src=rel)]
    for i in sorted(blocks):
        b = blocks[i]
        parts.append(f"\n<!-- cell {i} en={b.digest} -->\n{b.text.strip(chr(10))}\n")
    Path(path).write_text("".join(parts), encoding="utf-8")


# ------------------------------------------------------------------ checks

CODE_SPAN = re.compile(r"(`+)(.+?)\1", re.S)
FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
MATH = re.compile(r"\$\$.+?\$\$|(?<![\\$])\$(?!\s)[^$\n]+?(?<!\s)\$", re.S)
URL = re.compile(r"https?://[^\s)>\]]+")
HEADING = re.compile(r"^(#{1,6})\s", re.M)


def _without(text: str, *patterns) -> str:
    for p in patterns:
        text = p.sub(" ", text)
    return text


def check_pair(en: str, zh: str) -> list[str]:
    """What a translation must keep of its English cell; [] when it does.

    - the fenced code blocks, inline code spans, math and URLs, unchanged (as multisets);
    - the headings: as many, at the same levels, in the same order;
    - every number of the English prose (outside code and math) at least as often;
    - Chinese text, where the English cell has prose (a word outside code, math and
      links).
    """
    out = []
    fences_en = [m.group(0) for m in FENCE.finditer(en)]
    fences_zh = [m.group(0) for m in FENCE.finditer(zh)]
    if sorted(fences_en) != sorted(fences_zh):
        out.append(f"fenced code blocks differ ({len(fences_en)} in English, "
                   f"{len(fences_zh)} in Chinese, or their code changed)")
    en_b, zh_b = _without(en, FENCE), _without(zh, FENCE)
    spans_en = Counter(m.group(0) for m in CODE_SPAN.finditer(en_b))
    spans_zh = Counter(m.group(0) for m in CODE_SPAN.finditer(zh_b))
    if spans_en != spans_zh:
        out.append(f"code spans differ: only in English {sorted(spans_en - spans_zh)}, "
                   f"only in Chinese {sorted(spans_zh - spans_en)}")
    en_c, zh_c = _without(en_b, CODE_SPAN), _without(zh_b, CODE_SPAN)
    math_en, math_zh = Counter(MATH.findall(en_c)), Counter(MATH.findall(zh_c))
    if math_en != math_zh:
        out.append(f"math differs: only in English {sorted(math_en - math_zh)}, "
                   f"only in Chinese {sorted(math_zh - math_en)}")
    url_en, url_zh = Counter(URL.findall(en_c)), Counter(URL.findall(zh_c))
    if url_en != url_zh:
        out.append(f"links differ: only in English {sorted(url_en - url_zh)}, "
                   f"only in Chinese {sorted(url_zh - url_en)}")
    h_en, h_zh = HEADING.findall(en_b), HEADING.findall(zh_b)
    if h_en != h_zh:
        out.append(f"headings differ: English {[len(h) for h in h_en]}, "
                   f"Chinese {[len(h) for h in h_zh]} (levels in order)")
    prose_en = _without(en_c, MATH, URL)
    prose_zh = _without(zh_c, MATH, URL)
    missing = Counter(NUMBER.findall(prose_en)) - Counter(NUMBER.findall(prose_zh))
    if missing:
        out.append(f"numbers of the English missing in the Chinese: {dict(missing)}")
    if re.search(r"[A-Za-z]{2,}", _without(prose_en, HEADING)) and not CJK.search(zh):
        out.append("no Chinese text (the English cell has prose)")
    return out


# ------------------------------------------------------------------ the glossary's terms

GLOSSARY = ROOT / "docs" / "zh" / "glossary.md"
EXEMPT = re.compile(r"<!--\s*glossary-exempt:\s*(.*?)\s*-->")


def _alternatives(cell: str) -> list[str]:
    """"预填充 (prefill)" -> ["预填充", "prefill"]; "latency / time to first token (TTFT)"
    -> ["latency", "time to first token", "TTFT"]."""
    out = []
    for part in cell.split(" / "):
        inner = re.findall(r"[(（]([^)）]*)[)）]", part)
        outer = re.sub(r"\s*[(（][^)）]*[)）]", "", part).strip()
        for a in [outer] + [x for i in inner for x in re.split(r"[,，、]\s*", i)]:
            if a.strip():
                out.append(a.strip())
    return out


# English alternatives that are everyday words too ("half of the tokens"): not checked.
EVERYDAY = {"half"}


def glossary() -> list[tuple[list[str], list[str]]]:
    """(English alternatives, Chinese alternatives) for each row of docs/zh/glossary.md
    (the English ones less ``EVERYDAY`` words)."""
    rows = []
    for line in GLOSSARY.read_text(encoding="utf-8").splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 3 or cells[0] in ("中文", "") or set(cells[0]) <= set("-:"):
            continue
        rows.append(([a for a in _alternatives(cells[1]) if a not in EVERYDAY],
                     _alternatives(cells[0])))
    return rows


def _has(text: str, term: str) -> bool:
    if CJK.search(term):
        return term in text
    return re.search(r"(?<![\w-])" + re.escape(term) + r"(?![\w-])", text, re.I) is not None


def check_terms(en: str, zh: str, terms=None) -> list[str]:
    """The glossary's terms used in the English prose (outside code and math) that the
    Chinese renders otherwise: it must hold one of the term's Chinese forms, or the
    English term itself (the glossary keeps many English terms as they are). A block
    may exempt terms its English uses in another sense: ``<!-- glossary-exempt: a, b -->``."""
    terms = glossary() if terms is None else terms
    exempt = {t.strip().lower() for m in EXEMPT.finditer(zh) for t in m.group(1).split(",")}
    prose_en = _without(en, FENCE, CODE_SPAN, MATH, URL)
    out = []
    for en_alts, zh_alts in terms:
        used = [t for t in en_alts if _has(prose_en, t)]
        if not used or any(t.lower() in exempt for t in en_alts):
            continue
        if not any(_has(zh, t) for t in zh_alts + en_alts):
            out.append(f"glossary: the English says {used[0]!r}; the Chinese has none of "
                       f"{zh_alts + en_alts} (or mark it <!-- glossary-exempt: {en_alts[0]} -->)")
    return out


def status(src: Path, lang: str = "zh", nb=None) -> Status:
    nb = nb if nb is not None else read_notebook(src)
    cells = markdown_cells(nb)
    blocks = read(translation_path(src, lang))
    terms = glossary()
    st = Status(Path(src))
    for i, text in cells.items():
        b = blocks.get(i)
        if b is None or not b.text.strip():
            st.missing.append(i)
        elif b.digest != digest(text):
            st.stale.append(i)
        else:
            st.problems += [f"cell {i}: {p}" for p in check_pair(text, b.text)
                            + check_terms(text, b.text, terms)]
    st.orphans = sorted(set(blocks) - set(cells))
    return st


# ------------------------------------------------------------------ localizing a notebook

def _said(o, lang: str) -> str | None:
    """The text of a ``say`` output in ``lang`` (None: not a ``say`` output)."""
    if o.get("output_type") != "display_data" or ZH_KEY not in o.get("metadata", {}):
        return None
    text = o["metadata"][ZH_KEY] if lang == "zh" else o["data"].get("text/plain", "")
    return text if isinstance(text, str) else "".join(text)


# A line break between two Chinese characters (or CJK punctuation) inside a paragraph: the
# translations keep the English source's line wrapping, and a browser renders each such
# break as a space ("之后， 回答"). Joined when a page or a lab is made, outside code.
_CJK_CH = "\u3000-\u303f\u3400-\u9fff\uff00-\uffef"
_CJK_BREAK = re.compile(f"(?<=[{_CJK_CH}])[ \t]*\n[ \t]*(?=[{_CJK_CH}])")


def join_cjk_lines(text: str) -> str:
    """``text`` with the line breaks between two CJK characters removed (with the
    indentation of the next line), except inside fenced code blocks."""
    out, pos = [], 0
    for m in FENCE.finditer(text):
        out += [_CJK_BREAK.sub("", text[pos:m.start()]), m.group(0)]
        pos = m.end()
    return "".join(out + [_CJK_BREAK.sub("", text[pos:])])


def _untranslated(en: str, zh: str) -> bool:
    """A block still holding the English ``sync`` put there (no Chinese, prose to translate)."""
    return any(p.startswith("no Chinese") for p in check_pair(en, zh))


def localize(nb, src: Path, lang: str, *, strict: bool = False):
    """A copy of the executed notebook ``nb`` of ``src`` in ``lang`` ("en" or "zh").

    Markdown cells take their translation (a stale or missing one: the English cell
    under the "not yet translated" mark, or TranslationError when ``strict``). Every
    ``say`` output becomes printed text in ``lang``, merged with the printed text around
    it, so the page reads as the chapter printed it."""
    import nbformat

    out = nbformat.from_dict(copy.deepcopy(dict(nb)))
    if lang != "en":
        blocks = read(translation_path(src, lang))
        for i, c in enumerate(out.cells):
            if c.cell_type != "markdown":
                continue
            b = blocks.get(i)
            if (b is not None and b.text.strip() and b.digest == digest(c.source)
                    and not _untranslated(c.source, b.text)):
                c.source = join_cjk_lines(b.text)
            elif strict:
                raise TranslationError(f"{Path(src).name}, cell {i}: "
                                       f"{'stale' if b else 'no'} {lang} translation")
            else:
                c.source = UNTRANSLATED[lang] + c.source
    for c in out.cells:
        if c.cell_type != "code":
            continue
        outs: list = []
        for o in c.get("outputs", []):
            said = _said(o, lang)
            if said is not None:
                o = nbformat.v4.new_output("stream", name="stdout", text=said + "\n")
            if (outs and o.get("output_type") == "stream" and outs[-1].get("output_type")
                    == "stream" and outs[-1].get("name") == o.get("name")):
                outs[-1]["text"] = outs[-1]["text"] + o["text"]
            else:
                outs.append(o)
        c.outputs = outs
    return out


def localize_source(src: Path, lang: str, *, strict: bool = True):
    """The notebook of ``src`` (not executed: a lab) with its Markdown in ``lang``."""
    return localize(read_notebook(src), src, lang, strict=strict)


# ------------------------------------------------------------------ command line

def _sync(src: Path, lang: str) -> str:
    nb = read_notebook(src)
    cells = markdown_cells(nb)
    path = translation_path(src, lang)
    blocks = read(path)
    by_digest = {b.digest: b for b in blocks.values() if b.text.strip()}
    new: dict[int, Block] = {}
    moved = added = 0
    for i, text in cells.items():
        d = digest(text)
        b = blocks.get(i)
        if b is not None and (b.digest == d or d not in by_digest):
            new[i] = b  # in place (current, or stale: kept for the translator)
        elif d in by_digest:
            new[i] = Block(i, d, by_digest[d].text)
            moved += b is None or b.digest != d
        else:
            new[i] = Block(i, d, text)  # the English, to be replaced by its translation
            added += 1
    write(path, src, new)
    return f"{path.resolve().relative_to(ROOT)}: {moved} moved, {added} blocks added (English to translate)"


def main(argv: list[str]) -> int:
    cmd = argv[0] if argv else "status"
    if cmd == "status":
        bad = 0
        for src in (Path(a) for a in argv[1:]) if argv[1:] else sources():
            st = status(src)
            if st.ok:
                continue
            bad += 1
            print(f"{Path(src).resolve().relative_to(ROOT)}: missing {st.missing}, "
                  f"stale {st.stale}, orphans {st.orphans}")
            for p in st.problems:
                print("   ", p)
        print(f"{len(sources()) - bad} of {len(sources())} sources fully translated"
              if not argv[1:] else "")
        return 1 if bad else 0
    if cmd == "sync":
        for src in (Path(a) for a in argv[1:]) if argv[1:] else sources():
            print(_sync(src, "zh"))
        return 0
    if cmd == "accept":
        src = Path(argv[1])
        cells = markdown_cells(read_notebook(src))
        path = translation_path(src)
        blocks = read(path)
        for i in map(int, argv[2:]):
            if i not in blocks or i not in cells:
                print(f"cell {i}: no block, or not a Markdown cell")
                return 1
            blocks[i].digest = digest(cells[i])
        write(path, src, blocks)
        return 0
    if cmd == "show":
        src, i = Path(argv[1]), int(argv[2])
        nb = read_notebook(src)
        b = read(translation_path(src)).get(i)
        print(nb.cells[i].source, "\n---", digest(nb.cells[i].source))
        print(b.text if b else "(no translation)", "\n---", b.digest if b else "")
        return 0
    print(__doc__)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
