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
# # Chapter 14. INT8 weight-only quantization: per-tensor vs per-channel, outlier channels
#
# **Learning goals.** After this chapter you can
#
# 1. say what symmetric INT8 weight-only quantization stores (int8 codes and a float
#    scale, `w ≈ q · scale`, `scale = amax / 127`) and what "per tensor" and "per
#    channel" mean for a `[out_features, in_features]` weight (one scale, or one per
#    output row);
# 2. find the output channels that set a per-tensor scale, and read from one ratio,
#    max |w| / median channel amax, how many of the 255 codes the other channels keep;
# 3. measure the damage end to end on the embedded model (KL, answer KL and QA accuracy,
#    side by side, with confidence intervals) and the two fixes: per-channel scales, or
#    per-tensor scales with the outlier layers left unquantized (`quantization_config=
#    {"ignore": [...]}`, llm-compressor's convention);
# 4. tell which outliers per-channel scales cannot fix: an *input* channel
#    (LLM.int8()'s outlier features, or a smoothing scale folded into a weight) spans
#    every row.
#
# **The incident, from public sources.** There is no public int8 *weight-only* bug
# report in this course's incident list; the failure is the textbook one, and it shows on
# this model by itself (section 3).
#
# - **LLM.int8()** (Dettmers et al. 2022, arXiv:2208.07339): from about 6.7B parameters,
#   a few hidden dimensions carry activations up to ~20x larger than the rest ("outlier
#   features"); a single absmax scale per tensor then wastes the int8 range on them, and
#   the paper keeps those dimensions in fp16 (mixed-precision decomposition) while
#   vector-wise (per-row/per-column) scales handle the rest.
# - **vllm-project/vllm PR #23570** (2025): in a w4a8 path, per-group scales cast to fp8
#   lost accuracy that per-channel scales recovered: a related case of "which axis carries
#   the scale" deciding quality.
# - **The seed course.** 000 §2.4.3-2.4.4 presents weight quantization as the cheap,
#   safe knob ("weight quantization hurts less than KV-cache quantization": FP8 weights +
#   FP8 KV 92 → 89 %, back to 91.5 % with an FP16 KV cache), and 002 §五 asks for a
#   release procedure: quantize, run the regression set, compare with the baseline,
#   keep a rollback. Section 6 answers these with numbers from this model.
#
# **A fact about these weights that matters here.** The embedded SmolLM2-135M-Instruct
# ships as GGUF **Q4_1** (asymmetric 4-bit, groups of 32) and was dequantized to float32
# once. So "the original weights" below means those float32 numbers, and every group of
# 32 holds at most 16 distinct values. Section 2 checks this, and says why it does not
# make int8 look better or worse than it would on a native checkpoint (a 4-bit grid with
# the same groups would be a different story: chapter 15).
#
# Everything below is measured when the notebook runs, on the embedded model in float32
# with minivllm on this machine's CPU, except numbers marked as taken from
# `benchmarks/RESULTS.md` (the command is given there).

# %%
# %matplotlib inline
import gc
import time

import numpy as np
import torch
from matplotlib.figure import Figure

from minivllm import LLM, SamplingParams
from minivllm.layers.linear import linear_ref
from minivllm.precision import evalsets, metrics
from minivllm.quantization import weight_quant as wq
from minivllm.quantization.quantize import target_layers

torch.manual_seed(0)
T0 = time.perf_counter()
MODEL = "smollm2-135m-instruct"
COMMON = dict(dtype="float32", max_model_len=512, kv_cache_memory_bytes=48 << 20)
base = LLM(MODEL, **COMMON)                        # float32 weights: the reference
tok = base.get_tokenizer()
model = base.llm_engine.model_runner.model
layers = target_layers(model)                      # "layers.3.mlp.down_proj" -> module
W = {name: lin.weight.detach() for name, lin in layers.items()}
print(f"{len(W)} decoder linear layers (qkv_proj, o_proj, gate_up_proj, down_proj per layer; "
      f"q/k/v and gate/up fused as vLLM does), "
      f"{sum(w.numel() for w in W.values()) / 1e6:.1f} M weights")

