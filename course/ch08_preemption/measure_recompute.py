"""Chapter 8's measurement: does preemption by recompute change a request's tokens?

Runs a workload on an engine whose KV pool is too small (``num_gpu_blocks_override``),
so the scheduler preempts (frees a request's blocks, recomputes prompt + generated
tokens later), and compares every request with its unpreempted solo run on the same
engine: token agreement, first divergence, and the KL divergence (nats) of the logits
at each resumed position against the solo run's logits at the same position (only
where the tokens before it agree, so both rows condition on the same text).

Requests that were never preempted in the tight run are the control: they saw other
batch compositions (bf16/fp16 decode is not batch-invariant on the TORCH backend) but
no recompute.

Used two ways: the chapter imports :func:`measure` for its small live run; run as a
script it measures the larger workload whose rates the chapter quotes::

    OMP_NUM_THREADS=1 PYTHONPATH=. .venv/bin/python course/ch08_preemption/measure_recompute.py \
        --requests 40 --tokens 24 --out course/ch08_preemption/recompute_rates.json
"""

from __future__ import annotations

import argparse
import json
import math
import time

import torch

from minivllm import LLM, SamplingParams
from minivllm.precision.metrics import first_divergence, greedy_agreement, kl_divergence

TOPICS = ["the moon", "rivers", "bread", "volcanoes", "chess", "bees", "glass", "trains",
          "clocks", "salt", "owls", "maps", "rain", "copper", "tea", "bridges", "whales",
          "paper", "wind", "ice", "lighthouses", "ants", "snow", "kites", "coral", "honey",
          "deserts", "violins", "foxes", "silk", "comets", "caves"]


KINDS = ["Write a short story about", "Describe", "Write a poem about"]


def chat_prompts(tok, n: int, offset: int = 0) -> list[list[int]]:
    """n chat prompts (token ids): prompt i asks KINDS[j] about TOPICS[k] (i + offset =
    j * len(TOPICS) + k), so up to 96 are distinct."""
    out = []
    for i in range(n):
        j, k = divmod(i + offset, len(TOPICS))
        conv = [{"role": "user", "content": f"{KINDS[j % len(KINDS)]} {TOPICS[k]}."}]
        out.append(tok.encode(tok.apply_chat_template(conv, tokenize=False,
                                                      add_generation_prompt=True),
                              add_special_tokens=False))
    return out


def sampling(mode: str, n: int, tokens: int, seed0: int = 100) -> list[SamplingParams]:
    """greedy, or seeded sampling (temperature 1, per-request seed) with repetition 1.2,
    frequency 0.5 and presence 0.3 penalties."""
    if mode == "greedy":
        return [SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)] * n
    return [SamplingParams(temperature=1.0, seed=seed0 + i, max_tokens=tokens, ignore_eos=True,
                           repetition_penalty=1.2, frequency_penalty=0.5, presence_penalty=0.3)
            for i in range(n)]


class Recorder:
    """Records every sampled row's raw log-probs (float32, [V]) per request, keyed by the
    output index it samples, and marks the rows computed right after a resume (the
    request's ``num_preemptions`` went up since its previous row). Wraps the model
    runner's ``_sample`` while active (a measuring probe, not a step: it changes
    nothing)."""

    def __init__(self, llm: LLM):
        self.runner = llm.llm_engine.model_runner
        self.rows: dict[str, dict[int, torch.Tensor]] = {}
        self.resumed: dict[str, list[int]] = {}
        self._seen: dict[str, int] = {}

    def __enter__(self):
        orig = self.runner._sample

        def spy(out, logits, finite, reqs, bad):
            lp = torch.log_softmax(logits.float(), dim=-1).cpu()
            for r, row in zip(reqs, lp):
                k = r.num_output_tokens
                self.rows.setdefault(r.request_id, {})[k] = row.clone()
                if r.num_preemptions > self._seen.get(r.request_id, 0):
                    self.resumed.setdefault(r.request_id, []).append(k)
                self._seen[r.request_id] = r.num_preemptions
            return orig(out, logits, finite, reqs, bad)

        self.runner._sample = spy
        return self

    def __exit__(self, *exc):
        del self.runner._sample  # back to the class's method


def solo_runs(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]):
    """Each prompt alone (never preempted): (token lists, rows) where rows[i][k] is the
    raw log-prob row [V] that sampled output token k of request i."""
    tokens, rows = [], []
    for p, sp in zip(prompts, params):
        with Recorder(llm) as rec:
            out = llm.generate([p], sp)[0]
        tokens.append(out.outputs[0].token_ids)
        rows.append(next(iter(rec.rows.values())))
    return tokens, rows


