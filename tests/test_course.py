"""Every chapter notebook executes (jupytext source -> nbclient) on the embedded model.

Times are printed and recorded (grading/course_times.py: build/course_times.json, or
reports/course_times.json under `python scripts/course_times.py --measure`); the 60 s
budget per chapter is reported there, not asserted: tests do not time things. Each
executed notebook is also stored where the course website takes its chapters from
(docs/notebooks.py), so that tests/test_site.py, later in the same run, does not execute
them again.

``make course-isa`` runs this file as another CPU (``ISA_PROFILE`` below: PyTorch's,
oneDNN's and MKL's AVX2 kernels on an AVX-512/AMX machine), with
``MINIVLLM_COURSE_OUT=reports/course-avx2``: the executed copies go there, and neither
the site's cache nor the recorded times take that run.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

from grading import course_times

ROOT = Path(__file__).resolve().parents[1]
CHAPTERS = sorted((ROOT / "course").glob("ch*/ch*.py"))
# the environment that makes an AVX-512/AMX machine run the kernels of an AVX2 CPU
ISA_PROFILE = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2",
               "MKL_ENABLE_INSTRUCTIONS": "AVX2"}

pytestmark = pytest.mark.embedded


def _site_notebooks():
    """docs/notebooks.py: the cache of executed chapters that the course website renders."""
    spec = importlib.util.spec_from_file_location("_site_notebooks", ROOT / "docs" / "notebooks.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("path", CHAPTERS, ids=[p.parent.name for p in CHAPTERS])
def test_chapter_executes(path, embedded_model_dir):
    import jupytext
    import nbclient
    import nbformat

    site = _site_notebooks()
    key = site.notebook_key(path)  # the sources this run executes (before they can change)
    nb = jupytext.read(path)
    other_out = os.environ.get("MINIVLLM_COURSE_OUT")  # make course-isa: another CPU profile
    with course_times.measure() as m:
        nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                                resources={"metadata": {"path": str(path.parent)}}).execute()
    elapsed = m["seconds"]
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    out = ROOT / (other_out or "reports/course")
    out.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, out / f"{path.stem}.ipynb")  # executed copy, for reading the numbers
    assert not [o for o in outputs if o.get("output_type") == "error"]
    pngs = [o for o in outputs if "image/png" in o.get("data", {})]
    assert pngs, "a chapter shows at least one plot"
    profile = {k: os.environ[k] for k in ISA_PROFILE if k in os.environ}
    if not other_out:
        site.store(path, nb, elapsed, key)  # the site (tests/test_site.py) renders this copy
        course_times.record_chapter(path.parent.name, m)
    print(f"{path.parent.name}: executed in {elapsed:.1f} s ({m}); CPU profile "
          f"{profile or 'native'}; copy in {out}")


def test_isa_profile_is_what_the_makefile_sets():
    """``make course-isa`` sets the same variables this file documents (one list)."""
    text = (ROOT / "Makefile").read_text()
    for k, v in ISA_PROFILE.items():
        assert f"{k}={v}" in text, f"Makefile's course-isa does not set {k}={v}"
