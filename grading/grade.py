"""Build, release, validate and autograde the labs; check every fixture's exact score.

    python -m grading.grade            # all labs that have fixtures
    python -m grading.grade ch01       # one lab
    make grade

Steps, with nbgrader's own commands, in a scratch course root (``build/nbgrader``):

1. convert ``labs/source/chNN/*.py`` (jupytext percent, nbgrader metadata kept) to .ipynb;
2. ``nbgrader generate_assignment`` (student copy: solutions stubbed, hidden tests removed);
3. ``nbgrader validate`` on the source (the solution must pass every test);
4. one submission per fixture (``grading/fixtures/chNN.py``): the released notebook with
   the fixture's code in the solution cells;
5. ``nbgrader autograde`` (hidden tests restored, every cell executed with the timeout of
   ``grading/nbgrader_config.py``), then ``nbgrader generate_feedback``;
6. scores read back from the gradebook and compared with each fixture's expected score.

Prints a table, and as its last line a JSON object; exits 1 when any score differs.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOLUTION_RE = re.compile(r"[ \t]*### BEGIN SOLUTION\n(.*?)[ \t]*### END SOLUTION\n?", re.S)


def _nbgrader(course: Path, *args: str) -> subprocess.CompletedProcess:
    exe = Path(sys.executable).with_name("nbgrader")
    cmd = [str(exe) if exe.exists() else "nbgrader", *args]
    # nbgrader runs `alembic` and the kernel from PATH: put this interpreter's bin first.
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]),
        PATH=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]))
    proc = subprocess.run(cmd, cwd=course, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"`{' '.join(args)}` failed ({proc.returncode}):\n"
                           f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc


def _solution_code(cell_source: str) -> str:
    """The reference solution as a student would write it (markers removed)."""
    return SOLUTION_RE.sub(lambda m: m.group(1), cell_source)


def build_course(course: Path, labs: list[str]) -> None:
    import jupytext

    if course.exists():
        shutil.rmtree(course)
    (course / "source").mkdir(parents=True)
    shutil.copy(ROOT / "grading" / "nbgrader_config.py", course / "nbgrader_config.py")
    for lab in labs:
        src = ROOT / "labs" / "source" / lab
        out = course / "source" / lab
        out.mkdir(parents=True)
        for py in sorted(src.glob("*.py")):
            nb = jupytext.read(py)
            jupytext.write(nb, out / (py.stem + ".ipynb"), fmt="ipynb")


def make_submissions(course: Path, fixtures_mod) -> None:
    import nbformat

    a, name = fixtures_mod.ASSIGNMENT, fixtures_mod.NOTEBOOK
    source = nbformat.read(course / "source" / a / f"{name}.ipynb", as_version=4)
    release = nbformat.read(course / "release" / a / f"{name}.ipynb", as_version=4)
    solutions = {c.metadata["nbgrader"]["grade_id"]: _solution_code(c.source)
                 for c in source.cells if c.metadata.get("nbgrader", {}).get("solution")}
    for student, (base, edits, _) in fixtures_mod.FIXTURES.items():
        nb = nbformat.from_dict(json.loads(json.dumps(release)))  # deep copy
        for cell in nb.cells:
            meta = cell.metadata.get("nbgrader", {})
            gid = meta.get("grade_id")
            if not meta.get("solution"):
                continue
            unknown = set(edits) - set(solutions)
            if unknown:
                raise ValueError(f"fixture {student!r} edits unknown cells {sorted(unknown)}")
            if gid in edits:
                cell.source = edits[gid]
            elif base == "solution":
                cell.source = solutions[gid]
        out = course / "submitted" / student / a
        out.mkdir(parents=True, exist_ok=True)
        nbformat.write(nb, out / f"{name}.ipynb")


def read_scores(course: Path, assignment: str, students) -> dict[str, dict]:
    from nbgrader.api import Gradebook

    with Gradebook(f"sqlite:///{course / 'gradebook.db'}") as gb:
        out = {}
        for s in students:
            sub = gb.find_submission(assignment, s)
            out[s] = {"score": sub.score, "max_score": sub.max_score,
                      "cells": {g.name: g.score for nb in sub.notebooks for g in nb.grades}}
        return out


def grade_lab(lab: str, course: Path) -> dict:
    fx = importlib.import_module(f"grading.fixtures.{lab}")
    t0 = time.perf_counter()
    _nbgrader(course, "generate_assignment", lab, "--force")
    t_val = time.perf_counter()
    out = _nbgrader(course, "validate", str(Path("source") / lab / f"{fx.NOTEBOOK}.ipynb"))
    if "Success! Your notebook passes all the tests." not in out.stdout:
        raise RuntimeError(f"the solution of {lab} does not pass its own tests:\n"
                           f"{out.stdout[-4000:]}")
    validate_s = time.perf_counter() - t_val
    release = course / "release" / lab / f"{fx.NOTEBOOK}.ipynb"
    text = release.read_text()
    if "BEGIN HIDDEN TESTS" in text or "BEGIN SOLUTION" in text:
        raise RuntimeError(f"{release} still contains solutions or hidden tests")
    make_submissions(course, fx)
    t_ag = time.perf_counter()
    _nbgrader(course, "autograde", lab, "--force")
    autograde_s = time.perf_counter() - t_ag
    _nbgrader(course, "generate_feedback", lab, "--force")
    scores = read_scores(course, lab, fx.FIXTURES)
    rows, ok = [], True
    for student, (_, _, expected) in fx.FIXTURES.items():
        got = scores[student]["score"]
        match = abs(got - expected) < 1e-9
        ok &= match
        feedback = course / "feedback" / student / lab / f"{fx.NOTEBOOK}.html"
        rows.append({"fixture": student, "expected": expected, "score": got,
                     "max_score": scores[student]["max_score"], "ok": match,
                     "feedback": feedback.exists(), "cells": scores[student]["cells"]})
        ok &= feedback.exists()
    return {"lab": lab, "ok": ok, "validate_s": round(validate_s, 1),
            "autograde_s": round(autograde_s, 1), "total_s": round(time.perf_counter() - t0, 1),
            "fixtures": rows}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("labs", nargs="*", help="labs to grade (default: all with fixtures)")
    ap.add_argument("--course-root", default=str(ROOT / "build" / "nbgrader"))
    ap.add_argument("--prepare-only", action="store_true",
                    help="build the course root, generate the labs and release them to the "
                         "exchange, grade nothing (what `make lab` does for the formgrader "
                         "and the Assignment List)")
    ap.add_argument("--exchange", default=None,
                    help="nbgrader exchange for --prepare-only (default: build/exchange, which "
                         "the repository's nbgrader_config.py points JupyterLab to; outside "
                         "the course root, which is rebuilt, so submissions survive)")
    args = ap.parse_args(argv)
    available = sorted(p.stem for p in (ROOT / "grading" / "fixtures").glob("ch*.py"))
    labs = args.labs or available
    missing = [x for x in labs if x not in available]
    if missing:
        print(f"error: no fixtures for {missing}; available: {available}", file=sys.stderr)
        return 2
    course = Path(args.course_root)
    build_course(course, labs)
    if args.prepare_only:
        exchange = Path(args.exchange or ROOT / "build" / "exchange").resolve()
        exchange.mkdir(parents=True, exist_ok=True)
        for lab in labs:
            _nbgrader(course, "generate_assignment", lab, "--force")
            _nbgrader(course, "release_assignment", lab, "--force",
                      f"--Exchange.root={exchange}")
        print(f"course root ready: {course} (labs generated and released to {exchange}: "
              f"{', '.join(labs)})")
        return 0
    results = [grade_lab(lab, course) for lab in labs]
    for r in results:
        print(f"\n## {r['lab']}: validate {r['validate_s']} s, autograde of "
              f"{len(r['fixtures'])} fixtures {r['autograde_s']} s")
        print("| fixture | expected | score | ok | feedback |\n|---|---|---|---|---|")
        for f in r["fixtures"]:
            print(f"| {f['fixture']} | {f['expected']:g} | {f['score']:g} / {f['max_score']:g} "
                  f"| {'yes' if f['ok'] else '**NO**'} | {'yes' if f['feedback'] else 'no'} |")
    ok = all(r["ok"] for r in results)
    print(json.dumps({"ok": ok, "labs": results}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
