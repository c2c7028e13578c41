"""Throughput of the batch-invariant mode next to the default mode, measured in one run.

Two engines on the same model and dtype: ``LLM(batch_invariant=False)`` (default) and
``LLM(batch_invariant=True)`` (chapter 5; vLLM's ``VLLM_BATCH_INVARIANT=1``). Both
generate the same ``--num-prompts`` prompts of different lengths (greedy, exactly
``--max-tokens`` tokens each, EOS ignored) in one ``LLM.generate`` call, after a warm-up.
They run ``--rounds`` times alternately, order swapped each round (ABBA), and the median
tokens/s of each is reported with their ratio: this machine's speed drifts over minutes,
and a back-to-back pair would let the drift decide the ratio.

It also checks what the mode is for: the first prompt's tokens alone and in the batch
(equal in the batch-invariant mode; in the default mode they may differ).

Prints a table and, as its last line, one JSON object (default_tok_s,
batch_invariant_tok_s, slowdown, and the equality checks).

    python benchmarks/batch_invariance.py                       # bfloat16, 8 x 32 tokens
    python benchmarks/batch_invariance.py --dtype float32 --num-prompts 4 --max-tokens 16
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

PROMPTS = ["Dear diary, today I", "Write a short poem about the ocean.",
           "Explain volcanoes to a ten-year-old, in a few simple sentences.",
           "Give three surprising facts about honey bees.", "The capital of France is",
           "Summarize the plot of a famous novel about a whale and a captain who hunts it "
           "across the oceans of the world, in three short sentences.",
           "What are the main risks related to glaciers melting?", "Python is a language"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = ap.parse_args()
    if args.num_prompts < 1 or args.max_tokens < 1 or args.rounds < 1:
        ap.error("--num-prompts, --max-tokens and --rounds must be >= 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    from minivllm import LLM, SamplingParams

    prompts = [PROMPTS[i % len(PROMPTS)] + ("" if i < len(PROMPTS) else f" ({i})")
               for i in range(args.num_prompts)]
    sp = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    engines = {"default": LLM(dtype=args.dtype),
               "batch_invariant": LLM(dtype=args.dtype, batch_invariant=True)}
    for llm in engines.values():  # warm-up
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    times: dict[str, list[float]] = {k: [] for k in engines}
    outs: dict[str, list] = {}
    for r in range(args.rounds):
        order = list(engines) if r % 2 == 0 else list(engines)[::-1]
        for name in order:
            t0 = time.perf_counter()
            res = engines[name].generate(prompts, sp)
            times[name].append(time.perf_counter() - t0)
            outs[name] = [o.outputs[0].token_ids for o in res]
    n_tokens = args.num_prompts * args.max_tokens
    tok_s = {k: n_tokens / statistics.median(v) for k, v in times.items()}
    same_alone = {k: engines[k].generate([prompts[0]], sp)[0].outputs[0].token_ids == outs[k][0]
                  for k in engines}
    print(f"{platform.processor() or platform.machine()}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, {args.dtype}, {args.num_prompts} prompts x "
          f"{args.max_tokens} tokens, median of {args.rounds} rounds (ABBA)")
    print(f"{'mode':<16} {'tok/s':>8}  {'prompt 0 alone == in batch':>27}")
    for k in engines:
        print(f"{k:<16} {tok_s[k]:8.1f}  {str(same_alone[k]):>27}")
    slowdown = tok_s["default"] / tok_s["batch_invariant"]
    print(f"batch_invariant is {slowdown:.2f}x slower than default (tokens/s ratio)")
    print(json.dumps({"dtype": args.dtype, "num_prompts": args.num_prompts,
                      "max_tokens": args.max_tokens, "rounds": args.rounds,
                      "threads": torch.get_num_threads(),
                      "default_tok_s": round(tok_s["default"], 2),
                      "batch_invariant_tok_s": round(tok_s["batch_invariant"], 2),
                      "slowdown": round(slowdown, 3),
                      "prompt0_alone_equals_batched": same_alone}))


if __name__ == "__main__":
    main()
