"""Per-replica performance of the simulated deployment.

Figures for the default profile are first-principles (roofline) estimates for an 8B
Llama-3-class model in bf16 on one A100-40GB-class GPU, not measurements:
- prefill: 312 TFLOP/s × ~45 % MFU / (2 × 8e9 FLOP per token) ≈ 9,000 tokens/s;
- decode step: weights 16 GB / 1.55 TB/s ≈ 10 ms, plus overhead → 12 ms base; compute
  16 GFLOP per sequence / ~125 TFLOP/s ≈ 0.12 ms per sequence; KV 128 KiB per token
  (2 × 32 layers × 8 KV heads × 128 × 2 B) / 1.55 TB/s ≈ 85 ns per context token;
- KV cache: 40 GB − 16 GB weights − ~4 GB activations/graphs ≈ 20 GB ≈ 152k tokens;
- start-up: 60 s (pull cached image, load 16 GB of weights, capture CUDA graphs);
- KV transfer: 100 Gb/s Ethernet ≈ 10 GB/s effective, 2 ms latency;
- chunked prefill: 2,048 tokens per engine step (`--max-num-batched-tokens`; the runtime's CPU
  default is 512).
The "cpu-smollm2" profile is this runtime on a laptop-class CPU (SmolLM2-135M, fp32): prefill
≈ 2,000 tokens/s, decode step 20-40 ms at small batch. A JSON file with the same keys overrides
any of these (`--profile FILE`).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields, replace
from functools import cached_property
from pathlib import Path

from phasesplit.operator.planner.model import DecodeProfile, PrefillProfile


@dataclass(frozen=True)
class SimProfile:
    prefill_tokens_per_s: float = 9000.0
    prefill_overhead_s: float = 0.01
    decode_base_s: float = 0.012
    decode_per_seq_s: float = 0.00012
    decode_per_token_s: float = 85e-9
    max_batch: int = 256
    layers: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    dtype_bytes: int = 2
    kv_cache_bytes: float = 20e9
    startup_s: float = 60.0
    # Per-phase start-up where the phases differ (None: startup_s), e.g. decode pods that also
    # allocate a larger KV cache, or `--startup prefill=15s,decode=30s`.
    prefill_startup_s: float | None = None
    decode_startup_s: float | None = None
    transfer_bytes_per_s: float = 10e9
    transfer_latency_s: float = 0.002
    prefill_chunk_tokens: int = 2048  # the engine's token budget per step (--max-num-batched-tokens)

    @cached_property
    def decode_profile(self) -> DecodeProfile:
        """The planner's description of one decode replica (step-time curve, KV geometry): the
        KV formula lives there once, and the planner's exact prior is this profile."""
        return DecodeProfile(base_s=self.decode_base_s, per_seq_s=self.decode_per_seq_s,
                             per_token_s=self.decode_per_token_s, max_batch=self.max_batch, layers=self.layers,
                             kv_heads=self.kv_heads, head_dim=self.head_dim, dtype_bytes=self.dtype_bytes,
                             kv_cache_bytes=self.kv_cache_bytes)

    @cached_property
    def prefill_profile(self) -> PrefillProfile:
        return PrefillProfile(tokens_per_s=self.prefill_tokens_per_s, overhead_s=self.prefill_overhead_s)

    @property
    def kv_bytes_per_token(self) -> int:
        return self.decode_profile.kv_bytes_per_token

    @property
    def kv_capacity_tokens(self) -> float:
        return self.decode_profile.kv_capacity_tokens

    def startup(self, phase: str) -> float:
        """A new replica's time from creation to ready in this phase."""
        own = self.prefill_startup_s if phase == "prefill" else self.decode_startup_s
        return self.startup_s if own is None else own

    def to_dict(self) -> dict:
        return asdict(self)


PROFILES: dict[str, SimProfile] = {
    "a100-8b": SimProfile(),
    "cpu-smollm2": SimProfile(
        prefill_tokens_per_s=2000.0, prefill_overhead_s=0.02, decode_base_s=0.02, decode_per_seq_s=0.0005,
        decode_per_token_s=2e-7, max_batch=64, layers=30, kv_heads=3, head_dim=64, dtype_bytes=4,
        kv_cache_bytes=2 * 1024**3, startup_s=10.0, transfer_bytes_per_s=1e9, transfer_latency_s=0.001,
        prefill_chunk_tokens=512),
}


def load_profile(name_or_path: str) -> SimProfile:
    """A named profile, or a JSON file of SimProfile keys on top of the default."""
    if name_or_path in PROFILES:
        return PROFILES[name_or_path]
    data = json.loads(Path(name_or_path).read_text())
    known = {f.name for f in fields(SimProfile)}
    unknown = set(data) - known
    if unknown:
        raise ValueError(f"unknown profile keys {sorted(unknown)}; known: {sorted(known)}")
    return replace(SimProfile(), **data)
