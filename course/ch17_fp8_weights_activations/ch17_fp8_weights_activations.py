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
# # Chapter 17. FP8 weights and activations: static vs dynamic scales, calibration
#
# **Learning goals.** After this chapter you can
#
# 1. say what a W8A8 fp8 linear layer computes: e4m3 weights with a per-tensor or
#    per-channel scale, an e4m3 copy of the *input* with its own scale, a float32
#    accumulator, `y = (x_q · w_q^T) · s_x · s_w`;
# 2. tell the two kinds of activation scale apart: **static** (one number per layer,
#    calibrated offline and shipped as the checkpoint's `input_scale`) and **dynamic**
#    (computed from each token's own `amax / 448` at run time);
# 3. find this model's natural activation outlier (layer 11's `down_proj` input passes
#    2,800 while e4m3 ends at 448) and predict what a missing scale (1.0) does to it:
#    saturation, at one token per sequence;
# 4. measure static against dynamic, per-tensor against per-channel, a calibration set
#    that does not match the traffic, and a missing scale, by KL and QA accuracy with
#    confidence intervals;
# 5. answer the seed's claim that fp8 weights hurt less than an fp8 KV cache with this
#    model's numbers;
# 6. say when W8A8 makes a request's output depend on the other requests of its step: a
#    per-tensor dynamic activation scale does, a per-token one does not, and what is
#    left is the GEMM's accumulation (int32 exact, float32 not always).
#
# **The incidents, from public sources.**
#
# - **Scales that are not delivered**: NVIDIA/TensorRT-LLM PR #16916
#   passed `None` for the fp8 KV scale buffers (GSM8K 96.44 → 74.45, 96.89 once buffers
#   of 1.0 were passed); sgl-project/sglang #18818 loaded scales that never reached the
#   kernel; sglang PR #20705 fell back to 1.0 when a float was assigned over the scale
#   parameter; flashinfer-ai/flashinfer #1023 dropped scales passed positionally. Chapter 18
#   plants that on the KV cache; this chapter plants it on the weight side: a checkpoint
#   ships a calibrated `input_scale` per layer, and the engine quantizes with 1.0.
# - **Static scales that the traffic outgrows**: vllm-project/vllm PR #4570 "Make static
#   FP8 scaling more robust" (2024-05-03): a Mixtral-8x7B fp8 checkpoint whose activation
#   scales were calibrated on ultrachat scored **0.2295 on MMLU** (chance) because
#   activations larger than the calibrated maximum overflowed e4m3 into NaN; the fix
#   clamps (saturates) at ±448. vllm #4614 (2024-05-06) reported the same as "always
#   returns invalid tokens in FP8 static mode". This engine saturates (as vLLM does
#   since), so here the cost is saturation, not NaN.
# - **vllm PR #33972** (2026-02-06): NVFP4 checkpoints of dense Qwen3
#   models overflowed fp16 in the GEMM; the fix scales the input **dynamically** before
#   the GEMM. Dynamic scaling is this chapter's fix too.
# - **The seed course** (000 §2.4.3): FP8 weights plus an FP8 KV cache take a task from
#   92 % to 89 %; FP8 weights with the KV cache back in FP16 give 91.5 %, so "the weights
#   hurt less than the KV cache". Section 6 measures the three configurations here.
#
# **What this model does on its own, said up front.** SmolLM2 has a *massive activation*:
# at the first token of every sequence, the input of layer 11's `down_proj` reaches about
# 2,800-3,000 (layers 28 and 29: about 2,400 and 460, printed below), while every other
# linear input of every token stays below ~110. e4m3's largest value is 448. So a missing scale *does*
# saturate on this model, naturally, at one token per sequence: no planted weights are
# needed. The missing scale itself is planted through the step registry
# (`faults.input_scale_dropped`, on the `"fp8.linear"` step), since the engine delivers
# its scales correctly.
#
# Everything below is measured when the notebook runs, on the embedded
# SmolLM2-135M-Instruct with minivllm on this machine's CPU, model in float32, except the
# numbers marked as taken from `benchmarks/RESULTS.md` (the command is given there).

# %%
# %matplotlib inline
import gc
import time

import numpy as np
import torch
from matplotlib.figure import Figure

from minivllm import LLM, SamplingParams
from minivllm.i18n import Bi, claims_table, say
from minivllm.layers.linear import QuantLinear
from minivllm.precision import evalsets, faults, metrics
from minivllm.quantization import weight_quant as wq
from minivllm.quantization.calibration import (calibration_forward, calibration_sequences,
                                               observe_inputs)
from minivllm.quantization.checkpoint import cached_quantized
from minivllm.quantization.quantize import target_layers
from minivllm.quantization.w8a8 import fp8_linear_ref, fp8_static_input_scale

torch.manual_seed(0)
T0 = time.perf_counter()
MODEL = "smollm2-135m-instruct"
COMMON = dict(dtype="float32", max_model_len=512, kv_cache_memory_bytes=32 << 20)

t = time.perf_counter()
STATIC_PATH = cached_quantized(MODEL, "fp8", {"activation_scheme": "static"})
print(f"fp8 static checkpoint (calibrated on 4,096 tokens of the bundled chats) ready in "
      f"{time.perf_counter() - t:.1f} s, hash-checked: {STATIC_PATH.name}")
ref = LLM(MODEL, **COMMON)                       # float32 weights and KV: the reference
st = LLM(str(STATIC_PATH), **COMMON)             # fp8 W8A8, static input scales
tok = ref.get_tokenizer()
windows = evalsets.corpus_sequences(tok, seq_len=48)[40:43]   # prose the calibration never saw
FP8_LAYERS = {n: m for n, m in st.llm_engine.model_runner.model.named_modules()
              if isinstance(m, QuantLinear)}
print(f"{len(FP8_LAYERS)} fp8 linear layers; evaluation: {len(windows)} corpus windows of "
      f"{len(windows[0])} tokens (corpus tokens {40 * 48}-{43 * 48 - 1})")

# %% [markdown]
# ## 1. What an fp8 linear layer stores, and what this model feeds it
#
# `minivllm/quantization/weight_quant.py` follows vLLM's `Fp8LinearMethod` and
# `QuantFP8`: the weight is stored as `w_q = e4m3(w / s_w)` with `s_w = amax(w) / 448`
# (per tensor, or one per output row); at run time the input is quantized the same way,
# `x_q = e4m3(clamp(x / s_x, ±448))`, the product is accumulated in float32 and scaled
# back by `s_x · s_w`. e4m3 has 3 mantissa bits: inside its normal range
# `[2^-6, 448]` every value is rounded with the same *relative* error (at most 2^-4);
# below `2^-6` the subnormals have a fixed step of `2^-9`; above 448 it saturates.
# A scale slides that window over the data; it does not make the grid finer.
#
# The float32 model's linear inputs on the three evaluation windows, recorded with a
# forward pre-hook on each layer:

# %%
seen = {}
hooks = [m.register_forward_pre_hook(
    lambda mod, args, name=name: seen.setdefault(name, []).append(args[0].detach().reshape(-1, args[0].shape[-1])))  # noqa: F821 (del below)
    for name, m in target_layers(ref.llm_engine.model_runner.model).items()]
REF = ref.score(windows, output="logits")
for h in hooks:
    h.remove()
X = {name: torch.cat(v) for name, v in seen.items()}     # [3 * 48 tokens, in_features] per layer
del seen
amax_tok = {name: x.abs().amax(-1) for name, x in X.items()}
per_layer = {name: float(a.max()) for name, a in amax_tok.items()}
above = {name: v for name, v in per_layer.items() if v > 448}
starts = [i * len(windows[0]) for i in range(len(windows))]
for name, v in sorted(above.items(), key=lambda kv: -kv[1]):
    tokens = (amax_tok[name] > 448).nonzero().flatten().tolist()
    print(f"{name}: max |x| = {v:,.0f}, above 448 at rows {tokens} (window starts: {starts})")
rest = max(v for n, v in per_layer.items() if n not in above)
ch11 = X["layers.11.mlp.down_proj"][0].abs().topk(3)
print(f"every other linear input, every token: max |x| = {rest:.1f}")
others = [i for i in range(X["layers.11.mlp.down_proj"].shape[0]) if i not in starts]
print(f"layer 11 down_proj, first token: the largest channels {ch11.indices.tolist()} hold "
      f"{[round(v) for v in ch11.values.tolist()]}; the same channels at the other tokens: "
      f"max {float(X['layers.11.mlp.down_proj'][others][:, ch11.indices].abs().max()):.2f}")

# %%
names = list(per_layer)
fig = Figure(figsize=(10, 3.4), layout="constrained")
ax = fig.add_subplot()
for kind, marker in (("qkv_proj", "o"), ("o_proj", "s"), ("gate_up_proj", "^"), ("down_proj", "D")):
    idx = [i for i, n in enumerate(names) if n.endswith(kind)]
    ax.scatter([int(names[i].split(".")[1]) for i in idx], [per_layer[names[i]] for i in idx],
               marker=marker, label=kind, s=22)
ax.axhline(448, color="C3", ls="--")
ax.text(0, 448, " e4m3 max 448: above it, scale 1.0 saturates", color="C3", va="bottom", fontsize=8)
ax.axhline(2.0 ** -6, color="C7", ls=":")
ax.text(0, 2.0 ** -6, " 2^-6: below it, scale 1.0 stores subnormals", color="C7", va="bottom", fontsize=8)
ax.set_yscale("log")
ax.set_xlabel("decoder layer")
ax.set_ylabel(f"max |input| over {sum(map(len, windows))} tokens")
ax.set_title("SmolLM2's linear inputs: three down_proj layers pass e4m3's range, at the first token")
ax.legend(fontsize=8, ncol=4, loc="upper center")
fig

# %% [markdown]
# The outlier is a property of the model, not of the text: it appears at the first
# token of every window (a mid-sentence token of prose here; `<|im_start|>` in a chat),
# in a few channels, the "massive activation" that many LLMs grow at the first position
# and use as an attention sink (Sun et al. 2024, "Massive Activations in Large Language
# Models", arXiv:2402.17762). Nothing else comes within a factor of four of 448.
#
# ## 2. What a scale of 1.0 does to these inputs
#
# Quantize layer 11's `down_proj` inputs three ways: the checkpoint's calibrated static
# scale, scale 1.0 (no scale delivered), and dynamic per-token scales. Then compare the
# layer's output with float32, at the first token and at the others.

# %%
name = "layers.11.mlp.down_proj"
lay = FP8_LAYERS[name]
x = X[name]
w_f32 = ref.llm_engine.model_runner.model.get_submodule(name).weight.detach()
y_f32 = x @ w_f32.T
cal = lay.input_scale
rows_first, rows_rest = starts, others


def out_err(scale):
    y = fp8_linear_ref(x, lay.qweight, lay.weight_scale, scale, None)
    e = (y - y_f32).norm(dim=-1) / y_f32.norm(dim=-1)
    return float(e[rows_first].mean()), float(e[rows_rest].median())


print(f"{name}: calibrated input_scale {float(cal):.3f} (= amax {float(cal) * 448:,.0f} / 448)")
print("| input scale | first token: stored max | saturated | below 2^-6 (subnormal or 0) | "
      "relative output error, first tokens | other tokens (median) |\n|---|---|---|---|---|---|")
for label, s in (("calibrated static", cal), ("1.0 (not delivered)", torch.tensor(1.0)),
                 ("dynamic per token", None)):
    q, sx = wq.quantize_fp8_activation(x, s)
    back = q.float() * sx
    # saturated: beyond 464, the midpoint between e4m3's max 448 and the step above it
    # (480); a value up to 464 rounds to 448 anyway (dynamic s = amax / 448 puts the row
    # maximum at 448 up to the last bit of s, which is rounding, not saturation)
    sat = int((x.abs() / sx > 464).sum())
    sub = float((x.abs() < 2.0 ** -6 * sx).float().mean())
    e_first, e_rest = out_err(s)
    print(f"| {label} | {float(back[0].abs().max()):,.1f} | {sat} values | {sub:.1%} | "
          f"{e_first:.3f} | {e_rest:.4f} |")

# %% [markdown]
# With 1.0 the first token's outlier (2,949 in section 1) is stored as 448: that
# token's `down_proj` output is wrong by a large fraction of its norm (the table's
# first-token column). At the other tokens 1.0 costs about nothing (the last column:
# about the dynamic row's error): their inputs stay below 448, and a floating-point format
# gives the same relative precision anywhere in its normal range. Look at the calibrated
# row instead: its scale is stretched so that the first token's ~3,000 fits, which puts
# most of the *other* tokens' inputs below `2^-6 · s`, in the subnormals, and their
# output error is no better than with 1.0 (compare the last column). Dynamic per-token
# scales avoid both: each token gets a grid that fits it. So for activations, unlike
# int8, the value of a scale matters where it decides saturation (here the first token
# of each sequence, in three layers) and where one scale must serve tokens of very
# different size.
#
# ## 3. The missing scale, end to end (the planted fault)
#
# `faults.input_scale_dropped(llm, layers=None)` swaps the `"fp8.linear"` step of the
# static engine for one that quantizes with 1.0 whatever `input_scale` the layer holds
# (the engine's own scales stay loaded: the fault is in the delivery, as in the
# incidents). Score the windows with it planted in every layer, and only in the three
# layers whose inputs pass 448. Per-position KL against float32, separated into the
# first position of each window and the rest; 95 % CIs by resampling blocks of 16
# positions.

# %%
RES = {}


def kl_rows(rows):
    return [metrics.kl_divergence(a, b).numpy() for a, b in zip(REF, rows)]


