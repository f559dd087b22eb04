"""Split workers trust no one and drain, never cut (issue 13): real processes on loopback.

- every /internal/* route answers 401 without, or with a wrong, internal secret;
- a prefill worker sends K/V only to its caller; a decode worker calls only prefill workers it
  knows (a prefill URL in a request body is not followed);
- the decode worker's KV port sheds 1,000 idle connections and unauthenticated frames while
  serving;
- SIGTERM to a prefill and a decode worker while 8 long generations stream: all 8 complete.
"""

from __future__ import annotations

import json
import signal
import socket
import struct
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from phasesplit.runtime import internal_secret
from phasesplit.runtime.kv.wire import DATA, Header
from phasesplit.runtime.model.loader import resolve
from phasesplit.runtime.model.tokenizer import TextTokenizer
from tests.procs import INTERNAL, serve
from tests.prompts import RAW, all_prompt_ids

MODEL = "smollm2-135m-instruct"
FP32 = ("--dtype", "float32", "--max-model-len", "2048")
WRONG = {internal_secret.HEADER: "wrong-secret-of-the-right-length"}


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    logs = tmp_path_factory.mktemp("trust-logs")
    prefill = serve("prefill", logs, *FP32, "--drain-timeout", "600s")
    decode = serve("decode", logs, *FP32, "--prefill-urls", prefill.url,
                   "--prefill-timeout", "60s", "--drain-timeout", "600s")
    router = serve("router", logs, *FP32, "--prefill-urls", prefill.url, "--decode-urls", decode.url)
    procs = (prefill, decode, router)
    try:
        for p in procs:
            p.wait_ready()
        yield procs
    finally:
        for p in procs:
            p.stop()


@pytest.fixture(scope="module")
def prompts():
    return all_prompt_ids(TextTokenizer(resolve("smollm2").folder))


