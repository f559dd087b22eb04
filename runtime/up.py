"""`phasesplit up`: the local main job. Router + prefill + decode workers as child processes.

Each worker is a real `phasesplit serve --role ...` process on its own loopback port (as in a
pod), optionally pinned to its own cores, and all are stopped together on Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time

import httpx

_FORWARD = ("model", "served_model_name", "device", "dtype", "max_model_len", "block_size", "kv_cache_memory",
            "kv_cache_fraction", "max_num_seqs", "max_num_batched_tokens")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _model_flags(args: argparse.Namespace) -> list[str]:
    flags = []
    for name in _FORWARD:
        value = getattr(args, name)
        if value is not None:
            flags += [f"--{name.replace('_', '-')}", str(value)]
    if not args.prefix_caching:
        flags.append("--no-prefix-caching")
    return flags


def _cpu_sets(n: int) -> list[set[int] | None]:
    """Split the allowed CPUs evenly over n workers (None: not enough cores to pin)."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if n == 0 or len(cpus) < n:
        return [None] * n
    per = len(cpus) // n
    return [set(cpus[i * per:(i + 1) * per]) for i in range(n)]


class Child:
    def __init__(self, role: str, argv: list[str], cpus: set[int] | None, url: str) -> None:
        self.role, self.url = role, url
        cmd = [sys.executable, "-m", "phasesplit.runtime.cli", *argv]
        if cpus:
            cmd[0:0] = ["taskset", "-c", ",".join(map(str, sorted(cpus)))]
        self.p = subprocess.Popen(cmd, start_new_session=True)

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.p.poll() is None:
            try:
                os.killpg(self.p.pid, sig)
            except ProcessLookupError:
                pass


def up(args: argparse.Namespace) -> int:
    host = args.host
    model = _model_flags(args)
    common = ["--log-level", args.log_level]
    children: list[Child] = []
    workers: list[tuple[str, list[str]]] = []
    if args.colocated:
        workers.append(("both", []))
    else:
        workers += [("prefill", [])] * args.prefill
        workers += [("decode", ["--on-prefill-failure", args.on_prefill_failure, "--prefill-timeout",
                                str(args.prefill_timeout), "--local-prefill-threshold",
                                str(args.local_prefill_threshold)])] * args.decode
    cpu_sets = _cpu_sets(len(workers)) if args.pin_cpus else [None] * len(workers)

    def shutdown(*_: object) -> None:
        for c in children:
            c.stop()
        deadline = time.monotonic() + 10
        for c in children:
            try:
                c.p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                c.stop(signal.SIGKILL)
                c.p.wait()

    def on_signal(signum: int, _frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)
    try:
        urls: dict[str, list[str]] = {"prefill": [], "decode": [], "both": []}
        for (role, extra), cpus in zip(workers, cpu_sets, strict=True):
            port = args.port if role == "both" else _free_port()
            url = f"http://{host}:{port}"
            argv = ["serve", "--role", role, "--host", host, "--port", str(port), *model, *common, *extra]
            if cpus:
                argv += ["--threads", str(len(cpus))]
            children.append(Child(role, argv, cpus, url))
            urls[role].append(url)
            print(f"[up] {role} worker on {url}" + (f" (cpus {sorted(cpus)})" if cpus else ""), flush=True)
        if not args.colocated:
            router = ["serve", "--role", "router", "--host", host, "--port", str(args.port), *model, *common,
                      "--prefill-urls", ",".join(urls["prefill"]), "--decode-urls", ",".join(urls["decode"])]
            children.append(Child("router", router, None, f"http://{host}:{args.port}"))
        endpoint = f"http://{host}:{args.port}"
        _wait_ready(children, endpoint)
        print(f"[up] ready: OpenAI API at {endpoint}/v1 "
              f"({'colocated' if args.colocated else f'{args.prefill} prefill + {args.decode} decode'}); "
              "Ctrl-C stops everything", flush=True)
        while True:
            for c in children:
                if c.p.poll() is not None:
                    print(f"[up] {c.role} worker exited with {c.p.returncode}; stopping", file=sys.stderr)
                    return 1
            time.sleep(0.5)
    except KeyboardInterrupt:
        print("[up] stopping", flush=True)
        return 0
    except RuntimeError as e:
        print(f"[up] {e}", file=sys.stderr)
        return 1
    finally:
        shutdown()


def _wait_ready(children: list[Child], endpoint: str, timeout: float = 600.0) -> None:
    deadline = time.monotonic() + timeout
    pending = list(children)
    while pending:
        if time.monotonic() > deadline:
            raise RuntimeError(f"not ready after {timeout}s: {[c.role for c in pending]}")
        for c in list(pending):
            if c.p.poll() is not None:
                raise RuntimeError(f"{c.role} worker exited with {c.p.returncode} during start-up")
            try:
                if httpx.get(c.url + "/ready", timeout=1).status_code == 200:
                    pending.remove(c)
            except httpx.HTTPError:
                pass
        time.sleep(0.3)