def record(label, rows):
    kl = kl_rows(rows)
    rest = np.concatenate([k[1:] for k in kl])
    allpos = np.concatenate(kl)
    RES[label] = {"kl": float(allpos.mean()), "ci": metrics.bootstrap_ci(np.split(allpos, 9)),
                  "kl_rest": float(rest.mean()), "kl_first": float(np.mean([k[0] for k in kl])),
                  "top1": float(np.mean([metrics.top1_agreement(a, b) for a, b in zip(REF, rows)])),
                  "per_pos": kl}
    return RES[label]


DROP_ALL, DROP_3 = "static, scale dropped (all layers)", "static, scale dropped (layers 11, 28, 29)"
record("fp8 static (calibrated)", st.score(windows, output="logits"))
with faults.input_scale_dropped(st):
    record(DROP_ALL, st.score(windows, output="logits"))
with faults.input_scale_dropped(st, layers=[11, 28, 29]):
    record(DROP_3, st.score(windows, output="logits"))


def row(label):
    r = RES[label]
    return (f"| {label} | {r['kl']:.3g} [{r['ci'][0]:.3g}, {r['ci'][1]:.3g}] | {r['kl_first']:.3g} | "
            f"{r['kl_rest']:.3g} | {r['top1']:.1%} |")


HEAD = ("| W8A8 fp8 | mean KL, all positions [95% CI] | first position | other positions | "
        "top-1 agreement |\n|---|---|---|---|---|")
print(HEAD)
for label in ("fp8 static (calibrated)", DROP_ALL, DROP_3):
    print(row(label))

# %%
fig = Figure(figsize=(10, 3.2), layout="constrained")
ax = fig.add_subplot()
for label, c in (("fp8 static (calibrated)", "C0"), (DROP_ALL, "C3")):
    per = np.stack(RES[label]["per_pos"])           # [windows, positions]
    ax.semilogy(per.mean(0), color=c, label=label)
ax.set_xlabel("position in the window")
ax.set_ylabel(f"KL vs float32 (nats, mean of {len(windows)} windows)")
ax.set_title("A missing input scale: the first position breaks (saturation); the rest shifts a little")
ax.legend(fontsize=8)
fig

# %% [markdown]
# The missing scale costs the first position of each window several nats (its own
# next-token distribution is ruined by the saturated outlier) and raises the KL of the
# later positions by a smaller factor (the saturated token's keys and values are what
# the later tokens attend to). Planting the fault in the three saturating layers alone
# does the same damage as planting it everywhere: on this model a missing activation
# scale is a saturation problem, and the subnormals it creates elsewhere hardly count.
# Section 4 asks what greedy QA makes of it.
#
# ## 4. Static against dynamic, per tensor against per channel
#
# Three fp8 configurations of the same weights (vLLM's names):
#
# - **static, per-tensor weights**: the checkpoint above, one calibrated `input_scale`
#   per layer (`activation_scheme="static"`);
# - **dynamic, per-tensor weights**: the same fp8 weights, input scales computed per
#   token at run time (`activation_scheme="dynamic"`; vLLM's online `quantization="fp8"`
#   computes one dynamic scale per step instead, section 7). The per-tensor
#   weight scale does not depend on calibration, so this is the static engine with the
#   `"fp8.linear"` step given `x_scale=None` (`tests/test_fp8_input_scale.py` checks that
#   this is bit for bit the engine built with `quantization="fp8"`);
# - **dynamic, per-channel weights**: one weight scale per output row
#   (`granularity="channel"`); a third engine costs this chapter's budget more than it
#   teaches, so its row is the benchmark's (`python benchmarks/quantization.py`,
#   RESULTS.md, 2,560 positions).
#
# QA: greedy answers to 8 questions of the bundled QA set (every 22nd, across the
# categories; 12 tokens), CI by resampling questions. On a 2-core CPU a QA run costs
# more than everything else in a configuration, so only the runs that answer a question
# of this chapter get one (the missing scale and dynamic here; the KV cache and both in
# section 6; float32's answers are stored with the set); the 176-question accuracies come
# from the benchmark, with a binomial 95 % interval computed here.

# %%
qa = evalsets.load_qa()[::22]
qa_prompts = [evalsets.chat_prompt_ids(tok, evalsets.qa_prompt(it.question)) for it in qa]
greedy = SamplingParams(temperature=0.0, max_tokens=12)


def qa_acc(llm, label):
    outs = llm.generate(qa_prompts, greedy, use_tqdm=False)
    ok = [float(evalsets.answer_matches(o.outputs[0].text, it.answers)) for o, it in zip(outs, qa)]
    RES.setdefault(label, {}).update(acc=float(np.mean(ok)), acc_ci=metrics.bootstrap_ci(ok), ok=ok,
                                     texts=[o.outputs[0].text for o in outs])
    return RES[label]["acc"]


# float32 is not run again: the set stores its float32 answers (the HF reference, greedy,
# 24 tokens; evalsets/README.md), cut here to their first 12 tokens.
f32_texts = [tok.decode(tok.encode(it.reference_output, add_special_tokens=False)[:12]) for it in qa]
f32_ok = [float(evalsets.answer_matches(t, it.answers)) for t, it in zip(f32_texts, qa)]
RES["float32"] = {"acc": float(np.mean(f32_ok)), "acc_ci": metrics.bootstrap_ci(f32_ok), "ok": f32_ok}
say(f"float32 (stored answers, first 12 tokens): {RES['float32']['acc']:.0%} of {len(qa)} "
    f"questions ({', '.join(sorted({it.category for it in qa}))})",
    f"float32（存储的答案，前 12 个 token）：{len(qa)} 道题中答对 {RES['float32']['acc']:.0%}"
    f"（{', '.join(sorted({it.category for it in qa}))}）")


def dynamic(x, q_w, w_scale, x_scale, bias):
    """The "fp8.linear" step with the delivered static scale ignored: dynamic per token."""
    return fp8_linear_ref(x, q_w, w_scale, None, bias)


STATIC, DYN, CHAN = ("fp8 static (calibrated)", "fp8 dynamic, per-tensor weights",
                     "fp8 dynamic, per-channel weights")
with faults.input_scale_dropped(st):
    qa_acc(st, DROP_ALL)
with st.swap_step("fp8.linear", dynamic):
    record(DYN, st.score(windows, output="logits"))
    qa_acc(st, DYN)
BENCH_QA = {STATIC: 0.812, DYN: 0.858, CHAN: 0.847}   # RESULTS.md, 176 questions, 24 tokens


def bench_cell(label):
    if label not in BENCH_QA:
        return "-"
    p, n = BENCH_QA[label], 176
    half = 1.96 * (p * (1 - p) / n) ** 0.5                  # normal-approximation 95 % CI
    return f"{p:.1%} [{p - half:.1%}, {p + half:.1%}]"


def row_qa(label):
    r = RES[label]
    qa_cell = f"{r['acc']:.0%} [{r['acc_ci'][0]:.0%}, {r['acc_ci'][1]:.0%}]" if "acc" in r else "-"
    return row(label) + f" {qa_cell} | {bench_cell(label)} |"


