"""The benchmark's statistics against values computed by hand."""

import math

import pytest

from phasesplit.runtime.bench.metrics import (
    RequestResult,
    describe,
    itls,
    mean_itl,
    parse_slo,
    percentile,
    phase_breakdown,
    summarize,
    summarize_by_kind,
    tpot,
)


def approx(x):
    return pytest.approx(x, rel=1e-9, abs=1e-12)


def test_percentile_interpolates_linearly():
    xs = [4.0, 1.0, 3.0, 2.0]  # unsorted on purpose
    assert percentile(xs, 0) == 1.0
    assert percentile(xs, 100) == 4.0
    assert percentile(xs, 50) == approx(2.5)  # rank 1.5
    assert percentile(xs, 90) == approx(3.7)  # rank 2.7
    assert percentile(xs, 99) == approx(3.97)  # rank 2.97
    assert percentile([5.0], 99) == 5.0
    assert math.isnan(percentile([], 50))
    with pytest.raises(ValueError):
        percentile(xs, 101)


def test_describe():
    d = describe([0.2, 0.6])
    assert d == {"mean": approx(0.4), "p50": approx(0.4), "p90": approx(0.56), "p99": approx(0.596), "count": 2}


def _a():
    return RequestResult(index=0, kind="chat", prompt_len=10, output_len=4, ok=True, status=200, ttft_s=0.2,
                         e2el_s=0.65, chunk_times_s=[0.2, 0.3, 0.5, 0.6], output_tokens=4, server_prompt_tokens=10,
                         phase_timing={"queued": 0.05, "prefill": 0.15, "decode": 0.45})


def _b():
    return RequestResult(index=1, kind="doc", prompt_len=20, output_len=8, ok=True, status=200, ttft_s=0.6,
                         e2el_s=0.7, chunk_times_s=[0.6, 0.64], output_tokens=2, server_prompt_tokens=None,
                         phase_timing={"queued": 0.1, "prefill": 0.5, "kv_transfer": 0.02, "decode": 0.08})


def _c():
    return RequestResult(index=2, kind="chat", prompt_len=10, output_len=4, ok=False, status=500,
                         error="HTTP 500: boom")


def test_per_request_values():
    a, b = _a(), _b()
    assert itls(a) == [approx(0.1), approx(0.2), approx(0.1)]
    assert tpot(a) == approx((0.65 - 0.2) / 3)
    assert mean_itl(a) == approx(0.4 / 3)
    assert tpot(b) == approx(0.1)
    one = RequestResult(0, "x", 1, 1, ok=True, ttft_s=0.1, e2el_s=0.1, chunk_times_s=[0.1], output_tokens=1)
    assert tpot(one) is None and mean_itl(one) is None
    assert tpot(_c()) is None


def test_summary_throughput_and_latency():
    s = summarize([_a(), _b(), _c()], duration_s=2.0)
    assert (s["requests"], s["completed"], s["failed"]) == (3, 2, 1)
    assert s["request_throughput"] == approx(1.0)
    assert s["output_throughput"] == approx(3.0)  # (4 + 2) / 2
    # Prompt tokens: the server's count where given (10), else as built (20).
    assert s["total_token_throughput"] == approx((6 + 30) / 2.0)
    assert s["ttft_s"]["mean"] == approx(0.4)
    assert s["ttft_s"]["p99"] == approx(0.596)
    # ITL pools every gap: [0.1, 0.2, 0.1] and [0.04] -> sorted [0.04, 0.1, 0.1, 0.2].
    assert s["itl_s"]["mean"] == approx(0.11)
    assert s["itl_s"]["p50"] == approx(0.1)
    assert s["itl_s"]["p90"] == approx(0.17)
    assert s["itl_s"]["p99"] == approx(0.197)
    assert s["tpot_s"]["mean"] == approx((0.15 + 0.1) / 2)
    assert s["e2el_s"]["p50"] == approx(0.675)
    assert s["short_outputs"] == 1  # b asked for 8 and got 2
    assert s["prompt_len_mismatches"] == 0
    assert s["errors"] == {"500: HTTP 500: boom": 1}
    assert "goodput" not in s


def test_goodput_and_slo_attainment():
    slo = parse_slo("ttft=500ms,itl=150ms")
    s = summarize([_a(), _b(), _c()], duration_s=2.0, slo=slo)
    # a: ttft 0.2 ok, mean ITL 0.133 ok -> good. b: ttft 0.6 too slow. c failed.
    assert s["goodput"] == approx(0.5)
    assert s["slo_attainment"] == approx(1 / 3)
    assert s["slo_attainment_by_key"] == {"ttft": approx(1 / 3), "itl": approx(2 / 3)}
    # A tighter ITL bound fails a too (0.133 > 0.12).
    assert summarize([_a(), _b(), _c()], 2.0, parse_slo("ttft=500ms,itl=120ms"))["goodput"] == 0.0
    assert summarize([_a()], 1.0, parse_slo("tpot=150ms,e2el=1s"))["goodput"] == approx(1.0)
    assert summarize([_a()], 1.0, parse_slo("e2el=0.6s"))["goodput"] == 0.0


def test_phase_breakdown_means_and_shares():
    p = phase_breakdown([_a(), _b(), _c()])
    assert list(p) == ["queued", "prefill", "decode", "kv_transfer"]
    assert p["queued"]["mean_s"] == approx(0.075)
    assert p["queued"]["mean_share"] == approx((0.05 / 0.65 + 0.1 / 0.7) / 2)
    assert p["kv_transfer"] == {"mean_s": approx(0.02), "mean_share": approx(0.02 / 0.7), "count": 1}
    assert phase_breakdown([_c()]) is None
    assert "phases" not in summarize([_a().__class__(0, "x", 1, 1)], 1.0)


def test_summary_by_kind_only_for_several_kinds():
    by = summarize_by_kind([_a(), _b(), _c()], 2.0)
    assert set(by) == {"chat", "doc"}
    assert by["chat"]["completed"] == 1 and by["chat"]["failed"] == 1
    assert summarize_by_kind([_a()], 1.0) == {}


def test_parse_slo():
    assert parse_slo("ttft=500ms,itl=50ms") == {"ttft": approx(0.5), "itl": approx(0.05)}
    assert parse_slo("e2el=2s, tpot=40") == {"e2el": approx(2.0), "tpot": approx(0.04)}
    for bad in ("", "ttft", "speed=1ms", "ttft=-1ms", "ttft=fast", "ttft=0ms"):
        with pytest.raises(ValueError):
            parse_slo(bad)


def test_result_round_trips_through_dict():
    a = _a()
    assert RequestResult.from_dict(a.to_dict()) == a
