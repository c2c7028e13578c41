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

# %% [markdown] nbgrader={"grade": false, "grade_id": "intro", "locked": true, "schema_version": 3, "solution": false, "task": false}
# # Lab 26: the prompt a request really starts from
#
# In chapter 26 two prompt-processing bugs changed what the model read, with no rounding
# involved: a chat step that tokenized the rendered template with special tokens on put
# the start token in twice (vllm PR #16976: the answer loss rose on every item, KL ~7e-3
# nats), and a long chat cut to fit the context by its last k tokens (vLLM's
# `truncate_prompt_tokens`) lost its system prompt and started in the middle of an old
# message. This lab starts from that **broken engine**. Its tokenizer behaves like
# Llama-3's (it adds a BOS to every text encoded with special tokens; the setup cell
# builds it with `faults.bos_adding_tokenizer`), the `"prompt.chat_template"` step
# tokenizes the rendered chat with special tokens on, and long chats are cut with
# `truncate_prompt_tokens` (the left cut).
#
# You write two functions and make one decision; the grader calls the functions on
# **new** conversations and compares with the contract exactly, then plugs them into the
# engine (`llm.swap_step`) on fresh QA items and fresh long chats:
#
# 1. `render_and_tokenize(conversation, tokenizer, add_generation_prompt)`: the chat
#    step, 3 points;
# 2. `truncate_by_turns(conversation, render, budget)`: the chapter's fix for long chats,
#    drop the oldest whole turns and keep the system prompt, 4 points;
# 3. `BUDGET`: how many prompt tokens a request may keep here, a decision, 2 points;
#    then two restore checks, 2 points (the chat step) and 6 points (truncation by turns).
#
# Run the cells in order. Do not edit the setup and test cells.

# %% nbgrader={"grade": false, "grade_id": "setup", "locked": true, "schema_version": 3, "solution": false, "task": false}
import contextlib
import importlib

import grading.checks as checks  # first import: records the original functions
import torch

from minivllm import LLM, SamplingParams
from minivllm.precision import evalsets, faults, metrics
from minivllm.tokenizer import render_chat_ref

MAX_LEN = 160
ANSWER_TOKENS = 10   # every chat request in this lab asks for 10 greedy answer tokens
llm = LLM("smollm2-135m-instruct", dtype="float32", max_model_len=MAX_LEN)
smol_tok = llm.get_tokenizer()                 # SmolLM2's own: adds no BOS
tok = faults.bos_adding_tokenizer(smol_tok)    # Llama-3-like: adds <|im_start|> (id 1)
llm.llm_engine.tokenizer = tok                 # the engine now tokenizes like Llama-3's


@contextlib.contextmanager
def broken():
    """The broken chat step: it tokenizes the rendered template with special tokens on (a
    second start token). Use it as ``with broken(): ...``; outside the block the engine
    is correct."""
    with faults.doubled_bos(llm):
        yield


def render(conversation):
    """The engine's own chat step with the generation prompt: the token ids a chat
    request starts from (a list of ints)."""
    return render_chat_ref(tok, conversation, True, None)


example = [{"role": "user", "content": "What is the capital of France?"}]
with broken():
    _bad = llm.chat(example, SamplingParams(temperature=0, max_tokens=8))[0]
_good = llm.chat(example, SamplingParams(temperature=0, max_tokens=8))[0]
print("tokenizer: encode('Hello') =", tok.encode("Hello"), "(SmolLM2's own:",
      smol_tok.encode("Hello"), ")")
print("broken engine prompt starts:", _bad.prompt_token_ids[:5], "correct:",
      _good.prompt_token_ids[:5])
print("answers:", repr(_bad.outputs[0].text), "|", repr(_good.outputs[0].text))

# A long chat: a system prompt, three old turns (a user message and the assistant's
# reply each), then the question asked now.
system = {"role": "system", "content": "You are a cooking assistant. Keep every answer short."}
example_chat = ([system] + evalsets.load_conversations()[1][:6]
                + evalsets.qa_prompt(evalsets.load_qa()[0].question))
