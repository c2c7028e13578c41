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
# # Chapter 9. Softmax and attention numerics: max subtraction, online softmax, fp16 QK overflow, fully masked rows
#
# **Learning goals.** After this chapter you can
#
# 1. say where attention can leave a 16-bit format's range: the raw product `q.k`
#    (before the scale), `exp` of an unshifted score, and a row with nothing to attend
#    to, and give the thresholds (65504, ln 65504 = 11.09, ln(float32 max) = 88.7);
# 2. measure how close a real model comes to them, per layer, and tell a model that is
#    safe by luck from an implementation that is safe by construction;
# 3. write the three guards production kernels have: subtract the max, keep the scores
#    in float32 until they are scaled, and give a fully masked row 0;
# 4. explain the online softmax (FlashAttention's loop) and why it needs the same -inf
#    guard.
#
# **The incidents.**
#
# - **vllm #14126** "Qwen 2.5 produces all !!!!" (2025-03) and
#   **ggml-org/llama.cpp #7805** (2024-06; Qwen2 printed "GGGG" without flash attention), fixed by **PR #8412**
#   (2024-07-10), which forces the KQ matmul to F32 as was already done for Phi-2, Phi-3
#   and GPT-NeoX: `q @ k^T` rounded to fp16 passed 65504, became inf, and the softmax
#   turned inf into NaN.
# - **unslothai/unsloth #9708 / #9848** (2026-09): a left-padded row with nothing to attend
#   to gave NaN logits in fp16 and decoded to an empty string.
# - **vllm #23813** (2025): FP8 attention on Hopper accumulates in a register that does not
#   keep full fp32 precision, so the error grows with context length; fixed by two-level
#   accumulation that flushes each tile into a true fp32 accumulator
#   (vllm-project/flash-attention PR #104, Dao-AILab/flash-attention PR #2250).
#
# Everything below is measured when the notebook runs, on the embedded
# SmolLM2-135M-Instruct with minivllm on this machine's CPU, except the guard's benchmark
# figures in section 5, quoted from `benchmarks/RESULTS.md`. **The model's raw scores
# `q.k` do not overflow float16 on their own** (section 2 measures how far they stay
# below; what does break on the unmodified model is a softmax without max subtraction,
# section 4); to show the `q.k` overflow we use an exact
# reparametrization of its weights, `faults.qk_scale_reparam`, which leaves the float32
# output bit-identical, and say so wherever it is used.

# %%
# %matplotlib inline
import contextlib
import math
import time

import numpy as np
import torch
from matplotlib.figure import Figure

from minivllm import LLM, SamplingParams
from minivllm.i18n import Bi, claims_table, say
from minivllm.attention.backends.torch_ref import decode_attention_ref, prefill_attention_ref
from minivllm.precision import evalsets, faults, metrics
from minivllm.precision.overflow import track_nonfinite

torch.manual_seed(0)
T0 = time.perf_counter()
MODEL = "smollm2-135m-instruct"
FP16_MAX = torch.finfo(torch.float16).max
F32_LN_MAX = math.log(torch.finfo(torch.float32).max)  # 88.72: exp overflows float32 above it
kw = dict(max_model_len=320, num_gpu_blocks_override=48, seed=0)
llm32 = LLM(MODEL, dtype="float32", **kw)
llm16 = LLM(MODEL, dtype="float16", **kw)
tok = llm32.get_tokenizer()
text = evalsets.load_corpus()
ids_long = tok.encode(text[2000:12000])[:256]   # for the per-layer score survey
ids = ids_long[:48]                              # for the float16 runs (fp16 is slow on CPU)
attn0 = llm32.llm_engine.model_runner.model.layers[0].self_attn
NUM_LAYERS = len(llm32.llm_engine.model_runner.model.layers)
print(f"{NUM_LAYERS} layers, head_dim {attn0.head_dim}, softmax scale {attn0.scaling}")

# %% [markdown]
# ## 1. Where a softmax leaves the format
#
# `softmax(s)_i = exp(s_i) / sum_j exp(s_j)`. Written like that, `exp` overflows as soon
# as one score passes ln(max) of the format it runs in. Subtracting the row's max first
# changes nothing mathematically (the factor `exp(-max)` cancels) and makes every
# exponent <= 0, so the largest term is exactly 1 and nothing can overflow. A row whose
# every entry is masked (-inf) has max -inf, and `-inf - -inf` is NaN: that row needs its
# own rule.

# %%
print("| format | largest finite | ln(largest): exp overflows above |")
print("|---|---|---|")
for dt in (torch.float16, torch.bfloat16, torch.float32):
    fi = torch.finfo(dt)
    print(f"| {str(dt)[6:]} | {fi.max:.4g} | {math.log(fi.max):.2f} |")


def softmax_naive(s):
    e = torch.exp(s)
    return e / e.sum(-1, keepdim=True)


def softmax_shifted(s):
    e = torch.exp(s - s.amax(-1, keepdim=True))
    return e / e.sum(-1, keepdim=True)


