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
# # Chapter 3. Number formats: fp32, tf32, fp16, bf16, fp8 e4m3/e5m2, int8, int4
#
# *Range, spacing, rounding, subnormals.*
#
# **Learning goals.** After this chapter you can
#
# 1. read any binary floating-point format from three numbers (exponent bits E, mantissa
#    bits M, bias): its range, its spacing (ulp) at any value, its precision in bits and
#    decimal digits, its subnormals and its special values; and say how an integer
#    format (int8, int4) differs: one spacing everywhere, set by a scale;
# 2. measure, for each class of tensor a real model stores (weights, K, V, the residual
#    stream), which values land in a format's subnormals, underflow to zero or
#    saturate, and the relative rounding error each format costs;
# 3. correct the seed course's format claims with numbers, and know where a scale helps
#    (at the ends of the range) and where it cannot (inside it).
#
# **The incident (as the seed course tells it).** The seed's format overview says, in
# section 2.2.3 of document 000, that TF32 "只有 10 位尾数精度，远低于 FP16 的 10 位尾数"
# ("has only 10 mantissa bits of precision, far below FP16's 10-bit mantissa"): a sentence
# that contradicts itself, and a misreading that is easy to pass on ("TF32 is less
# precise than fp16"). Section 2.3.3 says FP8 keeps "约 3 位十进制有效数字" ("about 3 significant
# decimal digits"). Both are wrong, and the second one matters: it makes an fp8 KV cache
# sound as safe as fp16. A related, real failure: bf16 cannot hold integer positions above
# 256, so rotary angles computed from bf16 positions go wrong at long context (huggingface/
# candle PR #3520, EleutherAI/gpt-neox #1003, transformers PR #29285).
#
# Everything below is measured when the notebook runs: the format facts on tensors built
# here, the model facts on the embedded SmolLM2-135M-Instruct with minivllm on this
# machine's CPU.

# %%
# %matplotlib inline
import contextlib
import functools
import math
import time

import numpy as np
import torch
from matplotlib.figure import Figure

from minivllm import LLM
from minivllm.i18n import Bi, say
from minivllm.numerics import FORMATS, round_to_format, round_to_tf32, ulp
from minivllm.precision import evalsets, metrics
from minivllm.quantization.kv_cache import quantize_kv

T0 = time.perf_counter()
torch.manual_seed(0)
MODEL = "smollm2-135m-instruct"
FLOATS = ["float32", "tf32", "float16", "bfloat16", "fp8_e4m3", "fp8_e5m2"]

# %% [markdown]
# ## 1. A format is three numbers
#
# A binary float is a sign, an E-bit exponent field stored with a bias, and M explicit
# mantissa bits. A normal number is $(-1)^s \cdot 1.m \cdot 2^{e-\text{bias}}$: M + 1
# significant bits, so the spacing between neighbours (one ulp) is $2^{e-M}$ and the
# relative rounding error of round-to-nearest is at most $2^{-(M+1)}$, whatever the
# exponent. When the exponent field is 0 the number is *subnormal*,
# $(-1)^s \cdot 0.m \cdot 2^{1-\text{bias}}$: evenly spaced values between 0 and the
# smallest normal number, with fewer and fewer significant bits as they shrink.
#
# The table is computed from `minivllm.numerics.FORMATS` and checked against
# `torch.finfo` for the formats torch has. "Decimal digits" is $(M+1)\log_{10}2$.
# int8 and int4 are here for contrast: symmetric integers times a scale, one spacing
# (the scale) for every value.

# %%
TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16,
                "bfloat16": torch.bfloat16, "fp8_e4m3": torch.float8_e4m3fn,
                "fp8_e5m2": torch.float8_e5m2}
table = [Bi("| format | E | M | bias | significant bits | decimal digits | eps (ulp at 1) | "
            "min subnormal | min normal | max | inf? | checked against torch.finfo |",
            "| 格式 | E | M | bias | 有效位数 | 十进制位数 | eps（1 处的 ulp） | "
            "最小次正规数 | 最小正规数 | 最大值 | 有 inf？ | 与 torch.finfo 核对 |"),
         Bi("|---|---|---|---|---|---|---|---|---|---|---|---|",
            "|---|---|---|---|---|---|---|---|---|---|---|---|")]
for name in FLOATS:
    f = FORMATS[name]
    ok = None  # no torch dtype to check against
    if name in TORCH_DTYPES:
        fi = torch.finfo(TORCH_DTYPES[name])
        ok = (fi.max == f.max_normal and fi.smallest_normal == f.min_normal
              and fi.eps == f.eps and fi.bits == 1 + f.exponent_bits + f.mantissa_bits)
    table.append(Bi(
        f"| {name} | {f.exponent_bits} | {f.mantissa_bits} | {f.bias} | "
        f"{f.mantissa_bits + 1} | {(f.mantissa_bits + 1) * math.log10(2):.2f} | "
        f"{f.eps:.3g} | {f.min_subnormal:.3g} | {f.min_normal:.3g} | {f.max_normal:.6g} | "
        f"{'yes' if f.has_inf else 'no (NaN only)'} | "
        f"{'n/a (no torch dtype)' if ok is None else 'max, min normal, eps, bits: equal' if ok else 'max, min normal, eps, bits: **DIFFERENT**'} |",
        f"| {name} | {f.exponent_bits} | {f.mantissa_bits} | {f.bias} | "
        f"{f.mantissa_bits + 1} | {(f.mantissa_bits + 1) * math.log10(2):.2f} | "
        f"{f.eps:.3g} | {f.min_subnormal:.3g} | {f.min_normal:.3g} | {f.max_normal:.6g} | "
        f"{'是' if f.has_inf else '否（仅 NaN）'} | "
        f"{'不适用（torch 没有该 dtype）' if ok is None else 'max、最小正规数、eps、位数：相同' if ok else 'max、最小正规数、eps、位数：**不同**'} |"))
for bits in (8, 4):
    q = 2 ** (bits - 1) - 1
    table.append(Bi(
        f"| int{bits} (symmetric) | - | - | - | {bits} (sign incl.) | depends on |x| | "
        f"scale | scale | scale | {q} x scale | no | {2 * q + 1} levels |",
        f"| int{bits}（对称） | - | - | - | {bits}（含符号位） | 取决于 |x| | "
        f"缩放因子 | 缩放因子 | 缩放因子 | {q} x 缩放因子 | 否 | {2 * q + 1} 个级别 |"))
say("\n".join(t.en for t in table), "\n".join(t.zh for t in table))

# %% [markdown]
# Read across a row: fp16 and TF32 have the **same** M = 10, so the same precision; TF32
# has float32's 8-bit exponent, so float32's range. bf16 has float32's range with 7 bits.
# The two fp8 formats split 7 bits differently: e4m3 keeps one more mantissa bit, e5m2
# keeps fp16's exponent range (and its inf/NaN conventions); e4m3 (the OCP "fn" variant)
# has no infinities and only one NaN pattern per sign, which buys it the values up to 448.
#
# ## 2. The seed's claims, measured
#
# ### 2.1 "TF32 has far less mantissa than FP16"
#
# If both have 10 mantissa bits, they must round every value inside fp16's normal range
# *identically*. Test it on values spread log-uniformly over that range, with the
# engine's TF32 rounding (`round_to_tf32`, used for emulated TF32 matmuls) against a
# real fp16 cast:

