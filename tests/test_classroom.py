"""The class on one machine (`make lab`), through the configuration files the server reads.

A copy of the repository's two nbgrader configuration files (``nbgrader_config.py`` and
``grading/nbgrader_config.py``) in a temporary folder stands for the repository: its
``build/`` holds the course root, the exchange and the learner's folder, as `make lab`'s
does. ``python -m grading.grade --prepare-only --class-config <copy>`` prepares it (what
`make lab` runs, with the copy in place of the repository's file). The learner's side is
nbgrader's own server extension (the Assignment List's handlers call
``AssignmentList``'s methods, and the Validate button ``ValidateAssignmentHandler``'s
``load_config`` and nbgrader's ``Validator``), run in the server's working directory, the
repository root, exactly as the handlers run them: the list and every action read their
configuration again inside ``Exchange.assignment_dir``, which is what broke (a 500 without
the folder, "Unwritable directory /usr/local/share/nbgrader/exchange" with it). The
instructor's side is the commands of docs/instructor.md, run as written there: in the
course root, after ``source .venv/bin/activate`` (the venv's bin first on PATH).

The round trip with grading (validate, autograde, feedback, due date and late penalty,
export) runs the lab's engine, so it is marked ``embedded`` like the other grading tests.
"""

from __future__ import annotations

import csv
import json
import os
import shutil
import sqlite3
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import pytest

pytest.importorskip("nbgrader")

ROOT = Path(__file__).resolve().parents[1]
LAB = "ch03"  # grading.fixtures.CI_GENERIC_LAB: the fastest lab (solution 5 s)
COURSE_ID = "minivllm-precision"
VENV_BIN = Path(sys.executable).parent


def _repo(tmp_path: Path) -> Path:
    """The repository's nbgrader configuration files, copied as they are."""
    repo = tmp_path / "repo"
    (repo / "grading").mkdir(parents=True)
    shutil.copy(ROOT / "nbgrader_config.py", repo / "nbgrader_config.py")
    shutil.copy(ROOT / "grading" / "nbgrader_config.py", repo / "grading" / "nbgrader_config.py")
    return repo


def _prepare(repo: Path, *labs: str) -> tuple[str, float]:
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "grading.grade", "--prepare-only",
                           "--class-config", str(repo / "nbgrader_config.py"), *labs],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout, time.perf_counter() - t0


def _env(**extra: str) -> dict:
    """The instructor's shell after `source .venv/bin/activate`."""
    env = dict(os.environ, PATH=os.pathsep.join([str(VENV_BIN), os.environ.get("PATH", "")]),
               VIRTUAL_ENV=str(VENV_BIN.parent))
    env.pop("PYTHONPATH", None)
    env.update(extra)
    return env


