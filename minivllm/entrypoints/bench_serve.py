"""``minivllm bench serve``: load a running OpenAI-compatible server and measure latency.

vLLM: ``vllm bench serve`` (``vllm/benchmarks/serve.py``). Sends ``--num-prompts``
streaming ``/v1/completions`` requests of ``--input-len`` random token ids each, asking
for exactly ``--output-len`` tokens (``ignore_eos``), either with at most
``--max-concurrency`` in flight or arriving as a Poisson process at ``--request-rate``
per second (both may be given). Per request it records:

* TTFT: time to the first streamed token;
* ITL: the gaps between streamed chunks (one per engine step);
* TPOT: (e2e - TTFT) / (output tokens - 1), time per output token after the first;
* e2e: send to last byte.

Prints a table (mean, median, p99 of each, in ms) and throughput, and as its last line
one JSON object with the same numbers.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from dataclasses import dataclass, field
from typing import Optional


@dataclass
class RequestResult:
    ok: bool
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list = field(default_factory=list)
    output_tokens: int = 0
    error: str = ""


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    k = min(len(s) - 1, max(0, int(round(q / 100 * (len(s) - 1)))))
    return s[k]


async def _one(http, url: str, body: dict) -> RequestResult:
    start = time.perf_counter()
    res = RequestResult(ok=False)
    last = None
    try:
        async with http.stream("POST", url, json=body) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread()).decode()[:200]}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    res.error = str(chunk["error"])
                    return res
                if not chunk.get("choices"):
                    usage = chunk.get("usage")
                    if usage:
                        res.output_tokens = usage["completion_tokens"]
                    continue
                now = time.perf_counter()
                if last is None:
                    res.ttft = now - start
                else:
                    res.itl.append(now - last)
                last = now
        res.e2e = time.perf_counter() - start
        res.ok = True
    except Exception as e:  # network errors count as failed requests
        res.error = f"{type(e).__name__}: {e}"
    return res


async def run(base_url: str, model: str, num_prompts: int, input_len: int, output_len: int,
              max_concurrency: Optional[int], request_rate: Optional[float],
              api_key: Optional[str], seed: int, vocab_size: int) -> dict:
    import httpx

    rng = random.Random(seed)
    prompts = [[rng.randrange(3, vocab_size) for _ in range(input_len)]
               for _ in range(num_prompts)]
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    url = f"{base_url.rstrip('/')}/v1/completions"
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    limits = httpx.Limits(max_connections=max_concurrency or num_prompts)

    async with httpx.AsyncClient(headers=headers, timeout=None, limits=limits) as http:
        async def task(p):
            body = {"model": model, "prompt": p, "max_tokens": output_len, "temperature": 0,
                    "ignore_eos": True, "stream": True,
                    "stream_options": {"include_usage": True}}
            if sem is None:
                return await _one(http, url, body)
            async with sem:
                return await _one(http, url, body)

        start = time.perf_counter()
        tasks = []
        for p in prompts:
            tasks.append(asyncio.create_task(task(p)))
            if request_rate:
                await asyncio.sleep(rng.expovariate(request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)

    def stats(values):
        ms = [v * 1e3 for v in values]
        return {"mean": statistics.fmean(ms) if ms else float("nan"),
                "median": statistics.median(ms) if ms else float("nan"), "p99": _pct(ms, 99)}

    tpot = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    return {
        "num_prompts": num_prompts, "completed": len(ok), "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:3],
        "input_len": input_len, "output_len": output_len, "max_concurrency": max_concurrency,
        "request_rate": request_rate, "duration_s": duration,
        "request_throughput": len(ok) / duration, "output_throughput": out_tokens / duration,
        "total_token_throughput": (out_tokens + len(ok) * input_len) / duration,
        "ttft_ms": stats([r.ttft for r in ok]), "tpot_ms": stats(tpot),
        "itl_ms": stats([x for r in ok for x in r.itl]), "e2e_ms": stats([r.e2e for r in ok]),
    }


def print_report(res: dict) -> None:
    print(f"requests: {res['completed']} completed, {res['failed']} failed in "
          f"{res['duration_s']:.2f} s; {res['request_throughput']:.2f} req/s, output "
          f"{res['output_throughput']:.1f} tok/s, total {res['total_token_throughput']:.1f} tok/s")
    if res["errors"]:
        print("errors:", *res["errors"], sep="\n  ")
    print("| metric (ms) | mean | median | p99 |\n|---|---|---|---|")
    for key, label in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"),
                       ("e2e_ms", "E2E latency")):
        s = res[key]
        print(f"| {label} | {s['mean']:.1f} | {s['median']:.1f} | {s['p99']:.1f} |")
    print(json.dumps(res))


def add_parser(sub) -> None:
    b = sub.add_parser("bench", help="benchmarks (bench serve: load a running server)")
    bsub = b.add_subparsers(dest="bench_command", required=True)
    s = bsub.add_parser("serve", help="latency and throughput of a running server")
    s.add_argument("--base-url", default="http://127.0.0.1:8000")
    s.add_argument("--model", required=True, help="the served model name")
    s.add_argument("--num-prompts", type=int, default=64)
    s.add_argument("--input-len", type=int, default=128, help="prompt tokens (random ids)")
    s.add_argument("--output-len", type=int, default=64, help="tokens to generate (exactly)")
    s.add_argument("--max-concurrency", type=int, default=None)
    s.add_argument("--request-rate", type=float, default=None,
                   help="Poisson arrivals per second (default: all at once)")
    s.add_argument("--api-key", default=None)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--vocab-size", type=int, default=None,
                   help="random ids below this (default: the server's, from /v1/models)")
    s.set_defaults(func=cmd_bench_serve)


def _server_vocab(base_url: str, model: str, api_key: Optional[str]) -> int:
    """The served model's vocabulary size (minivllm's /v1/models lists it)."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    r = httpx.get(f"{base_url.rstrip('/')}/v1/models", headers=headers, timeout=30)
    r.raise_for_status()
    for m in r.json()["data"]:
        if m["id"] == model and "vocab_size" in m:
            return int(m["vocab_size"])
    raise ValueError(f"the server does not list model {model!r} with a vocab_size; "
                     "pass --vocab-size")


def cmd_bench_serve(ns: argparse.Namespace) -> int:
    for name in ("num_prompts", "input_len", "output_len"):
        if getattr(ns, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    if ns.max_concurrency is not None and ns.max_concurrency < 1:
        raise ValueError("--max-concurrency must be >= 1")
    if ns.request_rate is not None and not ns.request_rate > 0:
        raise ValueError("--request-rate must be > 0")
    vocab = ns.vocab_size or _server_vocab(ns.base_url, ns.model, ns.api_key)
    res = asyncio.run(run(ns.base_url, ns.model, ns.num_prompts, ns.input_len, ns.output_len,
                          ns.max_concurrency, ns.request_rate, ns.api_key, ns.seed, vocab))
    print_report(res)
    return 0 if res["failed"] == 0 else 1
