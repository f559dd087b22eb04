"""Greedy token choice (row-wise argmax of float32 logits) through argmax_f32.c."""

from __future__ import annotations

import ctypes

import torch

from phasesplit.runtime.kernels.build import KernelUnavailable


def declare(lib: ctypes.CDLL) -> None:
    fn = lib.ps_argmax_f32
    fn.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_int]
    fn.restype = ctypes.c_int


def argmax(fn: ctypes._CFuncPtr, logits: torch.Tensor) -> torch.Tensor:
    """logits [M, N] float32 on CPU -> [M] int64, the first maximum of each row."""
    logits = logits.contiguous()
    out = torch.empty(logits.shape[0], dtype=torch.int64)
    fn(logits.data_ptr(), logits.shape[0], logits.shape[1], out.data_ptr(), torch.get_num_threads())
    return out


def self_check(lib: ctypes.CDLL) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(9, 1037, generator=g)
    x[3, 5] = x[3, 900] = 50.0  # a tie: the first wins, as in torch
    x[4, :] = float("-inf")
    x[4, 1036] = 1.0  # the maximum in the masked tail
    if not torch.equal(argmax(lib.ps_argmax_f32, x), x.argmax(-1)):
        raise KernelUnavailable("argmax self-check failed")