# %%
g = torch.Generator().manual_seed(0)
f16 = FORMATS["float16"]
logs = torch.empty(200_000).uniform_(math.log2(f16.min_normal), math.log2(f16.max_normal),
                                     generator=g)
x = (2.0 ** logs) * torch.where(torch.rand(200_000, generator=g) < 0.5, -1.0, 1.0)
x = x.clamp(-f16.max_normal, f16.max_normal)
same = torch.equal(round_to_tf32(x), x.to(torch.float16).float())
say(f"{x.numel()} values in fp16's normal range: tf32 rounding == fp16 rounding, bit for bit: "
    f"{'True' if same else 'False'}",
    f"fp16 正规范围内的 {x.numel()} 个值：tf32 舍入 == fp16 舍入，逐位相同："
    f"{'是' if same else '否'}")
for v in (1024.5, 1e5, 1e-6, 3e-8):
    t = torch.tensor([v])
    a, b = float(round_to_tf32(t)), float(t.to(torch.float16).float())
    print(f"  {v:>9g}: tf32 -> {a:<12.7g} (rel err {abs(a - v) / v:.1e}), "
          f"fp16 -> {b:<12.7g} (rel err {abs(b - v) / v:.1e})")

# %% [markdown]
# Inside fp16's range the two are the same format. They differ only at the ends, where
# fp16's 5-bit exponent runs out: 1e5 overflows fp16 to inf, and 1e-6 is an fp16
# subnormal (spacing 2^-24 = 6e-8 there, so about 1 % of error: 1.3e-02 printed) while
# TF32 keeps it normal. 1024.5 is a tie between 1024 and 1025 in both;
# round-to-nearest-even gives 1024. The famous "1024.5 times the identity gives 1025 on
# a 3090" (pytorch/pytorch #53635) is the *same* 10-bit grid with a different tie rule
# (NVIDIA's `cvt.rna.tf32` rounds ties away from zero), not a coarser one.
#
# ### 2.2 "FP8 keeps about 3 decimal digits"
#
# Three significant decimal digits means a relative error of at most about 5e-4. Measure
# the largest and the RMS relative rounding error on values spread over each format's
# normal range:

# %%
digits = {}
print("| format | max relative rounding error | RMS relative error | decimal digits "
      "(-log10 of the max) |")
print("|---|---|---|---|")
for name in ["float16", "bfloat16", "fp8_e4m3", "fp8_e5m2"]:
    f = FORMATS[name]
    v = 2.0 ** torch.empty(50_000).uniform_(math.log2(f.min_normal), math.log2(f.max_normal),
                                             generator=g)
    rel = ((round_to_format(v, f, saturate=True) - v) / v).abs()
    digits[name] = (float(rel.max()), float(rel.pow(2).mean().sqrt()))
    print(f"| {name} | {digits[name][0]:.3e} | {digits[name][1]:.2e} | "
          f"{-math.log10(digits[name][0]):.2f} |")
pi = torch.tensor([math.pi])
print(f"pi in e4m3: {float(round_to_format(pi, 'fp8_e4m3')):.4g}, in e5m2: "
      f"{float(round_to_format(pi, 'fp8_e5m2')):.4g}, in fp16: "
      f"{float(round_to_format(pi, 'float16')):.6g}")

# %% [markdown]
# e4m3's worst case is just under $2^{-4}$ = 6.25 % (a value halfway between 1 and
# 1.125 is off by 0.0625 either way, 5.9 % of it): 4 significant bits, about 1.2 decimal
# digits. e5m2's bound is $2^{-3}$ = 12.5 %; its worst case is again a midpoint (1.125,
# halfway between 1 and 1.25, is off by 0.125): 11.1 %, the printed 1.111e-01, under one
# digit. "About 3 decimal digits" is fp16.
# In e4m3, π is 3.25, and every value from 3.125 to 3.375 is stored as 3.25 (or as 3.0 or
# 3.5 at the ends).
#
# ### 2.3 "bf16 cannot hold integer positions above 256"
#
# With M + 1 significant bits a format holds every integer up to $2^{M+1}$ and then
# starts skipping. Rotary embeddings multiply the position by a frequency, so a position
# that is not representable gives the wrong angle:

# %%
ints = torch.arange(0, 20_000, dtype=torch.float32)
first_lost, stored_as = {}, {}
for name in ["bfloat16", "float16", "tf32", "fp8_e4m3"]:
    r = round_to_format(ints, name, saturate=True)
    first = first_lost[name] = int(ints[r != ints][0])
    say(f"{name:>9}: every integer exact up to {first - 1}; {first} becomes {float(r[first]):g}",
        f"{name:>9}：直到 {first - 1} 的每个整数都是精确的；{first} 变成 {float(r[first]):g}")
for name, p in (("bfloat16", 15962.0), ("float16", 1044.27)):
    p_r = stored_as[p] = float(round_to_format(torch.tensor([p]), name))
    spacing = float(ulp(torch.tensor([p]), name))
    say(f"position/angle {p:g} in {name}: {p_r:g} (spacing {spacing:g}); "
        f"cos {math.cos(p):+.3f} -> {math.cos(p_r):+.3f}",
        f"位置/角度 {p:g} 在 {name} 中：{p_r:g}（间距 {spacing:g}）；"
        f"cos {math.cos(p):+.3f} -> {math.cos(p_r):+.3f}")

# %% [markdown]
# The candle thread's claim holds on the grid: 257 is the first integer bf16 loses, and
# position 15962 is stored as 15936 (spacing 64 there), which changes the cosine of the
# rotary angle at the highest frequency (angle = position) as printed above: a wrong
# rotation, not a small error. (The thread also quotes 15968, which is not a bf16
# value, and cosines for its own frequency; we do not reproduce those.) gpt-neox #1003's
# angle 1044.27 becomes 1044 in fp16 here (the thread reports 1045 after its own
# arithmetic). Keep positions and angles in float32: minivllm builds its rotary table in
# float32 (chapter 11 measures what low-precision tables do).
#
# ## 3. The grids, side by side
#
# Where are the representable values? Every e4m3 and e5m2 value comes from casting all
# 256 bit patterns; fp16's from all 65,536.

# %%
def all_values(dtype, nbits):
    pats = torch.arange(2 ** nbits, dtype=torch.int32)
    raw = pats.to(torch.uint8 if nbits == 8 else torch.int16).view(dtype).float()
    return raw[torch.isfinite(raw) & (raw >= 0)].unique()


grids = {"fp8_e4m3": all_values(torch.float8_e4m3fn, 8),
         "fp8_e5m2": all_values(torch.float8_e5m2, 8),
         "float16": all_values(torch.float16, 16)}
