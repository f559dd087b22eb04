"""Decode-only CPU steps in one C call: kernels/decode_step_bf16.c on the native bf16 path
(AVX512-BF16), kernels/decode_step_f32.c on the fp32-activation one (AVX2 CPUs without it).

With bf16 or GGUF-block weights on either path, a batch-1 decode step of SmolLM2 is ~300 kernel
calls, and the Python between them (module calls, views, ctypes argument conversion, an output
allocation per call) took a fifth to a quarter of the step: as long as attention and the norms
together, and a fixed cost that kept a Q8_0 step (half a bf16 step's weight bytes) from being
much faster than a bf16 one. Here the step's arguments are laid out once per model (weights,
norms, caches per layer) and once per step (tables, RoPE angles, buffers), and C runs every
layer, the final norm and the LM head.

The same kernels run with the same arguments in the same order as the layer-by-layer forward
(llama.py; on bf16 activations a GGUF projection widens its input and rounds its fp32 sums as
cpu_quant.matmul does), so the logits are the same bits: the first step is checked against that
forward and any difference, or a kernel rejecting its arguments, turns this off for the process
(logged once) with the forward serving on, as cuda_graphs.py does on a GPU.
PHASESPLIT_CPU_DECODE_STEP=0 keeps the forward.
"""

from __future__ import annotations

import ctypes
import logging
import os
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F

from phasesplit.runtime.kernels import build, cpu_attention, cpu_quant
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


class StepBf16(ctypes.Structure):
    """ps_step_bf16_t."""

    _fields_ = [(name, _n) for name in ("rows", "hidden", "heads", "kv_heads", "head_dim", "inter", "block_size",
                                        "max_blocks", "scratch_per_thread")] + [
        ("eps", _f), ("scale", _f)] + [(name, _p) for name in (
            "cos", "sin", "slots", "tables", "lens", "x", "xb", "h", "qkv", "attn", "mid", "xf", "rf", "yf",
            "scratch", "final_norm")] + [("head", Proj), ("logits", _p), ("threads", _i)] + [
        (name, _p) for name in ("bf16_shared", "qgemm", "qgemm_shared", "swiglu_f32", "attn_shared")]


def declare(lib: ctypes.CDLL, name: str, step: type[ctypes.Structure]) -> ctypes._CFuncPtr:
    fn = getattr(lib, name)
    fn.argtypes = [ctypes.POINTER(step), ctypes.POINTER(Layer), _n]
    fn.restype = _n
    return fn


def proj(lin: Linear, k: int, bf16: bool = False) -> Proj | None:
    """The C description of a projection with `k` inputs, or None if its weight is served some
    other way (fp32 weights through torch, oneDNN's layout): then the forward runs. `bf16`: for
    bf16 activations (cpu_gemm's kernel), else fp32 ones (cpu_gemm_avx2's)."""
    if lin.blocks is not None:
        b = lin.blocks
        if (b.out_features, b.in_features) != (lin.out_features, k) or not b.blocks.is_contiguous():
            return None
        return Proj(b.blocks.data_ptr(), b.out_features, k, b.blocks.stride(0), b.qtype, 0)
    if lin.tiled is not None and lin._gemm is not None and lin._bf16w != bf16:
        return Proj(lin.tiled.data_ptr(), lin.out_features, k, 0, 0, int(lin._swiglu))
    return None


def _address(fn) -> int | None:
    return None if fn is None else ctypes.cast(fn, ctypes.c_void_p).value


def _vector(t: torch.Tensor, size: int, dtype: torch.dtype) -> bool:
    return t.dtype == dtype and t.device.type == "cpu" and t.is_contiguous() and t.numel() == size


