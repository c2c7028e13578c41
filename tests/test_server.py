"""``minivllm serve`` as a real process on localhost, driven with the official ``openai``
client and raw HTTP: completions, chat, streaming, logprobs, stop strings, every error
status, /metrics moving as requests run, malformed bodies, client disconnects.

Expected texts come from the offline engine (``LLM.generate``/``LLM.chat``) on the same
tiny model and greedy parameters, not from the server itself.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import httpx
import pytest

from minivllm import LLM, SamplingParams

openai = pytest.importorskip("openai")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

KEY = "test-key"
NAME = "tiny"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(model_dir, *extra) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    cmd = [sys.executable, "-m", "minivllm.entrypoints.cli", "serve", str(model_dir),
           "--port", str(port), "--dtype", "float32", "--max-model-len", "512",
           "--served-model-name", NAME, "--disable-log-stats", *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited: {proc.stdout.read()[-3000:]}")
        try:
            if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            pass
        time.sleep(0.2)  # waiting for a process to come up, not timing anything
    proc.kill()
    raise RuntimeError("server did not become healthy in 120 s")


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    proc, base = _start(tiny_model_dir, "--api-key", KEY)
    yield base
    proc.terminate()
    proc.wait(timeout=30)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def offline(tiny_model_dir):
    return LLM(model=str(tiny_model_dir), dtype="float32", max_model_len=512)


PROMPT = "The quick brown fox"
CHAT = [{"role": "user", "content": "Paged attention stores keys"}]


def metrics(base) -> dict[str, float]:
    """name{labels} -> value, from /metrics."""
    out = {}
    for fam in text_string_to_metric_families(httpx.get(f"{base}/metrics").text):
        for s in fam.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items())
                              if k != "model_name")
            out[s.name + (f"{{{labels}}}" if labels else "")] = s.value
    return out


def wait_idle(base, timeout=30.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(base)
        if m["vllm:num_requests_running"] == 0 and m["vllm:kv_cache_usage_perc"] == 0:
            return m
        if time.monotonic() > deadline:
            raise AssertionError(f"server not idle after {timeout} s: {m}")
        time.sleep(0.1)


def test_completion_matches_offline_engine(client, offline):
    want = offline.generate([PROMPT], SamplingParams(temperature=0, max_tokens=12,
                                                      ignore_eos=True))[0].outputs[0]
    r = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=12, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].text == want.text
    assert r.usage.completion_tokens == 12 and r.choices[0].finish_reason == "length"


def test_chat_matches_offline_engine(client, offline):
    want = offline.chat(CHAT, SamplingParams(temperature=0, max_tokens=10))[0].outputs[0]
    r = client.chat.completions.create(model=NAME, messages=CHAT, max_tokens=10, temperature=0)
    assert r.choices[0].message.content == want.text
    assert r.choices[0].message.role == "assistant"


def test_streaming_equals_non_streaming(client):
    kw = dict(model=NAME, max_tokens=14, temperature=0, extra_body={"ignore_eos": True})
    full = client.completions.create(prompt=PROMPT, **kw).choices[0].text
    chunks = list(client.completions.create(prompt=PROMPT, stream=True,
                                            stream_options={"include_usage": True}, **kw))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 14
    full_chat = client.chat.completions.create(messages=CHAT, **kw).choices[0].message.content
    deltas = [c.choices[0].delta.content or "" for c in
              client.chat.completions.create(messages=CHAT, stream=True, **kw) if c.choices]
    assert "".join(deltas) == full_chat


def test_logprobs(client, offline):
    want = offline.generate([PROMPT], SamplingParams(temperature=0, max_tokens=5,
                                                      ignore_eos=True, logprobs=2))[0].outputs[0]
    r = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=5, temperature=0,
                                  logprobs=2, extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    expected = [d[t].logprob for d, t in zip(want.logprobs, want.token_ids)]
    assert lp.token_logprobs == pytest.approx(expected, abs=1e-5)
    assert all(len(top) >= 2 for top in lp.top_logprobs)
    c = client.chat.completions.create(model=NAME, messages=CHAT, max_tokens=4, temperature=0,
                                       logprobs=True, top_logprobs=3)
    content = c.choices[0].logprobs.content
    assert len(content) == 4 and all(len(x.top_logprobs) == 3 for x in content)
    assert all(x.top_logprobs[0].logprob >= x.logprob - 1e-6 for x in content)


def test_streamed_logprobs_equal_non_streamed(client):
    """Chunks carry the log-probs of their own tokens, and each chunk's text offsets start
    where the text sent before it ends: joined, they equal the one-shot response."""
    kw = dict(model=NAME, prompt=PROMPT, max_tokens=12, temperature=0, logprobs=1,
              extra_body={"ignore_eos": True})
    full = client.completions.create(**kw).choices[0].logprobs
    chunks = [c.choices[0] for c in client.completions.create(stream=True, **kw) if c.choices]
    got = [lp for ch in chunks for lp in ch.logprobs.token_logprobs]
    assert got == pytest.approx(full.token_logprobs, abs=1e-6)
    assert [t for ch in chunks for t in ch.logprobs.tokens] == full.tokens
    assert [o for ch in chunks for o in ch.logprobs.text_offset] == full.text_offset


def test_stop_string(client, offline):
    base = offline.generate([PROMPT], SamplingParams(temperature=0, max_tokens=16,
                                                      ignore_eos=True))[0].outputs[0].text
    stop = base[len(base) // 2:len(base) // 2 + 3]
    assert stop.strip(), base
    want = base[:base.index(stop)]
    for stream in (False, True):
        r = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=16, temperature=0,
                                      stop=[stop], stream=stream,
                                      extra_body={"ignore_eos": True})
        if stream:
            parts = [c for c in r if c.choices]
            text = "".join(c.choices[0].text for c in parts)
            reason = parts[-1].choices[0].finish_reason
        else:
            text, reason = r.choices[0].text, r.choices[0].finish_reason
        assert text == want and reason == "stop", (stream, text, want)


@pytest.mark.parametrize("case,status", [
    ("negative temperature", 400), ("prompt over max_model_len", 400),
    ("unknown model", 404), ("missing key", 401), ("wrong key", 401)])
def test_errors(server, case, status):
    headers = {"Authorization": f"Bearer {KEY}"}
    body = {"model": NAME, "prompt": PROMPT, "max_tokens": 4}
    if case == "negative temperature":
        body["temperature"] = -1.0
    elif case == "prompt over max_model_len":
        body["prompt"] = [5] * 600
    elif case == "unknown model":
        body["model"] = "gpt-5"
    elif case == "missing key":
        headers = {}
    else:
        headers = {"Authorization": "Bearer nope"}
    r = httpx.post(f"{server}/v1/completions", json=body, headers=headers)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == status and err["message"]
    if case == "prompt over max_model_len":
        assert "600" in err["message"] and "512" in err["message"], err["message"]
    if case == "negative temperature":
        assert "temperature" in err["message"]


def test_queue_limit_gives_503(tiny_model_dir):
    proc, base = _start(tiny_model_dir, "--max-waiting-requests", "0")
    try:
        r = httpx.post(f"{base}/v1/completions", json={"model": NAME, "prompt": PROMPT})
        assert r.status_code == 503 and "waiting" in r.json()["error"]["message"]
        assert httpx.get(f"{base}/health").status_code == 200
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_metrics_move(server, client):
    before = wait_idle(server)
    client.completions.create(model=NAME, prompt=PROMPT, max_tokens=7, temperature=0,
                              extra_body={"ignore_eos": True})
    after = wait_idle(server)
    assert after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"] == 7
    assert after["vllm:prompt_tokens_total"] > before["vllm:prompt_tokens_total"]
    key = "vllm:request_success_total{finished_reason=length}"
    assert after[key] - before.get(key, 0) == 1
    assert after["vllm:e2e_request_latency_seconds_count"] \
        == before["vllm:e2e_request_latency_seconds_count"] + 1
    assert after["vllm:time_to_first_token_seconds_count"] > \
        before["vllm:time_to_first_token_seconds_count"]
    for name in ("vllm:num_requests_waiting", "vllm:num_preemptions_total",
                 "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
                 "vllm:inter_token_latency_seconds_count", "vllm:corrupted_requests_total"):
        assert name in after, name


def test_disconnect_aborts_and_frees_blocks(server):
    before = wait_idle(server)
    body = {"model": NAME, "prompt": PROMPT, "max_tokens": 480, "stream": True,
            "ignore_eos": True, "temperature": 0}
    with httpx.stream("POST", f"{server}/v1/completions", json=body,
                      headers={"Authorization": f"Bearer {KEY}"}) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(4)]
    assert any(line.startswith("data: ") for line in got)
    after = wait_idle(server)
    key = "vllm:request_success_total{finished_reason=abort}"
    assert after.get(key, 0) - before.get(key, 0) == 1
    assert httpx.get(f"{server}/health").status_code == 200


MALFORMED = {
    "not json": b"{not json",
    "invalid utf-8": b'{"model": "tiny", "prompt": "\xff\xfe"}',
    "wrong type": json.dumps({"model": NAME, "prompt": PROMPT, "max_tokens": "many"}).encode(),
    "missing prompt": json.dumps({"model": NAME}).encode(),
    "huge max_tokens": json.dumps({"model": NAME, "prompt": PROMPT,
                                   "max_tokens": 10 ** 30}).encode(),
    "huge temperature": json.dumps({"model": NAME, "prompt": PROMPT,
                                    "temperature": 1e308 * 10}).encode(),
    "empty prompt": json.dumps({"model": NAME, "prompt": ""}).encode(),
    "token id out of vocab": json.dumps({"model": NAME, "prompt": [10 ** 9]}).encode(),
    "negative token id": json.dumps({"model": NAME, "prompt": [-1]}).encode(),
    "unknown field": json.dumps({"model": NAME, "prompt": PROMPT, "tempreature": 0}).encode(),
    "array body": b"[]",
    "n=2": json.dumps({"model": NAME, "prompt": PROMPT, "n": 2}).encode(),
}
MALFORMED_CHAT = {
    "empty messages": {"model": NAME, "messages": []},
    "message without content": {"model": NAME, "messages": [{"role": "user"}]},
    "bad role": {"model": NAME, "messages": [{"role": "robot", "content": "hi"}]},
    "image part": {"model": NAME, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]},
    "both max tokens": {"model": NAME, "messages": CHAT, "max_tokens": 2,
                        "max_completion_tokens": 2},
    "top_logprobs without logprobs": {"model": NAME, "messages": CHAT, "top_logprobs": 2},
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_completion_bodies_are_400(server, case):
    r = httpx.post(f"{server}/v1/completions", content=MALFORMED[case],
                   headers={"Authorization": f"Bearer {KEY}",
                            "Content-Type": "application/json"})
    assert r.status_code == 400, (case, r.status_code, r.text)
    assert r.json()["error"]["message"]


@pytest.mark.parametrize("case", list(MALFORMED_CHAT))
def test_malformed_chat_bodies_are_400(server, case):
    r = httpx.post(f"{server}/v1/chat/completions", json=MALFORMED_CHAT[case],
                   headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 400, (case, r.status_code, r.text)


def test_models_tokenize_detokenize_version(server, client, offline):
    assert [m.id for m in client.models.list().data] == [NAME]
    ids = httpx.post(f"{server}/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    assert ids == offline.get_tokenizer().encode(PROMPT)
    text = httpx.post(f"{server}/detokenize", json={"tokens": ids}).json()["prompt"]
    assert text == offline.get_tokenizer().decode(ids)
    assert httpx.post(f"{server}/detokenize", json={"tokens": [10 ** 9]}).status_code == 400
    assert "version" in httpx.get(f"{server}/version").json()


def test_load_64_streams_with_disconnects(server, offline, tiny_hf_model):
    """64 concurrent streaming requests; every 4th client leaves after 3 chunks. The rest
    finish with the text each prompt gives when run alone; afterwards no request runs,
    the KV cache is empty and the server is healthy."""
    import asyncio

    import torch

    g = torch.Generator().manual_seed(21)
    vocab = tiny_hf_model.config.vocab_size
    prompts = [torch.randint(3, vocab, (int(n),), generator=g).tolist()
               for n in torch.randint(4, 40, (64,), generator=g)]
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    alone = [offline.generate([p], sp, use_tqdm=False)[0].outputs[0].text for p in prompts]
    before = wait_idle(server)

    async def one(http, i):
        leaves = i % 4 == 0  # asks for many tokens, so it is still running when it leaves
        body = {"model": NAME, "prompt": prompts[i], "max_tokens": 400 if leaves else 24,
                "temperature": 0, "ignore_eos": True, "stream": True}
        text, n = "", 0
        async with http.stream("POST", f"{server}/v1/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                n += 1
                text += json.loads(line[6:])["choices"][0]["text"]
                if leaves and n == 3:
                    return None  # leave mid-stream: the server must abort the request
        return text

    async def main():
        async with httpx.AsyncClient(headers={"Authorization": f"Bearer {KEY}"},
                                     timeout=120) as http:
            return await asyncio.gather(*(one(http, i) for i in range(64)))

    texts = asyncio.run(main())
    for i, (got, want) in enumerate(zip(texts, alone)):
        if i % 4:
            assert got == want, f"request {i}: {got!r} != alone {want!r}"
    after = wait_idle(server)
    assert after["vllm:num_requests_waiting"] == 0
    done = "vllm:request_success_total{finished_reason=length}"
    aborted = "vllm:request_success_total{finished_reason=abort}"
    assert after[done] - before.get(done, 0) == 48
    assert after[aborted] - before.get(aborted, 0) == 16
    assert httpx.get(f"{server}/health").status_code == 200


def test_bench_serve_reports(server):
    """``minivllm bench serve`` against the live server: every request completes, and
    the JSON line's numbers are consistent with what was asked."""
    out = subprocess.run(
        [sys.executable, "-m", "minivllm.entrypoints.cli", "bench", "serve", "--base-url",
         server, "--model", NAME, "--api-key", KEY, "--num-prompts", "8", "--input-len", "6",
         "--output-len", "5", "--max-concurrency", "4"],
        capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "| TTFT |" in out.stdout
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["completed"] == 8 and res["failed"] == 0
    assert res["output_throughput"] * res["duration_s"] == pytest.approx(8 * 5, rel=1e-6)
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        s = res[key]
        assert 0 < s["median"] <= s["p99"], (key, s)
    assert res["ttft_ms"]["mean"] <= res["e2e_ms"]["mean"]


def test_non_streaming_disconnect_aborts(server):
    """A non-streaming client that sends its request and hangs up aborts the request;
    its blocks come back."""
    before = wait_idle(server)
    body = json.dumps({"model": NAME, "prompt": PROMPT, "max_tokens": 480,
                       "ignore_eos": True, "temperature": 0}).encode()
    host, port = server.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                     b"Content-Type: application/json\r\nAuthorization: Bearer " + KEY.encode()
                     + b"\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    key = "vllm:request_success_total{finished_reason=abort}"
    deadline = time.monotonic() + 30
    while metrics(server).get(key, 0) - before.get(key, 0) < 1:  # the server is async
        assert time.monotonic() < deadline, "the abort was never counted"
        time.sleep(0.05)
    after = wait_idle(server)
    assert after.get(key, 0) - before.get(key, 0) == 1


def test_precision_monitor_gauges_move_under_a_hotter_sampling_over_http(tiny_model_dir):
    """The drift monitor inside a real server (--precision-monitor): a stream at
    temperature 0.7 sets the baseline and raises no alarm; the same prompts at 1.6 (the
    planted regression, a hotter default as in lm-evaluation-harness #3154) raise it,
    and /metrics shows it."""
    proc, base = _start(tiny_model_dir, "--precision-monitor", '{"warmup": 20}')
    try:
        http = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)

        def send(temperature, n, offset):
            for i in range(n):
                http.completions.create(model=NAME, prompt=f"{PROMPT} {i + offset}",
                                        max_tokens=8, temperature=temperature, seed=i,
                                        extra_body={"ignore_eos": True})

        send(0.7, 40, 0)
        m = wait_idle(base)
        assert m["minivllm:precision_monitor_requests"] == 40
        assert m["minivllm:precision_monitor_alarm"] == 0
        assert m["minivllm:precision_monitor_sampled_logprob"] < 0
        for k in range(4):  # up to 40 more requests, 10 at a time
            send(1.6, 10, 100 + 10 * k)
            m = wait_idle(base)
            if m["minivllm:precision_monitor_alarm"] == 1:
                break
        print("monitor gauges:", {k: v for k, v in m.items() if k.startswith("minivllm:")})
        assert m["minivllm:precision_monitor_alarm"] == 1
        assert m["minivllm:precision_monitor_score"] > 12
    finally:
        proc.terminate()
        proc.wait(timeout=30)
