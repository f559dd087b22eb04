"""Decode steps replayed from CUDA graphs (CUDA only), one graph per (batch, context) bucket.

A decode step of a small model on a GPU is hundreds of tiny kernels whose launch cost exceeds
their run time; a captured graph launches them all at once. Shapes must be fixed, so a batch of
n sequences runs in the smallest batch bucket >= n and the widest context in the smallest width
bucket (powers of two from 256): extra rows write their K/V to a padding slot the block manager
never hands out and read slot 0 under a -inf mask; extra context columns are masked the same way.

Guarded: a graph is captured the first time its bucket is needed and checked against the eager
forward on that step's inputs; any capture error or mismatch turns graphs off for the process
(logged once) and the eager path serves on. The padding arithmetic is pure (`pad_decode`) and
tested on CPU against the unpadded forward; capture and replay need a GPU to be exercised
(no GPU was available where this was written).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from phasesplit.runtime.model.attention import AttentionMetadata, decode_gather, decode_tables

log = logging.getLogger(__name__)

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
MIN_WIDTH = 256


def batch_bucket(n: int) -> int | None:
    return next((b for b in BATCH_BUCKETS if b >= n), None)


def width_bucket(width: int, max_width: int) -> int:
    """Smallest power of two >= width (at least MIN_WIDTH), at most max_width."""
    w = MIN_WIDTH
    while w < width:
        w *= 2
    return max(width, min(w, max_width))


@dataclass
class PaddedDecode:
    ids: np.ndarray  # [B] int64
    positions: np.ndarray  # [B] int64
    slots: np.ndarray  # [B] int64: slot each row's new K/V is written to
    gather: np.ndarray  # [B, W] int64: cache slots each row attends over
    bias: np.ndarray  # [B, 1, W] float32: 0 where attended, -inf elsewhere


def pad_decode(decode: list[tuple[list[int], int]], ids: list[int], batch: int, width: int, block_size: int,
               pad_slot: int) -> PaddedDecode:
    """Inputs of n decode sequences ((block_table, context_len) each, last token `ids[i]`) padded
    to `batch` rows and `width` context columns. Padding rows write to `pad_slot` and attend to
    slot 0 alone (one live column keeps their softmax finite); their logits are discarded."""
    n = len(decode)
    if n > batch or any(ctx > width for _, ctx in decode):
        raise ValueError(f"{n} sequences or a context beyond the bucket ({batch} x {width})")
    out = PaddedDecode(ids=np.zeros(batch, np.int64), positions=np.zeros(batch, np.int64),
                       slots=np.full(batch, pad_slot, np.int64), gather=np.zeros((batch, width), np.int64),
                       bias=np.full((batch, 1, width), -np.inf, np.float32))
    if n:
        tables, lens, out.slots[:n] = decode_tables(decode, width, block_size)
        gather, mask = decode_gather(tables, lens, width, block_size)
        out.gather[:n] = gather
        out.bias[:n, 0][mask] = 0.0
        out.positions[:n] = lens - 1
        out.ids[:n] = ids
    out.bias[n:, 0, 0] = 0.0
    return out


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    ids: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor
    gather: torch.Tensor
    bias: torch.Tensor
    logits: torch.Tensor
    checked: bool = False


class DecodeGraphs:
    def __init__(self, model: torch.nn.Module, kv_cache: torch.Tensor, block_size: int, pad_slot: int,
                 max_width: int, dtype: torch.dtype) -> None:
        self.model, self.kv_cache, self.block_size = model, kv_cache, block_size
        self.pad_slot, self.max_width, self.dtype = pad_slot, max_width, dtype
        self.device = kv_cache.device
        self.graphs: dict[tuple[int, int], _Graph] = {}
        self.pool = torch.cuda.graph_pool_handle()
        self.enabled = True

    def run(self, decode: list[tuple[list[int], int]], ids: list[int]) -> torch.Tensor | None:
        """Logits [n, vocab] float32 for a decode-only step, or None: run it eagerly."""
        if not self.enabled:
            return None
        batch = batch_bucket(len(decode))
        if batch is None:
            return None
        width = width_bucket(max(ctx for _, ctx in decode), self.max_width)
        try:
            g = self.graphs.get((batch, width)) or self._capture(batch, width)
            padded = pad_decode(decode, ids, batch, width, self.block_size, self.pad_slot)
            for dst, src in ((g.ids, padded.ids), (g.positions, padded.positions), (g.slots, padded.slots),
                             (g.gather, padded.gather), (g.bias, padded.bias)):
                dst.copy_(torch.from_numpy(src).to(dst.dtype), non_blocking=False)
            g.graph.replay()
            if not g.checked:
                self._check(g)
            return g.logits[: len(decode)].clone()
        except Exception as e:  # noqa: BLE001 - any failure here must leave the eager path serving
            self.enabled = False
            log.warning("CUDA graphs turned off, decode runs eagerly: %s", e)
            return None

    def _meta(self, g: _Graph) -> AttentionMetadata:
        return AttentionMetadata(slot_mapping=g.slots, num_decode=g.ids.shape[0], decode_gather=g.gather,
                                 decode_bias=g.bias, block_size=self.block_size)

    def _forward(self, g: _Graph) -> torch.Tensor:
        index = torch.arange(g.ids.shape[0], device=self.device)
        return self.model(g.ids, g.positions, self.kv_cache, self._meta(g), index)

    @torch.inference_mode()
    def _capture(self, batch: int, width: int) -> _Graph:
        dev = self.device
        pad = pad_decode([], [], batch, width, self.block_size, self.pad_slot)  # all rows padding
        g = _Graph(graph=torch.cuda.CUDAGraph(), ids=torch.from_numpy(pad.ids).to(dev),
                   positions=torch.from_numpy(pad.positions).to(dev), slots=torch.from_numpy(pad.slots).to(dev),
                   gather=torch.from_numpy(pad.gather).to(dev),
                   bias=torch.from_numpy(pad.bias).to(device=dev, dtype=self.dtype), logits=torch.empty(0))
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up outside the graph (allocator, cuBLAS handles)
            for _ in range(2):
                self._forward(g)
        torch.cuda.current_stream().wait_stream(side)
        with torch.cuda.graph(g.graph, pool=self.pool):
            g.logits = self._forward(g)
        self.graphs[(batch, width)] = g
        log.info("captured a CUDA graph for decode batch %d, context %d", batch, width)
        return g

    @torch.inference_mode()
    def _check(self, g: _Graph) -> None:
        """The first replay of each graph against the eager forward on the same inputs (the eager
        pass rewrites the same K/V to the same slots)."""
        eager = self._forward(g)
        if not torch.allclose(g.logits, eager, rtol=2e-2, atol=2e-2):
            raise RuntimeError(f"graph replay differs from eager (max {(g.logits - eager).abs().max().item():.3g})")
        g.checked = True
