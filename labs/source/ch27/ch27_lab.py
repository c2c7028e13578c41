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
# # Lab 27: solve a mystery engine
#
# Chapter 27 found a fault it did not know about with three tools: a minimal
# reproduction, a configuration bisection and a layer-by-layer diff. In this lab you
# write the three tools yourself and the grader turns them on **fresh mystery engines**
# (`minivllm.precision.mystery`): each has one fault from the fault library planted in
# one decoder layer, only in engines whose configuration has one trigger key at its bad
# value. Your bisection must name that key exactly, your locator the layer and the block
# exactly; and the bad configuration must fail the KL check that the configuration with
# your culprit reverted passes.
#
# You write three functions (the grader also calls them on synthetic inputs it makes
# up, so a function that only works on the examples here will not pass):
#
# 1. `minimize_prompt(bad, good, ids)`: the shortest prefix that flips top-1, 3 points;
# 2. `bisect_config(good, bad, measure, threshold)`: the culprit keys, 4 points;
# 3. `locate(bad_states, good_states)`: the layer and block of the first jump, 3 points;
#    then the restore check on a fresh mystery, 7 points.
#
# Engines are built only when you call `engine()` or `example_measure()` (each build
# takes one to two seconds). Run the cells in order. Do not edit the setup and test cells.

# %% nbgrader={"grade": false, "grade_id": "setup", "locked": true, "schema_version": 3, "solution": false, "task": false}
import importlib
import math

import grading.checks as checks  # first import: records the original functions
import torch

from minivllm import LLM
from minivllm.precision import evalsets, metrics
from minivllm.precision.bisect import KLMeasure
from minivllm.precision.layer_diff import capture_hidden_states, relative_error
from minivllm.precision.mystery import GOOD_CONFIG, mystery

BASE = {"model": "smollm2-135m-instruct", "max_model_len": 128, "num_gpu_blocks_override": 16}
THRESHOLD = 1e-8  # nats: a configuration is bad when its mean KL is at or above this
_ENGINES = {}


def engine():
    """The good engine (float32, the engine's defaults), built once."""
    if "good" not in _ENGINES:
        _ENGINES["good"] = LLM(**BASE, **GOOD_CONFIG)
    return _ENGINES["good"]


def windows(n, length, skip=0):
    """n consecutive corpus windows of ``length`` tokens (after skipping ``skip``)."""
    if "corpus" not in _ENGINES:  # tokenized once
        _ENGINES["corpus"] = engine().get_tokenizer().encode(evalsets.load_corpus(),
                                                             add_special_tokens=False)
    ids = _ENGINES["corpus"]
    return [ids[i * length:(i + 1) * length] for i in range(skip, skip + n)]


def kl_measure(m, prompts):
    """A KLMeasure for mystery ``m``: builds each configuration with ``m.build`` and
    returns its mean KL against the good engine on ``prompts``."""
    good = engine()
    ref = good.score(prompts, output="logits")
    measure = KLMeasure(prompts, ref, base=BASE, build=m.build)
    again = good.score(prompts, output="logits")  # the good configuration: no new build
    measure.cache[measure.key(GOOD_CONFIG)] = sum(
        metrics.mean_kl(r, c) for r, c in zip(ref, again)) / len(prompts)
    return measure


example = mystery(11)  # yours to practise on: example.good, example.bad, example.build(cfg)
print(example)
print("keys the bad configuration changes:",
      [k for k in example.bad if example.bad[k] != example.good[k]])

# %% [markdown] nbgrader={"grade": false, "grade_id": "task1", "locked": true, "schema_version": 3, "solution": false, "task": false}
# ## Task 1: the shortest prefix that flips top-1 (3 points)
#
# `bad` and `good` are scoring functions: each takes a list of token ids and returns a
# float tensor `[len(ids), vocab]` whose row `t` holds the logits of the token after
# `ids[0..t]` (a causal model: row `t` depends on `ids[:t + 1]` only, e.g.
# `lambda ids: llm.score(ids, output="logits")`). Return the shortest prefix
# `ids[:k]` (a list of ints, `k >= 1`) whose **last** row has a different argmax under
# `bad` than under `good`, or `None` if no prefix flips. Logits that change without
# changing the argmax do not count. Each scoring function may be called **at most
# twice** (an engine scores a whole sequence in one pass; one call per prefix would cost
# a pass per token).

