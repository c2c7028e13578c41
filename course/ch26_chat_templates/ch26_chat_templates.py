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
# # Chapter 26. Chat templates, BOS tokens, truncation and max_model_len
#
# **Learning goals.** After this chapter you can
#
# 1. say which token ids a chat request really starts from: what the chat template
#    writes (special tokens, a default system prompt, the generation prompt) and what the
#    tokenizer adds on top (a BOS, or nothing);
# 2. recognise a doubled BOS by its signature (a small, systematic rise in the loss of
#    every answer, not noise) and avoid it: render the template, then tokenize with
#    `add_special_tokens=False`;
# 3. handle prompts that do not fit: `max_model_len` refuses them (it never truncates);
#    vLLM's `truncate_prompt_tokens=k` keeps the **last** k tokens; cutting the other
#    side, or cutting through the system prompt, costs accuracy, measured here.
#
# **The incidents.** **vllm PR #16976** "Fix doubling of BOS token
# when BOS already exists" (2025-04-22): `LLM.chat` with Llama-3.1-8B-Instruct rendered
# the chat template (which already starts with `<|begin_of_text|>`) and then tokenized
# the text with `add_special_tokens=True`, so prompts began `[128000, 128000, ...]`. **huggingface/trl #3853**
# (2025-08-06): GRPO rewards fell with vLLM against HF for this reason.
# **vllm-project/tpu-inference PR #1380** (2025-12-30): lm-eval 0.4.9.2 stopped forcing
# `add_bos_token=False` and GSM8K fell, Llama-3.3-70B 0.90 -> 0.76, Llama-3.1-8B
# 0.75 -> 0.71. **princeton-pli/retaining-by-doing #5** (2026-05-20): removing the double
# BOS raised Llama-3.1-8B MMLU by about 6 points. The mirror case, **sglang PR #888**
# (2024-08-02), fixed the same problem by tokenizing inside `apply_chat_template`.
# Links: https://github.com/vllm-project/vllm/pull/16976,
# https://github.com/huggingface/trl/issues/3853,
# https://github.com/vllm-project/tpu-inference/pull/1380,
# https://github.com/sgl-project/sglang/pull/888.
#
# Seed 002's "回答不准" (inaccurate answers) checklist names the same three suspects:
# the template, the system prompt, truncation; and it warns that `--max-model-len` is a
# limit, not automatic truncation.
#
# Everything below is measured when the notebook runs, on the embedded
# SmolLM2-135M-Instruct with minivllm on this machine's CPU, in float32 (so nothing here
# is rounding: every difference comes from the token ids). The prompt-processing steps
# are on the step registry like the numeric ones: `"prompt.chat_template"` (render, then
# tokenize) and `"prompt.truncate"` (what `truncate_prompt_tokens` keeps).

# %%
# %matplotlib inline
import time

import torch
from matplotlib.figure import Figure

from minivllm import LLM, SamplingParams
from minivllm.i18n import Bi, claims_table, say
from minivllm.precision import evalsets, faults, metrics
from minivllm.tokenizer import render_chat_ref

T0 = time.perf_counter()
MAX_LEN = 192    # small on purpose: the 10-turn conversations below (~850 tokens) do not fit
N_QA = 12        # QA items for the BOS measurements
N_TRUNC = 6      # QA items asked at the end of a long conversation
llm = LLM("smollm2-135m-instruct", dtype="float32", max_model_len=MAX_LEN)
tok = llm.get_tokenizer()
qa = evalsets.load_qa()
GREEDY = SamplingParams(temperature=0, max_tokens=12)

# %% [markdown]
# ## 1. What the tokenizer adds, and what the template writes
#
# Many tokenizers put a BOS token in front of every text they encode (Llama-3's adds
# `<|begin_of_text|>`). SmolLM2's does not. Its `bos_token` is `<|im_start|>` (id 1),
# the token the chat template writes at the start of **every** message; and when the
# conversation has no system message, the template writes one.

# %%
conv = [{"role": "user", "content": "What is the capital of France?"}]
text = tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
ids = render_chat_ref(tok, conv, True, None)
print("bos_token:", repr(tok.bos_token), tok.bos_token_id)
print("encode('Hello'):", tok.encode("Hello"), " add_special_tokens=False:",
      tok.encode("Hello", add_special_tokens=False))
