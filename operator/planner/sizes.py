"""Request sizes over the recent past: the work per request that capacity is held for.

One window's mean prompt length is noisy (a 15 s window of lognormal prompts moves it by
±10 %), and headroom sized from the largest of those means keeps a replica too many through
every lull. Capacity held for a remembered burst is sized from the mean over the last
`horizon` requests instead (a burst's requests are the same kind as the lull's). Pure.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


@dataclass
class RequestSizes:
    horizon: float = 2000.0  # requests to average over
    windows: deque[tuple[float, float, float]] = field(default_factory=deque)  # (requests, prompt, output)

    def observe(self, requests: float, prompt_mean: float | None, output_mean: float | None) -> None:
        """Add one window: its request count and mean prompt/output tokens (None: not seen)."""
        if requests <= 0 or not prompt_mean:
            return
        self.windows.append((requests, prompt_mean, output_mean if output_mean is not None else float("nan")))
        total = sum(n for n, _, _ in self.windows)
        while len(self.windows) > 1 and total - self.windows[0][0] >= self.horizon:
            total -= self.windows.popleft()[0]

    def prompt(self) -> float | None:
        n = sum(w for w, _, _ in self.windows)
        return sum(w * p for w, p, _ in self.windows) / n if n else None

    def output(self) -> float | None:
        seen = [(w, o) for w, _, o in self.windows if o == o]
        n = sum(w for w, _ in seen)
        return sum(w * o for w, o in seen) / n if n else None
