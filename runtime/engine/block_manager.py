"""Paged KV cache bookkeeping: a free list, reference counts, and prefix caching.

Blocks of `block_size` token slots. A full block is keyed by a hash chained over every token
before it, so two requests share a block only when their whole prefix up to it is equal. Freed
blocks keep their hash and content until reused: they sit in an LRU free list and a later
request with the same prefix takes them back (a cache hit) instead of recomputing them.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence as Seq

import numpy as np

from phasesplit.runtime.engine.sequence import Sequence


def block_hash(parent: bytes, tokens: Seq[int]) -> bytes:
    return hashlib.blake2b(parent + np.asarray(tokens, dtype=np.int64).tobytes(), digest_size=16).digest()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self.ref = [0] * num_blocks
        self.hash_of: list[bytes | None] = [None] * num_blocks
        self.by_hash: dict[bytes, int] = {}
        # Insertion order = eviction order: least recently freed first.
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.queries = 0  # prompt tokens looked up in the prefix cache
        self.hits = 0  # of which were found

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def usage(self) -> float:
        return 1.0 - len(self.free) / self.num_blocks

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def _take(self) -> int:
        block, _ = self.free.popitem(last=False)
        old = self.hash_of[block]
        if old is not None:  # evict its cached content
            if self.by_hash.get(old) == block:
                del self.by_hash[old]
            self.hash_of[block] = None
        self.ref[block] = 1
        return block

    def _prefix_hits(self, seq: Sequence) -> list[int]:
        """Cached blocks that hold a prefix of the sequence, never covering the last token (it must
        run), nor any prompt token when the request wants prompt logprobs (they must be computed)."""
        if not self.prefix_caching or seq.params.prompt_logprobs is not None:
            return []
        tokens = seq.all_ids
        hits, parent = [], b""
        usable = (len(tokens) - 1) // self.block_size
        for b in range(usable):
            parent = block_hash(parent, tokens[b * self.block_size : (b + 1) * self.block_size])
            block = self.by_hash.get(parent)
            if block is None:
                break
            hits.append(block)
        return hits

    def can_allocate(self, seq: Sequence, extra_tokens: int = 0) -> bool:
        hits = self._prefix_hits(seq)
        reusable_free = sum(1 for b in hits if self.ref[b] == 0)
        need = self.blocks_for(len(seq) + extra_tokens) - len(hits)
        return need <= len(self.free) - reusable_free

    def allocate(self, seq: Sequence) -> None:
        """Blocks for every token the sequence has now, reusing cached prefix blocks."""
        assert not seq.block_table
        tokens = seq.all_ids
        hits = self._prefix_hits(seq)
        for b in hits:
            if self.ref[b] == 0:
                del self.free[b]
            self.ref[b] += 1
        table = list(hits)
        while len(table) < self.blocks_for(len(tokens)):
            table.append(self._take())
        seq.block_table = table
        seq.num_computed = len(hits) * self.block_size
        seq.num_registered = len(hits)
        if self.prefix_caching:
            self.queries += len(tokens)
            self.hits += seq.num_computed
        if not seq.output_ids:
            seq.num_cached_prompt = seq.num_computed

    def fork(self, parent: Sequence, child: Sequence) -> bool:
        """Give `child` (another choice of the same prompt) the parent's computed prompt blocks.

        The blocks before the one holding the last prompt token are shared (one more reference
        each); from there the child has blocks of its own (copy-on-write at the first block the
        choices write differently), and recomputes that tail, which gives it its own logits for
        its first token. Returns False when the cache cannot hold the child's own blocks now."""
        assert not child.block_table and parent.num_computed >= len(parent.prompt_ids)
        shared = (len(child.prompt_ids) - 1) // self.block_size
        need = self.blocks_for(len(child)) - shared
        if need > len(self.free):
            return False
        for b in parent.block_table[:shared]:
            self.ref[b] += 1
        child.block_table = parent.block_table[:shared] + [self._take() for _ in range(need)]
        child.num_computed = shared * self.block_size
        child.num_registered = 0  # register_computed re-derives the chain (these blocks keep their hashes)
        child.num_cached_prompt = parent.num_cached_prompt
        return True

    @property
    def num_shared(self) -> int:
        """Blocks held by more than one sequence (shared prompt prefixes, forked choices)."""
        return sum(1 for r in self.ref if r > 1)

    def can_grow(self, seq: Sequence, tokens: int) -> bool:
        return self.blocks_for(tokens) - len(seq.block_table) <= len(self.free)

    def grow(self, seq: Sequence, tokens: int) -> None:
        """Make room for the sequence to hold `tokens` tokens in all."""
        while len(seq.block_table) < self.blocks_for(tokens):
            seq.block_table.append(self._take())

    def register_computed(self, seq: Sequence) -> None:
        """Publish hashes of blocks that became full and computed, so later requests can share them."""
        if not self.prefix_caching:
            return
        full = min(seq.num_computed, len(seq)) // self.block_size
        if full <= seq.num_registered:
            return
        tokens = seq.all_ids
        idx = seq.num_registered
        parent = self.hash_of[seq.block_table[idx - 1]] if idx else b""
        if idx and parent is None:  # an unregistered predecessor: recompute the chain from the start
            idx, parent = 0, b""
        for b in range(idx, full):
            parent = block_hash(parent, tokens[b * self.block_size : (b + 1) * self.block_size])
            block = seq.block_table[b]
            if self.hash_of[block] is None:
                self.hash_of[block] = parent
                self.by_hash.setdefault(parent, block)
        seq.num_registered = full

    def free_seq(self, seq: Sequence) -> None:
        self.free_blocks(seq.block_table)
        seq.block_table = []
        seq.num_registered = 0

    def free_blocks(self, blocks: list[int]) -> None:
        """Drop one reference to each block (a sequence's table, or blocks held apart from it)."""
        # Tail blocks first into the free list: they are evicted before the shared prefix.
        for block in reversed(blocks):
            self.ref[block] -= 1
            if self.ref[block] == 0:
                if self.hash_of[block] is None:
                    self.free[block] = None
                    self.free.move_to_end(block, last=False)  # nothing cached: reuse first
                else:
                    self.free[block] = None

    @property
    def num_allocated(self) -> int:
        return sum(1 for r in self.ref if r > 0)
