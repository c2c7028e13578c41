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
# # Chapter 10. Normalization and the residual stream: RMSNorm accumulation, fp16 activation overflow
#
# **Learning goals.** After this chapter you can
#
# 1. find the largest activations of a model (its residual stream, layer by layer and
#    token by token) and compare them with the range of float16 (65504) and with 255.9,
#    the largest |x| whose square float16 can hold;
# 2. explain why RMSNorm computes its mean square in float32 even when the model runs in
#    float16 or bfloat16, and measure what happens when it does not;
# 3. tell an fp16 **overflow** (a value past 65504: inf, then NaN everywhere) from a
#    precision loss, and say why bfloat16 does not overflow where float16 does;
# 4. weigh the fixes: float32 statistics, a clamp (and its cost), bfloat16, float32.
#
# **The incidents.**
# - **huggingface/transformers #36822** "Gemma 3 is broken with fp16" (2025-03-19):
#   gemma-3-4b-it on an RTX 4090 gave empty output in float16 and correct output in
#   bfloat16. Large RMSNorm weights and post-norms pushed the activations past
#   float16's maximum of 65504. The proposed fix, **PR #36832** (closed
#   without being merged), clamps the activations (and the residual adds, issue #39972); on gemma-3-12b-it the lm-eval
#   average was 0.752 in bfloat16 and 0.657 in float16 with the clamp. Later vLLM
#   builds refuse `--dtype float16` for Gemma 3 (seen in intel/llm-scaler #270).
# - The older precedent, **T5** (transformers #4287 in 2020, #9295 in 2021): the FFN's
#   output projection `wo` reaches about 66k in float16, giving inf and then NaN; fixed
#   with an inf clamp (PR #9487) and later by keeping `wo` in float32. NVIDIA
#   **TensorRT-LLM #1511** (2024-04-28) reports T5 float16 encoder NaNs again.
# - The "forgot to upcast" RMSNorm: computing `x.pow(2).mean()` in the activation dtype.
#   HF's `LlamaRMSNorm` and vLLM's `RMSNorm.forward_native` (`vllm/model_executor/layers/
#   layernorm.py`) both cast to float32 first for this reason.
#
# Everything below is measured when the notebook runs, on the embedded SmolLM2-135M-Instruct
# with minivllm on this machine's CPU. **This model does not overflow float16 on its own**
# (section 1 shows by how much it stays under): the overflow of sections 3-4 uses an exact
# reparametrization, `faults.residual_scale_reparam`, that scales the residual stream by
# `c` and leaves float32 outputs bit-identical (tested in `tests/test_norm_faults.py` and
# `tests/test_dtype_rule.py`). The RMSNorm fault of section 2 is natural on this model.

# %%
# %matplotlib inline
import time

import torch
from matplotlib.figure import Figure

from minivllm import LLM
from minivllm.i18n import Bi, claims_table, say
from minivllm.layers.rms_norm import RMSNorm, rms_norm_ref
from minivllm.precision import evalsets, faults, metrics
from minivllm.precision.layer_diff import capture_hidden_states, find_first_jump, relative_error
from minivllm.precision.overflow import track_nonfinite

torch.manual_seed(0)
T0 = time.perf_counter()
MODEL = "smollm2-135m-instruct"
FP16_MAX = torch.finfo(torch.float16).max
SQ_MAX = FP16_MAX ** 0.5  # the largest |x| whose square float16 holds: 255.94

f32 = LLM(MODEL, dtype="float32", max_model_len=256)
f16 = LLM(MODEL, dtype="float16", max_model_len=256)
bf16 = LLM(MODEL, dtype="bfloat16", max_model_len=256)
tok = f32.get_tokenizer()
text = evalsets.load_corpus()
# two sequences as a chat prompt starts: <|im_start|> (id 1), then corpus text
seqs = [[1] + tok.encode(text[s:s + 1500])[:23] for s in (2000, 9000)]
print(f"{len(seqs)} sequences of {[len(s) for s in seqs]} tokens; float16 max {FP16_MAX:.0f}, "
      f"largest |x| with a finite float16 square {SQ_MAX:.2f}")


def score(llm):
    return llm.score(seqs)


def kl(ref_rows, rows):
    """Mean KL (nats) over both sequences' positions; NaN if any row is not finite."""
    if not all(bool(torch.isfinite(r).all()) for r in rows):
        return float("nan")
    return sum(metrics.mean_kl(a, b) for a, b in zip(ref_rows, rows)) / len(rows)


