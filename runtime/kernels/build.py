"""Compile the C kernels in this folder once, cache the libraries, load them.

Three libraries, each built only for the instruction sets it names and loaded only on a CPU that
has them: the bf16 kernels (AVX512-BF16; `library()`, with the native bf16 path's one-call
decode step), the quantized-weight matmuls
(AVX2 + FMA + F16C; `quant_library()`, see cpu_quant.py), which also run where bf16 does not,
and the AVX2 fp32-activation path for CPUs without AVX512-BF16: the bf16-weight matmul
(`bf16w_library()`, see cpu_gemm_avx2.py), the decode helpers, and in the same library the fp32
norm, RoPE, decode attention and SwiGLU (`layer_f32_library()`, see cpu_layer_f32.py) and the
one-call decode step over all of them (cpu_decode_step.py).

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
from dataclasses import dataclass
from functools import cache
from pathlib import Path

log = logging.getLogger(__name__)

SOURCES = tuple(Path(__file__).with_name(f) for f in ("gemm_bf16.c", "decode_attention_bf16.c", "rms_norm_bf16.c",
                                                            "rope_bf16.c", "argmax_f32.c",
                                                            "prefill_attention_bf16.c",
                                                            # the one-call decode step over them (cpu_decode_step.py)
                                                            "decode_step_bf16.c"))
HEADERS = tuple(Path(__file__).with_name(f) for f in ("vec_math.h", "gemm_block.h", "decode_step.h", "attention_args.h",
                                                        "bf16_round.h"))
FLAGS = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512bf16", "-fopenmp", "-fPIC", "-shared"]
CPU_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16")


@dataclass(frozen=True)
class Spec:
    """One library: what it is built from and for, and which CPU flags it needs to run."""

    prefix: str
    sources: tuple[Path, ...]
    headers: tuple[Path, ...]
    flags: tuple[str, ...]
    cpu_flags: tuple[str, ...]


BF16 = Spec("phasesplit_kernels", SOURCES, HEADERS, tuple(FLAGS), CPU_FLAGS)
# The quantized matmuls use 256-bit integer dot products (vpmaddubsw), which every x86-64 server
# CPU of the last decade has; F16C converts the blocks' fp16 scales.
# quant_x16.c, in both libraries that hold quant_gemm.c, is the AVX512-VNNI kernel for weights packed
# 16 rows to a tile; its functions are compiled for those instructions alone and only used where
# the library says the CPU has them (ps_qx16_supported).
QUANT = Spec("phasesplit_quant", (Path(__file__).with_name("quant_gemm.c"), Path(__file__).with_name("quant_x16.c")),
             (Path(__file__).with_name("quant_blocks.h"), Path(__file__).with_name("bf16_round.h")),
             ("-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-fPIC", "-shared"), ("avx2", "fma", "f16c"))
# bf16 weights with fp32 activations where AVX512-BF16 is missing (cpu_gemm_avx2.py): AVX2 + FMA.
# With it, that matmul and the quantized one (quant_gemm.c again: the helpers call its tiles)
# shared out to persistent helper threads for decode steps of a few rows (decode_helpers.c).
BF16W = Spec("phasesplit_bf16w", (Path(__file__).with_name("gemm_bf16w_avx2.c"),
                                  Path(__file__).with_name("quant_gemm.c"),
                                  Path(__file__).with_name("quant_x16.c"),
                                  Path(__file__).with_name("decode_helpers.c"),
                                  # a layer's other fp32 ops (cpu_layer_f32.py), and the whole decode
                                  # step over them and the matmuls in one call (cpu_decode_step.py)
                                  Path(__file__).with_name("layer_f32_avx2.c"),
                                  Path(__file__).with_name("decode_step_f32.c")),
             tuple(Path(__file__).with_name(f) for f in ("decode_step.h", "quant_blocks.h", "attention_args.h",
                                                                "bf16_round.h")),
             ("-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-pthread", "-fPIC", "-shared"), ("avx2", "fma", "f16c"))


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


def cpu_supported(cpuinfo: str, spec: Spec = BF16) -> bool:
    """Whether a /proc/cpuinfo's flags list every instruction set a library is built for."""
    # Imported here: the image's kernel stage runs this file alone, without the package.
    from phasesplit.runtime import cpu_info

    flags = cpu_info.flags(cpuinfo)
    return bool(flags) and all(f in flags for f in spec.cpu_flags)


def _cache_dir() -> Path:
    from phasesplit.runtime.model.files import cache_root

    return cache_root() / "kernels"


def _compiler() -> str | None:
    for cc in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if cc and shutil.which(cc):
            return cc
    return None


def library_name(spec: Spec = BF16) -> str:
    """The library's file name: a hash of the sources and flags, so an edit never loads a stale build."""
    digest = hashlib.sha256(" ".join(spec.flags).encode())
    for src in spec.sources + spec.headers:
        digest.update(src.read_bytes())
    return f"{spec.prefix}-{digest.hexdigest()[:16]}.so"


