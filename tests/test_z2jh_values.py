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
import os
import re
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

def _spawner(admin: bool, groups: list[str], as_lists: bool, shared_env: dict):
    volumes = {"home": {"name": "home"}}
    mounts = {"home": {"name": "home", "mountPath": "/home/jovyan/work"}}
    if as_lists:
        volumes, mounts = list(volumes.values()), list(mounts.values())
    return SimpleNamespace(
        user=SimpleNamespace(admin=admin, groups=[SimpleNamespace(name=g) for g in groups]),
        environment=shared_env, volumes=volumes, volume_mounts=mounts)


def _hook(values: dict):
    c = SimpleNamespace(KubeSpawner=SimpleNamespace())
    exec(values["hub"]["extraConfig"]["minivllm-roles"], {"c": c})
    return c.KubeSpawner.pre_spawn_hook


def _after(spawner):
    as_list = (lambda x: list(x.values()) if isinstance(x, dict) else x)
    return spawner.environment, as_list(spawner.volumes), as_list(spawner.volume_mounts)


@pytest.mark.parametrize("as_lists", [False, True])
def test_roles_hook(as_lists):
    values = load_values()
    hook = _hook(values)
    files = values["singleuser"]["extraFiles"]
    course_root = re.search(r'CourseDirectory\.root = "([^"]+)"',
                            files["instructor-nbgrader-config"]["stringData"]).group(1)
    work = dockerspawner_notebook_dir()
    pvcs = {d["metadata"]["name"]: d for d in yaml.safe_load_all(PVCS.read_text()) if d}
    shared_env = {"JUPYTER_CONFIG_PATH": "/etc/minivllm/learner", "X": "1"}

    learner = _spawner(False, ["students"], as_lists, shared_env)
    hook(learner)
    env, vols, mounts = _after(learner)
    assert env["JUPYTER_CONFIG_PATH"] == "/etc/minivllm/learner" and env["X"] == "1"
    assert [v["name"] for v in vols] == ["home"] and len(mounts) == 1

    for admin, groups in ((False, ["instructors"]), (True, [])):
        spawner = _spawner(admin, groups, as_lists, shared_env)
        for _start in range(2):  # the spawner is reused: a second start adds nothing
            hook(spawner)
        env, vols, mounts = _after(spawner)
        assert env["JUPYTER_CONFIG_PATH"] == "/etc/minivllm/instructor"
        course = [m for m in mounts if m["name"] == "minivllm-course"]
        assert len(course) == 1 and sorted(v["name"] for v in vols) == ["home", "minivllm-course"]
        claim = [v for v in vols if v["name"] == "minivllm-course"][0]["persistentVolumeClaim"]
        assert claim["claimName"] in pvcs
        # the Formgrader needs the course root under the server's root
        assert course_root.startswith(course[0]["mountPath"] + "/")
        assert course[0]["mountPath"].startswith(work + "/")
        # removed from the instructors: the next start is a learner's, without the course
        spawner.user.admin, spawner.user.groups = False, []
        hook(spawner)
        env, vols, mounts = _after(spawner)
        assert env["JUPYTER_CONFIG_PATH"] == "/etc/minivllm/learner"
        assert [v["name"] for v in vols] == ["home"] and len(mounts) == 1
    assert shared_env == {"JUPYTER_CONFIG_PATH": "/etc/minivllm/learner", "X": "1"}, \
        "the hook must not change the configured (shared) environment"
    for path in ("/etc/minivllm/learner", "/etc/minivllm/instructor"):
        assert any(f["mountPath"].startswith(path + "/") for f in files.values())


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