print("rendered template:\n" + text)
say(f"{len(ids)} ids; first five {ids[:5]}; id 1 appears {ids.count(1)} times "
    f"(once per message, including the generation prompt)",
    f"{len(ids)} 个 id；前五个 {ids[:5]}；id 1 出现 {ids.count(1)} 次"
    f"（每条消息一次，包括生成提示）")
bos_llama_like = faults.bos_adding_tokenizer(tok)
print("a tokenizer that adds BOS (Llama-3 style), encode('Hello'):",
      bos_llama_like.encode("Hello"))

# %% [markdown]
# So with this model the double BOS **cannot** happen through the tokenizer: encoding the
# rendered text with or without special tokens gives the same ids. It happens with a
# tokenizer that adds a BOS (Llama-3's). To measure what it does, we plant it: the fault
# `faults.doubled_bos(llm)` swaps the `"prompt.chat_template"` step for one that tokenizes
# the rendered text with `add_special_tokens=True` through a BOS-adding copy of the
# tokenizer (vLLM before PR #16976), so every prompt starts with `<|im_start|>` twice.
# The engine's own step renders, then tokenizes with `add_special_tokens=False`.

# %%
convs = [evalsets.qa_prompt(q.question) for q in qa[:N_QA]]
with faults.doubled_bos(llm):
    bad_prompts = [o.prompt_token_ids for o in llm.chat(convs, SamplingParams(max_tokens=1))]
good_prompts = [render_chat_ref(tok, c, True, None) for c in convs]
print("engine prompt under the fault:", bad_prompts[0][:6], "...")
print("reference prompt:             ", good_prompts[0][:6], "...")
assert all(b == [1] + g for b, g in zip(bad_prompts, good_prompts))

# %% [markdown]
# ## 2. The doubled BOS, measured: 0, 1, 2 leading start tokens
#
# A sharp metric first: teacher-forced, the model reads each prompt followed by the
# reference answer (what the float32 model answers to the plain prompt) and we measure
# the answer's negative log-likelihood (NLL, nats per token) and the KL divergence of
# the next-token distributions from the 1-token prompt, over the answer positions.
# "0" drops the template's first token; "2" is the incident. All variants go through
# the engine in one batch. Then the coarse metric: greedy answers
# with 1 and 2 start tokens, checked against the accepted answers.

# %%
answers = [tok.encode(q.reference_output, add_special_tokens=False) for q in qa[:N_QA]]
variants = {0: [p[1:] for p in good_prompts], 1: good_prompts,
            2: [[1] + p for p in good_prompts]}
no_gen = [render_chat_ref(tok, c, False, None) for c in convs]
seqs, pos = [], []
for prompts in list(variants.values()) + [no_gen]:
    for p, a in zip(prompts, answers):
        seqs.append(p + a)
        pos.append(list(range(len(p) - 1, len(p) + len(a) - 1)))
rows = llm.score(seqs, positions=pos)
groups = [rows[i * N_QA:(i + 1) * N_QA] for i in range(len(variants) + 1)]
ref_rows = groups[1]


def nll(group):
    return sum(-float(r.gather(1, torch.tensor(a)[:, None]).mean())
               for r, a in zip(group, answers)) / N_QA


def mean_kl(group):
    return sum(metrics.mean_kl(r, c) for r, c in zip(ref_rows, group)) / N_QA


bos_table = {n: (nll(g), mean_kl(g), sum(metrics.top1_agreement(r, c)
                                         for r, c in zip(ref_rows, g)) / N_QA)
             for n, g in zip(variants, groups)}
nll_nogen, kl_nogen = nll(groups[-1]), mean_kl(groups[-1])
print("| leading <|im_start|> | answer NLL (nats/token) | KL vs 1 (nats) | top-1 agreement |")
print("|---|---|---|---|")
for n, (v, k, t) in bos_table.items():
    print(f"| {n} | {v:.4f} | {k:.2e} | {100 * t:.1f}% |")
print(f"| 1, no generation prompt | {nll_nogen:.4f} | {kl_nogen:.2e} | - |")

# %%
def accuracy(prompts, items, params=GREEDY):
    outs = llm.generate(prompts, params)
    texts = [o.outputs[0].text for o in outs]
    return sum(evalsets.answer_matches(t, q.answers) for t, q in zip(texts, items)), texts


