"""Mutation testing of a lab's grader: how many wrong variants of the reference solution
do the lab's tests catch?

    python -m grading.mutants ch01              # run, print the report, write the record
    python -m grading.mutants ch01 --list       # only list the mutants (no run)
    python -m grading.mutants ch01 --only 'mean_kl:3:*'   # a subset (fnmatch on the id)
    python -m grading.mutants --check           # every record current? (what CI checks)
    make mutants LABS="ch01 ch02"               # the same as the first line, several labs

A *mutant* is the lab's reference solution with one small, plausible change in one
solution cell, made on the cell's syntax tree (:func:`mutants_of`): a comparison flipped
or relaxed (``<`` / ``<=``, ``==`` / ``!=``), a number nudged (+-1, x2, /2), a dtype cast
removed or changed, a ``.clone()`` / ``list()`` / ``copy`` dropped or an operation made
in place, ``abs`` dropped, ``min`` / ``max`` or ``floor`` / ``ceil`` swapped, ``a / b``
written ``a * (1 / b)``, ``and`` / ``or`` swapped, ``try/finally`` unwrapped, an early
``return`` dropped. The grader *kills* a mutant when at least one graded test cell fails
on it (the learner would lose points); a mutant that keeps full marks *survives*.

How a lab runs here (no nbgrader, no kernel: one process and ``os.fork``):

1. The lab source (``labs/source/<lab>/*.py``, hidden tests included) is read with
   jupytext. Code cells up to the first solution cell (the setup) run once, in this
   process, in one namespace, in a scratch directory.
2. A baseline child runs the rest unmutated: every test cell must pass (else the lab is
   broken and nothing is measured), and the time each cell took sets the mutants' limit.
3. The parent then walks the remaining cells in order; before it runs a solution cell it
   forks one child per mutant of that cell. The child runs the mutant in place of the
   cell and every cell after it, and reports the first test cell that fails (the mutant
   is killed) or that all passed (it survived). A child past its time limit is killed
   and counts as killed: nbgrader would interrupt that cell and score it zero.

Equivalent mutants (no test can tell them from the solution because they compute the
same thing) are claimed in ``grading/equivalent/<lab>.py``, ``EQUIVALENT = {mutant id:
one-line reason}``; a claim must name a mutant that exists and survived. The kill rate is
``killed / (mutants - equivalent)``.

The record ``reports/mutation/<lab>.json`` holds the counts, each survivor with its diff,
each claim, and a digest of the lab source, the claims file and :data:`MUTATOR_VERSION`;
CI (``tests/test_grading.py``) checks that every record is current and that the labs in
:data:`GATED` kill at least :data:`MIN_KILL_RATE` of their non-equivalent mutants.

Only the code between a cell's ``### BEGIN/END SOLUTION`` markers is mutated (what the
learner writes; the ``def`` line around it comes with the released stub). Mutant ids:
``<grade_id>:<line>:<col>:<operator>``, line and column in the cell with the marker lines
removed (what ``grading.grade`` submits as the solution).
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import copy
import difflib
import fnmatch
import hashlib
import io
import json
import os
import select
import signal
import sys
import tempfile
import time
import traceback
from contextlib import redirect_stderr, redirect_stdout
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
REPORTS = ROOT / "reports" / "mutation"
EQUIVALENT_DIR = ROOT / "grading" / "equivalent"
# Bump when the operator set changes: every record then goes stale, as it should.
MUTATOR_VERSION = 2
MIN_KILL_RATE = 0.90
# Labs whose graders have been brought up to the contract: CI requires their records to
# show at least MIN_KILL_RATE. The others' records are checked for currency only.
GATED: tuple[str, ...] = tuple(f"ch{i:02d}" for i in range(1, 31))  # all 30 labs
# A child's time limit: this many times the unmutated run of the same cells, at least
# MIN_LIMIT_S (a correct cell on a busy machine is slower than the baseline measured).
LIMIT_FACTOR = 4.0
MIN_LIMIT_S = 30.0
RETRY_FACTOR = 2.0  # a timed-out mutant's second run (machine loaded) gets this times the limit


# ------------------------------------------------------------------ the lab's cells

@dataclass(frozen=True)
class Cell:
    kind: str          # "setup", "solution", "test" or "code"
    grade_id: str
    source: str
    points: float = 0.0
    # solution cells: the lines (1-based, in ``source``) between the markers, the code the
    # learner writes; the rest of the cell (the ``def`` line) comes with the released stub
    solution_lines: frozenset = frozenset()


def solution_lines(cell_source: str) -> frozenset:
    """Line numbers, in the cell with its ``### BEGIN/END SOLUTION`` lines removed, of the
    code between the markers."""
    out, inside, n = set(), False, 0
    for line in cell_source.splitlines():
        tag = line.strip()
        if tag == "### BEGIN SOLUTION":
            inside = True
            continue
        if tag == "### END SOLUTION":
            inside = False
            continue
        n += 1
        if inside:
            out.add(n)
    return frozenset(out)


def lab_source(lab: str, root: Path = ROOT) -> Path:
    files = sorted((root / "labs" / "source" / lab).glob("*.py"))
    if len(files) != 1:
        raise FileNotFoundError(f"lab {lab!r}: expected one labs/source/{lab}/*.py, "
                                f"found {[str(f) for f in files]}")
    return files[0]


def lab_cells(lab: str, root: Path = ROOT) -> list[Cell]:
    """The lab's code cells in order, solution markers removed (what a learner submits
    when they write the reference solution), hidden tests kept."""
    import jupytext

    from grading.grade import _solution_code

    nb = jupytext.read(lab_source(lab, root))
    cells, seen_solution = [], False
    for i, c in enumerate(nb.cells):
        if c.cell_type != "code":
            continue
        meta = c.metadata.get("nbgrader", {})
        gid = meta.get("grade_id", f"cell{i}")
        if meta.get("solution"):
            seen_solution = True
            cells.append(Cell("solution", gid, _solution_code(c.source),
                              solution_lines=solution_lines(c.source)))
        elif meta.get("grade"):
            cells.append(Cell("test", gid, c.source, float(meta.get("points", 0))))
        else:
            cells.append(Cell("code" if seen_solution else "setup", gid, c.source))
    if not seen_solution:
        raise ValueError(f"lab {lab!r} has no solution cell")
    return cells


# ------------------------------------------------------------------ the mutants

@dataclass(frozen=True)
class Mutant:
    id: str            # <grade_id>:<line>:<col>:<operator>
    cell: str
    line: int
    operator: str
    code: str          # the whole mutated cell
    diff: str          # unified diff against the solution cell


_CMP_SWAPS = {ast.Lt: [ast.LtE, ast.Gt], ast.LtE: [ast.Lt, ast.GtE], ast.Gt: [ast.GtE, ast.Lt],
              ast.GtE: [ast.Gt, ast.LtE], ast.Eq: [ast.NotEq], ast.NotEq: [ast.Eq],
              ast.Is: [ast.IsNot], ast.IsNot: [ast.Is], ast.In: [ast.NotIn],
              ast.NotIn: [ast.In]}
_BIN_SWAPS = {ast.Add: [ast.Sub], ast.Sub: [ast.Add], ast.Mult: [ast.Div], ast.Div: [ast.Mult],
              ast.FloorDiv: [ast.Div], ast.Mod: [ast.FloorDiv], ast.Pow: [ast.Mult]}
# torch / numpy dtype names and what each is changed to (the wider and the narrower type)
_DTYPE_SWAPS = {"float64": ["float32"], "double": ["float32"],
                "float32": ["float64", "bfloat16"], "float": ["float64", "bfloat16"],
                "float16": ["float32", "bfloat16"], "half": ["float32", "bfloat16"],
                "bfloat16": ["float32", "float16"], "int64": ["int32"], "int32": ["int64"],
                "int8": ["int16"], "uint8": ["int8"]}
_DTYPE_OWNERS = {"torch", "np", "numpy"}
_CAST_METHODS = {"float", "double", "half", "bfloat16", "to", "type", "long", "int"}
_COPY_METHODS = {"clone", "copy", "detach", "contiguous"}
_COPY_CALLS = {"list", "dict", "tuple", "set", "sorted", "deepcopy"}
_INPLACE = {"clamp", "add", "sub", "mul", "div", "abs", "round", "neg", "exp", "log",
            "sqrt", "pow", "masked_fill", "fill", "zero", "copy", "floor", "ceil", "sign",
            "nan_to_num", "clamp_min", "clamp_max", "index_fill", "scatter", "relu"}
_NAME_SWAPS = {"min": "max", "max": "min", "amin": "amax", "amax": "amin",
               "minimum": "maximum", "maximum": "minimum", "floor": "ceil", "ceil": "floor",
               "argmin": "argmax", "argmax": "argmin", "any": "all", "all": "any",
               "round": "floor", "trunc": "round", "sum": "mean", "mean": "sum",
               "isinf": "isnan", "isnan": "isinf", "isfinite": "isnan"}


def _skip_ids(tree: ast.AST) -> set[int]:
    """Nodes never mutated: docstrings, annotations, decorators."""
    skip: set[int] = set()

    def mark(node):
        for n in ast.walk(node):
            skip.add(id(n))

    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Module)):
            body = node.body
            if (body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                    and isinstance(body[0].value.value, str)):
                mark(body[0])
            for d in getattr(node, "decorator_list", []):
                mark(d)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if node.returns is not None:
                    mark(node.returns)
                for a in (node.args.args + node.args.kwonlyargs + node.args.posonlyargs
                          + [x for x in (node.args.vararg, node.args.kwarg) if x]):
                    if a.annotation is not None:
                        mark(a.annotation)
        if isinstance(node, ast.AnnAssign):
            mark(node.annotation)
        if (isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub)
                and isinstance(node.operand, ast.Constant)):
            skip.add(id(node.operand))  # mutated as the negative number it is
    return skip


def _call_name(node: ast.Call) -> str | None:
    f = node.func
    if isinstance(f, ast.Name):
        return f.id
    if isinstance(f, ast.Attribute):
        return f.attr
    return None


def _variants(node: ast.AST, parent_of: dict) -> list[tuple[str, object]]:
    """(operator label, replacement) for one node; the replacement is a node, or a
    callable that edits a deep copy of ``node`` and returns the node to put in its place."""
    out: list[tuple[str, object]] = []
    if isinstance(node, ast.Compare):
        for i, op in enumerate(node.ops):
            for new in _CMP_SWAPS.get(type(op), []):
                def f(n, i=i, new=new):
                    n.ops[i] = new()
                    return n
                at = f"[{i}]" if len(node.ops) > 1 else ""  # a chained comparison's i-th
                out.append((f"{type(op).__name__}{at}->{new.__name__}", f))
    elif isinstance(node, (ast.BinOp, ast.AugAssign)):
        aug = "Aug" if isinstance(node, ast.AugAssign) else ""
        for new in _BIN_SWAPS.get(type(node.op), []):
            def f(n, new=new):
                n.op = new()
                return n
            out.append((f"{aug}{type(node.op).__name__}->{new.__name__}", f))
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
            # a / b -> a * (1 / b): what the lab means by "divide" rounds differently
            out.append(("Div->MulReciprocal", lambda n: ast.BinOp(
                n.left, ast.Mult(), ast.BinOp(ast.Constant(1.0), ast.Div(), n.right))))
    elif isinstance(node, ast.BoolOp):
        new = ast.Or if isinstance(node.op, ast.And) else ast.And
        out.append((f"{type(node.op).__name__}->{new.__name__}",
                    lambda n, new=new: ast.BoolOp(new(), n.values)))
    elif (isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub)
          and isinstance(node.operand, ast.Constant) and type(node.operand.value) in (int, float)):
        # a negative literal is one number: nudged as such (-1 -> 0, -2), sign dropped
        v = -node.operand.value
        for new in sorted({v + 1, v - 1, -v} | ({v * 2} if isinstance(v, float) else set())):
            out.append((f"{v!r}->{new!r}", lambda n, new=new: ast.Constant(new) if new >= 0
                        else ast.UnaryOp(ast.USub(), ast.Constant(-new))))
    elif isinstance(node, ast.UnaryOp):
        if isinstance(node.op, (ast.Not, ast.USub)):
            out.append((f"drop {type(node.op).__name__}", lambda n: n.operand))
    elif isinstance(node, ast.Constant) and not isinstance(node.value, str):
        v = node.value
        if isinstance(v, bool):
            out.append((f"{v}->{not v}", lambda n, v=v: ast.Constant(not v)))
        elif isinstance(v, int):
            for new in sorted({v + 1, v - 1} | ({v * 2} if v not in (0, 1) else set())):
                out.append((f"{v}->{new}", lambda n, new=new: ast.Constant(new)))
        elif isinstance(v, float) and v == v:
            for label, new in (("x2", v * 2), ("/2", v / 2)) if v != 0 else (("0->1", 1.0),):
                out.append((f"{v!r}{label}", lambda n, new=new: ast.Constant(new)))
    elif isinstance(node, ast.Attribute):
        owner = node.value
        if (isinstance(owner, ast.Name) and owner.id in _DTYPE_OWNERS
                and node.attr in _DTYPE_SWAPS):
            for new in _DTYPE_SWAPS[node.attr]:
                out.append((f"{node.attr}->{new}", lambda n, new=new: ast.Attribute(
                    n.value, new, ast.Load())))
    elif isinstance(node, ast.Call):
        name = _call_name(node)
        f = node.func
        is_method = isinstance(f, ast.Attribute)
        # a cast or a copy dropped: x.float() / x.to(d) / x.clone() -> x
        if is_method and name in (_CAST_METHODS | _COPY_METHODS):
            if not (isinstance(f.value, ast.Name) and f.value.id in _DTYPE_OWNERS | {"copy"}):
                out.append((f"drop .{name}()", lambda n: n.func.value))
        if not is_method and name in _COPY_CALLS and len(node.args) == 1 and not node.keywords:
            out.append((f"drop {name}()", lambda n: n.args[0]))
        if (is_method and name == "deepcopy" and len(node.args) == 1):
            out.append(("drop deepcopy()", lambda n: n.args[0]))
        # an operation made in place: x.clamp(...) -> x.clamp_(...)
        if (is_method and name in _INPLACE and not (isinstance(f.value, ast.Name)
                                                   and f.value.id in _DTYPE_OWNERS | {"math"})):
            def g(n):
                n.func.attr = n.func.attr + "_"
                return n
            out.append((f"{name}->{name}_", g))
        # abs dropped
        if name == "abs" and ((not is_method and len(node.args) == 1) or
                              (is_method and not node.args)):
            if is_method and not (isinstance(f.value, ast.Name) and f.value.id in _DTYPE_OWNERS):
                out.append(("drop abs", lambda n: n.func.value))
            elif node.args:
                out.append(("drop abs", lambda n: n.args[0]))
        if name in _NAME_SWAPS:
            new = _NAME_SWAPS[name]

            def h(n, new=new):
                if isinstance(n.func, ast.Name):
                    n.func.id = new
                else:
                    n.func.attr = new
                return n
            out.append((f"{name}->{new}", h))
        # a keyword that sets the precision or the axis dropped
        for i, kw in enumerate(node.keywords):
            if kw.arg in ("dtype", "keepdim", "keepdims", "stable", "generator", "out"):
                def k(n, i=i):
                    del n.keywords[i]
                    return n
                out.append((f"drop {kw.arg}=", k))
    elif isinstance(node, ast.Try) and node.finalbody:
        out.append(("unwrap try/finally", lambda n: [*n.body, *n.finalbody]))
    elif isinstance(node, ast.Return):
        # an early return (not the function's last statement) dropped
        parent = parent_of.get(id(node))
        if parent is not None and not isinstance(parent, (ast.FunctionDef, ast.AsyncFunctionDef)):
            out.append(("drop early return", lambda n: ast.Pass()))
    return out


class _Replace(ast.NodeTransformer):
    def __init__(self, target_index: int, fn):
        self.target, self.fn, self.i = target_index, fn, -1

    def visit(self, node):
        self.i += 1
        if self.i == self.target:
            new = self.fn(node)
            return new
        return self.generic_visit(node)


def _preorder(tree: ast.AST) -> list[ast.AST]:
    """Nodes in the order NodeTransformer.visit meets them (pre-order, fields in order)."""
    out = []

    def rec(n):
        out.append(n)
        for child in ast.iter_child_nodes(n):
            rec(child)
    rec(tree)
    return out


def mutants_of(cell: str, code: str, lines: frozenset | None = None) -> list[Mutant]:
    """Every single-change mutant of one solution cell, deduplicated by resulting code;
    those that do not compile, or unparse to the original code, are left out. ``lines``:
    mutate only nodes that start on these lines (the code between the markers)."""
    tree = ast.parse(code)
    original = ast.unparse(tree)
    nodes = _preorder(tree)
    skip = _skip_ids(tree)
    parent_of: dict[int, ast.AST] = {}
    for n in nodes:
        for child in ast.iter_child_nodes(n):
            parent_of[id(child)] = n
    out, seen, ids = [], {original}, set()
    for index, node in enumerate(nodes):
        if id(node) in skip:
            continue
        if lines is not None and getattr(node, "lineno", None) not in lines:
            continue
        for label, fn in _variants(node, parent_of):
            t2 = copy.deepcopy(tree)
            t2 = _Replace(index, fn).visit(t2)
            ast.fix_missing_locations(t2)
            try:
                new = ast.unparse(t2)
                compile(new, "<mutant>", "exec")
            except (SyntaxError, ValueError, TypeError):
                continue
            if new in seen:
                continue
            seen.add(new)
            line, col = getattr(node, "lineno", 0), getattr(node, "col_offset", 0)
            diff = "".join(difflib.unified_diff(
                original.splitlines(True), new.splitlines(True), "solution", "mutant", n=0))
            diff = "\n".join(x for x in diff.splitlines() if not x.startswith(("---", "+++")))
            mid = f"{cell}:{line}:{col}:{label}"
            if mid in ids:  # nested nodes starting at one place, e.g. (4 * a) * b: the
                # inner one is told apart by where it ends (the outer keeps the plain id)
                mid += f":to{getattr(node, 'end_col_offset', 0)}"
            ids.add(mid)
            out.append(Mutant(mid, cell, line, label, new, diff))
    return out


def lab_mutants(lab: str, root: Path = ROOT) -> list[Mutant]:
    return [m for c in lab_cells(lab, root) if c.kind == "solution"
            for m in mutants_of(c.grade_id, c.source, c.solution_lines)]


# ------------------------------------------------------------------ running

def _exec(cell: Cell, code: str, ns: dict) -> None:
    sink = io.StringIO()
    with redirect_stdout(sink), redirect_stderr(sink):
        exec(compile(code, f"<{cell.grade_id}>", "exec"), ns)


def _run_from(cells: list[Cell], start: int, ns: dict, first_code: str | None,
              stop_at_failure: bool, edits: dict | None = None) -> dict:
    """Run cells[start:] in ``ns`` (cells[start] as ``first_code`` when given, a solution
    cell named in ``edits`` as its code there); returns per-test-cell outcomes and
    per-cell seconds."""
    outcome, times, failed = {}, {}, None
    edits = edits or {}
    for j in range(start, len(cells)):
        c = cells[j]
        code = first_code if (j == start and first_code is not None) else c.source
        if c.kind == "solution" and c.grade_id in edits:
            code = edits[c.grade_id]
        t = time.perf_counter()
        try:
            _exec(c, code, ns)
            ok, why = True, ""
        except BaseException as e:  # noqa: BLE001  (a cell may raise anything, as in a kernel)
            if isinstance(e, KeyboardInterrupt):
                raise
            ok, why = False, f"{type(e).__name__}: {str(e)[:300]}"
        times[c.grade_id] = round(time.perf_counter() - t, 3)
        if c.kind == "test":
            outcome[c.grade_id] = why or "passed"
            if not ok and failed is None:
                failed = c.grade_id
                if stop_at_failure:
                    break
    return {"tests": outcome, "times": times, "first_failure": failed}


def _spawn(fn) -> tuple[int, int]:
    """Fork a child that runs ``fn()`` and writes its JSON result to a pipe; (pid, fd).

    The child runs torch on one thread: libgomp's thread pool does not survive fork (a
    child that enters a parallel region the parent used hangs), and one thread per child
    lets one child per core run side by side."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        os.close(r)
        code = 0
        try:
            import torch
            torch.set_num_threads(1)
            payload = json.dumps(fn()).encode()
        except BaseException:  # noqa: BLE001
            payload = json.dumps({"crash": traceback.format_exc()[-2000:]}).encode()
            code = 1
        with os.fdopen(w, "wb") as f:
            f.write(payload)
        os._exit(code)
    os.close(w)
    return pid, r


