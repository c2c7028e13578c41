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
# # Chapter 23. Chunked prefill: chunk-size dependence; attending to earlier chunks
#
# **Learning goals.** After this chapter you can
#
# 1. say what a prefill chunk must attend to: keys `0 .. start + n - 1` (every earlier
#    chunk and itself), through a causal mask whose diagonal is shifted by `start`, read
#    from the slots the block table gives those positions, and nothing past `start + n`;
# 2. tell the two kinds of "chunked differs from unchunked" apart by their size: a
#    correct implementation changes the reduction order (float32: noise, bfloat16:
#    bfloat16 noise), a wrong one changes what the model sees (KL of nats, a lost needle);
# 3. test chunking the way it fails: chunked greedy against unchunked greedy, with a fact
#    the model can only answer from an *earlier* chunk (passkey recall), on prompts long
#    enough for many chunks.
#
# **The incidents.**
# - **vllm #5952** "Chunked prefill vs. non-chunked output is different for a long prompt"
#   (Jun 2024, closed as stale): the same long prompt gave different output with
#   `--enable-chunked-prefill` on and off. The maintainer: chunked prefill
#   runs a different attention kernel, so small numerical differences are expected (the
#   report did not use temperature 0 or fp32); show a quality loss before calling it a bug.
# - **nano-vllm PR #213** "correct seqlen_k to chunk boundary in prepare_prefill"
#   (2026-04-22, fixes #212): during chunked prefill the key length `seqlen_k` was the
#   *whole* sequence length instead of `start + n`, so attention read
#   KV slots not written yet (illegal memory access or wrong results). Chunking rarely
#   triggered there, which hid it.
# - **kekzl/imp PRs #114, #117** (2026-05-07): chunk attention covered only the current
#   chunk and ignored earlier chunks' K/V; Gemma needle recall was right at 128-1000
#   tokens and failed from 1100 tokens with 512-token chunks.
#
# Everything below is measured when the notebook runs, on the embedded
# SmolLM2-135M-Instruct (135 M parameters, 30 layers) with minivllm on this machine's CPU.
# Chunks come from vLLM's own knobs: `enable_chunked_prefill=True` and a token budget
# `max_num_batched_tokens` per step (a prompt longer than the budget is prefilled in
# budget-sized chunks). The two bugs are **planted** through the step registry: the
# engine's step `"prefill_chunk"` (`minivllm.attention.metadata.prefill_chunk_ref`) returns
# the read slots and the mask of one chunk, and `faults.chunk_seqlen_k_full` /
# `faults.chunk_no_past_kv` swap it for the two incidents' versions. The unmodified engine
# shows only the first, tiny effect on its own.

# %%
# %matplotlib inline
import contextlib
import dataclasses
import time

import numpy as np
import torch
from matplotlib.figure import Figure

from minivllm import LLM, SamplingParams
from minivllm.attention.metadata import chunk_causal_mask, prefill_chunk_ref
from minivllm.i18n import Bi, say
from minivllm.precision import evalsets, faults, metrics
from minivllm.tokenizer import render_chat_ref

torch.manual_seed(0)
T0 = time.perf_counter()
MODEL = "smollm2-135m-instruct"
N_SWEEP = 300     # teacher-forced sequence for the KL sweep (corpus text)
N_BF16 = 96       # bfloat16 is slow on CPUs without bf16 matmul units: a shorter one
CHUNKS = (64, 128, 256)

llm = LLM(MODEL, dtype="float32", max_model_len=1100, max_num_batched_tokens=2048,
          enable_chunked_prefill=True)
llm16 = LLM(MODEL, dtype="bfloat16", max_model_len=1100, max_num_batched_tokens=2048,
            enable_chunked_prefill=True)
tok = llm.get_tokenizer()
text = evalsets.load_corpus()
x_ids = tok.encode(text[2000:6000])[:N_SWEEP]


@contextlib.contextmanager
def budget(engine: LLM, max_num_batched_tokens: int):
    """Run the block with another token budget per step (the scheduler's
    ``max_num_batched_tokens``; chunked prefill is on), instead of building one engine
    per chunk size: same weights, same cache, only the schedule changes."""
    sch = engine.llm_engine.scheduler
    old = sch.config
    sch.config = dataclasses.replace(old, max_num_batched_tokens=max_num_batched_tokens)
    try:
        yield
    finally:
        sch.config = old


