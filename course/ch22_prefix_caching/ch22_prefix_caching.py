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
# # Chapter 22. Prefix caching: hit versus miss numerics; what the cache key must include
#
# **Learning goals.** After this chapter you can
#
# 1. explain how a paged engine finds a cached prefix: a **chained** hash per full block,
#    `hash(parent hash, the block's tokens, extra keys)`, looked up block by block from
#    the first, stopping at the first miss and always leaving the last token to compute;
# 2. measure whether a prefix-cache hit changes the numbers, in float32 and bfloat16, by
#    scoring the same rows with and without the hit (`LLM.score(...,
#    use_prefix_cache=True)`), and whether a step that mixes a hit with a miss (the
#    batches of vllm #5543) gives each request the numbers it gets alone;
# 3. say what the key must include (the whole prefix, through the chain; per-request
#    inputs such as `cache_salt`; and, by resetting the cache, every engine-wide setting
#    that changes K/V) and measure what a key that leaves something out does;
# 4. tell the two kinds of prefix-cache bug apart: a wrong key (wrong K/V reused, the
#    numbers change) and a missing isolation (right K/V, shared across tenants: a privacy
#    problem, not a precision one).
#
# **The incidents.**
#
# - **vllm #5543** "prefix-caching: inconsistent completions" (2024-06-14;
#   also InternLM/lmdeploy #1719): a server with `--enable-prefix-caching` disagreed
#   with one without it. The cause (vllm PR #7018) was a block table, not the cache key:
#   chapter 7 reproduces it (`faults.zeroed_block_tables`).
# - **GeeeekExplorer/nano-vllm PR #209** "prevent in-flight prefix cache hits within same
#   prefill batch" (2026-04-21; the same hazard in vllm PR #7822,
#   2024-08-23): a block was registered in the cache when it was *allocated*, so a second
#   request in the same prefill batch counted it as a hit before the first request had
#   written its K/V.
# - **What the key must include**: vLLM's design note on automatic prefix caching
#   (<https://docs.vllm.ai/en/latest/design/prefix_caching/>) hashes the parent block's
#   hash, the block's tokens and *extra keys* (LoRA id, multimodal input hashes, and the
#   per-request `cache_salt`, which isolates tenants from each other's cache).
#
# Everything below is measured when the notebook runs, on the embedded
# SmolLM2-135M-Instruct with minivllm on this machine's CPU. The wrong key is a planted
# fault through the step registry (`faults.unchained_block_hash`, the `"block_hash"`
# step); next to it, the unmodified engine.

# %%
# %matplotlib inline
import time

import numpy as np
import torch
from matplotlib.figure import Figure

from minivllm import LLM, SamplingParams
from minivllm.core.kv_cache_manager import hash_block_tokens
from minivllm.i18n import Bi, claims_table, say
from minivllm.layers.linear import linear_ref
from minivllm.precision import evalsets, faults, metrics

torch.manual_seed(0)
T0 = time.perf_counter()
MODEL = "smollm2-135m-instruct"
BS = 16  # tokens per block (vLLM's default)

llm = LLM(MODEL, dtype="float32", max_model_len=256, block_size=BS)
tok = llm.get_tokenizer()
text = evalsets.load_corpus()


def cat(*parts) -> Bi:
    """One Bi from Bi pieces and plain strings (text the same in both languages)."""
    return Bi("".join(x if isinstance(x, str) else x.en for x in parts),
              "".join(x if isinstance(x, str) else x.zh for x in parts))


def piece(start: int, n: int) -> list[int]:
    """n token ids of the bundled corpus from character `start` on."""
    ids = tok.encode(text[start:start + 12 * n])[:n]
    assert len(ids) == n
    return ids


def hits_of(fn, engine=None):
    """Run fn(); return (its result, prefix-cache hit tokens it added to `engine`'s
    vllm:prefix_cache_hits; default: the float32 engine)."""
    engine = engine or llm
    before = engine.stats.prefix_cache_hits
    out = fn()
    return out, engine.stats.prefix_cache_hits - before


# %% [markdown]
# ## 1. The key: a chained hash per full block
#
# A request's tokens are cut into blocks of 16. Only **full** blocks are cached. Block
# `i`'s key is `sha256(key of block i-1, its 16 token ids, extra keys)`: equal keys mean
# equal *prefixes*, not just equal blocks. Below, one 16-token block `X` placed first, and
# the same `X` after another block: its tokens are the same, its K/V are not (other
# positions, other context), and the chained key tells them apart.

# %%
X, Y = piece(0, BS), piece(2000, BS)
k_x_first = hash_block_tokens(None, X)
k_x_after_y = hash_block_tokens(hash_block_tokens(None, Y), X)
k_x_own = hash_block_tokens(None, X)  # what a key on the block's own tokens would give
print(f"block X first:          key {k_x_first.hex()[:16]}")
print(f"block X after block Y:  key {k_x_after_y.hex()[:16]} (chained)")
say(f"block X on its own tokens only (no parent): {k_x_own.hex()[:16]} "
    f"= X-first's key: {k_x_own == k_x_first}",
    f"块 X 只用自己的 token（没有父块）：{k_x_own.hex()[:16]} "
    f"= X 在最前面时的键：{k_x_own == k_x_first}")

