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
# # Chapter 19. KV-cache outliers: per-head and per-channel scales, INT8 KV
#
# **Learning goals.** After this chapter you can
#
# 1. say what a scale's *granularity* buys (one scale per layer, per KV head, per
#    (head, channel) for K, or per token and head computed on the fly) and what it
#    costs (bytes per token, calibration);
# 2. explain why an outlier channel in K hurts an **int8** cache and barely touches an
#    **fp8** one with a calibrated scale: int8's grid is evenly spaced, so the scale *is*
#    the step and one large channel coarsens every value that shares its scale; fp8's
#    grid is relative, so a larger scale only slides the window;
# 3. predict which granularity survives a K outlier channel: per tensor crushes the whole
#    layer, per head rescues the other heads, per token (dynamic) still loses inside the
#    head, because the outlier is in every token; per channel (KIVI) isolates it;
# 4. plant outlier channels in a model *without changing what it computes* (an exact
#    reparametrization on the step registry) and measure all of this as KL against a
#    float32 KV cache, with confidence intervals.
#
# **The incidents, from public sources.**
#
# - **verl PR #4435, comment of 2026-03-29**
#   (https://github.com/volcengine/verl/pull/4435): Qwen2.5-Math-7B with an fp8 KV cache
#   scored about 0 accuracy and answered "????", while Qwen3 was fine; the commenter
#   credited Qwen3's QK-norm for keeping K outliers small.
# - **vllm #38652** (https://github.com/vllm-project/vllm/issues/38652, 2026-03-31): fp8
#   KV on GLM-4.7-Flash took a multi-turn judge score from 4.61 to 1.07, while
#   Qwen3-235B-AWQ stayed at 4.74 → 4.71: the same cache, model-dependent damage.
# - **sglang #22671** (https://github.com/sgl-project/sglang/issues/22671, 2026-04-13):
#   GLM-5.1-FP8 with `fp8_e4m3` KV, aime26 76.7 against an official 95.3; normal with
#   bf16 KV. The same week sgl-cookbook PR #237
#   (https://github.com/sgl-project/sgl-cookbook/pull/237) removed `--kv-cache-dtype
#   fp8_e4m3` from recipes whose checkpoints ship no calibrated scales.
# - **KIVI** (Liu et al. 2024, https://arxiv.org/abs/2402.02750): K's outliers sit in a
#   few fixed channels, the same for every token, so K should be quantized per channel
#   and V per token.
#
# **What this model does on its own, said up front.** SmolLM2 has no outlier channels:
# its largest |K| or |V| is about 21 (19 on this notebook's calibration text), no K
# channel's maximum is more than about 6 times its layer's median channel (section 1),
# and per-head scales are **no better** than per-tensor ones (section 2). So we **plant**
# outlier channels with an exact reparametrization, `faults.k_outlier_reparam`
# (`minivllm/precision/faults.py`, on the `"linear"` step of one layer's `qkv_proj`):
# multiply one rotary pair of K dimensions `{j, j + 32}` of one KV head by `c`, and the
# same dimensions of that head's three query heads by `1 / c`. Rotary rotates each pair
# by an angle that depends only on the position, and a uniform scaling commutes with a
# rotation, so every score `q · k` is unchanged; with `c = 64` (a power of two) the
# float32 model's logits are bit-identical (checked in section 3). Only a cache that
# quantizes K sees the difference. Every result with outliers sits next to the
# unmodified model's.
#
# Everything below is measured when the notebook runs, on the embedded
# SmolLM2-135M-Instruct with minivllm on this machine's CPU, model in float32.

# %%
# %matplotlib inline
import time

import numpy as np
import torch
from matplotlib.figure import Figure

from minivllm import LLM
from minivllm.i18n import Bi, claims_table, say
from minivllm.precision import evalsets, faults, metrics
from minivllm.quantization.calibration import calibration_forward
from minivllm.quantization.kv_cache import dequantize_kv, kv_scales_from_amax, quantize_kv

torch.manual_seed(0)
T0 = time.perf_counter()
MODEL = "smollm2-135m-instruct"
COMMON = dict(dtype="float32", max_model_len=256, num_gpu_blocks_override=24)
ref = LLM(MODEL, kv_cache_dtype="float32", **COMMON)                 # the baseline
e4m3 = LLM(MODEL, kv_cache_dtype="fp8_e4m3", **COMMON)               # scale 1.0; set below
int8 = LLM(MODEL, kv_cache_dtype="int8", kv_scale=(1.0, 1.0), **COMMON)  # scales set below
dyn = LLM(MODEL, kv_cache_dtype="int8", kv_scale_type="dynamic", **COMMON)  # per token, head
tok = ref.get_tokenizer()
corpus = tok.encode(evalsets.load_corpus(), add_special_tokens=False)
calib_ids = corpus[:256]                      # calibration text
windows = [corpus[2048 + 96 * i: 2048 + 96 * (i + 1)] for i in range(2)]  # evaluation: disjoint
model = ref.llm_engine.model_runner.model
attn = model.layers[0].self_attn
H, D, GROUP = attn.num_kv_heads, attn.head_dim, attn.num_heads // attn.num_kv_heads
print(f"{len(model.layers)} layers, {attn.num_heads} query heads sharing {H} KV heads "
      f"({GROUP} each), head_dim {D}; calibration on tokens 0-255, KL on "
      f"{len(windows)} windows of 96 tokens from token 2048 on")


