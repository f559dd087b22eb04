"""Llama-family decoder in plain PyTorch, reading and writing a paged KV cache.

The forward pass takes a flat batch of tokens from many sequences (prefill chunks and decode
tokens together) so that every linear layer runs once per step on all of them; only attention
is per-sequence. Projections are fused (qkv, gate+up) to keep the op count per layer low: at
135M parameters, Python and dispatch overhead per op is a large share of a decode step on CPU.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable
from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from phasesplit.runtime.kernels import (
    build,
    cpu_gemm,
    cpu_gemm_avx2,
    cpu_layer_f32,
    cpu_norm,
    cpu_quant,
    cpu_rope,
    hugepages,
)
from phasesplit.runtime.model.attention import AttentionMetadata, LayerCache, layer_caches, paged_attention
from phasesplit.runtime.model.config import ModelConfig
from phasesplit.runtime.model.quantized import QuantWeight
from phasesplit.runtime.model.sharding import Shard, plan


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Inverse frequencies for RoPE, with the scaling variants Llama models use."""
    dim = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    sc = cfg.rope_scaling or {}
    kind = sc.get("rope_type", sc.get("type", "default"))
    if kind == "linear":
        inv = inv / float(sc["factor"])
    elif kind == "llama3":
        # Llama 3.1: keep high frequencies, divide low ones by `factor`, blend in between.
        factor = float(sc["factor"])
        low, high = float(sc.get("low_freq_factor", 1.0)), float(sc.get("high_freq_factor", 4.0))
        old_ctx = float(sc.get("original_max_position_embeddings", 8192))
        wavelen = 2 * math.pi / inv
        smooth = (old_ctx / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > old_ctx / low, inv / factor, inv)
        mid = (wavelen <= old_ctx / low) & (wavelen >= old_ctx / high)
        inv = torch.where(mid, (1 - smooth) * inv / factor + smooth * inv, scaled)
    elif kind not in ("default", None):
        raise ValueError(f"unsupported rope scaling type {kind!r}")
    return inv.float()


