"""bf16 matmuls on AVX512-BF16 CPUs through a small C kernel (gemm_bf16.c).

At this model size a decode step streams every weight once per token, and oneDNN's bf16 path
reaches only ~10 GB/s of the ~18-22 GB/s one core can read here (it is compute-bound on rows of
one). The kernel reads W in a layout made for that (see the C file) and beats oneDNN at every
row count measured, so the weights are kept in its layout alone: no second copy.

The C file is compiled with the system's C compiler on first use and cached under
`~/.cache/phasesplit/kernels/`, keyed by the source, flags and compiler, so later starts only
load it (~1 ms). No compiler, another CPU, or PHASESPLIT_CPU_KERNELS=0: callers fall back to
torch. The library is checked against F.linear once before it is used.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("gemm_bf16.c")
FLAGS = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-fopenmp", "-fPIC", "-shared"]
CPU_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512_bf16")
TILE = 16  # output columns per packed tile (one 512-bit register of fp32 sums)


class KernelUnavailable(RuntimeError):
    pass


def cpu_supported(cpuinfo: str) -> bool:
    """Whether /proc/cpuinfo's flags list every instruction set the kernel is built for."""
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            return all(f in flags for f in CPU_FLAGS)
    return False


def _cache_dir() -> Path:
    from phasesplit.runtime.model.loader import cache_root

    return cache_root() / "kernels"


def _compiler() -> str | None:
    for cc in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if cc and shutil.which(cc):
            return cc
    return None


def build(cc: str, out_dir: Path) -> Path:
    """Compile the kernel (once per source/flags/compiler) and return the shared library's path."""
    src = SOURCE.read_bytes()
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    key = hashlib.sha256(src + " ".join(FLAGS).encode() + version.encode()).hexdigest()[:16]
    lib = out_dir / f"gemm_bf16-{key}.so"
    if lib.exists():
        return lib
    out_dir.mkdir(parents=True, exist_ok=True)
    # Built under a temporary name and renamed: concurrent starts never load a half-written file.
    fd, tmp = tempfile.mkstemp(dir=out_dir, suffix=".so.tmp")
    os.close(fd)
    try:
        proc = subprocess.run([cc, *FLAGS, str(SOURCE), "-o", tmp], capture_output=True, text=True, timeout=300)
        if proc.returncode != 0:
            raise KernelUnavailable(f"{cc} failed to build {SOURCE.name}: {proc.stderr.strip()[-600:]}")
        os.replace(tmp, lib)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return lib


@cache
def library() -> ctypes.CDLL | None:
    """The compiled kernel, or None where it cannot be used here (the reason is logged once)."""
    try:
        return _load()
    except (KernelUnavailable, OSError, subprocess.SubprocessError) as e:
        log.info("bf16 CPU kernel not used: %s", e)
        return None


def _load() -> ctypes.CDLL:
    if os.environ.get("PHASESPLIT_CPU_KERNELS", "1") == "0":
        raise KernelUnavailable("PHASESPLIT_CPU_KERNELS=0")
    if platform.system() != "Linux" or platform.machine() != "x86_64":
        raise KernelUnavailable(f"not an x86-64 Linux machine ({platform.system()} {platform.machine()})")
    with open("/proc/cpuinfo") as f:
        if not cpu_supported(f.read()):
            raise KernelUnavailable(f"the CPU lacks one of {', '.join(CPU_FLAGS)}")
    cc = _compiler()
    if cc is None:
        raise KernelUnavailable("no C compiler (cc, gcc or clang) on PATH")
    # torch is imported first, so the library's libgomp.so.1 resolves to the one torch loaded:
    # one OpenMP thread pool for both, not two pools fighting over the same cores.
    lib = ctypes.CDLL(str(build(cc, _cache_dir())))
    fn = lib.ps_gemm_bf16
    fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_long] * 3 + [ctypes.c_int, ctypes.c_int]
    fn.restype = ctypes.c_int
    _self_check(fn)
    return lib


def pack(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] bf16 -> [ceil(N/16), K/2, 16, 2]: the kernel's layout (rows padded with zeros)."""
    n, k = weight.shape
    if k % 2:
        raise KernelUnavailable(f"odd inner size {k}")
    tiles = -(-n // TILE)
    w = F.pad(weight.detach(), (0, 0, 0, tiles * TILE - n))
    return w.view(tiles, TILE, k // 2, 2).permute(0, 2, 1, 3).contiguous()


def matmul(fn: ctypes._CFuncPtr, x: torch.Tensor, packed: torch.Tensor, n: int,
           residual: torch.Tensor | None = None, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """x [M, K] bf16 @ W^T (+ residual [M, N] bf16) with W packed by `pack`; out [M, N]."""
    x = x.contiguous()
    m, k = x.shape
    out = torch.empty(m, n, dtype=out_dtype)
    res = None
    if residual is not None:
        residual = residual.contiguous()
        res = residual.data_ptr()
    fn(x.data_ptr(), packed.data_ptr(), res, out.data_ptr(), m, n, k, out_dtype == torch.float32,
       torch.get_num_threads())
    return out


def _self_check(fn: ctypes._CFuncPtr) -> None:
    """Compare with F.linear on odd shapes (tails in N, many and few rows, both outputs)."""
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
                    m, n, k, f32, threads)
            err = (out.float() - want).abs().max().item()
            if rc != 0 or not err <= 0.02 * (1 + want.abs().max().item()):
                raise KernelUnavailable(f"self-check failed (rows {m}, cols {n}, inner {k}: max error {err:.3g})")
