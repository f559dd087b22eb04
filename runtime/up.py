"""`phasesplit up`: the local main job. Router + prefill + decode workers as child processes.

Each worker is a real `phasesplit serve --role ...` process on its own loopback port (as in a
pod), optionally pinned to its own cores, and all are stopped together on Ctrl-C or SIGTERM: each
child drains first (finishes what it holds, up to --drain-timeout), a second Ctrl-C stops at once.
The children share a random internal secret made here (their internal calls and KV port need it).
A child that exits after start-up is restarted on the same port with a backoff, as a Deployment
would restart its pod, while the others keep serving; only the user's signal stops everything.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import secrets
import signal
import socket
import subprocess
import sys
import time

import httpx

from phasesplit.runtime import internal_secret

_FORWARD = ("model", "served_model_name", "device", "dtype", "max_model_len", "block_size", "kv_cache_memory",
            "kv_cache_fraction", "max_num_seqs", "max_num_batched_tokens", "tensor_parallel_size",
            "quantization", "chunk_overhead")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _model_flags(args: argparse.Namespace) -> list[str]:
    flags = []
    for name in _FORWARD:
        value = getattr(args, name)
        if value is not None:
            flags += [f"--{name.replace('_', '-')}", *map(str, value if isinstance(value, list) else [value])]
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


# Restart backoff: 1 s after the first exit, doubling per exit that follows quickly, at most 16 s,
# so a worker killed once is back within seconds and a crash loop does not spin.
BACKOFF_BASE_S, BACKOFF_CAP_S = 1.0, 16.0
# A child that served this long before exiting starts the backoff over.
STABLE_AFTER_S = 60.0


def lend_idle_prefill(asked: bool | None, borrowing: bool) -> bool:
    """Whether the router lends idle prefill workers whole requests (`--lend-idle-prefill`): as
    asked, else unless the decode worker borrows the prefill workers' cores while they idle.

    Both give the idle prefill core to decoding. Lending does it as a second engine with its own
    batch, which reads every weight again each step on one core; borrowing as a helper of the
    decode worker's one engine, both cores streaming one read of the weights, so steps are shorter
    where decode is bound by memory. On the 2-core AVX512 machine, 64/128-token requests at 9.57
    req/s, ITL target 50 ms: lending met it for 3.56 req/s of goodput, not lending for 6.39, and
    colocated 6.60 (docs/benchmarks.md, "Lending or borrowing the idle prefill core"). Separate
    machines (a cluster) share no cores: there only lending puts the prefill pool's idle compute
    to decoding."""
    return (not borrowing) if asked is None else asked


def restart_delay(consecutive_exits: int) -> float:
    """Seconds to wait before restarting a child that has exited `consecutive_exits` times in a row."""
    return min(BACKOFF_CAP_S, BACKOFF_BASE_S * 2 ** max(0, consecutive_exits - 1))


def exit_reason(returncode: int) -> str:
    """How a child ended, in words (a negative return code is the signal that killed it)."""
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exited with status {returncode}"


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM it (it drains, then exits) when `up` dies, even by
    SIGKILL, so no worker outlives the process that owns its port (PR_SET_PDEATHSIG)."""
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)


class Child:
    def __init__(self, role: str, argv: list[str], cpus: set[int] | None, url: str, env: dict[str, str]) -> None:
        self.role, self.url, self.env = role, url, env
        self.cmd = [sys.executable, "-m", "phasesplit.runtime.cli", *argv]
        if cpus:
            self.cmd[0:0] = ["taskset", "-c", ",".join(map(str, sorted(cpus)))]
        self.exits = 0
        self.restart_at: float | None = None
        self.start()

    def start(self) -> None:
        self.p = subprocess.Popen(self.cmd, start_new_session=True, env=self.env,
                                  preexec_fn=_die_with_parent if sys.platform == "linux" else None)
        self.started = time.monotonic()
        self.restart_at = None

    def supervise(self, now: float) -> None:
        """Notice an exit and schedule a restart; restart when its backoff has passed."""
        if self.restart_at is None and self.p.poll() is not None:
            self.exits = 1 if now - self.started >= STABLE_AFTER_S else self.exits + 1
            delay = restart_delay(self.exits)
            self.restart_at = now + delay
            print(f"[up] {self.role} worker {self.url} (pid {self.p.pid}) {exit_reason(self.p.returncode)}; "
                  f"restarting in {delay:.0f} s (exit {self.exits} in a row)", file=sys.stderr, flush=True)
        elif self.restart_at is not None and now >= self.restart_at:
            self.start()
            print(f"[up] {self.role} worker {self.url} restarted (pid {self.p.pid})", file=sys.stderr, flush=True)

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.p.poll() is None:
            try:
                os.killpg(self.p.pid, sig)
            except ProcessLookupError:
                pass


