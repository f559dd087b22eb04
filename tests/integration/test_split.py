"""Split mode with every role in its own OS process, talking only over loopback sockets."""

from __future__ import annotations

import json
import socket
import struct
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from phasesplit.runtime import metric_names as names
from phasesplit.runtime.kv.wire import DATA, HEADER_SIZE, Header
from phasesplit.runtime.model.loader import resolve
from phasesplit.runtime.model.tokenizer import TextTokenizer
from tests.procs import INTERNAL, Proc, free_port, serve
from tests.prompts import all_prompt_ids

MODEL = "smollm2-135m-instruct"
FP32 = ("--dtype", "float32", "--max-model-len", "2048")


@pytest.fixture(scope="module")
def logs(tmp_path_factory):
    return tmp_path_factory.mktemp("split-logs")


@pytest.fixture(scope="module")
def prompts():
    return all_prompt_ids(TextTokenizer(resolve("smollm2").folder))


def start_split(logs, *, prefill_timeout: str = "15s", policy: str = "retry-local", decode_port: int | None = None,
                prefill: Proc | None = None):
    prefill = prefill or serve("prefill", logs, *FP32)
    decode = serve("decode", logs, *FP32, "--prefill-urls", prefill.url, "--prefill-timeout", prefill_timeout,
                   "--on-prefill-failure", policy, port=decode_port)
    router = serve("router", logs, *FP32, "--prefill-urls", prefill.url, "--decode-urls", decode.url)
    for p in (prefill, decode, router):
        p.wait_ready()
    return prefill, decode, router


@pytest.fixture(scope="module")
def split(logs):
    procs = start_split(logs)
    yield procs
    for p in procs:
        p.stop()


@pytest.fixture(scope="module")
def colocated(logs):
    p = serve("both", logs, *FP32)
    p.wait_ready()
    yield p
    p.stop()


