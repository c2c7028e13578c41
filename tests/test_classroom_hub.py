"""A class on JupyterHub, end to end: the hub of docker/local_hub/jupyterhub_config.py
(LocalProcessSpawner: every learner a Unix account, their server a process of their own
uid) started as an instructor would start it, with two learners and an instructor.

What it runs, through the hub's proxy as each user with their own API token:

- the instructor, in a terminal of their own server (the terminal API: what *File > New >
  Terminal* gives), the commands of docs/instructor.md, section "A hub without Docker":
  prepare, collect, autograde, generate and release feedback (one learner, then all),
  export;
- alice, through the Assignment List's own server endpoints (nbgrader's handlers in her
  server): courses, list, fetch, the notebook written through the contents API as the
  editor saves it, Validate, submit (the wrong fixture "truncate", then the solution: a
  resubmission), fetch feedback;
- bob, in Chromium: log in with his Unix password, open *Nbgrader > Assignment List*,
  Fetch, Submit (his notebook holds "truncate"); a screenshot in reports/classroom/;
- bob's attempts, from a terminal of his server, to read the lab's source, the grading
  fixtures, the course root and alice's home, to list the exchange's inbound folder, to
  change the released lab and to hand in a submission under alice's name; and the
  Formgrader, which a learner's server does not serve.

The second test runs the same class on docker/jupyterhub_config.py (DockerSpawner, the
learner image, each learner's container as the uid of their Unix account): alice through
the Assignment List's endpoints, bob in Chromium as above (the screenshot
hub-docker-assignment-list-bob.png), the instructor with the grader image ($G of
docs/instructor.md), bob's attempts from his container's terminal. It skips, with the
reason, without a Docker engine, the images or dockerspawner; its containers and volumes
are named minivllm-hubtest-* and removed afterwards.

Scores are exact: grading/fixtures/ch03.py's (solution 17, truncate 3). The test creates its
accounts (alice, bob, teacher) and removes them, stops every process it started and puts
the checkout's mode back. It needs root, JupyterHub (the `hub` extra) and
configurable-http-proxy, and runs only when MINIVLLM_CLASSROOM_HUB=1 (`make
classroom-test`): it adds Unix accounts and a group to the machine while it runs. The
learners' Python (docker/local_hub/jupyterhub_config.py builds it) is kept between runs in
$MINIVLLM_HUB_TEST_DIR (default /srv/minivllm-classroom-test): the first run takes a few
minutes longer.
"""

from __future__ import annotations

import asyncio
import csv
import grp
import json
import os
import pwd
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from tests.docker_ready import docker_why_not

ROOT = Path(__file__).resolve().parents[1]
LAB, NOTEBOOK, COURSE_ID = "ch03", "ch03_lab", "minivllm-precision"
LEARNERS, INSTRUCTOR = ("alice", "bob"), "teacher"
USERS = (*LEARNERS, INSTRUCTOR)
GROUP = "minivllm-instructors"
TEST_DIR = Path(os.environ.get("MINIVLLM_HUB_TEST_DIR", "/srv/minivllm-classroom-test"))
CREATED = TEST_DIR / "created-by-test.json"  # accounts and group this test made (a crash's too)
REPORTS = ROOT / "reports" / "classroom"
VENV_BIN = Path(sys.executable).parent
LOCAL_CONFIG = ROOT / "docker" / "local_hub" / "jupyterhub_config.py"

pytestmark = pytest.mark.embedded  # autograde runs the lab's engine


def _why_not() -> str | None:
    if os.environ.get("MINIVLLM_CLASSROOM_HUB") != "1":
        return ("adds Unix accounts (alice, bob, teacher) and a group while it runs: only under "
                "`make classroom-test` (MINIVLLM_CLASSROOM_HUB=1)")
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "needs root (a local-process hub starts each user's server as that user)"
    if not (VENV_BIN / "jupyterhub").exists():
        return f"no jupyterhub in {VENV_BIN} (pip install -e '.[hub]')"
    if shutil.which("configurable-http-proxy") is None:
        return "no configurable-http-proxy (npm install -g configurable-http-proxy)"
    if not shutil.which("useradd"):
        return "no useradd"
    made = json.loads(CREATED.read_text()) if CREATED.is_file() else {}
    for name in USERS:
        try:
            pwd.getpwnam(name)
        except KeyError:
            continue
        if name not in made.get("users", []):
            return f"an account {name!r} exists that this test did not create: it leaves it alone"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _uids(names) -> set[int]:
    out = set()
    for n in names:
        try:
            out.add(pwd.getpwnam(n).pw_uid)
        except KeyError:
            pass
    return out


def _kill_processes_of(names) -> list[int]:
    """Every process of the test's own accounts (their servers, kernels, terminals), by pid."""
    uids, killed = _uids(names), []
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for proc in Path("/proc").iterdir():
            if not proc.name.isdigit():
                continue
            try:
                if proc.stat().st_uid in uids:
                    os.kill(int(proc.name), sig)
                    killed.append(int(proc.name))
            except (FileNotFoundError, ProcessLookupError):
                pass
        time.sleep(0.5 if sig == signal.SIGTERM else 0)
    return sorted(set(killed))


