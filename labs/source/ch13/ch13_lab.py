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
# # Lab 13: restore float32 accuracy on TF32 units
#
# You start from the broken configuration of chapter 13: the engine with
# `float32_matmul_precision="high"`, whose linear layers and LM head round both matmul
# inputs to TF32 (10 mantissa bits). Against the float32 engine its next-token
# distributions are off by a few 1e-6 nats, five orders of magnitude above the float32
# noise floor. You restore float32 accuracy *without* leaving TF32 units: every matmul
# you run must read TF32 values only.
#
# You write three functions and answer one question. The grader calls your functions on
# **new** inputs (fresh bit patterns, fresh matrices, prompts you have not seen) and
# compares with its own reference, so code that only works on the examples here will not
# pass.
#
# 1. `round_tf32(x, mode)`: TF32 rounding by three rules, bit for bit, 4 points;
# 2. `MODE_53635`: which rule reproduces pytorch #53635, 1 point;
# 3. `split_tf32_matmul(a, b)`: a 3xTF32 matmul, 3 points;
# 4. `tf32x3_steps()`: the step functions that restore the TF32 engine, 7 points, 6 of
#    them checked by running the engine.
#
# Run the cells in order. Do not edit the setup and test cells.

# %% nbgrader={"grade": false, "grade_id": "setup", "locked": true, "schema_version": 3, "solution": false, "task": false}
import importlib

import grading.checks as checks  # first import: records the original functions
import torch
from torch.overrides import TorchFunctionMode

from minivllm import LLM
from minivllm.precision import evalsets, metrics
from minivllm.precision.noise import permuted_mlp_reduction

torch.manual_seed(0)
MODEL = "smollm2-135m-instruct"
COMMON = dict(dtype="float32", max_model_len=512, kv_cache_memory_bytes=32 << 20)
fp32 = LLM(MODEL, **COMMON)                                    # the reference
tf32 = LLM(MODEL, **COMMON, float32_matmul_precision="high")   # the broken configuration
tok = fp32.get_tokenizer()
example_seqs = evalsets.corpus_sequences(tok, seq_len=40, max_sequences=2)


def bits(x: torch.Tensor) -> torch.Tensor:
    """The float32 bit patterns of x as an int32 view (same shape and strides, no copy)."""
    return x.view(torch.int32)