def bad_rows(rows):
    return sum(int((~torch.isfinite(r)).any(-1).sum()) for r in rows)


ref = score(f32)

# %% [markdown]
# ## 1. How large does the residual stream get?
#
# A Llama layer adds its attention output and its MLP output to the **residual stream**
# (`h = x + attn(norm(x)); h = h + mlp(norm(h))`). Nothing bounds the stream itself: only
# what goes *into* each sublayer is normalised. Record max |x| of the stream after every
# layer, per token, in float32.

# %%
def stream_max(llm, ids):
    """[layers, tokens]: max |x| over the hidden dimension of the stream after each layer."""
    model = llm.llm_engine.model_runner.model
    out = {}
    hooks = [layer.register_forward_hook(
        lambda m, a, o, i=i: out.__setitem__(i, o.detach().abs().float().amax(-1)))
        for i, layer in enumerate(model.layers)]
    mlp = {}
    hooks.append(model.layers[11].mlp.register_forward_hook(
        lambda m, a, o: mlp.__setitem__("out", o.detach().abs().float().amax(-1))))
    try:
        llm.score(ids)
    finally:
        for h in hooks:
            h.remove()
    return torch.stack([out[i] for i in range(len(model.layers))]), mlp["out"]


peaks, mlp11 = stream_max(f32, seqs[0])
per_layer = peaks.amax(1)
tok0, rest = peaks[:, 0], peaks[:, 1:].amax(1)
peak = float(per_layer.max())
say(f"peak of the residual stream: {peak:.0f} = {100 * peak / FP16_MAX:.0f} % of float16's "
    f"{FP16_MAX:.0f}, first reached after layer {int((per_layer > 0.9 * peak).nonzero()[0])}",
    f"残差流的峰值：{peak:.0f} = float16 的 {FP16_MAX:.0f} 的 {100 * peak / FP16_MAX:.0f} %，"
    f"最早在第 {int((per_layer > 0.9 * peak).nonzero()[0])} 层之后达到")
say(f"that peak is on token 0 (the first token): max over the other tokens is "
    f"{float(rest.max()):.0f}",
    f"这个峰值在 token 0（第一个 token）上：其他 token 的最大值为 "
    f"{float(rest.max()):.0f}")
print(f"layer 11's MLP output on token 0: {float(mlp11[0]):.0f} (one matmul writes it)")
grab = []
handle = f32.llm_engine.model_runner.model.layers[11].register_forward_hook(
    lambda m, a, o: grab.append(o.detach()[0].abs()))
try:
    f32.score(seqs[:1])
finally:
    handle.remove()
top = grab[-1].topk(3)
print(f"token 0 after layer 11: dims {top.indices.tolist()} hold "
      f"{', '.join(f'{v:,.0f}' for v in top.values.tolist())}; median |x| of that row "
      f"{float(grab[-1].median()):.3g}")
say(f"layers whose stream passes |x| = 255.9 on token 0: "
    f"{[i for i in range(len(tok0)) if tok0[i] > SQ_MAX]}",
    f"token 0 的残差流超过 |x| = 255.9 的层："
    f"{[i for i in range(len(tok0)) if tok0[i] > SQ_MAX]}")
print("| layer | 0 | 1 | 2 | 8 | 10 | 11 | 20 | 27 | 28 | 29 |")
print("|---|---|---|---|---|---|---|---|---|---|---|")
print("| max abs x, token 0 | " + " | ".join(f"{float(tok0[i]):.0f}" for i in (0, 1, 2, 8, 10, 11, 20, 27, 28, 29)) + " |")
print("| max abs x, tokens 1.. | " + " | ".join(f"{float(rest[i]):.0f}" for i in (0, 1, 2, 8, 10, 11, 20, 27, 28, 29)) + " |")
# the first token's stream depends on that token alone (causal attention): score other
# first tokens as one-token sequences to see how the peak varies with it
step = (len(text) - 1000) // 10
firsts = [1] + [tok.encode(text[s:s + 200])[0] for s in range(500, 500 + 10 * step, step)]
first_peaks = stream_max(f32, [[t] for t in firsts])[0].amax(0)
say(f"peak for {len(firsts)} different first tokens: {float(first_peaks.min()):.0f} to "
    f"{float(first_peaks.max()):.0f} (<|im_start|>: {float(first_peaks[0]):.0f})",
    f"{len(firsts)} 个不同的第一个 token 的峰值：{float(first_peaks.min()):.0f} 到 "
    f"{float(first_peaks.max()):.0f}（<|im_start|>：{float(first_peaks[0]):.0f}）")

