"""Every lab graded with nbgrader against its fixtures (grading/fixtures/), as CI grades it:
the reference solution gets full points on every graded cell and raises nowhere, the
released copy zero on every graded cell; once, on grading.fixtures.CI_GENERIC_LAB, its
first lab-specific wrong answer and the generic fixtures (exception, infinite loop, NaN,
patched checks) exactly their expected scores, with nbgrader's feedback pages. Every
fixture of every lab: `make grade-all`, which writes grading/records/<lab>.json; CI checks
that each lab's record matches the lab as it is (grading/records.py).

Each lab's grading report goes to reports/grading_<lab>.json (per fixture its score per
cell and run time, per solution cell its time, cells slower than a quarter of the timeout
flagged); its times are recorded (grading/course_times.py), not asserted on.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from grading import course_times, fixtures, grade

ROOT = Path(__file__).resolve().parents[1]
LABS = sorted(p.stem for p in (ROOT / "grading" / "fixtures").glob("ch*.py"))


def test_every_lab_has_fixtures():
    """CI grades every lab: a lab in labs/source needs grading/fixtures/<lab>.py."""
    sources = sorted(p.name for p in (ROOT / "labs" / "source").glob("ch*") if p.is_dir())
    assert sources == LABS, f"labs without fixtures: {sorted(set(sources) - set(LABS))}"


def _source_cells(lab: str):
    import jupytext

    from grading.grade import lab_cells

    (src,) = sorted((ROOT / "labs" / "source" / lab).glob("*.py"))
    return lab_cells(jupytext.read(src))


@pytest.mark.parametrize("lab", LABS)
def test_fixture_file_matches_the_lab(lab):
    """Cheap, before any grading: the fixture file follows grading/fixtures/__init__.py's
    format, edits only solution cells of the lab, states every generic fixture, and its
    MAX_SCORE is the lab's points."""
    pytest.importorskip("jupytext")
    fx = fixtures.load(lab)
    solutions, points = _source_cells(lab)
    fixtures.check_lab(fx, solutions, points)
    kinds = [f.kind for f in fx.FIXTURES.values()]
    assert kinds.count("specific") >= 1, "a lab needs at least one lab-specific fixture"
    assert sorted(n for n, f in fx.FIXTURES.items() if f.kind == "generic") == \
        sorted(fixtures.GENERIC_FIXTURES)
    assert fx.FIXTURES["solution"].score == fx.MAX_SCORE and fx.FIXTURES["release"].score == 0


@pytest.mark.parametrize("lab", LABS)
def test_no_secret_line_is_also_in_the_task_prose(lab):
    """No line of a reference solution or hidden test (stripped, over 25 characters) also
    appears in the lab's markdown, which the site shows on the lab's page. tests/test_site.py
    checks the rendered page the same way, but only after building the whole site (minutes
    when run alone); this catches it in a second, while writing a lab."""
    import re

    jupytext = pytest.importorskip("jupytext")
    (src,) = sorted((ROOT / "labs" / "source" / lab).glob("*.py"))
    source = src.read_text()
    secret = [ln.strip() for block in re.findall(
        r"### BEGIN (?:SOLUTION|HIDDEN TESTS)\n(.*?)### END", source, re.S)
        for ln in block.splitlines() if len(ln.strip()) > 25]
    assert secret, f"{lab}: no solution or hidden-test block found"
    prose = "\n".join(c.source for c in jupytext.read(src).cells if c.cell_type == "markdown")
    leaked = [ln for ln in secret if ln in prose]
    assert not leaked, (f"{lab}: these secret lines also appear in the task prose "
                        f"(reword one side): {leaked[:3]}")


def test_generic_fixtures_build_from_a_solution_cell():
    code = "def f(x: int) -> float:\n    y = x + 1\n    return y / 2\n"
    made = {n: g.make(code) for n, g in fixtures.GENERIC_FIXTURES.items()}
    ns: dict = {}
    exec(made["nan"], ns)
    assert ns["f"](3) != ns["f"](3)  # NaN
    ns = {}
    exec(made["exception"], ns)
    with pytest.raises(RuntimeError):
        ns["f"](3)
    assert made["infinite_loop"].startswith("while True:")
    assert "_torch.allclose = " in made["patch_checks"] and "return float('nan')" in \
        made["patch_checks"]
    ns = {}
    exec(fixtures.GENERIC_FIXTURES["nan"].make("answer = 42\n"), ns)  # a cell with no def
    assert ns["answer"] != ns["answer"]


def _grade(tmp_path, *args: str) -> tuple[subprocess.CompletedProcess, dict, dict]:
    """`python -m grading.grade ARGS` in a scratch course root, as CI runs it, timed; its
    one lab's result and the time (course_times.measure)."""
    with course_times.measure() as m:
        proc = subprocess.run([sys.executable, "-m", "grading.grade", *args, "--course-root",
                               str(tmp_path / "course")], cwd=ROOT, capture_output=True,
                              text=True, timeout=1500)
    print(proc.stdout[-6000:])
    assert proc.stdout.strip(), proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    (lab_result,) = result["labs"]
    return proc, lab_result, m


