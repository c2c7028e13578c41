#!/usr/bin/env python3
"""The course's time budgets against measured numbers (reports/course_times.json).

    python scripts/course_times.py              # the report: totals, budgets, items over
                                                # them, CI projected to 30 chapters + 30 labs
    python scripts/course_times.py --file build/course_times.json   # the last `make test`'s
    python scripts/course_times.py --measure    # on an IDLE machine: both phases below,
                                                # recording into reports/course_times.json
    python scripts/course_times.py --measure --phase budgets   # or one of them
    python scripts/course_times.py --ci-run     # a fresh clone's .ci/run, end to end

Phases of --measure:
  budgets  every chapter notebook and every lab's CI grading, one at a time (pytest
           without workers): each chapter's and each lab solution's time against its
           budget, on an otherwise idle machine;
  suite    the whole test suite exactly as `make test` runs it (pytest -n auto: two
           workers on 2 cores), its wall time, and each chapter's and lab's time inside
           that run (slower than alone: two workers share the cores) for the projection.

Budgets (idle 2-core machine): a chapter notebook <= 60 s, a lab's solution <= 30 s, CI
<= 60 min. The numbers come from the tests that run the items (tests/test_course.py,
tests/test_grading.py; see grading/course_times.py); nothing asserts on them.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from grading import course_times as ct  # noqa: E402


# the tests that run chapters and grade labs (what the budget phase runs, one at a time)
BUDGET_TESTS = ("test_chapter_executes or test_lab_fixtures_get_exact_scores or "
                "test_generic_fixtures_get_exact_scores")
# `make test`'s pytest arguments (Makefile: PYTEST_WORKERS ?= auto)
SUITE_ARGS = ["-n", "auto"]


def _run(pytest_args: list[str], record_into: Path) -> int:
    env = dict(os.environ, **{ct.ENV: str(record_into)})
    cmd = [sys.executable, "-m", "pytest", "-q", *pytest_args]
    print(f"$ {ct.ENV}={record_into} {' '.join(cmd)}", flush=True)
    return subprocess.call(cmd, cwd=ROOT, env=env)


def _ci_run(p: Path) -> int:
    """A fresh clone of HEAD, its .ci/run timed, recorded as 'ci_run'."""
    import re
    import tempfile

    commit = subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                                     text=True).strip()
    with tempfile.TemporaryDirectory(prefix="minivllm-ci-") as tmp:
        clone = Path(tmp) / "clone"
        subprocess.check_call(["git", "clone", "-q", str(ROOT), str(clone)])
        log = Path(tmp) / "ci.log"
        print(f"$ .ci/run in a fresh clone of {commit} ({clone}); log: {log}", flush=True)
        with ct.measure() as m, open(log, "w") as out:
            rc = subprocess.call([str(clone / ".ci" / "run")], cwd=clone, stdout=out,
                                 stderr=subprocess.STDOUT)
        text = log.read_text()
        print(text[-3000:])
        counts = {"chapters": len(list(clone.glob("course/ch*/ch*.py"))),
                  "labs": len(list(clone.glob("labs/source/ch*/ch*_lab.py")))}
    found = re.findall(r"^=*\s*(.*(?:passed|failed).*) in ([0-9.]+)s", text, re.M)
    result, pytest_s = (found[-1][0].strip(), float(found[-1][1])) if found else ("?", None)
    ct.record("ci_run", {"kind": "ci_run", "commit": commit, "returncode": rc,
                         "result": result, "pytest_s": pytest_s, **counts, **m}, p)
    if rc:
        print(f"error: .ci/run failed (exit {rc})", file=sys.stderr)
    return rc


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--file", default=str(ct.COMMITTED),
                    help=f"the JSON to read (default {ct.COMMITTED.relative_to(ROOT)})")
    ap.add_argument("--measure", action="store_true",
                    help="run the tests first (--phase), recording into --file")
    ap.add_argument("--phase", choices=["budgets", "suite", "both"], default="both",
                    help="with --measure: which phase (default both; see above)")
    ap.add_argument("--max-load", type=float, default=0.5,
                    help="--measure refuses to start above this 1-min load average "
                         "(default 0.5): the numbers are an idle machine's")
    ap.add_argument("--ci-run", action="store_true",
                    help="clone HEAD into a scratch folder, run its .ci/run end to end (fresh "
                         "install included) and record the time as 'ci_run' in --file")
    ap.add_argument("--json", action="store_true", help="print the summary as JSON too")
    args = ap.parse_args(argv)
    p = Path(args.file).resolve()
    if args.measure:
        load1 = os.getloadavg()[0]
        if load1 > args.max_load:
            print(f"error: 1-min load average {load1:.2f} > {args.max_load}: the machine is "
                  "not idle (wait, or pass --max-load)", file=sys.stderr)
            return 2
        if args.phase in ("budgets", "both"):
            rc = _run(["-p", "no:xdist", "tests/test_course.py", "tests/test_grading.py",
                       "-k", BUDGET_TESTS], p)
            if rc:
                print(f"error: the budget phase failed (exit {rc})", file=sys.stderr)
                return rc
        if args.phase in ("suite", "both"):
            inside = p.with_name(p.stem + "_suite.json.tmp")
            inside.unlink(missing_ok=True)
            with ct.measure() as m:
                rc = _run(SUITE_ARGS, inside)
            if rc:
                print(f"error: the test suite failed (exit {rc}); its time is not recorded",
                      file=sys.stderr)
                return rc
            ct.record_suite(m, SUITE_ARGS, p, inside=ct.load(inside))
            inside.unlink(missing_ok=True)
    if args.ci_run:
        rc = _ci_run(p)
        if rc:
            return rc
    data = ct.load(p)
    if not data:
        print(f"no measurements in {p}: run python scripts/course_times.py --measure "
              f"(or MINIVLLM_COURSE_TIMES={p} make test)")
        return 1
    text, summary = ct.report(data)
    print(f"# Course times ({p.relative_to(ROOT) if p.is_relative_to(ROOT) else p})\n")
    print(text)
    if args.json:
        print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