# %%
fig = Figure(figsize=(8, 3.6))
ax = fig.subplots()
ax.semilogy(tok0.numpy(), "o-", label="token 0")
ax.semilogy(rest.numpy(), "s-", label="every other token (max)")
ax.semilogy((4 * tok0).numpy(), ":", color="C3", label="token 0, stream scaled by c = 4 (section 3)")
ax.axhline(FP16_MAX, color="k", lw=1)
ax.text(0, FP16_MAX * 1.15, "float16 max 65504", fontsize=8)
ax.axhline(SQ_MAX, color="gray", lw=1, ls="--")
ax.text(0, SQ_MAX * 1.15, "255.9: x*x overflows float16 above this", fontsize=8)
ax.set_xlabel("decoder layer")
ax.set_ylabel("max |x| of the residual stream")
ax.legend(fontsize=8, loc="lower right")
fig.tight_layout()
fig

# %% [markdown]
# The peak is a **massive activation** (Sun et al. 2024, "Massive Activations in Large
# Language Models"): on the first token, concentrated in very few hidden dimensions
# (the dimensions printed above), written by layer 11's MLP in one
# step and carried by the stream almost to the end, while the other tokens stay in the
# hundreds. It stays well inside float16's range (the percentage above), so the
# unmodified model does **not** overflow float16. Note the plot's "every other token"
# curve, though: the other tokens pass 255.9 too (in the plot, layers 2-9 and 23-29, as
# the claims table prints), which matters in section 2. How close float16 and bfloat16 get to float32 on
# these sequences:

# %%
rows16, rowsbf = score(f16), score(bf16)
kl16, klbf = kl(ref, rows16), kl(ref, rowsbf)
say(f"mean KL vs float32: float16 {kl16:.2e} nats, bfloat16 {klbf:.2e} nats "
    f"(float16 {klbf / kl16:.0f}x closer); non-finite rows: {bad_rows(rows16)}, {bad_rows(rowsbf)}",
    f"相对 float32 的平均 KL：float16 {kl16:.2e} nats，bfloat16 {klbf:.2e} nats "
    f"（KL 相差 {klbf / kl16:.0f} 倍，float16 更接近）；非有限的行：{bad_rows(rows16)}、{bad_rows(rowsbf)}")

# %% [markdown]
# Float16 has 10 mantissa bits to bfloat16's 7, so while nothing leaves its range it is
# the more precise of the two, here by more than an order of magnitude (the ratio above).
# The rest of the chapter is about what happens when something does leave it.
#
# ## 2. An RMSNorm that forgets to upcast
#
# `rms_norm_ref` (HF `LlamaRMSNorm`) casts x to float32, takes `mean(x**2)`, normalises,
# casts back, multiplies by the weight. `faults.rms_norm_no_upcast` takes the mean square
# in the activation dtype. In float16 a square past 65504 is inf: a row with any
# |x| > 255.9 gets an inf variance, `rsqrt(inf) = 0`, and the whole row normalises to 0.

# %%
w4 = torch.ones(4, dtype=torch.float16)
row = torch.tensor([[300.0, 1.0, -2.0, 4.0]], dtype=torch.float16)
print("row", row.tolist(), "-> reference", [round(v, 4) for v in rms_norm_ref(row, w4, 1e-5)[0].tolist()],
      "-> without the upcast", faults.rms_norm_no_upcast(row, w4, 1e-5)[0].tolist())

zeroed = {}


def count_zero_rows(llm):
    """Hooks on every RMSNorm: how many token rows come out all zero, per norm."""
    hooks = []
    for name, m in llm.llm_engine.model_runner.model.named_modules():
        if isinstance(m, RMSNorm):
            hooks.append(m.register_forward_hook(lambda mod, a, o, name=name: zeroed.__setitem__(
                name, zeroed.get(name, set()) | set((o == 0).all(-1).nonzero()[:, 0].tolist()))))
    return hooks


hooks = count_zero_rows(f16)
with faults.rmsnorm_no_upcast(f16):
    rows16_bad = score(f16)
