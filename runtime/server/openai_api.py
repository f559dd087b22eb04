"""The OpenAI-compatible HTTP API, over any backend that turns token ids into a token stream.

Colocated (`--role both`) the backend is the local engine; in split mode it is the router's
relay to a decode worker. Either way clients see the same API.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from phasesplit.runtime.engine.grammar import GrammarError
from phasesplit.runtime.model.tokenizer import TextTokenizer
from phasesplit.runtime.request import Overloaded, RequestError, RequestOutput, SamplingParams, Unavailable
from phasesplit.runtime.server.admission import Ticket
from phasesplit.runtime.server.guards import DEFAULT_MAX_BODY, Guards, check_api_key
from phasesplit.runtime.server.metrics import Metrics
from phasesplit.runtime.server.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
    ChatResponseMessage,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    TopLogprob,
    Usage,
    error_body,
    make_id,
)

log = logging.getLogger(__name__)


class Backend(Protocol):
    tokenizer: TextTokenizer
    max_model_len: int

    def check_request(self, prompt_len: int, params: SamplingParams) -> None: ...

    def admit(self, prompt_tokens: int, seqs: int = 1) -> Ticket:
        """Take a request in, or raise Overloaded (admission control)."""
        ...

    def capacity(self) -> int:
        """How many requests could be admitted now (the gate before the body: server/guards.py)."""
        ...

    def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams
                 ) -> AsyncIterator[RequestOutput]: ...


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code


def _error_response(e: APIError) -> JSONResponse:
    return JSONResponse(error_body(e.message, e.type, e.param, e.code), status_code=e.status)


def add_common_routes(app: FastAPI, metrics: Metrics, ready: Callable[[], tuple[bool, str]],
                      alive: Callable[[], tuple[bool, str]] | None = None) -> None:
    """Health, readiness and metrics, which every role serves. alive: False once the process can
    no longer serve (its engine thread died), so the liveness probe restarts it."""

    @app.get("/health")
    async def health() -> JSONResponse:
        ok, why = alive() if alive is not None else (True, "ok")
        return JSONResponse({"status": "ok" if ok else "failed", "reason": why}, status_code=200 if ok else 503)

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

    @app.exception_handler(Overloaded)
    async def _overloaded(_: Request, e: Overloaded) -> JSONResponse:
        # OpenAI's rate-limit shape: clients (the openai SDK included) back off on 429 + Retry-After.
        return JSONResponse(error_body(str(e), "requests", code="rate_limit_exceeded"), status_code=429,
                            headers={"Retry-After": str(e.retry_after)})

    @app.exception_handler(Unavailable)
    async def _unavailable(_: Request, e: Unavailable) -> JSONResponse:
        # No worker came within the hold timeout (the router's held queue): try again later.
        return JSONResponse(error_body(str(e), "server_error", code="service_unavailable"), status_code=503,
                            headers={"Retry-After": str(e.retry_after)})

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, e: RequestValidationError) -> JSONResponse:
        errors = e.errors()
        first = errors[0] if errors else {}
        if first.get("type") == "json_invalid":
            return _error_response(APIError(400, "the request body is not valid JSON"))
        loc = [str(x) for x in first.get("loc", []) if x != "body"]
        msg = first.get("msg", "invalid request")
        if first.get("type") == "extra_forbidden":
            msg = "this server does not implement this field"
        if not loc:
            return _error_response(APIError(400, f"the request body must be a JSON object: {msg}"))
        param = ".".join(loc) or None
        return _error_response(APIError(400, f"{param}: {msg}" if param else msg, param=param))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, e: StarletteHTTPException) -> JSONResponse:
        return _error_response(APIError(e.status_code, str(e.detail), "invalid_request_error"))


def served_names(args: argparse.Namespace, default: str) -> list[str]:
    """The names the API answers to: --served-model-name's (or the model's own), then the --model
    value the server was started with (as vLLM does). The first is the one metrics carry."""
    names = args.served_model_name or [default]
    names = [names] if isinstance(names, str) else list(names)
    return list(dict.fromkeys([*names, args.model]))


def build_openai_app(backend: Backend, served_name: str | list[str], metrics: Metrics,
                     ready: Callable[[], tuple[bool, str]], api_key: str | None = None,
                     secret: str | None = None, alive: Callable[[], tuple[bool, str]] | None = None,
                     max_body: int = DEFAULT_MAX_BODY) -> FastAPI:
    """api_key: required on the client routes (None: no key; "" is refused). secret: the internal
    secret the router's /internal/* routes need (server/guards.py checks both before the body)."""
    check_api_key(api_key)
    names = [served_name] if isinstance(served_name, str) else list(served_name)
    app = FastAPI(title="phasesplit", docs_url=None, redoc_url=None)
    app.add_middleware(Guards, api_key=api_key, secret=secret, max_body=max_body, capacity=backend.capacity)
    install_error_handlers(app)
    add_common_routes(app, metrics, ready, alive)
    tok = backend.tokenizer

    def check_model(name: str | None) -> None:
        if name is not None and name not in names:
            raise APIError(404, f"the model '{name}' does not exist; this server serves "
                                f"{', '.join(repr(n) for n in names)}", param="model", code="model_not_found")

    def sampling(req: ChatCompletionRequest | CompletionRequest, prompt_len: int) -> SamplingParams:
        default_max = max(1, backend.max_model_len - prompt_len)
        try:
            params = req.sampling(default_max)
        except (RequestError, GrammarError) as e:
            raise APIError(400, str(e), param=e.param) from None
        if isinstance(req, ChatCompletionRequest) and req.max_completion_tokens is not None:
            params.max_tokens = req.max_completion_tokens
        if req.stream and params.best_of is not None and params.best_of > params.n:
            raise APIError(400, "best_of > n cannot be streamed (the best choices are known only at the end)",
                           param="best_of")
        try:
            backend.check_request(prompt_len, params)
        except RequestError as e:
            raise APIError(400, str(e), param=e.param) from None
        return params

    @app.get("/v1/models")
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=n, root=names[0], max_model_len=backend.max_model_len)
                               for n in names])

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest) -> TokenizeResponse:
        check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "give exactly one of prompt and messages", param="prompt")
        if req.messages is not None:
            try:
                msgs = [{"role": m.role, "content": m.text()} for m in req.messages]
            except ValueError as e:
                raise APIError(400, str(e), param="messages") from None
            ids = await _render(tok, msgs, req.add_generation_prompt)
        elif req.add_special_tokens:
            ids = await asyncio.to_thread(tok.encode, req.prompt)
        else:
            ids = (await asyncio.to_thread(tok.tok.encode, req.prompt, add_special_tokens=False)).ids
        return TokenizeResponse(count=len(ids), max_model_len=backend.max_model_len, tokens=ids,
                                token_strs=[tok.token_text(t) for t in ids])

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest) -> DetokenizeResponse:
        check_model(req.model)
        if any(not 0 <= t < tok.vocab_size for t in req.tokens):
            raise APIError(400, "token ids must be within the vocabulary", param="tokens")
        return DetokenizeResponse(prompt=await asyncio.to_thread(tok.decode, req.tokens))

    @app.get("/tokenizer_info")
    async def tokenizer_info() -> dict[str, Any]:
        """vLLM's: what a client needs to tokenize as the server does (lm-eval's remote tokenizer)."""
        return {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": tok.eos_token, "bos_token": tok.bos_token,
                "pad_token": None, "model_max_length": backend.max_model_len, "vocab_size": tok.vocab_size}

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
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
            ids = await asyncio.to_thread(tok.encode, prompt)  # off the event loop
        else:
            ids = list(prompt)
            if any(not 0 <= t < tok.vocab_size for t in ids):
                raise APIError(400, "prompt token ids must be within the vocabulary", param="prompt")
        if not ids:
            raise APIError(400, "the prompt is empty", param="prompt")
        params = sampling(req, len(ids))
        rid = make_id("cmpl")
        echo = await asyncio.to_thread(tok.decode, ids) if req.echo else None
        outputs = await _start(backend, rid, ids, params, request)
        if req.stream:
            return _stream(request, rid, _completion_chunks(tok, outputs, rid, ids, req, echo))
        result = await _collect(request, outputs, rid, ids)
        choices = [CompletionChoice(index=i, text=(echo or "") + c.text, finish_reason=c.finish_reason,
                                    logprobs=_completion_logprobs(tok, c, req.echo) if req.logprobs is not None
                                    else None)
                   for i, c in enumerate(result.best(params))]
        return CompletionResponse(id=rid, model=req.model, choices=choices, usage=result.usage(),
                                  phasesplit_timing=result.timing)

    @app.post("/v1/chat/completions")
    async def chat(req: ChatCompletionRequest, request: Request):
        check_model(req.model)
        if not req.messages:
            raise APIError(400, "messages must not be empty", param="messages")
        try:
            msgs = [{"role": m.role, "content": m.text()} for m in req.messages]
        except ValueError as e:
            raise APIError(400, str(e), param="messages") from None
        ids = await _render(tok, msgs, req.add_generation_prompt)
        params = sampling(req, len(ids))
        rid = make_id("chatcmpl")
        outputs = await _start(backend, rid, ids, params, request)
        if req.stream:
            return _stream(request, rid, _chat_chunks(tok, outputs, rid, params, req))
        result = await _collect(request, outputs, rid, ids)
        choices = [ChatChoice(index=i, message=ChatResponseMessage(content=c.text), finish_reason=c.finish_reason,
                              logprobs=_chat_logprobs(tok, c.logprobs) if req.logprobs else None)
                   for i, c in enumerate(result.best(params))]
        return ChatCompletionResponse(id=rid, model=req.model, usage=result.usage(), phasesplit_timing=result.timing,
                                      choices=choices)

    return app


