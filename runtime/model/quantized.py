"""Serving a GGUF's projections in their own block formats (`--quantization`).

Decode is bound by how many weight bytes a step streams; a Q4_1 file holds ~0.63 bytes per
weight and a Q8_0 file ~1.06, against 4 for the fp32 and 2 for the bf16 copies the loader
dequantizes to. With `--quantization auto` (or the file's type named: q8_0, q4_0, q4_1) the
attention and MLP projections and the LM head keep the file's blocks, fused the way loader.py
fuses the dequantized weights (qkv, gate_up), and run through cpu_quant's kernels. The embedding
lookup, the norms and any projection of another type stay dequantized.

Dequantize-at-load (`none`, the default) stays the reference, and the fallback wherever the
native path cannot run: not a GGUF file (auto), a device other than the CPU, no usable kernel (another CPU, no compiler, a failed self-check, PHASESPLIT_CPU_KERNELS=0). Each
fallback says so in the log. Under tensor parallelism each rank keeps its slice of the blocks
(rows, and columns in whole blocks; a slice off block bounds is dequantized).
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from phasesplit.runtime.kernels import build, cpu_quant
from phasesplit.runtime.model.config import ModelConfig
from phasesplit.runtime.model.files import ModelError, ModelFiles, open_gguf
from phasesplit.runtime.model.loader import unpermute
from phasesplit.runtime.model.sharding import Shard, weight_slices

log = logging.getLogger(__name__)

MODES = ("none", "auto", "q8_0", "q4_0", "q4_1")


@dataclass(frozen=True)
class QuantWeight:
    """A [out_features, in_features] weight as rows of GGUF blocks (uint8 [N, K/32 * block bytes]),
    or those bytes packed for the kernel (qtype cpu_quant.X16 + the GGUF type, cpu_quant.pack_x16)."""

    blocks: torch.Tensor
    qtype: int
    in_features: int

    @property
    def out_features(self) -> int:
        return self.blocks.shape[0]

    @property
    def name(self) -> str:
        return cpu_quant.name(self.qtype)

    def dequantize(self) -> torch.Tensor:
        return cpu_quant.dequantize(self.blocks, self.qtype, self.in_features)


def gguf_projections(path: Path, cfg: ModelConfig) -> dict[str, QuantWeight | None]:
    """The projections of a Llama GGUF as block weights under LlamaModel's names (layers.i.qkv,
    .o_proj, .gate_up, .down, and `head`: output.weight, or the tied token embedding); None for
    one whose parts are not all of one type the kernels take."""
    reader = open_gguf(path)
    tensors = {t.name: t for t in reader.tensors}

    def fused(names: list[str], permute: list[int | None]) -> QuantWeight | None:
        parts = [tensors[n] for n in names]
        qtypes = {int(t.tensor_type) for t in parts}
        if len(qtypes) != 1 or (qtype := qtypes.pop()) not in cpu_quant.BLOCK_BYTES:
            return None
        k = int(parts[0].shape[0])  # GGUF lists the inner (row) size first
        rows = []
        for t, heads in zip(parts, permute, strict=True):
            arr = np.asarray(t.data).reshape(int(t.shape[1]), -1)
            # llama.cpp interleaves Q and K rows for its RoPE; blocks run along a row, so undoing
            # it is the same row permutation the loader applies to the dequantized weight.
            rows.append(unpermute(arr, heads) if heads else arr)
        # A copy out of the file's read-only mapping (concatenate copies even one part).
        return QuantWeight(torch.from_numpy(np.concatenate(rows)), qtype, k)

    try:
        out = {"head": fused(["output.weight" if "output.weight" in tensors else "token_embd.weight"], [None])}
        for i in range(cfg.num_layers):
            p, me = f"blk.{i}.", f"layers.{i}."
            out[me + "qkv"] = fused([p + "attn_q.weight", p + "attn_k.weight", p + "attn_v.weight"],
                                    [cfg.num_heads, cfg.num_kv_heads, None])
            out[me + "o_proj"] = fused([p + "attn_output.weight"], [None])
            out[me + "gate_up"] = fused([p + "ffn_gate.weight", p + "ffn_up.weight"], [None, None])
            out[me + "down"] = fused([p + "ffn_down.weight"], [None])
    except KeyError as e:
        raise ModelError(f"{path}: tensor {e.args[0]} is missing") from None
    return out


def apply(model: torch.nn.Module, files: ModelFiles, mode: str, device: torch.device) -> Counter[str] | None:
    """Swap the loaded (dequantized) projections of `model` for the GGUF's blocks where `mode`
    asks for it and the kernels can run; returns how many weights took each format, or None
    where everything stays dequantized (the reason is logged)."""
    if mode not in MODES:
        raise ValueError(f"quantization {mode!r} is not one of {', '.join(MODES)}")
    if mode == "none":
        return None
    if files.gguf is None:
        if mode != "auto":
            raise ModelError(f"--quantization {mode} needs a GGUF file; {files.folder} is a Hugging Face folder")
        log.info("--quantization auto: %s is not a GGUF file; weights stay as loaded", files.folder)
        return None
    weights = gguf_projections(files.gguf, model.cfg)
    layer_types = {w.name if w is not None else "other" for k, w in weights.items() if k != "head"}
    if mode != "auto" and layer_types != {mode}:
        raise ModelError(f"--quantization {mode}: the projections of {files.gguf} are "
                         f"{', '.join(sorted(layer_types))}; use auto or none")
    if device.type != "cpu":
        log.warning("quantized weights: no native kernel on %s; dequantized at load", device)
        return None
    lib = build.quant_library()
    if lib is None:
        log.warning("quantized weights: the quantized CPU kernels are unavailable here (see the line above); "
                    "dequantized at load")
        return None
    from phasesplit.runtime.model.llama import Linear

    counts: Counter[str] = Counter()
    unaligned = set()
    for i, layer in enumerate(model.layers):
        for name in ("qkv", "o_proj", "gate_up", "down"):
            w = weights[f"layers.{i}.{name}"]
            lin = getattr(layer, name)
            if w is not None and model.shard.size > 1:
                w = shard_blocks(w, f"layers.{i}.{name}.weight", model.cfg, model.shard)
                if w is None:
                    unaligned.add(name)
            if w is None:
                counts["dequantized"] += 1
                continue
            lin.use_blocks(w, lib)
            counts[w.name] += 1
    head = weights["head"]
    if head is None:
        counts["dequantized"] += 1
    elif model.lm_head is not None:
        model.lm_head.use_blocks(head, lib)
        counts[head.name] += 1
    else:  # tied: the embedding keeps its dequantized rows for the lookup
        model.tied_head = Linear.from_blocks(head, lib)
        counts[head.name] += 1
    if unaligned:
        log.warning("quantized weights: tensor-parallel rank %d's slice of %s does not fall on %d-weight block "
                    "bounds; those are dequantized at load", model.shard.rank, ", ".join(sorted(unaligned)),
                    cpu_quant.QK)
    return counts


def shard_blocks(w: QuantWeight, name: str, cfg: ModelConfig, shard: Shard) -> QuantWeight | None:
    """A tensor-parallel rank's part of a block weight, as sharding.weight_slices cuts the dense
    one: whole rows, and columns only in whole blocks (None where a column bound is not on one)."""
    rows, cols = weight_slices(name, cfg, shard)
    blocks, k = w.blocks, w.in_features
    if rows is not None:
        blocks = torch.cat([blocks[lo:hi] for lo, hi in rows])
    if cols is not None:
        lo, hi = cols
        if lo % cpu_quant.QK or hi % cpu_quant.QK:
            return None
        size = cpu_quant.BLOCK_BYTES[w.qtype]
        blocks, k = blocks[:, lo // cpu_quant.QK * size : hi // cpu_quant.QK * size], hi - lo
    return QuantWeight(blocks.contiguous(), w.qtype, k)
