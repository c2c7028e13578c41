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
# # Lab 29: a precision regression gate and a drift monitor
#
# Chapter 29 caught planted regressions with a CI gate (an fp8 KV cache swapped in and a
# sampling default changed under the users: both failed it) and a production monitor (the
# sampling default; the fp8 cache only once requests were shadow-scored), and showed the two
# ways a gate or a monitor goes wrong: judging a mean without its interval and without
# the noise floor, and an alarm set so tight that healthy traffic trips it. This lab
# starts from that broken setup: a monitor configured too tight (`threshold=3`,
# `allowance=0`) that alarms on benign traffic. You write the three pieces:
#
# 1. `is_regression(cand_kl, noise_kl, max_kl)`: the KL rule of the gate, 3 points;
# 2. `golden_check(snapshot, rows, tol_by_dtype)`: a golden log-prob snapshot check with
#    a tolerance per dtype, 3 points;
# 3. `DriftMonitor.update(logprobs, entropies=None)`: a two-sided CUSUM over each
#    request's mean sampled-token log-prob, 3 points;
#
# then the restore check (8 points): the grader plugs your monitor into the engine
# (`LLM.set_precision_monitor`) on fresh prompts. It must stay quiet over benign traffic
# and alarm within a few requests of each planted regression, where the too-tight
# configuration fails the same check. The grader also calls your functions on inputs it
# makes up, so a function that only works on the examples here will not pass.
#
# Engines are built only by the restore check. Do not edit the setup and test cells.

# %% nbgrader={"grade": false, "grade_id": "setup", "locked": true, "schema_version": 3, "solution": false, "task": false}
import math

import grading.checks as checks  # first import: records the original functions
import numpy as np
import torch

from minivllm.precision import metrics

print("bootstrap_ci([1, 2, 3, 4]) =", metrics.bootstrap_ci([1.0, 2.0, 3.0, 4.0]))

# %% [markdown] nbgrader={"grade": false, "grade_id": "task1", "locked": true, "schema_version": 3, "solution": false, "task": false}
# ## Task 1: the KL rule of the gate (3 points)
#
# `cand_kl` holds one mean KL (nats) per evaluation sequence, candidate against
# baseline; `noise_kl` the same for the baseline against its own reordered reduction
# (the noise floor), or `None` when there is no floor; `max_kl` the tolerated mean KL.
# Return `True` (a regression) when
#
# - any value of `cand_kl` is NaN or infinite, or
# - the **lower** end of the 95 % interval of the candidate's mean is above **both**
#   `max_kl` and the **upper** end of the noise floor's interval (0 without a floor).
#
# Take both intervals with `metrics.bootstrap_ci(values)` (its defaults: sequences are
# resampled whole, 2,000 resamples, seed 0). Raise `ValueError` when `cand_kl` is empty
# or `max_kl` is negative. Return a Python `bool`.

# %% nbgrader={"grade": false, "grade_id": "is_regression", "locked": false, "schema_version": 3, "solution": true, "task": false}
def is_regression(cand_kl, noise_kl, max_kl):
    ### BEGIN SOLUTION
    cand = [float(x) for x in cand_kl]
    if not cand:
        raise ValueError("cand_kl is empty")
    if not max_kl >= 0:
        raise ValueError(f"max_kl must be >= 0, got {max_kl}")
    if not all(math.isfinite(x) for x in cand):
        return True
    floor = 0.0
    if noise_kl is not None:
        floor = metrics.bootstrap_ci([float(x) for x in noise_kl])[1]
    return bool(metrics.bootstrap_ci(cand)[0] > max(floor, max_kl))
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "test_is_regression_visible", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
_floor = [3e-11, 2e-11, 4e-11, 3e-11, 2.5e-11]
checks.equal("is_regression(fp8 KV cache: 5.4e-3 .. 1.1e-2 per window)",
             is_regression([1.1e-2, 7.4e-3, 6.1e-3, 5.4e-3, 5.6e-3], _floor, 1e-3), True)
checks.equal("is_regression(batch reorder: 0 per window)",
             is_regression([0.0, 0.0, 0.0, 0.0, 0.0], _floor, 1e-3), False)
checks.equal("is_regression(fp16 KV cache: 4e-7 per window, tolerated)",
             is_regression([4e-7, 3e-7, 5e-7, 4e-7, 4e-7], _floor, 1e-3), False)
print("visible test passed")

# %% nbgrader={"grade": true, "grade_id": "test_is_regression_hidden", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
### BEGIN HIDDEN TESTS
import random as _random