for k, v in grids.items():
    f = FORMATS[k]
    say(f"{k:>9}: {v.numel()} non-negative finite values; largest {float(v.max()):g}; "
        f"subnormals: {int(((v > 0) & (v < f.min_normal)).sum())}",
        f"{k:>9}：{v.numel()} 个非负有限值；最大 {float(v.max()):g}；"
        f"次正规数：{int(((v > 0) & (v < f.min_normal)).sum())} 个")

fig = Figure(figsize=(9, 3.8), layout="constrained")
ax1, ax2 = fig.subplots(1, 2)
rows = list(grids)
for i, k in enumerate(rows):
    v = grids[k].numpy()
    near0 = v[v <= 0.04]
    ax1.eventplot(near0, lineoffsets=i, linelengths=0.7, colors=f"C{i}")
    top = v[v >= 100]
    ax2.eventplot(top, lineoffsets=i, linelengths=0.7, colors=f"C{i}")
ax1.axvline(FORMATS["fp8_e4m3"].min_normal, color="C0", ls="--", lw=1)
ax1.text(FORMATS["fp8_e4m3"].min_normal, 2.55, " e4m3 min normal 2^-6", fontsize=7, color="C0")
ax1.set_xlim(0, 0.04)
ax1.set_title("near 0 (linear): e4m3's 7 subnormals continue its grid", fontsize=9)
ax2.set_xscale("log")
ax2.set_title("near the top (log): e4m3 ends at 448, e5m2 at 57344", fontsize=9)
for ax in (ax1, ax2):
    ax.set_yticks(range(len(rows)), rows)
    ax.set_xlabel("value")
fig

# %% [markdown]
# Near 0 the e4m3 grid does not change its spacing at $2^{-6}$: subnormals continue the
# spacing of the lowest binade down to 0 ("gradual underflow"). Below $2^{-6}$ the
# spacing stays fixed while the values shrink, so the *relative* error grows: a value
# near 0.002 is stored with a single significant bit. e5m2 reaches much further down
# (normal to $2^{-14}$) but at 0.03 its spacing is already twice e4m3's. At the top,
# e5m2 has only four values per binade.
#
# The same picture as one curve per format: the relative spacing $\mathrm{ulp}(x)/x$.
# Flat (a sawtooth between $2^{-M}$ and $2^{-M-1}$) in the normal range, rising as $1/x$
# in the subnormals, ending at the format's maximum. An integer grid with a scale is one
# straight line of slope -1: its relative spacing is $\text{scale}/x$ everywhere.

# %%
xs = 2.0 ** torch.linspace(-26, 17, 4000)
fig = Figure(figsize=(7.5, 4), layout="constrained")
ax = fig.add_subplot()
for i, name in enumerate(["float16", "bfloat16", "fp8_e4m3", "fp8_e5m2"]):
    f = FORMATS[name]
    m = xs <= f.max_normal
    ax.loglog(xs[m], (ulp(xs[m], name) / xs[m]), label=name, color=f"C{i}")
ax.loglog(xs, (448 / 127) / xs, color="gray", ls=":", label="int8, scale 448/127 (same top)")
ax.set_ylim(1e-4, 2)
ax.set_xlabel("|x|")
ax.set_ylabel("relative spacing ulp(x)/x")
ax.grid(True, which="major", alpha=0.3)
ax.legend(fontsize=8)
fig

# %% [markdown]
# ## 4. What the model stores, per tensor class
#
# One float32 engine scores a chat conversation (teacher forcing, `LLM.score`). While it
# runs we record what it stores:
#
# - **K and V** of every layer, exactly as they go into the KV cache: the engine's
#   `"kv.quantize"` step (`minivllm/steps.py`) is swapped, layer by layer, for a function
#   that keeps a copy and then calls the reference;
# - **the residual stream** after every decoder layer (forward hooks);
# - **the weights**: a random sample of 2^21 of the 135 M parameters (from each tensor in
#   proportion to its size).

# %%
llm = LLM(MODEL, dtype="float32", max_model_len=512, kv_cache_memory_bytes=32 << 20)
tok = llm.get_tokenizer()
net = llm.llm_engine.model_runner.model
N_LAYERS = len(net.layers)
conv_seqs = evalsets.conversation_sequences(tok, max_conversations=3, max_tokens=256)
EVAL = conv_seqs[0]                  # the text everything is measured on
CALIB = conv_seqs[2][:128]           # another conversation, only for calibrating scales
print(f"scored text: {len(EVAL)} tokens; calibration text: {len(CALIB)} tokens")

captured = {"K": [[] for _ in range(N_LAYERS)], "V": [[] for _ in range(N_LAYERS)],
            "resid": [[] for _ in range(N_LAYERS)]}


def recording_quantize(layer, x, cache_dtype, scale=1.0):
    """The kv.quantize step of one layer: keep a copy of K (first call of a step) or V
    (second call), then do what the engine does."""
    ks, vs = captured["K"][layer], captured["V"][layer]
    (ks if len(ks) == len(vs) else vs).append(x.detach().float().clone())
    return quantize_kv(x, cache_dtype, scale)


hooks = [layer.register_forward_hook(
    lambda _m, _i, out, i=i: captured["resid"][i].append(out.detach().float().clone()))
    for i, layer in enumerate(net.layers)]
with contextlib.ExitStack() as stack:
    for i in range(N_LAYERS):
        stack.enter_context(llm.swap_step("kv.quantize", functools.partial(recording_quantize, i),
                                          where=i))
    base_rows = llm.score(EVAL, output="logits")
for h in hooks:
    h.remove()

# one tensor per layer (flattened)
parts = {c: [torch.cat(ts).flatten() for ts in captured[c]] for c in captured}
params = [p.detach() for p in net.parameters()]
sizes = torch.tensor([p.numel() for p in params], dtype=torch.float64)
n_per = (sizes / sizes.sum() * 2 ** 21).round().long().clamp(min=1)
parts["weights"] = [p.flatten()[torch.randint(0, p.numel(), (int(n),), generator=g)]
                    for p, n in zip(params, n_per)]
parts["V, layer 0"] = parts["V"][:1]
amax_of = {"weights": [float(p.abs().max()) for p in params]}
for c in ("K", "V", "resid"):
    amax_of[c] = [float(t.abs().max()) for t in parts[c]]
amax_of["V, layer 0"] = amax_of["V"][:1]
CLASSES = ["weights", "K", "V", "V, layer 0", "resid"]
for c in CLASSES:
    allv = torch.cat(parts[c]).abs()
    q = torch.quantile(allv[torch.randperm(allv.numel(), generator=g)[:200_000]],
                       torch.tensor([0.01, 0.5, 0.99]))
    print(f"{c:>11}: {allv.numel():>9,} values, |x| 1%/50%/99% = {q[0]:.2e} / {q[1]:.2e} / "
          f"{q[2]:.2e}, max {float(allv.max()):.4g}")

# %% [markdown]
# Rounding millions of values: `numerics.round_to_format` does it with integer
# arithmetic on the bit patterns (the readable reference); torch's casts do the same
# thing faster. With saturation (clamp to ±max, then round) they agree bit for bit,
# which we check on a sample before using the casts.

