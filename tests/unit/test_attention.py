"""Paged attention against plain per-sequence attention on the same tensors."""

import pytest
import torch
import torch.nn.functional as F

from phasesplit.runtime.model.attention import (
    LayerCache,
    build_metadata,
    decode_block_diagonal,
    paged_attention,
)


def reference(q: torch.Tensor, ks: list[torch.Tensor], vs: list[torch.Tensor]) -> torch.Tensor:
    """One query per sequence, each over its own unpadded K/V: [n, heads, dim]."""
    out = []
    for i, (k, v) in enumerate(zip(ks, vs, strict=True)):
        o = F.scaled_dot_product_attention(q[i][None, :, None, :], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                           enable_gqa=q.shape[1] != k.shape[1])
        out.append(o[0, :, 0])
    return torch.stack(out)


@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (4, 4), (8, 1)])
def test_block_diagonal_decode_equals_per_sequence_attention(heads: int, kv_heads: int) -> None:
    g = torch.Generator().manual_seed(heads * 10 + kv_heads)
    dim, lens = 16, [5, 17, 1, 12]
    q = torch.randn(len(lens), heads, dim, generator=g, dtype=torch.float64)
    ks = [torch.randn(n, kv_heads, dim, generator=g, dtype=torch.float64) for n in lens]
    vs = [torch.randn(n, kv_heads, dim, generator=g, dtype=torch.float64) for n in lens]
    width = max(lens)
    pad = torch.full((len(lens), 1, width), float("-inf"), dtype=torch.float64)
    k_pad = torch.randn(len(lens), width, kv_heads, dim, generator=g, dtype=torch.float64)  # garbage beyond each length
    v_pad = torch.randn(len(lens), width, kv_heads, dim, generator=g, dtype=torch.float64)
    for i, n in enumerate(lens):
        pad[i, 0, :n] = 0
        k_pad[i, :n], v_pad[i, :n] = ks[i], vs[i]
    got = decode_block_diagonal(q, k_pad, v_pad, pad)
    torch.testing.assert_close(got, reference(q, ks, vs))


def test_paged_decode_reads_each_sequence_own_blocks() -> None:
    """Two sequences with scattered, interleaved blocks: writes land in the right slots and each
    decode query sees exactly its own history, on the CPU fast path and the SDPA path alike."""
    g = torch.Generator().manual_seed(0)
    heads, kv_heads, dim, bs = 6, 2, 8, 4
    cache = torch.zeros(2, 1, 12 * bs, kv_heads, dim)
    layer = LayerCache(cache[0, 0], cache[1, 0])
    tables = [[7, 2, 9], [1, 11]]
    lens = [10, 6]  # tokens already cached, the new one included
    hist_k = [torch.randn(n, kv_heads, dim, generator=g) for n in lens]
    hist_v = [torch.randn(n, kv_heads, dim, generator=g) for n in lens]
    for table, k, v in zip(tables, hist_k, hist_v, strict=True):  # history but the last token
        pos = torch.arange(len(k) - 1)
        slots = torch.tensor(table)[pos // bs] * bs + pos % bs
        layer.write(slots, k[:-1], v[:-1])
    meta = build_metadata(list(zip(tables, lens, strict=True)), [], bs, torch.device("cpu"))
    q = torch.randn(2, heads, dim, generator=g)
    new_k = torch.stack([k[-1] for k in hist_k])
    new_v = torch.stack([v[-1] for v in hist_v])
    got = paged_attention(q, new_k, new_v, layer, meta)
    torch.testing.assert_close(got, reference(q, hist_k, hist_v))
    import phasesplit.runtime.model.attention as attention

    old = attention.BLOCK_DIAGONAL_MAX_KV_HEADS
    attention.BLOCK_DIAGONAL_MAX_KV_HEADS = 0  # force the SDPA path
    try:
        torch.testing.assert_close(paged_attention(q, new_k, new_v, layer, meta), reference(q, hist_k, hist_v))
    finally:
        attention.BLOCK_DIAGONAL_MAX_KV_HEADS = old


def test_paged_decode_through_the_cpu_kernel_matches_the_gather_path() -> None:
    """bf16 on CPU: metadata built for the kernel (block tables, no gather) gives the gather +
    block-diagonal path's result, with writes landing in the same slots. Where the kernel
    cannot run here, building such metadata must be refused by the runner (covered by
    kernel_decode_available)."""
    from phasesplit.runtime.model.attention import kernel_decode_available

    cpu = torch.device("cpu")
    if not kernel_decode_available(cpu, torch.bfloat16):
        from phasesplit.runtime.kernels import build

        assert build.library() is None
        pytest.skip("this CPU lacks AVX512-BF16 or no C compiler is on PATH: the decode kernel cannot run here")
    g = torch.Generator().manual_seed(3)
    heads, kv_heads, dim, bs = 9, 3, 64, 16
    cache = torch.randn(2, 1, 40 * bs, kv_heads, dim, generator=g).bfloat16()
    tables = [[int(b) for b in torch.randperm(40, generator=g)[:12]] for _ in range(5)]
    lens = [1, 16, 17, 100, 180]
    q = torch.randn(len(lens), heads, dim, generator=g).bfloat16()
    new_k = torch.randn(len(lens), kv_heads, dim, generator=g).bfloat16()
    new_v = torch.randn(len(lens), kv_heads, dim, generator=g).bfloat16()
    decode = list(zip(tables, lens, strict=True))
    outs, caches = [], []
    for kernel in (False, True):
        c = cache.clone()
        layer = LayerCache(c[0, 0], c[1, 0])
        meta = build_metadata(decode, [], bs, cpu, torch.bfloat16, paged_kernel=kernel)
        assert (meta.decode_gather is None) == kernel
        outs.append(paged_attention(q, new_k, new_v, layer, meta).float())
        caches.append(c)
    assert torch.equal(caches[0], caches[1])
    # the kernel keeps scores and probabilities in float32; the torch path rounds both to bf16
    torch.testing.assert_close(outs[1], outs[0], rtol=0.02, atol=0.02)