from minivllm.precision import regress as _R

_rng = _random.Random(29001)
_n = _rng.randrange(6, 10)
_s = _rng.uniform(0.7, 1.4)
_f32 = [_rng.uniform(1e-11, 5e-11) for _ in range(_n)]
_bf16 = [_s * _rng.uniform(1.5e-3, 3.5e-3) for _ in range(_n)]
_cases = {
    "clearly above the threshold": ([_s * _rng.uniform(5e-3, 9e-3) for _ in range(_n)], _f32, 1e-3, True),
    "tolerated: below max_kl": ([_s * _rng.uniform(5e-3, 9e-3) for _ in range(_n)], _f32, 2e-2, False),
    "one window carries the mean": ([0.0] * (_n - 1) + [_s * 0.05], _f32, 1e-3, False),
    "inside a noisy (bf16) floor": ([_s * _rng.uniform(1.8e-3, 2.4e-3) for _ in range(_n)], _bf16, 1e-3, False),
    "above the same threshold with a float32 floor": ([_s * _rng.uniform(1.8e-3, 2.4e-3) for _ in range(_n)], _f32, 1e-3, True),
    "a NaN window": ([1e-6] * (_n - 1) + [float("nan")], _f32, 1.0, True),
    "no floor, max_kl 0, exact zeros": ([0.0] * _n, None, 0.0, False),
    "no floor, max_kl 0, tiny drift": ([_rng.uniform(1e-9, 2e-9) for _ in range(_n)], None, 0.0, True),
}
for _name, (_c, _nz, _mk, _want) in _cases.items():
    _got = is_regression(list(_c), None if _nz is None else list(_nz), _mk)
    checks.equal(f"is_regression({_name})", _got, _want)
    checks.equal(f"is_regression({_name}) against minivllm.precision.regress", _got,
                 _R.is_regression(_c, _nz, _mk))
for _args in (([], _f32, 1e-3), ([1e-3], _f32, -1.0)):
    try:
        is_regression(*_args)
    except ValueError:
        pass
    else:
        raise AssertionError(f"is_regression{_args!r} should raise ValueError")
### END HIDDEN TESTS
print("hidden test passed")

# %% [markdown] nbgrader={"grade": false, "grade_id": "task2", "locked": true, "schema_version": 3, "solution": false, "task": false}
# ## Task 2: a golden snapshot with per-dtype tolerances (3 points)
#
# `snapshot` is a dict: `snapshot["dtype"]` (e.g. `"bfloat16"`), `snapshot["token_ids"]`
# (a list of sequences, each a list of `T` ints) and `snapshot["logprobs"]` (for each
# sequence, `T - 1` floats: the log-prob of token `t + 1` given tokens `0..t`). `rows` is
# one float tensor `[T, vocab]` per sequence, as `LLM.score` returns them: **logits or
# log-probs** (normalize each row with a log-softmax before you read a token's log-prob;
# compute in float64). `tol_by_dtype` maps a dtype name to the largest allowed
# `|log-prob - golden|` in nats.
#
# Return `(passed, max_abs_error)`: `passed` is `True` when every token's error is at
# most the tolerance **of the snapshot's dtype**; `max_abs_error` is the largest error
# (a Python float; `math.inf` if any log-prob is NaN, and then `passed` is False). Raise
# `ValueError` when `tol_by_dtype` has no entry for the snapshot's dtype, or when the
# number of row tensors or a tensor's row count does not match the snapshot.

# %% nbgrader={"grade": false, "grade_id": "golden_check", "locked": false, "schema_version": 3, "solution": true, "task": false}
def golden_check(snapshot, rows, tol_by_dtype):
    ### BEGIN SOLUTION
    dtype = snapshot["dtype"]
    if dtype not in tol_by_dtype:
        raise ValueError(f"no tolerance for dtype {dtype!r}")
    tol = float(tol_by_dtype[dtype])
    if len(rows) != len(snapshot["token_ids"]):
        raise ValueError("row count does not match the snapshot")
    worst = 0.0
    for r, ids, gold in zip(rows, snapshot["token_ids"], snapshot["logprobs"]):
        r = torch.as_tensor(r, dtype=torch.float64)
        if r.dim() != 2 or r.shape[0] != len(ids):
            raise ValueError(f"expected [{len(ids)}, vocab], got {tuple(r.shape)}")
        lp = torch.log_softmax(r, dim=-1)
        got = lp[:-1].gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1)
        err = (got - torch.tensor(gold, dtype=torch.float64)).abs()
        if torch.isnan(err).any():
            worst = math.inf
        elif err.numel():
            worst = max(worst, float(err.max()))
    return worst <= tol, worst
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "test_golden_visible", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
_lp = torch.log_softmax(torch.tensor([[2.0, 0.0, 0.0], [0.0, 3.0, 0.0], [1.0, 1.0, 1.0]]), -1)
_snap = {"dtype": "float32", "token_ids": [[0, 1, 2]],
         "logprobs": [[float(_lp[0, 1]), float(_lp[1, 2])]]}
