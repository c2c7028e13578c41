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
# # Chapter 20. Sampling parameters: penalties, temperature, top-k/top-p/min-p and their order, seeds, defaults
#
# **Learning goals.** After this chapter you can
#
# 1. say which tokens each penalty counts: **repetition** the prompt and the output (so
#    the chat template's and the question's tokens too), **frequency** and **presence**
#    the output only, and measure what `repetition_penalty=1.3` does to chat answers:
#    which answers change, why (which penalized token lost the argmax, and where it came
#    from: template, question or output), and how much log-probability the model's own
#    answer loses;
# 2. measure what a wrong penalty accounting does to the next-token distribution;
# 3. give vLLM v1's sampling order (`layers/sampler.py`): penalties on the raw logits,
#    then temperature, min_p, top-k, top-p on the distribution renormalised after
#    top-k, then the exponential race `argmax(p / E)`, and measure the total-variation
#    distance between the two filter orders on real logits;
# 4. say when a per-request `seed` reproduces a sample (same batch, or a batch-invariant
#    engine) and when it does not, measured on chapter 5's batch compositions;
# 5. say where a request's unset sampling fields come from (`generation_config`
#    `"auto"`, `"vllm"` or a folder, plus `override_generation_config`) and show that
#    they apply only where the client leaves a field unset;
# 6. put the size of sampling choices next to the size of numerical ones (quantization).
#
# **The incidents.**
#
# - **huggingface/text-generation-inference #1170 and huggingface/transformers #26902**
#   (both 2023-10-18, <https://github.com/huggingface/text-generation-inference/issues/1170>,
#   <https://github.com/huggingface/transformers/issues/26902>): a repetition penalty
#   counts every token of the prompt, and a chat format such as ChatML repeats
#   `<|im_start|>`, `<|im_end|>` and the role names in every turn, so the penalty works
#   against the format itself; the request was a list of tokens to exempt (TGI closed
#   it as stale). **transformers #36642** (2025-03-11) asked again whether penalising the
#   whole `input_ids` is right; HF's `RepetitionPenaltyLogitsProcessor` documents that
#   the considered tokens include the prompt. vLLM does the same: its `apply_penalties`
#   (`vllm/model_executor/layers/utils.py`, called by `vllm/v1/sample/ops/penalties.py`)
#   penalises `prompt_mask | output_mask` for `repetition_penalty` and subtracts the
#   frequency and presence penalties from the **output** counts only (OpenAI's
#   definition); `SamplingParams`' documentation says the same ("whether they appear in
#   the prompt and the generated text so far" against "in the generated text so far").
#   SmolLM2-135M-Instruct's template is ChatML with a default system prompt: section 1
#   measures what this costs.
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
#   `[B]` tensors (`SamplingMetadata`), so the order cannot matter.
# - **vllm #21310 / PR #2514**: a per-request `seed` that does not reproduce; PR #2514
#   already noted that batch composition can still change the sampled tokens.
# - **NeMo-RL #3497 / lm-evaluation-harness #3154**: sampling defaults from a model's
#   `generation_config.json` applied where a client did not expect them, and not applied
#   where it did (section 5; chapter 29 gates on such a change).
#
# Everything below is measured when the notebook runs, on the embedded
# SmolLM2-135M-Instruct (minivllm, this machine's CPU). The penalty of section 1 is the
# engine's own (vLLM's accounting), unmodified; the "template exempt" accounting next to
# it is an ablation swapped in through the step registry (the `"sampler.penalties"`
# step), not something vLLM offers. The bugs of sections 2 and 3 are **planted** the same
# way (`faults.penalty_accounting_mixed`, `faults.top_p_before_top_k`), next to the
# unmodified engine; the prompts are the incidents' own, the model is the *Instruct*
# variant of vllm-metal #69's SmolLM2-135M.

# %%
# %matplotlib inline
import json
import time
from pathlib import Path

import torch
from matplotlib.figure import Figure

from minivllm import LLM, SamplingParams
from minivllm.i18n import Bi, claims_table, say
from minivllm.layers.sampler import apply_top_k_top_p, penalties_ref
from minivllm.precision import evalsets, faults, metrics

torch.manual_seed(0)
T0 = time.perf_counter()
MODEL = "smollm2-135m-instruct"
KW = dict(max_model_len=256, kv_cache_memory_bytes=64 * 1024**2)  # a small KV cache per engine
llm = LLM(MODEL, dtype="float32", **KW)
tok = llm.get_tokenizer()
PARIS = sorted({tok.encode("Paris")[0], tok.encode(" Paris")[0]})  # 'Paris' and ' Paris'
print("the 'Paris' tokens:", PARIS, [tok.decode([i]) for i in PARIS])


def chat(text: str) -> list[int]:
    conv = [{"role": "user", "content": text}]
    return tok.encode(tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=True),
                      add_special_tokens=False)


def cat(*parts) -> Bi:
    """One Bi from Bi pieces and plain strings (text the same in both languages)."""
    return Bi("".join(x if isinstance(x, str) else x.en for x in parts),
              "".join(x if isinstance(x, str) else x.zh for x in parts))


