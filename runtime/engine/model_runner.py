"""Owns the model weights and the KV cache tensor; turns a scheduled batch into one forward pass."""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from phasesplit.runtime import cpu_info
from phasesplit.runtime.engine.cpu_decode_step import MAX_ROWS as CPU_STEP_ROWS
from phasesplit.runtime.engine.cpu_decode_step import CpuDecodeStep
from phasesplit.runtime.engine.cuda_graphs import DecodeGraphs
from phasesplit.runtime.engine.scheduler import ScheduledBatch
from phasesplit.runtime.engine.sequence import Sequence
from phasesplit.runtime.engine.tensor_parallel import Ranks, all_reduce, init_group
from phasesplit.runtime.kernels import cpu_attention, cpu_quant, hugepages
from phasesplit.runtime.model import quantized
from phasesplit.runtime.model.attention import (
    DECODE_WIDTH_STEP,
    build_metadata,
    kernel_decode_available,
    read_rows,
    write_rows,
)
from phasesplit.runtime.model.config import ModelConfig
from phasesplit.runtime.model.files import ModelFiles, read_config
from phasesplit.runtime.model.llama import LlamaModel, rope_inv_freq
from phasesplit.runtime.model.loader import load_weights
from phasesplit.runtime.model.sharding import kv_owners, plan

log = logging.getLogger(__name__)

# On CPU, memory is shared with everything else on the node; unless asked, do not take more than
# this for the cache: 1 GiB holds ~46k bf16 tokens of SmolLM2, and zeroing a bigger cache adds
# seconds to every start (scale-up speed). vLLM's CPU backend takes a fixed 4 GiB.
CPU_DEFAULT_KV_CAP = 1 << 30

# Decode-only steps of at most this many sequences run single-threaded under sleeping OpenMP waits
# (torch ops; with the CPU kernels, whose matmuls use the second core better: KERNEL_...).
SMALL_DECODE_BATCH = 4
KERNEL_SMALL_DECODE_BATCH = 2
# ... and on the native bf16 path's one-call step with the decode helpers running, every step it
# takes: its matmuls and attention are shared with the helpers, whose spin-then-sleep waits and
# take-back of a late helper's work beat OpenMP's regions at every batch measured here, idle and
# beside a busy neighbour (docs/benchmarks.md, "Decode steps on the helpers").

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class RunnerConfig:
    device: str = "auto"
    dtype: str = "auto"
    block_size: int = 16
    kv_cache_memory: int | None = None  # bytes; None: kv_cache_fraction of free memory
    kv_cache_fraction: float = 0.3
    max_model_len: int | None = None
    threads: int | None = None  # per tensor-parallel rank; None: the allowed CPUs / ranks
    tensor_parallel_size: int = 1
    quantization: str = "none"  # none: dequantize at load; auto/q8_0/q4_0/q4_1: GGUF blocks (quantized.py)
    # CPUs of other workers on this machine whose idle time this one-thread worker may use: one
    # idle-priority helper each for its matmuls, prefill included (_start_decode_helpers).
    borrow_cpus: tuple[int, ...] = ()


@dataclass
class LayerStream:
    """K/V a step streams out as each layer finishes (split prefill): positions [lo, hi) of each
    listed sequence. `send(layer, kvs)` gets them once layer's K/V are in the cache, one
    [2, tokens, kv_heads, head_dim] CPU tensor per read with all of the model's KV heads (under
    tensor parallelism gathered from the ranks that hold them)."""

    reads: list[tuple[Sequence, int, int]]
    send: Callable[[int, list[torch.Tensor]], None]


