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
# # Chapter 15. INT4 group quantization: round-to-nearest vs AWQ
#
# **Learning goals.** After this chapter you can
#
# 1. say what a 4-bit group-quantized weight stores (codes 0..15, one scale and one zero
#    point per group of `g` input columns, `w ≈ (q - z) · s`), what symmetric and
#    asymmetric grids are, and what the group size costs in bits per weight;
# 2. explain why the weights of this course's model, which came from GGUF **Q4_1**, make
#    some 4-bit grids look lossless, and pick a grid that shows the real trade-off;
# 3. run AWQ's search by hand on one layer: the activation-aware per-input-channel scale
#    `s = mean|x|^α`, the loss curve over α, and what the clip search adds;
# 4. measure RTN against AWQ end to end (KL, answer KL, QA accuracy side by side, with
#    confidence intervals) from a quantized checkpoint built once and cached
#    (`minivllm.quantization.checkpoint.cached_quantized`);
# 5. read greedy QA accuracy with care: on this model a calibrated 4-bit scheme can cut
#    KL by half and still lose QA answers (section 7 shows which answer tokens flip);
# 6. tell the gradual cost of 4 bits from a kernel failure: a GEMM with two paths chosen
#    by the number of rows, one accumulating in float16, fails on short prompts only
#    (section 5, vllm #10656).
#
# **The incident, from public sources.**
#
# - **The seed course** (000 §2.4.4) states that "modern methods such as AWQ keep over
#   95 % of the original performance at 4 bits". The AWQ paper (Lin et al. 2023,
#   arXiv:2306.00978) measures on 7B-70B models; this chapter measures the claim on a
#   135M one.
# - **vllm-project/vllm #10656** (2024-11): a GPTQ-Int4 Qwen2.5-32B answered "!!!!!" for
#   prompts of 50 tokens or fewer: the exllama-derived kernel switches paths at
#   `MAX_Q_GEMM_ROWS = 50`, and only the short-prompt path failed. A 4-bit deployment
#   has a kernel-level failure mode besides the gradual one measured here: section 5
#   emulates the two paths on one layer of this model, which does not fail as trained,
#   and shows the short-prompt-only failure with a planted (exact) cancelling split.
#
# **A fact about these weights that matters here.** The embedded SmolLM2-135M-Instruct
# ships as GGUF Q4_1 (asymmetric 4-bit, groups of 32, a float scale *and a float minimum*
# per group), dequantized to float32 once. Re-quantizing onto that exact grid would be
# lossless and hide everything this chapter is about. Section 2 measures which grids are
# affected; the end-to-end comparison uses groups of 128, four Q4_1 groups per group.
#
# Everything below is measured when the notebook runs, on the embedded model in float32
# with minivllm on this machine's CPU, except numbers marked as taken from
# `benchmarks/RESULTS.md` or `benchmarks/qa_inversion.py` (the command is given there).

# %%
# %matplotlib inline
import gc
import time

import numpy as np
import torch
from matplotlib.figure import Figure

from minivllm import LLM, SamplingParams
from minivllm.i18n import Bi, claims_table, say
from minivllm.layers.linear import linear_ref
from minivllm.precision import evalsets, metrics
from minivllm.quantization import weight_quant as wq
from minivllm.quantization.checkpoint import cached_quantized
from minivllm.quantization.quantize import target_layers



def txt(b, lang):
    """The ``lang`` ("en" or "zh") text of the Bi ``b``: a field that reads the same in both
    f-strings of a say/Bi pair but for the language's name."""
    return getattr(b, lang)


torch.manual_seed(0)
T0 = time.perf_counter()
MODEL = "smollm2-135m-instruct"
COMMON = dict(dtype="float32", max_model_len=512, kv_cache_memory_bytes=48 << 20)
base = LLM(MODEL, **COMMON)                        # float32 weights: the reference
tok = base.get_tokenizer()
model = base.llm_engine.model_runner.model
W = {name: lin.weight.detach() for name, lin in target_layers(model).items()}
print(f"{len(W)} decoder linear layers, {sum(w.numel() for w in W.values()) / 1e6:.1f} M weights")

# %% [markdown]
# ## 1. What int4 group quantization stores
#
# A weight `[out, in]` is cut along the input dimension into groups of `g` columns; each
# row's group gets its own scale `s` (and, asymmetric, an integer zero point `z`):
#
# - **symmetric**: `s = amax / 7`, `q = clamp(round(w / s), -8, 7) + 8`, `z = 8`;
# - **asymmetric**: `s = (max - min) / 15` over a range that contains 0,
#   `z = round(-min / s)`, `q = clamp(round(w / s) + z, 0, 15)`.
#
# `w ≈ (q - z) · s`. This is the GPTQ/AWQ checkpoint layout (vLLM's `gptq`, `awq` and
# their Marlin kernels read it). Storage per weight: 4 bits plus the group's scale and
# zero spread over `g` weights: here a float32 scale and a uint8 zero, `4 + 40 / g` bits
# (real checkpoints store fp16 scales and packed zeros: `4 + 20 / g`). A toy row of 8
# weights in groups of 4:

# %%
toy = torch.tensor([[0.31, -0.02, 0.05, 0.11, -0.9, -0.4, 0.02, -0.1]])
for sym in (True, False):
    q, s, z = wq.quantize_int4(toy, 4, sym)
    back = wq.dequantize_int4(q, s, z, 4)
    print(f"{'symmetric ' if sym else 'asymmetric'} codes {q.tolist()[0]} zeros {z.tolist()[0]}"
          f"\n           back  {[round(v, 3) for v in back.tolist()[0]]}")
for g in (32, 64, 128):
    print(f"g = {g:3}: {4 + 40 / g:.2f} bits per weight as stored here, "
          f"{4 + 20 / g:.2f} with fp16 scales and packed zeros")

# %% [markdown]
# The asymmetric grid spends its 16 levels on `[min, max]`; the symmetric one on
# `[-amax, amax]`, so a group whose weights are mostly of one sign wastes half its codes.
#
# ## 2. The Q4_1 provenance: which 4-bit grids look lossless here
#
# Q4_1 stores per group of 32 a float step `d` and a float minimum `m`: `w = d · q + m`,
# `q` in 0..15: at most 16 distinct values per group, which chapter 3 (section 4) counts
# in the decoder linears. Re-quantize a sample of layers onto four grids: Q4_1's own (float minimum, groups of 32), and the integer-zero-point
# layout above at g = 32, 64, 128.

# %%
def q41_requant(w):
    """Re-quantize onto Q4_1's grid: per group of 32, d = (max - min) / 15, float min m."""
    g = w.reshape(w.shape[0], -1, 32)
    lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
    d = torch.where(hi > lo, (hi - lo) / 15, torch.ones_like(hi))
    return (torch.round((g - lo) / d) * d + lo).reshape(w.shape)


sample = [n for i, n in enumerate(W) if i % 10 == 3]       # 12 layers of all four kinds
rel = {k: [] for k in ("Q4_1 grid (float min), g32", "int4 asym g32", "int4 asym g64",
                       "int4 asym g128", "int4 sym g128")}
for n in sample:
    w = W[n]
    rel["Q4_1 grid (float min), g32"].append(float((q41_requant(w) - w).norm() / w.norm()))
    for gs, sym in ((32, False), (64, False), (128, False), (128, True)):
        d = wq.dequantize_int4(*wq.quantize_int4(w, gs, sym), gs)
        rel[f"int4 {'sym' if sym else 'asym'} g{gs}"].append(float((d - w).norm() / w.norm()))