_tols = {"float32": 1e-3, "bfloat16": 0.5}
_ok, _err = golden_check(_snap, [_lp], _tols)
checks.equal("golden_check(the same log-probs) passed", _ok, True)
checks.close("golden_check(the same log-probs) error", _err, 0.0, atol=1e-6)
_moved = _lp.clone()
_moved[1, 2] -= 0.01  # row 1 renormalized: token 2's log-prob moves by a little under 0.01
_want = abs(float(torch.log_softmax(_moved[1].double(), -1)[2] - _lp[1, 2].double()))
_ok, _err = golden_check(_snap, [_moved], _tols)
checks.equal("golden_check(one log-prob moved by about 0.01, float32) passed", _ok, False)
checks.close("golden_check(one log-prob moved by about 0.01) error", _err, _want, rtol=1e-5)
print("visible test passed")

# %% nbgrader={"grade": true, "grade_id": "test_golden_hidden", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
### BEGIN HIDDEN TESTS
import random as _random

from minivllm.precision import regress as _R

_rng = _random.Random(29002)
_g = torch.Generator().manual_seed(_rng.randrange(10 ** 6))
_V = _rng.randrange(20, 80)
_ids = [torch.randint(0, _V, (_rng.randrange(6, 15),), generator=_g).tolist() for _ in range(3)]
_logits = [torch.randn(len(s), _V, generator=_g) * 3 + 7.0 for s in _ids]  # logits, not log-probs
_gold = [torch.log_softmax(x.double(), -1)[:-1].gather(1, torch.tensor(s[1:])[:, None]).squeeze(1).tolist()
         for x, s in zip(_logits, _ids)]
_tols = {"float32": 1e-3, "float16": 0.1, "bfloat16": 0.5}
for _dtype in ("float32", "float16", "bfloat16"):
    _snap = {"dtype": _dtype, "token_ids": _ids, "logprobs": _gold}
    for _shift in (0.0, 0.05, 0.3, 0.8):
        _rows = [x.clone() for x in _logits]
        _i = _rng.randrange(3)
        _t = _rng.randrange(len(_ids[_i]) - 1)
        _rows[_i][_t, _ids[_i][_t + 1]] += _shift  # that token's log-prob moves by < _shift
        _got = golden_check(_snap, _rows, _tols)
        _ref = _R.golden_check(dict(_snap, format=_R.GOLDEN_FORMAT), _rows, _tols)
        checks.equal(f"golden_check({_dtype}, one logit +{_shift}) passed", bool(_got[0]),
                     _ref.passed)
        checks.close(f"golden_check({_dtype}, one logit +{_shift}) error", _got[1],
                     _ref.max_abs_error, rtol=1e-6, atol=1e-9)
_rows = [x.clone() for x in _logits]
_rows[1][0, 0] = float("nan")
_got = golden_check({"dtype": "bfloat16", "token_ids": _ids, "logprobs": _gold}, _rows, _tols)
checks.equal("golden_check(a NaN row) passed", bool(_got[0]), False)
checks.equal("golden_check(a NaN row) error is inf", math.isinf(_got[1]), True)
for _what, _args in (("a dtype without a tolerance",
                      ({"dtype": "float8", "token_ids": _ids, "logprobs": _gold}, _logits, _tols)),
                     ("one row tensor too few",
                      ({"dtype": "float32", "token_ids": _ids, "logprobs": _gold}, _logits[:2], _tols)),
                     ("a tensor with too few rows",
                      ({"dtype": "float32", "token_ids": _ids, "logprobs": _gold},
                       [_logits[0][:-1]] + _logits[1:], _tols))):
    try:
        golden_check(*_args)
    except ValueError:
        pass
    else:
        raise AssertionError(f"golden_check with {_what} should raise ValueError")