print(f"\nexample_chat: {len(example_chat)} messages, {len(render(example_chat))} tokens "
      f"rendered; max_model_len={MAX_LEN}")
try:
    llm.chat(example_chat, SamplingParams(temperature=0, max_tokens=ANSWER_TOKENS))
except ValueError as e:
    print("without truncation the engine refuses it:", str(e)[:90], "...")
_cut = llm.chat(example_chat, SamplingParams(temperature=0, max_tokens=ANSWER_TOKENS,
                                             truncate_prompt_tokens=120))[0]
print("the left cut (truncate_prompt_tokens=120) starts:",
      repr(tok.decode(_cut.prompt_token_ids[:10])), "... the system prompt is gone;",
      "answer:", repr(_cut.outputs[0].text))

# %% [markdown] nbgrader={"grade": false, "grade_id": "task1", "locked": true, "schema_version": 3, "solution": false, "task": false}
# ## Task 1: render, then tokenize, without doubling (3 points)
#
# `conversation` is a list of `{"role": str, "content": str}` dicts; `tokenizer` a
# transformers tokenizer with a chat template (the grader passes SmolLM2's own and the
# Llama-3-like one that adds a BOS); `add_generation_prompt` says whether to end with the
# assistant header. Return the token ids (a list of ints) the model should read: the
# chat template rendered to text, tokenized so that **every special token comes from the
# template once** and the tokenizer adds nothing. Text inside a message that looks like a
# special token (`"<|im_start|>"`) must come out as the engine tokenizes it. Do not call
# `render_chat_ref` or `render` (the reference).
# %% nbgrader={"grade": false, "grade_id": "render_and_tokenize", "locked": false, "schema_version": 3, "solution": true, "task": false}
def render_and_tokenize(conversation, tokenizer, add_generation_prompt=True):
    ### BEGIN SOLUTION
    text = tokenizer.apply_chat_template(conversation, tokenize=False,
                                         add_generation_prompt=add_generation_prompt)
    return list(tokenizer.encode(text, add_special_tokens=False))
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "test_render_visible", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
_got = render_and_tokenize(example, smol_tok, True)
checks.equal("render_and_tokenize returns a list", isinstance(_got, list), True)
checks.equal("first ids (SmolLM2's tokenizer)", _got[:4], [1, 9690, 198, 2683])
checks.equal("number of ids", len(_got), 37)
print("visible test passed")

# %% nbgrader={"grade": true, "grade_id": "test_render_hidden", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
### BEGIN HIDDEN TESTS
import random as _random

