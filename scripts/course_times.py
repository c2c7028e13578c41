#!/usr/bin/env python3
"""The course's time budgets against measured numbers (reports/course_times.json).

    python scripts/course_times.py              # the report: totals, budgets, items over
                                                # them, CI projected to 30 chapters + 30 labs
    python scripts/course_times.py --file build/course_times.json   # the last `make test`'s
    python scripts/course_times.py --measure    # on an IDLE machine: the whole test suite
                                                # (as `make test` runs it), recording into
                                                # reports/course_times.json, then the report

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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--file", default=str(ct.COMMITTED),
                    help=f"the JSON to read (default {ct.COMMITTED.relative_to(ROOT)})")
    ap.add_argument("--measure", action="store_true",
                    help="run the test suite first, recording into --file")
    ap.add_argument("--max-load", type=float, default=0.5,
                    help="--measure refuses to start above this 1-min load average "
                         "(default 0.5): the numbers are an idle machine's")
    ap.add_argument("--json", action="store_true", help="print the summary as JSON too")
    ap.add_argument("pytest_args", nargs="*",
                    help="with --measure: pytest arguments instead of the whole suite (then "
                         "the suite's total is not recorded)")
    args = ap.parse_args(argv)
    p = Path(args.file).resolve()
    if args.measure:
        load1 = os.getloadavg()[0]
        if load1 > args.max_load:
            print(f"error: 1-min load average {load1:.2f} > {args.max_load}: the machine is "
                  "not idle (wait, or pass --max-load)", file=sys.stderr)
            return 2
        env = dict(os.environ, **{ct.ENV: str(p)})
        cmd = [sys.executable, "-m", "pytest", "-q", *args.pytest_args]
        print(f"$ {ct.ENV}={p} {' '.join(cmd)}", flush=True)
        with ct.measure() as m:
            rc = subprocess.call(cmd, cwd=ROOT, env=env)
        if rc != 0:
            print(f"error: the test suite failed (exit {rc}); the suite's total is not "
                  "recorded", file=sys.stderr)
            return rc
        if not args.pytest_args:
            ct.record_suite(m, [], p)
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