# %%
def round_fast(x, name):
    """x rounded to format `name`, saturating (clamp to +-max, then round to nearest even)."""
    if name == "tf32":
        return round_to_tf32(x)
    m = FORMATS[name].max_normal
    return x.clamp(-m, m).to(TORCH_DTYPES[name]).float()


sample = torch.cat([torch.cat(parts[c])[:4000] for c in CLASSES])
agree = {n: torch.equal(round_fast(sample, n).view(torch.int32),
                        round_to_format(sample, n, saturate=True).view(torch.int32))
         for n in FLOATS[1:]}
say(f"fast casts == numerics.round_to_format (saturate=True), bit for bit, on "
    f"{sample.numel()} model values: {agree}",
    f"在 {sample.numel()} 个模型数值上，快速类型转换 == numerics.round_to_format"
    f"（saturate=True），逐位相同：{agree}")


def sumsq(t):
    return float(torch.sum(t * t, dtype=torch.float64))


def per_value(cls, values):
    """One number per tensor of the class (an amax, a scale) -> one per value."""
    sizes = torch.tensor([t.numel() for t in parts[cls]])
    return torch.tensor(values, dtype=torch.float32).repeat_interleave(sizes)


def class_stats(cls, formats, ints=(8, 4)):
    """Per format: fractions subnormal / flushed to zero / saturated, and the relative RMS
    rounding error ||round(x) - x|| / ||x||; ints: symmetric, with a per-tensor absmax
    scale (one per parameter or per layer)."""
    t = torch.cat(parts[cls])
    a, nz, n, ref2 = t.abs(), t != 0, t.numel(), sumsq(t)
    out = {}
    for name in formats:
        f, r = FORMATS[name], round_fast(t, name)
        out[name] = {"sub": int((nz & (a < f.min_normal)).sum()) / n,
                     "zero": int((nz & (r == 0)).sum()) / n,
                     "sat": int((a > f.max_normal).sum()) / n,
                     "rel": math.sqrt(sumsq(r - t) / ref2)}
    amax = per_value(cls, amax_of[cls])
    for bits in ints:
        qmax = 2 ** (bits - 1) - 1
        r = torch.round(t * (qmax / amax)).clamp(-qmax, qmax) * (amax / qmax)
        out[bits] = {"zero": int((nz & (r == 0)).sum()) / n, "rel": math.sqrt(sumsq(r - t) / ref2)}
    return out


FMT8 = ["tf32", "float16", "bfloat16", "fp8_e4m3", "fp8_e5m2"]
per_class = {c: class_stats(c, FMT8) for c in CLASSES}
stats = {(c, n): per_class[c][n] for c in CLASSES for n in FMT8}
istats = {(c, b): per_class[c][b] for c in CLASSES for b in (8, 4)}

say("Scale 1 (values stored as they are). Per cell: % subnormal / % flushed to zero / "
    "% saturated\n",
    "缩放因子为 1（数值按原样存储）。每格：% 次正规数 / % 清零 / % 饱和\n")
print("| tensor class | " + " | ".join(FMT8) + " |")
print("|---" * (len(FMT8) + 1) + "|")
for c in CLASSES:
    print(f"| {c} | " + " | ".join(
        f"{100 * stats[c, n]['sub']:.3g} / {100 * stats[c, n]['zero']:.2g} / "
        f"{100 * stats[c, n]['sat']:.2g}" for n in FMT8) + " |")
say("\nRelative RMS rounding error ||round(x) - x|| / ||x|| (floats at scale 1; ints with "
    "a per-tensor absmax scale, and in brackets the % of non-zero values they round to 0)\n",
    "\n相对 RMS 舍入误差 ||round(x) - x|| / ||x||（浮点格式取缩放因子 1；整数格式用逐张量的 "
    "absmax 缩放因子，括号中是被它们舍入为 0 的非零值所占的 %）\n")
print("| tensor class | " + " | ".join(FMT8) + " | int8 | int4 |")
print("|---" * (len(FMT8) + 3) + "|")
for c in CLASSES:
    print(f"| {c} | " + " | ".join(f"{stats[c, n]['rel']:.2e}" for n in FMT8) + " | " +
          " | ".join(f"{istats[c, b]['rel']:.2e} ({100 * istats[c, b]['zero']:.0f}%)"
                     for b in (8, 4)) + " |")

# %% [markdown]
# How to read it: tf32 and bf16 never flush or saturate anything this model stores, fp16
# saturates nothing and flushes at most about 1e-4 % of a class to zero (the K row), and
# their errors are the format's precision alone (about ulp/√12 relative to the value:
# 2e-4 for 10 mantissa bits, 1.5e-3 for 7; tf32 and fp16 agree to every digit). The fp8
# columns are where the ends of the range show up, and the integer
# columns show why an integer format needs a good scale: one outlier sets the spacing for
# the whole tensor.
#
# The course plan for this chapter listed three expectations. Check each against the
# numbers just measured:

# %%
v0 = parts["V"][0]
e4 = FORMATS["fp8_e4m3"]
frac_v0 = float((v0.abs() < e4.min_normal).float().mean())
peak = max(amax_of["resid"])
peak_layer = int(np.argmax(amax_of["resid"]))
say(f"1. 'Most of layer 0's V falls below e4m3's normal range (2^-6)': "
    f"{100 * frac_v0:.1f}% of layer 0's V is below 2^-6 (amax {amax_of['V'][0]:.3f}).",
    f"1. “第 0 层的 V 大部分落在 e4m3 的正规范围（2^-6）以下”："
    f"第 0 层的 V 中有 {100 * frac_v0:.1f}% 低于 2^-6（amax {amax_of['V'][0]:.3f}）。")
res_all = torch.cat(parts["resid"])
big_channels = sorted({int(c) for ts in captured["resid"] for t in ts
                       for c in (t.abs() > 448).nonzero()[:, 1].tolist()})
say(f"2. 'The residual peak saturates e4m3, fits fp16 and is exact in bf16's range': "
    f"peak {peak:.6g} (layer {peak_layer}) = {100 * peak / FORMATS['float16'].max_normal:.0f}% "
    f"of fp16's max; {100 * float((res_all.abs() > 448).float().mean()):.3f}% of residual "
    f"values exceed 448; bf16 stores the peak as "
    f"{float(round_to_format(torch.tensor([peak]), 'bfloat16')):.6g} "
    f"(spacing {float(ulp(torch.tensor([peak]), 'bfloat16')):g} there). The values above 448 sit "
    f"in {len(big_channels)} of the {res_all.numel() // (len(EVAL) * N_LAYERS)} hidden channels: "
    f"{big_channels}.",
    f"2. “残差峰值会使 e4m3 饱和、能放进 fp16，并且在 bf16 的范围内是精确的”："
    f"峰值 {peak:.6g}（第 {peak_layer} 层）= fp16 最大值的 "
    f"{100 * peak / FORMATS['float16'].max_normal:.0f}%；"
    f"{100 * float((res_all.abs() > 448).float().mean()):.3f}% 的残差值超过 448；"
    f"bf16 把峰值存为 {float(round_to_format(torch.tensor([peak]), 'bfloat16')):.6g}"
    f"（那里的间距为 {float(ulp(torch.tensor([peak]), 'bfloat16')):g}）。超过 448 的值位于 "
    f"{res_all.numel() // (len(EVAL) * N_LAYERS)} 个隐藏通道中的 {len(big_channels)} 个："
    f"{big_channels}。")


