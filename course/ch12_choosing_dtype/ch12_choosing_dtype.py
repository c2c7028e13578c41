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

# %% [markdown]
# # Chapter 12. Choosing dtype: auto, half, bfloat16, float32; fp32 checkpoints served in fp16
#
# **Learning goals.** After this chapter you can
#
# 1. say what vLLM's `dtype="auto"` picks for a checkpoint on a given device, including the
#    case that surprises people: a **float32 checkpoint is served in 16 bits** (bfloat16 on
#    CPUs and Ampere+ GPUs, float16 on older GPUs, float16 everywhere in vLLM before mid-2025);
# 2. measure what each dtype costs on a real model (KL against float32, top-1 agreement, QA
#    accuracy with intervals, speed) and read why float16 can be *more* accurate than
#    bfloat16 on one model and produce nothing but NaN on another;
# 3. tell range from precision: float16 has 3 more mantissa bits than bfloat16 but overflows
#    at 65504; a model's activation peak decides which of the two wins;
# 4. pick a safe dtype from a checkpoint's statistics (its activation peaks against each
#    format's range), and check the choice on the engine.
#
# **The incidents, from public sources.**
#
# - **allenai/olmo-cookbook #60** (2025-05-07, <https://github.com/allenai/olmo-cookbook/issues/60>):
#   OLMo 2 checkpoints stored in float32; vLLM printed `"!!!!!!!!"` where HF transformers was
#   fine. HF run in float16 also gave `"!!!!"`, which pointed at the dtype: vLLM's
#   `dtype="auto"` had served the float32 checkpoint in float16. Fix: serve in bf16 or fp32.
# - **vllm PR #18340** (2025-05-19, <https://github.com/vllm-project/vllm/pull/18340>) quotes
#   the rule of that time (`vllm/config.py`): "if config_dtype == torch.float32: # Following
#   common practice, we use float16 for float32 models".
# - **vllm PR #18751** "[Core] Rework dtype resolution" (2025-05-27,
#   <https://github.com/vllm-project/vllm/pull/18751>): float32 models are now downcast to the
#   platform's preferred dtype, "This means that models may be downcasted to bfloat16 instead
#   of float16", and float16 is excluded for `gemma2`, `gemma3`, `plamo2`, `glm4` "because of
#   reported numerical stability issues". This chapter's engine follows that rule, as read in
#   `vllm/config/model.py` (`_resolve_auto_dtype`, `_get_and_verify_dtype`) at commit 18ec662
#   of vLLM's main branch; where the rule changed, the old one is shown beside it.
# - **huggingface/transformers #36822** (2025-03-19,
#   <https://github.com/huggingface/transformers/issues/36822>): Gemma 3 in float16 gives empty
#   output, correct in bfloat16: activations pass float16's 65504 (large RMSNorm weights).
#   vLLM now refuses `--dtype float16` for Gemma 3 (`_FLOAT16_NOT_SUPPORTED_MODELS`).
# - **The seed course** (002 §五) gives a dtype table: "auto 是合理起点" (auto is a reasonable
#   starting point), "FP16 数值范围小…少数模型更容易溢出" (FP16's range is small, a few models
#   overflow more easily), with bf16 as the safe default and fp32 rarely worth it; seed 003
#   §1.5 recommends an fp32 KV cache for an fp16 model. Each claim is measured below.
#
# Everything below is measured when the notebook runs, on the embedded SmolLM2-135M-Instruct
# with minivllm on this machine's CPU.

# %%
# %matplotlib inline
import json
import logging
import os
import time
from pathlib import Path

import numpy as np
import torch
from matplotlib.figure import Figure

from minivllm import LLM, SamplingParams
from minivllm.config import parse_dtype, resolve_auto_dtype, supported_dtypes
from minivllm.i18n import Bi, claims_table, say
from minivllm.precision import evalsets, metrics
from minivllm.precision.faults import residual_scale_reparam
from minivllm.precision.overflow import track_nonfinite

torch.manual_seed(0)
T0 = time.perf_counter()
MODEL = "smollm2-135m-instruct"
COMMON = dict(max_model_len=512, kv_cache_memory_bytes=48 << 20)
F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16


