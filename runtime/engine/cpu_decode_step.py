"""Decode-only steps of the fp32-activation CPU path in one C call (kernels/decode_step_f32.c).

Where dtype auto runs fp32 activations beside bf16 or GGUF-block weights (AVX2 CPUs without
AVX512-BF16), a batch-1 decode step of SmolLM2 is ~300 kernel calls, and the Python between them
(module calls, views, ctypes argument conversion, an output allocation per call) took a fifth to
a quarter of the step: as long as attention and the norms together, and a fixed cost that kept
a Q8_0 step (half a bf16 step's weight bytes) from being much faster than a bf16 one. Here the
step's arguments are laid out once per model (weights, norms, caches per layer) and once per
step (tables, RoPE angles, buffers), and C runs every layer, the final norm and the LM head.

The same kernels run with the same arguments in the same order as the layer-by-layer forward
(llama.py), so the logits are the same bits: the first step is checked against that forward and
any difference, or a kernel rejecting its arguments, turns this off for the process (logged
once) with the forward serving on, as cuda_graphs.py does on a GPU. PHASESPLIT_CPU_DECODE_STEP=0
keeps the forward.
"""

from __future__ import annotations

import ctypes
import logging
import os
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F

from phasesplit.runtime.kernels import cpu_attention, cpu_quant
from phasesplit.runtime.model.attention import decode_tables
from phasesplit.runtime.model.llama import Linear, LlamaModel

log = logging.getLogger(__name__)

# Rows a step may have: below cpu_quant.DENSE_ROWS, where the forward's quantized matmuls leave
# the block kernels (and the one-call step would no longer be the same arithmetic).
MAX_ROWS = min(64, cpu_quant.DENSE_ROWS - 1)

_p, _n, _i, _f = ctypes.c_void_p, ctypes.c_long, ctypes.c_int, ctypes.c_float


class Proj(ctypes.Structure):
    """ps_proj_t: bf16 tiles (row_bytes 0) or GGUF blocks; n output rows, k inner."""

    _fields_ = [("w", _p), ("n", _n), ("k", _n), ("row_bytes", _n), ("qtype", _i), ("swiglu", _i)]


class Layer(ctypes.Structure):
    """ps_layer_t."""

    _fields_ = [("qkv", Proj), ("o", Proj), ("gate_up", Proj), ("down", Proj), ("attn_norm", _p),
                ("mlp_norm", _p), ("k_cache", _p), ("v_cache", _p)]


class Step(ctypes.Structure):
    """ps_step_t."""

    _fields_ = [(name, _n) for name in ("rows", "hidden", "heads", "kv_heads", "head_dim", "inter", "block_size",
                                        "max_blocks", "scratch_per_thread")] + [
        ("eps", _f), ("scale", _f)] + [(name, _p) for name in (
            "cos", "sin", "slots", "tables", "lens", "x", "xb", "h", "qkv", "attn", "mid", "gu", "scratch",
            "final_norm")] + [("head", Proj), ("logits", _p), ("threads", _i)]


def declare(lib: ctypes.CDLL) -> None:
    fn = lib.ps_decode_step_f32
    fn.argtypes = [ctypes.POINTER(Step), ctypes.POINTER(Layer), _n]
    fn.restype = _n


def proj(lin: Linear, k: int) -> Proj | None:
    """The C description of a projection with `k` inputs, or None if its weight is served some
    other way (fp32 weights through torch, oneDNN's layout): then the forward runs."""
    if lin.blocks is not None:
        b = lin.blocks
        if (b.out_features, b.in_features) != (lin.out_features, k) or not b.blocks.is_contiguous():
            return None
        return Proj(b.blocks.data_ptr(), b.out_features, k, b.blocks.stride(0), b.qtype, 0)
    if lin._bf16w and lin.tiled is not None:
        return Proj(lin.tiled.data_ptr(), lin.out_features, k, 0, 0, int(lin._swiglu))
    return None


def _fp32_vector(t: torch.Tensor, size: int) -> bool:
    return t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous() and t.numel() == size


