"""What the user sees: a progress bar, summary tables, the results JSON and PNG plots.

Formatting functions are pure (summary in, text out); file writers take explicit paths.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

from .metrics import PERCENTILES, RequestResult, itls

AZURE_ATTRIBUTION = (
    "Workload from the Azure LLM inference trace 2023 (Azure Public Dataset, CC BY 4.0); "
    "Patel et al., \"Splitwise: Efficient generative LLM inference using phase splitting\", ISCA 2024."
)


def progress(total: int, desc: str, enabled: bool = True):
    """A tqdm bar on stderr; tqdm is imported here so the CLI module stays light."""
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="req", disable=not enabled, leave=False, dynamic_ncols=True)


def rate_label(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


def _ms(x: float) -> str:
    return "-" if x is None or math.isnan(x) else f"{x * 1000:.2f}"


def format_summary(s: Mapping, title: str) -> str:
    """One run's summary, laid out like vLLM's benchmark so the numbers are easy to compare."""
    w = 50
    lines = [f" {title} ".center(w + 12, "=")]

    def row(name: str, value: object) -> None:
        lines.append(f"{name:<{w}}{value}")

    row("Successful requests:", s["completed"])
    row("Failed requests:", s["failed"])
    row("Benchmark duration (s):", f"{s['duration_s']:.2f}")
    row("Total input tokens:", s["total_prompt_tokens"])
    row("Total generated tokens:", s["total_output_tokens"])
    row("Request throughput (req/s):", f"{s['request_throughput']:.2f}")
    row("Output token throughput (tok/s):", f"{s['output_throughput']:.2f}")
    row("Total token throughput (tok/s):", f"{s['total_token_throughput']:.2f}")
    if "goodput" in s:
        slo = ", ".join(f"{k}<={v * 1000:g}ms" for k, v in s["slo"].items())
        row(f"Goodput (req/s) [{slo}]:", f"{s['goodput']:.2f}")
        row("SLO attainment (all SLOs):", f"{s['slo_attainment'] * 100:.1f}%")
        for k, v in s["slo_attainment_by_key"].items():
            row(f"  {k}:", f"{v * 100:.1f}%")
    for key, name in (("ttft_s", "Time to First Token"), ("tpot_s", "Time per Output Token (excl. 1st token)"),
                      ("itl_s", "Inter-token Latency"), ("e2el_s", "End-to-end Latency")):
        short = key[:-2].upper()
        lines.append(f" {name} ".center(w + 12, "-"))
        d = s[key]
        row(f"Mean {short} (ms):", _ms(d["mean"]))
        for p in PERCENTILES:
            row(f"P{p} {short} (ms):", _ms(d[f"p{p}"]))
    if "phases" in s:
        lines.append(" Server-reported phases (mean) ".center(w + 12, "-"))
        for name, d in s["phases"].items():
            row(f"{name} (ms, share of E2EL):", f"{_ms(d['mean_s'])}  {d['mean_share'] * 100:.1f}%")
    if s.get("cached_prompt_tokens"):
        row("Prompt tokens served from prefix cache:", s["cached_prompt_tokens"])
    if s["short_outputs"]:
        lines.append(f"note: {s['short_outputs']} requests ended before max_tokens (the server may ignore ignore_eos)")
    if s["prompt_len_mismatches"]:
        lines.append(f"note: the server counted a different prompt length for {s['prompt_len_mismatches']} "
                     "requests (tokenizer mismatch?)")
    for err, n in s["errors"].items():
        lines.append(f"error x{n}: {err}")
    lines.append("=" * (w + 12))
    return "\n".join(lines)


def format_sweep(runs: Sequence[Mapping]) -> str:
    """One line per request rate: the table to read a sweep from."""
    has_slo = any("goodput" in r["summary"] for r in runs)
    head = ["rate", "ok/all", "req/s", "out tok/s", "TTFT p50", "TTFT p99", "ITL p50", "ITL p99", "TPOT p50"]
    if has_slo:
        head += ["goodput", "SLO ok"]
    rows = [head]
    for run in runs:
        s = run["summary"]
        row = [run["rate_label"], f"{s['completed']}/{s['requests']}", f"{s['request_throughput']:.2f}",
               f"{s['output_throughput']:.1f}", _ms(s["ttft_s"]["p50"]), _ms(s["ttft_s"]["p99"]),
               _ms(s["itl_s"]["p50"]), _ms(s["itl_s"]["p99"]), _ms(s["tpot_s"]["p50"])]
        if has_slo:
            row += [f"{s['goodput']:.2f}", f"{s['slo_attainment'] * 100:.0f}%"] if "goodput" in s else ["-", "-"]
        rows.append(row)
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(head))]
    out = ["  ".join(str(c).rjust(wd) for c, wd in zip(r, widths, strict=True)) for r in rows]
    out.insert(1, "  ".join("-" * wd for wd in widths))
    return "latencies in ms\n" + "\n".join(out)


def format_by_kind(by_kind: Mapping[str, Mapping]) -> str:
    """Per request class (chat vs doc in the mixed workload): where the pooled numbers come from."""
    lines = ["per request class (ms):"]
    for kind, s in by_kind.items():
        lines.append(f"  {kind:<6} n={s['completed']:<4} TTFT p50 {_ms(s['ttft_s']['p50'])}  p99 {_ms(s['ttft_s']['p99'])}"
                     f"   ITL p50 {_ms(s['itl_s']['p50'])}  p99 {_ms(s['itl_s']['p99'])}"
                     f"   TPOT p50 {_ms(s['tpot_s']['p50'])}")
    return "\n".join(lines)


def write_json(path: str | Path, doc: Mapping) -> None:
    """Write atomically (temp file + rename) so an interrupted run never leaves half a file."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(p.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1, default=_json_default, allow_nan=True))
    os.replace(tmp, p)


