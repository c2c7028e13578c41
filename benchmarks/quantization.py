"""Weight-quantization schemes on the embedded model, measured with the precision toolkit.

Baseline: minivllm with float32 weights (dtype="float32", float32 KV cache). Each scheme
quantizes the decoder's linear layers on load (``LLM(quantization=...)``; calibrated
methods use the bundled chat conversations, not the evaluation sets) and is measured on:

* the prose corpus (teacher-forced, windows of 512 tokens): mean KL(baseline || scheme)
  in nats with a 95 % cluster-bootstrap CI, top-1 agreement, perplexity ratio;
* the QA set (176 questions, greedy, 24 tokens): answer accuracy, and the mean KL at
  the answer positions of each prompt followed by the baseline's own answer
  (teacher-forced), which measures the same recall without greedy's all-or-nothing;
* weight bytes as stored (decoder linears: packed values plus scales; "total" adds the
  float embeddings and norms).

Reference rows: the noise floor (float32 with its MLP sum reordered), a bfloat16 model,
and float32 with emulated TF32 matmuls. Engines are built one at a time (each is freed
before the next), so memory stays near one model.

Note (from the project's design card): the embedded weights were dequantized from GGUF Q4_1 (asymmetric,
groups of 32). int4 asymmetric g32 on the same grid is therefore nearly lossless; g64 and
g128 and symmetric grids show the real 4-bit trade-off.

Prints a markdown table and, as its last line, one JSON object keyed by scheme name.

    python benchmarks/quantization.py            # the recorded run (~25 min on 2 cores)
    python benchmarks/quantization.py --quick    # 2 windows, 40 QA items, 5 schemes
"""

from __future__ import annotations

import argparse
import gc
import json
import time

import numpy as np
import torch

