"""Interference: do long prompts stall everyone's token stream? Split vs colocated, same run.

    ~/.cache/phasesplit/venv/bin/python tests/bench/interference.py [--rate 1.0] [--num-prompts 80]

Starts `phasesplit up --pin-cpus` (prefill on core 0, decode on core 1), drives it with
`phasesplit bench --workload mixed` (steady short chats plus a ~1600-token document now and
then), stops it, then does the same against `phasesplit up --colocated` (one worker, both
cores). Prints chat-request ITL and TTFT p50/p99 for both, the ITL p99 ratio and the TTFT cost.

    ... interference.py --heavy [--chats 3 --doc-every 4 --doc-input-len 1800 --duration 60]

The heavy case (issue 19 acceptance 3): three chat streams back to back (a closed loop of three)
while a different ~1800-token document arrives every 4 s (a second bench process, nearly even
gaps), on the same two systems; the documents stop when the chats are done.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from phasesplit.runtime import metric_names as names

BIN = Path(sys.executable).with_name("phasesplit")


def run_one(label: str, up_args: list[str], bench_args: list[str], out: Path, port: int,
            beside: list[str] | None = None, cap_s: float | None = None) -> dict:
    """One system: start it, run the bench (and `beside`, a second bench alongside, cut with SIGINT
    once the first is done: it keeps what finished), stop it. Returns the first bench's JSON.
    `cap_s`: the first bench is cut with SIGINT after that long too (it keeps what finished), and
    the JSON gets "cut_after_s": an offered load the system cannot keep up with would otherwise
    queue without end (1,800-token documents every 4 s are ~450 prompt tokens/s, more than two
    AVX2 cores prefill)."""
    print(f"[interference] {label}: starting phasesplit up {' '.join(up_args)}", flush=True)
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
        url = f"http://127.0.0.1:{port}"
        other = None
        if beside:
            other = subprocess.Popen([str(BIN), "bench", "--url", url, *beside, "--label", f"{label}-docs",
                                      "--output-json", str(out / f"{label}-docs.json"), "--no-progress"],
                                     stdout=subprocess.DEVNULL)
        cut = None
        started = time.monotonic()
        print(f"[interference] {label}: benchmark running" + (f" (cut after {cap_s:.0f} s)" if cap_s else ""),
              flush=True)
        try:
            bench = subprocess.Popen([str(BIN), "bench", "--url", url, *bench_args,
                                      "--label", label, "--output-json", str(path), "--no-progress"])
            try:
                rc = bench.wait(timeout=cap_s)
            except subprocess.TimeoutExpired:
                cut = time.monotonic() - started
                print(f"[interference] {label}: still running after {cut:.0f} s, cut (it keeps what finished): "
                      "the offered load is more than this system serves", flush=True)
                bench.send_signal(signal.SIGINT)
                rc = bench.wait(timeout=120)
            if rc != 0 and cut is None:
                raise SystemExit(f"{label}: phasesplit bench failed (exit {rc})")
        finally:
            if other is not None:
                other.send_signal(signal.SIGINT)
                other.wait(timeout=120)
        doc = json.loads(path.read_text())
        doc["lent"] = lent_requests(url)
        print(f"[interference] {label}: done in {time.monotonic() - started:.0f} s", flush=True)
        if cut is not None:
            doc["cut_after_s"] = round(cut)
        return doc
    finally:
        # The workers drain (nothing is in flight) and exit. Gone already (a failed start): the
        # error that says why propagates, not a ProcessLookupError from here.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(up.pid, signal.SIGTERM)
        try:
            up.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(up.pid, signal.SIGKILL)  # its workers get SIGTERM as their parent dies
            up.wait()


def lent_requests(url: str) -> int:
    """Requests the router sent whole to an idle prefill worker over the run (0 without a router)."""
    try:
        text = httpx.get(url + "/metrics", timeout=5).text
    except httpx.HTTPError:
        return 0
    return int(sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples
                   if s.name == names.LENT_REQUESTS))


def chat_stats(doc: dict) -> dict | None:
    """The chat requests' summary, or None where nothing was measured (cut during the warm-up)."""
    runs = [r for r in doc["runs"] if r.get("summary")]
    if not runs:
        return None
    run = runs[0]
    return run.get("by_kind", {}).get("chat") or run["summary"]  # --heavy: the chat bench is all chats


