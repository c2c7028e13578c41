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
# # Chapter 7. PagedAttention: block tables and slot mapping; what a wrong mapping does
#
# **Learning goals.** After this chapter you can
#
# 1. read a block table and compute a slot mapping by hand: where token `pos` of a
#    sequence lives in the paged KV pool (`block_table[pos // block_size] * block_size +
#    pos % block_size`), for a *fragmented* pool whose block ids are not contiguous;
# 2. recognise the three ways a mapping goes wrong (a reader handed the wrong table, an
#    off-by-one at block boundaries, a writer and a reader that disagree on the block
#    size) by what they do to the logits: how large, from which position on, for which
#    sequences;
# 3. test a mapping the way it can fail: on a fragmented pool, bit for bit against the
#    reference, because a fresh pool hides some of these bugs.
#
# **The incident.** **vllm #5543** "prefix-caching: inconsistent completions" (2024-06-14;
# also InternLM/lmdeploy #1719). TinyLlama-1.1B-Chat on vLLM
# 0.5.0.post1: a server with `--enable-prefix-caching` gave different completions from one
# without it, and from its own previous run, on 16 random prompts; the reporter's internal
# eval scores dropped. The fix, **vllm PR #7018** (2024-08-01) "Fix block table for seqs
# that have prefix cache hits": in the FlashAttention backend, when a batch mixed
# sequences with and without a prefix-cache hit, the sequences *without* a hit got an
# all-zero block table, so they read the K/V in block 0, someone else's, instead of their
# own (or crashed). No rounding is involved: it is a wrong address, and it shows up only
# when a particular mix of requests shares a step.
#
# Everything below is measured when the notebook runs, on the embedded
# SmolLM2-135M-Instruct with minivllm on this machine's CPU, in float32. The faults are
# planted through the step registry (`minivllm.steps`): the engine's slot mapping is the
# step `"slot_mapping"` (writer and reader) and `"slot_mapping.read"` (the reader alone).

# %%
# %matplotlib inline
import time

import numpy as np
import torch
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from minivllm import LLM, SamplingParams
from minivllm.attention.metadata import slot_mapping_ref
from minivllm.i18n import Bi, claims_table, say
from minivllm.precision import evalsets, faults, metrics
from minivllm.precision.paging import fragment_pool, record_block_tables

torch.manual_seed(0)
T0 = time.perf_counter()
MODEL = "smollm2-135m-instruct"
BS = 16          # tokens per block (the engine's default, as in vLLM)
NUM_BLOCKS = 24  # a small pool, so that every block gets used and reused
N_X = 40         # the teacher-forced sequence: 3 blocks, block boundaries at 16 and 32

llm = LLM(MODEL, dtype="float32", max_model_len=256, block_size=BS,
          num_gpu_blocks_override=NUM_BLOCKS)
eng = llm.llm_engine
kv = eng.kv_cache_manager
tok = llm.get_tokenizer()
text = evalsets.load_corpus()
x_ids = tok.encode(text[1000:3000])[:N_X]
print(f"pool: {NUM_BLOCKS} blocks x {BS} tokens = {NUM_BLOCKS * BS} slots per layer; "
      f"attention backend {eng.model_runner.backend.name}")

# %% [markdown]
# ## 1. A fresh pool, and a bug it hides
#
# On a freshly built engine the first request gets blocks 0, 1, 2: its block table is the
# identity, and slot = position. Plant fault (c) now, a reader that computes its slots
# with a block size of 32 while the writer (and the block manager) use 16, and score the
# sequence: `table[pos // 32] * 32 + pos % 32` with `table = [0, 1, 2]` is `pos` again.

# %%
with record_block_tables(llm) as tables_fresh, faults.reader_block_size(llm, 2 * BS):
    rows_c_fresh = llm.score(x_ids, output="logits")
rows_ref = llm.score(x_ids, output="logits")  # the correct engine (another table: same numbers)
print(f"block table on the fresh pool: {tables_fresh[0]}")
say(f"reader with block size {2 * BS} on it: logits bit-identical to the correct engine: "
    f"{torch.equal(rows_c_fresh, rows_ref)}",
    f"在它上面使用块大小为 {2 * BS} 的读取方：logits 与正确的引擎逐比特相同："
    f"{torch.equal(rows_c_fresh, rows_ref)}")

