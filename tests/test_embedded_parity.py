"""Integration: minivllm float32 against HF transformers float32 on the embedded SmolLM2-135M.

What is proven, per scenario (each builds its own engine; the HF model is shared):

* **Tokens.** Our 64 greedy tokens (``temperature=0, ignore_eos=True``) are exactly HF's
  greedy tokens. The reference is HF *teacher-forced* on ``prompt + our tokens``: a
  sequence is HF's greedy continuation iff every token is HF's argmax at its position,
  so one causal forward pass checks all 64 steps and also gives HF's logits at each of
  them. For a subset of prompts (all of them with ``MINIVLLM_PARITY_HF_GREEDY=all``)
  we also run HF's own KV-cached greedy loop (``cache=DynamicCache``, no EOS stop, no
  EOS mask) and require the same tokens, which cross-checks the method.
* **Logits.** The full float32 logit vector (49152 entries) that our sampler took its
  last (64th) token from, captured by wrapping the model runner's sampler, differs from
  HF's logits at that position by at most ``LOGIT_TOL`` (max abs). The public API is
  checked too: ``outputs[0].logprobs[t][token].logprob`` (``logprobs=0``) against HF's
  log-softmax at every one of the 64 steps.
* **No leaks.** After every scenario all KV blocks are back in the free pool.

Scenarios: with chunked prefill and prefix caching off (the baseline), 32 mixed-length
prompts (5 to 500 tokens) in one ``generate`` call, then three long prompts (913 to
1500 tokens) in another; chunked prefill with a 256-token budget; prefix caching with a
shared system prompt / shared document (hits asserted); forced preemption with a tiny
KV cache (preemptions asserted). 35 distinct prompts in all.

Measured numbers go to ``/tmp/parity_numbers.json`` (``MINIVLLM_PARITY_JSON`` to move it)
as each scenario finishes; run with ``-s`` to see the summaries.

Threads: the test machines share 2 cores between several workers, and OpenMP threads
that spin-wait on a busy core make torch 3-50x slower there, so this module runs torch
with one thread (``MINIVLLM_PARITY_THREADS`` to change it). Both sides run in the same
process with the same setting, so it does not favour either side.
"""

from __future__ import annotations

import json
import os
import random
from collections import defaultdict
from pathlib import Path

import pytest
import torch

from minivllm import LLM, SamplingParams

MAX_TOKENS = 64
LOGIT_TOL = 1e-3  # max |our logit - HF logit| over the whole vocabulary, last position
LOGPROB_TOL = 1e-3  # max |our logprob - HF logprob| of the chosen token, every step
NUMBERS_PATH = Path(os.environ.get("MINIVLLM_PARITY_JSON", "/tmp/parity_numbers.json"))
# Prompts also decoded by HF's own KV-cached greedy loop (expensive: 64 batch-1 steps).
HF_GREEDY_SUBSET = ("chat_capital", "raw_code_def", "raw_chinese", "chat_long_300")

pytestmark = pytest.mark.embedded


# --- prompts --------------------------------------------------------------------------

SHARED_SYSTEM = (
    "You are Quill, a meticulous assistant for a small public library in a coastal town. "
    "You answer questions from visitors about books, opening hours, events and local "
    "history. Keep answers short and friendly, use plain language, and never invent "
    "facts: if you are not sure, say so and suggest asking the front desk. The library "
    "opens at nine in the morning on weekdays and at ten on Saturdays; it is closed on "
    "Sundays. Children's story time is every Wednesday at four. The reading room on the "
    "second floor has twelve desks, free wifi and a view of the harbour."
)

_SUBJECTS = ["The engineer", "A young violinist", "My grandmother", "The old fisherman",
             "A curious student", "The city council", "Our neighbour", "The museum guide",
             "A tired nurse", "The baker on the corner", "Two astronomers", "The librarian"]
_VERBS = ["repaired", "painted", "described", "carried", "discovered", "measured",
          "photographed", "sold", "borrowed", "examined", "forgot", "planted"]
_OBJECTS = ["an old bicycle", "a map of the northern islands", "three wooden chairs",
            "a broken telescope", "the recipe for lemon cake", "a letter from 1953",
            "a box of rusty keys", "the tallest sunflower", "a rare blue stamp",
            "a notebook full of equations", "the village clock", "a pair of red boots"]