class CpuDecodeStep:
    """Runs decode-only steps through ps_decode_step_f32; `create` says whether a model can."""

    def __init__(self, lib: ctypes.CDLL, model: LlamaModel, block_size: int, layers: ctypes.Array,
                 head: Proj) -> None:
        self.lib, self.model, self.block_size = lib, model, block_size
        self.layers, self.head = layers, head
        self.enabled, self.checked = True, False
        self.steps = 0  # steps run in one call
        c = model.cfg
        self.heads, self.kv_heads = model.shard.num_heads, model.shard.num_kv_heads
        self.inter = model.shard.intermediate
        self.scale = c.head_dim**-0.5  # as cpu_attention.decode passes it
        self._buffers: dict[int, dict[str, torch.Tensor]] = {}

    @classmethod
    def create(cls, model: LlamaModel, kv_cache: torch.Tensor, block_size: int, paged_kernel: bool
               ) -> CpuDecodeStep | None:
        """The one-call step for this model, or None (the reason logged) where the layer-by-layer
        forward must run: another dtype or device, tensor parallelism, torch's attention, or a
        projection the C step does not serve."""
        why = cls._unsupported(model, kv_cache, paged_kernel)
        if why is None:
            lib = model.layer_f32  # built into the library of the bf16-weight and GGUF matmuls (build.py)
            c, shard = model.cfg, model.shard
            q, kv = shard.num_heads * c.head_dim, shard.num_kv_heads * c.head_dim
            layers = (Layer * c.num_layers)()
            for i, layer in enumerate(model.layers):
                projs = (proj(layer.qkv, c.hidden_size), proj(layer.o_proj, q),
                         proj(layer.gate_up, c.hidden_size), proj(layer.down, shard.intermediate))
                if any(p is None for p in projs) or not all(
                        _fp32_vector(t, c.hidden_size) for t in (layer.attn_norm, layer.mlp_norm)):
                    why = f"layer {i} has a projection or norm the one-call step does not serve"
                    break
                if projs[0].n != q + 2 * kv or projs[2].n != 2 * shard.intermediate:
                    why = f"layer {i}'s projection sizes are not the model's"
                    break
                layers[i] = Layer(*projs, layer.attn_norm.data_ptr(), layer.mlp_norm.data_ptr(),
                                  kv_cache[0, i].data_ptr(), kv_cache[1, i].data_ptr())
            head_lin = model.lm_head or model.tied_head
            head = None if head_lin is None else proj(head_lin, c.hidden_size)
            if why is None and (head is None or not _fp32_vector(model.norm, c.hidden_size)):
                why = "the LM head is not served by the CPU kernels"
        if why is not None:
            log.info("decode steps: layer by layer (%s)", why)
            return None
        declare(lib)
        log.info("decode steps of up to %d sequences: one C call for all %d layers and the head",
                 MAX_ROWS, model.cfg.num_layers)
        return cls(lib, model, block_size, layers, head)

    @staticmethod
    def _unsupported(model: LlamaModel, kv_cache: torch.Tensor, paged_kernel: bool) -> str | None:
        c = model.cfg
        if os.environ.get("PHASESPLIT_CPU_DECODE_STEP", "1") == "0":
            return "PHASESPLIT_CPU_DECODE_STEP=0"
        if (model.layer_f32 is None or kv_cache.device.type != "cpu" or kv_cache.dtype != torch.float32
                or model.embed.weight.dtype != torch.float32):
            return "not the fp32-activation CPU path with its layer kernels"
        if model.all_reduce is not None:
            return "tensor parallelism"
        if not paged_kernel or c.head_dim % 16 or c.hidden_size % 8 or not kv_cache.is_contiguous():
            return "the attention or RoPE kernel does not take this model's shapes"
        if not cpu_attention.decode_fits(model.shard.num_heads, model.shard.num_kv_heads, c.head_dim, torch.float32):
            return "the decode attention kernel does not take this model's heads"
        return None

    def _work(self, rows: int) -> dict[str, torch.Tensor]:
        """Per-batch-size work buffers (kept: a step allocates nothing of its own size)."""
        buf = self._buffers.get(rows)
        if buf is None:
            c = self.model.cfg
            sizes = {"xb": c.hidden_size, "h": c.hidden_size, "qkv": (self.heads + 2 * self.kv_heads) * c.head_dim,
                     "attn": self.heads * c.head_dim, "mid": self.inter, "gu": 2 * self.inter}
            buf = self._buffers[rows] = {k: torch.empty(rows, n, dtype=torch.float32) for k, n in sizes.items()}
        return buf

    @torch.inference_mode()
    def run(self, decode: list[tuple[list[int], int]], ids: list[int],
            eager: Callable[[], torch.Tensor]) -> torch.Tensor | None:
        """Logits [n, vocab] float32 of a decode-only step ((block_table, context_len) per
        sequence, each one's new token in `ids`), or None: run the forward. `eager` runs this
        step layer by layer; the first step is checked against it."""
        n = len(decode)
        if not self.enabled or not 0 < n <= MAX_ROWS:
            return None
        model, c = self.model, self.model.cfg
        tables, lens, slots = decode_tables(decode, max(ctx for _, ctx in decode), self.block_size)
        cos, sin = model.rope_angles(torch.from_numpy(lens - 1))  # the forward's table
        x = F.embedding(torch.tensor(ids, dtype=torch.long), model.embed.weight)  # fp32 (checked in create)
        slots = np.ascontiguousarray(slots)
        threads = torch.get_num_threads()
        per_thread = (self.heads // self.kv_heads) * int(lens.max())
        scratch = torch.empty(threads * per_thread, dtype=torch.float32)
        logits = torch.empty(n, self.head.n, dtype=torch.float32)
        w = self._work(n)
        step = Step(n, c.hidden_size, self.heads, self.kv_heads, c.head_dim, self.inter, self.block_size,
                    tables.shape[1], per_thread, c.rms_eps, self.scale, cos.data_ptr(), sin.data_ptr(),
                    slots.ctypes.data, tables.ctypes.data, lens.ctypes.data, x.data_ptr(), w["xb"].data_ptr(),
                    w["h"].data_ptr(), w["qkv"].data_ptr(), w["attn"].data_ptr(), w["mid"].data_ptr(),
                    w["gu"].data_ptr(), scratch.data_ptr(), model.norm.data_ptr(), self.head, logits.data_ptr(),
                    threads)
        rc = self.lib.ps_decode_step_f32(ctypes.byref(step), self.layers, c.num_layers)
        if rc != 0:
            self.enabled = False
            log.warning("one-call decode step turned off, layer by layer from now: a kernel rejected its "
                        "arguments (code %d)", rc)
            return None
        if not self.checked:
            want = eager()  # rewrites the same K/V to the same slots
            if not torch.equal(logits, want):
                self.enabled = False
                log.warning("one-call decode step turned off, layer by layer from now: its logits differ from "
                            "the forward's (max %.3g)", (logits - want).abs().max().item())
                return want
            self.checked = True
        self.steps += 1
        return logits