acc1, texts1 = accuracy(variants[1], qa[:N_QA])
acc2, texts2 = accuracy(variants[2], qa[:N_QA])
changed = [(q.question, a, b) for q, a, b in zip(qa[:N_QA], texts1, texts2) if a != b]
say(f"greedy QA accuracy: 1 start token {acc1}/{N_QA}, 2 start tokens {acc2}/{N_QA}; "
    f"{len(changed)} of {N_QA} answers changed",
    f"贪心问答准确率：1 个起始 token {acc1}/{N_QA}，2 个起始 token {acc2}/{N_QA}；"
    f"{N_QA} 个答案中有 {len(changed)} 个改变")
for qn, a, b in changed[:3]:
    print(f"  {qn!r}: {a!r} -> {b!r}")

# %% [markdown]
# The doubled token does not break this model: it still answers. What it does is
# a shift of the whole distribution: the mean loss of the answers goes up (the printed
# NLL), and the KL is far above float32's noise floor of ~1e-11 nats (for identical ids
# this engine measures exactly 0), while greedy answers change rarely, if at all (the
# count above). On a 135M model answering one-line questions this is
# a small effect; on Llama-3.3-70B and GSM8K (long chains of reasoning, where one changed
# token can derail the rest) it was 14 points. Missing the generation prompt is a far
# larger change: the model is not told that the assistant speaks next, so it first
# writes the role header itself (section 5 shows the text).
#
# ## 3. max_model_len is a limit, not truncation
#
# A 10-turn conversation from the bundled set, followed by a question, is ~900 tokens.
# The engine here has `max_model_len=192`. Without `truncate_prompt_tokens` it refuses
# the request with a clear error, and the server answers 400; nothing is cut silently.

# %%
convs_long = evalsets.load_conversations()
items = qa[40:40 + N_TRUNC]
long_chats = [convs_long[i % len(convs_long)] + evalsets.qa_prompt(q.question)
              for i, q in enumerate(items)]
long_ids = [render_chat_ref(tok, c, True, None) for c in long_chats]
print("prompt lengths:", [len(p) for p in long_ids])
refused = False  # does the engine refuse the too-long prompt (instead of cutting it)?
try:
    llm.generate(long_ids[:1], GREEDY)
except ValueError as e:
    refused = True
    print("ValueError:", e)

# %% [markdown]
# ## 4. Truncation: which side, and through what
#
# Four ways to make these prompts fit, each measured by QA accuracy on the final
# question (greedy, 12 tokens):
#
# * **left** (vLLM's `truncate_prompt_tokens=k` with k = `max_model_len - max_tokens`,
#   so the answer has room: the last k tokens); the prompt now starts in the middle of
#   an old message, and the system prompt is gone;
# * **right** (the first tokens; transformers' default `truncation_side="right"`, planted
#   as `faults.right_truncation` on the `"prompt.truncate"` step): the question and the
#   generation prompt are cut off;
# * **by turns** (the fix for chat): drop the oldest user/assistant pairs, keep the system
#   message, re-render, until it fits;
# * the question **alone** (the reference: what the model answers with no history).

# %%
def truncate_conversation(conv, max_tokens):
    """Drop the oldest non-system messages until the rendered prompt has at most
    ``max_tokens`` ids; the system message (if any) and the last user message stay.
    Raises ValueError when even that does not fit."""
    system = [m for m in conv[:1] if m["role"] == "system"]
    rest = conv[len(system):]
    while True:
        ids = render_chat_ref(tok, system + rest, True, None)
        if len(ids) <= max_tokens:
            return ids
        if len(rest) <= 1:
            raise ValueError(f"the last message alone renders to {len(ids)} tokens, more "
                             f"than {max_tokens}")
        rest = rest[2:] if rest[0]["role"] == "user" and len(rest) > 2 else rest[1:]


room = MAX_LEN - GREEDY.max_tokens
left = SamplingParams(temperature=0, max_tokens=12, truncate_prompt_tokens=room)
strategies = {}
strategies[f"left (truncate_prompt_tokens={room})"] = llm.generate(long_ids, left)
with faults.right_truncation(llm):
    strategies["right (first tokens)"] = llm.generate(long_ids, left)
