"""fp8 KV decode attention: the folded-scales kernel against the exact one and the bf16 cache.

Two parts, side by side in one run:

1. **Error against float64** (CPU in Triton's interpreter, or GPU): decode attention over
   random paged caches (GQA group 4, head_dim 128, per-head scales that are not powers of
   two, and per-token dynamic scales), for each query dtype and fp8 format. Each kernel's
   output is compared with :func:`paged_attention_decode_f64`, attention in float64 of the
   dequantized cache. The error of a row is ``max |out - truth| / max |V|`` over that
   row's keys (the output is a convex combination of the V rows, so this is the error
   relative to the largest value it can reach), in units of the query dtype's unit
   roundoff u (2**-8 bfloat16, 2**-11 float16, 2**-24 float32). Rows: ``folded`` (the
   default fp8 kernel: scales folded out of the tiles), ``exact`` (the earlier fp8 kernel: each tile dequantized and
   rounded to the query dtype) and ``float cache`` (the same dequantized values stored
   in a cache of the query's dtype, read by the float kernel: what a bf16 KV cache
   holding this data computes).
2. **Time** (GPU only; ``--time``): the Llama-3-8B shape (32 query heads, 8 KV heads,
   head_dim 128, block 16, blocks scattered at random), bf16 cache against fp8_e4m3 with
   each fp8 kernel (and the folded kernel with e4m3 NaNs kept, and with bfloat16 products:
   its ``F16`` setting), at several batch/context shapes, as CUDA-graph replays
   (``triton.testing.do_bench``, median, L2 flushed), with the copy bandwidth measured in
   the same run; then the fp8 kernels' launch choices (splits per program, pipeline depth,
   register cap) at batch 64 / 4k and 256 / 8k (``--sweep folded,exact``).

The swap-AB (keys in the tensor-core tile's rows) and fp8-product variants measured
beside these are in the commit 6982dff (``benchmarks/RESULTS.md`` has their numbers).

    python benchmarks/fp8_decode.py                 # errors (CPU: a few minutes)
    python benchmarks/fp8_decode.py --time          # + times (CUDA)

The last line is one JSON object with every number.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import minivllm  # noqa: E402,F401  (before torch: sets up Triton)
import torch  # noqa: E402

from minivllm_kernels import paged_attention as PA  # noqa: E402
from tests.fp8_decode_cases import errors  # noqa: E402


@contextlib.contextmanager
def overridden(config: dict, changes: dict):
    """A module-level launch configuration (``PA.DECODE_CONFIG_FOLDED``, ...) with
    ``changes`` applied for the block, and restored as it was afterwards."""
    saved = dict(config)
    config.update(changes)
    try:
        yield config
    finally:
        config.clear()
        config.update(saved)

def timings(shapes: list[tuple[int, int]], sweep_kernels: list[str]) -> dict:
    from benchmarks.gpu_suite import bench_graph, copy_bandwidth, paged_decode_inputs

    H, Hkv, D, bs = 32, 8, 128, 16
    copy_bw = copy_bandwidth()
    max_tokens = max(b * c for b, c in shapes + [(64, 4096)])
    num_blocks = max_tokens // bs + 16
    g = torch.Generator(device="cuda").manual_seed(0)
    kb = torch.randn(num_blocks * bs, Hkv, D, device="cuda", dtype=torch.bfloat16, generator=g)
    vb = torch.randn_like(kb)
    k8, v8 = kb.to(torch.float8_e4m3fn), vb.to(torch.float8_e4m3fn)
    ks = torch.full((Hkv,), 1.0, device="cuda")
    # the folded kernel as it is, and with its float16 products' other settings (F16:
    # 2 keeps e4m3 NaNs, 0 multiplies in bfloat16 with the tiles converted by the cast)
    kernels: list[tuple] = [("bf16", kb, vb, {}, {})]
    kernels += [(f"fp8 {n}", k8, v8, dict(fp8_kernel=n), {}) for n in PA.FP8_KERNELS]
    kernels += [("fp8 folded, NaN kept", k8, v8, {}, {"F16": 2}),
                ("fp8 folded, bf16 products", k8, v8, {}, {"F16": 0})]
    rows = []
    for B, ctx in shapes:
        q, bt, lens = paged_decode_inputs(num_blocks, B, ctx, H, D, bs, torch.bfloat16, g)
        elems = B * ctx * Hkv * D * 2  # K and V elements read
        r: dict = dict(batch=B, context=ctx)
        for name, kc, vc, kw, override in kernels:
            with overridden(PA.DECODE_CONFIG_FOLDED, override):
                ms = bench_graph(lambda: PA.paged_attention_decode(  # noqa: B023
                    q, kc, vc, bt, lens, bs, D ** -0.5, ks, ks, max_seq_len=ctx, **kw))
            r[f"{name} us"] = round(ms * 1e3, 1)
            r[f"{name} frac"] = round(elems * kc.element_size() / (ms * 1e-3) / copy_bw, 3)
        rows.append(r)
        print(json.dumps(r), flush=True)
    # launch choices of the fp8 kernels at batch 64 / 4k and 256 / 8k: splits per program
    # (the same bits for every value), pipeline depth, register cap, tile size
    sweep = []
    for B, ctx in [(64, 4096), (256, 8192)]:
        if B * ctx > max_tokens:
            continue
        q, bt, lens = paged_decode_inputs(num_blocks, B, ctx, H, D, bs, torch.bfloat16, g)
        for name in sweep_kernels:
            cfg = PA.decode_config(torch.float8_e4m3fn, name)
            saved = dict(cfg)
            for bn in (128,):
                for spp in (1, 2, 4, 8):
                    for st in (3, 4):
                        for reg in (96, 112, 128, 160):
                            cfg.clear()
                            cfg.update(BLOCK_N=bn, num_warps=4, num_stages=st)
                            # the tile step's own choices (folded: EVEN, EXP2) stay
                            cfg.update({k: v for k, v in saved.items() if k.isupper()
                                        and k != "BLOCK_N"})
                            if reg:
                                cfg["maxnreg"] = reg
                            try:
                                ms = bench_graph(lambda: PA.paged_attention_decode(  # noqa: B023
                                    q, k8, v8, bt, lens, bs, D ** -0.5, ks, ks,
                                    max_seq_len=ctx, fp8_kernel=name, splits_per_program=spp))
                            except Exception as e:  # noqa: BLE001  (out of resources)
                                print(f"{name} {bn} {spp} {st} {reg}: {type(e).__name__}")
                                continue
                            frac = B * ctx * Hkv * D * 2 / (ms * 1e-3) / copy_bw
                            sweep.append(dict(batch=B, context=ctx, kernel=name, BLOCK_N=bn,
                                              splits_per_program=spp, num_stages=st,
                                              maxnreg=reg, us=round(ms * 1e3, 1),
                                              frac_copy_bw=round(frac, 3)))
            cfg.clear()
            cfg.update(saved)
        best = sorted((r for r in sweep if r["batch"] == B), key=lambda r: r["us"])[:8]
        for r in best:
            print(json.dumps(r), flush=True)
    return dict(copy_GBps=copy_bw / 1e9, device=torch.cuda.get_device_name(), rows=rows,
                sweep=sweep)


def engine_kl(windows: int, seq_len: int, bootstrap_seeds: int) -> dict:
    """Mean KL (nats) of the embedded model's decode-mode scores against the float32
    engine (TORCH backend, float32 KV), on ``windows`` corpus windows: bfloat16 weights,
    an fp8_e4m3 KV cache with per-head scales calibrated once (``calculate_kv_scales`` on
    the TORCH engine; not powers of two, so the two fp8 kernels really differ), the
    TRITON backend with each
    fp8 kernel, and the TORCH backend on the same configuration (a third implementation
    of the same formula, whose distance to the exact kernel is the noise a kernel change
    is judged by). ``TRITON folded, bf16 products`` is the folded kernel with
    ``DECODE_CONFIG_FOLDED["F16"] = 0`` (bfloat16 instead of float16 products: its
    earlier default). The spread across seeds: the 95 % interval of the mean over windows
    resampled with ``bootstrap_seeds`` seeds, for each KL and for the paired differences
    against the exact kernel. Runs on CUDA when there is one (compiled kernels), else on
    the CPU (the interpreter)."""
    import functools

    import numpy as np

    from minivllm import LLM
    from minivllm.attention.backends.triton_attn import TritonAttentionBackend
    from minivllm.precision import evalsets as E
    from minivllm.precision.metrics import kl_divergence

    device = "cuda" if torch.cuda.is_available() else "cpu"
    common = dict(max_model_len=seq_len + 8, enforce_eager=True, enable_prefix_caching=False,
                  device=device)
    base = LLM("smollm2-135m-instruct", dtype="float32", kv_cache_dtype="auto",
               attention_backend="TORCH", **common)
    seqs = E.corpus_sequences(base.get_tokenizer(), seq_len, windows)
    ref = base.score(seqs, mode="decode")
    del base
    fp8 = dict(dtype="bfloat16", kv_cache_dtype="fp8_e4m3", **common)
    kl: dict = {}
    # calibrated per-head scales, from the TORCH engine (calibrating runs prefills, which
    # the TRITON engines would run in the interpreter), set into the TRITON engines
    scales = None
    for name, backend, kernel, f16 in (("TORCH", "TORCH", None, None),
                                       ("TRITON folded", "TRITON", "folded", None),
                                       ("TRITON folded, bf16 products", "TRITON", "folded", 0),
                                       ("TRITON exact", "TRITON", "exact", None)):
        calibrate = dict(calculate_kv_scales=True, kv_scale_granularity="head") \
            if scales is None else {}  # else per-tensor until set_scales below
        llm = LLM("smollm2-135m-instruct", attention_backend=backend, **calibrate, **fp8)
        caches = llm.llm_engine.model_runner.kv_caches
        if scales is None:
            scales = [(kv.k_scale.clone(), kv.v_scale.clone()) for kv in caches]
        else:
            for kv, (k, v) in zip(caches, scales):
                kv.set_scales(k, v)
        if kernel:
            for mod in llm.llm_engine.model_runner.model.modules():
                b = getattr(mod, "backend", None)
                if isinstance(b, TritonAttentionBackend):
                    b._decode = functools.partial(PA.paged_attention_decode, fp8_kernel=kernel)
        t0 = time.perf_counter()
        with overridden(PA.DECODE_CONFIG_FOLDED, {} if f16 is None else {"F16": f16}):
            out = llm.score(seqs, mode="decode")
        kl[name] = np.array([float(kl_divergence(r, c).mean()) for r, c in zip(ref, out)])
        print(f"{name}: mean KL {kl[name].mean():.6g} nats over {len(seqs)} windows "
              f"({time.perf_counter() - t0:.0f} s)", flush=True)
        del llm, caches
    rng = np.random.default_rng(0)
    idx = rng.integers(0, len(seqs), size=(bootstrap_seeds, len(seqs)))

    def ci(x):
        m = x[idx].mean(axis=1)
        return [float(np.quantile(m, 0.025)), float(np.quantile(m, 0.975))]

    res: dict = dict(device=device, windows=len(seqs), seq_len=seq_len)
    res.update({name: dict(mean=float(v.mean()), ci95=ci(v)) for name, v in kl.items()})
    for a_, b_ in (("TRITON folded", "TRITON exact"),
                   ("TRITON folded, bf16 products", "TRITON exact"),
                   ("TRITON folded", "TRITON folded, bf16 products"),
                   ("TORCH", "TRITON exact")):
        d = kl[a_] - kl[b_]
        res[f"{a_} - {b_}"] = dict(mean=float(d.mean()), ci95=ci(d))
    print(json.dumps(res), flush=True)
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--time", action="store_true", help="also time the kernels (CUDA)")
    ap.add_argument("--no-errors", action="store_true")
    ap.add_argument("--engine-kl", type=int, default=0, metavar="WINDOWS",
                    help="also the engine's mean KL on this many corpus windows")
    ap.add_argument("--seq-len", type=int, default=64, help="corpus window length")
    ap.add_argument("--shapes", default="1x4096,32x4096,64x4096,256x8192",
                    help="batch x context shapes to time")
    ap.add_argument("--sweep", default="", help="comma-separated fp8 kernels whose launch "
                    "configurations to sweep at batch 64 / 4k")
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    t0 = time.perf_counter()
    res: dict = dict(device=device, triton_interpret=PA.INTERPRET)
    if not args.no_errors:
        res["errors"] = errors(device, args.seeds)
    if args.engine_kl:
        res["engine_kl"] = engine_kl(args.engine_kl, args.seq_len, 1000)
    if args.time:
        shapes = [tuple(int(x) for x in sh.split("x")) for sh in args.shapes.split(",")]
        res["timings"] = timings(shapes, [k for k in args.sweep.split(",") if k])
    res["seconds"] = time.perf_counter() - t0
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
