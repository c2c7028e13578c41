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
# # Lab 12: choose a dtype that neither overflows nor wastes precision
#
# Chapter 12 started from a float32 checkpoint and vLLM's `dtype="auto"`: on a GPU without
# bfloat16 (T4, V100), and on every GPU before vLLM PR #18751, `auto` serves a float32
# checkpoint in **float16** (the OLMo incident, olmo-cookbook #60: `"!!!!!!!!"`). For the
# embedded model with its residual stream scaled by 4 (`faults.residual_scale_reparam`, an
# exact reparametrization: same logits in float32, bit for bit) that configuration gives NaN
# from layer 11 on, and every request ends with `finish_reason="error"`. On the unmodified
# model the opposite happens: `auto` picks bfloat16 on a CPU, while float16 would be more
# than ten times closer to float32.
#
# You write three functions. The grader calls them on **new** inputs (every combination of
# names, checkpoint dtypes, platforms and model types; fresh prompts; other scales of the
# residual) and compares with its own reference, so code that only works on the examples
# here will not pass.
#
# 1. `resolve_dtype(dtype, config_dtype, supported, model_type)`: vLLM's rule, 4 points;
# 2. `residual_peaks(llm, token_ids)`: the peak |x| of the residual stream per layer, 3 points;
# 3. `choose_dtype(config_dtype, peak, supported, model_type)`: the safe and precise choice,
#    10 points, 7 of them checked by building engines with your choice on fresh prompts.
#
# Run the cells in order. Do not edit the setup and test cells.

# %% nbgrader={"grade": false, "grade_id": "setup", "locked": true, "schema_version": 3, "solution": false, "task": false}
import importlib

import grading.checks as checks  # first import: records the original functions
import torch

from minivllm import LLM, SamplingParams
from minivllm.config import parse_dtype
from minivllm.precision import evalsets, metrics
from minivllm.models.loader import resolve_model_path
from minivllm.precision.faults import residual_scale_reparam
from minivllm.tokenizer import get_tokenizer

torch.manual_seed(0)
MODEL = "smollm2-135m-instruct"
F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
# Platforms: a platform's supported compute dtypes, preferred first (vLLM's
# current_platform.supported_dtypes).
CPU = [BF16, F16, F32]             # x86/aarch64 CPUs, and GPUs of compute capability >= 8.0
PRE_AMPERE = [F16, F32]            # T4, V100: no bfloat16
# vLLM's _FLOAT16_NOT_SUPPORTED_MODELS: model types that overflow float16.
FLOAT16_NOT_SUPPORTED = ("gemma2", "gemma3", "gemma3_text", "plamo2", "glm4")
NAMES = {"half": F16, "float16": F16, "bfloat16": BF16, "float": F32, "float32": F32}
MARGIN = 2.0  # a dtype holds a model if peak * MARGIN <= torch.finfo(dtype).max

_ENGINES = {}


def engine(dtype: torch.dtype) -> LLM:
    """The embedded model (a float32 checkpoint) served in `dtype`; one engine per dtype,
    built on first use and reused."""
    if dtype not in _ENGINES:
        _ENGINES[dtype] = LLM(MODEL, dtype=dtype, max_model_len=256,
                              kv_cache_memory_bytes=16 << 20)
    return _ENGINES[dtype]


def amplified(llm: LLM, c: float):
    """`with amplified(llm, 4): ...`: the residual stream scaled by c (exact for powers of
    two; chapter 12, section 3)."""
    return residual_scale_reparam(llm, c)


tok = get_tokenizer(str(resolve_model_path(MODEL)))  # no engine needed for the tokenizer
_text = evalsets.load_corpus()
example_ids = [tok.encode(_text[:400])[:24], tok.encode(_text[400:800])[:24]]
print(f"example: 2 corpus snippets of {len(example_ids[0])} tokens; engines are built when "
      "first needed (float32 about 2 s, each 16-bit one about 2 s)")

