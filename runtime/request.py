"""What a request is as it crosses process boundaries: sampling parameters, outputs, errors.

Torch-free on purpose: the router imports these and runs no model. The engine, the workers'
internal endpoints and the router share these types; sampling parameters have one serialised
form, the fields of SamplingParams as disagg/messages.py validates them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from pydantic import ConfigDict


class RequestError(ValueError):
    """A request that can never be served as asked (servers map it to HTTP 400)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


MAX_CHOICES = 16
MAX_LOGPROBS = 20


@dataclass
class SamplingParams:
    # Serialised by the internal calls (disagg/messages.py), which pydantic validates: an unknown
    # field is an error there (a peer of another version), not silently dropped.
    __pydantic_config__ = ConfigDict(extra="forbid")

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0
    n: int = 1  # choices returned
    best_of: int | None = None  # sequences generated (>= n); the n with the highest logprob are returned
    logprobs: int | None = None  # None: off; k: the chosen token's logprob and the k most likely
    prompt_logprobs: int | None = None  # the same for every prompt token (the first has none)
    guided: dict[str, str] | None = None  # a structured-output constraint (engine/grammar.py spec)

    def validate(self) -> None:
        """Raise RequestError naming the first field out of range."""
        if self.max_tokens < 1:
            raise RequestError("max_tokens must be at least 1", "max_tokens")
        if self.temperature < 0:
            raise RequestError("temperature must be >= 0", "temperature")
        if not 0 < self.top_p <= 1:
            raise RequestError("top_p must be in (0, 1]", "top_p")
        if self.top_k < 0:
            raise RequestError("top_k must be >= 0 (0 turns it off)", "top_k")
        if self.min_tokens < 0 or self.min_tokens > self.max_tokens:
            raise RequestError("min_tokens must be between 0 and max_tokens", "min_tokens")
        if not 1 <= self.n <= MAX_CHOICES:
            raise RequestError(f"n must be between 1 and {MAX_CHOICES}", "n")
        if self.best_of is not None and not self.n <= self.best_of <= MAX_CHOICES:
            raise RequestError(f"best_of must be between n and {MAX_CHOICES}", "best_of")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and not 0 <= k <= MAX_LOGPROBS:
                raise RequestError(f"{name} must be between 0 and {MAX_LOGPROBS}", name)

    @property
    def num_seqs(self) -> int:
        """Sequences the request runs: best_of, else n."""
        return self.best_of or self.n

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1



@dataclass
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    text: str  # new text since the previous output
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" (prefill workers: "prefilled")
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    error: str | None = None  # set when finish_reason is "error"
    timing: dict[str, float] | None = None  # on the last output: seconds queued, in prefill, decoding
    index: int = 0  # which choice of an n > 1 request
    # Per new token, when asked for: {"id", "logprob", "top": [[id, logprob], ...]} (sampling.logprobs_of).
    logprobs: list[dict[str, Any]] | None = None
    # On a choice's first output, when asked for: one entry per prompt token, the first None.
    prompt_logprobs: list[dict[str, Any] | None] | None = None
    cumulative_logprob: float | None = None  # on the last output of a best_of request

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RequestOutput:
        return cls(**d)