# %% [markdown]
# The mismatched reader passes a bit-exact test here. A test suite that builds a fresh
# engine per test and sends one request would never see it. So before measuring anything
# else, put the pool in the state a busy server leaves it in: fill every block with
# one-block requests, run them, and free them in random order (`fragment_pool`). New
# requests then get whatever blocks come off the free queue, and every block still holds
# the K/V its last owner wrote.
#
# ## 2. How a block table and a slot mapping work, on a fragmented pool

# %%
owner = fragment_pool(llm, seed=7)
queue = list(kv.block_pool.free_block_queue)
print(f"free queue after the random frees (next allocations come from the front): {queue}")
with record_block_tables(llm) as seen:
    out = llm.generate([x_ids[:20], x_ids[20:]],
                       SamplingParams(temperature=0, max_tokens=14, ignore_eos=True))
tab_a, tab_b = seen[0], seen[1]
print(f"request A, 20-token prompt: block table {tab_a}; request B, {N_X - 20}-token "
      f"prompt: {tab_b}")
print(f"after 14 decode steps: A {seen[-2] if len(seen) > 1 else tab_a}, "
      f"B {seen[-1]}")
print()
print("| request | pos | logical block = pos // 16 | physical block = table[...] | "
      "offset = pos % 16 | slot |")
print("|---|---|---|---|---|---|")
for name, tab in (("A", seen[-2]), ("B", seen[-1])):
    t = torch.tensor(tab)
    for p in (0, 15, 16, 17, 31, 32):
        if p // BS < len(tab):
            s = int(slot_mapping_ref(t, torch.tensor([p]), BS))
            print(f"| {name} | {p} | {p // BS} | {tab[p // BS]} | {p % BS} | {s} |")

# %%
fig = Figure(figsize=(8, 2.2), layout="constrained")
ax = fig.add_subplot()
final = {"A": seen[-2], "B": seen[-1]}
for b in range(NUM_BLOCKS):
    who = next((n for n, t in final.items() if b in t), None)
    c = {"A": "C0", "B": "C1"}.get(who, "0.85")
    ax.add_patch(Rectangle((b, 0), 0.95, 1, color=c))
    if who:
        ax.text(b + 0.47, 0.5, f"{who}{final[who].index(b)}", ha="center", va="center",
                fontsize=8, color="white")
ax.set_xlim(0, NUM_BLOCKS)
ax.set_ylim(0, 1)
ax.set_yticks([])
ax.set_xticks(np.arange(NUM_BLOCKS) + 0.47)
ax.set_xticklabels(range(NUM_BLOCKS), fontsize=7)
ax.set_xlabel("physical block id (label: request and logical block; grey: free, stale K/V)")
ax.set_title("Two requests on a fragmented pool: logical blocks are scattered")
fig

# %% [markdown]
# A request sees a contiguous sequence of positions; the pool sees scattered blocks.
# The **block table** is the only link: entry `j` is the physical block that holds
# positions `16 j .. 16 j + 15`. The **slot mapping** turns a position into a row of the
# pool, `table[pos // 16] * 16 + pos % 16`, and it is used twice per token and layer: once
# by the writer (where this step's K/V go: `slot_mapping` in the batch tensors) and once
# by the reader (which rows attention gathers: in minivllm the TORCH backend's read slots,
# in vLLM the block table handed to the paged-attention kernel). Both must be right, and
# they must agree.
#
# Two facts follow, and the faults below test both:
#
# - a sequence's K/V never move after they are written, so an error in the mapping is not
#   rounding: it reads a *different token's* K/V, and the result is as wrong as a wrong
#   token;
# - a mapping that is wrong in the same way for writer and reader is harmless as long as
#   it sends different positions to different slots the sequence owns. The damage comes
#   from collisions (two positions in one slot) and from foreign blocks.

