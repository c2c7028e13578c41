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
# # Chapter 1. The float32 baseline, and the multi-turn "FP16 KV cache" incident
#
# **Learning goals.** After this chapter you can
#
# 1. name the ground truth every later chapter measures against (HF transformers in
#    float32 on the same weights) and check that an engine matches it;
# 2. measure drift the course's way: fixed tokens first (teacher-forced KL, top-1
#    agreement), generation second (greedy agreement, first divergence), and always
#    against a noise floor;
# 3. reproduce the seed course's multi-turn incident honestly, and say which part of the
#    story the measurement supports and which it does not.
#
# **The incident (as the seed course tells it).** A chat service ran an fp16 model with
# an FP16 KV cache. Users reported that answers degraded after about ten turns of a
# conversation. The team switched the KV cache to FP32 and the degradation went away; the
# lesson drawn was "long conversations accumulate KV-cache rounding error, keep the cache
# in FP32".
#
# Everything below is measured when the notebook runs, on the embedded SmolLM2-135M-Instruct
# with minivllm on this machine's CPU.
#
# **Three instruments, in one paragraph each** (chapter 4 derives them properly):
#
# - *KL divergence* `KL(p_ref || p)` at a position compares two next-token distributions:
#   the expected extra log-loss, in nats, of using `p` where `p_ref` is right. 0 means
#   identical; the mean over all positions of a fixed text is this course's main number,
#   because it sees a change long before a greedy token flips.
# - *The noise floor* is the KL that a change which is exact in real arithmetic makes in
#   float32 (here: the MLP's sum reordered). A measurement at or below it says "no effect
#   we can tell from rounding"; only a result well above it is an effect.
# - *A bootstrap interval* resamples the conversation's turns with replacement and
#   recomputes the mean each time; the middle 95 % of those means is the `[95% CI]`
#   printed beside a mean KL. Two configurations whose intervals overlap are not shown
#   to differ.

# %%
# %matplotlib inline
import time

import numpy as np
import torch

from minivllm import LLM, SamplingParams
from minivllm.i18n import Bi, claims_table, say
from minivllm.precision import ReferenceModel, evalsets, metrics
from minivllm.precision.noise import permuted_mlp_reduction

torch.manual_seed(0)
T0 = time.perf_counter()
MODEL = "smollm2-135m-instruct"
KV_DTYPES = ["float16", "bfloat16", "fp8_e4m3"]
CONV_IDS = [4]  # one 10-turn conversation (the lab and benchmarks/kv_cache_sweep.py use others)

# %% [markdown]
# ## 1. The reference, and the habit of checking it first
#
# The reference is transformers' own `LlamaForCausalLM` in float32 on the same weights.
# Before measuring any "incident", check that the engine's float32 configuration matches
# it. `LLM.score(ids)` returns the engine's full next-token distribution at every
# position of a *fixed* token sequence (teacher forcing): no sampling, so one early
# difference cannot snowball into a different text.

# %%
ref = ReferenceModel(MODEL, dtype="float32")
engines = {kv: LLM(MODEL, dtype="float32", kv_cache_dtype=kv, max_model_len=2048,
                   kv_cache_memory_bytes=192 << 20)
           for kv in ["float32"] + KV_DTYPES}
tok = engines["float32"].get_tokenizer()
convs = [evalsets.load_conversations()[i] for i in CONV_IDS]
seqs = [evalsets.conversation_sequences(tok)[i] for i in CONV_IDS]
spans = [evalsets.assistant_turn_spans(tok, c) for c in convs]
print(f"{len(convs)} conversation, {[len(s) for s in seqs]} tokens, "
      f"{[len(s) for s in spans]} assistant turns")


def turn_groups(drifts):
    """Per-position KL split by assistant turn: the clusters for the bootstrap CI
    (positions inside one answer are correlated; answers much less so)."""
    return [d.kl[a:b] for d, sp in zip(drifts, spans) for (a, b) in sp]


def summary_line(drifts):
    s = metrics.summarize(drifts)
    lo, hi = metrics.bootstrap_ci(turn_groups(drifts))
    return s, (lo, hi)