def _run_many(jobs: list, limit_s: float, workers: int) -> list:
    """Run each ``fn`` of ``jobs`` in a forked child, at most ``workers`` at a time, each
    killed after ``limit_s``; returns, in order, (result or None, timed out, seconds)."""
    out: list = [None] * len(jobs)
    pending = list(enumerate(jobs))
    live: dict[int, tuple] = {}  # fd -> (index, pid, start, chunks)
    while pending or live:
        while pending and len(live) < workers:
            i, fn = pending.pop(0)
            pid, fd = _spawn(fn)
            live[fd] = (i, pid, time.monotonic(), [])
        now = time.monotonic()
        for fd, (i, pid, t0, chunks) in list(live.items()):
            if now - t0 > limit_s:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                os.close(fd)
                del live[fd]
                out[i] = (None, True, round(now - t0, 2))
        if not live:
            continue
        ready, _, _ = select.select(list(live), [], [], 0.5)
        for fd in ready:
            i, pid, t0, chunks = live[fd]
            data = os.read(fd, 1 << 16)
            if data:
                chunks.append(data)
                continue
            os.waitpid(pid, 0)
            os.close(fd)
            del live[fd]
            try:
                res = json.loads(b"".join(chunks) or b"null")
            except json.JSONDecodeError:
                res = None
            out[i] = (res, False, round(time.monotonic() - t0, 2))
    return out


