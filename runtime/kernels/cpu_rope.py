"""RoPE on the Q and K heads plus the KV cache write, in one call (rope_bf16.c)."""

from __future__ import annotations

import ctypes

import torch

from phasesplit.runtime.kernels.build import KernelUnavailable


def declare(lib: ctypes.CDLL) -> None:
    fn = lib.ps_rope_write_bf16
    fn.argtypes = [ctypes.c_void_p] + [ctypes.c_long] * 4 + [ctypes.c_void_p] * 5 + [ctypes.c_int]
    fn.restype = ctypes.c_int


def rope_and_write(fn: ctypes._CFuncPtr, qkv: torch.Tensor, heads: int, kv_heads: int, cos: torch.Tensor,
                   sin: torch.Tensor, slots: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """qkv [M, heads + 2*kv_heads, dim] bf16 (fp32 for ps_rope_write_f32) contiguous, rotated in
    place; cos/sin [M, dim/2] fp32; the rotated K and the V of row i go to cache slot slots[i]."""
    m, _, dim = qkv.shape
    if fn(qkv.data_ptr(), m, heads, kv_heads, dim, cos.data_ptr(), sin.data_ptr(), slots.data_ptr(),
          k_cache.data_ptr(), v_cache.data_ptr(), torch.get_num_threads()):
        raise KernelUnavailable(f"rope rejected head size {dim} (not a multiple of twice its vector width)")


def self_check(lib: ctypes.CDLL) -> None:
    g = torch.Generator().manual_seed(0)
    heads, kv_heads, dim, m = 4, 2, 64, 3
    qkv = torch.randn(m, heads + 2 * kv_heads, dim, generator=g).bfloat16()
    ang = torch.rand(m, dim // 2, generator=g) * 6
    k_cache = torch.zeros(8, kv_heads, dim).bfloat16()
    v_cache = torch.zeros(8, kv_heads, dim).bfloat16()
    x = qkv[:, : heads + kv_heads].float()
    cos, sin = torch.cat((ang.cos(), ang.cos()), -1)[:, None], torch.cat((ang.sin(), ang.sin()), -1)[:, None]
    rot = torch.cat((-x[..., dim // 2 :], x[..., : dim // 2]), -1)
    want = x * cos + rot * sin
    v = qkv[:, heads + kv_heads :].clone()
    work = qkv.clone()
    rope_and_write(lib.ps_rope_write_bf16, work, heads, kv_heads, ang.cos(), ang.sin(), torch.tensor([5, -1, 0]),
                   k_cache, v_cache)
    ok = torch.allclose(work[:, : heads + kv_heads].float(), want, rtol=1e-2, atol=1e-2)
    ok = ok and torch.equal(k_cache[5], work[0, heads : heads + kv_heads]) and torch.equal(v_cache[0], v[2])
    ok = ok and not k_cache[1:5].any() and torch.equal(work[:, heads + kv_heads :], v)
    if not ok:
        raise KernelUnavailable("rope self-check failed")
