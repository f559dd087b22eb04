"""Router worker choice: decode by free blocks, prefill by queue with prefix affinity."""

import random

from phasesplit.runtime.server.routing import (
    AFFINITY_SLACK_TOKENS,
    LEND_MARGIN,
    Pool,
    Worker,
    lend_prefill,
    pick_decode,
    rank_prefill,
)


def pool(*workers: Worker) -> Pool:
    return Pool({w.url: w for w in workers})


def test_decode_most_free_blocks_then_fewest_running():
    p = pool(Worker("a", True, free_blocks=10, running=1), Worker("b", True, free_blocks=50, running=9),
             Worker("c", False, free_blocks=99), Worker("d", True, free_blocks=50, running=2))
    assert pick_decode(p).url == "d"
    assert pick_decode(pool(Worker("x", False))) is None


def test_prefill_same_prefix_same_worker_unless_overloaded():
    ws = [Worker(f"http://p{i}", True) for i in range(4)]
    p = pool(*ws)
    rng = random.Random(0)
    prompt = list(range(100))
    homes = {rank_prefill(p, rng, prompt + [i])[0].url for i in range(20)}
    assert len(homes) == 1, "prompts sharing the first block stick to one worker"
    home = next(w for w in ws if w.url in homes)
    home.queued_tokens = AFFINITY_SLACK_TOKENS + 1
    assert rank_prefill(p, rng, prompt)[0] is not home, "an overloaded home loses its affinity"
    spread = {rank_prefill(p, rng, [i] * 40)[0].url for i in range(200)}
    assert len(spread) >= 3, "different prefixes spread over the pool"


def test_prefill_fallbacks_are_everyone_else_by_queue():
    ws = [Worker("a", True, queued_tokens=5), Worker("b", True, queued_tokens=1), Worker("c", True, queued_tokens=3)]
    ranked = rank_prefill(pool(*ws), random.Random(1))
    assert [w.url for w in ranked] == ["b", "c", "a"]


def test_prefill_counts_part_way_prompts_as_busy():
    # "a" has nothing waiting but is in the middle of a long prompt; "b" has a short one waiting.
    ws = [Worker("a", True, waiting_tokens=0, queued_tokens=2500), Worker("b", True, waiting_tokens=300,
                                                                           queued_tokens=300)]
    assert rank_prefill(pool(*ws), random.Random(0))[0].url == "b"
    # Idle workers share new prompts (ties at random), not the first in the list every time.
    idle = pool(*(Worker(f"w{i}", True) for i in range(3)))
    rng = random.Random(0)
    assert len({rank_prefill(idle, rng)[0].url for _ in range(30)}) == 3


def test_pool_can_be_iterated_while_discovery_changes_it():
    """The discovery thread sets URLs while the event loop iterates the pool (polls, picks,
    gauges): iteration must never see the mapping change under it."""
    import threading

    p = Pool()
    stop = threading.Event()
    errors: list[BaseException] = []

    def discover() -> None:
        i = 0
        while not stop.is_set():
            p.set_urls([f"http://w{j}" for j in range(i % 50)])
            i += 1

    t = threading.Thread(target=discover)
    t.start()
    try:
        for _ in range(20000):
            try:
                for w in p.workers.values():
                    w.up = True
                p.live()
                pick_decode(p)
            except RuntimeError as e:  # "dictionary changed size during iteration"
                errors.append(e)
                break
    finally:
        stop.set()
        t.join()
    assert not errors, errors


def test_set_urls_keeps_known_workers_and_drops_gone_ones():
    p = Pool()
    p.set_urls(["http://a", "http://b"])
    a = p.workers["http://a"]
    a.up, a.free_blocks = True, 7
    p.set_urls(["http://a", "http://c"])
    assert list(p.workers) == ["http://a", "http://c"] and p.workers["http://a"] is a


