"""OpenAI API completeness through the clients people use (issue 16): structured outputs, logprobs
with echo, n > 1, the model alias, /tokenize; colocated and split (prefill -> decode -> router)."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from phasesplit.runtime.model.loader import resolve
from phasesplit.runtime.model.tokenizer import TextTokenizer
from tests.procs import serve

MODEL = "smollm2-135m-instruct"
FP32 = ("--dtype", "float32", "--max-model-len", "2048")
SCHEMAS = json.loads((Path(__file__).resolve().parents[1] / "data" / "json_schemas.json").read_text())

pytestmark = pytest.mark.timeout(1800)


@pytest.fixture(scope="module")
def logs(tmp_path_factory):
    return tmp_path_factory.mktemp("api-logs")


@pytest.fixture(scope="module")
def colocated(logs):
    p = serve("both", logs, *FP32, "--served-model-name", MODEL, "smollm2-alias")
    p.wait_ready()
    yield p.url
    p.stop()


@pytest.fixture(scope="module")
def split(logs):
    prefill = serve("prefill", logs, *FP32)
    decode = serve("decode", logs, *FP32, "--prefill-urls", prefill.url, "--on-prefill-failure", "fail")
    router = serve("router", logs, *FP32, "--prefill-urls", prefill.url, "--decode-urls", decode.url)
    procs = (prefill, decode, router)
    try:
        for p in procs:
            p.wait_ready()
        yield router.url
    finally:
        for p in procs:
            p.stop()


@pytest.fixture(scope="module", params=["colocated", "split"])
def url(request):
    return request.getfixturevalue(request.param)


@pytest.fixture(scope="module")
def tok() -> TextTokenizer:
    return TextTokenizer(resolve("smollm2").folder)


def client(url: str):
    from openai import OpenAI

    return OpenAI(base_url=url + "/v1", api_key="unused", timeout=600)


def chat_body(content: str) -> list[dict]:
    return [{"role": "user", "content": content}]


# -- structured outputs ---------------------------------------------------------------------------


def test_json_schemas_parse_and_validate(url):
    """50 requests over 10 schemas (nested objects, enums, arrays, required fields, bounded
    numbers), greedy and sampled, sent together so constrained rows share steps: every output
    parses and validates."""
    import jsonschema

    c = client(url)

    def one(job: tuple[int, dict]) -> tuple[str, dict, str]:
        i, s = job
        sampled = i % 5 >= 2  # per schema: 2 greedy, 3 sampled with their own seeds
        r = c.chat.completions.create(
            model=MODEL, messages=chat_body(f"Give me an example {s['name']} as JSON."), max_tokens=200,
            temperature=0.8 if sampled else 0, seed=i if sampled else None,
            response_format={"type": "json_schema",
                             "json_schema": {"name": s["name"], "schema": s["schema"], "strict": True}})
        return s["name"], s["schema"], r.choices[0].message.content

    jobs = [(i, SCHEMAS[i // 5]) for i in range(50)]
    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(one, jobs))
    for name, schema, text in results:
        try:
            jsonschema.validate(json.loads(text), schema)
        except (ValueError, jsonschema.ValidationError) as e:
            raise AssertionError(f"{name}: {text!r}: {e}") from None


def test_sdk_parse_with_pydantic_model(url):
    from typing import Literal

    from pydantic import BaseModel, Field

    class Pet(BaseModel):
        name: str = Field(max_length=12)
        kind: Literal["cat", "dog", "bird"]
        age: int = Field(ge=0, le=30)

    c = client(url)
    for seed in (None, 7):
        r = c.beta.chat.completions.parse(model=MODEL, messages=chat_body("Describe a pet as JSON."), max_tokens=100,
                                          temperature=0 if seed is None else 0.8, seed=seed, response_format=Pet)
        pet = r.choices[0].message.parsed
        assert isinstance(pet, Pet) and pet.kind in ("cat", "dog", "bird") and 0 <= pet.age <= 30


def test_vllm_guided_fields(url):
    base = {"model": MODEL, "messages": chat_body("Is the sky blue?"), "max_tokens": 16, "temperature": 0}
    r = httpx.post(url + "/v1/chat/completions", json={**base, "guided_choice": ["yes", "no"]}, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] in ("yes", "no")
    r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "Call me at", "max_tokens": 16,
                                                  "temperature": 0, "guided_regex": r" [0-9]{3}-[0-9]{4}"},
                   timeout=120)
    text = r.json()["choices"][0]["text"]
    assert len(text) == 9 and text[4] == "-" and text.replace("-", "").strip().isdigit(), text
    r = httpx.post(url + "/v1/chat/completions", json={**base, "max_tokens": 60,
                                                       "response_format": {"type": "json_object"}}, timeout=120)
    assert isinstance(json.loads(r.json()["choices"][0]["message"]["content"]), dict)


@pytest.mark.parametrize(("extra", "param"), [
    ({"guided_regex": "[0-9"}, "guided_regex"),
    ({"guided_json": {"type": "nonsense"}}, "guided_json"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 3}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema"),
    ({"guided_choice": []}, "guided_choice"),
], ids=["regex", "guided_json", "json_schema", "no_schema", "choice"])
def test_invalid_constraint_is_400_naming_the_field(url, extra, param):
    body = {"model": MODEL, "messages": chat_body("hi"), "max_tokens": 4, **extra}
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text


# -- logprobs ----------------------------------------------------------------------------------------


def test_chat_logprobs_shapes_streaming_and_not(url):
    c = client(url)
    kw = {"model": MODEL, "messages": chat_body("Name three colours."), "max_tokens": 8, "min_tokens": 8,
          "temperature": 0, "logprobs": True, "top_logprobs": 3}
    r = c.chat.completions.create(**{k: v for k, v in kw.items() if k != "min_tokens"},
                                  extra_body={"min_tokens": 8})
    content = r.choices[0].logprobs.content
    assert len(content) == 8 and "".join(t.token for t in content) == r.choices[0].message.content
    for t in content:
        assert len(t.top_logprobs) == 3 and t.logprob <= 0 and bytes(t.bytes).decode(errors="replace") == t.token
        assert abs(t.top_logprobs[0].logprob - t.logprob) < 1e-4, "greedy picks the most likely token"
    chunks = list(c.chat.completions.create(**{k: v for k, v in kw.items() if k != "min_tokens"},
                                            extra_body={"min_tokens": 8}, stream=True))
    streamed = [t for ch in chunks if ch.choices and ch.choices[0].logprobs for t in ch.choices[0].logprobs.content]
    assert [(t.token, round(t.logprob, 4)) for t in streamed] == [(t.token, round(t.logprob, 4)) for t in content]
    r = httpx.post(url + "/v1/chat/completions", json={**kw, "top_logprobs": 21}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs"


def completion_logprobs(url: str, prompt: str, stream: bool = False) -> dict:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 6, "min_tokens": 6, "temperature": 0, "logprobs": 3,
            "echo": True, "stream": stream}
    if not stream:
        r = httpx.post(url + "/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]
    merged = {"text": "", "logprobs": {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                ch = json.loads(line[6:])["choices"]
                if ch:
                    merged["text"] += ch[0]["text"]
                    for k, v in (ch[0]["logprobs"] or {}).items():
                        merged["logprobs"][k] += v
    return merged


def test_completion_echo_logprobs(url, tok):
    prompt = "The capital of France is Paris. The capital of Italy is"
    n_prompt = len(tok.encode(prompt))
    got = completion_logprobs(url, prompt)
    lp = got["logprobs"]
    assert got["text"].startswith(prompt)
    assert len(lp["tokens"]) == n_prompt + 6 and "".join(lp["tokens"]) == got["text"]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert all(x is not None and x <= 0 for x in lp["token_logprobs"][1:])
    for chosen, top, token in zip(lp["token_logprobs"][1:], lp["top_logprobs"][1:], lp["tokens"][1:], strict=True):
        assert 3 <= len(top) <= 4 and top[token] == chosen  # the top 3 and the chosen token (vLLM's shape)
    streamed = completion_logprobs(url, prompt, stream=True)
    assert streamed["text"] == got["text"] and streamed["logprobs"]["tokens"] == lp["tokens"]
    assert all((a is None and b is None) or abs(a - b) < 1e-4
               for a, b in zip(streamed["logprobs"]["token_logprobs"], lp["token_logprobs"], strict=True))
    r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "logprobs": 6}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "logprobs"


def test_split_logprobs_equal_colocated(colocated, split):
    prompt = "Once upon a time, in a small village by the mountains, there lived"
    a, b = completion_logprobs(colocated, prompt), completion_logprobs(split, prompt)
    assert a["text"] == b["text"] and a["logprobs"]["tokens"] == b["logprobs"]["tokens"]
    for x, y in zip(a["logprobs"]["token_logprobs"], b["logprobs"]["token_logprobs"], strict=True):
        assert (x is None and y is None) or abs(x - y) < 1e-3
    for x, y in zip(a["logprobs"]["top_logprobs"][1:], b["logprobs"]["top_logprobs"][1:], strict=True):
        assert x.keys() == y.keys() and all(abs(x[k] - y[k]) < 1e-3 for k in x)


# -- n > 1 ---------------------------------------------------------------------------------------------


def test_n4_seeded_choices(url):
    c = client(url)
    kw = {"model": MODEL, "messages": chat_body("Write a one-line poem about rain."), "max_tokens": 12,
          "temperature": 1.0, "seed": 99, "n": 4}
    a = c.chat.completions.create(**kw)
    texts = [ch.message.content for ch in sorted(a.choices, key=lambda ch: ch.index)]
    assert [ch.index for ch in sorted(a.choices, key=lambda ch: ch.index)] == [0, 1, 2, 3]
    assert len(set(texts)) == 4, texts
    b = c.chat.completions.create(**kw)
    assert [ch.message.content for ch in sorted(b.choices, key=lambda ch: ch.index)] == texts
    assert a.usage.completion_tokens > 12, "usage counts every choice's tokens"
    # Streaming interleaves the choices, each chunk naming its index; the texts are the same.
    parts: dict[int, str] = {}
    order = []
    for ch in c.chat.completions.create(**kw, stream=True):
        for choice in ch.choices:
            parts[choice.index] = parts.get(choice.index, "") + (choice.delta.content or "")
            order.append(choice.index)
    assert [parts[i] for i in range(4)] == texts
    assert order != sorted(order), "choices stream interleaved, not one after another"


def test_best_of_completions(url):
    body = {"model": MODEL, "prompt": "My favourite fruit is", "max_tokens": 6, "temperature": 1.0, "seed": 5,
            "n": 2, "best_of": 4}
    r = httpx.post(url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    assert [ch["index"] for ch in r.json()["choices"]] == [0, 1]
    r = httpx.post(url + "/v1/completions", json={**body, "stream": True}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "best_of"


# -- the model alias, /tokenize --------------------------------------------------------------------


def test_model_alias(colocated):
    c = client(colocated)
    assert [m.id for m in c.models.list().data] == [MODEL, "smollm2-alias", "smollm2"]
    for name in ("smollm2", "smollm2-alias"):
        r = c.completions.create(model=name, prompt="Hello", max_tokens=2)
        assert r.model == name and r.choices[0].text
    r = httpx.post(colocated + "/v1/completions", json={"model": "gpt-4", "prompt": "hi"}, timeout=30)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_router_answers_to_model_value(split):
    assert [m.id for m in client(split).models.list().data] == [MODEL, "smollm2"]
    r = client(split).completions.create(model="smollm2", prompt="Hello", max_tokens=2)
    assert r.choices[0].text


def test_tokenize_detokenize(url, tok):
    text = "Hello, wörld — tokens!"
    r = httpx.post(url + "/tokenize", json={"model": MODEL, "prompt": text}, timeout=30).json()
    assert r["tokens"] == tok.encode(text) and r["count"] == len(r["tokens"]) and r["max_model_len"] == 2048
    assert "".join(r["token_strs"]) == text
    back = httpx.post(url + "/detokenize", json={"model": MODEL, "tokens": r["tokens"]}, timeout=30).json()
    assert back == {"prompt": text}
    msgs = chat_body("Count my tokens")
    counted = httpx.post(url + "/tokenize", json={"messages": msgs}, timeout=30).json()["count"]
    usage = client(url).chat.completions.create(model=MODEL, messages=msgs, max_tokens=1).usage
    assert counted == usage.prompt_tokens
    r = httpx.post(url + "/detokenize", json={"tokens": [10**7]}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"
    r = httpx.post(url + "/tokenize", json={"model": "nope", "prompt": "x"}, timeout=30)
    assert r.status_code == 404
