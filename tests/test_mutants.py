"""The grader's own tests: the mutation harness (grading/mutants.py) makes the mutants it
promises, its records are current, the labs whose graders were brought up to the contract
kill at least 90 % of their non-equivalent mutants, every random draw in a test cell is
seeded in that cell (so one notebook always gets one grade), and the contract helpers of
grading/checks.py catch what they are for.
"""

from __future__ import annotations

import ast
import random

import numpy
import pytest
import torch

from grading import checks, mutants

LABS = sorted(p.name for p in (mutants.ROOT / "labs" / "source").glob("ch*") if p.is_dir())


# ------------------------------------------------------------------ the mutator

def _ops(code: str) -> set[str]:
    return {m.operator for m in mutants.mutants_of("cell", code)}


def test_mutator_makes_the_promised_mutants():
    code = (
        "def f(x, s, items):\n"
        "    '''docstring: never mutated'''\n"
        "    y = x.clone().to(torch.float32) / s\n"
        "    if y.abs().max() >= 1.5 and len(items) == 0:\n"
        "        return None\n"
        "    z = torch.clamp(y, min=-1).sum(dim=-1)\n"
        "    try:\n"
        "        out = sorted(list(items))\n"
        "    finally:\n"
        "        cleanup()\n"
        "    return math.floor(z) + min(out)\n")
    ops = _ops(code)
    for want in ["GtE->Gt", "GtE->LtE", "Eq->NotEq", "And->Or", "Div->Mult",
                 "Div->MulReciprocal", "drop .clone()", "drop .to()", "float32->float64",
                 "float32->bfloat16", "drop abs", "max->min", "1.5x2", "1.5/2", "-1->0",
                 "-1->-2", "-1->1", "drop early return", "unwrap try/finally", "drop list()",
                 "drop sorted()", "floor->ceil", "min->max", "Add->Sub", "abs->abs_",
                 "sum->mean", "0->1"]:
        assert want in ops, f"missing {want}; made {sorted(ops)}"
    # the docstring and the final return are left alone
    assert not any("docstring" in m.diff for m in mutants.mutants_of("cell", code))
    assert all(m.code != ast.unparse(ast.parse(code)) for m in mutants.mutants_of("cell", code))


def test_mutant_ids_are_unique_and_each_mutant_differs_from_the_solution():
    for lab in ("ch01", "ch09", "ch14"):
        ms = mutants.lab_mutants(lab)
        assert len({m.id for m in ms}) == len(ms)
        assert len({m.code for m in ms}) == len(ms)
        for m in ms:
            compile(m.code, m.id, "exec")
            assert m.diff.count("\n-") + m.diff.startswith("-") >= 1


def test_a_mutation_record_goes_stale_when_the_lab_or_its_claims_change(tmp_path):
    (tmp_path / "labs" / "source" / "ch99").mkdir(parents=True)
    (tmp_path / "grading" / "equivalent").mkdir(parents=True)
    src = tmp_path / "labs" / "source" / "ch99" / "ch99_lab.py"
    src.write_text("x = 1\n")
    d0 = mutants.digest("ch99", tmp_path)
    src.write_text("x = 2\n")
    d1 = mutants.digest("ch99", tmp_path)
    (tmp_path / "grading" / "equivalent" / "ch99.py").write_text("EQUIVALENT = {}\n")
    d2 = mutants.digest("ch99", tmp_path)
    assert len({d0, d1, d2}) == 3


@pytest.mark.parametrize("lab", LABS)
def test_mutation_record_is_current(lab):
    """reports/mutation/<lab>.json was made by `python -m grading.mutants <lab>` on the lab
    source and equivalence claims as they are now; a lab in mutants.GATED kills at least
    90 % of its non-equivalent mutants."""
    problems = mutants.record_problems(lab, gated=lab in mutants.GATED)
    assert not problems, "\n".join(problems)


# ------------------------------------------------------------------ reproducible grades

_SAMPLERS = {"randn", "rand", "randint", "randperm", "multinomial", "normal", "bernoulli",
             "poisson", "rand_like", "randn_like", "randint_like"}
_RANDOM_MODULE_FUNCS = {"random", "randint", "randrange", "choice", "choices", "sample",
                        "shuffle", "uniform", "gauss", "normalvariate"}


def unseeded_draws(code: str) -> list[str]:
    """Random draws in one test cell that no generator seeded in the cell controls."""
    tree = ast.parse(code)
    text = code
    seeded_torch = "torch.manual_seed(" in text
    seeded_random = ".seed(" in text
    out = []
    for n in ast.walk(tree):
        if not isinstance(n, ast.Call):
            continue
        f = n.func
        name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None)
        owner = f.value.id if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) \
            else None
        line = ast.get_source_segment(code, n) or name
        if name == "Random" and not n.args and not n.keywords:
            out.append(f"random.Random() without a seed: {line}")
        elif name == "Generator" and owner == "torch" and ".manual_seed(" not in text:
            out.append(f"torch.Generator() never seeded: {line}")
        elif name == "default_rng" and not n.args:
            out.append(f"numpy default_rng() without a seed: {line}")
        elif (name in _SAMPLERS and owner == "torch"
              and not any(k.arg == "generator" for k in n.keywords) and not seeded_torch):
            out.append(f"torch.{name} from the global generator: {line}")
        elif (name in _RANDOM_MODULE_FUNCS and owner in ("random", "_random")
              and not seeded_random):
            out.append(f"{owner}.{name} from the global generator: {line}")
    return out


