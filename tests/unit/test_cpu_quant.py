"""The quantized-weight matmul (quant_gemm.c) against torch, and where it falls back."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from phasesplit.runtime.kernels import build, cpu_layer_f32, cpu_quant
from phasesplit.runtime.model.config import ModelConfig
from phasesplit.runtime.model.files import ModelFiles, builtin_gguf
from phasesplit.runtime.model.quantized import apply
from phasesplit.runtime.model.sharding import plan

NO_KERNELS = "the quantized CPU kernels need an x86-64 CPU with AVX2, FMA and F16C and a C compiler"
TYPES = {"q8_0": cpu_quant.Q8_0, "q4_0": cpu_quant.Q4_0, "q4_1": cpu_quant.Q4_1}


def _lib():
    lib = build.quant_library()
    if lib is None:
        pytest.skip(NO_KERNELS)
    return lib


def _emulated(x: torch.Tensor, blocks: torch.Tensor, qtype: int, k: int) -> torch.Tensor:
    """The kernel's arithmetic in numpy: activations rounded to int8 blocks (scale max|x|/127,
    round half to even), integer block dot products, per-block scales; float64 sums."""
    xb = x.numpy().reshape(x.shape[0], -1, 32)
    amax = np.abs(xb).max(-1, keepdims=True)
    inv = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    xq = np.rint(xb * inv).astype(np.int64)  # [M, nb, 32]
    dx = (amax / np.float32(127)).astype(np.float64)[..., 0]  # [M, nb]
    raw = blocks.numpy().reshape(blocks.shape[0], k // 32, -1)
    dw = raw[..., :2].copy().view(np.float16)[..., 0].astype(np.float64)  # [N, nb]
    if qtype == cpu_quant.Q8_0:
        wq, mw = raw[..., 2:].view(np.int8).astype(np.int64), np.zeros_like(dw)
    else:
        nib = raw[..., 4:] if qtype == cpu_quant.Q4_1 else raw[..., 2:]
        wq = np.concatenate([nib & 15, nib >> 4], axis=-1).astype(np.int64)
        mw = raw[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float64) if qtype == cpu_quant.Q4_1 else -8 * dw
    dots = np.einsum("mbi,nbi->mnb", xq, wq)
    sums = xq.sum(-1)  # [M, nb]
    out = np.einsum("mnb,mb,nb->mn", dots, dx, dw) + np.einsum("mb,mb,nb->mn", sums, dx, mw)
    return torch.from_numpy(out)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("kind", list(TYPES))
@pytest.mark.parametrize(("m", "n", "k"), [(1, 1, 32), (1, 17, 576), (2, 33, 96), (3, 100, 64), (4, 16, 1536),
                                           (5, 15, 160), (7, 49, 576), (33, 70, 224)])
def test_matmul_matches_torch(kind: str, m: int, n: int, k: int, threads: int) -> None:
    lib = _lib()
    qtype = TYPES[kind]
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    blocks = cpu_quant.quantize(torch.randn(n, k, generator=g), qtype)
    x = torch.randn(m, k, generator=g) * 3
    x[0, :32] = 0.0  # an all-zero block: scale 0, no division by it
    residual = torch.randn(m, n, generator=g)
    with build.num_threads(threads):
        got = cpu_quant.matmul(lib, x, blocks, qtype)
        got_res = cpu_quant.matmul(lib, x, blocks, qtype, residual=residual)
    assert got.shape == (m, n) and got.dtype == torch.float32
    # Exactly the kernel's arithmetic but for the order of float additions.
    want = _emulated(x, blocks, qtype, k)
    tol = 1e-5 * (1 + want.abs().max().item())
    assert (got.double() - want).abs().max().item() <= tol
    assert (got_res.double() - (want + residual.double())).abs().max().item() <= tol
    # And close to dequantize-then-matmul, the reference path (activation rounding only).
    ref = F.linear(x, cpu_quant.dequantize(blocks, qtype, k))
    assert (got - ref).abs().max().item() <= 0.02 * (1 + ref.abs().max().item())


@pytest.mark.parametrize("kind", list(TYPES))
def test_dense_path_for_many_rows_matches_torch(kind: str) -> None:
    """From DENSE_ROWS rows on, the C dequantizer + torch's matmul: the dequantized weight equals
    the gguf package's, so the product is F.linear's (with the residual fused by addmm)."""
    lib = _lib()
    qtype = TYPES[kind]
    g = torch.Generator().manual_seed(5)
    blocks = cpu_quant.quantize(torch.randn(45, 96, generator=g), qtype)
    dense = cpu_quant.dequantize(blocks, qtype, 96)
    assert torch.allclose(cpu_quant.dequantize_fast(lib, blocks, qtype, 96), dense, rtol=1e-6, atol=1e-6)
    x, r = torch.randn(cpu_quant.DENSE_ROWS, 96, generator=g), torch.randn(cpu_quant.DENSE_ROWS, 45, generator=g)
    got = cpu_quant.matmul(lib, x, blocks, qtype, residual=r)
    torch.testing.assert_close(got, F.linear(x, dense) + r, rtol=1e-5, atol=1e-4)


NO_X16 = ("this CPU lacks AVX512-VNNI, so weights stay in the file's row layout and the packed (X16) kernel "
          "of quant_x16.c is never used here")


def _x16_lib():
    lib = _lib()
    if not lib.ps_qx16_supported():
        pytest.skip(NO_X16)
    return lib


@pytest.mark.parametrize("kind", list(TYPES))
def test_x16_packing_moves_bytes_only_and_unpacks_exactly(kind: str) -> None:
    """pack_x16 is a permutation of the file's bytes (Q8_0's values xor 0x80): tile 0's first block
    starts with rows 0-15's scales, and unpacking gives the file's rows back."""
    qtype = TYPES[kind]
    g = torch.Generator().manual_seed(6)
    blocks = cpu_quant.quantize(torch.randn(48, 96, generator=g), qtype)
    packed = cpu_quant.pack_x16(blocks, qtype)
    assert packed.shape == blocks.shape and packed.dtype == torch.uint8
    assert not torch.equal(packed, blocks)
    assert torch.equal(packed[0, :32].view(16, 2), blocks[:16, :2])  # block 0's scales, row after row
    if qtype != cpu_quant.Q8_0:  # Q4's bytes are only moved
        assert sorted(packed.numpy().ravel().tolist()) == sorted(blocks.numpy().ravel().tolist())
    assert torch.equal(cpu_quant.unpack_x16(packed, qtype + cpu_quant.X16), blocks)
    assert torch.equal(cpu_quant.dequantize(packed, qtype + cpu_quant.X16, 96), cpu_quant.dequantize(blocks, qtype, 96))


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("kind", list(TYPES))
@pytest.mark.parametrize(("m", "n", "k"), [(1, 16, 32), (1, 48, 576), (2, 32, 96), (3, 96, 64), (4, 16, 1536),
                                           (5, 160, 160), (7, 48, 576), (33, 64, 224)])
def test_x16_matmul_matches_torch(kind: str, m: int, n: int, k: int, threads: int) -> None:
    """The packed kernel computes what the row-layout one does (the same integer block products
    and scales; only the order of float additions differs)."""
    lib = _x16_lib()
    qtype = TYPES[kind]
    g = torch.Generator().manual_seed(m * 1000 + n + k + 7)
    blocks = cpu_quant.quantize(torch.randn(n, k, generator=g), qtype)
    packed = cpu_quant.pack_x16(blocks, qtype)
    x = torch.randn(m, k, generator=g) * 3
    x[0, :32] = 0.0
    residual = torch.randn(m, n, generator=g)
    with build.num_threads(threads):
        got = cpu_quant.matmul(lib, x, packed, qtype + cpu_quant.X16)
        got_res = cpu_quant.matmul(lib, x, packed, qtype + cpu_quant.X16, residual=residual)
        plain = cpu_quant.matmul(lib, x, blocks, qtype)
    want = _emulated(x, blocks, qtype, k)
    tol = 1e-5 * (1 + want.abs().max().item())
    assert (got.double() - want).abs().max().item() <= tol
    assert (got_res.double() - (want + residual.double())).abs().max().item() <= tol
    assert (got - plain).abs().max().item() <= 2 * tol


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("kind", list(TYPES))
@pytest.mark.parametrize(("m", "n", "k"), [(1, 16, 32), (5, 48, 96), (130, 96, 64), (259, 64, 576), (3, 160, 64)])
def test_x16_bf16_in_c_is_the_long_way_bit_for_bit(kind: str, m: int, n: int, k: int, threads: int) -> None:
    """bf16 activations on packed weights go through one C call (ps_qx16_gemm_bf16): the same bits
    as widening with torch, the fp32 kernel (plus the residual) and torch's rounding; and with
    SwiGLU, as cpu_layer_f32's SwiGLU over the fp32 sums, rounded. Rows past the C side's
    128-row blocks, an odd number of tiles (48 columns) and a NaN included."""
    lib = _x16_lib()
    f32 = build.layer_f32_library()
    qtype = TYPES[kind]
    g = torch.Generator().manual_seed(m + n + k + 11)
    packed = cpu_quant.pack_x16(cpu_quant.quantize(torch.randn(n, k, generator=g), qtype), qtype)
    x = (torch.randn(m, k, generator=g) * 3).bfloat16()
    residual = torch.randn(m, n, generator=g).bfloat16()
    residual[-1, -1] = float("nan")
    pt = qtype + cpu_quant.X16
    with build.num_threads(threads):
        sums = cpu_quant.matmul(lib, x.float(), packed, pt)
        assert torch.equal(cpu_quant.matmul(lib, x, packed, pt), sums.bfloat16())
        got = cpu_quant.matmul(lib, x, packed, pt, residual=residual)
        want = cpu_quant.matmul(lib, x.float(), packed, pt, residual=residual.float()).bfloat16()
        # NaN in the same place (torch writes NaN as 0xffff from its vector code, 0x7fc0 from its
        # scalar code; C writes 0x7fc0), every other value the same bits
        assert torch.equal(got.isnan(), want.isnan()) and got.isnan().sum() == 1
        assert torch.equal(got.nan_to_num().view(torch.int16), want.nan_to_num().view(torch.int16))
        if f32 is None:
            return
        fused = cpu_quant.matmul_swiglu(lib, x, packed, pt, f32.ps_swiglu_f32)
        if n % 32:  # the gate is not whole tiles
            assert fused is None
        else:
            assert fused.shape == (m, n // 2)
            assert torch.equal(fused, cpu_layer_f32.swiglu(f32, sums).bfloat16())


def test_x16_bf16_in_c_is_refused_where_it_does_not_apply() -> None:
    """fp32 activations, an fp32 output, a gate of 8 columns and a weight view with gaps between
    its rows stay on the long path; dense_rows still sends wide calls to the dequantized path."""
    lib = _x16_lib()
    packed = cpu_quant.pack_x16(cpu_quant.quantize(torch.randn(16, 64), cpu_quant.Q8_0), cpu_quant.Q8_0)
    pt = cpu_quant.Q8_0 + cpu_quant.X16
    x = torch.randn(3, 64)
    assert cpu_quant.matmul(lib, x.bfloat16(), packed, pt, out_dtype=torch.float32).dtype == torch.float32
    f32 = build.layer_f32_library()
    if f32 is not None:
        assert cpu_quant.matmul_swiglu(lib, x, packed, pt, f32.ps_swiglu_f32) is None
        assert cpu_quant.matmul_swiglu(lib, x.bfloat16(), packed, pt, f32.ps_swiglu_f32) is None  # 16 rows: I = 8
    assert lib.ps_qx16_gemm_bf16(x.data_ptr(), packed.data_ptr(), None, x.data_ptr(), 3, 16, 64, cpu_quant.Q8_0,
                                 None, 1) == -1  # not a packed type
    wide = torch.zeros(16, packed.shape[1] * 2, dtype=torch.uint8)
    wide[:, : packed.shape[1]] = packed
    gappy = wide[:, : packed.shape[1]]  # the same bytes, rows twice as far apart
    want = cpu_quant.matmul(lib, x.bfloat16().float(), packed, pt).bfloat16()
    with pytest.raises(build.KernelUnavailable, match="rejected"):  # ps_qgemm refuses gaps in packed rows
        cpu_quant.matmul(lib, x.bfloat16(), gappy, pt)
    dense = cpu_quant.matmul(lib, x.bfloat16(), packed, pt, dense_rows=2)
    assert not torch.equal(dense, want)  # no activation rounding: F.linear on the dequantized weight
    assert torch.equal(dense, F.linear(x.bfloat16().float(), cpu_quant.dequantize(packed, pt, 64)).bfloat16())


def test_x16_dense_path_and_bad_shapes() -> None:
    """Packed weights take the integer kernel at any row count by default, and when asked to
    (dense_rows) are dequantized to exactly the file's values; a packed weight whose rows are not
    whole tiles is refused."""
    lib = _x16_lib()
    g = torch.Generator().manual_seed(8)
    for qtype in TYPES.values():
        blocks = cpu_quant.quantize(torch.randn(64, 96, generator=g), qtype)
        packed = cpu_quant.pack_x16(blocks, qtype)
        dense = cpu_quant.dequantize(blocks, qtype, 96)
        assert torch.equal(cpu_quant.dequantize_fast(lib, packed, qtype + cpu_quant.X16, 96), dense)
        x = torch.randn(cpu_quant.DENSE_ROWS, 96, generator=g)
        got = cpu_quant.matmul(lib, x, packed, qtype + cpu_quant.X16, dense_rows=cpu_quant.DENSE_ROWS)
        torch.testing.assert_close(got, F.linear(x, dense), rtol=1e-5, atol=1e-4)
        wide = cpu_quant.matmul(lib, x, packed, qtype + cpu_quant.X16)  # the integer kernel, row by row
        assert torch.equal(wide[:3], cpu_quant.matmul(lib, x[:3], packed, qtype + cpu_quant.X16))
        want = _emulated(x, blocks, qtype, 96)
        assert (wide.double() - want).abs().max().item() <= 1e-5 * (1 + want.abs().max().item())
    with pytest.raises(build.KernelUnavailable, match="rejected.*packed"):
        cpu_quant.matmul(lib, torch.randn(1, 96), packed[:40], cpu_quant.Q4_1 + cpu_quant.X16)


def test_weights_are_packed_where_the_kernel_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    lib = _lib()
    blocks = cpu_quant.quantize(torch.randn(48, 64), cpu_quant.Q8_0)
    got, qtype = cpu_quant.for_kernel(lib, blocks, cpu_quant.Q8_0)
    if lib.ps_qx16_supported():
        assert qtype == cpu_quant.Q8_0 + cpu_quant.X16 and torch.equal(got, cpu_quant.pack_x16(blocks, cpu_quant.Q8_0))
    else:
        assert qtype == cpu_quant.Q8_0 and got is blocks
    odd = blocks[:40]  # not whole tiles: as it is
    assert cpu_quant.for_kernel(lib, odd, cpu_quant.Q8_0) == (odd, cpu_quant.Q8_0)
    monkeypatch.setenv("PHASESPLIT_QUANT_X16", "0")
    assert cpu_quant.for_kernel(lib, blocks, cpu_quant.Q8_0) == (blocks, cpu_quant.Q8_0)


def test_rows_do_not_depend_on_the_batch() -> None:
    """A row's result is the same alone or among others (the 4-row groups and tails)."""
    lib = _lib()
    g = torch.Generator().manual_seed(3)
    blocks = cpu_quant.quantize(torch.randn(40, 128, generator=g), cpu_quant.Q4_1)
    x = torch.randn(7, 128, generator=g)
    together = cpu_quant.matmul(lib, x, blocks, cpu_quant.Q4_1)
    for i in range(7):
        alone = cpu_quant.matmul(lib, x[i : i + 1], blocks, cpu_quant.Q4_1)
        assert torch.equal(alone[0], together[i])