async def _render(tok: TextTokenizer, msgs: list[dict[str, str]], add_generation_prompt: bool) -> list[int]:
    """A conversation's prompt ids, rendered and tokenized in a thread: a long conversation must
    not stall the event loop. A template that refuses the conversation is the client's 400."""
    try:
        return await asyncio.to_thread(lambda: tok.encode(tok.apply_chat_template(msgs, add_generation_prompt)))
    except ValueError as e:
        raise APIError(400, str(e), param="messages") from None


def _finish_reason(out: RequestOutput) -> str | None:
    if not out.finished:
        return None
    return "length" if out.finish_reason == "length" else "stop"


def _usage(out: RequestOutput, completion_tokens: int | None = None) -> Usage:
    completion = out.completion_tokens if completion_tokens is None else completion_tokens
    return Usage(prompt_tokens=out.prompt_tokens, completion_tokens=completion,
                 total_tokens=out.prompt_tokens + completion,
                 prompt_tokens_details={"cached_tokens": out.cached_tokens})


# -- logprobs in the response shapes ---------------------------------------------------------


def _chat_logprobs(tok: TextTokenizer, entries: list[dict[str, Any]]) -> ChatLogprobs:
    def top(tid: int, lp: float) -> TopLogprob:
        return TopLogprob(token=tok.token_text(tid), logprob=lp, bytes=list(tok.token_bytes(tid)))

    return ChatLogprobs(content=[
        ChatTokenLogprob(token=tok.token_text(e["id"]), logprob=e["logprob"], bytes=list(tok.token_bytes(e["id"])),
                         top_logprobs=[top(t, lp) for t, lp in e["top"]])
        for e in entries])


