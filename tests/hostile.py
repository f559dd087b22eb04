"""Hostile requests for the serving tests: hand-picked cases and a schema-driven fuzzer.

The fuzzer reads the server's own OpenAPI schema (/openapi.json), generates request bodies from
it with hypothesis (`schema_strategy`: the JSON-schema subset pydantic emits), and mutates one field of each to a hostile value (NaN, inf, tiny
and huge numbers, wrong types, long strings). It sends them in concurrent batches over raw httpx
and checks the rule that matters: no 5xx other than a 503 or 429 that says why, and after every
batch the server still answers a normal request.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

# Values that have broken servers: non-finite and extreme numbers, wrong types, big strings.
HOSTILE_VALUES = [math.nan, math.inf, -math.inf, 1e-50, -1e-50, 1e308, -1e308, 0, -1, 2**31, 2**64, 2**80,
                  -(2**80), 0.5, 3.0, "", "x" * 5000, "\x00\ud7ff\uffff", None, True, [], {}, [[]], [-1],
                  [2**40], {"a": 1}, ["stop"] * 200, ["s" * 2000]]
ROUTES = {"/v1/completions": "CompletionRequest", "/v1/chat/completions": "ChatCompletionRequest"}


def fuzz_requests() -> int:
    """Requests per fuzz run (CI size by default)."""
    return int(os.environ.get("PHASESPLIT_FUZZ_REQUESTS", "5000"))


@dataclass
class FuzzStats:
    statuses: Counter = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)
    batches: int = 0

    @property
    def total(self) -> int:
        return sum(self.statuses.values())


_JSON_SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-10, 10), st.floats(-3, 3), st.text(max_size=8))


def schema_strategy(schema: dict, components: dict, depth: int = 0) -> st.SearchStrategy:
    """Values of a JSON schema: the subset pydantic writes (refs, anyOf, enums, objects, arrays,
    strings, numbers with bounds). Objects get their required fields and a random share of the rest."""
    if "$ref" in schema:
        return schema_strategy(components["schemas"][schema["$ref"].rsplit("/", 1)[1]], components, depth)
    if "const" in schema:
        return st.just(schema["const"])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    if "anyOf" in schema or "oneOf" in schema:
        return st.one_of([schema_strategy(s, components, depth) for s in schema.get("anyOf", schema.get("oneOf"))])
    t = schema.get("type")
    if t == "null":
        return st.none()
    if t == "boolean":
        return st.booleans()
    if t == "integer":
        return st.integers(schema.get("minimum", -(2**33)), schema.get("maximum", 2**33))
    if t == "number":
        return st.floats(schema.get("minimum"), schema.get("maximum"), allow_nan=False, allow_infinity=False)
    if t == "string":
        return st.text(max_size=min(schema.get("maxLength", 40), 40))
    if t == "array":
        items = schema_strategy(schema.get("items", {}), components, depth + 1) if depth < 4 else _JSON_SCALARS
        return st.lists(items, min_size=schema.get("minItems", 0), max_size=min(schema.get("maxItems", 4), 4))
    if t == "object" or "properties" in schema:
        props = schema.get("properties", {})
        required = set(schema.get("required", []))
        fields = {k: schema_strategy(v, components, depth + 1) for k, v in props.items()} if depth < 4 else {}

        @st.composite
        def obj(draw: st.DrawFn) -> dict:
            out = {}
            for k, strat in fields.items():
                if k in required or draw(st.booleans()):
                    out[k] = draw(strat)
            return out

        if not props:
            return st.dictionaries(st.text(max_size=6), _JSON_SCALARS, max_size=3)
        return obj()
    return _JSON_SCALARS


def _body_strategy(openapi: dict, schema_name: str, model: str) -> st.SearchStrategy[dict]:
    components = openapi.get("components", {})
    valid = schema_strategy({"$ref": f"#/components/schemas/{schema_name}"}, components)

    text = st.text(min_size=1, max_size=30)
    sampling = {"temperature": st.floats(0, 2), "top_p": st.floats(0.01, 1), "top_k": st.integers(-1, 50),
                "seed": st.integers(0, 2**32), "stop": st.lists(st.text(min_size=1, max_size=4), max_size=3),
                "stream": st.booleans(), "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
                "ignore_eos": st.booleans(), "min_tokens": st.integers(0, 1), "user": st.text(max_size=8),
                "stop_token_ids": st.lists(st.integers(0, 49151), max_size=3), "presence_penalty": st.just(0)}
    # Structured outputs, logprobs and choices: valid values, so the engine paths behind them run.
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}}}
    sampling |= {"n": st.integers(1, 3), "seed": st.integers(0, 2**32),
                 "response_format": st.sampled_from([{"type": "text"}, {"type": "json_object"},
                                                     {"type": "json_schema", "json_schema": {"name": "s",
                                                                                             "schema": schema}}]),
                 "guided_regex": st.sampled_from(["[0-9]+", "(yes|no)", "a{1,3}b?", "\\w+@\\w+"]),
                 "guided_choice": st.lists(st.text(min_size=1, max_size=6), min_size=1, max_size=3),
                 "guided_json": st.just(schema)}
    if schema_name == "ChatCompletionRequest":
        roles = st.sampled_from(["system", "user", "assistant", "developer"])
        core = {"messages": st.lists(st.fixed_dictionaries({"role": roles, "content": text}), min_size=1, max_size=4)}
        sampling |= {"logprobs": st.booleans(), "top_logprobs": st.integers(0, 20)}
    else:
        core = {"prompt": st.one_of(text, st.lists(st.integers(0, 49151), min_size=1, max_size=20))}
        sampling |= {"logprobs": st.integers(0, 5), "echo": st.booleans(), "best_of": st.integers(1, 3)}

    @st.composite
    def near_valid(draw: st.DrawFn) -> dict:
        b = {"model": model, **{k: draw(v) for k, v in core.items()}}
        for k in draw(st.lists(st.sampled_from(sorted(sampling)), unique=True, max_size=5)):
            b[k] = draw(sampling[k])
        return b

    @st.composite
    def body(draw: st.DrawFn) -> dict:
        # Three in four straight from the schema (mostly refused), one a valid request that runs.
        b = dict(draw(valid) if draw(st.integers(0, 3)) != 1 else draw(near_valid()))
        # Mostly our model and a tiny max_tokens, so accepted requests stay cheap on CPU.
        if draw(st.integers(0, 9)) < 8:
            b["model"] = model
        b["max_tokens"] = draw(st.integers(1, 2))
        b.pop("max_completion_tokens", None)
        if draw(st.integers(0, 2)) == 0:
            key = draw(st.sampled_from(sorted(b) + ["temperature", "top_p", "top_k", "stop", "stop_token_ids",
                                                   "min_tokens", "seed", "n", "presence_penalty", "messages",
                                                   "prompt", "stream", "logprobs", "echo", "best_of", "wizard",
                                                   "top_logprobs", "response_format", "guided_json",
                                                   "guided_regex", "guided_choice", "guided_grammar"]))
            b[key] = draw(st.sampled_from(HOSTILE_VALUES))  # a hostile max_tokens is refused before any work
        return b

    return body()


def _bad_5xx(r: httpx.Response) -> bool:
    if r.status_code < 500:
        return False
    if r.status_code in (503, 429):
        try:
            return not r.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            return True
    return True


def normal_request(url: str, headers: dict, model: str) -> None:
    r = httpx.post(url + "/v1/completions", headers=headers, timeout=120,
                   json={"model": model, "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200, f"a normal request failed after hostile ones: {r.status_code} {r.text}"
    assert r.json()["usage"]["completion_tokens"] >= 1


def run_fuzz(url: str, headers: dict, model: str, total: int, batch: int = 25) -> FuzzStats:
    openapi = httpx.get(url + "/openapi.json", timeout=30).json()
    stats = FuzzStats()
    strategies = {route: _body_strategy(openapi, name, model) for route, name in ROUTES.items()}
    route_and_body = st.sampled_from(sorted(ROUTES)).flatmap(lambda route: st.tuples(st.just(route),
                                                                                      strategies[route]))

    async def send(client: httpx.AsyncClient, route: str, body: dict) -> None:
        data = json.dumps(body, allow_nan=True)  # NaN/Infinity literals: Python's JSON parser takes them
        r = await client.post(route, content=data, headers={**headers, "Content-Type": "application/json"})
        stats.statuses[r.status_code] += 1
        if _bad_5xx(r) or (r.status_code == 200 and '"server_error"' in r.text):
            stats.failures.append(f"{route} {data[:300]} -> {r.status_code} {r.text[:300]}")

    async def send_batch(items: list[tuple[str, dict]]) -> None:
        async with httpx.AsyncClient(base_url=url, timeout=300) as client:
            await asyncio.gather(*(send(client, route, body) for route, body in items))

    @settings(max_examples=max(1, total // batch), deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(st.lists(route_and_body, min_size=batch, max_size=batch))
    def one_batch(items: list[tuple[str, dict]]) -> None:
        asyncio.run(send_batch(items))
        stats.batches += 1
        if stats.batches % 40 == 0:  # progress: a CI-size run takes minutes
            print(f"  fuzz {url}: {stats.total} requests in {time.monotonic() - t0:.0f}s, "
                  f"statuses {dict(sorted(stats.statuses.items()))}", flush=True)
        normal_request(url, headers, model)
        assert not stats.failures, "\n".join(stats.failures[:10])

    t0 = time.monotonic()
    one_batch()
    # Hypothesis skips examples whose draws overran its buffer: every batch must have been sent.
    assert stats.batches == max(1, total // batch), f"only {stats.batches} batches of {total // batch} ran"
    return stats


@dataclass
class Case:
    name: str
    path: str
    body: object  # a dict (sent as JSON, NaN allowed) or raw bytes
    status: int
    param: str | None = None


def hostile_cases(model: str) -> list[Case]:
    """Each gets its 4xx (and names the field where there is one)."""
    c, ch = "/v1/completions", "/v1/chat/completions"
    p = {"model": model, "prompt": "Hello", "max_tokens": 2}
    m = {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    cases = [
        Case("temperature NaN", c, {**p, "temperature": math.nan}, 400, "temperature"),
        Case("temperature inf", c, {**p, "temperature": math.inf}, 400, "temperature"),
        Case("temperature -1", c, {**p, "temperature": -1}, 400, "temperature"),
        Case("temperature 2.5", ch, {**m, "temperature": 2.5}, 400, "temperature"),
        Case("top_p NaN", c, {**p, "top_p": math.nan}, 400, "top_p"),
        Case("top_p 0", c, {**p, "top_p": 0}, 400, "top_p"),
        Case("top_p 1.5", ch, {**m, "top_p": 1.5}, 400, "top_p"),
        Case("top_k -5", c, {**p, "top_k": -5}, 400, "top_k"),
        Case("presence_penalty 5", c, {**p, "presence_penalty": 5}, 400, "presence_penalty"),
        Case("frequency_penalty 0.5 (not implemented)", ch, {**m, "frequency_penalty": 0.5}, 400,
             "frequency_penalty"),
        Case("stop_token_ids outside the vocabulary + min_tokens", c,
             {**p, "stop_token_ids": [10**9], "min_tokens": 1}, 400, "stop_token_ids"),
        Case("stop_token_ids negative", c, {**p, "stop_token_ids": [-3]}, 400, "stop_token_ids"),
        Case("prompt token outside the vocabulary", c, {**p, "prompt": [1, 2, 10**9]}, 400, "prompt"),
        Case("prompt token negative", c, {**p, "prompt": [-1]}, 400, "prompt"),
        Case("empty prompt", c, {**p, "prompt": ""}, 400, "prompt"),
        Case("two prompts", c, {**p, "prompt": ["a", "b"]}, 400, "prompt"),
        Case("logprobs 6 (completions: 0-5)", c, {**p, "logprobs": 6}, 400, "logprobs"),
        Case("logprobs -1", c, {**p, "logprobs": -1, "echo": True}, 400, "logprobs"),
        Case("top_logprobs 21 (0-20)", ch, {**m, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
        Case("top_logprobs without logprobs", ch, {**m, "top_logprobs": 2}, 400, "top_logprobs"),
        Case("logprobs a number on chat (a boolean there)", ch, {**m, "logprobs": 7}, 400, "logprobs"),
        Case("n 0", c, {**p, "n": 0}, 400, "n"),
        Case("n 17", ch, {**m, "n": 17}, 400, "n"),
        Case("n 2**40", c, {**p, "n": 2**40}, 400, "n"),
        Case("best_of below n", c, {**p, "n": 3, "best_of": 2}, 400, "best_of"),
        Case("best_of 100", c, {**p, "best_of": 100}, 400, "best_of"),
        Case("best_of > n streamed", c, {**p, "best_of": 2, "stream": True}, 400, "best_of"),
        Case("best_of on chat (not implemented)", ch, {**m, "best_of": 2}, 400, "best_of"),
        Case("echo on chat (not implemented)", ch, {**m, "echo": True}, 400, "echo"),
        Case("response_format type xml", ch, {**m, "response_format": {"type": "xml"}}, 400,
             "response_format.type"),
        Case("response_format json_schema without a schema", ch,
             {**m, "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, 400,
             "response_format.json_schema"),
        Case("response_format json_schema not an object", ch,
             {**m, "response_format": {"type": "json_schema", "json_schema": "x"}}, 400,
             "response_format.json_schema"),
        Case("bad json_schema (unknown type)", ch, {**m, "response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "wizard"}}}}, 400, "response_format.json_schema.schema"),
        Case("bad guided_json (not JSON)", c, {**p, "guided_json": "{not json"}, 400, "guided_json"),
        Case("guided_json a list", c, {**p, "guided_json": "[1, 2]"}, 400, "guided_json"),
        Case("bad guided_regex (unbalanced)", c, {**p, "guided_regex": "(a|b"}, 400, "guided_regex"),
        Case("bad guided_regex (nothing to repeat)", ch, {**m, "guided_regex": "*x"}, 400, "guided_regex"),
        Case("guided_choice empty", c, {**p, "guided_choice": []}, 400, "guided_choice"),
        Case("bad guided_grammar", c, {**p, "guided_grammar": "start: ((("}, 400, "guided_grammar"),
        Case("two constraints", c, {**p, "guided_regex": "a+", "guided_choice": ["a"]}, 400, "guided_choice"),
        Case("logit_bias (not implemented)", c, {**p, "logit_bias": {"1": 100}}, 400, "logit_bias"),
        Case("unknown field", c, {**p, "wizardry": 1}, 400, "wizardry"),
        Case("unknown role", ch, {**m, "messages": [{"role": "wizard", "content": "x"}]}, 400, "messages.0.role"),
        Case("no messages", ch, {**m, "messages": []}, 400, "messages"),
        Case("too many messages", ch, {**m, "messages": [{"role": "user", "content": "x"}] * 1025}, 400,
             "messages"),
        Case("image content part", ch, {**m, "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "http://169.254.169.254/"}}]}]}, 400, "messages"),
        Case("too many stop strings", c, {**p, "stop": [f"s{i}" for i in range(100)]}, 400, "stop"),
        Case("a 10,000-character stop string", c, {**p, "stop": "x" * 10000}, 400, "stop"),
        Case("max_tokens 0", c, {**p, "max_tokens": 0}, 400, "max_tokens"),
        Case("max_tokens -1", c, {**p, "max_tokens": -1}, 400, "max_tokens"),
        Case("max_tokens past the context", c, {**p, "max_tokens": 10**12}, 400, "max_tokens"),
        Case("max_tokens 2**80", c, {**p, "max_tokens": 2**80}, 400, "max_tokens"),
        Case("min_tokens > max_tokens", c, {**p, "min_tokens": 5}, 400, "min_tokens"),
        Case("seed 2**80", c, {**p, "seed": 2**80}, 400, "seed"),
        Case("wrong model", c, {**p, "model": "gpt-4"}, 404, "model"),
        Case("body not JSON", c, b"{not json", 400),
        Case("body a JSON array", c, b"[1, 2, 3]", 400),
        Case("body 5 MB", c, json.dumps({**p, "prompt": "x" * (5 << 20)}).encode(), 413),
    ]
    return cases


def check_cases(url: str, headers: dict, model: str) -> list[str]:
    """Send every hand-picked case; returns what went wrong (empty: all got their 4xx)."""
    wrong = []
    with httpx.Client(base_url=url, timeout=60, headers=headers) as client:
        for case in hostile_cases(model):
            data = case.body if isinstance(case.body, bytes) else json.dumps(case.body, allow_nan=True).encode()
            r = client.post(case.path, content=data, headers={"Content-Type": "application/json"})
            err = r.json().get("error", {}) if r.headers.get("content-type", "").startswith("application/json") else {}
            if r.status_code != case.status or not err.get("message"):
                wrong.append(f"{case.name}: {r.status_code} {r.text[:200]}")
            elif case.param is not None and err.get("param") != case.param:
                wrong.append(f"{case.name}: param {err.get('param')!r}, expected {case.param!r}")
    return wrong


PROBES = frozenset({"/health", "/ready", "/metrics"})


def check_api_key(url: str, key: str, model: str) -> tuple[int, list[str]]:
    """Every route the server's OpenAPI schema lists, but the probes, answers 401 invalid_api_key
    without the key, with a wrong one and with the bare key (no Bearer), and not 401 with it;
    /internal/* refuses the API key too (it needs the internal secret). Returns (checked, wrong)."""
    paths = httpx.get(url + "/openapi.json", timeout=30).json()["paths"]
    body = {"model": model, "prompt": "a", "max_tokens": 1}
    wrong, checked = [], 0
    for path, methods in sorted(paths.items()):
        if path in PROBES:
            continue
        for method in methods:
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": key},
                            {"Authorization": f"Bearer {key}x"}):
                r = httpx.request(method.upper(), url + path, headers=headers, timeout=30,
                                  json=body if method == "post" else None)
                err = r.json().get("error", {}) if r.status_code == 401 else {}
                if r.status_code != 401 or err.get("code") != "invalid_api_key":
                    wrong.append(f"{method.upper()} {path} {headers}: {r.status_code} {r.text[:200]}")
                checked += 1
            r = httpx.request(method.upper(), url + path, headers={"Authorization": f"Bearer {key}"}, timeout=60,
                              json=body if method == "post" else None)
            internal = path.startswith("/internal/")
            if (r.status_code == 401) != internal or r.status_code >= 500:
                wrong.append(f"{method.upper()} {path} with the key: {r.status_code} {r.text[:200]}")
    for path in PROBES:  # probes and scrapes carry no key
        if httpx.get(url + path, timeout=30).status_code != 200:
            wrong.append(f"{path} without a key is not 200")
    return checked, wrong
