"""`phasesplit up`, the README's main job: starts every role, answers, and stops with no orphans."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from phasesplit.runtime.kernels import build
from tests.kernels import can_build
from tests.procs import free_port

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Three primary colors are"]


def _children(pid: int) -> set[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return {int(x) for x in out.split()}


def _ignore_sigint() -> None:
    # As a non-interactive shell starts a background job: SIGINT ignored, inherited through exec.
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _run_up(extra: list[str], log, stop: int = signal.SIGTERM, background: bool = False,
            prompts: list[str] = PROMPTS, kids: int | None = None, during=None) -> tuple[list[str], set[int]]:
    """Start `up`, send the prompts, stop it; returns the texts and its child processes (`kids`:
    how many there must be; default 1 for --colocated, 3 for a split). `during(pids)` runs
    before it is stopped."""
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
        if during:
            during(kids)
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


def _idle_helpers(pid: int) -> list[tuple[str, str]]:
    """(the process's own CPUs, the CPUs of each of its threads at idle priority, SCHED_IDLE)."""
    def field(path: str) -> str:
        with open(path) as f:
            return next(line.split()[1] for line in f if line.startswith("Cpus_allowed_list:"))
    out = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            if os.sched_getscheduler(int(tid)) == os.SCHED_IDLE:
                out.append((field(f"/proc/{pid}/status"), field(f"/proc/{pid}/task/{tid}/status")))
        except (OSError, StopIteration):
            pass
    return out


def test_up_pinned_workers_borrow_each_others_idle_cpus(tmp_path):
    """`up --pin-cpus` on two CPUs: the prefill and decode workers own one CPU each and run an
    idle-priority helper on the other's (--borrow-idle-cpus), and the decode worker leaves its
    CPU to a short remote prefill (--pause-for-remote-prefill, decode only); the answers are the
    same as without (--no-borrow-idle-cpus). dtype auto: the CPU kernels the helpers share."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) != 2:
        pytest.skip(f"{len(cpus)} CPUs: `up --pin-cpus` gives a worker of this split one CPU (the case that "
                    "borrows) only on two")
    seen, pauses = {}, {}

    def helpers(kids: set[int]) -> None:
        for pid in kids:
            with open(f"/proc/{pid}/cmdline") as f:
                argv = f.read().split("\0")
            if "--role" in argv and argv[argv.index("--role") + 1] in ("prefill", "decode"):
                seen[argv[argv.index("--role") + 1]] = _idle_helpers(pid)
                pauses[argv[argv.index("--role") + 1]] = "--pause-for-remote-prefill" in argv

    with open(tmp_path / "up.log", "w") as log:
        borrowed, _ = _run_up(["--pin-cpus", "--dtype", "auto"], log, during=helpers)
        own, _ = _run_up(["--pin-cpus", "--dtype", "auto", "--no-borrow-idle-cpus"], log)
    assert borrowed == own
    assert pauses == {"prefill": False, "decode": True}, pauses
    if not seen.get("decode") and not seen.get("prefill"):
        assert not can_build(build.BF16W), f"the bf16-weight library builds here, yet no worker borrowed: {seen}"
        pytest.skip("no idle-priority helpers: no CPU matmul kernel serves the weights here (no AVX2/FMA/F16C "
                    "or no C compiler)")
    for role in ("prefill", "decode"):
        assert len(seen[role]) == 1, (role, seen)
        own_cpu, helper_cpu = seen[role][0]
        assert {own_cpu, helper_cpu} == {str(c) for c in cpus}, (role, seen)


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