def test_bf16_activations_come_back_bf16() -> None:
    lib = _lib()
    g = torch.Generator().manual_seed(4)
    blocks = cpu_quant.quantize(torch.randn(24, 64, generator=g), cpu_quant.Q8_0)
    x = torch.randn(3, 64, generator=g)
    got = cpu_quant.matmul(lib, x.bfloat16(), blocks, cpu_quant.Q8_0)
    assert got.dtype == torch.bfloat16
    ref = F.linear(x, cpu_quant.dequantize(blocks, cpu_quant.Q8_0, 64))
    assert (got.float() - ref).abs().max().item() <= 0.05 * (1 + ref.abs().max().item())


def test_bad_arguments_are_refused() -> None:
    lib = _lib()
    blocks = cpu_quant.quantize(torch.randn(8, 64), cpu_quant.Q8_0)
    with pytest.raises(build.KernelUnavailable, match="rejected"):
        cpu_quant.matmul(lib, torch.randn(2, 48), blocks, cpu_quant.Q8_0)  # inner size not 64
    with pytest.raises(build.KernelUnavailable, match="rejected"):
        cpu_quant.matmul(lib, torch.randn(2, 64), blocks, 99)  # no such type


def test_cpu_flags_select_the_library() -> None:
    flags = "flags : fpu sse2 avx avx2 fma f16c"
    assert build.cpu_supported(flags, build.QUANT)
    assert not build.cpu_supported("flags : fpu sse2 avx avx2 f16c", build.QUANT)  # no FMA
    assert not build.cpu_supported(flags, build.BF16)


