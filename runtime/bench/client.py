"""HTTP side: check the target, stream one request, and time every chunk.

Works with any OpenAI-compatible server (/v1/models, /v1/completions, /v1/chat/completions with
`stream: true`). Optional fields that only some servers accept (ignore_eos, min_tokens,
stream_options) are probed once and dropped if the server rejects them, so one tool measures
phasesplit, vLLM and llama.cpp alike.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

import httpx

from .metrics import RequestResult
from .workload import RequestSpec

ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


class BenchError(RuntimeError):
    """A problem that stops the benchmark before or between runs; the message is for the user."""


@dataclass
class Target:
    base_url: str
    model: str
    endpoint: str = "completions"  # a key of ENDPOINTS
    temperature: float = 0.0
    # Fields sent with every request beyond the OpenAI core; the probe may remove some.
    extra: dict = field(default_factory=dict)
    api_key: str | None = None

    @property
    def url(self) -> str:
        return self.base_url + ENDPOINTS[self.endpoint]

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


def describe_transport_error(e: Exception, url: str) -> str:
    if isinstance(e, httpx.ConnectError):
        return f"cannot connect to {url} ({e or 'connection refused'})"
    if isinstance(e, httpx.TimeoutException):
        return f"timed out waiting for {url}"
    if isinstance(e, httpx.RemoteProtocolError):
        return f"{url} closed the connection mid-response ({e})"
    return f"{type(e).__name__} talking to {url}: {e}"


def error_message(status: int, body: bytes) -> str:
    """The server's own words for a failed request: OpenAI's error shape, FastAPI's detail, or text."""
    text = body.decode("utf-8", "replace").strip()
    try:
        obj = json.loads(text)
    except ValueError:
        return f"HTTP {status}: {text[:300] or '(empty body)'}"
    if isinstance(obj, dict):
        err = obj.get("error")
        if isinstance(err, dict) and err.get("message"):
            return f"HTTP {status}: {err['message']}"
        if isinstance(err, str):
            return f"HTTP {status}: {err}"
        if "detail" in obj:
            return f"HTTP {status}: {obj['detail']}"
        if "message" in obj:
            return f"HTTP {status}: {obj['message']}"
    return f"HTTP {status}: {text[:300]}"


async def served_models(
    client: httpx.AsyncClient, base_url: str, headers: Mapping[str, str] | None = None
) -> dict[str, str]:
    """Model id -> owned_by, as /v1/models lists them; BenchError if the server cannot be asked."""
    url = base_url + "/v1/models"
    try:
        resp = await client.get(url, headers=dict(headers or {}))
    except httpx.HTTPError as e:
        raise BenchError(describe_transport_error(e, url)) from None
    if resp.status_code != 200:
        raise BenchError(f"{url} answered {error_message(resp.status_code, resp.content)}")
    try:
        data = resp.json()["data"]
        served = ServedModels((m["id"], str(m.get("owned_by", ""))) for m in data)
        served.one_model = len({m.get("root") or m["id"] for m in data}) == 1
    except (ValueError, KeyError, TypeError, AttributeError):
        raise BenchError(f"{url} did not return an OpenAI model list: {resp.text[:200]!r}") from None
    return served


class ServedModels(dict):
    """Model id -> owned_by, in the server's order. `one_model`: every id names the same model
    (aliases, which a server marks with a common `root` as vLLM does); the first is the default."""

    one_model = False


def choose_model(served: Mapping[str, str], wanted: str | None, base_url: str) -> str:
    if wanted is None:
        if len(served) == 1 or getattr(served, "one_model", False):
            return next(iter(served))
        raise BenchError(f"{base_url} serves {', '.join(served) or 'no models'}; pick one with --model")
    if wanted not in served:
        raise BenchError(f"model {wanted!r} is not served by {base_url}; it serves: {', '.join(served) or 'nothing'}")
    return wanted


def request_body(target: Target, prompt: str, max_tokens: int, stream: bool = True) -> dict:
    body: dict = {"model": target.model, "max_tokens": max_tokens, "temperature": target.temperature,
                  "stream": stream}
    if target.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    for k, v in target.extra.items():
        # min_tokens carries the request's own length so that ignore_eos-less servers that do
        # know min_tokens still produce the full output.
        body[k] = max_tokens if k == "min_tokens" else v
    if not stream:
        body.pop("stream_options", None)
    return body


def _parse_timing(obj: object) -> dict[str, float] | None:
    """phasesplit's per-request phase times; every numeric field, in seconds (`*_ms` converted)."""
    if not isinstance(obj, dict):
        return None
    out = {}
    for k, v in obj.items():
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            if k.endswith("_ms"):
                out[k[:-3]] = v / 1000.0
            elif k.endswith("_s"):
                out[k[:-2]] = float(v)
            else:
                out[k] = float(v)
    return out or None


def _chunk_text(choice: Mapping) -> str:
    if "delta" in choice:
        return (choice.get("delta") or {}).get("content") or ""
    return choice.get("text") or ""