def distinct_per_group(w, group=32):
    s = w.reshape(-1, group).sort(dim=1).values
    return 1 + (s.diff(dim=1) != 0).sum(dim=1)


lin = {n: p.detach() for n, p in net.named_parameters()
       if p.ndim == 2 and n.split(".")[:2] in (["layers", "0"], ["layers", "15"], ["layers", "29"])}
d_lin = max(int(distinct_per_group(p).max()) for p in lin.values())
d_emb = distinct_per_group(net.embed_tokens.weight.detach()[:8192])
say(f"3. 'Weights come from Q4_1, so each group of 32 holds <= 16 distinct values': decoder "
    f"linears of layers 0, 15, 29 ({len(lin)} matrices): at most {d_lin} distinct per group "
    f"of 32; the embedding (tied LM head), first 8192 rows: up to {int(d_emb.max())}, "
    f"mean {float(d_emb.float().mean()):.1f}.",
    f"3. “权重来自 Q4_1，所以每组 32 个权重至多有 16 个不同的值”：第 0、15、29 层的解码器"
    f"线性层（{len(lin)} 个矩阵）：每组 32 个中至多 {d_lin} 个不同的值；嵌入层（与 LM head "
    f"共享），前 8192 行：最多 {int(d_emb.max())} 个，平均 {float(d_emb.float().mean()):.1f} 个。")

# %% [markdown]
# Where the expectations were wrong:
#
# 1. **"Most" of layer 0's V is not subnormal in e4m3**: about four in ten values are
#    (the number above). That is still a large share of one layer's values stored with
#    1-3 significant bits, and the tensor where e4m3's subnormals matter most: the
#    weights (8 %), V over all layers (3 %) and K (1 %) touch them much less.
# 2. **The residual peak is inside bf16's range but not exact**: bf16 has 8 significant
#    bits, so at ~25,000 it rounds to a multiple of 128. (It does saturate e4m3 and fit
#    fp16, as expected: about 0.013 % of them (printed), in the few channels listed
#    above.)
# 3. **Only the decoder linears are Q4_1**: the embedding (which is also the LM head)
#    holds up to 32 distinct values per group; the GGUF stores it as Q8_0. Re-quantizing
#    a decoder linear to 4 bits on the same groups would be nearly lossless; chapters
#    14-16 take care of that.
#
# Three facts the plan did not list:
#
# - Among whole classes, the **weights** put the most values in e4m3's subnormals at
#   scale 1 (the table's first row): their median magnitude is about 0.1. Stored fp8
#   weights always come with a scale (chapter 17).
# - The **residual stream** is the class fp8 *saturates*: only about one value in 10,000
#   exceeds 448, but those few "massive activations" carry most of the stream's energy,
#   so e4m3's relative RMS error on the stream is close to 100 %. fp16 and bf16 hold it.
# - The residual stream is also the class that **integers** treat worst: a per-layer int8
#   scale set by the massive activations rounds most of the stream to 0 (the
#   bracketed percentages).
#
# Everything stored in fp16 or bf16 stays in range. bf16 keeps it all in its normal
# numbers; fp16 puts a small share in its subnormals (up to 0.22 % of layer 0's V, the
# table), too few to show in its error column, which matches tf32's: both columns show
# nothing but the format's precision.
#
# The histograms show where K, V and the residual stream sit against the fp8 ranges (log
# scale, so that the tails, down to single values, are visible):

# %%
bins = np.logspace(-10, 5, 121)
fig = Figure(figsize=(10, 3.6), layout="constrained")
axes = fig.subplots(1, 3, sharey=False)
for ax, (title, series) in zip(axes, [
        ("|K|, all layers", {"K": torch.cat(parts["K"])}),
        ("|V|", {"all layers": torch.cat(parts["V"]), "layer 0": parts["V"][0]}),
        ("residual stream, all layers", {"resid": res_all})]):
    for j, (lab, t) in enumerate(series.items()):
        a = t.abs().numpy()
        ax.hist(a[a > 0], bins=bins, histtype="step", weights=np.full((a > 0).sum(), 1 / a.size),
                label=lab, color=f"C{j}")
    for xv, lab, c, ls in ((2.0 ** -14, "fp16/e5m2 min normal 2^-14", "gray", "--"),
                           (2.0 ** -9, "e4m3 min subnormal 2^-9", "k", ":"),
                           (2.0 ** -6, "e4m3 min normal 2^-6", "k", "--"),
                           (448, "e4m3 max 448", "r", "--"), (57344, "e5m2 max 57344", "m", "--")):
        ax.axvline(xv, color=c, ls=ls, lw=0.9, label=lab if ax is axes[2] else None)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(1e-8, 2e5)
    ax.set_ylim(1e-7, 0.5)
    ax.set_title(title, fontsize=9)
    ax.set_xlabel("|x|")
    ax.legend(fontsize=6, loc="lower left" if ax is axes[2] else "upper left")
axes[0].set_ylabel("fraction of values per bin (8 bins per decade)")
fig

# %% [markdown]
# ## 5. Why
#
# - **A float's relative precision does not depend on the value, inside the normal
#   range.** Multiplying a tensor by a power of two moves every value along the same
#   grid; its relative rounding errors do not change at all. A scale only matters at the
#   two ends: values pushed below the smallest normal number lose significant bits
#   (subnormals) and finally round to 0; values above the maximum saturate (or become
#   inf/NaN without saturation).
# - **Subnormals keep small values from jumping to 0.** Without them (flush-to-zero),
#   every value below $2^{-6}$ in e4m3 would be stored as 0; with them it is stored on
#   the $2^{-9}$ grid, coarse but unbiased on average.
# - **An integer grid has one absolute spacing.** Its relative error is spacing/|x|: fine
#   for the largest values, useless for values far below them. That is why int8/int4
#   always come with a scale chosen per tensor, per channel or per group, and why a
#   tensor with massive outliers (the residual stream) is the worst case.
# - **More exponent bits buy range, not precision.** e5m2 has fp16's exponent range and
#   half as many values per binade as e4m3; on every class that fits in e4m3's range,
#   its rounding error is about twice e4m3's.
#
# ## 6. The fix, measured: a scale for the fp8 KV cache
#
# For each tensor class, pick the format whose range covers the values and whose spacing
# is fine enough: the tables above say 16-bit formats for everything here, e4m3 with a
# scale for K/V when memory matters. The scale is the fp8 KV cache's fix: store
# $Q(x/s)$, read back $Q(x/s)\cdot s$, with $s = \text{amax}/448$ per layer, calibrated
# on other text (the engine's `calibrate_kv_scales`). First on the captured tensors:
# what a per-layer scale does to each class's fractions and error.

# %%
llm8 = LLM(MODEL, dtype="float32", kv_cache_dtype="fp8_e4m3", max_model_len=512,
           kv_cache_memory_bytes=32 << 20)