print(f"{len(sample)} sampled layers\n")
print("| grid | relative weight error (median over the sample) | max |\n|---|---|---|")
for k, v in rel.items():
    print(f"| {k} | {np.median(v):.2e} | {max(v):.2e} |")
med = {k: float(np.median(v)) for k, v in rel.items()}
print()
say(f"medians: g32's error is {med['int4 asym g32'] / med['int4 asym g128']:.0%} of g128's, "
    f"g64's {med['int4 asym g64'] / med['int4 asym g128']:.0%}; symmetric g128 errs "
    f"{med['int4 sym g128'] / med['int4 asym g128']:.2f}x asymmetric g128; largest error: "
    f"{max(med, key=med.get)}",
    f"中位数：g32 的误差是 g128 的 {med['int4 asym g32'] / med['int4 asym g128']:.0%}，"
    f"g64 的是 {med['int4 asym g64'] / med['int4 asym g128']:.0%}；对称 g128 的误差是"
    f"非对称 g128 的 {med['int4 sym g128'] / med['int4 asym g128']:.2f}x；误差最大的："
    f"{max(med, key=med.get)}")

# %% [markdown]
# On Q4_1's own grid the re-quantized weights come back as they were, to the error in the first row
# of the table: a "4-bit" model that is lossless, which would make any 4-bit method look
# perfect. The GPTQ/AWQ layout does not have that grid even at g = 32: an *integer* zero
# point cannot place the grid at Q4_1's float minimum, so g32 keeps most of g128's error
# (the share is printed under the table, with the symmetric grid's error against the
# asymmetric one; `benchmarks/RESULTS.md`, full model: int4-asym-g32 KL 0.263, not ~0).
# The rest of the chapter uses **g = 128 asymmetric**,
# AWQ's default and the most common int4 checkpoint setting, where each group spans four
# Q4_1 groups with different offsets: the provenance gives it no free ride.
#
# ## 3. AWQ on one layer, by hand
#
# AWQ (Lin et al. 2023) keeps RTN's grid but first multiplies input column `j` of `W` by
# `s_j` and divides `x_j` by `s_j`: exact in real arithmetic, and a column with a large
# `s_j` is quantized with relatively finer steps. Columns that meet large activations
# ("salient" channels) matter most for the output, so `s = mean|x|^α`, with α chosen
# from a grid of 20 by the layer's output error on calibration inputs; then a clip search
# shrinks each group's range where that lowers the output error. The engine's
# implementation is `weight_quant.awq_search_scale`, `awq_search_clip`, `awq_quantize`
# (after AutoAWQ's `_search_best_scale` and `_compute_best_clip`).
#
# Inputs of layer 11's down_proj, recorded through the step registry while the float
# engine scores two prose windows: the first window calibrates, the second is held out.

# %%
windows = evalsets.corpus_sequences(tok, seq_len=64, max_sequences=4)
LAYER = "layers.11.mlp.down_proj"
captured = []


def record(x, weight, bias):
    captured.append(x.detach().reshape(-1, x.shape[-1]).clone())
    return linear_ref(x, weight, bias)


with base.swap_step("linear", record, where=LAYER):
    for win in windows[:2]:                        # one window per call: one capture each
        base.score([win], output="logits")