base_rows = engines["float32"].score(seqs)
n = 256  # the check on the first 256 tokens of one conversation (tests check more)
ref_rows = ref.score(seqs[0][:n])
eng_rows = engines["float32"].score(seqs[0][:n])
print(f"first {n} tokens: engine fp32 vs HF fp32  max |logprob diff| = "
      f"{(ref_rows - eng_rows).abs().max().item():.2e}, "
      f"mean KL = {metrics.mean_kl(ref_rows, eng_rows):.2e} nats")

# %% [markdown]
# The engine's float32 path agrees with the reference to rounding level (the line above:
# a max log-prob difference of order 1e-4 and a KL of order 1e-11, both rounding). From
# here on, the float32
# *engine* stands in for the reference, so that every comparison differs in exactly one
# setting: the KV-cache dtype.
#
# **Noise floor.** How big is "rounding level"? Reorder one reduction (the MLP's sum over
# its 1536 units; mathematically a no-op) and measure again. Differences below this are
# indistinguishable from float32 noise.

# %%
with permuted_mlp_reduction(engines["float32"], seed=0):
    noise_rows = engines["float32"].score(seqs)
noise = [metrics.sequence_drift(b, n, s) for b, n, s in zip(base_rows, noise_rows, seqs)]
noise_summary, noise_ci = summary_line(noise)
print(f"noise floor: mean KL {noise_summary.mean_kl:.2e} nats, "
      f"95% CI over turns {noise_ci[0]:.1e}..{noise_ci[1]:.1e}, "
      f"top-1 agreement {100 * noise_summary.top1_agreement:.2f}%")

# %% [markdown]
# ## 2. The incident, measured: KV-cache dtype against turn number
#
# Score the same conversation with the KV cache stored in float16, bfloat16 and fp8
# (e4m3, scale 1.0), everything else float32. The engine always reads K/V back from the
# cache (as vLLM does), so the storage dtype touches every attention read. We average
# the KL over the tokens of each assistant turn: if rounding error accumulated over a
# conversation, KL would grow with the turn number.

# %%
drift = {}
for kv in KV_DTYPES:
    rows = engines[kv].score(seqs)
    drift[kv] = [metrics.sequence_drift(b, c, s) for b, c, s in zip(base_rows, rows, seqs)]
    del rows

summary = {kv: summary_line(d) for kv, d in drift.items()}
lines = [Bi("| KV cache | mean KL (nats) [95% CI] | top-1 agreement | PPL ratio | above noise floor |",
            "| KV cache | 平均 KL (nats) [95% CI] | Top-1 一致率 | PPL 比值 | 高于噪声基底 |"),
         Bi("|---|---|---|---|---|", "|---|---|---|---|---|")]
for kv, (s, ci) in summary.items():
    above = ci[0] > noise_ci[1]
    lines.append(Bi(f"| {kv} | {s.mean_kl:.2e} [{ci[0]:.1e}, {ci[1]:.1e}] | "
                    f"{100 * s.top1_agreement:.2f}% | {s.ppl_ratio:.4f} | {'yes' if above else 'no'} |",
                    f"| {kv} | {s.mean_kl:.2e} [{ci[0]:.1e}, {ci[1]:.1e}] | "
                    f"{100 * s.top1_agreement:.2f}% | {s.ppl_ratio:.4f} | {'是' if above else '否'} |"))
say("\n".join(x.en for x in lines), "\n".join(x.zh for x in lines))

# %%
def kl_by_turn(drifts, spans):
    """Mean KL over each assistant turn's tokens, averaged over conversations: [turns]."""
    n_turns = min(len(s) for s in spans)
    return np.array([np.mean([d.kl[a:b].mean() for d, sp in zip(drifts, spans)
                              for (a, b) in [sp[t]]]) for t in range(n_turns)])


from matplotlib.figure import Figure

fig = Figure(figsize=(8.5, 4), layout="constrained")
ax = fig.add_subplot()
for kv in KV_DTYPES:
    ax.plot(np.arange(1, 11), kl_by_turn(drift[kv], spans)[:10], marker="o", label=f"{kv} KV")