by_turns = [truncate_conversation(c, room) for c in long_chats]
strategies["by turns, system kept"] = llm.generate(by_turns, GREEDY)
strategies["question alone"] = llm.generate(
    [render_chat_ref(tok, evalsets.qa_prompt(q.question), True, None) for q in items], GREEDY)
trunc_acc = {}
for name, outs in strategies.items():
    ok = sum(evalsets.answer_matches(o.outputs[0].text, q.answers) for o, q in zip(outs, items))
    trunc_acc[name] = ok
    lens = sorted({len(o.prompt_token_ids) for o in outs})
    print(f"{name:34s} accuracy {ok}/{N_TRUNC}  prompt lengths {lens[0]}..{lens[-1]}  "
          f"first answer {outs[0].outputs[0].text!r}")
LEFT = f"left (truncate_prompt_tokens={room})"
left_first = strategies[LEFT][0].prompt_token_ids
print("\nleft-truncated prompt starts:", repr(tok.decode(left_first[:12])))
kept_left = 1 == left_first[0] and tok.decode(left_first[:3]) == "<|im_start|>system\n"
kept_turns = tok.decode(by_turns[0][:3]) == "<|im_start|>system\n"
say(f"system prompt kept? left: {kept_left} | by turns: {kept_turns}",
    f"系统提示词是否保留？左侧截断：{kept_left} | 按轮次截断：{kept_turns}")
right_first = strategies["right (first tokens)"][0].prompt_token_ids
print("right-truncated prompt ends:", repr(tok.decode(right_first[-12:])))
minus1 = llm.generate(long_ids[:1], SamplingParams(temperature=0, max_tokens=12,
                                                   truncate_prompt_tokens=-1))[0]
say(f"truncate_prompt_tokens=-1: prompt {len(minus1.prompt_token_ids)} tokens, answer "
    f"{minus1.outputs[0].text!r} ({len(minus1.outputs[0].token_ids)} token, finish_reason "
    f"{minus1.outputs[0].finish_reason!r}): no room left for the answer",
    f"truncate_prompt_tokens=-1：提示词 {len(minus1.prompt_token_ids)} 个 token，答案 "
    f"{minus1.outputs[0].text!r}（{len(minus1.outputs[0].token_ids)} 个 token，finish_reason "
    f"{minus1.outputs[0].finish_reason!r}）：没有给答案留下空间")

# %% [markdown]
# Left truncation keeps the question and the generation prompt, so the model can still
# answer; it silently loses the system prompt and starts the context in the middle of an
# old message. Right truncation keeps the start of the conversation and loses what the
# request was about: the model answers a question nobody asked now. Truncating by turns
# keeps the template well-formed and the system prompt in place.

# %%
fig = Figure(figsize=(10, 3.6), layout="constrained")
ax1, ax2 = fig.subplots(1, 2)
ns = list(bos_table)
ax1.bar([str(n) for n in ns] + ["1, no gen.\nprompt"],
        [bos_table[n][0] for n in ns] + [nll_nogen], color=["#999", "#2a7", "#d62", "#a21"])
ax1.set_yscale("log")
ax1.axhline(bos_table[1][0], color="#2a7", lw=0.8, ls="--")
ax1.set_xlabel("leading <|im_start|> tokens (1 = the template's own)")
ax1.set_ylabel("answer NLL (nats/token)")
ax1.set_title(f"Doubled BOS: answer loss, {N_QA} QA items")
names = list(trunc_acc)
ax2.barh(names, [trunc_acc[n] for n in names], color=["#47a", "#d62", "#2a7", "#999"])
ax2.set_xlim(0, N_TRUNC)
ax2.set_xlabel(f"correct answers of {N_TRUNC}")
ax2.set_title(f"~900-token chats in max_model_len={MAX_LEN}")
ax2.invert_yaxis()
fig

# %% [markdown]
# ## 5. The fix, measured
#
# The engine's `"prompt.chat_template"` step renders to text and tokenizes with
# `add_special_tokens=False` (`LLM.chat` and the server do this), so even the BOS-adding
# tokenizer gives one start token; transformers' own `apply_chat_template(tokenize=True)`
# does the same (sglang PR #888's fix). For length: pass `truncate_prompt_tokens` only
# when cutting is acceptable, and for chats cut by turns before rendering.

# %%
from minivllm.tokenizer import render_chat_ref as engine_step  # noqa: E402

