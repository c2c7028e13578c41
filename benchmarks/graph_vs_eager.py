"""Graph against eager on a GPU, numerically (course chapter 24): does CUDA-graph padding
change the embedded model's log-probs, and by how much?

For each dtype (bfloat16, float32) it builds the embedded SmolLM2-135M-Instruct twice on
one device, with CUDA graphs (TRITON backend, the default on CUDA) and with
``enforce_eager=True``, and runs the same greedy requests through both:

* ``engine``: 16 prompts from the bundled corpus, 32 greedy tokens, all in one batch
  (decode batches of 16 run in the size-16 graph) and in batches of 5 (the size-8 graph,
  3 padding rows). Reported: prompts whose greedy tokens are identical, the first step
  where any differ, and the max |difference| of the chosen tokens' log-probs over the
  steps before the first divergence of each prompt.
* ``alone_vs_padded``: inside the graph engine only, each of the first 5 prompts run
  alone (size-1 graph, M = 1) against the 5 together (size-8 graph, M = 8): the same
  graph machinery, only the matmuls' row count differs (cuBLAS may pick another kernel).
* ``ms_per_token``: wall time of a ``generate`` call over the tokens it generated
  (prefill included; median over the calls) for the batch-1 and batch-16 runs, graphs
  and eager.

    python benchmarks/graph_vs_eager.py                # CUDA (the H200 run)
    python benchmarks/graph_vs_eager.py --device cpu --dtypes float32 --tokens 3 --prompts 6
                                                       # the CPU emulation (a smoke test)

On CPU the graph engine uses ``emulate_cuda_graphs=True`` (not a vLLM option) and the
TORCH backend; its step times mean nothing. Weights: the embedded model when its
converted folder is in the cache (``$MINIVLLM_CACHE``, default ``~/.cache/minivllm``),
else (a machine with no network: nothing to download) SmolLM2-135M's config with random
weights (``load_format="dummy"``, prompts of random token ids), as ``gpu_suite.py``
does; ``--dummy`` forces that. The JSON says which. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


# SmolLM2-135M-Instruct's shapes (the embedded model's config.json, the fields we read).
SMOLLM2_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 576,
    "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
    "num_key_value_heads": 3, "head_dim": 64, "hidden_act": "silu",
    "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 100000.0,
    "tie_word_embeddings": True, "vocab_size": 49152, "bos_token_id": 1, "eos_token_id": 2,
    "torch_dtype": "float32",
}


def chosen(out):
    return [step[t].logprob for t, step in zip(out.token_ids, out.logprobs)]


def compare(a, b) -> dict:
    """a, b: lists of CompletionOutput for the same prompts."""
    same = sum(x.token_ids == y.token_ids for x, y in zip(a, b))
    first_div, max_d = None, 0.0
    for x, y in zip(a, b):
        for i, (tx, ty, lx, ly) in enumerate(zip(x.token_ids, y.token_ids, chosen(x), chosen(y))):
            if tx != ty:
                first_div = i if first_div is None else min(first_div, i)
                break
            max_d = max(max_d, abs(lx - ly))
    return {"prompts_identical": same, "prompts": len(a), "first_divergent_step": first_div,
            "max_abs_dlogprob_before_divergence": max_d}


def run(llm, prompts, sp, batch):
    outs, step_times = [], []
    for i in range(0, len(prompts), batch):
        t = time.perf_counter()
        res = llm.generate(prompts[i:i + batch], sp, use_tqdm=False)
        if llm.llm_engine.model_runner.device.type == "cuda":
            torch.cuda.synchronize()
        step_times.append((time.perf_counter() - t) * 1e3 / sp.max_tokens)
        outs += [r.outputs[0] for r in res]
    return outs, statistics.median(step_times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--prompts", type=int, default=16, help="fewer for a smoke test")
    ap.add_argument("--dummy", action="store_true", help="random weights, SmolLM2's shapes")
    args = ap.parse_args()
    from minivllm import LLM, SamplingParams
    from minivllm.precision import evalsets

    cpu = args.device == "cpu"
    cache = Path(os.environ.get("MINIVLLM_CACHE", Path.home() / ".cache" / "minivllm"))
    folder = cache / "models" / "smollm2-135m-instruct"
    dummy = args.dummy or not (folder / "model.safetensors").exists()
    if dummy:
        cfg = dict(SMOLLM2_CONFIG)
        folder = Path(tempfile.mkdtemp()) / "smollm2-135m-shapes"
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(cfg))
        gen = torch.Generator().manual_seed(0)
        prompts = [torch.randint(3, cfg["vocab_size"], (48,), generator=gen).tolist()
                   for _ in range(args.prompts)]
        extra = dict(load_format="dummy", skip_tokenizer_init=True, seed=0)
    else:
        text = evalsets.load_corpus()
        prompts = [text[i * 997:i * 997 + 200] for i in range(args.prompts)]
        extra = {}
    sp = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True, logprobs=1)
    result = {"device": torch.cuda.get_device_name() if not cpu else "cpu (emulated graphs)",
              "torch": torch.__version__,
              "weights": "random (load_format=dummy, seed 0)" if dummy else "embedded SmolLM2-135M-Instruct"}
    for dtype in args.dtypes.split(","):
        kw = dict(dtype=dtype, max_model_len=512, max_num_seqs=16, device=args.device,
                  num_gpu_blocks_override=256)
        graph = LLM(str(folder), **kw, **extra, **({"emulate_cuda_graphs": True} if cpu else {}))
        eager = LLM(str(folder), **kw, **extra, enforce_eager=True)
        assert graph.llm_engine.model_runner.cuda_graphs is not None
        r = {}
        g16, g16_ms = run(graph, prompts, sp, 16)
        e16, e16_ms = run(eager, prompts, sp, 16)
        g5, _ = run(graph, prompts, sp, 5)
        e5, _ = run(eager, prompts, sp, 5)
        r["engine_batch16"] = compare(g16, e16)
        r["engine_batch5_padded_to_8"] = compare(g5, e5)
        g1, g1_ms = run(graph, prompts[:5], sp, 1)
        _, e1_ms = run(eager, prompts[:5], sp, 1)
        r["alone_vs_padded_graphs"] = compare(g1, g5[:5])
        r["ms_per_token"] = {"graphs_b1": round(g1_ms, 3), "eager_b1": round(e1_ms, 3),
                        "graphs_b16": round(g16_ms, 3), "eager_b16": round(e16_ms, 3)}
        result[dtype] = r
        print(dtype, json.dumps(r), flush=True)
        del graph, eager
    print(json.dumps(result))


if __name__ == "__main__":
    main()