# %% nbgrader={"grade": false, "grade_id": "minimize_prompt", "locked": false, "schema_version": 3, "solution": true, "task": false}
def minimize_prompt(bad, good, ids):
    ### BEGIN SOLUTION
    ids = list(ids)
    b, g = bad(ids), good(ids)
    differ = (b.argmax(-1) != g.argmax(-1)).nonzero().flatten()
    if len(differ) == 0:
        return None
    return ids[:int(differ[0]) + 1]
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "test_minimize_visible", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()


def _toy(flip_at, nudge_at):
    """A 5-token vocabulary; the bad model nudges one row a little and flips another."""
    def score(ids, bad):
        rows = torch.zeros(len(ids), 5)
        for t, i in enumerate(ids):
            rows[t, i % 5] = 2.0
            if bad and t == nudge_at:
                rows[t, (i + 1) % 5] = 1.0  # changed, argmax the same
            if bad and t >= flip_at:
                rows[t, (i + 1) % 5] = 3.0  # argmax flipped
        return rows
    return (lambda ids: score(ids, True)), (lambda ids: score(ids, False))


_bad, _good = _toy(flip_at=4, nudge_at=1)
checks.equal("minimize_prompt(toy flipping from row 4)",
             minimize_prompt(_bad, _good, [3, 1, 4, 1, 5, 9, 2, 6]), [3, 1, 4, 1, 5])
_bad, _good = _toy(flip_at=99, nudge_at=2)
checks.equal("minimize_prompt(toy that never flips)", minimize_prompt(_bad, _good, [7, 7, 7]),
             None)
print("visible test passed")

# %% nbgrader={"grade": true, "grade_id": "test_minimize_hidden", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
### BEGIN HIDDEN TESTS
import random as _random

_rng = _random.Random(27001)


def _counted(fn, calls):
    def wrapped(ids):
        calls.append(len(ids))
        return fn(ids)
    return wrapped


def _causal_pair(V, trigger, need):
    """good: row t peaks at sum(ids[:t+1]) % V; bad: the same, nudged at every row, and
    flipped once ``trigger`` has occurred ``need`` times in ids[:t+1]."""
    def score(ids, bad):
        rows = torch.zeros(len(ids), V)
        s, seen = 0, 0
        for t, i in enumerate(ids):
            s, seen = s + i, seen + (i == trigger)
            rows[t, s % V] = 4.0
            if bad:
                rows[t, (s + 2) % V] += 1.5
                if seen >= need:
                    rows[t, (s + 1) % V] = 6.0
        return rows
    return (lambda ids: score(ids, True)), (lambda ids: score(ids, False))


for _case in range(6):
    _V = _rng.randrange(7, 40)
    _ids = [_rng.randrange(_V) for _ in range(_rng.randrange(20, 60))]
    _trigger, _need = _ids[_rng.randrange(len(_ids))], _rng.choice([1, 2, 3])
    if _case == 5:
        _trigger = _V + 1  # never occurs: no flip
    _b, _g = _causal_pair(_V, _trigger, _need)
    _cb, _cg = [], []
    _got = minimize_prompt(_counted(_b, _cb), _counted(_g, _cg), list(_ids))
    _seen = [sum(1 for x in _ids[:t + 1] if x == _trigger) for t in range(len(_ids))]
    _first = next((t for t in range(len(_ids)) if _seen[t] >= _need), None)
    _want = None if _first is None else _ids[:_first + 1]
    checks.equal(f"minimize_prompt on {len(_ids)} ids (flip once token {_trigger} occurs "
                 f"{_need}x)", _got, _want)
    checks.at_most("calls to bad", len(_cb), 2)
    checks.at_most("calls to good", len(_cg), 2)

# a real engine: a mystery fault planted in place, against the same engine without it
_m = mystery(_rng.randrange(10 ** 6), faults=["fp16_input_rmsnorm"])
_llm = engine()
_ids = windows(1, 40, skip=_rng.randrange(2, 12))[0]
_scored = {}  # the grader's own scores, kept so that the reference reuses them


