"""The AVX512-BF16 matmul kernel against F.linear, and the layouts a Linear falls back to."""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F

from phasesplit.runtime.kernels import build, cpu_gemm
from phasesplit.runtime.model.llama import Linear
from tests.kernels import can_build

NO_KERNELS = "this CPU lacks AVX512-BF16 or no C compiler is on PATH: the kernels cannot be built here"


def _kernels():
    """The kernel library; the calling test is skipped where this CPU or machine cannot build
    it (the torch fallback is tested on its own)."""
    lib = build.library()
    if lib is None:
        assert not _cpu_can_run_kernel(), "the kernels should have built here"
        pytest.skip(NO_KERNELS)
    return lib


def _cpu_can_run_kernel() -> bool:
    return can_build(build.BF16)


def test_cpu_flag_parsing() -> None:
    line = "flags\t\t: fpu sse2 avx512f avx512dq avx512bw avx512vl avx512_bf16 avx512_vnni\n"
    assert build.cpu_supported("processor : 0\n" + line)
    assert not build.cpu_supported("flags : fpu sse2 avx512f avx512bw avx512vl\n")
    assert not build.cpu_supported("no flags here")


def test_library_is_built_where_the_cpu_and_a_compiler_allow_it() -> None:
    # Where the CPU has the instructions and a compiler exists, a None here is a bug (a failed
    # build or self-check), not a fallback.
    assert (build.library() is not None) == _cpu_can_run_kernel()


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(("m", "n", "k"), [(1, 576, 576), (3, 960, 576), (4, 40, 1536), (5, 33, 64),
                                           (8, 17, 34), (33, 576, 576), (130, 48, 96)])
def test_kernel_matches_float_matmul(m: int, n: int, k: int, threads: int) -> None:
    lib = _kernels()  # skips where no kernel builds: the Linear test below checks the fallback
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    w = (torch.randn(n, k, generator=g) * k**-0.5).bfloat16()
    x = torch.randn(m, k, generator=g).bfloat16()
    res = torch.randn(m, n, generator=g).bfloat16()
    packed = cpu_gemm.pack(w)
    with build.num_threads(threads):
        got = cpu_gemm.matmul(lib.ps_gemm_bf16, x, packed, n)
        got_res = cpu_gemm.matmul(lib.ps_gemm_bf16, x, packed, n, residual=res)
        got_f32 = cpu_gemm.matmul(lib.ps_gemm_bf16, x, packed, n, out_dtype=torch.float32)
        # Each row is computed the same way whatever the batch: row i alone gives the same bits.
        alone = cpu_gemm.matmul(lib.ps_gemm_bf16, x[m - 1 :], packed, n)
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
        monkeypatch.setattr(build, "library", lambda: None)
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


def test_a_built_library_is_readable_by_every_user(tmp_path) -> None:
    """Images prebuild the libraries as root (docker/runtime.Dockerfile) and pods run as their own
    user: a library only its owner can read (mkstemp's 0600) left every CPU pod without kernels."""
    import shutil
    import stat

    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler on PATH")
    lib = build.build(cc, tmp_path, build.QUANT)
    mode = stat.S_IMODE(lib.stat().st_mode)
    assert mode & 0o444 == 0o444 and mode & 0o111 == 0o111, oct(mode)