# %% [markdown]
# ## 2. Hit versus miss: does reusing cached K/V change the numbers?
#
# A shared 48-token "system prompt" (3 blocks) and three different 16-token questions.
# The cache is warmed by a request that is the system prompt plus one token (the K/V of
# the prefix then come from a 49-token prefill). Each question's rows 48-63 are scored
# twice: **miss**, all 64 positions computed in one prefill (`is_causal` attention), and
# **hit**, positions 0-47 read from the cache and only 48-63 computed, attending to the
# cached K/V through an explicit mask. The same comparison in bfloat16, on a second
# engine. Then greedy generation, hit vs miss.

# %%
system = piece(4000, 48)
questions = [piece(s, 16) for s in (6000, 7000, 8000)]
seqs = [system + q for q in questions]
rows = [list(range(48, 64))] * len(seqs)
one = SamplingParams(temperature=0, max_tokens=1)


def hit_vs_miss(engine: LLM, max_tokens: int):
    """(miss rows, hit rows, hit tokens, miss greedy, hit greedy) on `engine`."""
    engine.reset_prefix_cache()
    miss = engine.score(seqs, positions=rows)  # no lookup: every position computed
    greedy = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    engine.reset_prefix_cache()
    g_miss = [o.outputs[0].token_ids for o in engine.generate(seqs, greedy)]
    engine.reset_prefix_cache()
    engine.generate([system + [13]], one)  # warm: the system prompt plus one token
    h0 = engine.stats.prefix_cache_hits
    hit = engine.score(seqs, positions=rows, use_prefix_cache=True)
    n_hit = engine.stats.prefix_cache_hits - h0
    g_hit = [o.outputs[0].token_ids for o in engine.generate(seqs, greedy)]
    return miss, hit, n_hit, g_miss, g_hit


t = time.perf_counter()
res = {"float32": hit_vs_miss(llm, 12)}
t32 = time.perf_counter() - t
t = time.perf_counter()
llm_bf16 = LLM(MODEL, dtype="bfloat16", max_model_len=256, block_size=BS)
res["bfloat16"] = hit_vs_miss(llm_bf16, 4)  # bfloat16 is ~3x slower on a CPU: 4 tokens
tbf = time.perf_counter() - t  # llm_bf16 is kept for the mixed step below
print("| dtype | hit tokens (3 questions) | rows bit-identical | max abs logprob diff | "
      "mean KL (nats) | top-1 agreement | greedy tokens equal |")
print("|---|---|---|---|---|---|---|")
hvm = {}
for dt, (miss, hit, n_hit, g_miss, g_hit) in res.items():
    same = all(torch.equal(a, b) for a, b in zip(miss, hit))
    diff = max((a - b).abs().max().item() for a, b in zip(miss, hit))
    kl = float(np.mean([metrics.mean_kl(a, b) for a, b in zip(miss, hit)]))
    top1 = float(np.mean([metrics.top1_agreement(a, b) for a, b in zip(miss, hit)]))
    hvm[dt] = (same, diff, kl, top1, g_miss == g_hit, n_hit)
    print(f"| {dt} | {n_hit} | {same} | {diff:.3g} | {kl:.3g} | {100 * top1:.0f}% | "
          f"{g_miss == g_hit} ({len(g_miss)} x {len(g_miss[0])}) |")
print(f"(float32 {t32:.1f} s, bfloat16 with its engine {tbf:.1f} s)")

# %% [markdown]
# Read the table by its "bit-identical" column. Where it says True, a hit changes nothing
# at all: KL is exactly 0 and greedy generation is the same, stronger than the course
# plan expected ("fp32 at noise level, bf16 may flip"). On an AVX-512/AMX Xeon we saw
# True in both dtypes; with the kernels capped at AVX2 the same rows differed at rounding
# level (float32 KL ~2e-12, bfloat16 ~1e-4) with greedy tokens still equal. Whether the
# bits survive depends on reasons worth knowing, because each one can fail elsewhere:
#
# - the cached K/V of the prefix came from a 49-token prefill and the miss computes them
#   in a 64-token prefill; the linear layers' per-row results need not depend on the
#   number of rows, but a CPU GEMM can (the note in `worker/score.py:score_logits` records
#   float32 rows that differ at 1-3, 5-7 and 9-11 rows on the machine it was written on);
# - the explicit-mask attention of the hit and the `is_causal` attention of the miss
#   must give the same bits for each query row (the table shows whether they did; nothing
#   guarantees it in general);
# - on a GPU the two paths are usually **different kernels** (a prefill kernel versus a
#   prefill-with-context kernel, with other tilings and split-K reductions), so bitwise
#   equality is not expected there; this notebook did not measure a GPU.
#
# So "prefix caching won't change model outputs" (vLLM's design note) holds exactly where
# the column says True, and to rounding level elsewhere; what *can* change outputs by
# more is reusing the wrong K/V, which is the key's job.
#
# On GPUs the public record shows both effects. In vLLM's first engine a request with
# cached blocks ran its attention through a separate kernel, `context_attention_fwd`
# (the "contexted-prefill" kernel named in vllm PR #3010, 2024-02). vLLM v1's FlashAttention
# backend runs hits and misses through one kernel that reads every K/V through the block
# table, but the linear layers still see other row counts (a miss computes all N tokens,
# a hit only the tokens after the cached blocks): vllm PR #34046 (2026-02, closed
# without merging) traced bfloat16 hit/miss differences to GEMM tiles chosen by that
# count (chapter 5 measures this engine's GEMMs), and vllm #40896 (v0.19, H100) reports
# a first request and its cached repeats giving different greedy text at temperature 0.
#
# **Hit and miss in the same step.** vllm #5543's server batched requests with and
# without prefix hits together, and the bug fixed by vllm PR #7018 (2024-08-01) lived
# exactly there: "some requests have cache hit but some don't", and the block tables of
# the rows without a hit were built as zeros (chapter 7 plants that fault and measures
# it). Here, with correct block tables: the cache holds the system prompt; one step
# scores question 1 (48 tokens from the cache, 16 computed) beside a fresh 64-token text
# (no hit, 64 computed), and each request's rows 48-63 are compared with the same
# request scored **alone**, in both dtypes.

