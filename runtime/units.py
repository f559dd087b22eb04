"""Durations, SLO strings and timestamps as the operator, the CLI, the bench tool and the simulator
write them: one parser each (standard library only, so every command line may import it).

Two duration dialects share one grammar, a sequence of NUMBER UNIT with units ms, s, m, h:
- strict (`bare_unit=None`): the CRD's syntax (`500ms`, `1m30s`), matched by DURATION_PATTERN,
  which the API server enforces with the same regular expression;
- lenient (a `bare_unit`): what people type on a command line: case and surrounding blanks are
  ignored and a bare number is read in `bare_unit` (seconds for timeouts, milliseconds for SLOs).
"""

from __future__ import annotations

import datetime
import re
from collections.abc import Iterable

# RE2 (Kubernetes) and Python `re` must both accept this pattern: no lookarounds.
DURATION_PATTERN = r"^([0-9]+(\.[0-9]+)?(ms|s|m|h))+$"
_LENIENT = re.compile(r"^(([0-9]*\.?[0-9]+)\s*(ms|s|m|h)\s*)+$")
_PART = re.compile(r"([0-9]*\.?[0-9]+)\s*(ms|s|m|h)")
_BARE = re.compile(r"^[0-9]*\.?[0-9]+$")
UNIT_SECONDS = {"ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_duration(text: str, bare_unit: str | None = None, allow_zero: bool = False) -> float:
    """Seconds in a duration such as `500ms`, `30s`, `1m30s`; a bare number only with bare_unit.

    Raises ValueError naming the accepted syntax; zero only with allow_zero (never negative).
    """
    hint = "use e.g. 500ms, 30s, 1m30s" + (f", or a number of {bare_unit}" if bare_unit else "")
    if bare_unit is None:
        if not re.fullmatch(DURATION_PATTERN, text):
            raise ValueError(f"not a duration: {text!r} ({hint})")
        parts = _PART.findall(text)
    else:
        s = text.strip().lower()
        if _BARE.match(s):
            parts = [(s, bare_unit)]
        elif _LENIENT.match(s):
            parts = _PART.findall(s)
        else:
            raise ValueError(f"not a duration: {text!r} ({hint})")
    seconds = sum(float(n) * UNIT_SECONDS[u] for n, u in parts)
    if seconds <= 0 and not (allow_zero and seconds == 0):
        raise ValueError(f"duration must be positive: {text!r}")
    return seconds


def parse_slo(text: str, keys: Iterable[str], require_all: bool = False) -> dict[str, float]:
    """'ttft=500ms,itl=50ms' -> {'ttft': 0.5, 'itl': 0.05} (seconds). A bare number is milliseconds.

    keys: the SLO names allowed; require_all: every one of them must be given.
    """
    keys = tuple(keys)
    out: dict[str, float] = {}
    for part in text.split(","):
        if not part.strip():
            continue
        key, sep, value = part.partition("=")
        key = key.strip().lower()
        if not sep or key not in keys:
            raise ValueError(f"bad SLO {part.strip()!r}: use KEY=DURATION with KEY one of {', '.join(keys)}")
        try:
            out[key] = parse_duration(value, bare_unit="ms")
        except ValueError:
            raise ValueError(f"bad SLO duration {value.strip()!r} for {key}: use e.g. 500ms or 0.5s") from None
    example = ",".join(f"{k}=500ms" for k in keys[:2])
    if not out:
        raise ValueError(f"empty SLO: use e.g. {example}")
    if require_all and set(out) != set(keys):
        raise ValueError(f"give every SLO ({', '.join(keys)}), e.g. {example}")
    return out


def rfc3339(t: float) -> str:
    """A Unix time as Kubernetes writes timestamps: UTC, whole seconds, `Z`."""
    return datetime.datetime.fromtimestamp(t, datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
