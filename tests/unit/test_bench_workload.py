"""Workload shapes, trace parsing, exact-length prompts and the load schedule."""

import asyncio
import io
import math
import random

import pytest

from phasesplit.runtime.bench.load import (
    ErrorBreaker,
    arrival_offsets,
    parse_rates,
    run_schedule,
    trace_offsets,
)
from phasesplit.runtime.bench.metrics import RequestResult
from phasesplit.runtime.bench.workload import (
    HFTokenizer,
    MixedShape,
    PromptBuilder,
    RequestSpec,
    TraceScaling,
    WorkloadError,
    fixed_workload,
    mixed_workload,
    parse_trace,
    trace_workload,
)

AZURE = """TIMESTAMP,ContextTokens,GeneratedTokens
2023-11-16 18:15:50.9951690,396,109
2023-11-16 18:15:46.6805900,374,44
2023-11-16 18:15:52.1000000,2000,10
"""


def test_parse_trace_datetime_sorts_and_offsets():
    rows = parse_trace(io.StringIO(AZURE))
    assert [(r.context_tokens, r.generated_tokens) for r in rows] == [(374, 44), (396, 109), (2000, 10)]
    assert rows[0].arrival_s == 0.0
    assert rows[1].arrival_s == pytest.approx(50.995169 - 46.68059, abs=1e-6)
    assert rows[2].arrival_s == pytest.approx(52.1 - 46.68059, abs=1e-6)


def test_parse_trace_seconds_and_errors():
    rows = parse_trace(io.StringIO("TIMESTAMP,ContextTokens,GeneratedTokens\n10.5,5,6\n12,7,8\n"))
    assert [r.arrival_s for r in rows] == [0.0, 1.5]
    with pytest.raises(WorkloadError, match="columns"):
        parse_trace(io.StringIO("time,prompt,output\n1,2,3\n"))
    with pytest.raises(WorkloadError, match=":2:"):
        parse_trace(io.StringIO("TIMESTAMP,ContextTokens,GeneratedTokens\nyesterday,5,6\n"))
    with pytest.raises(WorkloadError, match="positive"):
        parse_trace(io.StringIO("TIMESTAMP,ContextTokens,GeneratedTokens\n1,0,6\n"))
    with pytest.raises(WorkloadError, match="no rows"):
        parse_trace(io.StringIO("TIMESTAMP,ContextTokens,GeneratedTokens\n"))


def test_trace_workload_scales_and_clips():
    rows = parse_trace(io.StringIO(AZURE))
    specs = trace_workload(rows, None, TraceScaling(start_s=1.0, time_scale=2.0, token_scale=0.5, max_input_len=500))
    # The first row (t=0) is skipped; times restart at the first kept row and double.
    assert [(s.prompt_len, s.output_len) for s in specs] == [(198, 54), (500, 5)]
    assert specs[0].arrival_s == 0.0
    assert specs[1].arrival_s == pytest.approx(2 * (52.1 - 50.995169), abs=1e-6)
    assert trace_offsets(specs) == [s.arrival_s for s in specs]
    assert len(trace_workload(rows, 2, TraceScaling())) == 2
    with pytest.raises(WorkloadError):
        trace_workload(rows, None, TraceScaling(start_s=100.0))


def test_fixed_and_mixed_shapes():
    assert fixed_workload(3, 10, 5) == [RequestSpec(i, 10, 5) for i in range(3)]
    with pytest.raises(WorkloadError):
        fixed_workload(0, 10, 5)
    shape = MixedShape(chat_input_len=100, chat_output_len=40, doc_input_len=1000, doc_output_len=20,
                       doc_fraction=0.25, range_ratio=0.1)
    specs = mixed_workload(40, shape, seed=3)
    docs = [s for s in specs if s.kind == "doc"]
    chats = [s for s in specs if s.kind == "chat"]
    assert len(docs) == 10 and len(chats) == 30
    assert all(900 <= s.prompt_len <= 1100 and 18 <= s.output_len <= 22 for s in docs)
    assert all(90 <= s.prompt_len <= 110 and 36 <= s.output_len <= 44 for s in chats)
    assert mixed_workload(40, shape, seed=3) == specs  # reproducible from the seed
    assert mixed_workload(40, shape, seed=4) != specs


