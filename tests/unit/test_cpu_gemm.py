"""The AVX512-BF16 matmul kernel against F.linear, and the layouts a Linear falls back to."""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F

from phasesplit.runtime.kernels import cpu_gemm
from phasesplit.runtime.model.llama import Linear


def _cpu_can_run_kernel() -> bool:
    with open("/proc/cpuinfo") as f:
        return cpu_gemm.cpu_supported(f.read()) and shutil.which("cc") is not None


def test_cpu_flag_parsing() -> None:
    line = "flags\t\t: fpu sse2 avx512f avx512bw avx512vl avx512_bf16 avx512_vnni\n"
    assert cpu_gemm.cpu_supported("processor : 0\n" + line)
    assert not cpu_gemm.cpu_supported("flags : fpu sse2 avx512f avx512bw avx512vl\n")
    assert not cpu_gemm.cpu_supported("no flags here")


def test_library_is_built_where_the_cpu_and_a_compiler_allow_it() -> None:
    # Where the CPU has the instructions and a compiler exists, a None here is a bug (a failed
    # build or self-check), not a fallback.
    assert (cpu_gemm.library() is not None) == _cpu_can_run_kernel()


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(("m", "n", "k"), [(1, 576, 576), (3, 960, 576), (4, 40, 1536), (5, 33, 64),
                                           (8, 17, 34), (33, 576, 576), (130, 48, 96)])
def test_kernel_matches_float_matmul(m: int, n: int, k: int, threads: int) -> None:
    lib = cpu_gemm.library()
    if lib is None:  # no kernel here: the fallback is what the Linear test below checks
        assert not _cpu_can_run_kernel()
        return
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    w = (torch.randn(n, k, generator=g) * k**-0.5).bfloat16()
    x = torch.randn(m, k, generator=g).bfloat16()
    res = torch.randn(m, n, generator=g).bfloat16()
    packed = cpu_gemm.pack(w)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = cpu_gemm.matmul(lib.ps_gemm_bf16, x, packed, n)
        got_res = cpu_gemm.matmul(lib.ps_gemm_bf16, x, packed, n, residual=res)
        got_f32 = cpu_gemm.matmul(lib.ps_gemm_bf16, x, packed, n, out_dtype=torch.float32)
        # Each row is computed the same way whatever the batch: row i alone gives the same bits.
        alone = cpu_gemm.matmul(lib.ps_gemm_bf16, x[m - 1 :], packed, n)
    finally:
        torch.set_num_threads(old)
    exact = F.linear(x.float(), w.float())
    assert got.dtype == torch.bfloat16 and got_f32.dtype == torch.float32
    # fp32 sums in another order than F.linear: only rounding differs
    torch.testing.assert_close(got_f32, exact, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(got.float(), exact, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(got_res.float(), exact + res.float(), rtol=1e-2, atol=2e-2)
    assert torch.equal(alone[0], got[m - 1])


@pytest.mark.parametrize("kernel", [True, False])
def test_linear_layouts_equal_the_plain_matmul(kernel: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Whichever layout a bf16 projection takes (the kernel's, else oneDNN's), it gives the plain
    matmul's result with and without the fused residual, and drops its plain copy."""
    if not kernel:
        monkeypatch.setattr(cpu_gemm, "library", lambda: None)
    g = torch.Generator().manual_seed(1)
    lin = Linear(64, 96)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(96, 64, generator=g))
    lin = lin.to(torch.bfloat16)
    plain = lin.weight.detach().clone()
    x = torch.randn(5, 64, generator=g).to(torch.bfloat16)
    res = torch.randn(5, 96, generator=g).to(torch.bfloat16)
    layout = lin.pack_for_cpu()
    if kernel and _cpu_can_run_kernel():
        assert layout == "cpu_gemm"
    elif not kernel:
        assert layout in ("onednn", None)
        assert (lin.packed is not None) == (layout == "onednn")
    if layout:
        assert lin.weight.numel() == 0, "the plain copy is dropped"
    with torch.inference_mode():
        torch.testing.assert_close(lin(x), F.linear(x, plain), rtol=1e-2, atol=5e-2)
        torch.testing.assert_close(lin(x, residual=res), torch.addmm(res, x, plain.t()), rtol=1e-2, atol=5e-2)


def test_build_failure_is_reported_not_raised(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A compiler that fails leaves a clear reason, and library() falls back to None."""
    bad = tmp_path / "cc"
    bad.write_text("#!/bin/sh\nif [ \"$1\" = --version ]; then echo fake; exit 0; fi\necho 'no such flag' >&2\nexit 1\n")
    bad.chmod(0o755)
    with pytest.raises(cpu_gemm.KernelUnavailable, match="no such flag"):
        cpu_gemm.build(str(bad), tmp_path / "out")
    assert not list((tmp_path / "out").glob("*.so*")), "no half-built library is left behind"
