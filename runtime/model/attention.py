"""Attention over a paged KV cache, on CPU and CUDA alike.

New K/V are scattered into their slots first; each sequence then attends over the slots its
block table names. Decode tokens (one query each) are batched with a padded gather and an
additive mask; prefill chunks run one sequence at a time with a causal mask offset by the cached
prefix.
Everything that does not depend on the layer (gather indices, masks) is built once per step in
`AttentionMetadata`, not once per layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from phasesplit.runtime.kernels import build, cpu_attention


@dataclass
class PrefillSegment:
    start: int  # first row of this sequence's queries in the flat batch
    length: int  # number of query tokens (this chunk)
    context: int  # tokens visible after this chunk: cached prefix + chunk
    gather: torch.Tensor | None  # slots of all `context` tokens; None when there is no prefix
    mask: torch.Tensor | None  # [length, context] bool, None when plain causal


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [tokens] slot each new token's K/V is written to
    num_decode: int = 0  # the first num_decode tokens are single-token decode queries
    decode_gather: torch.Tensor | None = None  # [num_decode, max_context] slots, padded
    decode_bias: torch.Tensor | None = None  # [num_decode, 1, max_context] 0 or -inf; None: no padding
    # For the CPU kernel instead of the gather: block tables, context lengths, the longest context
    decode_tables: torch.Tensor | None = None  # [num_decode, blocks] int64
    decode_lens: torch.Tensor | None = None  # [num_decode] int64
    decode_max_len: int = 0
    block_size: int = 0
    prefills: list[PrefillSegment] = field(default_factory=list)


class LayerCache:
    """One layer's K and V cache ([slots, kv_heads, dim] each) with their int64 row views made
    once, not at every call: at batch 1 each extra op is a noticeable share of a decode step."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k, self.v = k, v
        self.k_rows, self.v_rows = _int64_rows(k), _int64_rows(v)

    def write(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        kr, vr = _int64_rows(k), _int64_rows(v)
        if self.k_rows is None or kr is None or vr is None:
            write_rows(self.k, slots, k)
            write_rows(self.v, slots, v)
        else:
            self.k_rows[slots] = kr
            self.v_rows[slots] = vr

    def read(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V rows of `slots`: [*slots.shape, kv_heads, dim] each."""
        if self.k_rows is None:
            return self.k[slots], self.v[slots]
        return _select_rows(self.k_rows, self.k, slots), _select_rows(self.v_rows, self.v, slots)


def layer_caches(kv_cache: torch.Tensor) -> list[LayerCache]:
    """Per-layer views of a [2, layers, slots, kv_heads, dim] cache."""
    return [LayerCache(kv_cache[0, i], kv_cache[1, i]) for i in range(kv_cache.shape[1])]


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cache: LayerCache,
    meta: AttentionMetadata,
    written: bool = False,
) -> torch.Tensor:
    """q: [tokens, heads, dim]; k, v: [tokens, kv_heads, dim]. `written`: k and v are already in
    their cache slots (the CPU RoPE kernel writes them)."""
    if not written:
        cache.write(meta.slot_mapping, k, v)
    gqa = q.shape[1] != k.shape[1]
    if meta.num_decode and not meta.prefills:
        return _decode(q, cache, meta, gqa)
    out = torch.empty_like(q)
    if meta.num_decode:
        out[: meta.num_decode] = _decode(q[: meta.num_decode], cache, meta, gqa)
    lib = (build.library() if q.device.type == "cpu" and q.dtype == torch.bfloat16
           and cpu_attention.prefill_fits(q.shape[2]) else None)
    for seg in meta.prefills:
        sl = slice(seg.start, seg.start + seg.length)
        if seg.gather is None:
            ks, vs = k[sl], v[sl]
        else:  # a cached prefix: all of the context's K/V, from the cache
            ks, vs = cache.read(seg.gather)
        if lib is not None:  # the CPU kernel (2-3x SDPA here)
            out[sl] = cpu_attention.prefill(lib, q[sl], ks, vs)
            continue
        qs = q[sl].transpose(0, 1).unsqueeze(0)
        o = F.scaled_dot_product_attention(
            qs,
            ks.transpose(0, 1).unsqueeze(0),
            vs.transpose(0, 1).unsqueeze(0),
            attn_mask=seg.mask,
            is_causal=seg.mask is None,
            enable_gqa=gqa,
        )
        out[seg.start : seg.start + seg.length] = o[0].transpose(0, 1)
    return out


def _decode(q: torch.Tensor, cache: LayerCache, meta: AttentionMetadata, gqa: bool) -> torch.Tensor:
    if meta.decode_gather is None:  # built for the CPU kernel (build_metadata's paged_kernel)
        return cpu_attention.decode(_decode_kernel(q.dtype), q, cache.k, cache.v, meta.decode_tables,
                                    meta.decode_lens, meta.decode_max_len, meta.block_size)
    ks, vs = cache.read(meta.decode_gather)  # [n, ctx, kv_heads, dim]
    if q.device.type == "cpu" and cache.k.shape[1] <= BLOCK_DIAGONAL_MAX_KV_HEADS:
        return decode_block_diagonal(q, ks, vs, meta.decode_bias)
    mask = None if meta.decode_bias is None else meta.decode_bias.unsqueeze(1)  # [n, 1, 1, ctx]
    o = F.scaled_dot_product_attention(q.unsqueeze(2), ks.transpose(1, 2), vs.transpose(1, 2),
                                       attn_mask=mask, enable_gqa=gqa)
    return o.squeeze(2)


# Up to this many KV heads the block-diagonal form's wasted multiplies (a factor of kv_heads) cost
# less on CPU than the copies a per-head layout needs; beyond it SDPA is used.
BLOCK_DIAGONAL_MAX_KV_HEADS = 8

_spread_cache: dict[tuple, torch.Tensor] = {}


def _head_spread(kv_heads: int, dim: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """[1, kv_heads, 1, kv_heads, 1]: identity over KV heads, times the softmax scale."""
    key = (kv_heads, dim, dtype, device)
    t = _spread_cache.get(key)
    if t is None:
        t = (torch.eye(kv_heads, dtype=torch.float32) * dim**-0.5).to(dtype=dtype, device=device)
        t = _spread_cache[key] = t.view(1, kv_heads, 1, kv_heads, 1)
    return t


def decode_block_diagonal(q: torch.Tensor, ks: torch.Tensor, vs: torch.Tensor,
                          bias: torch.Tensor | None) -> torch.Tensor:
    """Single-query attention for a batch as two plain bmm calls over the gathered rows.

    q: [n, heads, dim]; ks, vs: [n, ctx, kv_heads, dim]; bias: [n, 1, ctx] (0 or -inf) or None.
    Each sequence's keys form a contiguous [ctx, kv_heads*dim] matrix, but a per-head matmul
    would need them as [kv_heads, ctx, dim], a strided layout that makes torch copy them (and
    CPU SDPA for one query measured ~10x slower). Instead each query head is spread into a
    block-diagonal row that is zero outside its KV head's `dim` columns, so q @ K^T over the
    whole row gives that head's scores; for P @ V the matching diagonal block of the product is
    that head's output. The extra zeros are cheap: decode attention is bound by reading K/V
    once, which this does. Scores are rounded to q's dtype and the softmax runs in float32, as
    in Hugging Face's eager attention.
    """
    n, heads, dim = q.shape
    ctx, kv_heads = ks.shape[1], ks.shape[2]
    group = heads // kv_heads
    spread = _head_spread(kv_heads, dim, q.dtype, q.device)
    q_bd = (q.view(n, kv_heads, group, 1, dim) * spread).view(n, heads, kv_heads * dim)
    scores = torch.bmm(q_bd, ks.reshape(n, ctx, kv_heads * dim).transpose(1, 2))  # [n, heads, ctx]
    if bias is not None:
        scores = scores + bias
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    out = torch.bmm(probs, vs.reshape(n, ctx, kv_heads * dim)).view(n, kv_heads, group, kv_heads, dim)
    return torch.diagonal(out, dim1=1, dim2=3).permute(0, 3, 1, 2).reshape(n, heads, dim)


def _int64_rows(t: torch.Tensor) -> torch.Tensor | None:
    """View [n, heads, dim] as [n, row_bytes/8] int64 when the layout allows it (no copy)."""
    row = t[0].numel() * t.element_size() if t.shape[0] else 0
    if row % 8 or t.stride(-1) != 1 or t.stride(-2) != t.shape[-1]:
        return None
    try:
        return t.reshape(t.shape[0], -1).view(torch.int64)
    except RuntimeError:
        return None


def write_rows(cache: torch.Tensor, slots: torch.Tensor, values: torch.Tensor) -> None:
    """cache[slots] = values, for [slots, heads, dim] tensors.

    Moving whole rows as int64 words is a plain memory copy; on CPU it measured ~50x faster than
    index_copy_ on bf16 (which takes a slow element-wise path), and it is exact for any dtype.
    """
    c, v = _int64_rows(cache), _int64_rows(values)
    if c is None or v is None:
        cache.index_copy_(0, slots, values.to(cache.dtype))
    else:
        c[slots] = v


def read_rows(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """cache[slots] for any shape of slot indices: [*slots.shape, heads, dim]."""
    c = _int64_rows(cache)
    if c is None:
        return cache[slots]
    return _select_rows(c, cache, slots)


def _select_rows(rows: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """cache[slots] through `rows`, cache's int64 row view (a plain row copy, see write_rows)."""
    picked = torch.index_select(rows, 0, slots.reshape(-1)).view(cache.dtype)
    return picked.view(*slots.shape, *cache.shape[1:])


def _decode_kernel(dtype: torch.dtype):
    lib = build.library() if dtype == torch.bfloat16 else build.layer_f32_library()
    if lib is None:
        raise RuntimeError("metadata was built for the CPU attention kernel, which is not available")
    return lib.ps_decode_attention_bf16 if dtype == torch.bfloat16 else lib.ps_decode_attention_f32


def kernel_decode_available(device: torch.device, dtype: torch.dtype, f32_kernels: bool = False,
                            shape: tuple[int, int, int] | None = None) -> bool:
    """Whether decode attention can use a CPU kernel: bf16 on a CPU the bf16 kernels were built
    for; fp32 where the model runs the AVX2 fp32 layer kernels (`f32_kernels`: dtype auto beside
    bf16 weights; --dtype float32 keeps torch's attention, the reference). `shape` (query heads,
    KV heads, head size; per rank) must be one the kernel takes (cpu_attention.decode_fits)."""
    if device.type != "cpu":
        return False
    if shape is not None and not cpu_attention.decode_fits(*shape, dtype):
        return False
    if dtype == torch.float32:
        return f32_kernels and build.layer_f32_library() is not None
    return dtype == torch.bfloat16 and build.library() is not None


DECODE_WIDTH_STEP = 32


def decode_tables(decode: list[tuple[list[int], int]], width: int, block_size: int
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Block tables [n, blocks covering `width`], context lengths [n] and the slot of each
    sequence's new token [n], for (block_table, context_len) pairs. Built with numpy in one pass:
    per-sequence torch ops cost more than the math here."""
    lens = np.fromiter((ctx for _, ctx in decode), dtype=np.int64, count=len(decode))
    tables = np.zeros((len(decode), -(-width // block_size)), dtype=np.int64)
    for i, (table, _) in enumerate(decode):
        n = min(len(table), tables.shape[1])
        tables[i, :n] = table[:n]
    last = lens - 1
    return tables, lens, tables[np.arange(len(decode)), last // block_size] * block_size + last % block_size


def decode_gather(tables: np.ndarray, lens: np.ndarray, width: int, block_size: int
                  ) -> tuple[np.ndarray, np.ndarray]:
    """The slots each sequence attends over, [n, width], and which of them are real ([n, width]
    bool); padding points at slot 0, which the runner keeps finite."""
    pos = np.arange(width)
    mask = pos[None, :] < lens[:, None]
    gather = np.where(mask, tables[:, pos // block_size] * block_size + pos % block_size, 0)
    return gather, mask


def build_metadata(
    decode: list[tuple[list[int], int]],
    prefill: list[tuple[list[int], int, int]],
    block_size: int,
    device: torch.device,
    dtype: torch.dtype = torch.float32,
    paged_kernel: bool = False,
) -> AttentionMetadata:
    """Metadata for one step.

    decode: (block_table, context_len) per decode sequence; its new token is at context_len-1.
    prefill: (block_table, cached_len, chunk_len) per prefill sequence, in flat-batch order
    after the decode tokens. paged_kernel: decode attention runs in the CPU kernel, which reads
    the cache through the block tables (no gather indices or padding mask are built).
    """
    slots: list[int] = []
    meta = AttentionMetadata(slot_mapping=torch.empty(0), num_decode=len(decode), block_size=block_size)
    if decode and paged_kernel:
        tables, lens, last_slots = decode_tables(decode, max(ctx for _, ctx in decode), block_size)
        slots = last_slots.tolist()
        meta.decode_tables, meta.decode_lens = torch.from_numpy(tables), torch.from_numpy(lens)
        meta.decode_max_len = int(lens.max())
    elif decode:
        # Rounded up so that the attention matmuls keep one shape for DECODE_WIDTH_STEP steps:
        # oneDNN builds (JIT-compiles) a kernel per bf16 matmul shape, ~0.7 ms each here, which
        # at one new context length per step cost more than the matmuls themselves.
        width = -(-max(ctx for _, ctx in decode) // DECODE_WIDTH_STEP) * DECODE_WIDTH_STEP
        tables, lens, last_slots = decode_tables(decode, width, block_size)
        slots = last_slots.tolist()
        gather, mask = decode_gather(tables, lens, width, block_size)
        meta.decode_gather = torch.from_numpy(gather).to(device)
        if not mask.all():  # no padding (every context a multiple of the step): no mask
            bias = np.where(mask, np.float32(0), np.float32(-np.inf))
            meta.decode_bias = torch.from_numpy(bias)[:, None, :].to(device=device, dtype=dtype)
    start = len(decode)
    for table, cached, chunk in prefill:
        ctx = cached + chunk
        new = _slots_of(table, cached, ctx, block_size)
        slots.extend(new.tolist())
        if cached == 0:
            seg = PrefillSegment(start, chunk, ctx, None, None)
        else:
            visible = torch.arange(ctx)[None, :] <= (cached + torch.arange(chunk))[:, None]
            seg = PrefillSegment(start, chunk, ctx, _slots_of(table, 0, ctx, block_size).to(device), visible.to(device))
        meta.prefills.append(seg)
        start += chunk
    meta.slot_mapping = torch.tensor(slots, dtype=torch.long, device=device)
    return meta


def _slots_of(table: list[int], begin: int, end: int, block_size: int) -> torch.Tensor:
    pos = torch.arange(begin, end)
    blocks = torch.tensor(table, dtype=torch.long)[pos // block_size]
    return blocks * block_size + pos % block_size
