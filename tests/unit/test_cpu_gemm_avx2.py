"""The bf16-weight fp32 matmul for AVX2 CPUs (cpu_gemm_avx2) against F.linear, and a Linear
taking that layout."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from phasesplit.runtime.kernels import build, cpu_gemm_avx2
from phasesplit.runtime.model.llama import Linear
from tests.kernels import built_or_skip

NO_KERNEL = "this CPU lacks AVX2 or FMA, or no C compiler is on PATH: the bf16-weight AVX2 kernel cannot be built here"


def _fn():
    return built_or_skip(build.bf16w_library(), build.BF16W, "bf16-weight kernel", NO_KERNEL).ps_gemm_bf16w_f32


def test_cpu_flag_parsing() -> None:
    assert build.cpu_supported("flags : fpu sse2 avx avx2 fma f16c\n", build.BF16W)
    assert not build.cpu_supported("flags : fpu sse2 avx f16c\n", build.BF16W)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(("m", "n", "k"), [(1, 576, 576), (2, 960, 576), (3, 40, 1536), (5, 33, 64),
                                           (8, 17, 34), (1, 7, 2), (33, 576, 576), (130, 48, 98)])
def test_kernel_matches_float_matmul(m: int, n: int, k: int, threads: int) -> None:
    fn = _fn()
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    w = torch.randn(n, k, generator=g) * k**-0.5
    x = torch.randn(m, k, generator=g)
    res = torch.randn(m, n, generator=g)
    packed = cpu_gemm_avx2.pack(w)
    with build.num_threads(threads):
        got = cpu_gemm_avx2.matmul(fn, x, packed, n)
        got_res = cpu_gemm_avx2.matmul(fn, x, packed, n, residual=res)
        # A row is computed the same way whatever else is in the call (batching does not change
        # a request's tokens): the last row alone, and every row alone, give the same bits.
        alone = [cpu_gemm_avx2.matmul(fn, x[i : i + 1], packed, n) for i in range(min(m, 3))]
    exact = F.linear(x, w.bfloat16().float())  # the weight is kept in bf16: that rounding is the layout's
    assert got.dtype == torch.float32 and got.shape == (m, n)
    torch.testing.assert_close(got, exact, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_res, exact + res, rtol=1e-5, atol=1e-5)
    for i, row in enumerate(alone):
        assert torch.equal(row[0], got[i]), f"row {i} alone differs from row {i} in a batch of {m}"


@pytest.mark.parametrize(("m", "inter", "k"), [(1, 1536, 576), (2, 32, 64), (5, 48, 34)])
def test_swiglu_epilogue_matches_silu_times_up(m: int, inter: int, k: int) -> None:
    fn = _fn()
    g = torch.Generator().manual_seed(inter + k)
    w = torch.randn(2 * inter, k, generator=g) * k**-0.5
    x = torch.randn(m, k, generator=g)
    gate, up = F.linear(x, w.bfloat16().float()).chunk(2, dim=-1)
    got = cpu_gemm_avx2.matmul(fn, x, cpu_gemm_avx2.pack(w, swiglu=True), 2 * inter, act=cpu_gemm_avx2.SWIGLU)
    torch.testing.assert_close(got, F.silu(gate) * up, rtol=1e-5, atol=1e-5)


def test_kernel_refuses_an_odd_inner_size() -> None:
    fn = _fn()
    x, out = torch.randn(1, 3), torch.empty(1, 16)
    w = torch.zeros(16 * 4, dtype=torch.bfloat16)
    assert fn(x.data_ptr(), w.data_ptr(), None, out.data_ptr(), 1, 16, 3, 1, 0) == -1


def test_linear_takes_the_layout_only_when_asked() -> None:
    """An fp32 projection keeps fp32 weights unless bf16 weights are asked for (dtype auto); then
    it holds only the bf16 layout and gives F.linear's result on the bf16-rounded weight, with and
    without the fused residual, and the SwiGLU product."""
    _fn()
    g = torch.Generator().manual_seed(3)
    w = torch.randn(64, 40, generator=g)
    x, res = torch.randn(3, 40, generator=g), torch.randn(3, 64, generator=g)
    plain = Linear.from_weight(w.clone())
    assert plain.pack_for_cpu() is None and plain.weight.shape == (64, 40), "fp32 stays fp32 by default"
    lin = Linear.from_weight(w.clone())
    assert lin.pack_for_cpu(bf16_weights=True) == "bf16w_avx2"
    assert lin.weight.numel() == 0 and lin.tiled.dtype == torch.bfloat16, "one copy, in bf16"
    ref = w.bfloat16().float()
    with torch.inference_mode():
        torch.testing.assert_close(lin(x), F.linear(x, ref), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(lin(x, residual=res), torch.addmm(res, x, ref.t()), rtol=1e-5, atol=1e-5)
    sw = Linear.from_weight(w.clone())
    assert sw.pack_for_cpu(swiglu=True, bf16_weights=True) == "bf16w_avx2"
    gate, up = F.linear(x, ref).chunk(2, dim=-1)
    with torch.inference_mode():
        torch.testing.assert_close(sw.swiglu(x), F.silu(gate) * up, rtol=1e-5, atol=1e-5)


def test_without_the_kernel_weights_stay_fp32(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(build, "bf16w_library", lambda: None)
    lin = Linear.from_weight(torch.randn(16, 8))
    assert lin.pack_for_cpu(bf16_weights=True) is None
    assert lin.weight.dtype == torch.float32 and lin.weight.shape == (16, 8)