def _bad_engine(ids):
    if ("bad", tuple(ids)) not in _scored:
        with _m.plant(_llm):
            _scored["bad", tuple(ids)] = _llm.score(list(ids), output="logits")
    return _scored["bad", tuple(ids)].clone()


def _good_engine(ids):
    if ("good", tuple(ids)) not in _scored:
        _scored["good", tuple(ids)] = _llm.score(list(ids), output="logits")
    return _scored["good", tuple(ids)].clone()


_got = minimize_prompt(_bad_engine, _good_engine, _ids)
_rows_b, _rows_g = _bad_engine(_ids), _good_engine(_ids)
_flips = (_rows_b.argmax(-1) != _rows_g.argmax(-1)).nonzero().flatten().tolist()
_want = _ids[:_flips[0] + 1] if _flips else None
print(f"engine: top-1 flips at rows {_flips[:8]} of {len(_ids)}; your prefix: "
      f"{None if _got is None else len(_got)} tokens")
checks.equal("minimize_prompt on a mystery engine (40 corpus tokens)", _got, _want)
if _want is not None:  # the prefix alone reproduces it
    checks.equal("the prefix scored alone flips top-1",
                 bool(_bad_engine(_got)[-1].argmax() != _good_engine(_got)[-1].argmax()), True)
### END HIDDEN TESTS

# %% [markdown] nbgrader={"grade": false, "grade_id": "task2", "locked": true, "schema_version": 3, "solution": false, "task": false}
# ## Task 2: bisect the configuration (4 points)
#
# `good` and `bad` are dicts of engine arguments (the same keys; values differ on some).
# `measure(cfg)` returns a number for a configuration (lower is better: the mean KL
# against a float32 reference, built and scored, 1-2 s per call); a configuration is
# **bad** when its measure is `>= threshold` or not finite. Setting a key "to its bad
# value" means `cfg[key] = bad[key]`.
#
# Return the **culprits** as a sorted list of keys: the keys you get by
#
# 1. finding a smallest set of keys whose bad values, set together on the good
#    configuration, make it bad (no key of it can be left out);
# 2. reverting that set in the bad configuration (setting those keys back to their good
#    values); if it still measures bad, repeat from 1 between the good configuration and
#    this one.
#
# So a single culprit gives `[key]`, two keys that only break the configuration together
# give both, two keys that each break it alone give both, and a key that never matters
# never appears. Raise `ValueError` when there is nothing to bisect: the configurations
# are equal, `good` measures bad, or `bad` measures good.
#
# Measurements are expensive: with one culprit among `n` differing keys, your function
# may call `measure` at most `2 * ceil(log2(n)) + 4` times (trying each key alone costs
# `n + 2`). Hint: order the differing keys and binary-search the shortest prefix of them
# whose bad values break the good configuration; its last key is a culprit. Do not call
# `minivllm.precision.bisect` (it would pass and teach nothing).

# %% nbgrader={"grade": false, "grade_id": "bisect_config", "locked": false, "schema_version": 3, "solution": true, "task": false}
def bisect_config(good, bad, measure, threshold):
    ### BEGIN SOLUTION
    diff = [k for k in bad if good[k] != bad[k]]
    if not diff:
        raise ValueError("the configurations are equal: nothing to bisect")
    memo = {}

    def broken(keys):
        key = frozenset(keys)
        if key not in memo:
            cfg = dict(good)
            cfg.update({k: bad[k] for k in keys})
            memo[key] = not (measure(cfg) < threshold)
        return memo[key]

    if broken([]):
        raise ValueError("the good configuration measures bad")
    if not broken(diff):
        raise ValueError("the bad configuration measures good")
    culprits, rest = [], list(diff)
    while broken(rest):
        found, cands = [], list(rest)
        while not (found and broken(found)):
            lo, hi = 0, len(cands)
            while hi - lo > 1:
                mid = (lo + hi) // 2
                if broken(found + cands[:mid]):
                    hi = mid
                else:
                    lo = mid
            found.append(cands[hi - 1])
            cands = cands[:hi - 1]
        culprits += found
        rest = [k for k in rest if k not in found]
    return sorted(culprits)
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "test_bisect_visible", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
_g = {"dtype": "float32", "block_size": 16, "kv_cache_dtype": "auto"}
_b = {"dtype": "float32", "block_size": 32, "kv_cache_dtype": "fp8_e4m3"}
_got = bisect_config(_g, _b, lambda c: 7e-3 if c["kv_cache_dtype"] == "fp8_e4m3" else 0.0, 1e-8)
checks.equal("bisect_config(fp8 KV hidden with block_size 32)", _got, ["kv_cache_dtype"])
print("visible test passed")