def _completion_logprobs(tok: TextTokenizer, c: _Choice, echo: bool, offset: int = 0) -> CompletionLogprobs:
    entries: list[tuple[int, dict[str, Any] | None]] = []
    if echo and c.prompt_logprobs is not None:
        entries += [(tid, e) for tid, e in zip(c.prompt_ids, c.prompt_logprobs, strict=True)]
    entries += [(e["id"], e) for e in c.logprobs]
    out = CompletionLogprobs()
    for tid, e in entries:
        text = tok.token_text(tid)
        out.tokens.append(text)
        out.text_offset.append(offset)
        offset += len(text)
        if e is None:  # the first prompt token: nothing predicts it
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
            continue
        out.token_logprobs.append(e["logprob"])
        # vLLM's shape: the k most likely tokens and the chosen one.
        tops = {tok.token_text(t): lp for t, lp in e["top"]}
        tops.setdefault(text, e["logprob"])
        out.top_logprobs.append(tops)
    return out


@dataclass
class _Choice:
    """One choice's outputs gathered (non-streaming)."""
    prompt_ids: list[int]
    parts: list[str] = field(default_factory=list)
    logprobs: list[dict[str, Any]] = field(default_factory=list)
    prompt_logprobs: list[dict[str, Any] | None] | None = None
    last: RequestOutput | None = None

    @property
    def text(self) -> str:
        return "".join(self.parts)

    @property
    def finish_reason(self) -> str | None:
        return _finish_reason(self.last) if self.last is not None else None

    def add(self, out: RequestOutput) -> None:
        self.parts.append(out.text)
        self.logprobs.extend(out.logprobs or [])
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        self.last = out


