"""`phasesplit up` supervises its workers: kill -9 one under load, the survivors keep serving, it comes back.

As a Deployment restarts a crashed pod while its siblings serve, `phasesplit up --prefill 2
--decode 2` restarts a worker that dies (same port, with a backoff) instead of stopping the whole
stack. Every client request must end (a completion or an error event), never hang.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.procs import free_port

pytestmark = pytest.mark.slow

BACK_WITHIN_S = 30.0
PROMPTS = ["The capital of France is", "Write a list of fruits:", "def add(a, b):", "Once upon a time"]


class Load:
    """Clients streaming completions through the router until stopped; records how each request ended."""

    def __init__(self, url: str, clients: int = 3) -> None:
        self.url, self.stop = url, threading.Event()
        self.results: list[tuple[float, float, str]] = []  # (start, end, outcome)
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(clients)]
        for t in self.threads:
            t.start()

    def _one(self, client: httpx.Client, prompt: str) -> str:
        body = {"model": "smollm2-135m-instruct", "prompt": prompt, "max_tokens": 24, "temperature": 0,
                "stream": True, "ignore_eos": True}
        with client.stream("POST", self.url + "/v1/completions", json=body) as r:
            if r.status_code != 200:
                return f"http {r.status_code}"
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    return "error event"
                if event["choices"] and event["choices"][0].get("finish_reason"):
                    return "completed"
        return "ended without finish_reason"

    def _run(self, i: int) -> None:
        # A read timeout well past a normal request's time: exceeding it is the hang this test forbids.
        with httpx.Client(timeout=httpx.Timeout(60.0, connect=5.0)) as client:
            n = 0
            while not self.stop.is_set():
                start = time.monotonic()
                try:
                    outcome = self._one(client, PROMPTS[(i + n) % len(PROMPTS)])
                except httpx.TimeoutException as e:
                    outcome = f"hang ({type(e).__name__})"
                except httpx.HTTPError as e:
                    outcome = f"transport error ({type(e).__name__})"
                with self.lock:
                    self.results.append((start, time.monotonic(), outcome))
                n += 1

    def finish(self) -> list[tuple[float, float, str]]:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=90)
            assert not t.is_alive(), "a client thread is stuck in a request"
        return list(self.results)


def _sum_metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics", timeout=5).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") or line.startswith(name + " "))


def _wait_ready(url: str, timeout: float) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        try:
            if httpx.get(url + "/ready", timeout=1).status_code == 200:
                return time.monotonic() - t0
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"{url} not back within {timeout} s")


def _kill_and_recover(up_log: Path, load: Load, router: str, role: str, url: str, pid: int, counter: str) -> None:
    killed_at = time.monotonic()
    os.killpg(pid, signal.SIGKILL)
    back_s = _wait_ready(url, BACK_WITHIN_S)
    print(f"\n[supervise] {role} {url}: kill -9 -> ready again in {back_s:.1f} s")
    log = up_log.read_text()
    assert re.search(rf"\[up\] {role} worker {re.escape(url)} \(pid {pid}\) killed by SIGKILL; restarting", log), log
    assert re.search(rf"\[up\] {role} worker {re.escape(url)} restarted \(pid \d+\)", log), log
    # The router notices the worker again (it polls) and sends it work: the restarted process counts some.
    deadline = time.monotonic() + 30
    while _sum_metric(url, counter) == 0:
        assert time.monotonic() < deadline, f"restarted {role} worker {url} got no request through the router"
        time.sleep(0.5)
    with load.lock:
        served_while_down = [r for r in load.results if r[0] >= killed_at and r[2] == "completed"]
    assert served_while_down, "no request completed after the kill: the survivors must keep serving"


def test_killed_workers_restart_while_survivors_serve(tmp_path):
    port = free_port()
    up_log = tmp_path / "up.log"
    router = f"http://127.0.0.1:{port}"
    with open(up_log, "w") as log:
        p = subprocess.Popen([sys.executable, "-m", "phasesplit.runtime.cli", "up", "--port", str(port),
                              "--prefill", "2", "--decode", "2", "--kv-cache-memory", "96MiB",
                              "--log-level", "warning"], stdout=log, stderr=subprocess.STDOUT,
                             env=dict(os.environ, PYTHONUNBUFFERED="1"), start_new_session=True)
    try:
        deadline = time.monotonic() + 400
        while "ready: OpenAI API" not in up_log.read_text():
            assert p.poll() is None and time.monotonic() < deadline, up_log.read_text()
            time.sleep(0.5)
        workers = {role: [(u, int(pid)) for u, pid in re.findall(rf"\[up\] {role} worker on (\S+) \(pid (\d+)\)",
                                                                  up_log.read_text())]
                   for role in ("prefill", "decode")}
        assert len(workers["prefill"]) == 2 and len(workers["decode"]) == 2, up_log.read_text()

        load = Load(router)
        time.sleep(4)
        _kill_and_recover(up_log, load, router, "decode", *workers["decode"][0], "phasesplit_request_success_total")
        _kill_and_recover(up_log, load, router, "prefill", *workers["prefill"][1], "phasesplit_prompt_tokens_total")
        results = load.finish()

        outcomes: dict[str, int] = {}
        for _, _, outcome in results:
            outcomes[outcome] = outcomes.get(outcome, 0) + 1
        print(f"[supervise] {len(results)} requests: {outcomes}")
        bad = {o: n for o, n in outcomes.items() if o not in ("completed", "error event")
               and not o.startswith("http 5")}
        assert not bad, f"every request must end with a completion or an error, got {outcomes}"
        assert p.poll() is None, "phasesplit up must keep running when a worker dies"
        r = httpx.post(router + "/v1/completions", timeout=60, json={
            "model": "smollm2-135m-instruct", "prompt": "Hello", "max_tokens": 4})
        assert r.status_code == 200, r.text
    finally:
        os.killpg(p.pid, signal.SIGTERM)
        p.wait(timeout=60)
