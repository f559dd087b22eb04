"""The client's pure helpers: request bodies, error messages, model choice, phase timing."""

import pytest

from phasesplit.runtime.bench.client import (
    BenchError,
    ServedModels,
    Target,
    _chunk_text,
    _parse_timing,
    choose_model,
    error_message,
    request_body,
)
from phasesplit.runtime.bench.session import normalize_url


def test_request_body_completions_and_chat():
    t = Target("http://h", "m", "completions", 0.0,
               {"ignore_eos": True, "min_tokens": 0, "stream_options": {"include_usage": True}})
    b = request_body(t, "hello", 12)
    assert b == {"model": "m", "max_tokens": 12, "temperature": 0.0, "stream": True, "prompt": "hello",
                 "ignore_eos": True, "min_tokens": 12, "stream_options": {"include_usage": True}}
    assert t.url == "http://h/v1/completions"
    chat = Target("http://h", "m", "chat")
    b = request_body(chat, "hi", 3, stream=False)
    assert b["messages"] == [{"role": "user", "content": "hi"}] and "prompt" not in b and b["stream"] is False
    assert chat.url == "http://h/v1/chat/completions"
    # A non-streaming request never carries stream_options (servers reject it there).
    assert "stream_options" not in request_body(t, "x", 1, stream=False)


def test_error_message_shapes():
    assert error_message(400, b'{"error": {"message": "prompt too long", "type": "x"}}') == "HTTP 400: prompt too long"
    assert error_message(422, b'{"detail": [{"loc": ["body"]}]}') == "HTTP 422: [{'loc': ['body']}]"
    assert error_message(500, b"Internal Server Error") == "HTTP 500: Internal Server Error"
    assert error_message(502, b"") == "HTTP 502: (empty body)"
    assert error_message(404, b'{"error": "no such model"}') == "HTTP 404: no such model"


def test_choose_model():
    assert choose_model({"a": "x"}, None, "u") == "a"
    aliases = ServedModels({"a": "x", "b": "x"})
    aliases.one_model = True  # one model under two names: the first is the default
    assert choose_model(aliases, None, "u") == "a" and choose_model(aliases, "b", "u") == "b"
    assert choose_model({"a": "x", "b": "y"}, "b", "u") == "b"
    with pytest.raises(BenchError, match="pick one with --model"):
        choose_model({"a": "x", "b": "y"}, None, "u")
    with pytest.raises(BenchError, match="'c' is not served by u; it serves: a, b"):
        choose_model({"a": "x", "b": "y"}, "c", "u")


def test_phase_timing_fields_in_seconds():
    t = _parse_timing({"queued_s": 0.5, "prefill_ms": 120, "kv_transfer_s": 0.01, "decode": 2, "worker": "p0",
                       "local": True})
    assert t == {"queued": 0.5, "prefill": pytest.approx(0.12), "kv_transfer": 0.01, "decode": 2.0}
    assert _parse_timing(None) is None and _parse_timing({"worker": "p0"}) is None


def test_chunk_text():
    assert _chunk_text({"text": "a"}) == "a"
    assert _chunk_text({"delta": {"content": "b"}}) == "b"
    assert _chunk_text({"delta": {"role": "assistant"}}) == ""
    assert _chunk_text({"delta": None}) == ""


def test_normalize_url():
    assert normalize_url("http://h:1/v1/") == "http://h:1"
    assert normalize_url(" https://h ") == "https://h"
    with pytest.raises(BenchError):
        normalize_url("h:1")
