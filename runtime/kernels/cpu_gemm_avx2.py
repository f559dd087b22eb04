"""fp32 matmuls with bf16 weights on AVX2 CPUs without AVX512-BF16 (gemm_bf16w_avx2.c).

There torch runs the model in fp32 (its bf16 is emulated), and a decode step streams 4 bytes per
weight. This keeps each projection's weight once, in bf16, laid out as cpu_gemm.pack lays it, and
widens it to fp32 in registers inside the matmul: half the bytes per step, activations and sums
fp32. Used by `dtype=auto` on such CPUs (model_runner.py); `--dtype float32` keeps fp32 weights.

Measured here (tests/bench/bf16_weights.py, one core, SmolLM2-135M's projections x 30 layers,
weights from memory; docs/benchmarks.md): 2.35x torch's fp32 matmul at 1 and 4 rows, 1.3x at 32;
at 512 rows 0.79x (a scratch run of an earlier variant: 1.3x; prefill is compute-bound there), and engine
prefill of a 512-token prompt equal within noise (173 vs 176 tok/s). Prefill uses the kernel too:
no second, widened fp32 copy is kept.
"""

from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F

from phasesplit.runtime.kernels import build, cpu_gemm
from phasesplit.runtime.kernels.build import KernelUnavailable

NONE, SWIGLU = cpu_gemm.NONE, cpu_gemm.SWIGLU


def declare(lib: ctypes.CDLL) -> None:
    fn = lib.ps_gemm_bf16w_f32
    fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_long] * 3 + [ctypes.c_int] * 2
    fn.restype = ctypes.c_int
    shared = lib.ps_gemm_bf16w_f32_shared
    shared.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_long] * 3 + [ctypes.c_int]
    shared.restype = ctypes.c_int
    lib.ps_helpers_start.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
    lib.ps_helpers_start.restype = ctypes.c_int
    lib.ps_helpers_borrow.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_long]
    lib.ps_helpers_borrow.restype = ctypes.c_int
    lib.ps_helpers_use.argtypes = [ctypes.c_int]
    lib.ps_helpers_use.restype = ctypes.c_int
    lib.ps_helpers_count.restype = ctypes.c_int
    lib.ps_helpers_stats.argtypes = [ctypes.c_void_p]
    lib.ps_helpers_stats.restype = None
    # The quantized matmul (quant_gemm.c, built in here too) and its call shared with the helpers.
    lib.ps_qgemm.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_long] * 4 + [ctypes.c_int] * 2
    lib.ps_qgemm.restype = ctypes.c_int
    lib.ps_qgemm_shared.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_long] * 4 + [ctypes.c_int]
    lib.ps_qgemm_shared.restype = ctypes.c_int
    lib.ps_qx16_supported.argtypes = []
    lib.ps_qx16_supported.restype = ctypes.c_int
    # The AVX512-BF16 matmul (another library, gemm_bf16.c) shared with the helpers: its blocks'
    # function by address (cpu_gemm.shared_call).
    lib.ps_bf16_shared.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_long] * 3 + [ctypes.c_int] * 2
    lib.ps_bf16_shared.restype = ctypes.c_int
    # The fp32 decode attention (layer_f32_avx2.c, built in here too) with its tasks shared:
    # ps_decode_attention_f32's arguments less `threads`.
    from phasesplit.runtime.kernels import cpu_layer_f32

    cpu_layer_f32.declare(lib)
    p, n = ctypes.c_void_p, ctypes.c_long
    lib.ps_decode_attention_f32_shared.argtypes = [p, n, p, p, p, n, p, p] + [n] * 5 + [ctypes.c_float, p, n]
    lib.ps_decode_attention_f32_shared.restype = ctypes.c_int
    # The AVX512-BF16 decode attention (decode_attention_bf16.c, in the other library) with its
    # tasks shared: that library's ps_attention_tasks_bf16 by address, then ps_decode_attention_bf16's
    # arguments less `threads`.
    lib.ps_decode_attention_bf16_shared.argtypes = [p, p, n, p, p, p, n, p, p] + [n] * 5 + [ctypes.c_float, p, n]
    lib.ps_decode_attention_bf16_shared.restype = ctypes.c_int


def pack(weight: torch.Tensor, swiglu: bool = False) -> torch.Tensor:
    """[N, K] float -> bf16 (round to nearest even) in cpu_gemm's layout; swiglu: gate and up
    tiles alternating (cpu_gemm.pack_swiglu)."""
    w = weight.detach().bfloat16()
    return cpu_gemm.pack_swiglu(w) if swiglu else cpu_gemm.pack(w)


