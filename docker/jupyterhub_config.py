"""JupyterHub for a class: one lab container per learner (DockerSpawner, the lab image).

    jupyterhub -f docker/jupyterhub_config.py        # on the Docker host, as root

What this file assumes (change it where yours differs):

- JupyterHub runs on the Docker host itself, not in a container, in an environment with
  `pip install -e ".[hub-docker]"` (jupyterhub, dockerspawner) and `npm install -g configurable-http-proxy`, as a
  user who may use the Docker socket. Learner containers reach the hub at the address of
  the default bridge, docker0 (HUB_CONNECT_IP, default 172.17.0.1); the hub's API listens
  there only.
- The lab image is built and tagged: `minivllm/lab-cpu:latest` (MINIVLLM_LAB_IMAGE picks
  another, e.g. `minivllm/lab-cuda:latest` with MINIVLLM_HUB_GPUS=1 and the NVIDIA
  Container Toolkit on the host). The image has jupyterhub-singleuser (the `hub` extra);
  the hub here should have the same major version of JupyterHub.
- Learners log in with the hub's default authenticator (PAM: Unix accounts of the host).
  MINIVLLM_HUB_USERS and MINIVLLM_HUB_ADMINS are comma-separated user names; nobody else
  may log in. Put TLS in front of the hub (or set c.JupyterHub.ssl_key/ssl_cert).
- Each learner has a Docker volume `minivllm-user-<name>` as their home folder
  (/home/jovyan/work, the server's root, working directory and HOME); a link
  `minivllm-course` in it points at the course in the image (/opt/minivllm: chapters,
  released labs), and their model cache is there (.cache/minivllm, SERVER_CMD below). Edits
  to the chapters live in the container and go when the server stops; labs fetched with
  nbgrader's Assignment List, and anything else under work/, stay.
- Each learner's container runs as a uid of its own: the uid and gid of the learner's Unix
  account on the host (PAM's users), else (no such account, or it has uid 0 or the
  grader's 1000) MINIVLLM_HUB_UID_BASE (10000) + the user's id in the hub's database. Before each start a short root container of the image makes the
  home volume theirs (chown, mode 0700), and the container gets an /etc/passwd and
  /etc/group (written under MINIVLLM_HUB_DIR, default /srv/minivllm, mounted read-only)
  in which the image's account `jovyan` has that uid: nbgrader then names submissions by
  hub user (JUPYTERHUB_USER), and the exchange's modes keep one learner out of another's
  submissions. So the learner image must run as any uid (docker/lab-cpu.Dockerfile's
  learner stage does).
- nbgrader's exchange is the Docker volume `minivllm-exchange`, the one docker/compose.yaml
  and the grader use: the instructor releases, collects and autogrades with the grader
  image on that volume (docker/README.md). Before each start its root is made mode 1777
  (nobody renames another's folder) and its course folder, if missing, is made for the
  grader's uid 1000 (no learner takes the name before the first release).
- Learners' servers have no Formgrader, course list or Create Assignment: a learner
  configuration (MINIVLLM_HUB_DIR/etc/learner, mounted read-only, JUPYTER_CONFIG_PATH)
  switches them off; the instructor works with the grader image.
- The exchange's inbound folder is writable by every learner (that is how a submission
  gets there), so bob can write a folder named alice+ch01+<timestamp>; nbgrader's collect
  only warns ("cheating attempt?", and in the grader's container, where learners' uids
  have no names, it warns for every submission) and takes it. MINIVLLM_HUB_DIR/etc/grader
  holds an nbgrader configuration for the grader's container (docs/instructor.md mounts
  it) whose collect takes a learner's submission only from a folder of that learner's
  uid (uids.json there: each learner's, written at each start).
- Each server gets at most MINIVLLM_HUB_CPUS cores (2) and MINIVLLM_HUB_MEM memory (6G):
  a chapter runs the embedded model and its float32 reference side by side.
"""

import asyncio
import json
import os
import pwd
from pathlib import Path

c = get_config()  # noqa: F821  (provided by traitlets)


def _names(var: str) -> set[str]:
    return {n.strip() for n in os.environ.get(var, "").split(",") if n.strip()}


# The hub: the proxy on port 8000 of every interface; the hub's API on docker0 only.
c.JupyterHub.bind_url = "http://:8000"
c.JupyterHub.hub_ip = os.environ.get("HUB_CONNECT_IP", "172.17.0.1")
c.JupyterHub.hub_connect_ip = c.JupyterHub.hub_ip

c.Authenticator.allowed_users = _names("MINIVLLM_HUB_USERS")
c.Authenticator.admin_users = _names("MINIVLLM_HUB_ADMINS")