scale1_rows = llm8.score(EVAL, output="logits")  # built-in fp8 e4m3 cache, scale 1.0
scales = llm8.llm_engine.calibrate_kv_scales([CALIB])  # amax / 448 per layer, on CALIB
K_S, V_S = scales["k_scale"], scales["v_scale"]
say(f"calibrated scales: K {min(K_S):.4f}..{max(K_S):.4f}, V {min(V_S):.5f}..{max(V_S):.4f} "
    f"(layer 0's V: {V_S[0]:.5f}, i.e. values multiplied by {1 / V_S[0]:.0f} before rounding)",
    f"校准得到的缩放因子：K {min(K_S):.4f}..{max(K_S):.4f}，V {min(V_S):.5f}..{max(V_S):.4f}"
    f"（第 0 层的 V：{V_S[0]:.5f}，即数值在舍入前乘以 {1 / V_S[0]:.0f}）")


def e4m3_stats(cls, layer_scales):
    """Store x / s in e4m3 (saturating), read back times s; one scale per layer."""
    t = torch.cat(parts[cls])
    s = per_value(cls, layer_scales)
    y = t / s
    r = round_fast(y, "fp8_e4m3") * s
    nz, n = t != 0, t.numel()
    return {"sub": int((nz & (y.abs() < e4.min_normal)).sum()) / n,
            "zero": int((nz & (r == 0)).sum()) / n,
            "sat": int((y.abs() > e4.max_normal).sum()) / n,
            "rel": math.sqrt(sumsq(r - t) / sumsq(t)),
            "mean_rel": float(((r - t)[nz] / t[nz]).abs().mean(dtype=torch.float64))}


print("| e4m3 | % subnormal | % flushed to 0 | % saturated | relative RMS error "
      "(norm-weighted) | mean relative error per value |")
print("|---|---|---|---|---|---|")
scaled = {}
for c, ss in (("K", K_S), ("V", V_S), ("V, layer 0", V_S[:1])):
    for lab, sc in (("scale 1", [1.0] * len(ss)), ("calibrated", ss)):
        st = scaled[c, lab] = e4m3_stats(c, sc)
        print(f"| {c}, {lab} | {100 * st['sub']:.3g} | {100 * st['zero']:.2g} | "
              f"{100 * st['sat']:.2g} | {100 * st['rel']:.2f}% | {100 * st['mean_rel']:.2f}% |")
# A power-of-two scale changes nothing inside the normal range, bit for bit:
k5 = parts["K"][5]
inside = (k5.abs() >= e4.min_normal) & (k5.abs() * 4 <= e4.max_normal)
same_k5 = torch.equal(round_fast(k5[inside] * 4, "fp8_e4m3") / 4, round_fast(k5[inside], "fp8_e4m3"))
say(f"K of layer 5, values in the normal range: round(4x)/4 == round(x) bit for bit: "
    f"{'True' if same_k5 else 'False'}",
    f"第 5 层的 K，正规范围内的值：round(4x)/4 == round(x)，逐位相同："
    f"{'是' if same_k5 else '否'}")

# %% [markdown]
# The scale lifts layer 0's V out of the subnormals: the mean relative error *per
# value* falls several fold. The norm-weighted relative RMS error hardly moves, because
# the values that were subnormal are the small ones, and small values weigh little in a
# norm (or in an attention sum). For K, already in the normal range, the scale changes
# almost nothing (a scale that is not a power of two only reshuffles which values round
# up and which down), and a scale calibrated on other text saturates a few values that
# exceed its calibration maximum.
#
# Does the model notice? KL of the next-token distributions against the float32 KV
# cache, on the same 256 tokens, for the built-in e4m3 cache at scale 1 and with the
# calibrated scales, and for two hand-written quantizers that get the format wrong
# (plugged in through the `"kv.quantize"` step): one that flushes subnormals to zero, one
# that truncates the mantissa instead of rounding to nearest. The intervals are 95 %
# bootstrap intervals over blocks of 16 positions; the last column is the paired
# difference from the built-in scale-1 cache.

# %%
calib_rows = llm8.score(EVAL, output="logits")


def e4m3_ftz(x, cache_dtype, scale=1.0):
    """Round to nearest even, but flush results below 2^-6 to zero (no subnormals)."""
    y = (x.float() / scale).clamp(-448, 448)
    q = y.to(cache_dtype).float()
    return torch.where(q.abs() < 2.0 ** -6, torch.zeros_like(q), q).to(cache_dtype)


def e4m3_chop(x, cache_dtype, scale=1.0):
    """Keep the top 3 mantissa bits of the float32 pattern (truncation toward zero)."""
    y = (x.float() / scale).clamp(-448, 448)
    return (y.view(torch.int32) & ~0xFFFFF).view(torch.float32).to(cache_dtype)


with llm8.swap_step("kv.quantize", e4m3_ftz):
    ftz_rows = llm8.score(EVAL, output="logits")
with llm8.swap_step("kv.quantize", e4m3_chop):
    chop_rows = llm8.score(EVAL, output="logits")


def blocks(v, size=16):
    return [v[i:i + size] for i in range(0, len(v), size)]


per_pos = {lab: metrics.kl_divergence(base_rows, rows).numpy() for lab, rows in (
    ("e4m3, scale 1.0 (built-in)", scale1_rows),
    ("e4m3, calibrated per-layer scales (built-in)", calib_rows),
    ("e4m3, scale 1.0, flush subnormals to zero", ftz_rows),
    ("e4m3, scale 1.0, truncate instead of round", chop_rows))}
ref_kl = per_pos["e4m3, scale 1.0 (built-in)"]
diff_ci = {lab: metrics.bootstrap_ci(blocks(k - ref_kl)) for lab, k in per_pos.items()}
rows_of = dict(zip(per_pos, (scale1_rows, calib_rows, ftz_rows, chop_rows)))
say(f"against the float32 KV cache, {len(EVAL)} positions:\n",
    f"相对 float32 KV cache，{len(EVAL)} 个位置：\n")
print("| KV cache | mean KL (nats) [95% CI] | top-1 agreement | max abs log-prob diff | "
      "KL minus scale-1 KL [95% CI] |")
print("|---|---|---|---|---|")
for lab, k in per_pos.items():
    lo, hi = metrics.bootstrap_ci(blocks(k))
    dlo, dhi = diff_ci[lab]
    top1 = metrics.top1_agreement(base_rows, rows_of[lab])
    dmax = metrics.abs_diff(metrics.log_softmax(base_rows), metrics.log_softmax(rows_of[lab]))[0]
    print(f"| {lab} | {k.mean():.2e} [{lo:.1e}, {hi:.1e}] | {100 * top1:.1f}% | {dmax:.2f} | "
          + ("-" if k is ref_kl else f"{(k - ref_kl).mean():+.1e} [{dlo:+.1e}, {dhi:+.1e}]")
          + " |")

