"""The Docker images and the one install script.

No Docker engine runs where this suite runs, so the images are not built here. What is
checked: hadolint passes on every Dockerfile; the images, the Makefile and CI all install
through scripts/install.sh (so the steps CI exercises are the steps the images take);
the script parses and answers --help; compose.yaml and the JupyterHub config refer to
files, volumes and paths that exist and agree with each other.
"""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DOCKER = ROOT / "docker"
INSTALL = ROOT / "scripts" / "install.sh"
DOCKERFILES = sorted(DOCKER.glob("*.Dockerfile"))
EXCHANGE = "/srv/nbgrader/exchange"


def _hadolint() -> str:
    exe = Path(sys.executable).with_name("hadolint")
    found = str(exe) if exe.exists() else shutil.which("hadolint")
    assert found, "hadolint not found: it comes with the dev extra (pip install -e '.[dev]')"
    return found


def _instructions(dockerfile: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", "\n".join(
        line for line in dockerfile.read_text().splitlines() if not line.lstrip().startswith("#")))
    return [(m.group(1).upper(), m.group(2)) for m in
            (re.match(r"\s*([A-Za-z]+)\s+(.*)", line) for line in text.splitlines()) if m]


def test_there_are_three_images():
    assert {p.name for p in DOCKERFILES} >= {
        "lab-cpu.Dockerfile", "lab-cuda.Dockerfile", "grader.Dockerfile"}


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_hadolint_clean(dockerfile):
    proc = subprocess.run([_hadolint(), "--no-color", str(dockerfile)],
                          capture_output=True, text=True)
    assert proc.returncode == 0, f"hadolint {dockerfile.name}:\n{proc.stdout}{proc.stderr}"


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_images_install_with_the_script(dockerfile):
    runs = [args for ins, args in _instructions(dockerfile) if ins == "RUN"]
    assert any("scripts/install.sh" in r and "--model" in r for r in runs), (
        f"{dockerfile.name} must install with scripts/install.sh --model (model converted "
        "at build time)")
    bypass = [r for r in runs if re.search(r"\bpip3? install\b|-m pip\b", r)]
    assert not bypass, f"{dockerfile.name} installs Python packages outside install.sh: {bypass}"


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_copied_files_exist(dockerfile):
    for ins, args in _instructions(dockerfile):
        if ins != "COPY" or "--from" in args:
            continue
        sources = [a for a in args.split() if not a.startswith("--")][:-1]
        for src in sources:
            assert (ROOT / src).exists(), f"{dockerfile.name}: COPY {src}: no such file"


def test_makefile_and_ci_install_with_the_script():
    make = (ROOT / "Makefile").read_text()
    recipe = re.search(r"^\$\(VENV\)/\.installed:.*\n((?:\t.*\n)+)", make, re.M)
    assert recipe and "scripts/install.sh" in recipe.group(1), recipe
    recipes = [ln for ln in make.splitlines() if ln.startswith("\t")]
    assert not [ln for ln in recipes if "pip install" in ln], "install through install.sh"
    ci = (ROOT / ".ci" / "run").read_text()
    assert re.search(r"^scripts/install\.sh .*--system-browser", ci, re.M), ci
    assert "pip install" not in ci
    assert re.search(r"^make test\b", ci, re.M) and re.search(r"^make lint-docker\b", ci, re.M)


def test_install_script_parses_and_helps():
    assert subprocess.run(["bash", "-n", str(INSTALL)]).returncode == 0
    out = subprocess.run([str(INSTALL), "--help"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    for opt in ("--torch", "--torch-index", "--extras", "--model", "--system-browser"):
        assert opt in out.stdout
    bad = subprocess.run([str(INSTALL), "--no-such-option"], capture_output=True, text=True)
    assert bad.returncode == 2 and "unknown option" in bad.stderr


def test_dockerignore_keeps_what_the_images_need():
    ignored = [ln.strip() for ln in (ROOT / ".dockerignore").read_text().splitlines()
               if ln.strip() and not ln.startswith("#")]
    for heavy in (".git", ".venv", "build", "reports"):
        assert heavy in ignored
    for needed in ("scripts", "docker", "minivllm", "pyproject.toml", "Makefile"):
        assert needed not in ignored


def _compose_cli() -> list[str] | None:
    """`docker compose` (the plugin) or a standalone Compose v2 `docker-compose`, if any."""
    for cmd in (["docker", "compose"], ["docker-compose"]):
        if shutil.which(cmd[0]):
            out = subprocess.run([*cmd, "version"], capture_output=True, text=True)
            if out.returncode == 0 and re.search(r"\bv?2\.", out.stdout):
                return cmd
    return None


def test_compose_file():
    path = DOCKER / "compose.yaml"
    cli = _compose_cli()
    if cli:  # Compose's own validation (offline); the checks below run either way
        proc = subprocess.run([*cli, "-f", str(path), "config", "-q"],
                              capture_output=True, text=True)
        # stderr too: some wrappers of the binary exit 0 on a validation error
        assert proc.returncode == 0 and not proc.stderr.strip(), proc.stderr
    spec = yaml.safe_load(path.read_text())
    services = spec["services"]
    assert {"lab", "grader"} <= set(services)
    declared = spec.get("volumes") or {}
    for name, svc in services.items():
        context = (path.parent / svc["build"]["context"]).resolve()
        assert context == ROOT, f"{name}: build context {context} is not the repository root"
        assert (context / svc["build"]["dockerfile"]).is_file(), name
        for vol in svc.get("volumes", []):
            source, target = vol.split(":")[:2]
            assert source in declared, f"{name}: volume {source} is not declared"
        mounts = [v.split(":")[1] for v in svc.get("volumes", [])]
        assert EXCHANGE in mounts, f"{name} does not mount nbgrader's exchange"
    assert services["grader"].get("network_mode") == "none"


def test_exchange_agrees_everywhere():
    """compose, the JupyterHub config and the images' nbgrader config use one exchange."""
    nbconf = (DOCKER / "nbgrader_config.py").read_text()
    assert f'c.Exchange.root = "{EXCHANGE}"' in nbconf
    hub = (DOCKER / "jupyterhub_config.py").read_text()
    ast.parse(hub)
    compose = yaml.safe_load((DOCKER / "compose.yaml").read_text())
    exchange_volume = compose["volumes"]["exchange"]["name"]
    assert f'"{exchange_volume}": "{EXCHANGE}"' in hub
    for dockerfile in DOCKERFILES:
        assert EXCHANGE in dockerfile.read_text(), dockerfile.name
