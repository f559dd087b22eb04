"""Version-coherent prefill/decode pairing on loopback, every role its own process (issue 12,
point 4): the router pairs by revision, a prefill worker refuses a decode worker of another
revision, and the KV handshake refuses a prefill worker whose K/V has another layout (here a
block size the frames themselves cannot reveal), by name, while the output stays correct."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from phasesplit.runtime import metric_names as names
from phasesplit.runtime.model.loader import resolve
from phasesplit.runtime.model.tokenizer import TextTokenizer
from tests.integration.test_split import FP32, MODEL, _sample, texts, wait_no_blocks
from tests.procs import INTERNAL, serve
from tests.prompts import all_prompt_ids


@pytest.fixture(scope="module")
def logs(tmp_path_factory):
    return tmp_path_factory.mktemp("pairing-logs")


@pytest.fixture(scope="module")
def prompts():
    return all_prompt_ids(TextTokenizer(resolve("smollm2").folder))[:3]


@pytest.fixture(scope="module")
def reference(logs, prompts):
    p = serve("both", logs, *FP32)
    try:
        p.wait_ready()
        return texts(p.url, prompts, 1)
    finally:
        p.stop()


def layout_of(url: str) -> str:
    return httpx.get(url + "/internal/state", headers=INTERNAL, timeout=5).json()["kv_layout"]


@pytest.fixture(scope="module")
def block32_prefill(logs):
    """A prefill worker whose K/V is laid out for another block size: same model, dtype and
    geometry, so every frame would pass the receiver's dtype and shape checks."""
    p = serve("prefill", logs, *FP32, "--block-size", "32")
    p.wait_ready()
    yield p
    p.stop()


def test_prefill_worker_of_another_layout_is_refused_and_decode_prefills_locally(logs, prompts, reference,
                                                                                 block32_prefill):
    decode = serve("decode", logs, *FP32, "--prefill-urls", block32_prefill.url, "--on-prefill-failure", "retry-local")
    router = serve("router", logs, *FP32, "--prefill-urls", block32_prefill.url, "--decode-urls", decode.url)
    try:
        decode.wait_ready()
        router.wait_ready()
        assert texts(router.url, prompts, 1) == reference, "the output is the colocated one"
        mine, theirs = layout_of(decode.url), layout_of(block32_prefill.url)
        assert mine != theirs and "block16" in mine and "block32" in theirs
        st = httpx.get(decode.url + "/internal/state", headers=INTERNAL, timeout=5).json()
        assert st["kv_mismatched"] >= 1, st
        m = httpx.get(decode.url + "/metrics").text
        assert float(_sample(m, names.LOCAL_PREFILL)) == len(prompts), "every prompt prefilled here instead"
        assert float(_sample(m, names.KV_BYTES)) == 0, "not a byte of the other layout's K/V was taken"
        assert wait_no_blocks(decode.url)["allocated_blocks"] == 0
        log = decode.log_path.read_text()
        line = next(s for s in log.splitlines() if "KV layout mismatch" in s)
        print(f"\n{line}")
        assert mine in line and theirs in line, "the error names both fingerprints"
    finally:
        router.stop()
        decode.stop()


def test_fail_policy_fails_the_request_naming_both_layouts(logs, prompts, block32_prefill):
    decode = serve("decode", logs, *FP32, "--prefill-urls", block32_prefill.url, "--on-prefill-failure", "fail")
    router = serve("router", logs, *FP32, "--prefill-urls", block32_prefill.url, "--decode-urls", decode.url)
    try:
        decode.wait_ready()
        router.wait_ready()
        body = {"model": MODEL, "prompt": prompts[0], "max_tokens": 8, "temperature": 0, "stream": True}
        errors = []
        with httpx.stream("POST", router.url + "/v1/completions", json=body, timeout=90) as r:
            if r.status_code >= 400:  # failed before its first token: an HTTP error in OpenAI's shape
                errors.append(json.loads(r.read())["error"]["message"])
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]" and "error" in json.loads(line[6:]):
                    errors.append(json.loads(line[6:])["error"]["message"])
        print(f"\nclient saw: {errors}")
        assert errors and "KV layout mismatch" in errors[0]
        assert layout_of(decode.url) in errors[0] and layout_of(block32_prefill.url) in errors[0]
        assert wait_no_blocks(decode.url)["allocated_blocks"] == 0
    finally:
        router.stop()
        decode.stop()


def test_router_pairs_decode_only_with_prefill_of_its_revision(logs, prompts, reference):
    """Two prefill revisions behind one router (a rollout half done); the decode worker is r1:
    every prompt goes to r1's prefill worker, none to r2's, however idle it is. Called directly
    with the wrong revision, a prefill worker refuses (409) by name."""
    p1 = serve("prefill", logs, *FP32, "--revision", "r1")
    p2 = serve("prefill", logs, *FP32, "--revision", "r2")
    decode = serve("decode", logs, *FP32, "--revision", "r1", "--prefill-urls", f"{p1.url},{p2.url}",
                   "--on-prefill-failure", "fail")
    router = serve("router", logs, *FP32, "--prefill-urls", f"{p1.url},{p2.url}", "--decode-urls", decode.url)
    procs = (p1, p2, decode, router)
    try:
        for p in procs:
            p.wait_ready()
        def seen() -> dict[str, str]:
            w = httpx.get(router.url + "/internal/workers", headers=INTERNAL, timeout=5).json()
            return {x["url"]: x["revision"] for x in w["prefill"] + w["decode"] if x["up"]}
        deadline = time.monotonic() + 30
        while len(seen()) < 3 and time.monotonic() < deadline:
            time.sleep(0.5)
        assert seen() == {p1.url: "r1", p2.url: "r2", decode.url: "r1"}, "the router knows each worker's revision"
        # Nine requests, two at a time: an idle r2 worker would win the queue comparison otherwise.
        assert texts(router.url, prompts * 3, 2) == reference * 3

        def prompt_tokens(url: str) -> float:
            return float(_sample(httpx.get(url + "/metrics").text, names.PROMPT_TOKENS, "prefill"))
        assert prompt_tokens(p1.url) > 0 and prompt_tokens(p2.url) == 0
        call = {"request_id": "x", "prompt_ids": [1, 2, 3], "kv_host": "127.0.0.1", "kv_port": 1, "transfer_id": 1,
                "revision": "r1"}
        r = httpx.post(p2.url + "/internal/prefill", json=call, headers=INTERNAL, timeout=10)
        assert r.status_code == 409 and "'r2'" in r.text and "'r1'" in r.text, r.text
    finally:
        for p in procs:
            p.stop()
