"""A request's state inside the engine."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from phasesplit.runtime.request import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"  # queued; no blocks
    REMOTE_PREFILL = "remote_prefill"  # blocks reserved; a prefill worker is filling them
    RUNNING = "running"  # in the batch (prefilling in chunks, or decoding)
    FINISHED = "finished"


@dataclass
class Sequence:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    arrival: float = field(default_factory=time.monotonic)
    output_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    block_table: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose K/V are in the cache
    num_cached_prompt: int = 0  # prompt tokens served by the prefix cache
    num_registered: int = 0  # leading blocks whose hashes are registered for prefix reuse
    finish_reason: str | None = None
    first_scheduled: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    num_preemptions: int = 0
    queued_step: int = 0  # the scheduler step it (re)joined the waiting queue at (aging)
    prefill_only: bool = False  # prefill worker: stop after the first token
    kv_transfer_s: float | None = None  # split mode: seconds the prompt's K/V took to arrive
    remote_queued_s: float | None = None  # split mode: its wait in the prefill worker's queue
    remote_prefill_s: float | None = None  # split mode: its prefill there, queue excluded
    # split mode: when its remote prefill was called, and the round trip placement estimated
    # (LLMEngine.remote_pause; set only where the decode worker pauses for remote prefills)
    remote_started: float | None = None
    remote_estimate_s: float | None = None
    group: str = ""  # the request this sequence is a choice of (its own id when n == 1)
    index: int = 0  # which choice of its request
    matcher: Any = None  # grammar matcher of a constrained request (engine/grammar.py)
    prompt_lp: list[dict | None] | None = None  # prompt logprobs so far, when asked for ([None] first)
    prompt_lp_sent: bool = False
    cumulative_logprob: float = 0.0  # sum of the chosen tokens' logprobs (best_of ranks on it)

    def __post_init__(self) -> None:
        if not self.group:
            self.group = self.request_id
        if self.params.prompt_logprobs is not None and self.prompt_lp is None:
            self.prompt_lp = [None]

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def __len__(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def uncomputed(self) -> int:
        return len(self) - self.num_computed
