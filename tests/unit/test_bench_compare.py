"""The comparison script's pure parts: it must rewrite only its own section of docs/benchmarks.md."""

import importlib.util
import sys
from pathlib import Path

spec = importlib.util.spec_from_file_location(
    "bench_compare", Path(__file__).resolve().parents[1] / "bench" / "compare.py")
compare = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = compare  # dataclasses look their module up there
spec.loader.exec_module(compare)


def test_splice_appends_then_replaces_only_its_section():
    engine = "# Benchmarks\n\n## Engine\n\nengine numbers\n"
    first = compare.splice(engine, f"{compare.BEGIN}\n## Serving\nv1\n{compare.END}\n")
    assert first.startswith(engine.rstrip("\n"))
    assert "v1" in first
    # The engine engineer adds text after ours; a re-render keeps it and swaps our section.
    edited = first + "\n## Later section\nkept\n"
    second = compare.splice(edited, f"{compare.BEGIN}\n## Serving\nv2\n{compare.END}\n")
    assert "v1" not in second and "v2" in second
    assert "engine numbers" in second and "## Later section\nkept" in second
    assert second.count(compare.BEGIN) == 1 and second.count(compare.END) == 1


def test_splice_into_empty_doc():
    out = compare.splice("", f"{compare.BEGIN}\nx\n{compare.END}\n")
    assert out.startswith("# Benchmarks\n\n" + compare.BEGIN)


def test_prompts_per_point_are_bounded():
    assert compare.n_prompts(0.1, 1.0) == compare.MIN_PROMPTS
    assert compare.n_prompts(0.5, 1.0) == 15
    assert compare.n_prompts(100.0, 1.0) == compare.MAX_PROMPTS


def test_a_fast_rate_still_lasts_twice_the_ttft_target():
    # 48 requests at 21.6 req/s arrive in 2.2 s: a burst an 8 s TTFT target never sees queued.
    assert compare.n_prompts(21.6, 1.0, 8.0) == 346  # 16 s of arrivals
    assert compare.n_prompts(2.0, 1.0, 8.0) == compare.MAX_PROMPTS  # 24 s already
    assert compare.n_prompts(1000.0, 1.0, 8.0) == compare.SPAN_PROMPTS
    assert compare.slo_ttft("ttft=8s,itl=150ms") == 8.0 and compare.slo_ttft("itl=50ms") == 0.0


def _pts(*specs):
    return [compare.PointResult(rate, good, met, cut) for rate, good, met, cut in specs]


def test_a_sweep_goes_on_while_goodput_grows_and_stops_past_the_knee():
    assert not compare.sweep_done([])
    rising = _pts((0.25, 0.25, 1.0, False), (0.38, 0.37, 1.0, False), (0.56, 0.50, 0.9, False))
    assert not compare.sweep_done(rising)
    # Goodput below 0.8x the best so far: past the knee, which is the best point.
    fallen = rising + _pts((0.84, 0.35, 0.6, False))
    assert compare.sweep_done(fallen)
    assert compare.knee(fallen) == 0.56
    # A cut point or one where most requests miss ends it at once, even early.
    assert compare.sweep_done(_pts((0.25, 0.25, 1.0, False), (0.38, 0.0, 0.1, True)))
    assert compare.sweep_done(_pts((0.25, 0.05, 0.2, False)))
    # A noisy dip within 0.8x does not, and the sweep is bounded.
    assert not compare.sweep_done(rising + _pts((0.84, 0.45, 0.8, False)))
    many = _pts(*[(0.1 * 1.5 ** i, 0.1 * 1.5 ** i, 1.0, False) for i in range(compare.MAX_SWEEP)])
    assert compare.sweep_done(many) and not compare.sweep_done(many[:-1])


def test_the_knee_prefers_the_lower_rate_on_a_tie_and_rates_step_geometrically():
    assert compare.knee([]) is None
    assert compare.knee(_pts((0.5, 0.4, 1.0, False), (0.75, 0.4, 0.6, False))) == 0.5
    assert compare.next_rate(0.25) == 0.375 and compare.next_rate(0.375) == 0.562


def test_each_point_sends_its_own_prompts_and_systems_share_them():
    seeds = {(w, r, rep): compare.point_seed(w, r, rep) for w in compare.WORKLOADS for r in (0.25, 0.375, 0.562)
             for rep in (1, 2, 3)}
    assert len(set(seeds.values())) == len(seeds)  # a server serving points in a row never sees a prompt again
    assert compare.point_seed("mixed", 0.375, 2) == compare.point_seed("mixed", 0.375, 2)
    system = compare.systems(8000)["split"]
    cmd = compare.bench_command(system, "http://x", "mixed", 0.375, 8, Path("o.json"), rep=2)
    assert cmd[cmd.index("--seed") + 1] == str(compare.point_seed("mixed", 0.375, 2))