rows = torch.tensor([[1.0, 2.0, 3.0], [10.0, 12.0, 13.0], [60.0, 61.0, 58.0],
                     [-math.inf, -math.inf, -math.inf]])
print()
print("| scores | dtype | naive | max subtracted |")
print("|---|---|---|---|")
for r in rows:
    for dt in (torch.float16, torch.float32):
        x = r.to(dt)
        print(f"| {r.tolist()} | {str(dt)[6:]} | "
              f"{[round(float(v), 4) for v in softmax_naive(x)]} | "
              f"{[round(float(v), 4) for v in softmax_shifted(x)]} |")

# %% [markdown]
# In float16 the naive form already fails at a score of 12 (`exp(12) = 162755 > 65504`,
# and inf / inf is NaN); in float32 (and bfloat16, which has float32's exponent range) it
# holds up to 88.7. Max subtraction fixes every finite row. The last row, fully masked, is
# NaN either way: its guard comes in section 5.
#
# ## 2. How close does the model come? Per-layer scores
#
# The thresholds matter only if a model's scores reach them. A spy on the
# `"attention.prefill"` step (it records, then calls the reference) sees every layer's
# `q` (rotary applied) and `k` while the float32 engine scores 256 tokens of corpus text.

# %%
def score_survey(llm, token_ids, capture=None):
    """Per layer: largest positive raw q.k, most negative raw q.k, largest scaled score.
    ``capture``: a dict that receives layer 10's q, k, v and scale (section 6)."""
    stats = np.zeros((NUM_LAYERS, 3))
    with contextlib.ExitStack() as stack:
        for i in range(NUM_LAYERS):
            def spy(q, k, v, scale, i=i):
                if capture is not None and i == 10:
                    capture.update(q=q.clone(), k=k.clone(), v=v.clone(), scale=scale)
                g = q.shape[1] // k.shape[1]
                s = torch.einsum("nhd,lhd->hnl", q.float(), k.float().repeat_interleave(g, 1))
                n, L = q.shape[0], k.shape[0]
                causal = (torch.arange(L)[None, :] <= torch.arange(L - n, L)[:, None])[None]
                top = float(s.masked_fill(~causal, -math.inf).max())
                low = float(s.masked_fill(~causal, math.inf).min())
                stats[i] = (max(stats[i, 0], top), min(stats[i, 1], low),
                            max(stats[i, 2], top * scale))
                return prefill_attention_ref(q, k, v, scale)
            stack.enter_context(llm.swap_step("attention.prefill", spy, where=i))
        llm.score(token_ids)
    return stats


t = time.perf_counter()
cap = {}  # layer 10's q, k, v for section 6
survey = score_survey(llm32, ids_long, capture=cap)
max_pos, min_neg, max_scaled = survey[:, 0], survey[:, 1], survey[:, 2]
max_abs = np.abs(survey[:, :2]).max(1)
print(f"survey of {len(ids_long)} tokens in {time.perf_counter() - t:.1f} s")
say(f"largest |q.k| per layer: {max_abs.min():.0f} to {max_abs.max():.0f} (layer "
    f"{int(max_abs.argmax())}); largest positive q.k: {max_pos.max():.0f} (layer "
    f"{int(max_pos.argmax())}); headroom to 65504: {FP16_MAX / max_abs.max():.0f}x for "
    f"|q.k|, {FP16_MAX / max_pos.max():.0f}x for positive q.k",
    f"各层最大 |q.k|：{max_abs.min():.0f} 到 {max_abs.max():.0f}（第 "
    f"{int(max_abs.argmax())} 层）；最大正 q.k：{max_pos.max():.0f}（第 "
    f"{int(max_pos.argmax())} 层）；离 65504 的余量：|q.k| 为 {FP16_MAX / max_abs.max():.0f}x，"
    f"正 q.k 为 {FP16_MAX / max_pos.max():.0f}x")
say(f"largest scaled score q.k/8: {max_scaled.max():.1f} (layer {int(max_scaled.argmax())}); "
    f"layers above ln(65504) = 11.09: {int((max_scaled > math.log(FP16_MAX)).sum())} of "
    f"{NUM_LAYERS}; above 88.7: {int((max_scaled > 88.7).sum())}",
    f"乘过缩放因子的最大分数 q.k/8：{max_scaled.max():.1f}（第 {int(max_scaled.argmax())} 层）；"
    f"超过 ln(65504) = 11.09 的层：{NUM_LAYERS} 层中有 {int((max_scaled > math.log(FP16_MAX)).sum())} "
    f"层；超过 88.7 的：{int((max_scaled > 88.7).sum())} 层")

