"""GPU suite (NVIDIA, e.g. H200): correctness first, then kernel and engine performance.

    python benchmarks/gpu_suite.py              # the full suite (~5 min on an H200)
    python benchmarks/gpu_suite.py --quick      # small shapes, 2-layer model: a smoke run

Steps, all in one process so every ratio is measured side by side:

0. Correctness on this GPU: ``tests/test_kernels.py`` and ``tests/test_fp8_attention.py``
   (every kernel against its PyTorch reference, compiled, not interpreted; on 8
   processes where pytest-xdist is installed) and ``tests/test_triton_backend.py`` (the engine
   on CUDA: TRITON with CUDA graphs against TORCH, chunked prefill, preemption, fp8/int8
   caches), and on a tiny random Llama in float32 the
   engine's greedy output with TRITON + CUDA graphs, TRITON eager and the TORCH
   reference backend.
1. Copy bandwidth: ``dst.copy_(src)`` of 4 GiB, counted as bytes read + bytes written.
2. (a) Decode attention: :func:`minivllm_kernels.paged_attention.paged_attention_decode` on a
   Llama-3-8B attention shape (32 query heads, 8 KV heads, head_dim 128, bf16 cache,
   block size 16, blocks scattered at random), batch 1..256 x context 512..32k, against
   ``F.scaled_dot_product_attention`` on the same K/V laid out contiguously
   (``[B, kv_heads, ctx, 128]``, ``enable_gqa``; skipped, with a line, at a shape whose
   contiguous copy does not fit in the free memory), and the same shapes with an fp8_e4m3
   cache (both fp8 kernels, ``fp8_kernel``) against the bf16 cache. Shapes whose caches do
   not fit are skipped with a line; each part frees its memory even when it fails, so an
   80 GB H100 runs the whole suite. Achieved bandwidth = K/V bytes read /
   kernel time (``triton.testing.do_bench`` on a CUDA-graph replay of the call, as the
   engine runs it, for both: median, L2 flushed). SDPA's backend is PyTorch's pick (with
   torch 2.11 on an H200: cuDNN's fused attention); the suite logs the kernels it ran.
3. (b) Engine decode throughput for a Llama-3-8B-shaped model with random bf16 weights
   (``load_format="dummy"``: nothing to download): minivllm with CUDA graphs, the same
   engine with its graphs switched off (what ``enforce_eager=True`` runs), and HF
   ``generate`` (transformers' LlamaForCausalLM, same config, its own random init; bf16,
   sdpa attention); batch 1, 16, 64, 256; prompts of 128 random tokens, 128 new tokens,
   EOS ignored, greedy. Decode step time = (time for 128 tokens - time for 1 token) / 127;
   with CUDA graphs the median of 3 such measurements.
4. (c) Roofline: a decode step must read every weight once plus the batch's K/V; at the
   measured copy bandwidth that takes ``(weight_bytes + kv_bytes) / bandwidth``. The
   ratio roofline / measured step time is how close the engine gets.

The last line is one JSON object with the headline ratios (and the tables are written
to ``--out``, default reports/gpu_suite.json).
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import inspect
import json
import os
import platform
import subprocess
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import minivllm  # noqa: E402,F401  (before torch: sets up Triton)
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402
from triton.testing import do_bench  # noqa: E402

LLAMA3_8B = dict(
    architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=4096,
    intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
    num_key_value_heads=8, head_dim=128, vocab_size=128256, max_position_embeddings=8192,
    rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False, hidden_act="silu",
    bos_token_id=128000, eos_token_id=128001, torch_dtype="bfloat16")


def log(*a):
    print(*a, flush=True)


def table(rows: list[dict], cols: list[str]) -> str:
    out = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        out.append("| " + " | ".join(_fmt(r.get(c)) for c in cols) + " |")
    return "\n".join(out)


def _fmt(v):
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
    return "" if v is None else str(v)


# --- 0. correctness ------------------------------------------------------------------
def correctness(quick: bool) -> dict:
    res = {}
    test_file = ROOT / "tests" / "test_kernels.py"
    if test_file.exists():
        t = time.time()
        # pytest-xdist, where installed, runs the tests on up to 8 processes (one GPU:
        # 464 s one at a time on an H100, about 200 s with 8), so the suite fits one
        # 10-minute command
        workers = min(8, os.cpu_count() or 1)
        xdist = ["-n", str(workers)] if importlib.util.find_spec("xdist") and workers > 1 else []
        files = [str(ROOT / "tests" / f) for f in
                 ("test_kernels.py", "test_fp8_attention.py", "test_triton_backend.py")]
        p = subprocess.run([sys.executable, "-m", "pytest", "-q", *files, *xdist,
                            "-m", "not embedded", "-p", "no:cacheprovider"],
                           cwd=ROOT, capture_output=True, text=True)
        tail = p.stdout.strip().splitlines()[-1] if p.stdout.strip() else p.stderr[-500:]
        log(f"kernel tests on GPU: {tail} ({time.time() - t:.0f} s)")
        if p.returncode != 0:
            log(p.stdout[-4000:])
        res["kernel_tests"] = tail
        res["kernel_tests_ok"] = p.returncode == 0
    from minivllm import LLM, SamplingParams
    from tests.tiny_model import make_tiny_llama

    d = make_tiny_llama(Path(tempfile.mkdtemp()) / "tiny", hidden_size=256, num_heads=8,
                        num_kv_heads=2, num_layers=2)
    prompts = [[1] + [5 + (i * 7 + j) % 300 for j in range(n)]
               for i, n in enumerate((3, 40, 17, 90, 5, 200, 33))]
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=0)
    outs = {}
    for name, kw in [("TORCH", dict(attention_backend="TORCH", enforce_eager=True)),
                     ("TRITON eager", dict(attention_backend="TRITON", enforce_eager=True)),
                     ("TRITON + CUDA graphs", dict(attention_backend="TRITON"))]:
        llm = LLM(str(d), device="cuda", dtype="float32", max_num_seqs=8, **kw)
        outs[name] = llm.generate(prompts, sp, use_tqdm=False)
        del llm
    ref = outs["TORCH"]
    for name in ("TRITON eager", "TRITON + CUDA graphs"):
        same = all(a.outputs[0].token_ids == b.outputs[0].token_ids for a, b in zip(ref, outs[name]))
        diff = max(abs(a.outputs[0].cumulative_logprob - b.outputs[0].cumulative_logprob)
                   for a, b in zip(ref, outs[name]))
        log(f"engine float32, {name} vs TORCH: greedy tokens equal = {same}, "
            f"max |cumulative logprob diff| = {diff:.2e}")
        res[f"engine_{name}_equal"] = same
        res[f"engine_{name}_logprob_diff"] = diff
    return res


# --- 1. copy bandwidth ---------------------------------------------------------------
def copy_bandwidth() -> float:
    n = 4 << 30
    src = torch.empty(n, dtype=torch.uint8, device="cuda").random_(0, 255)
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=50, rep=300)  # noqa: F821 (del below)
    bw = 2 * n / (ms * 1e-3)
    log(f"copy bandwidth: {bw / 1e9:.0f} GB/s (4 GiB copy, read + write, {ms:.3f} ms)")
    del src, dst
    torch.cuda.empty_cache()
    return bw


# --- 2. decode attention -------------------------------------------------------------
def bench_graph(fn) -> float:
    """Median GPU time (ms) of ``fn`` replayed from a CUDA graph, as the engine runs it:
    launch overhead on the CPU is left out, for our kernel and for SDPA alike."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # compile, allocate
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return do_bench(graph.replay, warmup=10, rep=50)