# an error of exactly the tolerance passes ("at most"): the tolerance set to the error
# your own function reports
_rows = [x.clone() for x in _logits]
_rows[2][1, _ids[2][2]] += 0.2
_snap = {"dtype": "float16", "token_ids": _ids, "logprobs": _gold}
_worst = golden_check(_snap, _rows, {"float16": 10.0})[1]
checks.equal(f"golden_check with the float16 tolerance equal to the error ({_worst!r}) passed",
             bool(golden_check(_snap, _rows, {"float16": _worst})[0]), True)
### END HIDDEN TESTS
print("hidden test passed")

# %% [markdown] nbgrader={"grade": false, "grade_id": "task3", "locked": true, "schema_version": 3, "solution": false, "task": false}
# ## Task 3: the drift monitor (3 points)
#
# Write `update(self, logprobs, entropies=None)`. The engine calls it once per finished
# request with the raw log-probs of the tokens it sampled (and their entropies, which
# you may ignore). Let `x` be the mean of `logprobs`.
#
# 1. A request with fewer than `self.min_tokens` tokens is skipped: return `self.alarm`
#    without counting it. Otherwise add 1 to `self.requests`.
# 2. If `x` is NaN or infinite: raise the alarm at once (below).
# 3. While `self.baseline` is None: keep `x`; once `self.warmup` values are kept, set
#    `self.baseline = (mean, std)` with the sample standard deviation (`ddof=1`) floored
#    at `self.min_std` (the noise floor: a stream that never moved in the warmup must not
#    make every later wiggle look infinite). No alarm during the warmup.
# 4. After: `z = (x - mean) / std`; `self.s_hi = max(0, s_hi + z - allowance)`,
#    `self.s_lo = max(0, s_lo - z - allowance)`; if either exceeds `self.threshold`,
#    raise the alarm.
#
# Raising the alarm sets `self.alarm = True` and, the first time only,
# `self.alarm_at = self.requests`. The alarm stays on. Return `self.alarm`.

# %% nbgrader={"grade": false, "grade_id": "drift_monitor", "locked": false, "schema_version": 3, "solution": true, "task": false}
class DriftMonitor:
    def __init__(self, warmup=30, threshold=8.0, allowance=0.5, min_tokens=4, min_std=0.05):
        self.warmup, self.threshold, self.allowance = warmup, threshold, allowance
        self.min_tokens, self.min_std = min_tokens, min_std
        self.requests, self.alarm, self.alarm_at = 0, False, None
        self.baseline, self.kept, self.s_hi, self.s_lo = None, [], 0.0, 0.0

    def _raise(self):
        if not self.alarm:
            self.alarm, self.alarm_at = True, self.requests

    def update(self, logprobs, entropies=None):
        ### BEGIN SOLUTION
        lp = [float(v) for v in logprobs]
        if len(lp) < self.min_tokens:
            return self.alarm
        self.requests += 1
        x = sum(lp) / len(lp)
        if not math.isfinite(x):
            self._raise()
            return self.alarm
        if self.baseline is None:
            self.kept.append(x)
            if len(self.kept) >= self.warmup:
                mu = sum(self.kept) / len(self.kept)
                sd = math.sqrt(sum((v - mu) ** 2 for v in self.kept) / (len(self.kept) - 1))
                self.baseline = (mu, max(sd, self.min_std))
            return self.alarm
        mu, sd = self.baseline
        z = (x - mu) / sd
        self.s_hi = max(0.0, self.s_hi + z - self.allowance)
        self.s_lo = max(0.0, self.s_lo - z - self.allowance)
        if max(self.s_hi, self.s_lo) > self.threshold:
            self._raise()
        return self.alarm
        ### END SOLUTION


TOO_TIGHT = dict(threshold=3.0, allowance=0.0)  # the broken configuration the lab starts from

# %% nbgrader={"grade": true, "grade_id": "test_monitor_visible", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
_m = DriftMonitor(warmup=4, threshold=12.0)
for _x in (-1.0, -1.2, -0.8, -1.0):  # warmup: mean -1.0, std 0.163
    checks.equal("update during the warmup", _m.update([_x] * 5), False)
checks.close("baseline mean", _m.baseline[0], -1.0, atol=1e-12)
checks.close("baseline std", _m.baseline[1], 0.1633, rtol=1e-3)
checks.equal("a request of 3 tokens is skipped", (_m.update([-9.0] * 3), _m.requests), (False, 4))
_alarms = [_m.update([-2.0] * 5) for _ in range(3)]  # z = -6.1 each: S- = 5.6, 11.2, 16.9
checks.equal("alarms over three requests 6 sd low", _alarms, [False, False, True])
checks.equal("alarm_at", _m.alarm_at, 7)
checks.equal("the alarm stays on", _m.update([-1.0] * 5), True)
print("visible test passed")

