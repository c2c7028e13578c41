"""Measured run times of the course: each chapter notebook, each lab (its solution, and
what grading it costs CI), and the rest of the test suite; budgets and the CI projection.

Recorded by the tests that run them (``tests/test_course.py`` for chapters,
``tests/test_grading.py`` for labs) into the JSON file named by ``$MINIVLLM_COURSE_TIMES``
(default ``build/course_times.json``, scratch), one entry per item with the date and the
machine's load average; ``scripts/course_times.py --measure`` runs the whole suite with it
set to ``reports/course_times.json`` (committed: measured on an idle machine) and records the
suite's wall time. ``scripts/course_times.py`` prints the budgets against the numbers.
No test asserts on time.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import platform
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COMMITTED = ROOT / "reports" / "course_times.json"
SCRATCH = ROOT / "build" / "course_times.json"
ENV = "MINIVLLM_COURSE_TIMES"

# Budgets on an idle 2-core machine.
CHAPTER_BUDGET_S = 60.0
LAB_SOLUTION_BUDGET_S = 30.0
CI_BUDGET_S = 60 * 60.0
TARGET_CHAPTERS = TARGET_LABS = 30
BUSY_SHARE = 0.10  # others' share of the CPU above which a measurement is not "idle"
# CI outside pytest (fresh install with scripts/install.sh, Chromium, hadolint): README's
# fresh-clone run took 15 min in all, of which the tests 13 min 32 s.
CI_OVERHEAD_S = 15 * 60.0 - (13 * 60 + 32)


def path() -> Path:
    return Path(os.environ.get(ENV) or SCRATCH)


def load(p: Path | None = None) -> dict:
    p = p or path()
    try:
        data = json.loads(p.read_text())
    except (FileNotFoundError, ValueError):
        return {}
    # entries of the older flat format ({chapter: seconds}) are dropped
    return {k: v for k, v in data.items() if isinstance(v, dict)}


def machine() -> dict:
    return {"cpus": os.cpu_count(), "machine": platform.machine(),
            "python": platform.python_version()}


def _busy_jiffies() -> float | None:
    """CPU time all processes used since boot, in seconds (Linux /proc/stat)."""
    try:
        fields = [float(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def _own_cpu() -> float:
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


@contextlib.contextmanager
def measure():
    """Times the block: fills the dict it yields with ``seconds``, ``load_1m_before`` and
    ``others_cpu_share``, the share of the machine's CPU time that processes other than
    this one and its (waited-for) children used meanwhile: about 0 on an idle machine.
    The load average, by contrast, also counts the measured run and the one before it."""
    out: dict = {}
    load0, busy0, own0, t0 = os.getloadavg()[0], _busy_jiffies(), _own_cpu(), time.perf_counter()
    try:
        yield out
    finally:
        wall = time.perf_counter() - t0
        busy1 = _busy_jiffies()
        out.update(seconds=round(wall, 1), load_1m_before=round(load0, 2))
        if busy0 is not None and busy1 is not None and wall > 0:
            others = (busy1 - busy0) - (_own_cpu() - own0)
            out["others_cpu_share"] = round(max(0.0, others) / (wall * (os.cpu_count() or 1)), 2)


def stamp() -> dict:
    """Date, load average (1, 5, 15 min) now, the machine, the number of pytest workers."""
    return {"measured": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "load_avg": [round(x, 2) for x in os.getloadavg()], **machine(),
            "workers": int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))}


@contextlib.contextmanager
def _locked(p: Path):
    p.parent.mkdir(parents=True, exist_ok=True)
    with open(p.with_name(p.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def record(key: str, entry: dict, p: Path | None = None) -> Path:
    """Replace ``key``'s entry (adds the date and load average), keeping the others."""
    p = p or path()
    with _locked(p):
        data = load(p)
        data[key] = {**stamp(), **entry}  # the entry's own fields win (a suite's workers)
        tmp = p.with_name(p.name + ".tmp")
        tmp.write_text(json.dumps(dict(sorted(data.items())), indent=2) + "\n")
        tmp.replace(p)
    return p


def record_chapter(name: str, m: dict) -> Path:
    """A chapter: ``m`` from :func:`measure` around its notebook's execution."""
    return record(f"chapters/{name}", {"kind": "chapter", **m})


def record_lab(result: dict, m: dict) -> Path:
    """A lab, from ``grading.grade``'s result and :func:`measure` around grading it as CI
    does: ``seconds`` is its solution's run time (first cell to last, in the grading
    kernel), ``ci_s`` what grading its CI share took (the generic fixtures are recorded
    apart, :func:`record_generic`)."""
    fx = {f["fixture"]: f for f in result["fixtures"]}
    sol = fx.get("solution") or {}
    return record(f"labs/{result['lab']}", {
        "kind": "lab", "seconds": result.get("solution_run_s"),
        "solution_cells": sol.get("cell_s", {}),
        "ci_s": m["seconds"],
        "fixture_run_s": {n: f["run_s"] for n, f in fx.items()},
        "timeout_s": result.get("timeout_s"), "slow_cells": result.get("slow_cells", {}),
        **{k: v for k, v in m.items() if k != "seconds"}})