def test_build_failure_is_reported_not_raised(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A compiler that fails leaves a clear reason, and library() falls back to None."""
    bad = tmp_path / "cc"
    bad.write_text("#!/bin/sh\nif [ \"$1\" = --version ]; then echo fake; exit 0; fi\necho 'no such flag' >&2\nexit 1\n")
    bad.chmod(0o755)
    with pytest.raises(build.KernelUnavailable, match="no such flag"):
        build.build(str(bad), tmp_path / "out")
    assert not list((tmp_path / "out").glob("*.so*")), "no half-built library is left behind"


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(9, 3, 64), (8, 8, 64), (16, 2, 128), (4, 1, 32)])
def test_decode_attention_kernel_matches_float_reference(heads: int, kv_heads: int, dim: int, threads: int) -> None:
    from phasesplit.runtime.kernels import cpu_attention

    lib = _kernels()
    g = torch.Generator().manual_seed(heads + kv_heads + dim)
    bs, blocks = 16, 64
    k_cache = torch.randn(blocks * bs, kv_heads, dim, generator=g).bfloat16()
    v_cache = torch.randn(blocks * bs, kv_heads, dim, generator=g).bfloat16()
    lens = torch.tensor([1, 15, 16, 33, 250, 1000])
    tables = torch.stack([torch.randperm(blocks, generator=g) for _ in lens])
    # q rows strided as in the model (a slice of the q+k heads tensor)
    qk = torch.randn(len(lens), heads + kv_heads, dim, generator=g).bfloat16()
    q = qk[:, :heads]
    with build.num_threads(threads):
        got = cpu_attention.decode(lib.ps_decode_attention_bf16, q, k_cache, v_cache, tables, lens,
                                   int(lens.max()), bs)
    want = cpu_attention.reference(q, k_cache, v_cache, tables, lens, bs)
    torch.testing.assert_close(got.float(), want, rtol=1e-2, atol=1e-2)
    # a single token's attention is that token's V row
    pos0 = tables[0, 0] * bs
    torch.testing.assert_close(got[0].float(), v_cache[pos0].float().repeat_interleave(heads // kv_heads, dim=0))


def test_decode_attention_kernel_refuses_tables_too_short() -> None:
    from phasesplit.runtime.kernels import cpu_attention

    lib = _kernels()
    cache = torch.zeros(64, 1, 32).bfloat16()
    with pytest.raises(build.KernelUnavailable, match="rejected"):
        # 40 tokens need 3 blocks of 16; the table has 2
        cpu_attention.decode(lib.ps_decode_attention_bf16, torch.zeros(1, 2, 32).bfloat16(), cache, cache,
                             torch.tensor([[0, 1]]), torch.tensor([40]), 40, 16)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(("m", "inter", "k"), [(1, 1536, 576), (4, 16, 64), (7, 48, 34), (70, 32, 128)])
def test_swiglu_epilogue_matches_silu_times_up(m: int, inter: int, k: int, threads: int) -> None:
    lib = _kernels()
    g = torch.Generator().manual_seed(m + inter + k)
    w = (torch.randn(2 * inter, k, generator=g) * k**-0.5).bfloat16()
    x = (torch.randn(m, k, generator=g) * 3).bfloat16()  # large enough that silu's tails matter
    with build.num_threads(threads):
        got = cpu_gemm.matmul(lib.ps_gemm_bf16, x, cpu_gemm.pack_swiglu(w), 2 * inter, act=cpu_gemm.SWIGLU,
                              out_dtype=torch.float32)
    gate, up = F.linear(x.float(), w.float()).chunk(2, dim=-1)
    torch.testing.assert_close(got, F.silu(gate) * up, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kernel", [True, False])
def test_linear_swiglu_equals_silu_gate_times_up(kernel: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    if not kernel:
        monkeypatch.setattr(build, "library", lambda: None)
    g = torch.Generator().manual_seed(2)
    lin = Linear(64, 96)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(96, 64, generator=g) * 0.2)
    lin = lin.to(torch.bfloat16)
    plain = lin.weight.detach().clone()
    lin.pack_for_cpu(swiglu=True)
    x = torch.randn(3, 64, generator=g).bfloat16()
    gate, up = F.linear(x.float(), plain.float()).chunk(2, dim=-1)
    with torch.inference_mode():
        torch.testing.assert_close(lin.swiglu(x).float(), F.silu(gate) * up, rtol=2e-2, atol=2e-2)


def test_rms_norm_kernel_matches_hugging_face_arithmetic() -> None:
    from phasesplit.runtime.kernels import cpu_norm
    from phasesplit.runtime.model.llama import rms_norm

    lib = build.library()
    g = torch.Generator().manual_seed(4)
    x = (torch.randn(37, 576, generator=g) * 5).bfloat16()
    w = torch.randn(576, generator=g).bfloat16()
    want = cpu_norm.reference(x, w, 1e-5)
    got = rms_norm(x, w, 1e-5)  # through the kernel where it is built, else the torch path
    torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-2)
    if lib is None:
        assert not _cpu_can_run_kernel()
        pytest.skip(f"the torch path is checked; the kernel itself is not: {NO_KERNELS}")
    # same rounding steps as the reference: at most one bf16 ulp apart, and almost always equal
    direct = cpu_norm.rms_norm(lib.ps_rms_norm_bf16, x, w, 1e-5)
    assert (direct != want).float().mean() < 0.01


def test_rope_kernel_rotates_q_and_k_and_writes_the_cache() -> None:
    """The model's torch RoPE (apply_rope with the signed-sin tables) against the kernel, on
    SmolLM2's head layout, with the K/V rows landing in their slots."""
    from phasesplit.runtime.kernels import cpu_rope
    from phasesplit.runtime.model.config import ModelConfig
    from phasesplit.runtime.model.llama import LlamaModel, apply_rope, rope_inv_freq

    lib = _kernels()
    cfg = ModelConfig(vocab_size=32, hidden_size=576, intermediate_size=64, num_layers=1, num_heads=9,
                      num_kv_heads=3, head_dim=64, rope_theta=100000.0, rms_eps=1e-5, max_position=8192,
                      tie_embeddings=True)
    with torch.device("meta"):
        model = LlamaModel(cfg)
    model.inv_freq = rope_inv_freq(cfg)
    g = torch.Generator().manual_seed(5)
    pos = torch.tensor([0, 7, 300, 5000])
    qkv = torch.randn(4, 15, 64, generator=g).bfloat16()
    cos, sin = model.rope_tables(pos, torch.float32)
    want = apply_rope(qkv[:, :12].float(), cos, sin)
    freqs = pos.float()[:, None] * model.inv_freq[None, :]
    k_cache, v_cache = torch.zeros(10, 3, 64).bfloat16(), torch.zeros(10, 3, 64).bfloat16()
    work = qkv.clone()
    cpu_rope.rope_and_write(lib.ps_rope_write_bf16, work, 9, 3, freqs.cos(), freqs.sin(), torch.tensor([2, 9, 0, 4]),
                            k_cache, v_cache)
    torch.testing.assert_close(work[:, :12].float(), want, rtol=1e-2, atol=2e-2)
    assert torch.equal(k_cache[[2, 9, 0, 4]], work[:, 9:12]) and torch.equal(v_cache[[2, 9, 0, 4]], qkv[:, 12:])
    assert torch.equal(work[:, 12:], qkv[:, 12:]), "V is not rotated"


def test_argmax_kernel_equals_torch_including_ties() -> None:
    from phasesplit.runtime.kernels import cpu_argmax

    lib = _kernels()
    g = torch.Generator().manual_seed(6)
    x = torch.randn(33, 49152, generator=g)
    x[0, 10] = x[0, 20] = 99.0
    x[1, -1] = 99.0  # the last column
    x[2] = 0.0  # all equal: index 0
    assert torch.equal(cpu_argmax.argmax(lib.ps_argmax_f32, x), x.argmax(-1))


def test_prebuilt_library_loads_without_a_compiler(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An image builds the library at build time (python -m ...kernels.build DIR) and runs with
    PHASESPLIT_KERNELS_DIR=DIR and no compiler on PATH."""
    if not _cpu_can_run_kernel():
        assert build.library() is None
        pytest.skip(NO_KERNELS)
    assert build.main([str(tmp_path / "prebuilt")]) == 0
    monkeypatch.setenv("PHASESPLIT_KERNELS_DIR", str(tmp_path / "prebuilt"))
    monkeypatch.setenv("PHASESPLIT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("PATH", str(tmp_path / "no-tools"))
    monkeypatch.delenv("CC", raising=False)
    lib = build._load()
    assert lib._name == str(tmp_path / "prebuilt" / build.library_name())
    monkeypatch.setenv("PHASESPLIT_KERNELS_DIR", str(tmp_path / "empty"))
    with pytest.raises(build.KernelUnavailable, match="no C compiler"):
        build._load()


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(("n", "prefix", "heads", "kv_heads", "dim"),
                         [(1, 0, 9, 3, 64), (16, 0, 9, 3, 64), (17, 0, 9, 3, 64), (300, 0, 9, 3, 64),
                          (40, 0, 8, 8, 128), (33, 0, 16, 2, 64), (1, 40, 9, 3, 64), (70, 130, 9, 3, 64)])
def test_prefill_attention_kernel_matches_causal_sdpa(n: int, prefix: int, heads: int, kv_heads: int, dim: int,
                                                      threads: int) -> None:
    """Queries at positions prefix..prefix+n-1 over keys 0..their own position."""
    from phasesplit.runtime.kernels import cpu_attention

    lib = _kernels()
    g = torch.Generator().manual_seed(n + prefix + heads + dim)
    qkv = torch.randn(prefix + n, heads + 2 * kv_heads, dim, generator=g).bfloat16()
    q, k, v = qkv[prefix:, :heads], qkv[:, heads : heads + kv_heads], qkv[:, heads + kv_heads :]
    with build.num_threads(threads):
        got = cpu_attention.prefill(lib, q, k, v)
    torch.testing.assert_close(got.float(), cpu_attention.prefill_reference(q, k, v), rtol=2e-2, atol=2e-2)
    if prefix == 0:  # causality: the first token attends to itself alone
        torch.testing.assert_close(got[0].float(), v[0].float().repeat_interleave(heads // kv_heads, dim=0),
                                   rtol=1e-2, atol=1e-2)


def test_huge_page_tensors_are_aligned_and_usable() -> None:
    from phasesplit.runtime.kernels import hugepages

    t = hugepages.empty(3 << 20, torch.bfloat16)  # 6 MiB
    assert t.numel() == 3 << 20 and t.dtype == torch.bfloat16 and t.is_contiguous()
    if sys.platform.startswith("linux"):
        assert t.data_ptr() % hugepages.HUGE_PAGE == 0
    t.fill_(1.5)
    assert t.float().sum().item() == 1.5 * (3 << 20)
    small = hugepages.empty(10, torch.float32)  # below a page: ordinary memory
    assert small.numel() == 10
