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


class Overloaded(RuntimeError):
    """The server holds as much work as it admits; try again later (servers map it to HTTP 429)."""

    def __init__(self, message: str, retry_after: int = 1) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class Unavailable(RuntimeError):
    """No worker could take the request within the time it may wait (the router's held queue
    timed out): servers map it to HTTP 503 with Retry-After."""

    def __init__(self, message: str, retry_after: int = 5) -> None:
        super().__init__(message)
        self.retry_after = retry_after


# Below this a temperature means greedy, as in vLLM: dividing logits by it overflows to inf/NaN.
GREEDY_TEMPERATURE = 1e-5
MAX_STOP_STRINGS = 16
MAX_STOP_LENGTH = 256
MAX_STOP_TOKEN_IDS = 256


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

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise RequestError naming the first field out of range (the ranges of vLLM and the
        OpenAI API). vocab_size: check stop_token_ids against it."""
        if self.max_tokens < 1:
            raise RequestError("max_tokens must be at least 1", "max_tokens")
        # `not a <= x <= b` is also true for NaN, so the range checks refuse non-finite numbers.
        if not 0 <= self.temperature <= 2:
            raise RequestError("temperature must be a number in [0, 2]", "temperature")
        if not 0 < self.top_p <= 1:
            raise RequestError("top_p must be a number in (0, 1]", "top_p")
        if self.top_k < 0:
            raise RequestError("top_k must be -1 or 0 (off) or a positive count", "top_k")
        if self.min_tokens < 0 or self.min_tokens > self.max_tokens:
            raise RequestError("min_tokens must be between 0 and max_tokens", "min_tokens")
        if self.seed is not None and not -(2**63) <= self.seed < 2**64:
            raise RequestError("seed must fit in 64 bits", "seed")
        if len(self.stop) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_LENGTH for s in self.stop):
            raise RequestError(f"stop takes at most {MAX_STOP_STRINGS} strings of at most {MAX_STOP_LENGTH} "
                               "characters", "stop")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise RequestError(f"stop_token_ids takes at most {MAX_STOP_TOKEN_IDS} ids", "stop_token_ids")
        if vocab_size is not None and any(not 0 <= t < vocab_size for t in self.stop_token_ids):
            raise RequestError(f"stop_token_ids must be token ids in [0, {vocab_size})", "stop_token_ids")
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
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1



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