# %% nbgrader={"grade": true, "grade_id": "test_monitor_hidden", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
### BEGIN HIDDEN TESTS
import random as _random

_rng = _random.Random(29003)


class _Ref:
    """The rule of task 3, written again for the grader."""

    def __init__(self, warmup, threshold, allowance, min_tokens, min_std):
        self.w, self.h, self.k, self.mt, self.ms = warmup, threshold, allowance, min_tokens, min_std
        self.n, self.kept, self.base, self.hi, self.lo, self.at = 0, [], None, 0.0, 0.0, None

    def update(self, lp):
        if len(lp) < self.mt:
            return self.at is not None
        self.n += 1
        x = float(np.mean(lp))
        if not math.isfinite(x):
            self.at = self.at or self.n
        elif self.base is None:
            self.kept.append(x)
            if len(self.kept) >= self.w:
                self.base = (float(np.mean(self.kept)), max(float(np.std(self.kept, ddof=1)), self.ms))
        else:
            z = (x - self.base[0]) / self.base[1]
            self.hi, self.lo = max(0.0, self.hi + z - self.k), max(0.0, self.lo - z - self.k)
            if max(self.hi, self.lo) > self.h and self.at is None:
                self.at = self.n
        return self.at is not None


def _stream(kind, n):
    mu, sd = _rng.uniform(-2.5, -0.5), _rng.uniform(0.2, 0.9)
    out = []
    for i in range(n):
        k = _rng.choice([2, 6, 8, 12])
        shift = 0.0
        if kind == "up" and i >= n // 2:
            shift = 1.5 * sd
        if kind == "down" and i >= n // 2:
            shift = -2.0 * sd
        x = mu + shift + _rng.gauss(0.0, sd)
        if kind == "nan" and i == n - 10:
            x = float("nan")
        if kind == "flat":  # a warmup that never moved, then wiggles of 0.01 nats
            out.append([mu if i < 60 else mu + _rng.uniform(-0.01, 0.01)] * k)
            continue
        out.append([x + _rng.uniform(-0.1, 0.1) * sd for _ in range(k)])
    return out


for _kind in ("calm", "up", "down", "flat", "nan"):
    _kw = dict(warmup=30, threshold=_rng.choice([8.0, 12.0]), allowance=_rng.choice([0.5, 0.8]),
               min_tokens=4, min_std=0.05)
    _m, _r = DriftMonitor(**_kw), _Ref(**_kw)
    _data = _stream(_kind, 120)
    _got = [_m.update(list(x)) for x in _data]
    _want = [_r.update(x) for x in _data]
    checks.equal(f"{_kind} stream: number of requests counted", _m.requests, _r.n)
    checks.equal(f"{_kind} stream: alarm_at", _m.alarm_at, _r.at)
    checks.equal(f"{_kind} stream: alarm after each request", _got, _want)
# the edges, on streams whose baseline is exact: warmup -11, -10, -9 gives mean -10, sample
# std 1; a request of exactly min_tokens tokens counts; after a z of 0 (s_hi stays 0), a z
# of 8.5 brings s_hi to exactly the threshold 8.0, which is not above it
_m = DriftMonitor(warmup=3, threshold=8.0, allowance=0.5, min_tokens=4)
_got = [_m.update([v] * 4) for v in (-11.0, -10.0, -9.0, -10.0, -1.5)]
_m.update([-1.0] * 3)                                       # 3 tokens: skipped
checks.equal("edge stream: baseline, requests counted, alarms",
             (_m.baseline, _m.requests, _got), ((-10.0, 1.0), 5, [False] * 5))
# a NaN request in the warmup raises the alarm and is not kept: the baseline comes from
# the finite requests
_m = DriftMonitor(warmup=3, threshold=8.0, allowance=0.5, min_tokens=4)
_got = [_m.update([v] * 4) for v in (-11.0, math.nan, -10.0, -9.0)]
checks.equal("a NaN in the warmup: alarms, alarm_at, baseline",
             (_got, _m.alarm_at, _m.baseline), ([False, True, True, True], 2, (-10.0, 1.0)))
### END HIDDEN TESTS
print("hidden test passed")