def heavy_args(a: argparse.Namespace) -> tuple[list[str], list[str]]:
    """The chat loop's and the documents' bench arguments for --heavy."""
    chat_s = 64 * 0.06  # a 64-token answer at ~60 ms a token: roughly how long one chat takes
    n_chats = max(12, round(a.chats * a.duration / chat_s))
    chats = ["--input-len", "64", "--output-len", "64", "--range-ratio", "0", "--request-rate", "inf",
             "--max-concurrency", str(a.chats), "--num-prompts", str(n_chats), "--warmup", str(a.chats),
             "--seed", "1"]
    # Enough documents to outlast the chats; a gamma shape of 1000 makes the gaps nearly even.
    docs = ["--input-len", str(a.doc_input_len), "--output-len", "8", "--range-ratio", "0.05",
            "--request-rate", f"{1 / a.doc_every:g}", "--burstiness", "1000",
            "--num-prompts", str(round(4 * a.duration / a.doc_every)), "--warmup", "0", "--seed", "2"]
    return chats, docs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rate", type=float, default=1.0, help="requests/s (chats and documents together)")
    ap.add_argument("--num-prompts", type=int, default=80)
    ap.add_argument("--doc-fraction", type=float, default=0.1)
    ap.add_argument("--doc-input-len", type=int, default=1600)
    ap.add_argument("--port", type=int, default=8100)
    ap.add_argument("--heavy", action="store_true",
                    help="chat streams back to back plus a document every --doc-every seconds")
    ap.add_argument("--chats", type=int, default=3, help="--heavy: chat streams")
    ap.add_argument("--doc-every", type=float, default=4.0, help="--heavy: seconds between documents")
    ap.add_argument("--duration", type=float, default=60.0, help="--heavy: about how long the chats run")
    ap.add_argument("--cap", type=float, default=None,
                    help="seconds after which a system's benchmark is cut, keeping what finished "
                         "(default: 4 x --duration + 120 with --heavy, none otherwise)")
    ap.add_argument("--placement", choices=("static", "adaptive"), default="static",
                    help="split's --prefill-placement (adaptive: short prompts may be prefilled on the decode worker)")
    ap.add_argument("--up-args", default="",
                    help="more flags for both systems' `phasesplit up`, e.g. '--chunk-overhead 0' (an A/B of one flag)")
    a = ap.parse_args()
    if a.heavy:
        a.doc_input_len = 1800 if a.doc_input_len == 1600 else a.doc_input_len
        bench, docs = heavy_args(a)
        what = f"{a.chats} chat streams back to back, a {a.doc_input_len}-token document every {a.doc_every:g} s"
    else:
        bench = ["--workload", "mixed", "--num-prompts", str(a.num_prompts), "--request-rate", str(a.rate),
                 "--chat-input-len", "64", "--chat-output-len", "64", "--doc-input-len", str(a.doc_input_len),
                 "--doc-output-len", "8", "--doc-fraction", str(a.doc_fraction), "--warmup", "4", "--seed", "1"]
        docs = None
        what = f"{a.doc_input_len}-token documents ({a.doc_fraction:.0%} of {a.rate} req/s)"
    out = Path(tempfile.mkdtemp(prefix="interference-"))
    results = {}
    split_args = ["--pin-cpus", "--prefill-placement", a.placement]
    cap = a.cap if a.cap is not None else (4 * a.duration + 120 if a.heavy else None)
    cuts = {}
    extra = shlex.split(a.up_args)
    for label, up_args in (("split", split_args + extra), ("colocated", ["--colocated", *extra])):
        doc = run_one(label, up_args, bench, out, a.port, beside=docs, cap_s=cap)
        results[label] = chat_stats(doc)
        if "cut_after_s" in doc:
            cuts[label] = doc["cut_after_s"]
    empty = [label for label, st in results.items() if st is None]
    if empty:
        print(f"\nnothing measured for {', '.join(empty)}: cut after {cap or 0:.0f} s still in the warm-up; the offered "
              f"load ({what}) is beyond this machine (raise --doc-every or --cap)")
        print(f"raw results: {out}")
        raise SystemExit(1)
    print(f"\nload average {os.getloadavg()[0]:.2f} after; chat requests under {what}:")
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
    for label, after in cuts.items():
        n = results[label].get("completed", "?")
        print(f"{label}: cut after {after} s with {n} chat requests done: its figures are of an overloaded system")
    print(f"raw results: {out}")


if __name__ == "__main__":
    main()