# %%
t = time.perf_counter()
fresh = piece(5000, 64)  # text no earlier request contains: no block of it is cached


def mixed_step(engine: LLM):
    """(rows of [hit request, miss request] scored in one step, hit tokens, steps taken,
    the hit request's rows alone, the miss request's rows alone) on `engine`."""
    engine.reset_prefix_cache()
    engine.generate([system + [13]], one)  # warm: the system prompt
    h0, s0 = engine.stats.prefix_cache_hits, engine.stats.num_steps
    both = engine.score([seqs[0], fresh], positions=[rows[0], rows[0]], use_prefix_cache=True)
    n_hit, n_steps = engine.stats.prefix_cache_hits - h0, engine.stats.num_steps - s0
    engine.reset_prefix_cache()
    engine.generate([system + [13]], one)
    hit_alone = engine.score(seqs[0], positions=rows[0], use_prefix_cache=True)
    engine.reset_prefix_cache()
    miss_alone = engine.score(fresh, positions=rows[0])  # nothing cached: all 64 computed
    return both, n_hit, n_steps, hit_alone, miss_alone


mixed = {"float32": mixed_step(llm), "bfloat16": mixed_step(llm_bf16)}
del llm_bf16
print("| dtype | hit tokens in the mixed step | engine steps | request | rows bit-identical "
      "to alone | max abs logprob diff | mean KL (nats) | top-1 agreement |")
print("|---|---|---|---|---|---|---|---|")
mix = {}
for dt, (both, n_hit, n_steps, hit_alone, miss_alone) in mixed.items():
    for name, a, b in (("hit (question 1)", both[0], hit_alone),
                       ("miss (fresh text)", both[1], miss_alone)):
        same = torch.equal(a, b)
        mix[dt, name.split()[0]] = (same, metrics.mean_kl(b, a), n_hit, n_steps)
        print(f"| {dt} | {n_hit} | {n_steps} | {name} | {same} | "
              f"{(a - b).abs().max().item():.3g} | {metrics.mean_kl(b, a):.3g} | "
              f"{100 * metrics.top1_agreement(b, a):.0f}% |")
mix_same = all(v[0] for v in mix.values())
say(f"every request equal to itself alone, bit for bit: {mix_same}",
    f"每个请求都与它单独运行时逐位相同：{mix_same}")
# the same row counts on one linear layer alone: rows 0-15 (the hit's 16) and rows 16-79
# (the miss's 64) computed on their own and inside one 80-row GEMM, as in the mixed step
w_probe = llm.llm_engine.model_runner.model.get_submodule("layers.0.mlp.down_proj").weight
x_probe = torch.randn(80, w_probe.shape[1], generator=torch.Generator().manual_seed(0))
gemm_rows = {}
with torch.inference_mode():  # as the model runner calls its layers (float32: packed weights)
    for dt, tdt in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        w_, x_ = w_probe.detach().to(tdt), x_probe.to(tdt)
        full = linear_ref(x_, w_, None)
        gemm_rows[dt] = (torch.equal(linear_ref(x_[:16], w_, None), full[:16]),
                         torch.equal(linear_ref(x_[16:], w_, None), full[16:]))
say(cat(Bi("one linear layer (layer 0's down_proj, random rows), bit-identical to the same rows "
           "of an 80-row GEMM: ",
           "单个线性层（第 0 层的 down_proj，随机行），与 80 行 GEMM 中相同的行逐位相同："),
        Bi("; ".join(f"{dt}: 16 rows {a}, 64 rows {b}" for dt, (a, b) in gemm_rows.items()),
           "；".join(f"{dt}：16 行 {a}，64 行 {b}" for dt, (a, b) in gemm_rows.items())),
        f"  ({time.perf_counter() - t:.1f} s)"))

