"""Compile the C kernels in this folder once, cache the library, load it (CPUs with AVX512-BF16).

The sources are compiled with the system's C compiler on first use and cached under
`~/.cache/phasesplit/kernels/`, keyed by the sources and flags, so later starts only load the
library (~1 ms). An image without a compiler ships it prebuilt: `python -m
phasesplit.runtime.kernels.build DIR` at image build, and PHASESPLIT_KERNELS_DIR=DIR at run time
(the runtime Dockerfile does this). No library and no compiler, another CPU, or
PHASESPLIT_CPU_KERNELS=0: `library()` is None and callers use torch. Each kernel is checked
against torch once before anything uses it.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from functools import cache
from pathlib import Path

log = logging.getLogger(__name__)

SOURCES = tuple(Path(__file__).with_name(f) for f in ("gemm_bf16.c", "decode_attention_bf16.c", "rms_norm_bf16.c",
                                                            "rope_bf16.c", "argmax_f32.c",
                                                            "prefill_attention_bf16.c"))
HEADERS = (Path(__file__).with_name("vec_math.h"), Path(__file__).with_name("gemm_block.h"))
FLAGS = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512bf16", "-fopenmp", "-fPIC", "-shared"]
CPU_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16")


class KernelUnavailable(RuntimeError):
    pass


@contextlib.contextmanager
def num_threads(n: int) -> Iterator[None]:
    """torch's (and so the kernels') thread count set to n for a block, then restored."""
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def cpu_supported(cpuinfo: str) -> bool:
    """Whether /proc/cpuinfo's flags list every instruction set the kernels are built for."""
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            return all(f in flags for f in CPU_FLAGS)
    return False


def _cache_dir() -> Path:
    from phasesplit.runtime.model.files import cache_root

    return cache_root() / "kernels"


def _compiler() -> str | None:
    for cc in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if cc and shutil.which(cc):
            return cc
    return None


def library_name() -> str:
    """The library's file name: a hash of the sources and flags, so an edit never loads a stale build."""
    digest = hashlib.sha256(" ".join(FLAGS).encode())
    for src in SOURCES + HEADERS:
        digest.update(src.read_bytes())
    return f"phasesplit_kernels-{digest.hexdigest()[:16]}.so"


def build(cc: str, out_dir: Path) -> Path:
    """Compile the kernels (once per sources and flags) and return the library's path."""
    lib = out_dir / library_name()
    if lib.exists():
        return lib
    out_dir.mkdir(parents=True, exist_ok=True)
    # Built under a temporary name and renamed: concurrent starts never load a half-written file.
    fd, tmp = tempfile.mkstemp(dir=out_dir, suffix=".so.tmp")
    os.close(fd)
    try:
        proc = subprocess.run([cc, *FLAGS, *map(str, SOURCES), "-o", tmp], capture_output=True, text=True,
                              timeout=300)
        if proc.returncode != 0:
            raise KernelUnavailable(f"{cc} failed to build the CPU kernels: {proc.stderr.strip()[-600:]}")
        os.replace(tmp, lib)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return lib


@cache
def library() -> ctypes.CDLL | None:
    """The compiled kernels, or None where they cannot be used here (the reason is logged once)."""
    try:
        return _load()
    except (KernelUnavailable, OSError, subprocess.SubprocessError) as e:
        log.info("CPU kernels not used: %s", e)
        return None


def _load() -> ctypes.CDLL:
    from phasesplit.runtime.kernels import cpu_argmax, cpu_attention, cpu_gemm, cpu_norm, cpu_rope

    if os.environ.get("PHASESPLIT_CPU_KERNELS", "1") == "0":
        raise KernelUnavailable("PHASESPLIT_CPU_KERNELS=0")
    if platform.system() != "Linux" or platform.machine() != "x86_64":
        raise KernelUnavailable(f"not an x86-64 Linux machine ({platform.system()} {platform.machine()})")
    with open("/proc/cpuinfo") as f:
        if not cpu_supported(f.read()):
            raise KernelUnavailable(f"the CPU lacks one of {', '.join(CPU_FLAGS)}")
    prebuilt = Path(os.environ.get("PHASESPLIT_KERNELS_DIR") or _cache_dir()) / library_name()
    if prebuilt.exists():
        path = prebuilt
    else:
        cc = _compiler()
        if cc is None:
            raise KernelUnavailable(f"no C compiler (cc, gcc or clang) on PATH and no {prebuilt}")
        path = build(cc, _cache_dir())
    # torch is imported first, so the library's libgomp.so.1 resolves to the one torch loaded:
    # one OpenMP thread pool for both, not two pools fighting over the same cores.
    lib = ctypes.CDLL(str(path))
    for kernel in (cpu_gemm, cpu_attention, cpu_norm, cpu_rope, cpu_argmax):
        kernel.declare(lib)
        kernel.self_check(lib)
    return lib


def main(argv: list[str] | None = None) -> int:
    """Prebuild the library into a folder (for images without a compiler)."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m phasesplit.runtime.kernels.build", description=main.__doc__)
    ap.add_argument("dir", type=Path)
    args = ap.parse_args(argv)
    cc = _compiler()
    if cc is None:
        print("no C compiler (cc, gcc or clang) on PATH", flush=True)
        return 1
    try:
        print(build(cc, args.dir))
    except KernelUnavailable as e:
        print(e)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