def cat(*parts):
    """One Bi from Bi pieces and plain strings (text the same in both languages)."""
    return Bi("".join(x if isinstance(x, str) else x.en for x in parts),
              "".join(x if isinstance(x, str) else x.zh for x in parts))

# %% [markdown]
# ## 1. What this model stores in K, channel by channel
#
# One float32 pass over the calibration text, keeping every layer's stored K (after
# rotary) and V: the pass `calculate_kv_scales=True` makes
# (`quantization/calibration.py:calibration_forward`), with the values kept. A channel
# is one of the `H × D = 192` (KV head, dimension) columns of a layer's K; its *amax* is
# its largest |K| over the tokens.

# %%
def capture(ids):
    """Stored K and V of every layer for one prefill of ``ids``: two float32 tensors
    [layers, tokens, kv_heads, head_dim] (through the engine's model, faults included)."""
    got = []
    calibration_forward(model, [ids], after_sequence=lambda: got.append(
        [(layer.self_attn.kv_cache.key.clone(), layer.self_attn.kv_cache.value.clone())
         for layer in model.layers]))
    return torch.stack([k for k, _ in got[0]]), torch.stack([v for _, v in got[0]])


K0, V0 = capture(calib_ids)
ka0, va0 = K0.abs().amax(1), V0.abs().amax(1)     # [layers, H, D] channel maxima
ratio = ka0.flatten(1).amax(1) / ka0.flatten(1).median(1).values
print(f"largest |K| {float(ka0.max()):.1f}, largest |V| {float(va0.max()):.1f} "
      f"(e4m3's largest value: 448)")
print(f"per layer, largest K channel / median K channel: {float(ratio.min()):.1f} .. "
      f"{float(ratio.max()):.1f} (layer {int(ratio.argmax())})")
head_amax = ka0.amax(-1)                           # [layers, H]
print(f"per layer, largest / smallest KV head's K amax: "
      f"{float((head_amax.amax(1) / head_amax.amin(1)).min()):.2f} .. "
      f"{float((head_amax.amax(1) / head_amax.amin(1)).max()):.2f}")

# %% [markdown]
# No channel stands out by more than a small factor, and the three KV heads of a layer
# have similar ranges. That is what to expect from a per-head scale on this model:
# nothing to separate.
#
# ## 2. The unmodified model: granularities side by side
#
# Teacher-forced: the same tokens through the float32-KV engine and each quantized one,
# KL of the next-token distributions at every position (nats), with a 95 % CI by cluster
# bootstrap over 12 blocks of 16 positions. The static scales are `amax / qmax` from the
# calibration pass (`kv_cache.kv_scales_from_amax`, the formula `calculate_kv_scales=True`
# uses), set on each cache directly so that one engine serves every granularity:
#
# | granularity | K scale | V scale | engine setting |
# |---|---|---|---|
# | scale 1.0 (e4m3 only) | 1.0 | 1.0 | vLLM's default without a checkpoint scale |
# | per tensor | one per layer | one per layer | `kv_scale_granularity="tensor"` |
# | per head | one per KV head | one per KV head | `"head"` |
# | per channel (K; int8 here) | one per (KV head, dim) | one per layer | `"channel"`, beyond vLLM |
# | dynamic (int8) | per token and head, from the values written | same | `kv_scale_type="dynamic"` |
#
# Which rows a vLLM deployment can use: the fp8 rows (per-tensor scales from a checkpoint
# or `--calculate-kv-scales`, per-head scales in recent versions). The int8 rows are this
# engine's: vLLM's `--kv-cache-dtype` lists `int8` only in some versions (`CacheDType` in
# `vllm/config/cache.py`) and per-channel K scales in none, so a configuration this
# chapter restores with int8 is a measurement of the format, not a deployable vLLM setting.

# %%
want = ref.score(windows, output="logits")
GRANS = ("scale 1.0", "per tensor", "per head", "per channel (K)")
CONFIGS = ([("fp8_e4m3", g) for g in GRANS[:3]] + [("int8", g) for g in GRANS[1:]]
           + [("int8", "dynamic")])


def set_scales(llm, gran, ka, va):
    """Static scales of one granularity from channel maxima ka, va [layers, H, D]."""
    qm = 448.0 if llm is e4m3 else 127.0
    for kv, k, v in zip(llm.llm_engine.model_runner.kv_caches, ka, va):
        if gran == "scale 1.0":
            ks, vs = torch.tensor(1.0), torch.tensor(1.0)
        elif gran == "per tensor":
            ks, vs = kv_scales_from_amax(k.max(), qm), kv_scales_from_amax(v.max(), qm)
        elif gran == "per head":
            ks, vs = kv_scales_from_amax(k.amax(-1), qm), kv_scales_from_amax(v.amax(-1), qm)
        else:
            ks, vs = kv_scales_from_amax(k, qm), kv_scales_from_amax(v.max(), qm)
        kv.set_scales(ks, vs)
    llm.llm_engine.kv_cache_manager.reset_prefix_cache()  # no block written under old scales


