"""Admission control: how much work a process holds at once, beyond which it answers 429.

Pure bookkeeping (no I/O, no clocks): the HTTP layer asks `admit` before a request starts and
calls `release` when it ends, however it ends. Limits are counts of in-flight sequences (a
request with n or best_of > 1 runs several) and their prompt tokens, running and queued together,
so the queues behind them stay bounded.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from phasesplit.runtime.request import Overloaded


@dataclass
class Ticket:
    """One admitted request; `release` gives its share back once, however often it is called
    (the normal path and a finalizer may both call it)."""

    admission: Admission
    tokens: int
    seqs: int = 1
    released: bool = field(default=False)

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.admission.requests -= self.seqs
            self.admission.tokens -= self.tokens


@dataclass
class Admission:
    max_requests: int  # sequences
    max_tokens: int  # prompt tokens
    requests: int = 0
    tokens: int = 0
    rejected: int = 0

    def admit(self, prompt_tokens: int, seqs: int = 1, max_requests: int | None = None,
              max_tokens: int | None = None) -> Ticket:
        """Take one request in, or raise Overloaded. The limits may be given per call (the
        router's follow the live workers). An idle process always admits one request, so a
        request no limit could ever admit still gets its 400 from the length checks instead."""
        max_requests = self.max_requests if max_requests is None else max_requests
        max_tokens = self.max_tokens if max_tokens is None else max_tokens
        if self.requests and (self.requests + seqs > max_requests or self.tokens + prompt_tokens > max_tokens):
            self.rejected += 1
            raise Overloaded(f"the server is at capacity ({self.requests} sequences, {self.tokens} prompt "
                             "tokens in flight); retry later")
        self.requests += seqs
        self.tokens += prompt_tokens
        return Ticket(self, prompt_tokens, seqs)
