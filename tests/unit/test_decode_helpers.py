"""The bf16-weight and quantized (GGUF block) matmuls shared by the caller and persistent helper
threads (decode_helpers.c) against the one-thread kernels, bit for bit: idle, and while another
process spins on a CPU."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

import pytest
import torch

from phasesplit.runtime.kernels import build, cpu_gemm_avx2, cpu_quant
from tests.kernels import built_or_skip

NO_KERNEL = "this CPU lacks AVX2 or FMA, or no C compiler is on PATH: the bf16-weight AVX2 kernel cannot be built here"
ONE_CPU = "only one CPU is allowed here: a helper thread would share it with the caller"


@pytest.fixture(scope="module")
def lib():
    lib = built_or_skip(build.bf16w_library(), build.BF16W, "bf16-weight kernel", NO_KERNEL)
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip(ONE_CPU)
    assert cpu_gemm_avx2.start_helpers(lib, 1, pin=True) >= 1  # as the runner starts them
    was = cpu_gemm_avx2.use_helpers(lib, True)
    yield lib
    cpu_gemm_avx2.use_helpers(lib, was)


def _case(m: int, n: int, k: int, residual: bool, act: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * k**-0.5
    x = torch.randn(m, k, generator=g)
    cols = n // 2 if act == cpu_gemm_avx2.SWIGLU else n
    res = torch.randn(m, cols, generator=g) if residual else None
    return x, cpu_gemm_avx2.pack(w, swiglu=act == cpu_gemm_avx2.SWIGLU), res


def _one_thread(lib, x, packed, n, res, act) -> torch.Tensor:
    with build.num_threads(1):
        return cpu_gemm_avx2.matmul(lib.ps_gemm_bf16w_f32, x, packed, n, res, act)  # no `shared`: one thread


def _shared(lib, x, packed, n, res, act) -> torch.Tensor:
    with build.num_threads(1):
        return cpu_gemm_avx2.matmul(lib.ps_gemm_bf16w_f32, x, packed, n, res, act, shared=lib.ps_gemm_bf16w_f32_shared)


CASES = [(1, 576, 576, False, cpu_gemm_avx2.NONE), (2, 960, 576, True, cpu_gemm_avx2.NONE),
         (1, 4099, 64, False, cpu_gemm_avx2.NONE),  # a column tail in the last block
         (2, 33, 34, True, cpu_gemm_avx2.NONE), (1, 97, 2, False, cpu_gemm_avx2.NONE),
         (3, 1000, 130, True, cpu_gemm_avx2.NONE), (1, 3072, 576, False, cpu_gemm_avx2.SWIGLU),
         (2, 64, 34, True, cpu_gemm_avx2.SWIGLU), (1, 17, 66, True, cpu_gemm_avx2.NONE)]  # one block: caller alone


@pytest.mark.parametrize(("m", "n", "k", "residual", "act"), CASES)
def test_shared_matmul_gives_the_one_thread_kernels_bits(lib, m, n, k, residual, act) -> None:
    x, packed, res = _case(m, n, k, residual, act, seed=m * 7919 + n + k)
    want = _one_thread(lib, x, packed, n, res, act)
    for _ in range(30):  # the helper joins some calls late, some early: every split the same bits
        assert torch.equal(_shared(lib, x, packed, n, res, act), want)


def test_helpers_take_part(lib) -> None:
    """Without this the tests above could pass with the caller doing everything."""
    x, packed, res = _case(1, 8192, 576, True, cpu_gemm_avx2.NONE, seed=3)
    want = _one_thread(lib, x, packed, 8192, res, cpu_gemm_avx2.NONE)
    before = cpu_gemm_avx2.helper_stats(lib)[0]
    deadline = time.monotonic() + 10
    while cpu_gemm_avx2.helper_stats(lib)[0] == before and time.monotonic() < deadline:
        assert torch.equal(_shared(lib, x, packed, 8192, res, cpu_gemm_avx2.NONE), want)
    assert cpu_gemm_avx2.helper_stats(lib)[0] > before, "no chunk was computed by a helper in 10 s"


def test_switched_off_the_caller_computes_alone(lib) -> None:
    x, packed, res = _case(1, 4096, 64, False, cpu_gemm_avx2.NONE, seed=5)
    want = _one_thread(lib, x, packed, 4096, res, cpu_gemm_avx2.NONE)
    cpu_gemm_avx2.use_helpers(lib, False)
    try:
        before = cpu_gemm_avx2.helper_stats(lib)
        for _ in range(20):
            assert torch.equal(_shared(lib, x, packed, 4096, res, cpu_gemm_avx2.NONE), want)
        assert cpu_gemm_avx2.helper_stats(lib)[:2] == before[:2]
    finally:
        cpu_gemm_avx2.use_helpers(lib, True)


def test_same_bits_while_another_process_spins_on_a_cpu(lib) -> None:
    """A helper whose core a busy process shares is descheduled mid-chunk now and then; the caller
    then takes its chunk back (or waits for it): the result is the same bits every call."""
    cpus = sorted(os.sched_getaffinity(0))
    spinner = subprocess.Popen(["taskset", "-c", str(cpus[-1]), sys.executable, "-c", "while True: pass"]
                               if shutil.which("taskset") else [sys.executable, "-c", "while True: pass"])
    try:
        cases = [(_case(m, n, k, r, a, seed=11 + i), n, a) for i, (m, n, k, r, a) in enumerate(CASES[:3] + CASES[6:8])]
        wants = [_one_thread(lib, x, p, n, res, a) for (x, p, res), n, a in cases]
        deadline = time.monotonic() + 3
        calls = 0
        while time.monotonic() < deadline:
            for ((x, p, res), n, a), want in zip(cases, wants, strict=True):
                assert torch.equal(_shared(lib, x, p, n, res, a), want)
                calls += 1
        assert calls > len(cases)
    finally:
        spinner.kill()
        spinner.wait()


def test_two_threads_calling_at_once_get_their_own_bits(lib) -> None:
    """One job at a time: a call made while another thread's is running computes alone."""
    import threading

    cases = [_case(1, 4096, 576, True, cpu_gemm_avx2.NONE, seed=21), _case(2, 3072, 576, False, cpu_gemm_avx2.SWIGLU,
                                                                           seed=22)]
    ns = [4096, 3072]
    acts = [cpu_gemm_avx2.NONE, cpu_gemm_avx2.SWIGLU]
    wants = [_one_thread(lib, x, p, n, r, a) for (x, p, r), n, a in zip(cases, ns, acts, strict=True)]
    bad: list[int] = []

    def work(i: int) -> None:
        (x, p, r), n, a = cases[i], ns[i], acts[i]
        for _ in range(60):
            if not torch.equal(_shared(lib, x, p, n, r, a), wants[i]):
                bad.append(i)

    threads = [threading.Thread(target=work, args=(i,)) for i in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not bad


# GGUF block weights: (type, rows, cols, inner, residual). Tiles of 16 columns; a column tail; the
# one-tile case (the caller alone); a vocabulary-sized head.
QCASES = [(cpu_quant.Q8_0, 1, 576, 576, True), (cpu_quant.Q4_0, 2, 1000, 96, False),
          (cpu_quant.Q4_1, 3, 1536, 576, True), (cpu_quant.Q8_0, 4, 4099, 64, False),
          (cpu_quant.Q4_1, 1, 16, 64, True), (cpu_quant.Q8_0, 1, 49152, 576, False),
          (cpu_quant.Q4_1, 40, 960, 576, True)]  # a batched one-call step's rows (up to 64)


def _qcase(qtype: int, m: int, n: int, k: int, residual: bool, seed: int):
    g = torch.Generator().manual_seed(seed)
    blocks = cpu_quant.quantize(torch.randn(n, k, generator=g) * k**-0.5, qtype)
    return torch.randn(m, k, generator=g), blocks, torch.randn(m, n, generator=g) if residual else None


def _q_one_thread(lib, x, blocks, qtype, res) -> torch.Tensor:
    with build.num_threads(1):
        return cpu_quant.matmul(lib, x, blocks, qtype, res)  # no `shared`: ps_qgemm on one thread


def _q_shared(lib, x, blocks, qtype, res) -> torch.Tensor:
    with build.num_threads(1):
        return cpu_quant.matmul(lib, x, blocks, qtype, res, shared=lib.ps_qgemm_shared)


# The same with weights packed 16 rows to a tile (quant_x16.c), where this CPU runs that kernel.
X16CASES = [(cpu_quant.Q8_0 + cpu_quant.X16, 1, 576, 576, True), (cpu_quant.Q4_0 + cpu_quant.X16, 2, 992, 96, False),
            (cpu_quant.Q4_1 + cpu_quant.X16, 3, 1536, 576, True), (cpu_quant.Q4_1 + cpu_quant.X16, 1, 16, 64, True),
            (cpu_quant.Q8_0 + cpu_quant.X16, 1, 49152, 576, False),
            (cpu_quant.Q8_0 + cpu_quant.X16, 33, 960, 576, True)]


@pytest.mark.parametrize(("qtype", "m", "n", "k", "residual"), QCASES + X16CASES)
def test_shared_quantized_matmul_gives_the_one_thread_kernels_bits(lib, qtype, m, n, k, residual) -> None:
    if qtype > cpu_quant.X16 and not lib.ps_qx16_supported():
        pytest.skip("this CPU lacks AVX512-VNNI: weights are never packed for quant_x16.c's kernel here")
    x, blocks, res = _qcase(cpu_quant.base_type(qtype), m, n, k, residual, seed=qtype * 31 + m * 7919 + n + k)
    if qtype > cpu_quant.X16:
        blocks = cpu_quant.pack_x16(blocks, cpu_quant.base_type(qtype))
    want = _q_one_thread(lib, x, blocks, qtype, res)
    for _ in range(20):
        assert torch.equal(_q_shared(lib, x, blocks, qtype, res), want)


def test_helpers_take_part_in_quantized_matmuls(lib) -> None:
    x, blocks, res = _qcase(cpu_quant.Q8_0, 1, 8192, 576, True, seed=4)
    want = _q_one_thread(lib, x, blocks, cpu_quant.Q8_0, res)
    before = cpu_gemm_avx2.helper_stats(lib)[0]
    deadline = time.monotonic() + 10
    while cpu_gemm_avx2.helper_stats(lib)[0] == before and time.monotonic() < deadline:
        assert torch.equal(_q_shared(lib, x, blocks, cpu_quant.Q8_0, res), want)
    assert cpu_gemm_avx2.helper_stats(lib)[0] > before, "no tile was computed by a helper in 10 s"


def test_jobs_of_both_kinds_in_turn_and_beside_a_spinner(lib) -> None:
    """A decode step of a model with some projections in GGUF blocks and others in bf16 alternates
    the two kinds of job; a helper late from one kind must never mix it into the next. Beside a
    spinning process, so that helpers are descheduled mid-claim now and then."""
    cpus = sorted(os.sched_getaffinity(0))
    spinner = subprocess.Popen(["taskset", "-c", str(cpus[-1]), sys.executable, "-c", "while True: pass"]
                               if shutil.which("taskset") else [sys.executable, "-c", "while True: pass"])
    try:
        bf = [_case(1, 1536, 576, True, cpu_gemm_avx2.NONE, seed=41), _case(2, 3072, 576, False, cpu_gemm_avx2.SWIGLU,
                                                                           seed=42)]
        bf_want = [_one_thread(lib, x, p, n, r, a) for (x, p, r), n, a in zip(bf, (1536, 3072),
                                                                              (cpu_gemm_avx2.NONE, cpu_gemm_avx2.SWIGLU),
                                                                              strict=True)]
        q = [_qcase(cpu_quant.Q8_0, 1, 960, 576, True, seed=43), _qcase(cpu_quant.Q4_1, 2, 576, 1536, False, seed=44)]
        q_want = [_q_one_thread(lib, x, b, t, r) for (x, b, r), t in zip(q, (cpu_quant.Q8_0, cpu_quant.Q4_1),
                                                                         strict=True)]
        deadline = time.monotonic() + 3
        rounds = 0
        while time.monotonic() < deadline:
            for i in (0, 1):
                (x, p, r), n, a = bf[i], (1536, 3072)[i], (cpu_gemm_avx2.NONE, cpu_gemm_avx2.SWIGLU)[i]
                assert torch.equal(_shared(lib, x, p, n, r, a), bf_want[i])
                (x, b, r), t = q[i], (cpu_quant.Q8_0, cpu_quant.Q4_1)[i]
                assert torch.equal(_q_shared(lib, x, b, t, r), q_want[i])
            rounds += 1
        assert rounds > 1
    finally:
        spinner.kill()
        spinner.wait()


NO_BF16 = "this CPU lacks AVX512-BF16 (or no C compiler is on PATH): the bf16 kernels of gemm_bf16.c do not run here"
# AVX512-BF16 kernel (gemm_bf16.c, another library, handed over by address): (rows, cols, inner,
# residual, act, fp32 out).
BCASES = [(1, 576, 576, False, cpu_gemm_avx2.NONE, False), (2, 960, 576, True, cpu_gemm_avx2.NONE, True),
          (1, 4099, 64, True, cpu_gemm_avx2.NONE, False),  # a column tail in the last block
          (1, 3072, 576, False, cpu_gemm_avx2.SWIGLU, False), (2, 1536, 96, True, cpu_gemm_avx2.SWIGLU, True),
          (1, 49152, 576, False, cpu_gemm_avx2.NONE, True),  # a vocabulary-sized head, fp32 logits
          (1, 17, 66, True, cpu_gemm_avx2.NONE, False),  # one block: the caller alone
          (64, 960, 576, True, cpu_gemm_avx2.NONE, False),  # a batched one-call step's rows (up to 64)
          (24, 3072, 576, False, cpu_gemm_avx2.SWIGLU, False)]


@pytest.fixture(scope="module")
def native(lib):
    from phasesplit.runtime.kernels import cpu_gemm

    native = build.library()
    if native is None:
        pytest.skip(NO_BF16)
    return native, cpu_gemm, cpu_gemm.shared_call(native)


def _bcase(cpu_gemm, m, n, k, residual, act, f32, seed):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=g) * k**-0.5).bfloat16()
    x = torch.randn(m, k, generator=g).bfloat16()
    cols = n // 2 if act == cpu_gemm.SWIGLU else n
    res = torch.randn(m, cols, generator=g).bfloat16() if residual else None
    packed = cpu_gemm.pack_swiglu(w) if act == cpu_gemm.SWIGLU else cpu_gemm.pack(w)
    return x, packed, res, torch.float32 if f32 else torch.bfloat16


