"""Matmuls with weights kept in GGUF's block formats (Q8_0, Q4_0, Q4_1) through quant_gemm.c.

The weight bytes are exactly the GGUF file's: rows of 32-weight blocks (an fp16 scale, Q4_1 an
fp16 minimum too, then the 8- or 4-bit values). The kernel quantizes the activation rows to 8-bit
blocks once per call and does integer dot products (see the C file), so results differ from
"dequantize, then fp32 matmul" by that rounding of the activations (~0.4 % of each block's
largest value); the self-check bounds it.

On CPUs with AVX512-VNNI the weights are repacked at load, 16 rows to a tile (`pack_x16`; the
layout is described at the top of quant_x16.c), for a kernel that needs about a sixth of the
instructions per weight; the bytes per weight stay the file's. PHASESPLIT_QUANT_X16=0 keeps the
file's row layout (the previous kernel) for comparison. There, bf16 activations (prefill on
AVX512-BF16 CPUs) go through one C call that widens, multiplies, adds the residual or applies
SwiGLU, and rounds (ps_qx16_gemm_bf16) instead of torch's conversions around the fp32 kernel.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F

from phasesplit.runtime.kernels import build
from phasesplit.runtime.kernels.build import KernelUnavailable

QK = 32  # weights per block
# GGML's type ids (gguf.GGMLQuantizationType) -> bytes per block.
Q4_0, Q4_1, Q8_0 = 2, 3, 8
BLOCK_BYTES = {Q4_0: 18, Q4_1: 20, Q8_0: 34}
NAMES = {Q4_0: "q4_0", Q4_1: "q4_1", Q8_0: "q8_0"}
# + a GGUF type: the same blocks with 16 weight rows interleaved (pack_x16, quant_x16.c)
X16 = 100
TILE = 16


def base_type(qtype: int) -> int:
    """The GGUF type of a (possibly packed) qtype."""
    return qtype - X16 if qtype > X16 else qtype


def name(qtype: int) -> str:
    return NAMES.get(base_type(qtype), str(qtype))


def layout_name(qtype: int) -> str:
    """How the start-up log names a weight's layout: the GGUF type, "x16" added when packed."""
    return name(qtype) + (" x16" if qtype > X16 else "")


LAYOUTS = tuple(NAMES.values()) + tuple(f"{n} x16" for n in NAMES.values())


# From this many activation rows on, the weight is dequantized for the call and multiplied by
# torch's fp32 matmul (see ps_qdequant); below, the integer kernel. Measured here (one core, CPU
# time, a 3072 x 576 weight): Q8_0 1 row 0.17 ms vs 0.73 for fp32 oneDNN/MKL, 32 rows 3.0 vs 5.2,
# 128 rows 11.9 vs 13.4 (dequantize + fp32 14.3), 512 rows 49.7 vs 39.5 dequantize + fp32.
# Weights packed for quant_x16.c never take that path by default: its integer kernel beat both
# dequantize + fp32 and torch's bf16 matmul at every row count measured (2 threads, Zen 4, a
# 576 x 1536 weight: 128 rows 0.4 ms vs 1.5-1.75 dequantize + fp32 and 0.6 bf16; 512 rows
# 1.7-2.3 vs 13 and 2.5), and so a row's result never depends on its batch.
DENSE_ROWS = 128