for h in hooks:
    h.remove()
hit = {k: v for k, v in zeroed.items() if v}
starts = {0, len(seqs[0])}  # the batch's rows: sequence 0's tokens, then sequence 1's
say(f"float16 with the fault in every norm: {len(hit)} of {len(zeroed)} norms zeroed rows; "
    f"the rows zeroed anywhere: {sorted(set().union(*hit.values()))} (the first token of "
    f"each sequence is row {sorted(starts)}); first norms hit: {list(hit)[:3]}",
    f"每个归一化都带故障的 float16：{len(zeroed)} 个归一化中有 {len(hit)} 个清零了某些行；"
    f"在任意处被清零的行：{sorted(set().union(*hit.values()))}（每个序列的第一个 token 是第 "
    f"{sorted(starts)} 行）；最早受影响的归一化：{list(hit)[:3]}")
with faults.rmsnorm_no_upcast(bf16):
    rowsbf_bad = score(bf16)
with faults.rmsnorm_no_upcast(f32):
    rows32_bad = score(f32)
print("| dtype | correct RMSNorm: KL vs float32 | no upcast: KL vs float32 |")
print("|---|---|---|")
same32_noup = all(torch.equal(a, b) for a, b in zip(ref, rows32_bad))
print(f"| float32 | 0 | bit-identical: {same32_noup} |")
print(f"| float16 | {kl16:.2e} | {kl(ref, rows16_bad):.3g} |")
print(f"| bfloat16 | {klbf:.2e} | {kl(ref, rowsbf_bad):.2e} |")

# %% [markdown]
# Almost every row is zeroed by some norm (the printed list: 46 of the 48 rows): the
# first token wherever its stream passes 255.9, from layer 2's input norm on (the first
# norms hit), the others in the layers where theirs does (section 1's plot, the "every
# other token" curve). A zeroed row gives attention a zero query, key and value for that
# token, and the final norm zeroes the logits of every token still past 255.9 at the
# end: a uniform distribution, whose KL against float32's is ln(vocabulary size) minus
# float32's entropy at that position, several nats (the code does not split the mean KL
# printed above by cause). In bfloat16 the same code cannot zero a row (bfloat16 has
# float32's exponent range, so squares never overflow), and its KL is no worse than with
# the correct norm (the table's last row); in float32 the fault *is* the reference.
#
# The layer diff finds it. Plant it in layer 17 only and compare the captured hidden
# states with the correct float16 engine's (same bits up to the fault):

# %%
with faults.rmsnorm_no_upcast(f16, where=17):
    cap_bad = capture_hidden_states(f16, seqs[0])
cap_good = capture_hidden_states(f16, seqs[0])
errs = {p: relative_error(cap_bad[p], cap_good[p]) for p in cap_good}
say(f"first jump: {find_first_jump(errs, 30)} (layer, block); relative error of layer 16's "
    f"stream {errs['layers.16']:.1e}, layer 17's attention output {errs['layers.17.self_attn']:.2f}",
    f"第一次跃变：{find_first_jump(errs, 30)}（层，模块）；第 16 层残差流的相对误差 "
    f"{errs['layers.16']:.1e}，第 17 层注意力输出的相对误差 {errs['layers.17.self_attn']:.2f}")

# %% [markdown]
# ## 3. Overflowing the residual stream, exactly
#
# To see float16 overflow on this model we make its activations larger **without
# changing what it computes**. `faults.residual_scale_reparam(llm, c)`:
#
# - multiplies the embeddings by `c` (Gemma multiplies its embeddings by
#   sqrt(hidden_size) the same way), and the outputs of every `o_proj` and `down_proj`
#   (the two sublayer outputs added to the stream) by `c`, so the stream after every layer
#   is `c` times the original;
# - multiplies every RMSNorm's eps by `c**2`, because
#   `norm(c h; c^2 eps) = c h / sqrt(c^2 mean(h^2) + c^2 eps) = norm(h; eps)`:
#   every norm output, so attention, MLP inputs and the (tied, untouched) LM head, is as
#   before.
#
# With `c` a power of two every scaling is exact in binary floating point (only the
# exponent moves) until a value leaves the range. So at `c = 4` float32 and bfloat16 must
# give the *same bits*, and float16 the same bits until a value passes 65504. The peak
# is multiplied by 4 (the dotted line of the plot above).