# %% [markdown]
# The engine-steps column says whether the two requests really shared one step (1), and
# the hit column that the hit happened (48 tokens). What can still move a row is the
# batch itself: the step's linear layers see 16 + 64 = 80 rows where the requests alone
# give 16 and 64, and a CPU GEMM may round a row differently at another row count
# (chapter 5). The last line puts exactly those row counts through one linear layer,
# without any cache: where it says False for a dtype, the GEMM alone already moves those
# rows, a batch-size effect, not a prefix-caching one. Wrong K/V would also move the
# float32 rows, which are computed with the same block tables; and a wrong block table
# is not at rounding level: chapter 7 measures KL of whole nats for the row without a
# hit.
#
# ## 3. In-flight hits: blocks are findable only after they are written
#
# nano-vllm PR #209 registered a block when it was allocated. minivllm registers a block
# in `Scheduler.update_after_step`, after the model wrote its K/V, so two identical
# prompts submitted together cannot hit each other: the second one computes its prompt
# too. A third copy, one step later, hits.
#
# Registering at allocation is not wrong in itself. vLLM v1 does it on purpose: a block
# that is full when allocated goes into the cache at once, "so that the block can be
# reused by other requests in the same batch" (the design note). That is safe there
# because in one forward pass every attention layer first writes the step's K/V into the
# cache (`reshape_and_cache_flash` in `v1/attention/backends/flash_attn.py`) and only
# then runs attention through the block tables, so at each layer the second request
# reads K/V the first request's tokens wrote moments before. nano-vllm's bug was the
# bookkeeping around it (PR #209: over-counted `num_cached_tokens`, wrong scheduled
# token counts, an `IndexError`). vLLM's first engine, whose attention did not read a
# request's own prompt back from the cache that way, kept such blocks "uncomputed"
# within their batch: otherwise "the rest sequences in the same batch will skip the
# computation of this block and result in incorrect output" (vllm PR #7822). This engine
# takes the simpler rule, and pays for it by computing the shared prompt twice in that
# step.

# %%
dup = system + questions[0]
llm.reset_prefix_cache()
outs_together, hit_together = hits_of(lambda: llm.generate([dup, dup], one))
outs_later, hit_later = hits_of(lambda: llm.generate([dup], one))
print(f"two identical {len(dup)}-token prompts in one step: cached tokens "
      f"{[o.num_cached_tokens for o in outs_together]} (hits {hit_together})")
print(f"the same prompt one step later: cached tokens {outs_later[0].num_cached_tokens} "
      f"(= {(len(dup) - 1) // BS} full blocks before the last token)")

# %% [markdown]
# ## 4. What the key must include: the whole prefix (the unchained-hash fault)
#
# Retrieval-augmented prompts are the natural case: a fixed head, then retrieved
# passages, then the question. Two requests retrieve the **same three passages in a
# different order**, each passage a 16-token snippet (one block), so the passages sit on
# block boundaries. With the chained key, request B can reuse only the head (its first block
# after the head already differs). With `faults.unchained_block_hash` (each block hashed
# on its own tokens only), every block of B's passages is "found", computed by A at other
# positions after other text, and B's question is answered from that K/V.

# %%
head = piece(9000, 16)
passages = [piece(s, 16) for s in (10000, 10600, 11200)]
question = tok.encode(" Question: which of the passages above is about learning? Answer:")
A = head + passages[0] + passages[1] + passages[2] + question
B = head + passages[2] + passages[0] + passages[1] + question
q_rows = list(range(len(B) - len(question), len(B)))
greedy12 = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
greedy4 = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)

llm.reset_prefix_cache()
ref_rows = llm.score(B, positions=q_rows)  # no lookup: the truth
ref_gen = llm.generate([B], greedy12)[0]
llm.reset_prefix_cache()
llm.score(A)  # request A: its blocks go into the cache
ok_rows, hit_ok = hits_of(lambda: llm.score(B, positions=q_rows, use_prefix_cache=True))
ok_gen = llm.generate([B], greedy12)[0]
with faults.unchained_block_hash(llm):  # resets the cache on entry and exit
    llm.score(A)
    bad_rows, hit_bad = hits_of(lambda: llm.score(B, positions=q_rows, use_prefix_cache=True))
    llm.reset_prefix_cache()
    llm.score(A)
    bad_gen = llm.generate([B], greedy12)[0]
kl_ok = metrics.kl_divergence(ref_rows, ok_rows).numpy()
kl_bad = metrics.kl_divergence(ref_rows, bad_rows).numpy()
print(f"B has {len(B)} tokens; {len(B) - len(question)} before the question")
say(f"chained key:   {hit_ok} hit tokens, question rows mean KL {kl_ok.mean():.3g} nats, "
    f"greedy equal to no-cache: {ok_gen.outputs[0].token_ids == ref_gen.outputs[0].token_ids}",
    f"链式键：     命中 {hit_ok} 个 token，问题行的平均 KL {kl_ok.mean():.3g} nats，"
    f"贪心输出与不用缓存时相同：{ok_gen.outputs[0].token_ids == ref_gen.outputs[0].token_ids}")
