"""Every chapter notebook executes (jupytext source -> nbclient) on the embedded model.

Times are printed and written to reports/course_times.json (the 60 s budget per chapter
is tracked there, not asserted: tests do not time things).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHAPTERS = sorted((ROOT / "course").glob("ch*/ch*.py"))

pytestmark = pytest.mark.embedded


@pytest.mark.parametrize("path", CHAPTERS, ids=[p.parent.name for p in CHAPTERS])
def test_chapter_executes(path, embedded_model_dir):
    import jupytext
    import nbclient
    import nbformat

    nb = jupytext.read(path)
    t0 = time.perf_counter()
    nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                            resources={"metadata": {"path": str(path.parent)}}).execute()
    elapsed = time.perf_counter() - t0
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    out = ROOT / "reports" / "course"
    out.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, out / f"{path.stem}.ipynb")  # executed copy, for reading the numbers
    assert not [o for o in outputs if o.get("output_type") == "error"]
    pngs = [o for o in outputs if "image/png" in o.get("data", {})]
    assert pngs, "a chapter shows at least one plot"
    report = ROOT / "reports" / "course_times.json"
    times = json.loads(report.read_text()) if report.exists() else {}
    times[path.parent.name] = round(elapsed, 1)
    report.write_text(json.dumps(times, indent=2) + "\n")
    print(f"{path.parent.name}: executed in {elapsed:.1f} s")