@pytest.fixture(scope="module")
def accounts():
    """alice, bob and teacher as Unix accounts with passwords; removed afterwards, with the
    instructors' group if the hub made it, and the checkout's mode and group put back."""
    why = _why_not()
    if why:
        pytest.skip(why)
    TEST_DIR.mkdir(parents=True, exist_ok=True)
    os.chmod(TEST_DIR, 0o755)
    made = json.loads(CREATED.read_text()) if CREATED.is_file() else {"users": []}
    try:
        grp.getgrnam(GROUP)
    except KeyError:
        made["group"] = GROUP  # the hub will make it: remove it afterwards
    st = ROOT.stat()  # the hub protects the checkout (mode 0750): put it back afterwards
    made.setdefault("checkout", [st.st_uid, st.st_gid, st.st_mode & 0o7777])
    passwords = {}
    for name in USERS:
        try:
            pwd.getpwnam(name)
        except KeyError:
            subprocess.run(["useradd", "-m", "-s", "/bin/bash", name], check=True)
            made["users"] = sorted({*made["users"], name})
        CREATED.write_text(json.dumps(made))
        passwords[name] = secrets.token_urlsafe(12)
        subprocess.run(["chpasswd"], input=f"{name}:{passwords[name]}\n", text=True, check=True)
    try:
        yield passwords
    finally:
        _kill_processes_of(USERS)
        for name in made["users"]:
            subprocess.run(["userdel", "-r", name], capture_output=True)
        if made.get("group"):
            subprocess.run(["groupdel", made["group"]], capture_output=True)
        uid, gid, mode = made["checkout"]
        os.chown(ROOT, uid, gid)
        os.chmod(ROOT, mode)
        CREATED.unlink(missing_ok=True)


class Hub:
    """A running hub: its REST API (as the test's service, an admin) and its users."""

    def __init__(self, url: str, token: str, proc: subprocess.Popen, log: Path, hub_dir: Path):
        import requests

        self.url, self.proc, self.log, self.dir = url, proc, log, hub_dir
        self.http = requests.Session()
        self.http.headers["Authorization"] = f"token {token}"

    def api(self, method: str, path: str, ok=(200, 201, 202, 204), **kw):
        r = self.http.request(method, f"{self.url}/hub/api{path}", timeout=60, **kw)
        assert r.status_code in ok, f"{method} {path}: {r.status_code} {r.text[:500]}"
        return r.json() if r.content else None

    def wait_up(self, timeout: float) -> None:
        import requests

        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if self.proc.poll() is not None:
                pytest.fail(f"the hub exited ({self.proc.returncode}):\n{self.log_tail()}")
            try:
                if requests.get(f"{self.url}/hub/api/", timeout=5).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(1)
        pytest.fail(f"the hub did not answer in {timeout} s:\n{self.log_tail()}")

    def log_tail(self, n: int = 6000) -> str:
        return self.log.read_text(errors="replace")[-n:]

    def server(self, name: str) -> Server:
        """Start ``name``'s server (if not running) and return it with a token of theirs."""
        self.api("POST", f"/users/{name}/server", ok=(201, 202, 400))  # 400: already running
        t0 = time.monotonic()
        while time.monotonic() - t0 < 180:
            model = self.api("GET", f"/users/{name}")
            if (model.get("servers") or {}).get("", {}).get("ready"):
                break
            time.sleep(1)
        else:
            pytest.fail(f"{name}'s server did not start:\n{self.log_tail()}")
        token = self.api("POST", f"/users/{name}/tokens", json={"note": "classroom test"})["token"]
        return Server(self, name, token)