def build(cc: str, out_dir: Path, spec: Spec = BF16) -> Path:
    """Compile a library (once per sources and flags) and return its path."""
    lib = out_dir / library_name(spec)
    if lib.exists():
        return lib
    out_dir.mkdir(parents=True, exist_ok=True)
    # Built under a temporary name and renamed: concurrent starts never load a half-written file.
    fd, tmp = tempfile.mkstemp(dir=out_dir, suffix=".so.tmp")
    os.close(fd)
    try:
        proc = subprocess.run([cc, *spec.flags, *map(str, spec.sources), "-o", tmp], capture_output=True,
                              text=True, timeout=300)
        if proc.returncode != 0:
            raise KernelUnavailable(f"{cc} failed to build {spec.prefix}: {proc.stderr.strip()[-600:]}")
        # mkstemp makes the file 0600: a library prebuilt into an image as root would then be
        # unreadable to the pod's own user, and every CPU pod would run without its kernels.
        os.chmod(tmp, 0o755)
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
        log.info("bf16 CPU kernels (AVX512-BF16) not used: %s", e)
        return None


@cache
def quant_library() -> ctypes.CDLL | None:
    """The quantized-weight matmuls (cpu_quant.py), or None where they cannot be used here (the
    reason is logged once; callers then dequantize the weights at load)."""
    from phasesplit.runtime.kernels import cpu_quant

    return _checked(QUANT, cpu_quant, "quantized CPU kernels")


@cache
def bf16w_library() -> ctypes.CDLL | None:
    """The bf16-weight fp32 matmul for AVX2 CPUs (cpu_gemm_avx2.py), or None where it cannot be
    used here (the reason is logged once; the weights then stay fp32)."""
    from phasesplit.runtime.kernels import cpu_gemm_avx2

    return _checked(BF16W, cpu_gemm_avx2, "bf16-weight AVX2 kernel")


@cache
def layer_f32_library() -> ctypes.CDLL | None:
    """The fp32 RMSNorm, RoPE + K/V write, decode attention and SwiGLU for AVX2 CPUs
    (cpu_layer_f32.py), or None where they cannot be used here (the reason is logged once; torch's
    ops then run). They are built into bf16w_library()'s file, so the one-call decode step runs
    the very code the layer-by-layer forward does."""
    from phasesplit.runtime.kernels import cpu_layer_f32

    lib = bf16w_library()
    if lib is None:
        return None
    try:  # declared with the library (cpu_gemm_avx2.declare)
        cpu_layer_f32.self_check(lib)
    except KernelUnavailable as e:
        log.info("fp32 layer kernels for AVX2 not used: %s", e)
        return None
    return lib


def _checked(spec: Spec, kernel, what: str) -> ctypes.CDLL | None:
    """A one-kernel library opened, declared and checked against torch; None (logged) if not usable."""
    try:
        lib = _open(spec)
        kernel.declare(lib)
        kernel.self_check(lib)
        return lib
    except (KernelUnavailable, OSError, subprocess.SubprocessError) as e:
        log.info("%s not used: %s", what, e)
        return None


def _load() -> ctypes.CDLL:
    from phasesplit.runtime.kernels import cpu_argmax, cpu_attention, cpu_gemm, cpu_norm, cpu_rope

    lib = _open(BF16)
    for kernel in (cpu_gemm, cpu_attention, cpu_norm, cpu_rope, cpu_argmax):
        kernel.declare(lib)
        kernel.self_check(lib)
    return lib


def _open(spec: Spec) -> ctypes.CDLL:
    """Find (prebuilt or cached) or build a library for this CPU and open it; no checks yet."""
    if os.environ.get("PHASESPLIT_CPU_KERNELS", "1") == "0":
        raise KernelUnavailable("PHASESPLIT_CPU_KERNELS=0")
    if platform.system() != "Linux" or platform.machine() != "x86_64":
        raise KernelUnavailable(f"not an x86-64 Linux machine ({platform.system()} {platform.machine()})")
    from phasesplit.runtime import cpu_info

    if not cpu_supported(cpu_info.read(), spec):
        raise KernelUnavailable(f"the CPU lacks one of {', '.join(spec.cpu_flags)}")
    prebuilt = Path(os.environ.get("PHASESPLIT_KERNELS_DIR") or _cache_dir()) / library_name(spec)
    if prebuilt.exists():
        path = prebuilt
    else:
        cc = _compiler()
        if cc is None:
            raise KernelUnavailable(f"no C compiler (cc, gcc or clang) on PATH and no {prebuilt}")
        path = build(cc, _cache_dir(), spec)
    # torch is imported first, so the library's libgomp.so.1 resolves to the one torch loaded:
    # one OpenMP thread pool for both, not two pools fighting over the same cores.
    return ctypes.CDLL(str(path))


def main(argv: list[str] | None = None) -> int:
    """Prebuild the libraries into a folder (for images without a compiler)."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m phasesplit.runtime.kernels.build", description=main.__doc__)
    ap.add_argument("dir", type=Path)
    args = ap.parse_args(argv)
    cc = _compiler()
    if cc is None:
        print("no C compiler (cc, gcc or clang) on PATH", flush=True)
        return 1
    try:
        for spec in (BF16, QUANT, BF16W):
            print(build(cc, args.dir, spec))
    except KernelUnavailable as e:
        print(e)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