fixed = [engine_step(bos_llama_like, c, True, None) for c in convs]
hf_ids = bos_llama_like.apply_chat_template(convs[0], tokenize=True, add_generation_prompt=True)
hf_ids = list(hf_ids["input_ids"] if not isinstance(hf_ids, list) else hf_ids)
say(f"engine step with the BOS-adding tokenizer == reference ids: {fixed == good_prompts}",
    f"使用会添加 BOS 的分词器时，引擎的步骤 == 参考 id：{fixed == good_prompts}")
say(f"transformers apply_chat_template(tokenize=True) == reference: {hf_ids == good_prompts[0]}",
    f"transformers apply_chat_template(tokenize=True) == 参考：{hf_ids == good_prompts[0]}")
no_gen_text = llm.generate([no_gen[0]], GREEDY)[0].outputs[0].text
say(f"without the generation prompt, the model writes the header itself: {no_gen_text!r}",
    f"没有生成提示时，模型自己写出了角色头：{no_gen_text!r}")

# %% [markdown]
# ## 6. Claim vs measurement

# %%
d_nll = 100 * (bos_table[2][0] / bos_table[1][0] - 1)
_nll_0, _nll_1 = bos_table[0][0], bos_table[1][0]
_sys = 'You are a helpful AI assistant named SmolLM' in text
_enc, _enc_plain = tok.encode('Hello'), tok.encode('Hello', add_special_tokens=False)
no_bos = _enc == _enc_plain and tok.bos_token_id not in _enc
keeps_last = all(o.prompt_token_ids == p[-room:] for o, p in zip(strategies[LEFT], long_ids))
minus1_ok = minus1.prompt_token_ids == long_ids[0][-(MAX_LEN - 1):]


def join(*parts):
    """One text from Bi parts and plain strings, in both languages."""
    return Bi("".join(getattr(p, "en", p) for p in parts),
              "".join(getattr(p, "zh", p) for p in parts))