def complete(url: str, ids: list[int], max_tokens: int = 24, timeout: float = 120) -> dict:
    body = {"model": MODEL, "prompt": ids, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    r = httpx.post(url + "/v1/completions", json=body, timeout=timeout)
    assert r.status_code == 200, r.text
    return r.json()


def texts(url: str, prompts: list[list[int]], parallel: int) -> list[str]:
    with ThreadPoolExecutor(parallel) as pool:
        return [r["choices"][0]["text"] for r in pool.map(lambda p: complete(url, p), prompts)]


def state(url: str) -> dict:
    return httpx.get(url + "/debug/state", headers=INTERNAL, timeout=5).json()


def wait_no_blocks(url: str, timeout: float = 20) -> dict:
    deadline = time.monotonic() + timeout
    st = state(url)
    while (st["allocated_blocks"] or st["requests"]) and time.monotonic() < deadline:
        time.sleep(0.2)
        st = state(url)
    return st


def test_split_equals_colocated(split, colocated, prompts):
    _, decode, router = split
    reference = texts(colocated.url, prompts, 1)
    assert texts(router.url, prompts, 1) == reference
    sixteen = (prompts * 2)[:16]
    assert texts(router.url, sixteen, 16) == (reference * 2)[:16]
    assert texts(colocated.url, sixteen, 16) == (reference * 2)[:16]
    # The KV really moved: the decode worker received bytes and prefilled nothing locally.
    m = httpx.get(decode.url + "/metrics").text
    assert float(_sample(m, names.KV_BYTES)) > 0
    assert float(_sample(m, names.LOCAL_PREFILL)) == 0
    assert float(_sample(m, names.KV_TRANSFER_FAILURES)) == 0
    assert wait_no_blocks(decode.url)["allocated_blocks"] == 0


def _placements(metrics_text: str) -> dict[tuple[str, str], float]:
    out = {}
    for line in metrics_text.splitlines():
        if line.startswith(names.PREFILL_PLACEMENT + "{"):
            labels = dict(kv.split("=", 1) for kv in line[line.index("{") + 1 : line.index("}")].split(","))
            out[(labels["where"].strip('"'), labels["reason"].strip('"'))] = float(line.rsplit(" ", 1)[1])
    return out


def test_adaptive_placement_equals_colocated(colocated, logs, prompts):
    """--prefill-placement adaptive on a mix of chats and a ~1,900-token document: the text is
    colocated's, and the decode worker prefilled some prompts itself and sent others away, each
    decision counted with its reason. The ITL target is set between what a chat's and the
    document's prefill steps take on this machine now (measured on the colocated server), so the
    decisions do not hang on how busy the machine is."""
    tokenizer = TextTokenizer(resolve("smollm2").folder)
    document = tokenizer.encode(" ".join(f"Note {i}: the meeting on day {i} discussed budget item {i * 7 % 13} "
                                         f"and agreed to revisit it." for i in range(120)))[:1900]
    chats = prompts[:5]
    # Measured after a first call each, so neither figure includes a cold start.
    complete(colocated.url, chats[0], max_tokens=1)
    chat_s = complete(colocated.url, chats[1], max_tokens=1)["phasesplit_timing"]["prefill_s"]
    doc_s = complete(colocated.url, document[:-1], max_tokens=1)["phasesplit_timing"]["prefill_s"]
    target = (chat_s * doc_s) ** 0.5
    mix = [*chats[:3], document, *chats[3:], document[:-7]]
    reference = texts(colocated.url, mix, 1)
    budget = ("--max-num-batched-tokens", "2048")  # the document's prefill is one step on either side
    prefill = serve("prefill", logs, *FP32, *budget)
    decode = serve("decode", logs, *FP32, *budget, "--prefill-urls", prefill.url, "--prefill-placement", "adaptive",
                   "--itl-target", f"{target:.4f}")
    router = serve("router", logs, *FP32, "--prefill-urls", prefill.url, "--decode-urls", decode.url)
    try:
        for p in (prefill, decode, router):
            p.wait_ready()
        assert texts(router.url, mix, 1) == reference
        m = httpx.get(decode.url + "/metrics").text
        placed = _placements(m)
        local = {reason: n for (where, reason), n in placed.items() if where == "local" and n}
        remote = {reason: n for (where, reason), n in placed.items() if where == "remote" and n}
        costs = httpx.get(decode.url + "/internal/state", headers=INTERNAL, timeout=5).json()["placement_costs"]
        why = f"target {target:.3f} s (chat {chat_s:.3f} s, document {doc_s:.3f} s); {placed}; {costs}"
        assert local and remote, why
        assert sum(local.values()) + sum(remote.values()) == len(mix), why
        assert set(local) <= {"short_prompt", "prefill_queued"} and set(remote) <= {"itl_budget", "remote_faster"}, why
        # Every local placement is a local prefill too (the older counter stays consistent).
        assert float(_sample(m, names.LOCAL_PREFILL)) == sum(local.values())
        assert float(_sample(m, names.KV_BYTES)) > 0
        # What the router's lending reads (routing.lend_prefill): the target, and the fitted step
        # once decode-only steps ran.
        state = httpx.get(decode.url + "/internal/state", headers=INTERNAL, timeout=5).json()
        assert state["itl_target_s"] == pytest.approx(target, abs=1e-4)
        complete(router.url, chats[0], max_tokens=8)
        assert httpx.get(decode.url + "/internal/state", headers=INTERNAL, timeout=5).json()["next_step_s"] > 0
        assert wait_no_blocks(decode.url)["allocated_blocks"] == 0
    finally:
        for p in (router, decode, prefill):
            p.stop()


def test_lent_requests_equal_colocated(colocated, logs, prompts):
    """--lend-idle-prefill: the router sends whole requests to the prefill worker while it has
    nothing to prefill and carries two requests fewer than the decode worker. Those are prefilled and
    decoded there, and every text is still colocated's, token for token."""
    sixteen = (prompts * 2)[:16]
    with ThreadPoolExecutor(16) as pool:
        reference = [r["choices"][0]["text"] for r in pool.map(lambda p: complete(colocated.url, p, 48), sixteen)]
    prefill = serve("prefill", logs, *FP32)
    decode = serve("decode", logs, *FP32, "--prefill-urls", prefill.url)
    router = serve("router", logs, *FP32, "--prefill-urls", prefill.url, "--decode-urls", decode.url,
                   "--lend-idle-prefill")
    try:
        for p in (prefill, decode, router):
            p.wait_ready()
        # Staggered past the router's 0.5 s poll: it lends at most one prompt per poll that finds
        # the prefill worker idle while the decode worker carries two requests more (48 tokens:
        # streams long enough that two overlap), and requests sent all at once fall within one
        # poll (under a loaded CI none was lent that way).
        def staggered(i: int) -> str:
            time.sleep(0.7 * i)
            return complete(router.url, sixteen[i], max_tokens=48)["choices"][0]["text"]

        with ThreadPoolExecutor(16) as pool:
            got = list(pool.map(staggered, range(len(sixteen))))
        assert got == reference
        lent = float(_sample(httpx.get(router.url + "/metrics").text, names.LENT_REQUESTS))
        assert lent >= 1
        # The lent ones never reached the decode worker: it saw the rest, all prefilled remotely.
        m = httpx.get(decode.url + "/metrics").text
        assert float(_sample(m, names.SUCCESS)) == len(sixteen) - lent
        assert float(_sample(m, names.LOCAL_PREFILL)) == 0
        # The prefill worker serves whole requests only as the router sends them: never with
        # prefill workers of its own to call.
        body = {"request_id": "x", "prompt_ids": prompts[0], "prefill_urls": [prefill.url]}
        r = httpx.post(prefill.url + "/internal/generate", json=body, headers=INTERNAL, timeout=10)
        assert r.status_code == 400 and r.json()["error"]["param"] == "prefill_urls"
        for p in (prefill, decode):
            assert wait_no_blocks(p.url)["allocated_blocks"] == 0
    finally:
        for p in (router, decode, prefill):
            p.stop()


def test_seeded_sampling_split_equals_colocated(split, colocated, prompts):
    """Non-greedy with a seed: the prefill worker samples the first token and the decode worker
    the rest, yet the text is the colocated one (and colocated stays reproducible)."""
    router = split[2]

    def seeded(url: str, ids: list[int]) -> str:
        body = {"model": MODEL, "prompt": ids, "max_tokens": 16, "temperature": 1.0, "seed": 1234,
                "ignore_eos": True}
        r = httpx.post(url + "/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]

    for ids in prompts[:2]:
        reference = seeded(colocated.url, ids)
        assert seeded(colocated.url, ids) == reference
        assert seeded(router.url, ids) == reference


def test_router_metrics_include_ttft_itl(split, prompts):
    router = split[2]
    timing = complete(router.url, prompts[0], max_tokens=4)["phasesplit_timing"]
    assert 0 < timing["kv_transfer_s"] <= timing["prefill_s"]  # the transfer happens inside the prefill
    # The remote prefill taken apart: the prefill worker's own queue and compute lie inside the
    # decode worker's prefill_s (one clock: both on this machine); the hops are the rest.
    queued, computed = timing["remote_queued_s"], timing["remote_prefill_s"]
    assert queued >= 0 and computed > 0 and queued + computed <= timing["prefill_s"]
    assert timing["remote_hop_s"] == pytest.approx(timing["prefill_s"] - queued - computed, abs=1e-9)
    m = httpx.get(router.url + "/metrics").text
    assert float(_sample(m, names.TTFT + "_count", phase="router")) > 0
    assert float(_sample(m, names.ITL + "_count", phase="router")) > 0


def test_garbage_kv_frames_are_rejected(split, prompts):
    _, decode, router = split
    kv_port = httpx.get(decode.url + "/internal/state", headers=INTERNAL).json()["kv_port"]
    expected = complete(router.url, prompts[0])["choices"][0]["text"]
    with ThreadPoolExecutor(2) as pool:
        fut = pool.submit(complete, router.url, prompts[0])
        rejected = httpx.get(decode.url + "/internal/state", headers=INTERNAL).json()["kv_refused"]
        for payload in (b"\x00" * 10, b"GET / HTTP/1.1\r\n\r\n" + b"x" * 80, _truncated_frame()):
            with socket.create_connection(("127.0.0.1", kv_port)) as s:
                try:
                    s.sendall(payload)
                    s.shutdown(socket.SHUT_WR)
                    s.recv(16)
                except OSError:
                    pass  # the receiver closed on us: that is the point
        assert fut.result()["choices"][0]["text"] == expected
    deadline = time.monotonic() + 10
    while httpx.get(decode.url + "/internal/state", headers=INTERNAL).json()["kv_refused"] < rejected + 3:
        assert time.monotonic() < deadline, "every unauthenticated connection must be refused"
        time.sleep(0.1)
    assert wait_no_blocks(decode.url)["allocated_blocks"] == 0


def _truncated_frame() -> bytes:
    h = Header(DATA, transfer_id=12345, layer=0, token_start=0, num_tokens=4, kv_heads=3, head_dim=64, dtype=1,
               payload_len=2 * 4 * 3 * 64 * 4)
    raw = h.pack()
    assert len(raw) == HEADER_SIZE
    return raw + struct.pack("<f", 1.0) * 10  # far short of the announced payload


def _sample(text: str, name: str, phase: str | None = None) -> str:
    for line in text.splitlines():
        if line.startswith(name + "{") and (phase is None or f'phase="{phase}"' in line):
            return line.rsplit(" ", 1)[1]
    raise AssertionError(f"{name} missing")


def test_kill_prefill_worker_mid_flight(logs, prompts):
    prefill, decode, router = start_split(logs, prefill_timeout="10s")
    try:
        with ThreadPoolExecutor(8) as pool:
            futs = [pool.submit(_outcome, router.url, p) for p in (prompts * 2)[:8]]
            time.sleep(1.0)
            prefill.kill()
            outcomes = [f.result(timeout=120) for f in futs]
        # Every request either completed (retried or prefilled locally) or ended with an error event.
        assert all(o in ("ok", "error") for o in outcomes), outcomes
        assert outcomes.count("ok") >= 1
        st = wait_no_blocks(decode.url)
        assert st["allocated_blocks"] == 0 and st["requests"] == 0, st
        assert httpx.get(router.url + "/health").status_code == 200
    finally:
        for p in (prefill, decode, router):
            p.stop()


def _outcome(url: str, ids: list[int]) -> str:
    body = {"model": MODEL, "prompt": ids, "max_tokens": 24, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=90) as r:
        if r.status_code >= 400:  # failed before its first token: an HTTP error in OpenAI's shape
            return "error" if "error" in json.loads(r.read()) else "cut"
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                if "error" in json.loads(line[6:]):
                    return "error"
            if line == "data: [DONE]":
                return "ok"
    return "cut"


def test_fail_policy_gives_error_event(logs, prompts):
    dead = free_port()  # nothing listens here: every remote prefill fails at once
    decode = serve("decode", logs, *FP32, "--prefill-urls", f"http://127.0.0.1:{dead}", "--on-prefill-failure", "fail")
    router = serve("router", logs, *FP32, "--decode-urls", decode.url, "--prefill-urls", f"http://127.0.0.1:{dead}")
    try:
        decode.wait_ready()
        router.wait_ready()
        assert _outcome(router.url, prompts[0]) == "error"
        assert wait_no_blocks(decode.url)["allocated_blocks"] == 0
        # The failed attempt is counted (the KV transfer failure alert reads this).
        m = httpx.get(decode.url + "/metrics").text
        assert float(_sample(m, names.KV_TRANSFER_FAILURES, "decode")) == 1
    finally:
        decode.stop()
        router.stop()


def test_kill_decode_worker_mid_stream(logs, prompts):
    prefill, decode, router = start_split(logs)
    port = int(decode.url.rsplit(":", 1)[1])
    try:
        body = {"model": MODEL, "prompt": prompts[0], "max_tokens": 400, "temperature": 0, "ignore_eos": True,
                "stream": True}
        got_error = False
        t0 = time.monotonic()
        with httpx.stream("POST", router.url + "/v1/completions", json=body, timeout=60) as r:
            n = 0
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                if "error" in json.loads(line[6:]):
                    got_error = True
                    break
                n += 1
                if n == 3:
                    decode.kill()
                    t0 = time.monotonic()
        assert got_error, "the client must get an error event, not a silent cut"
        assert time.monotonic() - t0 < 10
        assert httpx.get(router.url + "/health").status_code == 200
        decode2 = serve("decode", logs, *FP32, "--prefill-urls", prefill.url, port=port)
        decode2.wait_ready()
        deadline = time.monotonic() + 30
        while httpx.get(router.url + "/ready").status_code != 200 and time.monotonic() < deadline:
            time.sleep(0.3)
        assert complete(router.url, prompts[1], max_tokens=8)["usage"]["completion_tokens"] == 8
        decode2.stop()
    finally:
        for p in (prefill, decode, router):
            p.stop()


def test_a_request_that_cannot_reach_its_decode_worker_waits_for_one_instead_of_failing(logs, prompts):
    """The only decode worker dies between two polls of the router: the requests routed to it find
    the connection refused. Nothing started there, so the router holds them until a worker is up at
    that address again and they complete, where they used to fail with 503 "decode worker ...
    failed" (as they did under overload, when the router's connect timed out)."""
    decode = serve("decode", logs, *FP32)  # no prefill pool: it prefills every prompt itself
    port = int(decode.url.rsplit(":", 1)[1])
    # Polls far apart, so that the requests below reach the dead worker before a poll finds it down.
    router = serve("router", logs, *FP32, "--decode-urls", decode.url, "--hold-timeout", "120s",
                   "--worker-poll-interval", "5s")
    decode2 = None
    try:
        decode.wait_ready()
        router.wait_ready()
        want = complete(router.url, prompts[0], max_tokens=8)["choices"][0]["text"]
        decode.kill()  # the router still counts it up until its next poll, up to 5 s from now
        with ThreadPoolExecutor(4) as ex:
            sent = [ex.submit(complete, router.url, prompts[0], 8) for _ in range(4)]
            time.sleep(1.0)  # the sends land on the dead worker or in the held queue; then it comes back
            decode2 = serve("decode", logs, *FP32, port=port)
            got = [f.result()["choices"][0]["text"] for f in sent]
        assert got == [want] * 4
        # Not vacuous: they found the dead worker (no poll had marked it down yet).
        assert "could not be reached" in router.tail(20000), router.tail()
    finally:
        for p in (decode, decode2, router):
            if p is not None:
                p.stop()


def test_reservation_is_held_while_a_frame_lands():
    """A remote request aborted while a K/V frame is still being received into its blocks: the
    blocks stay allocated (no other request can get them) until the receiver reports the frame's
    end, then they are freed. The same holds when the request falls back to a local prefill."""
    from phasesplit.runtime.engine.engine import EngineConfig, KVConnector, LLMEngine
    from phasesplit.runtime.engine.model_runner import RunnerConfig
    from phasesplit.runtime.request import SamplingParams

    engine = LLMEngine("smollm2", EngineConfig(runner=RunnerConfig(dtype="float32", kv_cache_memory=16 << 20)))
    landing: dict[str, list[int]] = {}

    class FrameInFlight(KVConnector):  # what disagg.decode does while the receiver is busy
        def release(self, seq) -> bool:
            landing[seq.request_id] = seq.block_table
            return False

    engine.connector = FrameInFlight()
    seq = engine.add_request("a", list(range(1, 70)), SamplingParams(max_tokens=4), remote=True)
    reserved = list(seq.block_table)
    assert reserved and engine.blocks.num_allocated == len(reserved)
    engine.abort("a")
    assert "a" not in engine.seqs
    assert engine.blocks.num_allocated == len(reserved), "held, not freed"
    other = engine.add_request("b", list(range(1, 70)), SamplingParams(max_tokens=4), remote=True)
    assert not set(other.block_table) & set(reserved)
    engine.release_blocks(landing["a"])
    held = len(other.block_table)
    assert engine.blocks.num_allocated == held
    engine.prefill_locally("b")  # blocks dropped while landing: held apart, the request goes on
    assert not other.block_table and engine.blocks.num_allocated == held
    engine.release_blocks(landing["b"])
    assert engine.blocks.num_allocated == 0
    engine.connector = KVConnector()
    out = engine.step()  # computes its prompt here now
    assert out and out[0].request_id == "b"
    engine.abort("b")
    assert engine.blocks.num_allocated == 0


def test_a_decode_worker_pauses_for_its_short_remote_prefill_while_its_stream_is_ahead():
    """LLMEngine.remote_pause (what the engine thread waits before a step): a remote prefill in
    flight, estimated short, and a stream ahead of the ITL pace -> wait what is left of the
    estimate, each gap between two tokens within the target; no pause without the setting,
    without a remote prefill the connector stamped, or while a prompt waits to be prefilled here
    (it would be held up too). The target is 10 s, so the stream is ahead of it on any machine."""
    from phasesplit.runtime.engine.engine import EngineConfig, LLMEngine
    from phasesplit.runtime.engine.model_runner import RunnerConfig
    from phasesplit.runtime.request import SamplingParams

    engine = LLMEngine("smollm2", EngineConfig(remote_pause_target_s=10.0,
                                               runner=RunnerConfig(dtype="float32", kv_cache_memory=16 << 20)))
    engine.add_request("a", list(range(1, 20)), SamplingParams(max_tokens=64, ignore_eos=True))
    for _ in range(4):
        engine.step()
    assert engine.seqs["a"].output_ids, "the stream runs"
    assert engine.remote_pause() == 0, "no remote prefill in flight"
    b = engine.add_request("b", list(range(1, 40)), SamplingParams(max_tokens=4), remote=True)
    assert engine.remote_pause() == 0, "not stamped by the connector: not weighed"
    b.remote_started, b.remote_estimate_s = time.monotonic(), 5.0
    pause = engine.remote_pause()
    assert 0 < pause <= 5.0
    time.sleep(0.05)
    assert engine.remote_pause() < pause, "what is left of the estimate"
    b.remote_estimate_s = 40.0  # a long one: paused for between steps, each gap within the target
    assert 0 < engine.remote_pause() < 0.8 * 10.0 - (time.monotonic() - engine.seqs["a"].last_token_time)
    engine.add_request("c", list(range(1, 30)), SamplingParams(max_tokens=4))
    assert engine.remote_pause() == 0, "a prompt waits here"
    engine.step()  # c's prompt computed (or started): no pause while it is in chunks either
    engine.abort("c")
    assert engine.remote_pause() > 0
    engine.config.remote_pause_target_s = None
    assert engine.remote_pause() == 0
    for r in "ab":
        engine.abort(r)
    assert engine.blocks.num_allocated == 0


def test_remote_reservations_count_against_max_num_seqs():
    """A decode worker reserves blocks for remote prefills only while its batch has room: with
    --max-num-seqs 2, a third remote request waits unreserved (no K/V is sent for it) until one
    of the first two ends."""
    from phasesplit.runtime.engine.engine import EngineConfig, LLMEngine
    from phasesplit.runtime.engine.model_runner import RunnerConfig
    from phasesplit.runtime.request import SamplingParams

    engine = LLMEngine("smollm2", EngineConfig(max_num_seqs=2,
                                               runner=RunnerConfig(dtype="float32", kv_cache_memory=16 << 20)))
    seqs = [engine.add_request(r, list(range(1, 40)), SamplingParams(max_tokens=4), remote=True) for r in "abc"]
    assert [bool(s.block_table) for s in seqs] == [True, True, False]
    engine.remote_prefilled("a", 5)  # a joins the batch: still two in it (a running, b reserved)
    engine.step()
    assert not seqs[2].block_table
    engine.abort("b")
    engine.step()
    assert seqs[2].block_table, "reserved once a place in the batch was free"
    for r in "ac":
        engine.abort(r)
    assert engine.blocks.num_allocated == 0


def test_remote_first_token_goes_out_before_the_next_step():
    """The first token of a remote prefill reaches its stream as soon as the engine thread takes
    it in, not after the forward pass that computes the second token (one ITL on split's TTFT)."""
    import asyncio

    from phasesplit.runtime.engine.engine import EngineConfig, EngineObserver, LLMEngine
    from phasesplit.runtime.engine.model_runner import RunnerConfig
    from phasesplit.runtime.request import SamplingParams
    from phasesplit.runtime.server.async_engine import AsyncEngine

    events: list[str] = []

    class Steps(EngineObserver):
        def on_step(self, batch, seconds):
            events.append(f"step {len(batch.decode)}")

    engine = LLMEngine("smollm2", EngineConfig(runner=RunnerConfig(dtype="float32", kv_cache_memory=16 << 20)),
                       observer=Steps())  # the default connector reserves and waits: a remote prefill
    # No prefill worker sends K/V here: the reserved blocks would hold whatever memory the cache
    # was allocated over (NaN after a long test session: the sampler then fails). Zeros decode finitely.
    engine.runner.kv_cache.zero_()
    aengine = AsyncEngine(engine)
    deliver = aengine._deliver

    def delivered(request_id, item):  # on the engine thread, in order with its steps
        events.append(f"deliver {getattr(item, 'new_token_ids', item)}")
        deliver(request_id, item)

    aengine._deliver = delivered

    async def run() -> list[int]:
        tokens = []
        outputs = aengine.generate("r", list(range(1, 40)), SamplingParams(max_tokens=3, temperature=0, ignore_eos=True),
                                   remote=True)
        first = asyncio.ensure_future(anext(outputs))
        while not engine.seqs.get("r") or not engine.seqs["r"].block_table:
            await asyncio.sleep(0.01)
        aengine.call(lambda e: e.remote_prefilled("r", 7))
        out = await first
        tokens += out.new_token_ids
        async for out in outputs:
            tokens += out.new_token_ids
        return tokens

    try:
        tokens = asyncio.run(run())
    finally:
        aengine.shutdown()
    assert tokens[0] == 7 and len(tokens) == 3
    assert events[:2] == ["deliver [7]", "step 1"], events  # sent, then the second token computed
    assert engine.step_cost.count == events.count("step 1") == 2, events


def test_local_prefill_threshold_counts_uncached_tokens():
    """--local-prefill-threshold compares the tokens the decode worker's prefix cache lacks, not
    the whole prompt: a long prompt whose prefix is cached here is computed here, a long uncached
    one goes to a prefill worker (its transfer starts), and aborting it frees its reservation."""
    import asyncio
    from types import SimpleNamespace

    from phasesplit.runtime.disagg.decode import DecodeConnector
    from phasesplit.runtime.engine.engine import EngineConfig, LLMEngine
    from phasesplit.runtime.engine.model_runner import RunnerConfig
    from phasesplit.runtime.engine.sequence import Status
    from phasesplit.runtime.request import SamplingParams
    from phasesplit.runtime.server.metrics import Metrics

    engine = LLMEngine("smollm2", EngineConfig(runner=RunnerConfig(dtype="float32", kv_cache_memory=16 << 20)))
    metrics = Metrics("m", "decode")
    loop = asyncio.new_event_loop()  # never run: the transfer is only queued
    connector = DecodeConnector(SimpleNamespace(engine=engine), None, metrics, kv_host="", prefill_urls=["http://x"],
                                policy="local", timeout=1.0, local_threshold=20,
                                secret="unit-test-internal-secret")
    connector.loop = loop
    engine.connector = connector
    prompt = list(range(1, 70))
    engine.generate([prompt], SamplingParams(max_tokens=1))  # its first 64 tokens are now cached
    local = engine.add_request("x", prompt + [5], SamplingParams(max_tokens=2), remote=True)
    assert local.num_computed == 64 and local.status is Status.RUNNING, "70 tokens, 6 uncached: computed here"
    assert metrics.registry.get_sample_value(names.LOCAL_PREFILL, {"model": "m", "phase": "decode"}) == 1
    assert not connector.transfers
    remote = engine.add_request("y", list(range(100, 170)), SamplingParams(max_tokens=2), remote=True)
    assert remote.status is Status.REMOTE_PREFILL and "y" in connector.transfers
    engine.abort("y")
    assert connector.transfers["y"].ended and not remote.block_table
    while "x" in engine.seqs:
        engine.step()
    assert engine.blocks.num_allocated == 0
    loop.close()