# %% [markdown]
# ## 3. The incident, reproduced: zeroed block tables for rows without a prefix hit
#
# `faults.zeroed_block_tables(llm)` plants vLLM's bug: in a step whose batch mixes a
# prefill with computed context (a prefix-cache hit) and prefills without it, the reader
# gets an all-zero block table for the rows without it; writes stay right.
#
# Request H shares a 48-token prefix (3 blocks) with an earlier request, so its first 3
# blocks are cache hits; request M is fresh. They are submitted together. M is scored
# teacher-forced (its full logits) in the same step as H's prefill, first with the correct
# engine, then with the fault. Then H and a fresh prompt M' generate 12 tokens greedily,
# again side by side. (M' is new text: a prompt the engine has computed before may now be
# in the prefix cache itself, and a row with a hit is not hit by this bug.)

# %%
prefix = tok.encode(text[3000:3800])[:48]
h_ids = prefix + tok.encode(text[3800:4000])[:8]
m_ids = tok.encode(text[4000:5000])[:N_X]
m_gen = tok.encode(text[8000:9000])[:N_X]  # M's prompt for generation (never seen before)
greedy12 = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def warm():
    """Put the shared prefix in the prefix cache (another request that starts with it)."""
    llm.generate([prefix + tok.encode(" and")], SamplingParams(temperature=0, max_tokens=1))


def m_rows_beside_h():
    """H and M submitted together: M's teacher-forced logits, and how many of H's tokens
    were prefix-cache hits."""
    eng.add_request(h_ids, SamplingParams(temperature=0, max_tokens=1))
    m_req = eng.add_score_request(m_ids, mode="prefill", logits=True)
    hits = kv.prefix_cache_hits
    while eng.has_unfinished_requests():
        eng.step()
    eng.finished_outputs.clear()
    return m_req.score.result(), kv.prefix_cache_hits - hits


def mixed_step():
    """With the prefix cached: M's logits beside H, then both greedy continuations."""
    warm()
    m, hit_tokens = m_rows_beside_h()
    warm()
    outs = llm.generate([h_ids, m_gen], greedy12)
    return m, [o.outputs[0].token_ids for o in outs], hit_tokens


m_ref, gen_ref, hit_ref = mixed_step()
assert eng.reset_prefix_cache()
m_cold_ref, _ = m_rows_beside_h()  # the same batch, cache cold: H has no hit
with faults.zeroed_block_tables(llm):  # (the swap empties the prefix cache on entry)
    m_cold_bad, hit_cold = m_rows_beside_h()
    m_bad, gen_bad, hit_bad = mixed_step()
kl_a = metrics.kl_divergence(m_ref, m_bad).numpy()
top1_a = metrics.top1_agreement(m_ref, m_bad)
def tr(text, lang):
    """The ``lang`` ("en" or "zh") text of a ``Bi``."""
    return getattr(text, lang)


say(f"prefix-cache hit tokens in the mixed batch: correct run {hit_ref}, faulty run "
    f"{hit_bad}; cold cache {hit_cold}",
    f"混合批次中前缀缓存命中的 token 数：正确的运行 {hit_ref}，有故障的运行 "
    f"{hit_bad}；冷缓存 {hit_cold}")
say(f"cold cache (no hit in the batch), faulty engine: M's logits bit-identical to the "
    f"correct engine's: {torch.equal(m_cold_bad, m_cold_ref)}",
    f"冷缓存（批次中没有命中），有故障的引擎：M 的 logits 与正确引擎的逐比特相同："
    f"{torch.equal(m_cold_bad, m_cold_ref)}")
say(f"M (no hit), teacher-forced, faulty vs correct: mean KL {kl_a.mean():.2f} nats, "
    f"max {kl_a.max():.2f}, top-1 agreement {100 * top1_a:.0f}%",
    f"M（没有命中），教师强制，有故障对比正确：平均 KL {kl_a.mean():.2f} nats，"
    f"最大 {kl_a.max():.2f}，Top-1 一致率 {100 * top1_a:.0f}%")
