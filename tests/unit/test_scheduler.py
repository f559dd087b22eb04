"""Scheduler: token budget, chunked prefill, decode first, preemption by recompute."""

from phasesplit.runtime.engine.block_manager import BlockManager
from phasesplit.runtime.engine.scheduler import Scheduler
from phasesplit.runtime.engine.sequence import Sequence, Status
from phasesplit.runtime.request import SamplingParams


def run(sched: Scheduler, batch) -> None:
    """Pretend the model ran: advance computed counts, give finished prefills a token."""
    for s in batch.decode:
        s.num_computed += 1
        s.output_ids.append(7)
    for s, n in batch.prefill:
        s.num_computed += n
        if s.num_computed == len(s):
            s.output_ids.append(7)


def test_long_prompt_is_chunked_and_decode_keeps_going():
    sched = Scheduler(BlockManager(100, 4, prefix_caching=False), max_num_seqs=8, max_num_batched_tokens=16)
    short = Sequence("s", [1, 2, 3], SamplingParams())
    sched.add(short)
    run(sched, sched.schedule())
    long = Sequence("l", list(range(50)), SamplingParams())
    sched.add(long)
    chunks = []
    while long.num_computed < 50:
        b = sched.schedule()
        assert short in b.decode, "the running stream gets a token every step"
        assert b.num_tokens <= 16
        chunks.append(dict((s.request_id, n) for s, n in b.prefill).get("l", 0))
        run(sched, b)
    assert chunks == [15, 15, 15, 5]


def test_preempts_newest_when_cache_is_full():
    bm = BlockManager(4, 2, prefix_caching=False)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64)
    a = Sequence("a", [1, 2, 3, 4], SamplingParams())
    b = Sequence("b", [5, 6, 7, 8], SamplingParams())
    sched.add(a)
    sched.add(b)
    run(sched, sched.schedule())  # both prefilled: 2 blocks each, cache full
    assert bm.num_free == 0
    batch = sched.schedule()  # both need a third block for token 5: b (newest) is preempted
    assert [s.request_id for s in batch.decode] == ["a"] and batch.preempted == [b]
    assert b.status is Status.WAITING and b.num_computed == 0 and not b.block_table
    assert sched.num_preemptions == 1


def test_admission_respects_max_num_seqs():
    sched = Scheduler(BlockManager(100, 4), max_num_seqs=2, max_num_batched_tokens=100)
    for i in range(3):
        sched.add(Sequence(str(i), [i, i + 1], SamplingParams()))
    b = sched.schedule()
    assert len(b.prefill) == 2 and len(sched.waiting) == 1


def test_short_prompt_passes_a_long_one_which_still_progresses():
    sched = Scheduler(BlockManager(200, 4, prefix_caching=False), max_num_seqs=8, max_num_batched_tokens=16)
    doc = Sequence("doc", list(range(100)), SamplingParams())
    sched.add(doc)
    run(sched, sched.schedule())  # the document starts: 16 of 100 tokens
    assert doc.num_computed == 16
    chat = Sequence("chat", [1, 2, 3, 4, 5, 6], SamplingParams())
    sched.add(chat)
    b = sched.schedule()
    got = {s.request_id: n for s, n in b.prefill}
    assert got == {"chat": 6, "doc": 10}, "the chat is prefilled whole at once, the document gets the rest"
    run(sched, b)
    # A stream of short prompts, one per step: each is through its prompt by the step after it
    # arrived, and the document still advances by at least a quarter of every step.
    arrived: dict[str, int] = {}
    step = 0
    while doc.num_computed < 100:
        short = Sequence(f"s{step}", [7] * 8, SamplingParams(max_tokens=1))
        sched.add(short)
        arrived[short.request_id] = step
        before = doc.num_computed
        b = sched.schedule()
        got = {s.request_id: n for s, n in b.prefill}
        idle = len(b.decode) + sum(got.values()) < 16
        assert not idle or (got["doc"] == 100 - before and not sched.waiting), "budget left idle"
        assert got["doc"] >= min(4, 100 - before)
        run(sched, b)
        for s in [s for s in sched.running if s.request_id.startswith("s") and s.output_ids]:
            assert step - arrived[s.request_id] <= 1
            sched.finish(s)  # max_tokens=1: done after the first token
        step += 1
    assert step <= 21


