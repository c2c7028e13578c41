"""Full-grading records: proof, checked in CI, that every fixture of a lab got its exact
score on the lab as it is now.

CI (``tests/test_grading.py``) grades each lab's reference solution and released copy on
every run, but not its lab-specific wrong answers: at thirty labs they would cost CI about
a quarter of its hour. ``python -m grading.grade --record chNN`` (the solution, the
released copy and every lab-specific fixture) or ``--all`` (``make grade-all``: every
fixture) writes, when each graded fixture got exactly its expected score,
``grading/records/chNN.json``: the scores, and a digest of the files that decide them (the
lab source ``labs/source/chNN/*.py`` and its fixture file ``grading/fixtures/chNN.py``).
(The generic fixtures test the grader, the same for every lab: CI grades them once.)
Commit it with the lab. CI checks (cheaply, without grading) that every lab has a record
whose digest matches the files as they are, so a lab or fixture file changed without
re-grading every fixture fails CI, with the command to run.

What a record does not cover: an engine change that moves a wrong answer's score. CI
still catches the part that matters most there: every lab's restore test asserts, inside
the solution's run, that the broken configuration fails the same check.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECORDS = ROOT / "grading" / "records"


def lab_files(lab: str, root: Path = ROOT) -> list[Path]:
    """The files that decide a lab's fixture scores: its source(s) and fixture file."""
    files = sorted((root / "labs" / "source" / lab).glob("*.py"))
    files.append(root / "grading" / "fixtures" / f"{lab}.py")
    missing = [str(p) for p in files if not p.is_file()]
    if missing or len(files) < 2:
        raise FileNotFoundError(f"lab {lab!r}: missing {missing or 'labs/source/' + lab}")
    return files


def digest(lab: str, root: Path = ROOT) -> str:
    """sha256 over the lab's files (path relative to ``root``, then the bytes, each)."""
    h = hashlib.sha256()
    for p in lab_files(lab, root):
        h.update(str(p.relative_to(root)).encode() + b"\0")
        h.update(p.read_bytes() + b"\0")
    return h.hexdigest()


def _commit(root: Path) -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root,
                             capture_output=True, text=True, timeout=30)
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=root,
                               capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    return out.stdout.strip() + (" (with uncommitted changes)" if dirty.stdout.strip() else "")


def required(lab: str) -> list[str]:
    """The fixtures a record must cover: the solution, the released copy and every
    lab-specific wrong answer, in the fixture file's order."""
    from grading import fixtures

    return [n for n, f in fixtures.load(lab).FIXTURES.items()
            if f.kind in ("solution", "release", "specific")]


def write(result: dict, root: Path = ROOT) -> Path:
    """Record a lab's grading result (:func:`grading.grade.grade_lab`'s dict).

    Raises:
        ValueError: the result is not a passing grading of at least :func:`required`.
    """
    lab = result["lab"]
    graded = [f["fixture"] for f in result["fixtures"]]
    missing = [n for n in required(lab) if n not in graded]
    if not result["ok"] or missing:
        raise ValueError(f"{lab}: a record needs the solution, the released copy and every "
                         f"lab-specific fixture graded and passing (missing {missing}, "
                         f"ok={result['ok']})")
    if result.get("digest") and result["digest"] != digest(lab, root):
        raise ValueError(f"{lab}: its source or fixture file changed while it was graded; "
                         "the record would vouch for files that were not graded")
    rec = {"lab": lab, "digest": digest(lab, root),
           "files": [str(p.relative_to(root)) for p in lab_files(lab, root)],
           "commit": _commit(root),
           "graded_at": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
           "timeout_s": result["timeout_s"],
           "fixtures": {f["fixture"]: {"kind": f["kind"], "expected": f["expected"],
                                       "score": f["score"], "run_s": f["run_s"]}
                        for f in result["fixtures"]}}
    out = root / "grading" / "records" / f"{lab}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rec, indent=2) + "\n")
    return out


def problems(lab: str, root: Path = ROOT) -> list[str]:
    """Why the lab's record does not vouch for the lab as it is now ([] when it does)."""
    from grading import fixtures
    from grading.grade import execute_timeout

    fix = (f"run `python -m grading.grade --record {lab}` and commit "
           f"grading/records/{lab}.json")
    path = root / "grading" / "records" / f"{lab}.json"
    if not path.is_file():
        return [f"{lab}: no full-grading record ({fix})"]
    rec = json.loads(path.read_text())
    out = []
    if rec.get("digest") != digest(lab, root):
        out.append(f"{lab}: the lab source or its fixture file changed since every fixture "
                   f"was last graded ({rec.get('graded_at')}, {rec.get('commit')}): {fix}")
    names, graded = required(lab), list(rec.get("fixtures", {}))
    unknown = set(graded) - set(fixtures.load(lab).FIXTURES)
    if [n for n in graded if n in names] != names or unknown:
        out.append(f"{lab}: the record graded {graded}, the lab's solution, released copy "
                   f"and lab-specific fixtures are {names}: {fix}")
    wrong = {n: (f["expected"], f["score"]) for n, f in rec.get("fixtures", {}).items()
             if f["score"] != f["expected"]}
    if wrong:
        out.append(f"{lab}: fixtures off their expected score (expected, got): {wrong}")
    if rec.get("timeout_s") != execute_timeout():
        out.append(f"{lab}: graded with a {rec.get('timeout_s')} s timeout, not the course's "
                   f"{execute_timeout()} s: {fix}")
    return out
