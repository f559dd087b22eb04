"""Start real runtime processes on loopback for tests, and stop them without leaving orphans."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from phasesplit.runtime import internal_secret

ROOT = Path(__file__).resolve().parent.parent
# The split workers and the router of one test stack share this (as a service's pods share the
# Secret the operator makes); tests present it on /internal/* and the KV port.
INTERNAL_SECRET = "test-internal-secret-" + os.urandom(8).hex()
INTERNAL = {internal_secret.HEADER: INTERNAL_SECRET}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Proc:
    """One `phasesplit ...` child process with its log file."""

    def __init__(self, args: list[str], log_path: Path, url: str | None = None,
                 env: dict[str, str] | None = None) -> None:
        self.args, self.log_path, self.url = args, log_path, url
        self.log = open(log_path, "wb")
        env = {**os.environ, "PYTHONUNBUFFERED": "1", internal_secret.ENV: INTERNAL_SECRET, **(env or {})}
        self.p = subprocess.Popen([sys.executable, "-m", "phasesplit.runtime.cli", *args], stdout=self.log,
                                  stderr=subprocess.STDOUT, env=env, start_new_session=True)

    def wait_ready(self, path: str = "/ready", timeout: float = 180.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.p.poll() is not None:
                raise RuntimeError(f"process exited with {self.p.returncode}:\n{self.tail()}")
            try:
                if httpx.get(self.url + path, timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise TimeoutError(f"{self.args} not ready after {timeout}s:\n{self.tail()}")

    def tail(self, n: int = 4000) -> str:
        self.log.flush()
        return self.log_path.read_bytes()[-n:].decode(errors="replace")

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.p.poll() is None:
            try:
                os.killpg(self.p.pid, sig)
            except ProcessLookupError:
                pass
            self.p.wait(timeout=30)

    def stop(self) -> None:
        if self.p.poll() is None:
            os.killpg(self.p.pid, signal.SIGTERM)
            try:
                self.p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.kill()
        self.log.close()


def serve(role: str, log_dir: Path, *extra: str, port: int | None = None,
          env: dict[str, str] | None = None) -> Proc:
    port = port or free_port()
    args = ["serve", "--role", role, "--port", str(port), "--kv-cache-memory", "192MiB", *extra]
    return Proc(args, log_dir / f"{role}-{port}.log", f"http://127.0.0.1:{port}", env)
