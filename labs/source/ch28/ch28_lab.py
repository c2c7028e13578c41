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
# # Lab 28: size the pool from the bytes, choose inside the budget
#
# Chapter 28 found two planning mistakes. A team moved its KV cache from 16 to 32 bits
# and planned concurrency with the seed's rule of thumb ("+30 % memory"), so the engine
# admitted more requests than its pool could grow and preempted them. And a
# configuration picked for speed alone (fp8 weights and an fp8 KV cache) was outside the
# quality budget.
#
# This lab starts from **both broken plans**. You write the three functions a serving
# team's planning sheet needs:
#
# 1. `kv_bytes_per_token(cfg, kv_cache_dtype)`: the KV-cache bytes of one token, from a
#    model's `config.json`, 2 points;
# 2. `capacity(kv_memory_bytes, bytes_per_token, seq_len, block_size)`: the blocks a pool
#    holds and the sequences that fit at once, 3 points;
# 3. `choose_config(table, kl_budget, sla_ms, batch, context, bandwidth)`: the fastest
#    configuration inside a quality budget and a step-time SLA, 2 points;
# 4. your three functions in the engine, 3 points (nothing to write).
#
# The grader calls them on new configs, pools and tables; then it sizes a live engine
# with your `capacity` and runs it at full concurrency (no preemption allowed, where the
# "+30 %" plan preempts), and measures the configurations' KL on text you have not seen,
# lets your `choose_config` pick one, and checks the pick on other fresh text.
#
# Run the cells in order. Do not edit the setup and test cells.

# %% nbgrader={"grade": false, "grade_id": "setup", "locked": true, "schema_version": 3, "solution": false, "task": false}
import math

import grading.checks as checks  # first import: records the original functions
import torch

from minivllm.models.loader import load_hf_config, resolve_model_path
from minivllm.precision import evalsets

MODEL = "smollm2-135m-instruct"
CFG = load_hf_config(resolve_model_path(MODEL))  # the model's config.json, as a dict
BLOCK = 16                                       # the engine's block_size (tokens)
print({k: CFG.get(k) for k in ("num_hidden_layers", "num_attention_heads",
                                "num_key_value_heads", "hidden_size", "head_dim")})

# The broken plans of chapter 28.
BROKEN_CONCURRENCY = lambda seqs_fp16: int(seqs_fp16 / 1.3)  # noqa: E731  "fp32 KV: +30 %"
BROKEN_PICK = "fp8 W + fp8 KV"                                # the fastest, quality unseen

# %% [markdown] nbgrader={"grade": false, "grade_id": "task1", "locked": true, "schema_version": 3, "solution": false, "task": false}
# ## Task 1: KV bytes per token (2 points)
#
# `cfg` is a Hugging Face `config.json` as a dict. Every token keeps, in every layer
# (`num_hidden_layers`), a K and a V vector for each KV head (`num_key_value_heads`; a
# config without it has one KV head per attention head, `num_attention_heads`) of
# `head_dim` numbers (a config without `head_dim` uses `hidden_size //
# num_attention_heads`). Return the bytes as a Python `int` for `kv_cache_dtype` one of
# `"float32"`, `"float16"`, `"bfloat16"`, `"fp8_e4m3"`, `"fp8_e5m2"`, `"int8"` (static
# scales: nothing stored per token besides the values); any other name raises
# `ValueError`.

# %% nbgrader={"grade": false, "grade_id": "kv_bytes_per_token", "locked": false, "schema_version": 3, "solution": true, "task": false}
def kv_bytes_per_token(cfg: dict, kv_cache_dtype: str) -> int:
    ### BEGIN SOLUTION
    size = {"float32": 4, "float16": 2, "bfloat16": 2, "fp8_e4m3": 1, "fp8_e5m2": 1,
            "int8": 1}
    if kv_cache_dtype not in size:
        raise ValueError(f"kv_cache_dtype must be one of {sorted(size)}, got {kv_cache_dtype!r}")
    heads = cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or heads
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    return int(2 * cfg["num_hidden_layers"] * kv_heads * head_dim * size[kv_cache_dtype])
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "test_kv_bytes_visible", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
checks.equal("kv_bytes_per_token(SmolLM2, 'float16')", kv_bytes_per_token(CFG, "float16"), 23040)
checks.equal("kv_bytes_per_token(SmolLM2, 'float32') (2x float16, not +30 %)",
             kv_bytes_per_token(CFG, "float32"), 46080)