# %%
fig = Figure(figsize=(8, 3.6), layout="constrained")
ax = fig.add_subplot()
x = np.arange(NUM_LAYERS)
ax.bar(x - 0.2, max_pos, 0.4, label="largest positive raw q.k")
ax.bar(x + 0.2, -min_neg, 0.4, label="largest negative raw q.k (magnitude)")
ax.axhline(FP16_MAX, color="C3", ls="--", lw=1, label="fp16 max 65504")
ax.axhline(FP16_MAX / 1024, color="C2", ls=":", lw=1, label="65504 / 1024 (c = 1024 below)")
ax.set_yscale("log")
ax.set_xlabel("layer")
ax.set_ylabel("|q.k| before the scale")
ax.set_title(f"SmolLM2-135M, {len(ids_long)} tokens: raw attention scores per layer")
ax.legend(fontsize=8, loc="center right")
fig

# %% [markdown]
# The model is two orders of magnitude below fp16's maximum: its raw scores would not
# overflow even in the eager order that rounds `q.k` to fp16 before scaling. Its scaled
# scores, though, pass ln(65504) = 11.09 in several layers, so a softmax without max
# subtraction *does* break in float16 on the unmodified model (section 4). Note also the
# sign: only a **positive** overflow hurts. A product below -65504 becomes -inf, which is
# a zero weight, the same as a masked key (unless the whole row goes).
#
# ## 3. The incident, reproduced through an exact reparametrization
#
# Models with larger q/k norms (Qwen2 in the incidents) reach fp16's range. To give
# SmolLM2 the same raw scores without changing what it computes,
# `faults.qk_scale_reparam(llm, c)` multiplies the query rows of every layer's `qkv_proj`
# by `c` and the softmax scale by `1/c`: `(c q).k * (scale / c) = q.k * scale`. With
# `c = 1024`, a power of two, every factor is exact in floating point. Two attention
# orders meet it:
#
# - the engine's (SDPA, like FlashAttention): products accumulated in float32 and scaled
#   before anything is rounded to fp16;
# - transformers' eager order, `faults.eager_kq_attention`: `q @ k^T` in the model dtype
#   (fp16: rounded, and inf past 65504), then times the scale, then a float32 softmax.

# %%
C = 1024.0
survey48 = score_survey(llm32, ids)
first_pos = int(np.argmax(survey48[:, 0] * C > FP16_MAX))
ref32 = llm32.score(ids, output="logits")
with faults.qk_scale_reparam(llm32, C):
    rep32 = llm32.score(ids, output="logits")
plain16 = llm16.score(ids, output="logits")
with faults.qk_scale_reparam(llm16, C):
    rep16 = llm16.score(ids, output="logits")
with faults.eager_kq_attention(llm16):
    eager16 = llm16.score(ids, output="logits")
with track_nonfinite(llm16) as counts, faults.qk_scale_reparam(llm16, C), \
        faults.eager_kq_attention(llm16):
    bad16 = llm16.score(ids, output="logits")
kl = {name: metrics.mean_kl(ref32, r) for name, r in
      (("fp16", plain16), ("fp16 + reparam, engine order", rep16),
       ("fp16, eager order, no reparam", eager16))}
say(f"float32, reparam c={C:g}: logits bit-identical to the unmodified model: "
    f"{'True' if torch.equal(rep32, ref32) else 'False'}",
    f"float32，重参数化 c={C:g}：logits 与未修改的模型逐位相同："
    f"{'是' if torch.equal(rep32, ref32) else '否'}")
for name, v in kl.items():
    print(f"KL vs float32 ({len(ids)} tokens), {name}: {v:.2e} nats")
say(f"fp16 + reparam, eager order: non-finite logit rows "
    f"{int((~torch.isfinite(bad16)).any(-1).sum())} of {len(ids)}; first module with "
    f"NaN/inf: {counts.first()}; predicted from the survey (first layer whose largest "
    f"positive q.k x {C:g} > 65504): layer {first_pos}",
    f"fp16 + 重参数化，eager 顺序：非有限的 logit 行 {len(ids)} 行中有 "
    f"{int((~torch.isfinite(bad16)).any(-1).sum())} 行；第一个出现 "
    f"NaN/inf 的模块：{counts.first()}；由逐层测量预测（最大正 q.k x {C:g} > 65504 的"
    f"第一层）：第 {first_pos} 层")

# %%
chats = [[{"role": "user", "content": q}] for q in
         ("What is the capital of France?", "Name three primary colours.")]
greedy = SamplingParams(temperature=0, max_tokens=8)
before = llm16.llm_engine.stats.num_corrupted_requests
with faults.qk_scale_reparam(llm16, C), faults.eager_kq_attention(llm16):
    outs_bad = llm16.chat(chats, greedy)
corrupted = llm16.llm_engine.stats.num_corrupted_requests - before
with faults.qk_scale_reparam(llm16, C):
    outs_ok = llm16.chat(chats, greedy)
for ob, oo in zip(outs_bad, outs_ok):
    print(f"eager: finish_reason={ob.outputs[0].finish_reason!r} text={ob.outputs[0].text!r} | "
          f"engine order: {oo.outputs[0].text!r}")
say(f"corrupted requests counted by the engine (vllm:corrupted_requests): {corrupted}",
    f"引擎计数的已损坏请求（vllm:corrupted_requests）：{corrupted}")