@contextlib.contextmanager
def _lab_session(lab: str, cells: list[Cell]):
    """The lab's setup cells run once, in this process, in a scratch directory (left
    again on exit), with the grading kernels' environment: yields (namespace, index of the
    first solution cell, setup seconds). Forked children start from that namespace."""
    sys.path.insert(0, str(ROOT))
    old_cwd = os.getcwd()
    os.chdir(tempfile.mkdtemp(prefix=f"mutants-{lab}-"))
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    os.environ.setdefault("MPLBACKEND", "Agg")
    try:
        ns: dict = {"__name__": "__main__"}
        first_sol = next(i for i, c in enumerate(cells) if c.kind == "solution")
        t = time.perf_counter()
        for c in cells[:first_sol]:
            _exec(c, c.source, ns)
        yield ns, first_sol, time.perf_counter() - t
    finally:
        os.chdir(old_cwd)


def run_fixtures(lab: str, names: list[str], repeat: int = 1) -> dict:
    """Grade fixtures of ``grading/fixtures/<lab>.py`` in-process (the setup once, each
    fixture ``repeat`` times in a forked child): {name: [per-test-cell outcomes, ...]},
    an outcome being ``"passed"`` or the error. The score of an outcome is the sum of
    the points of the cells that passed (:func:`score_of`); nbgrader's grade of the same
    submission is the same unless a cell's result depends on the kernel (timeouts)."""
    from grading import fixtures

    fx = fixtures.load(lab)
    cells = lab_cells(lab)
    sols = {c.grade_id: c.source for c in cells if c.kind == "solution"}
    with _lab_session(lab, cells) as (ns, first_sol, _):
        jobs, keys = [], []
        for name in names:
            f = fx.FIXTURES[name]
            if f.base != "solution":
                raise ValueError(f"{lab} {name}: only fixtures built on the solution run here")
            edits = {g: (e(sols[g]) if callable(e) else e) for g, e in f.edits.items()}
            for _ in range(repeat):
                jobs.append(lambda edits=edits: _run_from(cells, first_sol, ns, None, False,
                                                          edits))
                keys.append(name)
        runs = _run_many(jobs, 3600, min(2, os.cpu_count() or 1))
    out: dict = {n: [] for n in names}
    for name, (res, timed_out, _) in zip(keys, runs):
        if timed_out or res is None or "crash" in res:
            raise RuntimeError(f"{lab} {name}: the in-process run failed: {res}")
        out[name].append(res["tests"])
    return out


