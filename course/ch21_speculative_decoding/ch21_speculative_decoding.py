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
# # Chapter 21. Speculative decoding: rejection sampling, greedy equality, verification numerics
#
# **Learning goals.** After this chapter you can
#
# 1. describe one speculative step in vLLM's terms: a proposer (n-gram prompt lookup, or
#    a draft model) proposes k tokens; the scheduler schedules 1 + k tokens for the
#    request; the target scores the k + 1 positions in **one** forward (a prefill chunk
#    with context); the rejection sampler keeps a prefix of the drafts and adds one
#    target token; the rejected drafts are rolled back (`num_computed_tokens`), never
#    cached;
# 2. state the rejection rule (accept d with probability min(1, p(d)/q(d)), else sample
#    from normalize(max(0, p - q)); a bonus token when all are accepted) and check on a
#    small vocabulary that it reproduces the target distribution whatever q is;
# 3. say what "lossless" means: exact in distribution, and for greedy decoding equal to
#    plain decoding **up to the numerics of scoring k + 1 positions at once**, and
#    measure that difference in float32 and bfloat16;
# 4. catch a verifier that accepts the first draft token unchecked;
# 5. use the acceptance rate (vLLM's `vllm:spec_decode_num_accepted_tokens_total` over
#    `vllm:spec_decode_num_draft_tokens_total`) and the mean acceptance length as a
#    numerics canary: measure how far they move when the target's precision changes
#    under a fixed drafter, and say with a bootstrap over prompts whether a move is
#    larger than the prompt-to-prompt spread.
#
# **The incidents.**
#
# - **vllm #7627** (2024-08-17, <https://github.com/vllm-project/vllm/issues/7627>):
#   opt-6.7b with an opt-125m draft at temperature 0 left the target-only output partway
#   through 128 tokens. vLLM's answer, **PR #7962** (docs, 2024-09-05): speculative
#   decoding is lossless "up to hardware numerics"; verification scores k + 1 tokens in
#   one forward, a different batch shape, so the logits differ in the last bits.
#   **transformers #39421** gives the same explanation for assisted decoding.
# - **ohdearquant/lattice #243** (2026-06-23): a real bug, the n-gram verifier accepted
#   draft[0] without checking it.
#
# Everything below is measured when the notebook runs, on the embedded
# SmolLM2-135M-Instruct (minivllm, this machine's CPU). There is no second, smaller
# SmolLM2 here, so the drafts come from prompt lookup (`method="ngram"`) in sections 2-6;
# section 7 uses the draft-model path (`method="draft_model"`) with the model drafting
# for itself in float32, and the speed of that path is measured by
# `benchmarks/spec_decode.py` (numbers in `benchmarks/RESULTS.md`). The
# verifier bug is **planted** through the step registry (`faults.spec_accept_first_unverified`,
# the `"rejection_sampler"` step).

# %%
# %matplotlib inline
import time

import torch
from matplotlib.figure import Figure

from minivllm import LLM, SamplingParams
from minivllm.i18n import Bi, claims_table, say
from minivllm.precision import faults, metrics
from minivllm.spec_decode import rejection_sampler_ref

T0 = time.perf_counter()
MODEL = "smollm2-135m-instruct"
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3}
plain32 = LLM(MODEL, dtype="float32", max_model_len=256, max_num_seqs=8)
spec32 = LLM(MODEL, dtype="float32", max_model_len=256, max_num_seqs=8, speculative_config=NGRAM)
tok = plain32.get_tokenizer()


def chat(text: str) -> list[int]:
    conv = [{"role": "user", "content": text}]
    return tok.encode(tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=True),
                      add_special_tokens=False)


def cat(*parts) -> Bi:
    """One Bi from Bi pieces and plain strings (text the same in both languages)."""
    return Bi("".join(x if isinstance(x, str) else x.en for x in parts),
              "".join(x if isinstance(x, str) else x.zh for x in parts))


def gen(llm, prompts, sp):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def spec_counts(llm):
    s = llm.llm_engine.stats
    return (s.spec_decode_num_drafts, s.spec_decode_num_draft_tokens,
            s.spec_decode_num_accepted_tokens, s.num_steps)


print("engines built in", round(time.perf_counter() - T0, 1), "s")