def complete(url: str, ids: list[int], max_tokens: int = 8) -> dict:
    body = {"model": MODEL, "prompt": ids, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    r = httpx.post(url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_internal_routes_need_the_secret(stack, prompts):
    prefill, decode, router = stack
    routes = [("POST", prefill.url + "/internal/prefill"), ("GET", prefill.url + "/internal/state"),
              ("POST", decode.url + "/internal/generate"), ("GET", decode.url + "/internal/state"),
              ("GET", router.url + "/internal/workers"),
              ("POST", prefill.url + "/internal/generate")]  # the whole requests a router lends it
    body = {"request_id": "x", "prompt_ids": prompts[0], "kv_host": "127.0.0.1", "kv_port": 1, "transfer_id": 1}
    refused = 0
    for method, url in routes:
        for hdrs in ({}, WRONG):
            r = httpx.request(method, url, json=body if method == "POST" else None, headers=hdrs, timeout=10)
            assert r.status_code == 401, (url, hdrs, r.text)
            assert r.json()["error"]["code"] == "invalid_api_key"
            refused += 1
    print(f"\n401 on {refused} internal calls ({len(routes)} routes, no or wrong secret)")
    for _, url in routes[1::2][:2] + [routes[4]]:
        assert httpx.get(url, headers=INTERNAL, timeout=10).status_code == 200
    assert complete(router.url, prompts[0])["choices"][0]["finish_reason"] == "length"


def test_prefill_sends_kv_only_to_its_caller(stack, prompts):
    prefill = stack[0]
    body = {"request_id": "ssrf", "prompt_ids": prompts[0], "kv_host": "10.1.2.3", "kv_port": 6379,
            "transfer_id": 7}
    r = httpx.post(prefill.url + "/internal/prefill", json=body, headers=INTERNAL, timeout=30)
    assert r.status_code == 403 and r.json()["error"]["param"] == "kv_host", r.text


def test_decode_follows_no_prefill_url_from_a_body(stack, prompts):
    decode = stack[1]
    trap = socket.create_server(("127.0.0.1", 0))
    hits = []
    trap.settimeout(0.2)
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            try:
                hits.append(trap.accept()[0])
            except TimeoutError:
                pass

    t = threading.Thread(target=watch, daemon=True)
    t.start()
    try:
        call = {"request_id": "ssrf-2", "prompt_ids": prompts[1], "params": {"max_tokens": 4, "temperature": 0},
                "prefill_urls": [f"http://127.0.0.1:{trap.getsockname()[1]}"]}
        with httpx.stream("POST", decode.url + "/internal/generate", json=call, headers=INTERNAL, timeout=60) as r:
            lines = [json.loads(x) for x in r.iter_lines() if x]
        assert lines and lines[-1]["finished"] and lines[-1]["finish_reason"] == "length", lines[-1:]
    finally:
        stop.set()
        t.join()
        trap.close()
    assert hits == [], "the decode worker connected to a prefill URL it does not know"


def test_kv_port_sheds_hostile_connections_while_serving(stack, prompts):
    prefill, decode, router = stack
    st = httpx.get(decode.url + "/internal/state", headers=INTERNAL).json()
    kv_port, refused0 = st["kv_port"], st["kv_refused"]
    expected = complete(router.url, prompts[2])["choices"][0]["text"]
    # An unauthenticated frame claiming ~2 GB for a guessed transfer id.
    h = Header(DATA, 0x1234_5678_9ABC, 0, 0, 1 << 22, 3, 64, dtype=1, payload_len=2 * (1 << 22) * 3 * 64 * 4)
    socks = []
    t0 = time.monotonic()
    with ThreadPoolExecutor(1) as pool:
        fut = pool.submit(complete, router.url, prompts[2])
        with socket.create_connection(("127.0.0.1", kv_port)) as s:
            s.sendall(h.pack() + struct.pack("<f", 1.0) * 16)
        for _ in range(1000):
            s = socket.socket()
            s.connect(("127.0.0.1", kv_port))
            socks.append(s)
        assert fut.result()["choices"][0]["text"] == expected
    try:
        closed = 0
        for s in socks:
            s.settimeout(15)
            try:
                while s.recv(4096):
                    pass
                closed += 1
            except ConnectionResetError:
                closed += 1
            except TimeoutError:
                pass
    finally:
        for s in socks:
            s.close()
    st = httpx.get(decode.url + "/internal/state", headers=INTERNAL).json()
    print(f"\nKV port: {closed} of 1000 idle connections closed in {time.monotonic() - t0:.1f}s, "
          f"refused {st['kv_refused'] - refused0}, open {st['kv_connections']}")
    assert closed == 1000
    assert st["kv_refused"] - refused0 >= 1001
    assert complete(router.url, prompts[2])["choices"][0]["text"] == expected


def _stream(url: str, ids: list[int], max_tokens: int, first: threading.Event, out: dict) -> None:
    body = {"model": MODEL, "prompt": ids, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    tokens, finish, errors = 0, None, []
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as r:
        out["status"] = r.status_code
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            d = json.loads(line[6:])
            if "error" in d:
                errors.append(d["error"])
                continue
            c = d["choices"][0]
            if c.get("text"):
                tokens += 1
                first.set()
            finish = c.get("finish_reason") or finish
    out.update(tokens=tokens, finish=finish, errors=errors)


def test_sigterm_drains_prefill_and_decode_workers(stack, prompts):
    """Last in the module: it stops the workers."""
    prefill, decode, router = stack
    # 64 tokens at batch 8 take well over uvicorn's old 5 s shutdown grace here (~1-5 tokens/s
    # per stream on the shared 2-core machine).
    n, max_tokens = 8, 64
    long_prompt = TextTokenizer(resolve("smollm2").folder).encode(RAW[2])
    ids = [long_prompt[: 300 + 20 * i] for i in range(n)]  # distinct: no prefix-cache shortcut
    outs: list[dict] = [{} for _ in range(n)]
    firsts = [threading.Event() for _ in range(n)]
    threads = [threading.Thread(target=_stream, args=(router.url, ids[i], max_tokens, firsts[i], outs[i]))
               for i in range(n)]
    for t in threads:
        t.start()
    # SIGTERM the prefill worker while it holds prompts.
    deadline = time.monotonic() + 60
    while True:
        st = httpx.get(prefill.url + "/internal/state", headers=INTERNAL, timeout=5).json()
        if st["running"] + st["waiting"] > 0:
            break
        assert time.monotonic() < deadline, "the prefill worker never got the prompts"
        time.sleep(0.02)
    t_prefill = time.monotonic()
    prefill.p.send_signal(signal.SIGTERM)
    r = httpx.get(prefill.url + "/ready", timeout=5)
    assert r.status_code == 503 and r.json()["reason"] == "draining"
    # SIGTERM the decode worker once every stream has its first token.
    for e in firsts:
        assert e.wait(120), "a stream never started"
    t_decode = time.monotonic()
    decode.p.send_signal(signal.SIGTERM)
    r = httpx.get(decode.url + "/ready", timeout=5)
    assert r.status_code == 503 and r.json()["reason"] == "draining"
    # New work is refused while the held streams go on.
    r = httpx.post(decode.url + "/internal/generate", headers=INTERNAL, timeout=10,
                   json={"request_id": "late", "prompt_ids": ids[0], "params": {"max_tokens": 2}})
    assert r.status_code == 503
    for t in threads:
        t.join(600)
    prefill_rc = prefill.p.wait(60)
    decode_rc = decode.p.wait(60)
    t_end = time.monotonic()
    done = sum(o.get("finish") == "length" and o["tokens"] == max_tokens and not o["errors"] for o in outs)
    print(f"\ndrain: {done}/{n} streams of {max_tokens} tokens completed; prefill exited {prefill_rc} "
          f"{t_end - t_prefill:.1f}s after SIGTERM at the latest, decode exited {decode_rc} "
          f"{t_end - t_decode:.1f}s after SIGTERM at the latest")
    # A prefill that arrived after SIGTERM is refused (503) and redone locally by the decode
    # worker (policy retry-local); one the prefill worker had taken must not be cut. Once the
    # prefill worker has drained and exited, a call finds no listener (httpx's ConnectError):
    # refused too, since nothing was taken (CI saw it when the drain ended before the last prompt).
    refused = ("HTTP 503", "All connection attempts failed")
    failed = [x for x in decode.tail(200_000).splitlines() if "remote prefill of" in x and "failed" in x]
    cut = [x for x in failed if not any(r in x for r in refused)]
    print(f"prefills refused while draining: {len(failed) - len(cut)}, cut: {len(cut)}")
    assert done == n, outs
    assert cut == [], cut[:3]
    assert prefill_rc == 0 and decode_rc == 0
    assert "drained" in prefill.tail() and "drained" in decode.tail()