# %% [markdown] nbgrader={"grade": false, "grade_id": "task4", "locked": true, "schema_version": 3, "solution": false, "task": false}
# ## The restore check (8 points)
#
# The grader builds the embedded model's engine (float32, served temperature 0.7) and
# sends it fresh prompts (the user turns of the conversations eval set, as "Q: ... A:"),
# 8 tokens each, with your monitor (default settings) attached through
# `LLM.set_precision_monitor`: 30 requests of warmup, then 40 benign requests (other
# prompts, other batch sizes), then each planted regression in turn, up to 30 requests
# each (defaults changed under the users: the model's generation config no longer read,
# so the temperature falls back from 0.7 to 1.0; then a hotter temperature with a
# repetition penalty), each
# watched by a copy of your monitor that has only seen healthy traffic. Your monitor must
# raise no alarm over the benign traffic and alarm within 30 requests of each regression; the
# too-tight configuration (`TOO_TIGHT`), fed the same requests, must fail that check.

# %% nbgrader={"grade": true, "grade_id": "test_restore", "locked": true, "points": 8, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
### BEGIN HIDDEN TESTS
import copy as _copy
import random as _random

from minivllm import LLM, SamplingParams
from minivllm.precision import evalsets as _E
from minivllm.precision.monitor import DriftMonitor as _RefMonitor

_mine = DriftMonitor()  # the learner's class first: a released stub fails here, before any engine
_mine.update([-1.0] * 8)
_mine = DriftMonitor()
_rng = _random.Random(2929)  # fixed prompts and seeds: the same traffic for every submission
_llm = LLM(model="smollm2-135m-instruct", dtype="float32", max_model_len=128,
           num_gpu_blocks_override=96, override_generation_config={"temperature": 0.7})
_tok = _llm.get_tokenizer()
_users = [t["content"] for c in _E.load_conversations() for t in c if t["role"] == "user"]
_prompts = [_tok.encode(f"Q: {u}\nA:", add_special_tokens=False)
            for u in _rng.sample(_users, len(_users)) + _rng.sample(_users, len(_users))]


class _Tee:
    """Feeds the learner's monitor and the too-tight one the same requests."""

    def __init__(self, *monitors):
        self.monitors = monitors

    def update(self, logprobs, entropies=None):
        return [m.update(list(logprobs), list(entropies)) for m in self.monitors][0]


def _send(prompts, batches, tee, change=None):
    _llm.set_precision_monitor(tee)
    s = 0
    for b in batches:
        chunk = prompts[s:s + b]
        params = [SamplingParams(**{"temperature": 0.7, **(change or {}), "max_tokens": 8,
                                    "ignore_eos": True, "seed": _rng.randrange(10 ** 9)})
                  for _ in chunk]
        _llm.generate(chunk, params)
        s += b
    _llm.set_precision_monitor(None)


_tight = _RefMonitor(warmup=30, min_tokens=4, **TOO_TIGHT)
_send(_prompts[:30], [30], _Tee(_mine, _tight))
checks.equal("your monitor's baseline is set after 30 requests", _mine.baseline is not None, True)
_send(_prompts[30:70], [15, 25], _Tee(_mine, _tight))
print(f"benign traffic: {_mine.requests - 30} requests; your monitor: alarm {_mine.alarm} "
      f"(S+ {_mine.s_hi:.2f}, S- {_mine.s_lo:.2f}); too tight: alarm {_tight.alarm} "
      f"at request {_tight.alarm_at}")
_caught = {}
for _name, _change, _sl in (("generation config dropped: temperature 0.7 -> 1.0",
                             {"temperature": 1.0}, slice(70, 100)),
                            ("temperature 1.2 with repetition_penalty 1.5",
                             {"temperature": 1.2, "repetition_penalty": 1.5}, slice(100, 130))):
    _m = _copy.deepcopy(_mine)  # has seen only healthy traffic
    _start = _m.requests
    _send(_prompts[_sl][:10], [10], _Tee(_m), _change)
    if not _m.alarm:  # the rest only when the first ten did not raise it
        _send(_prompts[_sl][10:], [20], _Tee(_m), _change)
    _caught[_name] = None if _m.alarm_at is None else _m.alarm_at - _start
    print(f"{_name}: your monitor alarms after {_caught[_name]} requests")
checks.equal("your monitor's alarms over benign traffic", _mine.alarm, False)
for _name, _after in _caught.items():
    checks.equal(f"{_name}: your monitor alarmed", _after is not None, True)
    checks.at_most(f"{_name}: requests until your monitor's alarm", _after, 30)
checks.equal("the too-tight configuration alarms on the same benign traffic", _tight.alarm, True)
del _llm
### END HIDDEN TESTS
print("restore test passed")
