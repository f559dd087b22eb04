"""Interference: do long prompts stall everyone's token stream? Split vs colocated, same run.

    ~/.cache/phasesplit/venv/bin/python tests/bench/interference.py [--rate 1.0] [--num-prompts 80]

Starts `phasesplit up --pin-cpus` (prefill on core 0, decode on core 1), drives it with
`phasesplit bench --workload mixed` (steady short chats plus a ~1600-token document now and
then), stops it, then does the same against `phasesplit up --colocated` (one worker, both
cores). Prints chat-request ITL and TTFT p50/p99 for both, the ITL p99 ratio and the TTFT cost.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

BIN = Path(sys.executable).with_name("phasesplit")


def run_one(label: str, up_args: list[str], bench_args: list[str], out: Path, port: int) -> dict:
    up = subprocess.Popen([str(BIN), "up", "--port", str(port), "--log-level", "warning", *up_args],
                          start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/ready", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if up.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"{label}: phasesplit up did not become ready")
            time.sleep(0.5)
        path = out / f"{label}.json"
        subprocess.run([str(BIN), "bench", "--url", f"http://127.0.0.1:{port}", *bench_args,
                        "--label", label, "--output-json", str(path), "--no-progress"], check=True)
        return json.loads(path.read_text())
    finally:
        os.killpg(up.pid, signal.SIGTERM)  # the workers drain (nothing is in flight) and exit
        try:
            up.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(up.pid, signal.SIGKILL)  # its workers get SIGTERM as their parent dies
            up.wait()


def chat_stats(doc: dict) -> dict:
    return doc["runs"][0]["by_kind"]["chat"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rate", type=float, default=1.0, help="requests/s (chats and documents together)")
    ap.add_argument("--num-prompts", type=int, default=80)
    ap.add_argument("--doc-fraction", type=float, default=0.1)
    ap.add_argument("--doc-input-len", type=int, default=1600)
    ap.add_argument("--port", type=int, default=8100)
    a = ap.parse_args()
    bench = ["--workload", "mixed", "--num-prompts", str(a.num_prompts), "--request-rate", str(a.rate),
             "--chat-input-len", "64", "--chat-output-len", "64", "--doc-input-len", str(a.doc_input_len),
             "--doc-output-len", "8", "--doc-fraction", str(a.doc_fraction), "--warmup", "4", "--seed", "1"]
    out = Path(tempfile.mkdtemp(prefix="interference-"))
    results = {}
    for label, up_args in (("split", ["--pin-cpus"]), ("colocated", ["--colocated"])):
        results[label] = chat_stats(run_one(label, up_args, bench, out, a.port))
    print(f"\nchat requests under {a.doc_input_len}-token documents ({a.doc_fraction:.0%} of {a.rate} req/s):")
    print(f"{'':10} {'ITL p50':>9} {'ITL p99':>9} {'TTFT p50':>9} {'TTFT p99':>9}  (ms)")
    for label, s in results.items():
        itl, ttft = s["itl_s"], s["ttft_s"]
        print(f"{label:10} {itl['p50'] * 1e3:9.1f} {itl['p99'] * 1e3:9.1f} {ttft['p50'] * 1e3:9.1f} "
              f"{ttft['p99'] * 1e3:9.1f}")
    ratio = results["colocated"]["itl_s"]["p99"] / results["split"]["itl_s"]["p99"]
    ttft_cost = results["split"]["ttft_s"]["p50"] / results["colocated"]["ttft_s"]["p50"]
    ttft_tail = results["split"]["ttft_s"]["p99"] / results["colocated"]["ttft_s"]["p99"]
    print(f"ITL p99 colocated/split: {ratio:.2f}x; TTFT split/colocated: p50 {ttft_cost:.2f}x, "
          f"p99 {ttft_tail:.2f}x")
    print(f"raw results: {out}")


if __name__ == "__main__":
    main()