def test_aging_bound_lets_a_long_prompt_in_past_a_stream_of_short_ones():
    """Two new 8-token prompts every step fill a 16-token budget: shortest-first alone would keep
    a 40-token prompt waiting for ever; past max_wait_steps it goes first (once started, the
    quarter of each step kept for the oldest started prompt carries it on)."""

    def admitted_at(max_wait_steps: int, steps: int = 30) -> int | None:
        sched = Scheduler(BlockManager(1000, 4, prefix_caching=False), max_num_seqs=64, max_num_batched_tokens=16,
                          max_wait_steps=max_wait_steps)
        long = Sequence("long", list(range(40)), SamplingParams())
        sched.add(long)
        for step in range(1, steps + 1):
            for i in range(2):
                sched.add(Sequence(f"s{step}.{i}", list(range(100, 108)), SamplingParams()))
            b = sched.schedule()
            assert b.num_tokens <= 16
            if any(s is long for s, _ in b.prefill):
                return step
            run(sched, b)
            for s, _ in b.prefill:  # the short ones are done after their prompt: leave the batch
                sched.finish(s)
        return None

    assert admitted_at(max_wait_steps=10_000) is None, "shortest-first alone starves it"
    assert admitted_at(max_wait_steps=5) == 6  # passed over in steps 1-5, first in step 6


def test_time_budget_cuts_prompt_chunks_beside_streams_only():
    """A decode worker keeping an ITL target: a step with decode rows carries as many prompt
    tokens as the fitted cost allows; a step without any takes the whole token budget."""
    from phasesplit.runtime.engine.step_costs import StepTimeBudget

    # 10 ms a step plus 1 ms a token against a 30 ms target: 20 tokens, decode rows included.
    budget = StepTimeBudget(target_s=0.030, base_s=0.010, per_token_s=0.001)
    assert budget.prompt_tokens(2) == 18
    assert StepTimeBudget(0.030, 0.050, 0.001).prompt_tokens(2) == budget.min_tokens  # slower than the target
    sched = Scheduler(BlockManager(200, 4, prefix_caching=False), max_num_seqs=8, max_num_batched_tokens=64)
    first = Sequence("first", list(range(100)), SamplingParams())
    sched.add(first)
    b = sched.schedule(budget)
    assert b.prefill == [(first, 64)], "no stream running: the whole budget"
    run(sched, b)
    while first.uncomputed > 1:
        run(sched, sched.schedule(budget))
    doc = Sequence("doc", list(range(100)), SamplingParams())
    sched.add(doc)
    chunks = []
    while doc.num_computed < 100:
        b = sched.schedule(budget)
        assert first in b.decode
        chunks.append(dict((s.request_id, n) for s, n in b.prefill)["doc"])
        run(sched, b)
    assert chunks == [19] * 5 + [5]  # 20 tokens a step minus the stream's row
    assert max(chunks) < 64


def test_chunk_cap_bounds_every_steps_prompt_tokens():
    """`chunk_tokens` (the engine's efficient chunk) caps prompt tokens in every step, with or
    without decode rows: a chat that arrives while a document is prefilled is done in a step of
    at most that many prompt tokens, not one padded to the whole token budget."""
    from phasesplit.runtime.engine.step_costs import efficient_chunk

    # A step of 35 ms plus 5 ms a token (one AVX2 core): a 5 % fixed cost at 133 tokens.
    assert efficient_chunk(0.035, 0.005, 0.05) == 133
    step = 0.035 + 0.005 * 133
    assert 0.035 / step <= 0.05 < 0.035 / (step - 0.005)
    assert efficient_chunk(0.035, 0.0, 0.05) is None and efficient_chunk(0.035, 0.005, 0.0) is None
    assert efficient_chunk(0.0001, 0.005, 0.05) == 32  # the floor: a fit with next to no base
    assert efficient_chunk(0.0, 0.005, 0.05) == 32  # and one with none: the cap stays on

    sched = Scheduler(BlockManager(400, 4, prefix_caching=False), max_num_seqs=8, max_num_batched_tokens=512)
    doc = Sequence("doc", list(range(1000)), SamplingParams())
    sched.add(doc)
    b = sched.schedule(chunk_tokens=133)
    assert b.prefill == [(doc, 133)]
    run(sched, b)
    chat = Sequence("chat", list(range(40)), SamplingParams())
    sched.add(chat)
    b = sched.schedule(chunk_tokens=133)
    got = {s.request_id: n for s, n in b.prefill}
    assert got == {"doc": 93, "chat": 40}  # the document's quarter (33), the chat whole, the rest to it
    run(sched, b)
    assert chat.output_ids, "the chat's first token came out of a step of 133 prompt tokens"
    while doc.uncomputed > 1:
        b = sched.schedule(chunk_tokens=133)
        assert chat in b.decode and sum(n for _, n in b.prefill) <= 133
        run(sched, b)
    assert sched.schedule().prefill == [], "uncapped: nothing left to prefill"
