"""OpenAI-compatible request and response bodies (the subset clients use), plus vLLM's extensions."""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from phasesplit.runtime.engine.grammar import spec as grammar_spec
from phasesplit.runtime.request import MAX_CHOICES, MAX_LOGPROBS, RequestError, SamplingParams

# Fields of the OpenAI API this server does not implement, with the values that ask for nothing
# (SDKs and tools send them at these): accepted at those values, refused otherwise. Any other
# unknown field is refused too (extra="forbid"), naming it, never silently ignored.
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "logit_bias": (None, {}),
    "best_of": (None, 1),  # chat; completions implement it
    "echo": (None, False),  # chat; completions implement it
    "suffix": (None, ""),
    "tools": (None, []),
    "tool_choice": (None, "none", "auto"),
    "parallel_tool_calls": (None, True, False),
    "functions": (None, []),
    "function_call": (None, "none", "auto"),
    "service_tier": (None, "auto", "default"),
    "store": (None, False),
    "metadata": (None, {}),
    "repetition_penalty": (None, 1, 1.0),
    "skip_special_tokens": (None, True),
}
MAX_MESSAGES = 1024


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str
    max_tokens: int | None = Field(default=None, description="most tokens to generate")
    # Finite numbers only; the ranges are SamplingParams.validate's (one definition).
    temperature: float = Field(default=1.0, allow_inf_nan=False)
    top_p: float = Field(default=1.0, allow_inf_nan=False)
    n: int = 1
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    user: str | None = None
    response_format: dict[str, Any] | None = None
    # vLLM extensions
    top_k: int = 0
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # Validated in OpenAI's range; only 0 (off) is implemented.
    presence_penalty: float = Field(default=0.0, ge=-2, le=2, allow_inf_nan=False)
    frequency_penalty: float = Field(default=0.0, ge=-2, le=2, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _drop_neutral(cls, data: Any) -> Any:
        if isinstance(data, dict):
            data = {k: v for k, v in data.items()
                    if k in cls.model_fields or k not in _NEUTRAL or not any(
                        v == n and type(v) is type(n) for n in _NEUTRAL[k])}
        return data

    @field_validator("n")
    @classmethod
    def _choices(cls, v: int) -> int:
        if not 1 <= v <= MAX_CHOICES:
            raise ValueError(f"must be between 1 and {MAX_CHOICES}")
        return v

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalty(cls, v: float) -> float:
        if v != 0:
            raise ValueError("penalties are not implemented by this server; send 0 or leave it out")
        return v

    def guided(self) -> dict[str, str] | None:
        """The structured-output constraint asked for, as the engine's spec;
        RequestError naming the field for a malformed one (the schema itself is checked where it is compiled)."""
        found = []
        rf = self.response_format
        if rf is not None:
            kind = rf.get("type")
            if kind == "json_object":
                found.append(grammar_spec("json_object", None, "response_format"))
            elif kind == "json_schema":
                js = rf.get("json_schema")
                if not isinstance(js, dict) or not isinstance(js.get("schema"), dict):
                    raise RequestError("response_format.json_schema must be an object with a 'schema' object",
                                       "response_format.json_schema")
                found.append(grammar_spec("json", js["schema"], "response_format.json_schema.schema"))
            elif kind != "text":
                raise RequestError(f"response_format.type must be 'text', 'json_object' or 'json_schema', not {kind!r}",
                                   "response_format.type")
        for field, kind in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                            ("guided_grammar", "grammar")):
            value = getattr(self, field)
            if value is not None:
                found.append(grammar_spec(kind, value, field))
        if len(found) > 1:
            raise RequestError("only one of response_format (json) and guided_* may be given", found[1]["param"])
        return found[0] if found else None

    def sampling(self, default_max: int) -> SamplingParams:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        # top_k: -1 (vLLM) and 0 both mean off; anything below -1 is refused by validate().
        return SamplingParams(
            max_tokens=self.max_tokens if self.max_tokens is not None else default_max,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=0 if self.top_k == -1 else self.top_k,
            seed=self.seed,
            stop=[s for s in stops if s],
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens,
            n=self.n,
            guided=self.guided(),
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.get("include_usage"))


class CompletionRequest(_Request):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=5)
    best_of: int | None = Field(default=None, ge=1, le=MAX_CHOICES)

    def sampling(self, default_max: int) -> SamplingParams:
        p = super().sampling(default_max)
        p.logprobs = self.logprobs
        p.prompt_logprobs = self.logprobs if self.echo and self.logprobs is not None else None
        p.best_of = self.best_of
        return p


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, tool_call_id, ...: template inputs
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.get("type") != "text":
                raise ValueError(f"content part type {part.get('type')!r} is not supported (text only)")
            parts.append(str(part.get("text", "")))
        return "".join(parts)


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(max_length=MAX_MESSAGES)
    max_completion_tokens: int | None = None
    add_generation_prompt: bool = True
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)

    def sampling(self, default_max: int) -> SamplingParams:
        p = super().sampling(default_max)
        if self.top_logprobs is not None and not self.logprobs:
            raise RequestError("top_logprobs needs logprobs: true", "top_logprobs")
        p.logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return p


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: dict[str, int] | None = None


def make_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


class CompletionLogprobs(BaseModel):
    """The legacy completions shape: parallel lists, top_logprobs as {token: logprob} (with the
    chosen token, as vLLM has it); prompt tokens first with echo, the first one's entries None."""
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: str | None = None
    logprobs: CompletionLogprobs | None = None


class _Envelope(BaseModel):
    """What every completion response and stream chunk carries, in OpenAI's field order."""
    id: str
    object: str
    created: int = Field(default_factory=now)
    model: str
    choices: list[Any]
    usage: Usage | None = None
    # Extension: seconds queued / in prefill / in KV transfer / decoding, on the last chunk only.
    phasesplit_timing: dict[str, float] | None = None


class CompletionResponse(_Envelope):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]


class ChatResponseMessage(BaseModel):
    role: str = "assistant"
    content: str | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatResponseMessage
    finish_reason: str | None = None
    logprobs: ChatLogprobs | None = None


class ChatCompletionResponse(_Envelope):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]


class ChatDelta(BaseModel):
    role: str | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    finish_reason: str | None = None
    logprobs: ChatLogprobs | None = None


class ChatCompletionChunk(_Envelope):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now)
    owned_by: str = "phasesplit"
    root: str | None = None  # the model this name serves (aliases share it), as vLLM lists it
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize: a prompt, or chat messages rendered with the model's template."""
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}