# %% [markdown]
# What this model shows, and what it does not:
#
# - **The scale fixes the stored tensors, not the KL.** Where the interval of the
#   difference contains 0, the change is not measurable on this text. It is the rounding
#   of *all* the normal-range K/V values, about 2.6 % RMS, that makes the fp8 cache's KL,
#   and no scale changes that. The benchmark over 10,000 positions
#   (`benchmarks/RESULTS.md`, "KV-cache scales") found the same: mean KL 0.00657 at scale 1
#   against 0.00654 calibrated.
# - **Flushing subnormals is nearly harmless on this model**, for the same reason: the
#   flushed values are the smallest ones. A model whose K or V lives lower (or a
#   scale that pushes values down) would lose more; SmolLM2 does not show it.
# - **Truncation is not harmless.** Chopping bits doubles the worst-case error and biases
#   every value toward zero, so errors no longer cancel in attention's weighted sums:
#   its KL is about twice the correct fp8 cache's, clearly outside the intervals.
#   The lab starts from this quantizer.
#
# ## 7. Claim vs measurement
#
# The claims this chapter checked, each with the number measured above.

# %%
kl1, klc, klt = (per_pos[k].mean() for k in ("e4m3, scale 1.0 (built-in)",
                                             "e4m3, calibrated per-layer scales (built-in)",
                                             "e4m3, scale 1.0, truncate instead of round"))
lo_c, hi_c = diff_ci["e4m3, calibrated per-layer scales (built-in)"]
lo_t, hi_t = diff_ci["e4m3, scale 1.0, truncate instead of round"]
m_tf32, m_fp16 = FORMATS["tf32"].mantissa_bits, FORMATS["float16"].mantissa_bits
THREE_DIGITS = 5e-4                  # a relative error of at most ~5e-4 (section 2.2)
peak_bf16 = float(round_to_format(torch.tensor([peak]), "bfloat16"))
v0_s1, v0_cal = scaled["V, layer 0", "scale 1"], scaled["V, layer 0", "calibrated"]
ends_fixed = v0_cal["sub"] < v0_s1["sub"] and v0_cal["mean_rel"] < v0_s1["mean_rel"]
claims = [
    (Bi("TF32 has far less mantissa precision than FP16", "TF32 的尾数精度远低于 FP16"),
     Bi("seed 000 §2.2.3", "种子课程 000 §2.2.3"),
     Bi(f"{'refuted' if same and m_tf32 >= m_fp16 else 'not refuted'}: tf32 has {m_tf32} "
        f"mantissa bits, fp16 {m_fp16}; tf32 and fp16 rounding of "
        f"{x.numel():,} values in fp16's normal range identical bit for bit: "
        f"{'True' if same else 'False'}; tf32 "
        f"differs only where fp16 runs out of exponent (1e5: fp16 inf; 1e-6: an fp16 "
        f"subnormal) (§2.1)",
        f"{'被证伪' if same and m_tf32 >= m_fp16 else '未被证伪'}：tf32 有 {m_tf32} 个"
        f"尾数位，fp16 有 {m_fp16} 个；在 fp16 正规范围内的 {x.numel():,} 个值上，tf32 与 "
        f"fp16 的舍入逐位相同：{'是' if same else '否'}；tf32 只在 fp16 的指数用尽的地方"
        f"不同（1e5：fp16 为 inf；1e-6：fp16 次正规数）（§2.1）")),
    (Bi("FP8 keeps about 3 significant decimal digits", "FP8 保留约 3 位十进制有效数字"),
     Bi("seed 000 §2.3.3", "种子课程 000 §2.3.3"),
     Bi(f"{'refuted' if digits['fp8_e4m3'][0] > THREE_DIGITS else 'confirmed'}"
        f": e4m3: worst relative rounding error {100 * digits['fp8_e4m3'][0]:.1f} % "
        f"({-math.log10(digits['fp8_e4m3'][0]):.1f} decimal digits; 3 digits is at most "
        f"{100 * THREE_DIGITS:.2f} %); e5m2 {100 * digits['fp8_e5m2'][0]:.1f} %; fp16 "
        f"{100 * digits['float16'][0]:.3f} % "
        f"{'is the format with about 3 digits' if digits['float16'][0] <= THREE_DIGITS else 'does not reach 3 digits either'}"
        f" (§2.2)",
        f"{'被证伪' if digits['fp8_e4m3'][0] > THREE_DIGITS else '得到证实'}"
        f"：e4m3：最坏相对舍入误差 {100 * digits['fp8_e4m3'][0]:.1f} %"
        f"（{-math.log10(digits['fp8_e4m3'][0]):.1f} 位十进制数字；3 位数字意味着至多 "
        f"{100 * THREE_DIGITS:.2f} %）；e5m2 {100 * digits['fp8_e5m2'][0]:.1f} %；fp16 "
        f"{100 * digits['float16'][0]:.3f} % "
        f"{'才是约有 3 位数字的格式' if digits['float16'][0] <= THREE_DIGITS else '也达不到 3 位数字'}"
        f"（§2.2）")),
    (Bi("bf16 cannot hold integer positions above 256", "bf16 无法容纳 256 以上的整数位置"),
     "candle PR #3520, gpt-neox #1003",
     Bi(f"{'confirmed' if first_lost['bfloat16'] == 257 else 'not confirmed'}"
        f": {first_lost['bfloat16']} is the first integer bf16 loses; 15962 is stored as "
        f"{stored_as[15962.0]:g}; fp16 keeps every integer below {first_lost['float16']}, "
        f"tf32 every one below {first_lost['tf32']} (§2.3)",
        f"{'得到证实' if first_lost['bfloat16'] == 257 else '未得到证实'}"
        f"：{first_lost['bfloat16']} 是 bf16 丢失的第一个整数；15962 被存储为 "
        f"{stored_as[15962.0]:g}；fp16 保留 {first_lost['float16']} 以下的每个整数，"
        f"tf32 保留 {first_lost['tf32']} 以下的每个整数（§2.3）")),
    (Bi("most of layer 0's V is subnormal in e4m3", "第 0 层的 V 在 e4m3 中大部分是次正规数"),
     Bi("this chapter's plan", "本章的计划"),
     Bi(f"{'yes' if frac_v0 > 0.5 else 'no'}: {100 * frac_v0:.0f} % of it (§4)",
        f"{'是' if frac_v0 > 0.5 else '否'}：占其 {100 * frac_v0:.0f} %（§4）")),
    (Bi("the residual peak is exact in bf16's range", "残差峰值在 bf16 的范围内是精确的"),
     Bi("this chapter's plan", "本章的计划"),
     Bi(f"{'in range' if peak <= FORMATS['bfloat16'].max_normal else 'out of range'}"
        f"{', exact' if peak_bf16 == peak else ', not exact'}"
        f": {peak:.6g} is stored as {peak_bf16:.6g} (§4)",
        f"{'在范围内' if peak <= FORMATS['bfloat16'].max_normal else '超出范围'}"
        f"{'，精确' if peak_bf16 == peak else '，不精确'}"
        f"：{peak:.6g} 被存储为 {peak_bf16:.6g}（§4）")),
    (Bi("each group of 32 weights holds at most 16 values (Q4_1)",
        "每组 32 个权重至多有 16 个不同的值（Q4_1）"),
     Bi("this chapter's plan", "本章的计划"),
     Bi(f"{'yes' if max(d_lin, int(d_emb.max())) <= 16 else 'for the decoder linears only' if d_lin <= 16 else 'no'}"
        f": decoder linears: at most {d_lin}; the embedding / LM head: up to "
        f"{int(d_emb.max())} (§4)",
        f"{'是' if max(d_lin, int(d_emb.max())) <= 16 else '仅对解码器线性层成立' if d_lin <= 16 else '否'}"
        f"：解码器线性层：至多 {d_lin} 个；嵌入层 / LM head：最多 "
        f"{int(d_emb.max())} 个（§4）")),
    (Bi("a scale fixes an fp8 KV cache", "缩放因子能修好 fp8 KV cache"),
     Bi("common advice", "常见建议"),
     Bi(f"{'it fixes the ends of the range' if ends_fixed else 'it does not fix the ends of the range'}"
        f" (layer 0's V: subnormal {100 * v0_s1['sub']:.0f} % -> {100 * v0_cal['sub']:.1f} %, "
        f"mean error per value {100 * v0_s1['mean_rel']:.1f} % -> "
        f"{100 * v0_cal['mean_rel']:.1f} %); mean KL {kl1:.2e} -> "
        f"{klc:.2e} nats, "
        f"{'a change the intervals of §6 cannot tell from noise here' if lo_c <= 0 <= hi_c else f'a change of {klc - kl1:+.1e} [{lo_c:+.1e}, {hi_c:+.1e}] (§6)'}",
        f"{'它修好了范围的两端' if ends_fixed else '它没有修好范围的两端'}"
        f"（第 0 层的 V：次正规数 {100 * v0_s1['sub']:.0f} % -> {100 * v0_cal['sub']:.1f} %，"
        f"每个值的平均误差 {100 * v0_s1['mean_rel']:.1f} % -> "
        f"{100 * v0_cal['mean_rel']:.1f} %）；平均 KL {kl1:.2e} -> "
        f"{klc:.2e} nats，"
        f"{'在这里，§6 的区间无法把这一变化与噪声区分开' if lo_c <= 0 <= hi_c else f'变化为 {klc - kl1:+.1e} [{lo_c:+.1e}, {hi_c:+.1e}]（§6）'}")),
    (Bi("(hand-written fp8) truncating is as good as rounding", "（手写的 fp8）截断与舍入一样好"),
     Bi("the lab's broken quantizer", "实验中坏掉的量化器"),
     Bi(f"{'no, worse' if lo_t > 0 else 'no, better' if hi_t < 0 else 'not distinguishable here'}"
        f": mean KL {klt:.2e} against {kl1:.2e} nats: {klt / kl1:.1f}x, difference "
        f"[{lo_t:+.1e}, {hi_t:+.1e}] (95 % CI) (§6)",
        f"{'不，更差' if lo_t > 0 else '不，更好' if hi_t < 0 else '此处无法区分'}"
        f"：平均 KL {klt:.2e}，对比 {kl1:.2e} nats：{klt / kl1:.1f}x，差值 "
        f"[{lo_t:+.1e}, {hi_t:+.1e}]（95 % CI）（§6）")),
]


