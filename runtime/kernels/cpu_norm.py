"""RMSNorm of bf16 rows through rms_norm_bf16.c: one call instead of eight torch ops."""

from __future__ import annotations

import ctypes

import torch

from phasesplit.runtime.kernels.build import KernelUnavailable


def declare(lib: ctypes.CDLL) -> None:
    fn = lib.ps_rms_norm_bf16
    fn.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_long] * 2 + [ctypes.c_float, ctypes.c_int]
    fn.restype = ctypes.c_int


def rms_norm(fn: ctypes._CFuncPtr, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [M, K] bf16 (K a multiple of 16), weight [K] bf16; or both fp32 with the fp32 kernel
    (cpu_layer_f32; K a multiple of 8)."""
    x = x.contiguous()
    out = torch.empty_like(x)
    if fn(x.data_ptr(), weight.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1], eps, torch.get_num_threads()):
        raise KernelUnavailable(f"rms_norm rejected a row of {x.shape[1]} (not a multiple of its vector width)")
    return out


def reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Hugging Face's LlamaRMSNorm arithmetic."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def self_check(lib: ctypes.CDLL) -> None:
    g = torch.Generator().manual_seed(0)
    for m, k in ((1, 576), (70, 64)):
        x = (torch.randn(m, k, generator=g) * 4).bfloat16()
        w = torch.randn(k, generator=g).bfloat16()
        got, want = rms_norm(lib.ps_rms_norm_bf16, x, w, 1e-5), reference(x, w, 1e-5)
        # the same rounding steps; only the order of the float32 sum of squares differs
        if not torch.allclose(got.float(), want.float(), rtol=1e-2, atol=1e-2):
            raise KernelUnavailable("rms_norm self-check failed")
