"""Where the golden-snapshot tolerances of minivllm.precision.regress come from.

For each compute dtype: the largest |token log-prob change| on fixed corpus windows when
only the MLP reduction order changes (rounding noise, minivllm.precision.noise), and when
an fp8 e4m3 KV cache is swapped in (a regression the tolerance must catch). Run:

    python benchmarks/golden_tolerances.py            # 6 windows of 64 tokens, ~1-2 min on 2 cores

Measured on a 2-core CPU (torch 2.x), SmolLM2-135M-Instruct: noise 2.4e-5 / 0.030 / 0.28
nats for float32 / float16 / bfloat16; fp8 KV 0.63 / 0.58 / 0.82.
"""

from __future__ import annotations

import argparse

from minivllm import LLM
from minivllm.precision import evalsets, metrics
from minivllm.precision.noise import permuted_mlp_reduction
from minivllm.precision.regress import DEFAULT_TOLERANCES


def largest_change(ref_rows, rows, seqs) -> float:
    return max(float((metrics.token_logprobs(a, s) - metrics.token_logprobs(b, s)).abs().max())
               for a, b, s in zip(ref_rows, rows, seqs))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--num-sequences", type=int, default=6)
    ap.add_argument("--seq-len", type=int, default=64)
    ns = ap.parse_args()
    kw = dict(model=ns.model, num_gpu_blocks_override=64, max_model_len=max(128, ns.seq_len))
    print("| dtype | reordered-reduction noise (nats) | fp8 e4m3 KV cache (nats) | tolerance |")
    print("|---|---|---|---|")
    for dtype in ("float32", "float16", "bfloat16"):
        llm = LLM(dtype=dtype, **kw)
        seqs = evalsets.corpus_sequences(llm.get_tokenizer(), ns.seq_len, ns.num_sequences)
        ref = llm.score(seqs)
        with permuted_mlp_reduction(llm, seed=1):
            noise = largest_change(ref, llm.score(seqs), seqs)
        del llm
        fp8 = LLM(dtype=dtype, kv_cache_dtype="fp8_e4m3", **kw)
        bad = largest_change(ref, fp8.score(seqs), seqs)
        del fp8
        print(f"| {dtype} | {noise:.2g} | {bad:.2g} | {DEFAULT_TOLERANCES[dtype]:g} |")


if __name__ == "__main__":
    main()