print(f"float32 and bfloat16 engines, attention backend "
      f"{llm.llm_engine.model_runner.backend.name}, block size "
      f"{llm.llm_engine.cache_config.block_size}; sweep sequence {len(x_ids)} tokens")

# %% [markdown]
# ## 1. What a chunk is, and what it must attend to
#
# With a budget of 128 tokens per step, a 300-token prompt is prefilled in three steps. A
# spy on the `"prefill_chunk"` step (the reference, wrapped) shows what the engine asks for each chunk:
# `(start, n)`, and the request's whole length. The reference answer for a chunk is
# `kv_slots` = the slots of positions `0 .. start + n - 1` and a mask `[n, start + n]`
# where query `i` (position `start + i`) sees keys `0 .. start + i`.

# %%
seen = []


def spy(block_table, start, n, block_size, num_tokens):
    seen.append((start, n, num_tokens, len(block_table)))
    return prefill_chunk_ref(block_table, start, n, block_size, num_tokens)


rows = {}  # (dtype, chunk) -> [N, vocab] float32 logits
rows["fp32", None] = llm.score(x_ids, output="logits")  # one step: the whole prompt
with budget(llm, 128), llm.swap_step("prefill_chunk", spy):
    rows["fp32", 128] = llm.score(x_ids, output="logits")
for start, n, total, nblocks in seen:
    print(f"chunk start {start:3d}, n {n:3d}: reads {start + n:3d} keys of {total}; "
          f"block table so far {nblocks} blocks")
slots, mask = prefill_chunk_ref(torch.tensor([7, 2, 9]), 20, 8, 16, num_tokens=40)
print("example, table [7, 2, 9], block size 16, start 20, n 8: slots", slots.tolist()[:3],
      "...", slots.tolist()[-3:], f"({len(slots)}), mask row 0 sees keys 0..{int(mask[0].sum()) - 1}")

# %% [markdown]
# The block table grows with the chunks: the scheduler allocates blocks for the tokens it
# schedules, so positions past `start + n` have no slot yet. (nano-vllm allocates a
# sequence's every block up front, which is why its wrong `seqlen_k` read *unwritten* slots
# instead of failing.)
#
# ## 2. Chunk-size dependence of a correct implementation
#
# The same 300 tokens, teacher-forced, unchunked and in chunks of 64, 128 and 256, in
# float32; in bfloat16 the first 96 tokens, unchunked and in chunks of 32. KL is per
# position, `KL(unchunked || chunked)` in nats, averaged over the sequence.

# %%
for c in (64, 256):
    with budget(llm, c):
        rows["fp32", c] = llm.score(x_ids, output="logits")
rows["bf16", None] = llm16.score(x_ids[:N_BF16], output="logits")
with budget(llm16, 32):
    rows["bf16", 32] = llm16.score(x_ids[:N_BF16], output="logits")


def compare(ref, cand):
    kl = metrics.kl_divergence(ref, cand).numpy()
    return kl, float((ref - cand).abs().max()), metrics.top1_agreement(ref, cand)


sweep = {}
print("| dtype | chunk | mean KL (nats) | max KL | max abs dlogit | top-1 agreement |")
print("|---|---|---|---|---|---|")
for key in [("fp32", c) for c in CHUNKS] + [("bf16", 32)]:
    kl, dmax, top1 = compare(rows[key[0], None], rows[key])
    sweep[key] = (kl, dmax, top1)
    print(f"| {key[0]} | {key[1]} | {kl.mean():.1e} | {kl.max():.1e} | {dmax:.1e} | "
          f"{100 * top1:.1f}% |")
bf_noise = compare(rows["fp32", None][:N_BF16], rows["bf16", None])[0].mean()
print(f"for scale: bfloat16 vs float32 (both unchunked), same {N_BF16} tokens: mean KL "
      f"{bf_noise:.1e}")