# %%
C = 4.0
table = {}
for name, llm, plain in (("float32", f32, ref), ("float16", f16, rows16), ("bfloat16", bf16, rowsbf)):
    with faults.residual_scale_reparam(llm, C), track_nonfinite(llm) as counts:
        rows = score(llm)
    table[name] = (rows, counts.first(), all(torch.equal(a, b) for a, b in zip(plain, rows)))
print(f"| dtype | c = 1: KL vs float32 | c = {C:g}: KL vs float32 | c = {C:g}: bit-identical to c = 1 "
      f"| non-finite rows | first non-finite module |")
print("|---|---|---|---|---|---|")
for name, plain in (("float32", ref), ("float16", rows16), ("bfloat16", rowsbf)):
    rows, first, same = table[name]
    print(f"| {name} | {kl(ref, plain):.2e} | {kl(ref, rows):.3g} | {same} | "
          f"{bad_rows(rows)} of {sum(map(len, seqs))} | {first} |")

# %% [markdown]
# Side by side: float32 and bfloat16 compute the amplified model bit for bit as the
# original; float16 overflows at layer 11's MLP (the matmul that writes the peak), the
# next norm turns the inf into NaN (`inf * rsqrt(inf) = inf * 0`), attention spreads it
# to every later token, and every row is NaN. That is Gemma 3's empty output and T5's
# NaN. The engine notices: a request whose logits hold NaN ends with
# `finish_reason="error"` (`llm.stats.num_corrupted_requests`) instead of sampling garbage.
#
# ## 4. The fixes, measured
#
# **bfloat16** needs no fix: same exponent range as float32 (the table above). It costs
# precision everywhere (its KL in section 1), which is why float16 is tempting when a
# model fits its range.
#
# **A clamp.** transformers clamps the stream into float16's range where it is added
# (issue #39972: `(residual + hidden).float()`, clamp to 65504, `.half()`; T5's PR #9487
# clamps infs). In minivllm every residual add goes through the step
# `"fused_add_rms_norm"` (vLLM's `fused_add_rms_norm`, `fused_add_rms_norm_ref`), so the
# clamp is one function swapped in. Where nothing overflows it changes no bit; where
# something does, it clips the value, and the cost depends on how much it clips:

# %%
def fused_add_rms_norm_clamped(x, residual, weight, eps):
    """The residual add in float32, clamped into the stream dtype's range, then stored."""
    limit = torch.finfo(residual.dtype).max
    h = (residual.float() + x.float()).clamp(-limit, limit).to(residual.dtype)
    return rms_norm_ref(h, weight, eps), h


with f16.swap_step("fused_add_rms_norm", fused_add_rms_norm_clamped):
    rows_c1 = score(f16)
say(f"unmodified model, float16, clamped adds: bit-identical to the engine's own: "
    f"{'True' if all(torch.equal(a, b) for a, b in zip(rows_c1, rows16)) else 'False'}",
    f"未修改的模型，float16，带截断的相加：与引擎自己的结果逐位相同："
    f"{'是' if all(torch.equal(a, b) for a, b in zip(rows_c1, rows16)) else '否'}")
cs = [2.75, 3.0, 4.0, 8.0]
cost = {}
for c in cs:
    with faults.residual_scale_reparam(f16, c):
        broken = score(f16)
        with f16.swap_step("fused_add_rms_norm", fused_add_rms_norm_clamped):
            fixed = score(f16)
    cost[c] = (bad_rows(broken), bad_rows(fixed), kl(ref, fixed),
               sum(metrics.top1_agreement(a, b) for a, b in zip(ref, fixed)) / len(seqs))
print("| c | token 0's peak | engine's add: non-finite rows | clamped: non-finite rows | "
      "clamped: KL vs float32 | clamped: top-1 agreement |")
print("|---|---|---|---|---|---|")
for c in cs:
    b, f, k, t1 = cost[c]
    print(f"| {c:g} | {c * float(tok0.max()):.0f} | {b} | {f} | {k:.2e} | {100 * t1:.0f}% |")

# %%
fig = Figure(figsize=(6.5, 3.2))
ax = fig.subplots()
over = [c for c in cs if cost[c][0]]
ax.semilogy([c * float(tok0.max()) / FP16_MAX for c in over], [cost[c][2] for c in over], "o-",
            label="float16, clamped residual adds")