def record_generic(result: dict, m: dict) -> Path:
    """CI's one grading run of the generic fixtures (grading.fixtures.ci_generic()):
    ``ci_s`` what it took CI."""
    return record(f"generic/{result['lab']}", {
        "kind": "generic", "seconds": m["seconds"], "ci_s": m["seconds"],
        "fixture_run_s": {f["fixture"]: f["run_s"] for f in result["fixtures"]},
        "timeout_s": result.get("timeout_s"),
        **{k: v for k, v in m.items() if k != "seconds"}})


def record_suite(m: dict, args: list[str], p: Path, inside: dict | None = None) -> Path:
    """The whole test suite's wall time (``m`` from :func:`measure`), and from ``inside``
    (what its tests recorded) each chapter's and lab's time within that run and the number
    of pytest workers."""
    inside = inside or {}
    items = {kind: {k.split("/", 1)[1]: e.get("ci_s", e.get("seconds"))
                    for k, e in inside.items() if e.get("kind") == kind}
             for kind in ("chapter", "lab", "generic")}
    workers = max([e.get("workers") or 1 for e in inside.values()] or [1])
    return record("suite", {"kind": "suite", "pytest_args": args, "workers": workers,
                            "inside": items, **m}, p)


def _mean(xs):
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def report(data: dict) -> tuple[str, dict]:
    """The budgets against the numbers, as text, and a summary dict."""
    chapters = {k.split("/", 1)[1]: v for k, v in data.items() if v.get("kind") == "chapter"}
    labs = {k.split("/", 1)[1]: v for k, v in data.items() if v.get("kind") == "lab"}
    suite = data.get("suite")
    lines = ["| item | measured s | budget s | over | others' CPU share | load avg 1 min "
             "(before; after) | date |", "|---|---|---|---|---|---|---|"]
    over = []

    def row(name, e, budget):
        s = e.get("seconds")
        is_over = s is not None and s > budget
        if is_over:
            over.append(name)
        lines.append(f"| {name} | {s} | {budget:g} | {'**OVER**' if is_over else ''} | "
                     f"{e.get('others_cpu_share', '?')} | {e.get('load_1m_before')}; "
                     f"{(e.get('load_avg') or ['?'])[0]} | {e.get('measured', '?')} |")

    for n, e in sorted(chapters.items()):
        row(f"chapter {n}", e, CHAPTER_BUDGET_S)
    for n, e in sorted(labs.items()):
        row(f"lab {n} (solution)", e, LAB_SOLUTION_BUDGET_S)
    ch_total = sum(e["seconds"] for e in chapters.values())
    lab_sol_total = sum(e.get("seconds") or 0 for e in labs.values())
    lab_ci_total = sum(e.get("ci_s") or 0 for e in labs.values())
    out = [f"Measured: {len(chapters)} chapters {ch_total:.0f} s, {len(labs)} lab solutions "
           f"{lab_sol_total:.0f} s (grading them in CI: {lab_ci_total:.0f} s)"
           + (f", whole test suite {suite['seconds']:.0f} s." if suite else "."), ""]
    out += lines
    out += ["", f"Over budget (chapter <= {CHAPTER_BUDGET_S:g} s, lab solution <= "
                f"{LAB_SOLUTION_BUDGET_S:g} s, idle 2-core machine): "
                + (", ".join(over) if over else "none")]
    busy = sorted(k for k, e in data.items() if (e.get("others_cpu_share") or 0) > BUSY_SHARE)
    if busy:
        out.append(f"NOT an idle machine's numbers (other processes used over "
                   f"{BUSY_SHARE:.0%} of the CPU meanwhile): {', '.join(busy)}")
    summary = {"over": over, "busy": busy}
    ci_run = data.get("ci_run")
    if ci_run:  # scripts/course_times.py --ci-run: a fresh clone's .ci/run, end to end
        out += ["", f"Fresh-clone `.ci/run` (install, Chromium, hadolint, make test): "
                    f"{ci_run['seconds'] / 60:.1f} min, of which pytest "
                    f"{(ci_run.get('pytest_s') or 0) / 60:.1f} min ({ci_run.get('result', '?')}; "
                    f"commit {ci_run.get('commit', '?')}, measured {ci_run.get('measured')}, "
                    f"others' CPU share {ci_run.get('others_cpu_share', '?')})"]
        summary["ci_run_s"] = ci_run["seconds"]
    # CI projected to the full course. The suite ran on `workers` pytest workers in W s;
    # inside that run each chapter took c_i s and each lab's CI grading l_j s (slower than
    # alone: the workers share the cores). Each further chapter or lab adds its mean time
    # divided by the workers (the work is spread over them):
    #   CI = outside pytest + W + (30 - chapters) * mean(c) / workers
    #                           + (30 - labs) * mean(l) / workers
    # For a serial run (1 worker) this is the suite minus its chapters and labs plus 30 of
    # each. The generic fixtures are graded once, so they are in W already.
    inside = (suite or {}).get("inside") or {}
    if suite and not inside.get("chapter"):  # a serial suite: the budget entries are its items
        inside = {"chapter": {n: e["seconds"] for n, e in chapters.items()},
                  "lab": {n: e.get("ci_s") for n, e in labs.items()}}
    workers = (suite or {}).get("workers") or 1
    if ci_run and ci_run.get("pytest_s"):
        overhead = ci_run["seconds"] - ci_run["pytest_s"]
        overhead_src = "the fresh-clone .ci/run above"
    else:
        overhead, overhead_src = CI_OVERHEAD_S, "README's earlier fresh-clone run"
    in_ch, in_lab = inside.get("chapter") or {}, inside.get("lab") or {}
    mean_ch, mean_lab = _mean(list(in_ch.values())), _mean(list(in_lab.values()))
    out.append("")
    full = ci_run and (ci_run.get("chapters") or 0) >= TARGET_CHAPTERS \
        and (ci_run.get("labs") or 0) >= TARGET_LABS and ci_run.get("returncode") == 0
    if full:  # the whole course ran end to end: nothing is left to project
        summary.update(projected_ci_s=round(ci_run["seconds"]), ci_measured_full_course=True)
        out += [f"CI with all {TARGET_CHAPTERS} chapters and {TARGET_LABS} labs: "
                f"{ci_run['seconds'] / 60:.1f} min against the {CI_BUDGET_S / 60:.0f}-minute "
                f"budget ({'OVER' if ci_run['seconds'] > CI_BUDGET_S else 'within'}; measured, "
                f"not projected: the fresh-clone .ci/run above, on this machine, whose speed "
                f"can differ from CI's)"]
    elif suite and mean_ch is not None and mean_lab is not None:
        more_ch, more_lab = TARGET_CHAPTERS - len(in_ch), TARGET_LABS - len(in_lab)
        proj = (overhead + suite["seconds"] + more_ch * mean_ch / workers
                + more_lab * mean_lab / workers)
        summary.update(projected_ci_s=round(proj), workers=workers,
                       mean_chapter_s=round(mean_ch, 1), mean_lab_ci_s=round(mean_lab, 1))
        how = [f"  = {overhead:.0f} s outside pytest (install, Chromium, hadolint: "
               f"{overhead_src})",
               f"  + {suite['seconds']:.0f} s the test suite as `make test` runs it "
               f"({workers} worker{'s' if workers > 1 else ''}; {len(in_ch)} chapters, "
               f"{len(in_lab)} labs, the generic fixtures once; measured "
               f"{suite.get('measured')})",
               f"  + {more_ch} more chapters x {mean_ch:.1f} s / {workers} (a chapter's mean "
               f"time inside that run)",
               f"  + {more_lab} more labs x {mean_lab:.1f} s / {workers} (a lab's mean CI "
               f"grading inside that run: what tests/test_grading.py grades of it)"]
        # A later fresh-clone run with more chapters is a second full measurement: the
        # growth between the two runs per chapter-with-its-lab is the measured marginal
        # cost (it includes what the item means miss: heavier new labs, workers waiting).
        # The projection is the larger of the two estimates.
        n_ci = (ci_run or {}).get("chapters")
        if ci_run and ci_run.get("pytest_s") and n_ci and n_ci > len(in_ch):
            slope = (ci_run["pytest_s"] - suite["seconds"]) / (n_ci - len(in_ch))
            by_slope = overhead + ci_run["pytest_s"] + (TARGET_CHAPTERS - n_ci) * slope
            summary.update(projected_ci_by_growth_s=round(by_slope),
                           growth_per_chapter_and_lab_s=round(slope, 1))
            how += [f"  or, from the growth between the two full runs: {overhead:.0f} s + "
                    f"{ci_run['pytest_s']:.0f} s (the fresh-clone pytest, {n_ci} chapters "
                    f"and labs) + {TARGET_CHAPTERS - n_ci} more x {slope:.1f} s (measured per "
                    f"chapter with its lab: ({ci_run['pytest_s']:.0f} - "
                    f"{suite['seconds']:.0f}) s / {n_ci - len(in_ch)}) = "
                    f"{by_slope / 60:.1f} min"]
            proj = max(proj, by_slope)
            summary["projected_ci_s"] = round(proj)
        out += [f"CI projected to {TARGET_CHAPTERS} chapters and {TARGET_LABS} labs: "
                f"{proj / 60:.1f} min against the {CI_BUDGET_S / 60:.0f}-minute budget "
                f"({'OVER' if proj > CI_BUDGET_S else 'within'}; the larger estimate below)"]
        out += how
    else:
        out.append("CI projection: needs chapters, labs and the suite's total "
                   "(python scripts/course_times.py --measure)")
    return "\n".join(out), summary