class Linear(nn.Module):
    """A bias-free linear layer without nn.Linear's random init (weights always come from a file,
    and initialising on the meta device pulls in seconds of torch imports at start-up)."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.packed: torch.Tensor | None = None  # oneDNN's blocked layout
        self.tiled: torch.Tensor | None = None  # cpu_gemm's layout
        self._gemm = self._gemm_shared = None  # _gemm_shared: cpu_gemm(_avx2).matmul(shared=...)
        self._swiglu = False  # tiled with gate and up tiles alternating (pack_for_cpu(swiglu=True))
        self._bf16w = False  # tiled holds bf16 weights for fp32 activations (cpu_gemm_avx2)
        self.blocks: QuantWeight | None = None  # GGUF blocks served natively (quantized.py)
        self._qlib = self._qshared = None  # _qshared: cpu_quant.matmul(shared=...)

    @classmethod
    def from_weight(cls, weight: torch.Tensor) -> Linear:
        lin = cls.__new__(cls)
        nn.Module.__init__(lin)
        lin.out_features = weight.shape[0]
        lin.weight = nn.Parameter(weight, requires_grad=False)
        lin.packed = lin.tiled = lin._gemm = lin._gemm_shared = lin.blocks = lin._qlib = lin._qshared = None
        lin._swiglu = lin._bf16w = False
        return lin

    @classmethod
    def from_blocks(cls, blocks: QuantWeight, qlib) -> Linear:
        lin = cls.from_weight(torch.empty(0))
        lin.out_features = blocks.out_features
        lin.use_blocks(blocks, qlib)
        return lin

    def use_blocks(self, blocks: QuantWeight, qlib) -> None:
        """Serve this projection from GGUF blocks through the quantized kernels (`qlib`,
        build.quant_library()), in the layout they read fastest on this CPU
        (cpu_quant.for_kernel); the dequantized weight is dropped."""
        want = (self.out_features, self.weight.shape[1] if self.weight.dim() == 2 else blocks.in_features)
        if (blocks.out_features, blocks.in_features) != want:
            raise ValueError(f"quantized weight is {blocks.out_features}x{blocks.in_features}, the layer {want}")
        packed, qtype = cpu_quant.for_kernel(qlib, blocks.blocks, blocks.qtype)
        self.blocks, self._qlib = QuantWeight(packed, qtype, blocks.in_features), qlib
        self._qshared = cpu_quant.shared_call(qlib)  # with the decode helpers, as the bf16 one
        self.weight = nn.Parameter(torch.empty(0, dtype=self.weight.dtype), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None,
                out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """x @ W^T, plus `residual` when given (fused into the matmul). `out_dtype` float32 asks
        for unrounded sums where the kernel can give them (logits); otherwise it is a hint."""
        if self._swiglu:
            raise RuntimeError("this weight is packed for swiglu(), not for a plain product")
        if self.blocks is not None:
            return cpu_quant.matmul(self._qlib, x, self.blocks.blocks, self.blocks.qtype, residual,
                                    out_dtype or x.dtype, shared=self._qshared)
        if self._bf16w:
            return cpu_gemm_avx2.matmul(self._gemm, x, self.tiled, self.out_features, residual,
                                        shared=self._gemm_shared)
        if self._gemm is not None:
            return cpu_gemm.matmul(self._gemm, x, self.tiled, self.out_features, residual,
                                   out_dtype or x.dtype, shared=self._gemm_shared)
        if self.packed is not None:
            if residual is None:
                return torch.ops.mkldnn._linear_pointwise(x, self.packed, None, "none", [], "")
            return torch.ops.mkldnn._linear_pointwise.binary(x, residual, self.packed, None, "add")
        if residual is None:
            return F.linear(x, self.weight)
        return torch.addmm(residual, x, self.weight.t())

    def swiglu(self, x: torch.Tensor, f32_kernels=None) -> torch.Tensor:
        """silu(gate) * up for a weight holding the gate rows, then the up rows; in the matmul's
        epilogue when the weight was packed with swiglu=True, else in one C call with
        `f32_kernels` (cpu_layer_f32's library: GGUF blocks beside fp32 activations under dtype
        auto, or beside bf16 ones, see LlamaModel.block_swiglu), else torch's ops."""
        if self._swiglu and self._bf16w:
            return cpu_gemm_avx2.matmul(self._gemm, x, self.tiled, self.out_features, act=cpu_gemm_avx2.SWIGLU,
                                        shared=self._gemm_shared)
        if self._swiglu:
            return cpu_gemm.matmul(self._gemm, x, self.tiled, self.out_features, act=cpu_gemm.SWIGLU,
                                   shared=self._gemm_shared)
        if (self.blocks is not None and f32_kernels is not None and x.dtype == torch.bfloat16 and x.dim() == 2
                and x.device.type == "cpu"):
            # GGUF blocks beside bf16 activations: the kernel's fp32 sums go through the fp32
            # SwiGLU and are rounded once (torch's bf16 chunk/silu/mul rounds three times, and is
            # not something the one-call decode step could repeat bit for bit). Packed weights do
            # all of it in one C call, the same bits.
            out = cpu_quant.matmul_swiglu(self._qlib, x, self.blocks.blocks, self.blocks.qtype,
                                          f32_kernels.ps_swiglu_f32, shared=self._qshared)
            if out is not None:
                return out
            return cpu_layer_f32.swiglu(f32_kernels, self(x, out_dtype=torch.float32)).to(torch.bfloat16)
        gu = self(x)
        if f32_kernels is not None and gu.dtype == torch.float32 and gu.dim() == 2 and gu.device.type == "cpu":
            return cpu_layer_f32.swiglu(f32_kernels, gu)
        gate, up = gu.chunk(2, dim=-1)
        return F.silu(gate) * up

    def pack_for_cpu(self, swiglu: bool = False, bf16_weights: bool = False) -> str | None:
        """Re-lay the bf16 weight once for a faster CPU matmul; returns which layout, or None.

        An fp32 weight with `bf16_weights` (dtype auto on an AVX2 CPU without AVX512-BF16): rounded
        to bf16 in cpu_gemm's layout for cpu_gemm_avx2's kernel, activations staying fp32 (half the
        bytes a decode step streams); "bf16w_avx2". Kept fp32 where that kernel is unavailable.

        First choice is cpu_gemm's kernel (AVX512-BF16; 2-3x oneDNN at decode batch sizes, 1.1x
        at prefill sizes, measured here), else oneDNN's blocked layout (which, against a plain
        weight, saves the reorder oneDNN otherwise does inside every bf16 matmul: 10-30 %). The
        plain copy is dropped, so memory does not grow. Kept plain when neither applies or a
        check fails.
        """
        if self.blocks is not None:
            return cpu_quant.layout_name(self.blocks.qtype)
        w = self.weight
        if bf16_weights and w.device.type == "cpu" and w.dtype == torch.float32 and w.shape[1] % 2 == 0:
            lib = build.bf16w_library()
            if lib is None:
                return None
            self._gemm, self._gemm_shared, self._bf16w = lib.ps_gemm_bf16w_f32, lib.ps_gemm_bf16w_f32_shared, True
            self._swiglu = swiglu and w.shape[0] % (2 * cpu_gemm.TILE) == 0
            self.tiled = cpu_gemm_avx2.pack(w, swiglu=self._swiglu)
            self.weight = nn.Parameter(torch.empty(0, dtype=w.dtype), requires_grad=False)
            return "bf16w_avx2"
        if w.device.type != "cpu" or w.dtype != torch.bfloat16:
            return None
        layout = None
        lib = build.library()
        if lib is not None and w.shape[1] % 2 == 0:
            self._gemm, layout = lib.ps_gemm_bf16, "cpu_gemm"
            self._gemm_shared = cpu_gemm.shared_call(lib)
            self._swiglu = swiglu and w.shape[0] % (2 * cpu_gemm.TILE) == 0
            self.tiled = cpu_gemm.pack_swiglu(w) if self._swiglu else cpu_gemm.pack(w)
        elif torch.backends.mkldnn.is_available():
            try:
                packed = torch.ops.mkldnn._reorder_linear_weight(w.detach(), 32)
                probe = torch.randn(3, w.shape[1], generator=torch.Generator().manual_seed(0)).to(w.dtype)
                got = torch.ops.mkldnn._linear_pointwise(probe, packed, None, "none", [], "")
            except (RuntimeError, AttributeError):
                return None
            if not torch.allclose(got.float(), F.linear(probe, w).float(), rtol=2e-2, atol=2e-2):
                return None
            self.packed, layout = packed, "onednn"
        if layout:
            self.weight = nn.Parameter(torch.empty(0, dtype=w.dtype), requires_grad=False)
        return layout