# %% [markdown] nbgrader={"grade": false, "grade_id": "task1", "locked": true, "schema_version": 3, "solution": false, "task": false}
# ## Task 1: vLLM's dtype rule (4 points)
#
# Write `resolve_dtype(dtype, config_dtype, supported, model_type=None)`, vLLM's
# `_get_and_verify_dtype` without the logging:
#
# - `dtype` is a string or a `torch.dtype`. Strings are matched **case-insensitively**
#   against `"auto"` and the keys of `NAMES`; any other string, and any other type, raises
#   `ValueError` (say what was given and what is allowed). A `torch.dtype` must be one of
#   float32, float16, bfloat16 (else `ValueError`) and is taken as it is.
# - `"auto"`: start from `supported` (the platform's dtypes, preferred first) and strike
#   float16 from it if `model_type` is in `FLOAT16_NOT_SUPPORTED`. A float32 checkpoint
#   (`config_dtype`) gets the first dtype left (the preferred one). A 16-bit checkpoint keeps
#   its dtype if it is left, else it also gets the first dtype left. If nothing is left,
#   raise `ValueError`.
# - Whatever was chosen, explicitly or by `"auto"`: float16 for a model type in
#   `FLOAT16_NOT_SUPPORTED` raises `ValueError`.
#
# Return the `torch.dtype`. Do not call `minivllm.config.parse_dtype` (the grader compares
# with it).

# %% nbgrader={"grade": false, "grade_id": "resolve_dtype", "locked": false, "schema_version": 3, "solution": true, "task": false}
def resolve_dtype(dtype, config_dtype: torch.dtype, supported: list,
                  model_type: str = None) -> torch.dtype:
    ### BEGIN SOLUTION
    if isinstance(dtype, torch.dtype):
        if dtype not in (F32, F16, BF16):
            raise ValueError(f"dtype {dtype} is not supported; use float32, float16 or bfloat16")
        chosen = dtype
    elif isinstance(dtype, str) and (dtype.lower() == "auto" or dtype.lower() in NAMES):
        key = dtype.lower()
        if key == "auto":
            left = [d for d in supported
                    if not (d == F16 and model_type in FLOAT16_NOT_SUPPORTED)]
            if not left:
                raise ValueError(f"no dtype of {supported} can run model type {model_type!r}")
            chosen = config_dtype if config_dtype != F32 and config_dtype in left else left[0]
        else:
            chosen = NAMES[key]
    else:
        raise ValueError(f"Unknown dtype {dtype!r}; allowed: auto, {', '.join(NAMES)}")
    if chosen == F16 and model_type in FLOAT16_NOT_SUPPORTED:
        raise ValueError(f"model type {model_type!r} does not support float16")
    return chosen
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "test_resolve_visible", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
checks.equal("resolve_dtype('auto', float32, CPU)", resolve_dtype("auto", F32, CPU), BF16)
checks.equal("resolve_dtype('auto', float32, PRE_AMPERE) (the OLMo path)",
             resolve_dtype("auto", F32, PRE_AMPERE), F16)
checks.equal("resolve_dtype('auto', bfloat16, CPU)", resolve_dtype("auto", BF16, CPU), BF16)
checks.equal("resolve_dtype('Half', float32, CPU)", resolve_dtype("Half", F32, CPU), F16)
try:
    resolve_dtype("fp16", F32, CPU)
except ValueError:
    pass
else:
    raise checks.CheckFailed("resolve_dtype('fp16', ...) must raise ValueError: vLLM's names "
                             "are auto, half, float16, bfloat16, float, float32")
print("visible test passed")

# %% nbgrader={"grade": true, "grade_id": "test_resolve_hidden", "locked": true, "points": 3, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
### BEGIN HIDDEN TESTS
import itertools as _it


def _outcome(fn, *args):
    try:
        return fn(*args)
    except ValueError:
        return "ValueError"


_names = ["auto", "AUTO", "half", "float16", "bfloat16", "BFloat16", "float", "float32",
          "FLOAT32", F16, BF16, F32, "fp16", "bf16", "float64", "", torch.float64, 16, None]