# %% [markdown]
# The same weights, the same fp16 engine, the same exact reparametrization: the engine's
# order keeps the unmodified fp16 model's KL against float32, the eager order gives NaN
# from the layer the survey predicts, and the engine reports those requests as corrupted
# (`finish_reason="error"`) instead of sampling from NaN, which is what prints "!!!!" in
# an engine that does not check (the argmax of a NaN row is a fixed token id: chapter 12,
# section 3, prints which). The fix
# llama.cpp shipped is the engine's order: accumulate KQ in F32 (section 7).
#
# ## 4. A softmax without max subtraction, on the unmodified model
#
# `faults.softmax_without_max` keeps the scores in float32 (nothing overflows before the
# softmax) and computes `exp(s) / sum exp(s)` in the model dtype. No reparametrization
# here: section 2 found scaled scores above 11.09.

# %%
with faults.softmax_without_max(llm32):
    nomax32 = llm32.score(ids, output="logits")
first_exp = int(np.argmax(survey48[:, 2] > math.log(FP16_MAX)))
with track_nonfinite(llm16) as counts_nm, faults.softmax_without_max(llm16):
    nomax16 = llm16.score(ids, output="logits")
say(f"float32: KL vs the reference {metrics.mean_kl(ref32, nomax32):.1e} nats (largest "
    f"scaled score here {survey48[:, 2].max():.1f} "
    f"{'< 88.7: no overflow)' if survey48[:, 2].max() < F32_LN_MAX else '>= 88.7: overflow)'}",
    f"float32：相对参考实现的 KL {metrics.mean_kl(ref32, nomax32):.1e} nats（此处乘过缩放因子的"
    f"最大分数 {survey48[:, 2].max():.1f} "
    f"{'< 88.7：无溢出）' if survey48[:, 2].max() < F32_LN_MAX else '>= 88.7：溢出）'}")
say(f"float16: non-finite logit rows {int((~torch.isfinite(nomax16)).any(-1).sum())} of "
    f"{len(ids)}; first NaN/inf in {counts_nm.first()}; predicted: first layer with a "
    f"scaled score > 11.09 = layer {first_exp}",
    f"float16：非有限的 logit 行 {len(ids)} 行中有 {int((~torch.isfinite(nomax16)).any(-1).sum())} "
    f"行；第一个 NaN/inf 出现在 {counts_nm.first()}；预测：乘过缩放因子的分数 > 11.09 的"
    f"第一层 = 第 {first_exp} 层")

# %% [markdown]
# ## 5. Fully masked rows
#
# A query row with no key to attend to happens in real engines: the padding rows of a
# CUDA-graph batch (`seq_len = 0`), left-padded rows in a transformers batch, a sliding
# window or a custom mask that excludes everything. Its softmax is 0/0, so an engine must
# decide what it outputs. FlashAttention-2 decided: a row whose running max stays -inf
# uses 0 as its max (`csrc/flash_attn/src/softmax.h`: "If max is -inf, then all elements
# must have been -inf (possibly due to masking). We don't want (-inf - (-inf)) since that
# would give NaN"), and a row whose sum is 0 is divided by 1, so its **output is 0**.
# minivllm does the same on both backends: the TORCH attention steps end with
# `zero_empty_rows`, and the Triton kernels carry FlashAttention's -inf guard (tested in
# `tests/test_softmax_numerics.py`).
#
# Why an explicit guard, when this PyTorch's SDPA already returns 0 for such a row? Its 0
# is a property of this version's kernels, not a contract, and it is `0 x values`: NaN as
# soon as the keys the row must not read hold NaN (a padding row reading a slot that a
# failed request wrote).

# %%
q = torch.randn(3, 9, 64)
k = torch.randn(3, 6, 3, 64)
v = torch.randn(3, 6, 3, 64)
lens = torch.tensor([6, 0, 4])  # row 1 is a padding row: nothing to attend to
k_nan, v_nan = k.clone(), v.clone()
k_nan[1] = float("nan")
v_nan[1] = float("nan")
sdpa = torch.nn.functional.scaled_dot_product_attention