def test_unseeded_draw_detector():
    assert unseeded_draws("r = _random.Random()\nx = r.random()")
    assert not unseeded_draws("r = _random.Random(5)\nx = r.random()")
    assert unseeded_draws("x = torch.randn(3)")
    assert not unseeded_draws("g = torch.Generator().manual_seed(1)\nx = torch.randn(3, generator=g)")
    assert unseeded_draws("g = torch.Generator()\nx = torch.randn(3, generator=g)")
    assert unseeded_draws("i = _random.randrange(9)")


@pytest.mark.parametrize("lab", LABS)
def test_every_draw_in_a_test_cell_is_seeded_there(lab):
    """One notebook, one grade: a test cell draws its fresh inputs from generators it
    seeds itself (grading twice gives the same score on every cell)."""
    bad = {c.grade_id: unseeded_draws(c.source) for c in mutants.lab_cells(lab)
           if c.kind == "test"}
    bad = {k: v for k, v in bad.items() if v}
    assert not bad, f"{lab}: unseeded draws in test cells: {bad}"


@pytest.mark.embedded
def test_grading_twice_gives_the_same_score_on_every_cell(embedded_model_dir):
    """The solution and two wrong fixtures of one lab, each graded twice in-process:
    identical per-cell outcomes, and the fixture's expected score."""
    from grading import fixtures

    lab = "ch03"  # its setup and solution run in seconds; `make grade-all` checks every lab
    fx = fixtures.load(lab).FIXTURES
    names = ["solution", "ties_away", "multiply_by_reciprocal"]
    runs = mutants.run_fixtures(lab, names, repeat=2)
    for name in names:
        first, second = runs[name]
        assert first == second, f"{name}: two gradings differ: {first} vs {second}"
        assert mutants.score_of(lab, first) == fx[name].score, (name, first)


# ------------------------------------------------------------------ contract helpers

def test_same_compares_types_dtypes_and_bits():
    checks.same("ok", [1, 2.0, torch.tensor([0.0])], [1, 2.0, torch.tensor([0.0])])
    for got, want in [(torch.tensor([-0.0]), torch.tensor([0.0])), (1, 1.0),
                      (torch.tensor(3), 3), (torch.tensor([1.0]), torch.tensor([1.0]).double()),
                      ({"a": 1}, {"a": 2}), ([1, 2], (1, 2)), (-0.0, 0.0)]:
        with pytest.raises(checks.CheckFailed):
            checks.same("x", got, want)
    checks.same("NaN equals itself", torch.tensor([float("nan")]), torch.tensor([float("nan")]))


def test_call_catches_side_effects_also_after_raising():
    t = torch.ones(3)
    with pytest.raises(checks.CheckFailed, match="changed by the call"):
        checks.call("f", lambda x: x.add_(1), t)
    with pytest.raises(checks.CheckFailed, match="torch's global generator"):
        checks.call("f", lambda x: torch.manual_seed(1) and x, torch.ones(2))
    with pytest.raises(checks.CheckFailed, match="random's global generator"):
        checks.call("f", lambda x: random.random(), 1)
    with pytest.raises(checks.CheckFailed, match="numpy"):
        checks.call("f", lambda x: numpy.random.rand(), 1)
    lst = [3, 1, 2]
    with pytest.raises(checks.CheckFailed, match="changed by the call"):
        checks.call("f", lambda x: x.sort(), lst)

    def raises_after_change(x):
        x.mul_(2)
        raise ValueError("bad input")
    with pytest.raises(checks.CheckFailed, match="changed by the call"):
        checks.call("f", raises_after_change, torch.ones(2), raises=ValueError)
    assert checks.call("f", lambda x: (_ for _ in ()).throw(ValueError("x")), 1,
                       raises=ValueError) is None
    with pytest.raises(checks.CheckFailed, match="expected ValueError"):
        checks.call("f", lambda x: x, 1, raises=ValueError)
    with pytest.raises(KeyError):  # an unexpected exception propagates as itself
        checks.call("f", lambda x: {}[x], 1)


def test_call_catches_hooks_left_registered():
    m = torch.nn.Linear(2, 2)

    def leaves_hook(x):
        m.register_forward_hook(lambda *a: None)
        raise RuntimeError("stop")
    with pytest.raises(checks.CheckFailed, match="hook"):
        checks.call("f", leaves_hook, 1, module=m, raises=RuntimeError)