_platforms = [CPU, PRE_AMPERE, [F32], [F16], [BF16, F32], [F16, BF16, F32]]
_types = [None, "llama", "qwen2", "gemma3", "gemma2", "glm4", "gemma3_text", "plamo2"]
import logging as _logging
_log = _logging.getLogger("minivllm")
_level, _n = _log.level, 0
_log.setLevel(_logging.ERROR)  # the engine's rule logs each fallback and cast: not needed here
for _name, _cfg, _sup, _mt in _it.product(_names, [F32, F16, BF16], _platforms, _types):
    _got = _outcome(resolve_dtype, _name, _cfg, list(_sup), _mt)
    if _name is None or _name == 16:
        _want = "ValueError"  # not a string or a torch.dtype
    else:
        _want = _outcome(lambda *a: parse_dtype(a[0], a[1], "cpu", model_type=a[3],
                                                supported=a[2]), _name, _cfg, list(_sup), _mt)
    if _got != _want:
        _log.setLevel(_level)
    checks.equal(f"resolve_dtype({_name!r}, {_cfg}, {_sup}, model_type={_mt!r})", _got, _want)
    _n += 1
_log.setLevel(_level)
print(f"{_n} combinations agree with the engine's rule")
### END HIDDEN TESTS

# %% [markdown] nbgrader={"grade": false, "grade_id": "task2", "locked": true, "schema_version": 3, "solution": false, "task": false}
# ## Task 2: the residual stream's peak per layer (3 points)
#
# Whether float16 can hold a model is decided by its largest activation. Write
# `residual_peaks(llm, token_ids)`: score the token sequences `token_ids` (a list of lists
# of ints) with `llm.score(token_ids)` and return a float32 tensor `[num_layers]` whose
# entry `i` is the largest `|x|` over every element of decoder layer `i`'s output (the
# residual stream after that layer) during that call. The decoder layers are
# `llm.llm_engine.model_runner.model.layers` (an `nn.ModuleList`): register a forward hook
# on each (`module.register_forward_hook(fn)`, `fn(module, args, output)`), and **remove
# every hook before returning**, also if scoring raises. An inf in the output makes that
# entry inf.

# %% nbgrader={"grade": false, "grade_id": "residual_peaks", "locked": false, "schema_version": 3, "solution": true, "task": false}
def residual_peaks(llm: LLM, token_ids: list) -> torch.Tensor:
    ### BEGIN SOLUTION
    layers = llm.llm_engine.model_runner.model.layers
    peaks = torch.zeros(len(layers), dtype=torch.float32)

    def hook(i):
        def record(module, args, output):
            peaks[i] = torch.maximum(peaks[i], output.detach().abs().max().float())
        return record

    handles = [layer.register_forward_hook(hook(i)) for i, layer in enumerate(layers)]
    try:
        llm.score(token_ids)
    finally:
        for h in handles:
            h.remove()
    return peaks
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "test_peaks_visible", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
_p = residual_peaks(engine(F32), example_ids)
checks.equal("residual_peaks returns a torch.Tensor", isinstance(_p, torch.Tensor), True)
checks.equal("residual_peaks shape", tuple(_p.shape), (30,))
checks.equal("residual_peaks dtype", _p.dtype, torch.float32)
checks.equal("every peak > 0", bool((_p > 0).all()), True)
checks.equal("no hook left on the decoder layers",
             sum(len(l._forward_hooks) for l in engine(F32).llm_engine.model_runner.model.layers), 0)
print(f"peaks of the example: layer 0 {float(_p[0]):.3g}, the largest {float(_p.max()):,.0f} "
      f"at layer {int(_p.argmax())}")

# %% nbgrader={"grade": true, "grade_id": "test_peaks_hidden", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
### BEGIN HIDDEN TESTS
import random as _random
_rng = _random.Random(12001)
_llm = engine(F32)
_layers = _llm.llm_engine.model_runner.model.layers