def score(llm):
    """Mean KL against the float32 cache, 95% CI, and the logits."""
    got = llm.score(windows, output="logits")
    kl = torch.cat([metrics.kl_divergence(a, b) for a, b in zip(want, got)]).numpy()
    lo, hi = metrics.bootstrap_ci(np.split(kl, 12))
    return {"kl": float(kl.mean()), "lo": lo, "hi": hi, "logits": got}


def measure_all(ka, va):
    out = {}
    for fmt, gran in CONFIGS:
        if gran == "dynamic":
            out[fmt, gran] = score(dyn)
            continue
        llm = e4m3 if fmt == "fp8_e4m3" else int8
        set_scales(llm, gran, ka, va)
        out[fmt, gran] = score(llm)
    return out


def fmt_kl(r):
    return f"{r['kl']:.3g} [{r['lo']:.3g}, {r['hi']:.3g}]"


plain = measure_all(ka0, va0)
print("| KV cache | scales | mean KL (nats) [95% CI] |\n|---|---|---|")
for key, r in plain.items():
    print(f"| {key[0]} | {key[1]} | {fmt_kl(r)} |")


def overlap(a, b):
    return a["lo"] <= b["hi"] and b["lo"] <= a["hi"]


for fmt in ("fp8_e4m3", "int8"):
    a, b = plain[fmt, "per head"], plain[fmt, "per tensor"]
    say(f"{fmt}: per head / per tensor KL {a['kl'] / b['kl']:.2f}, CIs overlap: {overlap(a, b)}",
        f"{fmt}：逐头 / 逐张量 KL 之比 {a['kl'] / b['kl']:.2f}，置信区间重叠：{overlap(a, b)}")
say(f"int8 dynamic vs int8 per tensor: {plain['int8', 'per tensor']['kl'] / plain['int8', 'dynamic']['kl']:.1f}x lower KL",
    f"int8 动态对比 int8 逐张量：KL 低 {plain['int8', 'per tensor']['kl'] / plain['int8', 'dynamic']['kl']:.1f}x")

# %% [markdown]
# On the unmodified model, per-head scales buy nothing over per-tensor ones, in either
# format (ratios near 1, overlapping CIs): there are no heads to separate. The benchmark
# (`benchmarks/kv_cache_scales.py`, 10,202 positions, in `benchmarks/RESULTS.md`) says
# the same: e4m3 per head 7.52e-3 against per tensor 6.54e-3, int8 3.45e-3 against
# 3.34e-3. Calibrated int8 beats fp8 here (an evenly spaced 8-bit grid fitted to the
# range has finer steps near the top than e4m3's 3 mantissa bits), and dynamic int8,
# whose scale follows each token and head, is the best 8-bit cache of all.
#
# ## 3. Planting outlier channels, exactly
#
# We pick layer 3 (the course plan's lab idea used layer 3 too), its KV head with the
# largest K, and that head's largest channel `j`; the fault scales the rotary pair
# `{j, j + 32}` of K by `c = 64` and the same dimensions of the head's three query heads
# by `1 / 64`.

