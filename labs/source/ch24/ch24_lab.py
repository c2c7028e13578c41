# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown] nbgrader={"grade": false, "grade_id": "intro", "locked": true, "schema_version": 3, "solution": false, "task": false}
# # Lab 24: pad, write in place, and know when not to replay
#
# In chapter 24 a graph replay ran what was captured and nothing else: a forward hook
# registered after capture ran for 1 of 6 steps, a planted fault was missed on every
# decode step, and a batch of 3 ran in the size-4 graph with one padding row (slot -1,
# length 0). This lab starts from a **broken graph runner** (CPU emulation,
# `emulate_cuda_graphs=True`, not a vLLM option) with two faults: its inputs are written
# into **fresh tensors** instead of the static buffers the capture reads (so every replay
# reads whatever the buffers last held), and it replays **while hooks or patches are
# active**. You write the three pieces that make it right; the last tests plug them into
# the engine's emulated graphs.
#
# 1. `pad_batch(inputs, capture_sizes)`: choose the graph and pad the rows, 3 points;
# 2. `write_static(buffers, step_inputs)`: write a step's inputs into the static buffers,
#    in place, 2 points;
# 3. `graph_safe(model, suspended)`: may this step replay a graph?, 2 points;
#    then two restore checks, 5 points.
#
# The grader calls your functions on **new** inputs (other batch sizes, other capture
# sizes, other buffers and modules). Run the cells in order. Do not edit the setup and
# test cells.

# %% nbgrader={"grade": false, "grade_id": "setup", "locked": true, "schema_version": 3, "solution": false, "task": false}
import importlib

import grading.checks as checks  # first import: records the original functions
import torch

from minivllm import LLM, SamplingParams
from minivllm.precision import evalsets, faults
from minivllm.worker.cuda_graph import capture_sizes

torch.manual_seed(0)
MODEL = "smollm2-135m-instruct"
NAMES = ("input_ids", "positions", "slot_mapping", "seq_lens")
PAD = {"input_ids": 0, "positions": 0, "slot_mapping": -1, "seq_lens": 0}
_engines = {}


def engines(eager=True):
    """The graph engine (emulated graphs, sizes 1, 2, 4) and, with ``eager``, an eager
    twin; float32, built on first use and kept."""
    kw = dict(dtype="float32", max_model_len=64, max_num_seqs=4, num_gpu_blocks_override=24)
    if "graph" not in _engines:
        _engines["graph"] = LLM(MODEL, **kw, emulate_cuda_graphs=True)
    if eager and "eager" not in _engines:
        _engines["eager"] = LLM(MODEL, **kw)
    return _engines["graph"], _engines.get("eager")


def broken_write_static(buffers, step_inputs):
    """The runner's fault: each input becomes a new tensor. The dict now holds fresh
    tensors; the captured graph still reads the old ones."""
    for name, values in step_inputs.items():
        if name == "block_tables":
            rows = [r + [0] * (buffers[name].shape[1] - len(r)) for r in values]
            buffers[name] = torch.tensor(rows, dtype=buffers[name].dtype)
        else:
            buffers[name] = torch.tensor(values, dtype=buffers[name].dtype)


print("capture sizes for up to 32 sequences:", capture_sizes(32))

# %% [markdown] nbgrader={"grade": false, "grade_id": "task1", "locked": true, "schema_version": 3, "solution": false, "task": false}
# ## Task 1: choose the graph and pad the batch (3 points)
#
# `inputs` is a dict with the keys `"input_ids"`, `"positions"`, `"slot_mapping"` and
# `"seq_lens"`, each a list of B Python ints (one per real row: its next token, that
# token's position, the cache slot its K/V goes to, the sequence length after it).
# `capture_sizes` is a list of the captured batch sizes, distinct positive ints in
# ascending order.
#
# Return a tuple `(size, padded)`: `size` is the smallest captured size that holds the B
# rows, and `padded` a **new** dict with the same four keys, each list extended to `size`
# entries with the padding row's values: token 0, position 0, slot **-1** (write nowhere)
# and length **0** (attend to nothing). Leave `inputs` unchanged. Raise `ValueError` when
# B is 0, when the four lists do not all have B entries, or when B is larger than the
# largest captured size (that step runs eagerly; a graph cannot hold it).