_PLACES = ["near the river", "in Lisbon", "behind the train station", "on the roof",
           "at the Saturday market", "in a quiet valley", "beside the lighthouse",
           "under the bridge", "in the school garden", "at the edge of the forest"]
_REASONS = ["because the weather was unusually warm", "while everyone else was asleep",
            "after a long argument about prices", "for reasons nobody understood",
            "just before the storm arrived", "to win a friendly bet",
            "since the festival started at noon", "although it was raining heavily"]


def _story_ids(tok, n_tokens: int, seed: int) -> list[int]:
    """About ``n_tokens`` tokens of varied, grammatical sentences (no single token repeated)."""
    rng = random.Random(seed)
    sentences = []
    while True:
        year = rng.randint(1890, 2024)
        subject = rng.choice(_SUBJECTS)
        s = (f"In {year}, {subject[0].lower() + subject[1:]} "
             f"{rng.choice(_VERBS)} {rng.choice(_OBJECTS)} {rng.choice(_PLACES)} "
             f"{rng.choice(_REASONS)}, and it took {rng.randint(2, 97)} minutes.")
        sentences.append(s)
        ids = tok.encode(" ".join(sentences), add_special_tokens=False)
        if len(ids) >= n_tokens:
            return ids[:n_tokens]


def _code_ids(tok, n_tokens: int) -> list[int]:
    """About ``n_tokens`` tokens of Python source with varied functions."""
    ops = [("add", "+"), ("sub", "-"), ("mul", "*"), ("div", "/"), ("mod", "%"), ("pow", "**")]
    parts = ["import math\nfrom dataclasses import dataclass\n\n"]
    i = 0
    while True:
        name, op = ops[i % len(ops)]
        parts.append(
            f"def {name}_{i}(a: float, b: float = {i + 1}) -> float:\n"
            f"    \"\"\"Apply '{op}' to a and b, then scale by {i * 3 + 1}.\"\"\"\n"
            f"    result = (a {op} b) * {i * 3 + 1}\n"
            f"    if result > {10 * (i + 2)}:\n"
            f"        return math.sqrt(abs(result))\n"
            f"    return result\n\n")
        if i % 4 == 3:
            parts.append(f"@dataclass\nclass Point{i}:\n    x: float = {i}.0\n    y: float = -{i}.5\n\n"
                         f"    def norm(self) -> float:\n        return math.hypot(self.x, self.y)\n\n")
        i += 1
        ids = tok.encode("".join(parts), add_special_tokens=False)
        if len(ids) >= n_tokens:
            tail = tok.encode("\n\ndef main():\n    values = [", add_special_tokens=False)
            return ids[:n_tokens - len(tail)] + tail


