"""Cost of the fully-masked-row guard (course chapter 9), measured side by side in one run.

* CPU, TORCH backend: greedy decode of the embedded SmolLM2-135M-Instruct (float32) with the engine's "attention.decode" step (SDPA + the guard,
  ``zero_empty_rows``) against the same SDPA call without the guard, swapped in through
  the step registry; rounds alternate (ABBA), medians reported; tokens must be equal.
* CUDA, TRITON backend (when a GPU is present): ``paged_attention_decode`` with the
  -inf guard in its online softmax (``minivllm_kernels/paged_attention.py``) against a copy of the
  kernel module with the guard lines taken out (built from the source text at run time),
  SmolLM2 decode shapes (9 query / 3 KV heads, head_dim 64), CUDA-event timing of 50
  launches replayed from one CUDA graph.

    python benchmarks/masked_row_guard.py [--threads 2] [--rounds 5]
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def decode_no_guard(q, k, v, seq_lens, scale):
    L = k.shape[1]
    mask = (torch.arange(L, device=q.device)[None, :] < seq_lens[:, None])[:, None, None, :]
    return F.scaled_dot_product_attention(q.unsqueeze(2), k.transpose(1, 2), v.transpose(1, 2),
                                          attn_mask=mask, scale=scale, enable_gqa=True).squeeze(2)


def cpu(rounds: int) -> None:
    from minivllm import LLM, SamplingParams

    llm = LLM("smollm2-135m-instruct", dtype="float32", max_model_len=256,
              num_gpu_blocks_override=64, seed=0)
    prompts = [{"prompt_token_ids": [(13 * i + 7 * j) % 40000 + 100 for j in range(5 + 9 * i)]}
               for i in range(4)]
    sp = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    times = {"guard": [], "no_guard": []}
    outs = {}
    for r in range(rounds):
        for name in (("guard", "no_guard") if r % 2 == 0 else ("no_guard", "guard")):
            t0 = time.perf_counter()
            if name == "guard":
                res = llm.generate(prompts, sp)
            else:
                with llm.swap_step("attention.decode", decode_no_guard):
                    res = llm.generate(prompts, sp)
            times[name].append(time.perf_counter() - t0)
            outs[name] = [o.outputs[0].token_ids for o in res]
    n = len(prompts) * sp.max_tokens
    g, ng = (n / statistics.median(times[k]) for k in ("guard", "no_guard"))
    print(f"CPU TORCH decode, {torch.get_num_threads()} threads, 4 prompts x 48 tokens, "
          f"{rounds} rounds: guard {g:.1f} tok/s, no guard {ng:.1f} tok/s, ratio "
          f"{g / ng:.3f}; tokens equal: {outs['guard'] == outs['no_guard']}")


def _no_guard_module():
    src = (ROOT / "minivllm_kernels" / "paged_attention.py").read_text()
    src = src.replace('    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)\n'
                      '    alpha = tl.exp(m - m_use)\n    p = tl.exp(s - m_use[:, None])',
                      '    alpha = tl.exp(m - m_new)\n    p = tl.exp(s - m_new[:, None])')
    src = src.replace('    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)\n'
                      '    a = tl.exp(m - m_use)\n    a_s = tl.exp(m_s - m_use)',
                      '    a = tl.exp(m - m_new)\n    a_s = tl.exp(m_s - m_new)')
    assert "m_use" not in src, "the guard lines changed; update this benchmark"
    path = ROOT / "minivllm_kernels" / "_paged_attention_no_guard.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location("minivllm_kernels._paged_attention_no_guard", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    path.unlink()
    return mod


def gpu(rounds: int) -> None:
    from minivllm_kernels import paged_attention as with_guard

    without = _no_guard_module()
    H, KV, D, bs = 9, 3, 64, 16
    for B, L in ((1, 1024), (32, 1024), (64, 4096)):
        nblk = B * (L // bs)
        kc = torch.randn(nblk * bs, KV, D, device="cuda", dtype=torch.bfloat16)
        vc = torch.randn_like(kc)
        bt = torch.randperm(nblk, device="cuda", dtype=torch.int32).view(B, L // bs)
        sl = torch.full((B,), L, device="cuda", dtype=torch.int32)
        q = torch.randn(B, H, D, device="cuda", dtype=torch.bfloat16)
        res = {}
        outs = {}
        for mod in (with_guard, without):
            f = lambda: mod.paged_attention_decode(q, kc, vc, bt, sl, bs, D ** -0.5,  # noqa: E731
                                                   max_seq_len=L)
            for _ in range(5):
                f()
            # 50 launches captured in one CUDA graph: a replay times the kernels, not
            # Python's launch overhead (eager launches took ~144 us at every shape here)
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                f()
            torch.cuda.current_stream().wait_stream(s)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for _ in range(50):
                    f()
            graph.replay()
            ts = []
            for _ in range(rounds):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                graph.replay()
                b.record()
                torch.cuda.synchronize()
                ts.append(a.elapsed_time(b) / 50 * 1000)
            res[mod is with_guard] = statistics.median(ts)
            outs[mod is with_guard] = f()
        print(f"CUDA TRITON decode B={B} L={L} bf16: guard {res[True]:.1f} us, no guard "
              f"{res[False]:.1f} us, ratio {res[True] / res[False]:.3f}; bitwise equal: "
              f"{torch.equal(outs[True], outs[False])}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--skip-cpu", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if not args.skip_cpu:
        cpu(args.rounds)
    if torch.cuda.is_available():
        gpu(args.rounds)


if __name__ == "__main__":
    main()