class Embedding(nn.Module):
    def __init__(self, num: int, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num, dim))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


class DecoderLayer(nn.Module):
    """One layer, or one tensor-parallel rank's share of it (`shard`: its query/KV heads and MLP
    columns; see sharding.py). Sizes below are the rank's own."""

    def __init__(self, cfg: ModelConfig, shard: Shard) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = shard.num_heads, shard.num_kv_heads, cfg.head_dim
        q, kv = self.num_heads * cfg.head_dim, self.num_kv_heads * cfg.head_dim
        self.q_size, self.kv_size = q, kv
        self.eps = cfg.rms_eps
        self.attn_norm = nn.Parameter(torch.empty(cfg.hidden_size))
        self.qkv = Linear(cfg.hidden_size, q + 2 * kv)  # column-parallel: this rank's heads
        self.o_proj = Linear(q, cfg.hidden_size)  # row-parallel: a partial sum per rank
        self.mlp_norm = nn.Parameter(torch.empty(cfg.hidden_size))
        self.gate_up = Linear(cfg.hidden_size, 2 * shard.intermediate)  # column-parallel
        self.down = Linear(shard.intermediate, cfg.hidden_size)  # row-parallel

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: LayerCache,
                meta: AttentionMetadata, rope_kernel=None,
                all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None, f32_kernels=None) -> torch.Tensor:
        """`rope_kernel` (a CPU kernel, ps_rope_write_bf16 or _f32 for x's dtype): cos/sin are
        float32 [tokens, head_dim/2] and one C call rotates Q and K in place and writes K/V to the
        cache; else torch does both. `f32_kernels`: cpu_layer_f32's library, for the fp32 RMSNorm
        (see `rms_norm`) and SwiGLU. `all_reduce` (tensor parallel): sums the ranks' partial
        o_proj and down products."""
        norm_kernel = None if f32_kernels is None else f32_kernels.ps_rms_norm_f32
        h = rms_norm(x, self.attn_norm, self.eps, norm_kernel)
        t = x.shape[0]
        qkv = self.qkv(h).view(t, self.num_heads + 2 * self.num_kv_heads, self.head_dim)
        nq, nkv = self.num_heads, self.num_kv_heads
        if rope_kernel is not None:
            cpu_rope.rope_and_write(rope_kernel, qkv, nq, nkv, cos, sin, meta.slot_mapping,
                                    cache.k, cache.v)
            q, k, v = qkv[:, :nq], qkv[:, nq : nq + nkv], qkv[:, nq + nkv :]
            attn = paged_attention(q, k, v, cache, meta, written=True)
        else:
            # Q and K heads sit next to each other: one RoPE call rotates both (half the ops).
            qk = apply_rope(qkv[:, : nq + nkv], cos, sin)
            q, k, v = qk[:, :nq], qk[:, nq:], qkv[:, nq + nkv :]
            attn = paged_attention(q, k, v, cache, meta)
        if all_reduce is not None:  # the residual is added once, after the ranks' sum
            x = x + all_reduce(self.o_proj(attn.reshape(t, self.q_size)))
            h = rms_norm(x, self.mlp_norm, self.eps, norm_kernel)
            return x + all_reduce(self.down(self.gate_up.swiglu(h, f32_kernels)))
        # Each residual add is folded into its projection: one op and one pass fewer.
        x = self.o_proj(attn.reshape(t, self.q_size), residual=x)
        h = rms_norm(x, self.mlp_norm, self.eps, norm_kernel)
        return self.down(self.gate_up.swiglu(h, f32_kernels), residual=x)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, f32_kernel=None) -> torch.Tensor:
    """RMSNorm; the sum of squares is accumulated in float32 for every dtype.

    For bf16/fp16 inputs F.rms_norm upcasts the whole activation and runs ~10 ops over it:
    measured 5.6 ms for a 2048-token prefill chunk here against 0.33 ms for this (one float32
    reduction, then two multiplies in the input's dtype), the same rounding class as Hugging
    Face's module. bf16 on a CPU with the kernels: one C call (cpu_norm). float32 keeps
    F.rms_norm, which is exactly Hugging Face's arithmetic, unless `f32_kernel` (the AVX2 fp32
    kernel, cpu_layer_f32: the same arithmetic in one call; dtype auto on such CPUs) is given.
    """
    if x.dtype == torch.float32:
        if f32_kernel is not None and x.dim() == 2 and x.shape[1] % 8 == 0 and x.device.type == "cpu":
            return cpu_norm.rms_norm(f32_kernel, x, weight, eps)
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    if x.dtype == torch.bfloat16 and x.device.type == "cpu" and x.dim() == 2 and x.shape[1] % 16 == 0:
        lib = build.library()
        if lib is not None:
            return cpu_norm.rms_norm(lib.ps_rms_norm_bf16, x, weight, eps)
    norm = torch.linalg.vector_norm(x, dim=-1, keepdim=True, dtype=torch.float32)
    return x * torch.rsqrt(norm.square_().div_(x.shape[-1]).add_(eps)).to(x.dtype) * weight


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE (Hugging Face layout). cos is [tokens, 1, head_dim]; `sin` comes signed
    (its first half negated, see `rope_tables`), so rotate_half(x) * sin is roll(x) * sin."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), sin)


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, shard: Shard | None = None) -> None:
        """`shard`: a tensor-parallel rank's share of the layers (default: the whole model);
        embedding, norm and head are replicated."""
        super().__init__()
        self.cfg = cfg
        self.shard = shard or plan(cfg, 1)[0]
        self.all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None  # set by the runner under TP
        self.embed = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, self.shard) for _ in range(cfg.num_layers))
        self.norm = nn.Parameter(torch.empty(cfg.hidden_size))
        self.lm_head = None if cfg.tie_embeddings else Linear(cfg.hidden_size, cfg.vocab_size)
        self.tied_head: Linear | None = None  # a re-laid copy of the embedding (pack_for_cpu)
        # fp32 norm/RoPE/decode-attention kernels for AVX2 CPUs, used beside bf16 weights (pack_for_cpu)
        self.layer_f32 = None
        # the fp32 SwiGLU (layer_f32's library) for GGUF gate/up blocks beside bf16 activations
        self.block_swiglu = None
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)
        self._caches: tuple[torch.Tensor, list[LayerCache]] | None = None
        self._rope_table: tuple[torch.Tensor, torch.Tensor] | None = None  # rope_angles

    def rope_tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin ([tokens, 1, head_dim]) for `apply_rope`."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        sin = freqs.sin()
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
        return emb.cos().to(dtype), torch.cat((-sin, sin), dim=-1)[:, None, :].to(dtype)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        logits_index: torch.Tensor | None,
        after_layer: Callable[[int], None] | None = None,
    ) -> torch.Tensor | None:
        """Run one step; returns logits for the tokens picked by `logits_index` only (None: no
        logits, a tensor-parallel rank other than 0).

        `kv_cache` is [2, layers, slots, kv_heads, head_dim] (this rank's KV heads);
        `after_layer(i)` is called once layer i's K/V are in the cache (the prefill worker
        streams them out from there).
        """
        x = self.embed(input_ids)
        rope_kernel = self._rope_kernel(x, kv_cache)
        f32_kernels = self.layer_f32 if x.dtype == torch.float32 else self.block_swiglu
        norm_kernel = None if self.layer_f32 is None else self.layer_f32.ps_rms_norm_f32
        if rope_kernel is not None:
            cos, sin = self.rope_angles(positions)
        else:
            cos, sin = self.rope_tables(positions, x.dtype)
        if self._caches is None or self._caches[0] is not kv_cache:
            self._caches = (kv_cache, layer_caches(kv_cache))
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, self._caches[1][i], meta, rope_kernel, self.all_reduce, f32_kernels)
            if after_layer is not None:
                after_layer(i)
        if logits_index is None:
            return None
        x = rms_norm(x[logits_index], self.norm, self.cfg.rms_eps, norm_kernel)
        head = self.lm_head or self.tied_head
        logits = F.linear(x, self.embed.weight) if head is None else head(x, out_dtype=torch.float32)
        return logits.float()

    def rope_angles(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of each position's angles, float32 [tokens, head_dim/2], for the CPU RoPE
        kernels: rows of a table made once (two gathers a step instead of four ops over a fresh
        product; the one-call decode step reads the same table, so both give the same bits)."""
        top = int(positions.max()) + 1 if positions.numel() else 1
        table = self._rope_table
        if table is None or table[0].shape[0] < top or table[0].device != positions.device:
            # Grown in powers of two (a model's max_position can be 128k: 64 MB of table)
            n = max(4096, 1 << (top - 1).bit_length())
            freqs = torch.arange(n, dtype=torch.float32, device=positions.device)[:, None] * self.inv_freq[None, :]
            table = self._rope_table = (freqs.cos(), freqs.sin())
        cos, sin = table
        return cos.index_select(0, positions), sin.index_select(0, positions)

    def _rope_kernel(self, x: torch.Tensor, kv_cache: torch.Tensor):
        """The CPU kernel that rotates Q/K and writes the cache for this dtype, or None (torch)."""
        if x.device.type != "cpu" or kv_cache.dtype != x.dtype:
            return None
        if x.dtype == torch.float32 and self.layer_f32 is not None and self.cfg.head_dim % 16 == 0:
            return self.layer_f32.ps_rope_write_f32
        if x.dtype != torch.bfloat16 or self.cfg.head_dim % 32:
            return None
        lib = build.library()
        return None if lib is None else lib.ps_rope_write_bf16

    def pack_for_cpu(self, bf16_weights: bool = False) -> dict[str, int]:
        """Re-lay every projection for the CPU matmul (see Linear.pack_for_cpu; `bf16_weights`:
        fp32 projections kept in bf16 for the AVX2 kernel); a tied LM head
        gets its own re-laid copy (the embedding lookup needs the plain rows): +vocab x hidden
        weights, for a head that is a fifth of SmolLM2's decode step otherwise. Returns how many
        weights took each layout."""
        counts: Counter[str] = Counter()
        for layer in self.layers:
            for m in (layer.qkv, layer.o_proj, layer.gate_up, layer.down):
                counts[m.pack_for_cpu(swiglu=m is layer.gate_up, bf16_weights=bf16_weights) or "plain"] += 1
        if self.lm_head is not None:
            counts[self.lm_head.pack_for_cpu(bf16_weights=bf16_weights) or "plain"] += 1
        elif self.tied_head is not None:  # already served from GGUF blocks
            counts[self.tied_head.pack_for_cpu() or "plain"] += 1
        else:  # packing drops only the head module's own reference; the embedding keeps its rows
            head = Linear.from_weight(self.embed.weight)
            layout = head.pack_for_cpu(bf16_weights=bf16_weights)
            if layout in ("cpu_gemm", "bf16w_avx2"):
                self.tied_head = head
                counts[layout] += 1
        if bf16_weights:
            # dtype auto on a CPU without native bf16 (fp32 activations): the rest of a layer in fp32
            # kernels too, whether the projections are bf16 or served from GGUF blocks (None: torch's
            # ops, as with --dtype float32, the reference).
            self.layer_f32 = build.layer_f32_library()
        elif any(layer.gate_up.blocks is not None for layer in self.layers):
            self.block_swiglu = build.layer_f32_library()
        self._tiled_on_huge_pages()
        return dict(counts)

    def _tiled_on_huge_pages(self) -> None:
        """Move the kernel-laid weights into one block of huge pages (see kernels/hugepages.py):
        one block, not one per weight, since each allocation rounds up to 2 MiB. GGUF blocks
        served natively get a block of their own (another dtype)."""
        linears = [m for m in self.modules() if isinstance(m, Linear)]
        if self.tied_head is not None and self.tied_head not in linears:
            linears.append(self.tied_head)
        tiled = [m for m in linears if m.tiled is not None]
        if tiled:
            for m, view in zip(tiled, _on_huge_pages([m.tiled for m in tiled]), strict=True):
                m.tiled = view
        quant = [m for m in linears if m.blocks is not None]
        if quant:
            for m, view in zip(quant, _on_huge_pages([m.blocks.blocks for m in quant]), strict=True):
                m.blocks = replace(m.blocks, blocks=view)


def _on_huge_pages(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of same-dtype tensors, laid one after another in one huge-page block."""
    arena = hugepages.empty(sum(t.numel() for t in tensors), tensors[0].dtype)
    views, offset = [], 0
    for t in tensors:
        view = arena[offset : offset + t.numel()].view(t.shape)
        view.copy_(t)
        views.append(view)
        offset += t.numel()
    return views
