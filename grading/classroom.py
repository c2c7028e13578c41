"""The class on one machine (`make lab`): the course root, its nbgrader configuration, and
two nbgrader plugins the course's configuration names.

:func:`prepare` is what ``python -m grading.grade --prepare-only`` (and so `make lab`) runs.
It keeps the class's work: the gradebook, ``submitted/``, ``autograded/`` and
``feedback/`` of the course root stay, and of the labs only those whose source changed
since they were last released are converted, generated and released again (a second
start with nothing changed regenerates nothing). A lab with submissions (in the gradebook
or waiting in the exchange) is never regenerated: nbgrader refuses to change the cells of
an assignment with submissions, and its grades must stay those of the notebook the
learners were given; prepare says so and keeps the released version.

It writes two configuration files, both generated from the one configuration
(``nbgrader_config.py`` at the repository root for `make lab`):

- ``<course root>/nbgrader_config.py``: the course's settings (``grading/nbgrader_config.py``,
  loaded by absolute path), the course root, the exchange and the learner's assignment
  folder, so that ``cd build/nbgrader && nbgrader collect ch01`` finds the exchange;
- ``<assignment dir>/nbgrader_config.py``: loads the former. nbgrader 0.9's Assignment List
  (its server extension) reads its configuration again from inside
  ``Exchange.assignment_dir`` (the cwd there and Jupyter's config path, nothing else), so
  without this file the list loses the exchange and fails ("Unwritable directory
  /usr/local/share/nbgrader/exchange"), and without the folder it fails with a 500.

Plugins (named in ``grading/nbgrader_config.py``):

- :class:`LatePenalty`: a late-submission penalty per started day late (nbgrader compares
  the submission's timestamp with the assignment's ``duedate``, set with
  ``nbgrader db assignment add chNN --duedate=...``);
- :class:`LmsCsvExport`: ``nbgrader export`` as one row per learner and one column per
  lab (what an LMS's grade import reads), written to ``<course root>/grades.csv``
  unless ``--to`` says otherwise.
"""

from __future__ import annotations

import csv
import hashlib
import json
import math
import os
import time
from pathlib import Path

from nbgrader.plugins import ExportPlugin, LateSubmissionPlugin
from traitlets import Float

ROOT = Path(__file__).resolve().parents[1]
COURSE_CONFIG = ROOT / "grading" / "nbgrader_config.py"
CLASS_CONFIG = ROOT / "nbgrader_config.py"  # the one-machine class (`make lab`)
STAMP = ".prepared.json"  # in the course root: per lab, the digest it was released from
HEADER = ("# {what}.\n# Written by `python -m grading.grade --prepare-only`, again at each prepare:\n"
          "# change {source} instead.\n")


def _load_config(config_file: Path):
    """An nbgrader configuration file as nbgrader reads it (its subconfigs included)."""
    from traitlets.config.loader import PyFileConfigLoader

    config_file = Path(config_file).resolve()
    return PyFileConfigLoader(config_file.name, str(config_file.parent)).load_config()


def class_paths(config_file: Path = CLASS_CONFIG) -> dict[str, Path | None]:
    """The course root, exchange and assignment folder that ``config_file`` (an nbgrader
    configuration, by default the repository's) sets, as nbgrader reads them."""
    cfg = _load_config(config_file)

    def get(section: str, key: str) -> Path | None:
        value = cfg[section][key] if key in cfg[section] else None
        return Path(value).resolve() if value else None

    return {"course": get("CourseDirectory", "root"), "exchange": get("Exchange", "root"),
            "assignment_dir": get("Exchange", "assignment_dir")}


def course_config_text(base: Path, settings: dict[str, str], source: str) -> str:
    """The course root's nbgrader_config.py: ``base`` loaded by absolute path (a relative
    ``load_subconfig`` resolves against the folder of the first file nbgrader read, and a
    missing file is skipped silently, so the file checks it exists), then ``settings``
    (``{"Exchange.root": "/path"}``)."""
    lines = [HEADER.format(what="The course root's nbgrader configuration", source=source),
             "import os\n\n",
             "c = get_config()  # noqa: F821\n",
             f"_base = {str(base)!r}\n",
             "if not os.path.isfile(_base):\n",
             "    raise FileNotFoundError(f'nbgrader configuration {_base} is missing')\n",
             "load_subconfig(_base)  # noqa: F821\n"]
    lines += [f"c.{key} = {value!r}\n" for key, value in settings.items()]
    return "".join(lines)