def _json_default(o: object) -> object:
    if isinstance(o, RequestResult):
        return o.to_dict()
    raise TypeError(f"cannot serialise {type(o).__name__}")


# ---------------------------------------------------------------- plots

# series: label -> list of runs, each {"rate": float, "summary": {...}, "results": [RequestResult]}
Series = Mapping[str, Sequence[Mapping]]


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _by_rate(runs: Sequence[Mapping]) -> list[Mapping]:
    return sorted(runs, key=lambda r: r["rate"])  # inf sorts last


def _plain_log_axis(axis) -> None:
    """Log scale with plain numbers (50, 100, 200) instead of 5x10^1 labels that collide."""
    from matplotlib.ticker import FuncFormatter

    axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    # Label the 2s and 5s between decades when there are few decades; more would overlap.
    lo, hi = axis.get_view_interval()
    few = lo > 0 and hi / lo < 10**2.5
    axis.set_minor_formatter(FuncFormatter(lambda v, _: f"{v:g}" if few and f"{v:.0e}"[0] in "25" else ""))


def plot_latency_vs_rate(series: Series, path: str | Path, title: str = "") -> Path:
    """TTFT and ITL p50/p90/p99 against the offered request rate, one colour per series.
    Runs at rate inf have no place on a rate axis and are left out (the tables show them)."""
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    styles = {50: "-", 90: "--", 99: ":"}
    for ax, key, name in ((axes[0], "ttft_s", "TTFT"), (axes[1], "itl_s", "ITL")):
        for i, (label, runs) in enumerate(series.items()):
            runs = [r for r in _by_rate(runs) if not math.isinf(r["rate"])]
            xs = [r["rate"] for r in runs]
            for p in PERCENTILES:
                ys = [r["summary"][key][f"p{p}"] * 1000 for r in runs]
                ax.plot(xs, ys, styles[p], marker="o", color=f"C{i}", label=f"{label} p{p}")
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel(f"{name} (ms)")
        ax.set_yscale("log")
        _plain_log_axis(ax.yaxis)
        ax.grid(True, which="both", alpha=0.3)
        ax.set_title(f"{name} percentiles vs request rate")
    axes[1].legend(fontsize=7, ncol=1)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return _save(fig, plt, path)


def _cdf(ax, values: Sequence[float], **kw) -> None:
    xs = sorted(v * 1000 for v in values)
    if xs:
        ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", **kw)


def plot_cdfs(series: Series, path: str | Path, title: str = "") -> Path:
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    n_lines = sum(len(runs) for runs in series.values())
    k = 0
    for label, runs in series.items():
        for run in _by_rate(runs):
            ok = [r for r in run["results"] if r.ok]
            name = f"{label} @ {rate_label(run['rate'])}/s" if len(series) > 1 else f"{rate_label(run['rate'])} req/s"
            color = plt.cm.viridis(k / max(1, n_lines - 1)) if len(series) == 1 else None
            _cdf(axes[0], [r.ttft_s for r in ok if r.ttft_s is not None], label=name, color=color)
            _cdf(axes[1], [g for r in ok for g in itls(r)], label=name, color=color)
            k += 1
    for ax, name in ((axes[0], "TTFT"), (axes[1], "ITL")):
        ax.set_xscale("log")
        _plain_log_axis(ax.xaxis)
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel("fraction of " + ("requests" if name == "TTFT" else "token gaps"))
        ax.grid(True, which="both", alpha=0.3)
        ax.set_title(f"{name} CDF")
    axes[1].legend(fontsize=7)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return _save(fig, plt, path)


def _save(fig, plt, path: str | Path) -> Path:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(p, dpi=110)
    plt.close(fig)
    return p