def pick_device(name: str, rank: int = 0, tp: int = 1) -> torch.device:
    """The device of a (tensor-parallel) rank: under TP on CUDA, rank r takes GPU r of the pod."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda was asked for but torch sees no CUDA device")
    if name == "cuda" and tp > 1:
        if torch.cuda.device_count() < tp:
            raise RuntimeError(f"--tensor-parallel-size {tp} needs {tp} GPUs; torch sees {torch.cuda.device_count()}")
        torch.cuda.set_device(rank)
        return torch.device("cuda", rank)
    return torch.device(name)


def pick_dtype(name: str, device: torch.device) -> torch.dtype:
    if name != "auto":
        return DTYPES[name]
    if device.type == "cuda":
        return torch.bfloat16
    # On CPUs with native bf16 dot products (AVX512-BF16/AMX) bf16 measured faster here than
    # fp32 (half the bytes per decode step); elsewhere bf16 is emulated and fp32 wins (with the
    # projections' weights still kept in bf16 where the AVX2 kernel runs: see _build).
    return torch.bfloat16 if _cpu_has_bf16() else torch.float32


def _cpu_has_bf16() -> bool:
    # PHASESPLIT_NATIVE_BF16=0 serves as a CPU without native bf16 would (fp32 activations, bf16
    # weights through the AVX2 kernels): to compare the two paths, or test the older one, here.
    if os.environ.get("PHASESPLIT_NATIVE_BF16") == "0":
        return False
    flags = cpu_info.flags()
    return "avx512_bf16" in flags or "amx_bf16" in flags


def cpu_threads() -> int | None:
    """CPUs this process may really use: its affinity mask, capped by a cgroup CPU quota.

    In a pod with `limits.cpu: 2` on a 64-core node the affinity mask still lists 64 CPUs; 64
    OpenMP threads sharing two CPUs' worth of quota wait on each other at every op and get
    throttled by CFS.
    """
    if not hasattr(os, "sched_getaffinity"):
        return None
    n = len(os.sched_getaffinity(0))
    quota = _cgroup_cpu_quota()
    return max(1, min(n, math.ceil(quota))) if quota else n


def _cgroup_cpu_quota(root: str = "/sys/fs/cgroup") -> float | None:
    try:  # cgroup v2: "max 100000" or "<quota> <period>"
        with open(f"{root}/cpu.max") as f:
            quota, period = f.read().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:  # cgroup v1
        with open(f"{root}/cpu/cpu.cfs_quota_us") as f:
            quota_us = int(f.read())
        with open(f"{root}/cpu/cpu.cfs_period_us") as f:
            period_us = int(f.read())
        return None if quota_us <= 0 else quota_us / period_us
    except (OSError, ValueError):
        return None


def available_memory(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 4 << 30


class ModelRunner:
    """One rank's model and KV cache. Under tensor parallelism (rc.tensor_parallel_size > 1)
    rank 0 is the one the engine uses: it starts the other ranks (tensor_parallel.py), which
    build their own ModelRunner with `rank` and `control` (their pipe from rank 0) and then run
    what rank 0 sends them (`handle`)."""

    def __init__(self, files: ModelFiles, rc: RunnerConfig, rank: int = 0, control=None,
                 init_method: str | None = None) -> None:
        t0 = time.perf_counter()
        tp = rc.tensor_parallel_size
        self.rank, self.tp_size = rank, tp
        self.borrow_cpus = tuple(rc.borrow_cpus)
        threads = rc.threads or cpu_threads()
        if threads and not rc.threads and tp > 1:  # the ranks share the allowed CPUs
            threads = max(1, threads // tp)
        if threads:
            torch.set_num_threads(threads)
        self.device = pick_device(rc.device, rank, tp)
        self.dtype = pick_dtype(rc.dtype, self.device)
        self.cfg: ModelConfig = read_config(files)
        self.shards = plan(self.cfg, tp)  # raises ShardingError for a size the model cannot take
        self.shard = self.shards[rank]
        self.ranks: Ranks | None = None
        if tp > 1 and rank == 0:  # they load their shards while this one loads its own
            self.ranks = Ranks(tp, files, rc)
        try:
            self._build(files, rc, control, t0)
            if tp > 1 and rank > 0:
                assert init_method is not None
                init_group(rank, tp, init_method, self.device)
        except BaseException:
            self.close()
            raise

    def _build(self, files: ModelFiles, rc: RunnerConfig, control, t0: float) -> None:
        with torch.device("meta"):
            model = LlamaModel(self.cfg, self.shard)
        load_weights(model, files, self.dtype, self.device)
        quantized.apply(model, files, rc.quantization, self.device)
        model.inv_freq = rope_inv_freq(self.cfg).to(self.device)
        if self.tp_size > 1:
            model.all_reduce = all_reduce
        # dtype auto on a CPU without native bf16 runs fp32, but a decode step is bound by the
        # weight bytes it streams: keep the projections in bf16 for the AVX2 kernel (activations,
        # norms and the KV cache stay fp32). --dtype float32 keeps fp32 weights, the reference.
        layouts = model.pack_for_cpu(bf16_weights=rc.dtype == "auto" and self.device.type == "cpu"
                                     and self.dtype == torch.float32)
        # "cpu/float32" below names the activations and KV cache; say when the weights are not.
        weights_note = " (bf16 weights)" if layouts.get("bf16w_avx2") else ""
        if set(layouts) != {"plain"}:
            log.info("weight layouts for the CPU matmul: %s",
                     ", ".join(f"{n} {name}" for name, n in sorted(layouts.items())))
        self.model = model.eval()
        self.block_size = rc.block_size
        self.max_model_len = min(rc.max_model_len or self.cfg.max_position, self.cfg.max_position)
        # Every rank needs the same number of blocks (one block table for all); rank 0 sizes them
        # for the rank holding the most KV heads and tells the others. The budget is per rank.
        heads = max(s.num_kv_heads for s in self.shards)
        per_token = self.cfg.kv_bytes_per_token(torch.finfo(self.dtype).bits // 8) * heads // self.cfg.num_kv_heads
        if self.rank == 0:
            budget = rc.kv_cache_memory or int(available_memory(self.device) * rc.kv_cache_fraction)
            if rc.kv_cache_memory is None and self.device.type == "cpu":
                budget = min(budget, CPU_DEFAULT_KV_CAP)
            self.num_blocks = budget // (per_token * self.block_size)
            if self.num_blocks < 2:
                raise ValueError(f"KV cache budget of {budget} bytes holds fewer than 2 blocks "
                                 f"({per_token * self.block_size} bytes each); raise --kv-cache-memory")
            if self.ranks is not None:
                self.ranks.send(("blocks", self.num_blocks))
        else:
            kind, self.num_blocks = control.recv()
            assert kind == "blocks", kind
        c = self.cfg
        # Left uninitialised: zeroing gigabytes costs seconds at every start. Attention only reads
        # slots that were written, except padding in batched decode, which points at slot 0; that
        # slot must hold finite numbers (a NaN there would survive its zero attention weight).
        # On CUDA one block more than the block manager hands out: padding rows of graph-replayed
        # decode steps write their K/V there (cuda_graphs.py).
        # Not under tensor parallelism: the all-reduces would have to be captured too (untested).
        use_graphs = (self.device.type == "cuda" and self.tp_size == 1
                      and os.environ.get("PHASESPLIT_CUDA_GRAPHS", "1") != "0")
        slots = (self.num_blocks + (1 if use_graphs else 0)) * self.block_size
        shape = (2, c.num_layers, slots, self.shard.num_kv_heads, c.head_dim)
        if self.device.type == "cpu":  # decode reads scattered blocks of it: huge pages help the TLB
            self.kv_cache = hugepages.empty(math.prod(shape), self.dtype).view(shape)
        else:
            self.kv_cache = torch.empty(shape, dtype=self.dtype, device=self.device)
        self.kv_cache[:, :, 0].zero_()
        self.graphs = None
        if use_graphs:
            width = -(-self.max_model_len // DECODE_WIDTH_STEP) * DECODE_WIDTH_STEP
            self.graphs = DecodeGraphs(model, self.kv_cache, self.block_size, self.num_blocks * self.block_size,
                                       width, self.dtype)
        self.threads = torch.get_num_threads()
        # With sleeping OpenMP waits every parallel op pays a thread wake-up; for a few decode
        # sequences that costs more than the second core gives back. Measured here (2 threads),
        # torch ops: batch 1-4 steps 40-49 ms on one thread vs 50-61 ms on two; batch 8 even;
        # 16+ favour two. CPU kernels: batch 1 21.5 vs 23.9 ms, 2 even (23.6 / 23.3), 4 favours
        # two (31.2 / 28.5), 32 62.6 vs 90.8 ms.
        self.small_step_threads = (1 if self.device.type == "cpu" and self.threads > 1
                                   and os.environ.get("OMP_WAIT_POLICY", "").upper() == "PASSIVE" else None)
        self._step_threads = self.threads
        shape = (self.shard.num_heads, self.shard.num_kv_heads, self.cfg.head_dim)
        self.paged_kernel = kernel_decode_available(self.device, self.dtype, self.model.layer_f32 is not None, shape)
        if not self.paged_kernel and kernel_decode_available(self.device, self.dtype, self.model.layer_f32 is not None):
            log.info("decode attention: torch's (the CPU kernel takes head sizes up to %d and up to %d query heads "
                     "per KV head; this model has %d and %d)", cpu_attention.MAX_HEAD_DIM, cpu_attention.MAX_GROUP,
                     self.cfg.head_dim, self.shard.num_heads // max(self.shard.num_kv_heads, 1))
        # The batch rule was measured with the bf16 kernels; the AVX2 fp32 path keeps the torch rule.
        self.small_decode_batch = (KERNEL_SMALL_DECODE_BATCH if self.paged_kernel and self.dtype == torch.bfloat16
                                   else SMALL_DECODE_BATCH)
        # Decode-only CPU steps (native bf16 or AVX2 fp32): all layers in one C call (cpu_decode_step.py).
        self.cpu_step = (CpuDecodeStep.create(model, self.kv_cache, self.block_size, self.paged_kernel)
                         if self.device.type == "cpu" and self.tp_size == 1 else None)
        self._helpers_mode = os.environ.get("PHASESPLIT_DECODE_HELPERS", "1")  # read once: 1, 0 or small
        self.decode_helpers = self._start_decode_helpers(
            sum(layouts.get(name, 0) for name in ("bf16w_avx2", "cpu_gemm", *cpu_quant.LAYOUTS)))
        if self.ranks is not None:
            self.ranks.join(self.device)
            self.ranks.wait_ready()
        tp = "" if self.tp_size == 1 else (f" (tensor-parallel rank {self.rank} of {self.tp_size}: query heads "
                                           f"{self.shard.heads}, KV heads {self.shard.kv_heads}, MLP {self.shard.ffn})")
        log.info("model loaded on %s/%s%s in %.2fs%s; KV cache: %d blocks x %d tokens = %d tokens (%.1f MiB)",
                 self.device, str(self.dtype).removeprefix("torch."), weights_note, time.perf_counter() - t0, tp,
                 self.num_blocks, self.block_size, self.num_blocks * self.block_size,
                 self.kv_cache.numel() * self.kv_cache.element_size() / 2**20)

    def close(self) -> None:
        """Stop the other tensor-parallel ranks (rank 0; nothing to do without TP)."""
        if self.ranks is not None:
            self.ranks.close()
            self.ranks = None

    def _start_decode_helpers(self, shareable_weights: int) -> int:
        """Where decode steps of a few sequences run on one thread (small_step_threads) with the
        CPU kernels' matmuls (AVX2 bf16 weights, AVX512-BF16, GGUF blocks served natively;
        `shareable_weights`: how many projections use them), share them with helper threads of our own
        (kernels/decode_helpers.c): the other cores stream weights too, and a helper whose core is
        taken is never waited for. PHASESPLIT_DECODE_HELPERS=0 keeps such steps on one thread;
        =small keeps the helpers to the steps of a few sequences on the native bf16 path too (the
        rule before they took whole one-call steps: an A/B switch for benchmarks).
        Returns how many helpers run."""
        if self._helpers_mode == "0" or not shareable_weights:
            return 0
        if self.borrow_cpus and self.threads == 1 and self.tp_size == 1 and self.device.type == "cpu":
            return self._borrow_helpers()
        if not self.small_step_threads:
            return 0
        from phasesplit.runtime.kernels import build, cpu_gemm_avx2

        lib = build.bf16w_library()
        if lib is None:
            return 0
        try:
            # Pinned away from this thread's CPU: measured beside a busy process here, unpinned
            # helpers were woken onto the caller's CPU and slowed the step (docs/benchmarks.md).
            n = cpu_gemm_avx2.start_helpers(lib, self.threads - 1, pin=True)
        except build.KernelUnavailable as e:
            log.warning("decode helpers not used: %s", e)
            return 0
        log.info("decode steps of up to %d sequences: matmuls shared by this thread and %d helper thread(s)",
                 self._one_thread_limit(n), n)
        return n

    def _borrow_helpers(self) -> int:
        """A worker pinned to one CPU (`phasesplit up --pin-cpus`) shares its matmuls, prefill
        chunks included, with idle-priority helpers on the other workers' CPUs: a lone prompt is
        prefilled on both cores while the decode worker idles, as colocated's would be, and
        decode steps stream the weights on both while the prefill worker idles; whichever
        worker owns a CPU preempts the helper there at once."""
        from phasesplit.runtime.kernels import build, cpu_gemm_avx2

        lib = build.bf16w_library()
        if lib is None:
            return 0
        cpus = list(self.borrow_cpus)
        try:
            placed = cpu_gemm_avx2.borrow_helpers(lib, cpus, max_rows=1 << 20)
        except build.KernelUnavailable as e:
            log.warning("idle CPUs %s not borrowed: %s", cpus, e)
            return 0
        if placed < len(cpus):
            log.warning("idle-priority helpers: %d of CPUs %s could be pinned (the others run unpinned)",
                        placed, cpus)
        log.info("matmuls shared with %d idle-priority helper(s) on CPUs %s (other workers' when idle)",
                 len(cpus), cpus)
        return len(cpus)

    def _one_thread_limit(self, helpers: int) -> int:
        """The most decode rows a step runs on one thread (plus `helpers` decode helpers)."""
        if (helpers and self.cpu_step is not None and self.cpu_step.enabled and self.dtype == torch.bfloat16
                and self._helpers_mode != "small"):
            return CPU_STEP_ROWS
        return self.small_decode_batch

    def _set_step_threads(self, prefill: bool, num_decode: int) -> None:
        small = self.small_step_threads and not prefill and num_decode <= self._one_thread_limit(self.decode_helpers)
        threads = self.small_step_threads if small else self.threads
        if threads != self._step_threads:
            torch.set_num_threads(threads)
            self._step_threads = threads

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch, stream: LayerStream | None = None
            ) -> tuple[list[Sequence], torch.Tensor, list[tuple[Sequence, int, torch.Tensor]]]:
        """One forward pass. Returns the sequences that reached their end this step (they need a
        sampled token) and their logits, row for row; and for sequences that asked for prompt
        logprobs, (sequence, first prompt position predicted, logits predicting it and on).
        Under tensor parallelism the other ranks run the same step (sent to them first)."""
        self._set_step_threads(bool(batch.prefill), len(batch.decode))
        ids: list[int] = []
        pos: list[int] = []
        logits_rows: list[int] = []
        sampled: list[Sequence] = []
        for seq in batch.decode:
            ids.append(seq.all_ids[-1])
            pos.append(len(seq) - 1)
            logits_rows.append(len(ids) - 1)
            sampled.append(seq)
        prefill_meta = []
        prompt_rows: list[tuple[Sequence, int, list[int]]] = []
        for seq, chunk in batch.prefill:
            start = seq.num_computed
            ids.extend(seq.all_ids[start : start + chunk])
            pos.extend(range(start, start + chunk))
            prefill_meta.append((seq.block_table, start, chunk))
            if start + chunk == len(seq):
                logits_rows.append(len(ids) - 1)
                sampled.append(seq)
            if seq.params.prompt_logprobs is not None and seq.prompt_lp is not None:
                # Position p predicts prompt token p + 1; those already scored (a recomputation
                # after preemption) are not asked for again.
                lo = max(start, len(seq.prompt_lp) - 1)
                hi = min(start + chunk, len(seq.prompt_ids) - 1)
                if hi > lo:
                    base = len(ids) - chunk - start
                    prompt_rows.append((seq, lo + 1, [base + p for p in range(lo, hi)]))
        decode = [(s.block_table, len(s)) for s in batch.decode]
        reads = [] if stream is None else [self.slots(seq, lo, hi) for seq, lo, hi in stream.reads]
        after_layer = None
        if stream is not None:
            def after_layer(layer: int) -> None:
                stream.send(layer, [self._gather_kv(layer, slots) for slots in reads])
        logits = None
        if self.graphs is not None and decode and not batch.prefill and stream is None:
            logits = self.graphs.run(decode, ids)
        elif self.cpu_step is not None and decode and not batch.prefill and stream is None:
            logits = self.cpu_step.run(decode, ids, lambda: self._forward(ids, pos, logits_rows, decode, [], None))
        if logits is None:
            if self.ranks is not None:
                self.ranks.send(("step", ids, pos, decode, prefill_meta, [r.tolist() for r in reads]))
            rows = logits_rows + [r for _, _, rs in prompt_rows for r in rs]
            logits = self._forward(ids, pos, rows, decode, prefill_meta, after_layer)
        prompt_logits = []
        at = len(logits_rows)
        for seq, first, rs in prompt_rows:
            prompt_logits.append((seq, first, logits[at : at + len(rs)]))
            at += len(rs)
        logits = logits[: len(logits_rows)]
        for seq in batch.decode:
            seq.num_computed += 1
        for seq, chunk in batch.prefill:
            seq.num_computed += chunk
        return sampled, logits, prompt_logits

    def _forward(self, ids: list[int], pos: list[int], logits_rows: list[int] | None,
                 decode: list[tuple[list[int], int]], prefill_meta: list[tuple[list[int], int, int]],
                 after_layer: Callable[[int], None] | None) -> torch.Tensor | None:
        meta = build_metadata(decode, prefill_meta, self.block_size, self.device, self.dtype, self.paged_kernel)
        dev = self.device
        return self.model(
            torch.tensor(ids, dtype=torch.long, device=dev),
            torch.tensor(pos, dtype=torch.long, device=dev),
            self.kv_cache,
            meta,
            None if logits_rows is None else torch.tensor(logits_rows, dtype=torch.long, device=dev),
            after_layer,
        )

    def _gather_kv(self, layer: int, slots: torch.Tensor) -> torch.Tensor | None:
        """One layer's K and V at `slots` with all KV heads, on the CPU: [2, tokens, kv_heads,
        head_dim]. Under TP every rank calls it at the same point: the ranks that hold a head
        range first send theirs to rank 0, which returns the whole (the others get None)."""
        cache = self.kv_cache
        local = torch.stack((read_rows(cache[0, layer], slots), read_rows(cache[1, layer], slots)))
        if self.tp_size == 1:
            return local.to("cpu")
        owners = kv_owners(self.shards)
        if self.rank != 0:
            if self.shard in owners:
                dist.send(local.contiguous(), dst=0)
            return None
        parts = [local]
        for o in owners[1:]:  # rank 0 holds the first heads
            buf = torch.empty((2, len(slots), o.num_kv_heads, self.cfg.head_dim), dtype=self.dtype, device=self.device)
            dist.recv(buf, src=o.rank)
            parts.append(buf)
        return torch.cat(parts, dim=2).to("cpu")

    def kv_landing(self, tokens: int) -> torch.Tensor | None:
        """Where a decode worker receives a remote prefill's K/V when its cache does not hold
        every KV head (tensor parallelism): [2, layers, tokens, kv_heads, head_dim] on the CPU,
        handed to write_kv once complete. None: frames go straight into the cache."""
        if self.tp_size == 1:
            return None
        c = self.cfg
        return torch.empty((2, c.num_layers, tokens, c.num_kv_heads, c.head_dim), dtype=self.dtype)

    @torch.inference_mode()
    def write_kv(self, seq: Sequence, start: int, kv: torch.Tensor) -> None:
        """Store K/V of all layers for positions [start, start + tokens) of a sequence; kv is
        [2, layers, tokens, kv_heads, head_dim] with all of the model's KV heads (a landed remote
        prefill). Each tensor-parallel rank keeps its own heads."""
        slots = self.slots(seq, start, start + kv.shape[2])
        if self.ranks is not None:
            self.ranks.send(("write_kv", slots.tolist()))
            for s in self.shards[1:]:
                lo, hi = s.kv_heads
                dist.send(kv[:, :, :, lo:hi].contiguous().to(self.device), dst=s.rank)
        lo, hi = self.shard.kv_heads
        self._write_local(slots, kv[:, :, :, lo:hi].to(self.device))

    def _write_local(self, slots: torch.Tensor, kv: torch.Tensor) -> None:
        kv = kv.contiguous()
        for layer in range(kv.shape[1]):
            write_rows(self.kv_cache[0, layer], slots, kv[0, layer])
            write_rows(self.kv_cache[1, layer], slots, kv[1, layer])

    @torch.inference_mode()
    def handle(self, msg: tuple) -> None:
        """A tensor-parallel rank other than 0: run one message from rank 0 (tensor_parallel.py)."""
        kind = msg[0]
        if kind == "step":
            _, ids, pos, decode, prefill_meta, reads = msg
            self._set_step_threads(bool(prefill_meta), len(decode))
            slots = [torch.tensor(r, dtype=torch.long, device=self.device) for r in reads]
            after_layer = None
            if slots:
                def after_layer(layer: int) -> None:
                    for s in slots:
                        self._gather_kv(layer, s)
            self._forward(ids, pos, None, decode, prefill_meta, after_layer)
        elif kind == "write_kv":
            slots = torch.tensor(msg[1], dtype=torch.long, device=self.device)
            c = self.cfg
            buf = torch.empty((2, c.num_layers, len(slots), self.shard.num_kv_heads, c.head_dim),
                              dtype=self.dtype, device=self.device)
            dist.recv(buf, src=0)
            self._write_local(slots, buf)
        else:
            raise ValueError(f"unknown tensor-parallel message {kind!r}")

    def slots(self, seq: Sequence, begin: int, end: int) -> torch.Tensor:
        """Flat cache slots of token positions [begin, end) of a sequence."""
        pos = torch.arange(begin, end)
        table = torch.tensor(seq.block_table, dtype=torch.long)
        return (table[pos // self.block_size] * self.block_size + pos % self.block_size).to(self.device)
