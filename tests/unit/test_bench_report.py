"""Report formatting, the results file and the plots, from hand-made results."""

import json
import math

from phasesplit.runtime.bench.metrics import RequestResult, parse_slo, summarize
from phasesplit.runtime.bench.report import (
    format_by_kind,
    format_summary,
    format_sweep,
    plot_cdfs,
    plot_latency_vs_rate,
    write_json,
)


def _results(scale: float):
    out = []
    for i in range(5):
        t = [scale * (0.1 + 0.01 * i) + 0.02 * k for k in range(4)]
        out.append(RequestResult(i, "fixed", 8, 4, start_s=0.1 * i, ok=True, status=200, ttft_s=t[0],
                                 e2el_s=t[-1] + 0.001, chunk_times_s=t, output_tokens=4, server_prompt_tokens=8))
    out.append(RequestResult(5, "fixed", 8, 4, ok=False, status=503, error="HTTP 503: overloaded"))
    return out


def _runs():
    slo = parse_slo("ttft=150ms")
    return [{"rate": r, "rate_label": lbl, "summary": summarize(_results(r), 2.0, slo), "results": _results(r)}
            for r, lbl in ((1.0, "1"), (2.0, "2"), (math.inf, "inf"))]


def test_format_summary_shows_the_numbers():
    s = summarize(_results(1.0), 2.0, parse_slo("ttft=150ms"))
    text = format_summary(s, "m @ 1 req/s")
    assert "Successful requests:" in text and " 5\n" in text
    assert "Failed requests:" in text
    assert "Mean TTFT (ms):" in text and "120.00" in text  # mean of 100..140 ms
    assert "Goodput (req/s) [ttft<=150ms]:" in text
    assert "error x1: 503: HTTP 503: overloaded" in text


def test_format_sweep_one_row_per_rate():
    lines = format_sweep(_runs()).splitlines()
    assert lines[1].split()[:3] == ["rate", "ok/all", "req/s"]
    assert [ln.split()[0] for ln in lines[3:]] == ["1", "2", "inf"]
    assert lines[3].split()[1] == "5/6"


def test_write_json_round_trips(tmp_path):
    path = tmp_path / "sub" / "r.json"
    write_json(path, {"runs": _runs()})
    doc = json.loads(path.read_text())
    assert doc["runs"][0]["results"][5]["error"] == "HTTP 503: overloaded"
    assert RequestResult.from_dict(doc["runs"][1]["results"][0]) == _results(2.0)[0]
    assert not (tmp_path / "sub" / "r.json.tmp").exists()


def test_plots_are_pngs(tmp_path):
    series = {"a": _runs(), "b": _runs()[:2]}
    for p in (plot_latency_vs_rate(series, tmp_path / "lat.png", "t"), plot_cdfs(series, tmp_path / "cdf.png")):
        data = p.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_format_by_kind():
    text = format_by_kind({"chat": summarize(_results(1.0), 2.0), "doc": summarize(_results(2.0), 2.0)})
    lines = text.splitlines()
    assert lines[1].split()[:2] == ["chat", "n=5"] and lines[2].split()[0] == "doc"
    assert "TTFT p50 120.00" in lines[1]
