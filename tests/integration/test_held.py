"""The router's held queue with real processes on loopback (issue 15): a request that finds no
worker waits at the router until one comes up, bounded in number (429) and time (503 with
Retry-After), and leaves the queue when its client goes away."""

from __future__ import annotations

import re
import threading
import time

import httpx
import pytest

from phasesplit.runtime import metric_names as names
from tests.procs import free_port, serve

MODEL = "smollm2-135m-instruct"
FP32 = ("--dtype", "float32", "--max-model-len", "512")
BODY = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def logs(tmp_path_factory):
    return tmp_path_factory.mktemp("held-logs")


def router_without_workers(logs, *flags: str, prefill: bool = False):
    """A router whose workers (on ports nothing listens on yet) are all down; its ports."""
    decode_port, prefill_port = free_port(), free_port()
    extra = ["--decode-urls", f"http://127.0.0.1:{decode_port}"]
    if prefill:
        extra += ["--prefill-urls", f"http://127.0.0.1:{prefill_port}", "--hold-for-prefill"]
    router = serve("router", logs, *FP32, *extra, *flags)
    router.wait_ready()  # ready with no worker: it can hold requests
    return router, decode_port, prefill_port


def held(url: str) -> float:
    for line in httpx.get(url + "/metrics", timeout=5).text.splitlines():
        if line.startswith(names.HELD + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{names.HELD} is not on the router's /metrics")


def held_wait_count(url: str) -> float:
    for line in httpx.get(url + "/metrics", timeout=5).text.splitlines():
        if line.startswith(names.HELD_WAIT + "_count{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{names.HELD_WAIT} is not on the router's /metrics")


def wait_for(what: str, probe, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = probe()
        if got:
            return got
        time.sleep(0.2)
    pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}")


def send_in_thread(url: str, body: dict, out: dict, timeout: float = 600.0) -> threading.Thread:
    def run() -> None:
        t0 = time.monotonic()
        try:
            out["response"] = httpx.post(url + "/v1/completions", json=body, timeout=timeout)
        except httpx.HTTPError as e:
            out["error"] = e
        out["seconds"] = time.monotonic() - t0

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_the_router_exports_its_own_metrics(logs):
    """The router-only names (held queue, lending) are on the router's /metrics from the start,
    labelled phase="router", before any request: dashboards and the planner find them at zero."""
    router, _, _ = router_without_workers(logs)
    try:
        text = httpx.get(router.url + "/metrics", timeout=5).text
        for name in [*names.ROUTER_GAUGES, *(h + "_bucket" for h in names.ROUTER_HISTOGRAMS), *names.ROUTER_COUNTERS]:
            assert re.search(rf'^{name}{{.*model="{MODEL}".*phase="router"', text, re.M), name
    finally:
        router.stop()


def test_request_held_until_the_workers_come_up(logs):
    """No worker at all: the request waits; decode, then prefill start on the ports the router
    polls; the same request is answered once both are up (--hold-for-prefill: decode alone may
    not prefill it)."""
    router, decode_port, prefill_port = router_without_workers(logs, "--hold-timeout", "600s", prefill=True)
    workers = []
    try:
        out: dict = {}
        sender = send_in_thread(router.url, BODY, out)
        wait_for("the request to be held", lambda: held(router.url) == 1)
        time.sleep(1.0)
        assert held(router.url) == 1 and not out, "nothing may answer while no worker is up"
        prefill_url = f"http://127.0.0.1:{prefill_port}"
        decode = serve("decode", logs, *FP32, "--prefill-urls", prefill_url, port=decode_port)
        workers.append(decode)
        decode.wait_ready()
        # A decode worker alone is not enough: with --hold-for-prefill the request waits for prefill too.
        time.sleep(1.5)
        assert held(router.url) == 1 and not out
        prefill = serve("prefill", logs, *FP32, port=prefill_port)
        workers.append(prefill)
        prefill.wait_ready()
        sender.join(timeout=120)
        r = out["response"]
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 4
        print(f"\nheld request answered {out['seconds']:.1f} s after it was sent: {r.json()['choices'][0]['text']!r}")
        assert held(router.url) == 0 and held_wait_count(router.url) == 1
        # The decode worker got the prompt's K/V from the prefill worker: the pair served it.
        local = [line for line in httpx.get(decode.url + "/metrics", timeout=5).text.splitlines()
                 if line.startswith(names.LOCAL_PREFILL + "{")]
        assert local and float(local[0].rsplit(" ", 1)[1]) == 0, local
    finally:
        for p in (*workers, router):
            p.stop()


def test_past_the_bound_429_and_a_client_that_leaves_frees_its_place(logs):
    router, _, _ = router_without_workers(logs, "--max-held", "1", "--hold-timeout", "600s")
    try:
        # The first request is held; its client gives up after 3 s.
        first: dict = {}
        sender = send_in_thread(router.url, BODY, first, timeout=3.0)
        wait_for("the request to be held", lambda: held(router.url) == 1)
        r = httpx.post(router.url + "/v1/completions", json=BODY, timeout=30)
        assert r.status_code == 429, r.text
        assert int(r.headers["retry-after"]) >= 1
        err = r.json()["error"]
        assert err["code"] == "rate_limit_exceeded" and "held" in err["message"], err
        sender.join(timeout=30)
        assert isinstance(first.get("error"), httpx.TimeoutException), first
        # The client left: its request leaves the queue, and a new one can be held again.
        wait_for("the abandoned request to leave the queue", lambda: held(router.url) == 0, timeout=10)
        second: dict = {}
        sender = send_in_thread(router.url, {**BODY, "stream": True}, second, timeout=2.0)
        wait_for("a streaming request to be held", lambda: held(router.url) == 1)
        sender.join(timeout=30)
        wait_for("the abandoned stream to leave the queue", lambda: held(router.url) == 0, timeout=10)
        assert held_wait_count(router.url) == 2
    finally:
        router.stop()


def test_past_the_timeout_503_with_retry_after(logs):
    router, _, _ = router_without_workers(logs, "--hold-timeout", "2s")
    try:
        t0 = time.monotonic()
        r = httpx.post(router.url + "/v1/chat/completions", timeout=30, json={
            "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
        took = time.monotonic() - t0
        assert r.status_code == 503, r.text
        assert int(r.headers["retry-after"]) >= 1
        err = r.json()["error"]
        assert err["type"] == "server_error" and err["code"] == "service_unavailable", err
        assert "no decode worker" in err["message"], err
        assert 2.0 <= took < 10, took
        assert held(router.url) == 0
    finally:
        router.stop()


def test_without_holding_no_worker_is_503_with_retry_after_at_once(logs):
    """--hold-timeout 0: nothing is held, and the 503 says when to come back (it used to have no
    Retry-After); the router is then not ready without a decode worker."""
    decode_port = free_port()
    router = serve("router", logs, *FP32, "--decode-urls", f"http://127.0.0.1:{decode_port}", "--hold-timeout", "0")
    try:
        router.wait_ready("/health")
        wait_for("a first poll", lambda: httpx.get(router.url + "/ready", timeout=5).status_code == 503)
        r = httpx.post(router.url + "/v1/completions", json=BODY, timeout=30)
        assert r.status_code == 503 and int(r.headers["retry-after"]) >= 1, (r.status_code, r.headers, r.text)
        assert r.json()["error"]["code"] == "service_unavailable"
    finally:
        router.stop()