ax.plot(np.arange(1, 11), np.maximum(kl_by_turn(noise, spans)[:10], 1e-12), marker=".",
        color="gray", linestyle="--", label="noise floor (fp32, reordered sum)")
ax.set_yscale("log")
ax.set_xlabel("assistant turn")
ax.set_ylabel("mean KL vs float32 KV (nats)")
ax.set_title("Does KV-cache rounding accumulate over a conversation?")
ax.grid(True, which="both", alpha=0.3)
# outside the axes, right: inside, the legend sat on the fp8 curve
ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
fig

# %% [markdown]
# Does it grow? Compare the mean KL of the last three assistant turns with the first
# three, for each dtype and for the noise floor, and set that against how far apart the
# dtypes are.

# %%
per_turn = {kv: kl_by_turn(drift[kv], spans)[:10] for kv in KV_DTYPES}
GROWTH = {kv: float(v[-3:].mean() / v[:3].mean()) for kv, v in per_turn.items()}
noise_turns = kl_by_turn(noise, spans)[:10]
noise_growth = float(noise_turns[-3:].mean() / noise_turns[:3].mean())
spread = max(summary[kv][0].mean_kl for kv in KV_DTYPES) / min(summary[kv][0].mean_kl
                                                                 for kv in KV_DTYPES)
growth_list = ", ".join(f"{kv} {g:.2f}x" for kv, g in GROWTH.items())
say(f"KL of turns 8-10 over turns 1-3: {growth_list}; noise floor {noise_growth:.2f}x. "
    f"Between the dtypes: {spread:,.0f}x",
    f"第 8-10 轮的 KL 与第 1-3 轮之比：{growth_list}；噪声基底 {noise_growth:.2f}x。"
    f"各 dtype 之间相差：{spread:,.0f}x")

# %% [markdown]
# Read the line above: a KV-cache dtype whose error accumulated turn by turn would grow
# over ten turns by a factor comparable to how far the dtypes are apart. A growth of a
# small factor against a spread of thousands is no accumulation: each entry is rounded
# once (section 4), and a later turn only attends over more of them. The claims table
# (section 7) prints that verdict from these numbers.
#
# ## 3. What a user would see: greedy answers at the last turn
#
# KL is the sensitive instrument; users see text. Generate the final assistant answer
# (the conversation up to the tenth user turn) greedily with each KV dtype and compare
# with the float32 answer token by token. The conversation's K/V is already in each
# engine's prefix cache from the scoring above, so only the new tokens are computed.

# %%
prompts = [tok.encode(tok.apply_chat_template(c[:-1], tokenize=False, add_generation_prompt=True),
                      add_special_tokens=False) for c in convs]
greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
answers = {kv: [o.outputs[0].token_ids for o in e.generate(prompts, greedy)]
           for kv, e in engines.items()}
print("| KV cache | greedy agreement with float32 | first divergence (token index) |")
print("|---|---|---|")
for kv in KV_DTYPES:
    agree = np.mean([metrics.greedy_agreement(a, b)
                     for a, b in zip(answers["float32"], answers[kv])])
    first = [metrics.first_divergence(a, b) for a, b in zip(answers["float32"], answers[kv])]
    print(f"| {kv} | {100 * agree:.0f}% | {first} |")
print("\nfloat32 answer to conversation 0:", repr(tok.decode(answers["float32"][0])))
print("fp8_e4m3 answer to conversation 0:", repr(tok.decode(answers["fp8_e4m3"][0])))

# %% [markdown]
# ## 4. Why
#
# A KV-cache entry is rounded once, when it is written, to the storage format's spacing:
# relative error up to 2^-11 ≈ 4.9e-4 for float16 (10 mantissa bits), 2^-8 ≈ 3.9e-3 for
# bfloat16 (7 bits), 2^-4 = 6.25% for fp8 e4m3 (3 bits), whose range also ends at 448 and
# whose small values fall into coarse subnormals when no scale is calibrated. Each read
# sees the same rounded value, so the error per attention read does **not** grow with the
# number of turns; what grows is only the number of positions that can be affected. The
# attention output is a softmax-weighted average of many rounded V rows, which averages
# independent rounding errors down; the logits move by a small fraction of their spread.
# Whether a small move changes a greedy token depends on near-ties, which is why
# agreement drops first where the model was unsure.

