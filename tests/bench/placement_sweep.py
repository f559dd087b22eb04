"""Split with adaptive placement vs colocated, past the knee of one workload (issue 19 points 1, 3).

    ~/.cache/phasesplit/venv/bin/python tests/bench/placement_sweep.py \
        [--input-len 512 --output-len 16 | --workload mixed] [--rates 0.45,0.7,1.0 --reps 3 --num-prompts 20]

Equal cores: `phasesplit up --colocated` (one worker on both cores) against `phasesplit up
--pin-cpus --prefill-placement adaptive --itl-target T` (a prefill worker on one core, a decode
worker on the other that prefills a prompt itself when that finishes it sooner within T). The
systems alternate, each run driving every rate in turn with `phasesplit bench`, so noise from the
shared machine falls on both; the repetitions show how large it is.

Each split worker borrows the other's core while it idles (`up --pin-cpus` gives it
`--borrow-idle-cpus`), and so the router lends idle prefill workers no whole requests
(`--lend-idle-prefill`, routing.lend_prefill; up.lend_idle_prefill): `split-lend` is split with
lending, `split-nolend` split with it refused explicitly, `split-noborrow` split without borrowing
(so with lending), and `split-nopause` split whose decode worker never leaves its core to a
remote prefill (`up --no-pause-for-remote-prefill`; LLMEngine.remote_pause).

Printed per rate, system and repetition: completed requests/s, TTFT p50/p90, pooled ITL p90/p99,
goodput under each --slo (the bench's own definition: TTFT and the request's mean ITL within
the targets, per second of the run) and how many measured requests were prefilled by the worker
that decoded them (their server timing has no KV transfer: the decode worker's local prefills and
the prefill worker's lent requests; the lent ones of each whole run are printed as it ends). Then
the median goodput ratio per rate.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from phasesplit.runtime.bench.metrics import RequestResult, parse_slo, summarize  # noqa: E402
from tests.bench.compare import WORKLOADS  # noqa: E402
from tests.bench.engine_peers import load1  # noqa: E402
from tests.bench.interference import run_one  # noqa: E402


def rows_of(doc: dict, slos: dict[str, dict[str, float]]) -> list[dict]:
    """One row per rate of a bench JSON."""
    rows = []
    for run in doc["runs"]:
        results = [RequestResult.from_dict(r) for r in run["results"]]
        duration = run["summary"]["duration_s"]
        s = summarize(results, duration)
        ok = [r for r in results if r.ok]
        row = {"rate": run["rate"], "done": len(ok), "sent": len(results), "req_s": s["request_throughput"],
               "ttft_p50": s["ttft_s"]["p50"], "ttft_p90": s["ttft_s"]["p90"],
               "itl_p90": s["itl_s"]["p90"], "itl_p99": s["itl_s"]["p99"],
               "local": sum(1 for r in ok if r.phase_timing and "kv_transfer" not in r.phase_timing)}
        for name, slo in slos.items():
            row[name] = summarize(results, duration, slo)["goodput"]
        rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--workload", choices=sorted(WORKLOADS), default=None,
                    help="one of compare.py's workloads instead of --input-len/--output-len (e.g. mixed: "
                         "chats with 20 %% 1,536-token documents)")
    ap.add_argument("--rates", default="0.45,0.7,1.0", help="request rates, each a run of --num-prompts")
    ap.add_argument("--num-prompts", type=int, default=20)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--itl-target", default="150ms", help="the split decode worker's --itl-target")
    ap.add_argument("--slo", action="append", default=None, metavar="NAME=SPEC",
                    help="goodput SLO, repeatable (default: standard=ttft=8s,itl=150ms and "
                         "tight=ttft=4s,itl=75ms: the usual SLO scaled to a 2-core CPU, where a "
                         "512-token prompt takes about a second on one core)")
    ap.add_argument("--port", type=int, default=8320)
    ap.add_argument("--systems", default="colocated,split",
                    help="comma-separated, in run order: colocated, split, split-nolend (split without "
                         "lending idle prefill workers whole requests), split-noborrow (split whose workers "
                         "compute on their own core only: up --no-borrow-idle-cpus), split-nopause (split whose "
                         "decode worker never pauses for a remote prefill: up --no-pause-for-remote-prefill)")
    ap.add_argument("--out", type=Path, default=None, help="folder for the bench JSONs (default: a temporary one)")
    a = ap.parse_args()
    specs = a.slo or ["standard=ttft=8s,itl=150ms", "tight=ttft=4s,itl=75ms"]
    slos = {}
    for spec in specs:
        name, _, text = spec.partition("=")
        slos[name] = parse_slo(text)
    out = a.out or Path(tempfile.mkdtemp(prefix="phasesplit-placement-sweep-"))
    out.mkdir(parents=True, exist_ok=True)
    split = ["--pin-cpus", "--prefill-placement", "adaptive", "--itl-target", a.itl_target]
    known = {"colocated": ["--colocated"], "split": split, "split-nolend": [*split, "--no-lend-idle-prefill"],
             "split-lend": [*split, "--lend-idle-prefill"],
             "split-noborrow": [*split, "--no-borrow-idle-cpus"],
             "split-nopause": [*split, "--no-pause-for-remote-prefill"]}
    systems = {name: known[name] for name in a.systems.split(",")}
    if not {"colocated", "split"} <= set(systems):
        raise SystemExit("--systems must include colocated and split (the ratio printed is theirs)")
    shape = (WORKLOADS[a.workload] if a.workload else
             ["--input-len", str(a.input_len), "--output-len", str(a.output_len), "--range-ratio", "0"])
    bench = ["--tokenizer", "smollm2", *shape, "--request-rate", a.rates, "--num-prompts", str(a.num_prompts),
             "--warmup", "2", "--seed", "3", "--timeout", "400"]
    table = []
    for rep in range(1, a.reps + 1):
        for name, up_args in systems.items():
            before = load1()
            t0 = time.strftime("%H:%M:%S", time.gmtime())
            doc = run_one(f"{name}_{rep}", up_args, bench, out, a.port)
            cond = f"{t0} UTC, load {before:.1f} -> {load1():.1f}"
            print(f"[placement_sweep] {name} rep {rep}: {cond}", flush=True)
            print(f"[placement_sweep] {name} rep {rep}: {doc.get('lent', 0)} requests lent to the prefill worker "
                  "(the whole run, warm-up included)", flush=True)
            table += [{"system": name, "rep": rep, "when": cond, "lent": doc.get("lent", 0), **r}
                      for r in rows_of(doc, slos)]
    names = list(slos)
    print(f"\nSLOs: {'; '.join(specs)}; JSONs in {out}\n")
    print("| rate | system | rep | done | req/s | TTFT p50 ms | TTFT p90 ms | ITL p90 ms | ITL p99 ms | "
          + " | ".join(f"goodput {n}" for n in names) + " | prefilled where decoded |")
    print("| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | " + " | ".join("---:" for _ in names)
          + " | ---: |")
    for r in sorted(table, key=lambda r: (r["rate"], r["rep"], r["system"])):
        local = f"{r['local']} of {r['done']}" if r["system"] != "colocated" else "-"
        print(f"| {r['rate']:g} | {r['system']} | {r['rep']} | {r['done']}/{r['sent']} | {r['req_s']:.2f} "
              f"| {r['ttft_p50'] * 1e3:.0f} | {r['ttft_p90'] * 1e3:.0f} | {r['itl_p90'] * 1e3:.0f} "
              f"| {r['itl_p99'] * 1e3:.0f} | " + " | ".join(f"{r[n]:.3f}" for n in names) + f" | {local} |")
    print("\nmedian goodput, split / colocated:")
    for rate in sorted({r["rate"] for r in table}):
        parts = []
        for n in names:
            med = {s: statistics.median(r[n] for r in table if r["rate"] == rate and r["system"] == s)
                   for s in systems}
            ratio = f"{med['split'] / med['colocated']:.2f}x" if med["colocated"] else "colocated 0"
            extra = "".join(f", {s} {med[s]:.3f}" for s in systems if s not in ("split", "colocated"))
            parts.append(f"{n} {med['split']:.3f} vs {med['colocated']:.3f} ({ratio}{extra})")
        print(f"  {rate:g} req/s: " + "; ".join(parts))


if __name__ == "__main__":
    main()