def _ref_peaks(ids):
    out = torch.zeros(len(_layers))
    hs = [l.register_forward_hook(lambda m, a, o, i=i: out.__setitem__(
        i, max(float(out[i]), float(o.detach().abs().max())))) for i, l in enumerate(_layers)]
    try:
        _llm.score(ids)
    finally:
        for h in hs:
            h.remove()
    return out


for _c in (2.0, 0.5):
    _s = _rng.randrange(0, len(_text) - 2000)
    _ids = [tok.encode(_text[_s:_s + 2000])[:n] for n in (_rng.randint(10, 30), 7)]
    with amplified(_llm, _c):
        _got = residual_peaks(_llm, _ids)
        _want = _ref_peaks(_ids)
    checks.equal(f"residual_peaks shape (residual x{_c})", tuple(_got.shape), (30,))
    for _i in range(30):
        checks.close(f"residual_peaks on fresh text (residual x{_c}), layer {_i}",
                     float(_got[_i]), float(_want[_i]), rtol=1e-6)
    checks.equal("no hook left behind",
                 sum(len(l._forward_hooks) for l in _layers), 0)
# an overflowing float16 engine: inf peaks are reported as inf
with amplified(engine(F16), 4.0):
    _got = residual_peaks(engine(F16), [tok.encode(_text[5000:5400])[:20]])
checks.equal("residual_peaks of the x4 model in float16 holds inf (the overflow)",
             bool(torch.isinf(_got).any()), True)
checks.equal("residual_peaks dtype on a float16 engine (a float32 tensor, whatever the engine)",
             _got.dtype, torch.float32)
# one call of llm.score that runs several forward passes (6 sequences of 200 tokens: more
# than one batch of the engine's token budget): the peak is over the whole call
_ids6 = [tok.encode(_text[_s:_s + 3000])[:200]
         for _s in (int(len(_text) * _f) for _f in (0.05, 0.2, 0.35, 0.5, 0.65, 0.8))]
_got = residual_peaks(_llm, _ids6)
_want = _ref_peaks(_ids6)
for _i in range(30):
    checks.close(f"residual_peaks over one call of several forward passes, layer {_i}",
                 float(_got[_i]), float(_want[_i]), rtol=1e-6)
checks.equal("no hook left behind (float16 engine)",
             sum(len(l._forward_hooks) for l in engine(F16).llm_engine.model_runner.model.layers), 0)
# a layer whose extreme is negative: a hook of the grader's, registered before yours,
# negates layer 12's output (your hook sees what it returns), so |x|'s peak there is a
# negative number (the model's own extremes from layer 11 on are positive)
_neg = _layers[12].register_forward_hook(lambda m, a, o: -o)
try:
    _ids = [tok.encode(_text[7000:7600])[:24]]
    _got = residual_peaks(_llm, _ids)
    _want = _ref_peaks(_ids)
finally:
    _neg.remove()
checks.close("residual_peaks at a layer whose largest |x| is a negative value (layer 12)",
             float(_got[12]), float(_want[12]), rtol=1e-6)
# scoring that raises (a token id past the vocabulary) must still remove every hook
_model = _llm.llm_engine.model_runner.model
_ = checks.call("residual_peaks(llm, [[1, 10**9]]) (scoring raises)",
                lambda ids: residual_peaks(_llm, ids), [[1, 10 ** 9]], module=_model,
                raises=Exception)
### END HIDDEN TESTS

# %% [markdown] nbgrader={"grade": false, "grade_id": "task3", "locked": true, "schema_version": 3, "solution": false, "task": false}
# ## Task 3: choose a safe and precise dtype (10 points: 3, and the restore check 7)
#
# Write `choose_dtype(config_dtype, peak, supported, model_type=None)`. `peak` is the largest
# residual value measured in float32 on calibration text (a float). A dtype **holds** the
# model if `peak * MARGIN <= torch.finfo(dtype).max`, and is **allowed** if it is in
# `supported` and is not float16 for a model type in `FLOAT16_NOT_SUPPORTED`. Return:
#
# 1. a 16-bit checkpoint's own dtype if it is allowed and holds the model (no cast between
#    16-bit formats when none is needed);
# 2. otherwise float16 if it is allowed and holds the model: it has 10 mantissa bits to
#    bfloat16's 7, so where it fits it is the more precise 16-bit format (chapter 12);
# 3. otherwise bfloat16 if it is allowed and holds the model;
# 4. otherwise float32.
#
# The grader then builds engines with your choices (your `residual_peaks` measures the
# peak on calibration text) and checks, on fresh prompts, the two configurations chapter 12
# found broken: the x4 model on a pre-Ampere platform (`auto`: float16, NaN) and the
# unmodified model on a CPU (`auto`: bfloat16, KL ~1e-3 nats against float32).

