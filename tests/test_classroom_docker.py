"""The class in containers: the learner image, learners' sessions through nbgrader's
exchange, and the grader with each submission sandboxed (docker/grade_sandbox.py).

Needs a Docker engine and the images built (docker/README.md): the learner image
``minivllm/lab-cpu`` and ``minivllm/grader`` (``MINIVLLM_LEARNER_IMAGE``,
``MINIVLLM_GRADER_IMAGE`` name others). Skipped, with the reason, where ``docker info``
fails or an image is missing (CI has no Docker engine).

One class on host folders, as the instructor's commands in docker/README.md run it: the
course root (the grader's /srv/course, uid 1000), the exchange (every container's
/srv/nbgrader/exchange), and one home folder per learner. Each learner's session is a
container of the learner image running as a uid of its own (alice 2001, bob 2002,
mallory 2003), as a hub with per-user uids runs them. The instructor prepares and
releases lab ch03 in the grader image; alice submits the solution (17/17), bob the
"truncate" fixture (grading/fixtures/ch03.py: 3/17), mallory a solution with attacks in
it; the instructor collects, grades with docker/grade_sandbox.py, generates and releases
feedback; the learners fetch it. Checked on the way: a learner cannot list another's
submissions in the exchange, find one by a pattern, or overwrite its files in place; given
a submission's exact name (which only nbgrader's record in the submitter's home holds)
another uid can read and replace its files, as nbgrader's permissions allow (shown, on a
copy: docker/README.md says so); the learner image has no lab source, fixture, solution
line or hidden test; mallory's attacks (network, gradebook, another's
submission, the course's hidden tests, the executor's memory, a fork bomb, 20 GB) fail
inside the sandbox and the submission is still graded: 7/17 (tasks 1 and 2; the 20 GB
cell kills its kernel, so task 3 and the restore check score 0).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.docker_ready import docker_why_not

ROOT = Path(__file__).resolve().parents[1]
LAB = "ch03"  # grading.fixtures.CI_GENERIC_LAB: the fastest lab
COURSE_ID = "minivllm-precision"
C = f"/srv/course/{COURSE_ID}"
EXCHANGE = "/srv/nbgrader/exchange"
INBOUND = f"{EXCHANGE}/{COURSE_ID}/inbound"
LEARNER = os.environ.get("MINIVLLM_LEARNER_IMAGE", "minivllm/lab-cpu")
GRADER = os.environ.get("MINIVLLM_GRADER_IMAGE", "minivllm/grader")
UIDS = {"alice": 2001, "bob": 2002, "mallory": 2003}
GRADER_UID = 1000
SANDBOX = {"memory": "3g", "cpus": "1.5", "pids": 128, "uid_base": 30000}


_why = docker_why_not((LEARNER, GRADER))
pytestmark = pytest.mark.skipif(_why is not None, reason=_why or "")


def run(*args: str, ok: bool = True, stdin: bytes | None = None, timeout: float = 900):
    proc = subprocess.run(list(args), capture_output=True, input=stdin, timeout=timeout)
    out = proc.stdout.decode(errors="replace") + proc.stderr.decode(errors="replace")
    if ok:
        assert proc.returncode == 0, f"{' '.join(args[:12])}...: exit {proc.returncode}\n{out[-4000:]}"
    return proc.returncode, out


class Session:
    """A learner's server: a container of the learner image as the learner's own uid, the
    learner's home folder on /home/jovyan/work, the class's exchange, no network."""

    def __init__(self, name: str, home: Path, exchange: Path, passwd: str):
        self.name, self.home = name, home
        self.container = f"minivllm-test-{name}-{os.getpid()}"
        uid = UIDS[name]
        # nbgrader names a submission after the uid's account (pwd.getpwuid): the learner's
        # own entry, as a hub whose learners are accounts of the host gives it (the host's
        # /etc/passwd mounted read-only)
        entries = home.parent / f"{name}.passwd"
        entries.write_text(passwd + f"{name}:x:{uid}:{uid}:{name}:/home/jovyan/work:/bin/bash\n")
        run("docker", "run", "-d", "--rm", "--name", self.container, "--network", "none",
            "--user", f"{uid}:{uid}", "-e", "HOME=/home/jovyan/work",
            "-v", f"{entries}:/etc/passwd:ro",
            "-v", f"{home}:/home/jovyan/work", "-v", f"{exchange}:{EXCHANGE}",
            LEARNER, "sleep", "infinity")

    def sh(self, command: str, ok: bool = True, user: str | None = None):
        return run("docker", "exec", *(["-u", user] if user else []), "-w", "/home/jovyan/work",
                   self.container, "sh", "-c", command, ok=ok)

    def close(self):
        subprocess.run(["docker", "rm", "-f", self.container], capture_output=True)


def grader(course: Path, exchange: Path, *cmd: str, workdir: str = C) -> str:
    """A command in the grader image as docker/README.md's $G runs it."""
    return run("docker", "run", "--rm", "--network", "none", "-v", f"{course}:/srv/course",
               "-v", f"{exchange}:{EXCHANGE}", "-w", workdir, GRADER, *cmd)[1]