# %% [markdown]
# ## 5. The fix, measured
#
# The seed's fix, an FP32 KV cache, removes the KV term by construction: KL = 0 against the
# float32 engine (the baseline above *is* that configuration). It costs 2x the memory of
# float16 and 4x that of fp8, i.e. half or a quarter of the concurrent sequences:

# %%
for kv, e in engines.items():
    cfg = e.llm_engine.cache_config
    per_token = 2 * e.llm_engine.model_config.num_layers * e.llm_engine.model_config.num_kv_heads \
        * e.llm_engine.model_config.head_dim * torch.empty((), dtype=cfg.cache_dtype).element_size()
    print(f"{kv:>9} KV: {per_token / 1024:5.1f} KiB per token, "
          f"{cfg.num_blocks * cfg.block_size:6d} tokens fit in the same 192 MiB")

# %% [markdown]
# ## 6. The seed's own setting: an fp16 model with an "FP32 KV cache"
#
# Everything above kept float32 weights and changed only the cache. The seed's service
# ran an **fp16 model**. There, K and V are *computed* in float16 (the K/V projections
# output float16), so storing them in a float32 cache keeps exactly the same numbers: a
# float16 value converts to float32 exactly, and the engine converts it back to float16
# before attention reads it. Measure it: the same tokens scored by an fp16 model with a
# float16 cache and with a float32 cache.

# %%
m16 = {kv: LLM(MODEL, dtype="float16", kv_cache_dtype=kv, max_model_len=256,
               kv_cache_memory_bytes=16 << 20) for kv in ("float16", "float32")}
ids16 = seqs[0][:128]
logits16 = {kv: e.score(ids16, output="logits") for kv, e in m16.items()}
same16 = torch.equal(logits16["float16"], logits16["float32"])
say(f"fp16 model, {len(ids16)} tokens: logits with a float32 KV cache bit-identical to a "
    f"float16 KV cache: {'True' if same16 else 'False'} (max |diff| "
    f"{(logits16['float16'] - logits16['float32']).abs().max().item():.1e})",
    f"fp16 模型，{len(ids16)} 个 token：配 float32 KV cache 的 logits 与配 "
    f"float16 KV cache 的逐位相同：{'是' if same16 else '否'}（最大 |diff| "
    f"{(logits16['float16'] - logits16['float32']).abs().max().item():.1e}）")
kl16 = metrics.mean_kl(base_rows[0][:len(ids16)], torch.log_softmax(logits16["float16"], -1))
say(f"the fp16 model itself vs the float32 engine: mean KL {kl16:.2e} nats "
    f"(the float16 *KV cache* alone: {summary['float16'][0].mean_kl:.2e})",
    f"fp16 模型本身相对 float32 引擎：平均 KL {kl16:.2e} nats"
    f"（仅 float16 *KV cache* 一项：{summary['float16'][0].mean_kl:.2e}）")
del m16

# %% [markdown]
# So in the seed's setting the fix changed nothing that attention reads. It could not
# even be configured as told: vLLM 0.4.2, the seed's version, accepted only
# `--kv-cache-dtype {auto,fp8}` (docs.vllm.ai/en/v0.4.2/models/engine_args.html), and
# later releases `{auto,fp8,fp8_e5m2,fp8_e4m3}`; `auto` means "the model's dtype". No
# version checked accepts `float32` (minivllm does, for teaching). An fp32 KV cache in
# vLLM means serving the model with `--dtype float32`: the weights change too, and that,
# not the cache, is what moves the numbers (the second line above).
#
# transformers behaves the same way: an fp16 model keeps an fp16 KV cache, there is no
# hidden fp32 cache to "switch back to":