# %% nbgrader={"grade": true, "grade_id": "test_bisect_hidden", "locked": true, "points": 3, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
### BEGIN HIDDEN TESTS
import random as _random

_rng = _random.Random(27002)


def _synthetic(n, rule):
    names = [f"key_{_rng.randrange(10 ** 6)}_{i}" for i in range(n)]
    _rng.shuffle(names)
    good = {k: _rng.choice([0, "off", False]) for k in names}
    bad = {k: ("changed", good[k]) for k in names}
    calls = []

    def measure(cfg):
        calls.append(dict(cfg))
        hit = rule([k for k in names if cfg[k] == bad[k]])
        return _rng.choice([1e-3, 0.4, math.inf, math.nan]) if hit else _rng.choice([0.0, 3e-12])
    return names, good, bad, measure, calls


for _n in (1, 5, 12, 21):  # one culprit
    _names, _gd, _bd, _meas, _calls = _synthetic(_n, lambda on: _c in on)
    _c = _rng.choice(_names)
    _got = bisect_config(_gd, _bd, _meas, 1e-8)
    checks.equal(f"one culprit among {_n} keys", _got, [_c])
    checks.at_most(f"measurements for one culprit among {_n} keys", len(_calls),
                   2 * math.ceil(math.log2(_n)) + 4 if _n > 1 else 4)
_names, _gd, _bd, _meas, _calls = _synthetic(10, lambda on: _a in on and _z in on)
_a, _z = _rng.sample(_names, 2)
checks.equal("two keys that only break together", bisect_config(_gd, _bd, _meas, 1e-8),
             sorted([_a, _z]))
_names, _gd, _bd, _meas, _calls = _synthetic(10, lambda on: _a in on or _z in on)
_a, _z = _rng.sample(_names, 2)
checks.equal("two keys that each break it alone", bisect_config(_gd, _bd, _meas, 1e-8),
             sorted([_a, _z]))
# a measure exactly at the threshold is bad (">= threshold")
_names, _gd, _bd, _meas, _calls = _synthetic(6, lambda on: _c in on)
_c = _rng.choice(_names)
checks.equal("one culprit among 6 keys whose measure is exactly the threshold",
             bisect_config(_gd, _bd, lambda c: 2.5e-4 if c[_c] == _bd[_c] else 0.0, 2.5e-4), [_c])
for _what, _gd2, _bd2, _val in (("equal configurations", {"a": 1}, {"a": 1}, 0.0),
                                ("good measures bad", {"a": 1}, {"a": 2}, 1.0),
                                ("bad measures good", {"a": 1}, {"a": 2}, 0.0)):
    try:
        bisect_config(_gd2, _bd2, lambda c: _val, 1e-8)
    except ValueError:
        pass
    else:
        raise checks.CheckFailed(f"bisect_config must raise ValueError when {_what}")
### END HIDDEN TESTS

