"""Where does a decode step's time go? A kernel-by-kernel profile of the engine (CUDA).

    python benchmarks/profile_decode.py                   # Llama-3-8B shape, batch 1
    python benchmarks/profile_decode.py --batch 16 --layers 4
    python benchmarks/profile_decode.py --batch 64 --context 2048 --kv-gb 24 --kv-cache-dtype fp8_e4m3

Builds the engine on a Llama-3-8B-shaped model with random bf16 weights
(``load_format="dummy"``), runs a few decode steps under ``torch.profiler`` and prints:

* GPU time per kernel family (the GEMMs, attention, norms, ...), summed over the steps;
* the step's wall time split into GPU busy time and GPU idle time (gaps: launch latency
  inside the graph, and host work between steps: scheduling, input preparation,
  sampling, the sync that reads the sampled tokens back);
* the same for one CUDA-graph replay of the forward pass alone.

Kernels launched inside a CUDA graph are recorded individually by CUPTI, so the table
covers graph replays too. Writes a Chrome trace to ``--trace`` (open it in
chrome://tracing or https://ui.perfetto.dev) to look at the gaps one by one.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import minivllm  # noqa: E402,F401  (before torch: sets up Triton)
import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from benchmarks.gpu_suite import LLAMA3_8B  # noqa: E402

FAMILIES = [  # (family, substrings of the kernel name), first match wins
    ("gemm (cuBLAS)", ("gemm", "gemv", "cutlass", "sm90_xmma", "nvjet", "splitk")),
    ("attention decode", ("_decode_split", "_decode_reduce")),
    ("attention prefill", ("_prefill",)),
    ("kv store", ("_store_kernel",)),
    ("rms norm", ("rms",)),
    ("rotary", ("rotary",)),
    ("silu * mul", ("silu", "act_and_mul")),
    ("argmax / sampler", ("argmax", "arg_max", "reduce_kernel", "exponential", "softmax")),
    ("copies", ("memcpy", "memset", "copy", "fill")),
    ("elementwise", ("elementwise", "vectorized", "unrolled")),
]


def family(name: str) -> str:
    low = name.lower()
    for fam, keys in FAMILIES:
        if any(k in low for k in keys):
            return fam
    return "other"


def kernel_events(prof) -> list:
    return [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


def summarize(prof, steps: int, wall_s: float, title: str) -> dict:
    evs = kernel_events(prof)
    by_fam: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for e in evs:
        f = by_fam[family(e.name)]
        f[0] += e.device_time_total
        f[1] += 1
    busy_us = sum(v[0] for v in by_fam.values())
    wall_us = wall_s * 1e6
    print(f"\n== {title}: {steps} step(s), wall {wall_us / steps / 1e3:.3f} ms/step, "
          f"GPU busy {busy_us / steps / 1e3:.3f} ms/step ({busy_us / wall_us:.1%}), "
          f"kernels/step {len(evs) / steps:.0f}")
    print(f"{'family':22s} {'ms/step':>9s} {'share':>7s} {'kernels/step':>13s}")
    for fam, (us, n) in sorted(by_fam.items(), key=lambda kv: -kv[1][0]):
        print(f"{fam:22s} {us / steps / 1e3:9.3f} {us / busy_us:7.1%} {n / steps:13.1f}")
    top = defaultdict(lambda: [0.0, 0])
    for e in evs:
        top[e.name][0] += e.device_time_total
        top[e.name][1] += 1
    print("top kernels:")
    for name, (us, n) in sorted(top.items(), key=lambda kv: -kv[1][0])[:12]:
        print(f"  {us / steps / 1e3:8.3f} ms/step  x{n / steps:5.1f}  "
              f"{us / n:7.1f} us each  {name[:90]}")
    return dict(wall_ms=wall_us / steps / 1e3, gpu_busy_ms=busy_us / steps / 1e3,
                kernels_per_step=len(evs) / steps,
                families={k: v[0] / steps / 1e3 for k, v in by_fam.items()})


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--context", type=int, default=128, help="prompt tokens")
    ap.add_argument("--eager", action="store_true", help="switch the CUDA graphs off")
    ap.add_argument("--kv-cache-dtype", default="auto", help="auto (bf16), fp8_e4m3, ...")
    ap.add_argument("--kv-gb", type=float, default=8.0, help="KV cache memory, GB")
    ap.add_argument("--trace", default=str(ROOT / "reports" / "decode_trace.json"))
    ns = ap.parse_args()
    if not torch.cuda.is_available():
        print("profile_decode needs a CUDA GPU", file=sys.stderr)
        return 2
    from minivllm import LLM, SamplingParams

    cfg = dict(LLAMA3_8B, num_hidden_layers=ns.layers)
    folder = Path(tempfile.mkdtemp()) / "shape"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(cfg))
    llm = LLM(str(folder), device="cuda", dtype="bfloat16", load_format="dummy",
              skip_tokenizer_init=True, max_model_len=ns.context + 1024,
              max_num_seqs=max(ns.batch, 1), kv_cache_dtype=ns.kv_cache_dtype,
              kv_cache_memory_bytes=int(ns.kv_gb * 1e9), enable_prefix_caching=False)
    eng = llm.llm_engine
    runner = eng.model_runner
    if ns.eager:
        runner.cuda_graphs = None
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, cfg["vocab_size"], (ns.batch, ns.context), generator=gen).tolist()
    # every prefill chunk, then warm decode steps: the profile holds decode steps only
    warm = -(-ns.batch * ns.context // eng.scheduler_config.max_num_batched_tokens) + 3
    sp = SamplingParams(temperature=0, max_tokens=warm + ns.steps + 8, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                 use_tqdm=False)
    for i, p in enumerate(prompts):
        eng.add_request(p, sp, str(i))
    for _ in range(warm):
        eng.step()
    torch.cuda.synchronize()
    report = {}
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(ns.steps):
            eng.step()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    graphs = "CUDA graphs" if runner.cuda_graphs is not None else "eager"
    report["engine_step"] = summarize(prof, ns.steps, wall, f"engine.step(), batch {ns.batch}, "
                                      f"{graphs}")
    Path(ns.trace).parent.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(ns.trace)
    if runner.cuda_graphs is not None:
        g = runner.cuda_graphs
        bs = next(s for s in g.sizes if s >= ns.batch)  # the graph a batch this size runs in
        graph = g.graphs[bs][0]
        g.seq_lens[:bs] = ns.context
        g.slot_mapping[:bs] = -1
        graph.replay()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof2:
            t0 = time.perf_counter()
            for _ in range(ns.steps):
                graph.replay()
            torch.cuda.synchronize()
            wall2 = time.perf_counter() - t0
        report["graph_replay"] = summarize(prof2, ns.steps, wall2,
                                           f"graph replay alone, batch {bs}")
    print(json.dumps({k: {kk: (round(vv, 4) if isinstance(vv, float) else vv)
                          for kk, vv in v.items() if kk != "families"}
                      for k, v in report.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
