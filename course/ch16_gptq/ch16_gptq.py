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
# # Chapter 16. GPTQ: when the calibration set becomes the test
#
# **Learning goals.** After this chapter you can
#
# 1. say what GPTQ does that round-to-nearest (RTN) does not: it quantizes a layer's
#    weight one input column at a time and pushes each column's rounding error onto the
#    columns not yet quantized, weighted by the inverse of the Hessian `H = 2/n · XᵀX` of
#    the layer's calibration inputs `X`;
# 2. measure a layer's output error on its calibration inputs *and* on held-out inputs,
#    and recognise overfitting: GPTQ with AutoGPTQ's defaults (no act-order, damping 1 %
#    of the mean diagonal) cuts the calibration error several times and *raises* the
#    held-out error above RTN's;
# 3. explain why from the Hessian's spectrum: a few hundred calibration tokens leave most
#    input directions of a wide layer empty, weak damping makes them free, and GPTQ
#    parks its error there; other text uses them;
# 4. apply and measure the fix: damping the Hessian with its mean diagonal
#    (`percdamp=1.0`), act-order, and more and more varied calibration data, per layer
#    and end to end (KL, answer KL and QA accuracy side by side, with confidence
#    intervals), from full-model checkpoints built once and cached;
# 5. answer the seed's "modern methods keep 95 % at 4 bits" with this model's numbers.
#
# **The incident.**
#
# - **This project's own measurement** (`benchmarks/RESULTS.md`, weight quantization,
#   2026-11-30, 176 QA questions): GPTQ with AutoGPTQ's defaults (`desc_act=False`,
#   `damp_percent=0.01`) on 4,096 chat calibration tokens *loses* to plain RTN at 4 bits,
#   groups of 128: perplexity ratio 1.75 against 1.57, greedy QA 25.6 % against 46.0 %,
#   although each layer's calibration error falls 2-6x. With act-order and
#   `percdamp=1.0` (the engine's defaults since) it wins on KL, 0.303 against 0.588, and
#   is ahead on QA, 53.4 % against 46.0 % (intervals overlapping).
# - **AutoGPTQ/AutoGPTQ #650** (2024-04,
#   [link](https://github.com/AutoGPTQ/AutoGPTQ/issues/650)): Llama-3-8B quantized with
#   GPTQ on c4 gave wikitext2 perplexity 17.5 where the paper reports 6.5; calibrated on
#   wikitext2 instead it gave 6.62. The maintainer's answer: "Pass at least 128 examples
#   of sufficient length". The same mechanism, seen from the evaluation side: GPTQ fits
#   the calibration distribution, and text outside it pays.
# - **IST-DASLab/gptq #1** ([link](https://github.com/IST-DASLab/gptq/issues/1)): GPTQ's
#   results differ across GPUs, through accumulation order; a reminder that a GPTQ
#   checkpoint is the output of a numerical procedure with its own sensitivities (here:
#   `minivllm.quantization.checkpoint` keys a cached checkpoint by a hash of the
#   quantizer's code, the calibration tokens and the options).
# - **vllm #10656** (the "!!!!!" GPTQ kernel for prompts of 50 tokens or fewer) is a
#   GPTQ *kernel* incident: a float16 accumulator in one of two GEMM paths chosen by the
#   number of rows; chapter 15 (section 5) emulates the two paths on one layer.
#
# Everything below is measured when the notebook runs, on the embedded SmolLM2-135M in
# float32 on this machine's CPU, except numbers marked as taken from
# `benchmarks/RESULTS.md` (the command is given there). As in chapter 15, these weights
# came from GGUF Q4_1; the symmetric g128 grid used here has no Q4_1 free ride (chapter
# 15, section 2).

# %%
# %matplotlib inline
import gc
import math
import time

import numpy as np
import torch
from matplotlib.figure import Figure

from minivllm import LLM, SamplingParams
from minivllm.i18n import Bi, claims_table, say
from minivllm.precision import evalsets, metrics
from minivllm.quantization import weight_quant as wq
from minivllm.quantization.calibration import observe_inputs
from minivllm.quantization.checkpoint import cached_quantized
from minivllm.quantization.quantize import target_layers

torch.manual_seed(0)
T0 = time.perf_counter()
MODEL = "smollm2-135m-instruct"
COMMON = dict(dtype="float32", max_model_len=512, kv_cache_memory_bytes=48 << 20)
base = LLM(MODEL, **COMMON)                        # float32 weights: the reference
tok = base.get_tokenizer()
LAYERS = target_layers(base.llm_engine.model_runner.model)
GROUP = 128

# %% [markdown]
# ## 1. GPTQ in one screen
#
# A linear layer computes `y = x Wᵀ`. RTN rounds every weight on its own. GPTQ (Frantar
# et al. 2022, arXiv:2210.17323) asks for the quantized `Q` that minimises the output
# error on calibration inputs `X`, `‖X Qᵀ − X Wᵀ‖²`, whose curvature in each row of `W`
# is `H = 2/n · XᵀX` (`[in, in]`). It goes through the input columns in order; after
# rounding column `i` it subtracts the rounding error, times row `i` of `U` (the upper
# Cholesky factor of `H⁻¹`, divided by `U[i, i]`), from the columns not yet quantized.
# Where two input channels move together, the second absorbs the first's error and the
# *output* barely changes. Two knobs matter here:
#
# - **damping**: before the inverse, `H += percdamp · mean(diag H) · I`. The reference
#   code and AutoGPTQ use 0.01; with it, a direction the calibration inputs never use
#   costs almost nothing to put error into.
# - **act-order** (`desc_act`): quantize columns in order of decreasing `diag H`, so the
#   channels with the largest inputs are rounded first, while many columns remain to
#   absorb their error.
#
# A toy: one weight row of four columns, one group (scale `0.30 / 7`), where inputs 1
# and 2 are nearly copies of each other.

