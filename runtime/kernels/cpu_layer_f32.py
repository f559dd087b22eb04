"""A decoder layer's fp32 ops besides its matmuls on AVX2 CPUs (layer_f32_avx2.c): RMSNorm, RoPE
with the K/V cache write, decode attention over the paged cache, and SwiGLU for the projections
whose matmul has no fused epilogue (GGUF blocks).

Used where dtype auto runs fp32 activations and KV cache beside bf16 weights (cpu_gemm_avx2.py):
there a batch-1 decode step spent about as long in these ops' torch versions (a dozen small ops
each per layer, the paged K/V gathered into a padded copy) as in streaming its weights. The
functions take the bf16 kernels' arguments, so cpu_norm.rms_norm, cpu_rope.rope_and_write and
cpu_attention.decode call them; `--dtype float32` keeps torch's ops, the reference.
"""

from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F

from phasesplit.runtime.kernels import cpu_attention, cpu_norm, cpu_rope
from phasesplit.runtime.kernels.build import KernelUnavailable, num_threads


def declare(lib: ctypes.CDLL) -> None:
    """The same argument lists as the bf16 kernels' (cpu_norm, cpu_rope, cpu_attention.declare)."""
    p, n = ctypes.c_void_p, ctypes.c_long
    for name, args in (("ps_rms_norm_f32", [p] * 3 + [n] * 2 + [ctypes.c_float, ctypes.c_int]),
                       ("ps_rope_write_f32", [p] + [n] * 4 + [p] * 5 + [ctypes.c_int]),
                       ("ps_decode_attention_f32",
                        [p, n, p, p, p, n, p, p] + [n] * 5 + [ctypes.c_float, p, n, ctypes.c_int]),
                       ("ps_swiglu_f32", [p, p, n, n])):
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, ctypes.c_int


def swiglu(lib: ctypes.CDLL, gu: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of gu [M, 2I] fp32 (gate columns first), as [M, I]."""
    gu = gu.contiguous()
    m, two_i = gu.shape
    out = torch.empty(m, two_i // 2, dtype=torch.float32)
    if two_i % 2 or lib.ps_swiglu_f32(gu.data_ptr(), out.data_ptr(), m, two_i // 2):
        raise KernelUnavailable(f"swiglu rejected a row of {two_i}")
    return out


def rope_reference(qkv: torch.Tensor, heads: int, kv_heads: int, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Q and K heads of qkv [M, heads + 2*kv_heads, dim] rotated (rotate-half), V unchanged."""
    half = qkv.shape[-1] // 2
    c, s = torch.cat((cos, cos), -1)[:, None], torch.cat((sin, sin), -1)[:, None]
    x = qkv[:, : heads + kv_heads]
    rot = torch.cat((-x[..., half:], x[..., :half]), -1)
    return torch.cat((x * c + rot * s, qkv[:, heads + kv_heads :]), 1)


def self_check(lib: ctypes.CDLL) -> None:
    """Each kernel against torch on small odd shapes, on 1 and 2 threads."""
    g = torch.Generator().manual_seed(0)
    for m, k in ((1, 576), (70, 24)):
        x, w = torch.randn(m, k, generator=g) * 4, torch.randn(k, generator=g)
        got = cpu_norm.rms_norm(lib.ps_rms_norm_f32, x, w, 1e-5)
        if not torch.allclose(got, F.rms_norm(x, (k,), w, 1e-5), rtol=1e-5, atol=1e-5):
            raise KernelUnavailable("fp32 rms_norm self-check failed")
    gu = torch.randn(5, 2 * 40, generator=g) * 6
    gate, up = gu.chunk(2, dim=-1)
    if not torch.allclose(swiglu(lib, gu), F.silu(gate) * up, rtol=1e-5, atol=1e-5):
        raise KernelUnavailable("fp32 swiglu self-check failed")
    heads, kv_heads, dim, m = 4, 2, 48, 3
    qkv = torch.randn(m, heads + 2 * kv_heads, dim, generator=g)
    ang = torch.rand(m, dim // 2, generator=g) * 6
    caches = torch.zeros(2, 8, kv_heads, dim)
    want = rope_reference(qkv, heads, kv_heads, ang.cos(), ang.sin())
    cpu_rope.rope_and_write(lib.ps_rope_write_f32, qkv, heads, kv_heads, ang.cos(), ang.sin(),
                            torch.tensor([5, -1, 0]), caches[0], caches[1])
    ok = torch.allclose(qkv, want, rtol=1e-5, atol=1e-5) and torch.equal(caches[0, 5], qkv[0, heads : heads + kv_heads])
    ok = ok and torch.equal(caches[1, 0], qkv[2, heads + kv_heads :]) and not caches[:, 1:5].any()
    if not ok:
        raise KernelUnavailable("fp32 rope self-check failed")
    fn = lib.ps_decode_attention_f32
    for heads, kv_heads, dim, lens in ((9, 3, 64, [1, 17, 40]), (4, 4, 40, [5, 33]), (8, 1, 128, [70])):
        block, blocks = 16, 12
        k_cache = torch.randn(blocks * block, kv_heads, dim, generator=g)
        v_cache = torch.randn(blocks * block, kv_heads, dim, generator=g)
        tables = torch.stack([torch.randperm(blocks, generator=g)[:6] for _ in lens])
        lens_t = torch.tensor(lens)
        q = torch.randn(len(lens), heads, dim, generator=g)
        want = cpu_attention.reference(q, k_cache, v_cache, tables, lens_t, block)
        for threads in (1, 2):
            with num_threads(threads):
                got = cpu_attention.decode(fn, q, k_cache, v_cache, tables, lens_t, max(lens), block)
            err = (got - want).abs().max().item()
            if not err <= 1e-5:
                raise KernelUnavailable(f"fp32 decode attention self-check failed (heads {heads}/{kv_heads}, "
                                        f"dim {dim}: max error {err:.3g})")