def assignment_dir_config_text(course_config: Path, source: str) -> str:
    return "".join([
        HEADER.format(what="The nbgrader configuration of the learner's folder: the Assignment "
                      "List reads its configuration again in here", source=source),
        "import os\n\n",
        f"_course = {str(course_config)!r}\n",
        "if not os.path.isfile(_course):\n",
        "    raise FileNotFoundError(f'{_course} is missing: run make lab (or "
        "python -m grading.grade --prepare-only)')\n",
        "load_subconfig(_course)  # noqa: F821\n"])


def lab_digest(lab: str, lang: str = "en") -> str:
    """What a lab's released copy is made from: its sources, in a language other than
    English their translation, and the course's settings (the stub that replaces a
    solution is one)."""
    h = hashlib.sha256()
    d = ROOT / "labs" / "source" / lab
    extra = sorted(d.glob(f"*.{lang}.md")) if lang != "en" else []
    for path in [*sorted(d.glob("*.py")), *extra, COURSE_CONFIG]:
        h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def course_id(config: Path = COURSE_CONFIG) -> str:
    return str(_load_config(config).CourseDirectory.course_id)


def submission_counts(course: Path, exchange: Path, labs: list[str]) -> dict[str, int]:
    """Per lab: its submissions in the gradebook plus those waiting in the exchange."""
    counts = {lab: 0 for lab in labs}
    inbound = exchange / course_id() / "inbound"
    if inbound.is_dir():
        for entry in inbound.iterdir():  # <student>+<assignment>+<timestamp>[+<random>]
            parts = entry.name.split("+")
            if len(parts) >= 3 and parts[1] in counts:
                counts[parts[1]] += 1
    db = course / "gradebook.db"
    if db.is_file():
        from nbgrader.api import Gradebook, MissingEntry

        with Gradebook(f"sqlite:///{db}") as gb:
            for lab in labs:
                try:
                    counts[lab] += len(gb.find_assignment(lab).submissions)
                except MissingEntry:
                    pass
    return counts


def release(course: Path, labs: list[str], exchange: Path | None) -> None:
    """``nbgrader release_assignment <lab> --force`` for each lab, in this one process (1.3 s
    a lab as separate commands): the course root's configuration read as the ``nbgrader``
    command reads it there (its folder, then Jupyter's config path), and nbgrader's exchange
    classes called as its Assignment List calls them. ``exchange``: ``--Exchange.root``."""
    from nbgrader.apps import NbGrader
    from nbgrader.auth import Authenticator
    from nbgrader.coursedir import CourseDirectory
    from nbgrader.exchange import ExchangeFactory

    cwd = os.getcwd()
    os.chdir(course)
    try:
        app = NbGrader()
        app.load_config_file()
        config = app.config
    finally:
        os.chdir(cwd)
    if exchange is not None:
        config.Exchange.root = str(exchange)
    config.ExchangeReleaseAssignment.force = True
    for i, lab in enumerate(labs, 1):
        _say(f"nbgrader release_assignment {lab} --force ({i}/{len(labs)})")
        config.CourseDirectory.assignment_id = lab
        coursedir = CourseDirectory(config=config)
        ExchangeFactory(config=config).ReleaseAssignment(
            coursedir=coursedir, authenticator=Authenticator(config=config),
            config=config).start()


def _say(msg: str) -> None:
    print(f"prepare: {msg}", flush=True)


def set_aside(course: Path) -> Path | None:
    """A course root that no prepare of this kind has written (no stamp) is moved to
    ``<root>.before-<time>`` (returned), so the class starts clean: before this, `make lab`
    rebuilt ``build/nbgrader`` at each start and `make grade` graded its fixtures there (its
    gradebook holds learners named ``solution``, ``release``, ...)."""
    if not course.is_dir() or (course / STAMP).is_file() or not any(course.iterdir()):
        return None
    aside = course.with_name(f"{course.name}.before-{time.strftime('%Y%m%d-%H%M%S')}")
    course.rename(aside)
    return aside