for name, i in ((Bi("H (hit)", "H（有命中）"), 0), (Bi("M' (no hit)", "M'（没有命中）"), 1)):
    agree = metrics.greedy_agreement(gen_ref[i], gen_bad[i])
    first = metrics.first_divergence(gen_ref[i], gen_bad[i])
    say(f"{tr(name, 'en')}: greedy agreement {100 * agree:.0f}% over 12 tokens, first divergence "
        f"{first}",
        f"{tr(name, 'zh')}：12 个 token 上的贪心一致率 {100 * agree:.0f}%，首次分歧位置 "
        f"{first}")
print(f"  correct M': {tok.decode(gen_ref[1])!r}\n  faulty M':  {tok.decode(gen_bad[1])!r}")

# %% [markdown]
# The request with the hit keeps its greedy tokens unchanged (the H line; only greedy
# agreement is measured for it); the request without one is garbage from its very
# first token, and its generation inherits that (its prompt's K/V in layers 1-29 were
# computed from the wrong attention). With a cold cache the same batch under the same
# fault gives bit-identical logits (second line): the bug needs the *mix*. That fits what
# the reporter saw, a cached server that disagreed with the uncached one and with itself:
# which requests share a step, and which have a hit, changes from run to run.
#
# ## 4. Fault (b): an off-by-one at block boundaries
#
# `faults.off_by_one_slots(llm)` takes the block index from `pos - 1` (clamped at 0) and
# the offset from `pos`: a 1-based/0-based mix-up. Every position maps right except the
# first token of each block after the first: position 16 lands in position 0's slot,
# position 32 in position 16's. Writer and reader share it, so the sequence is consistent
# with itself until a collision overwrites a token. Score the fixed sequence
# token by token (decode mode), with the correct engine and with the fault, and look at
# the KL per position; then the same in one prefill.

# %%
t = time.perf_counter()
dec_ref = llm.score(x_ids, mode="decode", output="logits")
with faults.off_by_one_slots(llm):
    dec_b = llm.score(x_ids, mode="decode", output="logits")
    pre_b = llm.score(x_ids, mode="prefill", output="logits")
t_b = time.perf_counter() - t
kl_b = metrics.kl_divergence(dec_ref, dec_b).numpy()
kl_bp = metrics.kl_divergence(rows_ref, pre_b).numpy()
first_bad = int(np.nonzero(kl_b > 0)[0][0]) if (kl_b > 0).any() else None
say(f"decode mode: positions 0-{BS - 1} bit-identical to the correct engine: "
    f"{torch.equal(dec_ref[:BS], dec_b[:BS])}; first position with KL > 0: {first_bad}",
    f"decode 模式：位置 0-{BS - 1} 与正确的引擎逐比特相同："
    f"{torch.equal(dec_ref[:BS], dec_b[:BS])}；第一个 KL > 0 的位置：{first_bad}")
say(f"decode mode, mean KL: positions < {BS} {kl_b[:BS].mean():.1e}, positions >= {BS} "
    f"{kl_b[BS:].mean():.2f} nats (max {kl_b.max():.2f}); top-1 agreement from {BS} on "
    f"{100 * metrics.top1_agreement(dec_ref[BS:], dec_b[BS:]):.0f}%",
    f"decode 模式，平均 KL：位置 < {BS} 为 {kl_b[:BS].mean():.1e}，位置 >= {BS} 为 "
    f"{kl_b[BS:].mean():.2f} nats（最大 {kl_b.max():.2f}）；从 {BS} 起的 Top-1 一致率 "
    f"{100 * metrics.top1_agreement(dec_ref[BS:], dec_b[BS:]):.0f}%")
say(f"prefill mode: mean KL positions < {BS} {kl_bp[:BS].mean():.2f}, >= {BS} "
    f"{kl_bp[BS:].mean():.2f} nats ({t_b:.1f} s for the three scores)",
    f"prefill 模式：平均 KL，位置 < {BS} 为 {kl_bp[:BS].mean():.2f}，>= {BS} 为 "
    f"{kl_bp[BS:].mean():.2f} nats（三次打分用时 {t_b:.1f} s）")

