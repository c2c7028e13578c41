"""Autograde a lab's collected submissions, each executed in a sandbox container.

Run by the instructor on the Docker host (Python 3 and the docker CLI; no other package):

    python3 docker/grade_sandbox.py ch03                       # every collected submission
    python3 docker/grade_sandbox.py ch03 --student alice --student bob
    python3 docker/grade_sandbox.py ch03 --course /srv/minivllm-course --memory 6g

in place of ``nbgrader autograde ch03``. Three steps, as three kinds of container:

1. **assemble** (trusted, the grader image, ``--network none``, the course mounted): for
   each submission nbgrader's own ``autograde`` with its sanitizing pass only (outputs
   cleared, the locked and test cells put back from the gradebook, hidden tests included;
   ``Autograde.autograde_preprocessors = []``: nothing executed, no score written). The
   notebooks come back to this script as a tar stream on stdout.
2. **execute** (untrusted, one container per submission, the *learner* image: no
   solutions, no fixtures, no course): the notebook arrives on stdin; nbgrader's
   ``Execute`` runs it with the course's timeouts (a cell whose kernel dies, e.g. killed at
   the memory limit, and every cell after it get an error output instead of failing the
   submission); the executed notebook goes back on stdout. The container runs with
   ``--network none``, ``--read-only`` (its only writable place is a size-limited tmpfs
   /tmp), ``--user`` a uid of its own (``--uid-base`` + the submission's index in this run:
   not the instructor's 1000, not a learner's), ``--memory`` (= ``--memory-swap``: no
   swap), ``--cpus``, ``--pids-limit``, ``--cap-drop ALL``, ``no-new-privileges`` and
   ``--init``; it is killed after ``--timeout`` seconds.
3. **record** (trusted, the grader image): nbgrader's ``autograde`` again, with its
   ``Execute`` replaced by :class:`SandboxOutputs`, which takes the outputs of the
   executed notebook when every cell's type and source are exactly those of the sanitized
   notebook (else every code cell gets an error: the submission scores 0), then
   nbgrader's own ``SaveAutoGrades``, late penalty and checks write the gradebook.

What it guarantees: a submission's code never runs in a container that has the course
(gradebook, source/ with solutions and hidden tests of every lab, other submissions,
feedback), the exchange or a network; it cannot write anything that outlives its
container except the outputs of its own notebook's cells, which decide only its own
score; it cannot take more than the memory, CPU share and processes given, nor run
longer than the timeout. The notebook file it runs is removed from disk before the kernel
starts and the executing process is made non-dumpable (its memory and open files are
closed to the kernel, which runs as the same uid); the kernel's stdout is not the stream
the result travels on.

What it does not guarantee: the submission's kernel is the one that runs the lab's test
cells, hidden ones included, as in every nbgrader autograde: code in a submission can
patch Python or IPython to make its own tests pass, or print what a test cell contains
once that cell runs (``grading.checks.guard`` catches the common patches, not all); the
feedback then shows it. A submission can kill its own executor (it scores 0). Reading the
hidden tests of the lab it is graded on ahead of time is made hard, not impossible (e.g. a
kernel exploit). The learner image must not contain anything secret (docker/README.md:
its contents are tested). The trusted steps trust nbgrader and the course's files.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import secrets
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

COURSE_ROOT = "/srv/course/minivllm-precision"
EXCHANGE = "/srv/nbgrader/exchange"
MAX_RESULT = 256 << 20  # bytes of executed notebooks accepted back from one sandbox
MAX_INPUT = 256 << 20   # bytes of assembled notebooks accepted by the sandbox
DIED = "SandboxKernelDied"
NOT_RUN = "SandboxNotRun"
NO_RESULT = "SandboxNoResult"


# ------------------------------------------------------------------------------ tar helpers
def _tar_bytes(files: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data in sorted(files.items()):
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(data), 0o644, int(time.time())
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def _untar_bytes(data: bytes) -> dict[str, bytes]:
    """Regular files only, relative names without '..' (anything else is dropped)."""
    out = {}
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tar:
        for m in tar.getmembers():
            parts = Path(m.name).parts
            if not m.isfile() or not parts or m.name.startswith("/") or ".." in parts:
                continue
            f = tar.extractfile(m)
            if f is not None:
                out[str(Path(*parts))] = f.read()
    return out


def _read_limited(stream, limit: int) -> bytes:
    data = stream.read(limit + 1)
    if len(data) > limit:
        raise ValueError(f"more than {limit} bytes")
    return data


def _error_output(ename: str, evalue: str) -> dict:
    return {"output_type": "error", "ename": ename, "evalue": evalue,
            "traceback": [f"{ename}: {evalue}"]}


# ------------------------------------------------------- trusted steps (grader container)
def _nbgrader_api(preprocessors):
    """nbgrader's API on the course root in the working directory, configured as the
    `nbgrader` command would be (/etc/jupyter, then the course root's nbgrader_config.py),
    with Autograde's execution pass replaced by ``preprocessors``."""
    from nbgrader.apps.api import NbGraderAPI
    from nbgrader.apps.nbgraderapp import NbGraderApp

    app = NbGraderApp()
    app.initialize([])  # reads the configuration files, as `nbgrader autograde` does
    config = app.config
    config.Autograde.autograde_preprocessors = preprocessors
    return NbGraderAPI(config=config), config


def _submitted(api, lab: str, students: list[str]) -> list[str]:
    root = Path(api.coursedir.root) / api.coursedir.submitted_directory
    found = sorted(p.parent.name for p in root.glob(f"*/{lab}") if p.is_dir())
    missing = [s for s in students if s not in found]
    if missing:
        raise SystemExit(f"no collected submission of {lab} for {missing} (nbgrader collect {lab})")
    return students or found


def assemble(lab: str, students: list[str]) -> int:
    """Step 1: sanitize each submission (nothing executed); a tar on stdout:
    ``settings.json`` (the course's Execute settings) and ``<student>/<files>``."""
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # nbgrader's messages must not mix with the tar stream
    api, config = _nbgrader_api([])
    from nbgrader.preprocessors import Execute

    ex = Execute(config=config)
    settings = {k: getattr(ex, k) for k in (
        "timeout", "interrupt_on_timeout", "iopub_timeout", "raise_on_iopub_timeout",
        "startup_timeout", "extra_arguments")}
    files = {"settings.json": json.dumps(settings).encode()}
    failed = {}
    for student in _submitted(api, lab, students):
        result = api.autograde(lab, student, force=True, create=True)
        if not result["success"]:
            failed[student] = result.get("error") or result.get("log", "")[-2000:]
            print(f"assemble {student}: FAILED\n{failed[student]}", file=sys.stderr)
            continue
        folder = Path(api.coursedir.format_path(api.coursedir.autograded_directory, student, lab))
        handed_in = Path(api.coursedir.format_path(api.coursedir.submitted_directory, student, lab))
        for p in sorted(folder.rglob("*")):
            rel = p.relative_to(folder)
            # the sanitized notebooks, and the learner's own other files; never a file
            # autograde copied in from source/ (only the notebooks are the lab's)
            if p.is_file() and (p.suffix == ".ipynb" or (
                    (handed_in / rel).is_file() and p.name != "timestamp.txt")):
                files[f"{student}/{rel}"] = p.read_bytes()
    files["failed.json"] = json.dumps(failed).encode()
    out.write(_tar_bytes(files))
    out.flush()
    return 0


def record(lab: str) -> int:
    """Step 3: the executed notebooks (a tar on stdin: ``<student>/<notebook>.ipynb``)
    graded by nbgrader's autograde with ``SandboxOutputs`` in place of Execute.
    Prints one JSON line: per student, score, max score and how it went."""
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    executed = _untar_bytes(_read_limited(sys.stdin.buffer, 16 * MAX_RESULT))
    status = json.loads(executed.pop("status.json", b"{}"))
    from nbgrader.converters import Autograde
    from nbgrader.preprocessors import Execute

    outputs = _sandbox_outputs_class()
    outputs.executed = executed
    default = Autograde.class_traits()["autograde_preprocessors"].default()
    api, _ = _nbgrader_api([outputs if p is Execute else p for p in default])
    from nbgrader.api import Gradebook

    report = {}
    for student in sorted(status):
        result = api.autograde(lab, student, force=True, create=True)
        with Gradebook(api.coursedir.db_url, api.coursedir.course_id) as gb:
            sub = gb.find_submission(lab, student)
            report[student] = {"score": sub.score, "max_score": sub.max_score,
                               "late_penalty": sub.late_submission_penalty,
                               "recorded": result["success"], **status[student]}
        if not result["success"]:
            print(f"record {student}: FAILED\n{result.get('error')}", file=sys.stderr)
    out.write(json.dumps(report) + "\n")
    out.flush()
    return 0 if all(r["recorded"] for r in report.values()) else 1


def _sandbox_outputs_class():
    from nbgrader.preprocessors import NbGraderPreprocessor

    class SandboxOutputs(NbGraderPreprocessor):
        """In place of nbgrader's Execute: the outputs the sandbox returned for this
        notebook, accepted only if its cells are those it was given (same types, same
        sources, same order); otherwise, or without a result, every code cell gets an
        error output, so every graded cell scores 0. A code cell returned without an
        execution count (never run) gets an error output too."""

        executed: dict[str, bytes] = {}

        def preprocess(self, nb, resources):
            import nbformat

            student = resources["nbgrader"]["student"]
            name = f"{student}/{resources['nbgrader']['notebook']}.ipynb"
            got, why = None, "the sandbox returned no notebook"
            if name in self.executed:
                try:
                    got = nbformat.reads(self.executed[name].decode(), as_version=4)
                    same = len(got.cells) == len(nb.cells) and all(
                        a.cell_type == b.cell_type and a.source == b.source
                        for a, b in zip(got.cells, nb.cells))
                    if not same:
                        got, why = None, "the returned notebook's cells are not those sent"
                except Exception as e:  # noqa: BLE001  (anything unreadable scores 0)
                    got, why = None, f"the returned notebook is unreadable ({type(e).__name__})"
            for i, cell in enumerate(nb.cells):
                if cell.cell_type != "code":
                    continue
                if got is None:
                    cell.outputs = [nbformat.from_dict(_error_output(NO_RESULT, why))]
                    cell.execution_count = None
                else:
                    cell.outputs = got.cells[i].get("outputs", [])
                    cell.execution_count = got.cells[i].get("execution_count")
                    ran = cell.execution_count is not None or not cell.source.strip()
                    if not ran and not any(o.get("output_type") == "error" for o in cell.outputs):
                        # nbgrader scores a test cell without an error as passed: a cell
                        # that never ran must not count as one that passed
                        cell.outputs.append(nbformat.from_dict(_error_output(
                            NOT_RUN, "the sandbox returned this cell unexecuted")))
            if got is None:
                self.log.warning("%s: %s: every code cell marked as an error", name, why)
            return nb, resources

    return SandboxOutputs


# ---------------------------------------------------- untrusted step (sandbox container)
def execute() -> int:
    """Step 2, in the sandbox: the assembled notebooks (a tar on stdin) executed; a tar of
    the executed notebooks on stdout. The notebooks are read into memory and deleted
    before any kernel starts; this process becomes non-dumpable (its memory, environment
    and file descriptors closed to the kernel, which runs as the same uid); the kernel
    inherits /dev/null as stdout, not the result stream."""
    import ctypes

    result = os.fdopen(os.dup(1), "wb")  # not inheritable (PEP 446): the kernel cannot write it
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    ctypes.CDLL(None, use_errno=True).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE = 4, off
    files = _untar_bytes(_read_limited(sys.stdin.buffer, MAX_INPUT))
    settings = json.loads(files.pop("settings.json"))
    work = Path(tempfile.mkdtemp(prefix="submission-"))
    notebooks = {}
    for name, data in files.items():
        if name.endswith(".ipynb"):
            notebooks[name] = data  # kept in memory only
        else:
            (work / name).parent.mkdir(parents=True, exist_ok=True)
            (work / name).write_bytes(data)
    del files
    out = {}
    for name, data in sorted(notebooks.items()):
        out[name] = _execute_one(data, work / Path(name).parent, settings)
        print(f"executed {name}", file=sys.stderr, flush=True)
    result.write(_tar_bytes(out))
    result.flush()
    return 0


def _execute_one(data: bytes, cwd: Path, settings: dict) -> bytes:
    import nbformat
    from nbgrader.preprocessors import Execute

    nb = nbformat.reads(data.decode(), as_version=4)
    cwd.mkdir(parents=True, exist_ok=True)
    state = {"cell": None}

    class Tracked(Execute):
        def preprocess_cell(self, cell, resources, index):
            state["cell"] = index  # the cell being executed when the kernel dies
            return super().preprocess_cell(cell, resources, index)

    ep = Tracked(**settings)
    try:
        nb, _ = ep.preprocess(nb, {"metadata": {"path": str(cwd)}})
    except Exception as e:  # noqa: BLE001  (the kernel died: OOM kill, os._exit, a signal)
        first = state["cell"] if state["cell"] is not None else 0
        why = f"{type(e).__name__}: {e}"[:500]
        print(f"kernel lost at cell {first}: {why}", file=sys.stderr, flush=True)
        for i, cell in enumerate(nb.cells):
            if cell.cell_type != "code" or i < first:
                continue
            err = (_error_output(DIED, f"the kernel died in this cell ({why}): the sandbox's "
                                 "memory or process limit, or the code ended it")
                   if i == first else
                   _error_output(NOT_RUN, f"not run: the kernel died in cell {first}"))
            cell.outputs = [*cell.get("outputs", []), nbformat.from_dict(err)]
    return nbformat.writes(nb).encode()


# ------------------------------------------------------------------ host (the instructor)
def _docker(args: list[str], stdin: bytes | None = None, timeout: float | None = None,
            name: str | None = None) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(["docker", *args], input=stdin, capture_output=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired:
        if name:
            subprocess.run(["docker", "kill", name], capture_output=True)
        raise


def _trusted(a, step: list[str], stdin: bytes | None = None) -> subprocess.CompletedProcess:
    """A trusted step in the grader image: this script's own text, run with the course
    mounted and the course root as working directory, no network."""
    proc = _docker(["run", "--rm", "-i", "--network", "none", "-v", f"{a.course}:/srv/course",
                    "-w", a.course_root, a.grader_image,
                    "python", "-c", Path(__file__).read_text(), *step], stdin=stdin)
    if proc.returncode != 0 and step[0] == "assemble":
        sys.stderr.write(proc.stderr.decode(errors="replace")[-5000:])
        raise SystemExit(f"{step[0]} failed ({proc.returncode})")
    return proc


def sandbox_command(a, uid: int, name: str) -> list[str]:
    """The docker run arguments of one submission's sandbox."""
    return ["run", "--rm", "-i", "--name", name, "--network", "none", "--read-only",
            "--tmpfs", f"/tmp:rw,nosuid,nodev,size={a.tmp_size},mode=1777",
            "--user", f"{uid}:{uid}", "--memory", a.memory, "--memory-swap", a.memory,
            "--cpus", str(a.cpus), "--pids-limit", str(a.pids_limit), "--cap-drop", "ALL",
            "--security-opt", "no-new-privileges", "--init",
            "-e", "HOME=/tmp", "-e", "PYTHONDONTWRITEBYTECODE=1",
            "-e", "OMP_WAIT_POLICY=PASSIVE", "-e", "MPLCONFIGDIR=/tmp",
            "-w", "/tmp", a.sandbox_image,
            "python", "-c", Path(__file__).read_text(), "execute"]


def grade(a) -> int:
    t0 = time.perf_counter()
    step = ["assemble", a.lab, *(x for s in a.student for x in ("--student", s))]
    files = _untar_bytes(_trusted(a, step).stdout)
    settings = files.pop("settings.json")
    failed = json.loads(files.pop("failed.json", b"{}"))
    students = sorted({n.split("/", 1)[0] for n in files} | set(failed))
    status, executed = {}, {}
    for i, student in enumerate(students):
        uid = a.uid_base + i
        if student in failed:
            status[student] = {"sandbox": "not run: nbgrader could not assemble it"}
            continue
        mine = {n.split("/", 1)[1]: d for n, d in files.items() if n.startswith(student + "/")}
        name = f"minivllm-sandbox-{secrets.token_hex(4)}"
        s0 = time.perf_counter()
        try:
            proc = _docker(sandbox_command(a, uid, name),
                           stdin=_tar_bytes({"settings.json": settings, **mine}),
                           timeout=a.timeout, name=name)
            if len(proc.stdout) > MAX_RESULT:
                raise ValueError(f"result over {MAX_RESULT} bytes")
            got = _untar_bytes(proc.stdout) if proc.returncode == 0 else {}
            how = "executed" if got else f"no result (exit {proc.returncode})"
        except subprocess.TimeoutExpired:
            got, how = {}, f"killed after {a.timeout} s"
        except (ValueError, tarfile.TarError) as e:
            got, how = {}, f"rejected: {e}"
        for n, d in got.items():
            executed[f"{student}/{n}"] = d
        status[student] = {"sandbox": how, "uid": uid, "seconds": round(time.perf_counter() - s0, 1)}
        print(f"{student}: {how} in sandbox uid {uid} ({status[student]['seconds']} s)",
              file=sys.stderr, flush=True)
    proc = _trusted(a, ["record", a.lab], stdin=_tar_bytes(
        {**executed, "status.json": json.dumps(status).encode()}))
    sys.stderr.write(proc.stderr.decode(errors="replace")[-3000:] if proc.returncode else "")
    lines = proc.stdout.decode().strip().splitlines()
    report = json.loads(lines[-1]) if lines else {}
    for student, r in sorted(report.items()):
        print(f"{a.lab} {student}: {r['score']:g} / {r['max_score']:g} ({r['sandbox']})")
    print(json.dumps({"lab": a.lab, "students": report,
                      "seconds": round(time.perf_counter() - t0, 1)}))
    return proc.returncode


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="step")
    # the host's command is the default: grade_sandbox.py LAB [options]
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] not in ("assemble", "record", "execute", "-h", "--help"):
        argv = ["grade", *argv]
    g = sub.add_parser("grade", help="(default) grade LAB's collected submissions")
    g.add_argument("lab")
    g.add_argument("--student", action="append", default=[],
                   help="only this learner's submission (repeatable; default: every one collected)")
    g.add_argument("--course", default="minivllm-course",
                   help="what holds the course root, mounted on /srv/course in the grader: a "
                        "Docker volume name or an absolute host folder (default: minivllm-course)")
    g.add_argument("--course-root", default=COURSE_ROOT,
                   help=f"the course root inside the grader (default {COURSE_ROOT})")
    g.add_argument("--grader-image", default="minivllm/grader")
    g.add_argument("--sandbox-image", default="minivllm/lab-cpu",
                   help="the image a submission runs in: the learner image (nothing secret in it)")
    g.add_argument("--memory", default="4g", help="memory limit, no swap (default 4g)")
    g.add_argument("--cpus", type=float, default=2.0, help="CPU limit (default 2)")
    g.add_argument("--pids-limit", type=int, default=256,
                   help="processes and threads (default 256)")
    g.add_argument("--tmp-size", default="512m", help="the writable /tmp (default 512m)")
    g.add_argument("--timeout", type=float, default=1800,
                   help="seconds a submission's container may run in all (default 1800; each "
                        "cell also has the course's c.Execute.timeout)")
    g.add_argument("--uid-base", type=int, default=20000,
                   help="sandbox uids are this + the submission's index (default 20000)")
    a1 = sub.add_parser("assemble", help="(grader container) step 1")
    a1.add_argument("lab")
    a1.add_argument("--student", action="append", default=[])
    a3 = sub.add_parser("record", help="(grader container) step 3")
    a3.add_argument("lab")
    sub.add_parser("execute", help="(sandbox container) step 2")
    a = ap.parse_args(argv)
    if a.step == "assemble":
        return assemble(a.lab, a.student)
    if a.step == "record":
        return record(a.lab)
    if a.step == "execute":
        return execute()
    if a.step == "grade":
        return grade(a)
    ap.print_help()
    return 2


if __name__ == "__main__":
    sys.exit(main())
