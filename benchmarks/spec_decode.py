"""Speculative decoding against plain decoding, measured side by side in one run.

Engines on the embedded model (float32 by default, where greedy speculative output must
equal plain output token for token):

* ``plain``: no speculation;
* ``ngram k=K``: prompt lookup (``speculative_config={"method": "ngram",
  "num_speculative_tokens": K, "prompt_lookup_min": 1, "prompt_lookup_max": 3}``);
* ``draft bf16 k=K``: the same model in bfloat16 drafting for itself
  (``{"method": "draft_model", "model": <the same folder>, "dtype": "bfloat16"}``):
  honest self-speculation (there is no second, smaller SmolLM2 here), so every draft
  token costs a full forward of a model as large as the target.

Two prompt sets, chat-formatted, greedy, ``--max-tokens`` each, EOS honoured:
"copy" (the answer repeats text from the prompt: prompt lookup's best case) and
"open" (free answers). Requests run one at a time (``max_num_seqs=1``): speculation
trades compute for fewer sequential steps, which pays at batch 1. Each engine
generates once as a warm-up and then ``--rounds`` times, engines alternating (order
reversed each round); the median tokens/s is reported.

For each engine and set: tokens/s, the ratio to plain, the acceptance rate (accepted /
draft tokens, vllm:spec_decode_num_accepted_tokens_total / ..._num_draft_tokens_total),
mean tokens per verification (1 + accepted / drafts), and how many outputs equal the
plain engine's. Prints a table and, last, one JSON line.

    python benchmarks/spec_decode.py                    # float32, 6 + 6 prompts, 48 tokens
    python benchmarks/spec_decode.py --rounds 1 --no-draft
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import time

import torch

PASSAGES = [
    "The lighthouse keeper climbed the stairs every evening at six, lit the lamp, wrote "
    "the weather in his log and watched the ships pass the northern rocks.",
    "def mean(values):\n    total = 0\n    for v in values:\n        total += v\n"
    "    return total / len(values)\n",
    "Bees visit flowers to collect nectar and pollen; the nectar becomes honey, and the "
    "pollen feeds the young bees in the hive.",
    "Rain fell on the city all night. In the morning the streets were clean, the river "
    "was high and the bakers opened their doors early.",
    "To make tea, boil fresh water, warm the pot, add one spoon of leaves per cup, pour "
    "the water and wait four minutes before serving.",
    "A prime number has exactly two divisors, one and itself: two, three, five, seven, "
    "eleven and thirteen are the first six primes.",
]
COPY = [f"Repeat the following text exactly, word for word:\n\n{p}" for p in PASSAGES]
OPEN = ["Write a short poem about the ocean.", "Explain volcanoes to a ten-year-old.",
        "Give three surprising facts about honey bees.", "Describe a quiet morning in a village.",
        "What is a prime number? Answer in two sentences.", "Tell a very short story about a cat."]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--k", type=int, default=3, help="num_speculative_tokens")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--no-draft", action="store_true", help="skip the draft-model engine")
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from minivllm import LLM, SamplingParams
    from minivllm.models.embedded import ensure_embedded_model

    model = ensure_embedded_model()
    engines = {
        "plain": None,
        f"ngram k={args.k}": {"method": "ngram", "num_speculative_tokens": args.k,
                              "prompt_lookup_min": 1, "prompt_lookup_max": 3},
    }
    if not args.no_draft:
        engines[f"draft bf16 k={args.k}"] = {"method": "draft_model", "model": str(model),
                                             "num_speculative_tokens": args.k,
                                             "dtype": "bfloat16"}
    llms = {name: LLM(model, dtype=args.dtype, max_model_len=512, max_num_seqs=1,
                      speculative_config=cfg) for name, cfg in engines.items()}
    tok = llms["plain"].get_tokenizer()
    sets = {name: [{"prompt": tok.apply_chat_template([{"role": "user", "content": p}],
                                                      add_generation_prompt=True, tokenize=False)}
                   for p in prompts] for name, prompts in (("copy", COPY), ("open", OPEN))}
    sp = SamplingParams(temperature=0, max_tokens=args.max_tokens)

    def run(llm, prompts):
        st = llm.llm_engine.stats
        before = (st.spec_decode_num_drafts, st.spec_decode_num_draft_tokens,
                  st.spec_decode_num_accepted_tokens, st.num_steps)
        t0 = time.perf_counter()
        outs = llm.generate(prompts, sp, use_tqdm=False)
        dt = time.perf_counter() - t0
        st = llm.llm_engine.stats
        after = (st.spec_decode_num_drafts, st.spec_decode_num_draft_tokens,
                 st.spec_decode_num_accepted_tokens, st.num_steps)
        d = [a - b for a, b in zip(after, before)]
        ids = [o.outputs[0].token_ids for o in outs]
        return ids, sum(map(len, ids)) / dt, d

    results = {}
    for set_name, prompts in sets.items():
        for llm in llms.values():  # warm-up
            run(llm, prompts[:1])
        tps = {n: [] for n in llms}
        counts, outputs = {}, {}
        order = list(llms)
        for r in range(args.rounds):
            for name in (order if r % 2 == 0 else order[::-1]):
                ids, t, d = run(llms[name], prompts)
                tps[name].append(t)
                counts[name], outputs[name] = d, ids
        for name in llms:
            drafts, draft_toks, acc, steps = counts[name]
            results[(set_name, name)] = {
                "tok_s": statistics.median(tps[name]), "runs_tok_s": [round(x, 2) for x in tps[name]],
                "acceptance": acc / draft_toks if draft_toks else None,
                "tokens_per_verification": 1 + acc / drafts if drafts else None,
                "steps": steps, "generated": sum(map(len, outputs[name])),
                "equal_to_plain": sum(a == b for a, b in zip(outputs[name], outputs["plain"])),
                "num_prompts": len(prompts)}
    print(f"\nspeculative decoding, {args.dtype}, k={args.k}, {args.max_tokens} tokens, "
          f"batch 1, median of {args.rounds} rounds, {torch.get_num_threads()} threads, "
          f"{platform.machine()}")
    print(f"{'set':5} {'engine':16} {'tok/s':>7} {'vs plain':>8} {'accept':>7} "
          f"{'tok/verif':>9} {'steps':>6} {'= plain':>8}")
    for (set_name, name), r in results.items():
        base = results[(set_name, "plain")]["tok_s"]
        acc = "-" if r["acceptance"] is None else f"{r['acceptance']:.3f}"
        tpv = "-" if r["tokens_per_verification"] is None else f"{r['tokens_per_verification']:.2f}"
        print(f"{set_name:5} {name:16} {r['tok_s']:7.1f} {r['tok_s'] / base:7.2f}x {acc:>7} "
              f"{tpv:>9} {r['steps']:6d} {r['equal_to_plain']:>4}/{r['num_prompts']}")
    out = {f"{s}|{n}": {**r, "tok_s": round(r["tok_s"], 2),
                        "ratio_vs_plain": round(r["tok_s"] / results[(s, "plain")]["tok_s"], 3)}
           for (s, n), r in results.items()}
    print(json.dumps({"dtype": args.dtype, "k": args.k, "max_tokens": args.max_tokens,
                      "rounds": args.rounds, "results": out}))
    del llms
    gc.collect()


if __name__ == "__main__":
    main()