def decode_no_guard(q, k, v, seq_lens, scale):
    L = k.shape[1]
    mask = (torch.arange(L)[None, :] < seq_lens[:, None])[:, None, None, :]
    return sdpa(q.unsqueeze(2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
                scale=scale, enable_gqa=True).squeeze(2)


def describe(r):
    return "NaN" if torch.isnan(r).any() else ("0" if (r == 0).all() else "other")


print("| decode step | padding row, finite keys | padding row, NaN keys | real rows finite |")
print("|---|---|---|---|")
masked_row = {}  # decode step -> (padding row with finite keys, with NaN keys)
for name, fn in (("softmax written out (eager)", faults.decode_attention_eager),
                 (f"SDPA alone (torch {torch.__version__})", decode_no_guard),
                 ("engine: SDPA + zero_empty_rows", decode_attention_ref)):
    a, b = fn(q, k, v, lens, 0.125), fn(q, k_nan, v_nan, lens, 0.125)
    ok = bool(torch.isfinite(a[[0, 2]]).all() and torch.isfinite(b[[0, 2]]).all())
    masked_row[name] = (describe(a[1]), describe(b[1]))
    print(f"| {name} | {describe(a[1])} | {describe(b[1])} | {ok} |")

# %% [markdown]
# The guard costs at most one elementwise pass over the decode output ([batch, heads,
# head_dim]) per layer (on CPU the TORCH decode step checks `seq_lens` on the host and
# skips it when no row is empty); `benchmarks/masked_row_guard.py` measures it side by
# side with and without.
# Measured (benchmarks/RESULTS.md): on a 2-core CPU, greedy decode ran at 34.3 tok/s with
# the guard and 33.8 without (machine drift, same tokens); on an H200 the Triton decode
# kernel, whose guard is two `tl.where` per tile, took 11.3 / 14.6 / 65.3 us with it and
# 11.6 / 14.7 / 65.4 us without (batch 1 and 32 at 1k context, 64 at 4k), bitwise equal.
#
# ## 6. Online softmax, and accumulating in too few bits
#
# FlashAttention never holds a whole row of scores: it reads the keys in tiles, keeps a
# running max `m`, sum `l` and unnormalised output `acc`, and when a tile raises the max
# it rescales what it has by `exp(m_old - m_new)` (Milakov & Gimelshein 2018). The result
# is the softmax, exactly in real arithmetic. Below, one query head of layer 10 (captured
# by the survey of section 2) against its float64 result, for
# several tile sizes; then the vllm #23813 question on synthetic data: what if the running
# `acc` is kept in a 16-bit register for the whole context instead of being flushed into
# float32 every tile.

# %%
L = cap["k"].shape[0]
q1 = cap["q"][-1, 0].double()          # the last query, head 0
k1, v1 = cap["k"][:, 0].double(), cap["v"][:, 0].double()  # its KV head (GQA group 0)


def online(qr, kr, vr, scale, tile):
    """One query's attention over tiles of keys (float32 running max, sum, output)."""
    m, l, acc = torch.tensor(-math.inf), torch.tensor(0.0), torch.zeros(vr.shape[-1])
    for t0 in range(0, kr.shape[0], tile):
        s = (kr[t0:t0 + tile] @ qr) * scale
        m_new = torch.maximum(m, s.max())
        alpha, p = torch.exp(m - m_new), torch.exp(s - m_new)
        l = l * alpha + p.sum()
        acc = acc * alpha + p @ vr[t0:t0 + tile]
        m = m_new
    return acc / l


exact = torch.softmax((k1 @ q1) * cap["scale"], 0) @ v1
print(f"layer 10, head 0, the last of {L} queries: max |online - float64| by tile size")
tile_err = {}
for tile in (1, 16, 64, L):
    err = online(q1.float(), k1.float(), v1.float(), cap["scale"], tile).double() - exact
    tile_err[tile] = float(err.abs().max())
    print(f"  tile {tile:4d}: {tile_err[tile]:.1e}")

# vllm #23813 on synthetic data: P.V accumulated over the whole context in bf16, against
# each 64-key tile's partial rounded to bf16 and added into float32 (two-level accumulation)
gen = torch.Generator().manual_seed(0)
lengths = [128, 256, 512, 1024, 2048, 4096]
DRAWS = 16  # random (scores, values) draws per length; the mean error is shown
err_bf16, err_flush = [], []
for n in lengths:
    s = torch.randn(DRAWS, n, generator=gen) * 2
    vv = torch.randn(DRAWS, n, 64, generator=gen)
    p = torch.softmax(s.double(), -1)
    want = torch.einsum("bn,bnd->bd", p, vv.double())
    pb, vb = p.float(), vv.float()
    acc = torch.zeros(DRAWS, 64, dtype=torch.bfloat16)
    flush = torch.zeros(DRAWS, 64)
    for i in range(0, n, 64):
        part = torch.einsum("bn,bnd->bd", pb[:, i:i + 64], vb[:, i:i + 64])
        acc = (acc.float() + part).to(torch.bfloat16)      # the running sum kept in bf16
        flush += part.to(torch.bfloat16).float()           # only the tile's partial in bf16
    scale_ = want.abs().amax(-1)
    err_bf16.append(float(((acc.double() - want).abs().amax(-1) / scale_).mean()))
    err_flush.append(float(((flush.double() - want).abs().amax(-1) / scale_).mean()))
fig2 = Figure(figsize=(6, 3.4), layout="constrained")
ax2 = fig2.add_subplot()
ax2.plot(lengths, err_bf16, "o-", label="running sum kept in bf16")
ax2.plot(lengths, err_flush, "s-", label="bf16 per tile, summed in fp32")
ax2.set_xscale("log", base=2)
ax2.set_yscale("log")
ax2.set_xlabel("context length (keys)")
ax2.set_ylabel(f"max rel. error of P.V (mean of {DRAWS})")
ax2.set_title("Accumulator precision against context length (synthetic)")
ax2.legend(fontsize=8)
ax2.grid(True, which="both", alpha=0.3)
print("| keys | running bf16 sum | per-tile bf16, summed in fp32 |")
print("|---|---|---|")
for n, a, b in zip(lengths, err_bf16, err_flush):
    print(f"| {n} | {a:.1e} | {b:.1e} |")
fig2

# %% [markdown]
# The online softmax agrees with float64 to float32 rounding at every tile size: tiling
# is not an approximation. The accumulator is another matter: a running sum kept in 8
# significant bits is rounded again after every tile, so its error grows with the number
# of tiles, while rounding only each tile's partial and adding the partials in float32
# keeps the error at one bf16 rounding, whatever the length. That is the shape of vllm #23813 and its fix, shown on random
# data with bf16 standing in for Hopper's FP8 accumulator (not the model, and not the
# hardware's exact register width).
#
# ## 7. The fix, measured
#
# The fix for the overflow is the order of operations: never round the unscaled product to
# fp16. Here is llama.cpp's fix (PR #8412: the KQ product in F32), written as the eager
# prefill step with its product in float32, swapped into the fp16 engine under the same
# reparametrization.

# %%
def prefill_kq_fp32(q, k, v, scale):
    n, L = q.shape[0], k.shape[0]
    g = q.shape[1] // k.shape[1]
    s = torch.einsum("nhd,lhd->hnl", q.float(), k.float().repeat_interleave(g, 1)) * scale
    causal = torch.arange(L)[None, :] <= torch.arange(L - n, L)[:, None]
    p = torch.softmax(s.masked_fill(~causal[None], -math.inf), -1)
    return torch.einsum("hnl,lhd->nhd", p, v.float().repeat_interleave(g, 1)).to(q.dtype)


with faults.qk_scale_reparam(llm16, C), llm16.swap_step("attention.prefill", prefill_kq_fp32):
    fixed16 = llm16.score(ids, output="logits")
kl_fixed = metrics.mean_kl(ref32, fixed16)
say(f"fp16 + reparam c={C:g}, KQ in float32: finite "
    f"{'True' if bool(torch.isfinite(fixed16).all()) else 'False'}, "
    f"KL vs float32 {kl_fixed:.2e} nats (unmodified fp16: {kl['fp16']:.2e})",
    f"fp16 + 重参数化 c={C:g}，KQ 用 float32："
    f"{'全部有限' if bool(torch.isfinite(fixed16).all()) else '并非全部有限'}，"
    f"相对 float32 的 KL {kl_fixed:.2e} nats（未修改的 fp16：{kl['fp16']:.2e}）")

# %% [markdown]
# ## 8. Claim vs measurement

# %%
nan_c = FP16_MAX / survey48[:, 0].max()  # the smallest c at which a positive q.k overflows
nomax16_bad = int((~torch.isfinite(nomax16)).any(-1).sum())
both_finite = bool(torch.isfinite(rep16).all()) and bool(torch.isfinite(fixed16).all())
e_row, s_row, g_row = masked_row.values()
rep_exact = torch.equal(rep32, ref32)
nomax_part = (Bi(f"yes, {nomax16_bad} of {len(ids)} rows non-finite, NaN first in "
                 f"{counts_nm.first()} (predicted layer {first_exp}, scaled score "
                 f"{survey48[first_exp, 2]:.1f} > 11.09)",
                 f"是，{len(ids)} 行中有 {nomax16_bad} 行非有限，NaN 最早出现在 "
                 f"{counts_nm.first()}（预测为第 {first_exp} 层，乘过缩放因子的分数 "
                 f"{survey48[first_exp, 2]:.1f} > 11.09）")
              if nomax16_bad else Bi("no non-finite row", "没有非有限的行"))
f32_part = Bi(f"in float32 this model "
              f"{'does not need it' if max_scaled.max() < F32_LN_MAX else 'needs it'}"
              f" (largest scaled score {max_scaled.max():.1f} "
              f"{'<' if max_scaled.max() < F32_LN_MAX else '>='} {F32_LN_MAX:.1f})",
              f"在 float32 中这个模型"
              f"{'不需要它' if max_scaled.max() < F32_LN_MAX else '需要它'}"
              f"（乘过缩放因子的最大分数 {max_scaled.max():.1f} "
              f"{'<' if max_scaled.max() < F32_LN_MAX else '>='} {F32_LN_MAX:.1f}）")
claims_table([
    (Bi("max \\|q.k\\| after rotary is 119-486 per layer over 512 corpus tokens (course plan)",
        "施加旋转之后的最大 \\|q.k\\| 在 512 个语料 token 上每层为 119-486（课程计划）"),
     Bi(f"{max_abs.min():.0f}-{max_abs.max():.0f} over {len(ids_long)} tokens; the largest "
        f"{'are negative' if -min_neg.min() > max_pos.max() else 'are positive'}"
        f": the largest positive q.k is {max_pos.max():.0f} (layer {int(max_pos.argmax())}), "
        f"the most negative {min_neg.min():.0f} (layer {int(min_neg.argmin())})",
        f"{len(ids_long)} 个 token 上为 {max_abs.min():.0f}-{max_abs.max():.0f}；绝对值最大的"
        f"{'是负的' if -min_neg.min() > max_pos.max() else '是正的'}"
        f"：最大的正 q.k 为 {max_pos.max():.0f}（第 {int(max_pos.argmax())} 层），"
        f"最负的为 {min_neg.min():.0f}（第 {int(min_neg.argmin())} 层）")),
    (Bi("that is 135x below 65504, so fp16 QK overflow does not happen naturally (course plan)",
        "即比 65504 低 135x，所以 fp16 QK 溢出不会自然发生（课程计划）"),
     Bi(f"{'yes' if max_pos.max() < FP16_MAX else 'no'}"
        f": {FP16_MAX / max_abs.max():.0f}x below in magnitude, "
        f"{FP16_MAX / max_pos.max():.0f}x for positive products, the only ones that hurt",
        f"{'是' if max_pos.max() < FP16_MAX else '否'}"
        f"：按绝对值低 {FP16_MAX / max_abs.max():.0f}x，"
        f"正乘积低 {FP16_MAX / max_pos.max():.0f}x，而只有正乘积有害")),
    (Bi("eager fp16 overflows for c >~ 135 and yields NaN (course plan)",
        "eager fp16 在 c >~ 135 时溢出并产生 NaN（课程计划）"),
     Bi(f"{'not from c ~ 135' if nan_c > 135 else 'yes'}"
        f": a negative overflow is a -inf score, a zero weight; NaN needs a positive one: "
        f"c > 65504 / {survey48[:, 0].max():.0f} = {nan_c:.0f} on the "
        f"{len(ids)}-token passage. At c = {C:g}: NaN first in {counts.first()}, predicted "
        f"layer {first_pos}",
        f"{'并非从 c ~ 135 起' if nan_c > 135 else '是'}"
        f"：负向溢出是 -inf 分数，即零权重；NaN 需要正向溢出："
        f"在 {len(ids)} 个 token 的段落上 c > 65504 / {survey48[:, 0].max():.0f} = {nan_c:.0f}。"
        f"c = {C:g} 时：NaN 最早出现在 {counts.first()}，预测为第 {first_pos} 层")),
    (Bi("the reparametrization is exact", "重参数化是精确的"),
     Bi(f"{'yes' if rep_exact else 'no'}: float32 logits bit-identical: "
        f"{'True' if rep_exact else 'False'}; fp16, engine order: "
        f"bit-identical {'True' if torch.equal(rep16, plain16) else 'False'}, KL "
        f"{kl['fp16 + reparam, engine order']:.2e} against {kl['fp16']:.2e} unmodified",
        f"{'是' if rep_exact else '否'}：float32 logits 逐位相同："
        f"{'是' if rep_exact else '否'}；fp16、引擎顺序："
        f"逐位相同 {'是' if torch.equal(rep16, plain16) else '否'}，KL "
        f"{kl['fp16 + reparam, engine order']:.2e}，未修改时为 {kl['fp16']:.2e}")),
    (Bi("pre-scaling q or accumulating KQ in fp32 never overflows (course plan; llama.cpp PR "
        "#8412)",
        "预先缩放 q 或在 fp32 中累加 KQ 永远不会溢出（课程计划；llama.cpp PR #8412）"),
     Bi(f"engine order (SDPA) and the KQ-in-fp32 eager step "
        f"{'both finite' if both_finite else 'NOT both finite'}"
        f" at c = {C:g}; KL {kl['fp16 + reparam, engine order']:.2e} and {kl_fixed:.2e}",
        f"引擎顺序（SDPA）与 KQ 用 fp32 的 eager 步骤在 c = {C:g} 时"
        f"{'都是有限的' if both_finite else '并非都是有限的'}"
        f"；KL 分别为 {kl['fp16 + reparam, engine order']:.2e} 和 {kl_fixed:.2e}")),
    (Bi("max subtraction is needed", "需要减去最大值"),
     Bi("in float16 on the unmodified model: " + nomax_part.en + "; " + f32_part.en,
        "在未修改的模型上用 float16：" + nomax_part.zh + "；" + f32_part.zh)),
    (Bi("a fully masked row gives NaN (unsloth #9848)", "全遮蔽行给出 NaN（unsloth #9848）"),
     Bi(f"padding row, finite / NaN keys: the written-out softmax: {e_row[0]} / {e_row[1]}; "
        f"this PyTorch's SDPA: {s_row[0]} / {s_row[1]}; the engine's guard: {g_row[0]} / "
        f"{g_row[1]}",
        f"填充行，key 有限 / key 为 NaN：直接写出的 softmax：{e_row[0]} / {e_row[1]}；"
        f"这个 PyTorch 的 SDPA：{s_row[0]} / {s_row[1]}；引擎的防护：{g_row[0]} / "
        f"{g_row[1]}")),
    (Bi("online softmax is exact; accumulator precision decays with length (vllm #23813)",
        "在线 softmax 是精确的；累加器精度随长度衰减（vllm #23813）"),
     Bi(f"tiling: max error against float64 {max(tile_err.values()):.1e} over tile sizes "
        f"{list(tile_err)} (one tile of all {L} keys, a plain float32 softmax: "
        f"{tile_err[L]:.1e}); a bf16 running sum: error "
        f"{err_bf16[0]:.0e} at {lengths[0]} keys, {err_bf16[-1]:.0e} at {lengths[-1]} "
        f"{'(grows' if err_bf16[-1] > err_bf16[0] else '(does not grow'}"
        f", synthetic); per-tile partials summed in fp32: {max(err_flush):.0e} at most",
        f"按 tile 计算：在 tile 大小 {list(tile_err)} 上相对 float64 的最大误差 "
        f"{max(tile_err.values()):.1e}（一个 tile 装下全部 {L} 个 key，即普通 float32 softmax："
        f"{tile_err[L]:.1e}）；bf16 运行和：{lengths[0]} 个 key 时误差 {err_bf16[0]:.0e}，"
        f"{lengths[-1]} 个 key 时 {err_bf16[-1]:.0e}"
        f"{'（增长' if err_bf16[-1] > err_bf16[0] else '（不增长'}"
        f"，合成数据）；逐 tile 部分和在 fp32 中相加：最多 {max(err_flush):.0e}")),
], header=(Bi("claim (source)", "论断（来源）"), Bi("what we measured here", "本次实测结果")))

# %% [markdown]
# ## Common misconceptions
#
# - *"Our model's scores are small, so fp16 attention is safe."* This one's are, with two
#   orders of magnitude to spare; a fine-tune, a longer context or another checkpoint of
#   the same architecture may not be. Safe by construction (the order of operations) beats
#   safe by measurement.
# - *"Overflow means any |q.k| > 65504."* Only positive products break the softmax; a
#   product below -65504 becomes a -inf score, a zero weight.
# - *"Without overflow the order does not matter."* Rounding the unscaled product to the
#   model dtype costs accuracy even when nothing overflows: section 3 prints the KL
#   against float32 of the unmodified fp16 model in the engine's order and in the eager
#   order ("fp16, eager order, no reparam"), and the eager one is larger. bfloat16 has
#   float32's range, so it never overflows, but it rounds the product to 8 significant
#   bits.
# - *"Max subtraction is a float16 trick."* It is what keeps every softmax finite; float32
#   only moves the threshold to 88.7.
# - *"A fully masked row never happens."* Padding rows of CUDA-graph batches and
#   left-padded batches produce it every step; decide what it outputs (0, as
#   FlashAttention) and test it with NaN in the keys it must not read.
# - *"Tiling (FlashAttention) approximates the softmax."* It is exact up to rounding; what
#   can lose precision is the width of the accumulator, not the tiling.
#
# ## Lab
#
# `labs/source/ch09/` starts from the broken configuration of section 3 (fp16 engine,
# reparametrization c = 1024, eager attention). You write `safe_softmax` (max subtraction
# and the fully-masked-row rule), `online_softmax_attention` (the tiled loop with its -inf
# guard) and `attention_fp16_safe` (products in float32 before the scale). The grader
# checks them against float64 on fresh extremes (scores +-3e4, empty rows, tiles that do
# not divide the length, fp16 inputs whose raw q.k pass 65504), then plugs them into the
# fp16 engine as its prefill and decode attention steps on fresh text: no corrupted
# request and KL <= 1e-3 against float32, next to the eager engine failing the same check.
#
# ## On real vLLM
#
# - `VLLM_COMPUTE_NANS_IN_LOGITS=1` makes vLLM check the logits and count requests with
#   NaN in `vllm:corrupted_requests` (off by default: it costs compute). A rising count
#   is section 3's failure; the text alone ("!!!!") is only a symptom.
# - The kernel fixes the order of operations: `--attention-backend` (`FLASH_ATTN`,
#   `FLASHINFER`, `TRITON_ATTN`, `FLEX_ATTENTION`; `VLLM_ATTENTION_BACKEND` in older
#   versions) reruns a request through another one.
# - `--dtype bfloat16` has float32's exponent range and cannot overflow where float16
#   does; FlashAttention 2 takes fp16 and bf16 only, `TRITON_ATTN` and `FLEX_ATTENTION`
#   also float32.
# - With an fp8 KV cache on FlashAttention 3 the queries are quantized to fp8 too (vLLM's
#   docs): the FP8 attention path of vllm #23813.
# - Checked against vLLM's docs and source of 2025-2026 (`vllm/envs.py`, metrics,
#   attention backends). This engine checks every logit row and ends such a request
#   with `finish_reason="error"`; both its backends give a fully masked row 0.

# %%
print(f"chapter 9 ran in {time.perf_counter() - T0:.0f} s")