def prepare(labs: list[str], course: Path, exchange: Path, assignment_dir: Path | None,
            exchange_in_config: bool, nbgrader, base: Path, source: str,
            lang: str = "en") -> dict:
    """Bring the course root ``course`` and the exchange up to date for ``labs``, keeping
    everything the class made. ``nbgrader(course, *args)`` runs one nbgrader command in the
    course root (``grading.grade._nbgrader``). The course root's configuration loads
    ``base`` (the class's configuration on one machine, else the course's) and sets what
    ``base`` does not already say: the course root, and with ``exchange_in_config`` the
    exchange and ``assignment_dir``. Without it (the images, where
    /etc/jupyter/nbgrader_config.py sets the exchange) labs are released with
    ``--Exchange.root`` and the configuration's exchange is left alone. Returns what it
    did per lab. ``lang``: the language of the labs' instructions ("en", "zh"); a lab
    released in another language is released again in this one unless it has
    submissions."""
    from grading.grade import convert_lab

    t0 = time.perf_counter()
    course, exchange = course.resolve(), exchange.resolve()
    have = class_paths(base)
    settings = {}
    if have["course"] != course:
        settings["CourseDirectory.root"] = str(course)
    if exchange_in_config and have["exchange"] != exchange:
        settings["Exchange.root"] = str(exchange)
    if assignment_dir is not None and have["assignment_dir"] != assignment_dir.resolve():
        settings["Exchange.assignment_dir"] = str(assignment_dir.resolve())
    (course / "source").mkdir(parents=True, exist_ok=True)
    exchange.mkdir(parents=True, exist_ok=True)
    config = course / "nbgrader_config.py"
    config.write_text(course_config_text(base, settings, source))
    if assignment_dir is not None:
        assignment_dir = assignment_dir.resolve()
        assignment_dir.mkdir(parents=True, exist_ok=True)
        (assignment_dir / "nbgrader_config.py").write_text(
            assignment_dir_config_text(config, source))
    stamp_file = course / STAMP
    stamp = json.loads(stamp_file.read_text()) if stamp_file.is_file() else {}
    outbound = exchange / course_id() / "outbound"
    submissions = submission_counts(course, exchange, labs)
    status, todo, release_only = {}, [], []
    for lab in labs:
        digest = lab_digest(lab, lang)
        released = (course / "release" / lab).is_dir()
        current = stamp.get(lab) == {"digest": digest, "exchange": str(exchange), "lang": lang}
        if current and released and (outbound / lab).is_dir():
            status[lab] = "up to date"
        elif submissions[lab] and released:
            if stamp.get(lab, {}).get("lang", "en") != lang:
                _say(f"{lab}: released in {stamp.get(lab, {}).get('lang', 'en')!r}, asked for {lang!r}, "
                     f"but it has {submissions[lab]} submission(s): kept the version the "
                     "learners were given")
                status[lab] = "kept (another language, has submissions)"
            elif stamp.get(lab, {}).get("digest") not in (None, digest):
                _say(f"{lab}: its source changed, but it has {submissions[lab]} submission(s): "
                     "kept the version the learners were given (nbgrader cannot change the "
                     "cells of an assignment with submissions)")
                status[lab] = "kept (source changed, has submissions)"
            else:
                status[lab] = "kept (has submissions)"
            if not (outbound / lab).is_dir():
                release_only.append(lab)
        else:
            todo.append(lab)
    if todo:
        _say(f"converting {len(todo)} lab(s) into {course / 'source'}: {' '.join(todo)}")
    for lab in todo:
        out = course / "source" / lab
        out.mkdir(parents=True, exist_ok=True)
        for old in out.glob("*.ipynb"):
            old.unlink()
        convert_lab(lab, out, lang)
    in_source = sorted(p.name for p in (course / "source").iterdir() if p.is_dir())
    if len(todo) > 1 and set(todo) == {x for x in in_source if x.startswith("ch")}:
        # every lab of the course root at once, in one nbgrader process (a process per
        # lab costs 2.5 s more each)
        _say(f"nbgrader generate_assignment (solutions and hidden tests removed): "
             f"{len(todo)} labs at once")
        nbgrader(course, "generate_assignment", "--assignment=ch*", "--force")
    else:
        for lab in todo:
            _say(f"nbgrader generate_assignment {lab}")
            nbgrader(course, "generate_assignment", lab, "--force")
    if todo or release_only:
        _say(f"releasing to the exchange {exchange}")
        release(course, todo + release_only, None if exchange_in_config else exchange)
    for lab in todo:
        stamp[lab] = {"digest": lab_digest(lab, lang), "exchange": str(exchange), "lang": lang}
        status[lab] = "generated and released"
    for lab in release_only:
        status[lab] += ", released again"
    stamp_file.write_text(json.dumps(stamp, indent=1, sort_keys=True) + "\n")
    counts: dict[str, int] = {}
    for s in status.values():
        counts[s] = counts.get(s, 0) + 1
    summary = ", ".join(f"{n} {s}" for s, n in sorted(counts.items()))
    _say(f"{len(labs)} labs in {time.perf_counter() - t0:.1f} s: {summary}")
    return status