async def stream_one(
    client: httpx.AsyncClient, target: Target, spec: RequestSpec, prompt: str, run_t0: float
) -> RequestResult:
    """Send one streaming request and record what arrived when. Never raises for server faults."""
    r = RequestResult(index=spec.index, kind=spec.kind, prompt_len=spec.prompt_len, output_len=spec.output_len)
    body = request_body(target, prompt, spec.output_len)
    chunks = 0
    finished = False
    t0 = time.perf_counter()
    r.start_s = t0 - run_t0
    try:
        async with client.stream("POST", target.url, json=body, headers=target.headers()) as resp:
            r.status = resp.status_code
            if resp.status_code != 200:
                r.error = error_message(resp.status_code, await resp.aread())
                return r
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                now = time.perf_counter() - t0
                payload = line[5:].strip()
                if payload == "[DONE]":
                    finished = True
                    break
                try:
                    obj = json.loads(payload)
                except ValueError:
                    r.error = f"malformed stream chunk: {payload[:200]!r}"
                    return r
                if "error" in obj:
                    err = obj["error"]
                    r.error = "error event: " + (err.get("message", str(err)) if isinstance(err, dict) else str(err))
                    return r
                for choice in obj.get("choices") or []:
                    if _chunk_text(choice):
                        r.chunk_times_s.append(now)
                        chunks += 1
                    if choice.get("finish_reason"):
                        finished = True
                usage = obj.get("usage")
                if isinstance(usage, dict):
                    if usage.get("completion_tokens") is not None:
                        r.output_tokens = int(usage["completion_tokens"])
                    if usage.get("prompt_tokens") is not None:
                        r.server_prompt_tokens = int(usage["prompt_tokens"])
                    details = usage.get("prompt_tokens_details")
                    if isinstance(details, dict) and details.get("cached_tokens") is not None:
                        r.cached_tokens = int(details["cached_tokens"])
                timing = _parse_timing(obj.get("phasesplit_timing"))
                if timing:
                    r.phase_timing = timing
    except httpx.HTTPError as e:
        r.error = describe_transport_error(e, target.url)
        return r
    r.e2el_s = time.perf_counter() - t0
    if not finished:
        r.error = "stream ended without a finish_reason or [DONE]"
        return r
    r.ok = True
    r.ttft_s = r.chunk_times_s[0] if r.chunk_times_s else None
    if r.output_tokens == 0:
        r.output_tokens = chunks
    return r


async def post_once(client: httpx.AsyncClient, target: Target, prompt: str, max_tokens: int) -> tuple[int, dict | str]:
    """A non-streaming request: (status, JSON body or error message)."""
    try:
        resp = await client.post(target.url, json=request_body(target, prompt, max_tokens, stream=False),
                                 headers=target.headers())
    except httpx.HTTPError as e:
        raise BenchError(describe_transport_error(e, target.url)) from None
    if resp.status_code != 200:
        return resp.status_code, error_message(resp.status_code, resp.content)
    try:
        return 200, resp.json()
    except ValueError:
        return resp.status_code, f"not JSON: {resp.text[:200]!r}"


async def remote_token_count(client: httpx.AsyncClient, target: Target, text: str) -> int | None:
    """Tokens the server itself counts in `text` (vLLM's /tokenize, which phasesplit serves too),
    no special tokens added; None when the server has no such endpoint."""
    try:
        resp = await client.post(target.base_url + "/tokenize", headers=target.headers(),
                                 json={"model": target.model, "prompt": text, "add_special_tokens": False})
        tokens = resp.json().get("tokens") if resp.status_code == 200 else None
    except (httpx.HTTPError, ValueError, AttributeError):
        return None
    return len(tokens) if isinstance(tokens, list) else None


OPTIONAL_FIELDS = ("ignore_eos", "min_tokens", "stream_options")


async def probe(client: httpx.AsyncClient, target: Target, prompt: str, prompt_tokens: int) -> tuple[int | None, list[str]]:
    """A small streaming request that checks the endpoint works and learns what the server adds.

    Returns (tokens the server adds around a prompt, e.g. BOS or the chat template, or None if it
    reports no usage; notes for the user). Optional fields the server rejects are dropped from
    target.extra. A failure that is not about those fields is a BenchError.
    """
    notes = []
    spec = RequestSpec(-1, prompt_tokens, 2, "probe")
    while True:
        r = await stream_one(client, target, spec, prompt, time.perf_counter())
        if r.ok:
            break
        if r.status is None:  # never got an HTTP answer
            raise BenchError(r.error or f"no answer from {target.url}")
        dropped = next((k for k in OPTIONAL_FIELDS if k in target.extra and k in (r.error or "")), None)
        if dropped is None and r.status in (400, 422) and target.extra:
            # Some servers reject unknown fields without naming them: drop one at a time.
            dropped = next(k for k in OPTIONAL_FIELDS if k in target.extra)
        if dropped is None:
            raise BenchError(f"the first request to {target.url} failed: {r.error}")
        target.extra.pop(dropped)
        notes.append(f"the server rejected '{dropped}'; sending without it")
    counted = r.server_prompt_tokens
    if counted is None:
        # Not every server puts usage in streams; the non-streaming answer usually has it.
        status, body = await post_once(client, target, prompt, 1)
        usage = body.get("usage") if status == 200 and isinstance(body, dict) else None
        if isinstance(usage, dict) and usage.get("prompt_tokens") is not None:
            counted = int(usage["prompt_tokens"])
    if counted is None:
        notes.append("the server reports no usage; prompt lengths are as built, unverified")
        return None, notes
    return counted - prompt_tokens, notes