ax.axhline(klbf, color="C1", ls="--", label=f"bfloat16, any c ({klbf:.1e})")
ax.axhline(kl16, color="C2", ls=":", label=f"float16, no overflow ({kl16:.1e})")
ax.set_xlabel("token 0's peak / 65504 (how far past the range)")
ax.set_ylabel("mean KL vs float32 (nats)")
ax.legend(fontsize=8)
fig.tight_layout()
fig

# %% [markdown]
# The clamp turns NaN into a working model, and costs about as much as bfloat16 (same
# order of magnitude) while it clips a few percent (c = 2.75: the peak is a few percent
# past the range). Clipping the massive activation by a quarter or more (c = 4, 8)
# changes the first token's normalised values, which every other token attends to (the
# first token is the model's *attention sink*), and the cost grows past a nat, with
# top-1 agreement dropping. That is the shape of Gemma 3's float16-with-clamp losing 0.752 -> 0.657 on
# lm-eval.
#
# **Float32 statistics** fix section 2's fault completely (that is what `rms_norm_ref`
# does); they do nothing for section 3, where the *value* does not fit float16. Keeping
# the stream itself wider is what Megatron's `fp32_residual_connection` and T5's
# `_keep_in_fp32_modules = ["wo"]` do; vLLM keeps the stream in the activation dtype and
# rejects float16 for models known to overflow it (Gemma 2/3: chapter 12's dtype rule).
#
# ## Claim vs measurement

# %%
def spans(idx):
    """[2, 3, 4, 9] -> '2-4, 9'."""
    out = []
    for i in idx:
        if out and i == out[-1][1] + 1:
            out[-1][1] = i
        else:
            out.append([i, i])
    return ", ".join(f"{a}-{b}" if b > a else f"{a}" for a, b in out) or "none"


kl_noup = kl(ref, rows16_bad)
SEVERE = 1.0  # nats: a KL above this is severe (the clamp's cost at c = 4 is of this order)
n_rows = sum(map(len, seqs))
nan16, nanbf = bad_rows(table["float16"][0]), bad_rows(table["bfloat16"][0])
rows_zeroed = set().union(*hit.values())
rest_over = [i for i in range(len(rest)) if rest[i] > SQ_MAX]
clamp_fixes = all(cost[c][1] == 0 for c in cs)
clamp_costs = max(cost[c][2] for c in cs) > kl16  # above float16's KL without overflow
stream_part = (Bi(f"on token 0 only (other tokens at most {float(rest.max()):.0f})",
                  f"仅在 token 0 上（其他 token 至多 {float(rest.max()):.0f}）")
               if float(tok0.max()) == peak and float(rest.max()) < peak
               else Bi("not on token 0 alone", "不只在 token 0 上"))
clamp_part = (Bi("no NaN at any c", "任何 c 下都没有 NaN") if clamp_fixes else
              Bi(f"NaN at c = {[c for c in cs if cost[c][1]]}",
                 f"c = {[c for c in cs if cost[c][1]]} 时出现 NaN"))
zeroed_part = (Bi(f"not only the first token: the others pass 255.9 in layers "
                  f"{spans(rest_over)}, section 1's plot",
                  f"不只是第一个 token：其他 token 在第 {spans(rest_over)} 层超过 255.9，"
                  f"见第 1 节的图")
               if rows_zeroed - starts else Bi("the first tokens only", "只有第一个 token"))