# %%
g = torch.Generator().manual_seed(16)
a = torch.randn(2000, 1, generator=g)
# inputs 1 and 2 are nearly copies of each other; 0 and 3 are independent
X_toy = torch.cat([torch.randn(2000, 1, generator=g), a, a + 0.05 * torch.randn(2000, 1, generator=g),
                   torch.randn(2000, 1, generator=g)], 1)
w_toy = torch.tensor([[0.30, 0.11, 0.12, 0.05]])
H_toy = wq.hessian_from_inputs(X_toy[:1000])       # calibrate on the first 1000 rows


def out_err(x, w, deq):
    """Relative output error ||x deqᵀ − x wᵀ|| / ||x wᵀ|| (Frobenius) of a layer."""
    y = x @ w.T
    return float((x @ deq.T - y).norm() / y.norm())


for name, deq in (("RTN", wq.dequantize_int4(*wq.quantize_int4(w_toy, 4, True), 4)),
                  ("GPTQ", wq.dequantize_int4(*wq.gptq_quantize(w_toy, H_toy, 4, True,
                                                                act_order=False), 4))):
    print(f"{name:4}: weights {[round(v, 4) for v in deq[0].tolist()]} (float "
          f"{[round(v, 2) for v in w_toy[0].tolist()]}); w1 + w2 = {float(deq[0, 1:3].sum()):.4f} "
          f"(float 0.23); output error on the other 1000 rows {out_err(X_toy[1000:], w_toy, deq):.4f}")

# %% [markdown]
# Both rows store the same kind of 4-bit codes. RTN rounds each weight to its nearest
# level, and weights 1 and 2 both round up. GPTQ rounds weight 1 up, then moves weight 2
# to make up for it, because inputs 1 and 2 are nearly equal: the sum `w1 + w2`, which
# is what the output sees, comes out closer to float, though weight 2 lands farther from
# its own value than RTN's. The trade is only good if future inputs are correlated as the calibration
# inputs were. That is the whole chapter.
#
# ## 2. The incident on two layers, live
#
# Record the inputs of two layers while the float engine reads text, with the engine's
# own calibration observer (`observe_inputs`, what `quantization="gptq"` uses):
#
# - **calibration**: 384 tokens of the bundled chat conversations (the engine's default
#   calibration set);
# - **held out**: 384 tokens of the prose corpus, text the quantizer never sees.
#
# The layers: layer 5's attention output (`o_proj`, 576 inputs) and layer 28's MLP output
# (`down_proj`, 1536 inputs, next to the LM head). Each is quantized four ways, 4 bits,
# symmetric, groups of 128: RTN; GPTQ with AutoGPTQ's defaults; GPTQ with act-order only;
# GPTQ with act-order and `percdamp=1.0` (the engine's default).

# %%
NAMES = ["layers.5.self_attn.o_proj", "layers.28.mlp.down_proj"]
chat = evalsets.conversation_sequences(tok, max_conversations=2, max_tokens=384)
prose = evalsets.corpus_sequences(tok, seq_len=192, max_sequences=6)


def capture(seqs):
    """Input rows [tokens, in] of each layer in NAMES while the float engine reads seqs
    (only the last position goes through the LM head: nothing else is needed)."""
    with observe_inputs({n: LAYERS[n] for n in NAMES}, max_rows=1 << 16) as obs:
        base.score(seqs, output="logits", positions=[[len(s) - 1] for s in seqs])
    return {n: obs[n].sample for n in NAMES}


X_CAL = capture(chat)                  # 2 x 384 chat tokens: calibration (the first 384)
X_MIX = capture([prose[0]])            # 192 prose tokens, for a mixed calibration set
X_HELD = capture(prose[2:4])           # 384 prose tokens, never calibrated on
W = {n: LAYERS[n].weight.detach().float() for n in NAMES}
AUTO, ACT, DAMPED = ("GPTQ, AutoGPTQ defaults (damp 0.01)", "GPTQ, act-order, damp 0.01",
                     "GPTQ, act-order, damp 1.0 (engine default)")
VARIANTS = {"RTN": None, AUTO: dict(act_order=False, percdamp=0.01),
            ACT: dict(act_order=True, percdamp=0.01), DAMPED: dict(act_order=True, percdamp=1.0)}


def quantize(name, variant, x_cal):
    """Dequantized [out, in] weight of layer `name`: RTN, or GPTQ calibrated on x_cal."""
    w = W[name]
    if variant is None:
        return wq.dequantize_int4(*wq.quantize_int4(w, GROUP, True), GROUP)
    return wq.dequantize_int4(*wq.gptq_quantize(w, wq.hessian_from_inputs(x_cal), GROUP, True,
                                                **variant), GROUP)


ERR = {}
print(f"calibration {X_CAL[NAMES[0]][:384].shape[0]} chat tokens, held out "
      f"{X_HELD[NAMES[0]].shape[0]} prose tokens\n")
print("| layer | weights | output error, calibration | held out | held out / RTN's |\n"
      "|---|---|---|---|---|")