def _row(cells, lang):
    return "| " + " | ".join(c if isinstance(c, str) else getattr(c, lang) for c in cells) + " |"


# the Chinese header keeps "source": docs/claims.py reads a three-column table by that word
say("| claim | source | measured here |\n|---|---|---|\n"
    + "\n".join(_row(c, "en") for c in claims),
    "| 论断 | 出处（source） | 本次实测 |\n|---|---|---|\n"
    + "\n".join(_row(c, "zh") for c in claims))

# %% [markdown]
# ## Common misconceptions
#
# - *"TF32 is a low-precision format, worse than fp16."* Same 10-bit mantissa; float32's
#   range. What makes TF32 matmuls differ from float32 is those 13 dropped bits, not a
#   difference from fp16 (chapter 13).
# - *"More exponent bits means more accuracy."* e5m2 has more range than e4m3 and half
#   its precision; in this model's K/V its rounding error is about twice e4m3's.
# - *"A good scale makes fp8 as accurate as the scale is fine."* The relative precision
#   of a float is fixed by M. A scale decides only what falls off the ends.
# - *"Subnormals are about numbers like 1e-40."* In e4m3 the subnormal range starts at
#   0.0156: four in ten values of this model's first V are there, stored with 1-3
#   significant bits. (Flushing them did not move this model's KL measurably: small
#   values weigh little in attention's sums. That is a fact about this model, not fp8.)
# - *"Rounding is chopping off bits."* Truncation doubles the worst-case error and
#   biases every value toward zero; the errors no longer cancel in attention's averages,
#   and the fp8 cache's KL doubles (§6).
# - *"8 bits are 8 bits: int8 and fp8 are equally precise."* They spend the bits
#   differently. With one absmax scale per tensor, int8 is *more* precise than e4m3 on
#   the K and V rows over all layers (the table in §4), whose values span a few decades
#   around their maximum, though not on layer 0's V alone (2.94e-02 against 2.79e-02);
#   on the residual stream, whose values span many decades below a few huge ones, one
#   int8 scale per layer rounds most values to 0, and e4m3 saturates the huge ones.
#
# ## Lab
#
# `labs/source/ch03/` starts from an engine whose fp8 e4m3 KV quantizer truncates. You
# write the format from its bits: decode any bit pattern of any (E, M, bias) format,
# round float32 values to it with round-to-nearest-even, subnormals and saturation, and
# plug your rounding into the engine; the grader checks it bit for bit against
# `minivllm/numerics.py` on formats you have not seen, and checks that the engine's
# logits come back bit-identical to its built-in fp8 cache.
#
# ## On real vLLM
#
# - `--kv-cache-dtype` picks the format: `fp8` (= `fp8_e4m3`, more precision; CUDA and
#   ROCm) or `fp8_e5m2` (more range; CUDA). Scales come from the checkpoint or
#   `--calculate-kv-scales`, else 1.0: the scale-1 cache of section 6.
# - vLLM's FP8 KV-cache page (v0.6 to v0.11) gives E4M3's range as ±240: that is the
#   maximum of `e4m3fnuz` (`torch.finfo`); OCP `e4m3fn`, measured here, reaches 448.
# - With the FlashAttention 3 backend and an fp8 cache, vLLM quantizes the queries to
#   fp8 as well (a note in its docs), so Q lands on this grid too.
# - Recent versions keep chosen layers in 16 bits (`--kv-cache-dtype-skip-layers`, layer
#   indices or `sliding_window`) and add dtypes with dynamic per-token-head scales
#   (e.g. `fp8_per_token_head`).
# - Checked against vLLM's docs and source of 2025-2026 (v0.6 docs to the main branch).
#   This engine rounds with explicit saturation at ±max and offers per-head and
#   per-channel (K) static scales and dynamic per-token scales; vLLM's KV-cache page
#   lists per-tensor scales and per-head ones from llm-compressor (FlashAttention only).

# %%
print(f"chapter 3 ran in {time.perf_counter() - T0:.0f} s")