# %% nbgrader={"grade": false, "grade_id": "pad_batch", "locked": false, "schema_version": 3, "solution": true, "task": false}
def pad_batch(inputs: dict, capture_sizes: list) -> tuple:
    ### BEGIN SOLUTION
    lengths = {len(inputs[name]) for name in NAMES}
    if len(lengths) != 1:
        raise ValueError(f"the input lists differ in length: {sorted(lengths)}")
    b = lengths.pop()
    if b == 0 or b > capture_sizes[-1]:
        raise ValueError(f"{b} rows: a graph holds 1 to {capture_sizes[-1]}")
    size = next(s for s in capture_sizes if s >= b)
    fill = {"input_ids": 0, "positions": 0, "slot_mapping": -1, "seq_lens": 0}
    return size, {name: list(inputs[name]) + [fill[name]] * (size - b) for name in NAMES}
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "test_pad_batch_visible", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
_in = {"input_ids": [11, 12, 13], "positions": [4, 9, 2], "slot_mapping": [20, 41, 66],
       "seq_lens": [5, 10, 3]}
_size, _pad = pad_batch(_in, [1, 2, 4, 8])
checks.equal("pad_batch: size for 3 rows, sizes [1, 2, 4, 8]", _size, 4)
checks.equal("padded slot_mapping", _pad["slot_mapping"], [20, 41, 66, -1])
checks.equal("padded seq_lens", _pad["seq_lens"], [5, 10, 3, 0])
checks.equal("padded input_ids", _pad["input_ids"], [11, 12, 13, 0])
checks.equal("inputs unchanged", _in["seq_lens"], [5, 10, 3])
print("visible test passed")

# %% nbgrader={"grade": true, "grade_id": "test_pad_batch_hidden", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
### BEGIN HIDDEN TESTS
import random as _random

_rng = _random.Random(24001)
for _sizes in (capture_sizes(256), capture_sizes(20), [3, 7, 12], [1]):
    for _b in sorted({1, _sizes[-1], _rng.randint(1, _sizes[-1]), _rng.randint(1, _sizes[-1])}):
        _in = {n: [_rng.randint(1, 9999) for _ in range(_b)] for n in NAMES}
        _copy = {n: list(v) for n, v in _in.items()}
        _size, _pad = pad_batch(_in, list(_sizes))
        _want = min(s for s in _sizes if s >= _b)
        checks.equal(f"size for {_b} rows, sizes {_sizes[:6]}...", _size, _want)
        for _n in NAMES:
            checks.equal(f"padded {_n} ({_b} rows -> {_want})", list(_pad[_n]),
                         _copy[_n] + [PAD[_n]] * (_want - _b))
        checks.equal("inputs left unchanged", _in, _copy)
for _bad, _why in (({n: [] for n in NAMES}, "0 rows"),
                   ({n: [1] * 9 for n in NAMES}, "9 rows, largest size 8"),
                   ({**{n: [1, 2] for n in NAMES}, "seq_lens": [3]}, "lists of unequal length")):
    try:
        pad_batch(_bad, [1, 2, 4, 8])
    except ValueError:
        pass
    else:
        raise checks.CheckFailed(f"pad_batch accepted {_why}: a ValueError was expected")
### END HIDDEN TESTS

# %% [markdown] nbgrader={"grade": false, "grade_id": "task2", "locked": true, "schema_version": 3, "solution": false, "task": false}
# ## Task 2: write the step's inputs into the static buffers (2 points)
#
# `buffers` is a dict of the tensors the captured graph reads: `"input_ids"`,
# `"positions"`, `"slot_mapping"` (int64, `[max_size]`), `"seq_lens"` (int32,
# `[max_size]`) and `"block_tables"` (int32, `[max_size, max_blocks]`). `step_inputs`
# holds the padded lists of task 1 (`size` entries each) and `"block_tables"`: `size`
# lists of block ids, one per row, of any length up to `max_blocks` (a padding row's is
# empty).
#
# Write row i's values into row i of each buffer: entries `0 .. size - 1` of the four
# vectors, and the first `len(table)` entries of row i of `block_tables`. Change nothing
# else (rows from `size` on stay as they are), and keep every buffer **the same tensor**
# (the graph holds its address): no new tensors in the dict. Return nothing. The setup
# cell's `broken_write_static` is the fault to avoid.