_toy = {"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 32}
checks.equal("kv_bytes_per_token(2 layers, 4 heads, no num_key_value_heads, no head_dim, "
             "'fp8_e4m3')", kv_bytes_per_token(_toy, "fp8_e4m3"), 2 * 2 * 4 * 8 * 1)
print("visible test passed")

# %% nbgrader={"grade": true, "grade_id": "test_kv_bytes_hidden", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
### BEGIN HIDDEN TESTS
import random as _random

from minivllm.config import ModelConfig as _MC
from minivllm.worker.model_runner import kv_cache_bytes_per_block as _per_block

_rng = _random.Random(28001)
_DT = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
       "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2, "int8": torch.int8}
for _ in range(6):
    _h = _rng.choice([4, 8, 12, 32])
    _cfg = {"num_hidden_layers": _rng.randrange(1, 40), "num_attention_heads": _h,
            "hidden_size": _h * _rng.choice([32, 64, 128])}
    if _rng.random() < 0.6:
        _cfg["num_key_value_heads"] = _rng.choice([d for d in (1, 2, 4, _h) if _h % d == 0])
    if _rng.random() < 0.5:
        _cfg["head_dim"] = _rng.choice([64, 96, 128])
    for _name, _dt in _DT.items():
        _got = kv_bytes_per_token(dict(_cfg), _name)       # the learner's function first
        _mc = _MC(model="x", path="x", dtype=torch.float32, max_model_len=1, vocab_size=1,
                  num_layers=_cfg["num_hidden_layers"],
                  num_kv_heads=_cfg.get("num_key_value_heads", _h),
                  head_dim=_cfg.get("head_dim") or _cfg["hidden_size"] // _h, eos_token_ids=())
        checks.equal(f"kv_bytes_per_token({_cfg}, {_name!r}) (the engine's count)",
                     _got, int(_per_block(_mc, 1, _dt)))
# no head_dim and a hidden size that the heads do not divide: hidden_size // heads
_odd = {"num_hidden_layers": 2, "num_attention_heads": 3, "hidden_size": 100}
checks.equal(f"kv_bytes_per_token({_odd}, 'float16') (head_dim 100 // 3 = 33)",
             kv_bytes_per_token(dict(_odd), "float16"), 2 * 2 * 3 * 33 * 2)
for _bad in ("fp8", "float64", "auto", None):
    try:
        kv_bytes_per_token(CFG, _bad)
    except ValueError:
        continue
    raise checks.CheckFailed(f"kv_bytes_per_token(cfg, {_bad!r}) should raise ValueError")
### END HIDDEN TESTS

# %% [markdown] nbgrader={"grade": false, "grade_id": "task2", "locked": true, "schema_version": 3, "solution": false, "task": false}
# ## Task 2: what a pool holds (3 points)
#
# The engine's KV pool is `kv_memory_bytes` bytes, cut into blocks of `block_size`
# tokens (a block holds `block_size · bytes_per_token` bytes; a partial block is
# unusable). A sequence of `seq_len` tokens (prompt plus generated) needs
# `ceil(seq_len / block_size)` whole blocks. Return `(num_blocks, max_num_seqs)`: the
# blocks the pool holds and how many such sequences fit **at once**, both Python `int`s.
# Raise `ValueError` when an argument is not a positive integer, or when not even one
# sequence fits (an engine sized like that could never finish a request).

# %% nbgrader={"grade": false, "grade_id": "capacity", "locked": false, "schema_version": 3, "solution": true, "task": false}
def capacity(kv_memory_bytes: int, bytes_per_token: int, seq_len: int,
             block_size: int = 16) -> tuple:
    ### BEGIN SOLUTION
    for name, v in (("kv_memory_bytes", kv_memory_bytes), ("bytes_per_token", bytes_per_token),
                    ("seq_len", seq_len), ("block_size", block_size)):
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
    num_blocks = kv_memory_bytes // (bytes_per_token * block_size)
    max_num_seqs = num_blocks // -(-seq_len // block_size)
    if max_num_seqs == 0:
        raise ValueError(f"{kv_memory_bytes} bytes hold {num_blocks} blocks, fewer than one "
                         f"sequence of {seq_len} tokens needs")
    return int(num_blocks), int(max_num_seqs)
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "test_capacity_visible", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
checks.equal("capacity(16 blocks of float32, 46080, 64) (64 tokens = 4 blocks)",
             capacity(16 * 16 * 46080, 46080, 64), (16, 4))
checks.equal("capacity(16 blocks + 100 bytes, 46080, 50) (50 tokens need 4 whole blocks; "
             "the 100 bytes are not a block)", capacity(16 * 16 * 46080 + 100, 46080, 50), (16, 4))
print("visible test passed")

# %% nbgrader={"grade": true, "grade_id": "test_capacity_hidden", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
### BEGIN HIDDEN TESTS
import random as _random

_rng = _random.Random(28002)
for _ in range(12):
    _bpt = _rng.choice([11520, 23040, 46080, 131072, 65536, _rng.randrange(100, 5000)])
    _bs = _rng.choice([8, 16, 32])
    _len = _rng.randrange(1, 600)
    _need = -(-_len // _bs)
    _blocks = _rng.randrange(_need, 40 * _need + 1)
    _mem = _blocks * _bpt * _bs + _rng.randrange(0, _bpt * _bs)   # a partial block left over
    _got = capacity(_mem, _bpt, _len, _bs)                   # the learner's function first
    checks.equal(f"capacity({_mem}, {_bpt}, {_len}, {_bs})", _got, (_blocks, _blocks // _need))
checks.equal("capacity(exactly one sequence: 4 blocks, 64 tokens)",
             capacity(4 * 16 * 100, 100, 64, 16), (4, 1))
# 1 is a positive integer too (one-token blocks, one byte per token, one-token sequences)
checks.equal("capacity(1000, 1, 1, 1)", capacity(1000, 1, 1, 1), (1000, 1000))
# whole numbers exactly, at any size: one byte short of 2^50 blocks is 2^50 - 1 blocks
# (a float division rounds it up to 2^50)
checks.equal("capacity(48 * 2**50 - 1, 3, 16, 16)", capacity(48 * 2 ** 50 - 1, 3, 16, 16),
             (2 ** 50 - 1, 2 ** 50 - 1))
for _args in ((4 * 16 * 100 - 1, 100, 64, 16), (0, 100, 10, 16), (10 ** 6, 0, 10, 16),
              (10 ** 6, 100, -5, 16), (10 ** 6, 100, 10, 0), (10 ** 6, 100.0, 10, 16)):
    try:
        capacity(*_args)
    except ValueError:
        continue
    raise checks.CheckFailed(f"capacity{_args} should raise ValueError")
### END HIDDEN TESTS

# %% [markdown] nbgrader={"grade": false, "grade_id": "task3", "locked": true, "schema_version": 3, "solution": false, "task": false}
# ## Task 3: the choice (2 points)
#
# `table` is a list of dicts, one per configuration: `"name"`, `"kl_high"` (the upper end
# of a 95 % interval of its mean KL against float32, nats), `"weight_bytes"` and
# `"kv_bytes_per_token"`. A decode step at `batch` sequences of `context` tokens moves at
# least `weight_bytes + batch · context · kv_bytes_per_token` bytes; at `bandwidth`
# bytes/s that is the cost model's step time (chapter 28, section 4; report it in ms).
#
# Return the `"name"` of the configuration with the **smallest step time** among those
# with `kl_high <= kl_budget` **and** step time `<= sla_ms`; on equal step times the
# smaller `kl_high`, then the earlier row. Return `None` when no row is inside both.

# %% nbgrader={"grade": false, "grade_id": "choose_config", "locked": false, "schema_version": 3, "solution": true, "task": false}
def choose_config(table: list, kl_budget: float, sla_ms: float, batch: int, context: int,
                  bandwidth: float):
    ### BEGIN SOLUTION
    best = None
    for i, row in enumerate(table):
        step_ms = (row["weight_bytes"] + batch * context * row["kv_bytes_per_token"]) \
            / bandwidth * 1e3
        if row["kl_high"] <= kl_budget and step_ms <= sla_ms:
            key = (step_ms, row["kl_high"], i)
            if best is None or key < best[0]:
                best = (key, row["name"])
    return None if best is None else best[1]
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "test_choose_visible", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
_table = [dict(name="fp32 KV", kl_high=0.0, weight_bytes=538e6, kv_bytes_per_token=46080),
          dict(name="fp16 KV", kl_high=6e-7, weight_bytes=538e6, kv_bytes_per_token=23040),
          dict(name="fp8 W + fp8 KV", kl_high=0.042, weight_bytes=220e6, kv_bytes_per_token=11520)]
checks.equal("choose_config(chapter 28's rows, KL <= 2e-3, 2 ms, batch 64, 4096, 4281e9)",
             choose_config(_table, 2e-3, 2.0, 64, 4096, 4281e9), "fp16 KV")
checks.equal("choose_config(same, KL <= 1e-9, 2 ms): nothing fits",
             choose_config(_table, 1e-9, 2.0, 64, 4096, 4281e9), None)
print("visible test passed")

# %% nbgrader={"grade": true, "grade_id": "test_choose_hidden", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
### BEGIN HIDDEN TESTS
import random as _random

_rng = _random.Random(28003)


def _ref_choose(table, kl_budget, sla_ms, batch, context, bandwidth):
    rows = []
    for i, r in enumerate(table):
        ms = (r["weight_bytes"] + batch * context * r["kv_bytes_per_token"]) / bandwidth * 1e3
        if r["kl_high"] <= kl_budget and ms <= sla_ms:
            rows.append((ms, r["kl_high"], i, r["name"]))
    return min(rows)[3] if rows else None


for _t in range(8):
    _n = _rng.randrange(2, 7)
    _table = [dict(name=f"config {_i}", kl_high=_rng.choice([0.0, 1e-6, 1e-3, 3e-3, 0.02, 0.05]),
                   weight_bytes=_rng.choice([1e8, 2e8, 5e8]),
                   kv_bytes_per_token=_rng.choice([11520, 23040, 46080]))
              for _i in range(_n)]
    if _t % 2:  # a tie on step time: the smaller kl_high must win
        _table.append(dict(_table[0], name="tie", kl_high=_table[0]["kl_high"] / 2))
    _batch, _ctx, _bw = _rng.choice([1, 16, 64]), _rng.choice([512, 2048, 4096]), 3e12
    _budget = _rng.choice([1e-6, 1e-3, 3e-3, 0.05])
    _sla = _rng.choice([0.1, 0.5, 1.0, 2.0, 5.0])
    _got = choose_config([dict(r) for r in _table], _budget, _sla, _batch, _ctx, _bw)
    checks.equal(f"choose_config({_table}, kl_budget={_budget}, sla_ms={_sla}, batch={_batch}, "
                 f"context={_ctx}, bandwidth={_bw:g})", _got,
                 _ref_choose(_table, _budget, _sla, _batch, _ctx, _bw))
# budgets are inclusive: a row exactly at the KL budget and exactly at the SLA is inside
_edge = [dict(name="at the limits", kl_high=2e-3, weight_bytes=1e9, kv_bytes_per_token=0)]
checks.equal("choose_config(a row with kl_high == kl_budget and step == sla_ms)",
             choose_config(_edge, 2e-3, 1.0, 1, 1, 1e12), "at the limits")
### END HIDDEN TESTS

# %% [markdown] nbgrader={"grade": false, "grade_id": "task4", "locked": true, "schema_version": 3, "solution": false, "task": false}
# ## Task 4: your plan in the engine (3 points)
#
# Nothing to write. The grader:
#
# 1. draws a fresh KV pool (the bytes of 40-47 float16 blocks) and fresh requests of
#    50-52 tokens, switches the cache to float32, and sizes an engine with **your**
#    `kv_bytes_per_token` and `capacity` (`num_gpu_blocks_override`, `max_num_seqs`); it
#    must fit the pool's bytes, run your number of requests at once and preempt
#    **none**, while the "+30 %" plan (`BROKEN_CONCURRENCY`) on the same pool preempts;
# 2. scores fresh text with three configurations (float32 KV, float16 KV, fp8 weights +
#    fp8 KV), builds the table with their KL upper bounds, their weight bytes and **your**
#    bytes per token, and lets **your** `choose_config` pick under a 2e-3 nats budget and a
#    2 ms SLA (batch 64, context 4096, 4,281 GB/s); the pick is then scored on **other**
#    fresh text and must stay inside the budget, where `BROKEN_PICK` does not.

# %% nbgrader={"grade": true, "grade_id": "test_engine", "locked": true, "points": 3, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
### BEGIN HIDDEN TESTS
import gc as _gc
import random as _random

from minivllm import LLM as _LLM
from minivllm import SamplingParams as _SP
from minivllm.precision import metrics as _metrics
from minivllm.quantization.checkpoint import cached_quantized as _cached

_rng = _random.Random(28004)
_bpt32 = kv_bytes_per_token(CFG, "float32")                 # the learner's functions first: a
_bpt16 = kv_bytes_per_token(CFG, "float16")                 # stub fails here, before any engine
_values = 2 * CFG["num_hidden_layers"] * CFG.get("num_key_value_heads", CFG["num_attention_heads"]) \
    * (CFG.get("head_dim") or CFG["hidden_size"] // CFG["num_attention_heads"])
_real = {"float32": 4 * _values, "float16": 2 * _values, "fp8_e4m3": _values}  # bytes per token
_real32 = _real["float32"]
_pool = _rng.randrange(40, 48) * BLOCK * _real["float16"]      # 40-47 float16 blocks
_seq_len = _rng.randrange(50, 53)  # K/V of 49-51 tokens (the last token is never fed): 4 blocks
_prompt_len = _rng.randrange(36, 41)                           # 3 blocks
_blocks, _seqs = capacity(_pool, _bpt32, _seq_len, BLOCK)
_seqs16 = capacity(_pool, _bpt16, _seq_len, BLOCK)[1]
_ = choose_config([dict(name="a", kl_high=0.0, weight_bytes=1, kv_bytes_per_token=1)],
                              1.0, 1e9, 1, 1, 1.0)
checks.at_most("bytes of the blocks your capacity gives (must fit the pool)",
               _blocks * BLOCK * _real32, _pool)
_text = evalsets.load_corpus()
_tok = None


def _run_plan(num_blocks, max_num_seqs):
    """A float32 engine with a float32 KV cache sized by a plan, run at full load; returns
    (engine, preemptions, most requests running at once)."""
    global _tok
    llm = _LLM(MODEL, dtype="float32", kv_cache_dtype="float32", max_model_len=_seq_len,
               num_gpu_blocks_override=num_blocks, max_num_seqs=max_num_seqs,
               enable_prefix_caching=False)
    _tok = llm.get_tokenizer()
    starts = [_rng.randrange(0, len(_text) - 400) for _ in range(_seqs + 2)]
    prompts = [_tok.encode(_text[s:s + 400])[:_prompt_len] for s in starts]
    llm.generate(prompts, _SP(temperature=0, max_tokens=_seq_len - _prompt_len, ignore_eos=True),
                 use_tqdm=False)
    st = llm.stats
    return llm, st.num_preemptions, max(h[1] for h in st.history)


_broken_n = BROKEN_CONCURRENCY(_seqs16)
_, _pre_bad, _peak_bad = _run_plan(_blocks, _broken_n)
del _
_gc.collect()
_plan_llm, _pre, _peak = _run_plan(_blocks, _seqs)  # also the float32 reference below
print(f"pool {_pool} bytes, requests of {_seq_len} tokens: your plan {_blocks} blocks, "
      f"max_num_seqs={_seqs}: {_pre} preemptions, {_peak} running at most; the +30 % plan "
      f"max_num_seqs={_broken_n}: {_pre_bad} preemptions")
if not _pre_bad > 0:
    raise checks.CheckFailed("the check does not discriminate: the +30 % plan did not preempt")
checks.equal("preemptions with your plan", _pre, 0)
checks.equal("sequences running at once with your plan (the pool used fully)", _peak, _seqs)


def _fresh(n, k=3):
    out = []
    for _ in range(k):
        s = _rng.randrange(0, len(_text) - 1500)
        out.append(_tok.encode(_text[s:s + 1500])[:n])
    return out


_text_a, _text_b = _fresh(40), _fresh(40)
_KW = dict(dtype="float32", max_model_len=64, num_gpu_blocks_override=16,
           enable_prefix_caching=False)
_CONFIGS = {"float32 KV": (MODEL, "float32"), "float16 KV": (MODEL, "float16"),
            "fp8 W + fp8 KV": (str(_cached(MODEL, "fp8", verbose=False)), "fp8_e4m3")}
_rows, _table = {}, []
for _name, (_path, _kv) in _CONFIGS.items():
    # float32 KV: the engine of your plan above is that configuration already
    _llm = _plan_llm if _name == "float32 KV" else _LLM(_path, kv_cache_dtype=_kv, **_KW)
    _rows[_name] = (_llm.score(_text_a, output="logits"), _llm.score(_text_b, output="logits"))
    _table.append(dict(name=_name, weight_bytes=_llm.weight_bytes()["total"],
                       kv_bytes_per_token=kv_bytes_per_token(CFG, _kv)))
    del _llm
    _gc.collect()
del _plan_llm
_gc.collect()


def _kl(name, i):
    ref = _rows["float32 KV"][i]
    return [_metrics.kl_divergence(a, b).numpy() for a, b in zip(ref, _rows[name][i])]


for _r in _table:
    _r["kl_high"] = _metrics.bootstrap_ci(_kl(_r["name"], 0))[1]
_pick = choose_config([dict(r) for r in _table], 2e-3, 2.0, 64, 4096, 4281e9)
checks.one_of("your choose_config's pick", _pick, [r["name"] for r in _table])
_kl_pick = float(sum(k.sum() for k in _kl(_pick, 1)) / sum(k.size for k in _kl(_pick, 1)))
_kl_bad = float(sum(k.sum() for k in _kl(BROKEN_PICK, 1)) / sum(k.size for k in _kl(BROKEN_PICK, 1)))
_ms = {r["name"]: (r["weight_bytes"] + 64 * 4096 * _real[_CONFIGS[r["name"]][1]]) / 4281e9 * 1e3
       for r in _table}                                     # the cost model, real bytes
_summary = ", ".join(f"{r['name']} {r['kl_high']:.2g}" for r in _table)
print(f"KL upper bounds on fresh text A: {_summary}; your pick {_pick!r}: mean KL on fresh "
      f"text B {_kl_pick:.3g}; {BROKEN_PICK}: {_kl_bad:.3g}")
if not _kl_bad > 2e-3:
    raise checks.CheckFailed("the check does not discriminate: the speed-only pick is inside "
                             "the KL budget")
checks.at_most(f"mean KL of your pick ({_pick}) on fresh text", _kl_pick, 2e-3)
checks.at_most(f"step time of your pick ({_pick}), cost model, ms", _ms[_pick], 2.0)
### END HIDDEN TESTS