def test_failed_self_check_means_no_library(monkeypatch: pytest.MonkeyPatch, caplog) -> None:
    _lib()

    def broken(lib) -> None:
        raise build.KernelUnavailable("quantized matmul self-check failed (simulated)")

    monkeypatch.setattr(cpu_quant, "self_check", broken)
    build.quant_library.cache_clear()
    try:
        with caplog.at_level(logging.INFO):
            assert build.quant_library() is None
        assert "self-check failed (simulated)" in caplog.text
    finally:
        monkeypatch.undo()
        build.quant_library.cache_clear()
    assert build.quant_library() is not None


def _meta_model(tp: int = 1):
    from phasesplit.runtime.model.files import model_info, read_config
    from phasesplit.runtime.model.llama import LlamaModel

    cfg: ModelConfig = read_config(model_info("smollm2"))
    with torch.device("meta"):
        return LlamaModel(cfg, plan(cfg, tp)[0])


def test_cuda_falls_back_to_dequantized_and_says_so(caplog) -> None:
    files = ModelFiles(builtin_gguf("smollm2").parent, "smollm2", gguf=builtin_gguf("smollm2"))
    with caplog.at_level(logging.INFO):
        assert apply(_meta_model(), files, "auto", torch.device("cuda")) is None
    assert "no native kernel on cuda; dequantized at load" in caplog.text