# %% nbgrader={"grade": false, "grade_id": "write_static", "locked": false, "schema_version": 3, "solution": true, "task": false}
def write_static(buffers: dict, step_inputs: dict) -> None:
    ### BEGIN SOLUTION
    for name in NAMES:
        values = step_inputs[name]
        buffers[name][:len(values)].copy_(torch.tensor(values, dtype=buffers[name].dtype))
    for i, row in enumerate(step_inputs["block_tables"]):
        if row:
            buffers["block_tables"][i, :len(row)] = torch.tensor(row, dtype=torch.int32)
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "test_write_static_visible", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
_buf = {n: torch.full((8,), 7, dtype=torch.int32 if n == "seq_lens" else torch.int64)
        for n in NAMES}
_buf["block_tables"] = torch.full((8, 3), 7, dtype=torch.int32)
_objs = dict(_buf)
_step = {"input_ids": [5, 6, 0, 0], "positions": [1, 2, 0, 0], "slot_mapping": [17, 33, -1, -1],
         "seq_lens": [2, 3, 0, 0], "block_tables": [[1], [2, 4], [], []]}
write_static(_buf, _step)
checks.equal("same tensors in the dict after writing (is the buffer the one captured?)",
             {n: _buf[n] is _objs[n] for n in _objs}, {n: True for n in _objs})
checks.equal("slot_mapping buffer", _buf["slot_mapping"].tolist(), [17, 33, -1, -1, 7, 7, 7, 7])
checks.equal("block_tables rows 0-1", _buf["block_tables"][:2].tolist(), [[1, 7, 7], [2, 4, 7]])
print("visible test passed")

# %% nbgrader={"grade": true, "grade_id": "test_write_static_hidden", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
### BEGIN HIDDEN TESTS
_g = torch.Generator().manual_seed(24002)
for _max, _blocks in ((16, 5), (24, 2), (4, 9)):
    _size = int(torch.randint(1, _max + 1, (), generator=_g))
    _real = int(torch.randint(1, _size + 1, (), generator=_g))
    _storage = torch.randint(-5, 100, (3, _max), generator=_g)  # views of one tensor, as
    _buf = dict(zip(NAMES[:3], _storage.unbind(0)))             # the runner's buffers are
    _buf["seq_lens"] = torch.randint(0, 50, (_max,), generator=_g, dtype=torch.int32)
    _buf["block_tables"] = torch.randint(0, 50, (_max, _blocks), generator=_g, dtype=torch.int32)
    _before = {n: t.clone() for n, t in _buf.items()}
    _ptr = {n: (t, t.data_ptr()) for n, t in _buf.items()}
    _step = {n: [int(v) for v in torch.randint(0, 1000, (_size,), generator=_g)] for n in NAMES}
    _step["slot_mapping"][_real:] = [-1] * (_size - _real)
    _step["block_tables"] = [
        [int(v) for v in torch.randint(0, 300, (int(torch.randint(1, _blocks + 1, (), generator=_g)),),
                                       generator=_g)] if i < _real else [] for i in range(_size)]
    write_static(_buf, _step)
    checks.equal(f"the same tensors, same storage (max size {_max})",
                 {n: _buf[n] is _ptr[n][0] and _buf[n].data_ptr() == _ptr[n][1] for n in _ptr},
                 {n: True for n in _ptr})
    _want = {n: t.clone() for n, t in _before.items()}
    for _n in NAMES:
        _want[_n][:_size] = torch.tensor(_step[_n])
    for _i, _row in enumerate(_step["block_tables"]):
        _want["block_tables"][_i, :len(_row)] = torch.tensor(_row, dtype=torch.int32)
    for _n in _buf:
        checks.equal(f"{_n} after writing a step of {_size} rows into [{_max}] buffers",
                     torch.equal(_buf[_n], _want[_n]), True)
    checks.equal("the int64 storage the views share", torch.equal(
        _storage, torch.stack([_want[n] for n in NAMES[:3]])), True)