# %% [markdown]
# ## 1. What int8 weight-only stores
#
# For a weight `w` `[out, in]`: `scale = amax / 127`, `q = clamp(round(w / scale), -127,
# 127)` as int8 (round half to even; -128 is unused so the grid is symmetric), and the
# layer computes `x @ (q · scale).T` with float activations. **Per tensor**: `amax` is
# max |w| over the whole matrix, one scale. **Per channel**: `amax` is taken per output
# row, `[out, 1]` scales (vLLM's `channelwise`; llm-compressor's `strategy="channel"`).
# The round trip errs by at most `scale / 2` per weight, so everything depends on how
# large `amax` is compared with the weights it serves. A toy row makes it concrete:

# %%
toy = torch.tensor([[0.02, -0.013, 0.007, 0.0011], [2.5, -0.9, 0.3, 0.05]])
for gran in ("tensor", "channel"):
    q, s = wq.quantize_int8(toy, gran)
    print(f"{gran:8} scale {s.flatten().tolist()}\n         codes {q.tolist()}\n"
          f"         back  {wq.dequantize_int8(q, s).tolist()}")

# %% [markdown]
# Per tensor, the first row shares a scale of 2.5/127 with the second: all its weights
# round to 1, 0 or -1, i.e. its information is gone. Per channel it keeps 127 levels of
# its own.
#
# ## 2. Where the outliers are in SmolLM2
#
# For each layer: the amax of every output channel (row), and the ratio **max |w| /
# median channel amax**. Per tensor, a channel with the median amax uses only about
# `127 / ratio` of the 127 positive codes.

# %%
stats = {}
for name, w in W.items():
    amax_row = w.abs().amax(dim=1)
    errs = {}
    for gran in ("tensor", "channel"):
        d = wq.dequantize_int8(*wq.quantize_int8(w, gran))
        errs[gran] = float((d - w).norm() / w.norm())
    stats[name] = {"ratio": float(amax_row.max() / amax_row.median()),
                   "row": int(amax_row.argmax()), "err_tensor": errs["tensor"],
                   "err_channel": errs["channel"]}
rank = sorted(stats, key=lambda n: -stats[n]["ratio"])
print("| layer | max abs w / median channel amax | outlier row | codes left for the median "
      "channel (per tensor) | rel. error per tensor | per channel |\n|---|---|---|---|---|---|")
for name in rank[:10]:
    s = stats[name]
    print(f"| {name} | {s['ratio']:.1f} | {s['row']} | {127 / s['ratio']:.0f} | "
          f"{s['err_tensor']:.4f} | {s['err_channel']:.4f} |")
med = {k: float(np.median([s[k] for s in stats.values()])) for k in ("ratio", "err_tensor",
                                                                  "err_channel")}
print(f"median over the {len(stats)} layers: ratio {med['ratio']:.1f}, relative weight error "
      f"per tensor {med['err_tensor']:.4f}, per channel {med['err_channel']:.4f} "
      f"({med['err_tensor'] / med['err_channel']:.1f}x)")
rows_507 = sum(1 for n in W if n.endswith("down_proj") and stats[n]["row"] == 507)
print(f"down_proj layers whose largest output channel is hidden dimension 507: {rows_507} of "
      f"{sum(1 for n in W if n.endswith('down_proj'))}")

# %%
kinds = ["self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"]
fig = Figure(figsize=(9, 4), layout="constrained")
ax = fig.add_subplot()
n_layers = len(model.layers)
for k, kind in enumerate(kinds):
    ax.bar(np.arange(n_layers) + (k - 1.5) * 0.2,
           [stats[f"layers.{i}.{kind}"]["ratio"] for i in range(n_layers)], width=0.2, label=kind)
ax.set_xlabel("decoder layer")
ax.set_ylabel("max |w| / median output-channel amax")
ax.set_title("How far each layer's largest output channel sits above a typical one")
ax.legend(fontsize=8, ncol=4)
fig

# %%
q10, q90 = np.quantile([s["ratio"] for s in stats.values()], [0.1, 0.9])
print(f"ratio: 10th-90th percentile over the layers {q10:.1f}-{q90:.1f}, so per tensor the "
      f"median channel keeps {127 / q90:.0f}-{127 / q10:.0f} of the 127 positive codes "
      f"({np.log2(2 * 127 / q90 + 1):.1f}-{np.log2(2 * 127 / q10 + 1):.1f} bits' worth); "
      f"per channel it keeps 127 (8 bits)")