class Messages(logging.Handler):
    """Keeps the engine's log messages (the dtype rule logs what it casts)."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.lines = []

    def emit(self, record):
        self.lines.append(f"{record.levelname}: {record.getMessage()}")


log = logging.getLogger("minivllm")
messages, old_level = Messages(), log.level
log.addHandler(messages)
log.setLevel(logging.INFO)
engines, build_s = {}, {}
for name in ["float32", "auto", "float16"]:
    t = time.perf_counter()
    engines[name] = LLM(MODEL, dtype=name, **COMMON)
    build_s[name] = time.perf_counter() - t
log.removeHandler(messages)
log.setLevel(old_level)
fp32, auto, fp16 = engines["float32"], engines["auto"], engines["float16"]
tok = fp32.get_tokenizer()
config = json.loads((Path(fp32.llm_engine.model_config.path) / "config.json").read_text())
print(f"checkpoint: model_type={config['model_type']!r}, torch_dtype={config.get('torch_dtype')!r}")
say(f"dtype='auto' on this CPU resolved to {auto.llm_engine.model_config.dtype}",
    f"在这个 CPU 上，dtype='auto' 解析为 {auto.llm_engine.model_config.dtype}")
print("the engine's log while building the three engines:", *messages.lines, sep="\n  ")

# %% [markdown]
# ## 1. What "auto" picks
#
# The embedded checkpoint is float32 (it was dequantized from a GGUF file and saved in
# float32). On this CPU, `dtype="auto"` serves it in **bfloat16**, and says so only at INFO
# level ("Downcasting"). The rule (`minivllm/config.py:resolve_auto_dtype`, vLLM's
# `_resolve_auto_dtype`):
#
# 1. a **float32** checkpoint is downcast to the platform's *preferred* dtype, the first of
#    its supported list: bfloat16 on CPUs and on GPUs of compute capability >= 8.0, float16
#    on older GPUs (T4, V100), which have no bfloat16;
# 2. a float16 or bfloat16 checkpoint keeps its dtype if the platform supports it;
# 3. otherwise (bfloat16 on a T4) the preferred dtype, with a warning;
# 4. for `gemma2`, `gemma3`, `gemma3_text`, `plamo2`, `glm4`, float16 is struck from the list
#    first (and an explicit `dtype="half"` is an error).
#
# Explicit names: `"half"`/`"float16"`, `"bfloat16"`, `"float"`/`"float32"`, in any case;
# anything else is an error listing those. A cast between the two 16-bit formats logs a
# **warning** ("Casting torch.bfloat16 to torch.float16."), a downcast from or an upcast to
# float32 only an INFO line. The table applies the engine's rule (with the platform's list
# passed in, `parse_dtype(..., supported=...)`) next to vLLM's rule before PR #18751 on a
# GPU, where every float32 checkpoint went to float16:

# %%
PLATFORMS = {"CPU (x86/aarch64)": supported_dtypes("cpu"),
             "GPU, compute capability >= 8.0": [BF16, F16, F32],
             "GPU, compute capability < 8.0 (T4, V100)": [F16, F32]}


def old_rule_gpu(config_dtype, supported):
    """vLLM before PR #18751 on a GPU (the rule quoted in PR #18340): float32 -> float16;
    a 16-bit checkpoint keeps its dtype (bfloat16 on a pre-Ampere GPU was an error)."""
    if config_dtype == F32:
        return F16
    return config_dtype if config_dtype in supported else "error"


def short(d):
    return {F32: "float32", F16: "float16", BF16: "bfloat16"}.get(d, str(d))


log.setLevel(logging.ERROR)  # the fallback warnings of the table's rows: one example below
print("| checkpoint | model_type | platform | auto (vLLM >= PR #18751, this engine) | "
      "auto before PR #18751 (GPU) |\n|---|---|---|---|---|")
for ckpt, model_type in [(F32, "llama"), (F32, "gemma3"), (BF16, "llama"), (F16, "gemma3")]:
    for plat, supported in PLATFORMS.items():
        now = short(parse_dtype("auto", ckpt, supported=supported, model_type=model_type))
        old = "-" if plat.startswith("CPU") else short(old_rule_gpu(ckpt, supported))
        if old == "error":
            old = "error (bfloat16 needs compute capability >= 8.0)"
        if model_type == "gemma3" and old == "float16":
            old += " (overflows, transformers #36822)"
        print(f"| {short(ckpt)} | {model_type} | {plat} | {now} | {old} |")
log.setLevel(old_level)

messages.lines.clear()
log.addHandler(messages)
parse_dtype("half", BF16)            # a bfloat16 checkpoint served in float16
parse_dtype("auto", BF16, supported=PLATFORMS["GPU, compute capability < 8.0 (T4, V100)"])
log.removeHandler(messages)
print("\nthe messages for a bfloat16 checkpoint with dtype='half', then 'auto' on a T4:",
      *messages.lines, sep="\n  ")

for name in ["half", "BFloat16", "fp16"]:
    try:
        print(f"dtype={name!r} -> {short(parse_dtype(name, F32))}")
    except ValueError as e:
        print(f"dtype={name!r} -> ValueError: {e}")
try:
    parse_dtype("half", BF16, model_type="gemma3")
except ValueError as e:
    print(f"dtype='half' for a gemma3 checkpoint -> ValueError: {e}")

# %% [markdown]
# The OLMo incident's path is in the table: a float32 checkpoint on any GPU before
# PR #18751 is served in **float16**, and so is one on a pre-Ampere GPU today unless
# float16 is struck for its model type (the gemma3 row on a T4 reads float32). vLLM's CPU
# backend of that era then turned float16 into bfloat16 with a warning (vllm #12794), so
# on a CPU the old rule ended in bfloat16 too.
#
# ## 2. What each dtype costs on the embedded model
#
# Teacher-forced scoring of 4 corpus windows of 32 tokens (128 positions; the windows are the
# clusters of the bootstrap interval, chapter 4) and greedy answers to 8 short questions.
# The float32 engine is the reference; while it scores, a forward hook on every decoder
# layer records the **peak |x| of the residual stream** (the layer's output), the number
# that decides whether float16 can hold this model.

# %%
seqs = evalsets.corpus_sequences(tok, seq_len=32, max_sequences=4)
qa = evalsets.load_qa()[:8]
qa_prompts = [tok.encode(tok.apply_chat_template(evalsets.qa_prompt(q.question), tokenize=False,
                                                 add_generation_prompt=True),
                         add_special_tokens=False) for q in qa]
greedy = SamplingParams(temperature=0.0, max_tokens=8)
n_layers = len(fp32.llm_engine.model_runner.model.layers)


def residual_peaks(llm, token_lists):
    """Score token_lists; return (logit rows, peak |residual| per decoder layer)."""
    peaks = torch.zeros(n_layers)
    layers = llm.llm_engine.model_runner.model.layers

    def hook(i):
        def record(module, args, out):
            peaks[i] = max(float(peaks[i]), float(out.detach().abs().max()))
        return record

    handles = [layer.register_forward_hook(hook(i)) for i, layer in enumerate(layers)]
    try:
        rows = llm.score(token_lists, output="logits")
    finally:
        for h in handles:
            h.remove()
    return rows, peaks


RUNS, TIMES = {}, {}


def run(name, llm, c=1, answers_from=None):
    """Score the windows and answer the questions with `llm`, the residual scaled by c.
    answers_from: take the answers of that run instead of generating (for a run whose
    logits are checked to be bit for bit that run's: greedy answers are then the same)."""
    with residual_scale_reparam(llm, c), track_nonfinite(llm) as counts:
        t = time.perf_counter()
        rows, peaks = residual_peaks(llm, seqs)
        TIMES[name] = time.perf_counter() - t
        before = llm.llm_engine.stats.num_corrupted_requests
        if answers_from is None:
            outs = [o.outputs[0] for o in llm.generate(qa_prompts, greedy)]
        else:
            assert all(torch.equal(a, b) for a, b in zip(rows, RUNS[answers_from]["rows"]))
            outs = RUNS[answers_from]["outs"]
        corrupted = llm.llm_engine.stats.num_corrupted_requests - before
    RUNS[name] = dict(rows=rows, peaks=peaks, outs=outs, corrupted=corrupted,
                      first_nonfinite=counts.first())
    return RUNS[name]


def wilson(k, n, z=1.96):
    """95 % Wilson score interval of a proportion k/n (stays informative at 0/n and n/n,
    where a bootstrap of n equal outcomes collapses to a point)."""
    p, d = k / n, 1 + z * z / n
    mid, half = (p + z * z / (2 * n)) / d, z * np.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / d
    return mid - half, mid + half


def drift(name):
    r, ref = RUNS[name], RUNS["float32"]
    kl = [metrics.kl_divergence(a, b).numpy() for a, b in zip(ref["rows"], r["rows"])]
    finite = all(np.isfinite(k).all() for k in kl)
    ok = [float(evalsets.answer_matches(o.text, q.answers)) for o, q in zip(r["outs"], qa)]
    return dict(kl=float(np.concatenate(kl).mean()) if finite else float("nan"),
                kl_ci=metrics.bootstrap_ci(kl) if finite else (float("nan"),) * 2,
                top1=metrics.top1_agreement(torch.cat(ref["rows"]), torch.cat(r["rows"])),
                acc=float(np.mean(ok)), acc_ci=wilson(sum(ok), len(ok)), n=len(ok),
                errors=sum(o.finish_reason == "error" for o in r["outs"]),
                corrupted=r["corrupted"], first=r["first_nonfinite"])


def table(names):
    print("| configuration | KL vs float32 (nats) [95% CI] | top-1 agreement | QA accuracy "
          "[95% CI] | requests ended 'error' | first non-finite module |\n|---|---|---|---|---|---|")
    for name in names:
        d = drift(name)
        print(f"| {name} | {d['kl']:.3g} [{d['kl_ci'][0]:.2g}, {d['kl_ci'][1]:.2g}] | "
              f"{100 * d['top1']:.2f}% | {100 * d['acc']:.0f}% [{100 * d['acc_ci'][0]:.0f}, "
              f"{100 * d['acc_ci'][1]:.0f}] of {d['n']} | {d['errors']} of {d['n']} | "
              f"{d['first'] or '-'} |")


# Speed: each engine scores the windows once more, timed (a CPU kernel's first call at a
# new shape packs weights and builds code, so the first call warms it up); BEST keeps the
# faster of that and the timed run below: one sample is noisy on a busy machine.
BEST = {}
for name, llm in [("float32", fp32), ("auto (bfloat16)", auto), ("float16", fp16)]:
    t = time.perf_counter()
    llm.score(seqs, output="logits")
    BEST[name] = time.perf_counter() - t
run("float32", fp32)
run("auto (bfloat16)", auto)
run("float16", fp16)
table(["float32", "auto (bfloat16)", "float16"])
peak = float(RUNS["float32"]["peaks"].max())
print()
say(f"residual peak (float32 engine): {peak:,.0f} at layer "
    f"{int(RUNS['float32']['peaks'].argmax())}, {100 * peak / torch.finfo(F16).max:.0f}% "
    f"of float16's max {torch.finfo(F16).max:,.0f}",
    f"残差峰值（float32 引擎）：{peak:,.0f}，位于第 "
    f"{int(RUNS['float32']['peaks'].argmax())} 层，是 float16 最大值 {torch.finfo(F16).max:,.0f} "
    f"的 {100 * peak / torch.finfo(F16).max:.0f}%")
BEST = {k: min(v, TIMES[k]) for k, v in BEST.items()}
print(f"score time for {sum(map(len, seqs))} positions, best of 2: " +
      ", ".join(f"{k} {v:.2f} s" for k, v in BEST.items()))
D2 = {n: drift(n) for n in ["float32", "auto (bfloat16)", "float16"]}
KL_RATIO = D2["auto (bfloat16)"]["kl"] / D2["float16"]["kl"]
say(f"KL bfloat16 / KL float16: {KL_RATIO:.0f}x: "
    f"{'float16 is the closer to float32' if KL_RATIO > 1 else 'bfloat16 is the closer to float32'}",
    f"KL bfloat16 / KL float16：{KL_RATIO:.0f}x，"
    f"{'float16 更接近 float32' if KL_RATIO > 1 else 'bfloat16 更接近 float32'}")
say(f"float16's maximum is {torch.finfo(F16).max / peak:.1f}x the residual peak",
    f"float16 的最大值是残差峰值的 {torch.finfo(F16).max / peak:.1f}x")
lo_hi = [D2[n]["acc_ci"] for n in D2]
qa_list = ", ".join(f"{n} {100 * d['acc']:.0f}%" for n, d in D2.items())
ci_overlap = max(a for a, _ in lo_hi) <= min(b for _, b in lo_hi)
say(f"QA accuracy: {qa_list}; the three 95% intervals overlap: "
    f"{'True' if ci_overlap else 'False'}",
    f"问答准确率：{qa_list}；三个 95% 置信区间是否重叠："
    f"{'是' if ci_overlap else '否'}")


def cpu_16bit_units():
    """The CPU's native 16-bit matmul instructions by /proc/cpuinfo, and any ISA cap in force."""
    try:
        flags = next(line for line in open("/proc/cpuinfo") if line.startswith("flags")).split()
    except (OSError, StopIteration):
        flags = []
    have = [f for f in ("amx_bf16", "avx512_bf16", "amx_fp16", "avx512_fp16") if f in flags]
    cap = os.environ.get("ONEDNN_MAX_CPU_ISA")
    return (", ".join(have) or "none") + (f" (oneDNN capped at {cap})" if cap else "")


def speed_verdict(name):
    """`name`'s scoring speed against float32's, from this run's two times."""
    r = BEST["float32"] / BEST[name]
    if r >= 1.25:
        return Bi(f"{r:.1f}x faster than float32", f"比 float32 快 {r:.1f}x")
    if r <= 0.8:
        return Bi(f"{1 / r:.1f}x slower than float32", f"比 float32 慢 {1 / r:.1f}x")
    return Bi(f"about as fast as float32 ({r:.2f}x its speed)",
              f"与 float32 大致一样快（其速度的 {r:.2f}x）")


SPEEDUP = {n: BEST["float32"] / BEST[n] for n in ("auto (bfloat16)", "float16")}
speed_head = Bi(f"speed, this CPU (ATen kernels {torch.backends.cpu.get_cpu_capability()}, native "
                f"16-bit matmul instructions: {cpu_16bit_units()}): bfloat16 scored ",
                f"速度，这个 CPU（ATen 内核 {torch.backends.cpu.get_cpu_capability()}，原生 "
                f"16 位矩阵乘法指令：{cpu_16bit_units()}）：bfloat16 打分")
sv_bf, sv_16 = speed_verdict("auto (bfloat16)"), speed_verdict("float16")
say(speed_head.en + sv_bf.en + ", float16 " + sv_16.en,
    speed_head.zh + sv_bf.zh + "，float16 " + sv_16.zh)

# %%
fig = Figure(figsize=(6.5, 3.2), layout="constrained")
ax = fig.add_subplot()
names16 = ["auto (bfloat16)", "float16"]
kls = [D2[n]["kl"] for n in names16]
err = [[D2[n]["kl"] - D2[n]["kl_ci"][0] for n in names16], [D2[n]["kl_ci"][1] - D2[n]["kl"] for n in names16]]
ax.bar(names16, kls, yerr=err, capsize=6, color=["C1", "C0"])
ax.set_yscale("log")
ax.set_ylabel("mean KL vs float32 (nats), 95% CI")
ax.set_title(f"The two 16-bit formats on {sum(map(len, seqs))} scored positions")
fig

# %% [markdown]
# Compare **float16 with bfloat16**, which is what `auto` picks: the KL ratio printed above
# says how much closer to float32 float16 came on this model. Both are 16 bits, split
# differently: float16 has 10 mantissa bits and 5 exponent bits (max 65504), bfloat16 has 7
# mantissa bits and float32's 8 exponent bits (max ~3.4e38). Three more mantissa bits are 8x
# finer rounding, and KL grows with the square of the rounding error, so for a model whose
# activations fit, float16 is expected to win by well over an order of magnitude; the
# printed ratio is this run's. Whether SmolLM2 fits is the line after it: float16's maximum
# over the residual peak. The QA accuracies come with intervals tens of points wide, so 8
# questions cannot see KLs this small; the QA accuracy line above says whether the three
# intervals overlap.
#
# The speed line is this CPU's, in this run (the better of two samples each, still noisy
# on a busy machine), not a GPU's, and no number in this chapter depends more on the CPU. A CPU
# without native 16-bit matmul units converts to float32 and back, so 16 bits buy it no
# speed and may cost some (the course's instructor guide, `docs/instructor.md`, budgets
# bfloat16 at ~3x slower than float32 on CPU); a CPU with native 16-bit matmul (AMX
# tiles, AVX512-BF16 or AVX512-FP16: `amx_bf16`, `avx512_bf16`, `avx512_fp16` in `lscpu`)
# *can* run those GEMMs faster than float32, as a GPU's tensor cores do, but only where
# the kernels use the units for that dtype, so bfloat16 and float16 can differ on the
# same CPU, and from run to run on a busy machine. The last line
# above gives this run's verdict and the units this CPU reports (a cap such as
# `ONEDNN_MAX_CPU_ISA` can keep the kernels from using them). Memory halves in 16 bits
# everywhere.
#
# ## 3. The incident: a model whose activations do not fit float16
#
# On its own SmolLM2 stays inside float16's range by the factor printed in section 2 (its
# peak against 65504). OLMo 2's float32 checkpoints did not, and neither do Gemma 3 and
# T5. Chapter 10 (sections 1 and 3) finds where this model's peak comes from (a massive
# activation written by layer 11's MLP on the first token) and introduces the exact
# reparametrization used here, `faults.residual_scale_reparam(llm, c)`: the residual
# stream c times larger, every norm, attention, MLP and the LM head seeing the same
# numbers as before, exact in every format for c a power of two until a value passes the
# format's maximum. Here it serves one purpose: a test model that does not fit float16,
# on which to evaluate the dtype choice of section 4 (documented as a reparametrization,
# not a property of SmolLM2). With c = 4:

# %%
C = 4
run("float32, residual x4", fp32, C, answers_from="float32")
run("auto (bfloat16), residual x4", auto, C, answers_from="auto (bfloat16)")
run("float16, residual x4", fp16, C)
SAME_X4 = {}  # dtype -> the x4 model's logits equal the unmodified model's, bit for bit
for d in ["float32", "auto (bfloat16)", "float16"]:
    a, b = torch.cat(RUNS[d]["rows"]), torch.cat(RUNS[f"{d}, residual x4"]["rows"])
    SAME_X4[d] = torch.equal(a, b)
    same = (Bi("bit for bit the same logits", "逐位相同的 logits") if SAME_X4[d] else
            Bi(f"different logits (finite: {'True' if torch.isfinite(b).all() else 'False'})",
               f"不同的 logits（是否有限：{'是' if torch.isfinite(b).all() else '否'}）"))
    head = Bi(f"{d:16} x{C}: peak {float(RUNS[f'{d}, residual x4']['peaks'].max()):,.0f}; ",
              f"{d:16} x{C}：峰值 {float(RUNS[f'{d}, residual x4']['peaks'].max()):,.0f}；")
    say(head.en + same.en, head.zh + same.zh)
table(["float32, residual x4", "auto (bfloat16), residual x4", "float16, residual x4"])

# %% [markdown]
# The reparametrized model is the same model: float32 and bfloat16 give the same logits bit
# for bit, peak four times higher (so their greedy answers are the unmodified runs'; `run`
# asserts the equality before reusing them). In float16 the residual passes 65504 in the MLP of the
# layer named in the table, becomes inf, then NaN (inf − inf in the next residual add,
# 0·inf in a norm), and every logit after it is NaN. The engine checks every logit row:
# each request ends with `finish_reason="error"` and is counted in
# `stats.num_corrupted_requests` (vLLM's `vllm:corrupted_requests`), so no answer comes
# out. An engine that samples from NaN logits anyway prints whatever token the argmax of a
# NaN row gives:

# %%
nan_row = torch.full((1, tok.vocab_size), float("nan"))
print(f"torch.argmax of an all-NaN row: {int(nan_row.argmax())}; token 0 of this vocabulary: "
      f"{tok.convert_ids_to_tokens(0)!r}")
say(f"corrupted requests so far: float16 engine {fp16.llm_engine.stats.num_corrupted_requests}, "
    f"bfloat16 {auto.llm_engine.stats.num_corrupted_requests}, float32 "
    f"{fp32.llm_engine.stats.num_corrupted_requests}",
    f"至今已损坏的请求：float16 引擎 {fp16.llm_engine.stats.num_corrupted_requests}，"
    f"bfloat16 {auto.llm_engine.stats.num_corrupted_requests}，float32 "
    f"{fp32.llm_engine.stats.num_corrupted_requests}")

# %% [markdown]
# The argmax of a NaN row is token 0. In SmolLM2's vocabulary that is `<|endoftext|>`, so
# such an engine would stop at once; in the GPT-2-style byte-level BPE vocabularies of GPT-2
# and OLMo, id 0 is `"!"`, which is consistent with the `"!!!!!!!!"` of olmo-cookbook #60
# (we did not run OLMo; the vocabulary fact is the tokenizers', the argmax is measured here).
#
# Where it breaks (the layer the table names) and why there: chapter 10's plot of the
# per-layer peaks, with the c = 4 curve against float16's maximum, and its printout of the
# massive activation's dimensions.
#
# One number per model decides float16's fate, and it is the peak, not the typical value.
#
# ## 4. The fix: choose the dtype from the checkpoint's statistics
#
# The fix in the incident was "serve in bf16 or fp32". It can be automated: measure the
# activation peaks once on calibration text in float32 (what the hooks above do), then
#
# - keep float16 only where `peak × margin ≤ 65504` (margin 2 here: other text can go
#   higher than the calibration text), and prefer it then, since it is the more precise
#   16-bit format;
# - otherwise bfloat16 if the device has it (same range as float32);
# - otherwise float32 (a pre-Ampere GPU: the OLMo case).
#
# Measured outcomes, each cell a run above (the float32 rows are the reference, KL 0):

# %%
def choose(peak, supported, margin=2.0):
    """float16 if it holds peak x margin, else bfloat16 if supported, else float32."""
    if F16 in supported and peak * margin <= torch.finfo(F16).max:
        return F16
    return BF16 if BF16 in supported else F32


MEASURED = {(F32, 1): "float32", (BF16, 1): "auto (bfloat16)", (F16, 1): "float16",
            (F32, C): "float32, residual x4", (BF16, C): "auto (bfloat16), residual x4",
            (F16, C): "float16, residual x4"}


def outcome(dtype, c):
    d = drift(MEASURED[(dtype, c)])
    if d["errors"]:
        return f"{short(dtype)}: NaN, {d['errors']} of {d['n']} requests 'error'"
    return f"{short(dtype)}: KL {d['kl']:.2g}, QA {100 * d['acc']:.0f}%"


print("| model | platform | dtype='auto' | chosen from the peak |\n|---|---|---|---|")
broken, restored, closer = 0, 0, []
for c in [1, C]:
    p = float(RUNS["float32" if c == 1 else "float32, residual x4"]["peaks"].max())
    for plat, supported in PLATFORMS.items():
        a_, ch = resolve_auto_dtype(F32, supported), choose(p, supported)
        print(f"| SmolLM2{'' if c == 1 else f', residual x{c}'} (peak {p:,.0f}) | {plat} | "
              f"{outcome(a_, c)} | {outcome(ch, c)} |")
        if drift(MEASURED[(a_, c)])["errors"]:
            broken += 1
            restored += not drift(MEASURED[(ch, c)])["errors"]
        if c == 1 and ch != a_:
            closer.append(drift(MEASURED[(ch, 1)])["kl"] < drift(MEASURED[(a_, 1)])["kl"])
print()
say(f"the check gives a finite answer in {restored} of the {broken} configurations where "
    f"'auto' gives NaN; where it picks another dtype than 'auto' for the unmodified model, "
    f"its KL is lower in {sum(closer)} of {len(closer)}",
    f"在“auto”给出 NaN 的 {broken} 个配置中，这个检查在 {restored} 个中给出有限的回答；在它为"
    f"未修改的模型选出不同于“auto”的 dtype 的 {len(closer)} 个情形中，有 {sum(closer)} 个的 KL 更低")

# %% [markdown]
# The broken configuration is the float16 row of the x4 model (a pre-Ampere GPU, where
# `auto` is float16); the line above says whether the check restores it, and whether on
# the unmodified model its pick (float16, where the peak fits with the margin) came out
# closer to float32 than `auto`'s bfloat16. What the check cannot know: a prompt unlike
# the calibration text may go higher (hence the margin); a clamp before the residual add
# (transformers PR #36832 for Gemma 3, chapter 10) keeps float16 finite but costs
# accuracy.
#
# ## 5. Seed 000 §2.4.2: bfloat16 weights, a float16 KV cache, TF32 off
#
# The seed's closing recommendation combines three settings: run the model in bfloat16
# (range), store K and V in float16 (three more mantissa bits), and turn TF32 off. What
# each does here:
#
# - **TF32** only ever touches float32 matmuls (chapter 13); a bfloat16 model has none, so
#   "TF32 off" changes nothing in this configuration.
# - **A float16 cache for bfloat16 K/V.** K and V come out of bfloat16 matmuls, so every
#   value has at most 8 significant bits, and float16 holds 11: any such value between
#   2^-14 and 65504 is stored exactly. The extra bits have nothing to keep. What float16
#   adds is a risk: values below 2^-14 lose bits (subnormal) and above 65504 overflow.
# - **What vLLM allows**: `--kv-cache-dtype` lists `auto`, `bfloat16`, the fp8 variants and,
#   in some versions, `float16` or `int8` (`CacheDType` in `vllm/config/cache.py`); `auto`
#   stores K/V in the model's dtype. (Seed 003 §1.5's float32 cache for a float16 model is
#   not among them, and chapter 1, section 6, measured that it stores float16 values
#   exactly: the same logits at twice the memory.)
#
# Measured: the bfloat16 engine with a float16 cache against the same engine with its
# default (bfloat16) cache, on the windows of section 2.

# %%
bf16_kv16 = LLM(MODEL, dtype="bfloat16", kv_cache_dtype="float16", **COMMON)
rows_kv16 = bf16_kv16.score(seqs, output="logits")
same_kv16 = all(torch.equal(a, b) for a, b in zip(rows_kv16, RUNS["auto (bfloat16)"]["rows"]))
kv16_kl = float(np.mean(np.concatenate([metrics.kl_divergence(a, b).numpy() for a, b in
                                        zip(RUNS["float32"]["rows"], rows_kv16)])))
kv_elem = {name: llm.llm_engine.model_runner.kv_caches[0].key.element_size()
           for name, llm in [("bfloat16 KV", auto), ("float16 KV", bf16_kv16)]}
# which stored K/V values float16 could not hold exactly: read back the float16 cache
_kc = bf16_kv16.llm_engine.model_runner.kv_caches
_vals = torch.cat([c.key.flatten().float() for c in _kc] + [c.value.flatten().float() for c in _kc])
_vals = _vals[_vals != 0]
tiny = int((_vals.abs() < 2.0 ** -14).sum())
say(f"bfloat16 model, float16 KV vs bfloat16 KV: logits bit for bit equal: "
    f"{'True' if same_kv16 else 'False'}; "
    f"mean KL against float32 {kv16_kl:.3g} (bfloat16 KV: {drift('auto (bfloat16)')['kl']:.3g}); "
    f"bytes per K/V element {kv_elem['bfloat16 KV']} vs {kv_elem['float16 KV']}; stored values "
    f"below 2^-14 (float16 subnormal): {tiny} of {_vals.numel():,}; largest |K/V| "
    f"{float(_vals.abs().max()):.3g}",
    f"bfloat16 模型，float16 KV 对 bfloat16 KV：logits 逐位相等："
    f"{'是' if same_kv16 else '否'}；"
    f"相对 float32 的平均 KL {kv16_kl:.3g}（bfloat16 KV：{drift('auto (bfloat16)')['kl']:.3g}）；"
    f"每个 K/V 元素的字节数 {kv_elem['bfloat16 KV']} 对 {kv_elem['float16 KV']}；存储值中"
    f"小于 2^-14（float16 次正规数）的：{_vals.numel():,} 个中有 {tiny} 个；最大 |K/V| "
    f"{float(_vals.abs().max()):.3g}")
del bf16_kv16

# %% [markdown]
# Read the line above this way: a bfloat16 value between 2^-14 and 65504 fits float16
# exactly, so only the values counted below 2^-14 can lose bits (the largest |K/V| printed
# shows how far the other end is). Where the logits are bit for bit equal, those few moved
# no logit; where they are not, the KL beside it says by how much. Either way the
# recommendation's float16 cache buys no accuracy for a bfloat16 model: a bfloat16 engine's
# accuracy is set by its bfloat16 matmuls, not by where K/V are stored.
#
# ## 6. Claim vs measurement

# %%
d32, dbf, d16 = drift("float32"), drift("auto (bfloat16)"), drift("float16")
d16x, dbfx = drift("float16, residual x4"), drift("auto (bfloat16), residual x4")
auto_dtype = auto.llm_engine.model_config.dtype
PRE_AMPERE = "GPU, compute capability < 8.0 (T4, V100)"
auto_t4 = resolve_auto_dtype(F32, PLATFORMS[PRE_AMPERE])  # this engine's rule on a T4
# the old rule on every GPU row of section 1's table (float32 checkpoint, model type llama)
old_gpu = {short(old_rule_gpu(F32, s_)) for p_, s_ in PLATFORMS.items() if not p_.startswith("CPU")}
# the x4 model on a pre-Ampere GPU: which of its dtypes give finite logits
t4_finite_x4 = [short(d_) for d_ in PLATFORMS[PRE_AMPERE]
                if not drift({F16: "float16, residual x4", F32: "float32, residual x4"}[d_])["errors"]]
bf16_safe_x4 = SAME_X4["auto (bfloat16)"] and not dbfx["errors"]
def joined(*parts):
    """One Bi of several Bi parts, each language's texts joined."""
    return Bi("".join(p.en for p in parts), "".join(p.zh for p in parts))


auto_t4_err = drift(MEASURED[(auto_t4, C)])["errors"]
claims = [
    (Bi("'auto' keeps the checkpoint's dtype", "“auto”保持检查点的 dtype"),
     Bi(f"{'not for float32 checkpoints' if auto_dtype != F32 else 'yes for this float32 checkpoint'}"
        f": this float32 checkpoint runs in {short(auto_dtype)} on this CPU, in {short(auto_t4)} "
        f"on a pre-Ampere GPU (and in {' / '.join(sorted(old_gpu))} on every GPU under the rule "
        f"before vLLM PR #18751)",
        f"{'对 float32 检查点并非如此' if auto_dtype != F32 else '对这个 float32 检查点是的'}"
        f"：这个 float32 检查点在这个 CPU 上以 {short(auto_dtype)} 运行，在 Ampere 之前的 GPU 上以 "
        f"{short(auto_t4)} 运行（在 vLLM PR #18751 之前的规则下，在所有 GPU 上以 "
        f"{' / '.join(sorted(old_gpu))} 运行）")),
    (Bi("'auto' is a reasonable starting point (seed 002 §五)",
        "“auto”是合理的起点（种子课程 002 §五）"),
     joined(Bi(f"for this model on this CPU: {short(auto_dtype)}, KL {dbf['kl']:.2g}, QA "
               f"{100 * dbf['acc']:.0f}% (float32 {100 * d32['acc']:.0f}%); ",
               f"对这个 CPU 上的这个模型：{short(auto_dtype)}，KL {dbf['kl']:.2g}，问答 "
               f"{100 * dbf['acc']:.0f}%（float32 {100 * d32['acc']:.0f}%）；"),
            Bi(f"but float16 is {dbf['kl'] / d16['kl']:.0f}x closer to float32",
               f"但 float16 更接近 float32（KL 相差 {dbf['kl'] / d16['kl']:.0f} 倍）") if d16["kl"] < dbf["kl"]
            else Bi(f"and float16 is not closer to float32 here ({d16['kl'] / dbf['kl']:.1f}x "
                    f"bfloat16's KL)",
                    f"而且这里 float16 并不更接近 float32（KL 是 bfloat16 的 "
                    f"{d16['kl'] / dbf['kl']:.1f}x）"),
            Bi(f" (KL {d16['kl']:.2g}), and on a pre-Ampere GPU 'auto' is {short(auto_t4)}, which "
               f"gives {'NaN' if auto_t4_err else 'finite logits'} for the x4 model "
               f"({auto_t4_err} of {d16x['n']} requests 'error')",
               f"（KL {d16['kl']:.2g}），而在 Ampere 之前的 GPU 上“auto”是 {short(auto_t4)}，它对 "
               f"x4 模型给出{' NaN' if auto_t4_err else '有限的 logits'}"
               f"（{d16x['n']} 个请求中有 {auto_t4_err} 个以 'error' 结束）"))),
    (Bi("bf16 is the safe default (seed 002)", "bf16 是安全的默认值（种子课程 002）"),
     joined(Bi("safe in range", "在范围上是安全的") if bf16_safe_x4
            else Bi("not shown safe in range here", "这里未显示出在范围上安全"),
            Bi(": the x4 model in bfloat16 gives ", "：x4 模型在 bfloat16 中给出"),
            Bi("the same logits as unmodified, bit for bit", "与未修改时逐位相同的 logits")
            if SAME_X4["auto (bfloat16)"]
            else Bi("different logits from the unmodified model's", "与未修改的模型不同的 logits"),
            Bi(f" (KL {dbfx['kl']:.2g}, {dbfx['errors']} of {dbfx['n']} requests 'error'); ",
               f"（KL {dbfx['kl']:.2g}，{dbfx['n']} 个请求中有 {dbfx['errors']} 个以 'error' 结束）；"),
            Bi("not the most accurate 16-bit choice where the peak fits float16",
               "在峰值放得进 float16 的地方，它不是最精确的 16 位选择")
            if d16["kl"] < dbf["kl"]
            else Bi("and here also the more accurate 16-bit format",
                    "而且这里它也是更精确的 16 位格式"))),
    (Bi("FP16's range is small, a few models overflow more easily (seed 002 §五)",
        "FP16 的数值范围小，少数模型更容易溢出（种子课程 002 §五）"),
     joined(Bi(f"{'yes' if d16x['errors'] else 'not shown here'}, and which models is a number: "
               f"SmolLM2 peaks at {peak:,.0f} ({100 * peak / 65504:.0f}% of 65504), ",
               f"{'是' if d16x['errors'] else '这里未显示'}，而哪些模型会溢出由一个数决定："
               f"SmolLM2 的峰值为 {peak:,.0f}（65504 的 {100 * peak / 65504:.0f}%），"),
            Bi(f"NaN from {d16['first']}", f"从 {d16['first']} 起为 NaN") if d16["errors"]
            else Bi("fine", "没有问题"),
            Bi(f"; x4 peaks at {float(RUNS['float32, residual x4']['peaks'].max()):,.0f}, ",
               f"；x4 的峰值为 {float(RUNS['float32, residual x4']['peaks'].max()):,.0f}，"),
            Bi(f"NaN from {d16x['first']}", f"从 {d16x['first']} 起为 NaN") if d16x["errors"]
            else Bi("still finite", "仍然有限"))),
    (Bi("fp32 is rarely worth it", "fp32 很少值得用"),
     joined(Bi(f"on this CPU, this run: bfloat16 scored in "
               f"{BEST['auto (bfloat16)'] / BEST['float32']:.2f}x "
               f"and float16 in {BEST['float16'] / BEST['float32']:.2f}x float32's time, so ",
               f"在这个 CPU 上、本次运行中：bfloat16 的打分用时是 float32 的 "
               f"{BEST['auto (bfloat16)'] / BEST['float32']:.2f}x，"
               f"float16 是 {BEST['float16'] / BEST['float32']:.2f}x，所以 "),
            Bi(f"16 bits bought no speed here ({max(SPEEDUP.values()):.2f}x at best)",
               f"16 位在这里没有带来速度（最多 {max(SPEEDUP.values()):.2f}x）")
            if max(SPEEDUP.values()) < 1.25 else
            Bi(f"bfloat16 was {SPEEDUP['auto (bfloat16)']:.1f}x and float16 "
               f"{SPEEDUP['float16']:.1f}x as fast as float32 (native 16-bit matmul "
               f"instructions: {cpu_16bit_units()})",
               f"bfloat16 的速度是 float32 的 {SPEEDUP['auto (bfloat16)']:.1f}x，float16 是 "
               f"{SPEEDUP['float16']:.1f}x（原生 16 位矩阵乘法"
               f"指令：{cpu_16bit_units()}）"),
            Bi("; on a GPU float32 costs speed and twice the memory, and ",
               "；在 GPU 上 float32 要付出速度和两倍内存的代价，而且"),
            Bi("it is the only dtype of a pre-Ampere GPU that keeps the x4 model finite",
               "它是 Ampere 之前的 GPU 上唯一能让 x4 模型保持有限的 dtype")
            if t4_finite_x4 == ["float32"] else
            Bi(f"on a pre-Ampere GPU the x4 model is finite in: {', '.join(t4_finite_x4) or 'none'}",
               f"在 Ampere 之前的 GPU 上，x4 模型在这些 dtype 中有限："
               f"{', '.join(t4_finite_x4) or '无'}"))),
    (Bi("bf16 weights + fp16 KV cache + TF32 off (seed 000 §2.4.2)",
        "bf16 权重 + fp16 KV cache + 关闭 TF32（种子课程 000 §2.4.2）"),
     joined(Bi("the float16 cache changed nothing: ", "float16 缓存什么也没有改变：") if same_kv16
            else Bi(f"the float16 cache changed the logits ({tiny} stored values below 2^-14): ",
                    f"float16 缓存改变了 logits（{tiny} 个存储值小于 2^-14）："),
            Bi(f"mean KL {kv16_kl:.3g} against bfloat16 KV's {drift('auto (bfloat16)')['kl']:.3g}; "
               f"TF32 touches no bfloat16 matmul; vLLM offers a float16 cache only in some versions",
               f"平均 KL {kv16_kl:.3g}，bfloat16 KV 为 {drift('auto (bfloat16)')['kl']:.3g}；"
               f"TF32 不涉及任何 bfloat16 矩阵乘法；vLLM 只在某些版本中提供 float16 缓存"))),
    (Bi("an fp32 KV cache helps an fp16 model (seed 003 §1.5)",
        "fp32 KV cache 对 fp16 模型有帮助（种子课程 003 §1.5）"),
     Bi("no: float16 values convert to float32 exactly, so the logits stay the same bit for bit "  # fact, not a measurement
        "(chapter 1, section 6, checks it), at twice the KV bytes",
        "否：float16 值能精确转换为 float32，所以 logits 逐位保持不变"
        "（第 1 章第 6 节检查了这一点），代价是两倍的 KV 字节数")),
    (Bi("vLLM serves fp32 checkpoints in fp16 (olmo-cookbook #60, PR #18340)",
        "vLLM 以 fp16 提供 fp32 检查点的服务（olmo-cookbook #60，PR #18340）"),
     Bi(f"true before PR #18751; "  # fact, not a measurement
        f"since then (this engine's rule) "
        f"{short(resolve_auto_dtype(F32, PLATFORMS['GPU, compute capability >= 8.0']))}"
        f" on Ampere+ GPUs and {short(auto_t4)} on pre-Ampere GPUs",
        f"在 PR #18751 之前为真；"
        f"此后（本引擎的规则）在 Ampere 及更新的 GPU 上为 "
        f"{short(resolve_auto_dtype(F32, PLATFORMS['GPU, compute capability >= 8.0']))}"
        f"，在 Ampere 之前的 GPU 上为 {short(auto_t4)}")),
]
claims_table(claims, header=(Bi("claim", "论断"), Bi("measured", "实测")))

# %% [markdown]
# ## Common misconceptions
#
# - *"`dtype='auto'` means the checkpoint's dtype."* For 16-bit checkpoints, yes where the
#   platform supports that dtype and the model type allows it (section 1's table: a bfloat16
#   checkpoint on a T4 gets float16, a float16 gemma3 checkpoint bfloat16 or float32); float32
#   checkpoints are downcast to the platform's preferred 16-bit format, quietly (INFO).
# - *"bfloat16 is more accurate than float16, it is the newer format."* bfloat16 has 3
#   mantissa bits *fewer*; it wins on range only. On a model that fits, float16 is the more
#   accurate 16-bit format (here by the factor in section 6).
# - *"Overflow shows up as slightly worse answers."* It shows up as inf, then NaN, then no
#   answer at all (this engine) or a constant token (an engine that samples NaN logits:
#   token 0, "!" in GPT-2-style vocabularies).
# - *"The typical activation size tells me whether float16 is safe."* The peak decides: one
#   massive activation in one layer (layer 11 here) is enough.
# - *"A float32 KV cache protects a float16 model."* It stores float16 values exactly,
#   which the float16 cache already did (chapter 1, section 6, compares the logits bit for
#   bit); likewise a float16 cache holds a bfloat16 model's K/V exactly, apart from the
#   few values below 2^-14 that section 5 counts.
# - *"Casting bfloat16 weights to float16 is harmless."* vLLM warns about it
#   ("Casting torch.bfloat16 to torch.float16."): a bfloat16 model's activations were
#   trained with float32's range and may not fit 65504.
#
# ## Lab
#
# `labs/source/ch12/` hands you the rule and the check: you write vLLM's dtype resolution,
# the per-layer activation peaks, and the choice of a safe dtype from them; the grader
# builds engines with your choice on prompts you have not seen, for the x4 model on a
# pre-Ampere platform (where `auto` gives NaN) and for the unmodified model (where your
# choice must beat `auto`'s bfloat16).
#
# ## On real vLLM
#
# - `--dtype auto` serves a float32 checkpoint in the platform's preferred 16-bit type
#   (the code's rule since vllm PR #18751; the `--dtype` help text still says FP16 for
#   FP32 models). Name the dtype you mean: `bfloat16`, `float16`/`half`, `float32`.
# - The startup log says what happened: INFO "Downcasting torch.float32 to
#   torch.bfloat16." (or "Upcasting"), WARNING "Casting torch.bfloat16 to
#   torch.float16." between the 16-bit formats.
# - `--dtype float16` raises for `gemma2`, `gemma3`, `gemma3_text`, `plamo2` and `glm4`
#   ("Numerical instability"); no other model is checked, so measure the peak as
#   section 4 does. `VLLM_COMPUTE_NANS_IN_LOGITS=1` counts NaN requests in
#   `vllm:corrupted_requests`.
# - Checked against `vllm/config/model.py` (`_resolve_auto_dtype`,
#   `_get_and_verify_dtype`) and the engine-argument docs of 2025-2026. This engine
#   applies the same rule (`resolve_auto_dtype`) and always checks logit rows for NaN,
#   ending such requests with `finish_reason="error"`.

# %%
print(f"chapter 12 ran in {time.perf_counter() - T0:.0f} s")