### END HIDDEN TESTS

# %% [markdown] nbgrader={"grade": false, "grade_id": "task3", "locked": true, "schema_version": 3, "solution": false, "task": false}
# ## Task 3: may this step replay a graph? (2 points)
#
# A replay runs no Python, so it must not run while Python would have done something the
# capture did not: a **forward hook** or **forward pre-hook** registered on the model or
# on any of its submodules, a **global** module hook (one that fires for every module),
# or a patch the engine announced by entering the runner's `suspended()` block
# (`suspended` counts the blocks currently entered).
#
# Return `True` when a replay is safe (no such hook anywhere, `suspended == 0`) and
# `False` otherwise. PyTorch keeps a module's hooks in the dicts `module._forward_hooks`
# and `module._forward_pre_hooks`, and the global ones in
# `torch.nn.modules.module._global_forward_hooks` and `_global_forward_pre_hooks` (same
# module). Your function is called before every decode step, so one pass over the
# modules, nothing more.

# %% nbgrader={"grade": false, "grade_id": "graph_safe", "locked": false, "schema_version": 3, "solution": true, "task": false}
def graph_safe(model: torch.nn.Module, suspended: int) -> bool:
    ### BEGIN SOLUTION
    if suspended:
        return False
    glob = torch.nn.modules.module
    if glob._global_forward_hooks or glob._global_forward_pre_hooks:
        return False
    return not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "test_graph_safe_visible", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
_net = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Sequential(torch.nn.ReLU()))
checks.equal("graph_safe(no hooks, suspended=0)", graph_safe(_net, 0), True)
checks.equal("graph_safe(no hooks, suspended=1)", graph_safe(_net, 1), False)
_h = _net[1][0].register_forward_hook(lambda m, a, o: None)
try:
    checks.equal("graph_safe(a hook on a nested module)", graph_safe(_net, 0), False)
finally:
    _h.remove()
checks.equal("graph_safe(hook removed)", graph_safe(_net, 0), True)
print("visible test passed")

# %% nbgrader={"grade": true, "grade_id": "test_graph_safe_hidden", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
### BEGIN HIDDEN TESTS
_mm = torch.nn.modules.module
_net = torch.nn.ModuleDict({"a": torch.nn.Linear(2, 2),
                            "b": torch.nn.ModuleList([torch.nn.Tanh(), torch.nn.Linear(2, 2)])})


def _noop(*args, **kwargs):
    return None


_regs = [("a forward hook on the root", lambda: _net.register_forward_hook(_noop)),
         ("a pre-hook on a deep module", lambda: _net["b"][1].register_forward_pre_hook(_noop)),
         ("a hook with kwargs", lambda: _net["b"][0].register_forward_hook(_noop, with_kwargs=True)),
         ("a global forward hook", lambda: _mm.register_module_forward_hook(_noop)),
         ("a global pre-hook", lambda: _mm.register_module_forward_pre_hook(_noop))]
for _what, _reg in _regs:
    _h = _reg()
    try:
        checks.equal(f"graph_safe with {_what}", graph_safe(_net, 0), False)
    finally:
        _h.remove()
    checks.equal(f"graph_safe after removing {_what}", graph_safe(_net, 0), True)
for _s in (1, 2, 5):
    checks.equal(f"graph_safe(suspended={_s})", graph_safe(_net, _s), False)
_bh = _net["a"].register_full_backward_hook(_noop)  # a backward hook: no forward runs it
try:
    checks.equal("graph_safe with only a backward hook", graph_safe(_net, 0), True)
finally:
    _bh.remove()
### END HIDDEN TESTS

