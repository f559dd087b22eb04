"""The OpenAI-compatible HTTP API, over any backend that turns token ids into a token stream.

Colocated (`--role both`) the backend is the local engine; in split mode it is the router's
relay to a decode worker. Either way clients see the same API.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from phasesplit.runtime.model.tokenizer import TextTokenizer
from phasesplit.runtime.request import RequestError, RequestOutput, SamplingParams
from phasesplit.runtime.server.metrics import Metrics
from phasesplit.runtime.server.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatResponseMessage,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    ModelCard,
    ModelList,
    Usage,
    error_body,
    make_id,
)

log = logging.getLogger(__name__)


class Backend(Protocol):
    tokenizer: TextTokenizer
    max_model_len: int

    def check_request(self, prompt_len: int, params: SamplingParams) -> None: ...

    def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams
                 ) -> AsyncIterator[RequestOutput]: ...


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code


def _error_response(e: APIError) -> JSONResponse:
    return JSONResponse(error_body(e.message, e.type, e.param, e.code), status_code=e.status)


def add_common_routes(app: FastAPI, metrics: Metrics, ready: Callable[[], tuple[bool, str]]) -> None:
    """Health, readiness and metrics, which every role serves."""

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/ready")
    async def readiness() -> JSONResponse:
        ok, why = ready()
        return JSONResponse({"ready": ok, "reason": why}, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def prometheus_metrics() -> PlainTextResponse:
        return PlainTextResponse(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError) -> JSONResponse:
        return _error_response(e)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, e: RequestValidationError) -> JSONResponse:
        errors = e.errors()
        first = errors[0] if errors else {}
        if first.get("type") == "json_invalid":
            return _error_response(APIError(400, "the request body is not valid JSON"))
        loc = [str(x) for x in first.get("loc", []) if x != "body"]
        msg = first.get("msg", "invalid request")
        if not loc:
            return _error_response(APIError(400, f"the request body must be a JSON object: {msg}"))
        param = ".".join(loc) or None
        return _error_response(APIError(400, f"{param}: {msg}" if param else msg, param=param))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, e: StarletteHTTPException) -> JSONResponse:
        return _error_response(APIError(e.status_code, str(e.detail), "invalid_request_error"))


def build_openai_app(backend: Backend, served_name: str, metrics: Metrics,
                     ready: Callable[[], tuple[bool, str]], api_key: str | None = None) -> FastAPI:
    app = FastAPI(title="phasesplit", docs_url=None, redoc_url=None)
    install_error_handlers(app)
    add_common_routes(app, metrics, ready)

    def check_auth(request: Request) -> None:
        if api_key and request.headers.get("authorization", "") != f"Bearer {api_key}":
            raise APIError(401, "missing or wrong API key (send 'Authorization: Bearer <key>')",
                           "authentication_error", code="invalid_api_key")

    def check_model(name: str) -> None:
        if name != served_name:
            raise APIError(404, f"the model '{name}' does not exist; this server serves '{served_name}'",
                           param="model", code="model_not_found")

    def sampling(req: ChatCompletionRequest | CompletionRequest, prompt_len: int) -> SamplingParams:
        default_max = max(1, backend.max_model_len - prompt_len)
        params = req.sampling(default_max)
        if isinstance(req, ChatCompletionRequest) and req.max_completion_tokens is not None:
            params.max_tokens = req.max_completion_tokens
        try:
            backend.check_request(prompt_len, params)
        except RequestError as e:
            raise APIError(400, str(e), param=e.param) from None
        return params

    @app.get("/v1/models")
    async def models(request: Request) -> ModelList:
        check_auth(request)
        return ModelList(data=[ModelCard(id=served_name, max_model_len=backend.max_model_len)])

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        check_auth(request)
        check_model(req.model)
        prompt = req.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], list):
            if len(prompt) != 1:
                raise APIError(400, "only one prompt per request is supported", param="prompt")
            prompt = prompt[0]
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise APIError(400, "only one prompt per request is supported", param="prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            ids = backend.tokenizer.encode(prompt)
        else:
            ids = list(prompt)
            if any(not 0 <= t < backend.tokenizer.vocab_size for t in ids):
                raise APIError(400, "prompt token ids must be within the vocabulary", param="prompt")
        if not ids:
            raise APIError(400, "the prompt is empty", param="prompt")
        params = sampling(req, len(ids))
        rid = make_id("cmpl")
        if req.stream:
            return _stream(request, rid, _completion_chunks(backend, rid, ids, params, req))
        text, reason, usage, timing = await _collect(request, backend, rid, ids, params)
        return CompletionResponse(id=rid, model=req.model, choices=[CompletionChoice(text=text, finish_reason=reason)],
                                  usage=usage, phasesplit_timing=timing)

    @app.post("/v1/chat/completions")
    async def chat(req: ChatCompletionRequest, request: Request):
        check_auth(request)
        check_model(req.model)
        if not req.messages:
            raise APIError(400, "messages must not be empty", param="messages")
        try:
            msgs = [{"role": m.role, "content": m.text()} for m in req.messages]
            prompt = backend.tokenizer.apply_chat_template(msgs, req.add_generation_prompt)
        except ValueError as e:
            raise APIError(400, str(e), param="messages") from None
        ids = backend.tokenizer.encode(prompt)
        params = sampling(req, len(ids))
        rid = make_id("chatcmpl")
        if req.stream:
            return _stream(request, rid, _chat_chunks(backend, rid, ids, params, req))
        text, reason, usage, timing = await _collect(request, backend, rid, ids, params)
        return ChatCompletionResponse(id=rid, model=req.model, usage=usage, phasesplit_timing=timing, choices=[
            ChatChoice(message=ChatResponseMessage(content=text), finish_reason=reason)])

    return app


def _finish_reason(out: RequestOutput) -> str | None:
    if not out.finished:
        return None
    return "length" if out.finish_reason == "length" else "stop"


def _usage(out: RequestOutput) -> Usage:
    return Usage(prompt_tokens=out.prompt_tokens, completion_tokens=out.completion_tokens,
                 total_tokens=out.prompt_tokens + out.completion_tokens,
                 prompt_tokens_details={"cached_tokens": out.cached_tokens})


async def _collect(request: Request, backend: Backend, rid: str, ids: list[int], params: SamplingParams
                   ) -> tuple[str, str | None, Usage, dict[str, float] | None]:
    """Run a non-streaming request; abort it if the client goes away."""
    parts: list[str] = []
    last: RequestOutput | None = None

    async def run() -> None:
        nonlocal last
        async for out in backend.generate(rid, ids, params):
            parts.append(out.text)
            last = out

    task = asyncio.create_task(run())
    try:
        while not task.done():
            done, _ = await asyncio.wait({task}, timeout=0.5)
            if not done and await request.is_disconnected():
                task.cancel()
                break
        await task
    except asyncio.CancelledError:
        raise
    except RequestError as e:
        raise APIError(400, str(e), param=e.param) from None
    except Exception as e:  # backend failure: report it as the server's fault
        log.warning("request %s failed: %s", rid, e)
        raise APIError(503, f"generation failed: {e}", "server_error") from None
    assert last is not None
    return "".join(parts), _finish_reason(last), _usage(last), last.timing


def _sse(obj: Any) -> str:
    if hasattr(obj, "model_dump_json"):
        # The timing extension rides on the last chunk only; other chunks look exactly like OpenAI's.
        skip = {"phasesplit_timing"} if getattr(obj, "phasesplit_timing", None) is None else None
        data = obj.model_dump_json(exclude=skip)
    else:
        data = json.dumps(obj)
    return f"data: {data}\n\n"


def _stream(request: Request, rid: str, chunks: AsyncIterator[str]) -> StreamingResponse:
    # When the client disconnects, Starlette cancels this generator; the backend's iterator is
    # closed with it, which aborts the request and frees its blocks.
    return StreamingResponse(chunks, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Request-Id": rid})


async def _guarded(gen: AsyncIterator[RequestOutput]) -> AsyncIterator[RequestOutput | dict]:
    """Turn a backend failure mid-stream into an error event instead of a cut connection."""
    try:
        async for out in gen:
            yield out
    except RequestError as e:
        yield error_body(str(e), param=e.param)
    except Exception as e:  # noqa: BLE001
        log.warning("stream failed: %s", e)
        yield error_body(f"generation failed: {e}", "server_error")


async def _events(outputs: AsyncIterator[RequestOutput], include_usage: bool,
                  chunk: Callable[[RequestOutput | None, Usage | None], Any]) -> AsyncIterator[str]:
    """SSE events of one request: a chunk per text delta, an optional usage chunk, then [DONE].

    `chunk(out, None)` builds a delta chunk, `chunk(None, usage)` the usage chunk.
    """
    last = None
    async for out in _guarded(outputs):
        if isinstance(out, dict):  # an error event ends the stream
            yield _sse(out)
            break
        last = out
        if out.text or out.finished:
            yield _sse(chunk(out, None))
    if last is not None and last.finished and include_usage:
        yield _sse(chunk(None, _usage(last)))
    yield "data: [DONE]\n\n"


def _completion_chunks(backend: Backend, rid: str, ids: list[int], params: SamplingParams,
                       req: CompletionRequest) -> AsyncIterator[str]:
    def chunk(out: RequestOutput | None, usage: Usage | None) -> CompletionResponse:
        choices = [] if out is None else [CompletionChoice(text=out.text, finish_reason=_finish_reason(out))]
        return CompletionResponse(id=rid, model=req.model, choices=choices, usage=usage,
                                  phasesplit_timing=out.timing if out is not None else None)

    return _events(backend.generate(rid, ids, params), req.include_usage, chunk)


async def _chat_chunks(backend: Backend, rid: str, ids: list[int], params: SamplingParams,
                       req: ChatCompletionRequest) -> AsyncIterator[str]:
    def chunk(out: RequestOutput | None, usage: Usage | None) -> ChatCompletionChunk:
        choices = [] if out is None else [ChatChunkChoice(delta=ChatDelta(content=out.text or None),
                                                          finish_reason=_finish_reason(out))]
        return ChatCompletionChunk(id=rid, model=req.model, choices=choices, usage=usage,
                                   phasesplit_timing=out.timing if out is not None else None)

    yield _sse(ChatCompletionChunk(id=rid, model=req.model, choices=[
        ChatChunkChoice(delta=ChatDelta(role="assistant", content=""))]))
    async for event in _events(backend.generate(rid, ids, params), req.include_usage, chunk):
        yield event
