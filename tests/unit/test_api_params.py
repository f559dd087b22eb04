"""Request fields -> SamplingParams: constraints, logprobs, n/best_of, and the errors naming a field."""

from __future__ import annotations

import json

import pytest

from phasesplit.runtime.engine.grammar import GrammarError, grammar_text
from phasesplit.runtime.engine.sampling import choice_seed
from phasesplit.runtime.request import RequestError, SamplingParams
from phasesplit.runtime.server.protocol import ChatCompletionRequest, CompletionRequest

MSG = [{"role": "user", "content": "hi"}]


def chat(**kw) -> SamplingParams:
    return ChatCompletionRequest(model="m", messages=MSG, **kw).sampling(16)


def test_response_format_and_guided_fields_become_one_spec():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    p = chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
    assert p.guided == {"kind": "json", "value": json.dumps(schema), "param": "response_format.json_schema.schema"}
    assert chat(response_format={"type": "json_object"}).guided["kind"] == "json_object"
    assert chat(response_format={"type": "text"}).guided is None
    assert chat(guided_choice=["a", "b"]).guided == {"kind": "choice", "value": '["a", "b"]', "param": "guided_choice"}
    assert chat(guided_regex="[0-9]+").guided["param"] == "guided_regex"
    for spec in (chat(guided_json=schema).guided, chat(guided_grammar='start: "x"').guided):
        assert grammar_text(spec)  # compiles


@pytest.mark.parametrize(("kw", "param"), [
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
    ({"top_logprobs": 3}, "top_logprobs"),
])
def test_malformed_fields_name_themselves(kw, param):
    with pytest.raises(RequestError) as e:
        chat(**kw)
    assert e.value.param == param


@pytest.mark.parametrize(("spec", "param"), [
    ({"kind": "regex", "value": "(", "param": "guided_regex"}, "guided_regex"),
    ({"kind": "json", "value": "[1]", "param": "guided_json"}, "guided_json"),
    ({"kind": "json", "value": '{"type": "nonsense"}', "param": "guided_json"}, "guided_json"),
    ({"kind": "choice", "value": "[]", "param": "guided_choice"}, "guided_choice"),
])
def test_bad_constraints_raise_naming_the_field(spec, param):
    with pytest.raises(GrammarError) as e:
        grammar_text(spec)
    assert e.value.param == param and param in str(e.value)


def test_logprobs_fields():
    assert chat(logprobs=True, top_logprobs=5).logprobs == 5
    assert chat(logprobs=True).logprobs == 0 and chat().logprobs is None
    p = CompletionRequest(model="m", prompt="x", logprobs=2, echo=True).sampling(16)
    assert (p.logprobs, p.prompt_logprobs) == (2, 2)
    p = CompletionRequest(model="m", prompt="x", logprobs=2).sampling(16)
    assert (p.logprobs, p.prompt_logprobs) == (2, None)
    with pytest.raises(ValueError):
        CompletionRequest(model="m", prompt="x", logprobs=6)


def test_n_best_of_and_choice_seeds():
    p = CompletionRequest(model="m", prompt="x", n=2, best_of=4).sampling(16)
    assert (p.n, p.best_of, p.num_seqs) == (2, 4, 4)
    with pytest.raises(ValueError, match="best_of"):
        SamplingParams(n=3, best_of=2).validate()
    with pytest.raises(ValueError, match="n must"):
        SamplingParams(n=17).validate()
    seeds = [choice_seed(42, i) for i in range(8)]
    assert seeds[0] == 42 and len(set(seeds)) == 8 and seeds == [choice_seed(42, i) for i in range(8)]
    assert choice_seed(None, 3) is None