# %% [markdown] nbgrader={"grade": false, "grade_id": "restore", "locked": true, "schema_version": 3, "solution": false, "task": false}
# ## Restore checks (5 points)
#
# **Replay (3 points).** The grader swaps your `pad_batch` and `write_static` into the
# graph engine's runner (they fill its static buffers before each replay) and
# teacher-forces fresh token sequences through its emulated graphs one decode step at a
# time, in fresh batch sizes with padding rows, one sequence in block 0. At every step the
# real rows' logits must equal, with `torch.equal`, (a) the runner's own replay with the
# engine's input code and (b) an eager forward over the same buffers; and no logit may be
# NaN or inf. The broken runner (`broken_write_static`) is measured by the same check and
# must fail it.
#
# **Replay only when safe (2 points).** The grader makes the runner ask your `graph_safe`
# before every replay, registers a forward hook on one decoder layer and generates a few
# greedy tokens: the hook must run on every step. Then it plants a fault that enters
# `suspended()` (`faults.wrong_rope_theta`) in the graph engine and in the eager twin:
# their log-probs must be equal. A runner that always replays fails both.

# %% nbgrader={"grade": true, "grade_id": "test_restore_replay", "locked": true, "points": 3, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
### BEGIN HIDDEN TESTS
import random as _random
from types import SimpleNamespace as _NS

_rng = _random.Random(24003)
_probe = {n: [1, 2, 3] for n in NAMES}
pad_batch(_probe, [1, 2, 4])  # the learner's functions first: a missing one fails here
write_static({n: torch.zeros(4, dtype=torch.int64) for n in NAMES} | {
    "block_tables": torch.zeros(4, 2, dtype=torch.int32)}, {**{n: [0, 0] for n in NAMES},
                                                          "block_tables": [[1], []]})
_graph_llm, _ = engines(eager=False)
_runner = _graph_llm.llm_engine.model_runner.cuda_graphs
_bsz = _runner.block_size
_tok = _graph_llm.get_tokenizer()
_text = evalsets.load_corpus()