def tv(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Total-variation distance per row: half the L1 distance of two distributions."""
    return 0.5 * (p - q).abs().sum(-1)

# %% [markdown]
# ## 1. The live incident: `repetition_penalty=1.3` on chat prompts
#
# The penalties act on the raw logits before temperature (`penalties_ref`, the
# `"sampler.penalties"` step): repetition (CTRL, arXiv:1909.05858) divides a positive
# logit by the penalty (multiplies a negative one) for every token id seen in the prompt
# **or** the output; frequency subtracts `frequency_penalty * count_in_output`, presence
# `presence_penalty` once per token in the output. Either way a penalised logit only
# goes down, so a greedy answer changes at a step only if the token it would have chosen
# was penalised: that token's origin (template, question, output so far) is the cause of
# the change, and the cell below finds it for every answer.
#
# One question of each category of the bundled QA set, rendered with the model's chat
# template (system prompt included), greedy, 20 tokens: without a penalty, with
# `repetition_penalty=1.3` (vLLM's accounting), and with an ablation that exempts the
# template's tokens (the question and the output still count: what TGI #1170 asked for).
# The renders look like this:

# %%
QA = []
for it in evalsets.load_qa():
    if it.category not in {q.category for q in QA}:
        QA.append(it)
q_prompts, q_parts = [], []
for it in QA:
    ids, q_ids = chat(it.question), tok.encode(it.question, add_special_tokens=False)
    s = next(i for i in range(len(ids)) if ids[i:i + len(q_ids)] == q_ids)  # the question's span
    q_prompts.append(ids)
    q_parts.append({"template": ids[:s] + ids[s + len(q_ids):], "question": q_ids})
print(repr(tok.decode(q_prompts[0])))
print(f"{len(QA)} prompts of {min(map(len, q_prompts))}-{max(map(len, q_prompts))} tokens: "
      f"{len(q_parts[0]['template'])} of the template's in each, questions of "
      f"{min(len(x['question']) for x in q_parts)}-{max(len(x['question']) for x in q_parts)}")
REP = 1.3
GREEDY20 = SamplingParams(temperature=0.0, max_tokens=20)


def template_exempt(logits, prompt_token_ids, output_token_ids, presence, frequency, repetition):
    """The ablation: the "sampler.penalties" step with only the question's tokens as the
    prompt (looked up by the prompt's ids), the template's tokens exempt."""
    questions = {tuple(p): part["question"] for p, part in zip(q_prompts, q_parts)}
    return penalties_ref(logits, [questions[tuple(p)] for p in prompt_token_ids],
                         output_token_ids, presence, frequency, repetition)


def answers(engine, sp, step=None):
    reqs = [{"prompt_token_ids": p} for p in q_prompts]
    if step is None:
        return [o.outputs[0] for o in engine.generate(reqs, sp)]
    with engine.swap_step("sampler.penalties", step):
        return [o.outputs[0] for o in engine.generate(reqs, sp)]


t1 = time.perf_counter()
PEN20 = SamplingParams(temperature=0.0, max_tokens=20, repetition_penalty=REP)
runs = {"none": answers(llm, GREEDY20), f"rep {REP}": answers(llm, PEN20)}

# %%
runs[f"rep {REP}, template exempt"] = answers(llm, PEN20, template_exempt)
correct = {k: [evalsets.answer_matches(o.text, it.answers) for o, it in zip(v, QA)] for k, v in runs.items()}
for k, v in runs.items():
    print(f"{k:28s} correct {sum(correct[k])}/{len(QA)}")


def origin(token: int, i: int, out: list[int]) -> str:
    """Where token id `token` was seen before output position `out` of prompt i."""
    where = [name for name, ids in (("template", q_parts[i]["template"]),
                                    ("question", q_parts[i]["question"]), ("output", out)) if token in ids]
    return "+".join(where) or "nowhere (impossible: an unpenalised argmax cannot lose)"


plain, pen = runs["none"], runs[f"rep {REP}"]
div_rows = []
for i, (a, b) in enumerate(zip(plain, pen)):
    d = metrics.first_divergence(a.token_ids, b.token_ids)
    if d is None or d >= len(a.token_ids):
        div_rows.append((i, d, None, "", (0, 0, 0)))
        continue
    lost = a.token_ids[d]  # the token the unpenalised model chose there
    out = list(a.token_ids[:d])
    T, Q = set(q_parts[i]["template"]), set(q_parts[i]["question"])
    sizes = (len(T), len(Q - T), len(set(out) - T - Q))  # distinct penalised ids by first source
    div_rows.append((i, d, lost, origin(lost, i, out), sizes))
print()
print(f"{'question':44s} {'none':>5s} {'1.3':>5s} {'diverge':>7s}  lost token (seen in)")
for (i, d, lost, src, _), it in zip(div_rows, QA):
    lost_s = "-" if lost is None else f"{tok.decode([lost])!r} ({src})"
    print(f"{it.question[:44]:44s} {str(correct['none'][i]):>5s} {str(correct[f'rep {REP}'][i]):>5s} "
          f"{str(d):>7s}  {lost_s}")
    if d is not None:
        print(f"      none: {plain[i].text!r}\n      1.3:  {pen[i].text!r}")

# %% [markdown]
# How many penalised token ids each source contributes (distinct ids at the first step
# where the answers part; a token counts for the first source in the order template,
# question, output), and where the lost tokens came from:

# %%
changed = [r for r in div_rows if r[2] is not None]
tot = [sum(r[4][k] for r in changed) for k in range(3)]
src_count = {s: sum(s in r[3].split("+") for r in changed) for s in ("template", "question", "output")}
only_template = sum(r[3] == "template" for r in changed)
say(f"answers changed by the penalty: {len(changed)}/{len(QA)}",
    f"被惩罚改变的回答：{len(changed)}/{len(QA)}")
if changed:
    say(f"penalised ids at the first divergence, summed over those {len(changed)} answers: "
        f"template {tot[0]}, question (not in the template) {tot[1]}, output (not in the "
        f"prompt) {tot[2]}: the template's share is {tot[0] / sum(tot):.0%}",
        f"首次分歧位置上被惩罚的 token id，对这 {len(changed)} 个回答求和："
        f"模板 {tot[0]}，问题（不在模板中）{tot[1]}，输出（不在提示词中）"
        f"{tot[2]}：模板所占比例为 {tot[0] / sum(tot):.0%}")
    say(f"the token that lost the argmax was in the template for {src_count['template']}, in the "
        f"question for {src_count['question']}, in the output so far for {src_count['output']} of "
        f"{len(changed)} (only in the template: {only_template})",
        f"在 {len(changed)} 个回答中，失去 argmax 的 token 出现在模板中的有 {src_count['template']} 个，"
        f"出现在问题中的有 {src_count['question']} 个，出现在目前输出中的有 {src_count['output']} 个"
        f"（只出现在模板中：{only_template}）")
eos = tok.eos_token_id
n_eos = sum(r[2] == eos for r in changed)
say(f"of which the lost token was the end of turn {tok.decode([eos])!r} (the template writes it "
    f"after the system prompt and the question): {n_eos}",
    f"其中失去的 token 是轮次结束 token {tok.decode([eos])!r}（模板在系统提示词和问题之后都会写它）"
    f"的有：{n_eos}")

# %% [markdown]
# The same penalty measured without generating: the log-probability of the model's own
# unpenalised answer (its greedy tokens, end of turn included when it stopped),
# teacher-forced, under each accounting. One scoring pass per prompt; the penalty is
# applied position by position with the prompt and the answer so far as history,
# exactly as the sampler would.

# %%
scored = llm.score([p + list(a.token_ids) for p, a in zip(q_prompts, plain)], output="logits")
ONE = torch.ones(1)


def answer_logprob(i: int, rep: float, prompt_ids=None) -> float:
    p, a = q_prompts[i], list(plain[i].token_ids)
    rows = scored[i][len(p) - 1:len(p) - 1 + len(a)]
    hist = [p if prompt_ids is None else prompt_ids] * len(a)
    lg = rows if rep == 1.0 else penalties_ref(rows, hist, [a[:t] for t in range(len(a))], None, None,
                                               rep * torch.ones(len(a)))
    return float(torch.log_softmax(lg, -1).gather(1, torch.tensor(a)[:, None]).sum())


lp = [(answer_logprob(i, 1.0), answer_logprob(i, REP), answer_logprob(i, REP, q_parts[i]["question"]))
      for i in range(len(QA))]
print(f"{'question':44s} {'tokens':>6s} {'log p none':>10s} {'rep 1.3':>8s} {'exempt':>8s}")
for it, a, (l0, l1, l2) in zip(QA, plain, lp):
    print(f"{it.question[:44]:44s} {len(a.token_ids):6d} {l0:10.2f} {l1:8.2f} {l2:8.2f}")
drop = [l0 - l1 for l0, l1, _ in lp]
drop_ex = [l0 - l2 for l0, _, l2 in lp]
say(cat(Bi(f"mean log-prob lost by the unpenalised answer: {sum(drop) / len(drop):.2f} nats with rep {REP}, "
           f"{sum(drop_ex) / len(drop_ex):.2f} with the template exempt; the exemption ",
           f"未受惩罚的回答平均损失的对数概率：rep {REP} 时为 {sum(drop) / len(drop):.2f} nats，"
           f"豁免模板时为 {sum(drop_ex) / len(drop_ex):.2f}；豁免"),
        Bi("keeps more of it", "保留了更多") if sum(drop_ex) < sum(drop)
        else Bi("does not keep more of it", "没有保留更多"),
        Bi(f" (every answer: {all(x <= y + 1e-6 for x, y in zip(drop_ex, drop))})",
           f"（每个回答都如此：{all(x <= y + 1e-6 for x, y in zip(drop_ex, drop))}）")))
print(f"section 1: {time.perf_counter() - t1:.1f} s")

# %% [markdown]
# **What it shows.** The tables above are the run's. An answer changes only where the
# token the unpenalised model wanted had been seen, and the "seen in" column says where.
# With SmolLM2's default system prompt the template is the longer part of every prompt
# (the token counts at the top of the section), and the split of the penalised set by
# source is printed; whether the tokens that actually lost the argmax came from the
# template, the question (an answer that repeats the question's words, "The capital of
# France is ...") or the answer itself is counted above, and so is the end-of-turn
# token, which ChatML writes after every message: where it lost, the answer ran on
# instead of stopping there. The teacher-forced log-probabilities say
# how much less likely the model's own answer became; exempting the template (the
# ablation) is the TGI #1170 proposal, measured, not a vLLM option. What `repetition_penalty`
# is for (breaking loops in long outputs) is not tested here: these answers are short.
#
# ## 2. Penalty accounting: the vllm-metal #69 prompt
#
# The planted fault is vllm-metal's accounting before PR #69. First the next-token
# distribution of the incident's prompt, step by step (the sampler's step on the model's
# own logits, exactly as the engine calls it):

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
say(f"texts changed by the buggy accounting: {n_changed} of {len(reqs)}",
    f"被有 bug 的统计方式改变的文本：{len(reqs)} 个中有 {n_changed} 个")
REP1_SAME = all(texts["correct"][i] == texts["buggy"][i] for i, (_, cn) in enumerate(reqs) if cn == "rep 1.0")
say(f"with repetition_penalty 1.0 the two accountings give the same texts: {REP1_SAME}",
    f"repetition_penalty 为 1.0 时两种统计方式给出相同的文本：{REP1_SAME}")

# %% [markdown]
# **What it shows.** SmolLM2-135M-*Instruct* gives another "Paris" after "Paris Paris
# ..." the probability printed above, so the count of "Paris" is what the run prints,
# not necessarily the incident's loop (the incident ran the base SmolLM2-135M). What
# the bug does is visible in the distribution: on the first step the buggy accounting
# leaves the prompt's tokens unpenalised (P(Paris) back to its unpenalised value, the TV
# column), and from the second step on it subtracts the frequency and presence
# penalties from every prompt token, so on the chat prompt the words of the question
# ("capital", "France") are pushed down; the texts the bug changed are counted above.
# Repetition penalty 1.0 is the identity, so the two accountings cannot differ with it
# (the run checks the texts).
#
# ## 3. The filter order: top-k then top-p
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
say(f"top-k alone (k=20, no top-p): TV max {float(only_k.max()):.1e} (the order cannot matter)",
    f"只用 top-k（k=20，没有 top-p）：TV 最大值 {float(only_k.max()):.1e}（顺序不可能有影响）")

# %% [markdown]
# The planted engine-level fault can give other tokens to seeded requests that use both
# filters (the first divergence is printed; None means it did not in 16 tokens), and
# cannot change requests with only one of them:

# %%
q_ids = chat("Write a short poem about the sea.")
both = SamplingParams(temperature=1.0, top_k=50, top_p=0.8, seed=11, max_tokens=16)
konly = SamplingParams(temperature=1.0, top_k=50, seed=11, max_tokens=16)
ok = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": q_ids}] * 2, [both, konly], use_tqdm=False)]
with faults.top_p_before_top_k(llm):
    bad = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": q_ids}] * 2, [both, konly], use_tqdm=False)]
order_div = [metrics.first_divergence(a, b) for a, b in zip(ok, bad)]
say(f"first divergence, top_k+top_p: {order_div[0]}; top_k only: {order_div[1]} (None: equal)",
    f"首次分歧位置，top_k+top_p：{order_div[0]}；只用 top_k：{order_div[1]}（None：相同）")

# %% [markdown]
# ## 4. Seeds: alone versus in a batch, on chapter 5's compositions
#
# A seeded request draws its exponentials from its own `torch.Generator`
# (`random_sample`), so its random stream does not depend on the batch. Its
# *probabilities* come from logits that, in this engine, can depend on what else is in
# the batch: chapter 5 (sections 2 to 4) finds where (decode attention over padded keys,
# and on some CPUs the bfloat16 GEMM from 33 rows on) and uses three short completion
# prompts beside a 30-token one, a composition that can change their greedy text in
# bfloat16 (chapter 5 section 2 counts how many on your CPU). The same composition
# here, each short prompt **sampled** with its own seed (temperature 0.8, 16 tokens):
# alone, then all three in one batch with chapter 5's 30-token prompt; on a bfloat16
# engine (what `dtype="auto"` gives on CPU) and in float32; where bfloat16 changed a
# sample, also on a bfloat16 engine with `batch_invariant=True` (the EngineArgs field
# behind `VLLM_BATCH_INVARIANT`, chapter 5 section 5), which is slow on a CPU and is
# built only then.

# %%
SHORTS = ["Dear diary, today I", "Scientists have discovered that", "Python is a language"]  # chapter 5
LONG = ("Summarize the plot of a famous novel about a whale and a captain who hunts it "
        "across the oceans of the world, in three short sentences.")
SEEDED = [SamplingParams(temperature=0.8, seed=100 + i, max_tokens=16, ignore_eos=True) for i in range(3)]
LONG_SP = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


def alone_vs_batch(engine):
    """Each short prompt's seeded sample alone, and the same requests in one batch with LONG."""
    alone = [engine.generate(s, sp)[0].outputs[0].token_ids for s, sp in zip(SHORTS, SEEDED)]
    batch = engine.generate(SHORTS + [LONG], SEEDED + [LONG_SP])
    return alone, [o.outputs[0].token_ids for o in batch[:len(SHORTS)]]


t4 = time.perf_counter()
seed_rows, alones = {}, {}
BI = "bfloat16, batch_invariant=True"
for name in ["bfloat16", BI, "float32"]:
    if name == BI and not any(d is not None for d in seed_rows["bfloat16"]):
        continue  # nothing for the batch-invariant engine to fix: not built (it is slow on CPU)
    engine = llm if name == "float32" else LLM(MODEL, dtype="bfloat16", batch_invariant=name == BI, **KW)
    alone, batched = alone_vs_batch(engine)
    divs = [metrics.first_divergence(a, b) for a, b in zip(alone, batched)]
    seed_rows[name], alones[name] = divs, alone
    say(f"{name:32s} seeded samples changed by the batch: {sum(d is not None for d in divs)} of "
        f"{len(SHORTS)} (first divergences {divs}; None: all 16 tokens equal)",
        f"{name:32s} 被批次改变的带种子采样：{len(SHORTS)} 个中有 "
        f"{sum(d is not None for d in divs)} 个（首次分歧位置 {divs}；None：16 个 token 全部相同）")
    if name == "bfloat16":
        for s, a, b, d in zip(SHORTS, alone, batched, divs):
            if d is not None:
                print(f"   {s!r}\n      alone:   {tok.decode(a)!r}\n      batched: {tok.decode(b)!r}")
again = llm.generate(SHORTS[0], SEEDED[0])[0].outputs[0].token_ids  # the same request alone, again
SEED_REPRO = again == alones["float32"][0]
n_seed = {k: sum(d is not None for d in v) for k, v in seed_rows.items()}
say(f"float32, the same seeded request alone twice: equal {SEED_REPRO}",
    f"float32，同一个带种子的请求单独运行两次：相同 {SEED_REPRO}")
if n_seed["bfloat16"] and not n_seed[BI]:
    say("verdict: the seed fixed the random stream, the batch moved the probabilities; the "
        "batch-invariant engine gave every seeded sample its alone tokens",
        "结论：随机种子固定了随机数流，批次改变了概率；批不变的引擎让每个带种子的采样都得到了"
        "单独运行时的 token")
elif n_seed["bfloat16"]:
    say("verdict: the batch changed seeded samples even on the batch-invariant engine",
        "结论：即使在批不变的引擎上，批次也改变了带种子的采样")
else:
    say("verdict: null on this CPU: no seeded sample changed in bfloat16 (no race was close "
        "enough to the batch's logit changes), so the batch-invariant engine was not needed",
        "结论：在这个 CPU 上为零结果：bfloat16 下没有带种子的采样改变（没有哪次竞赛接近到"
        "足以被批次引起的 logit 变化翻转），因此不需要批不变的引擎")
print(f"section 4: {time.perf_counter() - t4:.1f} s")

# %% [markdown]
# The verdict line is the run's. A sampled token flips only where two candidates' race
# is closer than the logit change the batch caused, so a seeded sample can survive a
# batch that changes greedy text, or flip where greedy does not; the float32 row shows
# whether float32's much smaller changes (chapter 5 section 3 prints them) flipped any
# race in this composition. The guarantee a seed gives is the random stream, not the
# probabilities; a batch-invariant engine is what makes the probabilities the same.
#
# ## 5. Where unset fields come from: `generation_config` and `override_generation_config`
#
# vLLM's `ModelConfig.get_diff_sampling_param` (`vllm/config/model.py`) builds the
# defaults for a request's **unset** sampling fields: with `generation_config="auto"`
# (the default since v0.8) from the model folder's `generation_config.json` (the fields
# `repetition_penalty`, `temperature`, `top_k`, `top_p`, `min_p`, and `max_new_tokens`
# as `max_tokens`, where they differ from transformers' defaults), with `"vllm"` from
# nothing, or from another folder's file; `override_generation_config` is merged on top
# (with `"vllm"` it is the only source). Offline these are
# `LLM.get_default_sampling_params()`, used when `generate` gets no `SamplingParams`; the
# OpenAI server fills the fields a request omits. minivllm does the same
# (`EngineArgs.generation_config`, `override_generation_config`,
# `minivllm/config.py:default_sampling_params`). A client that builds its own
# `SamplingParams` never sees them: that is lm-evaluation-harness #3154, where
# Qwen2.5-Coder's `repetition_penalty: 1.1` was not applied under vLLM while HF applied
# it (chapter 29 gates on such a change; NeMo-RL #3497 is the opposite surprise). Here a
# deployment sets section 1's penalty as its default, greedy, 20 tokens; section 1's
# chat prompts are sent once without `SamplingParams` and once with the client's own:

# %%
t5 = time.perf_counter()
gen_file = Path(llm.llm_engine.model_config.path) / "generation_config.json"
print(f"the model's generation_config.json: {json.loads(gen_file.read_text())}")
print(f"defaults it gives with generation_config='auto': {llm.llm_engine.default_sampling_params} "
      f"(so SamplingParams' own: repetition_penalty {llm.get_default_sampling_params().repetition_penalty})")
SERVED = {"temperature": 0.0, "repetition_penalty": REP, "max_new_tokens": 20}
served = LLM(MODEL, dtype="float32", override_generation_config=SERVED, **KW)
d = served.get_default_sampling_params()
print(f"override_generation_config={SERVED}: defaults temperature {d.temperature}, "
      f"repetition_penalty {d.repetition_penalty}, max_tokens {d.max_tokens}")
qa_reqs = [{"prompt_token_ids": p} for p in q_prompts]
by_default = [o.outputs[0] for o in served.generate(qa_reqs)]  # the client sets nothing
by_client = [o.outputs[0] for o in served.generate(qa_reqs, GREEDY20)]  # the client's own params
DEFAULT_IS_PEN = all(a.token_ids == b.token_ids for a, b in zip(by_default, pen))
CLIENT_IS_PLAIN = all(a.token_ids == b.token_ids for a, b in zip(by_client, plain))
n_diff = sum(a.token_ids != b.token_ids for a, b in zip(by_default, by_client))
ok_default = sum(evalsets.answer_matches(o.text, it.answers) for o, it in zip(by_default, QA))
ok_client = sum(evalsets.answer_matches(o.text, it.answers) for o, it in zip(by_client, QA))
say(f"no SamplingParams (the defaults): answers identical to section 1's rep {REP}: "
    f"{DEFAULT_IS_PEN}; correct {ok_default}/{len(QA)}",
    f"不带 SamplingParams（使用默认值）：回答与第 1 节 rep {REP} 的相同："
    f"{DEFAULT_IS_PEN}；正确 {ok_default}/{len(QA)}")
say(f"the client's SamplingParams(temperature=0, max_tokens=20): answers "
    f"identical to section 1's unpenalised ones: {CLIENT_IS_PLAIN}; correct {ok_client}/{len(QA)}",
    f"客户端自己的 SamplingParams(temperature=0, max_tokens=20)：回答"
    f"与第 1 节未受惩罚的相同：{CLIENT_IS_PLAIN}；正确 {ok_client}/{len(QA)}")
say(f"answers that differ between the two clients of the same server: {n_diff}/{len(QA)}",
    f"同一服务端的两个客户端之间不同的回答：{n_diff}/{len(QA)}")
print(f"section 5: {time.perf_counter() - t5:.1f} s")

# %% [markdown]
# ## 6. Temperature versus quantization
#
# The seed claim: temperature 0 vs 0.8 differs more than quantization does. Both on the
# same 33 corpus positions, teacher-forced (no sampling cascade): the distance between
# the float32 model at temperature 1 and 0.8 (KL), the chance that a temperature-0.8
# sample differs from the greedy token (`1 - mean p_0.8(argmax)`, the disagreement
# between temperature 0 and 0.8 per step), next to the same numbers between float32
# and int8 weights (`quantization="int8"`, per-channel, `minivllm/quantization`).

# %%
int8 = LLM(MODEL, dtype="float32", quantization="int8", **KW)
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
# Every number is printed by a cell above when the notebook runs; every verdict is
# computed from it.

# %%
r_chat_rep = [r for r in step_rows if r[0].startswith("chat") and r[1].startswith("rep")][0]
r_chat_fp = [r for r in step_rows if r[0].startswith("chat") and r[1].startswith("freq")][0]
n_ok = {k: sum(v) for k, v in correct.items()}
mean_drop, mean_drop_ex = sum(drop) / len(drop), sum(drop_ex) / len(drop_ex)


def yes(b: bool) -> Bi:
    return Bi("yes", "是") if b else Bi("no", "否")


paris_counts = ", ".join(f"{c}:{n}" for _, c, acc, n, _ in gen_rows[:6] if acc == "correct")
seed_changed = Bi(", ".join(f"{k}: {n_seed[k]}/{len(SHORTS)} changed" for k in seed_rows),
                  "；".join(f"{k}：{n_seed[k]}/{len(SHORTS)} 个改变" for k in seed_rows))
claims = [
    (Bi("TGI #1170 / transformers #26902: a repetition penalty that counts the prompt works "
        "against the chat format",
        "TGI #1170 / transformers #26902：统计提示词的重复惩罚会与对话格式作对"),
     cat(yes(len(changed) > 0 and src_count['template'] > 0),
         Bi(f": rep {REP} changed {len(changed)}/{len(QA)} "
            f"greedy answers; the token that lost the argmax was in the template in {src_count['template']}, "
            f"the question in {src_count['question']}, the output in {src_count['output']} (end of turn: "
            f"{n_eos}); correct {n_ok['none']}/{len(QA)} -> {n_ok[f'rep {REP}']}/{len(QA)}",
            f"：rep {REP} 改变了 {len(changed)}/{len(QA)} 个"
            f"贪心回答；失去 argmax 的 token 出现在模板中的有 {src_count['template']} 个，"
            f"问题中 {src_count['question']} 个，输出中 {src_count['output']} 个（轮次结束 token："
            f"{n_eos}）；正确 {n_ok['none']}/{len(QA)} -> {n_ok[f'rep {REP}']}/{len(QA)}"))),
    (Bi("the template is most of what the penalty counts", "惩罚统计的 token 大部分来自模板"),
     cat(yes(tot[0] > tot[1] + tot[2]),
         Bi(f": {tot[0]} template ids, {tot[1]} question, {tot[2]} output at the first divergences",
            f"：在首次分歧位置上，模板 id {tot[0]} 个，问题 {tot[1]} 个，输出 {tot[2]} 个"))
     if changed else Bi("not measured: no answer changed", "未测量：没有回答改变")),
    (Bi("the penalty costs the model's own answer log-probability; exempting the template costs less",
        "惩罚让模型自己的回答损失对数概率；豁免模板损失更少"),
     cat(yes(mean_drop > 0),
         Bi(f": {mean_drop:.2f} nats lost on average with rep {REP}; template exempt {mean_drop_ex:.2f} (",
            f"：rep {REP} 时平均损失 {mean_drop:.2f} nats；豁免模板时 {mean_drop_ex:.2f}（"),
         yes(mean_drop_ex < mean_drop),
         Bi(f", correct {n_ok[f'rep {REP}, template exempt']}/{len(QA)})",
            f"，正确 {n_ok[f'rep {REP}, template exempt']}/{len(QA)}）"))),
    (Bi("#69: repetition penalty must see the prompt on step 1", "#69：重复惩罚在第 1 步就必须看到提示词"),
     cat(Bi(f"chat prompt, rep 1.3: P(Paris) {r_chat_rep[3]:.2e} correct vs {r_chat_rep[4]:.2e} buggy, "
            f"TV {r_chat_rep[5]:.4f} (",
            f"对话提示词，rep 1.3：P(Paris) 正确为 {r_chat_rep[3]:.2e}，有 bug 为 {r_chat_rep[4]:.2e}，"
            f"TV {r_chat_rep[5]:.4f}（"),
         yes(r_chat_rep[5] > 0), Bi(")", "）"))),
    (Bi("#69: frequency/presence must not count the prompt", "#69：频率/存在惩罚不得统计提示词"),
     Bi(f"chat prompt, step 2: TV {r_chat_fp[5]:.4f}; greedy texts changed {n_changed}/{len(reqs)}",
        f"对话提示词，第 2 步：TV {r_chat_fp[5]:.4f}；贪心文本改变 {n_changed}/{len(reqs)}")),
    (Bi("#69 repro: 'Paris Paris ...' repeats 'Paris'", "#69 复现：'Paris Paris ...' 会重复 'Paris'"),
     cat(yes(any(n > 0 for _, _, acc, n, _ in gen_rows[:6] if acc == 'correct')),
         Bi(f" on the Instruct model: 'Paris' count {paris_counts} (completion prompt)",
            f"（Instruct 模型）：'Paris' 次数 {paris_counts}（补全提示词）"))),
    ("PR #1885: [.1,.2,.3,.4], k=2, p=0.5 -> [0,0,0,1] vs [0,0,.475,.525]",
     f"{[round(x, 3) for x in right[0].tolist()]} vs {[round(x, 3) for x in wrong[0].tolist()]}"),
    (Bi("the filter order matters on real logits", "在真实 logits 上过滤顺序有影响"),
     cat(yes(float(tv_grid.min()) > 0),
         Bi(f": mean TV {float(tv_grid.min()):.4f}..{float(tv_grid.max()):.4f} over the (k, p) grid; "
            "with one filter ",
            f"：在 (k, p) 网格上平均 TV 为 {float(tv_grid.min()):.4f}..{float(tv_grid.max()):.4f}；"
            "只用一种过滤时"),
         yes(float(only_k.max()) > 0),
         Bi(f" (max {float(only_k.max()):.0e})", f"（最大值 {float(only_k.max()):.0e}）"))),
    (Bi("a per-request seed reproduces a sample alone", "单独运行时，按请求设置的随机种子能复现一次采样"),
     cat(yes(SEED_REPRO), Bi(" (float32, run twice)", "（float32，运行两次）"))),
    (Bi("PR #2514: batch composition can still change a seeded sample (chapter 5's compositions)",
        "PR #2514：批次组合仍可能改变带种子的采样（第 5 章的组合）"),
     seed_changed),
    (Bi("a model's generation-config defaults apply where the client leaves fields unset",
        "模型 generation-config 中的默认值作用于客户端未设置的字段"),
     cat(yes(DEFAULT_IS_PEN),
         Bi(f": override_generation_config's penalty gave section 1's rep {REP} answers",
            f"：override_generation_config 的惩罚给出了第 1 节 rep {REP} 的回答"))),
    (Bi("lm-eval #3154: a client's own SamplingParams bypass them",
        "lm-eval #3154：客户端自己的 SamplingParams 会绕过它们"),
     cat(yes(CLIENT_IS_PLAIN),
         Bi(f": the same server gave the unpenalised answers; {n_diff}/{len(QA)} "
            "answers differ between the two clients",
            f"：同一服务端给出了未受惩罚的回答；两个客户端之间有 {n_diff}/{len(QA)} "
            "个回答不同"))),
    (Bi("seed claim: T=0 vs 0.8 differs more than quantization",
        "种子课程的论断：T=0 与 0.8 之间的差异比量化更大"),
     cat(yes(kl_temp > kl_quant and disagree_temp > disagree_quant),
         Bi(f": KL {kl_temp:.4f} vs {kl_quant:.4f} "
            f"nats; disagreement {disagree_temp:.3f} vs {disagree_quant:.3f}",
            f"：KL {kl_temp:.4f} 对 {kl_quant:.4f} "
            f"nats；不一致率 {disagree_temp:.3f} 对 {disagree_quant:.3f}"))),
]
claims_table(claims)

# %% [markdown]
# **Misconceptions.**
#
# - *"Repetition penalty is about what the model generated."* In vLLM (and HF) it is
#   about the prompt **and** the output: with a chat template that includes the role
#   markers, the end-of-turn token and the system prompt. Section 1 counts them and, for
#   each changed answer, whether the token that lost came from the template, the question
#   or the output; frequency and presence count the output only.
# - *"A small repetition penalty only stops loops."* A penalty lowers every seen token's
#   logit at every step, from the first; a short answer that repeats the question's
#   words or ends its turn pays it too (section 1's lost tokens).
# - *"top-k and top-p commute."* They do not when both are set: top-p after top-k
#   measures mass on the renormalised survivors. With one of them set, the order is
#   irrelevant (TV exactly 0 above).
# - *"A seed makes sampling deterministic."* It fixes the random stream; the
#   probabilities it races against can still depend on the batch (chapter 5) unless the
#   arithmetic is batch-invariant. Section 4 counts the seeded samples a batch changed.
# - *"The model's `generation_config.json` decides how it samples."* Only the fields a
#   request leaves unset, and only in an engine that reads it (`generation_config="auto"`);
#   a client that builds `SamplingParams` itself gets its own values (section 5).
# - *"Penalty 1.0 is 'a little' penalty."* It is the identity.
# - *"Temperature is a small knob next to numerics."* Section 6 puts the two side by side.
#
# ## On real vLLM
#
# - Sampling defaults: `--generation-config auto` (the default since v0.8: the model
#   folder's `generation_config.json`), `vllm` (SamplingParams' own defaults) or a
#   folder; `--override-generation-config '{"repetition_penalty": 1.0}'` on top
#   (vllm PR #12409). The server logs "Using default chat sampling params from model: ..." at
#   start (vllm #15622): read it, and `LLM.get_default_sampling_params()` offline.
# - `SamplingParams`: `repetition_penalty` (prompt and output), `frequency_penalty` and
#   `presence_penalty` (output only), `temperature`, `top_k`, `top_p`, `min_p`, `seed`
#   (per request), `logprobs`; a client that sets a field overrides the model's default,
#   a field it omits takes it. No vLLM option exempts template tokens from
#   `repetition_penalty` (TGI #1170 asked): use frequency/presence penalties when only
#   the output should count (the main branch checked also has `repetition_detection`,
#   which ends a request on a repeated n-gram without touching the logits).
# - A seeded sample is guaranteed to reproduce across batches only with batch-invariant
#   arithmetic: `VLLM_BATCH_INVARIANT=1` (chapter 5); otherwise only within the same
#   batch (section 4 counts whether this engine's batches changed any sample).
# - Checked against vLLM's source (2025-2026 main): `vllm/model_executor/layers/utils.py`
#   (`apply_penalties`: `prompt_mask | output_mask` for repetition, output counts for
#   frequency and presence), `vllm/v1/sample/ops/penalties.py`, `vllm/config/model.py`
#   (`generation_config`, `override_generation_config`, `get_diff_sampling_param`) and
#   the `SamplingParams` docs. This engine differs: penalties run in float32 on the CPU
#   in `penalties_ref` (vLLM uses a custom op for the repetition penalty), a seeded
#   request gets its own `torch.Generator` on the CPU, and the generation config is read
#   with transformers' `GenerationConfig` the same way but only for the six fields above.

# %%
print(f"chapter 20 ran in {time.perf_counter() - T0:.0f} s")
