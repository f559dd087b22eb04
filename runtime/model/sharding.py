"""Which slice of each weight a tensor-parallel rank holds (Megatron-style), as pure functions.

Attention is split by KV-head groups: a rank holds whole KV heads and the query heads that read
them, so attention needs no communication; `o_proj` is then row-parallel (each rank's partial
product is summed by an all-reduce). The MLP's gate and up projections are split by columns of
the intermediate size, `down` by the matching rows (one more all-reduce). Embedding, final norm
and LM head are replicated; only rank 0 computes the head (it samples).

Uneven splits are allowed, because real models rarely divide evenly: SmolLM2-135M has 9 query
heads in 3 KV groups, so TP=2 gives rank 0 two groups (6 query heads) and rank 1 one group (3).
With more ranks than KV heads, each KV head is replicated on `size / kv_heads` ranks and its
query heads are divided among them; that needs both divisions to be exact.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from phasesplit.runtime.model.config import ModelConfig


class ShardingError(ValueError):
    pass


@dataclass(frozen=True)
class Shard:
    rank: int
    size: int
    kv_heads: tuple[int, int]  # [lo, hi) of the model's KV heads this rank holds
    heads: tuple[int, int]  # [lo, hi) of the query heads
    ffn: tuple[int, int]  # [lo, hi) of the intermediate (MLP) columns

    @property
    def num_kv_heads(self) -> int:
        return self.kv_heads[1] - self.kv_heads[0]

    @property
    def num_heads(self) -> int:
        return self.heads[1] - self.heads[0]

    @property
    def intermediate(self) -> int:
        return self.ffn[1] - self.ffn[0]


def _even(n: int, parts: int, i: int) -> tuple[int, int]:
    """The i-th of `parts` contiguous ranges over n, the first n % parts one longer."""
    q, r = divmod(n, parts)
    lo = i * q + min(i, r)
    return lo, lo + q + (1 if i < r else 0)


def plan(cfg: ModelConfig, size: int) -> list[Shard]:
    """Every rank's shard for a tensor-parallel size; ShardingError when it cannot be split."""
    if size < 1:
        raise ShardingError(f"tensor parallel size must be at least 1, not {size}")
    kv, heads = cfg.num_kv_heads, cfg.num_heads
    group = heads // kv
    if size > cfg.intermediate_size:
        raise ShardingError(f"tensor parallel size {size} exceeds the MLP width {cfg.intermediate_size}")
    shards = []
    if size <= kv:
        for r in range(size):
            lo, hi = _even(kv, size, r)
            shards.append(Shard(r, size, (lo, hi), (lo * group, hi * group), _even(cfg.intermediate_size, size, r)))
        return shards
    copies = size // kv
    if size % kv or group % copies:
        valid = sorted({*range(1, kv + 1), *(kv * c for c in range(1, group + 1) if group % c == 0)})
        raise ShardingError(f"tensor parallel size {size} does not fit {heads} query heads in {kv} KV heads; "
                            f"this model supports {', '.join(map(str, valid))}")
    per = group // copies
    for r in range(size):
        h, c = divmod(r, copies)
        lo = h * group + c * per
        shards.append(Shard(r, size, (h, h + 1), (lo, lo + per), _even(cfg.intermediate_size, size, r)))
    return shards


def kv_owners(shards: list[Shard]) -> list[Shard]:
    """One rank per KV head range, covering every head once, in head order: where the full-head
    K/V of a layer is gathered from (replicated heads are read from their first holder)."""
    owners, seen = [], set()
    for s in shards:
        if s.kv_heads not in seen:
            seen.add(s.kv_heads)
            owners.append(s)
    return owners


def weight_slices(name: str, cfg: ModelConfig, shard: Shard
                  ) -> tuple[list[tuple[int, int]] | None, tuple[int, int] | None]:
    """Which part of a fused weight (loader.py's layout: qkv = [q; k; v] rows, gate_up = [gate;
    up] rows) a rank keeps: row ranges concatenated in order, and a column range; None: all.
    Shared by dense weights (shard_state) and GGUF blocks (quantized.py, where a column range
    must fall on block bounds)."""
    if shard.size == 1:
        return None, None
    d, q_all, kv_all = cfg.head_dim, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    (h0, h1), (k0, k1), (f0, f1) = shard.heads, shard.kv_heads, shard.ffn
    inter = cfg.intermediate_size
    if name.endswith(".qkv.weight"):
        return [(h0 * d, h1 * d), (q_all + k0 * d, q_all + k1 * d),
                (q_all + kv_all + k0 * d, q_all + kv_all + k1 * d)], None
    if name.endswith(".o_proj.weight"):
        return None, (h0 * d, h1 * d)
    if name.endswith(".gate_up.weight"):
        return [(f0, f1), (inter + f0, inter + f1)], None
    if name.endswith(".down.weight"):
        return None, (f0, f1)
    return None, None


def shard_state(state: dict[str, torch.Tensor], cfg: ModelConfig, shard: Shard) -> dict[str, torch.Tensor]:
    """Slice a fused state dict down to one rank's weights (weight_slices)."""
    if shard.size == 1:
        return state
    out = {}
    for name, w in state.items():
        rows, cols = weight_slices(name, cfg, shard)
        if rows is not None:
            w = torch.cat([w[lo:hi] for lo, hi in rows])
        if cols is not None:
            w = w[:, cols[0] : cols[1]]
        out[name] = w.contiguous()
    return out