# %% [markdown]
# So per tensor, the typical channel of a typical layer is quantized with a bit or two
# fewer than 8 (the line above), per channel with all 8. A handful of layers stand out
# (the table), and in most down_proj layers the largest output channel is the same hidden
# dimension, 507: one residual-stream dimension this model writes with large weights
# layer after layer (the count is printed above). That is an *output* channel, exactly
# what per-channel scales isolate.
#
# **The Q4_1 provenance, checked.** Count the distinct values in each group of 32 input
# columns, and compare the int8 per-channel step (row amax / 127) with the spacing of
# those values:

# %%
def q41_check(w):
    g = w.reshape(w.shape[0], -1, 32)
    srt = g.sort(dim=-1).values
    gaps = srt.diff(dim=-1)
    distinct = (gaps > 0).sum(-1) + 1
    # smallest positive gap in each group: the Q4_1 step d (or a multiple of it)
    step = torch.where(gaps > 0, gaps, torch.full_like(gaps, float("inf"))).amin(-1)
    int8_step = w.abs().amax(dim=1, keepdim=True) / 127
    return int(distinct.max()), float((int8_step / step).median())


checks = {n: q41_check(W[n]) for n in ("layers.0.self_attn.qkv_proj", "layers.11.mlp.down_proj",
                                       "layers.27.mlp.gate_up_proj")}
for n, (dmax, r) in checks.items():
    print(f"{n:30} at most {dmax} distinct values per group of 32; int8 per-channel step / "
          f"Q4_1 step (median) = {r:.2f}")

# %% [markdown]
# At most 16 distinct values per group: these are Q4_1 numbers. The int8 per-channel step
# is a fraction of a Q4_1 step, and the two grids are not aligned (Q4_1 stores a float
# minimum per group, int8 a multiple of a per-row scale), so int8 rounds these weights like
# any others: its error is not hidden by the provenance. What the provenance does change
# is the baseline: "lossless" below means lossless against this Q4_1-derived float32
# model, not against SmolLM2's original bf16 weights, which this course cannot load.
#
# ## 3. The incident on the embedded model: per tensor against per channel
#
# Two engines quantize every decoder linear layer on load (`LLM(quantization="int8",
# quantization_config={"granularity": ...})`); the LM head and embeddings stay float
# (vLLM leaves `lm_head` unquantized too). Three measures, each against the float32
# engine:
#
# - **KL** on prose: teacher-forced windows of the bundled corpus, mean KL(float ‖ int8)
#   per position, CI by resampling whole windows;
# - **answer KL**: each QA prompt followed by the float32 engine's own greedy answer,
#   KL at the answer positions only (the recall of facts, without greedy's
#   all-or-nothing), CI by resampling questions;
# - **QA accuracy**: greedy answers (12 tokens, enough for the answer word in most of the
#   set) judged against the accepted answers, CI by resampling questions; and how many
#   answers differ from float32's at all.
#
# The sample is kept small so the chapter runs in its time budget (a few hundred prose
# positions, 30 questions); `benchmarks/RESULTS.md` has the large run.

# %%
windows = evalsets.corpus_sequences(tok, seq_len=64, max_sequences=4)
qa = evalsets.load_qa()[::6]                       # every 6th question: all categories
qa_prompts = [tok.encode(tok.apply_chat_template(evalsets.qa_prompt(it.question), tokenize=False,
                                                 add_generation_prompt=True),
                         add_special_tokens=False) for it in qa]
greedy = SamplingParams(temperature=0.0, max_tokens=12)
base_out = base.generate(qa_prompts, greedy)
base_answers = [o.outputs[0].token_ids for o in base_out]
qa_seqs = [p + a for p, a in zip(qa_prompts, base_answers)]
answer_rows = [list(range(len(p) - 1, len(p) - 1 + len(a))) for p, a in zip(qa_prompts, base_answers)]
print(f"{len(windows)} prose windows x {len(windows[0])} tokens; {len(qa)} QA questions, "
      f"{sum(map(len, answer_rows))} answer positions")

REF = {"windows": base.score(windows, output="logits"),
       "answers": base.score(qa_seqs, output="logits", positions=answer_rows)}
RESULTS = {}


