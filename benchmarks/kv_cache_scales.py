"""KV-cache scales on the embedded model: fp8/int8 with scale 1.0, calibrated per-tensor
and per-head static scales, and dynamic per-token scales.

Baseline: minivllm float32 weights and float32 KV cache. Measured with the precision
toolkit on the chat conversations (teacher-forced KL, top-1 agreement, perplexity ratio)
and on passkey retrieval at 2048 and 4096 tokens (greedy). Calibrated scales come from
the bundled prose corpus (``calculate_kv_scales=True``), which neither evaluation set
contains. Also prints each configuration's calibrated per-layer K/V amax (the scale times
the format's largest value), so the saturation story can be read off.

Writes reports/kv_cache_scales/ and prints, as its last line, one JSON object (the
report's JSON plus the scales).

    python benchmarks/kv_cache_scales.py           # the recorded run (~15 min on 2 cores)
    python benchmarks/kv_cache_scales.py --quick   # 2 conversations, 1 passkey per length
"""

from __future__ import annotations

import argparse
import json
import time

import torch

CANDIDATES = {
    "fp8_e4m3, scale 1.0": {"kv_cache_dtype": "fp8_e4m3"},
    "fp8_e4m3, calibrated per tensor": {"kv_cache_dtype": "fp8_e4m3", "calculate_kv_scales": True},
    "fp8_e4m3, calibrated per head": {"kv_cache_dtype": "fp8_e4m3", "calculate_kv_scales": True,
                                      "kv_scale_granularity": "head"},
    "fp8_e4m3, dynamic per token": {"kv_cache_dtype": "fp8_e4m3", "kv_scale_type": "dynamic"},
    "fp8_e5m2, scale 1.0": {"kv_cache_dtype": "fp8_e5m2"},
    "fp8_e5m2, calibrated per tensor": {"kv_cache_dtype": "fp8_e5m2", "calculate_kv_scales": True},
    "int8, calibrated per tensor": {"kv_cache_dtype": "int8", "calculate_kv_scales": True},
    "int8, calibrated per head": {"kv_cache_dtype": "int8", "calculate_kv_scales": True,
                                  "kv_scale_granularity": "head"},
    "int8, dynamic per token": {"kv_cache_dtype": "int8", "kv_scale_type": "dynamic"},
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--out", default="reports/kv_cache_scales")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()

    from minivllm.precision.report import compare

    kw = dict(max_sequences=2, max_passkey_items=1) if args.quick else {}
    t0 = time.perf_counter()
    cands = [{"dtype": "float32", "max_model_len": 4608, **c} for c in CANDIDATES.values()]
    rep = compare({"dtype": "float32", "kv_cache_dtype": "float32", "max_model_len": 4608},
                  cands, eval_sets=("conversations", "passkey"), model=args.model,
                  passkey_lengths=[2048, 4096], **kw)
    paths = rep.save(args.out)
    print(rep.to_markdown())
    # Reading the scales back needs the engines: build each calibrated config once more.
    from minivllm import LLM

    scales = {}
    for name, c in CANDIDATES.items():
        if c.get("calculate_kv_scales"):
            llm = LLM(args.model, dtype="float32", max_model_len=1024,
                      kv_cache_memory_bytes=32 << 20, **c)
            s = llm.kv_cache_scales()
            qmax = {"fp8_e4m3": 448.0, "fp8_e5m2": 57344.0, "int8": 127.0}[c["kv_cache_dtype"]]
            amax = {kv: [max(x) * qmax if isinstance(x, list) else x * qmax for x in s[kv]]
                    for kv in ("k_scale", "v_scale")}
            scales[name] = {**s, "k_amax": amax["k_scale"], "v_amax": amax["v_scale"]}
            print(f"{name}: K amax per layer {[round(a, 2) for a in amax['k_scale']]}; "
                  f"V amax {[round(a, 2) for a in amax['v_scale']]}")
            del llm
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, "
          f"{time.perf_counter() - t0:.0f} s; wrote {', '.join(str(p) for p in paths.values())}")
    print(json.dumps({**rep.to_json(), "kv_scales": scales}))


if __name__ == "__main__":
    main()