claims_table([
    (Bi("SmolLM2's tokenizer adds no BOS (course plan)", "SmolLM2 的分词器不添加 BOS（课程计划）"),
     join(Bi(f"{'yes' if no_bos else 'no'}: encode('Hello') = ",
             f"{'是' if no_bos else '否'}：encode('Hello') = "),
          Bi(f"{_enc} with or without special tokens",
             f"{_enc}（无论带不带特殊 token）") if _enc == _enc_plain else
          Bi(f"{_enc} with special tokens, {_enc_plain} without",
             f"{_enc}（带特殊 token），不带时为 {_enc_plain}"),
          Bi(f"; its bos_token is "
             f"<\\|im_start\\|> (id {tok.bos_token_id}), written by the template",
             f"；它的 bos_token 是 "
             f"<\\|im_start\\|>（id {tok.bos_token_id}），由模板写入"))),
    (Bi("its template injects a default system prompt", "它的模板会注入一条默认的系统提示词"),
     Bi(f"{'yes' if _sys else 'no'}: {_sys} for a conversation without one",
        f"{'是' if _sys else '否'}：对没有系统提示词的对话为 {_sys}")),
    (Bi("a double BOS costs accuracy (vllm PR #16976; GSM8K 0.90 -> 0.76 on "
        "Llama-3.3-70B, tpu-inference PR #1380)",
        "重复的 BOS 会损失准确率（vllm PR #16976；Llama-3.3-70B 上 GSM8K 0.90 -> 0.76，"
        "tpu-inference PR #1380）"),
     join(Bi(f"planted here (this tokenizer cannot do it): "
             f"answer NLL {bos_table[1][0]:.3f} -> {bos_table[2][0]:.3f} nats/token "
             f"({d_nll:+.0f}%), KL {bos_table[2][1]:.1e} nats, greedy QA {acc1}/{N_QA} -> "
             f"{acc2}/{N_QA}; a small model on one-line answers, not GSM8K: the size of the "
             f"70B drop is not reproduced here",
             f"在这里植入（这个分词器本身不会这样）："
             f"答案 NLL {bos_table[1][0]:.3f} -> {bos_table[2][0]:.3f} nats/token"
             f"（{d_nll:+.0f}%），KL {bos_table[2][1]:.1e} nats，贪心问答 {acc1}/{N_QA} -> "
             f"{acc2}/{N_QA}；这是一个小模型回答单行问题，不是 GSM8K：这里没有复现 "
             f"70B 下降的幅度"),
          Bi(", its direction is (the answers' loss rises)", "，但复现了方向（答案的损失上升）")
          if d_nll > 0 else
          Bi(", nor its direction (the answers' loss does not rise)", "，也没有复现方向（答案的损失没有上升）"),
          "" if acc2 < acc1 else Bi("; no answer flips", "；没有答案翻转"))),
    (Bi("removing the double BOS: +6 MMLU points (retaining-by-doing #5)",
        "去掉重复的 BOS：MMLU +6 分（retaining-by-doing #5）"),
     join(Bi(f"not measured "
             f"(no MMLU here); removing the template's own start token moves the distribution "
             f"(KL {bos_table[0][1]:.1e}) at answer NLL {_nll_0:.3f} against {_nll_1:.3f} with it ",
             f"没有测量"
             f"（这里没有 MMLU）；去掉模板自己的起始 token 会使分布移动"
             f"（KL {bos_table[0][1]:.1e}），答案 NLL 为 {_nll_0:.3f}，保留它时为 {_nll_1:.3f}"),
          Bi("(higher)", "（更高）") if _nll_0 > _nll_1 * 1.01 else
          Bi("(lower)", "（更低）") if _nll_0 < _nll_1 * 0.99 else
          Bi("(about the same)", "（大致相同）"))),
    (Bi("max-model-len is not auto-truncation (seed 002)", "max-model-len 不是自动截断（种子课程 002）"),
     Bi(f"{'yes' if refused else 'no'}: a {len(long_ids[0])}-token "
        f"prompt {'raises ValueError' if refused else 'is accepted without an error'} at "
        f"max_model_len={MAX_LEN}{' (400 in the server)' if refused else ''}",
        f"{'是' if refused else '否'}：一个 {len(long_ids[0])} token 的"
        f"提示词在 max_model_len={MAX_LEN} 时"
        f"{'抛出 ValueError' if refused else '被接受，没有报错'}{'（服务端返回 400）' if refused else ''}")),
    (Bi("truncate_prompt_tokens keeps the last k tokens (vLLM)",
        "truncate_prompt_tokens 保留最后 k 个 token（vLLM）"),
     join(Bi(f"{'yes' if keeps_last else 'no'}: k={room} kept "
             f"{'the last' if keeps_last else 'not the last k but'} {len(left_first)} tokens",
             f"{'是' if keeps_last else '否'}：k={room} 保留了"
             f"{'最后' if keeps_last else '并非最后的'} {len(left_first)} 个 token"),
          Bi(f", accuracy {trunc_acc[LEFT]}/{N_TRUNC}, system prompt ",
             f"，准确率 {trunc_acc[LEFT]}/{N_TRUNC}，系统提示词"),
          Bi("kept", "保留了") if kept_left else Bi("gone", "没了"),
          Bi(f"; -1 kept {len(minus1.prompt_token_ids)} = max_model_len - 1 and left room for "
             f"{len(minus1.outputs[0].token_ids)} generated token",
             f"；-1 保留了 {len(minus1.prompt_token_ids)} = max_model_len - 1 个，只给 "
             f"{len(minus1.outputs[0].token_ids)} 个生成的 token 留出了空间") if minus1_ok else
          Bi(f"; -1 kept {len(minus1.prompt_token_ids)} tokens, not the last max_model_len - 1",
             f"；-1 保留了 {len(minus1.prompt_token_ids)} 个 token，不是最后 max_model_len - 1 个"))),
    (Bi("truncating the wrong side loses the question", "截错一侧会丢掉问题"),
     Bi(f"right truncation: "
        f"{trunc_acc['right (first tokens)']}/{N_TRUNC}",
        f"右侧截断："
        f"{trunc_acc['right (first tokens)']}/{N_TRUNC}")),
    (Bi("truncate by turns, keep the system prompt (course plan's fix)",
        "按轮次截断，保留系统提示词（课程计划中的修复）"),
     Bi(f"{trunc_acc['by turns, system kept']}/{N_TRUNC} (question alone: "
        f"{trunc_acc['question alone']}/{N_TRUNC})",
        f"{trunc_acc['by turns, system kept']}/{N_TRUNC}（只有问题时："
        f"{trunc_acc['question alone']}/{N_TRUNC}）")),
    (Bi("a missing add_generation_prompt", "缺少 add_generation_prompt"),
     Bi(f"answer NLL {bos_table[1][0]:.3f} -> "
        f"{nll_nogen:.3f}, KL {kl_nogen:.2f} nats: the largest template effect measured here",
        f"答案 NLL {bos_table[1][0]:.3f} -> "
        f"{nll_nogen:.3f}，KL {kl_nogen:.2f} nats：这里测得的最大的模板效应")),
], header=(Bi("claim", "论断"), Bi("what we measured here", "本次实测")))