claims_table([
    (Bi("Gemma 3 / T5 in fp16: activations pass 65504, inf then NaN (#36822, #9295)",
        "fp16 下的 Gemma 3 / T5：激活超过 65504，先 inf 后 NaN（#36822、#9295）"),
     Bi(f"{'not on this model by itself' if peak < FP16_MAX else 'yes, on this model by itself'}"
        f": its stream peaks at {peak:.0f} ({100 * peak / FP16_MAX:.0f} % of 65504), "
        + stream_part.en + "; "
        + f"{'reproduced' if nan16 else 'not reproduced'}"
        f" with the exact reparametrization: at c = {C:g} {nan16} of {n_rows} rows NaN in "
        f"float16, first non-finite {table['float16'][1]}",
        f"{'这个模型本身不会' if peak < FP16_MAX else '会，这个模型本身就会'}"
        f"：它的残差流峰值为 {peak:.0f}（65504 的 {100 * peak / FP16_MAX:.0f} %），"
        + stream_part.zh + "；"
        + f"{'已复现' if nan16 else '未复现'}"
        f"（使用精确的重参数化）：c = {C:g} 时 float16 的 {n_rows} 行中有 {nan16} 行为 NaN，"
        f"最早出现非有限值的是 {table['float16'][1]}")),
    (Bi("bf16 is the safe choice where fp16 overflows", "在 fp16 溢出的地方，bf16 是安全的选择"),
     Bi(f"{'yes' if nanbf == 0 else 'no'}"
        f": at c = {C:g} bfloat16 has {nanbf} non-finite rows and is bit-identical to the "
        f"unscaled model ({'True' if table['bfloat16'][2] else 'False'}), KL {klbf:.1e}",
        f"{'是' if nanbf == 0 else '否'}"
        f"：c = {C:g} 时 bfloat16 有 {nanbf} 个非有限的行，与未缩放的模型逐位相同"
        f"（{'是' if table['bfloat16'][2] else '否'}），KL {klbf:.1e}")),
    (Bi("fp16 is more precise than bf16 while nothing overflows (course plan: KL 1.8e-5 vs "
        "1.0e-3)",
        "在没有溢出时 fp16 比 bf16 更精确（课程计划：KL 1.8e-5 对 1.0e-3）"),
     Bi(f"{'yes' if kl16 < klbf else 'no'}"
        f": {kl16:.1e} vs {klbf:.1e} here ({klbf / kl16:.0f}x)",
        f"{'是' if kl16 < klbf else '否'}"
        f"：此处 {kl16:.1e} 对 {klbf:.1e}（{klbf / kl16:.0f}x）")),
    (Bi("the clamp proposed in PR #36832 fixes fp16 but costs accuracy (0.752 -> 0.657 lm-eval)",
        "PR #36832 提议的截断修复了 fp16，但损失准确率（lm-eval 0.752 -> 0.657）"),
     Bi(f"{'both' if clamp_fixes and clamp_costs else 'fixes it at no cost' if clamp_fixes else 'does not fix it'}"
        ": " + clamp_part.en
        + f"; KL {cost[2.75][2]:.1e} at c = 2.75, {cost[4.0][2]:.2f} at c = 4, "
        f"{cost[8.0][2]:.2f} at c = 8 (float16 without overflow: {kl16:.1e})",
        f"{'两者都对' if clamp_fixes and clamp_costs else '修复了且没有代价' if clamp_fixes else '没有修复'}"
        "：" + clamp_part.zh
        + f"；c = 2.75 时 KL {cost[2.75][2]:.1e}，c = 4 时 {cost[4.0][2]:.2f}，"
        f"c = 8 时 {cost[8.0][2]:.2f}（无溢出的 float16：{kl16:.1e}）")),
    (Bi("course plan: amplify with c = 3 (peak 67.7k)", "课程计划：用 c = 3 放大（峰值 67.7k）"),
     Bi(f"the peak depends on the first token "
        f"({float(first_peaks.min()):.0f} to {float(first_peaks.max()):.0f} over "
        f"{len(firsts)} first tokens), so c = 3 overflows "
        f"{int((3 * first_peaks > FP16_MAX).sum())} of them; here token 0 is <|im_start|>: "
        f"{3 * float(tok0.max()):.0f} at c = 3",
        f"峰值取决于第一个 token（在 {len(firsts)} 个不同的第一个 token 上为 "
        f"{float(first_peaks.min()):.0f} 到 {float(first_peaks.max()):.0f}），所以 c = 3 "
        f"让其中 {int((3 * first_peaks > FP16_MAX).sum())} 个溢出；这里 token 0 是 "
        f"<|im_start|>：c = 3 时为 {3 * float(tok0.max()):.0f}")),
    (Bi("the fp16 'forgot to upcast' RMSNorm is severe on this model (\\|x\\| > 256)",
        "fp16 中“忘了提升精度”的 RMSNorm 在这个模型上很严重（\\|x\\| > 256）"),
     Bi(f"{'yes' if kl_noup > SEVERE else 'no'}"
        f": KL {kl_noup:.2f} nats (severe: > {SEVERE:g}); {len(rows_zeroed)} of {n_rows} token "
        f"rows zeroed by some norm (" + zeroed_part.en
        + f"); bfloat16 {kl(ref, rowsbf_bad):.1e}; float32 "
        f"{'bit-identical' if same32_noup else 'changed'}",
        f"{'是' if kl_noup > SEVERE else '否'}"
        f"：KL {kl_noup:.2f} nats（严重：> {SEVERE:g}）；{n_rows} 个 token 行中有 "
        f"{len(rows_zeroed)} 行被某个归一化清零（" + zeroed_part.zh
        + f"）；bfloat16 {kl(ref, rowsbf_bad):.1e}；float32 "
        f"{'逐位相同' if same32_noup else '有改变'}")),
    (Bi("course plan (lab idea): scale one down_proj or norm weight by 1000",
        "课程计划（实验构想）：把某个 down_proj 或归一化权重放大 1000 倍"),
     Bi(f"not exact (changes the model); the reparametrization above "  # fact, not a measurement
        f"{'changes no float32 bit' if table['float32'][2] else 'changes float32 bits too'}",
        f"不精确（改变了模型）；上面的重参数化"
        f"{'不改变 float32 的任何一位' if table['float32'][2] else '也改变了 float32 的位'}")),
], header=(Bi("claim", "论断"), Bi("what we measured here", "本次实测结果")))

