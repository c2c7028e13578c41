"""Offline throughput: minivllm against HF transformers ``generate``, same prompts, one run.

64 chat prompts (by default), greedy, exactly ``--max-tokens`` new tokens each on every
side (EOS ignored: ``ignore_eos`` for minivllm, ``min_new_tokens`` for HF). Three
measurements, wall time of generation only (model loading and a warm-up excluded):

* minivllm: all prompts in one ``LLM.generate`` call (continuous batching);
* HF batched: ``generate`` on left-padded batches of ``--hf-batch-size`` prompts;
* HF sequential: ``generate`` one prompt at a time (once; it is 10x+ slower).

Both engines first warm up on the full prompt set (8 tokens). minivllm and HF batched
then run ``--rounds`` times alternately, order swapped each round (ABBA), and the median
of each is reported: this machine's speed drifts by 10-25 % over minutes, and a single
back-to-back pair lets that drift decide the ratio.

Prints a table and, as its last line, one JSON object with minivllm_tok_s,
hf_sequential_tok_s, hf_batched_tok_s, speedup_vs_hf_sequential, speedup_vs_hf_batched.

    python benchmarks/throughput.py            # the recorded configuration
    python benchmarks/throughput.py --num-prompts 8 --max-tokens 32   # quick look
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

TOPICS = ["the ocean", "volcanoes", "the moon", "honey bees", "ancient Rome", "jazz music",
          "bicycles", "rainforests", "chess", "the printing press", "glaciers", "coffee"]
TASKS = ["Write a short poem about {}.", "Explain {} to a ten-year-old.",
         "Give three surprising facts about {}.", "Write a short story involving {}.",
         "What are the main risks related to {}?", "Describe {} in the style of a news report."]


def make_prompts(n: int) -> list[list[dict]]:
    convs = []
    for i in range(n):
        task = TASKS[i % len(TASKS)]
        topic = TOPICS[(i // len(TASKS) + i) % len(TOPICS)]
        convs.append([{"role": "user", "content": task.format(topic)}])
    return convs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--hf-batch-size", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3,
                    help="alternating rounds of minivllm and HF batched (median reported)")
    ap.add_argument("--skip-hf-sequential", action="store_true")
    args = ap.parse_args()

    from transformers import AutoModelForCausalLM

    from minivllm import LLM, SamplingParams
    from minivllm.models.loader import resolve_model_path

    model_dir = str(resolve_model_path(args.model))
    llm = LLM(model_dir, dtype="float32", max_num_seqs=max(64, args.num_prompts),
              max_model_len=2048, enable_prefix_caching=False)
    tok = llm.get_tokenizer()
    prompts = [tok.encode(tok.apply_chat_template(c, tokenize=False, add_generation_prompt=True),
                          add_special_tokens=False) for c in make_prompts(args.num_prompts)]
    n_new = args.max_tokens
    total = n_new * len(prompts)
    print(f"{len(prompts)} prompts ({min(map(len, prompts))}-{max(map(len, prompts))} tokens), "
          f"{n_new} new tokens each, torch threads={torch.get_num_threads()}, "
          f"{platform.processor() or platform.machine()}")

    params = SamplingParams(temperature=0.0, max_tokens=n_new, ignore_eos=True)

    def run_minivllm() -> float:
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        dt = time.perf_counter() - t0
        assert all(len(o.outputs[0].token_ids) == n_new for o in outs)
        return total / dt

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0

    def hf_generate(batch: list[list[int]], n: int = n_new) -> int:
        width = max(map(len, batch))
        ids = torch.full((len(batch), width), pad, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, p in enumerate(batch):  # left padding
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        with torch.no_grad():
            out = hf.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                              do_sample=False, pad_token_id=pad)
        new = out.shape[1] - width
        assert new == n, new
        return new * len(batch)

    def run_hf_batched() -> float:
        t0 = time.perf_counter()
        done = 0
        for i in range(0, len(prompts), args.hf_batch_size):
            done += hf_generate(prompts[i:i + args.hf_batch_size])
        return done / (time.perf_counter() - t0)

    # Warm-up at full batch size (first large prefill pays page faults and allocator
    # growth, which would otherwise land on whichever engine runs first).
    warm = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    llm.generate(prompts, warm, use_tqdm=False)
    for i in range(0, len(prompts), args.hf_batch_size):
        hf_generate(prompts[i:i + args.hf_batch_size], 8)

    # Alternate the two batched engines, order swapped every round (ABBA), so drift in
    # this shared machine's speed lands on both; report the median of each.
    ours_runs, hf_runs = [], []
    for r in range(args.rounds):
        order = [("minivllm", run_minivllm, ours_runs), ("HF batched", run_hf_batched, hf_runs)]
        for name, fn, acc in (order if r % 2 == 0 else order[::-1]):
            acc.append(fn())
            print(f"round {r + 1}/{args.rounds}  {name:<10} {acc[-1]:7.1f} tok/s", flush=True)
    ours_tok_s = statistics.median(ours_runs)
    hf_batched_tok_s = statistics.median(hf_runs)
    print(f"minivllm: median {ours_tok_s:.1f} tok/s; HF batched (batch {args.hf_batch_size}): "
          f"median {hf_batched_tok_s:.1f} tok/s")

    hf_seq_tok_s = None
    if not args.skip_hf_sequential:
        from tqdm.auto import tqdm

        t0 = time.perf_counter()
        done = sum(hf_generate([p]) for p in tqdm(prompts, desc="HF sequential"))
        t_seq = time.perf_counter() - t0
        hf_seq_tok_s = done / t_seq
        print(f"HF sequential: {t_seq:.1f} s, {hf_seq_tok_s:.1f} tok/s")

    result = {
        "num_prompts": len(prompts), "max_tokens": n_new,
        "minivllm_tok_s": round(ours_tok_s, 2),
        "hf_sequential_tok_s": None if hf_seq_tok_s is None else round(hf_seq_tok_s, 2),
        "hf_batched_tok_s": round(hf_batched_tok_s, 2),
        "speedup_vs_hf_sequential": None if hf_seq_tok_s is None else round(ours_tok_s / hf_seq_tok_s, 2),
        "speedup_vs_hf_batched": round(ours_tok_s / hf_batched_tok_s, 2),
        "rounds": args.rounds,
        "minivllm_runs_tok_s": [round(x, 2) for x in ours_runs],
        "hf_batched_runs_tok_s": [round(x, 2) for x in hf_runs],
    }
    print("\n| engine | tok/s | minivllm speedup |\n|---|---|---|")
    print(f"| minivllm (continuous batching) | {ours_tok_s:.1f} | 1.00x |")
    print(f"| HF generate, batched x{args.hf_batch_size} | {hf_batched_tok_s:.1f} | "
          f"{result['speedup_vs_hf_batched']:.2f}x |")
    if hf_seq_tok_s is not None:
        print(f"| HF generate, one prompt at a time | {hf_seq_tok_s:.1f} | "
              f"{result['speedup_vs_hf_sequential']:.2f}x |")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
