"""Build the evaluation sets (see README.md here). Deterministic given the model.

    python -m minivllm.precision.evalsets.build            # all sets
    python -m minivllm.precision.evalsets.build --only qa passkey

Uses the float32 HF reference (``ReferenceModel``) on the embedded model: it answers
the QA candidates (only correct answers are kept), writes the assistant turns of the
conversations, and records its own passkey answers.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from minivllm.precision.evalsets import answer_matches, passkey_correct, qa_prompt
from minivllm.precision.evalsets.qa_candidates import candidates

HERE = Path(__file__).parent

PASSKEY_LENGTHS = (256, 512, 1024, 2048, 4096)
PASSKEY_DEPTHS = (0.1, 0.3, 0.5, 0.7, 0.9)
PASSKEY_INTRO = ("There is an important piece of information hidden inside a lot of "
                 "irrelevant text. Find it and remember it; I will ask you about it.")
PASSKEY_FILLER = ("The grass is green. The sky is blue. The sun is yellow. Here we go. "
                  "There and back again. ")
PASSKEY_QUESTION = "What is the pass key? Answer with the number only."

TOPICS = ["baking bread at home", "learning to play the guitar", "training for a first "
          "marathon", "keeping a vegetable garden", "saving money on a small salary",
          "learning a second language", "adopting a rescue dog", "planning a trip to Japan",
          "writing a short story", "starting to exercise after a long break",
          "understanding how computers store numbers", "taking better photographs"]
SCRIPTS = [
    ["I am interested in {topic}. Where should a beginner start?",
     "Why is that the best first step?",
     "Can you give me a concrete example?",
     "What is a common mistake people make with it?",
     "How would you explain it to a ten-year-old?",
     "What tools or materials do I need?",
     "How long does it usually take to see progress?",
     "Can you give me three quick tips?",
     "Summarize what we discussed so far in two sentences.",
     "Thank you. What is the single most important thing to remember?"],
    ["Tell me something interesting about {topic}.",
     "That is surprising. Can you say more?",
     "What would an expert do differently from a beginner?",
     "What is one thing that can go wrong, and how do I fix it?",
     "Give me a simple plan for the first week.",
     "What should I do in the second week?",
     "How do I know if I am doing it right?",
     "Is there a good book or resource you would recommend?",
     "Can you repeat the plan for the first week in a short list?",
     "Great. Please end with a word of encouragement."],
]


def build_qa(ref, batch_size: int = 32, max_tokens: int = 24) -> list[dict]:
    # An answer the question already contains ("capital of Singapore") would match any
    # echo of the question, so such candidates are left out.
    items = [c for c in candidates() if not answer_matches(c[1], c[2])]
    tok = ref.tokenizer
    kept: list[dict] = []
    for i in tqdm(range(0, len(items), batch_size), desc="qa"):
        batch = items[i:i + batch_size]
        prompts = [ref.encode_chat(qa_prompt(q)) for _, q, _ in batch]
        outs = ref.generate(prompts, max_tokens)
        for (cat, q, answers), out in zip(batch, outs):
            text = tok.decode(out, skip_special_tokens=True)
            if answer_matches(text, answers):
                kept.append({"id": f"qa-{len(kept):03d}", "category": cat, "question": q,
                             "answers": answers, "reference_output": text})
    print(f"qa: {len(kept)} of {len(items)} candidates answered correctly by the reference")
    return kept


def _passkey_prompt(n_filler: int, depth: float, key: str) -> str:
    before = round(n_filler * depth)
    return (PASSKEY_INTRO + "\n\n" + PASSKEY_FILLER * before
            + f"The pass key is {key}. Remember it. {key} is the pass key. "
            + PASSKEY_FILLER * (n_filler - before) + "\n\n" + PASSKEY_QUESTION)


def build_passkey(ref, max_tokens: int = 12) -> list[dict]:
    tok = ref.tokenizer
    rng = random.Random(1234)
    items: list[dict[str, Any]] = []
    for target in PASSKEY_LENGTHS:
        for depth in PASSKEY_DEPTHS:
            key = str(rng.randint(10000, 99999))

            def length(n: int) -> int:
                return len(ref.encode_chat([{"role": "user",
                                             "content": _passkey_prompt(n, depth, key)}]))
            n = 1  # largest filler count whose prompt fits in the target
            while length(n * 2) <= target:
                n *= 2
            lo, hi = n, n * 2
            while hi - lo > 1:
                mid = (lo + hi) // 2
                lo, hi = (mid, hi) if length(mid) <= target else (lo, mid)
            prompt = _passkey_prompt(lo, depth, key)
            items.append({"id": f"passkey-{target}-{int(depth * 100):02d}", "target_tokens": target,
                          "num_tokens": length(lo), "depth": depth, "passkey": key,
                          "prompt": prompt})
    for it in tqdm(items, desc="passkey (reference answers)"):
        out = ref.generate(ref.encode_chat([{"role": "user", "content": it["prompt"]}]), max_tokens)
        it["reference_output"] = tok.decode(out, skip_special_tokens=True)
    ok = sum(passkey_correct(it["reference_output"], it["passkey"]) for it in items)
    print(f"passkey: {len(items)} items, reference correct on {ok}")
    return items


def build_conversations(ref, max_tokens: int = 64) -> list[dict]:
    tok = ref.tokenizer
    convs: list[list[dict]] = [[] for _ in TOPICS]
    scripts = [SCRIPTS[i % len(SCRIPTS)] for i in range(len(TOPICS))]
    for turn in tqdm(range(len(SCRIPTS[0])), desc="conversations (turns)"):
        for conv, script, topic in zip(convs, scripts, TOPICS):
            conv.append({"role": "user", "content": script[turn].format(topic=topic)})
        outs = ref.generate([ref.encode_chat(c) for c in convs], max_tokens)
        for conv, out in zip(convs, outs):
            conv.append({"role": "assistant",
                         "content": tok.decode(out, skip_special_tokens=True).strip()})
    return [{"id": f"conv-{i:02d}", "topic": t, "messages": c}
            for i, (t, c) in enumerate(zip(TOPICS, convs))]


def _write(name: str, rows: list[dict]) -> None:
    with open(HERE / name, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    print(f"wrote {HERE / name} ({len(rows)} items)")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--only", nargs="*", choices=["qa", "passkey", "conversations"])
    args = ap.parse_args(argv)
    from minivllm.precision.reference import ReferenceModel

    ref = ReferenceModel(args.model, dtype="float32")
    todo = args.only or ["qa", "passkey", "conversations"]
    if "qa" in todo:
        _write("qa.jsonl", build_qa(ref))
    if "passkey" in todo:
        _write("passkey.jsonl", build_passkey(ref))
    if "conversations" in todo:
        _write("conversations.jsonl", build_conversations(ref))


if __name__ == "__main__":
    main()
