"""Temporary: registers / shared memory of the decode kernels per config, and timings of a
few whole-mode variants (not committed)."""
import sys
from pathlib import Path
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import minivllm  # noqa
import torch
from benchmarks.gpu_suite import bench_graph, log, paged_decode_inputs, sdpa_on_contiguous, table
from benchmarks._layout_exp import exp_kernel
from kernels import paged_attention as PA

H, Hkv, D, bs = 32, 8, 128, 16
dtype = torch.bfloat16
props = torch.cuda.get_device_properties(0)
log(f"SMs {props.multi_processor_count}, smem/SM {getattr(props, 'shared_memory_per_multiprocessor', '?')}, "
    f"regs/SM {getattr(props, 'regs_per_multiprocessor', '?')}")
shapes = [(32, 4096), (64, 8192), (256, 4096)]
num_blocks = 256 * 4096 // bs + 16
g = torch.Generator(device="cuda").manual_seed(0)
kc = torch.randn(num_blocks * bs, Hkv, D, device="cuda", dtype=dtype, generator=g)
vc = torch.randn(num_blocks * bs, Hkv, D, device="cuda", dtype=dtype, generator=g)
saved = dict(PA.DECODE_CONFIG)
cfgs = [(128, 4, 2), (128, 4, 3), (64, 4, 3), (64, 4, 4), (64, 4, 5), (128, 8, 3), (128, 8, 2)]
for B, ctx in shapes:
    q, bt, lens = paged_decode_inputs(num_blocks, B, ctx, H, D, bs, dtype, g)
    ms_sdpa = bench_graph(sdpa_on_contiguous(q, kc, vc, bt, bs, D ** -0.5))
    rows = []
    out = torch.empty_like(q)
    for bn, w, st in cfgs:
        PA.DECODE_CONFIG.clear(); PA.DECODE_CONFIG.update(BLOCK_N=bn, num_warps=w, num_stages=st)
        ms = bench_graph(lambda: PA.paged_attention_decode(q, kc, vc, bt, lens, bs, D ** -0.5, max_seq_len=ctx))
        info = []
        try:
            for c in PA._decode_split_kernel.device_caches.values():
                for k in (c[0] if isinstance(c, tuple) else c).values():
                    if k.metadata.num_warps == w and k.metadata.num_stages == st:
                        info.append((k.n_regs, k.metadata.shared))
        except Exception as e:
            info = [repr(e)[:60]]
        rows.append(dict(kernel="production", cfg=f"{bn}/{w}/{st}", us=ms * 1e3, vs_sdpa=ms_sdpa / ms, regs_smem=str(info[-1] if info else None)))
        fn = lambda: exp_kernel[(Hkv, B)](q, kc, vc, bt, lens, out, q.stride(0), q.stride(1), bt.stride(0), out.stride(0), out.stride(1),
                                          D ** -0.5, bs * Hkv * D, Hkv * D, D, QUERY_GROUP=4, G_PAD=16, D=D, BS=bs, BLOCK_N=bn,
                                          DEFER_SUM=False, num_warps=w, num_stages=st)
        ms = bench_graph(fn)
        ck = fn()
        rows.append(dict(kernel="exp (no splits)", cfg=f"{bn}/{w}/{st}", us=ms * 1e3, vs_sdpa=ms_sdpa / ms, regs_smem=str((ck.n_regs, ck.metadata.shared))))
    PA.DECODE_CONFIG.clear(); PA.DECODE_CONFIG.update(saved)
    log(f"\nB={B} ctx={ctx}: SDPA {ms_sdpa*1e3:.1f} us")
    log(table(rows, list(rows[0].keys())))
