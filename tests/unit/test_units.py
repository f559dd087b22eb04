"""One parser each for durations and SLO strings, one timestamp format, one version."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from phasesplit.operator import api, render
from phasesplit.runtime.units import parse_duration, parse_slo, rfc3339
from phasesplit.runtime.version import VERSION

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("text,bare,seconds", [
    ("500ms", None, 0.5), ("1m30s", None, 90), ("1.5h", None, 5400),
    ("30", "s", 30), ("250", "ms", 0.25), (" 2S ", "s", 2), ("1m 30s", "s", 90), (".5s", "ms", 0.5),
])
def test_durations(text, bare, seconds):
    assert parse_duration(text, bare_unit=bare) == pytest.approx(seconds)


@pytest.mark.parametrize("text,bare", [("5", None), ("1 s", None), ("1S", None), ("-1s", "s"), ("0", "s"),
                                       ("1d", "s"), ("fast", "ms"), ("", "s")])
def test_duration_errors_name_the_syntax(text, bare):
    with pytest.raises(ValueError, match="duration"):
        parse_duration(text, bare_unit=bare)


def test_zero_only_where_allowed():
    assert parse_duration("0", bare_unit="s", allow_zero=True) == 0.0
    assert parse_duration("0ms", bare_unit="s", allow_zero=True) == 0.0


def test_slo_strings():
    assert parse_slo("ttft=500ms, itl=50", ("ttft", "itl")) == {"ttft": pytest.approx(0.5), "itl": pytest.approx(0.05)}
    with pytest.raises(ValueError, match="give every SLO"):
        parse_slo("ttft=500ms", ("ttft", "itl"), require_all=True)
    with pytest.raises(ValueError, match="KEY one of ttft, itl"):
        parse_slo("speed=1s", ("ttft", "itl"))


def test_the_cli_dialects_share_the_parser():
    from phasesplit.operator.sim.cli import parse_duration as sim_duration
    from phasesplit.operator.sim.cli import parse_slo as sim_slo
    from phasesplit.runtime.bench.metrics import parse_slo as bench_slo
    from phasesplit.runtime.cli import parse_seconds

    assert parse_seconds("1m30s") == sim_duration("90") == 90
    assert bench_slo("ttft=0.5s,itl=50") == sim_slo("ttft=500ms,itl=50ms")


def test_rfc3339_is_utc_whole_seconds():
    assert rfc3339(1_700_000_000.9) == "2023-11-14T22:13:20Z"


def test_one_version_everywhere():
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert re.search(r'^version = "(.+)"$', pyproject, re.M).group(1) == VERSION
    chart = yaml.safe_load((ROOT / "charts" / "phasesplit" / "Chart.yaml").read_text())
    assert chart["version"] == chart["appVersion"] == VERSION
    assert api.DEFAULT_RUNTIME_IMAGE.endswith(f":{VERSION}")
    owner = render.Owner("a", "ns", "uid")
    assert render.labels(owner, "router")["app.kubernetes.io/version"] == VERSION
    crd = (ROOT / "crds" / f"{api.GROUP}_{api.PLURAL}.yaml").read_text()
    assert f"default: {api.DEFAULT_RUNTIME_IMAGE}" in crd


def test_cpu_lists_parse_as_taskset_writes_them():
    import argparse

    from phasesplit.runtime.cli import build_parser, cpu_list

    assert cpu_list("1") == (1,) and cpu_list("0,2") == (0, 2) and cpu_list("2-3,0") == (0, 2, 3)
    for bad in ("x", "1-", "a-2", "-1", "3-1", ""):
        with pytest.raises(argparse.ArgumentTypeError, match="CPU"):
            cpu_list(bad)
    serve = build_parser().parse_args(["serve", "--role", "prefill", "--borrow-idle-cpus", "1"])
    assert serve.borrow_idle_cpus == (1,)
    assert build_parser().parse_args(["serve"]).borrow_idle_cpus == ()
    assert build_parser().parse_args(["up", "--pin-cpus"]).borrow_idle_cpus is True  # borrowing is the default
    assert build_parser().parse_args(["up", "--no-borrow-idle-cpus"]).borrow_idle_cpus is False
    # A decode worker pauses for remote prefills only where told (up --pin-cpus tells it).
    assert build_parser().parse_args(["serve", "--role", "decode"]).pause_for_remote_prefill is False
    assert build_parser().parse_args(["up", "--pin-cpus"]).pause_for_remote_prefill is True
    assert build_parser().parse_args(["up", "--no-pause-for-remote-prefill"]).pause_for_remote_prefill is False


def test_up_lends_idle_prefill_workers_unless_the_decode_worker_borrows_their_cores():
    from phasesplit.runtime.cli import build_parser
    from phasesplit.runtime.up import lend_idle_prefill

    asked = [build_parser().parse_args(["up", *flags]).lend_idle_prefill
             for flags in ([], ["--lend-idle-prefill"], ["--no-lend-idle-prefill"])]
    assert asked == [None, True, False]
    assert [lend_idle_prefill(a, borrowing=False) for a in asked] == [True, True, False]
    assert [lend_idle_prefill(a, borrowing=True) for a in asked] == [False, True, False]