@dataclass
class _Result:
    choices: dict[int, _Choice]
    timing: dict[str, float] | None = None

    def best(self, params: SamplingParams) -> list[_Choice]:
        """The choices to return, in index order; with best_of > n the n of highest logprob."""
        ordered = [self.choices[i] for i in sorted(self.choices)]
        if params.best_of is not None and params.best_of > params.n:
            ordered.sort(key=lambda c: -(c.last.cumulative_logprob or 0.0) if c.last else 0.0)
            ordered = ordered[: params.n]
        # Prompt logprobs ride on choice 0's first output; every returned choice echoes them.
        prompt_lps = next((c.prompt_logprobs for c in self.choices.values() if c.prompt_logprobs), None)
        for c in ordered:
            c.prompt_logprobs = c.prompt_logprobs or prompt_lps
        return ordered

    def usage(self) -> Usage:
        lasts = [c.last for c in self.choices.values() if c.last is not None]
        return _usage(lasts[0], sum(o.completion_tokens for o in lasts))


async def _admitted(backend: Backend, rid: str, ids: list[int], params: SamplingParams
                    ) -> AsyncIterator[RequestOutput]:
    ticket = backend.admit(len(ids), params.num_seqs)
    try:
        async for out in backend.generate(rid, ids, params):
            yield out
    finally:  # however it ends: finished, failed, or the client left
        ticket.release()


async def _first(gen: AsyncIterator[RequestOutput], request: Request | None) -> RequestOutput:
    """The first output, or APIError 499 once the client has gone: a request may wait long for
    it (held at the router for a worker, queued), and one whose client left must stop waiting
    (and leave the router's held queue, or the worker's queue) rather than run for no one."""
    task = asyncio.ensure_future(anext(gen))
    while True:
        done, _ = await asyncio.wait({task}, timeout=0.5)
        if done:
            return task.result()
        if request is not None and await request.is_disconnected():
            task.cancel()
            try:
                await task
            except (asyncio.CancelledError, Exception):  # noqa: BLE001 - the request is abandoned
                pass
            await gen.aclose()
            raise APIError(499, "the client closed the request")


async def _start(backend: Backend, rid: str, ids: list[int], params: SamplingParams,
                 request: Request | None = None) -> AsyncIterator[RequestOutput]:
    """Admit the request and wait for its first output, so that what fails before any token
    (overload, a bad request, no worker) gets its HTTP status instead of a 200 with an error event."""
    gen = _admitted(backend, rid, ids, params)
    try:
        first = await _first(gen, request)
    except (Overloaded, Unavailable, APIError):
        raise
    except (RequestError, GrammarError) as e:
        raise APIError(400, str(e), param=e.param) from None
    except Exception as e:  # noqa: BLE001 - the backend's failure, reported as the server's
        log.warning("request %s failed: %s", rid, e)
        raise APIError(503, f"generation failed: {e}", "server_error") from None

    async def rest() -> AsyncIterator[RequestOutput]:
        try:
            yield first
            async for out in gen:  # it ends after the last choice's last output
                yield out
        finally:
            await gen.aclose()

    return rest()


