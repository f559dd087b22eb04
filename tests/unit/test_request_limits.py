"""Request validation ranges, admission bookkeeping and the pre-body guards (pure or in-process)."""

from __future__ import annotations

import asyncio
import math

import httpx
import pytest
from fastapi import FastAPI, Request
from pydantic import ValidationError

from phasesplit.runtime import internal_secret
from phasesplit.runtime.request import Overloaded, RequestError, SamplingParams
from phasesplit.runtime.server.admission import Admission
from phasesplit.runtime.server.guards import Guards
from phasesplit.runtime.server.protocol import ChatCompletionRequest, CompletionRequest


@pytest.mark.parametrize("field,value", [
    ("temperature", -0.1), ("temperature", 2.5), ("temperature", math.nan), ("temperature", math.inf),
    ("top_p", 0.0), ("top_p", 1.5), ("top_p", math.nan), ("top_k", -2), ("max_tokens", 0),
    ("min_tokens", 99), ("stop", ["x"] * 17), ("stop", ["y" * 257]), ("stop_token_ids", [49152]),
    ("stop_token_ids", [-1]), ("seed", 2**70),
])
def test_sampling_ranges_name_the_field(field, value):
    p = SamplingParams(**{"max_tokens": 16, field: value})
    with pytest.raises(RequestError) as e:
        p.validate(vocab_size=49152)
    assert e.value.param == field


def test_tiny_temperature_is_greedy():
    for t in (0.0, 1e-50, 9e-6):
        p = SamplingParams(temperature=t)
        p.validate(49152)
        assert p.greedy
    assert not SamplingParams(temperature=1e-4).greedy


def test_protocol_refuses_unimplemented_and_unknown_fields():
    base = {"model": "m", "prompt": "hi"}
    for extra in ({"presence_penalty": 0.5}, {"frequency_penalty": 3}, {"logit_bias": {"1": 5}},
                  {"suffix": "x"}, {"wizardry": 1}, {"temperature": math.nan}, {"top_p": math.inf},
                  # implemented, checked in their ranges
                  {"logprobs": 6}, {"logprobs": -1}, {"best_of": 17}, {"best_of": 0}, {"n": 0}, {"n": 17}):
        with pytest.raises(ValidationError) as e:
            CompletionRequest.model_validate({**base, **extra})
        assert next(iter(extra)) in str(e.value)
    # The neutral values SDKs send are accepted, and what main implements is.
    CompletionRequest.model_validate({**base, "presence_penalty": 0, "logit_bias": None, "best_of": 1,
                                      "echo": False, "logprobs": None, "user": "u"})
    ok = CompletionRequest.model_validate({**base, "echo": True, "logprobs": 5, "best_of": 3, "n": 2}).sampling(8)
    ok.validate(49152)
    assert (ok.logprobs, ok.prompt_logprobs, ok.best_of, ok.n) == (5, 5, 3, 2)
    CompletionRequest.model_validate({**base, "top_k": -1}).sampling(8).validate()
    with pytest.raises(RequestError) as err:  # best_of must be at least n
        CompletionRequest.model_validate({**base, "best_of": 2, "n": 3}).sampling(8).validate()
    assert err.value.param == "best_of"
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    ChatCompletionRequest.model_validate({**chat, "logprobs": False, "tools": None, "echo": False})
    ChatCompletionRequest.model_validate({**chat, "logprobs": True, "top_logprobs": 20}).sampling(8).validate()
    for bad in ({"messages": [{"role": "wizard", "content": "x"}]},
                {"messages": [{"role": "user", "content": "x"}] * 1025},
                {"top_logprobs": 21, "logprobs": True}, {"top_logprobs": -1, "logprobs": True},
                {"best_of": 2}, {"echo": True}):
        with pytest.raises(ValidationError) as e:
            ChatCompletionRequest.model_validate({**chat, **bad})
        assert next(iter(bad)) in str(e.value)
    for bad, param in (({"top_logprobs": 3}, "top_logprobs"),  # without logprobs: true
                       ({"response_format": {"type": "xml"}}, "response_format.type"),
                       ({"response_format": {"type": "json_schema", "json_schema": {"schema": 3}}},
                        "response_format.json_schema"),
                       ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice")):
        with pytest.raises(RequestError) as err:
            ChatCompletionRequest.model_validate({**chat, **bad}).sampling(8)
        assert err.value.param == param, (bad, err.value.param)


def test_admission_bounds_requests_and_tokens():
    a = Admission(max_requests=2, max_tokens=100)
    big = a.admit(500)  # an idle server always takes one request
    with pytest.raises(Overloaded):
        a.admit(1)
    big.release()
    big.release()  # idempotent
    assert (a.requests, a.tokens) == (0, 0)
    t1, t2 = a.admit(40), a.admit(40)
    with pytest.raises(Overloaded):
        a.admit(1)  # request count
    t2.release()
    with pytest.raises(Overloaded):
        a.admit(61)  # token count
    a.admit(60)
    t1.release()
    assert a.rejected == 3 and a.requests == 1


SECRET = "internal-secret-0123456789"


def _guarded_app(api_key: str | None, max_body: int, **kw) -> FastAPI:
    app = FastAPI()
    app.add_middleware(Guards, api_key=api_key, secret=SECRET, max_body=max_body, **kw)

    @app.post("/v1/echo")
    async def echo(request: Request) -> dict:
        return {"n": len(await request.body())}

    @app.get("/health")
    async def health() -> dict:
        return {"ok": True}

    @app.get("/debug/state")
    async def debug() -> dict:
        return {"ok": True}

    @app.post("/internal/echo")
    async def internal(request: Request) -> dict:
        return {"n": len(await request.body())}

    return app


def test_guards_key_and_body_size():
    async def run() -> None:
        app = _guarded_app("s3cret", 1000)
        seen: list[str] = []

        async def spy(scope, receive, send):  # what reaches the app: nothing of a refused request
            async def rx():
                m = await receive()
                seen.append(scope["path"])
                return m
            await app(scope, rx, send)

        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=spy), base_url="http://t") as c:
            for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": "s3cret"}):
                r = await c.post("/v1/echo", content=b"x", headers=headers)
                assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
            assert not seen  # refused before the body was read
            assert (await c.get("/health")).status_code == 200  # probes need no key
            ok = {"Authorization": "Bearer s3cret"}
            assert (await c.post("/v1/echo", content=b"x" * 1000, headers=ok)).json() == {"n": 1000}
            r = await c.post("/v1/echo", content=b"x" * 1001, headers=ok)
            assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

            async def chunks():  # no Content-Length: counted as it arrives
                for _ in range(20):
                    yield b"x" * 100
            r = await c.post("/v1/echo", content=chunks(), headers=ok)
            assert r.status_code == 413
            # The internal secret, not the API key, opens /internal/*.
            for headers in ({}, ok, {internal_secret.HEADER: "wrong-but-long-enough-secret"}):
                r = await c.post("/internal/echo", content=b"x", headers=headers)
                assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
            r = await c.post("/internal/echo", content=b"xy", headers=internal_secret.headers(SECRET))
            assert r.json() == {"n": 2}

    asyncio.run(run())
    with pytest.raises(ValueError, match="empty"):
        Guards(_guarded_app(None, 10), api_key="")