def up(args: argparse.Namespace) -> int:
    host = args.host
    model = _model_flags(args)
    common = ["--log-level", args.log_level, "--drain-timeout", str(args.drain_timeout)]
    env = dict(os.environ, **{internal_secret.ENV: secrets.token_urlsafe(32)})
    children: list[Child] = []
    workers: list[tuple[str, list[str]]] = []
    routed = args.colocated != 1  # a router in front: the split, or colocated replicas
    if args.colocated == 1:
        workers.append(("both", []))
    elif args.colocated:
        # Replicas: decode workers given no prefill worker prefill their own prompts (a colocated
        # engine each), balanced by the router as a split's decode pool is.
        workers += [("decode", [])] * args.colocated
    else:
        workers += [("prefill", [])] * args.prefill
        workers += [("decode", ["--on-prefill-failure", args.on_prefill_failure, "--prefill-timeout",
                                str(args.prefill_timeout), "--local-prefill-threshold",
                                str(args.local_prefill_threshold), "--prefill-placement",
                                args.prefill_placement, "--itl-target", str(args.itl_target)])] * args.decode
    cpu_sets = _cpu_sets(len(workers)) if args.pin_cpus else [None] * len(workers)
    pinned = set().union(*(s for s in cpu_sets if s))  # every worker's, for --borrow-idle-cpus

    def shutdown(*_: object) -> None:
        # SIGTERM: each child drains (not ready, no new requests, finishes its streams and
        # prefills); what is still running after the drain timeout and a margin is killed, as
        # is everything on a second Ctrl-C.
        for c in children:
            c.stop()
        if any(c.p.poll() is None for c in children):
            print(f"[up] draining (up to {args.drain_timeout:g}s; Ctrl-C again to stop at once)", flush=True)
        deadline = time.monotonic() + args.drain_timeout + 10
        try:
            for c in children:
                try:
                    c.p.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
        except KeyboardInterrupt:
            print("[up] stopping now", flush=True)
        for c in children:
            if c.p.poll() is None:
                c.stop(signal.SIGKILL)
                c.p.wait()

    def on_signal(signum: int, _frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)
    # Explicitly: a process started in the background by a non-interactive shell inherits SIGINT
    # ignored, and Python then leaves it so: Ctrl-C sent to it (a harness's SIGINT) did nothing.
    signal.signal(signal.SIGINT, on_signal)
    try:
        urls: dict[str, list[str]] = {"prefill": [], "decode": [], "both": []}
        borrowing = False  # a decode worker computes on the prefill workers' cores while they idle
        for (role, extra), cpus in zip(workers, cpu_sets, strict=True):
            port = args.port if role == "both" else _free_port()
            url = f"http://{host}:{port}"
            argv = ["serve", "--role", role, "--host", host, "--port", str(port), *model, *common, *extra]
            if role == "decode":  # the prefill workers it may call (it takes no URL from a body on trust)
                argv += ["--prefill-urls", ",".join(urls["prefill"])]
            if cpus:  # --threads is per tensor-parallel rank; the ranks share the worker's cores
                argv += ["--threads", str(max(1, len(cpus) // args.tensor_parallel_size))]
                others = sorted(pinned - cpus)
                if args.borrow_idle_cpus and others:  # the other workers' cores, while they idle
                    argv += ["--borrow-idle-cpus", ",".join(map(str, others))]
                    borrowing |= role == "decode"
                    if role == "decode" and args.pause_for_remote_prefill:  # the prefill workers borrow its core
                        argv += ["--pause-for-remote-prefill"]
            children.append(Child(role, argv, cpus, url, env))
            urls[role].append(url)
            print(f"[up] {role} worker on {url} (pid {children[-1].p.pid})"
                  + (f" (cpus {sorted(cpus)})" if cpus else ""), flush=True)
        if routed:
            router = ["serve", "--role", "router", "--host", host, "--port", str(args.port), *model, *common,
                      "--prefill-urls", ",".join(urls["prefill"]), "--decode-urls", ",".join(urls["decode"])]
            if args.prefill_placement == "adaptive" and lend_idle_prefill(args.lend_idle_prefill, borrowing):
                router.append("--lend-idle-prefill")  # every core may decode
            children.append(Child("router", router, None, f"http://{host}:{args.port}", env))
            print(f"[up] router on http://{host}:{args.port} (pid {children[-1].p.pid})", flush=True)
        endpoint = f"http://{host}:{args.port}"
        _wait_ready(children, endpoint)
        if not args.colocated:
            shape = f"{args.prefill} prefill + {args.decode} decode"
        else:
            shape = "colocated" if args.colocated == 1 else f"{args.colocated} colocated replicas"
        print(f"[up] ready: OpenAI API at {endpoint}/v1 ({shape}); Ctrl-C stops everything", flush=True)
        while True:
            now = time.monotonic()
            for c in children:
                c.supervise(now)
            time.sleep(0.25)
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