QA_HEAD = (HEAD.replace("top-1 agreement |", f"top-1 agreement | QA, {len(qa)} questions [95% CI] | "
                        "QA, 176 [95% CI] (RESULTS) |").replace("|---|---|---|---|---|",
                                                       "|---|---|---|---|---|---|---|"))
print(QA_HEAD)
for label in (STATIC, DYN, DROP_ALL):
    print(row_qa(label))
print(f"| {CHAN} (not run here: RESULTS.md, 2,560 positions) | 0.0254 [0.0233, 0.0275] | - | - | "
      f"90.04% | - | {bench_cell(CHAN)} |")
_a, _b = RES[DROP_ALL]["acc_ci"], RES[DYN]["acc_ci"]
say(f"QA on {len(qa)} questions, missing scale against dynamic: the CIs "
    f"{'overlap' if _a[0] <= _b[1] and _b[0] <= _a[1] else 'do not overlap'}",
    f"{len(qa)} 道题上的 QA，缺失缩放因子对比动态：CI "
    f"{'重叠' if _a[0] <= _b[1] and _b[0] <= _a[1] else '不重叠'}")

# %% [markdown]
# Dynamic per-token scales have a lower KL than the calibrated static scale (on these
# 144 positions the CIs may touch; on the benchmark's 2,560 they are apart: 0.0241
# [0.022, 0.0262] against 0.0292 [0.0277, 0.0306]). Each token gets the grid that fits
# it, while a static scale is set by the largest token of the calibration set. Here that
# is the first-token outlier, so in layer 11's `down_proj` every other token is quantized
# on a grid stretched to about 3,000 (layer 28's, to about 2,400), and most of its values
# land in the subnormals (section 2's table: the calibrated static row).
# Per-channel weight scales do not help here (`benchmarks/RESULTS.md`, 2,560 positions:
# 0.0254 [0.0233, 0.0275] against 0.0241 [0.022, 0.0262] per tensor). The missing scale
# shows in KL, most of it at the first positions; in a chat the first token is
# `<|im_start|>`, whose own next-token prediction nobody reads, so what reaches an
# answer is the smaller shift of the later positions. Greedy QA cannot rank any of these
# (the line under the table says whether its intervals overlap): on a handful of
# questions a CI spans tens of points (the missing scale's row) or shrinks to one point
# when every answer is right (the dynamic row's [100 %, 100 %], no more certain for
# that), and even on the benchmark's 176 the intervals of the three schemes overlap.
#
# ## 5. Calibrated on one distribution, served on another
#
# The checkpoint's static scales come from the bundled chat conversations. Serve prose,
# and some layers see inputs larger than anything in the calibration set: those saturate,
# as in vllm PR #4570. Calibrate again on 512 tokens of the corpus (the corpus' start;
# the evaluation windows come later) with `fp8_static_input_scale(amax)` (`amax / 448`,
# the rule the engine applies), compare the two `amax` per layer, and score the prose
# windows with each set of scales.

# %%
model_f32 = ref.llm_engine.model_runner.model
with observe_inputs(target_layers(model_f32)) as obs:
    calibration_forward(model_f32, calibration_sequences(tok, "corpus", 512, 512))
amax_corpus = {n: o.amax for n, o in obs.items()}
amax_chat = {n: m.input_scale.clone() * 448 for n, m in FP8_LAYERS.items()}
ratio = {n: float(amax_corpus[n] / amax_chat[n]) for n in FP8_LAYERS}
grown = {n: r for n, r in ratio.items() if r > 1}
worst = sorted(grown.items(), key=lambda kv: -kv[1])[:4]
say(f"layers whose prose amax exceeds the chat calibration's: {len(grown)} of {len(ratio)}; "
    f"the largest ratios: {', '.join(f'{n} {r:.2f}x' for n, r in worst)}",
    f"普通文本输入的 amax 超过对话校准值的层：{len(ratio)} 个中有 {len(grown)} 个；"
    f"最大的比值：{', '.join(f'{n} {r:.2f}x' for n, r in worst)}")
sat_eval = {n: int((X[n].abs() > amax_chat[n]).sum()) for n in FP8_LAYERS}
say(f"evaluation windows: {sum(sat_eval.values())} input values saturate under the chat "
    f"scales, in {sum(v > 0 for v in sat_eval.values())} layers",
    f"评测窗口：在对话缩放因子下有 {sum(sat_eval.values())} 个输入值饱和，"
    f"分布在 {sum(v > 0 for v in sat_eval.values())} 个层中")


def set_scales(scales):
    for n, m in FP8_LAYERS.items():
        m.input_scale.copy_(scales[n])
    st.llm_engine.kv_cache_manager.reset_prefix_cache()


CAL_CHAT, CAL_CORPUS = "static, calibrated on chats (the checkpoint)", "static, calibrated on prose"
RES[CAL_CHAT] = RES[STATIC]
chat_scales = {n: m.input_scale.clone() for n, m in FP8_LAYERS.items()}
set_scales({n: fp8_static_input_scale(a) for n, a in amax_corpus.items()})
record(CAL_CORPUS, st.score(windows, output="logits"))
set_scales(chat_scales)                               # the checkpoint's scales back
print(HEAD)
for label in (CAL_CHAT, CAL_CORPUS, DYN):
    print(row(label))
_a, _b = RES[CAL_CHAT]["ci"], RES[CAL_CORPUS]["ci"]
cal_ov = _a[0] <= _b[1] and _b[0] <= _a[1]
say(f"chats-calibrated against prose-calibrated: the CIs {'overlap' if cal_ov else 'do not overlap'}",
    f"对话校准对比普通文本校准：CI {'重叠' if cal_ov else '不重叠'}")

# %% [markdown]
# Prose pushes about a third of the layers past the chat calibration's maxima (the lines
# above the table), so a few dozen input values of the evaluation windows saturate. On
# this model that is a small effect: the overshoot is tens of percent, a value saturated
# from 1.3 · 448 to 448 is one of a handful, and the line under the table says whether
# the two static rows' CIs separate; both stay above dynamic scaling. On Mixtral in PR #4570 the
# overflow reached NaN, which saturation (this engine, and vLLM since that PR) rules out.
# The cheap insurances are a calibration set that looks like the traffic and headroom:
# `fp8_static_input_scale(amax, headroom=2)` gives scale `2 · amax / 448`. For a float
# format headroom is nearly free: doubling the scale moves every value one binade down,
# and only the values that reach the subnormals lose precision. For int8 the same
# headroom would cost a whole bit of resolution.
#
# ## 6. The seed's claim: do fp8 weights hurt less than an fp8 KV cache?
#
# Seed 000 §2.4.3: FP8 weights + FP8 KV 92 → 89 %; FP8 weights with FP16 KV 91.5 %. In
# other words the KV cache costs 2.5 points and the weights 0.5. Three engines here:
# W8A8 fp8 alone (dynamic per-token activations, per-tensor weights: this engine's
# `quantization="fp8"`), an fp8 e4m3 KV cache alone (`kv_cache_dtype="fp8_e4m3"`, float32
# weights, scale 1.0: chapter 18), and both.

