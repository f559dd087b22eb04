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
    monkeypatch.setattr(worker, "engine_config", lambda args: None)
    args = argparse.Namespace(model="stub", served_model_name=None)
    _, metrics, _ = worker.build_engine(args, "decode")
    value = metrics.registry.get_sample_value(names.WAITING,
                                              {"model": "stub", "phase": "decode"})
    assert value == 3  # one preempted + two waiting for their reservation