def paged_decode_inputs(num_blocks: int, B: int, ctx: int, H: int, D: int, bs: int,
                        dtype: torch.dtype, g: torch.Generator):
    """Decode inputs over a shared paged cache of ``num_blocks`` blocks: q [B, H, D], block
    tables [B, ctx / bs] int32 of distinct blocks scattered at random, seq_lens [B] = ctx."""
    perm = torch.randperm(num_blocks, device="cuda", generator=g)
    bt = perm[:B * (ctx // bs)].view(B, ctx // bs).to(torch.int32)
    lens = torch.full((B,), ctx, dtype=torch.int32, device="cuda")
    q = torch.randn(B, H, D, device="cuda", dtype=dtype, generator=g)
    return q, bt, lens


def cuda_kernel_names(fn) -> list[str]:
    """Names of the CUDA kernels (and memsets) one call of ``fn`` launches, from the torch
    profiler: which backend SDPA dispatched to is PyTorch's choice, so the suite says it."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sorted({e.name for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA})


def sdpa_backend(kernel_names: list[str]) -> str:
    """A short name for the SDPA backend the kernel names show."""
    text = " ".join(kernel_names).lower()
    for key, name in (("cudnn", "cudnn"), ("flash", "flash"), ("fmha", "efficient"),
                      ("mem_eff", "efficient")):
        if key in text:
            return name
    return "math"


def sdpa_on_contiguous(q, k_cache, v_cache, bt, bs: int, scale: float):
    """SDPA on the same keys and values laid out contiguously ([B, kv_heads, ctx, D],
    copied once here): returns a function giving [B, H, 1, D], for timing."""
    B = bt.shape[0]
    slots = (bt.long()[:, :, None] * bs + torch.arange(bs, device="cuda")).view(B, -1)
    kc = k_cache[slots].permute(0, 2, 1, 3).contiguous()
    vc = v_cache[slots].permute(0, 2, 1, 3).contiguous()
    qs = q[:, :, None, :]
    return lambda: F.scaled_dot_product_attention(qs, kc, vc, scale=scale, enable_gqa=True)


def decode_attention(copy_bw: float, quick: bool, full_sweep: bool = False) -> tuple:
    from minivllm_kernels import paged_attention as PA

    H, Hkv, D, bs = 32, 8, 128, 16
    batches = [1, 8, 32] if quick else [1, 8, 32, 64, 128, 256]
    ctxs = [512, 4096] if quick else [512, 1024, 4096, 8192, 16384, 32768]
    dtype = torch.bfloat16
    # room for every timed shape and for the batch-invariance check (256 x 4096) below,
    # in bf16 and fp8 (3 bytes per element), within the free memory: shapes that do not
    # fit are dropped with a line that says so
    free = torch.cuda.mem_get_info()[0]
    per_token = Hkv * D * 2 * 3  # K and V, bf16 + fp8
    fits = [(b, c) for b in batches for c in ctxs if b * c * per_token < 0.8 * free]
    for b, c in sorted(set((b, c) for b in batches for c in ctxs) - set(fits)):
        log(f"decode attention: batch {b}, context {c} skipped: its caches need "
            f"{b * c * per_token / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free")
    batches = sorted({b for b, _ in fits})
    ctxs = sorted({c for _, c in fits})
    max_tokens = max([b * c for b, c in fits] + [256 * 4096])
    num_blocks = max_tokens // bs + 16
    g = torch.Generator(device="cuda").manual_seed(0)
    k_cache = torch.randn(num_blocks * bs, Hkv, D, device="cuda", dtype=dtype, generator=g)
    v_cache = torch.randn(num_blocks * bs, Hkv, D, device="cuda", dtype=dtype, generator=g)
    rows = []

    def configs_sweep():
        # launch configurations of the split kernel at one large shape
        B, ctx = (32, 4096) if quick else (64, 8192)
        q, bt, lens = make(B, ctx)
        best = None
        out = []
        saved = dict(PA.DECODE_CONFIG)
        saved_split = PA.SPLIT_SIZE
        grid = [(sp, bn, w, st) for sp in (256, 512, 1024) for bn in (32, 64, 128)
                for w in (2, 4, 8) for st in (2, 3)] if full_sweep else \
            [(saved_split, bn, w, st) for bn in (32, 64, 128) for w in (2, 4) for st in (2, 3)]
        for split, block_n, warps, stages in grid:
            PA.SPLIT_SIZE = split
            PA.DECODE_CONFIG.update(BLOCK_N=block_n, num_warps=warps, num_stages=stages)
            try:
                ms = bench_graph(lambda: PA.paged_attention_decode(
                    q, k_cache, v_cache, bt, lens, bs, D ** -0.5, max_seq_len=ctx))  # noqa: F821 (del below)
            except Exception as e:  # resources exceeded for this config
                log(f"  config {block_n}/{warps}/{stages} failed: {type(e).__name__}")
                continue
            bw = B * ctx * Hkv * D * 2 * 2 / (ms * 1e-3)
            out.append(dict(SPLIT_SIZE=split, BLOCK_N=block_n, num_warps=warps,
                            num_stages=stages, ms=ms, frac_copy_bw=bw / copy_bw))
            if best is None or ms < best[0]:
                best = (ms, dict(PA.DECODE_CONFIG), split)
        # report only: the default (tuned over all shapes by benchmarks/decode_sweep.py)
        # is what the engine runs, so it is what the tables below measure
        PA.DECODE_CONFIG.clear()
        PA.DECODE_CONFIG.update(saved)
        PA.SPLIT_SIZE = saved_split
        log(f"decode kernel configs at B={B}, ctx={ctx} (default {saved}; best here "
            f"{best[1] if best else None}, split {best[2] if best else None}):")
        log(table(sorted(out, key=lambda r: r["ms"])[:10],
                  ["SPLIT_SIZE", "BLOCK_N", "num_warps", "num_stages", "ms", "frac_copy_bw"]))
        log(f"using SPLIT_SIZE={PA.SPLIT_SIZE}, {PA.DECODE_CONFIG}")
        return out

    def make(B, ctx):
        return paged_decode_inputs(num_blocks, B, ctx, H, D, bs, dtype, g)

    sweep = configs_sweep()
    sdpa_kernels: list[str] = []
    # fp8 KV (half the bytes) beside bf16 at every shape: the default kernel for fp8
    # caches (fp8_kernel="folded") and the exact one
    k8, v8 = k_cache.to(torch.float8_e4m3fn), v_cache.to(torch.float8_e4m3fn)
    one = torch.ones(Hkv, device="cuda")
    fp8_rows = []
    for B in batches:
        for ctx in ctxs:
            if (B, ctx) not in fits:
                continue
            q, bt, lens = make(B, ctx)
            kv_bytes = B * ctx * Hkv * D * 2 * k_cache.element_size()
            ms_tri = bench_graph(lambda: PA.paged_attention_decode(
                q, k_cache, v_cache, bt, lens, bs, D ** -0.5, max_seq_len=ctx))  # noqa: F821 (del below)
            o_tri = PA.paged_attention_decode(q, k_cache, v_cache, bt, lens, bs, D ** -0.5)
            spp = PA.default_splits_per_program(B, Hkv, -(-ctx // PA.SPLIT_SIZE),
                                                q.device)
            r = dict(batch=B, context=ctx, kv_MB=kv_bytes / 1e6, splits_per_program=spp,
                     triton_us=ms_tri * 1e3, triton_GBps=kv_bytes / (ms_tri * 1e-3) / 1e9,
                     frac_copy_bw=kv_bytes / (ms_tri * 1e-3) / copy_bw)
            # SDPA needs K and V copied contiguously: skip it where that does not fit
            need = 2 * kv_bytes
            free = torch.cuda.mem_get_info()[0]
            if need * 1.1 + (1 << 30) > free:
                log(f"SDPA skipped at batch {B}, context {ctx}: its contiguous K/V copy "
                    f"needs {need / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free")
            else:
                sdpa = sdpa_on_contiguous(q, k_cache, v_cache, bt, bs, D ** -0.5)
                if not sdpa_kernels:
                    sdpa_kernels = cuda_kernel_names(sdpa)
                    log(f"SDPA here runs: {sdpa_kernels}")
                ms_sdpa = bench_graph(sdpa)
                err = (o_tri.float() - sdpa()[:, :, 0].float()).abs().max().item()
                r.update(sdpa_us=ms_sdpa * 1e3, speedup_vs_sdpa=ms_sdpa / ms_tri,
                         max_abs_diff=err)
                del sdpa  # frees the contiguous copy
                torch.cuda.empty_cache()
            rows.append(r)
            f8 = dict(batch=B, context=ctx, kv_MB=kv_bytes / 2e6, bf16_us=ms_tri * 1e3)
            for name in ("default", "exact"):
                kw = {} if name == "default" else dict(fp8_kernel="exact")
                ms = bench_graph(lambda: PA.paged_attention_decode(  # noqa: B023
                    q, k8, v8, bt, lens, bs, D ** -0.5, one, one, max_seq_len=ctx, **kw))  # noqa: F821 (del below)
                f8[f"fp8_{name}_us"] = ms * 1e3
                f8[f"fp8_{name}_frac_copy_bw"] = kv_bytes / 2 / (ms * 1e-3) / copy_bw
                f8[f"fp8_{name}_speedup_vs_bf16"] = ms_tri / ms
            fp8_rows.append(f8)
    log("decode attention (bf16 KV, 32 heads / 8 KV heads, head_dim 128, block 16):")
    log(table(rows, ["batch", "context", "kv_MB", "splits_per_program", "triton_us", "sdpa_us",
                     "triton_GBps", "frac_copy_bw", "speedup_vs_sdpa", "max_abs_diff"]))
    default = inspect.signature(PA.paged_attention_decode).parameters["fp8_kernel"].default
    log(f"decode attention, fp8_e4m3 KV (default fp8 kernel: {default}; and the exact one), "
        f"against bf16 KV at the same shape:")
    log(table(fp8_rows, ["batch", "context", "kv_MB", "bf16_us", "fp8_default_us",
                         "fp8_default_frac_copy_bw", "fp8_default_speedup_vs_bf16",
                         "fp8_exact_us", "fp8_exact_frac_copy_bw",
                         "fp8_exact_speedup_vs_bf16"]))
    # batch invariance at this shape: the launch choices that follow the batch (splits per
    # program, pipeline depth) must not change a sequence's output bits
    invariant = {}
    q, bt, lens = make(256, 4096)
    lens -= 7 * torch.arange(256, device="cuda", dtype=torch.int32)  # ragged
    for name, kc, vc in (("bf16", k_cache, v_cache), ("fp8_e4m3", k8, v8)):
        run = lambda n: PA.paged_attention_decode(  # noqa: E731
            q[:n], kc, vc, bt[:n], lens[:n], bs, D ** -0.5, max_seq_len=4096)
        full = run(256)
        invariant[name] = all(torch.equal(run(n), full[:n]) for n in (1, 8, 32, 64))
    log(f"batch 1, 8, 32, 64 give the first rows of batch 256 bit for bit: {invariant}")
    del k_cache, v_cache, k8, v8
    torch.cuda.empty_cache()
    return rows, fp8_rows, sweep, all(invariant.values()), sdpa_kernels


# --- 3. engine -----------------------------------------------------------------------
def engine(copy_bw: float, quick: bool) -> tuple[list[dict], dict]:
    from transformers import LlamaConfig, LlamaForCausalLM

    from minivllm import LLM, SamplingParams

    cfg = dict(LLAMA3_8B)
    if quick:
        cfg["num_hidden_layers"] = 2
    batches = [1, 16] if quick else [1, 16, 64, 256]
    prompt_len, new_tokens = 128, 128
    folder = Path(tempfile.mkdtemp()) / "llama3-8b-shape"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(cfg))
    t = time.time()
    llm = LLM(str(folder), device="cuda", dtype="bfloat16", load_format="dummy",
              skip_tokenizer_init=True, max_model_len=1024, max_num_seqs=max(batches),
              kv_cache_memory_bytes=int(24e9), enable_prefix_caching=False)
    runner = llm.llm_engine.model_runner
    graphs = runner.cuda_graphs
    log(f"minivllm engine ready in {time.time() - t:.0f} s (weights + KV + CUDA graph capture "
        f"for sizes {graphs.sizes[0]}..{graphs.sizes[-1]})")
    model = runner.model
    weight_bytes = sum(p.numel() * p.element_size() for n, p in model.named_parameters()
                       if "embed_tokens" not in n)
    weight_bytes += model.embed_tokens.weight.shape[1] * 2  # one embedding row per token
    kv_per_token = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * 128 * 2
    gen = torch.Generator().manual_seed(0)

    def prompts(B):
        return torch.randint(0, cfg["vocab_size"], (B, prompt_len), generator=gen).tolist()

    def run_engine(B, n):
        p = prompts(B)
        sp = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        llm.generate(p[:1], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True),  # noqa: F821 (del below)
                     use_tqdm=False)  # warm
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        llm.generate(p, sp, use_tqdm=False)  # noqa: F821 (del below)
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    rows = {B: dict(batch=B) for B in batches}
    for mode in ("graphs", "eager"):
        runner.cuda_graphs = graphs if mode == "graphs" else None
        # the graph runs are short and carry the roofline target: median of 3 (eager and
        # HF, the slow sides of the ratios, run once)
        reps = 3 if mode == "graphs" else 1
        for B in batches:
            runs = [(run_engine(B, new_tokens), run_engine(B, 1)) for _ in range(reps)]
            t_full = statistics.median(full for full, _ in runs)
            steps = [(full - one) / (new_tokens - 1) for full, one in runs]
            step = statistics.median(steps)
            rows[B][f"{mode}_tok_s"] = B * new_tokens / t_full
            rows[B][f"{mode}_step_ms"] = step * 1e3
            rows[B][f"{mode}_decode_tok_s"] = B / step
            if reps > 1:
                log(f"{mode} batch {B}: step ms per run "
                    f"{', '.join(f'{x * 1e3:.3f}' for x in steps)} (median taken)")
    runner.cuda_graphs = graphs
    # graph replay alone at batch 1 (GPU time of the forward pass and the LM head, which
    # the graph includes; no scheduler, no sampler)
    graph, _ = graphs.graphs[1]
    graphs.seq_lens[:1] = 256
    graphs.slot_mapping[:1] = -1
    ms_replay = do_bench(graph.replay)
    del llm, runner, model, graphs, graph
    gc.collect()
    torch.cuda.empty_cache()

    # HF transformers
    hf_cfg = LlamaConfig(**{k: v for k, v in cfg.items() if k not in ("architectures",
                                                                       "model_type", "torch_dtype")})
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        hf = LlamaForCausalLM(hf_cfg)
    torch.set_default_dtype(torch.float32)
    hf.eval()

    def run_hf(B, n):
        ids = torch.tensor(prompts(B), device="cuda")
        kw = dict(do_sample=False, max_new_tokens=n, min_new_tokens=n, pad_token_id=0,
                  attention_mask=torch.ones_like(ids))
        with torch.inference_mode():
            hf.generate(ids[:1, :8], do_sample=False, max_new_tokens=2, pad_token_id=0)  # noqa: F821 (del below)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = hf.generate(ids, **kw)  # noqa: F821 (del below)
            torch.cuda.synchronize()
        assert out.shape[1] == prompt_len + n, out.shape
        return time.perf_counter() - t0

    for B in batches:
        t_full = run_hf(B, new_tokens)
        t_one = run_hf(B, 1)
        step = (t_full - t_one) / (new_tokens - 1)
        rows[B]["hf_tok_s"] = B * new_tokens / t_full
        rows[B]["hf_step_ms"] = step * 1e3
        rows[B]["hf_decode_tok_s"] = B / step
    del hf
    gc.collect()
    torch.cuda.empty_cache()

    out = []
    for B, r in rows.items():
        avg_ctx = prompt_len + new_tokens / 2
        roof_s = (weight_bytes + B * avg_ctx * kv_per_token) / copy_bw
        r["roofline_step_ms"] = roof_s * 1e3
        r["graphs_frac_roofline"] = roof_s * 1e3 / r["graphs_step_ms"]
        r["speedup_vs_hf"] = r["graphs_tok_s"] / r["hf_tok_s"]
        r["decode_speedup_vs_hf"] = r["graphs_decode_tok_s"] / r["hf_decode_tok_s"]
        r["graphs_vs_eager"] = r["graphs_tok_s"] / r["eager_tok_s"]
        out.append(r)
    log(f"engine, Llama-3-8B shape ({cfg['num_hidden_layers']} layers), random bf16 weights "
        f"({weight_bytes / 1e9:.2f} GB read per decode step), prompt {prompt_len}, "
        f"{new_tokens} new tokens:")
    log(table(out, ["batch", "graphs_tok_s", "eager_tok_s", "hf_tok_s", "speedup_vs_hf",
                    "graphs_vs_eager", "graphs_step_ms", "eager_step_ms", "hf_step_ms",
                    "decode_speedup_vs_hf"]))
    log("roofline (weights + K/V bytes at the measured copy bandwidth):")
    log(table(out, ["batch", "roofline_step_ms", "graphs_step_ms", "graphs_frac_roofline"]))
    extra = dict(weight_bytes=weight_bytes, graph_replay_b1_ms=ms_replay,
                 graph_replay_b1_frac_roofline=weight_bytes / copy_bw * 1e3 / ms_replay)
    log(f"batch-1 forward pass + LM head alone (graph replay, 256-token context): "
        f"{ms_replay:.3f} ms = "
        f"{extra['graph_replay_b1_frac_roofline']:.1%} of the weight roofline")
    return out, extra


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small shapes (a smoke run)")
    ap.add_argument("--skip", nargs="*", default=[], choices=["correctness", "attention",
                                                              "engine"])
    ap.add_argument("--sweep", action="store_true",
                    help="sweep split size and launch configs of the decode kernel widely")
    ap.add_argument("--out", default=str(ROOT / "reports" / "gpu_suite.json"))
    ns = ap.parse_args()
    if not torch.cuda.is_available():
        print("gpu_suite needs a CUDA GPU (torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
    import transformers

    env = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__,
               triton=triton.__version__, transformers=transformers.__version__,
               cuda=torch.version.cuda, python=platform.python_version())
    log("environment:", json.dumps(env))
    report: dict = {"env": env, "quick": ns.quick}
    if "correctness" not in ns.skip:
        report["correctness"] = correctness(ns.quick)
    bw = copy_bandwidth()
    report["copy_bandwidth_Bps"] = bw
    head = {"gpu": env["gpu"], "copy_GBps": round(bw / 1e9)}
    if "attention" not in ns.skip:
        try:
            rows, fp8_rows, sweep, invariant, sdpa_kernels = decode_attention(
                bw, ns.quick, ns.sweep)
            report.update(decode_attention=rows, decode_attention_fp8=fp8_rows,
                          decode_configs=sweep, decode_batch_invariant=invariant,
                          sdpa_kernels=sdpa_kernels)
            head["attn_batch_invariant"] = invariant
            head["sdpa_backend"] = sdpa_backend(sdpa_kernels)
            big = [r for r in rows if r["batch"] >= 32 and r["context"] >= 4096]
            if big:
                head["attn_min_frac_copy_bw_b32_ctx4k"] = round(
                    min(r["frac_copy_bw"] for r in big), 3)
                vs_sdpa = [r["speedup_vs_sdpa"] for r in big if "speedup_vs_sdpa" in r]
                if vs_sdpa:  # shapes whose SDPA copy did not fit have none
                    head["attn_min_speedup_vs_sdpa_b32_ctx4k"] = round(min(vs_sdpa), 3)
            fp8_big = [r for r in fp8_rows if r["batch"] >= 32 and r["context"] >= 4096]
            if fp8_big:
                head["fp8_min_frac_copy_bw_b32_ctx4k"] = round(
                    min(r["fp8_default_frac_copy_bw"] for r in fp8_big), 3)
                head["fp8_min_speedup_vs_bf16_b32_ctx4k"] = round(
                    min(r["fp8_default_speedup_vs_bf16"] for r in fp8_big), 3)
        except Exception:  # report it, and still run the engine part
            traceback.print_exc()
            head["attention_error"] = True
        finally:  # what a failed part held (its frames, the allocator's cache) goes
            gc.collect()
            torch.cuda.empty_cache()
    if "engine" not in ns.skip:
        try:
            rows, extra = engine(bw, ns.quick)
            report.update(engine=rows, engine_extra=extra)
            by_b = {r["batch"]: r for r in rows}
            head["engine_b1_frac_roofline"] = round(by_b[1]["graphs_frac_roofline"], 3)
            head["engine_b1_graphs_vs_eager"] = round(by_b[1]["graphs_vs_eager"], 3)
            if 64 in by_b:
                head["engine_b64_speedup_vs_hf"] = round(by_b[64]["speedup_vs_hf"], 2)
        except Exception:
            traceback.print_exc()
            head["engine_error"] = True
    if "correctness" in report:
        c = report["correctness"]
        head["correct"] = bool(c.get("kernel_tests_ok", True)
                               and c.get("engine_TRITON + CUDA graphs_equal"))
    Path(ns.out).parent.mkdir(parents=True, exist_ok=True)
    Path(ns.out).write_text(json.dumps(report, indent=1))
    print(json.dumps(head))
    return 0


if __name__ == "__main__":
    sys.exit(main())
