"""Temporary experiment: does a head-major block layout stream faster? (not committed)"""
import sys
from pathlib import Path
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import minivllm  # noqa
import torch, triton
import triton.language as tl
from benchmarks.gpu_suite import bench_graph, copy_bandwidth, log, paged_decode_inputs, sdpa_on_contiguous, table
from kernels import paged_attention as PA


@triton.jit
def exp_kernel(q_ptr, k_ptr, v_ptr, bt_ptr, lens_ptr, out_ptr, stride_qb, stride_qh, stride_bt,
               stride_ob, stride_oh, sm_scale, S_BLK, S_TOK, S_HEAD,
               QUERY_GROUP: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr,
               BS: tl.constexpr, BLOCK_N: tl.constexpr, DEFER_SUM: tl.constexpr):
    kvh = tl.program_id(0)
    b = tl.program_id(1)
    seq_len = tl.load(lens_ptr + b)
    g = tl.arange(0, G_PAD)
    d = tl.arange(0, D)
    heads = kvh * QUERY_GROUP + g
    gmask = g < QUERY_GROUP
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=gmask[:, None], other=0.0)
    m = tl.full([G_PAD], float("-inf"), tl.float32)
    l = tl.zeros([G_PAD], tl.float32)
    lt = tl.zeros([G_PAD, BLOCK_N], tl.float32)
    acc = tl.zeros([G_PAD, D], tl.float32)
    for n0 in range(0, seq_len, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        pmask = pos < seq_len
        blk = tl.load(bt_ptr + b * stride_bt + pos // BS, mask=pmask, other=0)
        base = blk.to(tl.int64) * S_BLK + (pos % BS) * S_TOK + kvh * S_HEAD
        k = tl.load(k_ptr + base[:, None] + d[None, :], mask=pmask[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k)) * sm_scale
        s = tl.where(pmask[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        if DEFER_SUM:
            lt = lt * alpha[:, None] + p
        else:
            l = l * alpha + tl.sum(p, axis=1)
        v = tl.load(v_ptr + base[:, None] + d[None, :], mask=pmask[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m = m_new
    if DEFER_SUM:
        l = tl.sum(lt, axis=1)
    o = acc / l[:, None]
    tl.store(out_ptr + b * stride_ob + heads[:, None] * stride_oh + d[None, :], o.to(out_ptr.dtype.element_ty), mask=gmask[:, None])


def main():
    H, Hkv, D = 32, 8, 128
    dtype = torch.bfloat16
    copy_bw = copy_bandwidth()
    shapes = [(32, 4096), (64, 8192), (256, 4096), (32, 16384), (128, 1024)]
    max_tokens = max(b * c for b, c in shapes)
    cfgs = [(128, 4, 3), (128, 4, 2), (64, 4, 3), (64, 4, 4), (128, 8, 3), (64, 8, 4)]
    # small-batch check of the new reduce (production kernel, default splits_per_program)
    for bs in (16,):
        num_blocks = max_tokens // bs + 16
        g = torch.Generator(device="cuda").manual_seed(0)
        k_flat = torch.randn(num_blocks * bs * Hkv * D, device="cuda", dtype=dtype, generator=g)
        v_flat = torch.randn(num_blocks * bs * Hkv * D, device="cuda", dtype=dtype, generator=g)
        kc, vc = k_flat.view(-1, Hkv, D), v_flat.view(-1, Hkv, D)
        for B, ctx in [(1, 4096), (1, 32768), (8, 4096), (16, 4096)]:
            q, bt, lens = paged_decode_inputs(num_blocks, B, ctx, H, D, bs, dtype, g)
            ms_sdpa = bench_graph(sdpa_on_contiguous(q, kc, vc, bt, bs, D ** -0.5))
            ms = bench_graph(lambda: PA.paged_attention_decode(q, kc, vc, bt, lens, bs, D ** -0.5, max_seq_len=ctx))
            log(f"production B={B} ctx={ctx}: {ms*1e3:.1f} us, SDPA {ms_sdpa*1e3:.1f} us, vs_sdpa {ms_sdpa/ms:.3f}")
    for bs in (16, 32):
        num_blocks = max_tokens // bs + 16
        g = torch.Generator(device="cuda").manual_seed(0)
        k_flat = torch.randn(num_blocks * bs * Hkv * D, device="cuda", dtype=dtype, generator=g)
        v_flat = torch.randn(num_blocks * bs * Hkv * D, device="cuda", dtype=dtype, generator=g)
        kc, vc = k_flat.view(-1, Hkv, D), v_flat.view(-1, Hkv, D)
        for B, ctx in shapes:
            q, bt, lens = paged_decode_inputs(num_blocks, B, ctx, H, D, bs, dtype, g)
            kv = B * ctx * Hkv * D * 4
            ms_sdpa = bench_graph(sdpa_on_contiguous(q, kc, vc, bt, bs, D ** -0.5))
            rows = []
            ms = bench_graph(lambda: PA.paged_attention_decode(q, kc, vc, bt, lens, bs, D ** -0.5, max_seq_len=ctx))
            rows.append(dict(kernel="production", cfg="128/4/3", us=ms * 1e3, vs_sdpa=ms_sdpa / ms, frac_copy=kv / (ms * 1e-3) / copy_bw))
            out = torch.empty_like(q)
            for layout in ("slot-major", "head-major"):
                strides = (bs * Hkv * D, Hkv * D, D) if layout == "slot-major" else (Hkv * bs * D, D, bs * D)
                for bn, w, st in cfgs:
                    for defer in (False, True):
                        fn = lambda: exp_kernel[(Hkv, B)](q, k_flat, v_flat, bt, lens, out, q.stride(0), q.stride(1), bt.stride(0),
                                                          out.stride(0), out.stride(1), D ** -0.5, *strides, QUERY_GROUP=H // Hkv,
                                                          G_PAD=16, D=D, BS=bs, BLOCK_N=bn, DEFER_SUM=defer, num_warps=w, num_stages=st)
                        try:
                            ms = bench_graph(fn)
                        except Exception as e:
                            log(f"fail {layout} {bn}/{w}/{st} {type(e).__name__} {str(e)[:100]}"); continue
                        rows.append(dict(kernel=layout + (" defer" if defer else ""), cfg=f"{bn}/{w}/{st}", us=ms * 1e3,
                                         vs_sdpa=ms_sdpa / ms, frac_copy=kv / (ms * 1e-3) / copy_bw))
            log(f"\nbs={bs} B={B} ctx={ctx}: SDPA {ms_sdpa*1e3:.1f} us ({kv/(ms_sdpa*1e-3)/copy_bw:.3f} of copy)")
            log(table(sorted(rows, key=lambda r: r["us"])[:14], list(rows[0].keys())))
        del k_flat, v_flat, kc, vc
        torch.cuda.empty_cache()


if __name__ == '__main__':
    main()