def _report(name: str, lab_result: dict) -> None:
    report = ROOT / "reports" / f"grading_{name}.json"
    report.parent.mkdir(exist_ok=True)
    report.write_text(json.dumps(lab_result, indent=2) + "\n")


def test_ci_grades_solution_and_release_and_once_the_rest():
    """CI's share (fixtures.select) for every lab; --all gives every fixture; once, on one
    lab: its first lab-specific fixture and the generic ones."""
    for lab in LABS:
        fx = fixtures.load(lab)
        assert fixtures.select(lab, fx.FIXTURES) == ["solution", "release"]
        assert fixtures.select(lab, fx.FIXTURES, everything=True) == list(fx.FIXTURES)
    lab, names, timeout = fixtures.ci_generic()
    specific = [n for n, f in fixtures.load(lab).FIXTURES.items() if f.kind == "specific"]
    assert lab in LABS and names == [specific[0], *fixtures.GENERIC_FIXTURES] and timeout > 0


@pytest.mark.parametrize("lab", LABS)
def test_every_fixture_was_graded_on_the_lab_as_it_is(lab):
    """grading/records/<lab>.json (written by `python -m grading.grade --all <lab>`): every
    fixture got its exact score, graded on the lab source and fixture file as they are
    now (a digest of both) with the course's timeout. CI grades only the solution and the
    released copy of each lab; this is what vouches for the lab-specific wrong answers."""
    from grading import records

    problems = records.problems(lab)
    assert not problems, "\n".join(problems)


