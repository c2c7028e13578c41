"""Why does decode attention over an fp8 KV cache not run at the bandwidth its bytes allow?

A probe for issue 27 item 3 (CUDA only). With a bf16 cache the split-KV decode kernel
(``minivllm_kernels/paged_attention.py``) reads K/V at 91-107 % of copy bandwidth at batch >= 32 and
context >= 4k; with an fp8_e4m3 cache at 44-46 % (``benchmarks/gpu_suite.py``). This script
times variants of the kernel's K/V tile path, each in its own process (Triton resolves a
kernel's ``@jit`` helpers when it first compiles), and checks each variant's output bits
against the production kernel:

- ``prod``: the kernel as it is (bf16 and fp8, static per-head scales);
- ``direct``: fp8 -> bf16 by one cast, no scale (exact, so equal to prod only at scale 1.0):
  the cost of the float32 multiply path;
- ``kt``: K loaded already transposed ([D, N]) so the QK dot needs no ``tl.trans``;
- ``kt_direct``: both;
- ``asm_unit``: fp8 e4m3 -> bf16 with integer PTX and one bf16x2 multiply, no ``cvt``
  (exact: checked on all 256 bytes, NaN kept; equal to prod only at scale 1.0).

Findings (H200, 2026-12-02) are in ``benchmarks/RESULTS.md``: none of these reaches the
bandwidth; neither the conversion nor the shared-memory detour nor the launch configuration is what bounds the fp8 kernel.

Usage: ``python benchmarks/fp8_decode_probe.py [--out DIR]`` (writes ``probe.json`` and each
variant's Triton IR dump under DIR).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SHAPES = [(64, 4096), (256, 8192)]  # (batch, context)
H, HKV, D, BS = 32, 8, 128, 16


import minivllm  # noqa: E402,F401  (before torch: sets up Triton)
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from minivllm_kernels import paged_attention as PA  # noqa: E402
from minivllm_kernels._quant import cast_rne, dot  # noqa: E402


@triton.jit
def load_direct(cache_ptr, scale_ptr, scale_cache_ptr, slot, pmask, kvh, d,
                NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, QUANT: tl.constexpr,
                DYNAMIC: tl.constexpr, OUT_DTYPE: tl.constexpr):
    """fp8 -> OUT_DTYPE by one cast, no scale (exact for fp8 into bf16)."""
    mask = pmask[:, None] & (d[None, :] < HEAD_DIM)
    x = tl.load(cache_ptr + slot[:, None] * (NUM_KV_HEADS * HEAD_DIM) + kvh * HEAD_DIM
                + d[None, :], mask=mask, other=0.0)
    return x.to(OUT_DTYPE)


# fp8 e4m3 bytes -> bf16 with integer ops and one bf16x2 multiply (no cvt), 4 at a time:
# each byte's sign and 7 magnitude bits are placed in a bf16 lane (value k * 2**-120, exact,
# subnormals included), multiplied by 2**120 (exact); e4m3fn's NaN (magnitude 0x7F) lanes
# are forced to a bf16 NaN.


@triton.jit
def e4m3_to_bf16(x):
    return tl.inline_asm_elementwise("""
{
.reg .b32 t0, t1, u0, u1, n0, n1, c;
prmt.b32 t0, $2, 0, 0x1404;
prmt.b32 t1, $2, 0, 0x3424;
and.b32 n0, t0, 0x7F007F00;
and.b32 n1, t1, 0x7F007F00;
add.u32 n0, n0, 0x01000100;
add.u32 n1, n1, 0x01000100;
and.b32 n0, n0, 0x80008000;
and.b32 n1, n1, 0x80008000;
shr.b32 u0, n0, 15;
shr.b32 u1, n1, 15;
sub.u32 n0, n0, u0;
sub.u32 n1, n1, u1;
shr.b32 u0, t0, 4;
shr.b32 u1, t1, 4;
and.b32 u0, u0, 0x07F007F0;
and.b32 u1, u1, 0x07F007F0;
and.b32 t0, t0, 0x80008000;
and.b32 t1, t1, 0x80008000;
or.b32 t0, t0, u0;
or.b32 t1, t1, u1;
mov.b32 c, 0x7B807B80;
mul.rn.bf16x2 t0, t0, c;
mul.rn.bf16x2 t1, t1, c;
or.b32 $0, t0, n0;
or.b32 $1, t1, n1;
}
""", "=r,=r,r",
                                     [x.to(tl.uint8, bitcast=True)], dtype=tl.bfloat16,
                                     is_pure=True, pack=4)


@triton.jit
def load_asm_unit(cache_ptr, scale_ptr, scale_cache_ptr, slot, pmask, kvh, d,
                  NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, QUANT: tl.constexpr,
                  DYNAMIC: tl.constexpr, OUT_DTYPE: tl.constexpr):
    """fp8 e4m3 -> bf16 through E4M3_TO_BF16_ASM, no scale (exact: equal to prod at 1.0)."""
    mask = pmask[:, None] & (d[None, :] < HEAD_DIM)
    x = tl.load(cache_ptr + slot[:, None] * (NUM_KV_HEADS * HEAD_DIM) + kvh * HEAD_DIM
                + d[None, :], mask=mask, other=0.0)
    if QUANT:
        return e4m3_to_bf16(x)
    return x.to(OUT_DTYPE)


@triton.jit
def _convert_all(x_ptr, y_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(y_ptr + i, e4m3_to_bf16(tl.load(x_ptr + i)))


def check_asm_exhaustive() -> dict:
    """All 256 e4m3fn bytes through the asm against torch's exact fp8 -> bf16 cast."""
    import torch
    x = torch.arange(256, dtype=torch.int32, device="cuda").to(torch.uint8)
    x = x.view(torch.float8_e4m3fn)
    y = torch.empty(256, dtype=torch.bfloat16, device="cuda")
    _convert_all[(1,)](x, y, N=256)
    want = x.to(torch.bfloat16)
    same = (y.view(torch.int16) == want.view(torch.int16)) | (y.isnan() & want.isnan())
    bad = [(int(i), float(want[i]), float(y[i])) for i in torch.nonzero(~same).flatten()[:8]]
    return dict(asm_exhaustive_ok=bool(same.all()), asm_mismatches=bad)


