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
# # Chapter 20. Sampling parameters: temperature, top-k/top-p/min-p and their order, penalties, seeds
#
# **Learning goals.** After this chapter you can
#
# 1. give vLLM v1's sampling order (`layers/sampler.py`): penalties on the raw logits,
#    then temperature, min_p, top-k, top-p on the distribution renormalised after
#    top-k, then the exponential race `argmax(p / E)`;
# 2. say which tokens each penalty counts: **repetition** the prompt and the output,
#    **frequency** and **presence** the output only, and measure what a wrong
#    accounting does to the next-token distribution;
# 3. measure the total-variation distance between the two filter orders on real logits;
# 4. say when a per-request `seed` reproduces a sample (same batch, or float32, or a
#    batch-invariant engine) and when it does not;
# 5. put the size of sampling choices next to the size of numerical ones (quantization).
#
# **The incidents.**
#
# - **vllm #718 / vllm PR #1885** (2023-08-09 / 2023-12-01,
#   <https://github.com/vllm-project/vllm/pull/1885>): vLLM applied top-p before top-k;
#   HF does top-k first. The PR's example: logits [0.1, 0.2, 0.3, 0.4], k = 2, p = 0.5
#   give [0, 0, 0, 1] one way and [0, 0, .475, .525] the other.
# - **vllm-project/vllm-metal PR #69** (2026-01-10,
#   <https://github.com/vllm-project/vllm-metal/pull/69>), reproduced there with
#   SmolLM2-135M and the prompt "Paris Paris ...": the repetition penalty did not see the
#   prompt on the first decode step, and on later steps prompt and output were merged,
#   so presence and frequency penalties counted the prompt's tokens.
# - **vllm PR #5639** (2024-06-18): penalty tensors shaped by whichever request came
#   first, so a request's penalty depended on batch order. minivllm keeps per-row
#   `[B]` tensors (`SamplingMetadata`), so the order cannot matter; section 3 checks
#   that for seeds.
# - **vllm #21310 / PR #2514**: a per-request `seed` that does not reproduce; PR #2514
#   already noted that batch composition can still change the sampled tokens.
#
# Everything below is measured when the notebook runs, on the embedded
# SmolLM2-135M-Instruct (minivllm, this machine's CPU). Both bugs are **planted** through
# the step registry (`faults.top_p_before_top_k`, the `"sampler.top_k_top_p"` step;
# `faults.penalty_accounting_mixed`, the `"sampler.penalties"` step); the model and the
# prompt are the incident's own, next to the unmodified engine.

# %%
# %matplotlib inline
import time

import torch
from matplotlib.figure import Figure

from minivllm import LLM, SamplingParams
from minivllm.layers.sampler import apply_top_k_top_p, penalties_ref
from minivllm.precision import evalsets, faults, metrics

torch.manual_seed(0)
T0 = time.perf_counter()
MODEL = "smollm2-135m-instruct"
llm = LLM(MODEL, dtype="float32", max_model_len=256)
tok = llm.get_tokenizer()
PARIS = sorted({tok.encode("Paris")[0], tok.encode(" Paris")[0]})  # 'Paris' and ' Paris'
print("the 'Paris' tokens:", PARIS, [tok.decode([i]) for i in PARIS])


def chat(text: str) -> list[int]:
    conv = [{"role": "user", "content": text}]
    return tok.encode(tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=True),
                      add_special_tokens=False)