# %% [markdown]
# **Why.** A chunk after the first one runs `scaled_dot_product_attention` with an
# explicit boolean mask over `start + n` keys; the unchunked prefill runs it with
# `is_causal=True` over the whole prompt, and every linear layer multiplies a matrix of `n`
# rows instead of 300. Same math, other kernels and other reduction orders, which is
# exactly what the vLLM maintainer said about #5952. In float32 that is at most rounding
# noise in the last bits, and the table shows whether it changed any bit at all here (a
# max abs dlogit of exactly 0 means bit-identical logits). In bfloat16 one would expect
# the same reordering to show up larger (the course plan's estimate); the table says what
# this CPU does, next to the bfloat16-vs-float32 difference for scale. Neither changes
# what the model attends to.
#
# ## 3. Bug (a): `seqlen_k` = the whole length (nano-vllm PR #213)
#
# `faults.chunk_seqlen_k_full` reads keys `0 .. num_tokens - 1` for every chunk with the
# causal mask aligned bottom-right (FlashAttention's convention when `seqlen_k >
# seqlen_q`): query `i` of a chunk sees keys up to `num_tokens - n + i`, most of them not
# written yet (zeros in a fresh block, stale K/V in a reused one). To make those slots
# exist it also allocates the whole sequence at admission, as nano-vllm does. The last
# chunk has `start + n == num_tokens` and is computed right, over wrong K/V of the
# earlier ones.
#
# ## 4. Bug (b): no past chunks (kekzl/imp PRs #114, #117)
#
# `faults.chunk_no_past_kv` gives each chunk only its own `n` keys under a plain
# lower-triangular mask: chunk 0 is exact, every later chunk starts from a blank context.
# Decode steps are untouched (they read the whole cache), so the question is whether the
# damage in the prompt's K/V is enough to lose a fact.

# %%
with budget(llm, 64):
    with faults.chunk_seqlen_k_full(llm):
        rows["seqlen_k_full", 64] = llm.score(x_ids, output="logits")
    with faults.chunk_no_past_kv(llm):
        rows["no_past", 64] = llm.score(x_ids, output="logits")
for name in ("seqlen_k_full", "no_past"):
    kl, dmax, top1 = compare(rows["fp32", None], rows[name, 64])
    sweep[name, 64] = (kl, dmax, top1)
    print(f"{name:14s} (64-token chunks): mean KL {kl.mean():.2f} nats (chunk 0: "
          f"{kl[:64].mean():.2f}, later chunks: {kl[64:].mean():.2f}), top-1 agreement "
          f"with unchunked {100 * top1:.0f}%")

# %%
fig = Figure(figsize=(11, 3.6))
ax, ax2 = fig.subplots(1, 2, gridspec_kw={"width_ratios": [2.2, 1]})
pos = np.arange(len(x_ids))
floor = 1e-16
for key, label, color in ((("seqlen_k_full", 64), "bug (a): seqlen_k = full length", "C3"),
                          (("no_past", 64), "bug (b): no past chunks", "C1"),
                          (("fp32", 64), "correct, float32", "C0")):
    ax.plot(pos[1:], np.maximum(sweep[key][0][1:], floor), lw=1, label=label, color=color)
ax.plot(pos[1:N_BF16], np.maximum(sweep["bf16", 32][0][1:], floor), lw=1,
        label="correct, bfloat16, 32-token chunks (vs bf16 unchunked)", color="C2")
for b in range(64, len(x_ids), 64):
    ax.axvline(b, color="grey", lw=0.5, ls=":")
ax.set_yscale("log")
ax.set_xlabel("position (dotted: 64-token chunk boundaries)")
ax.set_ylabel("KL(unchunked || chunked), nats")
ax.set_title("per-position KL, 64-token chunks")
ax.legend(fontsize=7, loc="lower right")
labels = [f"fp32 {c}" for c in CHUNKS] + ["bf16 32", "bug (a)", "bug (b)"]
vals = [sweep["fp32", c][0].mean() for c in CHUNKS] + [sweep["bf16", 32][0].mean(),
                                                      sweep["seqlen_k_full", 64][0].mean(),
                                                      sweep["no_past", 64][0].mean()]