async def _collect(request: Request, outputs: AsyncIterator[RequestOutput], rid: str, ids: list[int]) -> _Result:
    """Run a non-streaming request; abort it if the client goes away."""
    result = _Result({})

    async def run() -> None:
        try:
            async for out in outputs:
                result.choices.setdefault(out.index, _Choice(ids)).add(out)
                if out.timing is not None:
                    result.timing = out.timing
        finally:
            await outputs.aclose()  # aborts the request and gives its admission back

    task = asyncio.create_task(run())
    left = False
    try:
        while not task.done():
            done, _ = await asyncio.wait({task}, timeout=0.5)
            if not done and await request.is_disconnected():
                left = True
                task.cancel()
                break
        await task
    except asyncio.CancelledError:
        if not left:  # this handler itself is being cancelled (shutdown)
            raise
        # The client left and the request is aborted: answer no one, log no traceback.
        raise APIError(499, "the client closed the request") from None
    except RequestError as e:
        raise APIError(400, str(e), param=e.param) from None
    except Exception as e:  # backend failure: report it as the server's fault
        log.warning("request %s failed: %s", rid, e)
        raise APIError(503, f"generation failed: {e}", "server_error") from None
    assert result.choices
    return result


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
    """SSE events of one request: a chunk per text delta of any choice (choices interleave, each
    chunk naming its `index`), an optional usage chunk, then [DONE].

    `chunk(out, None)` builds a delta chunk, `chunk(None, usage)` the usage chunk.
    """
    lasts: dict[int, RequestOutput] = {}
    async for out in _guarded(outputs):
        if isinstance(out, dict):  # an error event ends the stream
            yield _sse(out)
            break
        lasts[out.index] = out
        if out.text or out.finished or out.logprobs or out.prompt_logprobs:
            yield _sse(chunk(out, None))
    if lasts and all(o.finished for o in lasts.values()) and include_usage:
        first = next(iter(lasts.values()))
        yield _sse(chunk(None, _usage(first, sum(o.completion_tokens for o in lasts.values()))))
    yield "data: [DONE]\n\n"


def _completion_chunks(tok: TextTokenizer, outputs: AsyncIterator[RequestOutput], rid: str, ids: list[int],
                       req: CompletionRequest, echo: str | None) -> AsyncIterator[str]:
    offsets: dict[int, int] = {}  # per choice: characters streamed so far (logprobs' text_offset)

    def chunk(out: RequestOutput | None, usage: Usage | None) -> CompletionResponse:
        choices = []
        if out is not None:
            first = out.index not in offsets
            text = (echo or "") + out.text if first else out.text
            lps = None
            if req.logprobs is not None:
                c = _Choice(ids, logprobs=out.logprobs or [], prompt_logprobs=out.prompt_logprobs)
                lps = _completion_logprobs(tok, c, bool(req.echo) and first, offsets.get(out.index, 0))
            offsets[out.index] = offsets.get(out.index, 0) + len(text)
            choices = [CompletionChoice(index=out.index, text=text, finish_reason=_finish_reason(out), logprobs=lps)]
        return CompletionResponse(id=rid, model=req.model, choices=choices, usage=usage,
                                  phasesplit_timing=out.timing if out is not None else None)

    return _events(outputs, req.include_usage, chunk)


async def _chat_chunks(tok: TextTokenizer, outputs: AsyncIterator[RequestOutput], rid: str, params: SamplingParams,
                       req: ChatCompletionRequest) -> AsyncIterator[str]:

    def chunk(out: RequestOutput | None, usage: Usage | None) -> ChatCompletionChunk:
        choices = []
        if out is not None:
            lps = _chat_logprobs(tok, out.logprobs or []) if req.logprobs else None
            choices = [ChatChunkChoice(index=out.index, delta=ChatDelta(content=out.text or None),
                                       finish_reason=_finish_reason(out), logprobs=lps)]
        return ChatCompletionChunk(id=rid, model=req.model, choices=choices, usage=usage,
                                   phasesplit_timing=out.timing if out is not None else None)

    yield _sse(ChatCompletionChunk(id=rid, model=req.model, choices=[
        ChatChunkChoice(index=i, delta=ChatDelta(role="assistant", content="")) for i in range(params.n)]))
    async for event in _events(outputs, req.include_usage, chunk):
        yield event