load_v = PA._load_kv_tile  # rebound by _patch before the first compile
KT_DIRECT = tl.constexpr(False)


@triton.jit
def attend_kt(q, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, ks_cache_ptr,
              vs_cache_ptr, slot, pmask, visible, kvh, d, m, l, acc, sm_scale,
              NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, QUANT: tl.constexpr,
              DYNAMIC: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """PA._attend_tile with K loaded as [D, N] (no tl.trans before the QK dot)."""
    mask_t = (d[:, None] < HEAD_DIM) & pmask[None, :]
    kt = tl.load(k_cache_ptr + slot[None, :] * (NUM_KV_HEADS * HEAD_DIM) + kvh * HEAD_DIM
                 + d[:, None], mask=mask_t, other=0.0)
    if QUANT:
        if KT_DIRECT:
            kt = kt.to(q.dtype)
        else:
            kt = cast_rne(kt.to(tl.float32) * tl.load(k_scale_ptr + kvh), q.dtype)
    s = dot(q, kt, PRECISION, UPCAST) * sm_scale
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, axis=1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m - m_use)
    p = tl.exp(s - m_use[:, None])
    l = l * alpha + tl.sum(p, axis=1)
    v = load_v(v_cache_ptr, v_scale_ptr, vs_cache_ptr, slot, pmask, kvh, d,
               NUM_KV_HEADS, HEAD_DIM, QUANT, DYNAMIC, q.dtype)
    acc = acc * alpha[:, None] + dot(cast_rne(p, v.dtype), v, PRECISION, UPCAST)
    return m_new, l, acc