class CpuDecodeStep:
    """Runs decode-only steps through ps_decode_step_f32 (fp32 activations beside bf16 or GGUF
    weights: AVX2 CPUs) or ps_decode_step_bf16 (bf16 activations: AVX512-BF16 CPUs); `create`
    says whether a model can."""

    def __init__(self, fn: ctypes._CFuncPtr, model: LlamaModel, block_size: int, layers: ctypes.Array,
                 head: Proj, dtype: torch.dtype, calls: dict[str, int | None]) -> None:
        self.fn, self.model, self.block_size = fn, model, block_size
        self.layers, self.head, self.dtype, self.calls = layers, head, dtype, calls
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
        dtype = kv_cache.dtype
        bf16 = dtype == torch.bfloat16
        calls: dict[str, int | None] = {}
        if why is None:
            c, shard = model.cfg, model.shard
            q, kv = shard.num_heads * c.head_dim, shard.num_kv_heads * c.head_dim
            layers = (Layer * c.num_layers)()
            for i, layer in enumerate(model.layers):
                projs = (proj(layer.qkv, c.hidden_size, bf16), proj(layer.o_proj, q, bf16),
                         proj(layer.gate_up, c.hidden_size, bf16), proj(layer.down, shard.intermediate, bf16))
                if any(p is None for p in projs) or not all(
                        _vector(t, c.hidden_size, dtype) for t in (layer.attn_norm, layer.mlp_norm)):
                    why = f"layer {i} has a projection or norm the one-call step does not serve"
                    break
                if projs[0].n != q + 2 * kv or projs[2].n != 2 * shard.intermediate:
                    why = f"layer {i}'s projection sizes are not the model's"
                    break
                if bf16 and not projs[2].swiglu and not projs[2].row_bytes:
                    why = f"layer {i}'s bf16 gate/up is not packed for the fused SwiGLU"
                    break
                layers[i] = Layer(*projs, layer.attn_norm.data_ptr(), layer.mlp_norm.data_ptr(),
                                  kv_cache[0, i].data_ptr(), kv_cache[1, i].data_ptr())
            head_lin = model.lm_head or model.tied_head
            head = None if head_lin is None else proj(head_lin, c.hidden_size, bf16)
            if why is None and (head is None or not _vector(model.norm, c.hidden_size, dtype)):
                why = "the LM head is not served by the CPU kernels"
            if why is None and bf16:
                calls, why = cls._bf16_calls(model, [head_lin, *(m for layer in model.layers for m in (
                    layer.qkv, layer.o_proj, layer.gate_up, layer.down))])
        if why is not None:
            log.info("decode steps: layer by layer (%s)", why)
            return None
        # The fp32 step is built into the library of the AVX2 matmuls, the bf16 one into the
        # AVX512-BF16 kernels' (build.py).
        lib = build.library() if bf16 else model.layer_f32
        fn = (declare(lib, "ps_decode_step_bf16", StepBf16) if bf16
              else declare(lib, "ps_decode_step_f32", Step))
        log.info("decode steps of up to %d sequences: one C call for all %d layers and the head (%s activations)",
                 MAX_ROWS, model.cfg.num_layers, str(dtype).removeprefix("torch."))
        return cls(fn, model, block_size, layers, head, dtype, calls)

    @staticmethod
    def _bf16_calls(model: LlamaModel, linears: list[Linear]) -> tuple[dict[str, int | None], str | None]:
        """The AVX2 library's calls the bf16 forward's matmuls reach (the step calls the same):
        the shared bf16 matmul, the GGUF block kernels, the fp32 SwiGLU after GGUF gate/up, and the
        decode attention shared with the decode helpers (where their library is built; it shares
        only while they run, as the matmuls do)."""
        # cpu_gemm.shared_call: functools.partial(ps_bf16_shared, this library's ps_bf16_blocks)
        shared = {None if lin._gemm_shared is None else (_address(lin._gemm_shared.func), lin._gemm_shared.args)
                  for lin in linears if lin.blocks is None}
        quant = {(_address(lin._qlib.ps_qgemm), _address(lin._qshared)) for lin in linears if lin.blocks is not None}
        blocks = _address(build.library().ps_bf16_blocks)
        if len(shared) > 1 or len(quant) > 1 or any(k is not None and k[1] != (blocks,) for k in shared):
            return {}, "the projections reach different matmul libraries"
        calls: dict[str, int | None] = {"bf16_shared": None, "qgemm": None, "qgemm_shared": None, "swiglu_f32": None,
                                        "attn_shared": None}
        helpers = build.bf16w_library()
        if helpers is not None:
            calls["attn_shared"] = _address(helpers.ps_decode_attention_bf16_shared)
        if shared and (key := shared.pop()) is not None:
            calls["bf16_shared"] = key[0]
        if quant:
            calls["qgemm"], calls["qgemm_shared"] = quant.pop()
        if any(layer.gate_up.blocks is not None for layer in model.layers):
            if model.block_swiglu is None:
                return {}, "GGUF gate/up blocks without the fp32 SwiGLU kernel"
            calls["swiglu_f32"] = _address(model.block_swiglu.ps_swiglu_f32)
        return calls, None

    @staticmethod
    def _unsupported(model: LlamaModel, kv_cache: torch.Tensor, paged_kernel: bool) -> str | None:
        c = model.cfg
        if os.environ.get("PHASESPLIT_CPU_DECODE_STEP", "1") == "0":
            return "PHASESPLIT_CPU_DECODE_STEP=0"
        if kv_cache.device.type != "cpu" or model.embed.weight.dtype != kv_cache.dtype:
            return "not a CPU path with its layer kernels"
        if kv_cache.dtype == torch.bfloat16:
            if build.library() is None or c.head_dim % 32:
                return "not the bf16 CPU path with its layer kernels"
        elif kv_cache.dtype != torch.float32 or model.layer_f32 is None:
            return "not the fp32-activation CPU path with its layer kernels"
        if model.all_reduce is not None:
            return "tensor parallelism"
        lanes = 16 if kv_cache.dtype == torch.bfloat16 else 8  # the norms' vector width
        if not paged_kernel or c.head_dim % 16 or c.hidden_size % lanes or not kv_cache.is_contiguous():
            return "the attention or RoPE kernel does not take this model's shapes"
        if not cpu_attention.decode_fits(model.shard.num_heads, model.shard.num_kv_heads, c.head_dim, kv_cache.dtype):
            return "the decode attention kernel does not take this model's heads"
        return None

    def _work(self, rows: int) -> dict[str, torch.Tensor]:
        """Per-batch-size work buffers (kept: a step allocates nothing of its own size). The bf16
        step's fp32 ones (xf, rf, yf) hold a GGUF projection's widened input, residual and sums."""
        buf = self._buffers.get(rows)
        if buf is None:
            c = self.model.cfg
            hidden, q, qkv = c.hidden_size, self.heads * c.head_dim, (self.heads + 2 * self.kv_heads) * c.head_dim
            sizes = {"xb": hidden, "h": hidden, "qkv": qkv, "attn": q, "mid": self.inter}
            f32 = ({"xf": max(hidden, q, self.inter), "rf": hidden, "yf": max(qkv, 2 * self.inter, hidden)}
                   if self.dtype == torch.bfloat16 else {"gu": 2 * self.inter})
            buf = {k: torch.empty(rows, n, dtype=self.dtype) for k, n in sizes.items()}
            buf.update({k: torch.empty(rows, n, dtype=torch.float32) for k, n in f32.items()})
            self._buffers[rows] = buf
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
        # in the activations' dtype (checked in create)
        x = F.embedding(torch.tensor(ids, dtype=torch.long), model.embed.weight)
        slots = np.ascontiguousarray(slots)
        threads = torch.get_num_threads()
        per_thread = (self.heads // self.kv_heads) * int(lens.max())
        scratch = torch.empty(threads * per_thread, dtype=torch.float32)
        logits = torch.empty(n, self.head.n, dtype=torch.float32)
        w = self._work(n)
        common = (n, c.hidden_size, self.heads, self.kv_heads, c.head_dim, self.inter, self.block_size,
                  tables.shape[1], per_thread, c.rms_eps, self.scale, cos.data_ptr(), sin.data_ptr(),
                  slots.ctypes.data, tables.ctypes.data, lens.ctypes.data, x.data_ptr())
        work = [w[k].data_ptr() for k in ("xb", "h", "qkv", "attn", "mid")]
        if self.dtype == torch.bfloat16:
            step = StepBf16(*common, *work, w["xf"].data_ptr(), w["rf"].data_ptr(), w["yf"].data_ptr(),
                            scratch.data_ptr(), model.norm.data_ptr(), self.head, logits.data_ptr(), threads,
                            self.calls["bf16_shared"], self.calls["qgemm"], self.calls["qgemm_shared"],
                            self.calls["swiglu_f32"], self.calls["attn_shared"])
        else:
            step = Step(*common, *work, w["gu"].data_ptr(), scratch.data_ptr(), model.norm.data_ptr(), self.head,
                        logits.data_ptr(), threads)
        rc = self.fn(ctypes.byref(step), self.layers, c.num_layers)
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