def _fill(course: Path, notebook: Path, fixture: str, extra: dict[str, str] | None = None):
    """The fixture's code in the fetched notebook's solution cells, as a learner types it
    (``extra``: code put before a cell's own)."""
    import nbformat

    from grading import fixtures
    from grading.grade import lab_cells

    fx = fixtures.load(LAB).FIXTURES[fixture]
    solutions, _ = lab_cells(nbformat.read(course / COURSE_ID / "source" / LAB / f"{LAB}_lab.ipynb", 4))
    nb = nbformat.read(notebook, as_version=4)
    for cell in nb.cells:
        meta = cell.metadata.get("nbgrader", {})
        if meta.get("solution"):
            gid = meta["grade_id"]
            edit = fx.edits.get(gid)
            code = solutions[gid] if fx.base == "solution" else cell.source
            code = (edit(code) if callable(edit) else edit) if edit else code
            cell.source = (extra or {}).get(gid, "") + code
    nbformat.write(nb, notebook)


# mallory's attacks, put before the solution of task 1 (decode): each one recorded, none
# may stop the cell; the solution after them scores
ATTACKS = r'''
import errno as _e, glob as _g, json as _j, os as _o, socket as _s, subprocess as _sp, sys as _sy, time as _t
_r = {"uid": _o.getuid()}
def _try(name, f):
    try:
        _r[name] = "ok: " + str(f())[:300]
    except BaseException as ex:  # noqa
        _r[name] = f"{type(ex).__name__} errno={getattr(ex, 'errno', None)}"
_try("socket", lambda: _s.create_connection(("1.1.1.1", 53), timeout=5))
_try("dns", lambda: _s.getaddrinfo("pypi.org", 443))
_try("gradebook_write", lambda: open("/srv/course/minivllm-precision/gradebook.db", "ab"))
_try("other_submission_write", lambda: open("/srv/course/minivllm-precision/submitted/alice/ch03/ch03_lab.ipynb", "w"))
_try("course_source_read", lambda: open("/srv/course/minivllm-precision/source/ch03/ch03_lab.ipynb").read())
_try("labs_source_list", lambda: _o.listdir("/opt/minivllm/labs/source"))
_try("exchange_inbound_list", lambda: _o.listdir("/srv/nbgrader/exchange/minivllm-precision/inbound"))
_try("exchange_write", lambda: open("/srv/nbgrader/exchange/mallory-was-here", "w"))
_try("image_write", lambda: open("/opt/minivllm/grading/checks.py", "a"))
_try("executor_memory", lambda: open(f"/proc/{_o.getppid()}/mem", "rb").read(1))
_try("executor_fds", lambda: _o.listdir(f"/proc/{_o.getppid()}/fd"))
_try("notebooks_on_disk", lambda: _g.glob("/tmp/**/*.ipynb", recursive=True))
_try("hidden_tests_on_disk", lambda: _sp.run(["grep", "-rlI", "BEGIN HIDDEN", "/tmp", "/home", "/srv"], capture_output=True, text=True).stdout.split())
_cg = lambda p: open(p).read().strip()
_try("memory_limit", lambda: _cg("/sys/fs/cgroup/memory/memory.limit_in_bytes"))
_try("cpu_quota", lambda: _cg("/sys/fs/cgroup/cpu/cpu.cfs_quota_us") + "/" + _cg("/sys/fs/cgroup/cpu/cpu.cfs_period_us"))
_try("pids_max", lambda: _cg("/sys/fs/cgroup/pids/pids.max"))
_kids = []
def _forks():
    try:
        while len(_kids) < 100000:
            pid = _o.fork()
            if pid == 0:
                _t.sleep(120)
                _o._exit(0)
            _kids.append(pid)
    except OSError as ex:
        return f"fork failed after {len(_kids)} children: errno={ex.errno}"
    return f"forked {len(_kids)} children"
_try("fork_bomb", _forks)
for _k in _kids:
    _o.kill(_k, 9)
for _k in _kids:
    _o.waitpid(_k, 0)
_try("memory_20gb_child", lambda: _sp.run([_sy.executable, "-c", "b = bytearray(20 << 30)"]).returncode)
print("ATTACKS " + _j.dumps(_r))
'''
# before task 3's solution (kv_quantize): 20 GB in the kernel itself
BOMB = "_bomb = bytearray(20 << 30)\n"