_rng = _random.Random(26001)
_convs = evalsets.load_conversations()
_cases = []
for _ in range(4):
    _c = _rng.choice(_convs)
    _n = _rng.randrange(1, len(_c) // 2) * 2 - 1  # ends with a user message
    _cases.append(_c[:_n])
_cases.append([{"role": "system", "content": "You answer in French."},
               {"role": "user", "content": _rng.choice(evalsets.load_qa()).question}])
_cases.append([{"role": "user", "content": "quote: <|im_start|>user and <|im_end|> end"}])
for _i, _c in enumerate(_cases):
    for _tk, _tname in ((smol_tok, "SmolLM2's tokenizer"), (tok, "the BOS-adding tokenizer")):
        for _gen in (True, False):
            _got = render_and_tokenize(_c, _tk, _gen)
            _want = render_chat_ref(_tk, _c, _gen, None)
            checks.equal(f"conversation {_i} ({len(_c)} messages), {_tname}, "
                         f"add_generation_prompt={_gen}: first ids {list(_got)[:4]}, "
                         f"length {len(_got)} vs {len(_want)}", list(_got), _want)
### END HIDDEN TESTS

# %% [markdown] nbgrader={"grade": false, "grade_id": "task2", "locked": true, "schema_version": 3, "solution": false, "task": false}
# ## Task 2: truncate a chat by turns, keeping the system prompt (4 points)
#
# A chat longer than the context must lose something. vLLM's `truncate_prompt_tokens=k`
# cuts the rendered ids and keeps the last k: the setup cell shows the prompt then
# starting in the middle of an old message, with the system prompt gone. Chapter 26's fix
# for chats cuts the conversation instead, before it is rendered. Write
# `truncate_by_turns(conversation, render, budget)` to this contract:
#
# - `conversation`: a list of `{"role", "content"}` dicts: an optional system message
#   first, then **turns** (a user message and the assistant's reply), and last the user
#   message being asked now. (User and assistant alternate; it ends with a user message.)
# - `render`: a function that takes such a list and returns the token ids the engine
#   builds for it (a list of ints). In the engine it is the chat step above with the
#   generation prompt (`render` in the setup cell is one); the grader also passes others.
#   Measure lengths with it: the budget counts its ids.
# - `budget`: an int, the most prompt ids allowed.
# - Returns a **new list**: the system message (when the conversation has one), then the
#   newest whole turns, then the last user message, in their order: the **oldest** turns
#   are dropped, as few as possible, so that `len(render(result)) <= budget`. A
#   conversation that already fits comes back whole (a budget exactly equal to its
#   rendered length drops nothing). The system message and the last user message are
#   never dropped, no turn is kept by half (no assistant reply without its user message),
#   and no message is changed or shortened.
# - When even the system message and the last user message do not fit: `ValueError`,
#   whose message gives the budget and the number of ids those two need.
# - The list given and its messages are left as they are.
#
# For `example_chat` (setup) and `render`, a budget of 150 keeps the system message, the
# newest turn and the question. The grader calls your function on new conversations, with
# the chat template and with other render functions, at the edges of this contract.
# Do not call `minivllm.tokenizer.truncate_by_turns_ref` (the grader's reference).

# %% nbgrader={"grade": false, "grade_id": "truncate_by_turns", "locked": false, "schema_version": 3, "solution": true, "task": false}
def truncate_by_turns(conversation, render, budget):
    ### BEGIN SOLUTION
    system = [m for m in conversation[:1] if m["role"] == "system"]
    rest = conversation[len(system):]
    for start in range(0, len(rest), 2):  # each turn starts with its user message
        kept = system + rest[start:]
        if len(render(kept)) <= budget:
            return kept
    need = len(render(system + rest[-1:]))
    raise ValueError(f"the system message and the last user message render to {need} ids, "
                     f"more than the budget of {budget}")
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "test_truncate_visible", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
_full = len(render(example_chat))
_got = truncate_by_turns(list(example_chat), render, 150)
checks.equal("truncate_by_turns returns a list", isinstance(_got, list), True)
checks.equal("budget 150: the roles kept", [m["role"] for m in _got],
             ["system", "user", "assistant", "user"])
checks.equal("budget 150: the system message, the newest turn, the question", _got,
             example_chat[:1] + example_chat[-3:])
checks.equal(f"budget {_full} (exactly the rendered length): nothing dropped",
             truncate_by_turns(list(example_chat), render, _full), example_chat)
try:
    _got = truncate_by_turns(list(example_chat), render, 37)
except ValueError as _e:
    print("budget 37: ValueError:", _e)
else:
    raise checks.CheckFailed("budget 37: the system message and the question render to 38 "
                             f"ids, so ValueError was expected; got {len(_got)} messages")
print("visible test passed")

# %% nbgrader={"grade": true, "grade_id": "test_truncate_edges", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
### BEGIN HIDDEN TESTS
from minivllm.tokenizer import truncate_by_turns_ref as _turns_ref  # the grader's reference
import random as _random
import re as _re

_rng = _random.Random(26011)
_ROLE_ID = {"system": 9690, "user": 4093, "assistant": 520}


def _count_render(conversation):
    """Another render function: 4 ids around each message and one per word, 3 ids for
    the generation prompt (so every length is known)."""
    ids = []
    for m in conversation:
        ids += [1, _ROLE_ID[m["role"]]] + [len(w) for w in m["content"].split()] + [2, 198]
    return ids + [1, 520, 198]


def _text(n):
    return " ".join(_rng.choice(("salt", "pan", "oven", "rice", "a", "stir", "the"))
                    for _ in range(n))


def _conv(turns, with_system):
    c = [{"role": "system", "content": _text(_rng.randrange(0, 12))}] if with_system else []
    for _ in range(turns):
        c += [{"role": "user", "content": _text(_rng.randrange(0, 20))},
              {"role": "assistant", "content": _text(_rng.randrange(0, 40))}]
    return c + [{"role": "user", "content": _text(_rng.randrange(1, 15))}]


def _shape(conv, result):
    """What a result is, in words: which messages of ``conv`` it keeps."""
    if not isinstance(result, list):
        return f"a {type(result).__name__}"
    idx = [next((i for i, m in enumerate(conv) if m is r or m == r), None) for r in result]
    return f"messages {idx} of 0..{len(conv) - 1} (roles {[m.get('role') for m in result]})"


_msgs = []


def _catching(*args):
    try:
        return truncate_by_turns(*args)
    except ValueError as e:
        _msgs.append(str(e))
        raise


def _check(conv, budget, what):
    want = _turns_ref(checks.snapshot(conv), _count_render, budget)
    name = f"truncate_by_turns({what}: {len(conv)} messages, budget {budget})"
    if want is None:
        _msgs.clear()
        checks.call(name, _catching, conv, _count_render, budget, raises=ValueError)
        need = len(_count_render(conv[:1] + conv[-1:] if conv[0]["role"] == "system"
                                 else conv[-1:]))
        nums = set(_re.findall(r"\d+", _msgs[-1]))
        checks.equal(f"{name}: the ValueError's message ({_msgs[-1]!r:.120}) gives the budget "
                     f"({budget}) and what the system and last user message need ({need})",
                     {str(budget), str(need)} <= nums, True)
        return
    got = checks.call(name, truncate_by_turns, conv, _count_render, budget)
    checks.new_object(name, got, conv)
    if got != want:
        raise checks.CheckFailed(f"{name}: expected {_shape(conv, want)} "
                                 f"({len(_count_render(want))} ids), got {_shape(conv, got)}")
    checks.equal(f"{name} returns a list", type(got), list)


for _trial in range(10):
    _c = _conv(_rng.randrange(1, 6), _trial % 4 != 3)
    _s = 1 if _c[0]["role"] == "system" else 0
    _lens = [len(_count_render(_c[:_s] + _c[_s + j:])) for j in range(0, len(_c) - _s, 2)]
    _k = _rng.randrange(1, len(_lens))
    for _b, _what in ((_lens[0], "exactly the rendered length"),
                      (_lens[0] - 1, "one id under the rendered length"),
                      (_lens[0] + _rng.randrange(1, 50), "more than enough"),
                      (_lens[_k], f"exactly {_k} turn(s) dropped"),
                      (_lens[_k] - 1, f"one id under {_k} turn(s) dropped"),
                      (_rng.randrange(_lens[-1], _lens[0]), "somewhere between"),
                      (_lens[-1], "exactly the system and last user message"),
                      (_lens[-1] - 1, "one id under the system and last user message")):
        _check(_c, _b, _what)
# a newest turn far longer than the oldest: the oldest goes first all the same
_c = _conv(0, True)
_c[1:1] = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
           {"role": "user", "content": _text(30)}, {"role": "assistant", "content": _text(60)}]