# %% nbgrader={"grade": false, "grade_id": "choose_dtype", "locked": false, "schema_version": 3, "solution": true, "task": false}
def choose_dtype(config_dtype: torch.dtype, peak: float, supported: list,
                 model_type: str = None) -> torch.dtype:
    ### BEGIN SOLUTION
    def ok(d):
        allowed = d in supported and not (d == F16 and model_type in FLOAT16_NOT_SUPPORTED)
        return allowed and peak * MARGIN <= torch.finfo(d).max

    if config_dtype in (F16, BF16) and ok(config_dtype):
        return config_dtype
    for d in (F16, BF16):
        if ok(d):
            return d
    return F32
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "test_choose_visible", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
checks.equal("choose_dtype(float32, peak 22500, CPU)", choose_dtype(F32, 22500.0, CPU), F16)
checks.equal("choose_dtype(float32, peak 90000, CPU)", choose_dtype(F32, 90000.0, CPU), BF16)
checks.equal("choose_dtype(float32, peak 90000, PRE_AMPERE)",
             choose_dtype(F32, 90000.0, PRE_AMPERE), F32)
checks.equal("choose_dtype(bfloat16, peak 100, CPU)", choose_dtype(BF16, 100.0, CPU), BF16)
print("visible test passed")

# %% nbgrader={"grade": true, "grade_id": "test_choose_hidden", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
### BEGIN HIDDEN TESTS
import itertools as _it
import random as _random
_rng = _random.Random(12002)


def _ref_choose(cfg, peak, sup, mt):
    def ok(d):
        return (d in sup and not (d == F16 and mt in FLOAT16_NOT_SUPPORTED)
                and peak * MARGIN <= torch.finfo(d).max)
    if cfg != F32 and ok(cfg):
        return cfg
    return next((d for d in (F16, BF16) if ok(d)), F32)


_h = torch.finfo(F16).max / MARGIN
_peaks = [0.0, 1.0, _h, _rng.uniform(0.5, 0.999) * _h, _rng.uniform(1.001, 3) * _h,
          float(torch.finfo(BF16).max), _rng.uniform(1e3, 6e4), 1e39,
          float("nan"), float("inf")]  # a NaN or inf peak holds in no dtype
_platforms = [CPU, PRE_AMPERE, [F32], [F16], [BF16, F32], [F16, BF16, F32]]
for _cfg, _p, _sup, _mt in _it.product([F32, F16, BF16], _peaks, _platforms,
                                       [None, "llama", "gemma3", "glm4"]):
    checks.equal(f"choose_dtype({_cfg}, peak={_p:.6g}, {_sup}, model_type={_mt!r})",
                 choose_dtype(_cfg, _p, list(_sup), _mt), _ref_choose(_cfg, _p, _sup, _mt))
### END HIDDEN TESTS

# %% [markdown] nbgrader={"grade": false, "grade_id": "restore", "locked": true, "schema_version": 3, "solution": false, "task": false}
# ## Restore check (7 points)
#
# For each of two scenarios the grader measures the peak with your `residual_peaks` on
# calibration text (float32 engine), asks your `choose_dtype` for a dtype, builds (or
# reuses) the engine in that dtype and scores four fresh corpus windows of 48 tokens (and
# for the x4 model answers two fresh questions greedily); the reference is the float32
# engine on the same model. It then
# runs the configuration `dtype="auto"` gives on that platform, with the same check, and
# requires it to fail:
#
# - the x4 model on `PRE_AMPERE` (`auto`: float16): every logit finite, no request ending
#   `"error"`, KL against float32 at most 5e-3 nats (bfloat16 weights measure ~1e-3);
# - the unmodified model on `CPU` (`auto`: bfloat16): KL at most 2e-4 nats (float16
#   measures 2e-5 to 3e-5, bfloat16 1e-3 to 2e-3).