# %%
hf16 = ref.model.to(torch.float16)
with torch.inference_mode():
    out = hf16(input_ids=torch.tensor([seqs[0][:16]]), use_cache=True)
cache = out.past_key_values
layer0 = cache.layers[0].keys if hasattr(cache, "layers") else cache[0][0]
say(f"transformers fp16 model: KV cache dtype = {layer0.dtype}",
    f"transformers fp16 模型：KV cache dtype = {layer0.dtype}")
_ = ref.model.to(torch.float32)  # back to the reference (assigned: no model printout)

# %% [markdown]
# ## 7. Claim vs measurement

# %%
n_conv = sum(len(x) for x in seqs)
g_max = max(GROWTH.values())
fp8_above = summary["fp8_e4m3"][1][0] > noise_ci[1]
claims_table([
    (Bi("FP16 KV cache degrades answers after ~10 turns",
        "FP16 KV cache 在约 10 轮对话后使回答变差"),
     Bi(f"float16 KV: KL {summary['float16'][0].mean_kl:.1e}, turns 8-10 at "
        f"{GROWTH['float16']:.2f}x turns 1-3 (plot above); greedy answers as in the table in "
        f"section 3",
        f"float16 KV：KL {summary['float16'][0].mean_kl:.1e}，第 8-10 轮为第 1-3 轮的 "
        f"{GROWTH['float16']:.2f}x（见上图）；贪心回答见第 3 节的表格")),
    (Bi("the error accumulates turn by turn", "误差逐轮累积"),
     Bi(f"rounding happens once per stored entry; over ten turns the per-turn KL changes by at "
        f"most {g_max:.1f}x for any dtype, while the dtypes differ by {spread:,.0f}x: "
        f"{'no accumulation' if g_max < 10 else 'it grows here'}",
        f"每个存储的条目只舍入一次；十轮之内，任一 dtype 的逐轮 KL 变化至多 {g_max:.1f}x，"
        f"而各 dtype 之间相差 {spread:,.0f}x："
        f"{'没有累积' if g_max < 10 else '此处确有增长'}")),
    (Bi("switching the KV cache to FP32 fixed it", "把 KV cache 换成 FP32 解决了问题"),
     Bi(f"with the seed's fp16 model the logits are "
        f"{'bit-identical' if same16 else 'NOT bit-identical'} with a float32 cache (section 6): "
        f"the switch {'changed nothing' if same16 else 'changed the logits'}; `float32` is not a "
        f"vLLM `--kv-cache-dtype` value (0.4.2: `auto`, `fp8`)",
        f"在种子课程的 fp16 模型上，配 float32 缓存时 logits "
        f"{'逐位相同' if same16 else '并非逐位相同'}（第 6 节）："
        f"这一切换{'什么也没改变' if same16 else '改变了 logits'}；`float32` 不是 "
        f"vLLM `--kv-cache-dtype` 的取值（0.4.2：`auto`、`fp8`）")),
    (Bi("an FP32 KV cache removes KV rounding", "FP32 KV cache 消除了 KV 的舍入"),
     Bi("true for float32 weights, by construction (KL 0 against the float32 engine)",
        "对 float32 权重成立，按构造即如此（相对 float32 引擎 KL 为 0）")),
    (Bi("the cost: 'memory +30 %, concurrency 32 -> 24'",
        "代价：“内存 +30 %，并发 32 -> 24”"),
     Bi("vLLM preallocates the KV pool (`gpu_memory_utilization`), so memory use does not grow; "
        "a float32 cache holds half the tokens of float16 in the same pool (section 5), so at a "
        "fixed `max_model_len` concurrency halves: 32 -> 16, not 24",
        "vLLM 预先分配 KV 池（`gpu_memory_utilization`），所以内存占用不会增长；在同样大小的池中，"
        "float32 缓存容纳的 token 数只有 float16 的一半（第 5 节），所以在固定的 `max_model_len` 下"
        "并发数减半：32 -> 16，而不是 24")),
    (Bi("degradation starts after ~2000 tokens", "质量下降在约 2000 个 token 之后开始"),
     Bi(f"not tested here: the conversation has {n_conv} tokens; its per-turn KL changes by at "
        f"most {g_max:.1f}x, nothing to extrapolate to a threshold",
        f"此处未测试：这段对话有 {n_conv} 个 token；其逐轮 KL 变化至多 {g_max:.1f}x，"
        f"没有可以外推出阈值的趋势")),
    (Bi("(implied) low-precision KV is harmless", "（隐含的）低精度 KV 无害"),
     Bi(f"{'not for fp8 without scales' if fp8_above else 'for fp8 without scales, yes here'}: "
        f"{'above' if fp8_above else 'not above'} the noise floor "
        f"(KL {summary['fp8_e4m3'][0].mean_kl:.1e}); greedy answers in section 3",
        f"{'对没有缩放因子的 fp8 不成立' if fp8_above else '对没有缩放因子的 fp8，此处成立'}："
        f"{'高于' if fp8_above else '不高于'}噪声基底"
        f"（KL {summary['fp8_e4m3'][0].mean_kl:.1e}）；贪心回答见第 3 节")),
], header=(Bi("the seed says", "种子课程的说法"), Bi("what we measured here", "本次实测")))

