"""The kernel tests' shared guard: a library that cannot be built here is a skip, one that should
have been built and was not is a failure."""

from __future__ import annotations

import shutil

import pytest

from phasesplit.runtime.kernels import build


def can_build(spec: build.Spec) -> bool:
    """Whether this CPU has the spec's instruction sets and a C compiler is on PATH."""
    with open("/proc/cpuinfo") as f:
        return build.cpu_supported(f.read(), spec) and shutil.which("cc") is not None


def built_or_skip(lib, spec: build.Spec, what: str, reason: str):
    """`lib` (a build.*_library() result); where it is None, a skip with `reason` if the CPU or
    the toolchain rules the library out, else a failure (it should have built)."""
    if lib is None:
        assert not can_build(spec), f"the {what} should have built here"
        pytest.skip(reason)
    return lib
