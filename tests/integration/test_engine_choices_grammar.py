"""Engine level: n > 1 choices forking the prompt's blocks, best_of, and grammar-constrained rows
sharing a batch with free ones."""

from __future__ import annotations

import json

import pytest

from phasesplit.runtime.engine.engine import EngineConfig, LLMEngine
from phasesplit.runtime.engine.grammar import spec
from phasesplit.runtime.engine.model_runner import RunnerConfig
from phasesplit.runtime.request import RequestError, SamplingParams
from tests.prompts import chat_prompt

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string", "maxLength": 16},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120}}}


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    return LLMEngine("smollm2", EngineConfig(runner=RunnerConfig(kv_cache_memory=64 << 20)))


def choices(outs) -> dict[int, list[int]]:
    by: dict[int, list[int]] = {}
    for o in outs:
        by.setdefault(o.index, []).extend(o.new_token_ids)
    return by


def test_n4_seeded_choices_differ_repeat_and_share_prompt_blocks(engine):
    ids = chat_prompt(engine.tokenizer, "Tell me a short story about a robot who learns to paint.")
    bs = engine.blocks.block_size
    assert len(ids) > 2 * bs
    params = SamplingParams(max_tokens=8, min_tokens=8, temperature=1.0, seed=1234, n=4)
    engine.add_request("n4", ids, params)
    shared = (len(ids) - 1) // bs
    seen_forked = False
    outs = []
    while "n4" in engine.groups:
        outs.extend(engine.step())
        running = [s for s in engine.scheduler.running if s.group == "n4"]
        if len(running) == 4 and not seen_forked:
            seen_forked = True
            # The prompt's full blocks are held once, by all four; each choice owns only its tail.
            own = sum(len(s.block_table) - shared for s in running)
            assert engine.blocks.num_shared == shared
            assert engine.blocks.num_allocated == shared + own
            assert all(s.block_table[:shared] == running[0].block_table[:shared] for s in running)
            assert own == 4 * (engine.blocks.blocks_for(len(ids) + 1) - shared)
    assert seen_forked
    first = choices(outs)
    assert sorted(first) == [0, 1, 2, 3] and all(len(v) == 8 for v in first.values())
    assert len({tuple(v) for v in first.values()}) == 4, "four seeded choices must differ"
    assert engine.blocks.num_allocated == 0
    again = choices(engine.run_to_end("n4-again", ids, params))
    assert again == first, "the same seed gives the same four choices"
    # Choice 0 is the request's own seed stream: n=1 with that seed gives it.
    alone = choices(engine.run_to_end("n1", ids, SamplingParams(max_tokens=8, min_tokens=8, temperature=1.0,
                                                                seed=1234)))
    assert alone[0] == first[0]


def test_best_of_reports_cumulative_logprobs(engine):
    ids = chat_prompt(engine.tokenizer, "Name a colour.")
    outs = engine.run_to_end("bo", ids, SamplingParams(max_tokens=4, temperature=1.0, seed=3, n=1, best_of=3))
    last = {o.index: o for o in outs if o.finished}
    assert sorted(last) == [0, 1, 2]
    assert all(o.cumulative_logprob is not None and o.cumulative_logprob < 0 for o in last.values())


def test_constrained_and_free_rows_share_a_step(engine):
    tok = engine.tokenizer
    free_ids = chat_prompt(tok, "What is the capital of France?")
    json_ids = chat_prompt(tok, "Describe a person as JSON.")
    greedy = SamplingParams(max_tokens=24, min_tokens=24, temperature=0)
    alone = engine.generate([free_ids], greedy)[0]
    guided = SamplingParams(max_tokens=48, temperature=0, guided=spec("json", PERSON, "guided_json"))
    choice = SamplingParams(max_tokens=8, temperature=0.7, seed=5,
                            guided=spec("choice", ["sunny", "rainy"], "guided_choice"))
    regex = SamplingParams(max_tokens=12, temperature=0, guided=spec("regex", r"[0-9]{3}-[0-9]{4}", "guided_regex"))
    out = engine.generate([free_ids, json_ids, json_ids, json_ids], [greedy, guided, choice, regex])
    assert out[0] == alone, "a free request's tokens do not change when constrained ones share its steps"
    doc = json.loads(tok.decode(out[1]).removesuffix("<|im_end|>"))
    assert set(doc) == {"name", "age"} and 0 <= doc["age"] <= 120 and len(doc["name"]) <= 16
    assert tok.decode(out[2]).removesuffix("<|im_end|>") in ("sunny", "rainy")
    text = tok.decode(out[3]).removesuffix("<|im_end|>")
    assert len(text) == 8 and text[3] == "-" and text.replace("-", "").isdigit()


@pytest.mark.parametrize("kind,value,param", [
    ("regex", "[0-9", "guided_regex"),
    ("json", {"type": "nonsense"}, "response_format.json_schema.schema"),
    ("choice", [], "guided_choice"),
    ("grammar", "start: ???", "guided_grammar"),
])
def test_invalid_constraint_is_a_request_error_naming_the_field(engine, kind, value, param):
    with pytest.raises(RequestError) as e:
        engine.add_request(f"bad-{kind}", [1, 2, 3], SamplingParams(guided=spec(kind, value, param)))
    assert e.value.param == param and param in str(e.value)
    assert f"bad-{kind}" not in engine.groups
