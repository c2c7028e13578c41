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
# # Lab 14: repair int8 on a smoothed checkpoint, under a byte budget
#
# You start from the broken configuration of chapter 14, section 6: a checkpoint with
# SmoothQuant's per-input-channel scales folded in (Xiao et al. 2022, arXiv:2211.10438;
# migration strength α = 1.0, each scale a power of two, so the float model computes
# bit for bit what the original does), quantized to int8 weight-only with **one scale per
# output channel** (`quantization="int8", quantization_config={"granularity":
# "channel"}`). The folded columns are the largest weights of every row, they set every
# row's scale, and the KL against the float32 engine is several times what the same
# quantizer gives on the unmodified model.
#
# The repair: one scale per row **and group of `g` input columns**, so a folded column
# sets the scale of its own group only. Scales cost bytes (float32, 4 each), and your
# deployment allows the decoder's linear weights at most `BUDGET_BYTES`: the per-channel
# model plus 3 %. Smaller groups are more accurate and cost more bytes.
#
# You write three functions. The grader calls them on **new** inputs (fresh matrices with
# zero groups, short last groups and exact ties; fresh layer shapes and budgets at the
# exact byte), then plugs your quantizer and your choice of group size into the engine
# (`minivllm.quantization.register_quantization_method`) on text you have not seen.
#
# 1. `quantize_int8_group(w, group_size)`: int8 codes and a scale per row and group,
#    3 points;
# 2. `linear_bytes(shapes, group_size, keep_float)`: the exact bytes of the stored
#    decoder linear weights, scales included, 2 points;
# 3. `choose_group_size(shapes, budget_bytes, candidates)`: the most accurate group size
#    that fits the budget, 2 points;
# 4. the engine with your quantizer at your group size on fresh text, 6 points (no code to
#    write: it runs your functions 1 and 3, and 3 runs 2).
#
# Run the cells in order. Do not edit the setup and test cells.

# %% nbgrader={"grade": false, "grade_id": "setup", "locked": true, "schema_version": 3, "solution": false, "task": false}
import importlib
import math
import tempfile
from pathlib import Path

import grading.checks as checks  # first import: records the original functions
import torch

from minivllm import LLM
from minivllm.layers.linear import LinearMethod
from minivllm.models.loader import resolve_model_path
from minivllm.precision import evalsets, metrics
from minivllm.quantization import register_quantization_method, smoothing
from minivllm.quantization.calibration import calibration_sequences
from minivllm.quantization.quantize import target_layers

torch.manual_seed(0)
MODEL = "smollm2-135m-instruct"
COMMON = dict(dtype="float32", max_model_len=256, kv_cache_memory_bytes=16 << 20)
GROUP_SIZES = (32, 64, 128, 256, 512)

# The broken checkpoint: SmoothQuant at alpha = 1.0 folded into the float model, exactly
# (chapter 14, section 6). Activation maxima from 512 tokens of the bundled conversations.
FLOAT = LLM(MODEL, **COMMON)
tokenizer = FLOAT.get_tokenizer()
_layers = target_layers(FLOAT.llm_engine.model_runner.model)
_amax = smoothing.input_amax(FLOAT, calibration_sequences(tokenizer, "conversations", 512, 256))
_tmp = tempfile.TemporaryDirectory()
FOLDED = str(smoothing.fold_into_checkpoint(resolve_model_path(MODEL), Path(_tmp.name) / "folded", {
    n: smoothing.smoothing_scales(a, _layers[n].weight.detach().abs().amax(dim=0), 1.0)
    for n, a in _amax.items()}))
# every decoder linear layer's shape (out_features, in_features): 120 layers
SHAPES = {n: (lin.out_features, lin.in_features) for n, lin in _layers.items()}
PER_CHANNEL_BYTES = sum(o * i + 4 * o for o, i in SHAPES.values())
BUDGET_BYTES = PER_CHANNEL_BYTES + PER_CHANNEL_BYTES * 3 // 100


def dequantize_int8_group(q: torch.Tensor, scale: torch.Tensor, group_size: int) -> torch.Tensor:
    """q int8 [out, in], scale float32 [out, ceil(in / g)] -> float32 [out, in]: column c
    of row r is q[r, c] * scale[r, c // g]."""
    cols = scale.to(torch.float32).repeat_interleave(group_size, dim=1)[:, :q.shape[1]]
    return q.to(torch.float32) * cols