class LatePenalty(LateSubmissionPlugin):
    """The course's late policy: a submission after its lab's due date loses
    ``percent_per_day`` % of its score per started day late (1 s late: one day), at most
    the whole score. ``penalty_method = 'zero'`` (nbgrader's) still gives zero for any late
    submission. Labs without a due date are never late."""

    percent_per_day = Float(
        10.0, help="% of the score lost per started day after the due date (0: late "
                   "submissions are flagged in the gradebook, not penalised)").tag(config=True)

    def late_submission_penalty(self, student_id: str, score: float,
                                total_seconds_late: float) -> float | None:
        if self.penalty_method == "zero":
            return score
        if total_seconds_late <= 0 or self.percent_per_day <= 0:
            return None
        days = math.ceil(total_seconds_late / 86400)
        penalty = min(score, score * self.percent_per_day / 100 * days)
        self.log.info("%s: %d day(s) late, %g %% a day: penalty %g of %g", student_id, days,
                      self.percent_per_day, penalty, score)
        return penalty


class LmsCsvExport(ExportPlugin):
    """``nbgrader export`` for a learning-management system's grade import: one row per
    learner (``student_id``, ``last_name``, ``first_name``, ``email``: match on the id or
    the e-mail), one column per lab with its score after the late penalty, and ``total``.
    A lab not submitted is left empty (not graded, rather than zero). Written to ``--to``,
    else to ``<course root>/grades.csv`` wherever the command runs. nbgrader's own format
    (a row per learner and lab, with due date, timestamp and penalty):
    ``nbgrader export --exporter=nbgrader.plugins.CsvExportPlugin``."""

    def export(self, gradebook) -> None:
        from nbgrader.api import MissingEntry

        root = getattr(getattr(self.parent, "coursedir", None), "root", None) or os.getcwd()
        dest = Path(self.to) if self.to else Path(root) / "grades.csv"
        labs = [a for a in gradebook.assignments
                if not self.assignment or a.name in self.assignment]
        students = [s for s in gradebook.students
                    if not self.student or s.id in self.student]
        dest.parent.mkdir(parents=True, exist_ok=True)
        with open(dest, "w", newline="") as fh:
            w = csv.writer(fh)
            w.writerow(["student_id", "last_name", "first_name", "email",
                        *[a.name for a in labs], "total"])
            for s in students:
                row, total = [], 0.0
                for a in labs:
                    try:
                        sub = gradebook.find_submission(a.name, s.id)
                    except MissingEntry:
                        row.append("")
                        continue
                    score = max(0.0, sub.score - (sub.late_submission_penalty or 0.0))
                    row.append(f"{score:g}")
                    total += score
                w.writerow([s.id, s.last_name or "", s.first_name or "", s.email or "",
                            *row, f"{total:g}"])
        self.log.info("Exported %d learner(s) x %d lab(s) to %s", len(students), len(labs), dest)
