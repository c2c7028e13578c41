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
# # Lab 11: repair a rotary table
#
# In chapter 11 a rotary table built from bf16 positions was exact below position 257
# and wrong after it (KL of tenths of a nat at positions 512-575), and a `rope_scaling` that an
# engine ignores (ANEForge PR #58) or gets wrong (llama-models #241: factor 8 for 32)
# changed the model's position encoding. This lab starts from both **broken
# configurations**: `broken_table()` plants the bf16-positions table in every layer (the
# `"rotary.table"` step, `faults.low_precision_rope_table`), and `llama3_model()` turns
# the engine into a model whose config says `rope_scaling` llama3, which the plain
# engine then ignores.
#
# You write two functions. The grader calls them on **new** configurations (other head
# sizes, thetas, factors, lengths) and compares with **transformers' own** implementation
# (`transformers.modeling_rope_utils`, `LlamaRotaryEmbedding`), then installs your table
# in the engine (`llm.swap_step("rotary.table", rope_table)`) on text you have not seen
# and checks the KL against the correct engine, next to the broken configuration failing
# the same check.
#
# 1. `rope_inv_freq_llama3(...)`: the llama3 scaling of the inverse frequencies, 3 points;
# 2. `rope_table(head_dim, max_position, base, rope_scaling=None)`: the cos/sin table in
#    float32, with or without llama3 scaling, 3 points;
#    then two restore checks, 2 points each.
#
# Run the cells in order. Do not edit the setup and test cells. (The engine is built by
# the first restore check, so the first cells run in seconds.)

# %% nbgrader={"grade": false, "grade_id": "setup", "locked": true, "schema_version": 3, "solution": false, "task": false}
import importlib
import math

import grading.checks as checks  # first import: records the original functions
import torch

from minivllm import LLM
from minivllm.layers.rotary_embedding import rope_inv_freq, rope_table_ref
from minivllm.precision import evalsets, faults, metrics

MODEL = "smollm2-135m-instruct"
THETA, HEAD_DIM = 100000.0, 64  # SmolLM2's
_text = evalsets.load_corpus()
_engine = []


def get_llm():
    """The float32 engine (SmolLM2 as it is), built on first use and reused."""
    if not _engine:
        _engine.append(LLM(MODEL, dtype="float32", max_model_len=384, num_gpu_blocks_override=28))
    return _engine[0]


# A Llama-3.1-style rope_scaling, normalized as the engine hands it to the "rotary.table"
# step of a model whose config.json has it (``hf_overrides={"rope_scaling": LLAMA3}``).
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 1024}


def broken_table():
    """Chapter 11's first fault: the table built from bf16 positions, in every layer.
    ``with broken_table(): ...``; outside the block the engine is right."""
    return faults.low_precision_rope_table(get_llm(), torch.bfloat16, stage="positions")


def llama3_model():
    """The engine as a model whose config says ``rope_scaling`` = LLAMA3: the engine's
    own llama3 table in every layer. (Outside the block the engine uses no scaling,
    which is what an engine that ignores rope_scaling does: ANEForge PR #58.)"""
    def table(head_dim, max_position, base):
        return rope_table_ref(head_dim, max_position, base, LLAMA3)
    return get_llm().swap_step("rotary.table", table)


# What the broken table does to the numbers (no model needed):
_cos, _ = rope_table_ref(HEAD_DIM, 2048, THETA)
_bad, _ = faults.rope_table_low_precision(HEAD_DIM, 2048, THETA, dtype=torch.bfloat16,
                                          stage="positions")
_err = (_bad - _cos).abs().amax(-1)
print(f"bf16-positions table: max |cos error| at positions 0-256: {_err[:257].max():.1e}, "
      f"257-2047: {_err[257:].max():.2f}")

# %% [markdown] nbgrader={"grade": false, "grade_id": "task1", "locked": true, "schema_version": 3, "solution": false, "task": false}
# ## Task 1: the llama3 scaling of the inverse frequencies (3 points)
#
# `inv_freq` is a float32 tensor `[head_dim // 2]`, `inv_freq[i] = base^(-2i/head_dim)`.
# Llama 3.1's `rope_scaling` (`rope_type: "llama3"`) changes each entry by its
# wavelength `2 pi / inv_freq[i]`, with `L0 = original_max_position_embeddings`:
#
# - wavelength above `L0 / low_freq_factor` (slow pairs): divide by `factor`;
# - wavelength below `L0 / high_freq_factor` (fast pairs): keep;
# - in between: blend, `(1 - s) * inv_freq / factor + s * inv_freq` with
#   `s = (L0 / wavelength - low_freq_factor) / (high_freq_factor - low_freq_factor)`.
#
# Return a float32 tensor of the same shape (do not change `inv_freq` in place). Do not
# call the engine's `rope_inv_freq`: that would pass and teach nothing.