def test_guards_split_worker_debug_needs_the_secret():
    async def run() -> None:
        app = _guarded_app(None, 1000, internal_prefixes=("/internal/", "/debug/"))
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            assert (await c.get("/debug/state")).status_code == 401
            assert (await c.get("/debug/state", headers=internal_secret.headers(SECRET))).status_code == 200
            assert (await c.post("/v1/echo", content=b"x")).status_code == 200  # no API key configured

    asyncio.run(run())


def test_guards_gate_refuses_generations_beyond_capacity_before_the_body():
    async def run() -> None:
        app = FastAPI()
        release = asyncio.Event()
        bodies: list[int] = []

        @app.post("/v1/completions")
        async def completions(request: Request) -> dict:
            bodies.append(len(await request.body()))
            await release.wait()
            return {"ok": True}

        @app.post("/tokenize")
        async def tokenize() -> dict:
            return {"ok": True}

        gated = Guards(app, capacity=lambda: 1)  # lets 2 x 1 past the gate
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=gated), base_url="http://t") as c:
            first = [asyncio.create_task(c.post("/v1/completions", content=b"{}")) for _ in range(2)]
            while gated.generating < 2:
                await asyncio.sleep(0.01)
            r = await c.post("/v1/completions", content=b"x" * 100)
            assert r.status_code == 429 and r.headers["retry-after"] == "1", r.text
            assert r.json()["error"]["code"] == "rate_limit_exceeded"
            assert (await c.post("/tokenize")).status_code == 200  # not a generation: not gated
            release.set()
            assert [(await t).status_code for t in first] == [200, 200]
            assert gated.generating == 0 and bodies == [2, 2]  # the refused body was never read
            assert (await c.post("/v1/completions", content=b"{}")).status_code == 200

    asyncio.run(run())