def score_of(lab: str, outcome: dict) -> float:
    """Points of the test cells that passed in one outcome of :func:`run_fixtures`."""
    pts = {c.grade_id: c.points for c in lab_cells(lab) if c.kind == "test"}
    return float(sum(pts[g] for g, o in outcome.items() if o == "passed"))


def equivalent_claims(lab: str, root: Path = ROOT) -> dict[str, str]:
    path = root / "grading" / "equivalent" / f"{lab}.py"
    if not path.exists():
        return {}
    ns: dict = {}
    exec(compile(path.read_text(), str(path), "exec"), ns)
    claims = ns.get("EQUIVALENT", {})
    if not isinstance(claims, dict) or not all(isinstance(k, str) and isinstance(v, str) and v
                                               for k, v in claims.items()):
        raise ValueError(f"{path}: EQUIVALENT must map mutant ids to one-line reasons")
    return claims


def digest(lab: str, root: Path = ROOT) -> str:
    """sha256 over the lab source, its equivalence claims and MUTATOR_VERSION."""
    h = hashlib.sha256(f"mutator {MUTATOR_VERSION}\0".encode())
    files = [lab_source(lab, root), root / "grading" / "equivalent" / f"{lab}.py"]
    for p in files:
        h.update(str(p.relative_to(root)).encode() + b"\0")
        h.update((p.read_bytes() if p.exists() else b"(none)") + b"\0")
    return h.hexdigest()