# One lab container per learner.
c.JupyterHub.spawner_class = "dockerspawner.DockerSpawner"
c.DockerSpawner.image = os.environ.get("MINIVLLM_LAB_IMAGE", "minivllm/lab-cpu:latest")
# The server (not the image's CMD): first, as the learner, a link `minivllm-course` to the
# course in the image (chapters, released labs), in place of a link `minivllm` (the image
# makes one in /home/jovyan/work: in that folder, `import minivllm` found the link, the
# repository's root, and `from minivllm import LLM` failed in a notebook saved there),
# and the learner's model cache (MINIVLLM_CACHE in their volume, its `models` a link to the
# image's converted model: the quantized checkpoints that chapters 15-17, 28 and 30 and
# labs 17 and 28 build on first use need a cache they may write); then
# jupyterhub-singleuser with the hub's arguments.
SERVER_CMD = (
    'w=/home/jovyan/work; [ "$(readlink $w/minivllm)" = /opt/minivllm ] && rm -f $w/minivllm; '
    'ln -sfn /opt/minivllm $w/minivllm-course; '
    'mkdir -p "$MINIVLLM_CACHE" && ln -sfn /opt/minivllm-cache/models "$MINIVLLM_CACHE/models"; '
    'exec jupyterhub-singleuser "$@"')
c.DockerSpawner.cmd = ["sh", "-c", SERVER_CMD, "jupyterhub-singleuser"]
c.DockerSpawner.remove = True  # a fresh container from the image at each start
notebook_dir = "/home/jovyan/work"
c.DockerSpawner.notebook_dir = notebook_dir
# ...and the server's working directory, not the image's WORKDIR (/opt/minivllm):
# nbgrader's Assignment List resolves assignment_dir "." and reads nbgrader_config.py in
# the working directory, where the repository's one-machine configuration would send
# every learner to /opt/minivllm/build/exchange ("Unwritable directory").
# tests/test_classroom_hub.py runs a class on this file (the learner image, per-user uids).
c.DockerSpawner.extra_create_kwargs = {"working_dir": notebook_dir}
c.DockerSpawner.volumes = {
    "minivllm-user-{username}": notebook_dir,
    "minivllm-exchange": "/srv/nbgrader/exchange",
}
c.DockerSpawner.environment = {"HOME": notebook_dir,
                               "MINIVLLM_CACHE": f"{notebook_dir}/.cache/minivllm",
                               # the learner configuration (below): no instructor tools
                               "JUPYTER_CONFIG_PATH": "/etc/minivllm/learner"}
c.DockerSpawner.cpu_limit = float(os.environ.get("MINIVLLM_HUB_CPUS", "2"))
c.DockerSpawner.mem_limit = os.environ.get("MINIVLLM_HUB_MEM", "6G")
c.Spawner.start_timeout = 120  # pulling or starting a ~3 GB image

if os.environ.get("MINIVLLM_HUB_GPUS") == "1":
    import docker

    c.DockerSpawner.extra_host_config = {
        "device_requests": [docker.types.DeviceRequest(count=-1, capabilities=[["gpu"]])]}

# Per-user uids (see the docstring): each start, the learner's uid, home volume, passwd
# entry and the exchange's modes.
HUB_DIR = Path(os.environ.get("MINIVLLM_HUB_DIR", "/srv/minivllm"))
UID_BASE = int(os.environ.get("MINIVLLM_HUB_UID_BASE", "10000"))
EXCHANGE = "/srv/nbgrader/exchange"
COURSE_ID = "minivllm-precision"
GRADER_UID = 1000  # jovyan of the grader image: it releases and collects
LEARNER_CONFIG = {  # file under etc/learner: its text
    # A terminal runs bash, not `bash -l`, Jupyter's choice under a spawner: a login shell
    # reads /etc/profile, whose PATH drops /opt/venv/bin (python without the engine).
    "jupyter_server_config.py":
        "c = get_config()  # noqa: F821\n"
        "c.ServerApp.terminado_settings = {'shell_command': ['/bin/bash']}\n",
    # merged per extension, as `jupyter server extension disable` writes them
    "jupyter_server_config.d/minivllm-learner.json":
        '{"ServerApp": {"jpserver_extensions": {\n'
        '  "nbgrader.server_extensions.formgrader": false,\n'
        '  "nbgrader.server_extensions.course_list": false}}}\n',
    "labconfig/page_config.json":
        '{"disabledExtensions": {\n  "@jupyter/nbgrader:formgrader": true,\n'
        '  "@jupyter/nbgrader:create-assignment": true,\n'
        '  "@jupyter/nbgrader:course-list": true}}\n',
}


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.parent.chmod(0o755)
    path.write_text(text)
    path.chmod(0o644)