def matmul(fn: ctypes._CFuncPtr, x: torch.Tensor, packed: torch.Tensor, n: int,
           residual: torch.Tensor | None = None, act: int = NONE, shared: ctypes._CFuncPtr | None = None
           ) -> torch.Tensor:
    """x [M, K] fp32 @ W^T (+ residual [M, N] fp32) with W packed by `pack`; out [M, N] fp32.
    act=SWIGLU: W packed with swiglu=True and n = 2I rows; out [M, I] = silu(gate) * up.
    `shared` (the library's ps_gemm_bf16w_f32_shared): when torch runs one thread (the runner's
    decode steps of a few sequences), the call is shared with the decode helpers, if started
    (`start_helpers`); the same bits either way."""
    x = x.float().contiguous()  # both no-ops for a contiguous fp32 tensor
    m, k = x.shape
    if residual is not None:
        residual = residual.float().contiguous()
    out = torch.empty(m, n // 2 if act == SWIGLU else n, dtype=torch.float32)
    res = None if residual is None else residual.data_ptr()
    threads = torch.get_num_threads()
    if shared is not None and threads == 1:
        rc = shared(x.data_ptr(), packed.data_ptr(), res, out.data_ptr(), m, n, k, act)
    else:
        rc = fn(x.data_ptr(), packed.data_ptr(), res, out.data_ptr(), m, n, k, threads, act)
    if rc != 0:
        raise KernelUnavailable(f"bf16-weight matmul rejected its arguments (rows {m}, cols {n}, inner {k}, "
                                f"act {act})")
    return out


def self_check(lib: ctypes.CDLL) -> None:
    """Compare with F.linear on the bf16-rounded weight: odd shapes (column tails, 1-9 rows: the
    row pairs and a single last row, an odd pair count), a residual, SwiGLU, 1 and 2 threads."""
    fn = lib.ps_gemm_bf16w_f32
    g = torch.Generator().manual_seed(0)
    cases = ((1, 37, 64, False, NONE), (5, 40, 34, True, NONE), (9, 16, 128, False, NONE),
             (3, 50, 98, True, NONE), (2, 64, 40, False, SWIGLU), (7, 96, 66, True, SWIGLU))
    for m, n, k, with_res, act in cases:
        w = torch.randn(n, k, generator=g)
        x = torch.randn(m, k, generator=g)
        r = torch.randn(m, n // 2 if act == SWIGLU else n, generator=g) if with_res else None
        want = F.linear(x, w.bfloat16().float())
        if act == SWIGLU:
            gate, up = want.chunk(2, dim=-1)
            want = F.silu(gate) * up
        if r is not None:
            want = want + r
        packed = pack(w, swiglu=act == SWIGLU)  # held here: the call reads it
        for threads in (1, 2):
            out = torch.empty_like(want)
            rc = fn(x.data_ptr(), packed.data_ptr(), None if r is None else r.data_ptr(), out.data_ptr(),
                    m, n, k, threads, act)
            err = (out - want).abs().max().item()
            # Only the summation order differs: fp32 rounding over k terms.
            if rc != 0 or not err <= 1e-4 * (1 + want.abs().max().item()):
                raise KernelUnavailable(f"bf16-weight matmul self-check failed (rows {m}, cols {n}, inner {k}, "
                                        f"act {act}, {threads} threads: code {rc}, "
                                        f"max error {err:.3g})")
    check_shared(lib, rounds=1)  # no helpers yet: its entry point on the caller alone


def start_helpers(lib: ctypes.CDLL, n: int, pin: bool = False, spin_us: int = -1, steal_us: int = -1) -> int:
    """Start the process's decode helpers (decode_helpers.c) until n run, and share one-thread
    calls of `matmul(shared=...)` with them; checked bit for bit against the one-thread kernel
    first (on failure they are switched off and KernelUnavailable raised). pin: each new helper
    pinned to a CPU other than the caller's now. spin_us / steal_us:
    a helper's spin before it sleeps, the caller's wait for a held chunk before it computes it
    itself (-1: the defaults). Returns how many helpers run; at most one pool per process."""
    got = lib.ps_helpers_start(n, int(pin), spin_us, steal_us)
    _use_checked(lib)
    return got


def borrow_helpers(lib: ctypes.CDLL, cpus: list[int], max_rows: int) -> int:
    """Start one helper per CPU of `cpus` (CPUs another worker owns), pinned there at idle
    priority (decode_helpers.c ps_helpers_borrow): it computes only while that CPU would idle.
    Calls of up to `max_rows` rows are shared, prefill chunks included. Checked bit for bit as
    start_helpers is. Returns how many helpers were pinned (the rest run unpinned, at idle
    priority all the same); at most one pool per process."""
    arr = (ctypes.c_int * len(cpus))(*cpus)
    placed = lib.ps_helpers_borrow(arr, len(cpus), max_rows)
    _use_checked(lib)
    return placed


def _use_checked(lib: ctypes.CDLL) -> None:
    """Switch the shared calls onto the helpers, checked bit for bit first; off again (and
    KernelUnavailable raised) if they differ."""
    lib.ps_helpers_use(1)
    try:
        check_shared(lib)
    except KernelUnavailable:
        lib.ps_helpers_use(0)
        raise


def use_helpers(lib: ctypes.CDLL, on: bool) -> bool:
    """Whether shared calls use the helpers (False: the caller alone; the threads stay, asleep);
    returns the previous setting."""
    return bool(lib.ps_helpers_use(int(on)))


def helper_stats(lib: ctypes.CDLL) -> tuple[int, int, float]:
    """(claims helpers computed and the caller used, claims the caller took back from a helper
    that held one too long, seconds the caller spent waiting for helpers) since the process
    started."""
    out = (ctypes.c_long * 3)()
    lib.ps_helpers_stats(out)
    return out[0], out[1], out[2] / 1e9


def check_shared(lib: ctypes.CDLL, rounds: int = 20) -> None:
    """The shared matmuls against the one-thread kernels, bit for bit: column tails, 1-3 rows, a
    residual, SwiGLU, each GGUF block type, and the AVX512-BF16 kernel where this CPU has it (bf16
    and fp32 outputs); repeated so that the helpers take part in some calls. 100 rows are shared
    only with helpers on borrowed CPUs (borrow_helpers: prefill chunks too)."""
    g = torch.Generator().manual_seed(1)
    for m, n, k, with_res, act in ((1, 1000, 64, True, NONE), (2, 97, 130, False, NONE),
                                   (3, 576, 96, True, NONE), (1, 384, 66, True, SWIGLU), (2, 1024, 34, False, SWIGLU),
                                   (40, 96, 64, True, NONE), (100, 192, 66, True, SWIGLU)):  # 100: prefill rows
        w = torch.randn(n, k, generator=g)
        x = torch.randn(m, k, generator=g)
        cols = n // 2 if act == SWIGLU else n
        r = torch.randn(m, cols, generator=g) if with_res else None
        packed = pack(w, swiglu=act == SWIGLU)
        want = torch.empty(m, cols)
        lib.ps_gemm_bf16w_f32(x.data_ptr(), packed.data_ptr(), None if r is None else r.data_ptr(),
                              want.data_ptr(), m, n, k, 1, act)
        for _ in range(rounds):
            got = torch.full((m, cols), float("nan"))
            rc = lib.ps_gemm_bf16w_f32_shared(x.data_ptr(), packed.data_ptr(), None if r is None else r.data_ptr(),
                                              got.data_ptr(), m, n, k, act)
            if rc != 0 or not torch.equal(got, want):
                raise KernelUnavailable(f"shared bf16-weight matmul differs from one thread's (rows {m}, cols {n}, "
                                        f"inner {k}, act {act}: code {rc})")
    from phasesplit.runtime.kernels import cpu_quant

    cases = [(cpu_quant.Q8_0, 1, 1000, 64, True), (cpu_quant.Q4_0, 2, 97, 96, False),
             (cpu_quant.Q4_1, 3, 576, 128, True), (cpu_quant.Q8_0, 4, 40, 32, False), (cpu_quant.Q4_1, 33, 64, 64, True)]
    if cpu_quant.x16_supported(lib):  # weights packed 16 rows to a tile (quant_x16.c), where they are used
        cases += [(cpu_quant.Q8_0 + cpu_quant.X16, 1, 1008, 64, True), (cpu_quant.Q4_1 + cpu_quant.X16, 3, 576, 128, True),
                  (cpu_quant.Q4_0 + cpu_quant.X16, 2, 96, 96, False)]
    for qtype, m, n, k, with_res in cases:
        blocks = cpu_quant.quantize(torch.randn(n, k, generator=g), cpu_quant.base_type(qtype))
        if qtype > cpu_quant.X16:
            blocks = cpu_quant.pack_x16(blocks, cpu_quant.base_type(qtype))
        x = torch.randn(m, k, generator=g)
        r = torch.randn(m, n, generator=g) if with_res else None
        res = None if r is None else r.data_ptr()
        want = torch.empty(m, n)
        lib.ps_qgemm(x.data_ptr(), blocks.data_ptr(), res, want.data_ptr(), m, n, k, blocks.stride(0), qtype, 1)
        for _ in range(rounds):
            got = torch.full((m, n), float("nan"))
            rc = lib.ps_qgemm_shared(x.data_ptr(), blocks.data_ptr(), res, got.data_ptr(), m, n, k,
                                     blocks.stride(0), qtype)
            if rc != 0 or not torch.equal(got, want):
                raise KernelUnavailable(f"shared quantized matmul differs from one thread's ({cpu_quant.name(qtype)}, "
                                        f"rows {m}, cols {n}, inner {k}: code {rc})")
    check_shared_attention(lib, g, rounds)
    native = build.library()  # the AVX512-BF16 kernels, where this CPU has them
    if native is None:
        return
    blocks_fn = ctypes.cast(native.ps_bf16_blocks, ctypes.c_void_p).value
    for m, n, k, with_res, act, f32 in ((1, 1000, 64, True, NONE, False), (2, 97, 130, False, NONE, True),
                                        (3, 576, 96, True, SWIGLU, False), (1, 384, 66, False, SWIGLU, True),
                                        (48, 160, 64, True, NONE, False)):
        w = torch.randn(n, k, generator=g).bfloat16()
        x = torch.randn(m, k, generator=g).bfloat16()
        cols = n // 2 if act == SWIGLU else n
        r = torch.randn(m, cols, generator=g).bfloat16() if with_res else None
        res = None if r is None else r.data_ptr()
        packed = cpu_gemm.pack_swiglu(w) if act == SWIGLU else cpu_gemm.pack(w)
        out_dtype = torch.float32 if f32 else torch.bfloat16
        want = torch.empty(m, cols, dtype=out_dtype)
        native.ps_gemm_bf16(x.data_ptr(), packed.data_ptr(), res, want.data_ptr(), m, n, k, f32, 1, act)
        for _ in range(rounds):
            got = torch.full((m, cols), float("nan"), dtype=out_dtype)
            rc = lib.ps_bf16_shared(blocks_fn, x.data_ptr(), packed.data_ptr(), res, got.data_ptr(), m, n, k, f32, act)
            if rc != 0 or not torch.equal(got, want):
                raise KernelUnavailable(f"shared AVX512-BF16 matmul differs from one thread's (rows {m}, cols {n}, "
                                        f"inner {k}, act {act}, fp32 out {f32}: code {rc})")


def check_shared_attention(lib: ctypes.CDLL, g: torch.Generator, rounds: int) -> None:
    """The shared decode attention against one thread's, bit for bit: 1-3 sequences of several
    blocks, grouped and plain heads, a strided q (a qkv row, as the decode step passes); fp32, and
    bf16 through the AVX512-BF16 kernel where this CPU has it."""
    native = build.library()
    dtypes = [torch.float32] + ([torch.bfloat16] if native is not None else [])
    for dtype in dtypes:
        for n, heads, kv_heads, dim, lens in ((1, 9, 3, 64, [40]), (3, 4, 4, 32, [5, 33, 17]),
                                              (2, 8, 2, 128, [70, 3])):
            block, blocks = 16, 12
            k_cache = torch.randn(blocks * block, kv_heads, dim, generator=g).to(dtype)
            v_cache = torch.randn(blocks * block, kv_heads, dim, generator=g).to(dtype)
            tables = torch.stack([torch.randperm(blocks, generator=g)[:6] for _ in lens])
            lens_t = torch.tensor(lens)
            qkv = torch.randn(n, heads + 2 * kv_heads, dim, generator=g).to(dtype)
            per = (heads // kv_heads) * max(lens)
            args = (qkv.data_ptr(), qkv.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(),
                    tables.shape[1], lens_t.data_ptr())
            want = torch.empty(n, heads, dim, dtype=dtype)
            scratch = torch.empty(per)
            tail = (n, heads, kv_heads, dim, block, dim**-0.5, scratch.data_ptr(), per)
            if dtype == torch.bfloat16:
                native.ps_decode_attention_bf16(*args, want.data_ptr(), *tail, 1)
                shared, first = (lib.ps_decode_attention_bf16_shared,
                                 (ctypes.cast(native.ps_attention_tasks_bf16, ctypes.c_void_p).value,))
            else:
                lib.ps_decode_attention_f32(*args, want.data_ptr(), *tail, 1)
                shared, first = lib.ps_decode_attention_f32_shared, ()
            for _ in range(rounds):
                got = torch.full((n, heads, dim), float("nan"), dtype=dtype)
                rc = shared(*first, *args, got.data_ptr(), *tail)
                if rc != 0 or not torch.equal(got, want):
                    raise KernelUnavailable(f"shared {str(dtype).removeprefix('torch.')} decode attention differs "
                                            f"from one thread's ({n} sequences, heads {heads}/{kv_heads}, dim {dim}: "
                                            f"code {rc})")