for n in NAMES:
    xc = X_CAL[n][:384]
    for v, opts in VARIANTS.items():
        deq = quantize(n, opts, xc)
        ERR[n, v] = (out_err(xc, W[n], deq), out_err(X_HELD[n], W[n], deq), deq)
        print(f"| {n} | {v} | {ERR[n, v][0]:.4f} | {ERR[n, v][1]:.4f} | "
              f"{ERR[n, v][1] / ERR[n, 'RTN'][1]:.2f} |")
for n in NAMES:
    say(f"{n}: AutoGPTQ's defaults cut the calibration error {ERR[n, 'RTN'][0] / ERR[n, AUTO][0]:.1f}x "
        f"and put the held-out error at {ERR[n, AUTO][1] / ERR[n, 'RTN'][1]:.2f}x RTN's; damp 1.0: "
        f"{ERR[n, 'RTN'][0] / ERR[n, DAMPED][0]:.1f}x and {ERR[n, DAMPED][1] / ERR[n, 'RTN'][1]:.2f}x",
        f"{n}：AutoGPTQ 默认设置把校准误差缩小了 {ERR[n, 'RTN'][0] / ERR[n, AUTO][0]:.1f} 倍，"
        f"留出误差则是 RTN 的 {ERR[n, AUTO][1] / ERR[n, 'RTN'][1]:.2f} 倍；damp 1.0：校准误差缩小 "
        f"{ERR[n, 'RTN'][0] / ERR[n, DAMPED][0]:.1f} 倍，留出误差为 RTN 的 {ERR[n, DAMPED][1] / ERR[n, 'RTN'][1]:.2f} 倍")

# %%
fig = Figure(figsize=(10, 3.4), layout="constrained")
axes = fig.subplots(1, len(NAMES), sharey=True)
TICKS = ["RTN", "GPTQ\nAutoGPTQ", "GPTQ\nact-order", "GPTQ act-order\n+ damp 1.0"]
for ax, n in zip(axes, NAMES):
    xs = np.arange(len(VARIANTS))
    ax.bar(xs - 0.2, [ERR[n, v][0] for v in VARIANTS], 0.4, label="calibration (chat)")
    ax.bar(xs + 0.2, [ERR[n, v][1] for v in VARIANTS], 0.4, label="held out (prose)")
    ax.set_xticks(xs, TICKS, fontsize=8)
    ax.set_title(n, fontsize=9)
axes[0].set_ylabel("relative output error")
axes[0].legend(fontsize=8)
fig

# %% [markdown]
# Read each panel from left to right. RTN's error is about the same on both texts: it
# never looked at either. GPTQ with AutoGPTQ's defaults cuts the calibration error
# several times (the left bars) and *raises* the held-out error above RTN's (the right
# bars; the last column of the table): a textbook overfit, by a quantizer. Act-order
# alone does not cure it. Damping with the mean diagonal gives back part of the
# calibration gain and brings the held-out error below RTN's. (`benchmarks/RESULTS.md`
# saw the same in layer 5's `down_proj` with 10k calibration tokens: 1.27x RTN.)
#
# ## 3. Why: directions the calibration set leaves empty
#
# GPTQ's objective weighs an error direction `v` (in input space) by `vᵀHv`, the
# calibration inputs' energy along `v`. Layer 28's `down_proj` has 1536 inputs; 384
# calibration tokens span at most 384 directions, so over a thousand directions have
# *zero* calibration energy, and only the damping term `percdamp · mean(diag H)` prices
# them. Take the calibration Hessian's eigen-directions (from the SVD of the 384 input
# rows) and call a direction *empty* when its eigenvalue is below what damping 0.01
# adds. How much energy do held-out inputs have there, how much of each quantizer's
# weight error `ΔW = Q − W` lies there, and how much held-out output error does that
# part of `ΔW` cause?

# %%
n = "layers.28.mlp.down_proj"
xc, xh = X_CAL[n][:384].double(), X_HELD[n].double()
_, sv, vh = torch.linalg.svd(xc, full_matrices=False)
evals = 2 / xc.shape[0] * sv ** 2                      # the nonzero eigenvalues of H = 2/n XᵀX
mean_diag = float(2 / xc.shape[0] * xc.pow(2).sum() / xc.shape[1])
full = vh[evals >= 0.01 * mean_diag]                   # the directions damping 0.01 does not swamp
n_empty = xc.shape[1] - full.shape[0]


def empty_part(m):
    """The component of the rows of m in the empty directions (orthogonal to `full`)."""
    return m - (m @ full.T) @ full


held_energy_along = 2 / xh.shape[0] * (xh @ vh.T).pow(2).sum(0)    # vᵀ H_held v per direction
held_empty = float(empty_part(xh).pow(2).sum() / xh.pow(2).sum())
cal_empty = float(empty_part(xc).pow(2).sum() / xc.pow(2).sum())
y_held = xh @ W[n].double().T
SHARE, EMPTY_ERR = {}, {}
for v in VARIANTS:
    dw = ERR[n, v][2].double() - W[n].double()
    SHARE[v] = float(empty_part(dw).pow(2).sum() / dw.pow(2).sum())
    EMPTY_ERR[v] = float((xh @ empty_part(dw).T).norm() / y_held.norm())