class Server:
    """A user's own server through the hub's proxy, with the user's token."""

    def __init__(self, hub: Hub, name: str, token: str):
        import requests

        self.hub, self.name, self.token = hub, name, token
        self.base = f"{hub.url}/user/{name}/"
        self.http = requests.Session()
        self.http.headers["Authorization"] = f"token {token}"

    def get(self, path: str, **kw):
        return self.http.get(self.base + path, timeout=120, **kw)

    def post(self, path: str, **kw):
        return self.http.post(self.base + path, timeout=900, **kw)

    def json(self, method: str, path: str, **kw):
        r = getattr(self, method)(path, **kw)
        assert r.status_code == 200, f"{self.name}: {method} {path}: {r.status_code} {r.text[:800]}"
        return r.json()

    # nbgrader's Assignment List, as its page calls it
    def assignments(self) -> dict:
        out = self.json("get", "assignments", params={"course_id": COURSE_ID})
        assert out["success"], out
        return {(a["assignment_id"], a["status"]): a for a in out["value"]}

    def action(self, action: str) -> dict:
        out = self.json("post", f"assignments/{action}",
                        data={"course_id": COURSE_ID, "assignment_id": LAB})
        assert out["success"], f"{self.name}: {action}: {out}"
        return out

    def notebook(self, path: str) -> dict:
        return self.json("get", f"api/contents/{path}", params={"content": "1"})

    def save(self, path: str, nb: dict) -> None:
        r = self.http.put(self.base + f"api/contents/{path}", timeout=60,
                          json={"type": "notebook", "format": "json", "content": nb})
        assert r.status_code in (200, 201), r.text[:500]

    def sh(self, command: str, timeout: float = 900) -> tuple[int, str]:
        """``command`` typed into a terminal of this server: (its exit status, its output)."""
        return asyncio.run(self._sh(command, timeout))

    async def _sh(self, command: str, timeout: float) -> tuple[int, str]:
        from tornado.httpclient import HTTPRequest
        from tornado.websocket import websocket_connect

        if not hasattr(self, "terminal"):
            self.terminal = self.json("post", "api/terminals")["name"]
        ws = self.base.replace("http://", "ws://") + f"terminals/websocket/{self.terminal}"
        conn = await websocket_connect(HTTPRequest(
            ws, headers={"Authorization": f"token {self.token}"}))
        conn.write_message(json.dumps(["set_size", 50, 2000]))  # no wrapped command lines
        mark = uuid.uuid4().hex[:12]
        conn.write_message(json.dumps(
            ["stdin", f"echo __start_{mark}__; {command}; echo __done_{mark}_$?__\r"]))
        out, t0 = [], time.monotonic()
        try:
            while True:
                left = timeout - (time.monotonic() - t0)
                raw = await asyncio.wait_for(conn.read_message(), max(left, 0.1))
                if raw is None:
                    raise AssertionError(f"{self.name}'s terminal closed: {''.join(out)[-2000:]}")
                msg = json.loads(raw)
                if msg[0] == "stdout":
                    out.append(msg[1])
                    text = "".join(out)
                    m = re.search(rf"__done_{mark}_(\d+)__", text)
                    if m:  # the output between the two markers' lines (not their echo)
                        text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]|\r", "", text[:m.start()])
                        body = re.split(rf"(?m)^__start_{mark}__$", text, maxsplit=1)[-1]
                        return int(m.group(1)), body.strip()
        finally:
            conn.close()

    def sh_ok(self, command: str, timeout: float = 900) -> str:
        rc, out = self.sh(command, timeout)
        assert rc == 0, f"{self.name}$ {command}\n(exit {rc})\n{out[-4000:]}"
        return out


@pytest.fixture(scope="module")
def local_hub(accounts):
    """The hub of docker/local_hub/jupyterhub_config.py, on free ports of 127.0.0.1, with a
    service token for the test (an admin); stopped afterwards with every server."""
    run = TEST_DIR / f"run-{os.getpid()}"
    if run.exists():
        shutil.rmtree(run)
    run.mkdir(mode=0o755)
    os.chmod(run, 0o755)
    port, token = _free_port(), secrets.token_hex(32)
    wrapper = run / "test_config.py"
    wrapper.write_text(
        f"load_subconfig({str(LOCAL_CONFIG)!r})  # noqa: F821\n"
        "c = get_config()  # noqa: F821\n"
        f"c.JupyterHub.hub_bind_url = 'http://127.0.0.1:{_free_port()}'\n"
        f"c.ConfigurableHTTPProxy.api_url = 'http://127.0.0.1:{_free_port()}'\n"
        "c.JupyterHub.services = [{'name': 'classroom-test', 'api_token': "
        f"{token!r}}}]\n"
        "c.JupyterHub.load_roles = [{'name': 'admin', 'services': ['classroom-test']}]\n")
    env = dict(os.environ, MINIVLLM_HUB_DIR=str(run / "hub"),
               MINIVLLM_HUB_VENV=str(TEST_DIR / "venv"), MINIVLLM_HUB_CACHE=str(TEST_DIR / "cache"),
               MINIVLLM_HUB_USERS=",".join(LEARNERS), MINIVLLM_HUB_INSTRUCTORS=INSTRUCTOR,
               MINIVLLM_HUB_BIND_URL=f"http://127.0.0.1:{port}")
    hub, proc, log = _start_hub(run, wrapper, env, port, token)
    try:
        hub.wait_up(1800)  # the first start builds the learners' Python
        yield hub
    finally:
        _stop_hub(hub, proc, 30)
        _kill_processes_of(USERS)
        REPORTS.mkdir(parents=True, exist_ok=True)
        shutil.copy(log, REPORTS / "hub-local.log")
        shutil.rmtree(run, ignore_errors=True)


def _start_hub(run: Path, wrapper: Path, env: dict, port: int, token: str):
    """Start ``jupyterhub -f wrapper`` in ``run`` (its own process group, output in
    ``run/jupyterhub.log``): (the Hub client, the process, the log's path)."""
    log = run / "jupyterhub.log"
    with open(log, "w") as fh:
        proc = subprocess.Popen([str(VENV_BIN / "jupyterhub"), "-f", str(wrapper)], cwd=run,
                                env=env, stdout=fh, stderr=subprocess.STDOUT,
                                start_new_session=True)
    return Hub(f"http://127.0.0.1:{port}", token, proc, log, run / "hub"), proc, log


