"""The kernel tests' shared guard: a library that cannot be built here is a skip, one that should
have been built and was not is a failure."""

from __future__ import annotations

import shutil

import pytest

from phasesplit.runtime import cpu_info
from phasesplit.runtime.kernels import build


def can_build(spec: build.Spec) -> bool:
    """Whether this CPU has the spec's instruction sets and a C compiler is on PATH."""
    return build.cpu_supported(cpu_info.read(), spec) and shutil.which("cc") is not None


def built_or_skip(lib, spec: build.Spec, what: str, reason: str):
    """`lib` (a build.*_library() result); where it is None, a skip with `reason` if the CPU or
    the toolchain rules the library out, else a failure (it should have built)."""
    if lib is None:
        assert not can_build(spec), f"the {what} should have built here"
        pytest.skip(reason)
    return lib


NO_SMALL_STEPS = "one CPU, or spinning OpenMP waits: decode steps keep all threads and no helpers start"


def decode_with_and_without_helpers(engine, lib, what: str) -> None:
    """One greedy request with logprobs decoded twice by `engine`: with the decode helpers (they
    must compute some of the matmuls: `what` names them in the failure) and with the caller alone;
    the tokens and logprobs must be the same bits. `lib`: the helpers' library (bf16w_library).
    Skipped where the runner keeps all threads for small decode steps (then no helpers start)."""
    from phasesplit.runtime.kernels import cpu_gemm_avx2
    from phasesplit.runtime.request import SamplingParams

    runner = engine.runner
    if not runner.small_step_threads:
        pytest.skip(NO_SMALL_STEPS)
    assert runner.decode_helpers == runner.threads - 1, "every CPU but the caller's should have a helper"

    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=1)
    prompt = list(range(3000, 3010))  # under one KV block: no prefix-cache hit on the second run

    def run(tag: str) -> list:
        return [(o.new_token_ids, o.logprobs) for o in engine.run_to_end(tag, prompt, params)]

    before = cpu_gemm_avx2.helper_stats(lib)[0]
    shared = run("shared")
    assert cpu_gemm_avx2.helper_stats(lib)[0] > before, f"no {what} of the decode steps ran on a helper"
    assert cpu_gemm_avx2.use_helpers(lib, False)
    try:
        alone = run("alone")
    finally:
        cpu_gemm_avx2.use_helpers(lib, True)
    assert shared == alone and len(shared) == 24