# %% [markdown]
# Token by token, the first 16 positions are exact (nothing has collided yet), and the
# damage starts exactly at position 16, the first block boundary, where position 16's
# K/V overwrite position 0's. One overwritten token costs the same order as the zeroed
# table of section 3 (half as much here: a mean KL of 2.65 against 5.34 nats, printed).
# This notebook does not isolate why; a likely reason is that the first token is an
# "attention sink" that many heads attend to heavily (Xiao et al., StreamingLLM, 2023),
# so every later query loses it. In one prefill the early positions are wrong too:
# all 40 tokens are written before any is read, so positions 0-15 already see
# position 16's K/V in position 0's slot. Same bug, two different pictures: which one
# you see depends on whether you test generation or a prompt.

# %%
fig = Figure(figsize=(7, 4), layout="constrained")
ax = fig.add_subplot()
pos = np.arange(N_X)
ax.plot(pos, np.maximum(kl_b, 1e-12), "o-", ms=3, lw=1, label="(b) off-by-one, decode mode")
ax.plot(pos, np.maximum(kl_bp, 1e-12), "s-", ms=3, lw=1, label="(b) off-by-one, one prefill")
ax.plot(pos, np.maximum(kl_a, 1e-12), "^-", ms=3, lw=1,
        label="(a) zeroed table, row without a hit")
for b in range(BS, N_X, BS):
    ax.axvline(b - 0.5, color="gray", ls=":", lw=1)
ax.set_yscale("log")
ax.set_ylim(5e-13, 50)
ax.set_xlabel("position (dotted: block boundaries)")
ax.set_ylabel("KL(correct || faulty) (nats; 1e-12 = exactly 0)")
ax.set_title("Where the damage starts")
ax.grid(True, which="both", alpha=0.3)
ax.legend(fontsize=8)
fig

# %% [markdown]
# ## 5. Fault (c) on the fragmented pool, and greedy agreement for all three
#
# The reader with block size 32 was exact on the fresh pool (section 1). On the
# fragmented pool its slots `table[pos // 32] * 32 + pos % 32` point at other blocks, or
# past the end of the pool (`NUM_BLOCKS * 16` rows), which on this CPU is an index error
# (on a GPU, an illegal memory access or silent garbage). Three prompts generate 20
# greedy tokens each, with the correct engine and under each fault.

# %%
prompts = [tok.encode(text[s:s + 400])[:n] for s, n in ((5000, 12), (6000, 20), (7000, 28))]
greedy20 = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
gen_ok = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy20)]
greedy_rows = {}
for label, fault in (("(b) off-by-one", lambda: faults.off_by_one_slots(llm)),
                     ("(c) reader block size 32", lambda: faults.reader_block_size(llm, 2 * BS))):
    try:
        with fault():
            got = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy20)]
        agree = [metrics.greedy_agreement(a, b) for a, b in zip(gen_ok, got)]
        firsts = [metrics.first_divergence(a, b) for a, b in zip(gen_ok, got)]
        # position in the sequence (prompt + output) where each answer first differs
        where = [None if f is None else len(p) + f for p, f in zip(prompts, firsts)]
        greedy_rows[label] = (f"{100 * np.mean(agree):.0f}%", str(where))
    except (IndexError, RuntimeError) as e:
        greedy_rows[label] = ("crashed", f"{type(e).__name__}: {str(e)[:60]}")
print(f"fragmented pool, next blocks off the queue: {list(kv.block_pool.free_block_queue)[:8]}")
print("| fault | greedy agreement | first divergence, as a position in the sequence |")
print("|---|---|---|")
f_a = metrics.first_divergence(gen_ref[1], gen_bad[1])
print(f"| (a) zeroed table, row without a hit (M': {len(m_gen)}-token prompt, 12 tokens) | "
      f"{100 * metrics.greedy_agreement(gen_ref[1], gen_bad[1]):.0f}% | "
      f"{None if f_a is None else len(m_gen) + f_a} |")
for label, (a, w) in greedy_rows.items():
    print(f"| {label} (prompts of {[len(p) for p in prompts]} tokens, 20 tokens each) | {a} "
          f"| {w} |")