@pytest.mark.parametrize("tp", [2, 3, 9])
def test_tensor_parallel_slices_of_blocks_equal_slices_of_the_dequantized_weight(tp: int) -> None:
    """Each rank's block slice dequantizes to exactly the dense slice shard_state takes; a column
    bound off the 32-weight blocks (TP=9: MLP columns of 171/170) gives None."""
    from phasesplit.runtime.model.quantized import QuantWeight, shard_blocks
    from phasesplit.runtime.model.sharding import shard_state

    cfg = _meta_model().cfg
    g = torch.Generator().manual_seed(tp)
    q, kv, inter, h = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size, cfg.hidden_size
    shapes = {"layers.0.qkv.weight": (q + 2 * kv, h), "layers.0.o_proj.weight": (h, q),
              "layers.0.gate_up.weight": (2 * inter, h), "layers.0.down.weight": (h, inter)}
    blocks = {n: QuantWeight(cpu_quant.quantize(torch.randn(*s, generator=g), cpu_quant.Q4_1), cpu_quant.Q4_1, s[1])
              for n, s in shapes.items()}
    dense = {n: w.dequantize() for n, w in blocks.items()}
    for shard in plan(cfg, tp):
        want = shard_state(dense, cfg, shard)
        for name, w in blocks.items():
            got = shard_blocks(w, name, cfg, shard)
            if tp == 9 and name.endswith("down.weight"):
                assert got is None
                continue
            assert got is not None and torch.equal(got.dequantize(), want[name]), (tp, shard.rank, name)