class LabInt8Group(LinearMethod):
    """Int8 weight-only with a scale per row and group of `columns` input columns,
    computed by YOUR quantize_int8_group (looked up by name when a layer is quantized,
    so a later fix of yours is used). The layer computes
    x @ dequantize_int8_group(qweight, weight_scale, columns).T."""

    def quantize(self, weight, stats=None):
        q, scale = globals()["quantize_int8_group"](weight, self.cfg.option("columns"))
        return {"qweight": q, "weight_scale": torch.as_tensor(scale).float()}

    def dequantize(self, t):
        return dequantize_int8_group(t["qweight"], t["weight_scale"], self.cfg.option("columns"))

    def expected(self, out_features, in_features):
        g = self.cfg.option("columns")
        return {"qweight": (torch.int8, (out_features, in_features)),
                "weight_scale": (torch.float32, (out_features, -(-in_features // g)))}


def register():
    register_quantization_method("lab_int8_group", LabInt8Group, options={"columns": 128},
                                 replace=True)


def measure(group_size: int = 128, n_tokens: int = 64) -> dict:
    """For you, before you submit (two engines, ~10 s): KL (nats) against the float32
    engine on one prose window, of the broken configuration and of YOUR quantizer at
    `group_size`, with the linear bytes the engine stores for each."""
    register()
    seq = evalsets.corpus_sequences(tokenizer, seq_len=n_tokens, max_sequences=1)
    ref = FLOAT.score(seq, output="logits")
    out = {"budget bytes": BUDGET_BYTES}
    for name, kw in (("int8 per channel (broken)", dict(quantization="int8", quantization_config={
                         "granularity": "channel"})),
                     (f"yours, groups of {group_size}", dict(quantization="lab_int8_group",
                                                             quantization_config={"columns": group_size}))):
        llm = LLM(FOLDED, **COMMON, **kw)
        rows = llm.score(seq, output="logits")
        out[name] = {"kl": float(torch.cat([metrics.kl_divergence(a, b) for a, b in zip(ref, rows)]).mean()),
                     "linear bytes": llm.weight_bytes()["linear"]}
    return out


example = torch.tensor([[0.02, -0.013, 2.5, 0.0011, 0.3, -0.05],
                        [0.0, 0.0, 0.0, 0.0, 0.9, -0.6]])
print(f"{len(SHAPES)} decoder linear layers; per-channel int8 stores {PER_CHANNEL_BYTES:,} bytes; "
      f"BUDGET_BYTES = {BUDGET_BYTES:,}")
print("example weight [2, 6]:", [[round(v, 4) for v in row] for row in example.tolist()])

# %% [markdown] nbgrader={"grade": false, "grade_id": "task1", "locked": true, "schema_version": 3, "solution": false, "task": false}
# ## Task 1: int8 codes and a scale per row and group (3 points)
#
# Write `quantize_int8_group(w, group_size)` for a 2-D float weight `w` `[out, in]` (any
# float dtype; compute in float32). Columns `[k·g, (k+1)·g)` of a row form group `k`;
# when `g` does not divide `in`, the last group is shorter (SmolLM2's 576 = 4·128 + 64),
# and a `g` larger than `in` makes one group of the whole row. Return `(q, scale)`:
#
# - `scale` float32 `[out, ceil(in / g)]`: the group's max |w| divided by 127; where that
#   is 0 (an all-zero group), 1.0;
# - `q` `torch.int8` `[out, in]`: `clamp(round(w / scale), -127, 127)` with the scale of
#   the column's group, `torch.round` (half to even), `w / scale` (a division, as written).
#
# Do not modify `w`. `group_size` must be a positive `int` (not a bool): anything else
# raises `ValueError`. The grader compares with the engine's
# `minivllm.quantization.weight_quant.quantize_int8_group` bit for bit; write yours with
# torch operations, without calling that module's quantizers (the grader checks that your
# function does not use them).

# %% nbgrader={"grade": false, "grade_id": "quantize_int8_group", "locked": false, "schema_version": 3, "solution": true, "task": false}
def quantize_int8_group(w: torch.Tensor, group_size: int = 128):
    ### BEGIN SOLUTION
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size <= 0:
        raise ValueError(f"group_size must be a positive int, got {group_size!r}")
    w32 = w.detach().to(torch.float32)
    out_f, in_f = w32.shape
    n_groups = -(-in_f // group_size)
    pad = n_groups * group_size - in_f
    wp = torch.cat([w32, w32.new_zeros(out_f, pad)], dim=1) if pad else w32
    scale = wp.reshape(out_f, n_groups, group_size).abs().amax(dim=-1) / 127
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    per_col = scale.repeat_interleave(group_size, dim=1)[:, :in_f]
    q = torch.round(w32 / per_col).clamp(-127, 127).to(torch.int8)
    return q, scale
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "test_quantize_visible", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
_q, _s = quantize_int8_group(example.clone(), 4)
checks.equal("groups of 4 over 6 columns: scale shape and dtype", (tuple(_s.shape), _s.dtype),
             ((2, 2), torch.float32))
checks.close("row 0, group 0 scale (amax 2.5)", float(_s[0, 0]), 2.5 / 127, rtol=1e-7)
checks.equal("row 1, group 0 (all zeros): scale 1.0", float(_s[1, 0]), 1.0)
checks.equal("codes", _q.tolist(), [[1, -1, 127, 0, 127, -21], [0, 0, 0, 0, 127, -85]])
checks.equal("codes dtype", _q.dtype, torch.int8)
print("visible test passed")

# %% nbgrader={"grade": true, "grade_id": "test_quantize_hidden", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
### BEGIN HIDDEN TESTS
from minivllm.quantization import weight_quant as _wq


def _fresh_cases():
    g = torch.Generator().manual_seed(1414)
    a = torch.randn(37, 53, generator=g) * 0.05
    a[3] = 0                                              # an all-zero row
    a[5, 16:32] = 0                                       # an all-zero group (g 16)
    a[:, 20] *= 64                                        # a folded input column
    # exact ties at scales that are not powers of two, groups of 32: the group's first
    # column is its amax; the others sit on (k + 0.5) scale exactly, where w * (1 / scale)
    # (an ulp off now and then) rounds to the other code
    amax = torch.rand(64, 1, generator=g) + 0.5
    sc = amax / 127
    k = torch.randint(-126, 126, (64, 200), generator=g).float() + 0.5
    w = k * sc
    exact = (w / sc == k) & (torch.round(w * (1.0 / sc)) != torch.round(w / sc))
    w = torch.where(exact, w, torch.zeros_like(w))[:, :31]
    ties = torch.cat([amax, w], dim=1).reshape(32, 64)
    assert int((ties != 0).sum()) - 64 >= 20, "too few tie cases for the check"
    big = torch.randn(96, 576, generator=g) * torch.exp(torch.randn(1, 576, generator=g))
    half = (torch.randn(24, 48, generator=g) * 0.02).to(torch.bfloat16)
    return {"[37, 53], a zero row, a zero group, a folded column, g16 (short last group)": (a, 16),
            "exact ties at scales that are not powers of two, g32": (ties, 32),
            "columns of very different size [96, 576], g128 (576 = 4 x 128 + 64)": (big, 128),
            "the same, g512 (one group of 512, one of 64)": (big, 512),
            "bfloat16 input [24, 48], g8": (half, 8),
            "all zeros [5, 6], g4": (torch.zeros(5, 6), 4),
            "one element, g1": (torch.tensor([[-0.3]]), 1),
            "a group wider than the row [3, 10], g64": (a[:3, :10].clone(), 64)}


checks.not_calling("quantize_int8_group", quantize_int8_group,
                   [_wq.quantize_int8_group, _wq.quantize_int8, _wq.dequantize_int8_group],
                   "the task is to write the quantizer; the engine's is the grader's reference")
for _name, (_w, _g) in _fresh_cases().items():
    _inp = _w.clone()
    _got_q, _got_s = quantize_int8_group(_inp, _g)        # the learner's function first
    _ref_q, _ref_s = _wq.quantize_int8_group(_w, _g)
    checks.equal(f"{_name}: w left unchanged", bool(torch.equal(_inp, _w)), True)
    _got_s = torch.as_tensor(_got_s)
    checks.equal(f"{_name}: scale dtype and shape", (_got_s.dtype, tuple(_got_s.shape)),
                 (torch.float32, tuple(_ref_s.shape)))
    checks.equal(f"{_name}: codes dtype and shape", (_got_q.dtype, tuple(_got_q.shape)),
                 (torch.int8, tuple(_w.shape)))
    _bad_s = int((_got_s != _ref_s).sum())
    _bad_q = (_got_q != _ref_q).nonzero()
    if _bad_s or len(_bad_q):
        _ex = "; ".join(f"w[{i},{j}] = {float(_w[i, j]):.6g}: expected code {int(_ref_q[i, j])}, "
                        f"got {int(_got_q[i, j])}" for i, j in _bad_q[:3].tolist())
        raise checks.CheckFailed(f"{_name}: {_bad_s} scale(s) and {len(_bad_q)} of {_w.numel()} "
                                 f"codes differ from the engine's quantize_int8_group. {_ex}")
# a group as wide as the row is per channel: the engine's quantize_int8(w, "channel")
_w = torch.randn(9, 40, generator=torch.Generator().manual_seed(5))
_qc, _sc = _wq.quantize_int8(_w, "channel")
_q, _s = quantize_int8_group(_w, 40)
checks.equal("group_size = in_features: the per-channel codes and scales",
             (bool(torch.equal(_q, _qc)), bool(torch.equal(torch.as_tensor(_s), _sc))), (True, True))
for _bad in (0, -4, 2.0, True, None):
    try:
        quantize_int8_group(torch.ones(2, 4), _bad)
    except ValueError:
        continue
    raise checks.CheckFailed(f"quantize_int8_group(w, {_bad!r}) should raise ValueError "
                             "(group_size must be a positive int)")
### END HIDDEN TESTS

# %% [markdown] nbgrader={"grade": false, "grade_id": "task2", "locked": true, "schema_version": 3, "solution": false, "task": false}
# ## Task 2: the bytes, scales included (2 points)
#
# Write `linear_bytes(shapes, group_size, keep_float=())`: `shapes` maps layer names to
# `(out_features, in_features)`; return the bytes (an `int`) the engine stores for those
# layers:
#
# - a layer named in `keep_float` stays float32: `4 · out · in`;
# - every other layer: `out · in` bytes of int8 codes plus 4 bytes (float32) per scale,
#   `out · ceil(in / group_size)` scales, or `out` scales when `group_size` is `None`
#   (per channel).
#
# A name in `keep_float` that is not in `shapes`, or a `group_size` that is neither `None`
# nor a positive `int`, raises `ValueError`. Do not modify `shapes` or `keep_float`.

# %% nbgrader={"grade": false, "grade_id": "linear_bytes", "locked": false, "schema_version": 3, "solution": true, "task": false}
def linear_bytes(shapes: dict, group_size, keep_float=()) -> int:
    ### BEGIN SOLUTION
    if group_size is not None and (isinstance(group_size, bool) or not isinstance(group_size, int)
                                   or group_size <= 0):
        raise ValueError(f"group_size must be None or a positive int, got {group_size!r}")
    unknown = [n for n in keep_float if n not in shapes]
    if unknown:
        raise ValueError(f"keep_float names layers not in shapes: {unknown}")
    total = 0
    for name, (out_f, in_f) in shapes.items():
        if name in keep_float:
            total += 4 * out_f * in_f
        else:
            n_scales = 1 if group_size is None else -(-in_f // group_size)
            total += out_f * in_f + 4 * out_f * n_scales
    return total
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "test_bytes", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
checks.equal("visible: linear_bytes({'a': (2, 6)}, 4)  (12 codes + 2 rows x 2 groups x 4)",
             linear_bytes({"a": (2, 6)}, 4), 12 + 16)
### BEGIN HIDDEN TESTS
from minivllm.quantization import weight_quant as _wq


def _stored(shape, g):
    """Bytes of what the engine's quantizer returns for a layer of this shape."""
    q, s = (_wq.quantize_int8(torch.ones(shape), "channel") if g is None
            else _wq.quantize_int8_group(torch.ones(shape), g))
    return q.numel() * q.element_size() + s.numel() * s.element_size()


_gen = torch.Generator().manual_seed(2014)
_shapes = {f"l{k}": (int(torch.randint(1, 300, (1,), generator=_gen)),
                     int(torch.randint(1, 700, (1,), generator=_gen))) for k in range(7)}
_shapes["exact"] = (64, 256)                                # g divides in_features
_shapes["narrow"] = (3, 5)                                  # narrower than most groups
for _g in (None, 1, 7, 32, 128, 256, 1000):
    _before = checks.snapshot(_shapes)
    _want = sum(_stored(s, _g) for s in _shapes.values())
    _ = checks.call(f"linear_bytes(9 fresh layers, {_g})", linear_bytes, _shapes, _g)
    checks.equal(f"linear_bytes(9 fresh layers, group_size={_g}): the bytes the engine's "
                 "quantizer returns", linear_bytes(_shapes, _g), _want)
    checks.unchanged("shapes", _shapes, _before)
_keep = ["l2", "narrow"]
_want = (sum(_stored(s, 128) for n, s in _shapes.items() if n not in _keep)
         + sum(4 * o * i for o, i in (_shapes[n] for n in _keep)))
_before, _keep_arg = checks.snapshot(_shapes), list(_keep)
checks.equal("linear_bytes(..., 128, keep_float=['l2', 'narrow'])",
             linear_bytes(_shapes, 128, _keep_arg), _want)
checks.unchanged("shapes, after a call with keep_float", _shapes, _before)
checks.unchanged("keep_float", _keep_arg, _keep)
checks.equal("the same call again (nothing left over from the first)",
             linear_bytes(_shapes, 128, list(_keep)), _want)
checks.equal("linear_bytes({}, 128) (no layers)", linear_bytes({}, 128), 0)
checks.equal("linear_bytes on the model's 120 layers, per channel", linear_bytes(SHAPES, None),
             PER_CHANNEL_BYTES)
for _args, _why in ((({"a": (2, 6)}, 0), "group_size 0"), (({"a": (2, 6)}, 2.0), "group_size 2.0"),
                    (({"a": (2, 6)}, True), "group_size True"),
                    (({"a": (2, 6)}, 4, ["b"]), "keep_float names a layer not in shapes")):
    try:
        linear_bytes(*_args)
    except ValueError:
        continue
    raise checks.CheckFailed(f"linear_bytes must raise ValueError: {_why}")
### END HIDDEN TESTS

# %% [markdown] nbgrader={"grade": false, "grade_id": "task3", "locked": true, "schema_version": 3, "solution": false, "task": false}
# ## Task 3: the group size that fits the budget (2 points)
#
# Write `choose_group_size(shapes, budget_bytes, candidates=GROUP_SIZES)`: among the
# `candidates` (positive ints, in any order), the **smallest** group size (the most
# scales, so the most accurate) whose `linear_bytes(shapes, g)` is at most `budget_bytes`
# (a budget met to the byte fits). When none fits, return `None`. Use your
# `linear_bytes`. Chapter 14, section 7, compares this repair with keeping whole layers in
# float at the same bytes.
#
# The grader calls it on fresh shapes and budgets, then task 4 runs the engine at
# `choose_group_size(SHAPES, BUDGET_BYTES)`.

# %% nbgrader={"grade": false, "grade_id": "choose_group_size", "locked": false, "schema_version": 3, "solution": true, "task": false}
def choose_group_size(shapes: dict, budget_bytes: int, candidates=GROUP_SIZES):
    ### BEGIN SOLUTION
    for g in sorted(candidates):
        if linear_bytes(shapes, g) <= budget_bytes:
            return g
    return None
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "test_choose", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
checks.equal("visible: choose_group_size({'a': (2, 6)}, 28, (2, 4, 8))", choose_group_size(
    {"a": (2, 6)}, 28, (2, 4, 8)), 4)
### BEGIN HIDDEN TESTS
def _bytes(shapes, g):
    return sum(o * i + 4 * o * -(-i // g) for o, i in shapes.values())


_gen = torch.Generator().manual_seed(3014)
_shapes = {f"l{k}": (int(torch.randint(8, 400, (1,), generator=_gen)),
                     int(torch.randint(60, 900, (1,), generator=_gen))) for k in range(6)}
_cands = (256, 16, 64, 512, 32, 128)                        # not in order
_sorted = sorted(_cands)
for _k, _g in enumerate(_sorted):
    _b = _bytes(_shapes, _g)
    checks.equal(f"a budget of exactly linear_bytes(shapes, {_g}) ({_b:,})",
                 choose_group_size(_shapes, _b, _cands), _g)
    _next = _sorted[_k + 1] if _k + 1 < len(_sorted) else None
    if _next is not None and _bytes(_shapes, _next) <= _b - 1:
        checks.equal(f"one byte less ({_b - 1:,}): the next larger group",
                     choose_group_size(_shapes, _b - 1, _cands), _next)
checks.equal("a budget below every candidate: None",
             choose_group_size(_shapes, _bytes(_shapes, 512) - 1, _cands), None)
checks.equal("no candidates: None", choose_group_size(_shapes, 10 ** 12, ()), None)
# candidates of equal bytes (both wider than every row: one group each): the smaller wins
_wide = {"a": (2, 6), "b": (3, 5)}
checks.equal("choose_group_size({'a': (2, 6), 'b': (3, 5)}, 50, (8, 6)): equal bytes, the "
             "smaller group size", choose_group_size(_wide, 50, (8, 6)), 6)
_before = checks.snapshot(_shapes)
checks.equal("SmolLM2's layers at the lab's budget", choose_group_size(SHAPES, BUDGET_BYTES),
             min(g for g in GROUP_SIZES if _bytes(SHAPES, g) <= BUDGET_BYTES))
_ = checks.unchanged("shapes", _shapes, _before)
### END HIDDEN TESTS

# %% [markdown] nbgrader={"grade": false, "grade_id": "task4", "locked": true, "schema_version": 3, "solution": false, "task": false}
# ## Task 4: the repaired model in the engine (6 points)
#
# Nothing to write. The grader takes `g = choose_group_size(SHAPES, BUDGET_BYTES)`,
# registers your quantizer (`register()` in the setup cell) and builds
#
#     LLM(FOLDED, quantization="lab_int8_group", quantization_config={"columns": g})
#
# then scores six windows of text you have not seen (480 positions). It requires the
# linear bytes the engine stores (`weight_bytes()["linear"]`) to be at most
# `BUDGET_BYTES`, and the mean KL against float32 to be at most **0.008 nats**: the
# neighbourhood of per-channel int8 on the unmodified model (chapter 14: about 4e-3), far
# below the broken configuration, which must fail the same check. `measure(g)` (setup
# cell) prints both on a prose window.

# %% nbgrader={"grade": true, "grade_id": "test_engine", "locked": true, "points": 6, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
### BEGIN HIDDEN TESTS
import gc as _gc

_LIMIT = 0.008
_g = choose_group_size(dict(SHAPES), BUDGET_BYTES)          # the learner's functions first
checks.equal("choose_group_size(SHAPES, BUDGET_BYTES) returns a group size (an int)",
             type(_g) is int and _g > 0, True)
quantize_int8_group(torch.randn(6, 10, generator=torch.Generator().manual_seed(7)), 4)
register()
_convs = evalsets.conversation_sequences(tokenizer, max_conversations=12)
_seqs = ([_convs[i][:80] for i in (9, 10, 11)]              # not the calibration text
         + evalsets.corpus_sequences(tokenizer, seq_len=80, max_sequences=3))


def _kl(ref, llm):
    rows = llm.score(_seqs, output="logits")
    return float(torch.cat([metrics.kl_divergence(a, b) for a, b in zip(ref, rows)]).mean())


try:  # the learner's engine first: a method the engine refuses fails before the others
    _yours = LLM(FOLDED, **COMMON, quantization="lab_int8_group",
                 quantization_config={"columns": _g})
except Exception as _e:
    raise checks.CheckFailed(f"the engine could not load with your method at group size {_g}: "
                             f"{type(_e).__name__}: {_e}") from None
_ref = FLOAT.score(_seqs, output="logits")
_broken_llm = LLM(FOLDED, **COMMON, quantization="int8", quantization_config={"granularity": "channel"})
_broken = _kl(_ref, _broken_llm)
del _broken_llm
_gc.collect()
_restored = _kl(_ref, _yours)
_bytes = _yours.weight_bytes()["linear"]
print(f"{sum(map(len, _seqs))} fresh positions; mean KL against float32 (nats): int8 per channel "
      f"(the broken configuration) {_broken:.3g}; yours, groups of {_g}, {_restored:.3g}; limit "
      f"{_LIMIT}. Linear bytes {_bytes:,} (budget {BUDGET_BYTES:,})")
# the check must discriminate: the broken configuration fails it
assert _broken > _LIMIT, f"int8 per channel ({_broken:.3g}) should fail the limit {_LIMIT}"
checks.at_most(f"linear bytes the engine stores at group size {_g}", _bytes, BUDGET_BYTES)
checks.at_most(f"KL of the engine with your int8 groups of {_g} (per channel: {_broken:.3g})",
               _restored, _LIMIT)
### END HIDDEN TESTS
