"""The controller's machinery without a cluster: the work queue and the Lease-based election."""

from __future__ import annotations

import datetime

from kubernetes.client.exceptions import ApiException

from phasesplit.operator.leader import LeaderElector
from phasesplit.operator.workqueue import WorkQueue


class Clock:
    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def test_a_key_is_queued_once_however_many_events():
    q = WorkQueue()
    for _ in range(5):
        q.add("a")
    q.add("b")
    assert [q.get(timeout=0), q.get(timeout=0), q.get(timeout=0)] == ["a", "b", None]


def test_a_key_added_while_processed_comes_back_after_done():
    q = WorkQueue()
    q.add("a")
    assert q.get(timeout=0) == "a"
    q.add("a")  # an event during the pass
    assert q.get(timeout=0) is None  # never two passes of one key at once
    q.done("a")
    assert q.get(timeout=0) == "a"


def test_failures_back_off_exponentially_and_success_resets():
    clock = Clock()
    q = WorkQueue(base_delay=0.5, max_delay=4.0, clock=clock)
    delays = [q.retry("a") for _ in range(5)]
    assert delays == [0.5, 1.0, 2.0, 4.0, 4.0]
    assert q.get(timeout=0) is None
    clock.t += 0.5
    assert q.get(timeout=0) == "a"
    q.done("a")
    q.forget("a")
    assert q.retry("a") == 0.5


def test_close_wakes_the_workers():
    q = WorkQueue()
    q.close()
    assert q.get() is None


class LeaseStore:
    """The API server's side of a Lease: create once, replace only at the current resourceVersion."""

    def __init__(self):
        self.lease = None
        self.rv = 0
        self.down = False

    def get_lease(self, namespace, name):
        if self.down:
            raise OSError("connection refused")
        return None if self.lease is None else {**self.lease, "metadata": {**self.lease["metadata"]}}

    def create_lease(self, namespace, body):
        if self.lease is not None:
            raise ApiException(status=409, reason="AlreadyExists")
        self.rv += 1
        self.lease = {**body, "metadata": {**body["metadata"], "resourceVersion": str(self.rv)}}
        return self.lease

    def replace_lease(self, namespace, name, body):
        if self.down:
            raise OSError("connection refused")
        if body["metadata"]["resourceVersion"] != self.lease["metadata"]["resourceVersion"]:
            raise ApiException(status=409, reason="Conflict")
        self.rv += 1
        self.lease = {**body, "metadata": {**body["metadata"], "resourceVersion": str(self.rv)}}
        return self.lease


def electors(store, clock, *names):
    changes = {n: [] for n in names}
    return [LeaderElector(store, "ns", "lease", n, changes[n].append, clock=clock) for n in names], changes


def test_only_one_of_two_candidates_leads():
    store, clock = LeaseStore(), Clock()
    (a, b), changes = electors(store, clock, "a", "b")
    assert a.try_once() and not b.try_once()
    for _ in range(10):  # renewals keep it
        clock.t += 2
        assert a.try_once() and not b.try_once()
    assert changes == {"a": [True], "b": []}


def test_a_lease_not_renewed_passes_to_the_other_candidate():
    store, clock = LeaseStore(), Clock()
    (a, b), changes = electors(store, clock, "a", "b")
    a.try_once()
    clock.t += 10
    assert not b.try_once()  # not expired yet (15 s)
    clock.t += 6
    assert b.try_once()
    assert store.lease["spec"]["holderIdentity"] == "b" and store.lease["spec"]["leaseTransitions"] == 1
    # The old holder, back, sees the Lease taken and steps down.
    assert not a.try_once() and changes["a"] == [True, False]


def test_a_holder_that_cannot_renew_steps_down_before_the_lease_expires():
    store, clock = LeaseStore(), Clock()
    (a,), changes = electors(store, clock, "a")
    a.try_once()
    store.down = True
    clock.t += 5
    assert a.try_once()  # within the renew deadline (10 s): still leading
    clock.t += 6
    assert not a.try_once() and changes["a"] == [True, False]


def test_a_clean_stop_hands_the_lease_over_at_once():
    store, clock = LeaseStore(), Clock()
    (a, b), _ = electors(store, clock, "a", "b")
    a.try_once()
    a.stop()
    assert b.try_once()


def test_renew_time_is_rfc3339_with_microseconds():
    store, clock = LeaseStore(), Clock(1_700_000_000.25)
    (a,), _ = electors(store, clock, "a")
    a.try_once()
    renew = store.lease["spec"]["renewTime"]
    assert renew == "2023-11-14T22:13:20.250000Z"
    assert datetime.datetime.fromisoformat(renew.replace("Z", "+00:00")).timestamp() == clock.t