def evaluate(name, llm, qa_too=True):
    """KL and top-1 agreement on the prose windows, and (qa_too) answer KL and QA accuracy,
    of `llm` against float32, with 95 % bootstrap CIs; stored in RESULTS[name]."""
    t = time.perf_counter()
    rows = llm.score(windows, output="logits")
    kl = [metrics.kl_divergence(r, c).numpy() for r, c in zip(REF["windows"], rows)]
    top1 = float(np.mean(np.concatenate([(r.argmax(-1) == c.argmax(-1)).numpy()
                                         for r, c in zip(REF["windows"], rows)])))
    RESULTS[name] = {"kl": float(np.concatenate(kl).mean()), "kl_ci": metrics.bootstrap_ci(kl),
                     "kl_rows": kl, "top1": top1, "bytes": llm.weight_bytes()["total"]}
    if not qa_too:
        return RESULTS[name]
    ans = llm.score(qa_seqs, output="logits", positions=answer_rows)
    akl = [float(metrics.kl_divergence(r, c).mean()) for r, c in zip(REF["answers"], ans)]
    outs = llm.generate(qa_prompts, greedy)
    ok = [float(evalsets.answer_matches(o.outputs[0].text, it.answers)) for o, it in zip(outs, qa)]
    changed = sum(o.outputs[0].token_ids != b for o, b in zip(outs, base_answers))
    RESULTS[name].update(answer_kl=float(np.mean(akl)), answer_kl_ci=metrics.bootstrap_ci(akl),
                         acc=float(np.mean(ok)), acc_ci=metrics.bootstrap_ci(ok), changed=changed,
                         seconds=time.perf_counter() - t)
    return RESULTS[name]


base_ok = [float(evalsets.answer_matches(o.outputs[0].text, it.answers)) for o, it in zip(base_out, qa)]
RESULTS["float32"] = {"kl": 0.0, "kl_ci": (0.0, 0.0), "top1": 1.0, "answer_kl": 0.0,
                      "answer_kl_ci": (0.0, 0.0), "acc": float(np.mean(base_ok)),
                      "acc_ci": metrics.bootstrap_ci(base_ok), "changed": 0,
                      "bytes": base.weight_bytes()["total"]}


def table(names):
    print("| weights | KL prose (nats) [95% CI] | top-1 agree | answer KL [95% CI] | "
          "QA accuracy [95% CI] | answers changed | weight MB |\n|---|---|---|---|---|---|---|")
    for n in names:
        r = RESULTS[n]
        if "acc" in r:
            qa_cols = (f"{r['answer_kl']:.3g} [{r['answer_kl_ci'][0]:.3g}, "
                       f"{r['answer_kl_ci'][1]:.3g}] | {100 * r['acc']:.1f}% "
                       f"[{100 * r['acc_ci'][0]:.0f}, {100 * r['acc_ci'][1]:.0f}] | "
                       f"{r['changed']} of {len(qa)}")
        else:
            qa_cols = "not run | not run | not run"
        print(f"| {n} | {r['kl']:.3g} [{r['kl_ci'][0]:.3g}, {r['kl_ci'][1]:.3g}] | "
              f"{100 * r['top1']:.1f}% | {qa_cols} | {r['bytes'] / 1e6:.0f} |")


for gran in ("tensor", "channel"):
    llm = LLM(MODEL, **COMMON, quantization="int8", quantization_config={"granularity": gran})
    evaluate(f"int8 per {gran}", llm)
    del llm
    gc.collect()
table(["float32", "int8 per tensor", "int8 per channel"])
ratio = RESULTS["int8 per tensor"]["kl"] / RESULTS["int8 per channel"]["kl"]
print(f"\nper tensor / per channel: {ratio:.0f}x in KL")
for n in ("int8 per tensor", "int8 per channel"):
    r = RESULTS[n]
    lost = round((RESULTS["float32"]["acc"] - r["acc"]) * len(qa))
    print(f"{n}: {r['changed']} greedy answers differ from float32's, {lost} fewer correct")

# %% [markdown]
# Same bytes (one scale per row adds 4 bytes per 576-3072 int8 weights), very different
# models. Per tensor, the KL is tens of times per channel's (the ratio is printed) and
# the CIs are far apart; answer KL moves with it, and greedy QA loses answers that per
# channel keeps. Per channel is not free either: its KL is a few 1e-3 and it changes some
# greedy answers; compare how many answers change with how many fewer are correct (the
# lines under the table): a changed answer often still contains the right word. The
# accuracy CIs are wide (30 questions): the KL columns are what separate the schemes with
# confidence, which is why a release check (section 6) should not rest on accuracy alone. `benchmarks/RESULTS.md` has the same comparison on 2,560 corpus positions
# and all 176 questions: KL 0.0775 against 0.0029 (26x), QA 80.1 % against 95.5 %.
#
# Per position, the gap is everywhere, not a few bad tokens:

# %%
fig = Figure(figsize=(8, 3.5), layout="constrained")
ax = fig.add_subplot()
for n in ("int8 per tensor", "int8 per channel"):
    kl = np.concatenate(RESULTS[n]["kl_rows"])
    ax.hist(np.log10(np.maximum(kl, 1e-8)), bins=60, alpha=0.6, label=f"{n} (mean {kl.mean():.3g})")
ax.set_xlabel("log10 KL(float32 || int8) per position (nats)")
ax.set_ylabel("positions")
ax.set_title(f"{len(windows)} prose windows, {sum(map(len, windows))} positions")
ax.legend(fontsize=8)
fig

# %% [markdown]
# ## 4. The other fix: per tensor, except the outlier layers
#
# Section 2 ranked the layers by their outlier ratio. Leave the top few unquantized with
# the `ignore` list (llm-compressor's convention: module names, or patterns prefixed
# `"re:"`; vLLM reads the same list from compressed-tensors checkpoints) and quantize the
# rest per tensor. The ignored layers stay float32, bit for bit the float model's. To stay
# in the time budget, these two engines are scored on the prose windows only.

# %%
K = 8
ignore = rank[:K]
mixed = LLM(MODEL, **COMMON, quantization="int8",
            quantization_config={"granularity": "tensor", "ignore": ignore})