def tv(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Total-variation distance per row: half the L1 distance of two distributions."""
    return 0.5 * (p - q).abs().sum(-1)

# %% [markdown]
# ## 1. Penalty accounting: the vllm-metal #69 prompt
#
# The penalties act on the raw logits before temperature (`penalties_ref`): repetition
# (CTRL, arXiv:1909.05858) divides a positive logit by the penalty (multiplies a negative
# one) for every token seen in the prompt **or** the output; frequency subtracts
# `frequency_penalty * count_in_output`, presence `presence_penalty` once per token in
# the output (OpenAI's definition). The planted fault is vllm-metal's accounting before
# PR #69. First the next-token distribution of the incident's prompt, step by step
# (the sampler's step on the model's own logits, exactly as the engine calls it):

# %%
PROMPTS = {"completion 'Paris Paris Paris Paris Paris'": tok.encode("Paris Paris Paris Paris Paris"),
           "chat 'What is the capital of France? Answer in one word.'":
               chat("What is the capital of France? Answer in one word.")}
one = torch.ones(1)
step_rows = []
for name, ids in PROMPTS.items():
    logits = llm.score(ids, output="logits")[-1:]
    first = int(logits.argmax())
    logits2 = llm.score(ids + [first], output="logits")[-1:]  # step 2: one output token
    for label, kw, lg, out in [("rep 1.3, step 1", dict(repetition_penalty=1.3 * one), logits, []),
                               ("freq 0.5 + pres 0.5, step 2",
                                dict(frequency_penalty=0.5 * one, presence_penalty=0.5 * one),
                                logits2, [first])]:
        args = dict(presence_penalty=None, frequency_penalty=None, repetition_penalty=None)
        args.update(kw)
        good = penalties_ref(lg, [ids], [out], args["presence_penalty"],
                             args["frequency_penalty"], args["repetition_penalty"])
        bad = faults.penalties_prompt_output_mixed(lg, [ids], [out], args["presence_penalty"],
                                                   args["frequency_penalty"],
                                                   args["repetition_penalty"])
        p0, pg, pb = (torch.softmax(x, -1)[0] for x in (lg, good, bad))
        step_rows.append((name, label, float(p0[PARIS].sum()), float(pg[PARIS].sum()),
                          float(pb[PARIS].sum()), float(tv(pg, pb))))
print(f"{'prompt':55s} {'penalty':28s} {'P(Paris) none':>13s} {'correct':>9s} {'buggy':>9s} {'TV':>7s}")
for r in step_rows:
    print(f"{r[0]:55s} {r[1]:28s} {r[2]:13.2e} {r[3]:9.2e} {r[4]:9.2e} {r[5]:7.4f}")

# %% [markdown]
# Then the generated text, greedy, 10 tokens, with `repetition_penalty` 1.0 and 1.3 and
# with frequency + presence 0.5, under the correct and the buggy accounting. With
# penalty 1.0 (and no other penalty) the two accountings cannot differ: the penalty is
# the identity.

# %%
CONFIGS = {"rep 1.0": dict(repetition_penalty=1.0), "rep 1.3": dict(repetition_penalty=1.3),
           "freq+pres 0.5": dict(frequency_penalty=0.5, presence_penalty=0.5)}
reqs = [(pn, cn) for pn in PROMPTS for cn in CONFIGS]
prompts = [{"prompt_token_ids": PROMPTS[pn]} for pn, _ in reqs]
sps = [SamplingParams(temperature=0.0, max_tokens=10, **CONFIGS[cn]) for _, cn in reqs]
texts = {"correct": [o.outputs[0].text for o in llm.generate(prompts, sps, use_tqdm=False)]}
with faults.penalty_accounting_mixed(llm):
    texts["buggy"] = [o.outputs[0].text for o in llm.generate(prompts, sps, use_tqdm=False)]
gen_rows = []
for i, (pn, cn) in enumerate(reqs):
    for acc in ("correct", "buggy"):
        t = texts[acc][i]
        gen_rows.append((pn[:10], cn, acc, t.count("Paris"), t))
        print(f"{pn[:10]:10s} {cn:14s} {acc:8s} Paris x{t.count('Paris')}: {t!r}")
n_changed = sum(texts["correct"][i] != texts["buggy"][i] for i in range(len(reqs)))
print(f"texts changed by the buggy accounting: {n_changed} of {len(reqs)}")

# %% [markdown]
# **What it shows.** SmolLM2-135M-*Instruct* does not continue "Paris Paris ..." with
# another "Paris" (its probability is printed above, far from the top), so the count of
# "Paris" does not move here (the incident ran the base SmolLM2-135M). What the bug does is visible in the distribution: on the first step
# the buggy accounting leaves the prompt's tokens unpenalised (P(Paris) back to its
# unpenalised value, the TV column), and from the second step on it subtracts the
# frequency and presence penalties from every prompt token, so on the chat prompt the
# words of the question ("capital", "France") are pushed down; the texts the bug changed
# are counted above. Repetition penalty 1.0 gives identical text under both accountings.
#
# ## 2. The filter order: top-k then top-p
#
# The worked example of PR #1885 through the engine's step (`apply_top_k_top_p`) and
# through the planted wrong order:

# %%
ex = torch.tensor([[0.1, 0.2, 0.3, 0.4]])
K2, P05 = torch.tensor([2]), torch.tensor([0.5])
right = torch.softmax(apply_top_k_top_p(ex, K2, P05), -1)
wrong = torch.softmax(faults.top_k_top_p_wrong_order(ex, K2, P05), -1)
print("top-k then top-p:", [round(x, 3) for x in right[0].tolist()])
print("top-p then top-k:", [round(x, 3) for x in wrong[0].tolist()])
print(f"TV distance: {float(tv(right, wrong)):.3f}")

# %% [markdown]
# Top-p after top-k measures mass on the *renormalised* top-k survivors, so it cuts
# deeper; top-p first measures mass on the full distribution and keeps more. On real
# logits: 33 positions of the bundled corpus, temperature 1, for a grid of (k, p):

# %%
text = evalsets.load_corpus()
corpus_ids = tok.encode(text[:4000])[:33]
L = llm.score(corpus_ids, output="logits")  # [33, V] float32
GRID_K, GRID_P = [5, 20, 50], [0.5, 0.8, 0.95]
tv_grid = torch.zeros(len(GRID_K), len(GRID_P))
for a, k in enumerate(GRID_K):
    for b, p in enumerate(GRID_P):
        kk = torch.full((L.shape[0],), k, dtype=torch.int64)
        pp = torch.full((L.shape[0],), p)
        r = torch.softmax(apply_top_k_top_p(L, kk, pp), -1)
        w = torch.softmax(faults.top_k_top_p_wrong_order(L, kk, pp), -1)
        d = tv(r, w)
        tv_grid[a, b] = d.mean()
        print(f"k={k:3d} p={p:.2f}: TV mean {float(d.mean()):.4f}, max {float(d.max()):.4f}, "
              f"rows that differ {int((d > 0).sum())}/{L.shape[0]}")
only_k = tv(torch.softmax(apply_top_k_top_p(L, torch.full((L.shape[0],), 20), None), -1),
            torch.softmax(faults.top_k_top_p_wrong_order(L, torch.full((L.shape[0],), 20), None), -1))
print(f"top-k alone (k=20, no top-p): TV max {float(only_k.max()):.1e} (the order cannot matter)")

# %% [markdown]
# The planted engine-level fault gives other tokens to seeded requests that use both
# filters, and the same tokens to requests with only one of them:

# %%
q_ids = chat("Write a short poem about the sea.")
both = SamplingParams(temperature=1.0, top_k=50, top_p=0.8, seed=11, max_tokens=16)
konly = SamplingParams(temperature=1.0, top_k=50, seed=11, max_tokens=16)
ok = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": q_ids}] * 2, [both, konly], use_tqdm=False)]
with faults.top_p_before_top_k(llm):
    bad = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": q_ids}] * 2, [both, konly], use_tqdm=False)]
order_div = [metrics.first_divergence(a, b) for a, b in zip(ok, bad)]
print(f"first divergence, top_k+top_p: {order_div[0]}; top_k only: {order_div[1]} (None: equal)")

# %% [markdown]
# ## 3. Seeds: alone versus in a batch, float32 and bfloat16
#
# A seeded request draws its exponentials from its own `torch.Generator`
# (`random_sample`), so its random stream does not depend on the batch. Its
# *probabilities* still come from the model, and chapter 5's batch-composition effect
# can move them (a sampled token flips only when two candidates' race is closer than
# that move). Request `seed=7`, temperature 0.8, 10 tokens, alone and
# then in a batch with two other prompts (placed second); also on a bfloat16 engine
# with `batch_invariant=True` (EngineArgs field: fixed reduction order whatever the
# batch):

# %%
SEEDED = SamplingParams(temperature=0.8, seed=7, max_tokens=10, ignore_eos=True)
target = chat("Tell me about the history of the city of Lyon.")
others = [chat(t) for t in ("What is 17 times 23?", "Name three rivers in Africa and describe them.",
                            "Write a haiku about snow on a mountain.")]
OTHER_SP = SamplingParams(temperature=0.0, max_tokens=10)


def alone_vs_batch(engine, twice: bool):
    a = engine.generate([{"prompt_token_ids": target}], SEEDED, use_tqdm=False)[0].outputs[0].token_ids
    batch = [others[0], target, others[1]]
    outs = engine.generate([{"prompt_token_ids": x} for x in batch],
                           [OTHER_SP, SEEDED, OTHER_SP], use_tqdm=False)
    b = outs[1].outputs[0].token_ids
    again = engine.generate([{"prompt_token_ids": target}], SEEDED, use_tqdm=False)[0].outputs[0].token_ids \
        if twice else a  # the same request alone again (float32 only, to keep the chapter short)
    return a, b, again


bf16 = LLM(MODEL, dtype="bfloat16", max_model_len=256)
bf16_bi = LLM(MODEL, dtype="bfloat16", max_model_len=256, batch_invariant=True)
seed_rows = []
for name, engine in [("float32", llm), ("bfloat16", bf16), ("bfloat16, batch_invariant=True", bf16_bi)]:
    a, b, again = alone_vs_batch(engine, twice=name == "float32")
    seed_rows.append((name, a == again, metrics.first_divergence(a, b)))
    print(f"{name:32s} alone twice equal: {a == again if name == 'float32' else '(not run)'}; alone vs batch: first divergence "
          f"{metrics.first_divergence(a, b)} (None: all 10 equal)")

# %% [markdown]
# On this CPU the measured answer is printed above: where "alone vs batch" is None, the
# batch did not move any of the 10 races far enough to flip a token, so
# `batch_invariant=True` had nothing to restore in this case (chapter 5 measures how far
# batch composition moves the logits per dtype). The guarantee a seed gives is the random
# stream, not the probabilities.

# %% [markdown]
# ## 4. Temperature versus quantization
#
# The seed claim: temperature 0 vs 0.8 differs more than quantization does. Both on the
# same 33 corpus positions, teacher-forced (no sampling cascade): the distance between
# the float32 model at temperature 1 and 0.8 (KL), the chance that a temperature-0.8
# sample differs from the greedy token (`1 - mean p_0.8(argmax)`, the disagreement
# between temperature 0 and 0.8 per step), next to the same numbers between float32
# and int8 weights (`quantization="int8"`, per-channel, `minivllm/quantization`).

# %%
int8 = LLM(MODEL, dtype="float32", max_model_len=256, quantization="int8")
Lq = int8.score(corpus_ids, output="logits")
lp1, lp08, lpq = (torch.log_softmax(x, -1) for x in (L, L / 0.8, Lq))
kl_temp = metrics.mean_kl(lp1, lp08)
kl_quant = metrics.mean_kl(lp1, lpq)
disagree_temp = 1 - float(lp08.exp().gather(1, L.argmax(-1, keepdim=True)).mean())
disagree_quant = 1 - metrics.top1_agreement(lp1, lpq)
print(f"KL(T=1 || T=0.8)            {kl_temp:.4f} nats")
print(f"KL(float32 || int8)         {kl_quant:.4f} nats")
print(f"P(T=0.8 sample != greedy)   {disagree_temp:.3f}")
print(f"greedy token float32 != int8 {disagree_quant:.3f}")

# %%
fig = Figure(figsize=(10, 3.6))
ax1, ax2 = fig.subplots(1, 2)
im = ax1.imshow(tv_grid.numpy(), cmap="viridis")
ax1.set_xticks(range(len(GRID_P)), [str(p) for p in GRID_P])
ax1.set_yticks(range(len(GRID_K)), [str(k) for k in GRID_K])
for a in range(len(GRID_K)):
    for b in range(len(GRID_P)):
        ax1.text(b, a, f"{float(tv_grid[a, b]):.3f}", ha="center", va="center", color="w")
ax1.set_xlabel("top_p")
ax1.set_ylabel("top_k")
ax1.set_title("mean TV: top-k then top-p vs the reverse")
fig.colorbar(im, ax=ax1)
names = ["KL T=1 vs 0.8", "KL fp32 vs int8", "P(sample T=0.8\n!= greedy)", "greedy fp32\n!= int8"]
vals = [kl_temp, kl_quant, disagree_temp, disagree_quant]
ax2.bar(names, vals, color=["C0", "C1", "C0", "C1"])
ax2.set_title("sampling choice (blue) vs quantization (orange)")
ax2.tick_params(axis="x", labelsize=7)
fig.tight_layout()
fig

# %% [markdown]
# ## Claims versus measurements
#
# Every number is printed by a cell above when the notebook runs.

# %%
r_chat_rep = [r for r in step_rows if r[0].startswith("chat") and r[1].startswith("rep")][0]
r_chat_fp = [r for r in step_rows if r[0].startswith("chat") and r[1].startswith("freq")][0]
claims = [
    ("PR #1885: [.1,.2,.3,.4], k=2, p=0.5 -> [0,0,0,1] vs [0,0,.475,.525]",
     f"{[round(x, 3) for x in right[0].tolist()]} vs {[round(x, 3) for x in wrong[0].tolist()]}"),
    ("the filter order matters on real logits",
     f"mean TV {float(tv_grid.min()):.4f}..{float(tv_grid.max()):.4f} over the (k, p) grid; "
     f"0 with one filter (max {float(only_k.max()):.0e})"),
    ("#69: repetition penalty must see the prompt on step 1",
     f"chat prompt, rep 1.3: P(Paris) {r_chat_rep[3]:.2e} correct vs {r_chat_rep[4]:.2e} buggy, TV {r_chat_rep[5]:.4f}"),
    ("#69: frequency/presence must not count the prompt",
     f"chat prompt, step 2: TV {r_chat_fp[5]:.4f}; greedy texts changed {n_changed}/{len(reqs)}"),
    ("#69 repro: 'Paris Paris ...' repeats 'Paris'",
     "not on the Instruct model: 'Paris' count " +
     ", ".join(f"{c}:{n}" for _, c, acc, n, _ in gen_rows[:6] if acc == 'correct') + " (completion prompt)"),
    ("a per-request seed reproduces a sample alone", f"float32, run twice: {seed_rows[0][1]}"),
    ("a seed survives batching in float32 / bf16 / bf16 batch-invariant",
     ", ".join(f"{r[0]}: {'equal' if r[2] is None else 'diverges at ' + str(r[2])}" for r in seed_rows)),
    ("seed claim: T=0 vs 0.8 differs more than quantization",
     f"KL {kl_temp:.4f} vs {kl_quant:.4f} nats; disagreement {disagree_temp:.3f} vs {disagree_quant:.3f}"),
]
for c, m in claims:
    print(f"- {c}\n    measured: {m}")
print(f"\nchapter wall time: {time.perf_counter() - T0:.1f} s")

# %% [markdown]
# **Misconceptions.**
#
# - *"top-k and top-p commute."* They do not when both are set: top-p after top-k
#   measures mass on the renormalised survivors. With one of them set, the order is
#   irrelevant (TV exactly 0 above).
# - *"Repetition penalty is about what the model generated."* In vLLM (and HF) it is
#   about the prompt **and** the output; frequency and presence are about the output
#   only. An engine that mixes the two lists changes both.
# - *"A seed makes sampling deterministic."* It fixes the random stream; the
#   probabilities it races against still depend on the batch (chapter 5) unless the
#   arithmetic is batch-invariant. Measured above per dtype.
# - *"Penalty 1.0 is 'a little' penalty."* It is the identity; the two accountings gave
#   the same text with it.
# - *"Temperature is a small knob next to numerics."* Section 4: going from greedy to
#   0.8 changes the next token far more often than int8 weights change the greedy token.
#
# Not in this chapter: `generation_config.json` defaults applied or not (NeMo-RL #3497,
# lm-eval #3154; the engine reads them with `generation_config="auto"`, and chapter 29
# plants such a change) and `logprobs_mode`.
