"""Build, release and autograde the labs; check every fixture's exact score.

    python -m grading.grade                 # every lab, CI's fixtures (what `make grade` runs)
    python -m grading.grade --all           # every lab, every fixture (`make grade-all`)
    python -m grading.grade --all ch03      # one lab, every fixture: run this before a lab is done
    python -m grading.grade --record ch03   # solution, release, the lab's own: the record CI checks
    python -m grading.grade ch01 --fixtures solution,wrong
    python -m grading.grade --load 2 ch01   # the same with 2 CPU-burning processes running
    python -m grading.grade --prepare-only  # the class's course root, kept (`make lab`)

CI's fixtures (``tests/test_grading.py``) are each lab's reference solution and released
copy, plus, once, on ``grading.fixtures.CI_GENERIC_LAB`` with a shorter timeout, that
lab's first lab-specific wrong answer and the generic ones (exception, infinite loop, NaN,
patched checks); ``--all`` grades every fixture of every lab with the course's timeout
and, for each lab whose fixtures all got their scores, writes ``grading/records/<lab>.json``
(``grading/records.py``: CI checks it against the lab's files). The fixtures and their
format: ``grading/fixtures/__init__.py``.

Steps, with nbgrader's own commands, in a scratch course root (``build/grading``; the
class's course root, ``build/nbgrader``, is ``--prepare-only``'s: ``grading/classroom.py``):

1. convert ``labs/source/chNN/*.py`` (jupytext percent, nbgrader metadata kept) to .ipynb,
   and check the lab's fixture file against it (cells, points);
2. ``nbgrader generate_assignment`` (student copy: solutions stubbed, hidden tests removed);
3. one submission per fixture: the released notebook with the fixture's code in the
   solution cells;
4. ``nbgrader autograde`` (hidden tests restored, every cell executed with the timeout of
   ``grading/nbgrader_config.py``), then ``nbgrader generate_feedback``;
5. scores read back from the gradebook, per graded cell: every fixture must get exactly
   its expected total, the solution full points on every graded cell and no error in any
   cell (what ``nbgrader validate`` on the source checks: the solution fixture is the
   same notebook run the same way, so validate is not run separately), the released copy
   zero on every graded cell;
6. each cell's execution time read from the autograded notebooks (nbclient records it in
   the cell metadata); cells of the solution slower than a quarter of the timeout are
   flagged (a warning: a slower machine, or load, would then get near the timeout).

Prints a report per lab, and as its last line a JSON object; exits 1 when any check fails.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

from grading import fixtures, records

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "grading" / "nbgrader_config.py"
CLASS_CONFIG = ROOT / "nbgrader_config.py"  # the one-machine class (`make lab`)
SOLUTION_RE = re.compile(r"[ \t]*### BEGIN SOLUTION\n(.*?)[ \t]*### END SOLUTION\n?", re.S)
SLOW_FRACTION = 0.25  # a solution cell slower than this fraction of the timeout is flagged
# The grading kernels' environment (unless already set). torch's OpenMP threads (libgomp)
# spin while they wait for each other; when other processes hold the cores, each of the
# thousands of small parallel regions of a decode step waits for a descheduled thread. On
# the 2-core machine at load average 8, generating 12 tokens for 10 prompts took 62.7 s
# spinning and 9.7 s with PASSIVE (threads sleep instead): a correct solution then fits
# the timeout on a busy grader. A grader outside `python -m grading.grade` (the class's
# `nbgrader autograde`) wants the same variable in its environment.
KERNEL_ENV = {"OMP_WAIT_POLICY": "PASSIVE"}


def _nbgrader(course: Path, *args: str) -> subprocess.CompletedProcess:
    exe = Path(sys.executable).with_name("nbgrader")
    cmd = [str(exe) if exe.exists() else "nbgrader", *args]
    # nbgrader runs `alembic` and the kernel from PATH: put this interpreter's bin first.
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]),
        PATH=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]))
    env.update({k: v for k, v in KERNEL_ENV.items() if k not in os.environ})
    proc = subprocess.run(cmd, cwd=course, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"`{' '.join(args)}` failed ({proc.returncode}):\n"
                           f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc


def execute_timeout(config: Path = CONFIG) -> float:
    """``c.Execute.timeout`` as ``config`` (default grading/nbgrader_config.py) sets it."""
    from traitlets.config import Config

    c = Config()
    exec(compile(config.read_text(), str(config), "exec"), {"get_config": lambda: c})
    return float(c.Execute.timeout)


def set_timeout(course: Path, seconds: float | None) -> float:
    """Write the course root's nbgrader_config.py: the course's own, with
    ``c.Execute.timeout = seconds`` appended when given. Returns the timeout in force."""
    text = CONFIG.read_text()
    if seconds is not None:
        if not seconds > 0:
            raise ValueError(f"timeout must be a positive number of seconds, got {seconds}")
        text += f"\n# grading.grade --timeout\nc.Execute.timeout = {float(seconds)!r}\n"
    cfg = course / "nbgrader_config.py"
    cfg.write_text(text)
    return execute_timeout(cfg)


def _solution_code(cell_source: str) -> str:
    """The reference solution as a student would write it (markers removed)."""
    return SOLUTION_RE.sub(lambda m: m.group(1), cell_source)


# records.digest of each lab when its source was converted into the course root: the
# record of a grading vouches for the files as they were then, not as they are when the
# grading ends (a lab edited meanwhile is graded on its old source)
BUILT_DIGESTS: dict[str, str] = {}


def _i18n():
    """docs/i18n.py (the translations of the labs' Markdown), loaded on its own."""
    import importlib.util

    mod = sys.modules.get("docs_i18n")
    if mod is None:
        spec = importlib.util.spec_from_file_location("docs_i18n", ROOT / "docs" / "i18n.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules["docs_i18n"] = mod
        spec.loader.exec_module(mod)
    return mod


def convert_lab(lab: str, out: Path, lang: str = "en") -> None:
    """Write each ``labs/source/<lab>/*.py`` (jupytext percent, nbgrader metadata kept)
    into ``out`` as ``.ipynb``, nbgrader's source format. ``lang="zh"``: its Markdown
    cells in Chinese (``labs/source/<lab>/<name>.zh.md``, docs/i18n.py); the code cells,
    cell ids, points and tests are the English lab's. Raises ValueError for another
    language, and docs/i18n.py's TranslationError when a cell's translation is missing or
    stale (a lab is not released half translated)."""
    import jupytext

    if lang not in _i18n().LANGS:
        raise ValueError(f"lab language {lang!r}: expected one of {_i18n().LANGS}")
    for py in sorted((ROOT / "labs" / "source" / lab).glob("*.py")):
        nb = jupytext.read(py) if lang == "en" else _i18n().localize_source(py, lang)
        jupytext.write(nb, out / (py.stem + ".ipynb"), fmt="ipynb")


def build_course(course: Path, labs: list[str], lang: str = "en") -> None:
    if course.exists():
        shutil.rmtree(course)
    (course / "source").mkdir(parents=True)
    shutil.copy(CONFIG, course / "nbgrader_config.py")
    for lab in labs:
        out = course / "source" / lab
        out.mkdir(parents=True)
        if (ROOT / "grading" / "fixtures" / f"{lab}.py").is_file():
            BUILT_DIGESTS[lab] = records.digest(lab)
        convert_lab(lab, out, lang)


def lab_cells(nb) -> tuple[dict[str, str], dict[str, float]]:
    """(solution cells: grade_id -> reference code, graded cells: grade_id -> points)."""
    solutions, points = {}, {}
    for c in nb.cells:
        meta = c.metadata.get("nbgrader", {})
        if meta.get("solution"):
            solutions[meta["grade_id"]] = _solution_code(c.source)
        if meta.get("grade"):
            points[meta["grade_id"]] = float(meta.get("points", 0))
    return solutions, points


def make_submissions(course: Path, fx, names: list[str]) -> None:
    import nbformat

    a, name = fx.ASSIGNMENT, fx.NOTEBOOK
    source = nbformat.read(course / "source" / a / f"{name}.ipynb", as_version=4)
    release = nbformat.read(course / "release" / a / f"{name}.ipynb", as_version=4)
    solutions, _ = lab_cells(source)
    for student in names:
        base, edits = fx.FIXTURES[student].base, fx.FIXTURES[student].edits
        unknown = set(edits) - set(solutions)
        if unknown:
            raise ValueError(f"fixture {student!r} edits unknown cells {sorted(unknown)}")
        nb = nbformat.from_dict(json.loads(json.dumps(release)))  # deep copy
        for cell in nb.cells:
            meta = cell.metadata.get("nbgrader", {})
            gid = meta.get("grade_id")
            if not meta.get("solution"):
                continue
            if gid in edits:
                edit = edits[gid]
                cell.source = edit(solutions[gid]) if callable(edit) else edit
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
                      "cells": {g.name: g.score for nb in sub.notebooks for g in nb.grades},
                      "cell_max": {g.name: g.max_score for nb in sub.notebooks
                                   for g in nb.grades}}
        return out


def _ts(s: str) -> float:
    return datetime.fromisoformat(s.replace("Z", "+00:00")).timestamp()


def notebook_timing(path: Path) -> dict:
    """Per-cell execution times (s) of an executed notebook, from the ``execution`` cell
    metadata nbclient records, and the whole run (first cell busy to last cell idle;
    the kernel's start-up is not in it). Cells: grade_id, or ``cell<i>``."""
    import nbformat

    nb = nbformat.read(path, as_version=4)
    cells, errors, first, last = {}, [], None, None
    for i, c in enumerate(nb.cells):
        if c.cell_type != "code":
            continue
        gid = c.metadata.get("nbgrader", {}).get("grade_id", f"cell{i}")
        ex = c.metadata.get("execution", {})
        start = ex.get("iopub.execute_input") or ex.get("iopub.status.busy")
        end = ex.get("shell.execute_reply") or ex.get("iopub.status.idle")
        if start and end:
            cells[gid] = round(_ts(end) - _ts(start), 2)
            first = first if first is not None else _ts(ex.get("iopub.status.busy", start))
            last = _ts(ex.get("iopub.status.idle", end))
        if any(o.get("output_type") == "error" for o in c.get("outputs", [])):
            errors.append(gid)
    return {"run_s": round(last - first, 1) if cells else None, "cells": cells,
            "errors": errors}


@contextlib.contextmanager
def cpu_load(n: int):
    """``n`` processes that burn a CPU each while the block runs; stopped afterwards, also
    on an error or Ctrl-C. Each also exits by itself when this process is gone."""
    procs = []
    burn = ("import os, sys\nparent = int(sys.argv[1])\n"
            "while os.getppid() == parent:\n    for _ in range(2_000_000):\n        pass\n")
    try:
        for _ in range(n):
            procs.append(subprocess.Popen([sys.executable, "-c", burn, str(os.getpid())],
                                          stdin=subprocess.DEVNULL))
        yield [p.pid for p in procs]
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def grade_lab(lab: str, course: Path, everything: bool = False,
              only: list[str] | None = None, timeout: float | None = None,
              feedback: bool = True) -> dict:
    """Grade one lab's fixtures (``only``, else :func:`grading.fixtures.select`) in the
    course root ``course`` with the execute timeout ``timeout`` (s; default the course's).
    ``feedback=False`` skips ``nbgrader generate_feedback`` (and its check that every
    fixture got a feedback page): CI's per-lab tests do, since the page is nbgrader's own
    rendering of the graded notebook, the same code for every lab; the generic fixtures'
    test and ``make grade``/``grade-all`` keep it. Returns the lab's result dict (printed
    by :func:`print_report`)."""
    import nbformat

    if lab in BUILT_DIGESTS and records.digest(lab) != BUILT_DIGESTS[lab]:
        raise RuntimeError(f"{lab}: its source or fixture file changed after the course root "
                           "was built; grade it again")
    fx = fixtures.load(lab)
    timeout = set_timeout(course, timeout)
    source = nbformat.read(course / "source" / lab / f"{fx.NOTEBOOK}.ipynb", as_version=4)
    solutions, points = lab_cells(source)
    fixtures.check_lab(fx, solutions, points)
    names = only or fixtures.select(lab, fx.FIXTURES, everything)
    unknown = [n for n in names if n not in fx.FIXTURES]
    if unknown:
        raise ValueError(f"{lab} has no fixtures {unknown}; it has {list(fx.FIXTURES)}")
    load_before = os.getloadavg()[0]
    t0 = time.perf_counter()
    _nbgrader(course, "generate_assignment", lab, "--force")
    generate_s = time.perf_counter() - t0
    release = course / "release" / lab / f"{fx.NOTEBOOK}.ipynb"
    text = release.read_text()
    if "BEGIN HIDDEN TESTS" in text or "BEGIN SOLUTION" in text:
        raise RuntimeError(f"{release} still contains solutions or hidden tests")
    make_submissions(course, fx, names)
    t_ag = time.perf_counter()
    _nbgrader(course, "autograde", lab, "--force")
    autograde_s = time.perf_counter() - t_ag
    t_fb = time.perf_counter()
    if feedback:
        _nbgrader(course, "generate_feedback", lab, "--force")
    feedback_s = time.perf_counter() - t_fb
    scores = read_scores(course, lab, names)
    rows, problems = [], []
    for student in names:
        f = fx.FIXTURES[student]
        got = scores[student]["score"]
        cells = scores[student]["cells"]
        timing = notebook_timing(course / "autograded" / student / lab / f"{fx.NOTEBOOK}.ipynb")
        has_feedback = (course / "feedback" / student / lab /
                        f"{fx.NOTEBOOK}.html").exists()
        bad = []
        if abs(got - f.score) > 1e-9:
            bad.append(f"score {got:g}, expected {f.score:g}")
        if f.kind == "solution":
            short = {g: s for g, s in cells.items()
                     if s != scores[student]["cell_max"][g]}
            if short:
                bad.append(f"graded cells below full points: {short}")
            if timing["errors"]:
                bad.append(f"cells raised an error: {timing['errors']}")
        if f.kind == "release":
            nonzero = {g: s for g, s in cells.items() if s != 0}
            if nonzero:
                bad.append(f"graded cells above zero: {nonzero}")
        if feedback and not has_feedback:
            bad.append("no feedback HTML")
        problems += [f"{lab} {student}: {b}" for b in bad]
        rows.append({"fixture": student, "kind": f.kind, "expected": f.score, "score": got,
                     "max_score": scores[student]["max_score"], "ok": not bad,
                     "problems": bad, "feedback": has_feedback if feedback else None,
                     "cells": cells,
                     "cell_max": scores[student]["cell_max"],
                     "run_s": timing["run_s"], "cell_s": timing["cells"]})
    sol = next((r for r in rows if r["kind"] == "solution"), None)
    slow = ({g: s for g, s in sol["cell_s"].items() if s > SLOW_FRACTION * timeout}
            if sol else {})
    return {"lab": lab, "ok": not problems, "problems": problems,
            "digest": BUILT_DIGESTS.get(lab),
            "fixtures_graded": names, "timeout_s": timeout,
            "solution_run_s": sol["run_s"] if sol else None,
            "slow_cells": slow, "slow_limit_s": SLOW_FRACTION * timeout,
            "generate_s": round(generate_s, 1), "autograde_s": round(autograde_s, 1),
            "feedback_s": round(feedback_s, 1) if feedback else None,
            "total_s": round(time.perf_counter() - t0, 1),
            "load_1m_before": round(load_before, 2),
            "load_1m_after": round(os.getloadavg()[0], 2), "fixtures": rows}


def reproducibility(lab: str, result: dict) -> list[str]:
    """Grades that do not depend on the run: every fixture of ``result`` built on the
    solution (the generic ones aside: an infinite loop would cost its timeout twice) graded
    twice more in-process (``grading.mutants.run_fixtures``), with the same outcome on
    every test cell both times and the same per-cell scores as nbgrader gave. Returns the
    problems ([] when reproducible)."""
    from grading import mutants

    fx = fixtures.load(lab).FIXTURES
    names = [f["fixture"] for f in result["fixtures"]
             if fx[f["fixture"]].base == "solution" and fx[f["fixture"]].kind != "generic"]
    runs = mutants.run_fixtures(lab, names, repeat=2)
    out = []
    for f in result["fixtures"]:
        name = f["fixture"]
        if name not in runs:
            continue
        first, second = runs[name]
        if first != second:
            diff = {g: (first.get(g), second.get(g)) for g in first if first.get(g) != second.get(g)}
            out.append(f"{lab} {name}: two in-process gradings differ on {diff}")
        passed = {g: o == "passed" for g, o in first.items()}
        full = {g: f["cells"].get(g) == f["cell_max"].get(g) for g in passed}
        if passed != full:
            out.append(f"{lab} {name}: nbgrader's per-cell scores {f['cells']} differ from the "
                       f"in-process outcomes {first}")
    return out


def print_report(r: dict) -> None:
    fb = "skipped" if r["feedback_s"] is None else f"{r['feedback_s']} s"
    print(f"\n## {r['lab']}: {len(r['fixtures'])} fixtures in {r['total_s']} s "
          f"(generate_assignment {r['generate_s']} s, autograde {r['autograde_s']} s, "
          f"generate_feedback {fb}; load average {r['load_1m_before']} "
          f"before, {r['load_1m_after']} after)")
    print("| fixture | kind | expected | score | ok | run s |\n|---|---|---|---|---|---|")
    for f in r["fixtures"]:
        print(f"| {f['fixture']} | {f['kind']} | {f['expected']:g} | {f['score']:g} / "
              f"{f['max_score']:g} | {'yes' if f['ok'] else '**NO**'} | {f['run_s']} |")
    sol = next((f for f in r["fixtures"] if f["kind"] == "solution"), None)
    if sol:
        print(f"\nsolution, time per cell (s; timeout {r['timeout_s']:g} s, flagged above "
              f"{r['slow_limit_s']:g} s):")
        for gid, s in sol["cell_s"].items():
            flag = "  << SLOW: over a quarter of the timeout" if gid in r["slow_cells"] else ""
            print(f"  {gid:28s} {s:7.2f}{flag}")
    for p in r["problems"]:
        print(f"FAILED: {p}")


def prepare(args, labs: list[str]) -> int:
    """``--prepare-only``: :func:`grading.classroom.prepare` on the class's paths (those of
    ``--class-config`` unless given), or, with another ``--course-root`` (the grader image's
    ``/srv/course/...``), on that root and ``--exchange`` (build/exchange by default; written
    into the root's configuration only when given, the images' configuration sets theirs)."""
    from grading import classroom  # imports nbgrader

    paths = classroom.class_paths(Path(args.class_config))
    course = Path(args.course_root).resolve() if args.course_root else paths["course"]
    if course is None:
        print(f"error: {args.class_config} sets no CourseDirectory.root; give --course-root",
              file=sys.stderr)
        return 2
    if course == paths["course"]:  # the class of --class-config (`make lab`)
        exchange = Path(args.exchange).resolve() if args.exchange else paths["exchange"]
        labs_dir = (Path(args.assignment_dir).resolve() if args.assignment_dir
                    else paths["assignment_dir"])
        in_config = exchange is not None
        exchange = exchange or ROOT / "build" / "exchange"
        base = Path(args.class_config).resolve()
    else:
        exchange = Path(args.exchange or ROOT / "build" / "exchange").resolve()
        labs_dir = Path(args.assignment_dir).resolve() if args.assignment_dir else None
        in_config = args.exchange is not None
        base = CONFIG
    source = f"{base} or the options of --prepare-only"
    if course == ROOT / "build" / "nbgrader":
        aside = classroom.set_aside(course)
        if aside is not None:
            print(f"prepare: {course} was not prepared by this version (`make grade`'s scratch "
                  f"root, or `make lab`'s, rebuilt at each start): moved to {aside}",
                  flush=True)
    print(f"prepare: course root {course}, exchange {exchange}"
          + (f", learner's folder {labs_dir}" if labs_dir else ""), flush=True)
    try:
        classroom.prepare(labs, course, exchange, labs_dir, in_config, _nbgrader, base, source,
                          lang=args.lang)
    except Exception as e:  # nbgrader failed (RuntimeError), or the exchange (ExchangeError)
        print(f"prepare FAILED: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    print(f"course root ready: {course} (labs released to {exchange}; gradebook and "
          "submissions kept)", flush=True)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("labs", nargs="*", help="labs to grade (default: every lab in labs/source; "
                    "each needs grading/fixtures/<lab>.py)")
    ap.add_argument("--all", action="store_true",
                    help="every fixture, the generic ones too, for every lab graded "
                         "(`make grade-all`), and each fixture built on the solution graded "
                         "twice more in-process: the same outcome on every cell (reproducible "
                         "grades); default: CI's fixtures")
    ap.add_argument("--fixtures", default=None,
                    help="comma-separated fixture names to grade instead (one lab at a time "
                         "while writing one)")
    ap.add_argument("--record", action="store_true",
                    help="grade the solution, the released copy and every lab-specific "
                         "fixture, and write grading/records/<lab>.json (CI checks it); "
                         "--all records too")
    ap.add_argument("--load", type=int, default=0, metavar="N",
                    help="run N CPU-burning processes while grading (stopped afterwards): "
                         "a correct solution must still get full marks")
    ap.add_argument("--timeout", type=float, default=None, metavar="S",
                    help="execute timeout per cell in seconds for this run (default: "
                         "grading/nbgrader_config.py's, 120 s)")
    ap.add_argument("--no-feedback", action="store_true",
                    help="skip nbgrader generate_feedback (CI's per-lab tests: the feedback "
                         "page is checked once, with the generic fixtures)")
    ap.add_argument("--course-root", default=None,
                    help="course root (default: build/grading, a scratch root erased at each "
                         "run; with --prepare-only, the class's: --class-config's, "
                         "build/nbgrader)")
    ap.add_argument("--prepare-only", action="store_true",
                    help="bring the class's course root up to date, grade nothing (what "
                         "`make lab` runs): keeps the gradebook and every submission, "
                         "converts, generates and releases only the labs whose source "
                         "changed, writes the nbgrader_config.py of the course root and of "
                         "the learner's folder (grading/classroom.py)")
    ap.add_argument("--lang", default=os.environ.get("COURSE_LANG") or "en",
                    choices=_i18n().LANGS,
                    help="the language of the labs' instructions (default: $COURSE_LANG, else "
                         "en): zh releases the Chinese edition, with the same assignment "
                         "names, cells, points and tests (docs/i18n.py); refused while a "
                         "lab's translation is missing or stale")
    ap.add_argument("--class-config", default=str(CLASS_CONFIG), metavar="FILE",
                    help="--prepare-only: the nbgrader configuration whose course root, "
                         "exchange and assignment folder it uses (default: the repository's "
                         "nbgrader_config.py, which JupyterLab reads in `make lab`)")
    ap.add_argument("--exchange", default=None,
                    help="--prepare-only: the nbgrader exchange (default: --class-config's, "
                         "build/exchange; with another --course-root, build/exchange, not "
                         "written into that root's configuration unless given)")
    ap.add_argument("--assignment-dir", default=None,
                    help="--prepare-only: the learner's folder for fetched labs (default: "
                         "--class-config's, build/labs; none with another --course-root)")
    args = ap.parse_args(argv)
    sources = sorted(p.name for p in (ROOT / "labs" / "source").glob("ch*") if p.is_dir())
    available = sorted(p.stem for p in (ROOT / "grading" / "fixtures").glob("ch*.py"))
    labs = args.labs or sources
    unknown = [x for x in labs if x not in sources]
    missing = [x for x in labs if x not in available]
    if unknown or (missing and not args.prepare_only):
        print(f"error: no lab source for {unknown}, no fixtures (grading/fixtures/<lab>.py) "
              f"for {missing}; labs: {sources}, with fixtures: {available}", file=sys.stderr)
        return 2
    only = [s.strip() for s in args.fixtures.split(",") if s.strip()] if args.fixtures else None
    if args.record and (only or args.all):
        print("error: --record grades its own fixtures; leave out --fixtures and --all "
              "(--all records too)", file=sys.stderr)
        return 2
    if args.prepare_only:
        return prepare(args, labs)
    course = Path(args.course_root or ROOT / "build" / "grading")
    try:
        build_course(course, labs, args.lang)
    except ValueError as e:  # a translation missing or stale (docs/i18n.py)
        print(f"error: {e}", file=sys.stderr)
        return 2
    # SIGTERM (a CI timeout, `kill`) unwinds like Ctrl-C, so the load processes stop too.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    with cpu_load(args.load) as burners:
        if burners:
            print(f"grading under load: {len(burners)} CPU-burning processes "
                  f"(pids {', '.join(map(str, burners))})", flush=True)
        runs = [(lab, records.required(lab) if args.record else only, args.timeout)
                for lab in labs]
        generic_lab, generic, generic_timeout = fixtures.ci_generic()
        if not (args.all or only or args.labs or args.record):
            # the whole course, CI's share: the generic fixtures once, on one lab, with a
            # shorter timeout (tests/test_grading.py grades them in a test of their own)
            runs.append((generic_lab, generic, args.timeout or generic_timeout))
        results = []
        for lab, names, timeout in runs:
            try:
                r = grade_lab(lab, course, args.all, names, timeout,
                              feedback=not args.no_feedback)
            except RuntimeError as e:  # nbgrader failed, or the lab changed: the next lab
                print(f"\nFAILED: {lab}: {e}", flush=True)
                results.append({"lab": lab, "ok": False, "problems": [str(e)]})
                continue
            r["extra_load_processes"] = args.load
            if args.all and r["ok"]:  # one notebook, one grade: graded again, twice
                r["problems"] += reproducibility(lab, r)
                r["ok"] = not r["problems"]
            print_report(r)
            if (args.all or args.record) and args.timeout is None and r["ok"]:
                print(f"every fixture graded got its score: recorded {records.write(r)}")
            sys.stdout.flush()
            results.append(r)
    ok = all(r["ok"] for r in results)
    print(json.dumps({"ok": ok, "labs": results}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