say(f"{n}: {n_empty} of {xc.shape[1]} directions are empty (eigenvalue below damping 0.01's "
    f"{0.01 * mean_diag:.3g}); held-out prose puts {held_empty:.2%} of its input energy there, "
    f"the calibration chat {cal_empty:.3%}.",
    f"{n}：{xc.shape[1]} 个方向中有 {n_empty} 个是空的（特征值低于阻尼 0.01 所加的 "
    f"{0.01 * mean_diag:.3g}）；留出的普通文本有 {held_empty:.2%} 的输入能量落在那里，"
    f"校准用的对话只有 {cal_empty:.3%}。")
print("| weights | share of ‖ΔW‖² in empty directions | held-out output error from that part | "
      "total held-out error |\n|---|---|---|---|")
for v in VARIANTS:
    print(f"| {v} | {SHARE[v]:.1%} | {EMPTY_ERR[v]:.4f} | {ERR[n, v][1]:.4f} |")

# %%
fig = Figure(figsize=(10, 3.6), layout="constrained")
ax1, ax2 = fig.subplots(1, 2)
idx = np.arange(1, len(evals) + 1)
ax1.loglog(idx, evals.numpy(), label="calibration (chat): eigenvalue of H")
ax1.loglog(idx, held_energy_along.numpy(), ".", ms=3, alpha=0.6,
           label="held out (prose): energy along the same direction")
for pd, ls in ((0.01, ":"), (1.0, "--")):
    ax1.axhline(pd * mean_diag, color="k", ls=ls, lw=1, label=f"damping, percdamp={pd}")
ax1.set_xlabel(f"eigen-direction (largest first; the other {xc.shape[1] - len(evals)} have 0)")
ax1.set_ylabel("energy")
ax1.legend(fontsize=7)
ax1.set_title(f"{n}: 384 calibration tokens, {xc.shape[1]} inputs", fontsize=9)
xs = np.arange(len(VARIANTS))
ax2.bar(xs - 0.2, [ERR[n, v][1] for v in VARIANTS], 0.4, label="held-out output error")
ax2.bar(xs + 0.2, [EMPTY_ERR[v] for v in VARIANTS], 0.4,
        label="... from ΔW's part in the empty directions")
ax2.set_xticks(xs, TICKS, fontsize=8)
ax2.set_ylabel("relative output error")
ax2.legend(fontsize=7)
fig

# %% [markdown]
# Left: the calibration spectrum falls off a cliff (384 tokens cannot fill more
# directions, and most of those they fill are nearly empty), while the held-out prose
# keeps energy along the small-eigenvalue directions, far above the calibration's own
# there (the dots over the curve's tail). Weak damping (dotted line) makes everything below it nearly free.
# The table and the right panel: GPTQ with weak damping moves more of its weight error
# into the empty directions than RTN's rounding puts there, and that part alone costs
# about as much held-out output error as RTN's whole error: the prose has only a small
# share of its energy there, but the error GPTQ parks there is large. Damping with the
# mean diagonal (dashed line) puts a floor under the eigenvalues, so the empty
# directions are no longer free.
#
# ## 4. The fix on one layer: damping, more data, varied data
#
# Still layer 28's `down_proj`, held-out error on the same prose, against RTN's. Three
# ways to price the empty directions: damp more; calibrate on more tokens (768 chat
# tokens instead of 384); calibrate on varied text (192 chat tokens plus 192 prose
# tokens from a part of the corpus that is not held out).

# %%
sets = {"384 chat tokens": X_CAL[n][:384], "768 chat tokens": X_CAL[n],
        "192 chat + 192 prose tokens": torch.cat([X_CAL[n][:192], X_MIX[n]])}
FIX = {("384 chat tokens", 0.01): ERR[n, AUTO][1], ("384 chat tokens", 1.0): ERR[n, DAMPED][1]}
rtn_held = ERR[n, "RTN"][1]
print(f"| calibration | GPTQ settings | held-out error | / RTN's ({rtn_held:.4f}) |\n|---|---|---|---|")
for label, x in sets.items():
    for pd, v in ((0.01, AUTO), (1.0, DAMPED)):
        if pd == 1.0 and label != "384 chat tokens":
            continue                   # damped GPTQ already beats RTN with the smallest set
        if (label, pd) not in FIX:
            FIX[label, pd] = out_err(X_HELD[n], W[n], quantize(n, VARIANTS[v], x))
        print(f"| {label} | {v.removeprefix('GPTQ, ')} | {FIX[label, pd]:.4f} | "
              f"{FIX[label, pd] / rtn_held:.2f} |")

# %% [markdown]
# Each lever helps. Twice the chat data shrinks the weak-damping overfit; swapping half
# of the chat tokens for prose (the held-out *kind* of text, not the held-out text
# itself) does far more, enough for weak damping to beat RTN; and `percdamp=1.0` beats
# RTN already with the smallest set. AutoGPTQ #650 is this table at the scale of an 8B
# model: c4 calibration, wikitext2 evaluation, perplexity 17.5; wikitext2 calibration,
# 6.62.
#
# ## 5. The whole model: RTN against GPTQ, weak and damped
#
# Full-model GPTQ quantizes 120 layers layer by layer (each calibrated on the outputs of
# the already quantized layers below it, as the GPTQ reference does) on 4,096 tokens of
# the chat conversations; that takes 41-52 s on an idle 2-core machine
# (`benchmarks/RESULTS.md`), most of a chapter's budget for one model. So both GPTQ
# checkpoints are built **once** with `LLM.save_quantized` and cached
# (`cached_quantized`, keyed by a sha256 of the source weights, options, calibration
# token ids and the quantizer's code; `make quantized` builds them ahead), and
# `LLM(path)` loads the stored int4 tensors. RTN needs no calibration and quantizes on
# load. Measured here against the float32 engine, as in chapter 15: **KL** on prose
# windows (CI by resampling windows) and **answer KL** at the answer positions of QA
# prompts followed by float32's own greedy answer (CI by resampling questions). Greedy
# **QA accuracy** needs a generation per model, the most expensive measure on a CPU, and
# a sample small enough for this notebook has CIs some 40-50 points wide; so its column is
# the full set measured by `python benchmarks/quantization.py` (`benchmarks/RESULTS.md`,
# 176 questions, 24 tokens, 2026-11-30), with 95 % intervals computed here (Wilson).