def batch_run(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]):
    """All prompts together (the pool decides who is preempted): (token lists, rows,
    resumed output indices, preemptions) per request, in prompt order."""
    with Recorder(llm) as rec:
        outs = llm.generate(prompts, params)  # in prompt order
    ids = [o.request_id for o in outs]
    return ([o.outputs[0].token_ids for o in outs], [rec.rows[i] for i in ids],
            [rec.resumed.get(i, []) for i in ids],
            [int(o.metrics["num_preemptions"]) for o in outs])


def compare(solo, batch) -> list[dict]:
    """One record per request: preemptions, first divergence, agreement, the KL (nats,
    solo || batch) at each resumed position whose earlier tokens agree, and the KL at the
    other compared positions (the batch-composition baseline)."""
    records = []
    for a, ra, b, rb, res, npre in zip(solo[0], solo[1], *batch):
        fd = first_divergence(a, b)
        upto = len(a) if fd is None else fd + 1  # rows up to the first divergence condition on the same text
        kl = {k: float(kl_divergence(ra[k][None], rb[k][None])) for k in range(upto)}
        at = [k for k in res if k < upto]
        records.append({"preemptions": npre, "resumed_at": res, "first_divergence": fd,
                        "agreement": greedy_agreement(a, b),
                        "kl_resumed": [kl[k] for k in at],
                        "kl_other": [v for k, v in kl.items() if k not in at]})
    return records


def measure(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> list[dict]:
    """:func:`batch_run` on ``llm`` (whose pool should force preemption) compared with
    :func:`solo_runs` (see :func:`compare`)."""
    return compare(solo_runs(llm, prompts, params), batch_run(llm, prompts, params))


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """95 % Wilson score interval for a rate k/n."""
    if n == 0:
        return (0.0, 1.0)
    p = k / n
    d = 1 + z * z / n
    c = (p + z * z / (2 * n)) / d
    h = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / d
    return (max(0.0, c - h), min(1.0, c + h))


def summarize(records: list[dict]) -> dict:
    pre = [r for r in records if r["preemptions"] > 0]
    ctl = [r for r in records if r["preemptions"] == 0]
    k_pre = sum(r["first_divergence"] is not None for r in pre)
    k_ctl = sum(r["first_divergence"] is not None for r in ctl)
    kl_res = [x for r in pre for x in r["kl_resumed"]]
    kl_oth = [x for r in records for x in r["kl_other"]]

    def med(xs):
        return float(torch.tensor(xs).median()) if xs else None

    return {
        "requests": len(records), "preempted": len(pre),
        "preempted_diverged": k_pre, "preempted_rate_ci95": wilson(k_pre, len(pre)),
        "control_diverged": k_ctl, "control": len(ctl), "control_rate_ci95": wilson(k_ctl, len(ctl)),
        "first_divergences_preempted": [r["first_divergence"] for r in pre],
        "mean_agreement_preempted": sum(r["agreement"] for r in pre) / max(len(pre), 1),
        "kl_resumed_median": med(kl_res), "kl_resumed_max": max(kl_res) if kl_res else None,
        "kl_resumed_n": len(kl_res),
        "kl_other_median": med(kl_oth), "kl_other_max": max(kl_oth) if kl_oth else None,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=40)
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--blocks", type=int, default=6)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-model-len", type=int, default=64)
    ap.add_argument("--reference", choices=["ample", "solo"], default="ample",
                    help="ample: the same batch on an engine with room for every request "
                         "at full length (never preempts); solo: each request alone on the same engine")
    ap.add_argument("--dtypes", default="bfloat16,float16,float32")
    ap.add_argument("--modes", default="greedy,sampled")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    result = {"command": "course/ch08_preemption/measure_recompute.py " + " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "out"),
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "runs": {}}
    for dtype in args.dtypes.split(","):
        kw = dict(dtype=dtype, block_size=args.block_size, max_model_len=args.max_model_len, seed=0)
        llm = LLM(num_gpu_blocks_override=args.blocks, **kw)
        room = args.requests * -(-args.max_model_len // args.block_size)  # every request at full length
        ample = LLM(num_gpu_blocks_override=room, **kw) if args.reference == "ample" else None
        prompts = chat_prompts(llm.get_tokenizer(), args.requests)
        for mode in args.modes.split(","):
            t = time.time()
            ps = sampling(mode, args.requests, args.tokens)
            if ample is None:
                recs = measure(llm, prompts, ps)
            else:
                ref = batch_run(ample, prompts, ps)
                assert sum(ref[3]) == 0, "the reference engine preempted"
                recs = compare(ref[:2], batch_run(llm, prompts, ps))
            s = summarize(recs)
            s["seconds"] = round(time.time() - t, 1)
            result["runs"][f"{dtype}/{mode}"] = {"summary": s, "records": recs}
            print(dtype, mode, json.dumps(s), flush=True)
            if args.out:
                with open(args.out, "w") as f:
                    json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