def test_router_process_does_not_import_torch():
    import subprocess
    import sys

    # The modules `phasesplit serve --role router` goes through, from the command line to the app.
    code = ("import sys, phasesplit.runtime.cli, phasesplit.runtime.server.launch, phasesplit.runtime.server.router; "
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out


def test_discovery_skips_terminating_and_unready_endpoints():
    """A pod being deleted (preStop delay, drain) is marked terminating in its EndpointSlice: the
    router sends it nothing new, whatever its ready condition says."""
    from types import SimpleNamespace as NS

    from phasesplit.runtime.server.router import slice_urls

    def ep(addr, ready=True, terminating=None):
        return NS(addresses=[addr], conditions=NS(ready=ready, serving=ready, terminating=terminating))

    obj = NS(ports=[NS(name="http", port=8000)], endpoints=[
        ep("10.0.0.1"), ep("10.0.0.2", ready=False), ep("10.0.0.3", terminating=True),
        ep("10.0.0.4", ready=False, terminating=True), NS(addresses=["10.0.0.5"], conditions=None)])
    assert slice_urls(obj) == ["http://10.0.0.1:8000", "http://10.0.0.5:8000"]


def test_a_refusing_decode_worker_is_skipped_for_the_retry():
    pool = Pool()
    pool.set_urls(["http://a", "http://b"])
    for w, free in zip(pool.workers.values(), (10, 5), strict=True):
        w.up, w.free_blocks = True, free
    assert pick_decode(pool).url == "http://a"
    assert pick_decode(pool, exclude={"http://a"}).url == "http://b"
    assert pick_decode(pool, exclude={"http://a", "http://b"}) is None


def test_prefill_peers_only_of_the_decode_workers_revision():
    """Mid-rollout: two revisions behind the same Services. A decode worker is never given a
    prefill worker of another revision, however idle that one is."""
    old = [Worker(f"http://old{i}", True, queued_tokens=900, revision="r1") for i in range(2)]
    new = [Worker("http://new0", True, queued_tokens=0, revision="r2")]
    p = pool(*old, *new)
    rng = random.Random(3)
    for i in range(50):
        ranked = rank_prefill(p, rng, [i] * 40, revision="r1")
        assert {w.revision for w in ranked} == {"r1"} and len(ranked) == 2
        assert [w.url for w in rank_prefill(p, rng, [i] * 40, revision="r2")] == ["http://new0"]
    assert rank_prefill(p, rng, revision="r3") == [], "no peer of its revision: the decode worker prefills itself"
    # Without a revision (the router of an older release) every live worker is a candidate.
    assert len(rank_prefill(p, rng)) == 3
    # Workers started without --revision ("") pair with each other only.
    plain = pool(Worker("a", True), Worker("b", True, revision="r1"))
    assert [w.url for w in rank_prefill(plain, rng, revision="")] == ["a"]


def test_decode_workers_with_a_prefill_peer_of_their_revision_come_first():
    d_old = Worker("http://d-old", True, free_blocks=90, revision="r1")
    d_new = Worker("http://d-new", True, free_blocks=10, revision="r2")
    p = pool(d_old, d_new)
    assert pick_decode(p).url == "http://d-old"  # no preference asked: most free blocks
    assert pick_decode(p, prefill_revisions={"r2"}).url == "http://d-new"  # the old prefill pool is gone
    assert pick_decode(p, prefill_revisions={"r1", "r2"}).url == "http://d-old"
    # No decode worker has a peer: any of them (it prefills locally) rather than none.
    assert pick_decode(p, prefill_revisions={"r9"}).url == "http://d-old"
    assert pick_decode(p, exclude={"http://d-new"}, prefill_revisions={"r2"}).url == "http://d-old"


def test_lend_only_an_idle_prefill_worker_that_carries_less():
    d = Worker("http://d", True, running=3)
    busy = Worker("http://p1", True, takes_requests=True, queued_tokens=64)  # a prompt to prefill
    idle = Worker("http://p2", True, takes_requests=True, running=1)
    assert lend_prefill(pool(busy, idle), d) is idle
    # Never a worker with prompt work, one that cannot serve whole requests, or one down or tried.
    assert lend_prefill(pool(busy), d) is None
    assert lend_prefill(pool(Worker("http://old", True, running=0)), d) is None
    assert lend_prefill(pool(Worker("http://p3", False, takes_requests=True)), d) is None
    assert lend_prefill(pool(idle), d, exclude={"http://p2"}) is None
    # The decode worker keeps requests on a tie, and with one more than the prefill worker.
    idle.running = 3
    assert lend_prefill(pool(idle), d) is None
    idle.running = 2
    assert lend_prefill(pool(idle), d) is None
    idle.running, d.running = 0, 1  # one stream: the decode worker is no bottleneck
    assert lend_prefill(pool(idle), d) is None
    # Requests sent since the last poll and requests waiting count as load on both sides.
    idle.running, d.inflight, d.waiting = 1, 0, 0
    d.running = 1
    assert lend_prefill(pool(idle), d) is None
    d.waiting = 2
    assert lend_prefill(pool(idle), d) is idle
    idle.inflight = 2
    assert lend_prefill(pool(idle), d) is None


def test_lend_only_to_relieve_a_decode_worker_near_its_itl_target():
    """A decode worker that reports its ITL target and fitted step is lent for only while a step
    with one stream more takes LEND_BUSY of the target or more: far inside it, a lent stream gains
    nothing and risks the long prompts the prefill worker gets next."""
    from phasesplit.runtime.server.routing import LEND_BUSY

    d = Worker("http://d", True, running=4, itl_target_s=0.1, next_step_s=0.023)
    idle = Worker("http://p", True, takes_requests=True)
    assert lend_prefill(pool(idle), d) is None
    d.next_step_s = LEND_BUSY * 0.1
    assert lend_prefill(pool(idle), d) is idle
    # The margin still holds, and a worker that reports neither (static placement, an older
    # one) or has no decode step fitted yet is weighed by the margin alone.
    d.running = 1
    assert lend_prefill(pool(idle), d) is None
    d.running = 4
    for target, step in ((None, 0.023), (0.1, None)):
        d.itl_target_s, d.next_step_s = target, step
        assert lend_prefill(pool(idle), d) is idle


def test_lent_requests_balance_a_decode_heavy_stream():
    """Requests arriving one per poll, each finishing after eight arrivals: with lending the
    decode worker carries about half, and a prefill worker given a prompt is not lent another
    until its prompt is done (the router counts the prompt as queued there)."""
    d = Worker("http://d", True)
    p = Worker("http://p", True, takes_requests=True)
    pools = pool(p)
    where: list[str] = []
    for _ in range(40):
        lent = lend_prefill(pools, d)
        w = lent or d
        w.running += 1
        where.append(w.url)
        if len(where) > 8:  # the request eight arrivals back finished
            gone = d if where[-9] == d.url else p
            gone.running -= 1
    assert 15 <= where.count(p.url) <= 25 and 0 <= d.running - p.running <= LEND_MARGIN
    p.queued_tokens = 64  # the router's own count after lending it a prompt, until the next poll
    assert lend_prefill(pools, Worker("http://d2", True, running=50)) is None