@triton.jit
def attend_stream(q, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, ks_cache_ptr,
                  vs_cache_ptr, slot, pmask, visible, kvh, d, m, l, acc, sm_scale,
                  NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, QUANT: tl.constexpr,
                  DYNAMIC: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """No attention: the same K/V tile loads, summed over keys (the memory access pattern
    alone, at the same grid, tiles, warps and stages)."""
    mask = pmask[:, None] & (d[None, :] < HEAD_DIM)
    off = slot[:, None] * (NUM_KV_HEADS * HEAD_DIM) + kvh * HEAD_DIM + d[None, :]
    k = tl.load(k_cache_ptr + off, mask=mask, other=0.0).to(tl.float32)
    v = tl.load(v_cache_ptr + off, mask=mask, other=0.0).to(tl.float32)
    acc = acc + tl.sum(k + v, axis=0)[None, :]
    return m, l + 1.0, acc


@triton.jit
def attend_stream_conv(q, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, ks_cache_ptr,
                       vs_cache_ptr, slot, pmask, visible, kvh, d, m, l, acc, sm_scale,
                       NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                       QUANT: tl.constexpr, DYNAMIC: tl.constexpr, PRECISION: tl.constexpr,
                       UPCAST: tl.constexpr):
    """As attend_stream but through prod's dequantize-and-cast (_load_kv_tile)."""
    k = PA._load_kv_tile(k_cache_ptr, k_scale_ptr, ks_cache_ptr, slot, pmask, kvh, d,
                         NUM_KV_HEADS, HEAD_DIM, QUANT, DYNAMIC, q.dtype)
    v = PA._load_kv_tile(v_cache_ptr, v_scale_ptr, vs_cache_ptr, slot, pmask, kvh, d,
                         NUM_KV_HEADS, HEAD_DIM, QUANT, DYNAMIC, q.dtype)
    acc = acc + tl.sum(k.to(tl.float32) + v.to(tl.float32), axis=0)[None, :]
    return m, l + 1.0, acc


ABL = tl.constexpr(0)  # ablation: 1 no masks, 2 no softmax, 3 no QK dot, 4 no PV dot


@triton.jit
def attend_ablate(q, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, ks_cache_ptr,
                  vs_cache_ptr, slot, pmask, visible, kvh, d, m, l, acc, sm_scale,
                  NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, QUANT: tl.constexpr,
                  DYNAMIC: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """PA._attend_tile with one part removed (ABL), to see what each part costs. ABL 1
    (no load masks, no where) is exact when every tile is full (context % 128 == 0)."""
    if ABL == 1:
        pm = tl.full(pmask.shape, 1, tl.int1)
    else:
        pm = pmask
    k = PA._load_kv_tile(k_cache_ptr, k_scale_ptr, ks_cache_ptr, slot, pm, kvh, d,
                         NUM_KV_HEADS, HEAD_DIM, QUANT, DYNAMIC, q.dtype)
    if ABL == 3:
        s = tl.zeros([q.shape[0], k.shape[0]], tl.float32) + tl.sum(k.to(tl.float32), axis=1)[None, :]
    else:
        s = dot(q, tl.trans(k), PRECISION, UPCAST) * sm_scale
    if ABL != 1:
        s = tl.where(visible, s, float("-inf"))
    if ABL == 2:
        p = s
        m_new = m
        alpha = tl.full(m.shape, 1.0, tl.float32)
    else:
        m_new = tl.maximum(m, tl.max(s, axis=1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m - m_use)
        p = tl.exp(s - m_use[:, None])
        l = l * alpha + tl.sum(p, axis=1)
    v = PA._load_kv_tile(v_cache_ptr, v_scale_ptr, vs_cache_ptr, slot, pm, kvh, d,
                         NUM_KV_HEADS, HEAD_DIM, QUANT, DYNAMIC, q.dtype)
    if ABL == 4:
        acc = acc * alpha[:, None] + tl.sum(v.to(tl.float32), axis=0)[None, :] + tl.sum(p, axis=1)[:, None]
    else:
        acc = acc * alpha[:, None] + dot(cast_rne(p, v.dtype), v, PRECISION, UPCAST)
    return m_new, l, acc


def _patch(variant: str) -> None:
    """Swap the kernel's tile helpers for a variant's (before the first compile)."""
    global load_v, KT_DIRECT
    if variant in ("direct", "kt_direct"):
        PA._load_kv_tile = load_direct
        load_v = load_direct
    if variant == "asm_unit":
        PA._load_kv_tile = load_asm_unit
    if variant == "stream":
        PA._attend_tile = attend_stream
    if variant == "stream_conv":
        PA._attend_tile = attend_stream_conv
    if variant.startswith("abl"):
        global ABL
        ABL = tl.constexpr(int(variant[3:]))
        PA._attend_tile = attend_ablate
    if variant == "split1":
        PA.default_splits_per_program = lambda *a: 1
    if variant == "f128":  # the float cache with the fp8 kernel's 128-key tiles
        PA.DECODE_CONFIG["BLOCK_N"] = 128
    if variant in ("kt", "kt_direct"):
        KT_DIRECT = tl.constexpr(variant == "kt_direct")
        PA._attend_tile = attend_kt


def child(variant: str, stages: int | None, block_n: int | None, out: Path,
          warps: int | None = None, maxnreg: int | None = None) -> None:
    import torch
    from triton.testing import do_bench

    _patch(variant)
    if variant == "asm_unit":
        print(json.dumps(check_asm_exhaustive()), flush=True)

    if stages:
        PA.DECODE_CONFIG_QUANT["num_stages"] = stages
        PA.DECODE_CONFIG["num_stages"] = stages
    if block_n:
        PA.DECODE_CONFIG_QUANT["BLOCK_N"] = block_n
    if warps:
        PA.DECODE_CONFIG_QUANT["num_warps"] = warps
    if maxnreg:
        PA.DECODE_CONFIG_QUANT["maxnreg"] = maxnreg
    g = torch.Generator(device="cuda").manual_seed(0)
    max_tokens = max(b * c for b, c in SHAPES)
    nblk = max_tokens // BS + 16
    kc = torch.randn(nblk * BS, HKV, D, device="cuda", dtype=torch.bfloat16, generator=g)
    vc = torch.randn(nblk * BS, HKV, D, device="cuda", dtype=torch.bfloat16, generator=g)
    k8, v8 = kc.to(torch.float8_e4m3fn), vc.to(torch.float8_e4m3fn)
    ks = torch.rand(HKV, device="cuda", generator=g) + 0.25
    vs = torch.rand(HKV, device="cuda", generator=g) + 0.25
    rows = []
    for B, ctx in SHAPES:
        perm = torch.randperm(nblk, device="cuda", generator=g)
        bt = perm[:B * (ctx // BS)].view(B, -1).to(torch.int32)
        if os.environ.get("PROBE_L2"):  # every table points into 64 blocks (2 MB: in L2):
            bt = bt % 64                 # what is left is the kernel's compute time

        lens = torch.full((B,), ctx, dtype=torch.int32, device="cuda")
        q = torch.randn(B, H, D, device="cuda", dtype=torch.bfloat16, generator=g)
        for cache, (kk, vv), scales in (("bf16", (kc, vc), (1.0, 1.0)),
                                        ("fp8", (k8, v8), (1.0, 1.0)),
                                        ("fp8_scaled", (k8, v8), (ks, vs))):
            def fn():
                return PA.paged_attention_decode(q, kk, vv, bt, lens, BS, D ** -0.5,
                                                 scales[0], scales[1], max_seq_len=ctx)
            o = fn()
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                fn()
            ms = do_bench(graph.replay, warmup=20, rep=100)
            kv_bytes = B * ctx * HKV * D * 2 * kk.element_size()
            torch.save(o.cpu(), out / f"{cache}_{B}_{ctx}.pt")
            rows.append(dict(variant=variant, stages=stages, block_n=block_n, cache=cache,
                             batch=B, context=ctx, us=ms * 1e3,
                             GBps=kv_bytes / (ms * 1e-3) / 1e9))
    try:  # registers, spills and shared memory of each compiled split kernel
        for dev in PA._decode_split_kernel.device_caches.values():
            for key, k in dev[0].items():
                print(json.dumps(dict(variant=variant, n_regs=k.n_regs, n_spills=k.n_spills,
                                      shared=k.metadata.shared,
                                      warps=k.metadata.num_warps,
                                      stages=k.metadata.num_stages)), flush=True)
    except Exception as e:  # noqa: BLE001  (a probe: report and go on)
        print(f"no kernel metadata: {e!r}", flush=True)
    (out / "rows.json").write_text(json.dumps(rows))


def copy_bandwidth() -> float:
    import torch
    from triton.testing import do_bench

    n = 4 * 1024**3
    src = torch.empty(n, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=5, rep=30)
    return 2 * n / (ms * 1e-3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="reports/fp8_probe")
    ap.add_argument("--child", default=None)
    ap.add_argument("--stages", type=int, default=None)
    ap.add_argument("--block-n", type=int, default=None)
    ap.add_argument("--warps", type=int, default=None)
    ap.add_argument("--maxnreg", type=int, default=None)
    ap.add_argument("--variants", default="prod,direct,kt,kt_direct")
    ap.add_argument("--extra", default="", help="variant:stages:block_n[:warps[:maxnreg]],... also run")
    args = ap.parse_args()
    out = Path(args.out)
    if args.child:
        child(args.child, args.stages, args.block_n, out, args.warps, args.maxnreg)
        return
    import torch

    out.mkdir(parents=True, exist_ok=True)
    bw = copy_bandwidth()
    print(f"copy bandwidth {bw / 1e9:.0f} GB/s", flush=True)
    runs = [(v, None, None, None, None) for v in args.variants.split(",")]
    for e in filter(None, args.extra.split(",")):
        v, st, bn, w, nreg = (e.split(":") + ["", ""])[:5]
        runs.append((v, int(st) if st else None, int(bn) if bn else None,
                     int(w) if w else None, int(nreg) if nreg else None))
    rows = []
    for v, st, bn, w, nreg in runs:
        name = f"{v}_s{st}_n{bn}" + (f"_w{w}" if w else "") + (f"_r{nreg}" if nreg else "")
        d = out / name
        d.mkdir(exist_ok=True)
        env = dict(os.environ, TRITON_KERNEL_DUMP="1", TRITON_DUMP_DIR=str(d / "ir"),
                   TRITON_CACHE_DIR=str(d / "cache"))
        cmd = [sys.executable, __file__, "--child", v, "--out", str(d)]
        if st:
            cmd += ["--stages", str(st)]
        if bn:
            cmd += ["--block-n", str(bn)]
        if w:
            cmd += ["--warps", str(w)]
        if nreg:
            cmd += ["--maxnreg", str(nreg)]
        p = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if p.returncode:
            print(f"{name}: failed\n{p.stderr[-3000:]}", flush=True)
            continue
        if p.stdout.strip():
            print(f"{name}: {p.stdout.strip()[-2000:]}", flush=True)
        for r in json.loads((d / "rows.json").read_text()):
            refp = out / f"prod_sNone_nNone/{r['cache']}_{r['batch']}_{r['context']}.pt"
            ref = torch.load(refp) if refp.exists() else None
            got = torch.load(d / f"{r['cache']}_{r['batch']}_{r['context']}.pt")
            r["bits_equal_prod"] = None if ref is None else bool(torch.equal(ref, got))
            r["frac_copy_bw"] = r["GBps"] * 1e9 / bw
            rows.append(r)
            print(f"{name:22s} {r['cache']:10s} B={r['batch']:4d} ctx={r['context']:5d} "
                  f"{r['us']:8.1f} us {r['frac_copy_bw']:6.1%} of copy bw  "
                  f"bits==prod {r['bits_equal_prod']}", flush=True)
    (out / "probe.json").write_text(json.dumps(dict(copy_bandwidth_Bps=bw, rows=rows), indent=1))


if __name__ == "__main__":
    main()