# %% nbgrader={"grade": true, "grade_id": "test_restore", "locked": true, "points": 7, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
### BEGIN HIDDEN TESTS
import random as _random
import numpy as _np
_rng = _random.Random(12003)
_qa = evalsets.load_qa()
_greedy = SamplingParams(temperature=0, max_tokens=8)


def _window(n):
    _s = _rng.randrange(0, len(_text) - 1500)
    return tok.encode(_text[_s:_s + 1500])[:n]


_calib = [_window(40)]
# 4 x 48 positions: with 2 x 24 one draw in 100 put float16 at 1.6e-4 (others <= 4.7e-5)
_seqs = [_window(48) for _ in range(4)]
_prompts = [tok.encode(tok.apply_chat_template(evalsets.qa_prompt(q.question), tokenize=False,
                                               add_generation_prompt=True),
                       add_special_tokens=False) for q in _rng.sample(_qa, 2)]


_refs = {}


def _measure(dtype, c):
    """(mean KL vs float32 or inf, requests ending 'error') of the x c model in dtype; the
    greedy answers (which show 'error') are generated for the x4 model only."""
    if c not in _refs:
        with amplified(engine(F32), c):
            _refs[c] = engine(F32).score(_seqs, output="logits")
    errors = 0
    with amplified(engine(dtype), c):
        rows = engine(dtype).score(_seqs, output="logits")
        if c != 1.0:
            outs = engine(dtype).generate(_prompts, _greedy)
            errors = sum(o.outputs[0].finish_reason == "error" for o in outs)
    if not all(bool(torch.isfinite(r).all()) for r in rows):
        return float("inf"), errors
    kl = torch.cat([metrics.kl_divergence(a, b) for a, b in zip(_refs[c], rows)]).mean()
    return float(kl), errors


_first = choose_dtype(F32, 1.0, list(CPU))  # your function first: a stub fails here at once
# CPU budget: float16 (the solution) 1.8e-5..3.3e-5 over 100 draws of 4 x 48 tokens, bfloat16
# (auto) 1.2e-3..2.0e-3: 2e-4 is 6x above the one and 6x below the other
for _c, _sup, _name, _budget in ((4.0, PRE_AMPERE, "PRE_AMPERE", 5e-3), (1.0, CPU, "CPU", 2e-4)):
    with amplified(engine(F32), _c):
        _peak = float(residual_peaks(engine(F32), _calib).max())
    _mine = choose_dtype(F32, _peak, list(_sup))
    checks.equal(f"choose_dtype returns a torch dtype ({_name})", _mine in (F32, F16, BF16), True)
    _auto = parse_dtype("auto", F32, supported=list(_sup))
    _kl_mine, _err_mine = _measure(_mine, _c)
    _kl_auto, _err_auto = _measure(_auto, _c)
    print(f"x{_c:g} model on {_name}: peak {_peak:,.0f}; your choice {_mine}: KL {_kl_mine:.3g}, "
          f"{_err_mine} of 2 requests 'error'; auto ({_auto}): KL {_kl_auto:.3g}, "
          f"{_err_auto} 'error' (budget {_budget:g})")
    if _kl_auto <= _budget and _err_auto == 0:
        raise checks.CheckFailed(f"the check does not discriminate: auto ({_auto}) passes it")
    checks.equal(f"requests ending 'error' with your choice ({_name}, x{_c:g})", _err_mine, 0)
    checks.at_most(f"KL vs float32 with your choice {_mine} ({_name}, x{_c:g}), nats",
                   _kl_mine, _budget)
### END HIDDEN TESTS