def _secret_lines() -> list[str]:
    """Lines only the labs' solution and hidden-test blocks have: every line of every
    lab's blocks, long enough to be distinctive (30 characters), that is not also in the
    same labs outside those blocks (the released part) nor in a file a learner is given
    (the engine, its kernels, the chapters, grading/checks.py)."""
    block = re.compile(r"### BEGIN (SOLUTION|HIDDEN TESTS)\n(.*?)### END \1", re.S)
    sources = [p.read_text() for p in (ROOT / "labs" / "source").glob("ch*/*_lab.py")]
    given = "\n".join(p.read_text(errors="replace")
                      for d in ("minivllm", "minivllm_kernels", "course")
                      for p in (ROOT / d).rglob("*") if p.is_file() and p.suffix in (".py", ".md"))
    given += (ROOT / "grading" / "checks.py").read_text()
    given += "\n".join(block.sub("", text) for text in sources)
    lines = set()
    for text in sources:
        for m in block.finditer(text):
            for line in m.group(2).splitlines():
                line = line.strip()
                if len(line) >= 30 and not line.startswith("#") and line not in given:
                    lines.add(line)
    return sorted(lines)


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture()
def classroom(tmp_path):
    course, exchange = tmp_path / "course", tmp_path / "exchange"
    course.mkdir()
    exchange.mkdir()
    os.chown(course, GRADER_UID, GRADER_UID)
    exchange.chmod(0o777)  # the images' exchange: open to every user, as nbgrader needs
    sessions = {}
    passwd = run("docker", "run", "--rm", "--network", "none", LEARNER, "cat", "/etc/passwd")[1]
    for name, uid in UIDS.items():
        home = tmp_path / "home" / name
        home.mkdir(parents=True)
        os.chown(home, uid, uid)
        home.chmod(0o700)
        sessions[name] = Session(name, home, exchange, passwd)
    try:
        yield course, exchange, sessions
    finally:
        for s in sessions.values():
            s.close()
        # files the containers wrote belong to their uids; the test runs as root or with
        # rights over tmp_path (pytest removes it later)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give host folders to the "
                    "containers' uids (chown)")
