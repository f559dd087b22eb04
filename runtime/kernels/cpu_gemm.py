"""bf16 matmuls on AVX512-BF16 CPUs through a small C kernel (gemm_bf16.c).

At this model size a decode step streams every weight once per token, and oneDNN's bf16 path
reaches only ~10 GB/s of the ~18-22 GB/s one core can read here (it is compute-bound on rows of
one). The kernel reads W in a layout made for that (see the C file) and beats oneDNN at every
row count measured, so the weights are kept in its layout alone: no second copy.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F

from phasesplit.runtime.kernels import build
from phasesplit.runtime.kernels.build import KernelUnavailable

TILE = 16  # output columns per packed tile (one 512-bit register of fp32 sums)


def declare(lib: ctypes.CDLL) -> None:
    fn = lib.ps_gemm_bf16
    fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_long] * 3 + [ctypes.c_int] * 3
    fn.restype = ctypes.c_int
    # ps_bf16_blocks is only handed over by address (shared_call), never called from here.


def shared_call(lib: ctypes.CDLL) -> Callable[..., int] | None:
    """The call that shares this library's matmul with the decode helpers (decode_helpers.c's
    ps_bf16_shared, handed this library's ps_bf16_blocks), with ps_gemm_bf16's arguments less
    `threads`; None where the helpers' library cannot be built (AVX2, FMA, F16C)."""
    helpers = build.bf16w_library()
    if helpers is None:
        return None
    return functools.partial(helpers.ps_bf16_shared, ctypes.cast(lib.ps_bf16_blocks, ctypes.c_void_p).value)


def pack(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] bf16 -> [ceil(N/16), K/2, 16, 2]: the kernel's layout (rows padded with zeros)."""
    n, k = weight.shape
    if k % 2:
        raise KernelUnavailable(f"odd inner size {k}")
    tiles = -(-n // TILE)
    w = F.pad(weight.detach(), (0, 0, 0, tiles * TILE - n))
    return w.view(tiles, TILE, k // 2, 2).permute(0, 2, 1, 3).contiguous()


def pack_swiglu(weight: torch.Tensor) -> torch.Tensor:
    """[2I, K] (gate rows, then up rows) -> gate and up tiles alternating, for act=SWIGLU."""
    inter = weight.shape[0] // 2
    if weight.shape[0] % 2 or inter % TILE:
        raise KernelUnavailable(f"gate+up rows {weight.shape[0]} are not two multiples of {TILE}")
    gate, up = pack(weight[:inter]), pack(weight[inter:])
    return torch.stack((gate, up), dim=1).flatten(0, 1)


NONE, SWIGLU = 0, 1


def matmul(fn: ctypes._CFuncPtr, x: torch.Tensor, packed: torch.Tensor, n: int,
           residual: torch.Tensor | None = None, out_dtype: torch.dtype = torch.bfloat16,
           act: int = NONE, shared: Callable[..., int] | None = None) -> torch.Tensor:
    """x [M, K] bf16 @ W^T (+ residual [M, N] bf16) with W packed by `pack`; out [M, N].
    act=SWIGLU: W packed by `pack_swiglu` with n = 2I rows; out [M, I] = silu(gate) * up.
    `shared` (shared_call's): when torch runs one thread (the runner's decode steps of a few
    sequences), the call is shared with the decode helpers, if started; the same bits either way."""
    x = x.contiguous()
    m, k = x.shape
    out = torch.empty(m, n // 2 if act == SWIGLU else n, dtype=out_dtype)
    res = None
    if residual is not None:
        residual = residual.contiguous()
        res = residual.data_ptr()
    threads = torch.get_num_threads()
    if shared is not None and threads == 1:
        rc = shared(x.data_ptr(), packed.data_ptr(), res, out.data_ptr(), m, n, k, out_dtype == torch.float32, act)
    else:
        rc = fn(x.data_ptr(), packed.data_ptr(), res, out.data_ptr(), m, n, k, out_dtype == torch.float32, threads,
                act)
    if rc != 0:
        raise KernelUnavailable(f"matmul rejected its arguments (rows {m}, cols {n}, inner {k}, act {act})")
    return out


def self_check(lib: ctypes.CDLL) -> None:
    """Compare with F.linear on odd shapes (tails in N, many and few rows, both outputs)."""
    fn = lib.ps_gemm_bf16
    g = torch.Generator().manual_seed(0)
    for m, n, k, res, f32 in ((1, 37, 64, False, False), (5, 40, 34, True, False), (9, 16, 128, False, True),
                              (3, 50, 96, True, True)):
        w = torch.randn(n, k, generator=g).bfloat16()
        x = torch.randn(m, k, generator=g).bfloat16()
        r = torch.randn(m, n, generator=g).bfloat16() if res else None
        want = F.linear(x.float(), w.float()) + (r.float() if r is not None else 0)
        packed = pack(w)  # held here: a temporary's memory could be freed before the call reads it
        for threads in (1, 2):
            out = torch.empty(m, n, dtype=torch.float32 if f32 else torch.bfloat16)
            rc = fn(x.data_ptr(), packed.data_ptr(), None if r is None else r.data_ptr(), out.data_ptr(),
                    m, n, k, f32, threads, NONE)
            err = (out.float() - want).abs().max().item()
            if rc != 0 or not err <= 0.02 * (1 + want.abs().max().item()):
                raise KernelUnavailable(f"matmul self-check failed (rows {m}, cols {n}, inner {k}: max error {err:.3g})")
    w = torch.randn(64, 40, generator=g).bfloat16()
    x = torch.randn(5, 40, generator=g).bfloat16()
    gate, up = F.linear(x.float(), w.float()).chunk(2, dim=-1)
    want = F.silu(gate) * up
    got = matmul(fn, x, pack_swiglu(w), 64, act=SWIGLU)
    err = (got.float() - want).abs().max().item()
    if not err <= 0.02 * (1 + want.abs().max().item()):
        raise KernelUnavailable(f"SwiGLU matmul self-check failed (max error {err:.3g})")
