"""Decode step time and TTFT against the KV-cache dtype on a GPU, next to the bytes-moved
cost model (course chapter 28: precision against a latency SLA).

A Llama-3-8B-shaped model with random bf16 weights (``load_format="dummy"``, nothing to
download), CUDA graphs on, prompts of ``--context`` random tokens, ``--new-tokens`` greedy
tokens. For each KV-cache dtype (bf16 = "auto", fp8_e4m3) and batch size:

* ``ttft_ms``: the whole ``generate`` call for 1 new token (prefill of batch x context
  tokens plus one sampled token), median of ``--reps``;
* ``step_ms``: one decode step, timed through ``LLMEngine.step()`` once every request has
  finished its prefill (N - 1 steps, each checked to have scheduled exactly one token per
  request: decode only), median of ``--reps``;
* ``gen_step_ms``: (time of ``generate`` for N tokens - time for 1 token) / (N - 1), the
  measure this script used until 2026-12-06. With chunked prefill the first requests
  decode while later ones still prefill, so it mixes prefill chunks (and the prefill
  kernel) into the "step", and it is noisy: on an H100 at batch 64 / 2k one run of it
  gave fp8 0.99x bf16 and the median of three 1.14x, where the decode step alone gave
  1.17x (2026-12-06, ``benchmarks/RESULTS.md``);
* ``model_step_ms``: the cost model, (weight bytes + batch x context x KV bytes per token)
  / copy bandwidth (measured in the same run): the time a step needs if it only streamed
  its bytes once at the copy bandwidth;
* ``frac_model``: model_step_ms / step_ms.

The fp8 cache halves the K/V bytes, so the cost model predicts a shorter step whenever
K/V bytes are a visible share of the step's bytes; whether the kernel delivers it is what
this measures. The earlier fp8 decode kernel (``--fp8-kernels exact``) reads at about
45 % of copy bandwidth on an H200 (``benchmarks/fp8_decode_probe.py``), the bf16 one at
91-107 %; the default one (``folded``) at 83 % at batch 64 / 4k on an H100
(``benchmarks/fp8_decode.py``, ``benchmarks/RESULTS.md``).

Usage: ``python benchmarks/precision_sla.py`` (needs CUDA; about 3 minutes on an H200).
Prints one table and a last JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import minivllm  # noqa: E402,F401
import torch  # noqa: E402

from benchmarks.gpu_suite import LLAMA3_8B, copy_bandwidth, table  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--new-tokens", type=int, default=33)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--layers", type=int, default=32, help="fewer for a quick check")
    ap.add_argument("--fp8-kernels", nargs="+", default=["folded"],
                    choices=["folded", "exact"], help="fp8 decode kernels to run "
                    "(paged_attention_decode's fp8_kernel; one fp8 row each)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("precision_sla.py needs CUDA", file=sys.stderr)
        return 2
    from minivllm import LLM, SamplingParams

    bw = copy_bandwidth()
    cfg = dict(LLAMA3_8B, num_hidden_layers=args.layers)
    folder = Path(tempfile.mkdtemp()) / "llama3-8b-shape"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(cfg))
    gen = torch.Generator().manual_seed(0)
    rows = []
    import functools

    from minivllm_kernels import paged_attention as PA

    decode = PA.paged_attention_decode
    chunk = 16384  # max_num_batched_tokens below

    def warm_steps(B: int) -> int:  # prefill chunks, then 2 more steps
        return -(-B * args.context // chunk) + 2

    warm_max = warm_steps(max(args.batches))
    for kv, kernel in [("auto", None)] + [("fp8_e4m3", k) for k in args.fp8_kernels]:
        # the TRITON backend imports paged_attention_decode when the engine starts
        PA.paged_attention_decode = functools.partial(decode, fp8_kernel=kernel or "folded")
        llm = LLM(str(folder), device="cuda", dtype="bfloat16", load_format="dummy",
                  skip_tokenizer_init=True, kv_cache_dtype=kv,
                  max_model_len=args.context + args.new_tokens + warm_max + 8,
                  max_num_seqs=max(args.batches), kv_cache_memory_bytes=int(40e9),
                  enable_prefix_caching=False, max_num_batched_tokens=chunk)
        model = llm.llm_engine.model_runner.model
        weight_bytes = sum(p.numel() * p.element_size() for n, p in model.named_parameters()
                           if "embed_tokens" not in n) + cfg["hidden_size"] * 2
        elem = 1 if kv == "fp8_e4m3" else 2
        kv_per_token = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * 128 * elem

        def run(B, n):
            p = torch.randint(0, cfg["vocab_size"], (B, args.context), generator=gen).tolist()
            sp = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            llm.generate([{"prompt_token_ids": x} for x in p], sp, use_tqdm=False)  # noqa: F821 (del below)
            torch.cuda.synchronize()
            return time.perf_counter() - t0

        def decode_step(B, n):
            """Seconds per decode step: n engine steps once all B requests decode."""
            eng = llm.llm_engine  # noqa: F821 (del below)
            p = torch.randint(0, cfg["vocab_size"], (B, args.context), generator=gen).tolist()
            sp = SamplingParams(temperature=0, max_tokens=warm_steps(B) + n + 1,
                                ignore_eos=True)
            ids = [eng.add_request(x, sp) for x in p]
            for _ in range(warm_steps(B)):
                eng.step()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(n):
                eng.step()
            torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            tokens = [h[-1] for h in eng.stats.history[-n:]]  # tokens scheduled per step
            eng.abort_request(ids)
            if tokens != [B] * n:
                raise RuntimeError(f"timed steps were not decode-only steps of batch {B}: "
                                   f"tokens scheduled {tokens}")
            return dt / n

        run(1, 2)  # warm
        for B in args.batches:
            pairs = [(run(B, args.new_tokens), run(B, 1)) for _ in range(args.reps)]
            gen_step = statistics.median((a - b) / (args.new_tokens - 1) for a, b in pairs)
            ttft = statistics.median(b for _, b in pairs)
            step = statistics.median(decode_step(B, args.new_tokens - 1)
                                     for _ in range(args.reps))
            ctx = args.context + args.new_tokens / 2
            model_s = (weight_bytes + B * ctx * kv_per_token) / bw
            rows.append(dict(kv_cache_dtype="bf16" if kv == "auto" else f"{kv} {kernel}",
                             batch=B,
                             kv_GB=round(B * ctx * kv_per_token / 1e9, 3),
                             weight_GB=round(weight_bytes / 1e9, 2),
                             ttft_ms=round(ttft * 1e3, 1), step_ms=round(step * 1e3, 3),
                             gen_step_ms=round(gen_step * 1e3, 3),
                             model_step_ms=round(model_s * 1e3, 3),
                             frac_model=round(model_s / step, 3)))
            print(rows[-1], flush=True)
        del llm, model
        torch.cuda.empty_cache()
    print(f"Llama-3-8B shape, {args.layers} layers, random bf16 weights, context "
          f"{args.context}, {args.new_tokens} new tokens, copy bandwidth {bw / 1e9:.0f} GB/s, "
          f"{torch.cuda.get_device_name()}")
    print(table(rows, list(rows[0])))
    PA.paged_attention_decode = decode

    def step(B, name):
        return next(r["step_ms"] for r in rows if r["batch"] == B and r["kv_cache_dtype"] == name)

    speed = {f"{k} {B}": step(B, "bf16") / step(B, f"fp8_e4m3 {k}")
             for k in args.fp8_kernels for B in args.batches}
    print(json.dumps({"gpu": torch.cuda.get_device_name(), "copy_GBps": round(bw / 1e9),
                      "context": args.context, "rows": rows,
                      "fp8_kv_step_speedup": {k: round(v, 3) for k, v in speed.items()}}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
