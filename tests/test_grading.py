"""Every lab graded both ways with nbgrader: each fixture submission gets exactly its
expected score, read back from the gradebook (solution full marks, released copy zero,
wrong / exception / infinite loop / NaN / check-patching at their fixed scores)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LABS = sorted(p.stem for p in (ROOT / "grading" / "fixtures").glob("ch*.py"))

pytestmark = pytest.mark.embedded


@pytest.mark.parametrize("lab", LABS)
def test_lab_fixtures_get_exact_scores(lab, tmp_path, embedded_model_dir):
    pytest.importorskip("nbgrader")
    proc = subprocess.run([sys.executable, "-m", "grading.grade", lab, "--course-root",
                           str(tmp_path / "course")], cwd=ROOT, capture_output=True, text=True,
                          timeout=1500)
    print(proc.stdout[-4000:])
    assert proc.stdout.strip(), proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    (lab_result,) = result["labs"]
    report = ROOT / "reports" / f"grading_{lab}.json"
    report.parent.mkdir(exist_ok=True)
    report.write_text(json.dumps(lab_result, indent=2) + "\n")
    wrong = {f["fixture"]: (f["expected"], f["score"]) for f in lab_result["fixtures"] if not f["ok"]}
    assert not wrong, f"fixture (expected, got): {wrong}\n{proc.stderr[-3000:]}"
    by = {f["fixture"]: f for f in lab_result["fixtures"]}
    assert by["solution"]["score"] == by["solution"]["max_score"]
    assert all(v == 0 for v in by["release"]["cells"].values())
    assert proc.returncode == 0


def test_prepare_only_releases_labs_to_a_local_exchange(tmp_path):
    """What `make lab` runs: every lab is generated and released to the exchange, so the
    Assignment List can fetch it (student copy: no solutions, no hidden tests) on one
    machine. Run from tmp_path so that the repository's nbgrader_config.py stays out."""
    pytest.importorskip("nbgrader")
    exchange = tmp_path / "exchange"
    proc = subprocess.run([sys.executable, "-m", "grading.grade", "--prepare-only",
                           "--course-root", str(tmp_path / "course"), "--exchange",
                           str(exchange)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    nbgrader = Path(sys.executable).with_name("nbgrader")
    opts = [f"--Exchange.root={exchange}", "--CourseDirectory.course_id=minivllm-precision"]
    listed = subprocess.run([str(nbgrader), "list", *opts], cwd=tmp_path, capture_output=True,
                            text=True, timeout=300)
    assert listed.returncode == 0, listed.stderr[-2000:]
    for lab in LABS:
        assert f"minivllm-precision {lab}" in listed.stdout + listed.stderr, listed.stderr
    learner = tmp_path / "learner"
    learner.mkdir()
    fetched = subprocess.run([str(nbgrader), "fetch_assignment", LABS[0], *opts],
                             cwd=learner, capture_output=True, text=True, timeout=300)
    assert fetched.returncode == 0, fetched.stderr[-2000:]
    (nb,) = (learner / LABS[0]).glob("*.ipynb")
    text = nb.read_text()
    assert "BEGIN SOLUTION" not in text and "BEGIN HIDDEN TESTS" not in text
    assert "raise NotImplementedError()" in text
