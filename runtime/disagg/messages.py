"""The internal HTTP calls of split mode (not for clients). Torch-free: the router sends the first.

- router → decode  POST /internal/generate  GenerateCall → NDJSON lines of RequestOutput
- decode → prefill POST /internal/prefill   PrefillCall  → PrefillDone (the first token travels
  once, in the KV stream's DONE frame, not in this reply; its logprob, when asked for, here)

Sampling parameters travel in one form: request.SamplingParams, validated by pydantic here.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field

from phasesplit.runtime.request import SamplingParams


class GenerateCall(BaseModel):
    request_id: str
    prompt_ids: list[int] = Field(min_length=1)
    params: SamplingParams = Field(default_factory=SamplingParams)
    prefill_urls: list[str] = Field(default_factory=list)  # best first; empty: the decode worker's own
    # Prompt tokens queued on the first of them when the router last polled it (placement.py)
    prefill_queued_tokens: int = Field(default=0, ge=0)


class PrefillCall(BaseModel):
    request_id: str
    prompt_ids: list[int] = Field(min_length=1)
    params: SamplingParams = Field(default_factory=SamplingParams)
    kv_host: str
    kv_port: int
    transfer_id: int
    skip: int = 0  # prompt positions the decode worker holds already (its prefix cache)
    revision: str = ""  # the calling decode worker's: a prefill worker of another revision refuses


class PrefillDone(BaseModel):
    bytes: int
    seconds: float
    # Only when the request asked for logprobs (they are not part of the KV stream): the first
    # token's entry and the prompt's, in RequestOutput's shapes.
    logprob: dict[str, Any] | None = None
    prompt_logprobs: list[dict[str, Any] | None] | None = None