ax2.bar(range(len(vals)), np.maximum(vals, floor),
        color=["C0"] * 3 + ["C2", "C3", "C1"])
ax2.set_yscale("log")
ax2.set_xticks(range(len(vals)), labels, rotation=45, fontsize=7)
ax2.set_ylabel("mean KL, nats")
ax2.set_title("by chunk size and bug")
fig.tight_layout()
fig

# %% [markdown]
# ## 5. Passkey recall: a fact in an earlier chunk
#
# The passkey items of `minivllm.precision.evalsets` hide a five-digit key in filler text
# and ask for it at the end. The 1011-token item with the key at depth 0.5, and the
# 507-token one at depth 0.9, in 64-token chunks (16 and 8 chunks): the question is in the
# last chunk, the key many chunks earlier. Greedy, 12 tokens. The unchunked reference is
# the answer stored with each item (the float32 HF `transformers` model, prefilled in one
# pass; minivllm's unchunked engine gives the same text on these two, which is how the
# evalset was checked). The fix (section 6) is the correct step written out plainly and
# swapped in; to save time the bugs run on the prompt where they teach something: (b) on
# both lengths, (a) on the shorter one (it already fails everything in section 3).

# %%
def prefill_chunk_fixed(block_table, start, n, block_size, num_tokens):
    """Read every position so far, 0 .. start + n - 1 (seqlen_k = start + n, not
    num_tokens), from the slots the block table gives them, under the causal mask shifted
    by start: query i (position start + i) sees keys 0 .. start + i."""
    seq_len = start + n
    pos = torch.arange(seq_len)
    slots = block_table[pos // block_size] * block_size + pos % block_size
    mask = torch.arange(seq_len)[None, :] <= (start + torch.arange(n))[:, None]
    return slots, mask


items = {it.num_tokens: it for it in evalsets.load_passkey()
         if (it.num_tokens, it.depth) in ((1011, 0.5), (507, 0.9))}
greedy = SamplingParams(temperature=0, max_tokens=12)
runs = {"fixed": lambda: llm.swap_step("prefill_chunk", prefill_chunk_fixed),
        "bug (a) seqlen_k full": lambda: faults.chunk_seqlen_k_full(llm),
        "bug (b) no past chunks": lambda: faults.chunk_no_past_kv(llm)}
plan = [(1011, "fixed"), (1011, "bug (b) no past chunks"), (507, "bug (a) seqlen_k full"),
        (507, "bug (b) no past chunks")]
recall = {}
for L, name in plan:
    it = items[L]
    ids = render_chat_ref(tok, [{"role": "user", "content": it.prompt}])
    with budget(llm, 64), runs[name]():
        out = llm.generate([ids], greedy)[0].outputs[0]
    ref_ids = tok.encode(it.reference_output, add_special_tokens=False)
    ok = evalsets.passkey_correct(out.text, it.passkey)
    div = metrics.first_divergence(ref_ids, out.token_ids[:len(ref_ids)])
    recall[L, name] = (out.token_ids, out.text, ok, div)
    say(f"{L}-token prompt, key {it.passkey} at depth {it.depth}, {name:22s}: "
        f"{out.text!r:50s} key found: {ok}; first divergence from the unchunked answer "
        f"{it.reference_output!r}: {'none' if div is None else f'token {div}'}",
        f"{L} token 提示词，密钥 {it.passkey} 位于深度 {it.depth}，{name:22s}："
        f"{out.text!r:50s} 找到密钥：{ok}；与不分块答案 "
        f"{it.reference_output!r} 的首次分歧位置：{'无' if div is None else f'第 {div} 个 token'}")

# %% [markdown]
# ## 6. The fix, measured
#
# The fix for both bugs is one line each: `seqlen_k = start + n` (nano-vllm PR #213), and
# keys from position 0, not from `start` (imp). `prefill_chunk_fixed` above is that,
# written without the reference; swapped in, the engine gives the same attention call as
# its default path, so the result must equal the default chunked run **bit for bit**.

# %%
with budget(llm, 64), llm.swap_step("prefill_chunk", prefill_chunk_fixed):
    fixed = llm.score(x_ids, output="logits")
say(f"fixed step, 64-token chunks: torch.equal(logits, default chunked engine) = "
    f"{torch.equal(fixed, rows['fp32', 64])}; mean KL vs unchunked "
    f"{metrics.mean_kl(rows['fp32', None], fixed):.1e}",
    f"修复后的步骤，64 token 分块：torch.equal(logits, 默认分块引擎) = "
    f"{torch.equal(fixed, rows['fp32', 64])}；相对不分块的平均 KL "
    f"{metrics.mean_kl(rows['fp32', None], fixed):.1e}")
say(f"greedy on the 1011-token passkey prompt equal to the unchunked answer: "
    f"{recall[1011, 'fixed'][3] is None}, key found: {recall[1011, 'fixed'][2]}",
    f"1011 token 密钥提示词上的贪心输出等于不分块的答案："
    f"{recall[1011, 'fixed'][3] is None}，找到密钥：{recall[1011, 'fixed'][2]}")
mask_ok = torch.equal(prefill_chunk_fixed(torch.arange(4), 30, 10, 16, 64)[1], chunk_causal_mask(10, 40))
say(f"mask of the fix == chunk_causal_mask: {mask_ok}", f"修复的掩码 == chunk_causal_mask：{mask_ok}")

# %% [markdown]
# ## 7. Claim vs measurement

# %%
kl32 = {c: sweep["fp32", c][0].mean() for c in CHUNKS}
kla, klb = sweep["seqlen_k_full", 64][0].mean(), sweep["no_past", 64][0].mean()
found = {k: v[2] for k, v in recall.items()}
def join(*parts):
    """One text from Bi parts and plain strings, in both languages."""
    return Bi("".join(getattr(p, "en", p) for p in parts),
              "".join(getattr(p, "zh", p) for p in parts))


def table3(rows):
    """Say a | claim | source | measured here | table (cells: Bi or str) in both languages."""
    en = ["| claim | source | measured here |", "|---|---|---|"]
    zh = ["| 论断 | 来源 | 本次实测 |", "|---|---|---|"]
    for cells in rows:
        en.append("| " + " | ".join(getattr(c, "en", c) for c in cells) + " |")
        zh.append("| " + " | ".join(getattr(c, "zh", c) for c in cells) + " |")
    say("\n".join(en), "\n".join(zh))


bit_identical = all(sweep["fp32", c][1] == 0 for c in CHUNKS)
row1 = join(
    Bi("not even that here: float32 chunked and unchunked logits are bit-identical, mean KL ",
       "这里连这一点都没有：float32 分块与不分块的 logits 逐位相同，平均 KL ")
    if bit_identical else Bi("yes, small: float32 mean KL ", "是的，很小：float32 平均 KL "),
    Bi(f"{kl32[64]:.1e} / {kl32[128]:.1e} / {kl32[256]:.1e} nats at 64 / 128 / 256 "
       f"tokens, top-1 {100 * sweep['fp32', 64][2]:.1f}%; greedy on the 1011-token "
       f"passkey prompt equal to the unchunked answer: {recall[1011, 'fixed'][3] is None}; "
       f"no quality loss to show",
       f"{kl32[64]:.1e} / {kl32[128]:.1e} / {kl32[256]:.1e} nats（64 / 128 / 256 "
       f"token 分块），top-1 {100 * sweep['fp32', 64][2]:.1f}%；1011 token "
       f"密钥提示词上的贪心输出等于不分块的答案：{recall[1011, 'fixed'][3] is None}；"
       f"没有可展示的质量损失"))
kl16 = sweep["bf16", 32][0].mean()
F32_NOISE = 1e-9  # float32 noise level: a reordered float32 sum gives a few 1e-11 nats (chapter 4)
f32_noise = kl32[64] <= F32_NOISE
budget_noise = max(kl32.values()) <= F32_NOISE  # every chunk budget at the float32 noise level
verdict = (Bi("bit-identical on this CPU, so not larger (not isolated here; a plausible "
              "reason: torch's CPU bfloat16 kernels accumulate in float32 and round once to "
              "bfloat16, which can absorb a float32-level reordering)",
              "在这块 CPU 上逐位相同，所以并不更大（这里没有单独验证；一个可能的原因："
              "torch 的 CPU bfloat16 核函数在 float32 中累加，最后只舍入一次到 "
              "bfloat16，这可以吸收 float32 级别的重排）")
           if sweep["bf16", 32][1] == 0 else
           Bi(f"{'larger' if kl16 > kl32[64] else 'not larger'} than float32",
              f"{'大于' if kl16 > kl32[64] else '不大于'} float32"))
row2 = join(
    Bi(f"float32: {'yes' if f32_noise else 'no'}, mean KL "
       f"{kl32[64]:.0e}{'' if f32_noise else ' (above 1e-9)'}, max |dlogit| {sweep['fp32', 64][1]:.1e}; bfloat16 (32-token chunks, "
       f"{N_BF16} tokens): mean KL {kl16:.1e}, max |dlogit| {sweep['bf16', 32][1]:.1e}, ",
       f"float32：{'是' if f32_noise else '否'}，平均 KL "
       f"{kl32[64]:.0e}{'' if f32_noise else '（高于 1e-9）'}，最大 |dlogit| {sweep['fp32', 64][1]:.1e}；bfloat16（32 token 分块，"
       f"{N_BF16} 个 token）：平均 KL {kl16:.1e}，最大 |dlogit| {sweep['bf16', 32][1]:.1e}，"),
    verdict,
    Bi(f"; bf16-vs-fp32 itself is {bf_noise:.1e}", f"；bf16 与 fp32 之间本身的差异为 {bf_noise:.1e}"))
table3([
    (Bi("chunked and unchunked prefill differ for a long prompt; a different kernel, so "
        "small differences are expected",
        "对长提示词，分块与不分块的 prefill 结果不同；换了一个核函数，所以微小差异在预期之内"),
     Bi("vllm #5952 (maintainer)", "vllm #5952（维护者）"), row1),
    (Bi("fp32 at noise level, bf16 larger", "fp32 处于噪声水平，bf16 更大"),
     Bi("course plan estimate", "课程计划的估计"), row2),
    (Bi("seqlen_k = full length reads unwritten slots: wrong results",
        "seqlen_k = 整个长度，会读取未写入的槽位：结果错误"),
     "nano-vllm PR #213",
     Bi(f"planted: mean KL {kla:.2f} nats from chunk 0 on, top-1 "
        f"{100 * sweep['seqlen_k_full', 64][2]:.0f}%; 507-token passkey found: "
        f"{found[507, 'bug (a) seqlen_k full']}",
        f"植入：从分块 0 起平均 KL {kla:.2f} nats，top-1 "
        f"{100 * sweep['seqlen_k_full', 64][2]:.0f}%；507 token 密钥提示词找到密钥："
        f"{found[507, 'bug (a) seqlen_k full']}")),
    (Bi("chunks that ignore earlier chunks lose the needle, only past some length "
        "(imp: from 1100 tokens, 512-token chunks)",
        "忽略之前分块的分块会丢失“针”，但只在超过某个长度之后"
        "（imp：从 1100 个 token 起，512 token 分块）"),
     "kekzl/imp #114/#117",
     Bi(f"planted, 64-token "
        f"chunks: mean KL {klb:.2f} nats (chunk 0: max KL "
        f"{sweep['no_past', 64][0][:64].max():.1g}); passkey found at 507 tokens: "
        f"{found[507, 'bug (b) no past chunks']}, at 1011: "
        f"{found[1011, 'bug (b) no past chunks']}",
        f"植入，64 token "
        f"分块：平均 KL {klb:.2f} nats（分块 0：最大 KL "
        f"{sweep['no_past', 64][0][:64].max():.1g}）；507 个 token 时找到密钥："
        f"{found[507, 'bug (b) no past chunks']}，1011 个 token 时："
        f"{found[1011, 'bug (b) no past chunks']}")),
    (Bi("enable-chunked-prefill and max-num-batched-tokens are performance settings "
        "(throughput/latency)",
        "enable-chunked-prefill 和 max-num-batched-tokens 是性能设置（吞吐量/延迟）"),
     Bi("seed 002 §二, §四", "种子课程 002 §二、§四"),
     Bi(f"{'right' if budget_noise else 'not quite'} for a correct engine: the budget "
        f"changes the logits {'only at' if budget_noise else 'above (1e-9)'} the float32 noise "
        f"level ({min(kl32.values()):.1e} to "
        f"{max(kl32.values()):.1e} nats); but it also decides whether a chunking bug runs at "
        f"all (a budget >= the prompt hides both bugs)",
        f"对正确的引擎{'成立' if budget_noise else '并不完全成立'}：预算"
        f"{'只在' if budget_noise else '在高于（1e-9）'} float32 噪声水平上改变 logits"
        f"（{min(kl32.values()):.1e} 到 "
        f"{max(kl32.values()):.1e} nats）；但它也决定了分块 bug 是否会运行"
        f"（预算 >= 提示词长度时两个 bug 都被掩盖）")),
])

# %% [markdown]
# ## Common misconceptions
#
# - *"Chunked prefill changes the answers, so it loses accuracy."* A correct
#   implementation changes the reduction order, no more: float32 KL of the order printed
#   in section 2, identical greedy text on the passkey prompts. A different answer in
#   bfloat16 is the usual bfloat16 sensitivity (chapter 5), not chunking.
# - *"Chunks are independent, like a batch."* Chunk `k` must attend to chunks `0 .. k-1`:
#   it is the same sequence, cut for scheduling. Bug (b) is what treating it as a batch
#   does.
# - *"The key length is the sequence length."* It is the length *so far*, `start + n`.
#   The request's whole length is known to the metadata builder, which is what makes bug
#   (a) so easy to write; it reads positions that are not written yet.
# - *"The first chunk is right, so chunking is right."* Both bugs leave the unchunked
#   prefill exact, bug (b) even leaves chunk 0 right (to rounding); and short prompts, or a budget larger
#   than the prompt, never chunk at all (nano-vllm's bug hid that way). Test with prompts
#   several chunks long, with the fact in an early chunk.
# - *"Passkey found = chunking works."* Decode steps read the whole cache, so bug (b) still
#   found the key in the shorter prompt: recall degrades with length (imp saw it from 1100
#   tokens). Compare chunked with unchunked greedy tokens, not just the final answer.
#
# ## Lab
#
# `labs/source/ch23/` starts from an engine that prefills in 16-token chunks with bug (b)
# planted (`faults.chunk_no_past_kv`). You write
# `chunk_schedule(num_tokens, budget)` (the `(start, n)` chunks the scheduler makes for a
# prompt alone) and `chunk_mask_and_slots(block_table, start, n, block_size, num_tokens)`
# (the `"prefill_chunk"` step). The grader compares them exactly with the engine on fresh
# parameters, then plugs your step into the engine: on fresh passkey prompts in 16-token
# chunks, chunked greedy must equal unchunked greedy and find the key, while each planted
# bug fails the same check.
#
# ## On real vLLM
#
# - In v1 chunked prefill is always on; `--max-num-batched-tokens` is the per-step token
#   budget, and the scheduler fills it with the running decodes **first**, then with
#   prefill chunks. A prompt's chunks therefore follow the load: section 2's chunk-size
#   dependence becomes a dependence on how many other requests were decoding.
# - `--long-prefill-token-threshold` caps the tokens one long prompt takes per step;
#   `--max-num-partial-prefills` and `--max-long-partial-prefills` cap how many prompts
#   are mid-prefill at once. The startup log states the budget ("Chunked prefill is
#   enabled with max_num_batched_tokens=...").
# - To test as section 5 does: a `--max-num-batched-tokens` at least as long as the
#   longest prompt keeps it in one step; compare `prompt_logprobs` and greedy output
#   against a small budget, with a fact only an early chunk holds.
# - Checked against vLLM's optimization guide and `vllm/config/scheduler.py`
#   (2025-2026). This engine has the same two knobs (`enable_chunked_prefill`, default
#   on, and `max_num_batched_tokens`); a chunk's mask and read slots are the
#   `"prefill_chunk"` step, which the faults replace.

# %%
print(f"chapter 23 ran in {time.perf_counter() - T0:.0f} s")