def test_learner_image_round_trip_sandboxed_grading_and_integrity(classroom):
    course, exchange, s = classroom
    times, t_all = {}, time.perf_counter()

    # the instructor: the course root, then the lab released to the exchange (docker/README.md)
    t0 = time.perf_counter()
    grader(course, exchange, "python", "-m", "grading.grade", "--prepare-only",
           "--course-root", C, LAB, workdir="/opt/minivllm")
    grader(course, exchange, "nbgrader", "release_assignment", LAB)
    times["prepare and release"] = time.perf_counter() - t0

    # the learners: fetch, fill in, submit (the Assignment List's calls, as commands)
    t0 = time.perf_counter()
    for name in UIDS:
        s[name].sh(f"nbgrader fetch_assignment {LAB}")
        nb = s[name].home / LAB / f"{LAB}_lab.ipynb"
        text = nb.read_text()
        assert "BEGIN SOLUTION" not in text and "BEGIN HIDDEN TESTS" not in text
    _fill(course, s["alice"].home / LAB / f"{LAB}_lab.ipynb", "solution")
    _fill(course, s["bob"].home / LAB / f"{LAB}_lab.ipynb", "truncate")
    _fill(course, s["mallory"].home / LAB / f"{LAB}_lab.ipynb", "solution",
          extra={"decode": ATTACKS, "kv_quantize": BOMB})
    for name in UIDS:
        s[name].sh(f"nbgrader submit {LAB}")
    times["fetch and submit, 3 learners"] = time.perf_counter() - t0

    # --- integrity: one learner against another's submission in the exchange
    inbound = exchange / COURSE_ID / "inbound"
    alice_sub = next(p for p in inbound.iterdir() if p.name.startswith("alice+"))  # as root
    attempts = {}
    rc, out = s["bob"].sh(f"ls {INBOUND}", ok=False)
    attempts["bob lists inbound"] = out.strip()
    assert rc != 0 and "Permission denied" in out, out
    rc, out = s["bob"].sh(f"cat {INBOUND}/alice+*/{LAB}_lab.ipynb", ok=False)
    attempts["bob reads alice+*"] = out.strip()
    assert rc != 0 and "No such file" in out, out
    named = f"'{INBOUND}/{alice_sub.name}'"  # the name has spaces (its timestamp)
    rc, out = s["bob"].sh(f"echo copied > {named}/{LAB}_lab.ipynb", ok=False)
    attempts["bob overwrites alice's notebook in place (name given)"] = out.strip()
    assert rc != 0 and "Permission denied" in out, out
    # What keeps a submission from the others is its name: a timestamp to the microsecond
    # and 9 random bytes, which only nbgrader's record in the submitter's own home holds.
    # Given the name, nbgrader's permissions (the submission's folder 0777 "so the
    # instructor can delete", its files 0644) let another uid read it and replace its
    # files, and anyone can put a folder named after another learner into inbound
    # (`nbgrader collect` only warns "cheating attempt?"): docker/README.md says so. Shown
    # here on a copy, so that alice's submission stays hers.
    spare = inbound / (alice_sub.name + "x")
    shutil.copytree(alice_sub, spare)
    for f in spare.iterdir():
        os.chown(f, UIDS["alice"], UIDS["alice"])
    os.chown(spare, UIDS["alice"], UIDS["alice"])
    spare.chmod(0o777)
    rc, out = s["bob"].sh(f"head -c 1 '{INBOUND}/{spare.name}/{LAB}_lab.ipynb' && "
                          f"rm -f '{INBOUND}/{spare.name}/{LAB}_lab.ipynb' && "
                          f"echo replaced > '{INBOUND}/{spare.name}/{LAB}_lab.ipynb'", ok=False)
    attempts["given the exact name: bob reads, deletes and replaces the file"] = f"exit {rc}"
    assert rc == 0 and (spare / f"{LAB}_lab.ipynb").stat().st_uid == UIDS["bob"], out
    shutil.rmtree(spare)
    assert alice_sub.name.count("+") == 3 and len(alice_sub.name.rsplit("+", 1)[1]) == 12
    before = {p: _sha(p) for p in alice_sub.rglob("*") if p.is_file()}

    # --- integrity: what the learner image holds
    rc, out = s["bob"].sh("ls /opt/minivllm/labs/source /opt/minivllm/grading/fixtures "
                          "/opt/minivllm/grading/records /opt/minivllm/tests", ok=False)
    attempts["bob lists labs/source, fixtures, records, tests"] = out.strip()
    assert rc != 0 and out.count("No such file") == 4, out
    _, out = s["bob"].sh("python -c \"import grading, os; "
                         "print(sorted(os.listdir(os.path.dirname(grading.__file__))))\"")
    attempts["import grading: its folder"] = out.strip()
    assert out.strip() == "['__init__.py', 'checks.py']", out
    _, out = s["bob"].sh("ls /opt/minivllm /opt/minivllm/labs | tr '\\n' ' '")
    attempts["/opt/minivllm"] = out.strip()
    assert "ch03" in out and "source" not in out
    secrets_ = _secret_lines()
    assert len(secrets_) > 300, len(secrets_)  # every lab's solutions and hidden tests
    t0 = time.perf_counter()
    # a few such lines are generic Python that third-party packages also have (e.g.
    # "if isinstance(dtype, torch.dtype):" in torch): found in /opt/venv, where no file of
    # this repository is (minivllm is installed in editable mode), they are dropped
    rc, out = run("docker", "run", "--rm", "-i", "--network", "none", "-u", "0", LEARNER,
                  "grep", "-rhoIF", "-f", "/dev/stdin", "/opt/venv",
                  stdin="\n".join(secrets_).encode(), ok=False)
    generic = set(out.splitlines()) & set(secrets_)
    assert rc in (0, 1) and len(generic) < 10, generic
    patterns = "\n".join(x for x in secrets_ if x not in generic).encode()
    # the whole image, as root (what it contains, not only what uid 2002 may read)
    rc, out = run("docker", "run", "--rm", "-i", "--network", "none", "-u", "0", LEARNER,
                  "grep", "-rlIF", "-f", "/dev/stdin", "/", "--exclude-dir=proc",
                  "--exclude-dir=sys", "--exclude-dir=dev", stdin=patterns, ok=False)
    attempts[f"grep / for {len(secrets_) - len(generic)} solution and hidden-test lines "
             f"({len(generic)} generic ones found in third-party packages dropped)"] = \
        f"exit {rc} {out.strip()}"
    assert rc == 1 and not out.strip(), out  # 1: no line found anywhere
    rc, out = run("docker", "run", "--rm", "--network", "none", "-u", "0", LEARNER,
                  "grep", "-rlIE", "BEGIN (SOLUTION|HIDDEN TESTS)", "/", "--exclude-dir=proc",
                  "--exclude-dir=sys", "--exclude-dir=dev", ok=False)
    markers = [p for p in out.split() if p.startswith("/")]
    # nbgrader's own code and its JupyterLab extension name the markers, and so does the
    # README's prose on how labs are written (the package's METADATA); nothing else may
    others = [p for p in markers if not re.match(
        r"/opt/venv/(lib/python3\.\d+/site-packages/(nbgrader/|minivllm-[\d.]+\.dist-info/METADATA$)"
        r"|share/jupyter/(labextensions|nbextensions)/)", p)]
    attempts["files with a BEGIN SOLUTION/HIDDEN TESTS marker, nbgrader's own aside"] = others
    assert markers and not others, others
    times["image greps"] = time.perf_counter() - t0

    # --- the instructor: collect, sandboxed autograde, feedback
    grader(course, exchange, "nbgrader", "collect", LAB)
    sub = course / COURSE_ID / "submitted"
    others_before = {p: _sha(p) for n in ("alice", "bob") for p in (sub / n).rglob("*") if p.is_file()}
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, str(ROOT / "docker" / "grade_sandbox.py"), LAB,
         "--course", str(course), "--grader-image", GRADER, "--sandbox-image", LEARNER,
         "--memory", SANDBOX["memory"], "--cpus", SANDBOX["cpus"],
         "--pids-limit", str(SANDBOX["pids"]), "--uid-base", str(SANDBOX["uid_base"])],
        capture_output=True, text=True, timeout=1800)
    times["grade_sandbox.py, 3 submissions"] = time.perf_counter() - t0
    out = proc.stdout
    print(proc.stderr[-3000:] + out)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(out.strip().splitlines()[-1])["students"]
    scores = {n: (r["score"], r["max_score"]) for n, r in report.items()}
    assert scores == {"alice": (17.0, 17.0), "bob": (3.0, 17.0), "mallory": (7.0, 17.0)}, out
    assert {r["uid"] for r in report.values()} == {30000, 30001, 30002}, report
    assert all(r["uid"] not in (GRADER_UID, *UIDS.values()) for r in report.values())
    assert {p: _sha(p) for p in others_before} == others_before  # graded, never changed
    assert {p: _sha(p) for p in before} == before

    # mallory's attacks, as her notebook printed them inside the sandbox
    import nbformat

    graded = nbformat.read(course / COURSE_ID / "autograded" / "mallory" / LAB / f"{LAB}_lab.ipynb", 4)
    text = "".join(o.get("text", "") for c in graded.cells if c.cell_type == "code"
                   for o in c.outputs if o.get("output_type") == "stream")
    got = json.loads(re.search(r"ATTACKS (\{.*\})", text).group(1))
    print("\nmallory's attacks in the sandbox:\n" + json.dumps(got, indent=1))
    assert got["uid"] == SANDBOX["uid_base"] + 2
    assert got["socket"] == "OSError errno=101", got  # ENETUNREACH: no interface but lo
    assert got["dns"].startswith("gaierror"), got
    for key in ("gradebook_write", "other_submission_write", "course_source_read",
                "labs_source_list", "exchange_inbound_list"):
        assert got[key] == "FileNotFoundError errno=2", (key, got[key])  # not in the sandbox
    assert got["exchange_write"] == "OSError errno=30", got  # EROFS: read-only
    assert got["image_write"] in ("OSError errno=30", "PermissionError errno=13"), got
    assert got["executor_memory"] == "PermissionError errno=13", got  # non-dumpable executor
    assert got["executor_fds"] == "PermissionError errno=13", got
    assert got["notebooks_on_disk"] == "ok: []" and got["hidden_tests_on_disk"] == "ok: []", got
    assert got["memory_limit"] == f"ok: {3 << 30}", got
    assert got["cpu_quota"] == "ok: 150000/100000", got
    assert got["pids_max"] == f"ok: {SANDBOX['pids']}", got
    forks = re.fullmatch(r"ok: fork failed after (\d+) children: errno=11", got["fork_bomb"])
    assert forks and int(forks.group(1)) < SANDBOX["pids"], got["fork_bomb"]
    assert got["memory_20gb_child"] == "ok: -9", got  # SIGKILL: the OOM killer at 3 GB
    died = [o for c in graded.cells for o in c.get("outputs", [])
            if o.get("output_type") == "error" and o.get("ename") == "SandboxKernelDied"]
    assert len(died) == 1, "the 20 GB cell's kernel was killed"

    # feedback: generated and released; each learner fetches their own
    t0 = time.perf_counter()
    grader(course, exchange, "nbgrader", "generate_feedback", LAB)
    grader(course, exchange, "nbgrader", "release_feedback", LAB)
    for name, score in (("alice", "17"), ("bob", "3")):
        s[name].sh(f"nbgrader fetch_feedback {LAB}")
        (html,) = (s[name].home / LAB / "feedback").glob("*/*.html")
        assert re.search(rf"Score: {score}(\.0)? / 17(\.0)?", html.read_text()), html.read_text()[:2000]
    times["feedback"] = time.perf_counter() - t0
    rc, out = s["bob"].sh(f"ls {EXCHANGE}/{COURSE_ID}/feedback", ok=False)
    attempts["bob lists the released feedback"] = f"exit {rc} {out.strip()}"
    times["total"] = time.perf_counter() - t_all
    print(json.dumps({"scores": scores, "sandbox": {n: {k: r[k] for k in ("uid", "seconds", "sandbox")}
                                                    for n, r in report.items()},
                      "attempts": attempts, "seconds": {k: round(v, 1) for k, v in times.items()}},
                     indent=1))