# %% [markdown]
# For (b), read the first divergences against the first block boundary, position 16:
# nothing before it can change in generation, since no slot has been reused yet (the
# prompts longer than 16 tokens are prefilled in one step, so their damage starts in the
# prompt). For (c), what happens depends on the block ids the requests got, which is the
# point: the same bug passed a bit-exact test on the fresh pool.
#
# ## 6. The fix, measured
#
# The fix is the mapping itself, computed the same way by writer and reader and from the
# right table for every row. Here it is written out plainly (the lab asks you for it),
# swapped in for the engine's step on the fragmented pool, and compared **bit for bit**
# with the correct engine in both paths.

# %%
def slot_mapping_fixed(block_table: torch.Tensor, positions: torch.Tensor,
                       block_size: int) -> torch.Tensor:
    """table[pos // block_size] * block_size + pos % block_size, for [..., n] positions
    and a [..., num_blocks] table (int64)."""
    logical = torch.div(positions, block_size, rounding_mode="floor")
    physical = torch.gather(block_table, -1, logical)
    return physical * block_size + torch.remainder(positions, block_size)


fragment_pool(llm, seed=11)
with record_block_tables(llm, slot_mapping_fixed) as tabs_fix:  # the fixed step, swapped in
    pre_fix = llm.score(x_ids, output="logits")
    dec_fix = llm.score(x_ids[:24], mode="decode", output="logits")  # past one boundary
    gen_fix = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy20)]
print(f"block tables the fixed mapping ran on: {tabs_fix[0]} (prefill), {tabs_fix[-1]} (last)")
say(f"prefill: torch.equal(logits, correct engine) = {torch.equal(pre_fix, rows_ref)}",
    f"prefill：torch.equal(logits, 正确的引擎) = {torch.equal(pre_fix, rows_ref)}")
say(f"decode:  torch.equal(logits, correct engine) = {torch.equal(dec_fix, dec_ref[:24])}",
    f"decode： torch.equal(logits, 正确的引擎) = {torch.equal(dec_fix, dec_ref[:24])}")
say(f"greedy, 3 prompts x 20 tokens: equal to the correct engine: {gen_fix == gen_ok}",
    f"贪心，3 个提示词 x 20 个 token：与正确的引擎相等：{gen_fix == gen_ok}")

# %% [markdown]
# Bit-identical, not "close": a mapping is integer arithmetic, so the right one reads
# exactly the same K/V, and any difference at all means a wrong address. That makes the
# test sharp (no tolerance to argue about) and cheap, but only if it runs on a pool where
# a wrong formula has somewhere wrong to point.
#
# ## 7. Claim vs measurement
#
# The course plan expected (a) and (c) to be catastrophic (KL >> 1) and (b) to be subtle and
# length-dependent. The numbers below are from this run.

# %%
kl_b_after, kl_b_mean_a = kl_b[BS:].mean(), kl_a.mean()
exact_below = torch.equal(dec_ref[:BS], dec_b[:BS])
hit_row_same = gen_ref[0] == gen_bad[0]
c_fresh_same = torch.equal(rows_c_fresh, rows_ref)
fix_same = (torch.equal(pre_fix, rows_ref), torch.equal(dec_fix, dec_ref[:24]), gen_fix == gen_ok)
REPRODUCED = hit_bad > 0 and kl_a.max() > 0
LEN_DEP = exact_below and kl_b_after > 0
EARLY = kl_bp[:BS].mean() > kl_bp[BS:].mean()


def agreement_text(value, lang):
    """A greedy_rows agreement ("NN%" or "crashed") in ``lang``."""
    return value if lang == "en" or value != "crashed" else "崩溃"