# %% nbgrader={"grade": false, "grade_id": "llama3_inv_freq", "locked": false, "schema_version": 3, "solution": true, "task": false}
def rope_inv_freq_llama3(inv_freq: torch.Tensor, factor: float, low_freq_factor: float,
                         high_freq_factor: float,
                         original_max_position_embeddings: int) -> torch.Tensor:
    ### BEGIN SOLUTION
    l0 = original_max_position_embeddings
    wavelen = 2 * math.pi / inv_freq
    s = (l0 / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - s) * inv_freq / factor + s * inv_freq
    out = torch.where(wavelen > l0 / low_freq_factor, inv_freq / factor, blended)
    return torch.where(wavelen < l0 / high_freq_factor, inv_freq, out)
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "test_llama3_visible", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
_inv = rope_inv_freq(HEAD_DIM, THETA)[0]
_got = rope_inv_freq_llama3(_inv.clone(), 8.0, 1.0, 4.0, 1024)
_want = rope_inv_freq(HEAD_DIM, THETA, LLAMA3)[0]  # the engine's reference
checks.equal("shape", tuple(_got.shape), tuple(_want.shape))
checks.equal("dtype", _got.dtype, torch.float32)
_rel = ((_got.double() - _want.double()).abs() / _want.double()).max().item()
print(f"max relative error vs the engine: {_rel:.1e}")
checks.at_most("max relative error (SmolLM2, factor 8, L0 1024)", _rel, 2.0 ** -21)
print("visible test passed")

# %% nbgrader={"grade": true, "grade_id": "test_llama3_hidden", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
### BEGIN HIDDEN TESTS
import random as _random

_rng = _random.Random(11001)
_cases = []
for _ in range(6):  # your function first, on fresh configurations
    _hd = _rng.choice([32, 64, 96, 128, 256])
    _th = _rng.choice([10000.0, 100000.0, 500000.0, 1000000.0]) * _rng.uniform(0.5, 2)
    _low = _rng.choice([0.5, 1.0, 2.0])
    _f = dict(factor=_rng.choice([2.0, 8.0, 16.0, 32.0, 12.5]), low_freq_factor=_low,
              high_freq_factor=_low * _rng.choice([2.0, 4.0, 8.0]),
              original_max_position_embeddings=_rng.choice([512, 2048, 4096, 8192]))
    _inv = rope_inv_freq(_hd, _th)[0]
    _keep = _inv.clone()
    _got = rope_inv_freq_llama3(_inv, **_f)
    checks.equal(f"input left unchanged ({_f})", torch.equal(_inv, _keep), True)
    checks.equal(f"dtype ({_f})", _got.dtype, torch.float32)
    _cases.append((_hd, _th, _f, _got))
import transformers as _tf
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS as _RIF

_tf.logging.set_verbosity_error()  # its config warnings go to stderr, which fails a cell
for _hd, _th, _f, _got in _cases:
    _cfg = _tf.LlamaConfig(hidden_size=_hd * 4, num_attention_heads=4, head_dim=_hd,
                           max_position_embeddings=int(_f["factor"] * _f["original_max_position_embeddings"]),
                           rope_parameters={"rope_type": "llama3", "rope_theta": _th, **_f})
    _want = _RIF["llama3"](_cfg, "cpu")[0]  # transformers' own llama3 function
    _rel = ((_got.double() - _want.double()).abs() / _want.double()).max().item()
    print(f"head_dim {_hd}, theta {_th:.0f}, {_f}: max relative error vs transformers {_rel:.1e}")
    checks.at_most(f"max relative error vs transformers (head_dim {_hd}, {_f})", _rel, 2.0 ** -21)
### END HIDDEN TESTS

# %% [markdown] nbgrader={"grade": false, "grade_id": "task2", "locked": true, "schema_version": 3, "solution": false, "task": false}
# ## Task 2: the rotary table (3 points)
#
# Write the engine's `"rotary.table"` step: `rope_table(head_dim, max_position, base,
# rope_scaling=None)` returns `(cos, sin)`, two float32 tensors `[max_position,
# head_dim]`. Row `p` holds the angles `p * inv_freq[i]` for the `head_dim // 2` pairs,
# repeated for the two halves of the head (the "rotate-half" layout of Llama and vLLM's
# neox style): `cos[p] = cos([angles, angles])`, likewise `sin`.
#
# - `inv_freq[i] = base^(-2i/head_dim)`; with `rope_scaling` a dict with `"rope_type":
#   "llama3"` (and the four fields of task 1), scale it with your task-1 function; with
#   `rope_scaling=None` use it as it is.
# - Compute the angles in float32 (or better); the positions must stay exact.
#
# The engine calls it with three arguments for a model without scaling and with
# `rope_scaling=` for one with it. Do not call `rope_table_ref` or `rope_inv_freq`.