def nbgrader(cwd: Path, *args: str, **env: str) -> str:
    """One documented command, e.g. ``nbgrader collect ch03``, run in ``cwd``."""
    proc = subprocess.run(["nbgrader", *args], cwd=cwd, env=_env(**env), capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, f"nbgrader {' '.join(args)}:\n{proc.stdout[-3000:]}\n" \
                                 f"{proc.stderr[-3000:]}"
    return proc.stdout + proc.stderr


class Learner:
    """The Assignment List and Validate button of `make lab`'s server: nbgrader's handlers'
    own code, in the server's working directory (the repository root)."""

    def __init__(self, repo: Path, monkeypatch):
        from nbgrader.server_extensions.assignment_list.handlers import AssignmentList

        monkeypatch.chdir(repo)
        # nbgrader's per-account folders stay out of the user's home whatever happens
        monkeypatch.setenv("JUPYTER_DATA_DIR", str(repo / "jupyter-data"))
        self.repo = repo
        self.manager = AssignmentList()
        self.manager.root_dir = str(repo)  # ServerApp.root_dir: `--notebook-dir .`

    def courses(self) -> dict:
        return self.manager.list_courses()

    def assignments(self) -> dict:
        out = self.manager.list_assignments(course_id=COURSE_ID)
        assert out["success"], out["value"]
        return {(a["assignment_id"], a["status"]): a for a in out["value"]}

    def fetch(self, lab: str) -> None:
        out = self.manager.fetch_assignment(COURSE_ID, lab)
        assert out["success"], out["value"]

    def submit(self, lab: str) -> None:
        out = self.manager.submit_assignment(COURSE_ID, lab)
        assert out["success"], out["value"]

    def fetch_feedback(self, lab: str) -> None:
        out = self.manager.fetch_feedback(COURSE_ID, lab)
        assert out["success"], out["value"]

    def validate(self, path: Path) -> dict:
        from nbgrader.server_extensions.validate_assignment.handlers import (
            ValidateAssignmentHandler,
        )
        from nbgrader.validator import Validator

        config = ValidateAssignmentHandler.load_config(None)  # uses no handler state
        return Validator(config=config).validate(str(path))


def _fill(course: Path, notebook: Path, fixture: str) -> None:
    """Write the fixture's code (grading/fixtures/<lab>.py) into the fetched notebook's
    solution cells, as a learner would type it."""
    import nbformat

    from grading import fixtures
    from grading.grade import lab_cells

    fx = fixtures.load(LAB).FIXTURES[fixture]
    solutions, _ = lab_cells(nbformat.read(course / "source" / LAB / f"{LAB}_lab.ipynb", 4))
    nb = nbformat.read(notebook, as_version=4)
    for cell in nb.cells:
        gid = cell.metadata.get("nbgrader", {}).get("grade_id")
        if cell.metadata.get("nbgrader", {}).get("solution"):
            edit = fx.edits.get(gid)
            code = solutions[gid] if fx.base == "solution" else cell.source
            cell.source = (edit(code) if callable(edit) else edit) if edit else code
    nbformat.write(nb, notebook)


def _rows(course: Path, table: str) -> int:
    with sqlite3.connect(course / "gradebook.db") as db:
        return db.execute(f"select count(*) from {table}").fetchone()[0]  # noqa: S608


def test_the_repository_config_is_the_class_layout():
    """The repository's nbgrader_config.py (what JupyterLab reads in `make lab`) sets the
    course root, exchange and learner's folder under build/, by absolute paths, and loads
    the course's settings from grading/nbgrader_config.py by an absolute path too (from
    build/labs, a relative one resolves against build/labs and is skipped silently)."""
    from traitlets.config.loader import PyFileConfigLoader

    from grading import classroom

    paths = classroom.class_paths()
    assert paths == {"course": ROOT / "build" / "nbgrader",
                     "exchange": ROOT / "build" / "exchange",
                     "assignment_dir": ROOT / "build" / "labs"}
    cfg = PyFileConfigLoader("nbgrader_config.py", str(ROOT)).load_config()
    assert cfg.Exchange.cache == str(ROOT / "build" / "nbgrader_cache")
    assert cfg.CourseDirectory.course_id == COURSE_ID
    assert cfg.ExchangeCollect["update"] is True
    assert cfg.Execute.timeout > 0


def test_late_penalty_per_started_day():
    from grading.classroom import LatePenalty

    p = LatePenalty()
    assert p.percent_per_day == 10.0
    assert p.late_submission_penalty("a", 17.0, 0) is None
    assert p.late_submission_penalty("a", 17.0, 1) == pytest.approx(1.7)
    assert p.late_submission_penalty("a", 17.0, 86400) == pytest.approx(1.7)
    assert p.late_submission_penalty("a", 17.0, 86401) == pytest.approx(3.4)
    assert p.late_submission_penalty("a", 17.0, 30 * 86400) == 17.0
    assert LatePenalty(penalty_method="zero").late_submission_penalty("a", 17.0, 1) == 17.0
    assert LatePenalty(percent_per_day=0).late_submission_penalty("a", 17.0, 1e6) is None


def test_assignment_list_round_trip_and_a_restart_keeps_the_class(tmp_path, monkeypatch):
    """Without grading: prepare; the Assignment List lists the course and the lab (from
    inside build/labs, the call that failed), fetches it, submits twice; the instructor's
    `nbgrader collect` (as documented, no --update) takes both, the second replacing the
    first; `nbgrader list` run by a learner inside build/labs finds the exchange; a second
    prepare regenerates nothing and keeps the collected submission and the exchange."""
    from nbgrader.utils import get_username

    repo = _repo(tmp_path)
    build = repo / "build"
    course, exchange, labs = build / "nbgrader", build / "exchange", build / "labs"
    out, first_s = _prepare(repo, LAB)
    assert "1 generated and released" in out, out
    for folder in (course, exchange, labs):
        assert folder.is_dir() and (folder is exchange or (folder / "nbgrader_config.py").is_file())

    learner = Learner(repo, monkeypatch)
    assert learner.courses() == {"success": True, "value": [COURSE_ID]}
    assert (LAB, "released") in learner.assignments()
    learner.fetch(LAB)
    nb = labs / LAB / f"{LAB}_lab.ipynb"
    text = nb.read_text()
    assert "BEGIN SOLUTION" not in text and "BEGIN HIDDEN TESTS" not in text
    assert (LAB, "fetched") in learner.assignments()
    listed = nbgrader(labs, "list")  # a learner's terminal in the learner's folder
    assert f"{COURSE_ID} {LAB}" in listed, listed

    learner.submit(LAB)
    assert list((build / "nbgrader_cache" / COURSE_ID).iterdir()), "no record of the submission"
    me = get_username()
    nbgrader(course, "collect", LAB)
    first = (course / "submitted" / me / LAB / "timestamp.txt").read_text()
    time.sleep(1.1)  # submission timestamps have microseconds; keep them apart anyway
    learner.submit(LAB)
    out = nbgrader(course, "collect", LAB)
    second = (course / "submitted" / me / LAB / "timestamp.txt").read_text()
    assert second > first, (first, second, out)

    # a restart: `make lab` runs prepare again
    sub = course / "submitted" / me / LAB / f"{LAB}_lab.ipynb"
    before = sub.read_bytes()
    out, again_s = _prepare(repo, LAB)
    assert "1 labs in" in out and "1 up to date" in out, out
    assert sub.read_bytes() == before and (course / "gradebook.db").is_file()
    assert (exchange / COURSE_ID / "outbound" / LAB).is_dir()
    assert (LAB, "fetched") in Learner(repo, monkeypatch).assignments()
    # the lab's source changed since its release (here: its recorded digest), but it has
    # submissions: prepare keeps the released version (nbgrader could not change its cells)
    stamp = course / ".prepared.json"
    stamp.write_text(stamp.read_text().replace(json.loads(stamp.read_text())[LAB]["digest"],
                                               "0" * 64))
    release = (course / "release" / LAB / f"{LAB}_lab.ipynb").read_bytes()
    out, _ = _prepare(repo, LAB)
    assert "kept (source changed, has submissions)" in out, out
    assert (course / "release" / LAB / f"{LAB}_lab.ipynb").read_bytes() == release
    assert sub.read_bytes() == before
    print(f"prepare {LAB}: first {first_s:.1f} s, again {again_s:.1f} s")


@pytest.mark.embedded
def test_grading_round_trip_feedback_late_penalty_export_and_restart(tmp_path, monkeypatch):
    """The whole class on one machine, two learners: the server's learner (the process's
    user) fetches the lab, writes the "truncate" fixture (3 of 17), Validate fails it, and
    submits; bob (`nbgrader submit --student=bob` in the learner's folder) submits the
    solution. The instructor runs docs/instructor.md's commands in the course root:
    collect, autograde (3 and 17); a due date of now; the learner resubmits the solution
    (late by seconds); collect takes it (no --update), autograde regrades it: 17 less the
    late penalty of 10 % a started day, 15.3; feedback generated, released to the learner
    alone (--student), fetched from the Assignment List, then to everyone; export writes
    course root/grades.csv (one row per learner); a second prepare keeps the gradebook's
    rows, every submission, autograded notebook and feedback."""
    from nbgrader.utils import get_username

    repo = _repo(tmp_path)
    build = repo / "build"
    course, exchange, labs = build / "nbgrader", build / "exchange", build / "labs"
    _prepare(repo, LAB)
    me, times = get_username(), {}
    learner = Learner(repo, monkeypatch)
    learner.fetch(LAB)
    nb = labs / LAB / f"{LAB}_lab.ipynb"
    _fill(course, nb, "truncate")
    t0 = time.perf_counter()
    result = learner.validate(nb)
    times["validate"] = time.perf_counter() - t0
    assert "failed" in result, result
    learner.submit(LAB)
    _fill(course, nb, "solution")
    nbgrader(labs, "submit", LAB, "--student=bob")  # bob, from the learner's folder

    nbgrader(course, "collect", LAB)
    t0 = time.perf_counter()
    nbgrader(course, "autograde", LAB, OMP_WAIT_POLICY="PASSIVE")
    times["autograde 2"] = time.perf_counter() - t0
    from grading.grade import read_scores

    scores = read_scores(course, LAB, [me, "bob"])
    assert (scores[me]["score"], scores["bob"]["score"]) == (3.0, 17.0), scores

    due = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
    nbgrader(course, "db", "assignment", "add", LAB, f"--duedate={due}")
    time.sleep(1.1)
    learner.submit(LAB)  # the solution now, after the due date
    nbgrader(course, "collect", LAB)
    t0 = time.perf_counter()
    nbgrader(course, "autograde", LAB, OMP_WAIT_POLICY="PASSIVE")
    times["autograde resubmission"] = time.perf_counter() - t0
    from nbgrader.api import Gradebook

    with Gradebook(f"sqlite:///{course / 'gradebook.db'}") as gb:
        mine, bobs = gb.find_submission(LAB, me), gb.find_submission(LAB, "bob")
        got = {"me": (mine.score, mine.late_submission_penalty, mine.total_seconds_late > 0),
               "bob": (bobs.score, bobs.late_submission_penalty)}
    assert got["me"][0] == 17.0 and got["me"][1] == pytest.approx(1.7) and got["me"][2], got
    assert got["bob"] == (17.0, 0.0) or got["bob"] == (17.0, None), got

    nbgrader(course, "generate_feedback", LAB)
    nbgrader(course, "release_feedback", LAB, f"--student={me}")
    released = sorted(p.name for p in (exchange / COURSE_ID / "feedback").iterdir())
    assert len(released) == 1, released
    learner.fetch_feedback(LAB)
    (html,) = (labs / LAB / "feedback").glob("*/*.html")
    assert "17" in html.read_text()
    nbgrader(course, "release_feedback", LAB)
    assert len(list((exchange / COURSE_ID / "feedback").iterdir())) == 2

    nbgrader(course, "export")
    with open(course / "grades.csv", newline="") as fh:
        table = {r["student_id"]: r for r in csv.DictReader(fh)}
    assert float(table[me][LAB]) == pytest.approx(15.3), table[me]
    assert float(table["bob"][LAB]) == 17.0 and float(table["bob"]["total"]) == 17.0

    rows = {t: _rows(course, t) for t in ("student", "submitted_assignment", "grade")}
    keep = {p: p.read_bytes() for d in ("submitted", "autograded", "feedback")
            for p in (course / d).rglob("*") if p.is_file()}
    out, again_s = _prepare(repo, LAB)
    assert {t: _rows(course, t) for t in rows} == rows, out
    assert all(p.read_bytes() == b for p, b in keep.items())
    assert "1 up to date" in out, out
    print(json.dumps({"scores": got, "gradebook rows": rows, "files kept": len(keep),
                      "second prepare s": round(again_s, 1),
                      **{k: round(v, 1) for k, v in times.items()}}))


def test_a_course_root_from_before_is_set_aside(tmp_path):
    """`make grade` used to grade its fixtures in build/nbgrader and `make lab` rebuilt it
    at each start: a course root without prepare's stamp is moved aside, not adopted (its
    gradebook's "learners" would be fixtures); one with the stamp is kept."""
    from grading import classroom

    course = tmp_path / "nbgrader"
    (course / "submitted" / "solution" / LAB).mkdir(parents=True)
    (course / "gradebook.db").write_bytes(b"")
    aside = classroom.set_aside(course)
    assert aside is not None and not course.exists()
    assert (aside / "submitted" / "solution" / LAB).is_dir()
    course.mkdir()
    (course / classroom.STAMP).write_text("{}")
    (course / "gradebook.db").write_bytes(b"")
    assert classroom.set_aside(course) is None and (course / "gradebook.db").is_file()