def run_lab(lab: str, only: str | None = None, progress: bool = True,
            workers: int | None = None) -> dict:
    """Run every mutant of the lab (or those whose id matches ``only``); the report."""
    t_start = time.perf_counter()
    workers = workers or min(4, os.cpu_count() or 1)
    cells = lab_cells(lab)
    claims = equivalent_claims(lab)
    with _lab_session(lab, cells) as (ns, first_sol, setup_s):
        # the baseline: the unmutated rest must pass every test
        ((base, to, _),) = _run_many(
            [lambda: _run_from(cells, first_sol, ns, None, False)], 3600, 1)
        if to or base is None or "crash" in base:
            raise RuntimeError(f"{lab}: the baseline run failed: {base}")
        bad = {g: o for g, o in base["tests"].items() if o != "passed"}
        if bad:
            raise RuntimeError(f"{lab}: the reference solution fails test cells {bad}: fix "
                               "the lab before measuring its grader")
        times = base["times"]
        results: list[dict] = []
        all_mutants = []
        for i in range(first_sol, len(cells)):
            c = cells[i]
            if c.kind == "solution":
                ms = mutants_of(c.grade_id, c.source, c.solution_lines)
                all_mutants += ms
                if only:
                    ms = [m for m in ms if fnmatch.fnmatchcase(m.id, only)]
                rest_s = sum(times.get(x.grade_id, 0.0) for x in cells[i:])
                limit = max(MIN_LIMIT_S, LIMIT_FACTOR * rest_s)
                runs = _run_many([lambda m=m, i=i: _run_from(cells, i, ns, m.code, True)
                                  for m in ms], limit, workers)
                # a loaded machine slows every run: while the load is above the cores, a
                # mutant that timed out runs again with RETRY_FACTOR times the limit before
                # the timeout counts (on an unloaded machine a timeout is a timeout)
                retry = [j for j, r in enumerate(runs) if r[1]]
                if retry and os.getloadavg()[0] > (os.cpu_count() or 1):
                    again = _run_many([lambda m=ms[j], i=i: _run_from(cells, i, ns, m.code, True)
                                       for j in retry], RETRY_FACTOR * limit, workers)
                    for j, r in zip(retry, again):
                        runs[j] = r
                    limit *= RETRY_FACTOR
                for m, (res, timed_out, dt) in zip(ms, runs):
                    if timed_out:
                        status, by, why = "killed", "timeout", f"over {limit:.0f} s"
                    elif res is None or "crash" in res:
                        status, by, why = "killed", "crash", str(res)[:300]
                    elif res["first_failure"]:
                        status, by = "killed", res["first_failure"]
                        why = res["tests"][by]
                    else:
                        status, by, why = "survived", None, ""
                    results.append({"id": m.id, "cell": m.cell, "operator": m.operator,
                                    "status": status, "killed_by": by, "why": why,
                                    "diff": m.diff, "seconds": dt})
                    if progress:
                        print("." if status == "killed" else "S", end="", flush=True)
            # the parent runs the unmutated cell and goes on
            try:
                _exec(c, c.source, ns)
            except Exception:  # noqa: BLE001  (test cells passed in the baseline child)
                pass
        if progress:
            print()
    ids = {m.id for m in all_mutants}
    stale = sorted(set(claims) - ids)
    for r in results:
        if r["status"] == "survived" and r["id"] in claims:
            r["status"], r["reason"] = "equivalent", claims[r["id"]]
    claimed_but_killed = sorted(r["id"] for r in results
                                if r["id"] in claims and r["status"] == "killed")
    n = len(results)
    killed = sum(r["status"] == "killed" for r in results)
    equiv = sum(r["status"] == "equivalent" for r in results)
    survived = n - killed - equiv
    rate = killed / (n - equiv) if n - equiv else 1.0
    return {"lab": lab, "mutator_version": MUTATOR_VERSION, "digest": digest(lab),
            "only": only, "mutants": n, "killed": killed, "equivalent": equiv,
            "survived": survived, "kill_rate": round(rate, 4),
            "stale_claims": stale, "claimed_but_killed": claimed_but_killed,
            "setup_s": round(setup_s, 1), "baseline_s": round(sum(times.values()), 1),
            "run_s": round(time.perf_counter() - t_start, 1),
            "killed_by": _count(r["killed_by"] for r in results if r["status"] == "killed"),
            "survivors": [{k: r[k] for k in ("id", "diff")} for r in results
                          if r["status"] == "survived"],
            "equivalents": [{"id": r["id"], "reason": r["reason"], "diff": r["diff"]}
                            for r in results if r["status"] == "equivalent"],
            "results": results}


