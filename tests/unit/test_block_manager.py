"""Block manager: reference counts, prefix sharing by chained hashes, LRU eviction."""

from phasesplit.runtime.engine.block_manager import BlockManager
from phasesplit.runtime.engine.sequence import Sequence
from phasesplit.runtime.request import SamplingParams


def seq(rid: str, tokens: list[int]) -> Sequence:
    return Sequence(rid, tokens, SamplingParams())


def computed(bm: BlockManager, s: Sequence) -> None:
    s.num_computed = len(s)
    bm.register_computed(s)


def test_shared_prefix_is_reused_and_refcounted():
    bm = BlockManager(num_blocks=10, block_size=4)
    a = seq("a", list(range(10)))
    bm.allocate(a)
    computed(bm, a)
    b = seq("b", list(range(8)) + [99, 98, 97])
    bm.allocate(b)
    assert b.block_table[:2] == a.block_table[:2], "the two full blocks of the common prefix are shared"
    assert b.num_computed == 8 and bm.hits == 8
    assert bm.ref[a.block_table[0]] == 2
    bm.free_seq(a)
    assert bm.ref[b.block_table[0]] == 1 and bm.num_allocated == len(b.block_table)


def test_last_token_is_never_served_from_cache():
    bm = BlockManager(num_blocks=10, block_size=4)
    a = seq("a", list(range(8)))
    bm.allocate(a)
    computed(bm, a)
    bm.free_seq(a)
    again = seq("b", list(range(8)))
    bm.allocate(again)
    assert again.num_computed == 4, "one token must run to produce logits, so the last block is recomputed"


def test_different_prefix_same_block_does_not_hit():
    bm = BlockManager(num_blocks=10, block_size=4)
    a = seq("a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    bm.allocate(a)
    computed(bm, a)
    b = seq("b", [0, 2, 3, 4, 5, 6, 7, 8, 9])  # second block equal, first differs: chained hash differs
    bm.allocate(b)
    assert b.num_computed == 0


def test_freed_blocks_stay_cached_until_evicted_lru():
    bm = BlockManager(num_blocks=4, block_size=2)
    a = seq("a", [1, 2, 3, 4, 5])
    bm.allocate(a)
    computed(bm, a)
    bm.free_seq(a)
    assert bm.num_free == 4 and bm.usage == 0.0
    # Two unrelated requests use up the free list; the oldest cached blocks go first.
    for i, rid in enumerate(["x", "y"]):
        s = seq(rid, [100 + i, 200 + i, 300 + i])
        bm.allocate(s)
    assert bm.num_free == 0
    fresh = seq("c", [1, 2, 3, 4, 5])
    assert not bm.can_allocate(fresh)


def test_can_allocate_counts_free_blocks_it_would_reuse():
    bm = BlockManager(num_blocks=3, block_size=2)
    a = seq("a", [1, 2, 3, 4, 5])
    bm.allocate(a)
    computed(bm, a)
    bm.free_seq(a)
    b = seq("b", [1, 2, 3, 4, 6])
    assert bm.can_allocate(b)
    bm.allocate(b)
    assert b.num_computed == 4 and bm.num_free == 0
