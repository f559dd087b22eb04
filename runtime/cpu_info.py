"""This machine's CPU as /proc/cpuinfo describes it: the one reader for the engine (which dtype),
the kernel builder (which libraries can run) and the benchmarks (what a table speaks for).
Torch-free."""

from __future__ import annotations

import platform
from pathlib import Path

CPUINFO = Path("/proc/cpuinfo")


def read() -> str:
    """The file's text; empty where there is none (not Linux)."""
    try:
        return CPUINFO.read_text()
    except OSError:
        return ""


def _first(text: str, key: str) -> str | None:
    """The first processor's value of `key` (every processor lists the same model and flags)."""
    for line in text.splitlines():
        name, sep, value = line.partition(":")
        if sep and name.strip() == key:
            return value.strip()
    return None


def flags(text: str | None = None) -> set[str]:
    """The instruction-set flags (of `text`, a cpuinfo's contents; default: this machine's)."""
    return set((_first(read() if text is None else text, "flags") or "").split())


def model_name(text: str | None = None) -> str:
    return _first(read() if text is None else text, "model name") or platform.processor() or "unknown CPU"


def kind(text: str | None = None) -> str:
    """The kind that decides which of phasesplit's CPU kernels run: avx512-bf16, avx2 or baseline."""
    f = flags(text)
    return "avx512-bf16" if "avx512_bf16" in f else "avx2" if "avx2" in f else "baseline"