C_AGREE = greedy_rows['(c) reader block size 32'][0]
claims_table([
    (Bi("vllm #5543: with prefix caching, completions differ from the uncached server",
        "vllm #5543：开启前缀缓存时，补全结果与未开启缓存的服务端不同"),
     Bi(f"{'reproduced' if REPRODUCED else 'not reproduced'} with the PR #7018 bug planted: the "
        f"row without a hit, batched with a hit ({hit_bad} hit tokens), mean KL "
        f"{kl_a.mean():.2f} nats (max {kl_a.max():.2f}), top-1 {100 * top1_a:.0f}%; the hit "
        f"row's greedy answer {'unchanged' if hit_row_same else 'changed too'} "
        f"({100 * metrics.greedy_agreement(gen_ref[0], gen_bad[0]):.0f}% agreement)",
        f"植入 PR #7018 的 bug 后{'已复现' if REPRODUCED else '未复现'}：没有命中的行与有命中的行"
        f"同批（{hit_bad} 个命中 token），平均 KL "
        f"{kl_a.mean():.2f} nats（最大 {kl_a.max():.2f}），Top-1 {100 * top1_a:.0f}%；有命中的行的"
        f"贪心回答{'不变' if hit_row_same else '也改变了'}"
        f"（一致率 {100 * metrics.greedy_agreement(gen_ref[0], gen_bad[0]):.0f}%）")),
    (Bi("(a) zeroed block tables are catastrophic (KL >> 1)", "(a) 全零块表是灾难性的（KL >> 1）"),
     Bi(f"{'yes' if kl_a.mean() > 1 else 'no'}: mean KL {kl_a.mean():.2f} nats, from the "
        f"first position (KL at position 0: {kl_a[0]:.2f})",
        f"{'是' if kl_a.mean() > 1 else '否'}：平均 KL {kl_a.mean():.2f} nats，从第一个位置"
        f"开始（位置 0 的 KL：{kl_a[0]:.2f}）")),
    (Bi("(b) an off-by-one is subtle and length-dependent", "(b) 差一错误是隐蔽且依赖长度的"),
     Bi(f"length-dependent, {'yes' if LEN_DEP else 'no'}: exact below position {BS} in decode "
        f"mode: {exact_below}, from position {first_bad} on mean KL {kl_b_after:.2f} nats; "
        f"subtle, {'no' if kl_b_after > 1 else 'yes'}: once it starts its mean KL is "
        f"{'above' if kl_b_after > 1 else 'at most'} 1 nat (row (a)'s threshold), "
        f"{kl_b_after / kl_b_mean_a:.2f}x that of (a) "
        f"(top-1 {100 * metrics.top1_agreement(dec_ref[BS:], dec_b[BS:]):.0f}%), from one "
        f"overwritten token (position 0's). In a prefill it hits "
        f"{'every position' if (kl_bp > 0).all() else f'{int((kl_bp > 0).sum())} of {N_X} positions'}"
        f"{', the early ones hardest' if EARLY else ', the later ones hardest'}"
        f" (mean KL {kl_bp[:BS].mean():.2f} below {BS}, {kl_bp[BS:].mean():.2f} after)",
        f"依赖长度，{'是' if LEN_DEP else '否'}：decode 模式下位置 {BS} 以下精确："
        f"{exact_below}，从位置 {first_bad} 起平均 KL {kl_b_after:.2f} nats；"
        f"隐蔽，{'否' if kl_b_after > 1 else '是'}：一旦开始，其平均 KL "
        f"{'高于' if kl_b_after > 1 else '至多为'} 1 nat（(a) 行的阈值），"
        f"是 (a) 的 {kl_b_after / kl_b_mean_a:.2f}x"
        f"（Top-1 {100 * metrics.top1_agreement(dec_ref[BS:], dec_b[BS:]):.0f}%），只来自一个"
        f"被覆盖的 token（位置 0 的）。在一次 prefill 中它影响"
        f"{'每一个位置' if (kl_bp > 0).all() else f'{int((kl_bp > 0).sum())} 个位置（共 {N_X} 个）'}"
        f"{'，靠前的位置最严重' if EARLY else '，靠后的位置最严重'}"
        f"（平均 KL：{BS} 以下 {kl_bp[:BS].mean():.2f}，之后 {kl_bp[BS:].mean():.2f}）")),
    (Bi("(c) a writer/reader block-size mismatch is catastrophic",
        "(c) 写入方与读取方的块大小不一致是灾难性的"),
     Bi(f"{'not on a fresh pool: bit-identical logits there' if c_fresh_same else 'already on a fresh pool: logits differ there'}"
        f" (table {tables_fresh[0]}); on the fragmented pool: {agreement_text(C_AGREE, 'en')}",
        f"{'在全新的池上不是灾难性的：那里的 logits 逐比特相同' if c_fresh_same else '在全新的池上就已出错：那里的 logits 不同'}"
        f"（块表 {tables_fresh[0]}）；在碎片化的池上：{agreement_text(C_AGREE, 'zh')}")),
    (Bi("the correct mapping is bitwise equal to the reference on a fragmented pool",
        "正确的映射在碎片化的池上与参考实现逐比特相等"),
     Bi(f"{'yes' if all(fix_same) else 'no'}: prefill {fix_same[0]}, decode {fix_same[1]}, "
        f"greedy {fix_same[2]}",
        f"{'是' if all(fix_same) else '否'}：prefill {fix_same[0]}，decode {fix_same[1]}，"
        f"贪心 {fix_same[2]}")),
], header=(Bi("claim", "论断"), Bi("what we measured here", "本次实测")))