# %%
KV, BOTH = "fp8 e4m3 KV cache alone", "fp8 W8A8 + fp8 KV cache"
kv = LLM(MODEL, kv_cache_dtype="fp8_e4m3", **COMMON)
record(KV, kv.score(windows, output="logits"))
qa_acc(kv, KV)
del kv
gc.collect()
both = LLM(MODEL, quantization="fp8", kv_cache_dtype="fp8_e4m3", **COMMON)
record(BOTH, both.score(windows, output="logits"))
qa_acc(both, BOTH)
del both
gc.collect()
print(QA_HEAD)
for label in (DYN, KV, BOTH):
    print(row_qa(label))
w_over_kv = RES[DYN]["kl"] / RES[KV]["kl"]
sep = RES[DYN]["ci"][0] > RES[KV]["ci"][1]
print(f"float32 QA on the same questions: {RES['float32']['acc']:.0%}")
_accs = {RES[k]["acc"] for k in ("float32", DYN, KV, BOTH)}
qa_same = len(_accs) == 1
qa_ov = (max(RES[k]["acc_ci"][0] for k in (DYN, KV, BOTH))
         <= min(RES[k]["acc_ci"][1] for k in (DYN, KV, BOTH)))
say(f"QA, W8A8 / KV / both on {len(qa)} questions: "
    f"{'the same for all' if qa_same else 'CIs overlap' if qa_ov else 'CIs separate'}",
    f"{len(qa)} 道题上的 QA，W8A8 / KV / 两者兼有："
    f"{'全部相同' if qa_same else 'CI 重叠' if qa_ov else 'CI 分开'}")
print()
say(f"W8A8 / KV-cache KL: {w_over_kv:.1f}x; the CIs "
    f"{'do not overlap' if sep else 'overlap'}; both together / sum of the two alone: "
    f"{RES[BOTH]['kl'] / (RES[DYN]['kl'] + RES[KV]['kl']):.2f}",
    f"W8A8 / KV cache 的 KL 之比：{w_over_kv:.1f}x；CI "
    f"{'不重叠' if sep else '重叠'}；两者兼有 / 两者单独之和："
    f"{RES[BOTH]['kl'] / (RES[DYN]['kl'] + RES[KV]['kl']):.2f}")

# %%
labels = [STATIC, CAL_CORPUS, DYN, KV, BOTH, DROP_3, DROP_ALL]
fig = Figure(figsize=(9, 3.8), layout="constrained")
ax = fig.add_subplot()
kls = [RES[k]["kl"] for k in labels]
err = np.array([[RES[k]["kl"] - RES[k]["ci"][0] for k in labels],
                [RES[k]["ci"][1] - RES[k]["kl"] for k in labels]])
colors = ["C3" if "dropped" in k else ("C2" if "KV" in k else "C0") for k in labels]
ax.barh(range(len(labels)), kls, xerr=err, color=colors)
ax.set_yticks(range(len(labels)))
ax.set_yticklabels(labels, fontsize=8)
ax.invert_yaxis()
ax.set_xscale("log")
ax.set_xlabel(f"mean KL against float32, {sum(map(len, windows))} prose positions (nats, log; bars: 95% CI)")
ax.set_title("fp8 on SmolLM2: the KV cache is the cheap part; a missing input scale is not")
fig

# %% [markdown]
# On this model the order is the seed's reversed: fp8 weights *and activations* cost
# several times the KL of an fp8 e4m3 KV cache, with CIs that do not overlap (the line
# under the table), and together they cost about the sum of the two (the ratio at the
# end of that line). (`benchmarks/RESULTS.md`, 2,560 corpus positions: W8A8 dynamic
# 0.0241 [0.022, 0.0262]; e4m3 KV 0.00648 [0.0055, 0.00765] on 10,202 conversation
# positions.) Why the seed could still be right for its model: it quantized weights
# *only* to fp8 (its 91.5 % row keeps FP16 KV), and a larger model may tolerate e4m3
# weights better than a 135M one (not measured here). Here the activations are part of
# the cost: an fp8 KV cache rounds K and V, which attention then averages, while W8A8
# rounds the input of every one of 120 matmuls.
#
# ## 7. Does W8A8 tie a request to its batch? Per-token against per-tensor scales
#
# **vllm #9567** "Models produce different output with different batch sizes"
# (2024-10, closed): greedy completions on an H100 changed when the same prompts ran
# batched; the investigation found the divergence early in the sequence, "larger than
# just precision error", and compared float32 too. Chapter 5 measures the general
# cause: a GEMM kernel may round a row differently at another row count M. Activation
# quantization adds a question of its own: does a request's *scale* depend on the
# others? A per-token scale, `amax(row) / qmax`, is computed from the row alone. A
# dynamic per-tensor scale, `amax(step) / qmax`, is computed over every row of the step,
# every request in it; that is what vLLM's online `--quantization fp8` does (its FP8
# docs: "a dynamic per-tensor scale").
#
# This engine's W8A8 path is fp8 only, so the int8 scheme (vLLM's INT8 W8A8 page,
# llm-compressor's `W8A8`: int8 weights with one scale per output channel, int8
# activations with a dynamic scale per token) is computed here in a few lines, on the
# real inputs of layer 11's `down_proj` from section 1. vLLM's CUTLASS W8A8 GEMM sums
# int8 products in int32 and fp8 products in float32 (`ElementAcc` in
# `csrc/quantization/cutlass_w8a8/c3x/scaled_mm.cuh`); both are computed here. Request A is
# one row, window 0's token 10, as in a decode step; its batch-mates are windows 1 and 2
# in prefill (96 rows, each starting with the first-token outlier). A's output row is
# computed alone (M = 1) and inside the 97-row batch, and compared bit for bit.

# %%
t = time.perf_counter()
L11 = "layers.11.mlp.down_proj"
x11, n_win, a_row = X[L11], len(windows[0]), 10
x_alone = x11[a_row:a_row + 1]                     # request A: one decode row
x_batch = torch.cat([x_alone, x11[n_win:]])        # A first, then windows 1 and 2: 97 rows
w11 = ref.llm_engine.model_runner.model.get_submodule(L11).weight.detach()
y_true = x_alone @ w11.T                           # float32, unquantized
w_q8, s_w8 = wq.quantize_int8(w11, "channel")      # int8 weights, [576, 1536], scales [576, 1]


def int8_activation(x, per_token):
    """Dynamic symmetric int8: scale amax / 127 per row, or one amax over all rows."""
    amax = x.abs().amax(-1, keepdim=True) if per_token else x.abs().amax().reshape(1, 1)
    s = (amax / 127).clamp(min=torch.finfo(torch.float32).tiny)
    return torch.round(x / s).clamp(-127, 127).to(torch.int8), s