# %%
t = time.perf_counter()
GPTQ_WEAK = {"group_size": GROUP, "symmetric": True, "act_order": False, "percdamp": 0.01}
GPTQ_FIX = {"group_size": GROUP, "symmetric": True, "act_order": True, "percdamp": 1.0}
PATHS = {"GPTQ, AutoGPTQ defaults": cached_quantized(MODEL, "gptq", GPTQ_WEAK),
         "GPTQ, act-order + damp 1.0": cached_quantized(MODEL, "gptq", GPTQ_FIX)}
print(f"GPTQ checkpoints ready in {time.perf_counter() - t:.1f} s (hash-checked): "
      f"{', '.join(p.name for p in PATHS.values())}")

windows = evalsets.corpus_sequences(tok, seq_len=64, max_sequences=4)
qa = evalsets.load_qa()[::11]                      # every 11th question: all categories
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
                       "answer_kl_ci": (0.0, 0.0), "bytes": base.weight_bytes()["total"]}}
say(f"{len(windows)} prose windows x {len(windows[0])} tokens; {len(qa)} QA prompts with "
    f"float32's greedy answers ({sum(map(len, answer_rows))} answer positions; float32 answers "
    f"{sum(base_ok):.0f} of them correctly)",
    f"{len(windows)} 个普通文本窗口 x {len(windows[0])} 个 token；{len(qa)} 个 QA 提示词，附 "
    f"float32 的贪心答案（{sum(map(len, answer_rows))} 个答案位置；float32 答对其中 "
    f"{sum(base_ok):.0f} 题）")
# Greedy QA accuracy on all 176 questions, from benchmarks/RESULTS.md (weight quantization
# table; `python benchmarks/quantization.py`): float32, int4-sym-g128, gptq-sym-g128-damp0.01,
# gptq-sym-g128-actorder-damp1.
QA_FULL = {"float32": 1.0, "int4 RTN sym g128": 0.460, "GPTQ, AutoGPTQ defaults": 0.256,
           "GPTQ, act-order + damp 1.0": 0.534}
N_QA = 176


def wilson(p, n, z=1.96):
    """95 % Wilson score interval of a proportion p measured on n items."""
    c = (p + z * z / (2 * n)) / (1 + z * z / n)
    h = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return c - h, c + h


def evaluate(name, llm):
    rows = llm.score(windows, output="logits")
    kl = [metrics.kl_divergence(r, c).numpy() for r, c in zip(REF["windows"], rows)]
    top1 = float(np.mean(np.concatenate([(r.argmax(-1) == c.argmax(-1)).numpy()
                                         for r, c in zip(REF["windows"], rows)])))
    ans = llm.score(qa_seqs, output="logits", positions=answer_rows)
    akl = [float(metrics.kl_divergence(r, c).mean()) for r, c in zip(REF["answers"], ans)]
    RESULTS[name] = {"kl": float(np.concatenate(kl).mean()), "kl_ci": metrics.bootstrap_ci(kl),
                     "kl_rows": kl, "top1": top1, "answer_kl": float(np.mean(akl)),
                     "answer_kl_ci": metrics.bootstrap_ci(akl),
                     "bytes": llm.weight_bytes()["total"]}


for name, kw in (("int4 RTN sym g128", dict(model=MODEL, quantization="int4",
                                            quantization_config={"group_size": GROUP,
                                                                 "symmetric": True})),
                 *((k, dict(model=str(p))) for k, p in PATHS.items())):
    llm = LLM(**kw, **COMMON)
    evaluate(name, llm)
    del llm
    gc.collect()

E2E = ["float32", "int4 RTN sym g128", *PATHS]
print("| weights | KL prose (nats) [95% CI] | top-1 agree | answer KL [95% CI] | QA accuracy, "
      "176 questions (RESULTS.md) [95% CI] | weight MB |\n|---|---|---|---|---|---|")
for k in E2E:
    r = RESULTS[k]
    r["acc"], r["acc_ci"] = QA_FULL[k], wilson(QA_FULL[k], N_QA)
    print(f"| {k} | {r['kl']:.3g} [{r['kl_ci'][0]:.3g}, {r['kl_ci'][1]:.3g}] | {100 * r['top1']:.1f}% | "
          f"{r['answer_kl']:.3g} [{r['answer_kl_ci'][0]:.3g}, {r['answer_kl_ci'][1]:.3g}] | "
          f"{100 * r['acc']:.1f}% [{100 * r['acc_ci'][0]:.1f}, {100 * r['acc_ci'][1]:.1f}] | "
          f"{r['bytes'] / 1e6:.0f} |")