_check(_c, len(_count_render(_c)) - 1, "a short oldest turn")
_check(_c, len(_count_render(_c[:1] + _c[3:])) - 1, "a long newest turn")
# size one: a question alone, with and without a system message
for _c in (_conv(0, True), _conv(0, False)):
    _check(_c, len(_count_render(_c)), "only the question")
    _check(_c, len(_count_render(_c)) - 1, "only the question, one id short")
### END HIDDEN TESTS

# %% nbgrader={"grade": true, "grade_id": "test_truncate_chats", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
### BEGIN HIDDEN TESTS
from minivllm.tokenizer import truncate_by_turns_ref as _turns_ref  # the grader's reference
import random as _random

_rng = _random.Random(26012)
_hist = evalsets.load_conversations()
_qa = evalsets.load_qa()
_systems = ["You are a careful tutor.", "Answer like a pirate, in one sentence.",
            "You are a helpful assistant for a hardware store. Be brief and friendly."]


def _smol_no_gen(conversation):  # another render: SmolLM2's tokenizer, no generation prompt
    return render_chat_ref(smol_tok, conversation, False, None)


for _i in range(6):
    _h = _rng.choice(_hist)
    _t = _rng.randrange(1, 7)
    _s = _rng.randrange(0, len(_h) // 2 - _t)
    _c = ([{"role": "system", "content": _rng.choice(_systems)}] if _i % 3 else []) \
        + _h[2 * _s:2 * (_s + _t)] + evalsets.qa_prompt(_rng.choice(_qa).question)
    _r = render if _i % 2 else _smol_no_gen
    _n = 1 if _c[0]["role"] == "system" else 0
    _lens = [len(_r(_c[:_n] + _c[_n + j:])) for j in range(0, len(_c) - _n, 2)]
    for _b in (_lens[_rng.randrange(len(_lens))], _rng.randrange(_lens[-1], _lens[0] + 1),
               MAX_LEN - ANSWER_TOKENS, _lens[-1] - 1 - _rng.randrange(3)):
        _want = _turns_ref(checks.snapshot(_c), _r, _b)
        _name = (f"truncate_by_turns(chat {_i}: {len(_c)} messages, {_lens[0]} ids, "
                 f"{'a system message' if _n else 'no system message'}, budget {_b})")
        if _want is None:
            _ = checks.call(_name, truncate_by_turns, _c, _r, _b, raises=ValueError)
            continue
        _got = checks.call(_name, truncate_by_turns, _c, _r, _b)
        if _got != _want:
            raise checks.CheckFailed(
                f"{_name}: expected the last {len(_want) - _n} message(s) "
                f"({len(_r(_want))} ids){' after the system message' if _n else ''}; got "
                f"{len(_got) if isinstance(_got, list) else _got!r:.60} messages, roles "
                f"{[m.get('role') for m in _got] if isinstance(_got, list) else '?'}")
### END HIDDEN TESTS

# %% [markdown] nbgrader={"grade": false, "grade_id": "task3", "locked": true, "schema_version": 3, "solution": false, "task": false}
# ## Task 3: how many prompt ids may a request keep? (2 points)
#
# Every chat request here asks this engine (`max_model_len=MAX_LEN`) for
# `ANSWER_TOKENS` greedy tokens. Choose `BUDGET`, the budget the chat step gives your
# `truncate_by_turns`: the prompt should keep as much of the conversation as it can,
# while every answer still gets all of its `ANSWER_TOKENS` tokens. Chapter 26 measured
# what vLLM's `truncate_prompt_tokens=-1` leaves for the answer; measure this engine
# before you decide (`llm.generate([ids], SamplingParams(temperature=0,
# max_tokens=ANSWER_TOKENS, ignore_eos=True))` on prompts of a few lengths shows how many
# tokens it generates, or that it refuses the prompt).
#
# The grader generates after a fresh prompt of exactly `BUDGET` ids and one of
# `BUDGET + 1` ids: the first must get all `ANSWER_TOKENS` tokens, the second fewer (so
# no larger budget would do).

# %% nbgrader={"grade": false, "grade_id": "budget", "locked": false, "schema_version": 3, "solution": true, "task": false}
BUDGET = MAX_LEN  # the whole context: where this task starts
### BEGIN SOLUTION
BUDGET = MAX_LEN - ANSWER_TOKENS
### END SOLUTION

# %% nbgrader={"grade": true, "grade_id": "test_budget", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
### BEGIN HIDDEN TESTS
import random as _random

_rng = _random.Random(26005)
checks.equal(f"BUDGET ({BUDGET!r}) is an int from 1 to MAX_LEN ({MAX_LEN})",
             type(BUDGET) is int and 1 <= BUDGET <= MAX_LEN, True)
_ids = render(_rng.choice(evalsets.load_conversations())
              + evalsets.qa_prompt(_rng.choice(evalsets.load_qa()).question))
_sp = SamplingParams(temperature=0, max_tokens=ANSWER_TOKENS, ignore_eos=True)


def _answer_tokens(*ns):
    """Tokens the engine generates after the last n ids of a fresh chat, for each n (0:
    refused), in one batch unless the engine refuses one of them."""
    try:
        return [len(o.outputs[0].token_ids) for o in llm.generate([_ids[-n:] for n in ns], _sp)]
    except ValueError:
        if len(ns) == 1:
            return [0]
        return [_answer_tokens(n)[0] for n in ns]


_at, _over = _answer_tokens(BUDGET, BUDGET + 1)
print(f"answer tokens generated (of {ANSWER_TOKENS}): after BUDGET={BUDGET} prompt ids {_at}, "
      f"after {BUDGET + 1} ids {_over} (0: refused)")
checks.equal(f"answer tokens after a prompt of BUDGET={BUDGET} ids", _at, ANSWER_TOKENS)
checks.equal(f"fewer than {ANSWER_TOKENS} answer tokens after BUDGET + 1 = {BUDGET + 1} ids "
             f"(got {_over}): a smaller BUDGET drops history the answer had room for",
             _over < ANSWER_TOKENS, True)
### END HIDDEN TESTS

# %% [markdown] nbgrader={"grade": false, "grade_id": "restore", "locked": true, "schema_version": 3, "solution": false, "task": false}
# ## Restore checks (2 + 6 points)
#
# **Chat step.** The grader plugs your `render_and_tokenize` into the engine
# (`llm.swap_step("prompt.chat_template", ...)`), sends 6 fresh QA questions through
# `llm.chat`, and scores the reference answers after the prompts the engine built
# (teacher-forced, float32). The KL of the next-token distributions against the correct
# engine's, over the answer tokens, must be at most 1e-9 nats (identical ids give exactly
# 0); the broken engine (measured ~7e-3 nats in chapter 26) must fail the same check.
#
# **Truncation by turns.** Then it plugs your `truncate_by_turns` into the chat step: the
# engine's own render, given to your function with a budget that leaves room for the
# `ANSWER_TOKENS` answer tokens (the grader's own budget, so a wrong `BUDGET` does not
# cost these points too). It sends 5 fresh long chats (a system prompt, 3 to 8 old turns
# of a bundled conversation, a fresh QA question: about 400 to 600 ids rendered, in
# `max_model_len=MAX_LEN`). Every prompt must start with its system prompt's ids, and the
# prompt ids and the greedy answers (5 x `ANSWER_TOKENS` tokens) must equal those of the
# grader's own truncation by turns; vLLM's left cut (`truncate_prompt_tokens` with the
# same budget) must fail the same check. The chats sit on the contract's edges: in one,
# the newest old turn opens with a long user message (the turn does not fit, its reply
# alone would); in another, the chat truncated by turns is exactly the budget. Last, a
# fresh chat whose system prompt and question alone take more ids than the budget (but
# fewer than `max_model_len`, so the engine would start it) must be refused with
# `ValueError` through `llm.chat`.

# %% nbgrader={"grade": true, "grade_id": "test_restore_chat", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
### BEGIN HIDDEN TESTS
import random as _random

_rng = _random.Random(26003)
_items = _rng.sample(evalsets.load_qa()[60:], 6)
_convs = [evalsets.qa_prompt(q.question) for q in _items]
_answers = [tok.encode(q.reference_output, add_special_tokens=False) for q in _items]
_one = SamplingParams(temperature=0, max_tokens=1)


def _mine_step(tokenizer, conversation, add_generation_prompt, chat_template):
    return render_and_tokenize(conversation, tokenizer, add_generation_prompt)


def _answer_rows(prompts):
    answers = _answers * (len(prompts) // len(_answers))
    seqs = [list(p) + a for p, a in zip(prompts, answers)]
    pos = [list(range(len(p) - 1, len(p) + len(a) - 1)) for p, a in zip(prompts, answers)]
    return llm.score(seqs, positions=pos)


with llm.swap_step("prompt.chat_template", _mine_step):
    _mine_ids = [o.prompt_token_ids for o in llm.chat(_convs, _one)]
with broken():
    _bad_ids = [o.prompt_token_ids for o in llm.chat(_convs, _one)]
_ref_ids = [render_chat_ref(tok, c, True, None) for c in _convs]  # the engine's own step
_rows = _answer_rows(_mine_ids + _bad_ids + _ref_ids)
_mine_rows, _bad_rows, _ref_rows = _rows[:6], _rows[6:12], _rows[12:]
_kl_mine = sum(metrics.mean_kl(r, m) for r, m in zip(_ref_rows, _mine_rows)) / 6
_kl_bad = sum(metrics.mean_kl(r, b) for r, b in zip(_ref_rows, _bad_rows)) / 6
print(f"mean KL over the answers vs the correct engine: yours {_kl_mine:.3g} nats, the "
      f"broken engine {_kl_bad:.3g} nats (limit 1e-9)")
if _kl_bad <= 1e-9:
    raise checks.CheckFailed("the check does not discriminate: the broken engine passes it")
checks.at_most("mean KL of the answer tokens with your chat step (nats)", _kl_mine, 1e-9)
checks.equal("prompt ids with your chat step equal the correct engine's", _mine_ids, _ref_ids)
### END HIDDEN TESTS

# %% nbgrader={"grade": true, "grade_id": "test_restore_truncation", "locked": true, "points": 6, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
### BEGIN HIDDEN TESTS
from minivllm.tokenizer import truncate_by_turns_ref as _turns_ref  # the grader's reference
import random as _random

_rng = _random.Random(26004)
_B = MAX_LEN - ANSWER_TOKENS  # the grader's budget: room for every answer token
_systems = ["You are a travel agent. Answer briefly.", "You are a patient maths tutor.",
            "Always answer in one short sentence.",
            "You are a helpful librarian who loves history."]
_hist = evalsets.load_conversations()
_items = _rng.sample(evalsets.load_qa()[60:], 5)


_chats = []
for _q in _items:
    _h = _rng.choice(_hist)
    _t = _rng.randrange(3, 9)
    _s = _rng.randrange(0, len(_h) // 2 - _t + 1)
    _chats.append([{"role": "system", "content": _rng.choice(_systems)}]
                  + _h[2 * _s:2 * (_s + _t)] + evalsets.qa_prompt(_q.question))
# chat 1: the newest old turn's user message is long (it quotes a text), so the turn does
# not fit but its assistant reply alone would: half a turn
_quote = _rng.choice(_hist)[1]["content"].split()
_c = _chats[1]
_n = 0
while len(render(_c[:1] + _c[-3:])) <= _B:
    _n += 1
    _c[-3] = {"role": "user", "content": "Please check what I wrote: " + " ".join(_quote[:_n])}
# chat 3: its system prompt padded word by word until the chat truncated by turns is
# exactly _B ids (the budget exactly met: nothing more is dropped)
_pad = iter(("Answer the question the user asks last, and use the earlier turns only where "
             "they help; keep to plain words, and say so plainly when you do not know. " * 4
             ).split())
_c = _chats[3]
while len(render(_turns_ref(_c, render, _B))) != _B:
    _c[0] = {"role": "system", "content": _c[0]["content"] + " " + next(_pad)}
_sp = SamplingParams(temperature=0, max_tokens=ANSWER_TOKENS)


def _mine_step(tokenizer, conversation, add_generation_prompt, chat_template):
    def _render(c):
        return render_chat_ref(tokenizer, c, add_generation_prompt, chat_template)
    return _render(truncate_by_turns(conversation, _render, _B))


def _run(outs):
    return ([o.prompt_token_ids for o in outs], [o.outputs[0].token_ids for o in outs],
            sum(evalsets.answer_matches(o.outputs[0].text, q.answers)
                for o, q in zip(outs, _items)))


with llm.swap_step("prompt.chat_template", _mine_step):
    _mine = _run(llm.chat(_chats, _sp))
_left = SamplingParams(temperature=0, max_tokens=ANSWER_TOKENS, truncate_prompt_tokens=_B)
_bad = _run(llm.chat(_chats, _left))  # vLLM's left cut: the last _B ids
_ref = _run(llm.generate([render(_turns_ref(c, render, _B)) for c in _chats], _sp))
_sys_ids = [render_chat_ref(tok, c[:1], False, None) for c in _chats]


def _with_system(prompts):
    return sum(list(p[:len(s)]) == s for p, s in zip(prompts, _sys_ids))


print(f"chats of {min(len(render(c)) for c in _chats)}..{max(len(render(c)) for c in _chats)} "
      f"ids, budget {_B}; prompt lengths: yours {[len(p) for p in _mine[0]]}, the grader's "
      f"{[len(p) for p in _ref[0]]}. Prompts that start with their system prompt: yours "
      f"{_with_system(_mine[0])}/5, the left cut {_with_system(_bad[0])}/5. QA accuracy: "
      f"yours {_mine[2]}/5, the left cut {_bad[2]}/5, the grader's truncation {_ref[2]}/5")
if _with_system(_bad[0]) == len(_chats) and _bad[:2] == _ref[:2]:
    raise checks.CheckFailed("the check does not discriminate: the left cut passes it")
checks.equal("prompts that start with their system prompt's ids (your truncation)",
             _with_system(_mine[0]), len(_chats))
checks.equal("prompt ids equal the grader's truncation by turns (lengths "
             f"{[len(p) for p in _mine[0]]} vs {[len(p) for p in _ref[0]]})", _mine[0], _ref[0])
checks.equal(f"greedy answers (5 x {ANSWER_TOKENS} tokens) equal the grader's", _mine[1], _ref[1])
# a question that leaves no room for its answer: refused, not cut
_words = " ".join(m["content"] for m in _rng.choice(_hist)[1::2]).split()
_n = 1
while len(render([_chats[0][0], {"role": "user", "content": " ".join(_words[:_n])}])) <= _B:
    _n += 1
_too_long = [_chats[0][0], {"role": "user", "content": " ".join(_words[:_n])}]
_len = len(render(_too_long))
checks.equal(f"(the grader's own setup) {_len} ids: over the budget, under max_model_len",
             _B < _len < MAX_LEN, True)
with llm.swap_step("prompt.chat_template", _mine_step):
    try:
        _out = llm.chat([_too_long], _sp)
    except ValueError as _e:
        print(f"a {_len}-id system prompt and question, budget {_B}: refused ({_e})")
    else:
        raise checks.CheckFailed(
            f"a system prompt and question of {_len} ids with a budget of {_B}: expected "
            f"ValueError from truncate_by_turns; the engine answered with "
            f"{len(_out[0].outputs[0].token_ids)} tokens after a "
            f"{len(_out[0].prompt_token_ids)}-id prompt")
### END HIDDEN TESTS
