"""Executed chapter notebooks for the site, cached by content.

The site shows each chapter with its outputs (numbers and plots measured when the
notebook ran). Executing a chapter takes about a minute on a 2-core CPU, so an executed
copy is kept in ``build/notebooks/<chapter>.ipynb`` together with a key: the sha256 of
the chapter's jupytext source and of every file of the engine (``minivllm/``,
``minivllm_kernels/``). A build reuses the copy while the key matches and executes the chapter
again when the chapter or the engine changed (``MINIVLLM_SITE_STALE_OK=1`` reuses an
older copy: for writing the docs while the engine is being changed). ``tests/test_course.py`` stores the copy it
executes, so ``make test`` executes each chapter once for both tests.

No mkdocs import here: the tests load this file on its own.
"""

from __future__ import annotations

import hashlib
import os
import re
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CACHE_DIR = Path(os.environ.get("MINIVLLM_SITE_NOTEBOOKS", ROOT / "build" / "notebooks"))
ENGINE_DIRS = ("minivllm", "minivllm_kernels")
META = "minivllm_site"


def chapter_sources() -> list[Path]:
    """The chapter notebooks on disk, in order (the same glob as tests/test_course.py)."""
    return sorted((ROOT / "course").glob("ch*/ch*.py"))


def engine_digest() -> str:
    h = hashlib.sha256()
    for d in ENGINE_DIRS:
        for p in sorted((ROOT / d).rglob("*")):
            if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc":
                h.update(str(p.relative_to(ROOT)).encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()


def notebook_key(src: Path, engine: str | None = None) -> str:
    h = hashlib.sha256(Path(src).read_bytes())
    h.update((engine or engine_digest()).encode())
    return h.hexdigest()


def cached_path(src: Path) -> Path:
    return CACHE_DIR / f"{Path(src).stem}.ipynb"


# a tqdm text bar as it ends up in a stream output: "desc:  40%|████      | 4/10 [00:01<...]"
PROGRESS_LINE = re.compile(r"^.*\d+%\|.*\|\s*\d+(?:\.\d+)?[kMG]?/\S+")


def strip_progress(text: str) -> str:
    """A stream's text without tqdm bars: of each line, what a terminal would show (the
    last non-empty carriage-return segment); lines that are progress bars are dropped,
    other text kept."""
    kept = []
    for line in text.split("\n"):
        segments = [seg for seg in line.split("\r") if seg.strip()]
        shown = segments[-1] if segments else line
        if not PROGRESS_LINE.match(shown):
            kept.append(shown)
    return "\n".join(kept)


def drop_widgets(nb) -> None:
    """Remove widget outputs (tqdm progress bars, e.g. transformers' "Loading weights"):
    a static page shows them frozen at 0 %, and their state is most of a page's weight.
    Text progress bars in stderr streams ("quantizing (...): 0%|...") go too, for the same
    reason; any other stderr text (warnings) is kept."""
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        outs = []
        for o in cell.get("outputs", []):
            if "application/vnd.jupyter.widget-view+json" in o.get("data", {}):
                continue
            if o.get("output_type") == "stream" and o.get("name") == "stderr":
                text = strip_progress(o.get("text", ""))
                if not text.strip():
                    continue
                o["text"] = text
            outs.append(o)
        cell.outputs = outs
    nb.metadata.pop("widgets", None)


def store(src: Path, nb, seconds: float, key: str | None = None) -> Path:
    """Save an executed notebook (less its widget outputs) as the cached copy of ``src``
    (atomic replace). ``key``: computed before executing, when the caller has it."""
    import nbformat

    nb = nbformat.from_dict(nb)  # a copy: the caller's notebook keeps its outputs
    drop_widgets(nb)
    nb.metadata[META] = {"key": key or notebook_key(src),
                         "source": str(Path(src).resolve().relative_to(ROOT)),
                         "executed_s": round(seconds, 1)}
    out = cached_path(src)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".ipynb.tmp")
    nbformat.write(nb, tmp)
    tmp.replace(out)
    return out


def execute(src: Path):
    """Execute a chapter as tests/test_course.py does (cwd: the chapter's folder).
    Returns (notebook, seconds)."""
    import jupytext
    import nbclient

    nb = jupytext.read(src)
    t0 = time.perf_counter()
    nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                            resources={"metadata": {"path": str(Path(src).parent)}}).execute()
    return nb, time.perf_counter() - t0


def errors(nb) -> list[str]:
    return [f"{o.get('ename')}: {o.get('evalue')}" for c in nb.cells if c.cell_type == "code"
            for o in c.get("outputs", []) if o.get("output_type") == "error"]


def executed_notebook(src: Path, log=print) -> Path:
    """The path of an executed copy of ``src`` that matches the current sources
    (executing the chapter first when there is none)."""
    import nbformat

    src = Path(src)
    key = notebook_key(src)
    out = cached_path(src)
    if out.exists():
        try:
            cached = nbformat.read(out, as_version=4).metadata.get(META, {}).get("key")
        except Exception:  # a corrupt copy: execute again
            cached = None
        if cached == key:
            return out
        if cached and os.environ.get("MINIVLLM_SITE_STALE_OK") == "1":
            log(f"{out.relative_to(ROOT) if out.is_relative_to(ROOT) else out}: reused "
                "although the chapter or the engine changed (MINIVLLM_SITE_STALE_OK=1)")
            return out
    log(f"executing {src.relative_to(ROOT)} (not cached or changed sources) ...")
    try:
        nb, seconds = execute(src)
    except Exception as e:  # nbclient's CellExecutionError: keep the end, drop the colours
        text = re.sub(r"\x1b\[[0-9;]*m", "", str(e))
        raise RuntimeError(f"{src.relative_to(ROOT)} raised while executing:\n"
                           f"...{text[-2000:]}") from None
    bad = errors(nb)
    if bad:
        raise RuntimeError(f"{src.relative_to(ROOT)} raised while executing: {bad}")
    log(f"executed {src.relative_to(ROOT)} in {seconds:.0f} s")
    return store(src, nb, seconds, key)


if __name__ == "__main__":  # python docs/notebooks.py: execute what is stale
    for chapter in chapter_sources():
        print(executed_notebook(chapter))