def _count(items) -> dict:
    out: dict = {}
    for x in items:
        out[x] = out.get(x, 0) + 1
    return dict(sorted(out.items()))


def write_record(report: dict) -> Path:
    REPORTS.mkdir(parents=True, exist_ok=True)
    keep = {k: v for k, v in report.items() if k != "results"}
    keep["results"] = [{k: r[k] for k in ("id", "status", "killed_by")} for r in report["results"]]
    path = REPORTS / f"{report['lab']}.json"
    path.write_text(json.dumps(keep, indent=1) + "\n")
    return path


def record_problems(lab: str, root: Path = ROOT, gated: bool = False) -> list[str]:
    """What is wrong with the lab's mutation record (empty: current, and, when ``gated``,
    at the kill rate CI requires)."""
    path = root / "reports" / "mutation" / f"{lab}.json"
    fix = f"run `python -m grading.mutants {lab}` and commit {path.relative_to(root)}"
    if not path.exists():
        return [f"{lab}: no mutation record; {fix}"]
    rec = json.loads(path.read_text())
    out = []
    if rec.get("digest") != digest(lab, root):
        out.append(f"{lab}: the mutation record is stale (the lab source, its equivalence "
                   f"claims or the mutator changed since); {fix}")
    if rec.get("only"):
        out.append(f"{lab}: the mutation record covers only {rec['only']!r}; {fix}")
    if rec.get("stale_claims") or rec.get("claimed_but_killed"):
        out.append(f"{lab}: equivalence claims that name no surviving mutant: "
                   f"{rec.get('stale_claims')} {rec.get('claimed_but_killed')}")
    if gated and rec.get("kill_rate", 0) < MIN_KILL_RATE:
        out.append(f"{lab}: kills {rec['kill_rate']:.1%} of its non-equivalent mutants, "
                   f"below {MIN_KILL_RATE:.0%}; survivors: {[s['id'] for s in rec['survivors']]}")
    return out