# %% nbgrader={"grade": false, "grade_id": "rope_table", "locked": false, "schema_version": 3, "solution": true, "task": false}
def rope_table(head_dim: int, max_position: int, base: float, rope_scaling=None):
    ### BEGIN SOLUTION
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    if rope_scaling is not None:
        inv_freq = rope_inv_freq_llama3(
            inv_freq, rope_scaling["factor"], rope_scaling["low_freq_factor"],
            rope_scaling["high_freq_factor"], rope_scaling["original_max_position_embeddings"])
    positions = torch.arange(max_position, dtype=torch.float32)
    angles = torch.outer(positions, inv_freq)
    emb = torch.cat((angles, angles), dim=-1)
    return emb.cos(), emb.sin()
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "test_table_visible", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
_out = rope_table(HEAD_DIM, 2048, THETA)
checks.equal("returns (cos, sin)", isinstance(_out, tuple) and len(_out) == 2, True)
_c, _s = _out
checks.equal("cos shape", tuple(_c.shape), (2048, HEAD_DIM))
checks.equal("dtype", (_c.dtype, _s.dtype), (torch.float32, torch.float32))
_rc, _rs = rope_table_ref(HEAD_DIM, 2048, THETA)
_pos = torch.arange(2048, dtype=torch.float64)
# float32 angles carry up to ~1 ulp of rounding (the largest angle at row p is p radians)
_tol = 1e-6 + 4 * torch.finfo(torch.float32).eps * _pos
_excess = torch.maximum((_c - _rc).abs().amax(-1), (_s - _rs).abs().amax(-1)) - _tol
_worst = int(_excess.argmax())
print(f"worst row {_worst}: error {_excess[_worst] + _tol[_worst]:.1e}, allowed {_tol[_worst]:.1e}")
checks.at_most(f"max |error| - allowed over rows 0..2047 (worst: row {_worst})",
               _excess.max().item(), 0.0)
print("visible test passed")

# %% nbgrader={"grade": true, "grade_id": "test_table_hidden", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
### BEGIN HIDDEN TESTS
import random as _random

_rng = _random.Random(11002)
_cases = []
for _i in range(4):  # your function first, on fresh configurations
    _hd = _rng.choice([16, 64, 80, 128])
    _th = _rng.choice([10000.0, 500000.0]) * _rng.uniform(0.5, 2)
    _n = _rng.randrange(300, 4000)
    _low = _rng.choice([1.0, 2.0])
    _scale = None if _i % 2 == 0 else {
        "rope_type": "llama3", "factor": _rng.choice([4.0, 8.0, 32.0]), "low_freq_factor": _low,
        "high_freq_factor": 4 * _low, "original_max_position_embeddings": _rng.choice([1024, 8192])}
    _out = rope_table(_hd, _n, _th) if _scale is None else rope_table(_hd, _n, _th, rope_scaling=_scale)
    checks.equal("returns (cos, sin)", isinstance(_out, tuple) and len(_out) == 2, True)
    _c, _s = _out
    checks.equal("shape and dtype", (tuple(_c.shape), _c.dtype, tuple(_s.shape), _s.dtype),
                 ((_n, _hd), torch.float32, (_n, _hd), torch.float32))
    _cases.append((_hd, _th, _n, _scale, _c, _s))
import transformers as _tf
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding as _LRE

_tf.logging.set_verbosity_error()  # its config warnings go to stderr, which fails a cell
for _hd, _th, _n, _scale, _c, _s in _cases:
    _params = {"rope_type": "default", "rope_theta": _th} if _scale is None else \
        {**_scale, "rope_theta": _th}
    _mpe = _n if _scale is None else max(_n, int(_scale["factor"] * _scale["original_max_position_embeddings"]))
    _hf = _LRE(_tf.LlamaConfig(hidden_size=_hd * 4, num_attention_heads=4, head_dim=_hd,
                               max_position_embeddings=_mpe, rope_parameters=_params))
    _pos = torch.tensor(sorted(set([0, 1, 255, 256, 257, _n - 1] +
                                   [_rng.randrange(_n) for _ in range(40)])))
    _wc, _ws = _hf(torch.zeros(1, len(_pos), _hd), _pos[None])  # transformers' table
    _tol = 1e-6 + 4 * torch.finfo(torch.float32).eps * _pos.double()
    _err = torch.maximum((_c[_pos] - _wc[0]).abs().amax(-1), (_s[_pos] - _ws[0]).abs().amax(-1))
    _worst = int((_err - _tol).argmax())
    print(f"head_dim {_hd}, theta {_th:.0f}, {_n} positions, scaling {_scale}: worst position "
          f"{int(_pos[_worst])}, error {_err[_worst]:.1e} (allowed {_tol[_worst]:.1e})")
    checks.at_most(f"|table - transformers| - allowed at position {int(_pos[_worst])} "
                   f"(head_dim {_hd}, scaling {_scale})", (_err - _tol).max().item(), 0.0)
