"""`phasesplit up`, the README's main job: starts every role, answers, and stops with no orphans."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx

from tests.procs import free_port

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Three primary colors are"]


def _children(pid: int) -> set[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return {int(x) for x in out.split()}


def _ignore_sigint() -> None:
    # As a non-interactive shell starts a background job: SIGINT ignored, inherited through exec.
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _run_up(extra: list[str], log, stop: int = signal.SIGTERM, background: bool = False,
            prompts: list[str] = PROMPTS, kids: int | None = None) -> tuple[list[str], set[int]]:
    """Start `up`, send the prompts, stop it; returns the texts and its child processes (`kids`:
    how many there must be; default 1 for --colocated, 3 for a split)."""
    port = free_port()
    p = subprocess.Popen([sys.executable, "-m", "phasesplit.runtime.cli", "up", "--port", str(port), "--dtype",
                          "float32", "--kv-cache-memory", "128MiB", "--log-level", "warning", *extra],
                         stdout=subprocess.PIPE, stderr=log, text=True,
                         preexec_fn=_ignore_sigint if background else None)
    try:
        deadline = time.monotonic() + 240
        lines = []
        for line in p.stdout:
            lines.append(line)
            if "ready: OpenAI API" in line:
                break
            assert time.monotonic() < deadline and p.poll() is None, "".join(lines)
        want = kids if kids is not None else (1 if "--colocated" in extra else 3)
        kids = _children(p.pid)
        assert len(kids) == want, lines
        texts = []
        for prompt in prompts:
            r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=120, json={
                "model": "smollm2-135m-instruct", "prompt": prompt, "max_tokens": 16, "temperature": 0})
            assert r.status_code == 200, r.text
            texts.append(r.json()["choices"][0]["text"])
    finally:
        p.send_signal(stop)
        p.wait(timeout=60)
    return texts, kids


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_up_split_and_colocated_agree_and_stop_cleanly(tmp_path):
    with open(tmp_path / "up.log", "w") as log:
        split, kids_split = _run_up([], log)
        colocated, kids_colo = _run_up(["--colocated"], log)
    assert split == colocated
    time.sleep(0.5)
    assert not [k for k in kids_split | kids_colo if _alive(k)], "SIGTERM must stop every child"


def test_up_colocated_replicas_behind_the_router(tmp_path):
    """`--colocated 2`: two workers that prefill their own prompts, one core each, behind the
    router (the equal-cores baseline of one engine per core) answer as one colocated worker does."""
    with open(tmp_path / "up.log", "w") as log:
        one, _ = _run_up(["--colocated"], log)
        two, kids = _run_up(["--colocated", "2", "--pin-cpus"], log, prompts=PROMPTS * 2, kids=3)
    assert two == one * 2
    time.sleep(0.5)
    assert not [k for k in kids if _alive(k)], "SIGTERM must stop every child"


def test_up_stops_on_sigint_in_the_background_and_no_worker_outlives_it(tmp_path):
    """Ctrl-C (SIGINT) stops `up` even when it inherited SIGINT ignored (started in the background
    by a script; it used to ignore it and a harness's SIGINT left every worker running), and a
    SIGKILLed `up` takes its workers with it (they drain and exit) instead of leaving them on their
    ports."""
    with open(tmp_path / "up.log", "w") as log:
        _, kids_int = _run_up(["--colocated"], log, stop=signal.SIGINT, background=True, prompts=PROMPTS[:1])
        _, kids_kill = _run_up([], log, stop=signal.SIGKILL, prompts=PROMPTS[:1])
    deadline = time.monotonic() + 30
    while [k for k in kids_int | kids_kill if _alive(k)] and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not [k for k in kids_int | kids_kill if _alive(k)], "a worker outlived `up`"
