"""The worker gauges the planner reads, from engine state (no model needed)."""

from __future__ import annotations

import argparse
from types import SimpleNamespace

from phasesplit.runtime import metric_names as names
from phasesplit.runtime.engine.engine import LLMEngine
from phasesplit.runtime.server import worker


class _Engine:
    model_name = "stub"

    def __init__(self, *args, **kwargs) -> None:
        self.scheduler = SimpleNamespace(running=[1, 2, 3], waiting=[4], waiting_tokens=700)
        self.remote_waiting = [5, 6]  # split decode: waiting for KV blocks before their prefill
        self.blocks = SimpleNamespace(usage=0.5)

    num_waiting = LLMEngine.num_waiting  # the engine's own definition, over this state


def test_decode_waiting_gauge_counts_requests_waiting_to_reserve_kv(monkeypatch):
    monkeypatch.setattr(worker, "LLMEngine", _Engine)
    monkeypatch.setattr(worker, "engine_config", lambda args, phase="both": None)
    args = argparse.Namespace(model="stub", served_model_name=None)
    _, metrics, _ = worker.build_engine(args, "decode")
    value = metrics.registry.get_sample_value(names.WAITING,
                                              {"model": "stub", "phase": "decode"})
    assert value == 3  # one preempted + two waiting for their reservation


def test_adaptive_decode_worker_keeps_its_itl_target_in_its_steps():
    """Only a decode worker placing prompts adaptively cuts its prompt chunks to --itl-target;
    static placement, colocated and prefill workers keep the whole token budget, as does 0 (a
    prefill worker serving requests the router lent it too: routing.lend_prefill)."""
    from phasesplit.runtime.cli import build_parser

    def config(phase: str, *flags: str):
        args = build_parser().parse_args(["serve", "--role", phase, *flags])
        return worker.engine_config(args, phase)

    assert config("decode", "--prefill-placement", "adaptive", "--itl-target", "150ms").itl_target_s == 0.15
    assert config("decode", "--prefill-placement", "adaptive").itl_target_s == 0.1  # the default target
    assert config("decode", "--prefill-placement", "adaptive", "--itl-target", "0").itl_target_s is None
    assert config("decode").itl_target_s is None  # static placement
    assert config("both", "--prefill-placement", "adaptive").itl_target_s is None
    assert config("prefill", "--prefill-placement", "adaptive").itl_target_s is None