def _fill_with(write):
    def fill(reqs, tables):
        ins = {"input_ids": [], "positions": [], "slot_mapping": [], "seq_lens": []}
        for r in reqs:
            p = r.num_computed_tokens
            t = tables[r.request_id]
            ins["input_ids"].append(r.all_token_ids[p])
            ins["positions"].append(p)
            ins["slot_mapping"].append(t[p // _bsz] * _bsz + p % _bsz)
            ins["seq_lens"].append(p + 1)
        size, padded = pad_batch(ins, list(_runner.sizes))
        padded["block_tables"] = [tables[r.request_id] for r in reqs] + [[]] * (size - len(reqs))
        bufs = {"input_ids": _runner.input_ids, "positions": _runner.positions,
                "slot_mapping": _runner.slot_mapping, "seq_lens": _runner.seq_lens,
                "block_tables": _runner.block_tables}
        write(bufs, padded)
        return size
    return fill


_n = 3  # padded to 4: one padding row
_L = 4
_seqs = []
for _ in range(_n):
    _s = _rng.randrange(0, len(_text) - 600)
    _seqs.append(_tok.encode(_text[_s:_s + 600])[:_L])
_blocks = [0] + _rng.sample(range(1, 24), _n - 1)  # one sequence in block 0
_tables = {str(i): [_blocks[i]] for i in range(_n)}


def _teacher_force(fill, rows, ref=None):
    """Per step: (replay rows, eager rows at the padded shape or None, padding finite);
    with ``ref``, no eager rows, and it stops at the first step that differs from ref."""
    out = []
    _runner._fill_inputs = fill
    size = next(s for s in _runner.sizes if s >= len(rows))
    try:
        with torch.inference_mode():
            for p in range(_L):
                reqs = [_NS(request_id=str(i), num_computed_tokens=p, all_token_ids=_seqs[i])
                        for i in rows]
                logits = _runner.run(reqs, _tables)[0].clone()
                finite = bool(torch.isfinite(_runner.graphs[size][1][0]).all())
                eager_rows = None if ref is not None else _runner._forward(size)[0][:len(rows)].clone()
                out.append((logits, eager_rows, finite))
                if ref is not None and not torch.equal(logits, ref[p][0]):
                    break
    finally:
        del _runner._fill_inputs  # back to the engine's own
    return out


_rows = list(range(_n))
_ref = _teacher_force(_runner._fill_inputs, _rows)
_mine = _teacher_force(_fill_with(write_static), _rows, ref=_ref)
_bad = _teacher_force(_fill_with(broken_write_static), _rows, ref=_ref)


def _ok(run):
    return len(run) == _L and all(
        torch.equal(m[0], r[0]) and torch.equal(r[0], r[1]) and m[2] for m, r in zip(run, _ref))


print(f"{_n} fresh sequences (blocks {_blocks}), {_L} decode steps in the size-"
      f"{next(s for s in _runner.sizes if s >= _n)} graph: yours pass {_ok(_mine)}, "
      f"the broken runner passes {_ok(_bad)}")
if _ok(_bad):
    raise checks.CheckFailed("the check does not discriminate: the broken runner passes it")
checks.equal("the engine's own replay equals its eager forward at every step",
             all(torch.equal(_r[0], _r[1]) for _r in _ref), True)
for _p, (_m, _r) in enumerate(zip(_mine, _ref)):
    checks.equal(f"step {_p}: padding and real rows finite", _m[2], True)
    checks.equal(f"step {_p}: real rows torch.equal the engine's replay and its eager forward "
                 f"(max |diff| {(_m[0] - _r[0]).abs().max().item():.3g})",
                 torch.equal(_m[0], _r[0]), True)
checks.equal("decode steps run", len(_mine), _L)
### END HIDDEN TESTS

# %% nbgrader={"grade": true, "grade_id": "test_restore_safe", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
### BEGIN HIDDEN TESTS
import random as _random

_rng = _random.Random(24004)
graph_safe(torch.nn.Linear(1, 1), 0)  # the learner's function first
_graph_llm, _eager_llm = engines()
_runner = _graph_llm.llm_engine.model_runner.cuda_graphs


def _can_run_with(safe):
    def can_run(scheduled):
        if not safe(_runner.model, _runner._suspended):
            return False
        return 0 < len(scheduled) <= _runner.max_batch_size and all(
            n == 1 and req.score is None for req, n in scheduled)
    return can_run


_prompt = _rng.choice(["Name three primary colours.", "What is the boiling point of water?",
                       "Write a short greeting for a colleague."])
_n_tok = _rng.choice([4, 5])
_sp = SamplingParams(temperature=0, max_tokens=_n_tok, ignore_eos=True, logprobs=1)
_layer = _rng.randrange(len(_runner.model.layers))


def _hook_calls_and_fault(safe, stop_early=False):
    """(calls of a hook on one layer in _n_tok steps, fault log-probs equal to eager's);
    with stop_early, (calls, None) when the hook already missed a step."""
    _runner.can_run = _can_run_with(safe)
    calls = []
    try:
        h = _runner.model.layers[_layer].register_forward_hook(lambda m, a, o: calls.append(1))
        try:
            _graph_llm.generate([_prompt], _sp, use_tqdm=False)
        finally:
            h.remove()
        if stop_early and len(calls) != _n_tok:
            return len(calls), None
        with faults.wrong_rope_theta(_graph_llm, 1, 100.0), \
                faults.wrong_rope_theta(_eager_llm, 1, 100.0):
            a = _graph_llm.generate([_prompt], _sp, use_tqdm=False)[0].outputs[0]
            b = _eager_llm.generate([_prompt], _sp, use_tqdm=False)[0].outputs[0]
    finally:
        del _runner.can_run
    same = a.token_ids == b.token_ids and all(
        {t: lp.logprob for t, lp in x.items()} == {t: lp.logprob for t, lp in y.items()}
        for x, y in zip(a.logprobs, b.logprobs))
    return len(calls), same


_mine = _hook_calls_and_fault(graph_safe)
_bad = _hook_calls_and_fault(lambda model, suspended: True, stop_early=True)
print(f"hook on layer {_layer}, {_n_tok} steps: yours ran it {_mine[0]} times, the always-replay "
      f"runner {_bad[0]}; fault log-probs equal to eager: yours {_mine[1]}, always-replay {_bad[1]}")
if _bad == (_n_tok, True):
    raise checks.CheckFailed("the check does not discriminate: the always-replay runner passes it")
checks.equal(f"the hook ran on every one of {_n_tok} steps", _mine[0], _n_tok)
checks.equal("under a planted fault, graph-engine log-probs equal the eager engine's", _mine[1], True)
### END HIDDEN TESTS