def test_new_object():
    t = torch.ones(4)
    checks.new_object("ok", t.clone(), t)
    for bad in (t, t.view(2, 2), t[1:]):
        with pytest.raises(checks.CheckFailed):
            checks.new_object("f", bad, t)
    d = {}
    with pytest.raises(checks.CheckFailed):
        checks.new_object("f", d, d)


_SILENT = {"print", "guard", "equal", "close", "at_most", "one_of", "same", "unchanged",
           "new_object", "rng_unchanged", "bits_equal"}


@pytest.mark.parametrize("lab", LABS)
def test_no_test_cell_ends_in_a_value(lab):
    """nbgrader reads a number that a graded cell displays as partial credit (and fails
    the whole submission when it exceeds the cell's points): a test cell's last statement
    must not be an expression with a value (checks.call returns the learner's result)."""
    bad = []
    for c in mutants.lab_cells(lab):
        if c.kind != "test":
            continue
        body = ast.parse(c.source).body
        last = body[-1] if body else None
        if isinstance(last, ast.Expr):
            f = last.value.func if isinstance(last.value, ast.Call) else None
            name = getattr(f, "attr", None) or getattr(f, "id", None)
            if name not in _SILENT and not (name or "").startswith("_"):  # _helpers: the cell's own
                bad.append(f"{c.grade_id}: {ast.unparse(last)[:80]}")
    assert not bad, f"{lab}: test cells ending in a displayed value: {bad}"


# The engine restore checks of labs 1-15: the test cells that plug the learner's code (or
# decision) into the engine on fresh prompts and show the broken configuration failing
# the same check. Together they carry at least 40 % of each lab's points (DESIGN.md's lab
# template), so a learner cannot reach a pass on unit tests alone.
RESTORE_CELLS = {
    "ch01": ["test_restore"], "ch02": ["test_size_accuracy"], "ch03": ["test_restore"],
    "ch04": ["test_restore"], "ch05": ["test_restore"], "ch06": ["test_restore"],
    "ch07": ["test_restore"], "ch08": ["test_restore"], "ch09": ["test_restore"],
    "ch10": ["test_restore_norm", "test_restore_overflow"], "ch11": ["test_restore_long",
                                                                     "test_restore_scaling"],
    "ch12": ["test_restore"], "ch13": ["test_steps_engine"], "ch14": ["test_engine"],
    "ch15": ["test_engine"], "ch16": ["test_engine"], "ch17": ["test_restore"],
    "ch18": ["test_restore"], "ch19": ["test_restore"], "ch20": ["test_restore"],
    "ch21": ["test_restore"], "ch22": ["test_restore"], "ch23": ["test_restore"],
    "ch24": ["test_restore_replay", "test_restore_safe"], "ch25": ["test_restore"],
    "ch26": ["test_restore_chat", "test_restore_truncation"], "ch27": ["test_restore"],
    "ch28": ["test_engine"], "ch29": ["test_restore"],
    "ch30": ["test_engine_nvfp4", "test_engine_matmul"],
}


@pytest.mark.parametrize("lab", sorted(RESTORE_CELLS))
def test_restore_check_carries_at_least_40_percent(lab):
    points = {c.grade_id: c.points for c in mutants.lab_cells(lab) if c.kind == "test"}
    missing = [g for g in RESTORE_CELLS[lab] if g not in points]
    assert not missing, f"{lab}: no test cell {missing} (renamed? update RESTORE_CELLS)"
    restore, total = sum(points[g] for g in RESTORE_CELLS[lab]), sum(points.values())
    share = restore / total
    print(f"{lab}: restore check {restore:g} of {total:g} points ({share:.0%})")
    assert share >= 0.4, f"{lab}: the restore check carries {share:.0%} of the points (< 40 %)"


def test_not_calling_finds_the_reference_however_it_is_reached():
    from minivllm.quantization import weight_quant as wq

    ref = [wq.quantize_int8_group]
    ns = {"wq": wq, "_ref": wq.quantize_int8_group, "torch": torch}
    bad = {
        "module attribute": "def f(w, g):\n    return wq.quantize_int8_group(w, g)\n",
        "renamed global": "def f(w, g):\n    return _ref(w, g)\n",
        "import inside": ("def f(w, g):\n    from minivllm.quantization.weight_quant import "
                          "quantize_int8_group\n    return quantize_int8_group(w, g)\n"),
        "module import inside": ("def f(w, g):\n    import minivllm.quantization.weight_quant"
                                 " as m\n    return m.quantize_int8_group(w, g)\n"),
        "in a lambda": "def f(w, g):\n    h = lambda: _ref(w, g)\n    return h()\n",
    }
    for label, src in bad.items():
        g = dict(ns)
        exec(src, g)
        with pytest.raises(checks.CheckFailed, match="f uses"):
            checks.not_calling("f", g["f"], ref, "write it yourself")
    g = dict(ns)
    exec("def f(w, g):\n    return torch.round(w / g), torch.ones(1)\n", g)
    checks.not_calling("f", g["f"], ref, "write it yourself")   # torch is allowed
