"""`phasesplit bench` against a real phasesplit server process (colocated, the bundled model).

Each test runs the benchmark as a user would (a subprocess of the `phasesplit` console script)
and checks the results file: exact prompt lengths as counted by the server, forced output
lengths, every rate measured, and clear failures with the partial results kept.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from phasesplit.runtime import metric_names as names

pytestmark = pytest.mark.slow

PHASESPLIT = str(Path(sys.executable).with_name("phasesplit"))
TRACES = Path(__file__).resolve().parents[2].parent / "shared" / "traces"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(tmp_path: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    log = open(tmp_path / f"server-{port}.log", "wb")
    proc = subprocess.Popen([PHASESPLIT, "serve", "--role", "both", "--port", str(port), "--model", "smollm2",
                             "--log-level", "warning"], stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):  # up to ~5 minutes on a busy 2-core machine, bounded
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}: {(tmp_path / log.name).read_text()[-2000:]}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    stop(proc)
    raise RuntimeError("server did not become healthy")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    proc, url = start_server(tmp_path_factory.mktemp("server"))
    yield url
    stop(proc)


def bench(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([PHASESPLIT, "bench", "--no-progress", *args], capture_output=True, text=True,
                          timeout=timeout)


def served_model(url: str) -> str:
    return httpx.get(url + "/v1/models").json()["data"][0]["id"]


def test_fixed_lengths_sweep_exact_and_plotted(server, tmp_path):
    out = tmp_path / "r.json"
    p = bench("--url", server, "--input-len", "48", "--output-len", "12", "--num-prompts", "6",
              "--request-rate", "4,inf", "--slo", "ttft=60s,itl=10s", "--output-json", str(out),
              "--plot", str(tmp_path / "plots"))
    assert p.returncode == 0, p.stderr
    doc = json.loads(out.read_text())
    assert doc["error"] is None
    assert doc["target"]["model"] == served_model(server)
    assert doc["target"]["prompt_lengths_checked_by_server"] is True  # through the server's /tokenize
    assert [r["rate_label"] for r in doc["runs"]] == ["4", "inf"]
    for run in doc["runs"]:
        s = run["summary"]
        assert s["completed"] == 6 and s["failed"] == 0
        assert s["prompt_len_mismatches"] == 0 and s["short_outputs"] == 0
        assert s["cached_prompt_tokens"] == 0  # new text every time: the prefix cache never helps
        assert s["goodput"] > 0 and s["slo_attainment"] == 1.0
        for r in run["results"]:
            assert r["server_prompt_tokens"] == 48  # built to the exact length, as the server counts it
            assert r["output_tokens"] == 12  # ignore_eos honoured
            assert r["ttft_s"] > 0 and r["e2el_s"] >= r["ttft_s"]
            assert r["chunk_times_s"] == sorted(r["chunk_times_s"])
    assert "Successful requests:" in p.stdout and "TTFT p99" in p.stdout
    for name in ("latency_vs_rate.png", "cdfs.png"):
        assert (tmp_path / "plots" / name).read_bytes()[:4] == b"\x89PNG"


def test_chat_mixed_workload_counts_template_tokens(server, tmp_path):
    out = tmp_path / "chat.json"
    p = bench("--url", server, "--endpoint", "chat", "--workload", "mixed", "--num-prompts", "5",
              "--chat-input-len", "60", "--chat-output-len", "8", "--doc-input-len", "400", "--doc-output-len", "4",
              "--doc-fraction", "0.4", "--max-concurrency", "2", "--output-json", str(out))
    assert p.returncode == 0, p.stderr
    doc = json.loads(out.read_text())
    assert doc["target"]["prompt_tokens_added_by_server"] > 0  # the chat template's tokens
    results = doc["runs"][0]["results"]
    assert sorted(r["kind"] for r in results) == ["chat", "chat", "chat", "doc", "doc"]
    for r in results:
        assert r["ok"] and r["server_prompt_tokens"] == r["prompt_len"]
        assert r["output_tokens"] == r["output_len"]
    assert set(doc["runs"][0]["by_kind"]) == {"chat", "doc"}


def test_azure_trace_replay_keeps_attribution(server, tmp_path):
    out = tmp_path / "trace.json"
    p = bench("--url", server, "--trace", str(TRACES / "AzureLLMInferenceTrace_conv.csv"), "--num-prompts", "4",
              "--trace-time-scale", "0.05", "--trace-token-scale", "0.1", "--max-output-len", "8",
              "--output-json", str(out))
    assert p.returncode == 0, p.stderr
    assert "Splitwise" in p.stdout and "CC BY 4.0" in p.stdout
    doc = json.loads(out.read_text())
    assert "Splitwise" in doc["attribution"]
    run = doc["runs"][0]
    assert run["rate_label"] == "trace"
    # The first four rows of the conversation trace, scaled by 0.1 (prompt) and clipped (output).
    first = [(374, 44), (396, 109)]
    assert [(r["prompt_len"], r["output_len"]) for r in run["results"][:2]] == [
        (round(c * 0.1), min(8, round(g * 0.1))) for c, g in first]
    assert all(r["ok"] and r["server_prompt_tokens"] == r["prompt_len"] for r in run["results"])


def test_unreachable_url_fails_clearly(tmp_path):
    out = tmp_path / "r.json"
    p = bench("--url", f"http://127.0.0.1:{free_port()}", "--output-json", str(out), timeout=60)
    assert p.returncode == 2
    assert "cannot connect to" in p.stderr
    assert "Traceback" not in p.stderr
    assert "cannot connect" in json.loads(out.read_text())["error"]


def test_unknown_model_lists_served_ones(server, tmp_path):
    out = tmp_path / "r.json"
    p = bench("--url", server, "--model", "no-such-model", "--output-json", str(out), timeout=60)
    assert p.returncode == 2
    assert "'no-such-model' is not served" in p.stderr and served_model(server) in p.stderr
    assert json.loads(out.read_text())["runs"] == []


def test_server_errors_stop_the_run_and_keep_results(server, tmp_path):
    # Prompts longer than the model's context: the server answers every one with a 4xx.
    out = tmp_path / "r.json"
    p = bench("--url", server, "--input-len", "20000", "--output-len", "4", "--num-prompts", "30", "--warmup", "0",
              "--max-consecutive-errors", "3", "--max-concurrency", "1", "--output-json", str(out))
    assert p.returncode == 1, p.stderr
    assert "the first 3 requests all failed" in p.stderr
    doc = json.loads(out.read_text())
    results = doc["runs"][0]["results"]
    assert len(results) == 3  # stopped instead of sending all 30
    assert all(not r["ok"] and 400 <= r["status"] < 500 and r["error"].startswith("HTTP 4") for r in results)
    assert "stopped" in doc["error"]


def test_server_dying_mid_run_keeps_partial_results(tmp_path):
    proc, url = start_server(tmp_path)
    out = tmp_path / "r.json"
    try:
        b = subprocess.Popen([PHASESPLIT, "bench", "--no-progress", "--url", url, "--input-len", "32",
                              "--output-len", "64", "--num-prompts", "40", "--max-concurrency", "1",
                              "--output-json", str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        # Kill the server once it has finished a few measured requests (a condition, not a timer).
        for _ in range(1200):
            if b.poll() is not None or _generated_tokens(url) >= 64 * 4:
                break
            time.sleep(0.25)
        os.killpg(proc.pid, signal.SIGKILL)
        _, err = b.communicate(timeout=300)
    finally:
        stop(proc)
    assert b.returncode == 1, err
    assert "some requests failed" in err
    results = json.loads(out.read_text())["runs"][0]["results"]
    ok = [r for r in results if r["ok"]]
    failed = [r for r in results if not r["ok"]]
    assert ok and failed and len(results) == 40
    assert all(r["status"] is None or r["status"] == 200 for r in failed)  # transport errors, not HTTP ones


def _generated_tokens(url: str) -> float:
    try:
        text = httpx.get(url + "/metrics", timeout=2).text
    except httpx.HTTPError:
        return 0.0
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(names.GENERATION_TOKENS))


def test_interrupt_keeps_partial_results(server, tmp_path):
    out = tmp_path / "r.json"
    before = _generated_tokens(server)
    b = subprocess.Popen([PHASESPLIT, "bench", "--no-progress", "--url", server, "--input-len", "32",
                          "--output-len", "32", "--num-prompts", "40", "--max-concurrency", "1", "--warmup", "0",
                          "--output-json", str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    # Interrupt once three requests have finished on the client's side (a condition, not a timer):
    # with one request at a time, the fourth request's first token means the third one came back.
    # The tool's probe request generates 2 tokens first.
    for _ in range(1200):
        if b.poll() is not None or _generated_tokens(server) - before >= 2 + 32 * 3 + 1:
            break
        time.sleep(0.25)
    b.send_signal(signal.SIGINT)
    _, err = b.communicate(timeout=120)
    assert b.returncode == 130, err
    assert "interrupted" in err
    doc = json.loads(out.read_text())
    assert doc["error"] == "interrupted"
    run = doc["runs"][0]
    assert 3 <= run["summary"]["completed"] < 40
    assert all(r["ok"] for r in run["results"])  # in-flight requests are dropped, not counted as failures
