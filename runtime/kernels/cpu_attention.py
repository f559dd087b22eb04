"""Decode attention over the paged bf16 KV cache through decode_attention_bf16.c (AVX512).

It reads each sequence's K/V rows where the block table puts them; the torch path copies them
into a padded batch first and multiplies block-diagonal rows (see model/attention.py).
"""

from __future__ import annotations

import ctypes

import torch

from phasesplit.runtime.kernels.build import KernelUnavailable, num_threads


def declare(lib: ctypes.CDLL) -> None:
    fn = lib.ps_decode_attention_bf16
    fn.argtypes = ([ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_long,
                    ctypes.c_void_p, ctypes.c_void_p] + [ctypes.c_long] * 5
                   + [ctypes.c_float, ctypes.c_void_p, ctypes.c_long, ctypes.c_int])
    fn.restype = ctypes.c_int
    fn = lib.ps_prefill_attention_bf16
    fn.argtypes = ([ctypes.c_void_p, ctypes.c_long] * 3 + [ctypes.c_void_p] + [ctypes.c_long] * 5
                   + [ctypes.c_float, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_long, ctypes.c_int])
    fn.restype = ctypes.c_int
    fn = lib.ps_prefill_attention_scratch
    fn.argtypes = [ctypes.c_long] * 4 + [ctypes.POINTER(ctypes.c_long)]
    fn.restype = ctypes.c_long