r_rtn, r_weak, r_fix = (RESULTS[k] for k in E2E[1:])

# %%
fig = Figure(figsize=(11, 3.4), layout="constrained")
ax1, ax2 = fig.subplots(1, 2)
for k in E2E[1:]:
    kl = np.concatenate(RESULTS[k]["kl_rows"])
    ax1.hist(np.log10(np.maximum(kl, 1e-6)), bins=50, alpha=0.5, label=f"{k} (mean {kl.mean():.3g})")
ax1.set_xlabel("log10 KL(float32 || int4) per prose position (nats)")
ax1.set_ylabel("positions")
ax1.legend(fontsize=7)
xs = np.arange(len(E2E) - 1)
for j, (key, ci, lab) in enumerate((("kl", "kl_ci", "KL prose"),
                                     ("answer_kl", "answer_kl_ci", "answer KL"))):
    vals = [RESULTS[k][key] for k in E2E[1:]]
    err = np.array([[v - RESULTS[k][ci][0], RESULTS[k][ci][1] - v] for v, k in zip(vals, E2E[1:])]).T
    ax2.bar(xs + (j - 0.5) * 0.4, vals, 0.4, yerr=err, capsize=3, label=lab)
ax2.set_xticks(xs, ["RTN", "GPTQ\nAutoGPTQ defaults", "GPTQ\nact-order + damp 1.0"], fontsize=8)
ax2.set_ylabel("nats (95% CI)")
ax2.legend(fontsize=8)
fig

# %% [markdown]
# The full-model numbers follow the per-layer ones. With AutoGPTQ's defaults GPTQ is not
# better than RTN end to end (its KL and answer-KL intervals overlap RTN's), although
# it fits its calibration inputs better than RTN (the two layers above; `benchmarks/RESULTS.md`:
# 2-6x lower calibration error over all layers); damped
# and in act-order it is clearly better on both KLs.
#
# The weak configuration is also *unstable*. When this chapter was written, its
# checkpoint built with one CPU thread gave KL 0.745 [0.576, 0.914] and answer KL 0.46 on
# these windows and prompts; rebuilt with two threads (a different summation order for
# the Hessian, nothing else changed) it gives the numbers above. The damped checkpoint
# moved far less between builds (the current one's KL is printed above).
# Weak damping leaves the Hessian's inverse ill-conditioned, so rounding noise in `H`
# moves the codes; IST-DASLab/gptq #1 saw the same across GPUs. (To see it: `OMP_NUM_THREADS=1
# python -m minivllm.quantization.checkpoint gptq '{"group_size": 128, "symmetric": true,
# "act_order": false, "percdamp": 0.01}' --rebuild`, then run this section again.)
# On greedy QA (the full set, RESULTS.md) the weak configuration loses to RTN with
# non-overlapping intervals and the damped one is ahead on the point estimate (53.4 %
# against RTN's 46.0 %, intervals overlapping); the other RESULTS.md rows at g128:
# act-order with damp 0.01 30.7 %, damp 0.1 38.6 %, and perplexity ratios 1.57 (RTN),
# 1.75 (AutoGPTQ defaults), 1.44, 1.41, 1.28 (damp 1.0) (chapter 15 found that RESULTS.md's AWQ
# g128 accuracy did not reproduce with later code, 47.7 % then and 59.7 % with
# `benchmarks/qa_inversion.py`; the GPTQ rows were not re-run).
#
# **Greedy QA against KL.** Chapter 15, section 7, took the inversion
# apart (`python benchmarks/qa_inversion.py`): answers flip at float32's own near-ties,
# mostly in the opening words, on a set built from questions float32 answers, so a
# greedy score reads a few coin tosses that KL does not order. For GPTQ at g128 the full
# set does not invert (damped GPTQ wins on KL and is ahead on QA); at g64 it does (RESULTS.md:
# damped GPTQ g64 46.0 % against RTN sym g64 65.3 %, with less than half the KL). Read
# such a difference paired (the same questions, lost against gained, with a sign test,
# as `benchmarks/qa_inversion.py` does), not as two percentages.
#
# ## 6. Claim vs measurement