def test_learner_image_start_gives_any_uid_the_course_link_and_a_writable_cache(tmp_path):
    """The learner image's entrypoint (docker/learner-start.sh), as a hub runs it: a uid of
    the learner's own with their (empty, or an older image's) folder on /home/jovyan/work.
    The course is the link minivllm-course (an older image's link `minivllm`, which shadowed
    the package there, is gone, and `from minivllm import LLM` works in that folder); the
    model cache is in the folder, its models the image's converted model (readable: the
    conversion writes 0644 under umask 022), and a quantized checkpoint builds in it (the
    image's /opt/minivllm-cache is root's, read-only for learners). A read-only sandbox as
    grade_sandbox.py runs one (HOME=/tmp) still starts and finds the model."""
    home = tmp_path / "home"
    home.mkdir()
    home.chmod(0o777)  # the hubs chown the learner's volume to them; any uid may write here
    (home / "minivllm").symlink_to("/opt/minivllm")  # an older image's link, in a kept volume
    t0 = time.perf_counter()
    probe = (
        'echo "cache=$MINIVLLM_CACHE"; echo "models=$(readlink "$MINIVLLM_CACHE/models")"; '
        'ls -A; stat -c "mode=%a" /opt/minivllm-cache/models/*/model.safetensors; '
        'touch /opt/minivllm-cache/probe 2>/dev/null && echo shared-cache-writable; '
        'python -c "from minivllm import LLM; import minivllm; print(\'pkg=\' + minivllm.__file__)"; '
        'python -m minivllm.quantization.checkpoint int8 2>&1 | tail -1')
    out = run("docker", "run", "--rm", "--network", "none", "--user", "2004:2004",
              "-e", "HOME=/home/jovyan/work", "-v", f"{home}:/home/jovyan/work", LEARNER,
              "sh", "-c", probe)[1]
    lines = out.splitlines()
    cache = "/home/jovyan/work/.cache/minivllm"
    assert f"cache={cache}" in lines and "models=/opt/minivllm-cache/models" in lines, out
    assert "minivllm-course" in lines and "minivllm" not in lines, out
    assert (home / "minivllm-course").readlink() == Path("/opt/minivllm")
    assert "mode=644" in lines and "shared-cache-writable" not in lines, out
    assert "pkg=/opt/minivllm/minivllm/__init__.py" in lines, out
    built = [p for p in (home / ".cache/minivllm/quantized").rglob("model.safetensors")]
    assert len(built) == 1 and built[0].stat().st_uid == 2004, (built, out)
    out = run("docker", "run", "--rm", "--network", "none", "--read-only",
              "--tmpfs", "/tmp:rw,mode=1777", "--user", "30001:30001", "-e", "HOME=/tmp",
              LEARNER, "python", "-c",
              "import os; from minivllm.models.embedded import is_converted; "
              "print(os.environ['MINIVLLM_CACHE'], is_converted())")[1]
    assert out.split()[-2:] == ["/tmp/.cache/minivllm", "True"], out
    print(f"\n[learner image start] uid 2004: link, cache, int8 checkpoint built; read-only "
          f"sandbox starts: {time.perf_counter() - t0:.0f} s")
