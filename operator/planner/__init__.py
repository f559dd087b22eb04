"""Per-phase SLO planner: metrics in, desired prefill and decode replicas and the reasons out.

Pure logic: nothing here does I/O or reads the clock; time comes in with the metrics snapshot
and the `now` argument, so the operator and the simulator run exactly the same code.
"""

from phasesplit.operator.planner.behavior import HPA_BEHAVIOR
from phasesplit.operator.planner.model import DecodeProfile, PerfModel, PrefillProfile
from phasesplit.operator.planner.planner import Decision, PhaseDecision, Planner, PlannerConfig
from phasesplit.operator.planner.snapshot import MetricsSnapshot

__all__ = [
    "HPA_BEHAVIOR",
    "DecodeProfile",
    "Decision",
    "MetricsSnapshot",
    "PerfModel",
    "PhaseDecision",
    "Planner",
    "PlannerConfig",
    "PrefillProfile",
]