# %% [markdown]
# ## Common misconceptions
#
# - *"Paged attention changes the numbers a little, like a lower precision."* A correct
#   mapping changes nothing: the logits above are bit-identical on a scattered pool. A
#   wrong one is not a small error either: it reads another token's K/V.
# - *"If one request is right, the mapping is right."* On a fresh engine the first
#   request's table is `[0, 1, 2, ...]`, where several wrong formulas give the right slot
#   (section 1). Test on a fragmented pool, with several requests in flight.
# - *"A bug that depends on the batch is nondeterminism."* vllm #5543 looked like
#   run-to-run noise, but it is deterministic given the batch: rows without a hit are wrong
#   exactly when a hit shares their step. Reproduce with the batch, not with a seed.
# - *"Short prompts passed, so long ones will."* An off-by-one at block boundaries is
#   invisible below one block (16 tokens here) in decode mode and shows up at the first
#   boundary; tests must cross block boundaries, and test decode as well as prefill.
# - *"Writer and reader bugs look the same."* A wrong mapping shared by both is harmless
#   unless it collides or leaves the sequence's blocks; a reader-only bug (vllm #5543)
#   reads someone else's K/V however the writer behaved.
#
# ## Lab
#
# `labs/source/ch07/` starts from an engine with the off-by-one slot mapping of section 4
# planted. You write `blocks_for` (how many blocks a sequence needs), `slot_mapping` (the
# step itself, for one table or a batch of them) and `read_slots` (the slots a reader
# gathers for one sequence). The grader compares them bit for bit with the engine's
# reference on fresh random non-contiguous tables, then plugs your `slot_mapping` into
# the engine on a fragmented pool with fresh prompts: the logits must equal the correct
# engine's (`torch.equal`) and the greedy tokens too, next to the broken engine failing
# the same check. Last, you choose the most precise `kv_cache_dtype` whose pool, in a
# fixed byte budget, holds a batch at once; the grader reads each option's pool size
# from the engine and measures the KL of those that fit.
#
# ## On real vLLM
#
# - `--block-size` (default 16) sets the page; the attention backend limits it
#   (FlashAttention: multiples of 16; FlashInfer: 16, 32 or 64). Test at more than one
#   size, with prompts that cross block boundaries.
# - Fragment the pool on purpose: a small `--num-gpu-blocks-override` (documented as
#   "Used for testing preemption") and many short requests before the ones under test.
# - The vllm #5543 check: the same requests with `--enable-prefix-caching` and
#   `--no-enable-prefix-caching`, compared on log-probs (a wrong block table is a large
#   KL, not a near-tie flip); `vllm:prefix_cache_hits` shows whether hits happened, and
#   `--attention-backend` runs another kernel's reader.
# - Checked against vLLM's docs of 2025-2026 (engine arguments, attention backends,
#   metrics). Here the mapping is a swappable step ("slot_mapping",
#   "slot_mapping.read") and the TORCH backend gathers K/V into dense tensors; vLLM's
#   kernels, like this engine's TRITON backend, walk the block table.

# %%
print(f"chapter 7 ran in {time.perf_counter() - T0:.0f} s")