def test_a_record_goes_stale_when_the_lab_changes(tmp_path):
    """records.digest covers the lab source and its fixture file, byte for byte."""
    from grading import records

    for rel in ("labs/source/ch99/ch99_lab.py", "grading/fixtures/ch99.py"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("x = 1\n")
    before = records.digest("ch99", tmp_path)
    assert records.digest("ch99", tmp_path) == before
    for rel in ("labs/source/ch99/ch99_lab.py", "grading/fixtures/ch99.py"):
        (tmp_path / rel).write_text("x = 2\n")
        after = records.digest("ch99", tmp_path)
        assert after != before, rel
        before = after
    (tmp_path / "labs/source/ch99/extra.py").write_text("")  # a second source file counts
    assert records.digest("ch99", tmp_path) != before
    with pytest.raises(FileNotFoundError):
        records.digest("ch98", tmp_path)


@pytest.mark.embedded
@pytest.mark.parametrize("lab", LABS)
def test_lab_fixtures_get_exact_scores(lab, tmp_path, embedded_model_dir):
    pytest.importorskip("nbgrader")
    fx = fixtures.load(lab)
    proc, lab_result, m = _grade(tmp_path, lab, "--no-feedback")
    _report(lab, lab_result)
    course_times.record_lab(lab_result, m)
    by = {f["fixture"]: f for f in lab_result["fixtures"]}
    # what CI grades: the solution and the released copy (the lab-specific fixtures:
    # grading/records/, test_every_fixture_was_graded_on_the_lab_as_it_is)
    assert list(by) == fixtures.select(lab, fx.FIXTURES) == ["solution", "release"]
    assert lab_result["timeout_s"] == grade.execute_timeout()  # the course's own timeout
    assert lab_result["feedback_s"] is None  # the feedback pages: once, generic fixtures
    wrong = {n: (f["expected"], f["score"]) for n, f in by.items()
             if f["score"] != f["expected"]}
    assert not wrong, f"fixture (expected, got): {wrong}\n{proc.stderr[-3000:]}"
    sol, rel = by["solution"], by["release"]
    assert sol["score"] == sol["max_score"] == fx.MAX_SCORE
    assert sol["cells"] and sol["cells"] == sol["cell_max"], sol["cells"]  # per graded cell
    assert rel["cells"] and all(v == 0 for v in rel["cells"].values()), rel["cells"]
    assert lab_result["ok"], lab_result["problems"]
    assert proc.returncode == 0


@pytest.mark.embedded
def test_generic_fixtures_get_exact_scores(tmp_path, embedded_model_dir):
    """The grader itself, once (fixtures.ci_generic()): a function that raises, a cell that
    never ends (interrupted at the timeout, scored zero, grading goes on), NaN, and code
    that patches the comparisons each get exactly the score the lab's fixture file says;
    so does the lab's first lab-specific fixture (a `wrong` edit of a solution cell)."""
    pytest.importorskip("nbgrader")
    lab, names, timeout = fixtures.ci_generic()
    fx = fixtures.load(lab)
    proc, lab_result, m = _grade(tmp_path, lab, "--fixtures", ",".join(names),
                                 "--timeout", str(timeout))
    _report(f"{lab}_generic", lab_result)
    course_times.record_generic(lab_result, m)
    assert lab_result["timeout_s"] == timeout
    by = {f["fixture"]: f for f in lab_result["fixtures"]}
    assert list(by) == names and set(fixtures.GENERIC_FIXTURES) < set(by)
    got = {n: (f["score"], fx.FIXTURES[n].score) for n, f in by.items()}
    assert all(a == b for a, b in got.values()), f"fixture (got, expected): {got}"
    # the infinite loop really ran into the timeout (its cell took at least that long)
    # nbgrader generate_feedback ran and wrote a page per fixture (checked here, once:
    # the per-lab tests skip it, since it is nbgrader's rendering, the same for every lab)
    assert lab_result["feedback_s"] is not None
    assert all(f["feedback"] is True for f in by.values()), {n: f["feedback"]
                                                              for n, f in by.items()}
    loop = by["infinite_loop"]
    assert max(loop["cell_s"].values()) >= timeout, loop["cell_s"]
    assert lab_result["ok"], lab_result["problems"]
    assert proc.returncode == 0


@pytest.mark.embedded
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


# ------------------------------------------------------------------ the labs in Chinese

def _translated(lab: str) -> bool:
    i18n = grade._i18n()
    return all(i18n.translation_path(p).is_file() and i18n.status(p).ok
               for p in (ROOT / "labs" / "source" / lab).glob("*.py"))


@pytest.mark.parametrize("lab", LABS)
def test_a_lab_converts_to_chinese_with_the_same_cells(lab, tmp_path):
    """grade.convert_lab(lang="zh"): the Markdown cells in Chinese, everything nbgrader
    grades by (cell order and types, nbgrader metadata: its cell ids (grade_id), points,
    locks; code, tests) the English lab's; a lab whose translation is missing or stale is
    refused. (The notebook format's own cell "id" is a fresh random one at each
    conversion, in English too: jupytext's; nbgrader does not use it.)"""
    import nbformat

    i18n = grade._i18n()
    if not _translated(lab):
        with pytest.raises(i18n.TranslationError):
            grade.convert_lab(lab, tmp_path, "zh")
        pytest.skip(f"{lab}: not translated yet (refused, as it must be)")
    (tmp_path / "en").mkdir()
    (tmp_path / "zh").mkdir()
    grade.convert_lab(lab, tmp_path / "en", "en")
    grade.convert_lab(lab, tmp_path / "zh", "zh")
    for en_path in (tmp_path / "en").glob("*.ipynb"):
        en = nbformat.read(en_path, as_version=4)
        zh = nbformat.read(tmp_path / "zh" / en_path.name, as_version=4)
        assert len(en.cells) == len(zh.cells)
        changed = 0
        for a, b in zip(en.cells, zh.cells):
            assert (a.cell_type, a.metadata) == (b.cell_type, b.metadata)
            if a.cell_type == "code":
                assert a.source == b.source
            else:
                changed += a.source != b.source
                assert i18n.CJK.search(b.source) or not i18n.check_pair(a.source, a.source)
        assert changed, "no Markdown cell was translated"
    with pytest.raises(ValueError, match="expected one of"):
        grade.convert_lab(lab, tmp_path, "fr")


# The lab graded in Chinese in CI (one lab: grading it costs about half a minute; every
# translated lab: `make grade COURSE_LANG=zh`).
ZH_GRADED_LAB = "ch09"


@pytest.mark.embedded
def test_a_lab_released_in_chinese_gets_the_same_exact_scores(tmp_path, embedded_model_dir):
    """ZH_GRADED_LAB released with Chinese instructions (`--lang zh`) and graded: the
    solution, the released copy and the lab's first wrong answer get exactly the scores
    the fixture file states for the English lab, cell by cell for the solution; the
    released notebook's instructions are Chinese."""
    pytest.importorskip("nbgrader")
    import nbformat

    lab = ZH_GRADED_LAB
    assert _translated(lab), f"{lab}'s translation is missing or stale"
    fx = fixtures.load(lab)
    specific = next(n for n, f in fx.FIXTURES.items() if f.kind == "specific")
    proc, lab_result, _ = _grade(tmp_path, lab, "--lang", "zh", "--no-feedback",
                                 "--fixtures", f"solution,release,{specific}")
    by = {f["fixture"]: f for f in lab_result["fixtures"]}
    got = {n: by[n]["score"] for n in by}
    assert got == {n: float(fx.FIXTURES[n].score) for n in ("solution", "release", specific)}, (
        got, proc.stderr[-3000:])
    assert by["solution"]["cells"] == by["solution"]["cell_max"]
    assert lab_result["ok"] and proc.returncode == 0, lab_result["problems"]
    (released,) = (tmp_path / "course" / "release" / lab).glob("*.ipynb")
    md = [c.source for c in nbformat.read(released, as_version=4).cells if c.cell_type == "markdown"]
    assert sum(bool(grade._i18n().CJK.search(s)) for s in md) >= len(md) // 2, md[:2]