### END HIDDEN TESTS

# %% [markdown] nbgrader={"grade": false, "grade_id": "restore", "locked": true, "schema_version": 3, "solution": false, "task": false}
# ## Restore checks (2 + 2 points)
#
# **Long positions.** The grader takes 384 tokens of text at a random place in the
# corpus, and scores the rows of positions 0-63 and 320-383 (past bf16's exact 256)
# three times: with the correct engine, with the broken table, and with your
# `rope_table` installed in every layer (`llm.swap_step("rotary.table", rope_table)`).
# Your table must give KL(correct || yours) at most 1e-6 nats at positions 320-383 (a
# float32 table that differs from the engine's only in rounding gives ~1e-11); the broken
# table must fail the same check.
#
# **Scaling.** Two fresh 96-token texts, scored as the llama3 model (`llama3_model()`),
# with your `rope_table` called with `rope_scaling=LLAMA3` (as the engine calls the step
# for a model whose config has it) in every layer, and by the plain engine (the scaling
# ignored). Yours: mean KL at most 1e-6; ignored: must fail.

# %% nbgrader={"grade": true, "grade_id": "test_restore_long", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
### BEGIN HIDDEN TESTS
import random as _random

_rng = _random.Random(11003)
_probe = rope_table(8, 300, 10000.0)  # your function first: a missing one fails here
checks.equal("rope_table returns (cos, sin)", isinstance(_probe, tuple) and len(_probe) == 2, True)
_llm = get_llm()
_s0 = _rng.randrange(0, len(_text) - 2200)
_ids = _llm.get_tokenizer().encode(_text[_s0:_s0 + 2200])[:384]
checks.equal("fresh text length", len(_ids), 384)
_rows_pos = list(range(0, 64)) + list(range(320, 384))
with _llm.swap_step("rotary.table", rope_table):
    _mine = _llm.score(_ids, positions=_rows_pos)
_ref = _llm.score(_ids, positions=_rows_pos)
with broken_table():
    _bad = _llm.score(_ids, positions=_rows_pos)
_kl_mine = metrics.kl_divergence(_ref, _mine)
_kl_bad = metrics.kl_divergence(_ref, _bad)
print(f"mean KL vs the correct engine, positions 0-63 / 320-383: yours "
      f"{_kl_mine[:64].mean():.1e} / {_kl_mine[64:].mean():.1e}; broken table "
      f"{_kl_bad[:64].mean():.1e} / {_kl_bad[64:].mean():.1e}")
if _kl_bad[64:].mean() <= 1e-6:
    raise checks.CheckFailed("the check does not discriminate: the broken table passes it")
checks.at_most("your table: mean KL at positions 320-383 (nats)", _kl_mine[64:].mean().item(), 1e-6)
checks.at_most("your table: max KL over the scored rows (nats)", _kl_mine.max().item(), 1e-5)
### END HIDDEN TESTS

# %% nbgrader={"grade": true, "grade_id": "test_restore_scaling", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
### BEGIN HIDDEN TESTS
import random as _random

_rng = _random.Random(11004)
_probe = rope_table(8, 300, 10000.0, rope_scaling=LLAMA3)  # your function first
checks.equal("rope_table returns (cos, sin)", isinstance(_probe, tuple) and len(_probe) == 2, True)
_llm = get_llm()
_seqs = []
for _ in range(2):
    _s0 = _rng.randrange(0, len(_text) - 700)
    _seqs.append(_llm.get_tokenizer().encode(_text[_s0:_s0 + 700])[:96])


def _as_llama3_model(head_dim, max_position, base):  # the engine hands a scaled model's table fn this
    return rope_table(head_dim, max_position, base, rope_scaling=dict(LLAMA3))


with _llm.swap_step("rotary.table", _as_llama3_model):
    _mine = _llm.score(_seqs)
with llama3_model():
    _ref = _llm.score(_seqs)
_bad = _llm.score(_seqs)  # the scaling ignored
_kl_mine = max(metrics.mean_kl(r, m) for r, m in zip(_ref, _mine))
_kl_bad = min(metrics.mean_kl(r, b) for r, b in zip(_ref, _bad))
print(f"mean KL vs the llama3 model (worse of 2 texts): yours {_kl_mine:.1e}; "
      f"scaling ignored {_kl_bad:.1e}")
if _kl_bad <= 1e-6:
    raise checks.CheckFailed("the check does not discriminate: the ignored scaling passes it")
checks.at_most("your table with rope_scaling=LLAMA3: mean KL (nats)", _kl_mine, 1e-6)
### END HIDDEN TESTS