def test_tensor_parallel_rank_dequantizes_only_unaligned_slices(caplog) -> None:
    _lib()
    files = ModelFiles(builtin_gguf("smollm2").parent, "smollm2", gguf=builtin_gguf("smollm2"))
    model = _meta_model(9)
    with caplog.at_level(logging.INFO):
        counts = apply(model, files, "auto", torch.device("cpu"))
    assert counts == {"q4_1": 3 * model.cfg.num_layers, "q8_0": 1, "dequantized": model.cfg.num_layers}
    assert "slice of down does not fall on 32-weight block bounds" in caplog.text
    assert model.layers[0].down.blocks is None and model.layers[0].o_proj.blocks.in_features == model.cfg.head_dim


def test_named_type_must_match_the_file() -> None:
    from phasesplit.runtime.model.files import ModelError

    files = ModelFiles(builtin_gguf("smollm2").parent, "smollm2", gguf=builtin_gguf("smollm2"))
    with pytest.raises(ModelError, match="projections of .* are q4_1"):
        apply(_meta_model(), files, "q8_0", torch.device("cpu"))
    with pytest.raises(ModelError, match="needs a GGUF file"):
        apply(_meta_model(), ModelFiles(builtin_gguf("smollm2").parent, "x"), "q4_1", torch.device("cpu"))