def _stop_hub(hub, proc: subprocess.Popen, wait_s: float) -> None:
    """Stop every user's server through the API, then the hub's process group: SIGTERM,
    and SIGKILL after ``wait_s`` seconds."""
    for name in USERS:
        try:
            hub.api("DELETE", f"/users/{name}/server", ok=(202, 204, 400, 404))
        except Exception:  # noqa: BLE001  (the hub may be gone already)
            pass
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(wait_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def _fixture_notebook(released: dict, source: Path, fixture: str) -> dict:
    """The released notebook with the fixture's code in its solution cells (as a learner
    types it): grading/fixtures/ch03.py's edits on the solution (source) or released code."""
    import nbformat

    from grading import fixtures
    from grading.grade import lab_cells

    fx = fixtures.load(LAB).FIXTURES[fixture]
    solutions, _ = lab_cells(nbformat.read(source, as_version=4))
    nb = json.loads(json.dumps(released))
    for cell in nb["cells"]:
        meta = cell.get("metadata", {}).get("nbgrader", {})
        if meta.get("solution"):
            gid = meta["grade_id"]
            code = solutions[gid] if fx.base == "solution" else "".join(cell["source"])
            edit = fx.edits.get(gid)
            cell["source"] = (edit(code) if callable(edit) else edit) if edit else code
    return nb


def _browser(profile: Path):
    chromium = next((shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome")
                     if shutil.which(n)), None)
    chromedriver = shutil.which("chromedriver")
    if not (chromium and chromedriver):
        return None, f"no headless browser (chromium: {chromium}, chromedriver: {chromedriver})"
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        return None, "selenium is not installed (the docs extra)"
    opts = webdriver.ChromeOptions()
    opts.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1400,1000", f"--user-data-dir={profile}"):
        opts.add_argument(arg)
    return webdriver.Chrome(service=Service(chromedriver), options=opts), None


def _browser_fetch_and_submit(hub: Hub, name: str, password: str, fill, setup: str) -> dict:
    """``name`` logs in with their Unix password, opens Nbgrader > Assignment List, fetches the
    lab, (``fill()`` writes their answer), submits it; a screenshot
    (reports/classroom/hub-<setup>-assignment-list-<name>.png). Returns what it saw."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as EC
    from selenium.webdriver.support.ui import WebDriverWait

    profile = hub.dir.parent / "chromium-profile"
    driver, why = _browser(profile)
    if driver is None:
        pytest.skip(why)
    seen = {}
    try:
        wait = WebDriverWait(driver, 240)
        driver.get(f"{hub.url}/hub/login")
        driver.find_element(By.ID, "username_input").send_keys(name)
        driver.find_element(By.ID, "password_input").send_keys(password)
        driver.find_element(By.ID, "login_submit").click()
        wait.until(lambda d: f"/user/{name}/lab" in d.current_url)

        def menu(label):
            item = wait.until(EC.element_to_be_clickable(
                (By.XPATH, f"//div[contains(@class,'lm-MenuBar-itemLabel') and text()='{label}']")))
            item.click()
            labels = [e.text for e in driver.find_elements(
                By.CSS_SELECTOR, ".lm-Menu-content .lm-Menu-itemLabel") if e.text]
            return labels

        seen["nbgrader menu"] = menu("Nbgrader")
        driver.find_element(
            By.XPATH, "//div[contains(@class,'lm-Menu-itemLabel') and text()='Assignment List']"
        ).click()
        fetch = wait.until(EC.element_to_be_clickable(
            (By.XPATH, f"//div[@id='released_assignments_list']//div[contains(., '{LAB}')]"
                       "//button[normalize-space()='Fetch']")))
        fetch.click()
        wait.until(EC.presence_of_element_located(
            (By.XPATH, f"//div[@id='fetched_assignments_list']//*[contains(., '{LAB}')]"
                       "//button[normalize-space()='Submit']")))
        fill()
        submit = driver.find_element(
            By.XPATH, f"//div[@id='fetched_assignments_list']//*[contains(., '{LAB}')]"
                      "//button[normalize-space()='Submit']")
        submit.click()
        wait.until(EC.presence_of_element_located(
            (By.XPATH, f"//div[@id='submitted_assignments_list']//*[contains(., '{LAB}')]")))
        REPORTS.mkdir(parents=True, exist_ok=True)
        shot = REPORTS / f"hub-{setup}-assignment-list-{name}.png"
        driver.save_screenshot(str(shot))
        seen["screenshot"] = str(shot.relative_to(ROOT))
        seen["submitted list"] = driver.find_element(By.ID, "submitted_assignments_list").text
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)
    return seen


def _scores(course: Path) -> dict:
    from nbgrader.api import Gradebook

    with Gradebook(f"sqlite:///{course / 'gradebook.db'}") as gb:
        return {s.student.id: s.score for s in gb.find_assignment(LAB).submissions}


def test_local_process_hub_round_trip_scores_and_integrity(local_hub, accounts):
    from grading import fixtures

    hub, t_start, record = local_hub, time.perf_counter(), {"hub": "local-process"}
    expected = {"alice": fixtures.load(LAB).FIXTURES["solution"].score,
                "bob": fixtures.load(LAB).FIXTURES["truncate"].score}
    course = hub.dir / "course"
    exchange = hub.dir / "exchange"
    ex = str(exchange)

    # -- the instructor prepares and releases the lab, in a terminal of their server
    teacher = hub.server(INSTRUCTOR)
    assert teacher.sh_ok("which nbgrader python").startswith(str(TEST_DIR / "venv"))
    out = teacher.sh_ok(f"cd ~/course && python -m grading.grade --prepare-only "
                        f"--course-root ~/course --exchange {ex} {LAB}")
    assert "1 generated and released" in out, out
    assert (exchange / COURSE_ID / "outbound" / LAB / f"{NOTEBOOK}.ipynb").is_file()
    # the instructor's Formgrader sees the course (its root under the server's: ~/course)
    listed = teacher.json("get", "formgrader/api/assignments")
    assert [a["name"] for a in listed] == [LAB], listed

    # -- alice, through the Assignment List's endpoints in her server
    alice = hub.server("alice")
    assert alice.json("get", "courses") == {"success": True, "value": [COURSE_ID]}
    assert (LAB, "released") in alice.assignments()
    alice.action("fetch")
    path = f"{LAB}/{NOTEBOOK}.ipynb"
    released = alice.notebook(path)
    assert released["path"] == path and (Path(pwd.getpwnam("alice").pw_dir) / path).is_file()
    text = json.dumps(released["content"])
    assert "BEGIN SOLUTION" not in text and "BEGIN HIDDEN TESTS" not in text
    source = course / "source" / LAB / f"{NOTEBOOK}.ipynb"
    alice.save(path, _fixture_notebook(released["content"], source, "truncate"))
    t0 = time.perf_counter()
    validated = alice.json("post", "assignments/validate", data={"path": path})
    record["validate s"] = round(time.perf_counter() - t0, 1)
    assert "failed" in json.dumps(validated), validated
    alice.action("submit")

    # -- bob, in a browser: log in, Assignment List, Fetch, Submit (his answer: truncate)
    def bob_writes():
        bob_server = hub.server("bob")
        bob_server.save(path, _fixture_notebook(bob_server.notebook(path)["content"], source,
                                                "truncate"))
    record["browser"] = _browser_fetch_and_submit(hub, "bob", accounts["bob"], bob_writes,
                                                  "local")
    assert "Assignment List" in record["browser"]["nbgrader menu"], record["browser"]
    assert not {"Formgrader", "Course List"} & set(record["browser"]["nbgrader menu"])
    bob = hub.server("bob")
    assert (LAB, "submitted") in bob.assignments()

    # -- collect; alice hands in the solution, collect takes the resubmission
    out = teacher.sh_ok(f"cd ~/course && nbgrader collect {LAB}")
    assert "Collecting submission: alice" in out and "Collecting submission: bob" in out, out
    first = (course / "submitted" / "alice" / LAB / "timestamp.txt").read_text()
    time.sleep(1.1)  # submission timestamps are the folder names: keep them apart
    alice.save(path, _fixture_notebook(alice.notebook(path)["content"], source, "solution"))
    alice.action("submit")
    out = teacher.sh_ok(f"cd ~/course && nbgrader collect {LAB}")
    assert "Updating submission: alice" in out, out
    assert (course / "submitted" / "alice" / LAB / "timestamp.txt").read_text() > first

    # -- bob tries what a learner must not be able to do, from a terminal of his server
    attempts = {}

    def attempt(what: str, command: str, expect: str) -> None:
        rc, out = bob.sh(command)
        attempts[what] = {"command": command, "exit": rc, "output": out[-300:]}
        assert rc != 0 and expect in out, f"bob$ {command}: exit {rc}\n{out}"

    repo = str(ROOT)
    inbound = exchange / COURSE_ID / "inbound"
    (alices,) = [p.name for p in inbound.iterdir() if p.name.startswith("alice+")][-1:]
    attempt("read the lab's source (solutions, hidden tests)",
            f"cat {repo}/labs/source/{LAB}/{NOTEBOOK}.py", "Permission denied")
    attempt("read the grading fixtures", f"cat {repo}/grading/fixtures/{LAB}.py",
            "Permission denied")
    attempt("read the repository's history", f"git -C {repo} log -1", "ermission denied")
    # the learner's Python has what a lab imports, and nothing else of grading; the model
    # is found through bob's own cache (where quantized checkpoints are built)
    bob.sh_ok("python -c 'import grading.checks; from minivllm import LLM'")
    cache = bob.sh_ok("python -c 'from minivllm.models import embedded as e; "
                      "print(e.is_converted(), e.cache_dir())'")
    assert cache == f"True {pwd.getpwnam('bob').pw_dir}/.cache/minivllm", cache
    attempt("import the fixtures", "python -c 'import grading.fixtures'",
            "No module named 'grading.fixtures'")
    attempt("read the course root (gradebook, collected submissions)",
            f"ls {course}/submitted/alice", "Permission denied")
    attempt("list the exchange's submissions", f"ls {inbound}", "Permission denied")
    attempt("read alice's submission without its random suffix",
            f"cat '{inbound}/{alices.rsplit('+', 1)[0]}/{NOTEBOOK}.ipynb'", "No such file")
    attempt("read alice's home (her notebook, her record of submissions)",
            f"cat ~alice/{path}", "Permission denied")
    attempt("change the released lab", f"touch {exchange}/{COURSE_ID}/outbound/{LAB}/x",
            "Permission denied")
    attempt("take the course's exchange folder", f"mv {exchange}/{COURSE_ID} {exchange}/x",
            "Operation not permitted")
    r = bob.get("formgrader")
    attempts["open the Formgrader"] = {"GET": "/user/bob/formgrader", "status": r.status_code}
    assert r.status_code == 404, (r.status_code, r.text[:300])
    page = re.search(r'<script id="jupyter-config-data" type="application/json">(.*?)</script>',
                     bob.get("lab").text, re.S)
    hidden = set(json.loads(page.group(1))["disabledExtensions"])
    assert {"@jupyter/nbgrader:formgrader", "@jupyter/nbgrader:create-assignment"} <= hidden
    attempts["open the Formgrader"]["lab page disables"] = sorted(hidden)
    # a submission under alice's name: inbound must be writable, so the folder can be made,
    # but the instructor's collect skips it (it is bob's, not alice's)
    forged = f"alice+{LAB}+2099-01-01 00:00:00.000000 UTC+forged"
    rc, out = bob.sh(f"cp -r ~/{LAB} '{inbound}/{forged}' && echo made")
    attempts["submit under alice's name"] = {"exit": rc, "output": out[-300:]}
    assert rc == 0 and "made" in out, out  # nbgrader's inbound: writable by every learner
    kept = (course / "submitted" / "alice" / LAB / f"{NOTEBOOK}.ipynb").read_bytes()
    out = teacher.sh_ok(f"cd ~/course && nbgrader collect {LAB}")
    assert f"Skipped {forged}: named after alice, not owned by them" in out, out
    assert (course / "submitted" / "alice" / LAB / f"{NOTEBOOK}.ipynb").read_bytes() == kept
    attempts["submit under alice's name"]["collect"] = "skipped: named after alice, not owned"
    # (the folder stays: it is bob's, and only root may empty it; every collect skips it)
    record["attempts"] = attempts

    # -- autograde, feedback to alice alone, then to everyone; export
    t0 = time.perf_counter()
    teacher.sh_ok(f"cd ~/course && OMP_WAIT_POLICY=PASSIVE nbgrader autograde {LAB}")
    record["autograde s"] = round(time.perf_counter() - t0, 1)
    scores = _scores(course)
    record["scores"] = scores
    assert scores == expected, scores
    teacher.sh_ok(f"cd ~/course && nbgrader generate_feedback {LAB}")
    teacher.sh_ok(f"cd ~/course && nbgrader release_feedback {LAB} --student=alice")
    alice.action("fetch_feedback")
    bob.action("fetch_feedback")
    feedback = lambda server: [  # noqa: E731
        e["path"] for d in server.json("get", f"api/contents/{LAB}/feedback")["content"]
        for e in server.json("get", f"api/contents/{d['path']}")["content"]]
    (page_path,) = feedback(alice)
    html = alice.get(f"files/{page_path}").text
    assert f"{NOTEBOOK}" in html and "17" in html
    assert bob.get(f"api/contents/{LAB}/feedback").status_code == 404  # not released to bob
    teacher.sh_ok(f"cd ~/course && nbgrader release_feedback {LAB}")
    bob.action("fetch_feedback")
    (bobs_page,) = feedback(bob)
    assert "Score: 3.0 / 17.0" in re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ",
                                                            bob.get(f"files/{bobs_page}").text))
    teacher.sh_ok("cd ~/course && nbgrader export")
    with open(course / "grades.csv", newline="") as fh:
        table = {row["student_id"]: row for row in csv.DictReader(fh)}
    assert {n: float(table[n][LAB]) for n in LEARNERS} == expected, table

    record["round trip s"] = round(time.perf_counter() - t_start, 1)
    REPORTS.mkdir(parents=True, exist_ok=True)
    (REPORTS / "hub-local.json").write_text(json.dumps(record, indent=1))
    print(json.dumps(record, indent=1))


# ---------------------------------------------------------------------------------------
# The DockerSpawner hub: docker/jupyterhub_config.py, the learner image, per-user uids.

DOCKER_CONFIG = ROOT / "docker" / "jupyterhub_config.py"
LAB_IMAGE = os.environ.get("MINIVLLM_LAB_IMAGE", "minivllm/lab-cpu:latest")
GRADER_IMAGE = os.environ.get("MINIVLLM_GRADER_IMAGE", "minivllm/grader:latest")
PREFIX = "minivllm-hubtest"  # the test's containers and volumes: never a class's own


def _docker_why_not() -> str | None:
    why = docker_why_not((LAB_IMAGE, GRADER_IMAGE))
    if why:
        return why
    try:
        import dockerspawner  # noqa: F401
    except ImportError:
        return "dockerspawner is not installed (the hub-docker extra: scripts/install.sh --extras dev,course,serve,docs,hub-docker .venv)"
    return None


def _docker0_ip() -> str:
    out = subprocess.run(["ip", "-4", "-o", "addr", "show", "docker0"], capture_output=True,
                         text=True).stdout
    m = re.search(r"inet (\d+\.\d+\.\d+\.\d+)", out)
    return m.group(1) if m else "172.17.0.1"


def _volume_path(name: str) -> Path:
    out = subprocess.run(["docker", "volume", "inspect", "-f", "{{.Mountpoint}}", name],
                         capture_output=True, text=True, check=True).stdout
    return Path(out.strip())


@pytest.fixture(scope="module")
def docker_hub(accounts):
    why = _docker_why_not()
    if why:
        pytest.skip(why)
    run = TEST_DIR / f"docker-run-{os.getpid()}"
    shutil.rmtree(run, ignore_errors=True)
    run.mkdir(mode=0o755)
    os.chmod(run, 0o755)
    port, token, ip = _free_port(), secrets.token_hex(32), _docker0_ip()
    wrapper = run / "test_config.py"
    wrapper.write_text(
        f"load_subconfig({str(DOCKER_CONFIG)!r})  # noqa: F821\n"
        "c = get_config()  # noqa: F821\n"
        f"c.JupyterHub.bind_url = 'http://127.0.0.1:{port}'\n"
        f"c.JupyterHub.hub_bind_url = 'http://{ip}:{_free_port()}'\n"
        f"c.ConfigurableHTTPProxy.api_url = 'http://127.0.0.1:{_free_port()}'\n"
        f"c.JupyterHub.db_url = 'sqlite:///{run}/jupyterhub.sqlite'\n"
        f"c.JupyterHub.cookie_secret_file = '{run}/cookie_secret'\n"
        f"c.ConfigurableHTTPProxy.pid_file = '{run}/proxy.pid'\n"
        f"c.DockerSpawner.prefix = {PREFIX!r}\n"
        f"c.DockerSpawner.volumes = {{'{PREFIX}-user-{{username}}': '/home/jovyan/work', "
        f"'{PREFIX}-exchange': '/srv/nbgrader/exchange'}}\n"
        "c.JupyterHub.services = [{'name': 'classroom-test', 'api_token': "
        f"{token!r}}}]\n"
        "c.JupyterHub.load_roles = [{'name': 'admin', 'services': ['classroom-test']}]\n")
    env = dict(os.environ, MINIVLLM_HUB_DIR=str(run / "hub"), HUB_CONNECT_IP=ip,
               MINIVLLM_HUB_USERS=",".join(LEARNERS), MINIVLLM_HUB_ADMINS=INSTRUCTOR,
               MINIVLLM_LAB_IMAGE=LAB_IMAGE)
    hub, proc, log = _start_hub(run, wrapper, env, port, token)
    try:
        hub.wait_up(120)
        yield hub
    finally:
        _stop_hub(hub, proc, 60)
        names = subprocess.run(["docker", "ps", "-aq", "--filter", f"name=^{PREFIX}-"],
                               capture_output=True, text=True).stdout.split()
        if names:
            subprocess.run(["docker", "rm", "-f", *names], capture_output=True)
        volumes = subprocess.run(["docker", "volume", "ls", "-q", "--filter", f"name=^{PREFIX}-"],
                                 capture_output=True, text=True).stdout.split()
        if volumes:
            subprocess.run(["docker", "volume", "rm", "-f", *volumes], capture_output=True)
        REPORTS.mkdir(parents=True, exist_ok=True)
        shutil.copy(log, REPORTS / "hub-docker.log")
        shutil.rmtree(run, ignore_errors=True)


def test_docker_spawner_hub_round_trip_scores_and_integrity(docker_hub, accounts):
    """docker/jupyterhub_config.py with the learner image: alice and bob through the
    Assignment List in containers of their own uids (bob in Chromium: log in, Nbgrader >
    Assignment List, Fetch, Submit; a screenshot in reports/classroom/); the instructor's
    commands of docs/instructor.md ($G: the grader image on the course and exchange volumes)."""
    from grading import fixtures

    hub, t_start, record = docker_hub, time.perf_counter(), {"hub": "DockerSpawner"}
    expected = {"alice": fixtures.load(LAB).FIXTURES["solution"].score,
                "bob": fixtures.load(LAB).FIXTURES["truncate"].score}
    C = f"/srv/course/{COURSE_ID}"
    G = ["docker", "run", "--rm", "--network", "none", "-e", "OMP_WAIT_POLICY=PASSIVE",
         "-v", f"{PREFIX}-course:/srv/course", "-v", f"{PREFIX}-exchange:/srv/nbgrader/exchange",
         "-v", f"{hub.dir}/etc/grader:/etc/minivllm/grader:ro",
         "-e", "JUPYTER_CONFIG_PATH=/etc/minivllm/grader"]

    def instructor(*args: str, cwd: str | None = C) -> str:
        cmd = [*G, *(["-w", cwd] if cwd else []), GRADER_IMAGE, *args]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1200)
        assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}"
        return proc.stdout + proc.stderr

    alice, bob = hub.server("alice"), hub.server("bob")  # their start prepares the exchange
    uids = {s.name: int(s.sh_ok("id -u")) for s in (alice, bob)}
    record["uids"] = uids
    assert uids == {n: pwd.getpwnam(n).pw_uid for n in LEARNERS}, uids
    instructor("python", "-m", "grading.grade", "--prepare-only", "--course-root", C, LAB,
               cwd=None)
    instructor("nbgrader", "release_assignment", LAB)

    assert (LAB, "released") in alice.assignments()
    path = f"{LAB}/{NOTEBOOK}.ipynb"
    course = _volume_path(f"{PREFIX}-course") / COURSE_ID
    source = course / "source" / LAB / f"{NOTEBOOK}.ipynb"
    alice.action("fetch")
    released = alice.notebook(path)["content"]
    assert "BEGIN SOLUTION" not in json.dumps(released)
    alice.save(path, _fixture_notebook(released, source, "truncate"))
    validated = alice.json("post", "assignments/validate", data={"path": path})
    assert "failed" in json.dumps(validated), validated
    alice.action("submit")

    # -- bob, in a browser: log in (PAM), Assignment List, Fetch, Submit (his answer: truncate)
    def bob_writes():
        released = bob.notebook(path)["content"]
        assert "BEGIN SOLUTION" not in json.dumps(released)
        bob.save(path, _fixture_notebook(released, source, "truncate"))
    t0 = time.perf_counter()
    record["browser"] = _browser_fetch_and_submit(hub, "bob", accounts["bob"], bob_writes,
                                                  "docker")
    record["browser s"] = round(time.perf_counter() - t0, 1)
    assert "Assignment List" in record["browser"]["nbgrader menu"], record["browser"]
    assert not {"Formgrader", "Course List"} & set(record["browser"]["nbgrader menu"])
    assert (LAB, "submitted") in bob.assignments()
    out = instructor("nbgrader", "collect", LAB)
    assert "Collecting submission: alice" in out and "Collecting submission: bob" in out, out
    time.sleep(1.1)
    alice.save(path, _fixture_notebook(alice.notebook(path)["content"], source, "solution"))
    alice.action("submit")
    out = instructor("nbgrader", "collect", LAB)
    assert "Updating submission: alice" in out, out

    attempts = {}

    def attempt(what: str, command: str, expect: str) -> None:
        rc, out = bob.sh(command)
        attempts[what] = {"command": command, "exit": rc, "output": out[-300:]}
        assert rc != 0 and expect in out, f"bob$ {command}: exit {rc}\n{out}"

    inbound = f"/srv/nbgrader/exchange/{COURSE_ID}/inbound"
    attempt("read the lab's source (not in the learner image)",
            f"cat /opt/minivllm/labs/source/{LAB}/{NOTEBOOK}.py", "No such file")
    assert bob.sh_ok("which python") == "/opt/venv/bin/python"
    # in the home folder, where a notebook saved there runs: the engine, bob's own cache
    cache = bob.sh_ok("cd ~ && python -c 'from minivllm import LLM; from minivllm.models "
                      "import embedded as e; print(e.is_converted(), e.cache_dir())'")
    assert cache == "True /home/jovyan/work/.cache/minivllm", cache
    bob.sh_ok("cd /tmp && python -c 'import grading.checks; from minivllm import LLM'")
    attempt("import the fixtures", "cd /tmp && python -c 'import grading.fixtures'",
            "No module named 'grading.fixtures'")
    attempt("list the exchange's submissions", f"ls {inbound}", "Permission denied")
    alices = [p.name for p in (_volume_path(f"{PREFIX}-exchange") / COURSE_ID / "inbound")
              .iterdir() if p.name.startswith("alice+")][-1]
    attempt("read alice's submission without its random suffix",
            f"cat '{inbound}/{alices.rsplit('+', 1)[0]}/{NOTEBOOK}.ipynb'", "No such file")
    attempt("change the released lab", f"touch /srv/nbgrader/exchange/{COURSE_ID}/outbound/{LAB}/x",
            "Permission denied")
    attempt("take the course's exchange folder",
            f"mv /srv/nbgrader/exchange/{COURSE_ID} /srv/nbgrader/exchange/x",
            "Operation not permitted")
    r = bob.get("formgrader")
    attempts["open the Formgrader"] = {"GET": "/user/bob/formgrader", "status": r.status_code}
    assert r.status_code == 404, (r.status_code, r.text[:300])
    forged = f"alice+{LAB}+2099-01-01 00:00:00.000000 UTC+forged"
    rc, out = bob.sh(f"cp -r ~/{LAB} '{inbound}/{forged}' && echo made")
    attempts["submit under alice's name"] = {"exit": rc, "output": out[-300:]}
    assert rc == 0 and "made" in out, out  # nbgrader's inbound: writable by every learner
    kept = (course / "submitted" / "alice" / LAB / f"{NOTEBOOK}.ipynb").read_bytes()
    out = instructor("nbgrader", "collect", LAB)
    assert f"Skipped {forged}: named after alice, not owned by them" in out, out
    assert "cheating attempt" not in out, out  # nbgrader's own check: every uid is nameless
    assert (course / "submitted" / "alice" / LAB / f"{NOTEBOOK}.ipynb").read_bytes() == kept
    attempts["submit under alice's name"]["collect"] = "skipped: named after alice, not owned"
    record["attempts"] = attempts

    t0 = time.perf_counter()
    instructor("nbgrader", "autograde", LAB)
    record["autograde s"] = round(time.perf_counter() - t0, 1)
    scores = _scores(course)
    record["scores"] = scores
    assert scores == expected, scores
    instructor("nbgrader", "generate_feedback", LAB)
    instructor("nbgrader", "release_feedback", LAB, "--student=alice")
    alice.action("fetch_feedback")
    bob.action("fetch_feedback")
    assert alice.get(f"api/contents/{LAB}/feedback").status_code == 200
    assert bob.get(f"api/contents/{LAB}/feedback").status_code == 404
    instructor("nbgrader", "release_feedback", LAB)
    bob.action("fetch_feedback")
    assert bob.get(f"api/contents/{LAB}/feedback").status_code == 200
    record["round trip s"] = round(time.perf_counter() - t_start, 1)
    REPORTS.mkdir(parents=True, exist_ok=True)
    (REPORTS / "hub-docker.json").write_text(json.dumps(record, indent=1))
    print(json.dumps(record, indent=1))