# %% [markdown] nbgrader={"grade": false, "grade_id": "task3", "locked": true, "schema_version": 3, "solution": false, "task": false}
# ## Task 3: where does it start? (3 points)
#
# `bad_states` and `good_states` are what `capture_hidden_states(llm, ids)` returns for
# the bad and the good engine on the same tokens: dicts from capture point to a float64
# tensor `[T, hidden]`, with the points `"embed_tokens"`, then for each decoder layer `i`
# `"layers.{i}.self_attn"` (attention output), `"layers.{i}.mlp"` (MLP output) and
# `"layers.{i}"` (the residual stream after the layer), then `"norm"`. The error at a
# point is `relative_error(bad, good)` (imported above: `||a - b|| / ||b||`, NaN when a
# tensor holds NaN or inf). Return `(layer, block)`:
#
# - `layer`: the first decoder layer whose residual-stream error *jumps*: it is not
#   finite, or it is above `1e-5` **and** above 10 times the largest residual error
#   before it (the embeddings' error included). `(0, None)` if the embeddings' error is
#   not finite; `(None, None)` if no layer jumps;
# - `block`: in that layer, the first of `"self_attn"`, `"mlp"` whose own error jumps
#   against the same block's error in the layer before (not finite, or above `1e-5` and
#   10 times it; in layer 0, or when the previous error is not finite, "before" counts as
#   0); `None` if neither does.
#
# Not the layer with the largest error: errors grow after the fault. Do not call
# `layer_diff` or `find_first_jump` (they would pass and teach nothing).

# %% nbgrader={"grade": false, "grade_id": "locate", "locked": false, "schema_version": 3, "solution": true, "task": false}
def locate(bad_states, good_states):
    ### BEGIN SOLUTION
    err = {p: relative_error(bad_states[p], good_states[p]) for p in good_states}
    n = sum(1 for p in err if p.count(".") == 1)

    def jumps(e, before):
        return not math.isfinite(e) or (e > 1e-5 and e > 10 * before)

    worst = err["embed_tokens"]
    if not math.isfinite(worst):
        return (0, None)
    for i in range(n):
        if jumps(err[f"layers.{i}"], worst):
            for block in ("self_attn", "mlp"):
                prev = err[f"layers.{i - 1}.{block}"] if i > 0 else 0.0
                if jumps(err[f"layers.{i}.{block}"], prev if math.isfinite(prev) else 0.0):
                    return (i, block)
            return (i, None)
        worst = max(worst, err[f"layers.{i}"])
    return (None, None)
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "test_locate_visible", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
_T, _H = 3, 8
_gen = torch.Generator().manual_seed(27)
_good_s = {"embed_tokens": torch.randn(_T, _H, generator=_gen, dtype=torch.float64)}
for _i in range(4):
    for _p in ("self_attn", "mlp", ""):
        _good_s[f"layers.{_i}.{_p}".rstrip(".")] = torch.randn(_T, _H, generator=_gen,
                                                               dtype=torch.float64)
_good_s["norm"] = torch.randn(_T, _H, generator=_gen, dtype=torch.float64)
_bad_s = {k: v.clone() for k, v in _good_s.items()}
for _p, _e in (("layers.2.mlp", 1e-2), ("layers.2", 1e-3), ("layers.3.self_attn", 3e-3),
               ("layers.3.mlp", 5e-2), ("layers.3", 2e-2), ("norm", 2e-2)):
    _bad_s[_p] = _good_s[_p] * (1 + _e)
checks.equal("locate(a fault in layer 2's MLP, 4 layers)", locate(_bad_s, _good_s), (2, "mlp"))
checks.equal("locate(identical states)", locate(_good_s, _good_s), (None, None))
print("visible test passed")

# %% nbgrader={"grade": true, "grade_id": "test_locate_hidden", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
### BEGIN HIDDEN TESTS
import random as _random

from minivllm.precision.layer_diff import find_first_jump

_rng = _random.Random(27003)


def _fake_states(L, jump, block, noise, nan=False):
    g = torch.Generator().manual_seed(_rng.randrange(2 ** 31))
    names = ["embed_tokens"] + [f"layers.{i}{s}" for i in range(L)
                                for s in (".self_attn", ".mlp", "")] + ["norm"]
    good = {p: torch.randn(4, 16, generator=g, dtype=torch.float64) for p in names}
    bad = {}
    for p in names:
        i = int(p.split(".")[1]) if p.startswith("layers.") else (-1 if p == "embed_tokens" else L)
        e = noise * (1.3 ** max(i, 0))  # smooth growth: noise, not a jump
        if jump is not None and i >= jump:
            e = max(e, 3e-3 * (1.5 ** (i - jump)))
            if i == jump and p.endswith(("self_attn", "mlp")) and not p.endswith(block):
                e = noise * (1.3 ** i)
        bad[p] = good[p] + e * torch.randn(4, 16, generator=g, dtype=torch.float64) \
            * good[p].norm() / 8
        if nan and jump is not None and (i > jump or (i == jump and (
                p.endswith(block) or p == f"layers.{i}"))):
            bad[p] = bad[p].clone()
            bad[p][0, 0] = math.nan
    return bad, good