# %% [markdown]
# The "PPL ratio" column above is the candidate's perplexity over the float32 engine's on
# the conversation's own tokens; 0.9999 for float16 is noise around 1, not an
# improvement. How much KL is too much in practice, and how to tell noise from an
# anomaly, is chapter 4's subject. And real degradation after many turns is more often a
# context-length or prompt-template problem (truncation, a lost system prompt) than KV
# rounding; chapter 26 measures those.

# %% [markdown]
# ## Common misconceptions
#
# - *"A lower-precision KV cache error grows with every token."* Each entry is rounded
#   once; reading it again does not round it again.
# - *"If greedy outputs differ, the configuration is broken."* Greedy text is a cascade:
#   one flipped near-tie changes everything after it. Measure on fixed tokens first.
# - *"Any difference from the reference is a bug."* Compare against the noise floor; a
#   float32 engine with a different reduction order differs too.
#
# ## Lab
#
# `labs/source/ch01/` starts from the broken configuration (fp8 e4m3 without scales) and
# asks you to build this comparison yourself and restore accuracy at the lowest cost: the
# cheapest KV cache whose mean KL stays under a budget on conversations you have not seen
# (float16 and bfloat16 cost the same; the measurement decides).
#
# ## On real vLLM
#
# - The baseline is `--dtype float32` with `--kv-cache-dtype auto` (auto = the model's
#   dtype). No vLLM version offers a `float32` KV cache: the choices are `auto`, 16-bit
#   types and fp8 (`fp8` = `fp8_e4m3` on CUDA, `fp8_e5m2`), plus newer quantized ones.
# - An fp8 cache needs scales: calibrated k/v scales in the checkpoint (llm-compressor)
#   or `--calculate-kv-scales` (set once from a warmup batch; deprecated in 2026, vllm
#   PR #37565). With neither they are 1.0: this chapter's broken configuration.
# - Score fixed tokens as here with `SamplingParams(prompt_logprobs=k)`; `k` is capped by
#   `--max-logprobs` (default 20). Recent versions take `-1` for the whole vocabulary
#   (with `--max-logprobs -1`), which a KL needs.
# - The startup log prints "GPU KV cache size" (tokens) and "Maximum concurrency":
#   compare them across `--kv-cache-dtype` values, as section 5 does.
# - Checked against vLLM's docs and source of 2025-2026 (v0.10 to the main branch). This
#   engine also accepts `kv_cache_dtype="float32"` (for teaching); its
#   `calculate_kv_scales=True` sets amax / qmax from bundled text, where vLLM divides one
#   batch's amax by fixed constants (`K_SCALE_CONSTANT` 200, `V_SCALE_CONSTANT` 100); and
#   `LLM.score` returns every position's full distribution.

# %%
print(f"chapter 1 ran in {time.perf_counter() - T0:.0f} s")