def w8a8_int8(x, per_token, accumulate):
    """(y, codes, scales): y = (x_q @ w_q^T) * s_x * s_w, the integer products summed in
    int32 or in float32."""
    q, s = int8_activation(x, per_token)
    if accumulate == "int32":
        acc = (q.to(torch.int32) @ w_q8.to(torch.int32).T).to(torch.float32)
    else:
        acc = q.to(torch.float32) @ w_q8.to(torch.float32).T
    return acc * s * s_w8.T, q, s


def w8a8_fp8(x, per_token):
    """(y, codes as bytes, scales): this engine's fp8 W8A8, dynamic per token, or one
    dynamic scale for the whole step."""
    s = None if per_token else (x.abs().amax() / wq.FP8_MAX).reshape(())
    q, sx = wq.quantize_fp8_activation(x, s)
    return fp8_linear_ref(x, lay.qweight, lay.weight_scale, s, None), q.view(torch.uint8), sx


SCHEMES = {
    "int8, per token, int32 sums (vLLM's INT8 W8A8)": lambda x: w8a8_int8(x, True, "int32"),
    "int8, per token, float32 sums of the same integers": lambda x: w8a8_int8(x, True, "float32"),
    "fp8, per token (this engine's dynamic)": lambda x: w8a8_fp8(x, True),
    "int8, one dynamic scale per step": lambda x: w8a8_int8(x, False, "int32"),
    "fp8, one dynamic scale per step (vLLM's online fp8)": lambda x: w8a8_fp8(x, False),
}


def rel(y):
    return float((y - y_true).norm() / y_true.norm())


def first_scale(sx):
    return sx.reshape(-1)[:1]


BATCH = {}
print("| W8A8 scheme | A's scale alone | in the batch | A's scale and codes bit-identical | "
      "A's output row bit-identical | error vs float32, alone | batched |\n"
      "|---|---|---|---|---|---|---|")
for label, fn in SCHEMES.items():
    (y1, q1, s1), (yb, qb, sb) = fn(x_alone), fn(x_batch)
    codes_same = torch.equal(first_scale(s1), first_scale(sb)) and torch.equal(q1[0], qb[0])
    BATCH[label] = dict(same=torch.equal(y1[0], yb[0]), codes=codes_same,
                        s1=float(first_scale(s1)), sb=float(first_scale(sb)),
                        e1=rel(y1), eb=rel(yb[:1]))
    b = BATCH[label]
    print(f"| {label} | {b['s1']:.3g} | {b['sb']:.3g} | {codes_same} | {b['same']} | "
          f"{b['e1']:.4f} | {b['eb']:.4f} |")
q_all, _ = int8_activation(x_batch, True)
bound = int((q_all.abs().double() @ w_q8.abs().double().T).max())  # exact in float64
say(f"int8 per token: the largest sum of |products| in any output is {bound:,}; below 2^24 "
    f"= {2 ** 24:,} (every partial sum an exact float32 integer, in any order): "
    f"{bound < 2 ** 24}",
    f"int8 逐 token：任一输出中 |乘积| 之和的最大值为 {bound:,}；低于 2^24 "
    f"= {2 ** 24:,}（无论什么顺序，每个部分和都是精确的 float32 整数）："
    f"{bound < 2 ** 24}")
s_step8 = BATCH["int8, one dynamic scale per step"]["sb"]
zero8 = float((torch.round(x_alone / s_step8) == 0).float().mean())
s_step_fp8 = BATCH["fp8, one dynamic scale per step (vLLM's online fp8)"]["sb"]
s_own_fp8 = BATCH["fp8, one dynamic scale per step (vLLM's online fp8)"]["s1"]
sub_own = float((x_alone.abs() < 2.0 ** -6 * s_own_fp8).float().mean())
sub_step = float((x_alone.abs() < 2.0 ** -6 * s_step_fp8).float().mean())
elapsed = time.perf_counter() - t
say(f"A with the step's scale: int8 stores {zero8:.0%} of A's values as 0; fp8 puts "
    f"{sub_step:.0%} of them below 2^-6 · s (subnormal or 0), against {sub_own:.0%} with "
    f"A's own scale  ({elapsed:.1f} s)",
    f"A 使用这一步的缩放因子时：int8 把 A 的值中的 {zero8:.0%} 存为 0；fp8 把其中 "
    f"{sub_step:.0%} 推到 2^-6 · s 以下（次正规数或 0），而用 A 自己的缩放因子时为 {sub_own:.0%}"
    f"（{elapsed:.1f} s）")

# %% [markdown]
# Read the first three rows by their two "bit-identical" columns, the last two by their
# scales. A per-token scale comes from A's row alone, so it and A's codes are the same
# whether A runs alone or among 96 other rows. What can still differ is the GEMM. Sums
# of int8 products in int32 are exact, so no tiling, split or order chosen for M = 97
# can change them. Float32 sums of the same integers are exact too while every partial
# sum stays below 2^24 (the line under the table checks that bound). The fp8 products
# are summed in float32 by this CPU's GEMM, whose order may change with the row count
# (chapter 5): that row's output column says what this CPU did. One dynamic scale per
# step is different in kind: the batch-mates' first-token outliers (section 1) set A's
# scale (the two scale columns), so A's codes and output change with its neighbours. What
# that costs depends on the format: the second line under the table counts A's values
# that int8 rounds to zero and that fp8 pushes below `2^-6 · s` with the step's scale,
# and the error columns give the result. So per-token W8A8 by itself does not make a
# request depend on its batch; a per-tensor dynamic scale does, by construction; and
# where per-token W8A8 still moves, the cause is a float accumulation whose kernel
# follows M, chapter 5's subject.
#
# ## 8. Claim vs measurement

