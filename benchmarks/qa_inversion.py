"""Why greedy QA accuracy can move against KL for calibrated 4-bit weights (issue 25, item 4).

benchmarks/quantization.py found AWQ-asym-g128 with 2.4x less corpus KL than int4 RTN
(asym, g128) yet 47.7 % against 68.2 % greedy QA accuracy on the 176-question set. This
script takes the two models apart per question:

* each engine's greedy answer (``--max-tokens``, default 24, as the benchmark) and whether
  it matches (``evalsets.answer_matches``); the paired table RTN-right/AWQ-wrong against
  RTN-wrong/AWQ-right with an exact two-sided sign test (McNemar);
* where each answer first leaves the float32 answer (token index), and what the float32
  model's margin (top-1 minus top-2 log-prob) was at that position;
* the answer KL per question (teacher-forced on the float32 answer, as the benchmark);
* for every wrong answer: whether the answer appears when the same engine may write
  ``--long-tokens`` tokens (the 24-token cut at fault), and the category of the first
  changed token (the answer word itself, or the wording before it).

Prints a summary and the table of flipped questions, then one JSON line.

    python benchmarks/qa_inversion.py                       # ~3-6 min on 2 cores (+ the
                                                            # one-time AWQ build if not cached)
    python benchmarks/qa_inversion.py --awq-path DIR        # a saved AWQ checkpoint folder
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import time

import numpy as np
import torch


def sign_test_p(b: int, c: int) -> float:
    """Exact two-sided binomial (McNemar) p-value for b against c discordant pairs."""
    n, k = b + c, min(b, c)
    if n == 0:
        return 1.0
    p = sum(math.comb(n, i) for i in range(k + 1)) / 2 ** n
    return min(1.0, 2 * p)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--long-tokens", type=int, default=64)
    ap.add_argument("--awq-path", default=None, help="a saved AWQ checkpoint (default: the "
                    "cached one, built on first use)")
    args = ap.parse_args(argv)

    from minivllm import LLM, SamplingParams
    from minivllm.precision import evalsets as E
    from minivllm.precision import metrics as M
    from minivllm.quantization.checkpoint import cached_quantized

    t0 = time.perf_counter()
    g = args.group_size
    common = dict(dtype="float32", max_model_len=512, kv_cache_memory_bytes=96 << 20)
    awq_path = args.awq_path or str(cached_quantized(
        "smollm2-135m-instruct", "awq", {"group_size": g, "symmetric": False}))
    base = LLM(**common)
    tok = base.get_tokenizer()
    qa = E.load_qa()
    prompts = [tok.encode(tok.apply_chat_template(E.qa_prompt(it.question), tokenize=False,
                                                  add_generation_prompt=True),
                          add_special_tokens=False) for it in qa]
    greedy = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    longer = SamplingParams(temperature=0.0, max_tokens=args.long_tokens)

    def run(llm):
        outs = llm.generate(prompts, greedy, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs], [o.outputs[0].text for o in outs]

    base_ids, base_txt = run(base)
    seqs = [p + a for p, a in zip(prompts, base_ids)]
    rows = [list(range(len(p) - 1, len(p) - 1 + len(a))) for p, a in zip(prompts, base_ids)]
    ref = base.score(seqs, output="logits", positions=rows)
    res = {"float32": {"ids": base_ids, "text": base_txt}}
    engines = {"rtn": dict(quantization="int4", quantization_config={"group_size": g,
                                                                     "symmetric": False}),
               "awq": dict(model=awq_path)}
    for name, kw in engines.items():
        llm = LLM(**{**common, **kw})
        ids, txt = run(llm)
        cand = llm.score(seqs, output="logits", positions=rows)
        akl = [float(M.kl_divergence(r, c).mean()) for r, c in zip(ref, cand)]
        ok = [E.answer_matches(t, it.answers) for t, it in zip(txt, qa)]
        long_txt = [None] * len(qa)
        wrong = [i for i, v in enumerate(ok) if not v]
        if wrong:
            outs = llm.generate([prompts[i] for i in wrong], longer, use_tqdm=False)
            for i, o in zip(wrong, outs):
                long_txt[i] = o.outputs[0].text
        res[name] = {"ids": ids, "text": txt, "ok": ok, "answer_kl": akl, "long": long_txt}
        del llm
        gc.collect()
    base_ok = [E.answer_matches(t, it.answers) for t, it in zip(base_txt, qa)]

    # float32's margin (top-1 minus top-2 log-prob) at each of its answer positions
    margins = []
    for r in ref:
        lp = torch.log_softmax(r.double(), -1)
        top2 = lp.topk(2, dim=-1).values
        margins.append((top2[:, 0] - top2[:, 1]).numpy())

    def first_div(a, b):
        for k, (x, y) in enumerate(zip(a, b)):
            if x != y:
                return k
        return None if len(a) == len(b) else min(len(a), len(b))

    def answer_start(i):
        """Token index in float32's answer where the first accepted answer's text begins."""
        text = base_txt[i].lower()
        pos = min((text.find(a.lower()) for a in qa[i].answers if a.lower() in text),
                  default=-1)
        if pos < 0:
            return None
        for k in range(1, len(base_ids[i]) + 1):
            if len(tok.decode(base_ids[i][:k])) > pos:
                return k - 1
        return None

    per_q = []
    for i, it in enumerate(qa):
        d = {"id": it.id, "category": it.category, "question": it.question,
             "answers": list(it.answers), "float32": base_txt[i], "answer_start": answer_start(i)}
        for name in engines:
            r = res[name]
            k = first_div(base_ids[i], r["ids"][i])
            d[name] = {"ok": bool(r["ok"][i]), "text": r["text"][i],
                       "answer_kl": r["answer_kl"][i], "first_div": k,
                       "margin_at_div": None if k is None or k >= len(margins[i])
                       else float(margins[i][k]),
                       "long_ok": None if r["long"][i] is None
                       else E.answer_matches(r["long"][i], it.answers),
                       "long": r["long"][i]}
        per_q.append(d)

    n = len(qa)
    summary = {"n": n, "float32_correct": int(sum(base_ok)), "seconds": None}
    print(f"{n} questions, greedy {args.max_tokens} tokens; float32 correct {sum(base_ok)}/{n}")
    for name in engines:
        ok = np.array([q[name]["ok"] for q in per_q], float)
        akl = np.array([q[name]["answer_kl"] for q in per_q])
        changed = sum(q[name]["first_div"] is not None for q in per_q)
        lo, hi = M.bootstrap_ci(list(ok))
        wrong = [q for q in per_q if not q[name]["ok"]]
        trunc = sum(bool(q[name]["long_ok"]) for q in wrong)
        at_word = sum(q[name]["first_div"] is not None and q["answer_start"] is not None
                      and q[name]["first_div"] >= q["answer_start"] for q in wrong)
        summary[name] = {"acc": float(ok.mean()), "acc_ci": [lo, hi],
                         "answer_kl": float(akl.mean()), "changed": changed,
                         "wrong": len(wrong), "wrong_but_right_with_more_tokens": trunc,
                         "wrong_diverging_at_or_after_answer_word": at_word}
        print(f"{name}: accuracy {ok.mean():.1%} [{lo:.1%}, {hi:.1%}], answer KL "
              f"{akl.mean():.3f}, {changed} answers differ from float32's, {len(wrong)} wrong; "
              f"of those {trunc} are right with {args.long_tokens} tokens (the cut at "
              f"{args.max_tokens} tokens), {at_word} first differ at or after the answer word")
    b = sum(q["rtn"]["ok"] and not q["awq"]["ok"] for q in per_q)
    c = sum(q["awq"]["ok"] and not q["rtn"]["ok"] for q in per_q)
    summary.update(rtn_only=b, awq_only=c, sign_test_p=sign_test_p(b, c))
    print(f"paired: RTN right / AWQ wrong {b}, AWQ right / RTN wrong {c}, exact sign test "
          f"p = {sign_test_p(b, c):.2g}")
    # answer KL of the flipped items against the rest
    flip = [q for q in per_q if q["rtn"]["ok"] and not q["awq"]["ok"]]
    rest = [q for q in per_q if not (q["rtn"]["ok"] and not q["awq"]["ok"])]
    for label, group in (("RTN right / AWQ wrong", flip), ("the other items", rest)):
        if group:
            print(f"{label}: mean answer KL AWQ {np.mean([q['awq']['answer_kl'] for q in group]):.3f}"
                  f", RTN {np.mean([q['rtn']['answer_kl'] for q in group]):.3f}; median "
                  f"float32 margin at AWQ's first change "
                  f"{np.median([q['awq']['margin_at_div'] for q in group if q['awq']['margin_at_div'] is not None] or [float('nan')]):.2f}")
    by_cat: dict = {}
    for q in per_q:
        cat = by_cat.setdefault(q["category"], [0, 0, 0])
        cat[0] += 1
        cat[1] += q["rtn"]["ok"]
        cat[2] += q["awq"]["ok"]
    summary["by_category"] = by_cat
    print("| category | items | RTN right | AWQ right |\n|---|---|---|---|")
    for cat, (k, r, a) in sorted(by_cat.items()):
        print(f"| {cat} | {k} | {r} | {a} |")
    print("\n| id | question | float32 | RTN | AWQ | AWQ first change (token, float32 margin) |"
          "\n|---|---|---|---|---|---|")
    for q in flip:
        print(f"| {q['id']} | {q['question']} | {q['float32']!r} | {q['rtn']['text']!r} | "
              f"{q['awq']['text']!r} | {q['awq']['first_div']}, {q['awq']['margin_at_div'] or 0:.2f} |")
    summary["seconds"] = round(time.perf_counter() - t0, 1)
    summary["per_question"] = per_q
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