x_cal, x_held = captured
w = W[LAYER]
s, info = wq.awq_search_scale([w], x_cal, 128, False, n_grid=20)
x_mean = x_cal.abs().mean(0)
top1pct = float(x_mean.topk(w.shape[1] // 100).values.sum() / x_mean.sum())
say(f"{LAYER}: {w.shape[1]} input channels; mean|x| ranges {x_mean.min():.3g}..{x_mean.max():.3g} "
    f"({float(x_mean.max() / x_mean.min()):,.0f}x), top 1% of channels carry {top1pct:.1%}"
    f" of the total; best alpha {info['best_ratio']:.2f}, calibration loss "
    f"{info['rtn_loss']:.3g} (RTN, alpha 0) -> {info['best_loss']:.3g}",
    f"{LAYER}：{w.shape[1]} 个输入通道；mean|x| 的范围为 {x_mean.min():.3g}..{x_mean.max():.3g}"
    f"（{float(x_mean.max() / x_mean.min()):,.0f}x），最大的前 1% 通道占总和的 {top1pct:.1%}"
    f"；最佳 alpha {info['best_ratio']:.2f}，校准损失 "
    f"{info['rtn_loss']:.3g}（RTN，alpha 0）-> {info['best_loss']:.3g}")


def out_err(xx, deq, scale=None):
    """Relative output error of the layer on inputs xx with weight deq (inputs / scale)."""
    y = linear_ref(xx, w, None)
    yq = linear_ref(xx if scale is None else xx / scale, deq, None)
    return float((yq - y).norm() / y.norm())


rtn = wq.dequantize_int4(*wq.quantize_int4(w, 128, False), 128)
awq_noclip = wq.dequantize_int4(*wq.quantize_int4(w * s, 128, False), 128)
awq_full = wq.dequantize_int4(*wq.awq_quantize(w, s, x_cal, 128, False, clip=True), 128)
print("| weights | output error, calibration window | held-out window |\n|---|---|---|")
ERR = {}
for label, deq, sc in (("RTN asym g128", rtn, None), ("AWQ scale only", awq_noclip, s),
                       ("AWQ scale + clip", awq_full, s)):
    ERR[label] = (out_err(x_cal, deq, sc), out_err(x_held, deq, sc))
    print(f"| {label} | {ERR[label][0]:.4f} | {ERR[label][1]:.4f} |")
cut = [ERR["RTN asym g128"][i] / ERR["AWQ scale only"][i] for i in (0, 1)]
clip_change = ERR["AWQ scale + clip"][1] / ERR["AWQ scale only"][1] - 1
say(f"the scale alone divides the output error by {cut[0]:.1f} on the calibration window and "
    f"by {cut[1]:.1f} on the held-out one; the clip search then changes the held-out error "
    f"by {clip_change:+.1%} ({'worse' if clip_change > 0 else 'better'})",
    f"单靠缩放因子，就使输出误差在校准窗口上除以 {cut[0]:.1f}、"
    f"在留出窗口上除以 {cut[1]:.1f}；截断搜索随后使留出窗口上的误差变化 "
    f"{clip_change:+.1%}（{'更差' if clip_change > 0 else '更好'}）")

# %%
def awq_loss(alpha):
    """AWQ's search loss at one alpha, from the formula in awq_search_scale's docstring."""
    sa = x_mean.pow(alpha).clamp(min=1e-4)
    sa = sa / torch.sqrt(sa.max() * sa.min())
    deq = wq.dequantize_int4(*wq.quantize_int4(w * sa, 128, False), 128)
    return float(((x_cal / sa) @ deq.T - x_cal @ w.T).pow(2).mean())


# The engine's grid is k / 20 for k = 0..19; alpha = 1 (s = mean|x| itself) is added by hand.
assert np.isclose(awq_loss(info["best_ratio"]), info["best_loss"], rtol=1e-5)
alphas = np.arange(len(info["losses"]) + 1) / len(info["losses"])
losses = np.array(info["losses"] + [awq_loss(1.0)])
best = int(losses.argmin())
flat = alphas[losses <= 1.1 * losses[best]]
interior = 0 < best < len(alphas) - 1
where_min = (Bi("interior", "位于区间内部") if interior else
             Bi(f"at the end alpha = {alphas[best]:.0f}", f"位于端点 alpha = {alphas[best]:.0f}"))
say(f"loss: alpha 0 (RTN) {losses[0]:.3g}, minimum {losses[best]:.3g} at alpha {alphas[best]:.2f}"
    f", alpha 1 {losses[-1]:.3g} ({losses[-1] / losses[best]:.2f}x the minimum); within 10 % of "
    f"the minimum for alpha {flat.min():.2f}..{flat.max():.2f}; the minimum is {txt(where_min, 'en')}",
    f"损失：alpha 0（RTN）{losses[0]:.3g}，最小值 {losses[best]:.3g} 在 alpha {alphas[best]:.2f}"
    f"，alpha 1 {losses[-1]:.3g}（最小值的 {losses[-1] / losses[best]:.2f}x）；alpha 在 "
    f"{flat.min():.2f}..{flat.max():.2f} 时损失在最小值的 10 % 以内；最小值{txt(where_min, 'zh')}")

fig = Figure(figsize=(10, 3.5), layout="constrained")
ax1, ax2 = fig.subplots(1, 2)
ax1.semilogy(alphas, losses, marker="o")
ax1.axvline(alphas[best], color="k", ls=":")
ax1.set_xlabel("alpha (s = mean|x|^alpha; 0 is plain RTN, 1 is s = mean|x|)")
ax1.set_ylabel("output MSE on calibration rows")
ax1.set_title(f"AWQ's scale search, {LAYER}")
order = x_mean.argsort(descending=True)
ax2.semilogy(x_mean[order].numpy(), label="mean |x| per input channel")
ax2.semilogy(s[order].numpy(), label="chosen scale s")
ax2.set_xlabel("input channel, by mean |x|")
ax2.legend(fontsize=8)
ax2.set_title("salient channels get the largest scales")
fig

# %% [markdown]
# Read the curve (log axis) with the line above it. α = 0 is RTN; as α grows the salient
# columns get finer steps and the others coarser ones (s is normalised, so what one column
# gains the others pay), and at α = 1 the scale is mean|x| itself. The line says where the
# minimum lies on this layer, how flat the curve is around it (the α range within 10 % of
# the minimum) and what α = 1 costs against it: where the minimum is interior, protecting
# the salient columns can be overdone, by the ratio printed for α = 1 (small where the
# curve is nearly flat near its end). This layer's inputs span the range printed above the
# table across channels, and the line under the table says how many times the scale alone
# cuts the output error on the calibration window and on the held-out one: where the two
# cuts are alike, the salient channels are a property of the layer, not of one text. The
# clip search, fitted to 64 calibration rows, is a second-order change on the held-out
# window (the same line prints its sign and size), which is why the cached checkpoint
# below leaves it out.
#
# ## 4. The whole model: RTN against AWQ, from a cached checkpoint
#
# Full-model AWQ calibrates layer by layer on the bundled chat conversations and searches
# 120 layers: the engine's default (scale and clip search, 4,096 tokens) took 68 s on
# the 2-core machine of `benchmarks/RESULTS.md`, longer than this chapter's whole
# budget. This chapter uses the scale search alone (`clip=False`, the part section 3
# showed first) on 1,024 calibration tokens (`make quantized` builds it; the cache
# record `minivllm-cache.json` beside it keeps its `build_seconds`); the engine's
# default is measured in `benchmarks/RESULTS.md` and quoted in section 7.
# Either way the checkpoint is built **once** with
# `LLM.save_quantized` and cached beside the converted model: `cached_quantized` keys it
# by a sha256 of the source weights, the quantization config, the calibration token ids
# and the quantizer's code, rebuilds it when any of them changes, and checks every file's
# hash before handing out the path (a tampered file is refused with a message). `LLM(path)`
# then loads the stored int4 tensors, with no search. The time the next cell prints
# shows whether it built the checkpoint (a search over 120 layers: tens of seconds) or
# found it (a fraction of a second).
#
# RTN needs no calibration and quantizes on load. Three measures, each against the
# float32 engine (as chapter 14): **KL** on prose windows (CI by resampling windows),
# **answer KL** at the answer positions of each QA prompt followed by float32's own greedy
# answer (CI by resampling questions), and greedy **QA accuracy** (24 tokens, as the
# benchmark; CI by resampling questions).

# %%
t = time.perf_counter()
AWQ_CFG = {"group_size": 128, "symmetric": False, "clip": False, "calibration_tokens": 1024}
AWQ_PATH = cached_quantized(MODEL, "awq", AWQ_CFG)
print(f"AWQ checkpoint ready in {time.perf_counter() - t:.1f} s (hash-checked): {AWQ_PATH.name}")

qa = evalsets.load_qa()[::6]                       # every 6th question: all categories
qa_prompts = [evalsets.chat_prompt_ids(tok, evalsets.qa_prompt(it.question)) for it in qa]
greedy = SamplingParams(temperature=0.0, max_tokens=24)
base_out = base.generate(qa_prompts, greedy, use_tqdm=False)
base_answers = [o.outputs[0].token_ids for o in base_out]
qa_seqs = [p + a for p, a in zip(qa_prompts, base_answers)]
answer_rows = [list(range(len(p) - 1, len(p) - 1 + len(a))) for p, a in zip(qa_prompts, base_answers)]
REF = {"windows": base.score(windows, output="logits"),
       "answers": base.score(qa_seqs, output="logits", positions=answer_rows)}
base_ok = [float(evalsets.answer_matches(o.outputs[0].text, it.answers)) for o, it in zip(base_out, qa)]
RESULTS = {"float32": {"kl": 0.0, "kl_ci": (0.0, 0.0), "top1": 1.0, "answer_kl": 0.0,
                       "answer_kl_ci": (0.0, 0.0), "acc": float(np.mean(base_ok)),
                       "acc_ci": metrics.bootstrap_ci(base_ok), "changed": 0,
                       "bytes": base.weight_bytes()["total"]}}
OUTS = {"float32": [o.outputs[0] for o in base_out]}
print(f"{len(windows)} prose windows x {len(windows[0])} tokens; {len(qa)} QA questions "
      f"(float32 answers {sum(base_ok):.0f} of them correctly), {sum(map(len, answer_rows))} "
      "answer positions")


def evaluate(name, llm):
    rows = llm.score(windows, output="logits")
    kl = [metrics.kl_divergence(r, c).numpy() for r, c in zip(REF["windows"], rows)]
    top1 = float(np.mean(np.concatenate([(r.argmax(-1) == c.argmax(-1)).numpy()
                                         for r, c in zip(REF["windows"], rows)])))
    ans = llm.score(qa_seqs, output="logits", positions=answer_rows)
    akl = [float(metrics.kl_divergence(r, c).mean()) for r, c in zip(REF["answers"], ans)]
    outs = [o.outputs[0] for o in llm.generate(qa_prompts, greedy, use_tqdm=False)]
    ok = [float(evalsets.answer_matches(o.text, it.answers)) for o, it in zip(outs, qa)]
    OUTS[name] = outs
    RESULTS[name] = {"kl": float(np.concatenate(kl).mean()), "kl_ci": metrics.bootstrap_ci(kl),
                     "kl_rows": kl, "top1": top1, "answer_kl": float(np.mean(akl)),
                     "answer_kl_ci": metrics.bootstrap_ci(akl), "akl": akl,
                     "acc": float(np.mean(ok)), "acc_ci": metrics.bootstrap_ci(ok), "ok": ok,
                     "ans_rows": ans,
                     "changed": sum(o.token_ids != b for o, b in zip(outs, base_answers)),
                     "bytes": llm.weight_bytes()["total"]}


for name, kw in (("int4 RTN asym g128", dict(model=MODEL, quantization="int4",
                                             quantization_config={"group_size": 128,
                                                                  "symmetric": False})),
                 ("AWQ asym g128, scale only", dict(model=str(AWQ_PATH)))):
    llm = LLM(**kw, **COMMON)
    evaluate(name, llm)
    del llm
    gc.collect()

NAMES = ["float32", "int4 RTN asym g128", "AWQ asym g128, scale only"]
print("| weights | KL prose (nats) [95% CI] | top-1 agree | answer KL [95% CI] | QA accuracy "
      "[95% CI] | answers changed | weight MB |\n|---|---|---|---|---|---|---|")
for n in NAMES:
    r = RESULTS[n]
    print(f"| {n} | {r['kl']:.3g} [{r['kl_ci'][0]:.3g}, {r['kl_ci'][1]:.3g}] | {100 * r['top1']:.1f}% | "
          f"{r['answer_kl']:.3g} [{r['answer_kl_ci'][0]:.3g}, {r['answer_kl_ci'][1]:.3g}] | "
          f"{100 * r['acc']:.1f}% [{100 * r['acc_ci'][0]:.0f}, {100 * r['acc_ci'][1]:.0f}] | "
          f"{r['changed']} of {len(qa)} | {r['bytes'] / 1e6:.0f} |")
r_rtn, r_awq = RESULTS["int4 RTN asym g128"], RESULTS["AWQ asym g128, scale only"]
kept = {n: RESULTS[n]["acc"] / RESULTS["float32"]["acc"] for n in NAMES[1:]}
print()
say(f"AWQ / RTN: KL x{r_awq['kl'] / r_rtn['kl']:.2f}, answer KL x{r_awq['answer_kl'] / r_rtn['answer_kl']:.2f}"
    f"; share of float32's correct answers kept: RTN {kept['int4 RTN asym g128']:.0%}, "
    f"AWQ {kept['AWQ asym g128, scale only']:.0%}",
    f"AWQ / RTN：KL x{r_awq['kl'] / r_rtn['kl']:.2f}，答案 KL x{r_awq['answer_kl'] / r_rtn['answer_kl']:.2f}"
    f"；保住的 float32 正确答案比例：RTN {kept['int4 RTN asym g128']:.0%}，"
    f"AWQ {kept['AWQ asym g128, scale only']:.0%}")

# %%
fig = Figure(figsize=(8, 3.5), layout="constrained")
ax = fig.add_subplot()
for n in NAMES[1:]:
    kl = np.concatenate(RESULTS[n]["kl_rows"])
    ax.hist(np.log10(np.maximum(kl, 1e-6)), bins=50, alpha=0.6, label=f"{n} (mean {kl.mean():.3g})")
ax.set_xlabel("log10 KL(float32 || int4) per prose position (nats)")
ax.set_ylabel("positions")
ax.legend(fontsize=8)
q_rtn, q_awq = (np.quantile(np.concatenate(RESULTS[n]["kl_rows"]), [0.1, 0.5, 0.9]) for n in NAMES[1:])
pct_rtn, pct_awq = (" / ".join(f"{v:.3g}" for v in q_) for q_ in (q_rtn, q_awq))
overlap = r_awq["kl_ci"][1] >= r_rtn["kl_ci"][0] and r_rtn["kl_ci"][1] >= r_awq["kl_ci"][0]
say(f"per-position KL, 10th / 50th / 90th percentile: RTN {pct_rtn}, AWQ {pct_awq}"
    f"; AWQ lower at {int((q_awq < q_rtn).sum())} of the 3; KL CIs overlap: {overlap}",
    f"逐位置 KL 的第 10 / 50 / 90 百分位数：RTN {pct_rtn}，AWQ {pct_awq}"
    f"；3 个中 AWQ 更低的有 {int((q_awq < q_rtn).sum())} 个；KL 置信区间重叠：{overlap}")
widths = {n: 100 * (RESULTS[n]["acc_ci"][1] - RESULTS[n]["acc_ci"][0]) for n in NAMES[1:]}
say(f"QA accuracy CI width on {len(qa)} questions: "
    f"{', '.join(f'{n} {v:.0f} points' for n, v in widths.items())}",
    f"{len(qa)} 个问题上的问答准确率置信区间宽度："
    f"{'，'.join(f'{n} {v:.0f} 个百分点' for n, v in widths.items())}")
fig

# %% [markdown]
# The histogram and the percentiles under it show whether AWQ moves the whole
# distribution of per-position KL down or only a few outliers, and the line says whether
# the KL CIs of the two schemes overlap. Both means are to be read against chapter 14's
# int8 per channel (a few 1e-3): 4 bits on a 135M model is expensive whatever the method.
# QA accuracy is another story: its CIs on this sample are as wide as printed above, and
# on the full 176-question set the engine's default AWQ g128 answered
# *fewer* questions than RTN g128 with less than half its KL (`benchmarks/RESULTS.md`,
# 2026-11-30: 47.7 % against 68.2 %; with today's code, `python
# benchmarks/qa_inversion.py`: 59.7 % [52.3, 67.0] against 68.2 % [61.4, 75.0]). Section 7
# takes that apart.
#
# ## 5. A kernel failure mode: two GEMM paths chosen by M (vllm #10656)
#
# Everything above is the *gradual* cost of 4 bits. vllm #10656 (2024-11-26) was
# different: a GPTQ-Int4 Qwen2.5-32B answered only "!" for prompts of 50 tokens or fewer
# and was fine for longer ones; `gptq_marlin` was fine for both. vLLM's `gptq` kernel
# (`csrc/quantization/gptq/q_gemm.cu`, adapted from exllamav2) has two paths chosen by the
# number of rows M: up to `MAX_Q_GEMM_ROWS = 50` a fused kernel dequantizes and multiplies
# in one pass, accumulating with `__hfma2`, float16 multiply-adds into a **float16**
# accumulator; above 50 it dequantizes the whole weight to float16 and calls cuBLAS, which
# accumulates in float32. The issue thread gives the symptom and the switch, not a
# published root cause; the mechanism below is the one the code allows: a float16
# accumulator overflows as soon as a *partial* sum passes 65504, even when the finished
# sum would not.
#
# The cell emulates both paths on one layer, layer 11's `down_proj` (the one that writes
# the massive activation of chapter 10), quantized to int4 g128 (round to nearest) and
# run in float16 inside the float32 model (`swap_step("linear", ..., where=...)`): the
# fused path adds one product at a time and rounds the accumulator to float16 after each
# (the product of two float16 numbers is exact in float32, so this is the `__hfma2` chain
# up to a double rounding; the kernel's order, 128-column blocks added by `atomicAdd`,
# changes the order of the adds, not the format). Then it asks the engine for a short
# chat prompt (≤ 50 tokens: the fused path) and a long one (> 50: cuBLAS's path); decode
# steps have M = 1 and take the fused path too.

# %%
T5 = time.perf_counter()
MAX_Q_GEMM_ROWS = 50                                # vLLM's q_gemm.cu
GEMM_LAYER = "layers.11.mlp.down_proj"
W16 = wq.dequantize_int4(*wq.quantize_int4(W[GEMM_LAYER], 128, False), 128).half()


def fp16_accumulate(x, w):
    """x [M, K] float16 @ w [N, K] float16 -> [M, N] float16 with a float16 accumulator:
    rounded to float16 after every multiply-add, in column order. Also returns the largest
    |partial sum| met on the way (inf once one overflowed)."""
    acc, peak = torch.zeros(x.shape[0], w.shape[0]), 0.0
    xf, wf = x.float(), w.float()
    for k in range(xf.shape[1]):
        acc = (acc + xf[:, k, None] * wf[:, k]).half().float()
        peak = max(peak, float(acc.abs().max()))
    return acc.half(), peak


def cancelling_split(x, w):
    """The planted fault: the largest input channel j's product x_j w_j written as
    4 x_j w_j - x_j w_j - x_j w_j - x_j w_j (four columns appended at the end): the same
    sum in exact arithmetic, and every weight stays exact in float16 (4w and -w)."""
    j = int(x.abs().amax(0).argmax())
    w = w.clone()
    wj = w[:, j].clone()
    w[:, j] = 4 * wj
    return torch.cat([x] + [x[:, j:j + 1]] * 3, 1), torch.cat([w] + [-wj[:, None]] * 3, 1)


PATHS, PLANT = [], {"on": False}


def gptq_two_paths(x, weight, bias):
    """The "linear" step for GEMM_LAYER: vLLM gptq's two paths, chosen by M."""
    x2, w = x.reshape(-1, x.shape[-1]).half(), W16
    if PLANT["on"]:
        x2, w = cancelling_split(x2, w)
    if x2.shape[0] <= MAX_Q_GEMM_ROWS:
        y, peak = fp16_accumulate(x2, w)
        final = float(y.float().abs().max())
        PATHS.append(("fused, fp16 accumulator", x2.shape[0], peak, final))
    else:
        y = (x2.float() @ w.float().T).half()
        PATHS.append(("dequantize + GEMM, fp32 accumulator", x2.shape[0], None,
                      float(y.float().abs().max())))
    return y.float().reshape(*x.shape[:-1], -1)


question = "What is the capital of France?"
context = ("Paris, Lyon, Marseille, Toulouse and Nice are large French cities. Lyon is "
           "known for its food, Marseille for its port, Toulouse for aircraft and Nice for "
           "its coast. ")
chats = {"short": [{"role": "user", "content": question}],
         "long": [{"role": "user", "content": context + question}]}
greedy8 = SamplingParams(max_tokens=8, temperature=0)
runs = {}
for plant in (False, True):
    PLANT["on"] = plant
    for name, chat in chats.items():
        PATHS.clear()
        with base.swap_step("linear", gptq_two_paths, where=GEMM_LAYER):
            out = base.chat([chat], greedy8)[0]
        runs[plant, name] = dict(n=len(out.prompt_token_ids), text=out.outputs[0].text,
                                 finish=out.outputs[0].finish_reason, prefill=PATHS[0])
print("| layer | prompt | tokens | prefill path | largest partial sum | largest output | "
      "text (8 tokens) | finish |\n|---|---|---|---|---|---|---|---|")
for (plant, name), r in runs.items():
    path, m, peak, final = r["prefill"]
    print(f"| {'planted split' if plant else 'as trained'} | {name} | {r['n']} | {path} | "
          f"{'-' if peak is None else f'{peak:.0f}'} | {final:.0f} | {r['text']!r} | "
          f"{r['finish']} |")
SHORT_FAILS = runs[True, "short"]["finish"] == "error"
LONG_OK = runs[True, "long"]["finish"] != "error"
UNPLANTED_OK = all(runs[False, n]["finish"] != "error" for n in chats)
ONE_SIDED = runs[False, "short"]["prefill"][2] <= 1.05 * runs[False, "short"]["prefill"][3]
t5 = time.perf_counter() - T5
say(f"as trained, both prompts {'finish' if UNPLANTED_OK else 'do NOT all finish'}; the "
    f"float16 accumulator's largest partial sum is "
    f"{runs[False, 'short']['prefill'][2] / runs[False, 'short']['prefill'][3]:.2f}x the "
    f"largest output ({'one-sided: nothing to overflow before the result does' if ONE_SIDED else 'partial sums exceed the result'}); "
    f"planted: short prompt {'fails (non-finite logits, finish_reason=error)' if SHORT_FAILS else 'does not fail'}, "
    f"long prompt {'finishes' if LONG_OK else 'fails too'} ({t5:.1f} s)",
    f"按训练所得的原样，两个提示词{'都正常结束' if UNPLANTED_OK else '并非都正常结束'}；"
    f"float16 累加器的最大部分和是最大输出的 "
    f"{runs[False, 'short']['prefill'][2] / runs[False, 'short']['prefill'][3]:.2f}x"
    f"（{'单向累加：在结果溢出之前没有东西会溢出' if ONE_SIDED else '部分和超过了结果'}）；"
    f"植入拆分后：短提示词{'出错（logits 非有限值，finish_reason=error）' if SHORT_FAILS else '没有出错'}，"
    f"长提示词{'正常结束' if LONG_OK else '也出错'}（{t5:.1f} s）")

# %% [markdown]
# Read the table from the top. **As trained**, this model does not show the incident: its
# massive activation is summed one-sidedly (the largest partial sum is about the largest
# output, the ratio printed above), so a float16 accumulator has nothing to overflow that
# the float16 output would not overflow too, and then both paths would fail alike. The
# short-prompt-only failure
# needs partial sums that leave float16's range on their way to a result that does not.
# The **planted split** builds that on purpose, an exact rewrite of one product as
# 4p - p - p - p: the fused path meets 4p, past 65504, holds inf, and inf - p - p - p is
# still inf; the next RMSNorm turns the row into NaN, attention spreads it to every
# position, and the engine stops the request with `finish_reason="error"` where vLLM's
# sampler, fed NaN logits, picked token 0 ("!" in Qwen's vocabulary; chapter 9 shows that
# path). The long prompt takes the float32-accumulating path for its prefill, and its
# decode steps (M = 1, the fused path) never meet the massive activation, which lives at
# position 0: it finishes. That is #10656's signature: same weights, same prompt text
# shape, and the result depends on the prompt's *length* because the length picks the
# kernel.
#
# What the incident's users did: `--quantization gptq_marlin` (Marlin accumulates in
# float32; vLLM picks it by itself for GPTQ checkpoints on GPUs that support it), or, on
# GPUs without Marlin, pad prompts past 50 tokens. What to test before serving a 4-bit
# checkpoint: several prompt *lengths* on each side of every kernel switch, not only one
# evaluation set.

# %% [markdown]
# ## 6. Claim vs measurement

# %%
lo_awq, hi_awq = (v / RESULTS["float32"]["acc"] for v in r_awq["acc_ci"])
KL_BETTER = r_awq["kl_ci"][1] < r_rtn["kl_ci"][0]  # AWQ's whole CI below RTN's
QA_BETTER = r_awq["acc_ci"][0] > r_rtn["acc_ci"][1]  # AWQ's whole QA CI above RTN's
MED = {k: float(np.median(v)) for k, v in rel.items()}
Q41_ONLY_OWN = MED["Q4_1 grid (float min), g32"] == 0 and MED["int4 asym g32"] > 0
q41_word = (Bi("only on Q4_1's own grid", "只在 Q4_1 自己的网格上成立") if Q41_ONLY_OWN
            else Bi("not as stated", "不像所说的那样"))
claims = [
    (Bi("AWQ keeps over 95 % of the original performance at 4 bits (seed 000 §2.4.4)",
        "AWQ 在 4 位下保持 95 % 以上的原始性能（种子课程 000 §2.4.4）"),
     Bi(f"{'yes' if kept['AWQ asym g128, scale only'] > 0.95 else 'no'} on this sample: AWQ g128 "
        f"keeps {kept['AWQ asym g128, scale only']:.0%} of float32's correct "
        f"QA answers here [CI {lo_awq:.0%}, {min(hi_awq, 1):.0%}] ({len(qa)} questions), top-1 "
        f"agreement on prose {100 * r_awq['top1']:.0f}%; full set (RESULTS.md, 176 questions): "
        "47.7 % (g128) and 73.3 % (g64) in RESULTS.md, 59.7 % (g128, today's code, "
        "qa_inversion.py): no on the full set (the paper measured 7B-70B models; larger models "
        "are not measured here)",
        f"在这个样本上{'是' if kept['AWQ asym g128, scale only'] > 0.95 else '否'}：AWQ g128 "
        f"在这里保住了 float32 正确问答答案的 {kept['AWQ asym g128, scale only']:.0%} "
        f"[置信区间 {lo_awq:.0%}, {min(hi_awq, 1):.0%}]（{len(qa)} 个问题），普通文本上的 top-1 "
        f"一致率 {100 * r_awq['top1']:.0f}%；完整集合（RESULTS.md，176 个问题）："
        "RESULTS.md 中为 47.7 %（g128）和 73.3 %（g64），59.7 %（g128，今天的代码，"
        "qa_inversion.py）：在完整集合上为否（论文测量的是 7B-70B 的模型；这里没有测量更大的"
        "模型）")),
    (Bi("AWQ beats round-to-nearest at the same bits", "相同位数下 AWQ 优于就近取整（RTN）"),
     Bi(f"on KL {'yes (CIs apart)' if KL_BETTER else 'not clearly here'}: {r_awq['kl']:.3g} "
        f"[{r_awq['kl_ci'][0]:.3g}, {r_awq['kl_ci'][1]:.3g}] against "
        f"{r_rtn['kl']:.3g} [{r_rtn['kl_ci'][0]:.3g}, {r_rtn['kl_ci'][1]:.3g}], answer KL "
        f"{r_awq['answer_kl']:.3g} against {r_rtn['answer_kl']:.3g}; on greedy QA "
        f"{'yes (CIs apart)' if QA_BETTER else 'not resolved (CIs overlap)'} "
        f"(here {100 * r_awq['acc']:.0f}% against {100 * r_rtn['acc']:.0f}%; full set, engine "
        "default AWQ: 59.7 % against 68.2 %, 36 items lost and 21 gained, sign test p = 0.063: "
        "section 7)",
        f"在 KL 上{'是（置信区间分离）' if KL_BETTER else '此处不明显'}：{r_awq['kl']:.3g} "
        f"[{r_awq['kl_ci'][0]:.3g}, {r_awq['kl_ci'][1]:.3g}] 对 "
        f"{r_rtn['kl']:.3g} [{r_rtn['kl_ci'][0]:.3g}, {r_rtn['kl_ci'][1]:.3g}]，答案 KL "
        f"{r_awq['answer_kl']:.3g} 对 {r_rtn['answer_kl']:.3g}；在贪心问答上"
        f"{'是（置信区间分离）' if QA_BETTER else '无法判定（置信区间重叠）'}"
        f"（此处 {100 * r_awq['acc']:.0f}% 对 {100 * r_rtn['acc']:.0f}%；完整集合，本引擎"
        "默认的 AWQ：59.7 % 对 68.2 %，丢失 36 道、新答对 21 道，符号检验 p = 0.063："
        "第 7 节）")),
    (Bi("these weights came from Q4_1, so 4-bit re-quantization is lossless (a reviewer's caution)",
        "这些权重来自 Q4_1，所以 4 位重新量化是无损的（一位审阅者的提醒）"),
     Bi(f"{txt(q41_word, 'en')}"
        f" (relative weight error {np.median(rel['Q4_1 grid (float min), g32']):.1e}); "
        f"the integer-zero-point layout errs already at g32 ({np.median(rel['int4 asym g32']):.3f}) "
        f"and at g128 ({np.median(rel['int4 asym g128']):.3f})",
        f"{txt(q41_word, 'zh')}"
        f"（相对权重误差 {np.median(rel['Q4_1 grid (float min), g32']):.1e}）；"
        f"整数零点的布局在 g32 时就已有误差（{np.median(rel['int4 asym g32']):.3f}），"
        f"在 g128 时也有（{np.median(rel['int4 asym g128']):.3f}）")),
    (Bi("AWQ's gain comes from a few salient input channels", "AWQ 的收益来自少数几个显著的输入通道"),
     Bi(f"layer 11's down_proj: the scale search alone cuts the held-out output error from "
        f"{out_err(x_held, rtn):.4f} to {out_err(x_held, awq_noclip, s):.4f}, clipping to "
        f"{out_err(x_held, awq_full, s):.4f} (alpha {info['best_ratio']:.2f})",
        f"第 11 层的 down_proj：单靠缩放因子搜索就把留出窗口上的输出误差从 "
        f"{out_err(x_held, rtn):.4f} 降到 {out_err(x_held, awq_noclip, s):.4f}，加上截断后为 "
        f"{out_err(x_held, awq_full, s):.4f}（alpha {info['best_ratio']:.2f}）")),
    (Bi("smaller groups are better", "组越小越好"),
     Bi(f"{'yes' if MED['int4 asym g32'] < MED['int4 asym g64'] < MED['int4 asym g128'] else 'not monotone here'}"
        f" in weight error: g128 {np.median(rel['int4 asym g128']):.3f} -> g64 "
        f"{np.median(rel['int4 asym g64']):.3f} -> g32 {np.median(rel['int4 asym g32']):.3f} for "
        f"{4 + 40 / 128:.2f} -> {4 + 40 / 64:.2f} -> {4 + 40 / 32:.2f} bits per weight",
        f"就权重误差而言{'是' if MED['int4 asym g32'] < MED['int4 asym g64'] < MED['int4 asym g128'] else '此处并不单调'}"
        f"：g128 {np.median(rel['int4 asym g128']):.3f} -> g64 "
        f"{np.median(rel['int4 asym g64']):.3f} -> g32 {np.median(rel['int4 asym g32']):.3f}，对应每个权重 "
        f"{4 + 40 / 128:.2f} -> {4 + 40 / 64:.2f} -> {4 + 40 / 32:.2f} 位")),
    (Bi("vllm #10656: a GPTQ int4 kernel fails on prompts of 50 tokens or fewer only",
        "vllm #10656：一个 GPTQ int4 kernel 只在 50 个 token 及以下的提示词上出错"),
     Bi(f"the two paths emulated on layer 11's down_proj: as trained, "
        f"{'no failure on either side of 50 tokens' if UNPLANTED_OK else 'a failure'} (largest "
        f"float16 partial sum {runs[False, 'short']['prefill'][2] / runs[False, 'short']['prefill'][3]:.2f}x "
        f"the output); with a planted cancelling split the {runs[True, 'short']['n']}-token prompt "
        f"{'fails' if SHORT_FAILS else 'does not fail'} and the {runs[True, 'long']['n']}-token one "
        f"{'finishes' if LONG_OK else 'fails too'}: the mechanism (float16 partial sums) "
        f"{'reproduced, planted' if SHORT_FAILS and LONG_OK else 'not reproduced'}",
        f"在第 11 层的 down_proj 上模拟两条路径：按训练所得的原样，"
        f"{'50 个 token 两侧都没有出错' if UNPLANTED_OK else '出现了故障'}（float16 最大部分和"
        f"为输出的 {runs[False, 'short']['prefill'][2] / runs[False, 'short']['prefill'][3]:.2f}x）；"
        f"植入一个相互抵消的拆分后，{runs[True, 'short']['n']} 个 token 的提示词"
        f"{'出错' if SHORT_FAILS else '没有出错'}，{runs[True, 'long']['n']} 个 token 的提示词"
        f"{'正常结束' if LONG_OK else '也出错'}：该机制（float16 部分和）"
        f"{'已复现（植入）' if SHORT_FAILS and LONG_OK else '未复现'}")),
]
claims_table(claims, header=(Bi("claim", "论断"), Bi("measured", "实测")))

# %% [markdown]
# ## 7. Why greedy QA accuracy moves against KL
#
# `benchmarks/RESULTS.md` found QA accuracy moving against KL in 6 of 9
# calibrated-against-RTN pairs. Take the questions of this chapter's sample one by one:
# which answers change, where the change starts (the first token that differs from
# float32's answer), and how sure float32 itself was there (its margin: top-1 minus
# top-2 log-prob at that position).

# %%
def first_change(a, b):
    return next((k for k, (x, y) in enumerate(zip(a, b)) if x != y),
                None if len(a) == len(b) else min(len(a), len(b)))


margins = []
for r in REF["answers"]:
    top2 = torch.log_softmax(r.double(), -1).topk(2, dim=-1).values
    margins.append((top2[:, 0] - top2[:, 1]).numpy())
rows_ = []
for i, it in enumerate(qa):
    cells = {}
    for n in NAMES[1:]:
        k = first_change(base_answers[i], OUTS[n][i].token_ids)
        cells[n] = (bool(RESULTS[n]["ok"][i]), k,
                    None if k is None or k >= len(margins[i]) else float(margins[i][k]))
    rows_.append(cells)
both = {(a, b): sum(c[NAMES[1]][0] == a and c[NAMES[2]][0] == b for c in rows_)
        for a in (True, False) for b in (True, False)}
say(f"paired: both right {both[True, True]}, RTN only {both[True, False]}, AWQ only "
    f"{both[False, True]}, both wrong {both[False, False]}",
    f"配对：两者都对 {both[True, True]}，仅 RTN 对 {both[True, False]}，仅 AWQ 对 "
    f"{both[False, True]}，两者都错 {both[False, False]}")
changed_k = {n: [c[n][1] for c in rows_ if c[n][1] is not None] for n in NAMES[1:]}
all_m = np.concatenate([m[:3] for m in margins])
for n in NAMES[1:]:
    ms = [c[n][2] for c in rows_ if c[n][2] is not None]
    say(f"{n}: {len(ms)} answers change; first change at token {np.median(changed_k[n]):.0f} "
        f"(median; {sum(k == 0 for k in changed_k[n])} at the very first token); float32's "
        f"margin there: median {np.median(ms):.2f} nats (its margin over the first 3 answer "
        f"tokens of all questions: median {np.median(all_m):.2f})",
        f"{n}：{len(ms)} 个答案改变；第一处改变在第 {np.median(changed_k[n]):.0f} 个 token"
        f"（中位数；{sum(k == 0 for k in changed_k[n])} 个在第一个 token 就改变）；float32 在该处的"
        f"余量：中位数 {np.median(ms):.2f} nats（它在所有问题前 3 个答案 token 上的余量："
        f"中位数 {np.median(all_m):.2f}）")
# Teacher-forced on float32's answers: KL and top-1 flips where float32 was unsure
# (margin < 1 nat) and where it was sure, and at the first answer token alone.
m_all = np.concatenate(margins)
unsure = m_all < 1.0
print()
say(f"float32's answer positions: {len(m_all)}, of which {unsure.sum()} with a margin under 1 nat",
    f"float32 的答案位置：{len(m_all)} 个，其中 {unsure.sum()} 个的余量低于 1 nat")
print("| weights | answer KL, margin < 1 | margin >= 1 | first answer token | top-1 "
      "flips, margin < 1 | margin >= 1 |\n|---|---|---|---|---|---|")
TF = {}
for n in NAMES[1:]:
    kl_pos = np.concatenate([metrics.kl_divergence(r, c).numpy()
                             for r, c in zip(REF["answers"], RESULTS[n]["ans_rows"])])
    flips = np.concatenate([(r.argmax(-1) != c.argmax(-1)).numpy()
                            for r, c in zip(REF["answers"], RESULTS[n]["ans_rows"])])
    first = np.array([float(metrics.kl_divergence(r[:1], c[:1])[0])
                      for r, c in zip(REF["answers"], RESULTS[n]["ans_rows"])])
    TF[n] = dict(kl_unsure=kl_pos[unsure].mean(), kl_sure=kl_pos[~unsure].mean(),
                 kl_first=first.mean(), flips_unsure=int(flips[unsure].sum()),
                 flips_sure=int(flips[~unsure].sum()))
    t = TF[n]
    print(f"| {n} | {t['kl_unsure']:.3f} | {t['kl_sure']:.3f} | {t['kl_first']:.3f} | "
          f"{t['flips_unsure']} of {unsure.sum()} | {t['flips_sure']} of {(~unsure).sum()} |")
ta, tr = TF[NAMES[2]], TF[NAMES[1]]
say(f"AWQ's answer KL below RTN's: at margin < 1 {ta['kl_unsure'] < tr['kl_unsure']}, at "
    f"margin >= 1 {ta['kl_sure'] < tr['kl_sure']}; top-1 flips at margin < 1: AWQ "
    f"{ta['flips_unsure']}, RTN {tr['flips_unsure']}",
    f"AWQ 的答案 KL 低于 RTN 的：余量 < 1 处 {ta['kl_unsure'] < tr['kl_unsure']}，"
    f"余量 >= 1 处 {ta['kl_sure'] < tr['kl_sure']}；余量 < 1 处的 top-1 翻转：AWQ "
    f"{ta['flips_unsure']}，RTN {tr['flips_unsure']}")


def answer_start(i):
    """Token index in float32's answer where an accepted answer's text begins (None: not
    found verbatim), as benchmarks/qa_inversion.py finds it."""
    text = OUTS["float32"][i].text.lower()
    pos = min((text.find(a.lower()) for a in qa[i].answers if a.lower() in text), default=-1)
    return None if pos < 0 else next((k - 1 for k in range(1, len(base_answers[i]) + 1)
                                      if len(tok.decode(base_answers[i][:k])) > pos), None)


print()
for n in NAMES[1:]:
    lost = [i for i in range(len(qa)) if base_ok[i] and not RESULTS[n]["ok"][i]]
    starts = {i: answer_start(i) for i in lost}
    opening = sum(starts[i] is not None and rows_[i][n][1] < starts[i] for i in lost)
    fact = sum(starts[i] is not None and rows_[i][n][1] >= starts[i] for i in lost)
    kind = (Bi("none lost", "没有丢失") if not lost else
            Bi("mostly a different opening", "大多是开头不同") if opening > fact else
            Bi("mostly at the answer word", "大多在答案词处") if fact > opening else
            Bi("as many of each", "两种一样多"))
    say(f"{n}: of the {len(lost)} items float32 answers correctly and it does not, {opening} "
        f"leave float32's answer before the answer word (a different opening), {fact} at the "
        f"answer word or after it (float32's opening, then another word where its answer "
        f"stood), {len(lost) - opening - fact} where the answer is not verbatim in float32's "
        f"text: in this sample, {txt(kind, 'en')}",
        f"{n}：在 float32 答对而它答错的 {len(lost)} 道题中，{opening} 道在答案词之前就偏离了 "
        f"float32 的答案（开头不同），{fact} 道在答案词处或之后偏离（开头与 float32 相同，"
        f"随后在其答案所在之处换成了另一个词），{len(lost) - opening - fact} 道的答案并未"
        f"原样出现在 float32 的文本中：在这个样本中，{txt(kind, 'zh')}")
print("\nquestions where the two schemes disagree on correctness:")
for i, c in enumerate(rows_):
    if c[NAMES[1]][0] != c[NAMES[2]][0]:
        print(f"  {qa[i].question!r} (accepted: {qa[i].answers[0]!r})\n"
              f"    float32: {OUTS['float32'][i].text!r}\n    RTN:     {OUTS[NAMES[1]][i].text!r}"
              f"\n    AWQ:     {OUTS[NAMES[2]][i].text!r}")

# %% [markdown]
# What this sample shows (the lines above, which count it), and what the full set (176
# questions, 24 tokens; `python benchmarks/qa_inversion.py`) adds. The sample has a few
# dozen questions and only a dozen or so lost items per scheme (the lines above count
# them), so its counts can move with the CPU's kernels and need not agree with the full
# set's:
#
# 1. **Not the cut at 24 tokens.** Of the wrong answers on the full set, 1 of RTN's 56 and
#    1 of AWQ's 71 contain the answer when the same engine may write 64 tokens.
# 2. **On the full set, mostly a different opening, not a different answer word.** AWQ's
#    wrong answers leave float32's answer *before* the answer word in 52 of 71 cases
#    (RTN's in 28 of 56), and 47 of AWQ's 118 changed answers change at the first token
#    (RTN: 32 of 125). Float32 opens "Portugal's capital is Lisbon."; AWQ opens "Portugal
#    is the second largest country in Europe..." and never states the capital. The
#    capitals carry most of the loss (RTN 44, AWQ 31 of 56 right). This chapter's sample
#    is counted the same way in the lines above (how many changed answers change at the
#    very first token, and whether the items each scheme loses mostly change before the
#    answer word or at it); with so few lost items either can come out, and an answer
#    that changes at the answer word may be a wrong fact (another city named as the
#    capital) or a digression: the list of disagreements shows which.
# 3. **The flips sit at near-ties of float32 itself.** On the full set, float32's margin
#    at AWQ's first changed token is a fraction of a nat (median 0.66 on the items AWQ
#    loses); the sample's median is printed above, beside float32's typical margin over
#    the first three answer tokens. Teacher-forced on float32's answers (the table above
#    and the line under it), compare the KL with the top-1 flips at the unsure positions:
#    a near-tie is tipped by any 4-bit error of this size, so fewer nats need not mean
#    fewer flips there, and which way it tips (a paraphrase that still names the answer,
#    or a description that does not) is not ordered by KL.
# 4. **So the metric reads a few coin tosses.** Answer KL is measured along float32's
#    path; greedy follows the model's own path, and one flipped opening token sends it
#    into a continuation no KL scored: on the items AWQ loses its answer KL is *lower*
#    than RTN's (0.240 against 0.343, full set). With 176 items the difference in
#    accuracy is 36 lost against 21 gained (sign test p = 0.063), and the 20-point gap
#    recorded on 2026-11-30 did not reproduce with today's code (59.7 % where RESULTS.md
#    has 47.7 %; RTN reproduces exactly, 68.2 %).
# 5. **The set is part of it.** Every item is one the float32 reference (HF transformers)
#    answered correctly when the set was built (section 4 prints how many this engine's
#    float32 answers correctly on this CPU), many of them at a near-tie opening, and the
#    score is all-or-nothing on a greedy string. Such a set measures "does the opening
#    token survive", which a 4-bit model of this size fails at random. Gate on KL and
#    answer KL; if accuracy is reported, pair it (same items, sign test) and prefer a
#    likelihood read (the log-prob of the accepted answer) to one greedy string.
#
# Full-set numbers: `python benchmarks/qa_inversion.py --awq-path <default AWQ g128
# checkpoint>` on 2026-12-02 (176 questions, 24 tokens, engine default AWQ: scale and clip
# search, 4,096 calibration tokens), recorded in `benchmarks/RESULTS.md`.
#
# ## Common misconceptions
#
# - *"4-bit is 4-bit."* Group size, symmetric or asymmetric, and where the zero point
#   lives (integer code or float offset) decide the error: on these weights the same 4
#   bits are lossless on Q4_1's grid and cost a KL of a few tenths on the GPTQ/AWQ grid.
# - *"AWQ changes the weights' format."* It stores the same int4 codes, scales and zeros
#   as RTN plus one scale per input channel, which the layer divides its input by (or the
#   previous layer absorbs): the gain is all in *which* numbers are stored.
# - *"A method that lowers KL raises accuracy."* On a few dozen greedy answers, no: the
#   accuracy CI on 30 questions is tens of points wide (section 4 prints it), and on 176
#   questions the two measures disagreed in 6 of 9 calibrated-against-RTN pairs of
#   `benchmarks/RESULTS.md`. Gate a release on KL and
#   answer KL; read accuracy beside them, paired.
# - *"Calibration data does not matter."* AWQ fits its scales to the activations it saw
#   (here chat conversations); the held-out window in section 3 shows how well the fit
#   transfers for one layer, section 7 what it does to short factual answers.
# - *"A 4-bit model that passed the evaluation set is safe at every prompt length."* The
#   kernel may change with the number of rows (prompt length in prefill, batch size in
#   decode): vllm #10656 failed at 50 tokens or fewer only. Test lengths on both sides of
#   each switch (section 5).
# - *"The benchmark's 95 % carries over."* Retention claims are per model size and task;
#   measure on your own model.
#
# ## Lab
#
# `labs/source/ch15/` starts from round-to-nearest int4 (asymmetric, g128) on the MLPs of
# the first decoder layers. You write group-wise int4 quantization (bit for bit the
# engine's), AWQ's scale search, and the quantizer that applies the scale; the grader
# registers them as a calibrated quantization method and checks, on text you have not
# seen, that your AWQ cuts RTN's KL against float32 by at least a quarter on the same
# positions.
#
# ## On real vLLM
#
# - Serve an AWQ checkpoint as it is: vLLM reads its `quantization_config` and, where it
#   can, runs the `awq_marlin` kernel; an explicit `--quantization awq` forces the
#   older AWQ kernel (its log says so). `--dtype half` is the recommended dtype for AWQ.
# - Make checkpoints with llm-compressor: AutoAWQ is deprecated and its AWQ moved there
#   (vLLM docs, AutoAWQ page). AutoAWQ's example config (4 bits, `zero_point`,
#   `q_group_size` 128) is this chapter's asymmetric g128 grid.
# - Gate on this chapter's numbers: `prompt_logprobs` KL and answer KL against the
#   16-bit model, accuracy paired on the same items; test several prompt lengths too
#   (vllm #10656 failed on short prompts only).
# - Checked against vLLM's docs (quantization, AutoAWQ, engine arguments) and
#   `awq_marlin.py`, 2025-2026. This engine runs its own AWQ search (scales, clip) on
#   bundled text, caches the checkpoint, and multiplies by the dequantized weight.

# %%
print(f"chapter 15 ran in {time.perf_counter() - T0:.0f} s")