say(f"unchained key: {hit_bad} hit tokens, question rows mean KL {kl_bad.mean():.3g} nats "
    f"(max {kl_bad.max():.3g}), top-1 agreement "
    f"{100 * metrics.top1_agreement(ref_rows, bad_rows):.0f}%, greedy agreement "
    f"{100 * metrics.greedy_agreement(ref_gen.outputs[0].token_ids, bad_gen.outputs[0].token_ids):.0f}%",
    f"非链式键：   命中 {hit_bad} 个 token，问题行的平均 KL {kl_bad.mean():.3g} nats"
    f"（最大 {kl_bad.max():.3g}），Top-1 一致率 "
    f"{100 * metrics.top1_agreement(ref_rows, bad_rows):.0f}%，贪心一致率 "
    f"{100 * metrics.greedy_agreement(ref_gen.outputs[0].token_ids, bad_gen.outputs[0].token_ids):.0f}%")
print(f"  no cache:      {ref_gen.outputs[0].text!r}\n  unchained key: {bad_gen.outputs[0].text!r}")

# %% [markdown]
# The wrong key does not crash, does not log anything, and *looks* like a better cache
# (more hit tokens). The K/V it reuses are real K/V of the same tokens, only computed at
# other positions (B's first passage, positions 16-31, gets the K/V that A computed for
# it at positions 48-63: rotated by RoPE for other positions) and after
# other text, so the answer drifts instead of turning into noise. The lookup still stops
# at the first miss: a block that has never been cached anywhere breaks the run of hits,
# which is why the harm needs repeated content (reordered passages, a paragraph that
# appears twice, boilerplate at different offsets).
#
# ## 5. What the key must include: per-request inputs (`cache_salt`)
#
# `cache_salt` is vLLM's per-request field (`{"prompt": ..., "cache_salt": "..."}` offline,
# `"cache_salt"` in the OpenAI request body). It is an extra key of the **first** block
# only; the chain carries it to every later block. Two tenants send the same system
# prompt; then tenant A again; then the engine's `"block_hash.extra_keys"` step is
# swapped for one that forgets the salt, and tenant B comes back.

# %%
doc = system + questions[1]
llm.reset_prefix_cache()
runs = []
for who, salt in (("tenant A", "a-3f9c"), ("tenant B", "b-81d2"), ("tenant A again", "a-3f9c"),
                  ("no salt", None)):
    prompt = {"prompt_token_ids": doc} if salt is None else {"prompt_token_ids": doc,
                                                             "cache_salt": salt}
    out, n = hits_of(lambda: llm.generate([prompt], greedy4)[0])
    runs.append((who, n, out.outputs[0].token_ids))
with llm.swap_step("block_hash.extra_keys", lambda cache_salt, block_index: ()):
    llm.reset_prefix_cache()
    llm.generate([{"prompt_token_ids": doc, "cache_salt": "a-3f9c"}], one)
    out, n = hits_of(lambda: llm.generate([{"prompt_token_ids": doc, "cache_salt": "b-81d2"}],
                                          greedy4)[0])
    runs.append(("tenant B, salt dropped from the key", n, out.outputs[0].token_ids))
print("| request | prefix-cache hit tokens | tokens it computed | greedy equal to tenant A's |")
print("|---|---|---|---|")
for who, n, ids in runs:
    print(f"| {who} | {n} | {len(doc) - n} | {ids == runs[0][2]} |")

# %% [markdown]
# Different salts share nothing; the same salt hits as before. With the salt dropped,
# tenant B reuses tenant A's blocks and gets *exactly* the same tokens: the K/V are the
# right ones. The harm is not numerical. A hit is observable (the request computed fewer
# tokens, so its first token comes sooner), and that timing tells B that someone
# already sent this prefix: a side channel that leaks other users' prompts. That is why
# vLLM's salt is a per-request secret, "random, protected from access by 3rd parties",
# and why the numbers alone would never catch this bug.
#
# ## 6. What the key must include: nothing engine-wide, so the cache must be emptied
#
# Engine-wide settings (dtype, `kv_cache_dtype`, K/V scales, a swapped K/V step) are not
# in the key at all: they are the same for every request of one engine, so the engine
# **empties the cache** whenever one of them changes (`calibrate_kv_scales` and
# `swap_step` for steps that change K/V both call `reset_prefix_cache`). What forgetting
# that does: an engine with an fp8 (e4m3) KV cache and static scales (1.0 until
# calibrated) scores a prompt, so its blocks are stored with scale 1.0; then the scales
# are calibrated on other text and the prompt's last 16 rows are scored through the
# cache, first with `faults.skip_prefix_reset_on_rescale` (the reset skipped: the old
# blocks are read back with the new scales), then with the engine as written.

