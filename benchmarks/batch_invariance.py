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
    python benchmarks/batch_invariance.py --device cuda --dummy-smollm2-shapes --check-logits
        # on a GPU with no checkpoint: random weights of SmolLM2-135M's shapes (a config
        # written to a temporary folder, load_format="dummy", token-id prompts), plus
        # the bitwise logits check

``--check-logits`` also scores a fixed 16-token sequence in decode mode alone and beside
three batch compositions (other prompts generating beside it) with each mode and prints
whether the logits are bitwise equal to the solo run's (the check of
``tests/test_batch_invariant.py``).
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
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--load-format", default="auto", choices=["auto", "dummy"])
    ap.add_argument("--check-logits", action="store_true")
    ap.add_argument("--dummy-smollm2-shapes", action="store_true",
                    help="random weights of SmolLM2-135M's shapes, no tokenizer")
    args = ap.parse_args()
    if args.num_prompts < 1 or args.max_tokens < 1 or args.rounds < 1:
        ap.error("--num-prompts, --max-tokens and --rounds must be >= 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    from minivllm import LLM, SamplingParams

    prompts = [PROMPTS[i % len(PROMPTS)] + ("" if i < len(PROMPTS) else f" ({i})")
               for i in range(args.num_prompts)]
    extra = {}
    if args.dummy_smollm2_shapes:
        args.model, args.load_format = _smollm2_shapes_folder(), "dummy"
        extra["skip_tokenizer_init"] = True
        prompts = [{"prompt_token_ids": [(13 * i + 7 * j) % 40000 + 100
                                         for j in range(5 + (7 * i) % 26)]}
                   for i in range(args.num_prompts)]
    sp = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    kw = dict(dtype=args.dtype, device=args.device, load_format=args.load_format,
              max_model_len=512, **extra)
    engines = {"default": LLM(args.model, **kw),
               "batch_invariant": LLM(args.model, batch_invariant=True, **kw)}
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
    logits_equal = check_logits(engines) if args.check_logits else None
    print(json.dumps({"dtype": args.dtype, "device": args.device,
                      "load_format": args.load_format, "logits_bitwise_equal": logits_equal, "num_prompts": args.num_prompts,
                      "max_tokens": args.max_tokens, "rounds": args.rounds,
                      "threads": torch.get_num_threads(),
                      "default_tok_s": round(tok_s["default"], 2),
                      "batch_invariant_tok_s": round(tok_s["batch_invariant"], 2),
                      "slowdown": round(slowdown, 3),
                      "prompt0_alone_equals_batched": same_alone}))


def _smollm2_shapes_folder() -> str:
    """A folder with a config.json of SmolLM2-135M-Instruct's shapes (nothing else)."""
    import tempfile
    from pathlib import Path

    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
           "hidden_size": 576, "intermediate_size": 1536, "num_attention_heads": 9,
           "num_key_value_heads": 3, "num_hidden_layers": 30, "head_dim": 64,
           "vocab_size": 49152, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5,
           "rope_theta": 100000.0, "tie_word_embeddings": True, "bos_token_id": 1,
           "eos_token_id": 2, "hidden_act": "silu", "torch_dtype": "float32"}
    folder = Path(tempfile.mkdtemp()) / "smollm2-135m-shapes"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(cfg))
    return str(folder)


def check_logits(engines: dict) -> dict:
    """Per mode: is a fixed sequence's decode-mode logits bitwise equal alone and in each
    of three batch compositions? Prints the max |dlogit| per composition."""
    from minivllm.precision.batching import decode_logits_beside

    target = [(37 * i + 11) % 5000 + 100 for i in range(16)]
    comps = {"one 30-token prompt": [[100 + i for i in range(30)]],
             "3 prompts (7, 20, 45 tokens)": [[200 + i for i in range(7)],
                                             [300 + i for i in range(20)],
                                             [400 + (7 * i) % 900 for i in range(45)]],
             "2 prompts (3, 60 tokens)": [[900 + i for i in range(3)],
                                          [1000 + (3 * i) % 700 for i in range(60)]]}
    out = {}
    for name, llm in engines.items():
        def run(companions):
            return decode_logits_beside(llm, target, companions)
        alone = run([])
        diffs = {c: float((run(cs) - alone).abs().max()) for c, cs in comps.items()}
        print(f"{name}: decode logits, max |dlogit| vs alone per composition: {diffs}")
        out[name] = all(d == 0 for d in diffs.values())
    return out


if __name__ == "__main__":
    main()
