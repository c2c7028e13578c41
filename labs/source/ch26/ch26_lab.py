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
# nats), and truncation on the wrong side cut off the question. This lab starts from
# that **broken engine**. Its tokenizer behaves like Llama-3's (it adds a BOS to every
# text encoded with special tokens; the setup cell builds it with
# `faults.bos_adding_tokenizer`), the `"prompt.chat_template"` step tokenizes the
# rendered chat with special tokens on, and the `"prompt.truncate"` step keeps the
# first k tokens.
#
# You write two functions; the grader calls them on **new** conversations and token
# lists and compares with the engine's reference exactly, then plugs them into the
# engine (`llm.swap_step`) on fresh QA items:
#
# 1. `render_and_tokenize(conversation, tokenizer, add_generation_prompt)`: the chat
#    step, 3 points;
# 2. `truncate_prompt(token_ids, truncate_prompt_tokens, max_model_len)`: vLLM's
#    `truncate_prompt_tokens`, 3 points;
#    then two restore checks, 2 points each.
#
# Run the cells in order. Do not edit the setup and test cells.

# %% nbgrader={"grade": false, "grade_id": "setup", "locked": true, "schema_version": 3, "solution": false, "task": false}
import contextlib
import importlib

import grading.checks as checks  # first import: records the original functions
import torch

from minivllm import LLM, SamplingParams
from minivllm.precision import evalsets, faults, metrics
from minivllm.tokenizer import (render_chat_ref, resolve_truncate_prompt_tokens,
                                truncate_prompt_ref)

MAX_LEN = 160
llm = LLM("smollm2-135m-instruct", dtype="float32", max_model_len=MAX_LEN)
smol_tok = llm.get_tokenizer()                 # SmolLM2's own: adds no BOS
tok = faults.bos_adding_tokenizer(smol_tok)    # Llama-3-like: adds <|im_start|> (id 1)
llm.llm_engine.tokenizer = tok                 # the engine now tokenizes like Llama-3's


@contextlib.contextmanager
def broken():
    """The broken engine: the chat step tokenizes the rendered template with special
    tokens on (a second start token), and truncation keeps the FIRST k tokens. Use it as
    ``with broken(): ...``; outside the block the engine is correct."""
    with faults.doubled_bos(llm), faults.right_truncation(llm):
        yield


example = [{"role": "user", "content": "What is the capital of France?"}]
with broken():
    _bad = llm.chat(example, SamplingParams(temperature=0, max_tokens=8))[0]
_good = llm.chat(example, SamplingParams(temperature=0, max_tokens=8))[0]
print("tokenizer: encode('Hello') =", tok.encode("Hello"), "(SmolLM2's own:",
      smol_tok.encode("Hello"), ")")
print("broken engine prompt starts:", _bad.prompt_token_ids[:5], "correct:",
      _good.prompt_token_ids[:5])
print("answers:", repr(_bad.outputs[0].text), "|", repr(_good.outputs[0].text))

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
# `render_chat_ref` (the reference).

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
# ## Task 2: truncate_prompt_tokens, vLLM's way (3 points)
#
# `token_ids` is a list of ints (a tokenized prompt), `max_model_len` the engine's
# context length. Return a new list:
#
# - `truncate_prompt_tokens=None`: the ids unchanged (nothing is cut unless asked; a
#   prompt that does not fit is refused later by the engine's length check);
# - an int `k >= 1`: the **last** k ids (all of them if there are fewer); `k` larger
#   than `max_model_len` raises `ValueError`;
# - `-1`: as many of the last ids as this engine accepts: `max_model_len - 1` (one
#   generated token must fit);
# - anything else (0, -2, a float, a bool...): raise `ValueError`.
#
# Do not call the engine's functions (`truncate_prompt_ref`,
# `resolve_truncate_prompt_tokens`).

# %% nbgrader={"grade": false, "grade_id": "truncate_prompt", "locked": false, "schema_version": 3, "solution": true, "task": false}
def truncate_prompt(token_ids, truncate_prompt_tokens, max_model_len):
    ### BEGIN SOLUTION
    k = truncate_prompt_tokens
    if k is None:
        return list(token_ids)
    if isinstance(k, bool) or not isinstance(k, int) or not (k >= 1 or k == -1):
        raise ValueError(f"truncate_prompt_tokens must be an int >= 1 or -1, got {k!r}")
    if k == -1:
        k = max_model_len - 1
    if k > max_model_len:
        raise ValueError(f"truncate_prompt_tokens ({k}) is greater than max_model_len "
                         f"({max_model_len})")
    return list(token_ids[-k:])
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "test_truncate_visible", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
_ids = list(range(100, 110))
checks.equal("truncate_prompt(10 ids, 4, 64)", truncate_prompt(_ids, 4, 64), [106, 107, 108, 109])
checks.equal("truncate_prompt(10 ids, None, 64)", truncate_prompt(_ids, None, 64), _ids)
checks.equal("truncate_prompt(10 ids, 20, 64)", truncate_prompt(_ids, 20, 64), _ids)
print("visible test passed")