# %%
t = time.perf_counter()
fp8 = LLM(MODEL, dtype="float32", max_model_len=128, block_size=BS, kv_cache_dtype="fp8_e4m3")
calib = [piece(500, 128)]
stale_ids, stale_rows = system + questions[2], list(range(48, 64))
fp8.score(stale_ids)  # not calibrated yet: its blocks are stored with scale 1.0
with faults.skip_prefix_reset_on_rescale(fp8):
    fp8.llm_engine.calibrate_kv_scales(calib)
stale_rows_out, stale_hits = hits_of(
    lambda: fp8.score(stale_ids, positions=stale_rows, use_prefix_cache=True), fp8)  # noqa: F821 (del below)
fp8.reset_prefix_cache()
fp8_truth = fp8.score(stale_ids, positions=stale_rows)  # calibrated scales, nothing reused
fp8.llm_engine.calibrate_kv_scales(calib)  # the engine as written: this empties the cache
_, good_hits = hits_of(
    lambda: fp8.score(stale_ids, positions=stale_rows, use_prefix_cache=True), fp8)  # noqa: F821 (del below)
kl_stale = metrics.mean_kl(fp8_truth, stale_rows_out)
scales = fp8.kv_cache_scales()
del fp8
print(f"calibrated scales, layer 0: k {scales['k_scale'][0]:.3g}, v {scales['v_scale'][0]:.3g} "
      f"(were 1.0)")
say(f"with the reset:    {good_hits} hit tokens after a recalibration (the cache was "
    f"emptied)",
    f"有重置：         重新校准后命中 {good_hits} 个 token（缓存已被清空）")
say(f"reset skipped:     {stale_hits} hit tokens, mean KL {kl_stale:.3g} nats against a "
    f"fresh computation ({time.perf_counter() - t:.1f} s)",
    f"跳过重置：       命中 {stale_hits} 个 token，相对重新计算的平均 KL 为 {kl_stale:.3g} nats"
    f"（{time.perf_counter() - t:.1f} s）")

# %%
fig = Figure(figsize=(9, 3.6), layout="constrained")
ax, ax2 = fig.subplots(1, 2, width_ratios=[2, 1])
pos = np.array(q_rows)
ax.plot(pos, np.maximum(kl_bad, 1e-12), "o-", ms=3, label="unchained key (false hits)")
ax.plot(pos, np.maximum(kl_ok, 1e-12), "s-", ms=3, label="chained key (true hits)")
for dt, (_, _, kl, _, _, _) in hvm.items():
    ax.axhline(max(kl, 1e-12), ls=":", lw=1, color="gray")
ax.text(pos[0], 2e-12, "hit vs miss, float32 and bfloat16 (dotted; at the floor if exactly 0): "
        + ", ".join(f"{kl:.1g}" for (_, _, kl, _, _, _) in hvm.values()), fontsize=8, color="gray")
ax.axhline(kl_stale, ls="--", lw=1, color="C3",
           label="reset skipped after recalibrating fp8 K/V scales (mean, another prompt)")
ax.set_yscale("log")
ax.set_ylim(5e-13, 30)
ax.set_xlabel("position in request B (the question)")
ax.set_ylabel("KL(no cache || cached) (nats; 1e-12 = exactly 0)")
ax.set_title("What a wrong key reuses")
ax.legend(fontsize=8)
labels = ["chained", "unchained", "salt B after A", "salt dropped"]
values = [hit_ok, hit_bad, runs[1][1], runs[-1][1]]
ax2.bar(labels, values, color=["C1", "C0", "C2", "C3"])
for i, v in enumerate(values):
    ax2.text(i, v + 1, str(v), ha="center", fontsize=8)
ax2.set_ylabel("prefix-cache hit tokens")
ax2.set_title("Hits: more is not better")
ax2.tick_params(axis="x", labelsize=8, rotation=20)
fig

# %% [markdown]
# ## 7. The fix, measured
#
# The fix is the engine's reference: the chained hash with the salt as the first block's
# extra key, and a lookup that stops at the first miss, leaves one token to compute and
# only sees blocks that have been written. Measured above with it (section 4, "chained
# key"): B's question rows against the no-cache run, and B's greedy answer; section 5:
# different salts share nothing. The lab asks you to write those functions and checks them the same way.
#
# ## 8. Claim vs measurement

# %%
h32, hbf = hvm["float32"], hvm["bfloat16"]
mix_kl = max(v[1] for v in mix.values())
_inflight = (all(o.num_cached_tokens == 0 for o in outs_together)
             and outs_later[0].num_cached_tokens > 0)
