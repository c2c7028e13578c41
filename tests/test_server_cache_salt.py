"""``cache_salt`` over HTTP: ``minivllm serve`` as a real process, driven with the
official ``openai`` client. The hit count is read from the server's
``vllm:prefix_cache_hits_total`` counter; the expected count comes from the prompt's
length and the block size (the full blocks before the last token)."""

from __future__ import annotations

import httpx
import pytest

from tests.test_server import KEY, NAME, _start, wait_idle

openai = pytest.importorskip("openai")

BS = 16
PROMPT = list(range(3, 3 + 70))  # 70 token ids: a repeat may reuse 4 blocks (64 tokens)
WANT_HITS = (len(PROMPT) - 1) // BS * BS


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    proc, base = _start(tiny_model_dir, "--api-key", KEY, "--block-size", str(BS))
    yield base
    proc.terminate()
    proc.wait(timeout=30)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0)


def _complete(client, server, salt=None):
    """One greedy completion; returns (hit tokens it added to the server's counter, text)."""
    before = wait_idle(server).get("vllm:prefix_cache_hits_total", 0.0)
    extra = {"ignore_eos": True}
    if salt is not None:
        extra["cache_salt"] = salt
    r = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=4, temperature=0,
                                  extra_body=extra)
    after = wait_idle(server).get("vllm:prefix_cache_hits_total", 0.0)
    return after - before, r.choices[0].text


def test_salted_requests_hit_only_their_own_salt(client, server):
    n, text_a = _complete(client, server, "tenant-a")
    assert n == 0
    n, text_b = _complete(client, server, "tenant-b")
    assert n == 0, "tenant-b hit tenant-a's prefix"
    n, _ = _complete(client, server)
    assert n == 0, "an unsalted request hit a salted prefix"
    n, text_a2 = _complete(client, server, "tenant-a")
    assert n == WANT_HITS
    assert text_a == text_b == text_a2


def test_chat_cache_salt(client, server):
    msgs = [{"role": "user", "content": "a fairly long question about caches " * 6}]
    hits = []
    for salt in ("s1", "s2", "s1"):
        before = wait_idle(server).get("vllm:prefix_cache_hits_total", 0.0)
        client.chat.completions.create(model=NAME, messages=msgs, max_tokens=2, temperature=0,
                                       extra_body={"cache_salt": salt})
        hits.append(wait_idle(server).get("vllm:prefix_cache_hits_total", 0.0) - before)
    assert hits[0] == 0 and hits[1] == 0 and hits[2] > 0


@pytest.mark.parametrize("salt", [5, "", ["a"], {"a": 1}])
def test_bad_cache_salt_is_a_400(server, salt):
    for path, body in (("/v1/completions", {"prompt": PROMPT}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
        r = httpx.post(f"{server}{path}", headers={"Authorization": f"Bearer {KEY}"},
                       json={"model": NAME, "max_tokens": 2, "cache_salt": salt, **body})
        assert r.status_code == 400, r.text
        assert "cache_salt" in r.json()["error"]["message"]
        assert "non-empty string" in r.json()["error"]["message"]
    m = wait_idle(server)
    assert m["vllm:kv_cache_usage_perc"] == 0