SCHEMES: dict[str, dict] = {
    "bfloat16 (unquantized)": {"dtype": "bfloat16"},
    "tf32 matmuls (emulated)": {"float32_matmul_precision": "high"},
    "int8-tensor": {"quantization": "int8", "quantization_config": {"granularity": "tensor"}},
    "int8-channel": {"quantization": "int8", "quantization_config": {"granularity": "channel"}},
    "int4-asym-g32": {"quantization": "int4",
                      "quantization_config": {"group_size": 32, "symmetric": False}},
    "int4-sym-g32": {"quantization": "int4", "quantization_config": {"group_size": 32}},
    "int4-sym-g64": {"quantization": "int4", "quantization_config": {"group_size": 64}},
    "int4-asym-g64": {"quantization": "int4",
                      "quantization_config": {"group_size": 64, "symmetric": False}},
    "awq-asym-g64": {"quantization": "awq", "quantization_config": {"group_size": 64}},
    "gptq-sym-g64-actorder-damp0.01": {
        "quantization": "gptq",
        "quantization_config": {"group_size": 64, "act_order": True, "percdamp": 0.01}},
    "gptq-sym-g64-actorder-damp1": {
        "quantization": "gptq",
        "quantization_config": {"group_size": 64, "act_order": True, "percdamp": 1.0}},
    "int4-sym-g128": {"quantization": "int4", "quantization_config": {"group_size": 128}},
    "int4-asym-g128": {"quantization": "int4",
                       "quantization_config": {"group_size": 128, "symmetric": False}},
    "awq-asym-g128": {"quantization": "awq", "quantization_config": {"group_size": 128}},
    "awq-sym-g128": {"quantization": "awq",
                     "quantization_config": {"group_size": 128, "symmetric": True}},
    "gptq-sym-g128-damp0.01": {
        "quantization": "gptq",
        "quantization_config": {"group_size": 128, "act_order": False, "percdamp": 0.01}},
    "gptq-sym-g128-actorder-damp0.01": {
        "quantization": "gptq",
        "quantization_config": {"group_size": 128, "act_order": True, "percdamp": 0.01}},
    "gptq-sym-g128-actorder-damp0.1": {
        "quantization": "gptq",
        "quantization_config": {"group_size": 128, "act_order": True, "percdamp": 0.1}},
    "gptq-sym-g128-actorder-damp1": {
        "quantization": "gptq",
        "quantization_config": {"group_size": 128, "act_order": True, "percdamp": 1.0}},
    "fp8-tensor-dynamic": {"quantization": "fp8"},
    "fp8-channel-dynamic": {"quantization": "fp8", "quantization_config": {"granularity": "channel"}},
    "fp8-tensor-static": {"quantization": "fp8",
                          "quantization_config": {"activation_scheme": "static"}},
    "mxfp4": {"quantization": "mxfp4"},
    "nvfp4 (modelopt_fp4)": {"quantization": "modelopt_fp4"},
}
QUICK = ("int8-tensor", "int8-channel", "int4-sym-g128", "gptq-sym-g128-actorder-damp1",
         "fp8-tensor-dynamic")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--quick", action="store_true", help="2 windows, 40 QA items, 5 schemes")
    ap.add_argument("--schemes", nargs="*", help=f"subset of: {', '.join(SCHEMES)}")
    args = ap.parse_args()

    from tqdm.auto import tqdm

    from minivllm import LLM, SamplingParams
    from minivllm.precision import evalsets as E
    from minivllm.precision import metrics as M
    from minivllm.precision.noise import permuted_mlp_reduction

    names = list(args.schemes or (QUICK if args.quick else SCHEMES))
    unknown = [n for n in names if n not in SCHEMES]
    if unknown:
        ap.error(f"unknown scheme(s) {unknown}; choose from {list(SCHEMES)}")
    max_windows, max_qa = (2, 40) if args.quick else (None, None)
    common = dict(model=args.model, max_model_len=1024, kv_cache_memory_bytes=256 << 20)
    t0 = time.perf_counter()

    base = LLM(dtype="float32", kv_cache_dtype="float32", **common)
    tok = base.get_tokenizer()
    seqs = E.corpus_sequences(tok, seq_len=512, max_sequences=max_windows)
    qa = E.load_qa()[:max_qa]
    qa_prompts = [tok.encode(tok.apply_chat_template(E.qa_prompt(it.question), tokenize=False,
                                                     add_generation_prompt=True),
                             add_special_tokens=False) for it in qa]
    greedy = SamplingParams(temperature=0.0, max_tokens=24)

    def qa_accuracy(llm) -> float:
        outs = llm.generate(qa_prompts, greedy)
        return float(np.mean([E.answer_matches(o.outputs[0].text, it.answers)
                              for o, it in zip(outs, qa)]))

    # QA answers as teacher-forced sequences: each prompt plus the baseline's greedy
    # answer; the KL is taken at the answer positions only (where the facts are recalled).
    base_answers = [o.outputs[0].token_ids for o in base.generate(qa_prompts, greedy)]
    qa_seqs = [p + a for p, a in zip(qa_prompts, base_answers)]
    answer_pos = [slice(len(p) - 1, len(p) - 1 + len(a)) for p, a in zip(qa_prompts, base_answers)]

    def answer_logprobs(llm) -> list:
        rows = []
        for i in range(0, len(qa_seqs), 16):  # full [T, vocab] rows only a few at a time
            scored = llm.score(qa_seqs[i:i + 16])
            rows += [r[sl].clone() for r, sl in zip(scored, answer_pos[i:i + 16])]
        return rows

    ref_rows = base.score(seqs)
    ref_answers = answer_logprobs(base)
    results: dict[str, dict] = {}

    def record(name: str, llm, rows, qa_acc: float, nbytes: dict, seconds: float) -> None:
        s = M.summarize([M.sequence_drift(r, c, ids) for r, c, ids in zip(ref_rows, rows, seqs)])
        ans = answer_logprobs(llm)
        qa_kl = float(np.mean(np.concatenate(
            [M.kl_divergence(r, c).numpy() for r, c in zip(ref_answers, ans)])))
        results[name] = {"mean_kl": s.mean_kl, "kl_ci": list(s.kl_ci),
                         "top1_agreement": s.top1_agreement, "ppl_ratio": s.ppl_ratio,
                         "qa_accuracy": qa_acc, "qa_answer_kl": qa_kl,
                         "linear_weight_bytes": nbytes["linear"],
                         "total_weight_bytes": nbytes["total"], "load_seconds": seconds}

    base_bytes = base.weight_bytes()
    record("float32 (baseline)", base, ref_rows, qa_accuracy(base), base_bytes, 0.0)
    with permuted_mlp_reduction(base, seed=0):
        noise_rows = base.score(seqs)
        record("noise floor", base, noise_rows,
               results["float32 (baseline)"]["qa_accuracy"], base_bytes, 0.0)
    del base, noise_rows
    gc.collect()

    for name in tqdm(names, desc="schemes", unit="scheme"):
        t = time.perf_counter()
        llm = LLM(**{**dict(dtype="float32", kv_cache_dtype="float32"), **common,
                     **SCHEMES[name]})
        load_s = time.perf_counter() - t
        record(name, llm, llm.score(seqs), qa_accuracy(llm), llm.weight_bytes(), load_s)
        del llm
        gc.collect()

    n_pos = sum(len(s) for s in seqs)
    print(f"\n{len(seqs)} corpus windows ({n_pos} positions), {len(qa)} QA items; "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"{time.perf_counter() - t0:.0f} s\n")
    print("| scheme | mean KL (nats) [95% CI] | top-1 agree | PPL ratio | QA acc | "
          "QA answer KL | linear weight MB | total MB | load s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, r in results.items():
        print(f"| {name} | {r['mean_kl']:.3g} [{r['kl_ci'][0]:.3g}, {r['kl_ci'][1]:.3g}] | "
              f"{r['top1_agreement']:.2%} | {r['ppl_ratio']:.4f} | {r['qa_accuracy']:.1%} | "
              f"{r['qa_answer_kl']:.3g} | "
              f"{r['linear_weight_bytes'] / 1e6:.1f} | {r['total_weight_bytes'] / 1e6:.1f} | "
              f"{r['load_seconds']:.0f} |")
    clean = {k: {f: (None if isinstance(v, float) and not np.isfinite(v) else v)
                 for f, v in r.items()} for k, r in results.items()}
    print(json.dumps(clean, allow_nan=False))


if __name__ == "__main__":
    main()
