"""KV-cache dtype sweep on the embedded model with the precision toolkit.

Baseline: minivllm float32 weights and float32 KV cache. Candidates: KV cache in float16,
bfloat16, fp8_e4m3 and fp8_e5m2 (scale 1.0). Measured on the evaluation sets:

* "corpus" and "conversations": teacher-forced KL (mean, 95 % cluster-bootstrap CI),
  top-1 agreement, perplexity ratio; the noise floor (baseline with its MLP reduction
  reordered) tells which differences are more than float32 rounding noise;
* "passkey": greedy retrieval accuracy per context length (256 to 4096 tokens).

Writes reports/kv_cache_sweep/ (report.md, report.json, PNGs) and prints, as its last
line, one JSON object (the report's JSON).

    python benchmarks/kv_cache_sweep.py                  # the recorded run (~20 min on 2 cores)
    python benchmarks/kv_cache_sweep.py --quick          # a smaller look (~3 min)
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--mode", choices=["prefill", "decode"], default="prefill")
    ap.add_argument("--out", default="reports/kv_cache_sweep")
    ap.add_argument("--quick", action="store_true",
                    help="2 corpus windows, 2 conversations, passkey 256/1024 only")
    args = ap.parse_args()

    from minivllm.precision.report import compare

    kw = {}
    if args.quick:
        kw = dict(max_sequences=2, passkey_lengths=[256, 1024], max_passkey_items=2)
    t0 = time.perf_counter()
    rep = compare({"dtype": "float32", "kv_cache_dtype": "float32"},
                  [{"dtype": "float32", "kv_cache_dtype": kv}
                   for kv in ("float16", "bfloat16", "fp8_e4m3", "fp8_e5m2")],
                  eval_sets=("corpus", "conversations", "passkey"), model=args.model,
                  mode=args.mode, **kw)
    paths = rep.save(args.out)
    print(rep.to_markdown())
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, "
          f"{time.perf_counter() - t0:.0f} s; wrote {', '.join(str(p) for p in paths.values())}")
    print(json.dumps(rep.to_json()))


if __name__ == "__main__":
    main()