# %%
o5, w28 = NAMES
kept = {k: RESULTS[k]["acc"] / RESULTS["float32"]["acc"] for k in E2E[1:]}
lo_fix, hi_fix = (v / RESULTS["float32"]["acc"] for v in r_fix["acc_ci"])
claims = [
    (Bi("AWQ / modern methods keep over 95 % of the original performance at 4 bits "
        "(seed 000 §2.4.4)",
        "AWQ / 现代方法在 4 位下能保留 95 % 以上的原始性能（种子课程 000 §2.4.4）"),
     Bi(f"not on this 135M model: damped GPTQ g128 keeps {kept['GPTQ, act-order + damp 1.0']:.0%} "
        f"of float32's correct QA answers [CI {lo_fix:.0%}, {hi_fix:.0%}] (176 questions, "
        f"RESULTS.md), with AutoGPTQ's defaults {kept['GPTQ, AutoGPTQ defaults']:.0%}; top-1 "
        f"agreement on prose {100 * r_fix['top1']:.0f}% (measured here); AWQ 47.7-73.3 % "
        "(chapter 15)",
        f"在这个 135M 模型上不成立：加阻尼的 GPTQ g128 保留了 float32 答对的 QA 题中的 "
        f"{kept['GPTQ, act-order + damp 1.0']:.0%} [CI {lo_fix:.0%}, {hi_fix:.0%}]（176 道题，"
        f"RESULTS.md），采用 AutoGPTQ 默认设置时为 {kept['GPTQ, AutoGPTQ defaults']:.0%}；普通文本上的 top-1 "
        f"一致率 {100 * r_fix['top1']:.0f}%（本次实测）；AWQ 为 47.7-73.3 %"
        "（第 15 章）")),
    (Bi("GPTQ minimises each layer's error, so it beats round-to-nearest",
        "GPTQ 让每一层的误差最小，所以它胜过就近取整量化（RTN）"),
     Bi(f"on the calibration data, yes ({w28}: {ERR[w28, AUTO][0]:.3f} against RTN's "
        f"{ERR[w28, 'RTN'][0]:.3f}); on held-out prose AutoGPTQ's defaults are worse "
        f"({ERR[w28, AUTO][1]:.3f} against {ERR[w28, 'RTN'][1]:.3f}; {o5}: {ERR[o5, AUTO][1]:.3f} "
        f"against {ERR[o5, 'RTN'][1]:.3f}); end to end KL {r_weak['kl']:.3g} against RTN's "
        f"{r_rtn['kl']:.3g}; full set (RESULTS.md): perplexity ratio 1.75 against 1.57, QA "
        "25.6 % against 46.0 %",
        f"在校准数据上是的（{w28}：{ERR[w28, AUTO][0]:.3f}，RTN 为 "
        f"{ERR[w28, 'RTN'][0]:.3f}）；在留出的普通文本上，AutoGPTQ 默认设置更差"
        f"（{ERR[w28, AUTO][1]:.3f} 对 {ERR[w28, 'RTN'][1]:.3f}；{o5}：{ERR[o5, AUTO][1]:.3f} "
        f"对 {ERR[o5, 'RTN'][1]:.3f}）；端到端 KL {r_weak['kl']:.3g}，RTN 为 "
        f"{r_rtn['kl']:.3g}；完整题集（RESULTS.md）：困惑度比 1.75 对 1.57，QA "
        "25.6 % 对 46.0 %")),
    (Bi("act-order is what fixes GPTQ", "修好 GPTQ 的是 act-order"),
     Bi(f"not alone: act-order at damp 0.01 leaves {w28}'s held-out error at "
        f"{ERR[w28, ACT][1]:.3f} (RTN {ERR[w28, 'RTN'][1]:.3f}); damping "
        f"1.0 brings it to {ERR[w28, DAMPED][1]:.3f}; full model (RESULTS.md): act-order alone "
        "KL 0.361, with damp 1.0 0.303, RTN 0.588",
        f"单靠它不行：damp 0.01 下的 act-order 让 {w28} 的留出误差停在 "
        f"{ERR[w28, ACT][1]:.3f}（RTN {ERR[w28, 'RTN'][1]:.3f}）；阻尼 "
        f"1.0 把它降到 {ERR[w28, DAMPED][1]:.3f}；完整模型（RESULTS.md）：单开 act-order "
        "KL 0.361，加 damp 1.0 为 0.303，RTN 为 0.588")),
    (Bi("128 calibration samples are enough (AutoGPTQ #650's advice)",
        "128 条校准样本就够了（AutoGPTQ #650 的建议）"),
     Bi(f"the count is not the point, coverage is: with weak damping, doubling the chat "
        f"tokens moves {w28}'s held-out error from {FIX['384 chat tokens', 0.01]:.3f} to "
        f"{FIX['768 chat tokens', 0.01]:.3f}, swapping half of them for prose to "
        f"{FIX['192 chat + 192 prose tokens', 0.01]:.3f} (RTN {rtn_held:.3f}); the full model "
        "with 4,096 chat tokens still loses to RTN on QA and perplexity (RESULTS.md)",
        f"关键不在数量，而在覆盖面：弱阻尼下，把对话 token 加倍使 {w28} 的留出误差从 "
        f"{FIX['384 chat tokens', 0.01]:.3f} 变为 {FIX['768 chat tokens', 0.01]:.3f}，"
        f"把其中一半换成普通文本则变为 "
        f"{FIX['192 chat + 192 prose tokens', 0.01]:.3f}（RTN {rtn_held:.3f}）；用 4,096 个对话 "
        "token 的完整模型在 QA 和困惑度上仍输给 RTN（RESULTS.md）")),
    (Bi("a quantizer cannot overfit: it has no trainable parameters",
        "量化器不会过拟合：它没有可训练的参数"),
     Bi(f"it fits 4-bit codes to one Hessian: {SHARE[AUTO]:.0%} of weak GPTQ's weight error on "
        f"{w28} lies in directions the calibration set leaves empty (RTN {SHARE['RTN']:.0%}), "
        f"and that part alone costs a held-out output error of {EMPTY_ERR[AUTO]:.3f} (RTN's whole "
        f"error: {ERR[w28, 'RTN'][1]:.3f}), though held-out inputs carry only {held_empty:.1%} of "
        "their energy there",
        f"它把 4 位编码拟合到一个 Hessian 上：弱阻尼 GPTQ 在 {w28} 上的权重误差有 {SHARE[AUTO]:.0%} "
        f"落在校准集留空的方向（RTN {SHARE['RTN']:.0%}），"
        f"仅这一部分就造成 {EMPTY_ERR[AUTO]:.3f} 的留出输出误差（RTN 的全部"
        f"误差：{ERR[w28, 'RTN'][1]:.3f}），而留出输入在那里的能量只占 {held_empty:.1%}")),
    (Bi("damped GPTQ beats RTN end to end", "加阻尼的 GPTQ 端到端胜过 RTN"),
     Bi(f"here on KL {r_fix['kl']:.3g} [{r_fix['kl_ci'][0]:.3g}, {r_fix['kl_ci'][1]:.3g}] against "
        f"{r_rtn['kl']:.3g} [{r_rtn['kl_ci'][0]:.3g}, {r_rtn['kl_ci'][1]:.3g}] and answer KL "
        f"{r_fix['answer_kl']:.3g} against {r_rtn['answer_kl']:.3g}; QA (RESULTS.md, 176 "
        f"questions) {100 * r_fix['acc']:.1f}% [{100 * r_fix['acc_ci'][0]:.1f}, "
        f"{100 * r_fix['acc_ci'][1]:.1f}] against {100 * r_rtn['acc']:.1f}% "
        f"[{100 * r_rtn['acc_ci'][0]:.1f}, {100 * r_rtn['acc_ci'][1]:.1f}]",
        f"这里 KL 为 {r_fix['kl']:.3g} [{r_fix['kl_ci'][0]:.3g}, {r_fix['kl_ci'][1]:.3g}]，对 "
        f"{r_rtn['kl']:.3g} [{r_rtn['kl_ci'][0]:.3g}, {r_rtn['kl_ci'][1]:.3g}]；答案 KL "
        f"{r_fix['answer_kl']:.3g} 对 {r_rtn['answer_kl']:.3g}；QA（RESULTS.md，176 "
        f"道题）{100 * r_fix['acc']:.1f}% [{100 * r_fix['acc_ci'][0]:.1f}, "
        f"{100 * r_fix['acc_ci'][1]:.1f}] 对 {100 * r_rtn['acc']:.1f}% "
        f"[{100 * r_rtn['acc_ci'][0]:.1f}, {100 * r_rtn['acc_ci'][1]:.1f}]")),
]
claims_table(claims, header=(Bi("claim", "论断"), Bi("measured", "实测")))