# %% [markdown]
# ## 1. The rejection rule keeps the target distribution
#
# Leviathan et al. 2023 (arXiv:2211.17192), Algorithm 1, as vLLM's
# `vllm/v1/sample/rejection_sampler.py` implements it and `minivllm/spec_decode/
# rejection_sampler.py` does here. On a vocabulary of 8 with a random target p and a
# random draft q (k = 2 drafts sampled from q), the first emitted token must follow p,
# not q. The planted fault accepts draft 0 unchecked, so its first token follows q.

# %%
V, K, TRIALS = 8, 2, 4000
torch.manual_seed(0)  # p and q below
p = torch.distributions.Dirichlet(torch.ones(V)).sample((K + 1,))
q = torch.distributions.Dirichlet(torch.ones(V) * 0.5).sample((K,))


def first_token_freq(fn, seed=1):
    g = torch.Generator().manual_seed(seed)
    counts = torch.zeros(V)
    n_out = 0
    for _ in range(TRIALS):
        draft = [int(torch.multinomial(q[j], 1, generator=g)) for j in range(K)]
        out = fn(draft, q, p, None, g)
        counts[out[0]] += 1
        n_out += len(out)
    return counts / TRIALS, n_out / TRIALS


def chi2_pvalue(freq, probs, n):
    exp = probs.double() * n
    stat = float(((freq.double() * n - exp) ** 2 / exp).sum())
    return float(torch.special.gammaincc(torch.tensor((V - 1) / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


ok_freq, ok_len = first_token_freq(rejection_sampler_ref)
bad_freq, _ = first_token_freq(faults.rejection_sampler_first_unverified)
pv_ok, pv_bad = chi2_pvalue(ok_freq, p[0], TRIALS), chi2_pvalue(bad_freq, p[0], TRIALS)
tv_ok = 0.5 * float((ok_freq - p[0]).abs().sum())
tv_bad = 0.5 * float((bad_freq - p[0]).abs().sum())
print(f"correct: TV(first token, p0) {tv_ok:.4f}, chi-square p-value {pv_ok:.3g}; "
      f"tokens per step {ok_len:.2f}")
print(f"fault  : TV(first token, p0) {tv_bad:.4f}, chi-square p-value {pv_bad:.3g}; "
      f"TV(p0, q0) {0.5 * float((p[0] - q[0]).abs().sum()):.4f}")

fig = Figure(figsize=(8, 3))
ax = fig.subplots()
x = torch.arange(V)
for i, (vals, name) in enumerate([(p[0], "target p0"), (q[0], "draft q0"),
                                  (ok_freq, "rejection sampler"), (bad_freq, "draft 0 unverified")]):
    ax.bar(x + (i - 1.5) * 0.2, vals, width=0.2, label=name)
ax.set_xlabel("token")
ax.set_ylabel("probability / frequency")
ax.set_title(f"first emitted token, {TRIALS} trials, V={V}, k={K}")
ax.legend(fontsize=7)
fig

# %% [markdown]
# ## 2. Greedy: speculative output equals plain output in float32
#
# Eight chat prompts, 24 tokens each, greedy, n-gram drafts (k = 3, n-grams of 1 to 3
# tokens). Half the prompts ask to repeat a passage, where prompt lookup finds the
# answer in the prompt; half ask open questions.

# %%
PASSAGES = ["The keeper lit the lamp at six and wrote the weather in his log.",
            "def mean(xs):\n    return sum(xs) / len(xs)\n",
            "Bees turn nectar into honey and feed pollen to the young.",
            "Rain fell all night; by morning the river was high."]
OPEN = ["Write a short poem about the ocean.", "Explain volcanoes to a child.",
        "Give two facts about the moon.", "Describe a quiet village morning."]
PROMPTS = [chat(f"Repeat exactly: {t}") for t in PASSAGES] + [chat(t) for t in OPEN]
GREEDY = SamplingParams(temperature=0, max_tokens=24)

want32 = gen(plain32, PROMPTS, GREEDY)
got32, by_kind = [], {}
for kind, part in (("repeat", PROMPTS[:4]), ("open", PROMPTS[4:])):
    before = spec_counts(spec32)
    out = gen(spec32, part, GREEDY)
    by_kind[kind] = [a - b for a, b in zip(spec_counts(spec32), before)][:3] + [sum(map(len, out))]
    got32 += out
d, dt, acc = (by_kind["repeat"][i] + by_kind["open"][i] for i in range(3))
equal32 = sum(a == b for a, b in zip(want32, got32))
say(f"float32: {equal32}/{len(PROMPTS)} outputs identical",
    f"float32：{equal32}/{len(PROMPTS)} 个输出相同")
print(f"verifications {d}, draft tokens {dt}, accepted {acc}: acceptance {acc / dt:.3f}, "
      f"{1 + acc / d:.2f} tokens per verification")
for i in (0, 4):
    print(repr(tok.decode(got32[i])[:70]))

# %% [markdown]
# ## 3. Why "lossless up to hardware numerics": scoring k + 1 positions at once
#
# A verification runs the pending token and the k drafts as one chunk; plain decoding
# runs one token per step. Same positions, same weights, a different shape: different
# GEMM row counts and a different attention path (masked chunk versus paged decode).
# `LLM.score` computes the same rows both ways (`mode="prefill"`: all positions in one
# pass; `mode="decode"`: one token per step through the paged KV cache).

# %%
seq = PROMPTS[4] + want32[4]
bf16 = LLM(MODEL, dtype="bfloat16", max_model_len=256, max_num_seqs=8)
num_rows = {}
for name, engine in (("float32", plain32), ("bfloat16", bf16)):
    a = engine.score(seq, mode="prefill", output="logits")
    b = engine.score(seq, mode="decode", output="logits")
    num_rows[name] = (float((a - b).abs().max()),
                      float((a.argmax(-1) != b.argmax(-1)).float().mean()),
                      metrics.mean_kl(torch.log_softmax(a, -1), torch.log_softmax(b, -1)))
    print(f"{name:9s} chunk vs step-by-step: max |dlogit| {num_rows[name][0]:.3g}, argmax "
          f"differs at {100 * num_rows[name][1]:.2f}% of {len(seq)} positions, mean KL "
          f"{num_rows[name][2]:.2e}")

# %% [markdown]
# ## 4. bfloat16: does greedy speculation still equal plain decoding?
#
# vllm #7627's setting: greedy, bf16-class arithmetic. The four open prompts (long
# answers; only four to keep the run short: on a CPU without native bfloat16 matmul
# instructions bfloat16 runs slower than float32, chapter 12) with the same drafter,
# plain versus speculative, in bfloat16.

# %%
spec16 = LLM(MODEL, dtype="bfloat16", max_model_len=256, max_num_seqs=8, speculative_config=NGRAM)
OPEN_IDS = PROMPTS[4:]
want16 = gen(bf16, OPEN_IDS, GREEDY)
got16 = gen(spec16, OPEN_IDS, GREEDY)
div16 = [metrics.first_divergence(a, b) for a, b in zip(want16, got16)]
equal16 = sum(x is None for x in div16)
say(f"bfloat16: {equal16}/{len(OPEN_IDS)} identical; first divergence per prompt: {div16}",
    f"bfloat16：{equal16}/{len(OPEN_IDS)} 个相同；每个提示词的首次分歧位置：{div16}")

# %% [markdown]
# Where a prompt diverges, it is the #7627 mechanism: a near-tie between the two best
# tokens, decided one way by the chunk's logits and the other by the decode step's. In
# float32 the per-position differences of section 3 are too small to flip a greedy
# token on these prompts; in bfloat16 they are larger (section 3), and whether a tie
# falls inside them depends on the prompt. Neither engine is "wrong": each is the
# model's argmax under its own rounding.

# %% [markdown]
# ## 5. The planted verifier bug (lattice #243)
#
# `faults.spec_accept_first_unverified` swaps the `"rejection_sampler"` step for one that
# accepts draft 0 without looking at the target. On "1 1 1 1 ..." prompts prompt lookup
# always proposes another "1"; the model does not always want one.

# %%
ONES = [chat("1 1 1 1 1 1 1 1"), chat("Count: 1 1 1 1 1 1"), chat("ha ha ha ha ha ha"),
        chat("Repeat exactly: 7 7 7 7 7 7 7")]
SHORT = SamplingParams(temperature=0, max_tokens=24)
want_ones = gen(plain32, ONES, SHORT)
good_ones = gen(spec32, ONES, SHORT)
with faults.spec_accept_first_unverified(spec32):
    bad_ones = gen(spec32, ONES, SHORT)
div_bad = [metrics.first_divergence(a, b) for a, b in zip(want_ones, bad_ones)]
div_good = [metrics.first_divergence(a, b) for a, b in zip(want_ones, good_ones)]
say(f"correct verifier, first divergence from plain: {div_good}",
    f"正确的验证器，与普通解码的首次分歧位置：{div_good}")
say(f"draft 0 unverified, first divergence from plain: {div_bad}",
    f"不验证草稿 0，与普通解码的首次分歧位置：{div_bad}")
i_bad = next((i for i, x in enumerate(div_bad) if x is not None), None)
if i_bad is not None:
    print("plain :", repr(tok.decode(want_ones[i_bad])))
    print("buggy :", repr(tok.decode(bad_ones[i_bad])))

# %% [markdown]
# ## 6. What speculation buys here
#
# Steps are the sequential work: a batch-1 request needs one forward per token plainly,
# about 1 / (tokens per verification) of that with speculation. Whether that is faster
# depends on how much a (k + 1)-token forward costs next to a 1-token one.

# %%
# Each target forward of a request yields one target token plus the drafts it accepted,
# so forwards = tokens - accepted drafts (plain decoding: one forward per token).
for kind, (d_, dt_, acc_, toks) in by_kind.items():
    say(f"{kind:6s}: acceptance {acc_ / max(dt_, 1):.3f}; {toks} tokens from "
        f"{toks - acc_} target forwards (plain: {toks}), {toks / (toks - acc_):.2f}x fewer",
        f"{kind:6s}：接受率 {acc_ / max(dt_, 1):.3f}；{toks} 个 token 来自 "
        f"{toks - acc_} 次目标模型前向计算（普通解码：{toks} 次，为其 {toks / (toks - acc_):.2f} 倍）")

# %% [markdown]
# Measured elsewhere, not by this notebook (`benchmarks/spec_decode.py`, batch 1, float32,
# k = 3, one loaded 2-core CPU; the command and numbers are in `benchmarks/RESULTS.md`):
# in that run prompt lookup sped up the "repeat" prompts and cost a little on open ones,
# and the bf16 self-draft accepted nearly every token but, paying a forward of the whole
# model per draft token, was no faster than plain decoding. A draft model pays only when
# it is much cheaper than the target.

# %% [markdown]
# ## 7. Acceptance rate as a numerics canary
#
# In production the acceptance rate is a free, always-on measurement: vLLM exports the
# counters behind it (box at the end). With a drafter that normally agrees with the
# target, a greedy draft is accepted exactly when the target's argmax equals the
# drafter's, so the acceptance rate is a running top-1 agreement between the target and
# a **fixed** reference. Change the target's numerics and leave the drafter alone, and
# every position where the new rounding flips the argmax shows up as a rejection, before
# any quality evaluation has run.
#
# The drafter here is the embedded model drafting for itself in float32
# (`method="draft_model"`, k = 3, greedy), with its own float32 KV cache. The targets:
#
# - **float32**: the drafter's own numerics, so it differs only by section 3's
#   chunk-versus-step rounding (the reference);
# - **bfloat16**: a mild change, the supported 16-bit dtype;
# - **float32 with `kv_cache_dtype="fp8"`**: K and V stored as fp8 e4m3 with scales of
#   1.0 (vLLM's default when a checkpoint ships none), a supported quantized configuration;
# - **planted**: float32 with the RoPE angle table computed in bfloat16
#   (`faults.low_precision_rope_table`, the bf16-autocast RoPE bug of transformers
#   PR #29285). A fault, not a configuration anyone should run.
#
# Eight open prompts, 16 tokens each, the same for every target. Each request's own
# counts come from `RequestOutput.metrics["spec_decode"]`; the intervals resample the
# prompts (2,000 paired bootstrap draws: the same resampled prompts for the target and
# the reference), and a configuration "moved" when the 95 % interval of its difference
# from the reference excludes zero. The intervals cover prompt-to-prompt noise only; on a
# GPU server, run-to-run noise (batch composition changes the rounding) adds to it.

# %%
T7 = time.perf_counter()
KEYS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")
CANARY_PROMPTS = OPEN_IDS + [chat(t) for t in ("Why is the sky blue?", "Suggest a name for a bakery.",
                                               "How do plants drink water?", "Tell me about trains.")]
SELF_DRAFT = {"method": "draft_model", "model": MODEL, "num_speculative_tokens": 3,
              "dtype": "float32"}
REF, PLANTED = "float32 (reference)", "float32, RoPE angles in bf16 (planted)"
CANARY = SamplingParams(temperature=0, max_tokens=16)


def spec_run(llm):
    """[prompts, 3] float64: each request's verifications, draft tokens, accepted drafts."""
    outs = llm.generate([{"prompt_token_ids": p} for p in CANARY_PROMPTS], CANARY, use_tqdm=False)
    return torch.tensor([[o.metrics["spec_decode"][k] for k in KEYS] for o in outs],
                        dtype=torch.float64)


canary = {}
for name, kw in ((REF, {"dtype": "float32"}), ("bfloat16", {"dtype": "bfloat16"}),
                 ("float32, fp8 KV cache", {"dtype": "float32", "kv_cache_dtype": "fp8"})):
    engine = LLM(MODEL, max_model_len=256, max_num_seqs=8, speculative_config=SELF_DRAFT, **kw)
    canary[name] = spec_run(engine)
    if name == REF:  # the planted fault: same engine, target's RoPE table swapped
        with faults.low_precision_rope_table(engine, torch.bfloat16, stage="angles"):
            canary[PLANTED] = spec_run(engine)
    del engine


def acc_rate(c):
    return c[..., 2].sum(-1) / c[..., 1].sum(-1)


def acc_len(c):
    return 1 + c[..., 2].sum(-1) / c[..., 0].sum(-1)


BOOT = torch.randint(0, len(CANARY_PROMPTS), (2000, len(CANARY_PROMPTS)),
                     generator=torch.Generator().manual_seed(0))
Q = torch.tensor([0.025, 0.975], dtype=torch.float64)
ref = canary[REF]
canary_rows = {}
print(f"{'target (drafter: float32)':40s} acceptance  length  d acceptance vs ref [95% CI]  "
      "prompts lower  verdict")
for name, c in canary.items():
    d_rate = acc_rate(c[BOOT]) - acc_rate(ref[BOOT])
    dl = acc_len(c[BOOT]) - acc_len(ref[BOOT])
    lo, hi = (float(v) for v in torch.quantile(d_rate, Q))
    lo_l, hi_l = (float(v) for v in torch.quantile(dl, Q))
    lower = int((c[:, 2] / c[:, 1] < ref[:, 2] / ref[:, 1]).sum())
    moved = name != REF and (hi < 0 or lo > 0)
    canary_rows[name] = dict(rate=float(acc_rate(c)), length=float(acc_len(c)), lo=lo, hi=hi,
                             lo_l=lo_l, hi_l=hi_l, lower=lower, moved=moved,
                             drafts=int(c[:, 1].sum()))
    verdict = "-" if name == REF else ("moved" if moved else "within prompt noise")
    print(f"{name:40s} {acc_rate(c):10.3f}  {acc_len(c):6.2f}  {float(acc_rate(c) - acc_rate(ref)):+.3f} "
          f"[{lo:+.3f}, {hi:+.3f}]      {lower}/{len(CANARY_PROMPTS)}         {verdict}")
for name, r in canary_rows.items():
    if name != REF:
        print(f"  {name}: mean acceptance length {r['length']:.2f} vs {canary_rows[REF]['length']:.2f}, "
              f"difference 95% CI [{r['lo_l']:+.2f}, {r['hi_l']:+.2f}]")
# The n-gram drafter of sections 2 and 4 on the same four open prompts, float32 vs bfloat16
# (counts from those runs, no new compute): prompt lookup measures how much the answer
# repeats the prompt, not how well two models agree.
ng32 = by_kind["open"]
ng16 = spec_counts(spec16)
print(f"n-gram drafter, 4 open prompts: float32 {ng32[2]}/{ng32[1]} drafts accepted "
      f"({ng32[2] / max(ng32[1], 1):.3f}), bfloat16 {ng16[2]}/{ng16[1]} "
      f"({ng16[2] / max(ng16[1], 1):.3f})")
# how far the planted table is from the float32 one at the positions these runs reach
from minivllm.layers.rotary_embedding import rope_table_ref
from minivllm.models.loader import load_hf_config, resolve_model_path

_hf = load_hf_config(resolve_model_path(MODEL))
_hd = _hf.get("head_dim") or _hf["hidden_size"] // _hf["num_attention_heads"]
_npos = max(map(len, CANARY_PROMPTS)) + CANARY.max_tokens
_ref_t = rope_table_ref(_hd, _npos, _hf["rope_theta"])
_bad_t = faults.rope_table_low_precision(_hd, _npos, _hf["rope_theta"], dtype=torch.bfloat16,
                                         stage="angles")
rope_err = max(float((b - a).abs().max()) for a, b in zip(_ref_t, _bad_t))
print(f"planted RoPE table: largest |cos or sin error| {rope_err:.2g} at positions < {_npos} "
      f"(first position with an error: "
      f"{int(((_bad_t[0] - _ref_t[0]).abs().amax(-1) > 0).nonzero()[0]) if rope_err else 'none'})")
moved = [n for n, r in canary_rows.items() if r["moved"]]
quiet = [n for n, r in canary_rows.items() if n != REF and not r["moved"]]
say(f"moved beyond prompt noise: {', '.join(moved) or 'none'}; within it: {', '.join(quiet) or 'none'}",
    f"变化超出提示词噪声的：{'、'.join(moved) or '无'}；在噪声之内的：{'、'.join(quiet) or '无'}")
print(f"section 7 took {time.perf_counter() - T7:.1f} s")

# %% [markdown]
# How to read it. The reference is below 1.0 only where the rounding difference between
# the drafter's one-token steps and the target's (k + 1)-token verification (section 3)
# flips an argmax. A target change moves the acceptance rate only through
# argmax flips, so a change that keeps nearly every top-1 token can stay inside the
# prompt-to-prompt spread (bfloat16's row: its acceptance is the share of drafts whose
# top-1 token it kept, its verdict says whether that drop left the spread on these eight
# prompts), and so can a fault that changes no top-1 token where it is measured: the
# planted table rounds the angles themselves to bfloat16, so it is already wrong at
# these prompts' positions (the rounding step grows with the angle, so with position; the
# "planted RoPE table" line prints how wrong), and its acceptance and verdict above say
# whether that flipped any of the target's top-1 tokens here. A change that flips many argmaxes (the fp8 KV row's
# verdict says whether it did) is what the canary catches. The direction
# depends on the drafter: with prompt lookup (the n-gram line above) the rate measures how much
# an answer repeats its prompt, and a broken model that loops would raise it. A canary
# needs a model drafter (draft model, EAGLE, MTP) and a baseline taken on the same
# traffic.

# %% [markdown]
# ## Claims versus measurements
#
# Every number is printed by a cell above when the notebook runs.

# %%
chunk_en = ", ".join(f"{k}: {'bit-equal' if num_rows[k][0] == 0 else 'differ'} (max |dlogit| "
                     f"{num_rows[k][0]:.2g})" for k in ("float32", "bfloat16"))
chunk_zh = "，".join(f"{k}：{'逐位相等' if num_rows[k][0] == 0 else '不同'}（最大 |dlogit| "
                    f"{num_rows[k][0]:.2g}）" for k in ("float32", "bfloat16"))
claims = [
    (Bi("rejection sampling keeps the target distribution (any q)",
        "拒绝采样保持目标分布（任意 q）"),
     Bi(f"{'consistent' if pv_ok >= 0.01 else 'rejected'} (chi-square test at 1 %): V=8, "
        f"{TRIALS} trials: TV {tv_ok:.4f}, p {pv_ok:.2g}",
        f"{'一致' if pv_ok >= 0.01 else '被拒绝'}（1 % 水平的卡方检验）：V=8，"
        f"{TRIALS} 次试验：TV {tv_ok:.4f}，p {pv_ok:.2g}")),
    (Bi("accepting draft 0 unverified breaks it", "不验证就接受草稿 0 会破坏它"),
     Bi(f"{'broken' if pv_bad < 0.01 else 'not detected'} (chi-square test at 1 %): TV "
        f"{tv_bad:.4f}, p {pv_bad:.2g}",
        f"{'被破坏' if pv_bad < 0.01 else '未检测到'}（1 % 水平的卡方检验）：TV "
        f"{tv_bad:.4f}，p {pv_bad:.2g}")),
    (Bi("greedy speculative == plain in fp32 (course plan estimate)",
        "fp32 中贪心推测 == 普通解码（课程计划的估计）"),
     Bi(f"{'true' if equal32 == len(PROMPTS) else 'false'} here: {equal32}/{len(PROMPTS)} "
        "identical (24 tokens, n-gram k=3)",
        f"此处{'成立' if equal32 == len(PROMPTS) else '不成立'}：{equal32}/{len(PROMPTS)} "
        "个相同（24 个 token，n-gram k=3）")),
    (Bi("#7962: lossless up to hardware numerics (k+1 in one forward)",
        "#7962：仅限于硬件数值差异之内的无损（一次前向计算处理 k+1 个位置）"),
     cat(Bi("chunk vs step logits ", "分块与逐步的 logits："), Bi(chunk_en, chunk_zh),
         Bi(": lossless only up to these numerics", "：只在这些数值差异之内无损"))),
    (Bi("bf16: divergences expected, as in #7627 (course plan estimate)",
        "bf16：预期会出现分歧，如 #7627（课程计划的估计）"),
     Bi(f"{'reproduced' if equal16 < len(OPEN_IDS) else 'not reproduced on these prompts'}: "
        f"{len(OPEN_IDS) - equal16}/{len(OPEN_IDS)} open prompts diverged (first at {div16})",
        f"{'已复现' if equal16 < len(OPEN_IDS) else '在这些提示词上未复现'}："
        f"{len(OPEN_IDS) - equal16}/{len(OPEN_IDS)} 个开放性提示词出现分歧（首次分歧位置 {div16}）")),
    (Bi("the planted draft[0] bug diverges on '1 1 1 1' prompts",
        "植入的 draft[0] bug 在 '1 1 1 1' 提示词上出现分歧"),
     Bi(f"{'reproduced' if any(x is not None for x in div_bad) else 'not reproduced'}: "
        f"{sum(x is not None for x in div_bad)}/{len(ONES)} diverged; correct verifier "
        f"{sum(x is not None for x in div_good)}/{len(ONES)}",
        f"{'已复现' if any(x is not None for x in div_bad) else '未复现'}："
        f"{sum(x is not None for x in div_bad)}/{len(ONES)} 个出现分歧；正确的验证器 "
        f"{sum(x is not None for x in div_good)}/{len(ONES)}")),
    (Bi("acceptance rate / tokens per verification (fp32, 8 prompts)",
        "接受率 / 每次验证得到的 token 数（fp32，8 个提示词）"),
     f"{acc / dt:.3f} / {1 + acc / d:.2f}"),
] + [
    (Bi(f"acceptance moves when the target's numerics change: {name} (drafter float32)",
        f"目标模型的数值改变时，接受率随之变化：{name}（草稿器 float32）"),
     Bi(f"{'moved' if r['moved'] else 'not beyond prompt noise'}: acceptance {r['rate']:.3f} vs "
        f"{canary_rows[REF]['rate']:.3f}, difference 95% CI [{r['lo']:+.3f}, {r['hi']:+.3f}]; "
        f"mean length {r['length']:.2f} vs {canary_rows[REF]['length']:.2f} "
        f"({len(CANARY_PROMPTS)} prompts, {r['drafts']} draft tokens)",
        f"{'变化了' if r['moved'] else '未超出提示词噪声'}：接受率 {r['rate']:.3f} 对 "
        f"{canary_rows[REF]['rate']:.3f}，差值的 95% 置信区间 [{r['lo']:+.3f}, {r['hi']:+.3f}]；"
        f"平均长度 {r['length']:.2f} 对 {canary_rows[REF]['length']:.2f}"
        f"（{len(CANARY_PROMPTS)} 个提示词，{r['drafts']} 个草稿 token）"))
    for name, r in canary_rows.items() if name != REF
]
claims_table(claims)
print(f"\nchapter wall time: {time.perf_counter() - T0:.1f} s")

# %% [markdown]
# **Misconceptions.**
#
# - *"Speculative decoding is an approximation."* With a correct rejection sampler the
#   output distribution is exactly the target's (section 1); the draft only changes how
#   many tokens a step yields.
# - *"Greedy speculative output is bit-identical to plain output."* Only up to the
#   numerics of scoring k + 1 positions at once (section 3); in float32 that was below
#   a greedy flip on these prompts, in bfloat16 it can flip near-ties (section 4).
# - *"The first draft token is safe to accept: it continues the prompt."* It is a guess
#   like the others; accepting it unchecked changes the output (section 5).
# - *"More accepted tokens means faster."* Only if a draft token is cheaper than a
#   target step: a self-draft accepts almost everything (section 7) but pays a forward of
#   the whole model per draft token, and in the recorded CPU benchmark (section 6) it was
#   no faster than plain decoding.
# - *"A steady acceptance rate means the numerics did not change."* Greedy acceptance
#   counts argmax flips only: a change that keeps most top-1 tokens can leave the rate
#   inside the prompt noise (section 7's bfloat16 row prints its acceptance and whether
#   it stayed inside the noise here).
#   The rate is an alarm for large regressions, not a proof of equality.
# - *"A drop in acceptance is always the drafter's fault."* With the drafter fixed, the
#   drop comes from the target (section 7). And with prompt lookup the rate measures
#   repetition, so a broken model that loops would raise it.
# - *"Rejected drafts are harmless leftovers."* Their K/V is in the cache; the engine
#   must roll `num_computed_tokens` back and never register those blocks in the prefix
#   cache (`tests/test_spec_decode.py` checks both).

# %% [markdown]
# ## On real vLLM
#
# - `speculative_config` (`--speculative-config '{...}'`): `method` ("ngram",
#   "draft_model", "eagle", "eagle3", "mtp", "suffix", ...), `num_speculative_tokens`,
#   `prompt_lookup_min` / `prompt_lookup_max` (ngram), `model` and `quantization` (the
#   drafter's weights), `draft_tensor_parallel_size`, and on the main branch
#   `kv_cache_dtype` (the drafter's KV cache; left unset it inherits `--kv-cache-dtype`)
#   and `draft_sample_method`. The drafter's dtype is the target's (`dtype=
#   self.target_model_config.dtype` in `vllm/config/speculative.py`): a `--dtype` change
#   moves both models, so the canary is sharpest for changes that reach the target but
#   not the drafter (the target's weight quantization, a bug in a code path only the
#   target runs), and weakest for a dtype switch of a self-draft.
# - Metrics (`vllm/v1/spec_decode/metrics.py`, `SpecDecodingProm`):
#   `vllm:spec_decode_num_drafts_total`, `vllm:spec_decode_num_draft_tokens_total`,
#   `vllm:spec_decode_num_accepted_tokens_total` and
#   `vllm:spec_decode_num_accepted_tokens_per_pos_total{position}`. Acceptance rate =
#   `rate(..._accepted_tokens_total[5m]) / rate(..._draft_tokens_total[5m])`; mean
#   acceptance length = `1 + rate(..._accepted_tokens_total[5m]) /
#   rate(..._drafts_total[5m])`; the per-position vector shows where a chain breaks.
#   The periodic `SpecDecoding metrics:` log line prints the same quantities (mean
#   acceptance length, per-position and average draft acceptance rates).
# - Over a deploy: record the acceptance rate and mean length per model version and
#   traffic class before the change, compare the new version's on the same traffic
#   (a canary replica beside the old one, not last week's mix: the rate depends on the
#   prompts, section 7's spread), and alert on a drop larger than that spread. Per-request
#   numbers (`--per-request-spec-decode-metrics summary`, the response's
#   `metrics.speculative_decoding`, experimental in vLLM 0.32) allow section 7's
#   bootstrap over requests.
# - Checked against vLLM's `vllm/config/speculative.py` (main branch, commit 002e77c),
#   `vllm/v1/spec_decode/metrics.py` (commit 016a858) and the docs' "Per-Request
#   Acceptance Metrics" page (v0.32.0), 2026-12. This engine differs: its drafter can
#   run in its own dtype (`speculative_config["dtype"]`, not a vLLM key) and always keeps
#   its own KV cache in that dtype; it exports the three totals but no per-position
#   counter; the per-request counts are `RequestOutput.metrics["spec_decode"]`; methods
#   are ngram and draft_model only; and section 7's intervals cover prompt noise only,
#   not a GPU server's run-to-run noise.
