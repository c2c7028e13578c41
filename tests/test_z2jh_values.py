"""The class on Kubernetes: docker/z2jh/values.yaml for the zero-to-jupyterhub chart.

No helm binary and no cluster run where this suite runs, so nothing is rendered or
deployed. What is checked:

- the schema: the chart's default values (docker/z2jh/chart-defaults.json) merged with
  values.yaml as helm merges them, validated against the chart's own values.schema.json
  (both vendored from z2jh 4.4.0, docker/z2jh/README.md), the check `helm install` makes
  before rendering; plus the one rule the chart's templates add (extraFiles `data` needs a
  .json/.yaml/.yml/.toml file name);
- the course's contract: the lab image, limits with guarantee <= limit, the idle culler,
  nbgrader's exchange mounted where docker/nbgrader_config.py puts it (from a claim in
  docker/z2jh/pvcs.yaml that is ReadWriteMany), the working directory of
  docker/jupyterhub_config.py, an authenticator other than dummy, TLS;
- the roles: the hub.extraConfig hook run on stand-in spawners (learner, instructor by
  group, admin), and the files it points servers at, read by this environment's
  jupyter_server, jupyterlab_server and nbgrader (the learner's server has no Formgrader,
  the instructor's Formgrader finds the course root under the server's root);
- that the checks catch breakage: mutated copies of the values (a misspelled key the
  schema rejects, a guarantee above its limit, ...) fail.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import jsonschema
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
Z2JH = ROOT / "docker" / "z2jh"
VALUES = Z2JH / "values.yaml"
SCHEMA = Z2JH / "values.schema.json"
DEFAULTS = Z2JH / "chart-defaults.json"
PVCS = Z2JH / "pvcs.yaml"
CHART_VERSION = "4.4.0"
LAB_IMAGE = "minivllm-lab"  # the placeholder's last path component: registry.example.edu/minivllm-lab
DUMMY = {"dummy", "jupyterhub.auth.DummyAuthenticator", "null", "nullauthenticator"}


def helm_merge(defaults, values):
    """The chart's defaults overlaid with a values file as helm coalesces them: maps merge
    key by key, anything else (lists included) replaces, and a null removes the key."""
    out = copy.deepcopy(defaults)
    for key, value in values.items():
        if value is None:
            out.pop(key, None)
        elif isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = helm_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def load_values() -> dict:
    return yaml.safe_load(VALUES.read_text())


def exchange_root() -> str:
    """Exchange.root as docker/nbgrader_config.py (the images' /etc/jupyter copy) sets it."""
    from traitlets.config.loader import PyFileConfigLoader

    cfg = PyFileConfigLoader("nbgrader_config.py", str(ROOT / "docker")).load_config()
    return cfg.Exchange.root


def dockerspawner_notebook_dir() -> str:
    text = (ROOT / "docker" / "jupyterhub_config.py").read_text()
    return re.search(r'^notebook_dir = "([^"]+)"', text, re.M).group(1)


def bytes_of(spec) -> float:
    """KubeSpawner's memory spec (a number of bytes, or K/M/G/T, powers of 1024)."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([KMGT]?)", str(spec))
    assert m, f"memory {spec!r}: KubeSpawner takes a number with K, M, G or T"
    return float(m.group(1)) * 1024 ** "_KMGT".index(m.group(2) or "_")


def schema_problems(values: dict) -> list[str]:
    schema = json.loads(SCHEMA.read_text())
    merged = helm_merge(json.loads(DEFAULTS.read_text()), values)
    validator = jsonschema.Draft7Validator(schema)
    problems = [f"schema: {'.'.join(map(str, e.absolute_path)) or '(top)'}: {e.message}"
                for e in validator.iter_errors(merged)]
    for key, f in (values.get("singleuser", {}).get("extraFiles") or {}).items():
        if "data" in f and not re.search(r"\.(json|ya?ml|toml)$", f.get("mountPath", "")):
            problems.append(f"chart: extraFiles.{key} has data but no .json/.yaml/.toml name")
    return problems


def contract_problems(values: dict) -> list[str]:
    """What the course needs of the values, beyond the chart's schema."""
    p = []
    su = values.get("singleuser", {})
    hub_config = values.get("hub", {}).get("config", {})

    image = su.get("image", {})
    if not str(image.get("name", "")).endswith("/" + LAB_IMAGE):
        p.append(f"singleuser.image.name {image.get('name')!r} is not the lab image <registry>/{LAB_IMAGE}")
    if not image.get("tag") or image.get("tag") == "latest":
        p.append("singleuser.image.tag must be set (a pushed tag, not latest)")
    if su.get("cmd") != "jupyterhub-singleuser":  # docker/jupyterhub_config.py: not `make lab`
        p.append("singleuser.cmd must be jupyterhub-singleuser")

    cpu, mem = su.get("cpu") or {}, su.get("memory") or {}
    if not (cpu.get("limit") and cpu.get("guarantee")):
        p.append("singleuser.cpu: guarantee and limit must be set")
    elif float(cpu["guarantee"]) > float(cpu["limit"]):
        p.append("singleuser.cpu: guarantee above limit")
    elif not 2 <= float(cpu["limit"]) <= 4:
        p.append("singleuser.cpu.limit: a chapter needs about 2 cores")
    if not (mem.get("limit") and mem.get("guarantee")):
        p.append("singleuser.memory: guarantee and limit must be set")
    elif bytes_of(mem["guarantee"]) > bytes_of(mem["limit"]):
        p.append("singleuser.memory: guarantee above limit")
    elif bytes_of(mem["limit"]) < 4 * 1024**3:
        p.append("singleuser.memory.limit: a chapter needs up to about 4 GB")

    cull = values.get("cull", {})
    if not cull.get("enabled"):
        p.append("cull.enabled must be true")
    elif not (0 < cull.get("every", 0) <= cull.get("timeout", 0)):
        p.append("cull: every and timeout must be set, every <= timeout")

    storage = su.get("storage", {})
    root = exchange_root()
    mounts = [m for m in storage.get("extraVolumeMounts") or [] if m.get("mountPath") == root]
    claims = {v["name"]: v.get("persistentVolumeClaim", {}).get("claimName")
              for v in storage.get("extraVolumes") or []}
    pvcs = {d["metadata"]["name"]: d for d in yaml.safe_load_all(PVCS.read_text()) if d}
    if not mounts:
        p.append(f"no extraVolumeMount at the exchange {root} (docker/nbgrader_config.py)")
    for m in mounts:
        claim = claims.get(m["name"])
        if claim is None:
            p.append(f"exchange mount {m['name']!r} has no persistentVolumeClaim volume")
        elif "ReadWriteMany" not in pvcs.get(claim, {}).get("spec", {}).get("accessModes", []):
            p.append(f"exchange claim {claim!r} is not a ReadWriteMany claim of docker/z2jh/pvcs.yaml")
        if m.get("readOnly"):
            p.append("the exchange must be writable (learners submit into it)")

    work = dockerspawner_notebook_dir()
    spawner = hub_config.get("KubeSpawner", {})
    if spawner.get("working_dir") != work or spawner.get("notebook_dir") != work:
        p.append(f"hub.config.KubeSpawner.working_dir and notebook_dir must be {work} "
                 "(nbgrader resolves assignment_dir '.' against the working directory)")
    if storage.get("homeMountPath") != work:
        p.append(f"singleuser.storage.homeMountPath must be {work} (the learner's volume)")

    auth = hub_config.get("JupyterHub", {}).get("authenticator_class")
    if not auth or auth in DUMMY:
        p.append(f"hub.config.JupyterHub.authenticator_class {auth!r}: a real authenticator")
    if auth == "generic-oauth":
        oauth = hub_config.get("GenericOAuthenticator", {})
        for key in ("client_id", "oauth_callback_url", "authorize_url", "token_url", "userdata_url"):
            if not oauth.get(key):
                p.append(f"hub.config.GenericOAuthenticator.{key} is missing")
    if not hub_config.get("Authenticator", {}).get("admin_users"):
        p.append("hub.config.Authenticator.admin_users: name the instructor")

    https = values.get("proxy", {}).get("https", {})
    if not (https.get("enabled") and https.get("type") == "letsencrypt" and https.get("hosts")
            and https.get("letsencrypt", {}).get("contactEmail")):
        p.append("proxy.https: letsencrypt with hosts and contactEmail")
    if "minivllm-roles" not in values.get("hub", {}).get("extraConfig", {}):
        p.append("hub.extraConfig.minivllm-roles (learners without the Formgrader) is missing")

    # the instructor image: named to the hook (hub.extraEnv) and pulled onto every node
    instructor = str(values.get("hub", {}).get("extraEnv", {}).get("MINIVLLM_INSTRUCTOR_IMAGE", ""))
    pulled = [f"{i['name']}:{i['tag']}" for i in
              ((values.get("prePuller") or {}).get("extraImages") or {}).values()]
    if not instructor.rpartition(":")[0].endswith("/" + LAB_IMAGE + "-instructor"):
        p.append(f"hub.extraEnv.MINIVLLM_INSTRUCTOR_IMAGE {instructor!r} is not "
                 f"<registry>/{LAB_IMAGE}-instructor:<tag>")
    elif instructor not in pulled:
        p.append(f"prePuller.extraImages does not pull the instructor image {instructor}")
    # no fsGroup: the kubelet would give the shared exchange to each starting learner's group
    if su.get("fsGid", "unset") is not None:
        p.append("singleuser.fsGid must be null (the hook's init container owns the home)")
    # the learner image's entrypoint makes the link minivllm-course; a link named minivllm in
    # the home folder would shadow the package there
    if re.search(r"/home/jovyan/work/minivllm\b(?!-)", json.dumps(su.get("lifecycleHooks") or {})):
        p.append("singleuser.lifecycleHooks: a link named minivllm in the home shadows the package")
    return p


def test_chart_version_pinned_in_values_docs_and_provenance():
    for path in (VALUES, Z2JH / "README.md", ROOT / "docker" / "README.md"):
        assert f"--version {CHART_VERSION}" in path.read_text() or \
            f"version {CHART_VERSION}" in path.read_text(), path
    assert "5c5f5df751588a68a7781ead01d0f62e88e2e72f" in (Z2JH / "README.md").read_text()
    assert "BSD-3-Clause" in (Z2JH / "README.md").read_text()


def test_schema_is_strict_and_accepts_the_chart_defaults():
    """The vendored schema is the chart's (additionalProperties false at the levels this file
    uses, so a misspelled key fails), and the chart's own defaults pass it."""
    schema = json.loads(SCHEMA.read_text())
    props = schema["properties"]
    for level in (schema, props["singleuser"], props["singleuser"]["properties"]["storage"],
                  props["cull"], props["proxy"]["properties"]["https"], props["hub"]):
        assert level["additionalProperties"] is False
    assert schema_problems({}) == []


def test_values_pass_the_chart_schema():
    assert schema_problems(load_values()) == []


def test_values_meet_the_course_contract():
    assert contract_problems(load_values()) == []


def _set(values: dict, dotted: str, value) -> None:
    *parents, last = dotted.split(".")
    for key in parents:
        values = values[key]
    values[last] = value


def _rename(values: dict, dotted: str, new_key: str) -> None:
    *parents, last = dotted.split(".")
    for key in parents:
        values = values[key]
    values[new_key] = values.pop(last)


MUTATIONS = {
    # a misspelled key: the chart would ignore it, the schema rejects it
    "misspelled extraVolumeMounts": (lambda v: _rename(v, "singleuser.storage.extraVolumeMounts",
                                                       "extraVolumeMount"), "schema"),
    "misspelled cull.timeout": (lambda v: _rename(v, "cull.timeout", "timout"), "schema"),
    "top-level typo": (lambda v: _rename(v, "singleuser", "singleUser"), "schema"),
    "letsencrypt type misspelled": (lambda v: _set(v, "proxy.https.type", "letsencrpyt"), "schema"),
    "cpu limit as text": (lambda v: _set(v, "singleuser.cpu.limit", "two"), "schema"),
    "extraFiles data without a file type": (
        lambda v: _set(v, "singleuser.extraFiles.learner-page-config.mountPath",
                       "/etc/minivllm/learner/labconfig/page_config"), "chart"),
    "memory guarantee above limit": (lambda v: _set(v, "singleuser.memory.guarantee", "8G"),
                                     "guarantee above limit"),
    "culler off": (lambda v: _set(v, "cull.enabled", False), "cull.enabled"),
    "exchange mounted elsewhere": (
        lambda v: _set(v, "singleuser.storage.extraVolumeMounts",
                       [{"name": "nbgrader-exchange", "mountPath": "/srv/exchange"}]), "exchange"),
    "working dir dropped": (lambda v: v["hub"]["config"].pop("KubeSpawner"), "working_dir"),
    "dummy authenticator": (lambda v: _set(v, "hub.config.JupyterHub.authenticator_class",
                                           "dummy"), "authenticator"),
    "sample image": (lambda v: _set(v, "singleuser.image.name",
                                    "quay.io/jupyterhub/k8s-singleuser-sample"), "lab image"),
    "instructors on the learner image": (
        lambda v: _set(v, "hub.extraEnv.MINIVLLM_INSTRUCTOR_IMAGE",
                       "registry.example.edu/minivllm-lab:2026.1"), "minivllm-lab-instructor"),
    "instructor image not pre-pulled": (
        lambda v: _set(v, "prePuller.extraImages.minivllm-instructor.tag", "other"), "prePuller"),
    "fsGroup back": (lambda v: _set(v, "singleuser.fsGid", 100), "fsGid"),
    "the old link": (lambda v: _set(v, "singleuser.lifecycleHooks", {"postStart": {"exec": {
        "command": ["sh", "-c", "ln -sfn /opt/minivllm /home/jovyan/work/minivllm"]}}}),
        "shadows the package"),
}


@pytest.mark.parametrize("name", MUTATIONS)
def test_a_broken_copy_fails(name):
    mutate, expected = MUTATIONS[name]
    values = load_values()
    mutate(values)
    # what helm refuses first; the course's checks assume values of the schema's types
    problems = schema_problems(values) or contract_problems(values)
    assert any(expected in problem for problem in problems), (name, problems)


# --- the roles: the hook of hub.extraConfig, and the files it points servers at ---------------

HOME_TEMPLATE = "volume-{username}{servername}"  # the chart's volumeNameTemplate


def _spawner(admin: bool, groups: list[str], as_lists: bool, shared_env: dict, uid: int = 7,
             name: str = "learner@example.edu"):
    """A stand-in KubeSpawner as the chart configures it: the home volume (its name a template
    KubeSpawner expands), the exchange from extraVolumes, the chart's own init container
    (a V1Container object in a list, or a dict entry)."""
    values = load_values()
    storage = values["singleuser"]["storage"]
    exchange_mount = storage["extraVolumeMounts"][0]
    volumes = {"home": {"name": HOME_TEMPLATE, "persistentVolumeClaim": {"claimName": "claim-x"}},
               "exchange": storage["extraVolumes"][0]}
    mounts = {"home": {"name": HOME_TEMPLATE, "mountPath": "/home/jovyan/work"},
              "exchange": exchange_mount}
    block = {"name": "block-cloud-metadata", "image": "network-tools"}
    init = {"block": block}
    if as_lists:
        volumes, mounts = list(volumes.values()), list(mounts.values())
        init = [SimpleNamespace(**block)]  # the chart appends a kubernetes V1Container
    return SimpleNamespace(
        user=SimpleNamespace(admin=admin, groups=[SimpleNamespace(name=g) for g in groups],
                             id=uid, name=name),
        environment=shared_env, volumes=volumes, volume_mounts=mounts, init_containers=init,
        image=_images(values)[0], uid=values["singleuser"]["uid"], gid=None, fs_gid=100,
        log=logging.getLogger("stand-in-spawner"))


def _images(values: dict) -> tuple[str, str]:
    """(learner, instructor) images as the chart and hub.extraEnv name them."""
    image = values["singleuser"]["image"]
    return f"{image['name']}:{image['tag']}", values["hub"]["extraEnv"]["MINIVLLM_INSTRUCTOR_IMAGE"]


def _hook(values: dict, monkeypatch):
    # the chart's jupyterhub_config.py sets KubeSpawner.image from singleuser.image, and the
    # hub's environment from hub.extraEnv, before it runs extraConfig
    c = SimpleNamespace(KubeSpawner=SimpleNamespace(image=_images(values)[0]))
    for k, v in values["hub"]["extraEnv"].items():
        monkeypatch.setenv(k, v)
    exec(values["hub"]["extraConfig"]["minivllm-roles"], {"c": c})
    return c.KubeSpawner.pre_spawn_hook


def _as_list(x):
    return list(x.values()) if isinstance(x, dict) else list(x)


def _after(spawner):
    return spawner.environment, _as_list(spawner.volumes), _as_list(spawner.volume_mounts)


def _names(items) -> list[str]:
    return sorted(v["name"] if isinstance(v, dict) else v.name for v in _as_list(items))


def _prepare(spawner) -> dict:
    """The hook's init container."""
    found = [v for v in _as_list(spawner.init_containers)
             if isinstance(v, dict) and v["name"] == "minivllm-prepare"]
    assert len(found) == 1, spawner.init_containers
    return found[0]


@pytest.mark.parametrize("as_lists", [False, True])
def test_roles_hook(as_lists, monkeypatch):
    values = load_values()
    hook = _hook(values, monkeypatch)
    learner_image, instructor_image = _images(values)
    files = values["singleuser"]["extraFiles"]
    course_root = re.search(r'CourseDirectory\.root = "([^"]+)"',
                            files["instructor-nbgrader-config"]["stringData"]).group(1)
    work = dockerspawner_notebook_dir()
    pvcs = {d["metadata"]["name"]: d for d in yaml.safe_load_all(PVCS.read_text()) if d}
    shared_env = {"JUPYTER_CONFIG_PATH": "/etc/minivllm/learner", "X": "1"}
    learner_volumes = sorted([HOME_TEMPLATE, "nbgrader-exchange", "minivllm-ids"])

    def check_learner(spawner):
        env, vols, mounts = _after(spawner)
        assert env["JUPYTER_CONFIG_PATH"] == "/etc/minivllm/learner" and env["X"] == "1"
        assert env["MINIVLLM_CACHE"].startswith(work + "/")  # a cache the learner may write
        assert _names(vols) == learner_volumes and len(mounts) == 4  # home, exchange, passwd, group
        assert spawner.image == learner_image
        assert spawner.uid == spawner.gid == 10000 + spawner.user.id and spawner.fs_gid is None
        assert _names(spawner.init_containers) == ["block-cloud-metadata", "minivllm-prepare"]

    learner = _spawner(False, ["students"], as_lists, shared_env)
    hook(learner)
    check_learner(learner)

    for admin, groups in ((False, ["instructors"]), (True, [])):
        spawner = _spawner(admin, groups, as_lists, shared_env)
        for _start in range(2):  # the spawner is reused: a second start adds nothing
            hook(spawner)
        env, vols, mounts = _after(spawner)
        assert env["JUPYTER_CONFIG_PATH"] == "/etc/minivllm/instructor"
        assert "MINIVLLM_CACHE" not in env  # the instructor image's own cache, theirs
        assert spawner.image == instructor_image and spawner.uid == spawner.gid == 1000
        course = [m for m in mounts if m["name"] == "minivllm-course"]
        assert len(course) == 1 and _names(vols) == sorted(learner_volumes + ["minivllm-course"])
        assert _names(spawner.init_containers) == ["block-cloud-metadata", "minivllm-prepare"]
        claim = [v for v in vols if v["name"] == "minivllm-course"][0]["persistentVolumeClaim"]
        assert claim["claimName"] in pvcs
        # the Formgrader needs the course root under the server's root
        assert course_root.startswith(course[0]["mountPath"] + "/")
        assert course[0]["mountPath"].startswith(work + "/")
        # removed from the instructors: the next start is a learner's, without the course
        spawner.user.admin, spawner.user.groups = False, []
        hook(spawner)
        check_learner(spawner)
    assert shared_env == {"JUPYTER_CONFIG_PATH": "/etc/minivllm/learner", "X": "1"}, \
        "the hook must not change the configured (shared) environment"
    for path in ("/etc/minivllm/learner", "/etc/minivllm/instructor"):
        assert any(f["mountPath"].startswith(path + "/") for f in files.values())


def test_hook_gives_each_learner_a_uid_of_their_own(monkeypatch):
    """Learners' pods run as distinct uids, never root's 0 or the grader's 1000 (the
    exchange's course folder is the grader's: with its uid a learner would list every
    submission), stable from start to start; instructors run as the grader, 1000, with the
    instructor image; the init container gets the pod's image and ids."""
    values = load_values()
    hook = _hook(values, monkeypatch)
    learner_image, instructor_image = _images(values)
    assert learner_image != instructor_image
    uids = {}
    for hub_id in (1, 2, 3, 17, 999, 1000, 1001, 5000):  # hub database ids
        spawner = _spawner(False, [], hub_id % 2 == 0, {}, uid=hub_id, name=f"u{hub_id}")
        hook(spawner)
        first = spawner.uid
        hook(spawner)  # the next start: the same uid
        assert spawner.uid == first == spawner.gid and spawner.fs_gid is None
        assert spawner.image == learner_image and _prepare(spawner)["image"] == learner_image
        uids[hub_id] = spawner.uid
        script = _prepare(spawner)["command"][-1]
        assert f"jovyan:x:{first}:{first}:" in script and f"chown -R {first}:{first}" in script
    assert len(set(uids.values())) == len(uids), uids
    assert not {0, 1000} & set(uids.values()), uids
    assert min(uids.values()) > 1000
    for admin, groups in ((True, []), (False, ["instructors"])):
        spawner = _spawner(admin, groups, False, {}, uid=4)
        hook(spawner)
        assert spawner.image == instructor_image == _prepare(spawner)["image"]
        assert spawner.uid == spawner.gid == 1000


def test_hook_strings_survive_kubespawners_expansion(monkeypatch):
    """KubeSpawner formats every string of volumes, mounts, init containers and the
    environment with the user's name (str.format with username, servername, ...): a brace in
    the init container's shell script would raise or change it."""
    values = load_values()
    hook = _hook(values, monkeypatch)
    for admin in (False, True):
        spawner = _spawner(admin, [], False, {"JUPYTER_CONFIG_PATH": "x"})
        hook(spawner)
        ns = {"username": "alice-40example-2eedu", "servername": "", "user_server": "alice",
              "unescaped_username": "alice@example.edu", "userid": 7}

        def expand(x):
            if isinstance(x, dict):
                return {k: expand(v) for k, v in x.items()}
            if isinstance(x, list):
                return [expand(v) for v in x]
            return x.format(**ns) if isinstance(x, str) else x

        ours = [_prepare(spawner), spawner.environment,
                *[v for v in _as_list(spawner.volumes) if v["name"].startswith("minivllm")],
                *[m for m in _as_list(spawner.volume_mounts) if m["name"].startswith("minivllm")]]
        for item in ours:  # unchanged, but for the home volume's name, the template's
            assert json.dumps(expand(item)) == \
                json.dumps(item).replace(HOME_TEMPLATE, "volume-alice-40example-2eedu")
        assert _prepare(spawner)["volumeMounts"][0]["name"] == HOME_TEMPLATE


def test_init_container_in_the_learner_image(tmp_path, monkeypatch):
    """The hook's init container run as Kubernetes would run it, in the learner image (a
    Docker engine and minivllm/lab-cpu needed, else skipped): the home becomes the learner's
    (0700), the exchange 1777 with the course folder the grader's, and the server, as the
    learner's uid with the passwd and group written, is jovyan to nbgrader, so submissions
    carry the hub user's name (JUPYTERHUB_USER)."""
    image = os.environ.get("MINIVLLM_LEARNER_IMAGE", "minivllm/lab-cpu")
    if not shutil.which("docker") or \
            subprocess.run(["docker", "image", "inspect", image], capture_output=True).returncode:
        pytest.skip(f"needs a Docker engine and the learner image {image} (make classroom-images)")
    if os.geteuid() != 0:
        pytest.skip("needs root to remove the folders the containers give to other uids")
    values = load_values()
    hook = _hook(values, monkeypatch)
    spawner = _spawner(False, [], False, {}, uid=42)
    hook(spawner)
    prep, uid = _prepare(spawner), spawner.uid
    folders = {m["mountPath"]: tmp_path / m["mountPath"].strip("/").replace("/", "_")
               for m in prep["volumeMounts"]}
    for f in folders.values():
        f.mkdir()
    (folders["/srv/nbgrader/exchange"]).chmod(0o755)
    binds = [x for path, f in folders.items() for x in ("-v", f"{f}:{path}")]
    out = subprocess.run(["docker", "run", "--rm", "--network", "none", "--user", "0:0",
                          "--entrypoint", prep["command"][0], *binds, image, *prep["command"][1:]],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    home, exchange = folders["/home/jovyan/work"], folders["/srv/nbgrader/exchange"]
    assert (home.stat().st_uid, home.stat().st_mode & 0o777) == (uid, 0o700)
    assert exchange.stat().st_mode & 0o7777 == 0o1777
    course = exchange / "minivllm-precision"
    assert (course.stat().st_uid, course.stat().st_mode & 0o777) == (1000, 0o755)
    ids = folders["/minivllm-ids"]
    probe = ("import os, pwd; from nbgrader.utils import get_username; "
             "print(pwd.getpwuid(os.getuid()).pw_name, os.path.expanduser('~'), get_username())")
    out = subprocess.run(["docker", "run", "--rm", "--network", "none", "--user", f"{uid}:{uid}",
                          "-e", "JUPYTERHUB_USER=alice@example.edu", "-e", "HOME=/home/jovyan/work",
                          "-v", f"{ids / 'passwd'}:/etc/passwd:ro", "-v", f"{ids / 'group'}:/etc/group:ro",
                          "-v", f"{home}:/home/jovyan/work", image, "python", "-c", probe],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["jovyan", "/home/jovyan/work", "alice@example.edu"], out.stdout
    assert (home / "minivllm-course").is_symlink()  # the image's entrypoint, as that uid


def _write_extra_files(values: dict, root: Path) -> None:
    """singleuser.extraFiles as the chart writes them (data as JSON for .json names), under
    ``root`` instead of /; the image's course path replaced by this checkout's."""
    for f in values["singleuser"]["extraFiles"].values():
        path = root / f["mountPath"].lstrip("/")
        path.parent.mkdir(parents=True, exist_ok=True)
        if "data" in f:
            assert path.suffix == ".json"
            path.write_text(json.dumps(f["data"]))
        else:
            path.write_text(f["stringData"].replace("/opt/minivllm/", f"{ROOT}/"))


PROBE = textwrap.dedent("""
    import json, os
    from jupyter_core.paths import jupyter_path
    from jupyter_server.serverapp import ServerApp
    from jupyterlab_server.config import get_page_config
    from nbgrader.apps import NbGrader

    # as ExtensionApp.initialize_server (jupyterhub-singleuser) makes the server: its own
    # extension passed in, then the configuration files, then the extensions found
    app = ServerApp.instance(jpserver_extensions={"jupyterhub": True})
    app.parse_command_line([])
    app.load_config_file()
    app.find_server_extensions()
    disabled = get_page_config(jupyter_path("labextensions"))["disabledExtensions"]
    if isinstance(disabled, dict):
        disabled = [k for k, v in disabled.items() if v]
    nb = NbGrader()
    nb.load_config_file()
    print(json.dumps({"ext": dict(app.jpserver_extensions), "disabled": sorted(disabled),
                      "course_root": nb.config.CourseDirectory.get("root"),
                      "course_id": nb.config.CourseDirectory.get("course_id"),
                      "cache": nb.config.Exchange.get("cache")}))
""")


def _probe(tmp_path: Path, config_path: Path) -> dict:
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    env = {**os.environ, "HOME": str(home), "JUPYTER_CONFIG_DIR": str(home / ".jupyter"),
           "JUPYTER_CONFIG_PATH": str(config_path)}
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, cwd=home, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_role_files_as_the_servers_read_them(tmp_path):
    """The learner's files turn the Formgrader off (server and lab extensions) and keep the
    Assignment List and jupyterhub-singleuser's own extension; the instructor's give nbgrader
    the course root and keep the Formgrader."""
    pytest.importorskip("nbgrader")
    pytest.importorskip("jupyterlab_server")
    values = load_values()
    _write_extra_files(values, tmp_path)
    learner = _probe(tmp_path, tmp_path / "etc/minivllm/learner")
    ext = learner["ext"]
    assert ext.get("jupyterhub") is True
    assert ext.get("nbgrader.server_extensions.formgrader") is False
    assert ext.get("nbgrader.server_extensions.course_list") is False
    assert ext.get("nbgrader.server_extensions.assignment_list") is True
    assert ext.get("nbgrader.server_extensions.validate_assignment") is True
    assert {"@jupyter/nbgrader:formgrader", "@jupyter/nbgrader:create-assignment"} <= \
        set(learner["disabled"])
    assert "@jupyter/nbgrader:assignment-list" not in learner["disabled"]
    assert learner["course_root"] is None
    assert learner["cache"].startswith(dockerspawner_notebook_dir() + "/")

    instructor = _probe(tmp_path, tmp_path / "etc/minivllm/instructor")
    assert instructor["ext"].get("nbgrader.server_extensions.formgrader") is True
    assert instructor["disabled"] == [] or "@jupyter/nbgrader:formgrader" not in instructor["disabled"]
    assert instructor["course_root"] == "/home/jovyan/work/course/minivllm-precision"
    assert instructor["course_id"] == "minivllm-precision"


def test_a_plain_server_config_json_would_drop_jupyterhub_singleuser(tmp_path):
    """Why the learner's server settings live in jupyter_server_config.d/: the same settings
    in jupyter_server_config.json replace the whole jpserver_extensions dict."""
    pytest.importorskip("nbgrader")
    pytest.importorskip("jupyterlab_server")
    values = load_values()
    f = values["singleuser"]["extraFiles"]["learner-server-config"]
    assert "/jupyter_server_config.d/" in f["mountPath"]
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "jupyter_server_config.json").write_text(json.dumps(f["data"]))
    ext = _probe(tmp_path, plain)["ext"]
    assert "jupyterhub" not in ext and ext.get("nbgrader.server_extensions.formgrader") is False


ASSIGNMENT_LIST_PROBE = textwrap.dedent("""
    import json, os, sys
    from nbgrader.exchange import ExchangeFactory
    from nbgrader.server_extensions.assignment_list.handlers import AssignmentList

    lister = AssignmentList()
    lister.root_dir = sys.argv[1]  # the server's root (notebook_dir)
    with lister.get_assignment_dir_config() as config:  # as the Assignment List's handlers do
        ex = ExchangeFactory(config=config).List(config=config)
        print(json.dumps({"exchange": config.Exchange.get("root"),
                          "assignment_dir": os.path.abspath(ex.assignment_dir)}))
""")


def test_the_working_directory_decides_the_assignment_lists_exchange(tmp_path):
    """nbgrader 0.9's Assignment List reads its configuration again in Exchange.assignment_dir
    ('.': the server process's working directory, not its root). In the server's root (what
    values.yaml sets) it finds the images' exchange; in the lab image's WORKDIR, the
    repository (/opt/minivllm, here this checkout), it reads the repository's
    nbgrader_config.py, the one-machine class, and lists build/exchange instead of the
    shared exchange, fetching into build/labs."""
    pytest.importorskip("nbgrader")
    work, home = tmp_path / "work", tmp_path / "home"
    work.mkdir()
    home.mkdir()
    # docker/ stands for the image's /etc/jupyter (docker/nbgrader_config.py is copied there)
    env = {**os.environ, "HOME": str(home), "JUPYTER_CONFIG_DIR": str(home / ".jupyter"),
           "JUPYTER_CONFIG_PATH": str(ROOT / "docker")}

    def listing(cwd: Path) -> dict:
        out = subprocess.run([sys.executable, "-c", ASSIGNMENT_LIST_PROBE, str(work)], env=env,
                             cwd=cwd, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr[-3000:]
        return json.loads(out.stdout.strip().splitlines()[-1])

    in_root = listing(work)
    assert in_root == {"exchange": exchange_root(), "assignment_dir": str(work)}
    in_repo = listing(ROOT)
    assert in_repo["exchange"] == str(ROOT / "build" / "exchange") != exchange_root()
    assert in_repo["assignment_dir"] == str(ROOT / "build" / "labs")