# %% [markdown]
# ## Common misconceptions
#
# - *"Lower calibration error means a better quantized model."* The calibration error is
#   a training error. Measure each layer's output error on text the quantizer did not
#   see (section 2), and the model's KL on such text (section 5).
# - *"Damping is a numerical safeguard for the Cholesky."* It is that, and here it is
#   also the regulariser: `percdamp` is the price of error in directions the calibration
#   set did not visit. 0.01 was chosen for 7B+ models calibrated on 128 x 2048 tokens,
#   whose Hessians are well filled; a small calibration set on a wide layer needs more.
# - *"Act-order is about accuracy, damping about stability."* On this model act-order
#   alone barely moves the held-out error; the damping does the work (section 2, and the
#   RESULTS.md rows).
# - *"Any text will do for calibration."* GPTQ fits the calibration distribution; chat
#   calibration leaves prose directions empty (sections 3-4), c4 calibration left
#   wikitext2 worse (AutoGPTQ #650). Calibrate on what the model will serve, or on a mix.
# - *"GPTQ is always at least as good as RTN."* With AutoGPTQ's defaults on a small
#   calibration set it was worse here, end to end (RESULTS.md: perplexity ratio 1.75
#   against 1.57).
# - *"A 4-bit checkpoint keeps 95 %."* Not a 135M model: measure retention per model and
#   task (section 6).
#
# ## Lab
#
# `labs/source/ch16/` starts from GPTQ with AutoGPTQ's defaults on two layers. You write
# the Hessian, GPTQ's column sweep (damping and act-order included) and the held-out
# error, then choose the settings; the grader plugs your GPTQ into the engine as a
# calibrated quantization method and checks, on prose you have not seen, that it beats
# RTN where the weak-damping configuration does not.
#
# ## On real vLLM
#
# - Serve a GPTQ checkpoint as it is: vLLM reads its `quantization_config` and, where it
#   can, converts it to the `gptq_marlin` kernel at load ("The model is convertible to
#   gptq_marlin during runtime"); an explicit `--quantization gptq` forces the older
#   kernel (its log: "however you specified quantization=gptq explicitly, so forcing
#   gptq"). Two kernels can round differently: compare them on `prompt_logprobs` KL,
#   with short and long prompts (vllm #10656 failed on short prompts only).
# - The settings of this chapter live in the checkpoint, not in vLLM: AutoGPTQ's and
#   GPTQModel's `quantize_config` carry `damp_percent` (often 0.01) and `desc_act`
#   (act-order); llm-compressor's `GPTQModifier` has `dampening_frac` and `actorder`.
#   Read them before serving a checkpoint someone else made.
# - Gate on text that was not the calibration set: `prompt_logprobs` KL and answer KL
#   against the 16-bit model on held-out prompts, as section 5 does (vLLM's INT8 W8A8
#   guide: calibration data should closely match your deployment data).
# - Checked against vLLM's `gptq_marlin.py` log lines (v0.6.3 and v0.11.0), its
#   quantization docs and llm-compressor's `GPTQModifier` reference (0.7). This engine
#   runs its own GPTQ (`percdamp=1.0`, `act_order=True` by default), caches the
#   checkpoint and multiplies by the dequantized weight: no Marlin kernel.

# %%
print(f"chapter 16 ran in {time.perf_counter() - T0:.0f} s")
