"""Decode-attention launch configurations on a GPU, side by side with SDPA.

    python benchmarks/decode_sweep.py            # Llama-3-8B attention shape, bf16 KV
    python benchmarks/decode_sweep.py --quick    # fewer shapes and configurations
    python benchmarks/decode_sweep.py --spp      # also splits_per_program 1, 2, 4, whole

For each shape (batch, context) it times :func:`minivllm_kernels.paged_attention.paged_attention_decode`
under every configuration of the grid (``BLOCK_N`` keys per tile, warps, pipeline
stages, where ``None`` is the choice of
:func:`~minivllm_kernels.paged_attention.decode_num_stages`; with ``--spp`` also
``splits_per_program``: 1, 2, 4 or a whole sequence per program; otherwise the default
rule's) and ``F.scaled_dot_product_attention`` on the
same K/V laid out contiguously, all as CUDA-graph replays (median, L2 flushed, as in
gpu_suite.py).
It also checks each configuration's output against SDPA and whether outputs are
bit-identical across configurations (the engine needs one fixed configuration per model
for batch invariance; this says whether two configurations could be mixed).
Two diagnostics per shape, for the default configuration: the same call with the blocks
in order (is the scattered block layout what costs?) and the reduce kernel alone.
Prints one table per shape and, last, one JSON line with the best configuration.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import minivllm  # noqa: E402,F401  (before torch: sets up Triton)
import torch  # noqa: E402
import triton  # noqa: E402

from benchmarks.gpu_suite import (bench_graph, copy_bandwidth, log,  # noqa: E402
                                  paged_decode_inputs, sdpa_on_contiguous, table)
from minivllm_kernels import paged_attention as PA  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--spp", action="store_true",
                    help="also time splits_per_program 1, 2, 4 and whole (default rule only)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("decode_sweep.py needs a CUDA GPU")
    H, Hkv, D, bs = 32, 8, 128, 16
    dtype = torch.bfloat16
    shapes = [(1, 256), (32, 4096), (64, 8192)] if args.quick else \
        [(1, 256), (1, 4096), (8, 4096), (16, 4096), (32, 4096), (32, 32768), (64, 4096),
         (64, 8192), (128, 1024), (128, 4096), (256, 4096)]
    # "whole": one program per (sequence, KV head); None: the default rule
    spps = (None, 1, 2, 4, "whole") if args.spp else (None,)
    grid = [dict(BLOCK_N=n, num_warps=w, num_stages=st, spp=spp)
            for (n, w, st), spp in itertools.product(
                [(64, 4, st) for st in (None, 2, 3, 4, 5, 6)] + [(128, 4, st) for st in (2, 3, 4)]
                + [(128, 8, 3), (64, 8, 4)], spps)]
    if args.quick:
        grid = [g for g in grid if g["BLOCK_N"] == 128 and g["num_warps"] == 4]
    copy_bw = copy_bandwidth()
    max_tokens = max(b * c for b, c in shapes)
    num_blocks = max_tokens // bs + 16
    g = torch.Generator(device="cuda").manual_seed(0)
    k_cache = torch.randn(num_blocks * bs, Hkv, D, device="cuda", dtype=dtype, generator=g)
    v_cache = torch.randn(num_blocks * bs, Hkv, D, device="cuda", dtype=dtype, generator=g)
    saved = dict(PA.DECODE_CONFIG)
    totals = {i: 0.0 for i in range(len(grid))}
    summary = []
    for B, ctx in shapes:
        q, bt, lens = paged_decode_inputs(num_blocks, B, ctx, H, D, bs, dtype, g)
        kv_bytes = B * ctx * Hkv * D * 2 * 2
        sdpa = sdpa_on_contiguous(q, k_cache, v_cache, bt, bs, D ** -0.5)
        ms_sdpa = bench_graph(sdpa)
        ref = sdpa()[:, :, 0].float()
        rows, first = [], None
        splits = triton.cdiv(ctx, PA.SPLIT_SIZE)
        for i, cfg in enumerate(grid):
            PA.DECODE_CONFIG.clear()
            PA.DECODE_CONFIG.update({k: v for k, v in cfg.items()
                                     if k != "spp" and v is not None})  # None: the rule
            spp = splits if cfg["spp"] == "whole" else cfg["spp"]
            run = lambda: PA.paged_attention_decode(  # noqa: E731
                q, k_cache, v_cache, bt, lens, bs, D ** -0.5, max_seq_len=ctx,
                splits_per_program=spp)
            try:
                ms = bench_graph(run)
                o = run()
            except Exception as e:  # out of resources for this configuration
                log(f"  {cfg}: {type(e).__name__}: {str(e)[:120]}")
                totals[i] = float("inf")
                continue
            torch.cuda.synchronize()
            if first is None:
                first = o.clone()
            totals[i] += ms / ms_sdpa
            rows.append(dict(**cfg, us=ms * 1e3, frac_copy_bw=kv_bytes / (ms * 1e-3) / copy_bw,
                             vs_sdpa=ms_sdpa / ms,
                             err=(o.float() - ref).abs().max().item(),
                             same_bits_as_first=bool(torch.equal(o, first))))
        rows.sort(key=lambda r: r["us"])
        # diagnostics for the default configuration: the same call with the blocks in
        # order (contiguous, like SDPA's layout), and the reduce kernel alone
        PA.DECODE_CONFIG.clear()
        PA.DECODE_CONFIG.update(saved)
        bt_in_order = torch.arange(B * (ctx // bs), device="cuda", dtype=torch.int32).view(B, -1)
        ms_order = bench_graph(lambda: PA.paged_attention_decode(
            q, k_cache, v_cache, bt_in_order, lens, bs, D ** -0.5, max_seq_len=ctx))
        part_m = torch.zeros(B, H, splits, device="cuda")
        part_l = torch.ones_like(part_m)
        part_acc = torch.zeros(B, H, splits, D, device="cuda")
        out = torch.empty_like(q)
        ms_reduce = bench_graph(lambda: PA._decode_reduce_kernel[(H, B)](
            part_m, part_l, part_acc, lens, out, out.stride(0), out.stride(1), splits,
            NUM_HEADS=H, HEAD_DIM=D, D_PAD=D, SPLIT=PA.SPLIT_SIZE))
        log(f"\nB={B} ctx={ctx}: SDPA {ms_sdpa * 1e3:.1f} us "
            f"({kv_bytes / (ms_sdpa * 1e-3) / copy_bw:.3f} of copy bandwidth)")
        default = PA.default_splits_per_program(B, Hkv, splits, q.device)
        log(table(rows[:8] + [r for r in rows[8:] if all(r[k] == saved[k] for k in saved)],
                  list(rows[0].keys())))
        log(f"default {saved}, splits_per_program {default} of {splits}: blocks in order "
            f"{ms_order * 1e3:.1f} us; reduce kernel alone {ms_reduce * 1e3:.1f} us")
        summary.append(dict(batch=B, context=ctx, sdpa_us=ms_sdpa * 1e3, best=rows[0]))
    PA.DECODE_CONFIG.clear()
    PA.DECODE_CONFIG.update(saved)
    best = min(totals, key=totals.get)
    log("\nconfigurations by mean time / SDPA over all shapes:")
    order = sorted(totals, key=totals.get)[:10]
    log(table([dict(**grid[i], mean_time_vs_sdpa=totals[i] / len(shapes)) for i in order],
              list(grid[0].keys()) + ["mean_time_vs_sdpa"]))
    print(json.dumps(dict(copy_GBps=round(copy_bw / 1e9), best_config=grid[best],
                          per_shape=[dict(batch=s["batch"], context=s["context"],
                                          best_vs_sdpa=round(s["best"]["vs_sdpa"], 3))
                                     for s in summary])))


if __name__ == "__main__":
    main()
