"""Continuous batching with chunked prefill and preemption by recomputation.

Every step the scheduler fills a token budget: first one token for each decoding sequence (so
a long prompt never stalls running streams), then prompt chunks, shortest remaining prompt
first (started or newly admitted alike), with a quarter of the step kept for the oldest started
prompt so that long prompts still progress, and a waiting prompt that has waited more than
`max_wait_steps` steps ahead of every shorter one (an aging bound: a steady stream of short
prompts cannot keep a long one out of the batch). When the cache runs out the most recently admitted
sequence is preempted: its blocks are freed and it goes back to the front of the queue, to be
recomputed (its prefix blocks often survive in the prefix cache).

With a `StepTimeBudget` (a decode worker keeping an ITL target), a step that carries decode rows
carries only as many prompt tokens as fit the target by the measured step cost: a prompt
prefilled beside running streams then goes in chunks that keep their inter-token latency, and
the streams' steps never wait for a whole budget's worth of prompt. `chunk_tokens` (the engine's
step_costs.efficient_chunk) caps the prompt tokens of every step: chunks only as long as they pay
for the step's fixed cost, so a short prompt arriving meanwhile, or scheduled beside a long one,
waits for no more.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from phasesplit.runtime.engine.block_manager import BlockManager
from phasesplit.runtime.engine.sequence import Sequence, Status
from phasesplit.runtime.engine.step_costs import StepTimeBudget

# Steps a waiting prompt may be passed over by shorter ones before it goes first: at ~20-50 ms a
# step on the reference CPU, about 1-3 s.
MAX_WAIT_STEPS = 64


@dataclass
class ScheduledBatch:
    decode: list[Sequence] = field(default_factory=list)  # one new token each
    prefill: list[tuple[Sequence, int]] = field(default_factory=list)  # (sequence, chunk length)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.decode and not self.prefill

    @property
    def num_tokens(self) -> int:
        return len(self.decode) + sum(n for _, n in self.prefill)


class Scheduler:
    def __init__(self, blocks: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_wait_steps: int = MAX_WAIT_STEPS) -> None:
        self.blocks = blocks
        self.max_wait_steps = max_wait_steps
        self.steps = 0  # schedule() calls so far: the aging clock, in steps rather than seconds
        self.max_num_seqs = max_num_seqs
        self.budget = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admission order
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        seq.queued_step = self.steps
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting) or any(s.status is Status.RUNNING for s in self.running)

    @property
    def waiting_tokens(self) -> int:
        return sum(s.uncomputed for s in self.waiting)

    def schedule(self, time_budget: StepTimeBudget | None = None, chunk_tokens: int | None = None) -> ScheduledBatch:
        """This step's batch. `time_budget`: cap the prompt tokens of a step with decode rows;
        `chunk_tokens`: cap the prompt tokens of any step."""
        self.steps += 1
        batch = ScheduledBatch()
        active = [s for s in self.running if s.status is Status.RUNNING]
        # 1. Decoding sequences: one token each, preempting the newest when blocks run out.
        for seq in [s for s in active if s.uncomputed == 1]:
            if seq not in self.running:  # preempted while making room for an older one
                continue
            while not self.blocks.can_grow(seq, len(seq)):
                victim = self._newest_preemptible(exclude=seq)
                if victim is None:
                    break
                self._preempt(victim, batch)
            if not self.blocks.can_grow(seq, len(seq)):
                self._preempt(seq, batch)
                continue
            if len(batch.decode) == self.budget:
                break
            self.blocks.grow(seq, len(seq))
            batch.decode.append(seq)
        budget = self.budget - len(batch.decode)
        step_tokens = self.budget  # the step's prompt tokens: the oldest started prompt gets a quarter
        if chunk_tokens is not None:
            step_tokens = min(step_tokens, chunk_tokens)
        if time_budget is not None and batch.decode:
            step_tokens = min(step_tokens, time_budget.prompt_tokens(len(batch.decode)))
        budget = min(budget, step_tokens)
        # 2. Prompt work: sequences part-way through their prompt, then waiting requests, the
        # shortest remaining prompt first, so a chat is not stuck behind every chunk of a long
        # document (FIFO made chat TTFT wait for whole 1600-token prefills). The oldest started
        # prompt is first granted a quarter of the step, so a stream of short prompts cannot
        # starve a long one.
        partial = [s for s in self.running if s.status is Status.RUNNING and s.uncomputed > 1]
        grants: dict[int, int] = {}  # id(seq) -> prompt tokens this step
        if partial and budget > 0:
            grants[id(partial[0])] = min(partial[0].uncomputed, max(1, step_tokens // 4), budget)
            budget -= grants[id(partial[0])]
        def order(s: Sequence) -> tuple[int, int]:  # aged waiting prompts first, oldest first; then shortest
            if s.status is not Status.RUNNING and self.steps - s.queued_step > self.max_wait_steps:
                return (0, s.queued_step)
            return (1, s.uncomputed)

        for seq in sorted([*partial, *self.waiting], key=order):  # stable: FIFO ties
            if budget == 0:
                break
            if seq.status is Status.RUNNING:
                extra = min(seq.uncomputed - grants.get(id(seq), 0), budget)
                if extra > 0:
                    grants[id(seq)] = grants.get(id(seq), 0) + extra
                    budget -= extra
                    if seq is not partial[0]:
                        batch.prefill.append((seq, 0))  # placeholder, sized below
                continue
            # 3. Admit a waiting request while the batch size and cache allow.
            if len(self.running) >= self.max_num_seqs:
                break
            if not self.blocks.can_allocate(seq):
                break  # longer prompts would not fit either; do not let them jump the queue
            self.waiting.remove(seq)
            self.blocks.allocate(seq)
            seq.status = Status.RUNNING
            self.running.append(seq)
            chunk = min(seq.uncomputed, budget)
            grants[id(seq)] = chunk
            batch.prefill.append((seq, 0))
            budget -= chunk
        if partial and id(partial[0]) in grants:
            batch.prefill.insert(0, (partial[0], 0))
        batch.prefill = [(seq, grants[id(seq)]) for seq, _ in batch.prefill]
        return batch

    def _newest_preemptible(self, exclude: Sequence) -> Sequence | None:
        for seq in reversed(self.running):
            if seq is not exclude and seq.status is Status.RUNNING:
                return seq
        return None

    def _preempt(self, seq: Sequence, batch: ScheduledBatch) -> None:
        self.blocks.free_seq(seq)
        seq.num_computed = 0
        seq.status = Status.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.running.remove(seq)
        seq.queued_step = self.steps
        self.waiting.appendleft(seq)
        batch.preempted.append(seq)
        if seq in batch.decode:
            batch.decode.remove(seq)

    def finish(self, seq: Sequence) -> None:
        """Remove a sequence from wherever it is and free its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.free_seq(seq)
        seq.status = Status.FINISHED