_greedy_bad = 100 * metrics.greedy_agreement(ref_gen.outputs[0].token_ids, bad_gen.outputs[0].token_ids)
YES, NO = Bi("yes", "是"), Bi("no", "否")
claims = [
    (Bi("prefix caching \"won't change model outputs\" (vLLM design note)",
        "前缀缓存 \"won't change model outputs\"（不会改变模型输出；vLLM 设计说明）"),
     cat(Bi("with the right ", "使用正确的"),
         Bi("key, yes, exactly", "键：是，精确成立") if h32[0] and hbf[0]
         else Bi("key, to rounding level", "键：在舍入水平上成立"),
         Bi(f": hit vs miss rows bit-identical in float32 ({h32[0]}) and bfloat16 ({hbf[0]}), "
            f"greedy equal ({h32[4]}, {hbf[4]})",
            f"：命中与未命中的行逐位相同，float32（{h32[0]}）和 bfloat16（{hbf[0]}），"
            f"贪心输出相同（{h32[4]}，{hbf[4]}）"))),
    (Bi("fp32: KL at noise level, greedy identical (course plan estimate)",
        "fp32：KL 在噪声水平，贪心输出相同（课程计划的估计）"),
     cat(f"KL {h32[2]:.3g} ",
         Bi("(exactly 0)", "（恰好为 0）") if h32[2] == 0 else Bi("(rounding level)", "（舍入水平）"),
         Bi(f", greedy {'identical' if h32[4] else 'NOT identical'}",
            f"，贪心输出{'相同' if h32[4] else '不相同'}"))),
    (Bi("bf16: may flip (course plan estimate)", "bf16：可能翻转（课程计划的估计）"),
     cat(Bi("not on this CPU", "在这个 CPU 上没有") if hbf[4] and hbf[3] == 1
         else Bi("it did here", "在这里翻转了"),
         Bi(f": KL {hbf[2]:.3g}, top-1 {100 * hbf[3]:.0f}%, greedy "
            f"{'identical' if hbf[4] else 'NOT identical'}; a GPU's prefill-with-context kernel is a "
            f"different kernel (not measured here)",
            f"：KL {hbf[2]:.3g}，top-1 {100 * hbf[3]:.0f}%，贪心输出"
            f"{'相同' if hbf[4] else '不相同'}；GPU 上带上下文的 prefill 核函数是另一个"
            f"核函数（此处未测量）"))),
    (Bi("a step that mixes prefix-cache hits and misses gives each request its own numbers "
        "(vllm #5543; vllm PR #7018 fixed its block tables)",
        "同时包含前缀缓存命中与未命中的步骤给每个请求它自己的数值"
        "（vllm #5543；vllm PR #7018 修复了其中的块表）"),
     cat(Bi("yes, bit for bit", "是，逐位相同") if mix_same else
         Bi(f"not bit for bit: largest KL {mix_kl:.3g} nats "
            f"(a zeroed block table costs whole nats, chapter 7)",
            f"并非逐位相同：最大 KL {mix_kl:.3g} nats"
            f"（全零的块表会造成若干个 nats 的损失，第 7 章）"),
         Bi(f": {mix['float32', 'hit'][2]} hit tokens in {mix['float32', 'hit'][3]} step(s); ",
            f"：在 {mix['float32', 'hit'][3]} 个步骤中命中 {mix['float32', 'hit'][2]} 个 token；"),
         ", ".join(f"{dt} {kind} {mix[dt, kind][0]}" for dt in ("float32", "bfloat16")
                   for kind in ("hit", "miss")),
         Bi("; one linear layer alone, 16 rows vs the same rows in an 80-row GEMM: ",
            "；单个线性层，16 行对比 80 行 GEMM 中相同的行："),
         ", ".join(f"{dt} {a}" for dt, (a, _) in gemm_rows.items()))),
    (Bi("minivllm is immune to in-flight hits by construction", "minivllm 从设计上就不受进行中命中的影响"),
     cat(YES if _inflight else NO,
         Bi(": two identical "
            f"prompts in one step cached {[o.num_cached_tokens for o in outs_together]} tokens; "
            f"one step later {outs_later[0].num_cached_tokens}",
            "：同一步中的两个相同提示词"
            f"缓存了 {[o.num_cached_tokens for o in outs_together]} 个 token；"
            f"一步之后为 {outs_later[0].num_cached_tokens}"))),
    (Bi("an unchained hash gives false hits at different prefixes, KL >> noise "
        "(course plan estimate)",
        "非链式哈希会在不同前缀上给出虚假命中，KL >> 噪声（课程计划的估计）"),
     cat(Bi("yes, when content repeats", "是，当内容重复时")
         if hit_bad > hit_ok and kl_bad.mean() > 1e-3 else Bi("not here", "此处没有"),
         Bi(f": {hit_bad} hit tokens instead of "
            f"{hit_ok}, question rows mean KL {kl_bad.mean():.3g} nats (max {kl_bad.max():.3g}), "
            f"greedy agreement {_greedy_bad:.0f}%",
            f"：命中 {hit_bad} 个 token 而不是 "
            f"{hit_ok} 个，问题行的平均 KL {kl_bad.mean():.3g} nats（最大 {kl_bad.max():.3g}），"
            f"贪心一致率 {_greedy_bad:.0f}%"))),
    (Bi("an unchained hash breaks every shared prompt", "非链式哈希会破坏每一个共享的提示词"),
     Bi("no, by construction (not measured "  # fact, not a measurement: the lookup's rule
        "here): the lookup stops at the first miss, so it needs blocks that recur at other "
        "offsets; a prompt that only shares a prefix gets the chained key's hits",
        "否，这由设计决定（此处未"
        "测量）：查找在第一次未命中处停止，因此它需要在其他偏移处重复出现的块；只共享前缀的"
        "提示词得到的命中与链式键相同")),
    (Bi("cache_salt isolates tenants", "cache_salt 能隔离租户"),
     cat(YES if runs[1][1] == 0 and runs[2][1] > 0 else NO,
         Bi(f": another salt {runs[1][1]} hit tokens, the same "
            f"salt {runs[2][1]}; without the salt in the key {runs[-1][1]}, with identical "
            f"outputs (a privacy bug, invisible to precision metrics)",
            f"：另一个盐值命中 {runs[1][1]} 个 token，相同"
            f"盐值 {runs[2][1]} 个；键中没有盐值时 {runs[-1][1]} 个，且输出"
            f"相同（这是隐私 bug，精度指标看不到）"))),
    (Bi("skipping the prefix-cache reset after recalibrating K/V scales reuses stale "
        "blocks (course plan)",
        "重新校准 K/V 缩放因子后跳过前缀缓存重置会复用过期的块（课程计划）"),
     cat(YES if stale_hits > 0 and good_hits == 0 else NO,
         Bi(f": {stale_hits} hit tokens on blocks stored with scale 1.0, "
            f"mean KL {kl_stale:.3g} nats (fp8 e4m3 KV); with the reset {good_hits} hits "
            f"after a recalibration",
            f"：在以缩放因子 1.0 存储的块上命中 {stale_hits} 个 token，"
            f"平均 KL {kl_stale:.3g} nats（fp8 e4m3 KV）；有重置时重新校准后命中 "
            f"{good_hits} 个"))),
]
claims_table(claims, header=(Bi("claim", "论断"), Bi("what we measured here", "本次实测")))