def build_prompts(tok) -> dict[str, list[int]]:
    """35 prompts, name -> token ids: raw text and chat-templated, 5 to 1500 tokens."""

    def raw(text):
        return tok.encode(text, add_special_tokens=False)

    def chat(messages):
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return tok.encode(text, add_special_tokens=False)

    def user(text, system=None):
        msgs = [{"role": "system", "content": system}] if system else []
        return chat(msgs + [{"role": "user", "content": text}])

    p: dict[str, list[int]] = {}
    # Raw text, short.
    p["raw_capital"] = raw("The capital of France is")
    p["raw_code_def"] = raw("def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n")
    p["raw_numbers"] = raw("1, 1, 2, 3, 5, 8, 13, 21, 34,")
    p["raw_list"] = raw("Things to pack for a camping trip:\n1. Tent\n2. Sleeping bag\n3.")
    p["raw_repeat"] = raw("I like green apples. " * 16)
    p["raw_french"] = raw("Il était une fois, dans un petit village de Provence,")
    p["raw_german"] = raw("Die Hauptstadt von Deutschland ist Berlin. Die Hauptstadt von Italien ist")
    p["raw_chinese"] = raw("我最喜欢的季节是秋天，因为")
    p["raw_json"] = raw('{"name": "Alice", "age": 30, "skills": ["python", ')
    p["raw_math"] = raw("Question: What is 17 + 25?\nAnswer:")
    p["raw_sql"] = raw("-- total orders per customer\nSELECT customer_id, COUNT(*)")
    p["raw_table"] = raw("| Planet | Moons |\n|---|---|\n| Earth | 1 |\n| Mars | 2 |\n|")
    p["raw_email"] = raw("Subject: Meeting moved to Thursday\n\nHi team,\n\nQuick update:")
    p["raw_russian"] = raw("Москва — столица России. Самая длинная река в Европе —")
    p["raw_japanese"] = raw("日本の首都は東京です。富士山の高さは")
    p["raw_poem"] = raw("Roses are red,\nViolets are blue,\n")
    p["raw_story_200"] = _story_ids(tok, 200, seed=5)
    # Chat-templated, short (the template adds its default system prompt).
    p["chat_capital"] = user("What is the capital of France?")
    p["chat_haiku"] = user("Write a haiku about the ocean.")
    p["chat_code"] = user("Write a Python function that reverses a string.")
    p["chat_spanish"] = user("¿Cuál es la montaña más alta del mundo?")
    p["chat_list"] = user("List five fruits that are red.")
    p["chat_multiturn"] = chat([
        {"role": "user", "content": "Hi! Can you help me plan a picnic?"},
        {"role": "assistant", "content": "Of course! How many people are coming?"},
        {"role": "user", "content": "Six adults and two kids. What food should I bring?"}])
    p["chat_recipe"] = user("Give me a simple recipe for pancakes.")
    p["chat_math"] = user("What is 12 times 7? Explain briefly.")
    # Chat with a shared ~140-token system prompt (prefix caching scenario).
    for i, q in enumerate(["When does the library open on Saturday?",
                           "Is there a story time for children?",
                           "How many desks are in the reading room?",
                           "Can I use the wifi in the library?",
                           "Are you open on Sundays?"]):
        p[f"sys_{i}"] = user(q, system=SHARED_SYSTEM)
    # Long prompts, built from varied sentences / code.
    doc = _story_ids(tok, 900, seed=7)
    p["long_doc_q1"] = doc + raw("\n\nQuestion: Who repaired the old bicycle?\nAnswer:")
    p["long_doc_q2"] = doc + raw("\n\nQuestion: In which year did it rain?\nAnswer:")
    p["long_story_1500"] = _story_ids(tok, 1500, seed=11)
    p["code_500"] = _code_ids(tok, 500)
    summary_src = tok.decode(_story_ids(tok, 260, seed=3))
    p["chat_long_300"] = user("Summarize the following text in two sentences.\n\n" + summary_src)
    return p


# --- references and capture ------------------------------------------------------------

class HFReference:
    """HF transformers float32: teacher-forced logits (cached) and a KV-cached greedy loop."""

    def __init__(self, model):
        self.model = model
        self.cache: dict[tuple, dict] = {}
        self.greedy_cache: dict[tuple, list[int]] = {}

    @torch.inference_mode()
    def teacher_forced(self, prompt: list[int], gen: list[int]) -> dict:
        """HF's next-token distribution at each of the len(gen) generation steps, with
        context prompt + gen[:t] (our tokens). Returns argmax ids, top-2 gap, the
        log-prob of our token at each step, and the full last-step logits."""
        key = (tuple(prompt), tuple(gen))
        if key not in self.cache:
            seq = torch.tensor([prompt + gen[:-1]])
            logits = self.model(input_ids=seq, use_cache=False,
                                logits_to_keep=len(gen)).logits[0].float()  # [n, V]
            assert logits.shape[0] == len(gen)
            logprobs = torch.log_softmax(logits, dim=-1)
            top2 = logits.topk(2, dim=-1).values
            ours = torch.tensor(gen)
            self.cache[key] = {
                "argmax": logits.argmax(dim=-1).tolist(),
                "gap": (top2[:, 0] - top2[:, 1]).tolist(),
                "logit_ours": logits.gather(1, ours[:, None]).squeeze(1).tolist(),
                "logit_max": top2[:, 0].tolist(),
                "lp_ours": logprobs.gather(1, ours[:, None]).squeeze(1).tolist(),
                "last_logits": logits[-1].clone(),
            }
        return self.cache[key]

    @torch.inference_mode()
    def greedy(self, prompt: list[int], n: int) -> list[int]:
        """HF's own greedy decoding: prefill, then n-1 single-token steps on a
        DynamicCache; argmax of the raw logits (no EOS stop, no EOS masking)."""
        key = (tuple(prompt), n)
        if key not in self.greedy_cache:
            from transformers import DynamicCache

            cache = DynamicCache(config=self.model.config)
            logits = self.model(input_ids=torch.tensor([prompt]), cache=cache, use_cache=True,
                                logits_to_keep=1).logits
            toks = []
            for i in range(n):
                nxt = int(logits[0, -1].argmax())
                toks.append(nxt)
                if i + 1 < n:
                    logits = self.model(input_ids=torch.tensor([[nxt]]), cache=cache,
                                        use_cache=True).logits
            self.greedy_cache[key] = toks
        return self.greedy_cache[key]