# %%
r = RES
dyn_best = all(r[DYN]["kl"] < r[k]["kl"] for k in (STATIC, CAL_CORPUS, CAL_CHAT, DROP_ALL, DROP_3))
claims = [
    (Bi("seed 000 §2.4.3: fp8 weights hurt less than an fp8 KV cache (91.5 % vs 89 % from 92 %)",
        "种子课程 000 §2.4.3：fp8 权重的损害小于 fp8 KV cache（从 92 % 分别降到 91.5 % 和 89 %）"),
     Bi(f"{'reversed here' if sep and w_over_kv > 1 else 'as claimed here' if sep else 'not resolved here (CIs overlap)'}"
        f": KL W8A8 {r[DYN]['kl']:.3g} [{r[DYN]['ci'][0]:.3g}, {r[DYN]['ci'][1]:.3g}] "
        f"vs fp8 KV {r[KV]['kl']:.3g} [{r[KV]['ci'][0]:.3g}, {r[KV]['ci'][1]:.3g}] ({w_over_kv:.1f}x), "
        f"both {r[BOTH]['kl']:.3g}; QA on {len(qa)} questions: {r[DYN]['acc']:.0%}, {r[KV]['acc']:.0%}, "
        f"{r[BOTH]['acc']:.0%} ({'the same for all' if qa_same else 'CIs overlap' if qa_ov else 'CIs separate'}"
        f": QA on so few questions cannot rank them, KL can)",
        f"{'这里结论相反' if sep and w_over_kv > 1 else '这里与论断一致' if sep else '这里无法判定（CI 重叠）'}"
        f"：KL W8A8 {r[DYN]['kl']:.3g} [{r[DYN]['ci'][0]:.3g}, {r[DYN]['ci'][1]:.3g}] "
        f"对 fp8 KV {r[KV]['kl']:.3g} [{r[KV]['ci'][0]:.3g}, {r[KV]['ci'][1]:.3g}]（{w_over_kv:.1f}x），"
        f"两者兼有 {r[BOTH]['kl']:.3g}；{len(qa)} 道题上的 QA：{r[DYN]['acc']:.0%}、{r[KV]['acc']:.0%}、"
        f"{r[BOTH]['acc']:.0%}（{'全部相同' if qa_same else 'CI 重叠' if qa_ov else 'CI 分开'}"
        f"：题目这么少，QA 无法给它们排序，KL 可以）")),
    (Bi("the layer-11 down_proj input reaches about 2,800, above e4m3's 448",
        "第 11 层 down_proj 的输入达到约 2,800，超过 e4m3 的 448"),
     Bi(f"here {per_layer['layers.11.mlp.down_proj']:,.0f} (layer 28: "
        f"{per_layer['layers.28.mlp.down_proj']:,.0f}, 29: {per_layer['layers.29.mlp.down_proj']:,.0f}), "
        f"at the first token of every window only; every other input <= {rest:.0f}",
        f"这里为 {per_layer['layers.11.mlp.down_proj']:,.0f}（第 28 层："
        f"{per_layer['layers.28.mlp.down_proj']:,.0f}，第 29 层：{per_layer['layers.29.mlp.down_proj']:,.0f}），"
        f"只出现在每个窗口的第一个 token；其他所有输入 <= {rest:.0f}")),
    (Bi("a missing input scale (1.0) saturates the outlier and costs a large KL at that token",
        "缺失的输入缩放因子（1.0）让离群值饱和，并在那个 token 上造成很大的 KL"),
     Bi(f"{'confirmed' if r[DROP_ALL]['kl_first'] > 10 * r[STATIC]['kl_first'] else 'not confirmed'}"
        f": first-position KL {r[DROP_ALL]['kl_first']:.2f} nats vs "
        f"{r[STATIC]['kl_first']:.3g} calibrated; the other positions {r[DROP_ALL]['kl_rest']:.3g} vs "
        f"{r[STATIC]['kl_rest']:.3g}; planted in layers 11/28/29 alone: {r[DROP_3]['kl']:.3g} "
        f"(all layers {r[DROP_ALL]['kl']:.3g}); QA {r[DROP_ALL]['acc']:.0%} vs dynamic "
        f"{r[DYN]['acc']:.0%}, float32 {r['float32']['acc']:.0%}",
        f"{'得到证实' if r[DROP_ALL]['kl_first'] > 10 * r[STATIC]['kl_first'] else '未得到证实'}"
        f"：第一个位置的 KL 为 {r[DROP_ALL]['kl_first']:.2f} nats，校准时为 "
        f"{r[STATIC]['kl_first']:.3g}；其他位置 {r[DROP_ALL]['kl_rest']:.3g} 对 "
        f"{r[STATIC]['kl_rest']:.3g}；只植入第 11/28/29 层：{r[DROP_3]['kl']:.3g}"
        f"（所有层 {r[DROP_ALL]['kl']:.3g}）；QA {r[DROP_ALL]['acc']:.0%}，动态为 "
        f"{r[DYN]['acc']:.0%}，float32 为 {r['float32']['acc']:.0%}")),
    (Bi("RESULTS: fp8 dynamic per tensor KL 0.0241, static 0.0292, per channel 0.0254",
        "RESULTS：fp8 动态逐张量 KL 0.0241，静态 0.0292，逐通道 0.0254"),
     Bi(f"{'same order here' if r[DYN]['kl'] < r[STATIC]['kl'] else 'the other order here'}"
        f" on {sum(map(len, windows))} positions: dynamic {r[DYN]['kl']:.3g}, static "
        f"{r[STATIC]['kl']:.3g}, "
        f"per channel 0.0254 (RESULTS; not run here)",
        f"{'这里顺序相同' if r[DYN]['kl'] < r[STATIC]['kl'] else '这里顺序相反'}"
        f"（{sum(map(len, windows))} 个位置）：动态 {r[DYN]['kl']:.3g}，静态 "
        f"{r[STATIC]['kl']:.3g}，"
        f"逐通道 0.0254（RESULTS；这里没有运行）")),
    (Bi("static scales calibrated on chats saturate on prose (vllm PR #4570's failure)",
        "在对话上校准的静态缩放因子在普通文本上饱和（vllm PR #4570 的故障）"),
     Bi(f"{len(grown)} of {len(ratio)} layers see larger prose inputs (up to {worst[0][1]:.1f}x); "
        f"{sum(sat_eval.values())} evaluation values saturate; KL chats-calibrated "
        f"{r[CAL_CHAT]['kl']:.3g}, prose-calibrated {r[CAL_CORPUS]['kl']:.3g} "
        f"(CIs {'overlap' if cal_ov else 'do not overlap'})",
        f"{len(ratio)} 个层中有 {len(grown)} 个看到更大的普通文本输入（最多 {worst[0][1]:.1f}x）；"
        f"{sum(sat_eval.values())} 个评测值饱和；KL 对话校准 "
        f"{r[CAL_CHAT]['kl']:.3g}，普通文本校准 {r[CAL_CORPUS]['kl']:.3g}"
        f"（CI {'重叠' if cal_ov else '不重叠'}）")),
    (Bi("the fix is dynamic per-token scales (vllm PR #33972's dynamic input scaling)",
        "修复方法是逐 token 的动态缩放因子（vllm PR #33972 的动态输入缩放）"),
     Bi(f"dynamic KL {r[DYN]['kl']:.3g}, "
        f"{'below every static variant' if dyn_best else 'not below every static variant'}"
        " and independent of any delivered scale (the lab restores the broken engine this way)",
        f"动态 KL {r[DYN]['kl']:.3g}，"
        f"{'低于每一种静态方案' if dyn_best else '并非低于每一种静态方案'}"
        "，且不依赖任何送达的缩放因子（实验就用这种方式修复出问题的引擎）")),
]
_tok = [k for k in BATCH if "per token" in k]
_step = [k for k in BATCH if "per step" in k]
_int8_same = all(BATCH[k]["same"] for k in _tok[:2])
_tok_same = ", ".join(f"{k.split(' (')[0]} {BATCH[k]['same']}" for k in _tok)   # labels: data
_codes_same = all(BATCH[k]["codes"] for k in _tok)
_step_moves = all(not BATCH[k]["codes"] for k in _step)
s0, s1 = _step                                       # int8 and fp8, one dynamic scale per step
claims += [
    (Bi("per-token dynamic W8A8 makes a request's output depend on its batch (vllm #9567's "
        "symptom)",
        "逐 token 的动态 W8A8 让请求的输出依赖于它的批次（vllm #9567 的症状）"),
     Bi(f"{'no for int8: ' if _int8_same else 'the int8 rows differed here: '}"
        f"A's row alone and in a 97-row step bit-identical: {_tok_same}"
        f"; A's scale and codes identical in all three: "
        f"{_codes_same} (int8 sums exact: bound {bound:,} < 2^24 "
        f"{bound < 2 ** 24}; a difference in the fp8 row comes from the float32 GEMM, chapter 5)",
        f"{'对 int8 不会：' if _int8_same else '这里 int8 的行出现了差异：'}"
        f"A 的行单独计算与在 97 行的步骤中计算是否逐位相同：{_tok_same}"
        f"；三种方案中 A 的缩放因子和编码都相同："
        f"{_codes_same}（int8 的和是精确的：界 {bound:,} < 2^24 "
        f"{bound < 2 ** 24}；fp8 那一行若有差异，来自 float32 GEMM，见第 5 章）")),
    (Bi("a dynamic per-tensor activation scale (vLLM's online fp8) ties a request to its batch",
        "动态的逐张量激活缩放因子（vLLM 的在线 fp8）把请求和它的批次绑在一起"),
     Bi(f"{'yes' if _step_moves else 'not here'}"
        f": A's scale grows {BATCH[s0]['sb'] / BATCH[s0]['s1']:.0f}x ({s0.split(',')[0]}: error "
        f"{BATCH[s0]['e1']:.3f} alone, {BATCH[s0]['eb']:.3f} batched), "
        f"{BATCH[s1]['sb'] / BATCH[s1]['s1']:.0f}x ({s1.split(',')[0]}: error "
        f"{BATCH[s1]['e1']:.3f} alone, {BATCH[s1]['eb']:.3f} batched)",
        f"{'是的' if _step_moves else '这里没有'}"
        f"：A 的缩放因子增大 {BATCH[s0]['sb'] / BATCH[s0]['s1']:.0f}x（{s0.split(',')[0]}：误差 "
        f"单独 {BATCH[s0]['e1']:.3f}，成批 {BATCH[s0]['eb']:.3f}），"
        f"{BATCH[s1]['sb'] / BATCH[s1]['s1']:.0f}x（{s1.split(',')[0]}：误差 "
        f"单独 {BATCH[s1]['e1']:.3f}，成批 {BATCH[s1]['eb']:.3f}）")),
]
claims_table(claims, header=(Bi("claim", "论断"), Bi("measured", "实测")))