for _case in range(8):
    _L = _rng.randrange(3, 30)
    _jump = None if _case == 0 else _rng.randrange(_L)
    _block = _rng.choice(["self_attn", "mlp"])
    _noise = (1e-7, 1e-9, 0.0)[_case] if _case < 3 else _rng.choice([0.0, 1e-9, 1e-7])
    _bad_s, _good_s = _fake_states(_L, _jump, _block, _noise, nan=_case == 7)
    _got = locate(_bad_s, _good_s)
    _errs = {p: relative_error(_bad_s[p], _good_s[p]) for p in _good_s}
    _want = find_first_jump(_errs, _L)
    checks.equal(f"locate on {_L} synthetic layers (planted: "
                 f"{None if _jump is None else (_jump, _block)}{', NaN' if _case == 7 else ''})",
                 tuple(_got) if isinstance(_got, list) else _got, _want)



def _crafted(errs, L):
    """States whose errors are exactly `errs` (missing points: 0): good is a unit vector,
    bad adds the error along another axis, so ||bad - good|| / ||good|| is the error itself."""
    names = ["embed_tokens"] + [f"layers.{i}{s}" for i in range(L)
                                for s in (".self_attn", ".mlp", "")] + ["norm"]
    good = {p: torch.tensor([[1.0, 0.0]], dtype=torch.float64) for p in names}
    bad = {p: torch.tensor([[1.0, errs.get(p, 0.0)]], dtype=torch.float64) for p in names}
    return bad, good


# the edges of "jumps": exactly 1e-5 is not above it; 1.5e-5 is (from 0); 7e-6 is not;
# exactly 10x the largest error before is not above it, 10.5x is, 9.5x is not; a layer
# whose blocks do not jump gives (layer, None), even if a later layer's block would; in
# layer 1 a block compares with layer 0's; a non-finite block before counts as 0; a
# non-finite embedding error gives (0, None)
_edges = [
    ("exactly 1e-5 in layer 0", {"layers.0": 1e-5, "layers.0.mlp": 1e-5}, 3),
    ("1.5e-5 in layer 1", {"layers.1": 1.5e-5, "layers.1.mlp": 1.5e-5}, 3),
    ("7e-6 in layer 1", {"layers.1": 7e-6, "layers.1.mlp": 7e-6}, 3),
    ("embeddings 1e-4, then exactly 10x, then 10.5x",
     {"embed_tokens": 1e-4, "layers.0": 10 * 1e-4, "layers.1": 10.5 * (10 * 1e-4),
      "layers.1.self_attn": 0.5}, 3),
    ("embeddings 1e-4, then 9.5x", {"embed_tokens": 1e-4, "layers.0": 9.5e-4,
                                    "layers.0.mlp": 9.5e-4}, 3),
    ("layer 1 jumps with no block; layer 3 jumps in its MLP",
     {"layers.1": 1e-3, "layers.2": 1e-3, "layers.3": 0.5, "layers.3.mlp": 0.5}, 5),
    ("layer 1's attention 2x layer 0's, its MLP 50x",
     {"layers.0.self_attn": 1e-3, "layers.0.mlp": 1e-3, "layers.1": 0.1,
      "layers.1.self_attn": 2e-3, "layers.1.mlp": 5e-2}, 3),
    ("layer 0's attention NaN, layer 1's attention 0.5",
     {"layers.0.self_attn": math.nan, "layers.1": 1.0, "layers.1.self_attn": 0.5}, 3),
    ("embeddings NaN, the layers finite", {"embed_tokens": math.nan}, 3),
]
for _what, _errs, _L in _edges:
    _bad_s, _good_s = _crafted(_errs, _L)
    _want = find_first_jump({p: relative_error(_bad_s[p], _good_s[p]) for p in _good_s}, _L)
    _got = locate(_bad_s, _good_s)
    checks.equal(f"locate, {_what}", tuple(_got) if isinstance(_got, list) else _got, _want)

