"""``make demo``: the first incident, measured.

Runs real chat prompts through HF transformers in float32 (the reference) and through
minivllm with every KV-cache storage dtype, greedy, and reports for each dtype how long
the output stays token-identical to the reference. Everything shown is measured now.

Metrics (per dtype, over all prompts):
* identical prefix: generated tokens before the first divergence, as a fraction of all
  generated tokens (1.0 = every prompt token-identical to the reference);
* prompts identical: prompts whose whole output matches;
* first divergence: the earliest / median position (0-based generated token) where a
  prompt's output first differs, "-" when none differs;
* tokens/s: generated tokens per second of minivllm wall time (batched, CPU).
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

DEMO_CONVERSATIONS = [
    "What is the capital of France?",
    "Write a short story about a robot who learns to paint.",
    "Explain how a refrigerator works, step by step.",
    "Give me three tips for learning a new programming language.",
    "What is 17 multiplied by 23? Show your work.",
    "Write a Python function that checks whether a string is a palindrome.",
    "Summarize the water cycle in a few sentences.",
    "Translate 'Good morning, how are you?' into French and Spanish.",
    "Why is the sky blue?",
    "List five animals that live in the ocean and one fact about each.",
]
KV_DTYPES = ["float32", "float16", "bfloat16", "fp8_e4m3", "fp8_e5m2"]


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """Index of the first position where a and b differ (None if equal up to the
    shorter length and equally long)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def hf_reference(model_dir: str, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Greedy float32 HF transformers outputs, one prompt at a time, EOS ignored."""
    import torch
    from tqdm.auto import tqdm
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    outs = []
    for p in tqdm(prompts, desc="HF float32 reference"):
        with torch.no_grad():
            g = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                            max_new_tokens=max_tokens, min_new_tokens=None, do_sample=False,
                            eos_token_id=None, pad_token_id=0)
        outs.append(g[0, len(p):].tolist())
    return outs


def run_demo(model: str = "smollm2-135m-instruct", max_tokens: int = 96,
             out_path: str = "reports/demo.md") -> list[dict]:
    """Run the demo, print the table, write the markdown report; returns the rows."""
    from minivllm.llm import LLM
    from minivllm.models.loader import resolve_model_path
    from minivllm.sampling_params import SamplingParams
    from minivllm.tokenizer import get_tokenizer

    model_dir = str(resolve_model_path(model))
    tok = get_tokenizer(model_dir)
    prompts = [tok.apply_chat_template([{"role": "user", "content": c}], tokenize=False,
                                       add_generation_prompt=True) for c in DEMO_CONVERSATIONS]
    prompt_ids = [tok.encode(p, add_special_tokens=False) for p in prompts]
    print(f"{len(prompt_ids)} chat prompts, {max_tokens} greedy tokens each, EOS ignored on both sides")
    ref = hf_reference(model_dir, prompt_ids, max_tokens)

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    rows, texts = [], {}
    for i, kv in enumerate(KV_DTYPES, 1):
        llm = LLM(model_dir, dtype="float32", kv_cache_dtype=kv, max_model_len=2048,
                  max_num_seqs=len(prompt_ids), enable_prefix_caching=False)
        engine = llm.llm_engine
        from tqdm.auto import tqdm

        t0 = time.perf_counter()
        rids = [engine.add_request(p, params) for p in prompt_ids]
        done: dict = {}
        total = len(prompt_ids) * max_tokens
        with tqdm(total=total, unit="tok", desc=f"minivllm kv_cache_dtype={kv} ({i}/{len(KV_DTYPES)})") as bar:
            while engine.has_unfinished_requests():
                before = engine.stats.num_generation_tokens
                for out in engine.step():
                    done[out.request_id] = out
                bar.update(engine.stats.num_generation_tokens - before)
        outs = [done[r] for r in rids]
        dt = time.perf_counter() - t0
        ids = [o.outputs[0].token_ids for o in outs]
        divs = [first_divergence(r, o) for r, o in zip(ref, ids)]
        same_prefix = sum(max_tokens if d is None else d for d in divs)
        hits = [d for d in divs if d is not None]
        rows.append({
            "kv_cache_dtype": kv,
            "identical_prefix": same_prefix / (max_tokens * len(ids)),
            "prompts_identical": sum(d is None for d in divs),
            "num_prompts": len(ids),
            "first_divergence_min": min(hits) if hits else None,
            "first_divergence_median": statistics.median(hits) if hits else None,
            "tokens_per_s": sum(len(x) for x in ids) / dt,
        })
        texts[kv] = ids
        eos_ids = llm.llm_engine.model_config.eos_token_ids
        del llm

    # Show the prompt where fp8_e4m3 departs from the reference earliest, each reply cut
    # at its first EOS (generation itself ignored EOS so that lengths are equal).
    divs = [first_divergence(r, o) for r, o in zip(ref, texts["fp8_e4m3"])]
    show = min(range(len(divs)), key=lambda i: (divs[i] is None, divs[i] or 0))

    def upto_eos(ids: list[int]) -> str:
        cut = next((i for i, t in enumerate(ids) if t in eos_ids), len(ids))
        return tok.decode(ids[:cut], skip_special_tokens=True)

    replies = {"HF float32 reference": upto_eos(ref[show])}
    replies.update({kv: upto_eos(texts[kv][show]) for kv in KV_DTYPES})

    header = ("| kv_cache_dtype | identical prefix | prompts identical | first divergence "
              "(min / median) | tokens/s |")
    lines = [header, "|---|---|---|---|---|"]
    for r in rows:
        fd = "-" if r["first_divergence_min"] is None else \
            f"{r['first_divergence_min']} / {r['first_divergence_median']:g}"
        lines.append(f"| {r['kv_cache_dtype']} | {r['identical_prefix']:.1%} | "
                     f"{r['prompts_identical']}/{r['num_prompts']} | {fd} | {r['tokens_per_s']:.1f} |")
    table = "\n".join(lines)
    print("\nGreedy agreement with the HF transformers float32 reference "
          f"(model weights float32, {max_tokens} tokens per prompt):\n")
    print(table)
    q = DEMO_CONVERSATIONS[show]
    sample = "\n".join(f"- `{kv}`: {text[:240]!r}" for kv, text in replies.items())
    print(f"\nPrompt {q!r} (where fp8_e4m3 diverges first), reply per KV dtype:\n{sample}")

    report = f"""# minivllm demo: KV-cache precision against the float32 reference

Model: `{model}` (weights float32). {len(prompt_ids)} chat prompts, {max_tokens} greedy
tokens each, EOS ignored on both sides. Reference: HF transformers float32 `generate`.
Every number below was measured when this report was written.

{table}

*identical prefix*: generated tokens before the first divergence, over all generated
tokens. *first divergence*: 0-based index of the first differing generated token.

Prompt {q!r} (where fp8_e4m3 diverges first), reply per KV dtype:

{sample}
"""
    path = Path(out_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(report, encoding="utf-8")
    print(f"\nReport written to {path}")
    return rows