def not_tf32(t: torch.Tensor) -> int:
    """How many finite values of float32 `t` have any of the low 13 mantissa bits set
    (0: every value is a TF32 value). Tensors over 2^20 elements are checked on a regular
    sample of about 2^20 of their elements."""
    s = max(1, int(-(-(t.numel() / 2**20) ** (1 / max(t.dim(), 1)) // 1)))
    sample = t.detach()[tuple(slice(None, None, s) for _ in range(t.dim()))] if s > 1 else t.detach()
    b = sample.contiguous().view(torch.int32)
    return int((((b & 0x1FFF) != 0) & ((b & 0x7F800000) != 0x7F800000)).sum())


class MatmulWatch(TorchFunctionMode):
    """Inside `with MatmulWatch() as w:`, counts every matmul-like torch call and records
    any whose multiplied operands are not TF32 values (float32 with the low 13 mantissa
    bits zero; inf/NaN patterns allowed)."""

    NAMES = {"matmul", "mm", "bmm", "linear", "addmm", "baddbmm", "addbmm", "einsum",
             "tensordot", "inner", "dot", "vdot", "mv", "addmv", "outer", "chain_matmul",
             "multi_dot", "__matmul__", "__rmatmul__"}

    def __init__(self):
        super().__init__()
        self.calls, self.problems = 0, []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in self.NAMES:
            ops = [a for a in args if isinstance(a, torch.Tensor)]
            if name.startswith("add") or name == "baddbmm":
                ops = ops[1:]          # the added tensor is not multiplied
            if name == "linear":
                ops = ops[:2]          # the bias is not multiplied
            self.calls += 1
            for t in ops:
                if t.dtype != torch.float32:
                    self.problems.append(f"{name} on a {t.dtype} operand (TF32 units read float32)")
                elif not_tf32(t):
                    self.problems.append(f"{name} on a float32 operand {tuple(t.shape)} holding "
                                         f"values that are not TF32 (low 13 bits set)")
        return func(*args, **(kwargs or {}))


def measure(steps: dict, seqs: list) -> dict:
    """For you, before you submit: KL (nats) against the float32 engine of the plain TF32
    engine, of the TF32 engine with `steps` swapped in, and the float32 noise floor."""
    def kl(rows):
        return float(torch.cat([metrics.kl_divergence(b, r) for b, r in zip(base, rows)]).mean())
    base = fp32.score(seqs, output="logits")
    with permuted_mlp_reduction(fp32, seed=1):
        noise = fp32.score(seqs, output="logits")
    broken = tf32.score(seqs, output="logits")
    swaps = [tf32.swap_step(name, fn) for name, fn in steps.items()]
    for s in swaps:
        s.__enter__()
    try:
        restored = tf32.score(seqs, output="logits")
    finally:
        for s in reversed(swaps):
            s.__exit__(None, None, None)
    return {"noise floor": kl(noise), "tf32": kl(broken), "restored": kl(restored)}


_base = fp32.score(example_seqs, output="logits")
_kl = torch.cat([metrics.kl_divergence(b, r) for b, r in
                 zip(_base, tf32.score(example_seqs, output="logits"))]).mean()
print(f"example: {len(example_seqs)} prose windows of {len(example_seqs[0])} tokens; the TF32 "
      f"engine against the float32 one: mean KL {float(_kl):.3g} nats (the float32 noise floor "
      f"is ~1e-11)")

# %% [markdown] nbgrader={"grade": false, "grade_id": "task1", "locked": true, "schema_version": 3, "solution": false, "task": false}
# ## Task 1: TF32 rounding by three rules (4 points)
#
# TF32 keeps float32's sign and 8 exponent bits and the top 10 of the 23 mantissa bits.
# On the float32 bit pattern (`bits(x)`), rounding to TF32 decides what happens to the
# low 13 bits. Write `round_tf32(x, mode)` for a float32 tensor `x` of any shape; return
# a float32 tensor of the same shape whose low 13 mantissa bits are zero:
#
# - `"rne"`: to the nearest TF32 value, an exact tie (low 13 bits = `0x1000`) to the
#   neighbour whose last kept bit is 0. This is the engine's `round_to_tf32` (and, as
#   chapter 13 measured, what the H200's cuBLAS does); the grader compares with it.
# - `"rna"`: to the nearest, an exact tie away from zero (PTX `cvt.rna.tf32.f32`).
# - `"truncate"`: toward zero, the low 13 bits dropped (a tensor core fed raw float32
#   registers).
#
# Rules for every mode: the sign is kept (-0.0 stays -0.0, -1024.5 rounds like 1024.5);
# float32 subnormals are rounded on the same grid (TF32 has float32's exponent); a carry
# out of the mantissa raises the exponent, so rounding up from the largest finite values
# gives infinity; **inf and NaN patterns come back bit for bit unchanged** (careful:
# clearing the low bits of the NaN `0x7F800001` would make it +inf). Do not modify `x`.
# Integer arithmetic on `bits(x)` (int32) does all of this; `.view(torch.float32)`
# turns int32 patterns back into floats.

# %% nbgrader={"grade": false, "grade_id": "round_tf32", "locked": false, "schema_version": 3, "solution": true, "task": false}
def round_tf32(x: torch.Tensor, mode: str = "rne") -> torch.Tensor:
    ### BEGIN SOLUTION
    if mode not in ("rne", "rna", "truncate"):
        raise ValueError(f"mode must be 'rne', 'rna' or 'truncate', got {mode!r}")
    b = bits(x)
    if mode == "rne":
        r = b + 0xFFF + ((b >> 13) & 1)   # ties go up only when the last kept bit is 1
    elif mode == "rna":
        r = b + 0x1000                    # ties (and above) go up, in magnitude
    else:
        r = b
    special = (b & 0x7F800000) == 0x7F800000
    return torch.where(special, b, r & ~0x1FFF).view(torch.float32)
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "test_round_visible", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
_x = torch.tensor([1024.5, 1025.5, 1024.25, 1024.75, -1024.5, float("inf")])
_want = {"rne": [1024.0, 1026.0, 1024.0, 1025.0, -1024.0, float("inf")],
         "rna": [1025.0, 1026.0, 1024.0, 1025.0, -1025.0, float("inf")],
         "truncate": [1024.0, 1025.0, 1024.0, 1024.0, -1024.0, float("inf")]}
for _mode, _w in _want.items():
    _got = round_tf32(_x.clone(), _mode)
    checks.equal(f"round_tf32({_x.tolist()}, {_mode!r})", _got.tolist(), _w)
checks.equal("round_tf32 keeps the shape", tuple(round_tf32(torch.ones(2, 3, 4)).shape), (2, 3, 4))
checks.equal("round_tf32 returns float32", round_tf32(torch.ones(3)).dtype, torch.float32)
print("visible test passed")

# %% nbgrader={"grade": true, "grade_id": "test_round_hidden", "locked": true, "points": 3, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
### BEGIN HIDDEN TESTS
from minivllm.numerics import round_to_tf32 as _engine_rne


def _ref_bits(x, mode):
    """The grader's reference: rne is the engine's round_to_tf32; truncate drops the low
    13 bits; rna is the nearest neighbour with exact ties moved away from zero."""
    b = x.contiguous().view(torch.int32)
    special = (b & 0x7F800000) == 0x7F800000
    down = b & ~0x1FFF
    if mode == "rne":
        out = _engine_rne(x).view(torch.int32)
    elif mode == "truncate":
        out = down
    else:
        out = torch.where((b & 0x1FFF) >= 0x1000, down + 0x2000, down)
    return torch.where(special, b, out)


def _kind(b):
    m, low = b & 0x7FFFFFFF, b & 0x1FFF
    if m >= 0x7F800000:
        return "NaN" if m > 0x7F800000 else "inf"
    if m < 0x00800000:
        return "subnormal" + (" tie" if low == 0x1000 else "")
    if m >= 0x7F7FE000:
        return "near the largest finite value"
    return "exact tie" if low == 0x1000 else "ordinary"


_g = torch.Generator().manual_seed(20261313)
_rand = torch.randint(-2**31, 2**31, (200_000,), generator=_g, dtype=torch.int64)
_ties = (torch.randint(-2**31, 2**31, (20_000,), generator=_g, dtype=torch.int64) & ~0x1FFF) | 0x1000
_sub = torch.randint(0, 0x800000, (20_000,), generator=_g, dtype=torch.int64) \
    | (torch.randint(0, 2, (20_000,), generator=_g, dtype=torch.int64) << 31)
_edge = torch.tensor([0, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00000, 0x7F800001,
                      0xFF801234, 0x7FFFFFFF, 0x7F7FFFFF, 0xFF7FFFFF, 0x7F7FF000, 0x7F7FE000 | 0x1000,
                      0x7F7FD000, 0x00001000, 0x00003000, 0x80001000, 0x007FF000, 0x007FFFFF,
                      0x44801000, 0x44803000, 0xC4801000, 0x3F801000, 0x3F800FFF], dtype=torch.int64)
_all = torch.cat([_rand, _ties, _sub, _edge]).to(torch.int32)   # wraps to int32 patterns
_x = _all.view(torch.float32)
for _mode in ("rne", "rna", "truncate"):
    _inp = _x.clone()
    _got = round_tf32(_inp, _mode)
    checks.equal(f"round_tf32(x, {_mode!r}) left x unchanged",
                 bool(torch.equal(_inp.view(torch.int32), _all)), True)
    checks.equal(f"round_tf32(x, {_mode!r}) shape and dtype", (tuple(_got.shape), _got.dtype),
                 (tuple(_x.shape), torch.float32))
    _want = _ref_bits(_x, _mode)
    _bad = (_got.contiguous().view(torch.int32) != _want).nonzero().flatten()
    if len(_bad):
        _ex = "; ".join(f"{_kind(int(_all[i]))}: input 0x{int(_all[i]) & 0xFFFFFFFF:08X} -> "
                        f"expected 0x{int(_want[i]) & 0xFFFFFFFF:08X}, got "
                        f"0x{int(_got.view(torch.int32)[i]) & 0xFFFFFFFF:08X}" for i in _bad[:4])
        raise checks.CheckFailed(f"round_tf32(x, {_mode!r}): {len(_bad)} of {len(_all)} fresh bit "
                                 f"patterns differ from the reference, e.g. {_ex}")
# a non-contiguous view of a 2-D tensor, rounded element by element
_m = _x[:60_000].reshape(200, 300).T
checks.equal("round_tf32 on a transposed (non-contiguous) tensor",
             bool(torch.equal(round_tf32(_m, "rne").contiguous().view(torch.int32),
                              _ref_bits(_m.contiguous(), "rne"))), True)
### END HIDDEN TESTS

# %% [markdown] nbgrader={"grade": false, "grade_id": "task2", "locked": true, "schema_version": 3, "solution": false, "task": false}
# ## Task 2: which rule did the RTX 3090 use? (1 point)
#
# In pytorch #53635 (2021), `torch.tensor([1024.5]) @ torch.tensor([[1.0]])` returned
# `1025.` on an RTX 3090 with TF32 on. Set `MODE_53635` to the mode of `round_tf32`
# that reproduces that number. (Chapter 13 measured an H200 that does something else.)

# %% nbgrader={"grade": false, "grade_id": "mode_53635", "locked": false, "schema_version": 3, "solution": true, "task": false}
### BEGIN SOLUTION
MODE_53635 = "rna"
### END SOLUTION

# %% nbgrader={"grade": true, "grade_id": "test_mode_53635", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
checks.one_of("MODE_53635", MODE_53635, ["rne", "rna", "truncate"])
_by_mode = {"rne": 1024.0, "rna": 1025.0, "truncate": 1024.0}  # the three rules on 1024.5
checks.equal(f"[1024.5] @ I rounded with mode {MODE_53635!r} (the 3090 gave 1025.0)",
             _by_mode[MODE_53635], 1025.0)
print("test passed")

# %% [markdown] nbgrader={"grade": false, "grade_id": "task3", "locked": true, "schema_version": 3, "solution": false, "task": false}
# ## Task 3: a 3xTF32 matmul (3 points)
#
# Write `split_tf32_matmul(a, b)` for float32 `a` `[M, K]` and `b` `[K, N]` (`b` may be a
# transposed view): split each operand into two TF32 parts with your `round_tf32`,
# `hi = round_tf32(a)`, `lo = round_tf32(a - hi)` (then `a = hi + lo` up to ~2^-22 of
# `a`), and return the float32 `[M, N]` result of `a_lo @ b_hi + a_hi @ b_lo + a_hi @ b_hi`
# (summing the two small products first). The dropped `a_lo @ b_lo` is ~2^-22 of the
# result.
#
# The grader checks two things on fresh matrices: every matmul you run reads TF32 values
# only (it watches with `MatmulWatch`; a plain float32 `a @ b` fails, so do float64
# operands), and the error against float64, mean of `|y - exact| / (|a| @ |b|)`, is at
# most **4x the error of a plain float32 matmul** of the same operands.

# %% nbgrader={"grade": false, "grade_id": "split_tf32_matmul", "locked": false, "schema_version": 3, "solution": true, "task": false}
def split_tf32_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    ### BEGIN SOLUTION
    a_hi = round_tf32(a, "rne")
    a_lo = round_tf32(a - a_hi, "rne")
    b_hi = round_tf32(b, "rne")
    b_lo = round_tf32(b - b_hi, "rne")
    return (a_lo @ b_hi + a_hi @ b_lo) + a_hi @ b_hi
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "test_split_visible", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
_g = torch.Generator().manual_seed(5)
_a, _b = torch.randn(16, 256, generator=_g), torch.randn(256, 32, generator=_g)
_exact = _a.double() @ _b.double()
_scale = _a.double().abs() @ _b.double().abs()


def _err(y):
    return float(((y.double() - _exact).abs() / _scale).mean())


with MatmulWatch() as _w:
    _y = split_tf32_matmul(_a, _b)
checks.equal("split_tf32_matmul ran at least one matmul", _w.calls > 0, True)
checks.equal("every matmul read TF32 values only", _w.problems[:3], [])
checks.equal("result shape and dtype", (tuple(_y.shape), _y.dtype), ((16, 32), torch.float32))
_e32, _etf = _err(_a @ _b), _err(round_tf32(_a, "rne") @ round_tf32(_b, "rne"))
print(f"mean relative error: float32 {_e32:.3g}, plain TF32 {_etf:.3g}, yours {_err(_y):.3g}")
checks.at_most("split_tf32_matmul error / float32 error", _err(_y) / _e32, 4.0)
print("visible test passed")

# %% nbgrader={"grade": true, "grade_id": "test_split_hidden", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
### BEGIN HIDDEN TESTS
_g = torch.Generator().manual_seed(77013)
_cases = {
    "a decode row [1x576] @ [576x1536]": (torch.randn(1, 576, generator=_g),
                                          torch.randn(1536, 576, generator=_g).T),
    "[33x1536] @ [1536x576]": (torch.randn(33, 1536, generator=_g),
                               torch.randn(576, 1536, generator=_g).T * 0.02),
    "[8x4096] @ [4096x64], wide magnitudes": (torch.randn(8, 4096, generator=_g)
                                              * torch.exp(3 * torch.randn(8, 4096, generator=_g)),
                                              torch.randn(4096, 64, generator=_g)),
    "[24x512] @ [512x48], all positive": (torch.rand(24, 512, generator=_g),
                                          torch.rand(512, 48, generator=_g)),
}
for _name, (_a, _b) in _cases.items():
    _exact = _a.double() @ _b.double()
    _scale = _a.double().abs() @ _b.double().abs()
    with MatmulWatch() as _w:
        _y = split_tf32_matmul(_a, _b)
    if _w.calls == 0 or _w.problems:
        raise checks.CheckFailed(
            f"{_name}: a 3xTF32 matmul multiplies TF32 values only, with torch matmuls the "
            f"grader can watch; seen {_w.calls} matmul call(s), problems: {_w.problems[:3]}")
    checks.equal(f"{_name}: shape and dtype", (tuple(_y.shape), _y.dtype),
                 ((_a.shape[0], _b.shape[1]), torch.float32))
    _e = float(((_y.double() - _exact).abs() / _scale).mean())
    _e32 = float((((_a @ _b).double() - _exact).abs() / _scale).mean())
    checks.at_most(f"{_name}: mean relative error {_e:.3g} / float32's {_e32:.3g}", _e / _e32, 4.0)
### END HIDDEN TESTS

# %% [markdown] nbgrader={"grade": false, "grade_id": "task4", "locked": true, "schema_version": 3, "solution": false, "task": false}
# ## Task 4: restore the TF32 engine (7 points)
#
# Return a dict `{step name: function}` of steps of the step registry
# (`minivllm.steps`, chapter 13 section 6) that, swapped into the TF32 engine, bring its
# distributions back to float32 accuracy while every matmul still reads TF32 values:
#
# - `"linear"` takes `(x, weight, bias)` with `x` `[..., in]`, `weight` `[out, in]`,
#   `bias` `[out]` or None, and returns `x @ weight.T + bias`;
# - `"lm_head"` takes `(hidden, weight)` and returns float32 logits `hidden @ weight.T`.
#
# Build them on your `split_tf32_matmul`. Which steps does the engine need? Chapter 13
# measured where TF32's error comes from; `measure(tf32x3_steps(), example_seqs)` prints
# the numbers for your choice (the plain TF32 engine, yours, and the noise floor).
#
# The grader swaps your steps into the TF32 engine (`tf32.swap_step(name, fn)` for each
# entry), scores prompts you have not seen, and requires the mean KL against the float32
# engine to be at most **10x the float32 noise floor** measured on the same prompts (the
# noise floor is ~1e-11 nats, plain TF32 ~3e-6). Every matmul inside your steps must read
# TF32 values only.

# %% nbgrader={"grade": false, "grade_id": "steps", "locked": false, "schema_version": 3, "solution": true, "task": false}
def tf32x3_steps() -> dict:
    ### BEGIN SOLUTION
    def linear(x, weight, bias):
        y = split_tf32_matmul(x.reshape(-1, x.shape[-1]), weight.T)
        y = y.reshape(*x.shape[:-1], weight.shape[0])
        return y if bias is None else y + bias

    def lm_head(hidden, weight):
        return split_tf32_matmul(hidden, weight.T).float()

    return {"linear": linear, "lm_head": lm_head}
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "test_steps_visible", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
from minivllm.steps import STEPS as _STEPS

_steps = tf32x3_steps()
checks.equal("tf32x3_steps() returns a dict", isinstance(_steps, dict), True)
for _name, _fn in _steps.items():
    checks.one_of("a step name", _name, list(_STEPS))
    checks.equal(f"steps[{_name!r}] is callable", callable(_fn), True)
checks.one_of("the steps include", "linear", list(_steps))
_g = torch.Generator().manual_seed(9)
_x, _wt, _bias = torch.randn(5, 576, generator=_g), torch.randn(64, 576, generator=_g) * 0.05, \
    torch.randn(64, generator=_g)
with MatmulWatch() as _w:
    _y = _steps["linear"](_x, _wt, _bias)
checks.equal("the linear step's matmuls read TF32 values only", _w.problems[:3], [])
_exact = _x.double() @ _wt.double().T + _bias.double()
_scale = _x.double().abs() @ _wt.double().abs().T
_e = float(((_y.double() - _exact).abs() / _scale).mean())
_e32 = float(((torch.nn.functional.linear(_x, _wt, _bias).double() - _exact).abs() / _scale).mean())
checks.at_most("linear step error / float32 linear's", _e / _e32, 4.0)
print("visible test passed; steps:", list(_steps))

# %% nbgrader={"grade": true, "grade_id": "test_steps_engine", "locked": true, "points": 6, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
### BEGIN HIDDEN TESTS
import contextlib as _contextlib

_watch, _steps = [], tf32x3_steps()  # the learner's function first: a stub fails at once
_seqs = [evalsets.conversation_sequences(tok, max_conversations=12)[11][:96]]
# the "linear" step's contract: x of any shape [..., in] (here [2, 3, 64]), y [..., out]
_g = torch.Generator().manual_seed(13001)
_x3, _w3 = torch.randn(2, 3, 64, generator=_g), torch.randn(16, 64, generator=_g) * 0.1
_y3 = _steps["linear"](_x3, _w3, None)
checks.equal("linear step on x of shape [2, 3, 64]: output shape", tuple(_y3.shape), (2, 3, 16))
checks.at_most("linear step on x [2, 3, 64]: max |y - float64 x W^T|",
               float((_y3.double() - _x3.double() @ _w3.double().T).abs().max()), 1e-4)


def _kl(base, rows):
    return float(torch.cat([metrics.kl_divergence(b, r) for b, r in zip(base, rows)]).mean())


_base = fp32.score(_seqs, output="logits")
with permuted_mlp_reduction(fp32, seed=13):
    _noise = _kl(_base, fp32.score(_seqs, output="logits"))
_limit = 10 * _noise
_broken = _kl(_base, tf32.score(_seqs, output="logits"))   # the TF32 engine as configured



def _watched(fn):
    def call(*args):
        with MatmulWatch() as w:
            out = fn(*args)
        _watch.append(w)
        return out
    return call


with _contextlib.ExitStack() as _stack:
    for _name, _fn in _steps.items():
        _stack.enter_context(tf32.swap_step(_name, _watched(_fn)))
    _restored = _kl(_base, tf32.score(_seqs, output="logits"))

print(f"{sum(map(len, _seqs))} fresh positions; mean KL against the float32 engine (nats): "
      f"noise floor {_noise:.3g} (limit 10x = {_limit:.3g}); plain TF32 {_broken:.3g} "
      f"({_broken / _noise:,.0f}x the floor); TF32 + your steps {_restored:.3g} "
      f"({_restored / _noise:,.1f}x the floor)")
# the check must discriminate: the broken configuration fails it
assert _broken > _limit, f"plain TF32 ({_broken:.3g}) should fail the limit {_limit:.3g}"
_problems = [p for w in _watch for p in w.problems]
if not _watch or _problems or not all(w.calls for w in _watch):
    raise checks.CheckFailed(
        "every swapped step must compute with matmuls that read TF32 values only "
        f"({len(_watch)} step calls, {sum(not w.calls for w in _watch)} without a visible "
        f"matmul; problems: {_problems[:3]})")
checks.at_most(f"KL of the TF32 engine with your steps {list(_steps)} (plain TF32: "
               f"{_broken:.3g}; if only part of the matmuls are fixed, the rest still carry "
               f"TF32's error)", _restored, _limit)
### END HIDDEN TESTS