@pytest.fixture(scope="module")
def bpe_tokenizer(tmp_path_factory):
    """A real byte-level BPE tokenizer trained here, so the test needs no model download."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    rng = random.Random(0)
    letters = "abcdefghijklmnopqrstuvwxyz"
    words = ["".join(rng.choice(letters) for _ in range(rng.randint(3, 8))) for _ in range(600)]
    corpus = [" ".join(rng.choices(words, k=50)) + " 12345, ok." for _ in range(400)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=2000, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus, trainer)
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return HFTokenizer(path)


def test_prompt_builder_exact_lengths(bpe_tokenizer):
    b = PromptBuilder(bpe_tokenizer, seed=1, min_words=100)
    for n in (1, 2, 17, 300, 1500):
        assert len(bpe_tokenizer.encode(b.text(n))) == n
    first, second = b.text(50), b.text(50)
    assert first != second  # every prompt distinct: no accidental prefix-cache hits
    again = PromptBuilder(bpe_tokenizer, seed=1, min_words=100)
    assert [again.text(n) for n in (1, 2, 17, 300, 1500, 50)][-1] == first  # reproducible from the seed
    with pytest.raises(WorkloadError):
        b.text(0)


def test_prompt_builder_rejects_unsuitable_tokenizer(bpe_tokenizer):
    with pytest.raises(WorkloadError, match="single-token"):
        PromptBuilder(bpe_tokenizer, seed=1, min_words=10**6)


def test_hf_tokenizer_bad_inputs(tmp_path):
    bad = tmp_path / "tokenizer.json"
    bad.write_text("{not json")
    with pytest.raises(WorkloadError):
        HFTokenizer(bad)
    with pytest.raises(WorkloadError):
        HFTokenizer.from_json("[]")


def test_parse_rates():
    assert parse_rates("1, 2.5,inf") == [1.0, 2.5, math.inf]
    for bad in ("", "0", "-1", "fast"):
        with pytest.raises(ValueError):
            parse_rates(bad)


def test_arrival_offsets():
    assert arrival_offsets(3, math.inf, 1.0, 0) == [0.0, 0.0, 0.0]
    xs = arrival_offsets(20000, 4.0, 1.0, seed=7)
    assert xs[0] == 0.0 and all(b >= a for a, b in zip(xs, xs[1:], strict=False))
    assert arrival_offsets(20000, 4.0, 1.0, seed=7) == xs
    gaps = [b - a for a, b in zip(xs, xs[1:], strict=False)]
    mean = sum(gaps) / len(gaps)
    assert mean == pytest.approx(0.25, rel=0.03)
    # Poisson gaps have coefficient of variation 1; gamma shape k gives 1/sqrt(k).
    cv = (sum((g - mean) ** 2 for g in gaps) / len(gaps)) ** 0.5 / mean
    assert cv == pytest.approx(1.0, rel=0.05)
    bursty = arrival_offsets(20000, 4.0, 0.25, seed=7)
    bg = [b - a for a, b in zip(bursty, bursty[1:], strict=False)]
    bm = sum(bg) / len(bg)
    assert bm == pytest.approx(0.25, rel=0.06)
    assert (sum((g - bm) ** 2 for g in bg) / len(bg)) ** 0.5 / bm == pytest.approx(2.0, rel=0.08)
    with pytest.raises(ValueError):
        arrival_offsets(3, 1.0, 0.0, 0)


def _run(specs, send, **kw):
    return asyncio.run(run_schedule(specs, ["p"] * len(specs), [0.0] * len(specs), send, **kw))


def test_run_schedule_respects_max_concurrency():
    in_flight, peak = [0], [0]

    async def send(spec, prompt):
        in_flight[0] += 1
        peak[0] = max(peak[0], in_flight[0])
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        in_flight[0] -= 1
        return RequestResult(spec.index, spec.kind, spec.prompt_len, spec.output_len, ok=True)

    specs = fixed_workload(20, 4, 4)
    results, duration = _run(specs, send, max_concurrency=3)
    assert [r.index for r in results] == list(range(20))
    assert peak[0] == 3
    assert duration >= 0
    peak[0] = 0
    _run(specs, send)
    assert peak[0] == 20  # open loop at rate inf: everything at once


def test_error_breaker_stops_a_failing_run():
    sent = []

    async def send(spec, prompt):
        sent.append(spec.index)
        return RequestResult(spec.index, spec.kind, spec.prompt_len, spec.output_len, ok=False, error="HTTP 500")

    breaker = ErrorBreaker(4)
    results, _ = _run(fixed_workload(50, 4, 4), send, max_concurrency=1, breaker=breaker)
    assert breaker.tripped
    assert len(results) == 4 and len(sent) == 4


def test_error_breaker_tolerates_errors_after_a_success():
    b = ErrorBreaker(2)
    b.record(RequestResult(0, "x", 1, 1, ok=True))
    for i in range(5):
        b.record(RequestResult(i, "x", 1, 1, ok=False))
    assert not b.tripped
    assert not ErrorBreaker(0).tripped


def test_cancelled_run_hands_back_finished_requests():
    from phasesplit.runtime.bench.load import Interrupted

    release = None

    async def send(spec, prompt):
        if spec.index >= 3:
            await release.wait()  # never set: these are in flight when the run is cancelled
        return RequestResult(spec.index, spec.kind, spec.prompt_len, spec.output_len, ok=True)

    async def main():
        nonlocal release
        release = asyncio.Event()
        done = []
        task = asyncio.create_task(run_schedule(fixed_workload(6, 4, 4), ["p"] * 6, [0.0] * 6, send,
                                                on_done=done.append))
        while len(done) < 3:
            await asyncio.sleep(0)
        task.cancel()
        try:
            await task
        except Interrupted as e:
            return e
        raise AssertionError("run_schedule did not report the interruption")

    e = asyncio.run(main())
    assert [r.index for r in e.results] == [0, 1, 2]
    assert e.duration_s >= 0