def print_report(rep: dict) -> None:
    print(f"\n## {rep['lab']}: {rep['mutants']} mutants, {rep['killed']} killed, "
          f"{rep['equivalent']} equivalent, {rep['survived']} survived: kill rate "
          f"{rep['kill_rate']:.1%} of the non-equivalent (setup {rep['setup_s']} s, baseline "
          f"{rep['baseline_s']} s, whole run {rep['run_s']} s)")
    print(f"killed by: {rep['killed_by']}")
    for s in rep["survivors"]:
        print(f"\nSURVIVED {s['id']}\n{s['diff']}")
    for e in rep["equivalents"]:
        print(f"\nequivalent {e['id']}: {e['reason']}")
    for x in rep["stale_claims"]:
        print(f"STALE CLAIM (no such mutant): {x}")
    for x in rep["claimed_but_killed"]:
        print(f"CLAIM ON A KILLED MUTANT: {x}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("labs", nargs="*", help="labs (default: every lab with a record, for "
                    "--check; required otherwise)")
    ap.add_argument("--list", action="store_true", help="list the mutants, run nothing")
    ap.add_argument("--only", default=None, help="fnmatch pattern on mutant ids (no record "
                    "is written)")
    ap.add_argument("--check", action="store_true", help="check the records are current")
    ap.add_argument("--workers", type=int, default=None,
                    help="mutants run side by side (default: one per core, at most 4)")
    args = ap.parse_args(argv)
    if args.check:
        labs = args.labs or sorted(p.stem for p in REPORTS.glob("ch*.json"))
        probs = [p for lab in labs for p in record_problems(lab, gated=lab in GATED)]
        print("\n".join(probs) or f"mutation records current: {', '.join(labs)}")
        return 1 if probs else 0
    if not args.labs:
        ap.error("name at least one lab")
    summary = []
    for lab in args.labs:
        if args.list:
            for m in lab_mutants(lab):
                print(f"{m.id}\n{m.diff}")
            continue
        rep = run_lab(lab, args.only, workers=args.workers)
        print_report(rep)
        if not args.only:
            print(f"recorded {write_record(rep).relative_to(ROOT)}")
        summary.append({k: rep[k] for k in ("lab", "mutants", "killed", "equivalent",
                                             "survived", "kill_rate", "run_s")})
    if summary:
        print("\n| lab | mutants | killed | equivalent | survived | kill rate | run s |")
        print("|---|---|---|---|---|---|---|")
        for s in summary:
            print(f"| {s['lab']} | {s['mutants']} | {s['killed']} | {s['equivalent']} | "
                  f"{s['survived']} | {s['kill_rate']:.1%} | {s['run_s']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