def _uid_gid(user) -> tuple[int, int]:
    """The host account's ids, unless they are root's or the grader's (uid 1000 owns the
    exchange's course folder: a learner with it would list every submission)."""
    try:
        pw = pwd.getpwnam(user.name)
        if pw.pw_uid not in (0, GRADER_UID) and pw.pw_gid not in (0, GRADER_UID):
            return pw.pw_uid, pw.pw_gid
    except KeyError:
        pass
    return UID_BASE + user.id, UID_BASE + user.id


def _root_run(spawner, script: str, volumes: dict) -> str:
    """``script`` in a short container of the lab image as root, no network: its output."""
    import docker

    client = docker.from_env()
    out = client.containers.run(spawner.image, ["sh", "-ec", script], entrypoint=[],
                                user="0:0", network_disabled=True, remove=True,
                                volumes=volumes)
    return out.decode()


def _as_uid(lines: str, name: str, uid: int, gid: int, passwd: bool) -> str:
    """/etc/passwd or /etc/group of the image with jovyan's ids replaced."""
    out = []
    for line in lines.splitlines():
        f = line.split(":")
        if f[0] == name:
            f[2] = str(uid) if passwd else str(gid)
            if passwd:
                f[3], f[5] = str(gid), notebook_dir
        out.append(":".join(f))
    return "\n".join(out) + "\n"


async def minivllm_per_user_uid(spawner) -> None:
    uid, gid = _uid_gid(spawner.user)
    binds = spawner.volume_binds  # {volume or host path: {"bind": path in the container}}
    home = next(v for v, b in binds.items() if b["bind"] == notebook_dir)
    exchange = next(v for v, b in binds.items() if b["bind"] == EXCHANGE)
    course = f"{EXCHANGE}/{COURSE_ID}"
    ids = await asyncio.to_thread(_root_run, spawner, (
        f"chown -R {uid}:{gid} {notebook_dir} && chmod 0700 {notebook_dir}\n"
        f"chmod 1777 {EXCHANGE}\n"
        f"if [ ! -e {course} ]; then mkdir {course} && chown {GRADER_UID}:{GRADER_UID} {course}"
        f" && chmod 0755 {course}; fi\n"
        "cat /etc/passwd; echo ---; cat /etc/group"),
        {home: {"bind": notebook_dir, "mode": "rw"}, exchange: {"bind": EXCHANGE, "mode": "rw"}})
    passwd, group = ids.split("---\n")
    users = HUB_DIR / "users" / spawner.user.name
    _write(users / "passwd", _as_uid(passwd, "jovyan", uid, gid, True))
    _write(users / "group", _as_uid(group, "jovyan", uid, gid, False))
    _record_uid(spawner.user.name, uid)
    spawner.extra_create_kwargs = {**BASE_CREATE_KWARGS, "user": f"{uid}:{gid}"}
    spawner.read_only_volumes = {**BASE_READ_ONLY, str(users / "passwd"): "/etc/passwd",
                                 str(users / "group"): "/etc/group"}
    spawner.log.info("%s runs as uid %d, gid %d", spawner.user.name, uid, gid)


GRADER_NBGRADER = """c = get_config()  # noqa: F821
import json
import os

from nbgrader.exchange.default.collect import ExchangeCollect

UIDS = "/etc/minivllm/grader/uids.json"  # this folder, as docs/instructor.md mounts it


class OwnerCheckedCollect(ExchangeCollect):
    \"""nbgrader's collect, keeping only submissions whose folder is the learner's uid.\"""

    def _owned(self, rec):
        try:
            with open(UIDS) as fh:
                uid = json.load(fh).get(rec["username"])
            return uid == os.stat(os.path.join(self.inbound_path, rec["filename"])).st_uid
        except OSError:
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
# the learners' uids have no names in this container: nbgrader's own check would warn for
# every submission; the class above checks the uid instead
c.ExchangeCollect.check_owner = False
"""


def _record_uid(name: str, uid: int) -> None:
    path = HUB_DIR / "etc" / "grader" / "uids.json"
    uids = json.loads(path.read_text()) if path.is_file() else {}
    if uids.get(name) != uid:
        _write(path, json.dumps({**uids, name: uid}, indent=1, sort_keys=True) + "\n")


def _prepare_hub_dir() -> None:
    for rel, text in LEARNER_CONFIG.items():
        _write(HUB_DIR / "etc" / "learner" / rel, text)
    _write(HUB_DIR / "etc" / "grader" / "nbgrader_config.py", GRADER_NBGRADER)
    (HUB_DIR / "users").mkdir(parents=True, exist_ok=True)
    (HUB_DIR / "users").chmod(0o755)


_prepare_hub_dir()
BASE_CREATE_KWARGS = dict(c.DockerSpawner.extra_create_kwargs)
BASE_READ_ONLY = {str(HUB_DIR / "etc" / "learner"): "/etc/minivllm/learner"}
c.DockerSpawner.read_only_volumes = BASE_READ_ONLY
c.DockerSpawner.pre_spawn_hook = minivllm_per_user_uid