# %% [markdown]
# ## Common misconceptions
#
# - *"An fp8 activation scale is like an int8 one: get it wrong and everything loses
#   precision."* fp8 is floating point: a scale 100x off moves values along a grid of
#   the same relative spacing. What a wrong scale does is decide which values saturate
#   (above `448 · s`) and which become subnormal (below `2^-6 · s`). On this model only
#   the first-token outliers are at stake (sections 2-3).
# - *"Static scales are the accurate option, dynamic the fast one."* Static scales cost
#   nothing at run time, but one number per layer has to cover every token of every
#   request. Here the calibration maximum is the first token's 3,000, so every other token
#   of layers 11 and 28 is quantized far below the top of the range: dynamic per-token
#   scales are *more* accurate (section 4).
# - *"A calibrated checkpoint is calibrated for my traffic."* For the traffic it was
#   calibrated on. Prose exceeds the chat maxima in about a third of the layers here
#   (section 5; harmless on this model);
#   PR #4570's Mixtral checkpoint, calibrated on ultrachat, scored at chance on MMLU
#   until saturation was added.
# - *"If the engine loads the scales without an error, it uses them."* The delivery
#   failures of chapter 18 apply to `input_scale` too. Test it: serve the checkpoint with
#   a deliberately wrong scale (say 100x) and check that the output changes; or compare
#   the first position's KL, which is where a missing activation scale shows first.
# - *"Dynamic activation scales make outputs depend on the batch."* Only a scale shared
#   by the step does. A per-token scale comes from the row alone; int8 products summed in
#   int32 are exact; what can still move a row is a float accumulation whose kernel
#   changes with the row count (section 7, chapter 5).
# - *"Weight quantization is the safe part."* With W8A8 the activations are quantized
#   too, at every linear layer; on this model that costs more than an fp8 KV cache
#   (section 6).
#
# ## Lab
#
# `labs/source/ch17/` starts from the broken engine of section 3: the static fp8
# checkpoint with its input scales not delivered. You write the activation quantizer
# (static and dynamic per token, saturating), the calibration rule with headroom, and the
# fp8 linear layer; the grader plugs your linear into the engine's `"fp8.linear"` step
# with the fault still planted, computing dynamic scales, and checks on fresh prose that
# the KL against float32 is back at the built-in dynamic engine's, while the broken
# engine fails the same check. Then you decide which (at most three) linear layers get
# dynamic per-token scales, everything else keeping the missing static scale's 1.0: the
# grader measures your choice against dynamic scales everywhere on fresh text (section 2's
# saturation table is the place to look).
#
# ## On real vLLM
#
# - `--quantization fp8` on a 16-bit checkpoint quantizes online: weights to e4m3 with
#   one scale per tensor, activations with a **dynamic per-tensor** scale computed from
#   each forward pass (vLLM's FP8 W8A8 page). The tensor is the whole step, every request
#   in it, so a request's activation scale depends on what it is batched with.
# - llm-compressor's `FP8_DYNAMIC` scheme (the one vLLM's docs recommend) stores
#   per-channel weight scales and quantizes activations per token at run time: no
#   calibration data. A checkpoint with `activation_scheme: "static"` ships an
#   `input_scale` per layer: calibrate it on text like your traffic (section 5).
# - W8A8 runs on compute capability 8.9 and above (Ada, Hopper, Blackwell); older GPUs
#   run FP8 checkpoints weight-only (W8A16, FP8 Marlin), where activations are not
#   quantized and sections 2-5 do not apply. The startup log names the GEMM kernel
#   picked for each module ("Selected ... for ...").
# - Checked against vLLM's FP8 W8A8 and INT8 W8A8 docs (v0.5 to the main branch) and
#   `quantization/fp8.py` (`ACTIVATION_SCHEMES = ['static', 'dynamic']`, v0.15). This
#   engine emulates the e4m3 GEMM in float32 on CPU (exact products, float32 sums); its
#   dynamic scheme is always per token, its static one per tensor.

# %%
print(f"chapter 17 ran in {time.perf_counter() - T0:.0f} s")