def _b(native, shared, x, packed, n, res, out_dtype, act) -> torch.Tensor:
    lib, cpu_gemm, call = native
    with build.num_threads(1):
        return cpu_gemm.matmul(lib.ps_gemm_bf16, x, packed, n, res, out_dtype, act, shared=call if shared else None)


@pytest.mark.parametrize(("m", "n", "k", "residual", "act", "f32"), BCASES)
def test_shared_bf16_matmul_gives_the_one_thread_kernels_bits(native, m, n, k, residual, act, f32) -> None:
    x, packed, res, out_dtype = _bcase(native[1], m, n, k, residual, act, f32, seed=m * 7919 + n + k + f32)
    want = _b(native, False, x, packed, n, res, out_dtype, act)
    for _ in range(20):
        assert torch.equal(_b(native, True, x, packed, n, res, out_dtype, act), want)


def test_helpers_take_part_in_bf16_matmuls_and_every_kind_in_turn(lib, native) -> None:
    """A helper computes some of the AVX512-BF16 kernel's blocks; calls of the three kinds in turn
    (a late helper must never carry one kind's job into the next) keep their bits."""
    x, packed, res, out_dtype = _bcase(native[1], 1, 8192, 576, True, cpu_gemm_avx2.NONE, False, seed=51)
    want = _b(native, False, x, packed, 8192, res, out_dtype, cpu_gemm_avx2.NONE)
    before = cpu_gemm_avx2.helper_stats(lib)[0]
    deadline = time.monotonic() + 10
    while cpu_gemm_avx2.helper_stats(lib)[0] == before and time.monotonic() < deadline:
        assert torch.equal(_b(native, True, x, packed, 8192, res, out_dtype, cpu_gemm_avx2.NONE), want)
    assert cpu_gemm_avx2.helper_stats(lib)[0] > before, "no block was computed by a helper in 10 s"
    xf, pf, rf = _case(1, 1536, 576, True, cpu_gemm_avx2.NONE, seed=52)
    f_want = _one_thread(lib, xf, pf, 1536, rf, cpu_gemm_avx2.NONE)
    xq, bq, rq = _qcase(cpu_quant.Q8_0, 1, 960, 576, True, seed=53)
    q_want = _q_one_thread(lib, xq, bq, cpu_quant.Q8_0, rq)
    for _ in range(50):
        assert torch.equal(_b(native, True, x, packed, 8192, res, out_dtype, cpu_gemm_avx2.NONE), want)
        assert torch.equal(_shared(lib, xf, pf, 1536, rf, cpu_gemm_avx2.NONE), f_want)
        assert torch.equal(_q_shared(lib, xq, bq, cpu_quant.Q8_0, rq), q_want)


