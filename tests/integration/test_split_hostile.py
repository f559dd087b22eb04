"""Hostile input and overload against a router with one prefill and one decode worker (real
processes on loopback): the fuzz run of the router's schema, 1,000 concurrent streaming clients
(short outputs, then 256-token ones) that each end with a completion or a 429, and a hung decode
worker that turns into an error event instead of a hung stream."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time

import httpx
import pytest

from tests.hostile import check_cases, fuzz_requests, normal_request, run_fuzz
from tests.procs import serve

MODEL = "smollm2-135m-instruct"
# Small batches so the admitted share of 1,000 clients finishes in about a minute on 2 cores.
LIMITS = ("--max-num-seqs", "8", "--max-queued-requests", "8")
FP32 = ("--dtype", "float32", "--max-model-len", "1024", *LIMITS)
CLIENTS = int(os.environ.get("PHASESPLIT_OVERLOAD_CLIENTS", "1000"))


@pytest.fixture(scope="module")
def split(tmp_path_factory):
    logs = tmp_path_factory.mktemp("split-hostile-logs")
    prefill = serve("prefill", logs, *FP32)
    decode = serve("decode", logs, *FP32, "--prefill-urls", prefill.url)
    router = serve("router", logs, *FP32, "--prefill-urls", prefill.url, "--decode-urls", decode.url,
                   "--worker-read-timeout", "20s")
    procs = (prefill, decode, router)
    try:
        for p in procs:
            p.wait_ready()
        yield procs
    finally:
        for p in procs:
            p.stop()


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


class Watch:
    """Samples each process's RSS and the router's readiness while a load runs."""

    def __init__(self, procs, router_url: str) -> None:
        self.procs, self.url = procs, router_url
        self.peak = {p.args[2]: 0.0 for p in procs}  # role -> MiB
        self.not_ready: list[str] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stop.is_set():
            for p in self.procs:
                self.peak[p.args[2]] = max(self.peak[p.args[2]], rss_mib(p.p.pid))
            try:
                r = httpx.get(self.url + "/ready", timeout=10)
                if r.status_code != 200:
                    self.not_ready.append(r.text)
            except httpx.HTTPError as e:
                self.not_ready.append(repr(e))
            self.stop.wait(0.5)

    def __enter__(self) -> Watch:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()


async def one_stream(client: httpx.AsyncClient, i: int, max_tokens: int) -> str:
    body = {"model": MODEL, "prompt": f"Request {i}: tell me a story about the number {i}.",
            "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code == 429:
            err = json.loads(await r.aread())["error"]
            assert err["code"] == "rate_limit_exceeded" and r.headers.get("retry-after"), err
            return "429"
        if r.status_code != 200:
            return f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
        finish, tokens_text = None, []
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            d = json.loads(line[6:])
            if "error" in d:
                return f"error event: {d['error']}"
            for c in d["choices"]:
                tokens_text.append(c["text"])
                finish = c["finish_reason"] or finish
        return "completed" if finish == "length" else f"ended without finishing ({finish})"


def overload(router_url: str, clients: int, max_tokens: int, timeout: float) -> dict[str, int]:
    async def main() -> list[str]:
        limits = httpx.Limits(max_connections=clients + 10, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=router_url, limits=limits, timeout=timeout) as client:
            async def guarded(i: int) -> str:
                try:
                    return await asyncio.wait_for(one_stream(client, i, max_tokens), timeout)
                except (asyncio.TimeoutError, httpx.TimeoutException):
                    return "hung past its timeout"
                except httpx.HTTPError as e:
                    return f"transport error: {e!r}"
            return await asyncio.gather(*(guarded(i) for i in range(clients)))

    results = asyncio.run(main())
    counts: dict[str, int] = {}
    for r in results:
        counts[r] = counts.get(r, 0) + 1
    return counts


@pytest.mark.parametrize("max_tokens,timeout", [(8, 300), (256, 600)])
def test_overload_ends_every_request_with_a_completion_or_429(split, max_tokens, timeout):
    prefill, decode, router = split
    t0 = time.monotonic()
    with Watch(split, router.url) as watch:
        counts = overload(router.url, CLIENTS, max_tokens, timeout)
    took = time.monotonic() - t0
    print(f"\noverload: {CLIENTS} streaming clients, max_tokens={max_tokens}: {counts} in {took:.0f}s; "
          f"peak RSS MiB {({k: round(v) for k, v in watch.peak.items()})}; router not ready {len(watch.not_ready)}x")
    assert set(counts) <= {"completed", "429"}, counts
    assert counts.get("completed", 0) >= 16 and counts.get("429", 0) > 0  # both sides of admission
    assert not watch.not_ready, watch.not_ready[:3]
    # Bounded: the router holds no model (its RSS does not grow with 1,000 clients past a few
    # hundred MiB), the workers hold the model plus a fixed KV cache.
    assert watch.peak["router"] < 600, watch.peak
    assert max(watch.peak["prefill"], watch.peak["decode"]) < 3000, watch.peak
    normal_request(router.url, {}, MODEL)
    state = httpx.get(decode.url + "/debug/state", timeout=10).json()
    deadline = time.monotonic() + 30
    while state["requests"] and time.monotonic() < deadline:
        time.sleep(0.5)
        state = httpx.get(decode.url + "/debug/state", timeout=10).json()
    assert state["requests"] == 0 and state["allocated_blocks"] == 0, state


def test_router_hand_picked_hostile_requests(split):
    router = split[2]
    wrong = check_cases(router.url, {}, MODEL)
    assert not wrong, "\n".join(wrong)
    normal_request(router.url, {}, MODEL)


def test_router_fuzz(split):
    router = split[2]
    stats = run_fuzz(router.url, {}, MODEL, fuzz_requests())
    print(f"\nfuzz (router): {stats.total} requests in {stats.batches} batches, "
          f"statuses {dict(sorted(stats.statuses.items()))}")
    assert not stats.failures and stats.total >= fuzz_requests() - 100
    for p in split:
        log = p.log_path.read_text(errors="replace")
        assert "Traceback" not in log and "engine step failed" not in log, log[-3000:]


def test_hung_decode_worker_becomes_an_error_event(split):
    _, decode, router = split

    async def main() -> str:
        async with httpx.AsyncClient(base_url=router.url, timeout=60) as client:
            body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 400, "temperature": 0,
                    "ignore_eos": True, "stream": True}
            async with client.stream("POST", "/v1/completions", json=body) as r:
                assert r.status_code == 200
                n = 0
                async for line in r.aiter_lines():
                    if line.startswith("data: {") and "error" in json.loads(line[6:]):
                        return json.loads(line[6:])["error"]["message"]
                    n += 1
                    if n == 3:
                        os.kill(decode.p.pid, signal.SIGSTOP)  # hung, not dead
        return "the stream ended without an error event"

    t0 = time.monotonic()
    try:
        message = asyncio.run(main())
        took = time.monotonic() - t0
        workers = httpx.get(router.url + "/internal/workers", timeout=10).json()
    finally:
        os.kill(decode.p.pid, signal.SIGCONT)
    print(f"\nhung decode worker: error event after {took:.1f}s: {message}")
    assert "decode worker" in message and took < 30
    assert workers["decode"][0]["up"] is False
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and httpx.get(router.url + "/ready", timeout=5).status_code != 200:
        time.sleep(0.5)
    normal_request(router.url, {}, MODEL)