# %% nbgrader={"grade": true, "grade_id": "test_truncate_hidden", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
### BEGIN HIDDEN TESTS
import random as _random

_rng = _random.Random(26002)
for _ in range(12):
    _mml = _rng.randrange(8, 300)
    _n = _rng.randrange(1, 2 * _mml)
    _ids = [_rng.randrange(0, 49152) for _ in range(_n)]
    for _k in (None, -1, 1, _rng.randrange(1, _mml + 1), _mml):
        _got = truncate_prompt(list(_ids), _k, _mml)
        _r = resolve_truncate_prompt_tokens(_k, _mml)
        _want = list(_ids) if _r is None else truncate_prompt_ref(_ids, _r)
        checks.equal(f"truncate_prompt({_n} ids, {_k}, max_model_len={_mml}): length "
                     f"{len(_got)} vs {len(_want)}, first ids {list(_got)[:3]} vs {_want[:3]}",
                     list(_got), _want)
    for _bad in (_mml + 1, 10 * _mml, 0, -2, 2.0, True):
        try:
            truncate_prompt(list(_ids), _bad, _mml)
        except ValueError:
            continue
        raise checks.CheckFailed(f"truncate_prompt(..., {_bad!r}, max_model_len={_mml}) "
                                 "should raise ValueError (vLLM refuses it), returned instead")
### END HIDDEN TESTS

# %% [markdown] nbgrader={"grade": false, "grade_id": "restore", "locked": true, "schema_version": 3, "solution": false, "task": false}
# ## Restore checks (2 + 2 points)
#
# **Chat step.** The grader plugs your `render_and_tokenize` into the engine
# (`llm.swap_step("prompt.chat_template", ...)`), sends 6 fresh QA questions through
# `llm.chat`, and scores the reference answers after the prompts the engine built
# (teacher-forced, float32). The KL of the next-token distributions against the correct
# engine's, over the answer tokens, must be at most 1e-9 nats (identical ids give exactly
# 0); the broken engine (measured ~7e-3 nats in chapter 26) must fail the same check.
#
# **Truncation.** Then it plugs your `truncate_prompt` into the `"prompt.truncate"` step
# and sends 4 fresh ~900-token chats (a long conversation, then a fresh QA question)
# with `truncate_prompt_tokens=150` (room for 10 generated tokens): the prompt ids and
# the greedy answers must equal the correct engine's, and the broken engine must fail.

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

# %% nbgrader={"grade": true, "grade_id": "test_restore_truncation", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
import importlib, grading.checks as checks  # fresh names: a rebinding in the lab cannot stand in
checks = importlib.reload(checks)
checks.guard()
### BEGIN HIDDEN TESTS
import random as _random

_rng = _random.Random(26004)
_K = MAX_LEN - 10
_items = _rng.sample(evalsets.load_qa()[60:], 4)
_hist = evalsets.load_conversations()
_chats = [_rng.choice(_hist) + evalsets.qa_prompt(q.question) for q in _items]
_long = [render_chat_ref(tok, c, True, None) for c in _chats]
_sp = SamplingParams(temperature=0, max_tokens=10, truncate_prompt_tokens=_K)


def _mine_trunc(token_ids, k):
    return truncate_prompt(token_ids, k, MAX_LEN)


def _run():
    outs = llm.generate(_long, _sp)
    return [o.prompt_token_ids for o in outs], [o.outputs[0].token_ids for o in outs], \
        sum(evalsets.answer_matches(o.outputs[0].text, q.answers) for o, q in zip(outs, _items))


with llm.swap_step("prompt.truncate", _mine_trunc):
    _mine = _run()
with broken():
    _bad = _run()
_ref = _run()
print(f"prompts {min(map(len, _long))}..{max(map(len, _long))} tokens, truncate_prompt_tokens="
      f"{_K}; QA accuracy: yours {_mine[2]}/4, broken {_bad[2]}/4, correct engine {_ref[2]}/4")
if _bad[:2] == _ref[:2]:
    raise checks.CheckFailed("the check does not discriminate: the broken engine passes it")
checks.equal("prompt ids after your truncation equal the correct engine's", _mine[0], _ref[0])
checks.equal("greedy answers (4 x 10 tokens) equal the correct engine's", _mine[1], _ref[1])
### END HIDDEN TESTS