def _attention_case(n: int, heads: int, kv_heads: int, dim: int, ctx: int, seed: int):
    """q as rows of a qkv projection (strided), bf16 caches of scattered 16-token blocks."""
    g = torch.Generator().manual_seed(seed)
    block, per_seq = 16, -(-ctx // 16)
    slots = n * per_seq + 4
    k_cache = torch.randn(slots * block, kv_heads, dim, generator=g).bfloat16()
    v_cache = torch.randn(slots * block, kv_heads, dim, generator=g).bfloat16()
    tables = torch.randperm(slots, generator=g)[: n * per_seq].view(n, per_seq).contiguous()
    lens = torch.randint(1, ctx + 1, (n,), generator=g)
    qkv = torch.randn(n, heads + 2 * kv_heads, dim, generator=g).bfloat16()
    per = (heads // kv_heads) * ctx
    args = (qkv.data_ptr(), qkv.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(), per_seq,
            lens.data_ptr())
    tail = (n, heads, kv_heads, dim, block, dim**-0.5)
    return (qkv, k_cache, v_cache, tables, lens), args, tail, per


@pytest.mark.parametrize(("n", "heads", "kv_heads", "dim", "ctx"),
                         [(1, 9, 3, 64, 300), (20, 9, 3, 64, 200), (64, 9, 3, 64, 40), (3, 8, 8, 128, 90),
                          (5, 16, 2, 64, 33)])
def test_shared_bf16_decode_attention_gives_one_threads_bits(lib, native, n, heads, kv_heads, dim, ctx) -> None:
    """The AVX512-BF16 decode attention's (sequence, KV head) tasks shared with the helpers (as the
    one-call step shares them) against the kernel on one thread, bit for bit; the helpers take
    part in some calls."""
    import ctypes

    keep, args, tail, per = _attention_case(n, heads, kv_heads, dim, ctx, seed=n * 31 + heads + dim)
    nat = native[0]
    scratch = torch.empty(per)
    want = torch.empty(n, heads, dim, dtype=torch.bfloat16)
    assert nat.ps_decode_attention_bf16(*args, want.data_ptr(), *tail, scratch.data_ptr(), per, 1) == 0
    tasks = ctypes.cast(nat.ps_attention_tasks_bf16, ctypes.c_void_p).value
    before = cpu_gemm_avx2.helper_stats(lib)[0]
    for _ in range(40):
        got = torch.full((n, heads, dim), float("nan"), dtype=torch.bfloat16)
        rc = lib.ps_decode_attention_bf16_shared(tasks, *args, got.data_ptr(), *tail, scratch.data_ptr(), per)
        assert rc == 0 and torch.equal(got, want)
    if n * kv_heads >= 8:
        assert cpu_gemm_avx2.helper_stats(lib)[0] > before, "no attention task was computed by a helper"