# %%
L = 3
h = int(ka0[L].amax(-1).argmax())
j = int(ka0[L, h].argmax()) % (D // 2)      # the pair {j, j + 32} holding the head's largest |K|
C = 64.0
ENGINES = (ref, e4m3, int8, dyn)


class planted:
    """The fault in all four engines at once (they share nothing, so each gets it)."""

    def __init__(self, c=C):
        self.c = c

    def __enter__(self):
        self.ctx = [faults.k_outlier_reparam(llm, L, h, j, self.c) for llm in ENGINES]
        self.dims = [cm.__enter__() for cm in self.ctx][0]
        return self.dims

    def __exit__(self, *exc):
        for cm in reversed(self.ctx):
            cm.__exit__(*exc)


with planted() as dims:
    same = torch.equal(ref.score(windows, output="logits")[0], want[0])
    K1, V1 = capture(calib_ids)
ka1, va1 = K1.abs().amax(1), V1.abs().amax(1)
pd = [d for _, _, d in dims]
print(f"planted: layer {L}, KV head {h}, dimensions {pd} (query heads {h * GROUP}-{h * GROUP + GROUP - 1} "
      f"scaled by 1/{C:g})")
say(f"float32 KV cache, logits with the fault bit-identical to without: {same}",
    f"float32 KV cache，有故障时的 logits 与没有故障时逐位相同：{same}")
expect = ka0.clone()
expect[L, h, pd] *= C
say(f"K amax of the planted channels: {ka0[L, h, pd].tolist()} -> {ka1[L, h, pd].tolist()}; "
    f"every channel equal to the unmodified one, the planted two times {C:g} exactly: "
    f"{torch.equal(ka1, expect)}",
    f"被植入通道的 K amax：{ka0[L, h, pd].tolist()} -> {ka1[L, h, pd].tolist()}；"
    f"每个通道都等于未修改时的值，被植入的两个通道恰好乘以 {C:g}："
    f"{torch.equal(ka1, expect)}")
say(f"V unchanged: {torch.equal(va1, va0)}", f"V 不变：{torch.equal(va1, va0)}")

# %%
fig = Figure(figsize=(9, 3.2), layout="constrained")
ax = fig.add_subplot()
x = np.arange(H * D)
ax.bar(x, ka1[L].flatten().numpy(), width=1.0, color="C3", label=f"with the planted pair (c = {C:g})")
ax.bar(x, ka0[L].flatten().numpy(), width=1.0, color="C0", label="unmodified")
ax.axhline(448, color="k", ls="--", lw=1)
ax.text(2, 448, " e4m3's largest value, 448", va="bottom", fontsize=8)
for hh in range(1, H):
    ax.axvline(hh * D - 0.5, color="grey", lw=0.8)
ax.set_yscale("log")
ax.set_xlim(-1, H * D)
ax.set_xlabel(f"layer {L}: K channel (KV head x {D} dimensions; grey lines separate the heads)")
ax.set_ylabel("max |K| over the calibration text")
ax.set_title("Two planted channels, 64x larger; the model computes the same function")
ax.legend(loc="upper right", fontsize=8)
fig

# %% [markdown]
# ## 4. What each granularity does to the other values, tensor by tensor
#
# Before the engine, the mechanism, on layer 3's calibrated K itself: quantize it the
# way each granularity would (the engine's `quantize_kv` / `dequantize_kv`, the scale
# from the same amax), read it back, and measure the relative error of three groups of
# values: the planted channels, the other 62 channels of the planted head, and the other
# heads. Also the share of the planted head's other values that int8 stores as 0.

# %%
def layer_scale(gran, ka_l, K_l, qm):
    """Layer L's K scale for one granularity, broadcastable to [T, H, D]."""
    if gran == "scale 1.0":
        return 1.0
    if gran == "per tensor":
        return kv_scales_from_amax(ka_l.max(), qm)
    if gran == "per head":
        return kv_scales_from_amax(ka_l.amax(-1), qm)[:, None]
    if gran == "per channel (K)":
        return kv_scales_from_amax(ka_l, qm)
    s = K_l.abs().amax(-1, keepdim=True) * (1.0 / qm)          # dynamic: [T, H, 1]
    return torch.where(s > 0, s, torch.ones_like(s))


other_dims = [d for d in range(D) if d not in pd]
groups = {"planted channels": (slice(None), h, pd), "rest of the head": (slice(None), h, other_dims),
          "other heads": (slice(None), [g for g in range(H) if g != h], slice(None))}


def k_errors(K_l, ka_l):
    rows = {}
    for fmt, gran in CONFIGS:
        dt = torch.float8_e4m3fn if fmt == "fp8_e4m3" else torch.int8
        s = layer_scale(gran, ka_l, K_l, 448.0 if fmt == "fp8_e4m3" else 127.0)
        q = quantize_kv(K_l, dt, s)
        back = dequantize_kv(q, torch.float32, s)
        err = {g: float((back - K_l)[ix].norm() / K_l[ix].norm()) for g, ix in groups.items()}
        err["zeros"] = float((q[groups["rest of the head"]].float() == 0).float().mean())
        rows[fmt, gran] = err
    return rows


err0, err1 = k_errors(K0[L], ka0[L]), k_errors(K1[L], ka1[L])
print(f"layer {L}, relative error ||K' - K|| / ||K|| per group; unmodified -> with the planted "
      f"pair\n")
print("| KV cache | scales | planted channels | rest of the head | other heads | "
      "rest of the head stored as 0 |\n|---|---|---|---|---|---|")
for key in err1:
    a, b = err0[key], err1[key]
    print(f"| {key[0]} | {key[1]} | " + " | ".join(
        f"{a[g]:.3f} -> {b[g]:.3f}" for g in groups) + f" | {a['zeros']:.0%} -> {b['zeros']:.0%} |")
sat = float((K1[L].abs() > 448).float().mean())
say(f"\ne4m3 at scale 1.0: {sat:.2%} of layer {L}'s K values exceed 448 and saturate "
    f"(largest {float(K1[L].abs().max()):.0f})",
    f"\ne4m3 在缩放因子 1.0 时：第 {L} 层 K 的数值中有 {sat:.2%} 超过 448 而饱和"
    f"（最大为 {float(K1[L].abs().max()):.0f}）")

# %% [markdown]
# Read the int8 rows first. **Per tensor**, one scale serves the whole layer, and the
# planted channels set it about 64 times larger: every other value of the layer is now
# stored with a step of several units, most of them as 0 (the relative error of the rest
# of the head and of the other heads jumps to the order of 1). **Per head** rescues the
# other heads (their error is back where it was) but not the rest of the planted head.
# **Dynamic** scales follow each token, but the outlier channel is in *every* token, so
# each token's scale is set by it and the rest of the head is crushed just as per head.
# **Per channel** gives each column its own scale: the planted channels' scale grows by
# exactly 64 and absorbs it, and nothing else moves (every error column is unchanged).
#
# e4m3 is different. A calibrated per-tensor scale also grows 64x, but a floating-point
# grid keeps the same relative precision wherever the scale puts it (chapter 18), so
# only the smallest values slide into the subnormals: the error of the rest of the
# layer barely moves. At scale 1.0 it is the planted channels themselves that suffer:
# they pass 448 and saturate.
#
# ## 5. The engine: KL with the outliers planted

# %%
with planted():
    outl = measure_all(ka1, va1)
with planted(512.0):
    set_scales(e4m3, "scale 1.0", ka1, va1)
    sat512 = score(e4m3)
print("| KV cache | scales | unmodified: KL [95% CI] | planted (c = 64): KL [95% CI] | ratio |\n"
      "|---|---|---|---|---|")
for key in CONFIGS:
    a, b = plain[key], outl[key]
    print(f"| {key[0]} | {key[1]} | {fmt_kl(a)} | {fmt_kl(b)} | {b['kl'] / a['kl']:.1f}x |")
print(f"| fp8_e4m3 | scale 1.0, c = 512 (amax {512 * float(ka0[L, h, pd].max()):.0f}) | | "
      f"{fmt_kl(sat512)} | {sat512['kl'] / plain['fp8_e4m3', 'scale 1.0']['kl']:.1f}x |")
pc_same = torch.equal(torch.cat(outl["int8", "per channel (K)"]["logits"]),
                      torch.cat(plain["int8", "per channel (K)"]["logits"]))
say(f"\nint8 per channel: logits with the outliers bit-identical to without: {pc_same}",
    f"\nint8 逐通道：有离群值时的 logits 与没有离群值时逐位相同：{pc_same}")

# %%
fig = Figure(figsize=(9, 4), layout="constrained")
ax = fig.add_subplot()
labels = [f"{f}, {g}" for f, g in CONFIGS]
y = np.arange(len(CONFIGS))
for off, res, color, name in ((-0.2, plain, "C0", "unmodified"),
                              (0.2, outl, "C3", f"planted outlier pair, c = {C:g}")):
    kl = np.array([res[k]["kl"] for k in CONFIGS])
    err = np.array([[res[k]["kl"] - res[k]["lo"] for k in CONFIGS],
                    [res[k]["hi"] - res[k]["kl"] for k in CONFIGS]])
    ax.barh(y + off, kl, height=0.38, xerr=err, color=color, label=name)
ax.set_yticks(y)
ax.set_yticklabels(labels, fontsize=8)
ax.invert_yaxis()
ax.set_xscale("log")
ax.set_xlabel("mean KL against a float32 KV cache (nats, log; bars: 95% CI)")
ax.set_title(f"One outlier pair in one head of one layer: int8 per tensor "
             f"{outl['int8', 'per tensor']['kl'] / plain['int8', 'per tensor']['kl']:.0f}x, "
             f"per channel unmoved")
ax.legend(fontsize=8, loc="lower right")
fig

# %% [markdown]
# The engine agrees with the tensors. With the planted pair, int8 per tensor loses by an
# order of magnitude or more; per head recovers most of it (two of three heads are clean
# again) but not all; dynamic int8, the best cache on the unmodified model, is now among
# the worst, because its per-token scales cannot separate channels. Per-channel K scales
# give bit-identical logits with and without the outliers: the reparametrization is a
# power of two per channel, and a per-channel scale absorbs it exactly. e4m3 with any
# calibrated scale is unmoved; at scale 1.0, saturation costs little at c = 64 (the
# planted channels pass 448 by 2x at most) and a multiple at c = 512.
#
# What we did not reproduce: a collapse to "????". One planted pair in one layer is a
# small outlier budget; Qwen2.5-Math's outliers are in many layers and heads. The
# mechanism is the same; its size depends on how much of the model shares one scale
# with an outlier.
#
# ## 6. Choosing a configuration
#
# Cost per token and layer: every 8-bit cache stores `2 · H · D = 384` bytes; dynamic
# scales add a float32 per token, head and tensor (`2 · H · 4 = 24` bytes); static
# scales cost nothing per token. The rule the lab asks for: among the configurations
# whose KL's upper CI bound is within a budget, take the fewest bytes per token, then
# the lowest mean KL. With a budget of 1.5x the unmodified int8 per-tensor KL (what this
# cache gave before the outliers):

# %%
def bytes_per_token(key):
    return 2 * H * D + (2 * H * 4 if key[1] == "dynamic" else 0)


budget = 1.5 * plain["int8", "per tensor"]["kl"]


def choose(res):
    ok = [k for k in CONFIGS if res[k]["hi"] <= budget]
    return min(ok, key=lambda k: (bytes_per_token(k), res[k]["kl"])) if ok else None


for name, res in ((Bi("unmodified", "未修改"), plain), (Bi("with the outliers", "植入离群值后"), outl)):
    fits = [f"{k[0]} {k[1]}" for k in CONFIGS if res[k]["hi"] <= budget]
    say(cat(name, Bi(f": budget {budget:.3g} nats; within it: {fits}; chosen: {choose(res)}",
                     f"：预算 {budget:.3g} nats；在预算之内：{fits}；选中：{choose(res)}")))
say(f"the best static int8 cache (per channel) against dynamic int8, unmodified: "
    f"{plain['int8', 'per channel (K)']['kl'] / plain['int8', 'dynamic']['kl']:.1f}x the KL",
    f"最好的静态 int8 cache（逐通道）对比动态 int8，未修改模型：KL 为其 "
    f"{plain['int8', 'per channel (K)']['kl'] / plain['int8', 'dynamic']['kl']:.1f}x")

# %% [markdown]
# ## 7. Claim vs measurement

# %%
p, o = plain, outl
E4, I8 = "fp8_e4m3", "int8"
# per head no better than per tensor: the two 95 % CIs overlap, in both formats (section 2)
head_no_better = all(overlap(p[f, "per head"], p[f, "per tensor"]) for f in (E4, I8))
best_plain = min(CONFIGS, key=lambda k: p[k]["kl"])
# "moved": the CI with the outliers lies entirely above the unmodified one
moved = {k: o[k]["lo"] > p[k]["hi"] for k in CONFIGS}
e4_calibrated_unmoved = all(overlap(o[E4, g], p[E4, g]) for g in ("per tensor", "per head"))
e4_raw_broken = moved[E4, "scale 1.0"] or sat512["lo"] > p[E4, "scale 1.0"]["hi"]
CRUSH = 2.0   # "crushed": the relative error of a group at least CRUSH times its unmodified one
crushed = {f: err1[f, "per tensor"]["rest of the head"] >= CRUSH * err0[f, "per tensor"]["rest of the head"]
           for f in (E4, I8)}
# "rescued": the other heads' error within 1.25x of unmodified, and the KL's CI below per tensor's
rescued = (err1[I8, "per head"]["other heads"] <= 1.25 * err0[I8, "per head"]["other heads"]
           and o[I8, "per head"]["hi"] < o[I8, "per tensor"]["lo"])
has_qk_norm = any(n.endswith(("q_norm", "k_norm")) for n, _ in model.named_modules())
YES, NO = Bi("yes", "是"), Bi("no", "否")
claims = [
    (Bi("benchmarks/RESULTS.md: on SmolLM2 per-head static scales are no better than per-tensor "
        "(e4m3 7.52e-3 vs 6.54e-3, int8 3.45e-3 vs 3.34e-3)",
        "benchmarks/RESULTS.md：在 SmolLM2 上，逐头静态缩放因子并不比逐张量的更好"
        "（e4m3 7.52e-3 对 6.54e-3，int8 3.45e-3 对 3.34e-3）"),
     cat(Bi("confirmed", "得到证实") if head_no_better else Bi("not confirmed", "未得到证实"),
         Bi(f" on {sum(map(len, windows))} positions (per head's and per tensor's 95 % CIs "
            f"{'overlap in both formats' if head_no_better else 'do not overlap in every format'}): "
            f"e4m3 {p[E4, 'per head']['kl']:.3g} vs {p[E4, 'per tensor']['kl']:.3g}, int8 "
            f"{p[I8, 'per head']['kl']:.3g} vs {p[I8, 'per tensor']['kl']:.3g} (CIs in section 2)",
            f"（{sum(map(len, windows))} 个位置；逐头与逐张量的 95 % 置信区间"
            f"{'在两种格式中都重叠' if head_no_better else '并非在每种格式中都重叠'}）："
            f"e4m3 {p[E4, 'per head']['kl']:.3g} 对 {p[E4, 'per tensor']['kl']:.3g}，int8 "
            f"{p[I8, 'per head']['kl']:.3g} 对 {p[I8, 'per tensor']['kl']:.3g}（置信区间见第 2 节）"))),
    (Bi("benchmarks/RESULTS.md: int8 dynamic per token is the best 8-bit cache (6.9e-4)",
        "benchmarks/RESULTS.md：int8 动态逐 token 是最好的 8 位 cache（6.9e-4）"),
     cat(YES if best_plain == (I8, "dynamic") else
         Bi(f"no ({best_plain[0]} {best_plain[1]} is)", f"否（最好的是 {best_plain[0]} {best_plain[1]}）"),
         Bi(f" on the unmodified model: {fmt_kl(p[I8, 'dynamic'])} here; with one outlier pair "
            f"{o[I8, 'dynamic']['kl']:.3g}, {o[I8, 'dynamic']['kl'] / p[I8, 'dynamic']['kl']:.0f}x ",
            f"（未修改模型）：此处为 {fmt_kl(p[I8, 'dynamic'])}；植入一对离群值后为 "
            f"{o[I8, 'dynamic']['kl']:.3g}，{o[I8, 'dynamic']['kl'] / p[I8, 'dynamic']['kl']:.0f}x"),
         Bi("worse: per-token scales do not separate channels",
            "（变差：逐 token 缩放因子无法分开通道）") if moved[I8, "dynamic"]
         else Bi("its unmodified KL, CIs overlapping", "（相对其未修改时的 KL），置信区间重叠"))),
    (Bi("verl PR #4435: K outliers break an fp8 KV cache",
        "verl PR #4435：K 的离群值会破坏 fp8 KV cache"),
     cat(Bi("for e4m3 only without a calibrated scale", "仅对不带校准缩放因子的 e4m3 成立")
         if e4_raw_broken and e4_calibrated_unmoved else
         Bi(f"e4m3 without a calibrated scale: {'broken' if e4_raw_broken else 'not broken'}, "
            f"calibrated: {'unmoved' if e4_calibrated_unmoved else 'moved'}",
            f"不带校准缩放因子的 e4m3：{'被破坏' if e4_raw_broken else '未被破坏'}，"
            f"校准后：{'不受影响' if e4_calibrated_unmoved else '受到影响'}"),
         Bi(f": scale 1.0 {o[E4, 'scale 1.0']['kl']:.3g} at c = 64, {sat512['kl']:.3g} at c = 512 (vs "
            f"{p[E4, 'scale 1.0']['kl']:.3g}); calibrated per tensor "
            f"{o[E4, 'per tensor']['kl']:.3g} vs {p[E4, 'per tensor']['kl']:.3g}: ",
            f"：缩放因子 1.0 在 c = 64 时为 {o[E4, 'scale 1.0']['kl']:.3g}，在 c = 512 时为 "
            f"{sat512['kl']:.3g}（未修改时为 {p[E4, 'scale 1.0']['kl']:.3g}）；校准的逐张量为 "
            f"{o[E4, 'per tensor']['kl']:.3g} 对 {p[E4, 'per tensor']['kl']:.3g}："),
         Bi("unmoved (CIs overlap)", "不受影响（置信区间重叠）")
         if overlap(o[E4, "per tensor"], p[E4, "per tensor"])
         else Bi("moved (CIs apart)", "受到影响（置信区间分离）"),
         Bi(". ", "。"),
         Bi("int8 per tensor is the cache they break", "被破坏的是 int8 逐张量 cache")
         if moved[I8, "per tensor"] else Bi("int8 per tensor is not broken either", "int8 逐张量也未被破坏"),
         Bi(f": {o[I8, 'per tensor']['kl']:.3g} vs {p[I8, 'per tensor']['kl']:.3g}",
            f"：{o[I8, 'per tensor']['kl']:.3g} 对 {p[I8, 'per tensor']['kl']:.3g}"))),
    (Bi("a per-tensor scale crushes the other channels", "逐张量缩放因子会压垮其他通道"),
     Bi(f"int8: {'yes' if crushed[I8] else 'no'} (threshold: {CRUSH:g}x the unmodified error), the rest "
        f"of the head goes from {err0[I8, 'per tensor']['rest of the head']:.3f} "
        f"to {err1[I8, 'per tensor']['rest of the head']:.3f} relative error "
        f"({err1[I8, 'per tensor']['zeros']:.0%} stored as 0); e4m3: {'yes' if crushed[E4] else 'no'}, "
        f"{err0[E4, 'per tensor']['rest of the head']:.3f} -> "
        f"{err1[E4, 'per tensor']['rest of the head']:.3f}",
        f"int8：{'是' if crushed[I8] else '否'}（阈值：未修改误差的 {CRUSH:g}x），该头其余部分的"
        f"相对误差从 {err0[I8, 'per tensor']['rest of the head']:.3f} "
        f"变为 {err1[I8, 'per tensor']['rest of the head']:.3f}"
        f"（{err1[I8, 'per tensor']['zeros']:.0%} 被存成 0）；e4m3：{'是' if crushed[E4] else '否'}，"
        f"{err0[E4, 'per tensor']['rest of the head']:.3f} -> "
        f"{err1[E4, 'per tensor']['rest of the head']:.3f}")),
    (Bi("per-head scales rescue the other heads", "逐头缩放因子能救回其他头"),
     cat(YES if rescued else NO,
         Bi(" (other heads' error within 1.25x of unmodified, KL's CI below per tensor's): int8 "
            f"other heads {err1[I8, 'per head']['other heads']:.3f} (unmodified "
            f"{err0[I8, 'per head']['other heads']:.3f}); KL {o[I8, 'per head']['kl']:.3g} vs "
            f"per tensor {o[I8, 'per tensor']['kl']:.3g}, still "
            f"{o[I8, 'per head']['kl'] / p[I8, 'per head']['kl']:.1f}x its unmodified KL",
            "（判据：其他头的误差在未修改时的 1.25x 以内，且 KL 的置信区间低于逐张量的）：int8 "
            f"其他头 {err1[I8, 'per head']['other heads']:.3f}（未修改 "
            f"{err0[I8, 'per head']['other heads']:.3f}）；KL {o[I8, 'per head']['kl']:.3g} 对"
            f"逐张量 {o[I8, 'per tensor']['kl']:.3g}，仍为其未修改 KL 的 "
            f"{o[I8, 'per head']['kl'] / p[I8, 'per head']['kl']:.1f}x"))),
    (Bi("per-channel K scales (KIVI) fix it", "逐通道 K 缩放因子（KIVI）能解决它"),
     cat(Bi("exactly", "精确解决") if pc_same else Bi("not exactly", "并非精确解决"),
         Bi(f": int8 per channel {o[I8, 'per channel (K)']['kl']:.3g} with the outliers, "
            f"bit-identical logits to without: {pc_same}",
            f"：有离群值时 int8 逐通道为 {o[I8, 'per channel (K)']['kl']:.3g}，"
            f"logits 与没有离群值时逐位相同：{pc_same}"))),
    (Bi("verl PR #4435: QK-norm keeps K outliers small", "verl PR #4435：QK-norm 让 K 的离群值保持较小"),
     cat(Bi("not testable here", "此处无法检验") if not has_qk_norm
         else Bi("testable here, not tested", "此处可检验，但未检验"),
         Bi(f": SmolLM2 {'has no' if not has_qk_norm else 'has a'} QK-norm module, and ",
            f"：SmolLM2 {'没有' if not has_qk_norm else '有'} QK-norm 模块，"),
         Bi("no outlier channel either", "也没有离群通道") if float(ratio.max()) < 10
         else Bi("an outlier channel", "并有一个离群通道"),
         Bi(f" (largest channel / median {float(ratio.max()):.1f} at most, counted as an outlier from "
            f"10; largest |K| {float(ka0.max()):.1f})",
            f"（最大通道 / 中位数最多为 {float(ratio.max()):.1f}，从 10 起算作离群值；"
            f"最大 |K| 为 {float(ka0.max()):.1f}）"))),
    (Bi("course plan (lab idea): multiply 2 channels of K in layer 3 by 50",
        "课程计划（实验构想）：把第 3 层 K 的 2 个通道乘以 50"),
     cat(Bi("done exactly", "已精确实现") if same and torch.equal(ka1, expect) else Bi("not exact", "并不精确"),
         Bi(f", with c = {C:g} and the query compensated by 1/{C:g} so the model is unchanged "
            f"(float32 logits bit-identical: {same}); multiplying K alone would be a different model, "
            "not an outlier",
            f"，取 c = {C:g}，并以 1/{C:g} 补偿 query，使模型不变"
            f"（float32 logits 逐位相同：{same}）；只乘 K 会成为另一个模型，而不是离群值"))),
]
claims_table(claims, header=(Bi("claim", "论断"), Bi("measured", "实测")))

# %% [markdown]
# ## Common misconceptions
#
# - *"Per-head scales are always better than per-tensor ones."* Only when the heads'
#   ranges differ. On this model they do not, and per head measures the same as per
#   tensor (section 2).
# - *"Dynamic per-token scales handle outliers: they adapt."* They adapt along the token
#   axis. K's outliers live on the channel axis, in every token, so each token's scale
#   is the outlier's and the rest of the head is crushed (section 4).
# - *"A large scale crushes the small values of an fp8 cache."* Not while they stay in
#   the normal range: fp8 keeps ~6 % relative precision at every magnitude. The crush
#   is an int8 (evenly spaced grid) effect; fp8 fails at its ends, by saturation at
#   scale 1.0 or subnormals at very large scales.
# - *"Outlier channels mean the model is broken."* The planted model computes exactly
#   the same function; outliers are a property of how the function is parametrized, and
#   only a quantizer that shares one scale across them sees them.
# - *"A finer granularity is never worse."* A static per-channel scale is fitted to
#   each channel's largest calibrated value; with too little calibration text some
#   channels' maxima are underestimated and unseen values clip (see the note under Lab).
# - *"Per-channel scales must be expensive."* For K they are static: `H × D` floats per
#   layer, nothing per token. (V's outliers, where a model has them, are per token,
#   which is why KIVI quantizes V per token.)
#
# ## Lab
#
# `labs/source/ch19/` starts from the broken configuration of section 5: an int8 KV
# cache with per-tensor scales on a model with planted outlier channels. You write
# `find_outlier_channels` (find the planted channels from captured K, exactly),
# `per_channel_k_scales` and the int8 quantize step, and `choose_kv_config`, and you
# decide the K scale granularity: the cheapest of per tensor, per head, per channel and
# per token whose KL stays within the limit below. The grader plants a fresh outlier
# (random layer, head, dimension), calibrates your scales at your granularity on text
# you have not seen, plugs your quantizer into the engine
# (`llm.swap_step("kv.quantize", ...)`) and checks that the KL is back within 1.5x of
# what int8 per tensor gave before the outliers, that no cheaper granularity would have
# passed (it measures each), and that per-tensor int8 fails the same check.
#
# The grader calibrates on 512 tokens. Per-channel scales fit 192 maxima per layer
# instead of 1 or 3, so they need more calibration text: with 160 tokens they clipped
# values the calibration had not seen and were no better than per tensor on fresh text
# (0.94-1.28x per tensor's KL over five random draws), with 512 tokens 0.57-0.80x
# (`python benchmarks/kv_channel_calibration.py`, recorded in its docstring; not run
# here).
#
# (The course plan asked for 1.5x the unmodified *dynamic* int8 KL. No static scale
# reaches it on this model: the best static int8 cache, per channel, sits at several times
# the unmodified dynamic cache's KL (the ratio is printed under section 6's choice),
# because a static scale is set by the largest value seen in calibration while a
# per-token scale fits each token. The lab's anchor is therefore the cache's own
# unmodified per-tensor KL.)
#
# ## On real vLLM
#
# - vLLM's fp8 KV cache takes one scale per tensor, or one per KV head from an
#   llm-compressor calibration (FlashAttention backend only; quantized KV-cache docs).
#   There is no per-channel K scale: against an outlier channel like section 3's, per
#   head is the finest static choice there.
# - Recent main-branch builds add `--kv-cache-dtype int8_per_token_head` (and
#   `fp8_per_token_head`, `int4_per_token_head`): scales per token and KV head, this
#   chapter's dynamic int8 cache. v0.16's list has none of them; check `vllm serve
#   --help` on the version you run.
# - `--kv-cache-dtype-skip-layers` (layer indices, or `sliding_window`) keeps chosen
#   layers in 16 bits: the remedy when the outliers sit in a few layers, as the planted
#   one does. Find them first: per-channel max |K| per layer on your traffic, section 1.
# - Checked against `vllm/config/cache.py` (v0.16 docs and the 2026 main branch) and the
#   quantized KV-cache docs. This engine offers per-tensor, per-head and per-channel (K)
#   static scales and dynamic per-token scales for both fp8 and int8, emulated on CPU.

# %%
print(f"chapter 19 ran in {time.perf_counter() - T0:.0f} s")
