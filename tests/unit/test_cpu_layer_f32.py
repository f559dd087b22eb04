"""The AVX2 fp32 layer kernels (cpu_layer_f32: RMSNorm, RoPE + K/V write, decode attention over
the paged cache) against torch, and the model's attention taking them only when asked."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from phasesplit.runtime.kernels import build, cpu_attention, cpu_layer_f32, cpu_norm, cpu_rope
from phasesplit.runtime.model.attention import (
    LayerCache,
    build_metadata,
    kernel_decode_available,
    paged_attention,
)
from tests.kernels import built_or_skip

NO_KERNEL = "this CPU lacks AVX2 or FMA, or no C compiler is on PATH: the fp32 AVX2 layer kernels cannot be built here"


def _lib():
    return built_or_skip(build.layer_f32_library(), build.BF16W, "fp32 layer kernels", NO_KERNEL)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(("m", "k"), [(1, 576), (3, 24), (70, 8), (65, 200)])
def test_rms_norm_matches_torch(m: int, k: int, threads: int) -> None:
    lib = _lib()
    g = torch.Generator().manual_seed(m + k)
    x, w = torch.randn(m, k, generator=g) * 3, torch.randn(k, generator=g)
    with build.num_threads(threads):
        got = cpu_norm.rms_norm(lib.ps_rms_norm_f32, x, w, 1e-6)
    torch.testing.assert_close(got, F.rms_norm(x, (k,), w, 1e-6), rtol=1e-5, atol=1e-6)


def test_rms_norm_refuses_a_row_that_is_not_a_multiple_of_8() -> None:
    lib = _lib()
    with pytest.raises(build.KernelUnavailable):
        cpu_norm.rms_norm(lib.ps_rms_norm_f32, torch.randn(2, 12), torch.randn(12), 1e-6)


@pytest.mark.parametrize(("m", "heads", "kv_heads", "dim"), [(1, 9, 3, 64), (5, 4, 4, 16), (70, 8, 1, 128),
                                                             (3, 6, 2, 48)])
def test_rope_rotates_q_and_k_in_place_and_writes_the_cache(m: int, heads: int, kv_heads: int, dim: int) -> None:
    lib = _lib()
    g = torch.Generator().manual_seed(m * 100 + dim)
    qkv = torch.randn(m, heads + 2 * kv_heads, dim, generator=g)
    ang = torch.rand(m, dim // 2, generator=g) * 50
    slots = torch.randperm(2 * m, generator=g)[:m]
    slots[0] = -1  # a row whose K/V are not written (the kernel's contract)
    caches = torch.zeros(2, 2 * m, kv_heads, dim)
    want = cpu_layer_f32.rope_reference(qkv, heads, kv_heads, ang.cos(), ang.sin())
    with build.num_threads(2):
        cpu_rope.rope_and_write(lib.ps_rope_write_f32, qkv, heads, kv_heads, ang.cos(), ang.sin(), slots,
                                caches[0], caches[1])
    torch.testing.assert_close(qkv, want, rtol=1e-5, atol=1e-5)
    for i in range(1, m):
        assert torch.equal(caches[0, slots[i]], qkv[i, heads : heads + kv_heads])
        assert torch.equal(caches[1, slots[i]], qkv[i, heads + kv_heads :])
    written = set(slots[1:].tolist())
    untouched = [s for s in range(2 * m) if s not in written]
    assert not caches[:, untouched].any(), "a slot no row names was written"


def _paged(g: torch.Generator, lens: list[int], heads: int, kv_heads: int, dim: int, block: int):
    """A cache of scattered blocks holding len(lens) sequences; tables padded with block 0."""
    per_seq = [-(-n // block) for n in lens]
    blocks = sum(per_seq) + 3
    order = torch.randperm(blocks, generator=g)
    tables, at = torch.zeros(len(lens), max(per_seq), dtype=torch.long), 0
    for i, n in enumerate(per_seq):
        tables[i, :n] = order[at : at + n]
        at += n
    k_cache = torch.randn(blocks * block, kv_heads, dim, generator=g)
    v_cache = torch.randn(blocks * block, kv_heads, dim, generator=g)
    q = torch.randn(len(lens), heads, dim, generator=g)
    return q, k_cache, v_cache, tables, torch.tensor(lens)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(("heads", "kv_heads", "dim", "block", "lens"), [
    (9, 3, 64, 16, [1, 15, 16, 17, 300]),  # SmolLM2's shape, contexts across block boundaries
    (8, 1, 128, 16, [33, 2]),
    (6, 2, 64, 8, [9, 64, 65]),  # a group of 3 ... and of 1 below, other block sizes
    (4, 4, 64, 32, [31, 32, 97]),
    (5, 1, 40, 16, [18, 1]),  # a head size without its own variant (plain loops)
    (2, 2, 16, 4, [7]),
    (12, 3, 8, 16, [40]),
])
def test_decode_attention_matches_per_sequence_attention(heads: int, kv_heads: int, dim: int, block: int,
                                                         lens: list[int], threads: int) -> None:
    lib = _lib()
    g = torch.Generator().manual_seed(heads * 1000 + dim + block)
    q, k_cache, v_cache, tables, lens_t = _paged(g, lens, heads, kv_heads, dim, block)
    want = cpu_attention.reference(q, k_cache, v_cache, tables, lens_t, block)
    with build.num_threads(threads):
        got = cpu_attention.decode(lib.ps_decode_attention_f32, q, k_cache, v_cache, tables, lens_t, max(lens), block)
    assert got.dtype == torch.float32 and got.shape == q.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_decode_attention_takes_strided_query_rows() -> None:
    """Queries are a slice of the fused qkv activation: row stride larger than heads * dim."""
    lib = _lib()
    g = torch.Generator().manual_seed(5)
    q, k_cache, v_cache, tables, lens = _paged(g, [20, 5], 9, 3, 64, 16)
    qkv = torch.cat((q, torch.randn(2, 6, 64, generator=g)), 1)
    got = cpu_attention.decode(lib.ps_decode_attention_f32, qkv[:, :9], k_cache, v_cache, tables, lens, 20, 16)
    torch.testing.assert_close(got, cpu_attention.decode(lib.ps_decode_attention_f32, q, k_cache, v_cache,
                                                         tables, lens, 20, 16), rtol=0, atol=0)


def test_decode_attention_refuses_bad_shapes() -> None:
    lib = _lib()
    g = torch.Generator().manual_seed(6)
    q, k_cache, v_cache, tables, lens = _paged(g, [20], 4, 2, 64, 16)
    with pytest.raises(build.KernelUnavailable):  # scratch sized for a shorter context than a sequence has
        cpu_attention.decode(lib.ps_decode_attention_f32, q, k_cache, v_cache, tables, lens, 10, 16)
    q, k_cache, v_cache, tables, lens = _paged(g, [20], 4, 2, 12, 16)
    with pytest.raises(build.KernelUnavailable):  # a head size that is not a multiple of 8
        cpu_attention.decode(lib.ps_decode_attention_f32, q, k_cache, v_cache, tables, lens, 20, 16)


def test_paged_attention_takes_the_fp32_kernel_only_when_asked() -> None:
    """float32 decode through the model's attention: metadata built for the kernel (dtype auto
    beside bf16 weights) gives the torch path's result (--dtype float32, the reference), and the
    K/V of the new tokens land in the same slots."""
    _lib()
    cpu = torch.device("cpu")
    assert not kernel_decode_available(cpu, torch.float32), "float32 keeps torch's attention unless asked"
    assert kernel_decode_available(cpu, torch.float32, f32_kernels=True)
    heads, kv_heads, dim, bs = 9, 3, 64, 16
    tables, lens = [[4, 1, 6], [2, 5]], [40, 17]
    out, caches = [], []
    for kernel in (False, True):
        cache = torch.zeros(2, 8 * bs, kv_heads, dim)
        layer = LayerCache(cache[0], cache[1])
        hist = torch.Generator().manual_seed(8)
        for table, n in zip(tables, lens, strict=True):
            pos = torch.arange(n - 1)
            slots = torch.tensor(table)[pos // bs] * bs + pos % bs
            layer.write(slots, torch.randn(n - 1, kv_heads, dim, generator=hist),
                        torch.randn(n - 1, kv_heads, dim, generator=hist))
        meta = build_metadata(list(zip(tables, lens, strict=True)), [], bs, cpu, torch.float32, paged_kernel=kernel)
        assert (meta.decode_gather is None) == kernel
        step = torch.Generator().manual_seed(9)
        q, k, v = (torch.randn(2, h, dim, generator=step) for h in (heads, kv_heads, kv_heads))
        out.append(paged_attention(q, k, v, layer, meta))
        caches.append(cache)
    torch.testing.assert_close(out[1], out[0], rtol=1e-5, atol=1e-5)
    assert torch.equal(caches[0], caches[1])


@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [
    (16, 1, 64), (17, 1, 64), (32, 2, 64), (34, 2, 64),  # query heads per KV head: 16 fits, 17 does not
    (4, 1, 256), (4, 1, 264), (4, 1, 8), (4, 1, 12), (6, 4, 64)])
def test_decode_fits_says_exactly_which_shapes_the_kernel_takes(heads: int, kv_heads: int, dim: int) -> None:
    """The model runner picks the kernel only for shapes it takes (a model beyond them decodes with
    torch's attention instead of failing at its first decode): the Python limits must be the C ones."""
    lib = _lib()
    fits = cpu_attention.decode_fits(heads, kv_heads, dim, torch.float32)
    bs, cpu = 16, torch.device("cpu")
    k_cache, v_cache = torch.randn(2 * bs, kv_heads, dim), torch.randn(2 * bs, kv_heads, dim)
    tables, lens = torch.tensor([[1, 0]]), torch.tensor([20])
    q = torch.randn(1, heads, dim)
    if fits:
        got = cpu_attention.decode(lib.ps_decode_attention_f32, q, k_cache, v_cache, tables, lens, 20, bs)
        torch.testing.assert_close(got, cpu_attention.reference(q, k_cache, v_cache, tables, lens, bs),
                                   rtol=1e-4, atol=1e-5)
    else:
        with pytest.raises(cpu_attention.KernelUnavailable):
            cpu_attention.decode(lib.ps_decode_attention_f32, q, k_cache, v_cache, tables, lens, 20, bs)
    assert kernel_decode_available(cpu, torch.float32, True, (heads, kv_heads, dim)) == fits