def test_slos_per_workload_replace_the_defaults_and_reach_the_bench():
    default = compare.workload_slos(None)
    assert all(v == compare.SLOS for v in default.values())
    slos = compare.workload_slos(["standard=ttft=8s,itl=150ms", "tight=ttft=4s,itl=75ms",
                                  "decode-heavy:standard=ttft=2s,itl=100ms"])
    assert slos["mixed"] == {"standard": "ttft=8s,itl=150ms", "tight": "ttft=4s,itl=75ms"}
    assert slos["decode-heavy"] == {"standard": "ttft=2s,itl=100ms"}  # a workload's own replace the rest
    assert compare.first_slo(slos["mixed"]) == "ttft=8s,itl=150ms"
    cmd = compare.bench_command(compare.systems(8000)["split"], "http://x", "mixed", 0.5, 8, Path("o.json"),
                                slo=compare.first_slo(slos["mixed"]))
    assert cmd[cmd.index("--slo") + 1] == "ttft=8s,itl=150ms"
    for bad in ("standard", "nope:standard=ttft=1s", "standard=ttft=8q", "=ttft=1s"):
        try:
            compare.workload_slos([bad])
        except ValueError as e:
            assert "--slo" in str(e) or "bad SLO" in str(e)
        else:
            raise AssertionError(f"{bad!r} was accepted")


def test_the_slo_flags_give_the_same_slos_back():
    assert compare.slo_flags(compare.workload_slos(None)) == []
    given = ["standard=ttft=8s,itl=150ms", "tight ITL=ttft=4s,itl=75ms",
             "decode-heavy:standard=ttft=2s,itl=100ms", "decode-heavy:tight ITL=ttft=2s,itl=50ms"]
    slos = compare.workload_slos(given)
    flags = compare.slo_flags(slos)
    assert flags[1::2] == given
    assert compare.workload_slos(flags[1::2]) == slos


def test_the_sweep_reads_goodput_as_the_offered_rate_met_not_the_runs_length(tmp_path):
    """Two runs of one rate, every request within the SLO, one twice as long (a late Poisson
    arrival): the same goodput for the sweep, so a short run cannot end it below the knee."""
    import json

    def point(name: str, duration: float, attained: float) -> Path:
        summary = {"requests": 10, "slo_attainment": attained, "goodput": 10 * attained / duration}
        path = tmp_path / name
        path.write_text(json.dumps({"runs": [{"planned": 10, "summary": summary}], "error": None}))
        return path

    short, long_ = (compare._point_result(point(n, d, 1.0), 0.5, 0) for n, d in (("a", 15.0), ("b", 30.0)))
    assert short.goodput == long_.goodput == 0.5 and short.attainment == 1.0
    assert compare._point_result(point("c", 20.0, 0.4), 0.5, 0).goodput == 0.2
    assert compare._point_result(tmp_path / "missing", 0.5, 1).cut


def test_the_tables_count_goodput_as_the_sweep_does():
    """The rendered goodput of a run is the offered rate x the share of planned requests within
    the SLO, whatever the run's length; a request that failed or missed a target counts against it."""
    from phasesplit.runtime.bench.metrics import RequestResult

    def req(i: int, ttft: float, ok: bool = True) -> RequestResult:
        return RequestResult(index=i, kind="chat", prompt_len=64, output_len=4, ok=ok, ttft_s=ttft,
                             chunk_times_s=[ttft, ttft + 0.05, ttft + 0.1, ttft + 0.15])

    results = [req(i, 0.2) for i in range(7)] + [req(7, 3.0), req(8, 0.2, ok=False)]
    for duration in (10.0, 40.0):
        run = {"planned": 10, "results": results, "summary": {"requests": 9, "duration_s": duration}}
        good, met = compare._goodput(run, 2.0, "ttft=1s,itl=100ms")
        assert met == 0.7 and abs(good - 1.4) < 1e-9
    assert compare._goodput(run, 2.0, "ttft=4s,itl=100ms")[1] == 0.8
    assert compare._goodput(run, 2.0, "ttft=4s,itl=40ms")[1] == 0.0


def test_capacity_is_the_last_rate_before_attainment_first_falls_below_the_target():
    assert compare.slo_capacity({0.5: 1.0, 1.0: 0.95, 1.5: 0.6, 2.25: 0.92}) == (1.0, False)  # a lucky point after
    assert compare.slo_capacity({0.5: 1.0, 1.0: 0.95}) == (1.0, True)  # never fell: at least 1.0
    assert compare.slo_capacity({0.5: 0.5, 1.0: 1.0}) == (None, False)
    assert compare.slo_capacity({}) == (None, True)


def test_a_split_is_told_the_tightest_itl_target_it_is_judged_by():
    slos = {"standard": "ttft=8s,itl=150ms", "tight ITL": "ttft=4s,itl=75ms"}
    systems = compare.systems(0)
    assert compare.server_flags(systems["adaptive"], slos) == ["--itl-target", "0.075"]
    assert compare.server_flags(systems["split"], slos) == ["--itl-target", "0.075"]
    assert compare.server_flags(systems["colocated"], slos) == []
    assert compare.server_flags(systems["split"], {"standard": "ttft=2s"}) == []