class LogitRecorder:
    """Wraps an engine's model runner to keep, per request, the float32 logits its
    sampler was given at the latest step (and the top-2 logits of every step)."""

    def __init__(self, llm: LLM):
        runner = llm.llm_engine.model_runner
        self.last: dict[str, torch.Tensor] = {}
        self.top2: dict[str, list[tuple]] = defaultdict(list)
        self._logits = None
        sampler, execute = runner.sampler, runner.execute_model
        rec = self

        class _SpySampler:
            def __call__(self, logits, meta):
                rec._logits = logits.detach().float().clone()
                return sampler(logits, meta)

            def __getattr__(self, name):
                return getattr(sampler, name)

        def _execute(scheduled, block_tables):
            rec._logits = None
            out = execute(scheduled, block_tables)
            if out.sampled_request_ids:
                vals, ids = rec._logits.topk(2, dim=-1)
                for i, rid in enumerate(out.sampled_request_ids):
                    rec.last[rid] = rec._logits[i].clone()
                    rec.top2[rid].append((int(ids[i, 0]), float(vals[i, 0]),
                                          int(ids[i, 1]), float(vals[i, 1])))
            return out

        runner.sampler = _SpySampler()
        runner.execute_model = _execute


def _record_numbers(scenario: str, data: dict) -> None:
    numbers = {}
    if NUMBERS_PATH.exists():
        try:
            numbers = json.loads(NUMBERS_PATH.read_text())
        except ValueError:
            numbers = {}
    numbers[scenario] = data
    NUMBERS_PATH.write_text(json.dumps(numbers, indent=2, sort_keys=True))


# --- fixtures ----------------------------------------------------------------------------

@pytest.fixture(scope="module", autouse=True)
def _torch_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(int(os.environ.get("MINIVLLM_PARITY_THREADS", "1")))
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module", autouse=True)
def _fresh_numbers_file():
    if NUMBERS_PATH.exists():
        NUMBERS_PATH.unlink()
    yield