# %% [markdown]
# ## Common misconceptions
#
# - *"float16 is more precise than bfloat16, so it is the better 16-bit format."* More
#   precise inside its range (section 1: over an order of magnitude closer to float32);
#   useless outside it. One value past 65504 and every logit is NaN.
# - *"The float32 upcast in RMSNorm is a precision nicety."* In float16 it is about
#   range: the square of anything above 255.9 overflows, and this model's stream passes
#   that on most tokens somewhere (section 1's plot; section 2 lists
#   the rows zeroed, 46 of 48).
# - *"A clamp fixes float16 overflow."* It removes the NaN. Its cost grows with how
#   much it clips: nothing below the range (bit-identical), bfloat16's order of cost a
#   few percent over, more than a nat when a massive activation loses a quarter of its
#   size (section 4's table).
# - *"Clamp NaN too, and the output is clean."* A NaN means an operation already failed
#   (0 * inf, inf - inf); `nan_to_num` would hide a corrupted request behind plausible
#   numbers. Clamp infinities, never NaN.
# - *"Scaling the activations changes the model."* Not through an RMSNorm, with eps
#   scaled by c^2: float32 gives the same bits at c = 4. The scale of the stream is a free
#   parameter of the model, which is why some models (Gemma) have it large and others
#   (SmolLM2) do not.
#
# ## Lab
#
# `labs/source/ch10/` starts from the two broken float16 engines of this chapter. You
# write `rms_norm` (float32 statistics), `clamp_for_dtype` (infinities into the range, NaN
# left alone) and `fused_add_rms_norm` (vLLM's residual add + norm, with the clamp). The
# grader checks them on fresh tensors against the engine's references, then plugs them
# into the engine through the step registry on fresh sequences: your norm brings the
# faulty engine's KL from several nats back under 1e-4 (or under twice the correct float16
# engine's, on the rare draw where float16 flips a near tie), and your fused add brings the
# amplified engine (c = 2.75) from NaN to finite logits within 1e-2 nats of float32.
# Last, you decide for the unmodified and the amplified model whether to serve float16
# (with your fixes) or bfloat16; the grader measures both on fresh sequences.
#
# ## On real vLLM
#
# - vLLM refuses `--dtype float16` for the model types it knows to overflow (`gemma2`,
#   `gemma3`, `gemma3_text`, `plamo2`, `glm4`: "does not support float16"); it checks no
#   other model, so measure the activation peak before serving float16.
# - Its `RMSNorm` is the custom op `rms_norm`:
#   `--compilation-config '{"custom_ops": ["+rms_norm"]}'` runs the op's own kernel,
#   `"-rms_norm"` lets torch.compile build one from `forward_native`; compare the two.
# - An overflow ends in NaN logits: `VLLM_COMPUTE_NANS_IN_LOGITS=1` counts those
#   requests in `vllm:corrupted_requests`; compare float16 and bfloat16 replicas on it.
# - Checked against vLLM's source and docs of 2025-2026 (`vllm/config/model.py`,
#   `layernorm.py`, the compilation config). This engine's norm reference upcasts to
#   float32 (`rms_norm_ref`); the clamp and the fused add + norm of the lab are steps you
#   install (`fused_add_rms_norm` is vLLM's name for the fused op).

# %%
print(f"chapter 10 ran in {time.perf_counter() - T0:.0f} s")
