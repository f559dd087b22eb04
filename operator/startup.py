"""Measured replica start-up: pod creation to Ready, per phase, as a rolling median. Pure.

The planner's reaction time is the start-up of a new replica plus its interval: how long capacity
ordered now takes to serve. A fixed profile value is wrong wherever images are cached or not,
models are converted on start, or nodes are busy; the operator measures it instead from the pods
it watches (controller.py), shows it in status (`status.<phase>.startupSeconds`) and hands it to
the planner (Planner.use_startup).

A pod counts once, the first time it is seen Ready, as its Ready condition's lastTransitionTime
minus its creationTimestamp (both whole seconds, as the API server writes them). A pod whose
container has restarted is not counted: its Ready time is that of the restart, not the start.
"""

from __future__ import annotations

import datetime
import statistics
from collections import OrderedDict, deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

WINDOW = 5  # pods per phase in the rolling median
SEEN = 256  # pod uids remembered per service (a pod is counted once)


def _time(text: str | None) -> float | None:
    if not text:
        return None
    try:
        return datetime.datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def pod_startup(pod: Mapping[str, Any]) -> float | None:
    """Seconds from the pod's creation to its first Ready, or None (not Ready, restarted, or a
    timestamp missing)."""
    meta, status = pod.get("metadata") or {}, pod.get("status") or {}
    if meta.get("deletionTimestamp"):
        return None
    if any((c.get("restartCount") or 0) > 0 for c in status.get("containerStatuses") or []):
        return None
    ready = next((c for c in status.get("conditions") or [] if c.get("type") == "Ready"), None)
    if ready is None or ready.get("status") != "True":
        return None
    created, since = _time(meta.get("creationTimestamp")), _time(ready.get("lastTransitionTime"))
    if created is None or since is None or since < created:
        return None
    return since - created


@dataclass
class StartupTimes:
    """One service's measured start-ups: the last WINDOW per phase, and the pods counted."""

    phases: dict[str, deque[float]] = field(default_factory=dict)
    seen: OrderedDict[str, None] = field(default_factory=OrderedDict)

    def observe(self, phase: str, uid: str, pod: Mapping[str, Any]) -> bool:
        """Count this pod's start-up if it is Ready and not counted yet; whether it was counted."""
        if not uid or uid in self.seen:
            return False
        seconds = pod_startup(pod)
        if seconds is None:
            return False
        self.seen[uid] = None
        while len(self.seen) > SEEN:
            self.seen.popitem(last=False)
        self.phases.setdefault(phase, deque(maxlen=WINDOW)).append(seconds)
        return True

    def median(self, phase: str) -> float | None:
        times = self.phases.get(phase)
        return statistics.median(times) if times else None

    def medians(self) -> dict[str, float]:
        return {p: m for p in self.phases if (m := self.median(p)) is not None}
