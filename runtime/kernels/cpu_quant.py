"""Matmuls with weights kept in GGUF's block formats (Q8_0, Q4_0, Q4_1) through quant_gemm.c.

The weight bytes are exactly the GGUF file's: rows of 32-weight blocks (an fp16 scale, Q4_1 an
fp16 minimum too, then the 8- or 4-bit values). The kernel quantizes the activation rows to 8-bit
blocks once per call and does integer dot products (see the C file), so results differ from
"dequantize, then fp32 matmul" by that rounding of the activations (~0.4 % of each block's
largest value); the self-check bounds it.
"""

from __future__ import annotations

import ctypes
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


# From this many activation rows on, the weight is dequantized for the call and multiplied by
# torch's fp32 matmul (see ps_qdequant); below, the integer kernel. Measured here (one core, CPU
# time, a 3072 x 576 weight): Q8_0 1 row 0.17 ms vs 0.73 for fp32 oneDNN/MKL, 32 rows 3.0 vs 5.2,
# 128 rows 11.9 vs 13.4 (dequantize + fp32 14.3), 512 rows 49.7 vs 39.5 dequantize + fp32.
DENSE_ROWS = 128


def declare(lib: ctypes.CDLL) -> None:
    fn = lib.ps_qgemm
    fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_long] * 4 + [ctypes.c_int] * 2
    fn.restype = ctypes.c_int
    fn = lib.ps_qdequant
    fn.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_long] * 3 + [ctypes.c_int] * 2
    fn.restype = ctypes.c_int


def shared_call(lib: ctypes.CDLL | None) -> Callable[..., int] | None:
    """The call that shares `lib`'s (quant_library()'s) matmul with the decode helpers: the
    helpers' library holds quant_gemm.c too, and its ps_qgemm_shared takes ps_qgemm's arguments
    less `threads`; None without `lib` or where the helpers' library cannot be built."""
    helpers = build.bf16w_library() if lib is not None else None
    return None if helpers is None else helpers.ps_qgemm_shared


def matmul(lib: ctypes.CDLL, x: torch.Tensor, blocks: torch.Tensor, qtype: int,
           residual: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
           dense_rows: int = DENSE_ROWS, shared: ctypes._CFuncPtr | None = None) -> torch.Tensor:
    """x [M, K] @ W^T (+ residual [M, N]) with W as `blocks` [N, K/32 * block bytes] uint8.

    The kernels work in fp32: other activations are converted in and the result converted back
    to `out_dtype` (default: x's dtype). From `dense_rows` rows on, W is dequantized for the
    call and torch multiplies (no activation rounding then). `shared` (the bf16w library's
    ps_qgemm_shared): when torch runs one thread (the runner's decode steps of a few sequences),
    the call is shared with the decode helpers, if started; the same bits either way."""
    out_dtype = out_dtype or x.dtype
    xf = x.contiguous() if x.dtype == torch.float32 else x.float().contiguous()
    m, k = xf.shape
    n = blocks.shape[0]
    if residual is not None:
        residual = residual.contiguous() if residual.dtype == torch.float32 else residual.float().contiguous()
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
                                f"type {NAMES.get(qtype, qtype)}): code {rc}")
    return out if out_dtype == torch.float32 else out.to(out_dtype)


def dequantize_fast(lib: ctypes.CDLL, blocks: torch.Tensor, qtype: int, k: int) -> torch.Tensor:
    """GGUF blocks -> [N, K] fp32 through the C kernel (all threads)."""
    out = torch.empty(blocks.shape[0], k, dtype=torch.float32)
    rc = lib.ps_qdequant(blocks.data_ptr(), out.data_ptr(), blocks.shape[0], k, blocks.stride(0), qtype,
                         torch.get_num_threads())
    if rc != 0:
        raise KernelUnavailable(f"dequantize rejected its arguments (rows {blocks.shape[0]}, inner {k}, "
                                f"type {NAMES.get(qtype, qtype)})")
    return out


def quantize(weight: torch.Tensor, qtype: int) -> torch.Tensor:
    """[N, K] float -> GGUF blocks [N, K/32 * block bytes] uint8 (the gguf package's reference
    quantizer); for checks, tests and re-quantized files."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize as gguf_quantize

    arr = weight.detach().float().numpy()
    return torch.from_numpy(np.ascontiguousarray(gguf_quantize(arr, GGMLQuantizationType(qtype))))


def dequantize(blocks: torch.Tensor, qtype: int, k: int) -> torch.Tensor:
    """GGUF blocks -> [N, K] fp32 (the gguf package's reference dequantizer)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize

    arr = gguf_dequantize(blocks.numpy(), GGMLQuantizationType(qtype))
    return torch.from_numpy(np.ascontiguousarray(arr, dtype=np.float32)).view(blocks.shape[0], k)


def self_check(lib: ctypes.CDLL) -> None:
    """Every type against F.linear on the dequantized weight: odd row counts (1, 3, 5, 9: the
    4-row groups and their tails), columns that are not a tile multiple, a residual, 1 and 2
    threads."""
    fn = lib.ps_qgemm
    g = torch.Generator().manual_seed(0)
    for qtype in (Q8_0, Q4_0, Q4_1):
        for m, n, k, with_res in ((1, 37, 64, False), (5, 40, 96, True), (9, 16, 128, False), (3, 50, 32, True)):
            w = quantize(torch.randn(n, k, generator=g), qtype)
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
                    raise KernelUnavailable(f"quantized matmul self-check failed ({NAMES[qtype]}, rows {m}, "
                                            f"cols {n}, inner {k}: code {rc}, max error {err:.3g})")
            dense = dequantize_fast(lib, w, qtype, k)
            if not torch.allclose(dense, dequantize(w, qtype, k), rtol=1e-6, atol=1e-6):
                raise KernelUnavailable(f"dequantize self-check failed ({NAMES[qtype]}, rows {n}, inner {k})")