def prefill(lib: ctypes.CDLL, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention of a chunk: q [L, heads, dim] for the last L of the k/v [NK, kv_heads, dim]
    positions (NK - L tokens of cached prefix; bf16; rows may be strided, each row's heads
    contiguous). Returns [L, heads, dim]."""
    n, heads, dim = q.shape
    nk, kv_heads = k.shape[0], k.shape[1]
    q, k, v = (t if t.stride(2) == 1 and t.stride(1) == dim else t.contiguous() for t in (q, k, v))
    pack_elems = ctypes.c_long()
    per_thread = lib.ps_prefill_attention_scratch(nk, heads, kv_heads, dim, ctypes.byref(pack_elems))
    threads = torch.get_num_threads()
    pack = torch.empty(pack_elems.value, dtype=torch.bfloat16)
    scratch = torch.empty(threads * per_thread, dtype=torch.uint8)
    out = torch.empty(n, heads, dim, dtype=q.dtype)
    rc = lib.ps_prefill_attention_bf16(q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0),
                                       out.data_ptr(), n, nk - n, heads, kv_heads, dim, dim**-0.5, pack.data_ptr(),
                                       scratch.data_ptr(), per_thread, threads)
    if rc != 0:
        raise KernelUnavailable(f"prefill attention rejected its arguments (code {rc})")
    return out


def prefill_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """float32 causal attention with GQA (queries are the last rows of k/v's positions): what
    `prefill` must equal up to rounding."""
    n, nk = q.shape[0], k.shape[0]
    visible = torch.arange(nk)[None, :] <= (nk - n + torch.arange(n))[:, None]
    o = torch.nn.functional.scaled_dot_product_attention(
        q.float().transpose(0, 1)[None], k.float().transpose(0, 1)[None], v.float().transpose(0, 1)[None],
        attn_mask=visible, enable_gqa=q.shape[1] != k.shape[1])
    return o[0].transpose(0, 1)


# The decode kernels' limits (MAX_DIM and MAX_GROUP in decode_attention_bf16.c and
# layer_f32_avx2.c; the head size a whole number of vectors: 16 bf16 lanes, 8 fp32 lanes). A
# model beyond them decodes with torch's attention instead of failing at its first decode.
MAX_HEAD_DIM = 256
MAX_GROUP = 16


def prefill_fits(head_dim: int) -> bool:
    """Whether the bf16 prefill kernel takes this head size (prefill_attention_bf16.c: whole
    32-element pairs of vectors); other sizes go through torch's SDPA."""
    return head_dim > 0 and head_dim % 32 == 0


def decode_fits(heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> bool:
    """Whether the decode kernel for `dtype` takes this attention shape (per rank under TP)."""
    lanes = 16 if dtype == torch.bfloat16 else 8
    return (kv_heads >= 1 and heads % kv_heads == 0 and heads // kv_heads <= MAX_GROUP
            and head_dim % lanes == 0 and 0 < head_dim <= MAX_HEAD_DIM)


def decode(fn: ctypes._CFuncPtr, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
           tables: torch.Tensor, lens: torch.Tensor, max_len: int, block_size: int) -> torch.Tensor:
    """q [n, heads, dim] bf16, or fp32 for ps_decode_attention_f32 (rows may be strided); caches
    [slots, kv_heads, dim]; tables [n, max_blocks] int64; lens [n] int64 (context incl. the new
    token). Returns [n, heads, dim]."""
    n, heads, dim = q.shape
    kv_heads = k_cache.shape[1]
    if q.stride(2) != 1 or q.stride(1) != dim:
        q = q.contiguous()
    threads = torch.get_num_threads()
    per_thread = (heads // kv_heads) * max_len
    scratch = torch.empty(threads * per_thread, dtype=torch.float32)
    out = torch.empty(n, heads, dim, dtype=q.dtype)
    rc = fn(q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(), tables.shape[1],
            lens.data_ptr(), out.data_ptr(), n, heads, kv_heads, dim, block_size, dim**-0.5, scratch.data_ptr(),
            per_thread, threads)
    if rc != 0:
        raise KernelUnavailable(f"decode attention rejected its arguments (code {rc})")
    return out


def reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
              lens: torch.Tensor, block_size: int) -> torch.Tensor:
    """Per-sequence float32 attention: what `decode` must equal up to rounding."""
    n, heads, dim = q.shape
    group = heads // k_cache.shape[1]
    out = torch.empty(n, heads, dim)
    for i in range(n):
        pos = torch.arange(int(lens[i]))
        slots = tables[i][pos // block_size] * block_size + pos % block_size
        k = k_cache[slots].float().repeat_interleave(group, dim=1)  # [ctx, heads, dim]
        v = v_cache[slots].float().repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,thd->ht", q[i].float(), k) * dim**-0.5
        out[i] = torch.einsum("ht,thd->hd", scores.softmax(-1), v)
    return out


def self_check(lib: ctypes.CDLL) -> None:
    g = torch.Generator().manual_seed(1)
    for n, prefix, heads, kv_heads, dim in ((1, 0, 2, 1, 32), (37, 0, 9, 3, 64), (50, 0, 4, 4, 64), (20, 33, 9, 3, 64)):
        qkv = torch.randn(prefix + n, heads + 2 * kv_heads, dim, generator=g).bfloat16()
        q, k, v = qkv[prefix:, :heads], qkv[:, heads : heads + kv_heads], qkv[:, heads + kv_heads :]
        for threads in (1, 2):
            with num_threads(threads):
                got = prefill(lib, q, k, v)
            err = (got.float() - prefill_reference(q, k, v)).abs().max().item()
            if not err <= 0.03:
                raise KernelUnavailable(f"prefill attention self-check failed ({n} tokens, heads {heads}/{kv_heads}: "
                                        f"max error {err:.3g})")
    fn = lib.ps_decode_attention_bf16
    g = torch.Generator().manual_seed(0)
    for heads, kv_heads, dim, lens in ((9, 3, 64, [1, 17, 40]), (4, 4, 32, [5, 33]), (8, 1, 128, [70])):
        block, blocks = 16, 12
        k_cache = torch.randn(blocks * block, kv_heads, dim, generator=g).bfloat16()
        v_cache = torch.randn(blocks * block, kv_heads, dim, generator=g).bfloat16()
        tables = torch.stack([torch.randperm(blocks, generator=g)[:6] for _ in lens])
        lens_t = torch.tensor(lens)
        q = torch.randn(len(lens), heads, dim, generator=g).bfloat16()
        want = reference(q, k_cache, v_cache, tables, lens_t, block)
        for threads in (1, 2):
            with num_threads(threads):
                got = decode(fn, q, k_cache, v_cache, tables, lens_t, max(lens), block)
            err = (got.float() - want).abs().max().item()
            if not err <= 0.02:
                raise KernelUnavailable(f"decode attention self-check failed (heads {heads}/{kv_heads}, dim {dim}: "
                                        f"max error {err:.3g})")