def declare(lib: ctypes.CDLL) -> None:
    fn = lib.ps_qgemm
    fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_long] * 4 + [ctypes.c_int] * 2
    fn.restype = ctypes.c_int
    fn = lib.ps_qdequant
    fn.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_long] * 3 + [ctypes.c_int] * 2
    fn.restype = ctypes.c_int
    lib.ps_qx16_supported.argtypes = []
    lib.ps_qx16_supported.restype = ctypes.c_int
    fn = lib.ps_qx16_gemm_bf16
    fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_long] * 3 + [ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
    fn.restype = ctypes.c_int


def x16_supported(lib: ctypes.CDLL) -> bool:
    """Whether weights are packed for quant_x16.c's kernel here: the CPU has AVX512-VNNI (the
    library asks it) and PHASESPLIT_QUANT_X16 is not 0."""
    return os.environ.get("PHASESPLIT_QUANT_X16", "1") != "0" and bool(lib.ps_qx16_supported())


def for_kernel(lib: ctypes.CDLL, blocks: torch.Tensor, qtype: int) -> tuple[torch.Tensor, int]:
    """A weight's blocks and qtype in the layout `lib` multiplies fastest on this CPU: packed 16
    rows to a tile where x16_supported and the rows come in whole tiles, else as they are."""
    if qtype in NAMES and blocks.shape[0] % TILE == 0 and x16_supported(lib):
        return pack_x16(blocks, qtype), qtype + X16
    return blocks, qtype


def _geometry(blocks: torch.Tensor, qtype: int) -> tuple[int, int, int, int, int]:
    """Of a [N, K/32 * block bytes] weight of GGUF type `qtype`: its tiles of 16 rows, blocks per
    row, bytes per block, the block's fp16 header values (scale, and Q4_1's minimum) and its
    groups of 4 value bytes."""
    bb = BLOCK_BYTES[qtype]
    return (blocks.shape[0] // TILE, blocks.shape[1] // bb, bb, 2 if qtype == Q4_1 else 1,
            8 if qtype == Q8_0 else 4)


def pack_x16(blocks: torch.Tensor, qtype: int) -> torch.Tensor:
    """GGUF rows [N, K/32 * block bytes] (N a multiple of 16) -> the same bytes packed for
    quant_x16.c: per tile of 16 rows and block, the 16 rows' fp16 header values, then groups of
    4 value bytes of all 16 rows (Q8_0's as q ^ 0x80). Same shape; a "row" of the result is no
    longer one weight row, only whole tiles mean anything."""
    tiles, nb, bb, heads, groups = _geometry(blocks, qtype)
    a = blocks.numpy().reshape(tiles, TILE, nb, bb).transpose(0, 2, 1, 3)  # [tiles, nb, 16, bb]
    head = a[..., : 2 * heads].reshape(tiles, nb, TILE, heads, 2).transpose(0, 1, 3, 2, 4)
    vals = a[..., 2 * heads:].reshape(tiles, nb, TILE, groups, 4).transpose(0, 1, 3, 2, 4)
    if qtype == Q8_0:
        vals = vals ^ np.uint8(0x80)
    out = np.concatenate([head.reshape(tiles, nb, -1), vals.reshape(tiles, nb, -1)], axis=2)
    return torch.from_numpy(np.ascontiguousarray(out).reshape(blocks.shape))


def unpack_x16(blocks: torch.Tensor, qtype: int) -> torch.Tensor:
    """pack_x16's inverse: packed blocks (qtype with or without X16) -> GGUF rows."""
    qtype = base_type(qtype)
    tiles, nb, bb, heads, groups = _geometry(blocks, qtype)
    a = blocks.numpy().reshape(tiles, nb, TILE * bb)
    head = a[..., : 32 * heads].reshape(tiles, nb, heads, TILE, 2).transpose(0, 1, 3, 2, 4)
    vals = a[..., 32 * heads:].reshape(tiles, nb, groups, TILE, 4).transpose(0, 1, 3, 2, 4)
    if qtype == Q8_0:
        vals = vals ^ np.uint8(0x80)
    rows = np.concatenate([head.reshape(tiles, nb, TILE, -1), vals.reshape(tiles, nb, TILE, -1)], axis=3)
    return torch.from_numpy(np.ascontiguousarray(rows.transpose(0, 2, 1, 3)).reshape(blocks.shape))


def shared_call(lib: ctypes.CDLL | None) -> Callable[..., int] | None:
    """The call that shares `lib`'s (quant_library()'s) matmul with the decode helpers: the
    helpers' library holds quant_gemm.c too, and its ps_qgemm_shared takes ps_qgemm's arguments
    less `threads`; None without `lib` or where the helpers' library cannot be built."""
    helpers = build.bf16w_library() if lib is not None else None
    return None if helpers is None else helpers.ps_qgemm_shared


def matmul(lib: ctypes.CDLL, x: torch.Tensor, blocks: torch.Tensor, qtype: int,
           residual: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
           dense_rows: int | None = None, shared: ctypes._CFuncPtr | None = None) -> torch.Tensor:
    """x [M, K] @ W^T (+ residual [M, N]) with W as `blocks` [N, K/32 * block bytes] uint8.

    The kernels work in fp32: other activations are converted in and the result converted back
    to `out_dtype` (default: x's dtype). From `dense_rows` rows on (default: DENSE_ROWS for the
    file's row layout, never for packed weights), W is dequantized for the call and torch
    multiplies (no activation rounding then). `shared` (the bf16w library's
    ps_qgemm_shared): when torch runs one thread (the runner's decode steps of a few sequences),
    the call is shared with the decode helpers, if started; the same bits either way."""
    out_dtype = out_dtype or x.dtype
    if _bf16_in_c(x, blocks, qtype, residual, out_dtype, shared) and (dense_rows is None or x.shape[0] < dense_rows):
        return _matmul_bf16(lib, x, blocks, qtype, residual, None)
    xf = x.contiguous() if x.dtype == torch.float32 else x.float().contiguous()
    m, k = xf.shape
    n = blocks.shape[0]
    if residual is not None:
        residual = residual.contiguous() if residual.dtype == torch.float32 else residual.float().contiguous()
    if dense_rows is None:
        dense_rows = DENSE_ROWS if qtype < X16 else m + 1
    if m >= dense_rows:
        w = dequantize_fast(lib, blocks, qtype, k)
        out = F.linear(xf, w) if residual is None else torch.addmm(residual, xf, w.t())
        return out if out_dtype == torch.float32 else out.to(out_dtype)
    res = None if residual is None else residual.data_ptr()
    out = torch.empty(m, n, dtype=torch.float32)
    threads = torch.get_num_threads()
    if shared is not None and threads == 1:
        rc = shared(xf.data_ptr(), blocks.data_ptr(), res, out.data_ptr(), m, n, k, blocks.stride(0), qtype)
    else:
        rc = lib.ps_qgemm(xf.data_ptr(), blocks.data_ptr(), res, out.data_ptr(), m, n, k, blocks.stride(0), qtype,
                          threads)
    if rc != 0:
        raise KernelUnavailable(f"quantized matmul rejected its arguments (rows {m}, cols {n}, inner {k}, "
                                f"type {name(qtype)}{' packed' if qtype > X16 else ''}): code {rc}")
    return out if out_dtype == torch.float32 else out.to(out_dtype)


def _bf16_in_c(x: torch.Tensor, blocks: torch.Tensor, qtype: int, residual: torch.Tensor | None,
               out_dtype: torch.dtype, shared: ctypes._CFuncPtr | None) -> bool:
    """Whether a call goes to ps_qx16_gemm_bf16 (bf16 in and out, packed weights): the same bits
    as widening, multiplying and rounding here, without the passes over [M, N] fp32 arrays. Not
    for the calls shared with the decode helpers (one torch thread), which stay on ps_qgemm."""
    return (qtype > X16 and x.dtype == torch.bfloat16 and out_dtype == torch.bfloat16 and x.dim() == 2
            and blocks.is_contiguous()  # the C side takes whole tiles with no gap between rows
            and (residual is None or residual.dtype == torch.bfloat16)
            and not (shared is not None and torch.get_num_threads() == 1))


def _matmul_bf16(lib: ctypes.CDLL, x: torch.Tensor, blocks: torch.Tensor, qtype: int,
                 residual: torch.Tensor | None, swiglu: int | None) -> torch.Tensor:
    x = x.contiguous()
    m, k = x.shape
    n = blocks.shape[0]
    if residual is not None:
        residual = residual.contiguous()
    out = torch.empty(m, n // 2 if swiglu else n, dtype=torch.bfloat16)
    rc = lib.ps_qx16_gemm_bf16(x.data_ptr(), blocks.data_ptr(), None if residual is None else residual.data_ptr(),
                               out.data_ptr(), m, n, k, qtype, swiglu, torch.get_num_threads())
    if rc != 0:
        raise KernelUnavailable(f"quantized bf16 matmul rejected its arguments (rows {m}, cols {n}, inner {k}, "
                                f"type {name(qtype)} packed{', swiglu' if swiglu else ''}): code {rc}")
    return out


def matmul_swiglu(lib: ctypes.CDLL, x: torch.Tensor, blocks: torch.Tensor, qtype: int, swiglu: ctypes._CFuncPtr,
                  shared: ctypes._CFuncPtr | None = None) -> torch.Tensor | None:
    """silu(gate) * up for W = `blocks` (gate rows, then up rows) on bf16 x, in one C call with
    `swiglu` (cpu_layer_f32's ps_swiglu_f32) applied per unit of columns: the bits of matmul's
    fp32 sums through that SwiGLU, rounded to bf16. None where that call does not apply (see
    _bf16_in_c; the gate's width not a multiple of 16): the caller goes the long way."""
    if not _bf16_in_c(x, blocks, qtype, None, torch.bfloat16, shared) or blocks.shape[0] % 32:
        return None
    return _matmul_bf16(lib, x, blocks, qtype, None, ctypes.cast(swiglu, ctypes.c_void_p).value)


def dequantize_fast(lib: ctypes.CDLL, blocks: torch.Tensor, qtype: int, k: int) -> torch.Tensor:
    """GGUF blocks -> [N, K] fp32 through the C kernel (all threads)."""
    out = torch.empty(blocks.shape[0], k, dtype=torch.float32)
    rc = lib.ps_qdequant(blocks.data_ptr(), out.data_ptr(), blocks.shape[0], k, blocks.stride(0), qtype,
                         torch.get_num_threads())
    if rc != 0:
        raise KernelUnavailable(f"dequantize rejected its arguments (rows {blocks.shape[0]}, inner {k}, "
                                f"type {name(qtype)})")
    return out


def quantize(weight: torch.Tensor, qtype: int) -> torch.Tensor:
    """[N, K] float -> GGUF blocks [N, K/32 * block bytes] uint8 (the gguf package's reference
    quantizer); for checks, tests and re-quantized files."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize as gguf_quantize

    arr = weight.detach().float().numpy()
    return torch.from_numpy(np.ascontiguousarray(gguf_quantize(arr, GGMLQuantizationType(qtype))))


def dequantize(blocks: torch.Tensor, qtype: int, k: int) -> torch.Tensor:
    """GGUF blocks (or packed ones, unpacked first) -> [N, K] fp32 (the gguf package's reference
    dequantizer)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize

    if qtype > X16:
        blocks, qtype = unpack_x16(blocks, qtype), base_type(qtype)
    arr = gguf_dequantize(blocks.numpy(), GGMLQuantizationType(qtype))
    return torch.from_numpy(np.ascontiguousarray(arr, dtype=np.float32)).view(blocks.shape[0], k)


def self_check(lib: ctypes.CDLL) -> None:
    """Every type against F.linear on the dequantized weight: odd row counts (1, 3, 5, 9: the
    4-row groups and their tails), columns that are not a tile multiple, a residual, 1 and 2
    threads; the packed layout's kernel too where this CPU runs it (whole tiles only)."""
    fn = lib.ps_qgemm
    g = torch.Generator().manual_seed(0)
    # packed (X16) weights where this CPU runs their kernel: whole tiles of 16 rows
    packed = x16_supported(lib)
    for qtype in (Q8_0, Q4_0, Q4_1) + ((Q8_0 + X16, Q4_0 + X16, Q4_1 + X16) if packed else ()):
        shapes = ((1, 37, 64, False), (5, 40, 96, True), (9, 16, 128, False), (3, 50, 32, True))
        if qtype > X16:
            shapes = ((1, 48, 64, False), (5, 32, 96, True), (9, 16, 128, False), (3, 64, 32, True), (2, 16, 608, True))
        for m, n, k, with_res in shapes:
            w = quantize(torch.randn(n, k, generator=g), base_type(qtype))
            if qtype > X16:
                w = pack_x16(w, base_type(qtype))
            x = torch.randn(m, k, generator=g)
            r = torch.randn(m, n, generator=g) if with_res else None
            want = F.linear(x, dequantize(w, qtype, k)) + (r if r is not None else 0)
            for threads in (1, 2):
                out = torch.empty(m, n)
                rc = fn(x.data_ptr(), w.data_ptr(), None if r is None else r.data_ptr(), out.data_ptr(),
                        m, n, k, w.stride(0), qtype, threads)
                err = (out - want).abs().max().item()
                # Activation rounding: at most half a step (max|x| / 254) per element.
                if rc != 0 or not err <= 0.02 * (1 + want.abs().max().item()):
                    raise KernelUnavailable(f"quantized matmul self-check failed ({name(qtype)}, rows {m}, "
                                            f"cols {n}, inner {k}: code {rc}, max error {err:.3g})")
            dense = dequantize_fast(lib, w, qtype, k)
            if not torch.allclose(dense, dequantize(w, qtype, k), rtol=1e-6, atol=1e-6):
                raise KernelUnavailable(f"dequantize self-check failed ({name(qtype)}, rows {n}, inner {k})")
