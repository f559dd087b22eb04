"""The colocated server as a real process: OpenAI SDK compatibility, errors, aborts, metrics."""

from __future__ import annotations

import json
import re
import socket
import time

import httpx
import pytest

from phasesplit.runtime import metric_names as names
from tests.procs import serve

MODEL = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    proc = serve("both", tmp_path_factory.mktemp("logs"), "--dtype", "float32", "--max-model-len", "2048")
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.stop()


def metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics").text
    values = [float(m.group(1)) for m in re.finditer(rf"^{name}{{[^}}]*}} (\S+)$", text, re.M)]
    assert values, f"{name} not exported"
    return sum(values)


def state(url: str) -> dict:
    return httpx.get(url + "/debug/state").json()


def test_openai_sdk_chat_and_completions(server):
    from openai import OpenAI

    client = OpenAI(base_url=server.url + "/v1", api_key="unused")
    assert [m.id for m in client.models.list().data] == [MODEL, "smollm2"]  # the --model value is an alias
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Capital of France?"}],
                                          max_tokens=12, temperature=0)
    assert chat.choices[0].message.content and chat.usage.completion_tokens <= 12
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Capital of France?"}],
                                            max_tokens=12, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == chat.choices[0].message.content, "streaming must give the same text"
    assert chunks[-1].usage.completion_tokens == chat.usage.completion_tokens
    comp = client.completions.create(model=MODEL, prompt="The quick brown fox", max_tokens=8, temperature=0)
    assert comp.choices[0].finish_reason == "length" and comp.usage.completion_tokens == 8
    parts = list(client.completions.create(model=MODEL, prompt="The quick brown fox", max_tokens=8,
                                           temperature=0, stream=True))
    assert "".join(p.choices[0].text for p in parts) == comp.choices[0].text


def test_seed_gives_same_output(server):
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 16, "temperature": 0.9, "seed": 1234}
    a = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
    b = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
    assert a == b


def test_stop_string_ends_output(server):
    body = {"model": MODEL, "prompt": "1, 2, 3, 4, 5,", "max_tokens": 30, "temperature": 0, "stop": [" 8"]}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()
    assert " 8" not in r["choices"][0]["text"] and r["choices"][0]["finish_reason"] == "stop"


BAD = [
    ("malformed json", b"{not json", 400),
    ("unknown model", {"model": "nope", "prompt": "hi"}, 404),
    ("max_tokens < 1", {"model": MODEL, "prompt": "hi", "max_tokens": 0}, 400),
    ("temperature < 0", {"model": MODEL, "prompt": "hi", "temperature": -1}, 400),
    ("prompt longer than context", {"model": MODEL, "prompt": "word " * 3000, "max_tokens": 4}, 400),
    ("empty prompt", {"model": MODEL, "prompt": ""}, 400),
    ("missing prompt", {"model": MODEL}, 400),
]


@pytest.mark.parametrize(("what", "body", "status"), BAD, ids=[b[0] for b in BAD])
def test_bad_completion_inputs_get_openai_errors(server, what, body, status):
    kw = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes) \
        else {"json": body}
    r = httpx.post(server.url + "/v1/completions", timeout=30, **kw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and err["type"] and "param" in err and "code" in err
    assert httpx.get(server.url + "/health").status_code == 200


def test_bad_chat_inputs(server):
    r = httpx.post(server.url + "/v1/chat/completions", json={"model": MODEL, "messages": []})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    r = httpx.post(server.url + "/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user"}],
                                                              "max_tokens": -3})
    assert r.status_code == 400 and "max_tokens" in r.json()["error"]["message"]


def test_disconnect_mid_stream_frees_blocks(server):
    host, port = server.url.removeprefix("http://").split(":")
    body = json.dumps({"model": MODEL, "prompt": "Tell me a long story.", "max_tokens": 1500,
                       "ignore_eos": True, "stream": True}).encode()
    with socket.create_connection((host, int(port))) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n" % len(body) + body)
        seen = b""
        while seen.count(b"data:") < 3:
            seen += s.recv(4096)
        assert state(server.url)["allocated_blocks"] > 0
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and state(server.url)["allocated_blocks"]:
        time.sleep(0.1)
    st = state(server.url)
    assert st["allocated_blocks"] == 0 and st["requests"] == 0, st
    assert metric(server.url, names.KV_USAGE) == 0


def test_prefix_cache_hits_and_same_output(server):
    prefix = "You are a careful assistant. " + " ".join(f"Rule {i}: be precise about item {i}." for i in range(30))
    body = {"model": MODEL, "prompt": prefix + " Question: what is rule 3?", "max_tokens": 16, "temperature": 0}
    hits0 = metric(server.url, names.PREFIX_HITS)
    first = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()
    hits1 = metric(server.url, names.PREFIX_HITS)
    second = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()
    hits2 = metric(server.url, names.PREFIX_HITS)
    assert hits2 - hits1 >= 200, (hits0, hits1, hits2)
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= 200
    assert second["choices"][0]["text"] == first["choices"][0]["text"]


def test_metrics_names(server):
    text = httpx.get(server.url + "/metrics").text
    # Every name the operator may read is exported, histograms with their buckets.
    for name in [*(h + "_bucket" for h in names.HISTOGRAMS), *names.COUNTERS, *names.GAUGES]:
        assert re.search(rf'^{name}{{.*model="{MODEL}".*phase="both"', text, re.M), name
    # The router's own (held queue, lending) are not a worker's: a sum over phases counts them once.
    for name in [*names.ROUTER_GAUGES, *names.ROUTER_HISTOGRAMS, *names.ROUTER_COUNTERS]:
        assert not re.search(rf"^{name}", text, re.M), name


def test_last_chunk_reports_where_time_went(server):
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0, "stream": True}
    chunks = []
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert all("phasesplit_timing" not in c for c in chunks[:-1])
    t = chunks[-1]["phasesplit_timing"]
    assert set(t) == {"queued_s", "prefill_s", "decode_s"} and all(v >= 0 for v in t.values())
    assert t["decode_s"] > 0
