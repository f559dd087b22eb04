"""One polling loop for the tests that wait on a cluster or a node."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

import pytest

T = TypeVar("T")


def wait_until(what: str, probe: Callable[[], T | None], timeout: float, interval: float = 0.25) -> T:
    """Polls probe until it returns something truthy, which is returned; fails after timeout."""
    deadline = time.monotonic() + timeout
    last: T | None = None
    while time.monotonic() < deadline:
        last = probe()
        if last:
            return last
        time.sleep(interval)
    pytest.fail(f"timed out after {timeout:.0f} s waiting for {what} (last: {last!r})")