@pytest.fixture(scope="module")
def hf_tokenizer(embedded_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(embedded_model_dir)


@pytest.fixture(scope="module")
def prompts(hf_tokenizer):
    return build_prompts(hf_tokenizer)


@pytest.fixture(scope="module")
def hf_ref(embedded_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(embedded_model_dir, dtype=torch.float32).eval()
    return HFReference(model)


# --- the comparison ----------------------------------------------------------------------

SP = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)


def _make_llm(model_dir, **kwargs) -> tuple[LLM, LogitRecorder]:
    llm = LLM(str(model_dir), dtype="float32", kv_cache_dtype="auto", **kwargs)
    return llm, LogitRecorder(llm)


def _generate(llm: LLM, names: list[str], prompts: dict[str, list[int]], as_text=(), tok=None):
    """One generate call; names in ``as_text`` are passed as text (engine tokenizes)."""
    inputs = [tok.decode(prompts[n]) if n in as_text else prompts[n] for n in names]
    outs = llm.generate(inputs, SP)
    for n, o in zip(names, outs):
        assert o.prompt_token_ids == prompts[n], f"{n}: engine tokenized the text differently"
    return outs


def compare(scenario: str, names: list[str], outs, rec: LogitRecorder, prompts, hf_ref,
            extra: dict | None = None, check_hf_greedy=()):
    """Compare every output with HF; record numbers; assert. Returns the summary dict."""
    rows, failures = [], []
    for name, out in zip(names, outs):
        comp = out.outputs[0]
        gen = comp.token_ids
        prompt = prompts[name]
        if len(gen) != MAX_TOKENS or comp.finish_reason != "length":
            failures.append(f"{name}: got {len(gen)} tokens, finish_reason={comp.finish_reason}")
            continue
        ref = hf_ref.teacher_forced(prompt, gen)
        mismatch = [t for t in range(MAX_TOKENS) if ref["argmax"][t] != gen[t]]
        ours_last = rec.last[out.request_id]
        logit_diff = float((ours_last - ref["last_logits"]).abs().max())
        lp_diff = max(abs(comp.logprobs[t][gen[t]].logprob - ref["lp_ours"][t])
                      for t in range(MAX_TOKENS))
        row = {"prompt": name, "prompt_tokens": len(prompt), "identical": not mismatch,
               "tokens_agree": MAX_TOKENS - len(mismatch),
               "max_abs_logit_diff_last": logit_diff, "max_abs_logprob_diff_all_steps": lp_diff,
               "hf_min_top2_gap": min(ref["gap"]),
               "num_cached_tokens": out.num_cached_tokens,
               "num_preemptions": out.metrics.get("num_preemptions", 0)}
        if mismatch:
            t = mismatch[0]
            ours_top = rec.top2[out.request_id][t] if t < len(rec.top2[out.request_id]) else None
            row["first_divergence"] = {
                "step": t, "ours": gen[t], "hf": ref["argmax"][t],
                "hf_logit_gap_hf_minus_ours": ref["logit_max"][t] - ref["logit_ours"][t],
                "ours_top2": ours_top}
            failures.append(f"{name}: first divergence at step {t}: ours {gen[t]}, HF "
                            f"{ref['argmax'][t]}, HF logit gap "
                            f"{ref['logit_max'][t] - ref['logit_ours'][t]:.3e}")
        if name in check_hf_greedy:
            hf_tokens = hf_ref.greedy(prompt, MAX_TOKENS)
            row["hf_kv_greedy_identical"] = hf_tokens == gen
            if hf_tokens != gen:
                t = next(i for i in range(MAX_TOKENS) if hf_tokens[i] != gen[i])
                failures.append(f"{name}: HF KV-cached greedy differs from ours at step {t}")
        if logit_diff > LOGIT_TOL:
            failures.append(f"{name}: last-step max |logit diff| {logit_diff:.3e} > {LOGIT_TOL}")
        if lp_diff > LOGPROB_TOL:
            failures.append(f"{name}: max |logprob diff| {lp_diff:.3e} > {LOGPROB_TOL}")
        rows.append(row)

    summary = {
        "num_prompts": len(names),
        "prompt_tokens_min": min(len(prompts[n]) for n in names),
        "prompt_tokens_max": max(len(prompts[n]) for n in names),
        "prompts_token_identical": sum(r["identical"] for r in rows),
        "tokens_agree": sum(r["tokens_agree"] for r in rows),
        "tokens_total": MAX_TOKENS * len(names),
        "max_abs_logit_diff_last": max((r["max_abs_logit_diff_last"] for r in rows), default=None),
        "max_abs_logprob_diff_all_steps": max((r["max_abs_logprob_diff_all_steps"] for r in rows),
                                              default=None),
        "hf_min_top2_gap": min((r["hf_min_top2_gap"] for r in rows), default=None),
        "hf_kv_greedy_checked": sum("hf_kv_greedy_identical" in r for r in rows),
        "hf_kv_greedy_identical": sum(bool(r.get("hf_kv_greedy_identical")) for r in rows),
        "failures": failures,
        "per_prompt": rows,
        **(extra or {}),
    }
    _record_numbers(scenario, summary)
    print(f"\n[{scenario}] prompts={summary['num_prompts']} "
          f"(tokens {summary['prompt_tokens_min']}..{summary['prompt_tokens_max']}), "
          f"identical={summary['prompts_token_identical']}/{len(names)}, "
          f"tokens agree {summary['tokens_agree']}/{summary['tokens_total']}, "
          f"max|logit diff| last step={summary['max_abs_logit_diff_last']:.3e}, "
          f"max|logprob diff| all steps={summary['max_abs_logprob_diff_all_steps']:.3e}, "
          f"HF min top-2 gap={summary['hf_min_top2_gap']:.3e}, "
          f"HF KV greedy identical {summary['hf_kv_greedy_identical']}/"
          f"{summary['hf_kv_greedy_checked']}"
          + "".join(f", {k}={v}" for k, v in (extra or {}).items()))
    assert not failures, (f"[{scenario}] {len(failures)} parity failure(s) "
                          f"(max logit diff {summary['max_abs_logit_diff_last']}):\n"
                          + "\n".join(failures))
    return summary


def _assert_no_leak(llm: LLM, scenario: str) -> None:
    s = llm.stats
    assert s.num_running == 0 and s.num_waiting == 0, scenario
    assert s.num_free_blocks == s.num_total_blocks, (
        f"[{scenario}] {s.num_total_blocks - s.num_free_blocks} KV blocks still held "
        f"after every request finished")


# --- scenarios ---------------------------------------------------------------------------

LONG_NAMES = ("long_doc_q1", "long_doc_q2", "long_story_1500")


def _hf_greedy_names(names) -> tuple:
    """Prompts to also decode with HF's KV-cached greedy loop (a subset, for run time)."""
    if os.environ.get("MINIVLLM_PARITY_HF_GREEDY") == "all":
        return tuple(names)
    return tuple(n for n in HF_GREEDY_SUBSET if n in names)


@pytest.fixture(scope="module")
def baseline_llm(embedded_model_dir):
    """Chunked prefill and prefix caching off: every prompt is prefilled whole."""
    return _make_llm(embedded_model_dir, enable_chunked_prefill=False,
                     enable_prefix_caching=False, max_model_len=2048,
                     num_gpu_blocks_override=512)


@pytest.mark.embedded
def test_parity_batch32_mixed_lengths(baseline_llm, prompts, hf_ref, hf_tokenizer):
    """32 prompts (5 to 500 tokens; raw text, code, lists, numbers, a repeated phrase,
    five languages, chat-templated single and multi-turn) in ONE generate call, each
    prefilled whole in the same first step, then decoded together."""
    llm, rec = baseline_llm
    names = [n for n in prompts if n not in LONG_NAMES]
    assert len(names) == 32
    lens = sorted(len(prompts[n]) for n in names)
    assert lens[0] <= 6 and lens[-1] >= 500 and len(set(lens)) >= 20, lens
    steps_before = len(llm.stats.history)
    outs = _generate(llm, names, prompts, as_text={"raw_capital", "raw_french", "raw_json"},
                     tok=hf_tokenizer)
    batched = [h[4] for h in llm.stats.history[steps_before:]]
    assert batched[0] == sum(lens), "all 32 prompts should be prefilled in the first step"
    assert max(batched[1:]) == len(names), "then all 32 should decode together"
    assert llm.stats.num_preemptions == 0
    compare("baseline_batch32", names, outs, rec, prompts, hf_ref,
            extra={"prompt_tokens_in_first_step": batched[0]},
            check_hf_greedy=_hf_greedy_names(names))
    _assert_no_leak(llm, "batch32")


@pytest.mark.embedded
def test_parity_long_prompts_unchunked(baseline_llm, prompts, hf_ref):
    """Prompts of 913, 914 and 1500 tokens, each prefilled in a single step. (Kept out
    of the 32-prompt call only for run time: the reference attention backend pads every
    decode row to the longest sequence in the batch.)"""
    llm, rec = baseline_llm
    names = list(LONG_NAMES)
    outs = _generate(llm, names, prompts)
    assert max(len(prompts[n]) for n in names) >= 1500
    assert llm.stats.num_preemptions == 0
    compare("baseline_long_unchunked", names, outs, rec, prompts, hf_ref,
            check_hf_greedy=_hf_greedy_names(names))
    _assert_no_leak(llm, "long prompts")


CHUNKED_NAMES = ["long_story_1500", "long_doc_q1", "code_500", "chat_long_300",
                 "raw_capital", "raw_chinese", "raw_repeat", "chat_haiku"]


@pytest.mark.embedded
def test_parity_chunked_prefill(embedded_model_dir, prompts, hf_ref):
    """Chunked prefill with a 256-token budget: long prompts are computed over several
    steps, interleaved with other requests' decodes."""
    budget = 256
    llm, rec = _make_llm(embedded_model_dir, enable_chunked_prefill=True,
                         max_num_batched_tokens=budget, enable_prefix_caching=False,
                         max_model_len=2048, num_gpu_blocks_override=256)
    outs = _generate(llm, CHUNKED_NAMES, prompts)
    batched = [h[4] for h in llm.stats.history]
    assert max(batched) <= budget
    # The 1500-token prompt needs >= 6 steps of prefill: it was really chunked.
    assert max(len(prompts[n]) for n in CHUNKED_NAMES) > 5 * budget
    compare("chunked_prefill_256", CHUNKED_NAMES, outs, rec, prompts, hf_ref,
            extra={"max_num_batched_tokens": budget, "num_steps": len(batched)})
    _assert_no_leak(llm, "chunked")


@pytest.mark.embedded
def test_parity_prefix_caching(embedded_model_dir, prompts, hf_ref):
    """Prefix caching on: the first call computes a shared system prompt and a shared
    900-token document; the second call's requests reuse those blocks (and one prompt is
    repeated exactly). Outputs that read cached K/V must still match HF."""
    first = ["sys_0", "long_doc_q1", "raw_capital"]
    second = ["sys_1", "sys_2", "sys_3", "sys_4", "long_doc_q2", "sys_0", "raw_json"]
    llm, rec = _make_llm(embedded_model_dir, enable_prefix_caching=True,
                         enable_chunked_prefill=False, max_model_len=2048,
                         num_gpu_blocks_override=256)
    outs1 = _generate(llm, first, prompts)
    hits_after_first = llm.stats.prefix_cache_hits
    outs2 = _generate(llm, second, prompts)
    stats = llm.stats
    assert stats.prefix_cache_hits > 0
    assert stats.prefix_cache_hits > hits_after_first, "the second call should hit the cache"
    # Every second-call request that shares a prefix with the first call got hits
    # covering the shared full blocks.
    shared_sys = _common_prefix(prompts["sys_0"], prompts["sys_1"])
    shared_doc = _common_prefix(prompts["long_doc_q1"], prompts["long_doc_q2"])
    for name, out in zip(second, outs2):
        if name.startswith("sys_"):
            assert out.num_cached_tokens >= shared_sys // 16 * 16 > 0, (name, out.num_cached_tokens)
        if name == "long_doc_q2":
            assert out.num_cached_tokens >= shared_doc // 16 * 16 > 0, out.num_cached_tokens
    compare("prefix_caching", first + second, outs1 + outs2, rec, prompts, hf_ref,
            extra={"prefix_cache_hits": stats.prefix_cache_hits,
                   "prefix_cache_queries": stats.prefix_cache_queries})
    _assert_no_leak(llm, "prefix caching")


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


PREEMPTION_NAMES = ["raw_capital", "raw_code_def", "raw_numbers", "raw_repeat", "raw_french",
                    "raw_chinese", "raw_json", "raw_table", "raw_russian", "raw_poem",
                    "chat_capital", "chat_haiku", "chat_code", "chat_spanish",
                    "chat_multiturn", "chat_math"]


@pytest.mark.embedded
def test_parity_under_preemption(embedded_model_dir, prompts, hf_ref):
    """A KV cache far smaller than the batch needs: running requests are preempted and
    later recomputed (their prompt and generated tokens re-prefilled)."""
    max_model_len, num_blocks = 256, 40
    names = [n for n in PREEMPTION_NAMES if len(prompts[n]) + MAX_TOKENS <= max_model_len]
    needed = sum(-(-(len(prompts[n]) + MAX_TOKENS) // 16) for n in names)
    assert len(names) == 16 and needed > 2 * num_blocks, (len(names), needed)
    llm, rec = _make_llm(embedded_model_dir, enable_prefix_caching=False,
                         enable_chunked_prefill=False, max_model_len=max_model_len,
                         num_gpu_blocks_override=num_blocks)
    outs = _generate(llm, names, prompts)
    stats = llm.stats
    assert stats.num_preemptions > 0
    preempted = [n for n, o in zip(names, outs) if o.metrics["num_preemptions"] > 0]
    assert preempted
    compare("preemption", names, outs, rec, prompts, hf_ref,
            extra={"num_preemptions": stats.num_preemptions,
                   "num_requests_preempted": len(preempted), "preempted": preempted,
                   "num_gpu_blocks": num_blocks, "blocks_needed_without_preemption": needed})
    _assert_no_leak(llm, "preemption")