# %% [markdown]
# ## Common misconceptions
#
# - *"A prefix-cache hit is an approximation."* It can be bit-identical (section 2's table
#   says whether it was on your CPU). When hit and miss differ it is because different
#   kernels or shapes ran, at rounding level; a large difference means wrong K/V.
# - *"A batch that mixes cached and uncached requests is numerically special."* With
#   right block tables each request's rows move only as any batch moves them (section
#   2's mixed step prints whether they were bit-identical here); the large differences of
#   vllm #5543 came from zeroed block tables (chapter 7).
# - *"Equal blocks can share K/V."* A block's K/V depend on its position and on every
#   token before it. Only equal *prefixes* can share, which is what the chain encodes.
# - *"More hits means a better cache."* The unchained key had the most hits of all.
#   Check hits against what the prompts share, and check outputs against caching off.
# - *"cache_salt is a numerics setting."* It changes no number; it decides who may reuse
#   whose blocks. A missing salt is caught by hit counts and timing, never by KL.
# - *"A fully cached prompt needs no compute."* The last token is always computed (its
#   logits are the next token's distribution), so at most `(n - 1) // 16` blocks hit.
# - *"prompt_logprobs can come from the cache."* A position served from the cache never
#   runs through the model, so its log-prob does not exist. vLLM skips the cache for
#   requests with prompt_logprobs, and so does minivllm; `LLM.score(...,
#   use_prefix_cache=True)` lets a hit stop at the first row you ask for.
#
# ## Lab
#
# `labs/source/ch22/` starts from an engine whose block hash ignores the parent (the
# fault of section 4). You write the chained `hash_block`, the `extra_keys` of a block
# (the salt on the first block only) and `num_cached_blocks` (the lookup: leading hits
# only, at least one token left). The grader checks them on fresh inputs against the
# engine's references, then plugs them into the engine through the step registry on
# fresh reordered prompts: the cached engine must give the no-cache engine's logits and
# hit counts, next to the broken engine failing the same check.
#
# ## On real vLLM
#
# - Prefix caching is on by default in v1 (`enable_prefix_caching=True` in
#   `CacheConfig`); `--no-enable-prefix-caching` is the other arm of vllm #5543's A/B,
#   compared on log-probs, not only on text.
# - Watch `vllm:prefix_cache_queries` and `vllm:prefix_cache_hits` (counters; `_total`
#   when scraped): more hits than the prompts share is the unchained-key signature of
#   section 4. `LLM.reset_prefix_cache()` empties the cache after anything that changes
#   K/V without changing the key (section 6).
# - `--prefix-caching-hash-algo`: `sha256` (default), `sha256_cbor`, `xxhash`,
#   `xxhash_cbor`; the config warns that the xxhash ones raise the collision risk in
#   multi-tenant setups. Isolate tenants with the per-request `cache_salt`.
# - Checked against `vllm/config/cache.py`, the automatic prefix caching design note and
#   `v1/attention/backends/flash_attn.py` (2025-2026). v1 registers a full block when it
#   is allocated, so requests in the same step hit it (safe: each layer writes the
#   step's K/V before its attention reads them); a common prefix of at least 256 tokens
#   shared by 8 or more requests can also switch FlashAttention to cascade attention,
#   another kernel. This engine registers blocks after the step (section 3).

# %%
print(f"chapter 22 ran in {time.perf_counter() - T0:.0f} s")