# %% [markdown]
# ## Common misconceptions
#
# - *"The BOS is added by the tokenizer, always."* Some tokenizers add one (Llama-3),
#   some do not (SmolLM2), and chat templates usually write it themselves. Look at the
#   ids, not at the config: `tok.encode("Hello")` and the first ids of a rendered chat.
# - *"A doubled BOS would be obvious."* The answers stay fluent; on this model the greedy
#   answers hardly change (section 2 prints how many did). It shows up as a rise in the
#   answers' loss, which on a benchmark with long answers becomes points lost, not an
#   error message.
# - *"`max_model_len` truncates long prompts."* It refuses them (ValueError offline,
#   400 in the server). Truncation happens only when asked (`truncate_prompt_tokens`).
# - *"`truncate_prompt_tokens=-1` makes any prompt work."* It keeps as much prompt as
#   the context allows, which leaves no room for the answer (one token here). Choose
#   k = max_model_len - max_tokens.
# - *"Truncation is harmless if the model still answers."* Left truncation drops the
#   system prompt and starts mid-message; right truncation drops the question. Cut chats
#   by turns, keeping the system message.
# - *"The template's system prompt is optional decoration."* SmolLM2's template adds one
#   when you give none, so "no system prompt" is not the same prompt as an empty one.
#
# ## Lab
#
# `labs/source/ch26/` starts from an engine with both faults planted: the chat step
# doubles the start token (a Llama-3-like BOS-adding tokenizer tokenized with special
# tokens on), and long chats are cut on the left by `truncate_prompt_tokens`, which drops
# the system prompt. You write `render_and_tokenize` (the chat step without doubling) and
# `truncate_by_turns` (this chapter's fix: drop the oldest whole turns until the rendered
# chat fits, never the system prompt or the question, an error when even those two do
# not fit), and you decide how many prompt ids a request may keep in a context of 160 when
# it asks for 10 answer tokens. The grader checks the ids exactly on fresh conversations
# (including text that looks like special tokens) and your truncation at the budget's
# edges, then plugs both into the engine: the KL over the reference answers must be back
# to 0, and on fresh long chats every prompt must start with its system prompt and give
# the greedy answers of the grader's truncation by turns, where the left cut keeps the
# system prompt in none of them.
#
# ## On real vLLM
#
# - `--chat-template` (a file or a string) replaces the tokenizer's template. In a chat
#   request `add_special_tokens` defaults to false ("the chat template takes care of
#   adding the special tokens") and `add_generation_prompt` to true; setting
#   `add_special_tokens: true` on a BOS-adding tokenizer is vllm PR #16976's doubled BOS.
# - Check the ids, not the text: the server's `/tokenize` endpoint takes `messages` too
#   and returns what a chat request becomes; count the start tokens.
# - `--max-model-len` rejects a longer prompt; `truncate_prompt_tokens=k` keeps the last
#   k tokens, which drops the system prompt first (section 4). Trim whole turns before
#   sending, as section 5 does.
# - Evaluations: vLLM's quantization guides tell lm-eval users to pass
#   `add_bos_token=True` (lm-eval does not add a BOS by default), the setting whose
#   change doubled the BOS in tpu-inference PR #1380: check whether the template already
#   writes one before you pass it.
# - Checked against vLLM's OpenAI-server docs and the request protocol
#   (`ChatCompletionRequest`, `TokenizeChatRequest`), 2025-2026. Here the chat and
#   truncation steps are `"prompt.chat_template"` and `"prompt.truncate"` on the step
#   registry, which the faults replace.

# %%
print(f"chapter 26 ran in {time.perf_counter() - T0:.0f} s")