# two fresh mystery faults in a real engine (one in an MLP), each against the clean engine
_llm = engine()
_ids = windows(1, 24, skip=_rng.randrange(2, 12))[0]
_clean = capture_hidden_states(_llm, _ids)
for _kinds in (["fp16_post_attention_rmsnorm"],
               ["fp16_input_rmsnorm", "rope_theta_10000"]):
    _m = mystery(_rng.randrange(10 ** 6), faults=_kinds)
    with _m.plant(_llm):
        _faulty = capture_hidden_states(_llm, _ids)
    _got = locate(_faulty, _clean)
    _ans = _m.reveal()
    print(f"mystery {_m.seed}: you found {_got}, planted ({_ans['layer']}, {_ans['block']})")
    checks.equal(f"locate on mystery {_m.seed}", _got, (_ans["layer"], _ans["block"]))
### END HIDDEN TESTS

# %% [markdown] nbgrader={"grade": false, "grade_id": "restore", "locked": true, "schema_version": 3, "solution": false, "task": false}
# ## Restore check (7 points)
#
# The grader draws a fresh mystery, measures each configuration your `bisect_config`
# asks for (engines built from the mystery, mean KL against the good engine on two
# fresh corpus windows of 24 tokens) and checks your culprits against the planted
# trigger, exactly. It then reverts your culprits in the bad configuration: that
# configuration must pass the KL check (KL below `THRESHOLD`) and the bad configuration
# must fail the same check. Last, it builds the bad engine, captures it and the good
# engine on a fresh window and checks that your `locate` names the planted layer and
# block, exactly.

# %% nbgrader={"grade": true, "grade_id": "test_restore", "locked": true, "points": 7, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
### BEGIN HIDDEN TESTS
import random as _random

_rng = _random.Random(27004)
# your function first, on a made-up measure (fails fast before any engine is built)
checks.equal("bisect_config on a two-key probe",
             bisect_config({"p": 0, "q": 0}, {"p": 1, "q": 1},
                           lambda c: 1.0 if c["q"] == 1 else 0.0, 0.5), ["q"])
_m = mystery(_rng.randrange(10 ** 6))
_skip = _rng.randrange(2, 12)
_measure = kl_measure(_m, windows(2, 24, skip=_skip))
_culprits = bisect_config(_m.good, _m.bad, _measure, THRESHOLD)
_ans = _m.reveal()
print(f"mystery {_m.seed}: bad configuration {_m.bad}")
print(f"your culprits {_culprits}; {len(_measure.cache) - 1} configurations built")
checks.equal(f"culprits of mystery {_m.seed}", _culprits, [_ans["culprit"]])
_fixed = dict(_m.bad)
_fixed.update({k: _m.good[k] for k in _culprits})
_kl_fixed, _kl_bad = _measure(_fixed), _measure(_m.bad)
print(f"KL check (< {THRESHOLD:g}): culprit reverted {_kl_fixed:.2e}, bad configuration "
      f"{_kl_bad:.2e}")
if _kl_bad < THRESHOLD:
    raise checks.CheckFailed("the check does not discriminate: the bad configuration passes it")
checks.at_most("KL of the bad configuration with your culprits reverted", _kl_fixed,
               THRESHOLD * 0.999)
_ids = windows(1, 24, skip=_skip + 2)[0]
_bad_llm = _m.build(_m.bad)
_bad_s = capture_hidden_states(_bad_llm, _ids)
del _bad_llm
_good_s = capture_hidden_states(engine(), _ids)
_got = locate(_bad_s, _good_s)
print(f"locate: you found {_got}, planted ({_ans['layer']}, {_ans['block']})")
checks.equal(f"locate on mystery {_m.seed} (the bad engine against the good one)", _got,
             (_ans["layer"], _ans["block"]))
### END HIDDEN TESTS