assert torch.equal(target_layers(mixed.llm_engine.model_runner.model)[ignore[0]].weight, W[ignore[0]])
name_mixed = f"int8 per tensor, top {K} outlier layers ignored"
evaluate(name_mixed, mixed, qa_too=False)
del mixed
gc.collect()
# a control: K layers chosen without looking at the weights (one per block of layers)
control = [f"layers.{i}.{kinds[i % 4]}" for i in range(0, n_layers, n_layers // K)][:K]
ctrl = LLM(MODEL, **COMMON, quantization="int8",
           quantization_config={"granularity": "tensor", "ignore": control})
name_ctrl = f"int8 per tensor, {K} layers ignored blindly"
evaluate(name_ctrl, ctrl, qa_too=False)
del ctrl
gc.collect()
print("ignored by ratio:", ignore)
print("ignored blindly: ", control)
table(["int8 per tensor", name_mixed, name_ctrl, "int8 per channel"])

# %% [markdown]
# Compare the two middle rows: the layers the ratio points at carry a large share of
# per-tensor's damage, and as many layers picked blindly carry much less (the numbers are
# in the table and in the claims of section 6). Neither comes near per channel: every
# other layer still loses bits to its own, milder outlier rows, and each ignored layer
# costs float32 bytes (the MB column). Per channel is cheaper and better here; the ignore
# list is the tool for what per-channel scales cannot fix, next.
#
# ## 5. Outliers per-channel scales cannot fix: an input channel
#
# LLM.int8()'s outlier features are *input* dimensions of a linear layer: large
# activations in a few columns of `x`. Weight-only quantization meets them when an
# activation scale is folded into the weight, as SmoothQuant and AWQ do on purpose:
# multiply input column `j` of `W` by `s` and divide `x_j` by `s` (the producer's row
# `j` of the previous layer). The layer computes exactly the same, but column `j` of `W`
# is now `s` times larger in **every row**, so it sets every per-channel scale.
#
# This model has no such column by itself: the same ratio taken over *columns* (max |w| /
# median column amax) is of the size of section 2's row ratios (printed below), and
# per-channel quantization is already good in every layer (its relative weight error,
# section 2's table). So we **plant one, exactly**: `s = 2^6`, a power of two, so `x_j / s` and `W[:, j] · s` are exact in
# float32 and `y = x W^T` comes out **bit for bit** the same. On real activations of layer
# 11's down_proj (recorded through the step registry while the float engine scores one
# window):

# %%
captured = []


def record(x, weight, bias):
    captured.append(x.detach().reshape(-1, x.shape[-1]).clone())
    return linear_ref(x, weight, bias)


with base.swap_step("linear", record, where="layers.11.mlp.down_proj"):
    base.score(windows[:1], output="logits")
col_ratio = {n: float(v.abs().amax(dim=0).max() / v.abs().amax(dim=0).median()) for n, v in W.items()}
top_col = max(col_ratio, key=col_ratio.get)
print(f"largest column ratio in the model: {col_ratio[top_col]:.1f} ({top_col}); median over "
      f"layers {np.median(list(col_ratio.values())):.1f}")
x = captured[-1]
w = W["layers.11.mlp.down_proj"]
j = int(w.abs().amax(dim=0).argmax())                   # the column that is largest already
s = 2.0 ** 6
x_p, w_p = x.clone(), w.clone()
x_p[:, j] /= s
w_p[:, j] *= s
y, y_p = linear_ref(x, w, None), linear_ref(x_p, w_p, None)
print(f"input column {j}, s = {s:g}: outputs bit-equal after the reparametrization: "
      f"{torch.equal(y, y_p)}; column ratio of this layer {col_ratio['layers.11.mlp.down_proj']:.1f} "
      f"-> {float(w_p.abs().amax(0).max() / w_p.abs().amax(0).median()):.0f}")
assert torch.equal(y, y_p), "the reparametrization must be exact"


def out_err(xx, ww, gran):
    """Relative error of the layer output with ww quantized to int8 at gran."""
    yq = linear_ref(xx, wq.dequantize_int8(*wq.quantize_int8(ww, gran)), None)
    return float((yq - y).norm() / y.norm())


print("| weight | per tensor | per channel | per channel, column j kept float |\n|---|---|---|---|")
for label, xx, ww in (("original", x, w), (f"column {j} x {s:g} (planted)", x_p, w_p)):
    rest = ww.clone()
    rest[:, j] = 0                                        # quantize all but column j
    q_rest = wq.dequantize_int8(*wq.quantize_int8(rest, "channel"))
    q_rest[:, j] = ww[:, j]
    kept = float((linear_ref(xx, q_rest, None) - y).norm() / y.norm())
    print(f"| {label} | {out_err(xx, ww, 'tensor'):.4f} | {out_err(xx, ww, 'channel'):.4f} | "
          f"{kept:.4f} |")

# %% [markdown]
# Per channel, the planted column multiplies the layer's output error (second row against
# first): every row's scale is now set by column `j`, and the other columns lose the
# bits. Keeping that one column in float brings it back. The fixes are
# outside "per channel": keep the column (or the layer: `ignore`) in float, as LLM.int8()
# does with its outlier dimensions, or use scales along the input dimension too (groups,
# chapter 15). This is a layer-level experiment on recorded activations, stated as such:
# the unmodified model does not have such a column.
#
# ## 6. Claim vs measurement

# %%
r_t, r_c = RESULTS["int8 per tensor"], RESULTS["int8 per channel"]
r_m, r_b = RESULTS[name_mixed], RESULTS[name_ctrl]
claims = [
    ("int8 weights are 'nearly lossless' (seed 000 §2.4.3-2.4.4: weight quantization is the "
     "safe knob)",
     f"per channel: KL {r_c['kl']:.2g} nats, answer KL {r_c['answer_kl']:.2g}, QA "
     f"{100 * r_c['acc']:.0f}% (float32 {100 * RESULTS['float32']['acc']:.0f}%), "
     f"{r_c['changed']} of {len(qa)} greedy answers changed; per tensor: KL {r_t['kl']:.2g}, "
     f"QA {100 * r_t['acc']:.0f}% [{100 * r_t['acc_ci'][0]:.0f}, {100 * r_t['acc_ci'][1]:.0f}]: "
     "true only per channel"),
    ("per-channel scales beat per-tensor by 26x in KL (benchmarks/RESULTS.md, 2,560 positions)",
     f"{ratio:.0f}x here on {sum(map(len, windows))} positions "
     f"(CIs [{r_t['kl_ci'][0]:.3g}, {r_t['kl_ci'][1]:.3g}] vs [{r_c['kl_ci'][0]:.3g}, "
     f"{r_c['kl_ci'][1]:.3g}])"),
    ("a few outlier output channels set the per-tensor step (RESULTS.md's reading)",
     f"ignoring the {K} layers with the largest ratio (of {len(W)}) cuts KL from {r_t['kl']:.3g} "
     f"to {r_m['kl']:.3g}; {K} layers ignored blindly: {r_b['kl']:.3g}; hidden dimension 507 "
     f"is the largest output channel of {rows_507} of {n_layers} down_proj layers"),
    ("weight quantization hurts less than KV-cache quantization (seed 000 §2.4.3)",
     f"depends on the scheme: int8 weights per channel KL {r_c['kl']:.2g} here, per tensor "
     f"{r_t['kl']:.2g}; benchmarks/RESULTS.md (12 conversations, other text): fp8 e4m3 KV "
     "0.0066, int8 KV per token 0.00069: the scale's granularity matters as much as which "
     "tensor is quantized"),
    ("per-channel scales handle outliers (the usual advice)",
     "output channels yes; an input-channel outlier (planted exactly, section 5) sets every "
     "row's scale and needs float columns/layers (ignore) or input-side groups"),
    ("the weights came from Q4_1, so requantizing looks lossless (a reviewer's caution)",
     f"at most {max(d for d, _ in checks.values())} distinct values per group of 32 (Q4_1), but "
     "the int8 grid is not Q4_1's: int8 per channel still errs (KL above), and per tensor "
     "fails; the caution applies to 4-bit grids with groups of 32 (chapter 15)"),
    ("release a quantized model only after a regression check (seed 002 §五)",
     f"a KL check on {sum(map(len, windows))} positions separates the schemes with "
     "non-overlapping CIs; QA accuracy on a few dozen questions does not always: gate on "
     "KL (and answer KL), report accuracy beside it"),
]
print("| claim | measured |\n|---|---|")
for c, m in claims:
    print(f"| {c} | {m} |")

# %% [markdown]
# ## Common misconceptions
#
# - *"INT8 is INT8."* The scale's granularity decides the quality: per tensor and per
#   channel store the same bytes and differ by tens of times in KL on this model.
# - *"Per channel means per input channel."* In vLLM and llm-compressor it means one scale
#   per **output** channel (row of `[out, in]`). It isolates a large row, not a large
#   column.
# - *"Outliers are rare, so they don't matter."* One outlier row per layer is enough: it
#   sets the per-tensor scale for hundreds of thousands of weights.
# - *"Weight-only int8 touches activations."* It does not: activations and the LM head stay
#   float here; only the stored weights change (bytes: 538 → 220 MB with the float
#   embeddings).
# - *"If accuracy on my eval set didn't move, the quantization is fine."* With a few dozen
#   questions the accuracy CI is ±10 points; KL on a few hundred positions resolves
#   differences that accuracy cannot.
# - *"These weights came from 4-bit, so any 8-bit grid is lossless."* Only a grid that
#   contains the 4-bit grid is; int8 with a per-row scale does not.
#
# ## Lab
#
# `labs/source/ch14/` starts from the per-tensor engine. You write int8 quantization and
# dequantization (per tensor and per channel, bit for bit the engine's) and a finder for
# outlier channels; the grader registers your functions as a quantization method
# (`minivllm.quantization.register_quantization_method`), runs the engine with it on text
# you have not seen, and checks that the KL against float32 is back under the per-channel
# threshold while the per-tensor configuration is not. Last, with per-tensor scales only,
# you choose the one `o_proj` or `down_proj` to keep in float (`ignore`); the grader
# measures the KL it leaves on fresh text.
#
# ## On real vLLM
#
# - vLLM serves int8 weight-only from a quantized checkpoint: llm-compressor's `W8A16`
#   preset stores int8 weights with one symmetric scale per output channel (this
#   chapter's per-channel scheme). vLLM reads `quantization_config` from config.json;
#   no `--quantization` flag is needed.
# - Outlier layers: the checkpoint's `ignore` list (module names or `re:` patterns)
#   keeps them unquantized; vLLM applies it when it loads compressed-tensors weights.
# - `W8A8` (int8 activations too) is another scheme with other errors (docs: INT8
#   W8A8): measure the one you ship, with the `prompt_logprobs` KL of section 3.
# - Checked against vLLM's quantization docs and source, and compressed-tensors'
#   `quant_scheme.py` (2025-2026). This engine quantizes on load (`quantization="int8"`,
#   `granularity` "tensor" or "channel", `ignore`) and multiplies by the dequantized
#   weight (`F.linear`).

# %%
print(f"chapter 14 ran in {time.perf_counter() - T0:.0f} s")
