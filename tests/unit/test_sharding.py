"""Tensor-parallel shard plans (pure): who holds which heads and MLP columns, and the weight slices."""

from __future__ import annotations

import pytest
import torch

from phasesplit.runtime.model.config import ModelConfig
from phasesplit.runtime.model.sharding import ShardingError, kv_owners, plan, shard_state

# SmolLM2-135M's shape: 9 query heads in 3 KV groups, MLP width 1536.
SMOL = ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
                   num_kv_heads=3, head_dim=64, max_position=2048)


def test_two_ranks_split_smollm2_unevenly_by_kv_group():
    a, b = plan(SMOL, 2)
    assert (a.kv_heads, a.heads, a.ffn) == ((0, 2), (0, 6), (0, 768))
    assert (b.kv_heads, b.heads, b.ffn) == ((2, 3), (6, 9), (768, 1536))
    assert kv_owners([a, b]) == [a, b]


def test_three_ranks_divide_smollm2_exactly():
    shards = plan(SMOL, 3)
    assert [s.kv_heads for s in shards] == [(0, 1), (1, 2), (2, 3)]
    assert [s.heads for s in shards] == [(0, 3), (3, 6), (6, 9)]
    assert [s.intermediate for s in shards] == [512, 512, 512]


def test_more_ranks_than_kv_heads_replicate_them():
    shards = plan(SMOL, 9)
    assert [s.kv_heads for s in shards[:4]] == [(0, 1), (0, 1), (0, 1), (1, 2)]
    assert [s.heads for s in shards] == [(h, h + 1) for h in range(9)]
    assert [o.rank for o in kv_owners(shards)] == [0, 3, 6]  # each head read from its first holder


@pytest.mark.parametrize("size", [0, 4, 6])
def test_sizes_that_cannot_split_are_refused_with_the_valid_ones(size):
    with pytest.raises(ShardingError, match="1, 2, 3, 9" if size else "at least 1"):
        plan(SMOL, size)


def test_the_slices_put_back_together_are_the_full_weights():
    cfg = ModelConfig(vocab_size=10, hidden_size=8, intermediate_size=6, num_layers=1, num_heads=6,
                      num_kv_heads=3, head_dim=2, max_position=16)
    g = torch.Generator().manual_seed(0)
    q, kv, inter = 6 * 2, 3 * 2, 6
    full = {"layers.0.qkv.weight": torch.randn(q + 2 * kv, 8, generator=g),
            "layers.0.o_proj.weight": torch.randn(8, q, generator=g),
            "layers.0.gate_up.weight": torch.randn(2 * inter, 8, generator=g),
            "layers.0.down.weight": torch.randn(8, inter, generator=g),
            "embed.weight": torch.randn(10, 8, generator=g)}
    parts = [shard_state(full, cfg, s) for s in plan(cfg, 2)]  # 2 KV heads + 1: uneven
    assert [p["layers.0.qkv.weight"].shape[0] for p in parts] == [4 * 2 + 2 * 2 * 2, 2 * 2 + 2 * 1 * 2]
    qkv = [p["layers.0.qkv.weight"] for p in parts]
    q_rows = torch.cat([qkv[0][:8], qkv[1][:4]])
    k_rows = torch.cat([qkv[0][8:12], qkv[1][4:6]])
    v_rows = torch.cat([qkv[0][12:], qkv[1][6:]])
    assert torch.equal(torch.cat([q_rows, k_rows, v_rows]), full["layers.0.qkv.weight"])
    assert torch.equal(torch.cat([p["layers.0.o_proj.weight"] for p in parts], dim=1), full["layers.0.o_proj.weight"])
    gu = [p["layers.0.gate_up.weight"] for p in parts]
    assert torch.equal(torch.cat([gu[0][:3], gu[1][:3], gu[0][3:], gu[1][3:]]), full["layers.0.gate_up.weight"])
    assert torch.equal(torch.cat([p["layers.0.down.weight"] for p in parts], dim=1), full["layers.0.down.weight"])
    assert all(torch.equal(p["embed.weight"], full["embed.weight"]) for p in parts)  # replicated


def test_the_runner_refuses_a_size_the_bundled_model_cannot_take_before_starting_ranks():
    from phasesplit.runtime.engine.model_runner import ModelRunner, RunnerConfig
    from phasesplit.runtime.model.loader import resolve

    with pytest.raises(ShardingError, match="supports 1, 2, 3, 9"):
        ModelRunner(resolve("smollm2"), RunnerConfig(dtype="float32", tensor_parallel_size=4))
