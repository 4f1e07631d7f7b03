"""A router's view of the nodes, kept from their residency logs: the node's log (what
it records, what it answers whom, when it says to start again), L2's changes going
into it, the node's ``changes`` answer, and the router's ``ResidencyView`` (what it
answers, when a node is stale, its bounds)."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
from raykv.cache_actors.errors import DeadlineExceededError
from raykv.cache_actors.node.l2_index import L2Index
from raykv.cache_actors.node.l2_pools import L2Pools
from raykv.cache_actors.node.load_costs import LoadCosts
from raykv.cache_actors.node.residency_log import ResidencyLog
from raykv.cache_actors.node.residency_query import ResidencyQuery
from raykv.controllers.residency import ResidencyChanges
from raykv.integrations.serve import residency_view
from raykv.integrations.serve.residency_view import ResidencyView

from tests.unit.test_l2_pools import ME, A, B, FakeNode, layout

OA, OB = A.owner, B.owner


def test_the_log_answers_an_owner_its_own_changes_in_order():
    log = ResidencyLog(capacity=8)
    log.record(OA, "l2", ["m_a", "m_b"], True)
    log.record(OB, "l2", ["n_a"], True)  # another owner's
    log.record(OA, "segment", ["m_a"], True)
    log.record(OA, "l2", ["m_a"], False)
    assert log.last == 5
    assert log.since(0, OA, "m_") == ([("l2", "m_a", True), ("l2", "m_b", True),
                                       ("segment", "m_a", True), ("l2", "m_a", False)], 5)
    assert log.since(3, OA, "m_") == ([("segment", "m_a", True), ("l2", "m_a", False)], 5)
    assert log.since(5, OA, "m_") == ([], 5)
    assert log.since(0, OB, "n_") == ([("l2", "n_a", True)], 5)
    assert log.since(0, OA, "m_b") == ([("l2", "m_b", True)], 5)  # keys of its prefix only
    assert log.since(0, OA, "m_", limit=2) == ([("l2", "m_a", True), ("l2", "m_b", True)], 2)


def test_the_log_says_to_start_again_when_it_cannot_answer():
    log = ResidencyLog(capacity=3)
    log.record(OA, "l2", ["m_a", "m_b", "m_c", "m_d"], True)  # m_a no longer kept
    assert log.since(0, OA, "") is None  # fell behind
    assert log.since(1, OA, "")[0] == [("l2", k, True) for k in ("m_b", "m_c", "m_d")]
    assert log.since(5, OA, "") is None  # never given
    assert log.since(-1, OA, "") is None
    assert ResidencyLog().incarnation != log.incarnation
    log.record(OA, "segment", ["m_b", "m_c", "m_b"], True)
    assert log.kept("segment", OA, "", 5) == [("segment", "m_c", True),
                                              ("segment", "m_b", True)]
    assert log.kept("segment", OB, "", 5) == []


class SlowOwner:
    """An owner whose comparison waits (for ``free``) the first time: a query's look at
    the log's entries held up mid-scan. ``scanning`` is set once it is."""

    def __init__(self) -> None:
        self.scanning, self.free = threading.Event(), threading.Event()

    def __eq__(self, other: object) -> bool:
        if not self.scanning.is_set():
            self.scanning.set()
            self.free.wait(WAIT_S)
        return False

    __hash__ = object.__hash__


WAIT_S = 10.0  # bound of a wait: only turns a hang into a failure


@pytest.mark.parametrize("query", ["since", "kept"])
def test_a_query_looks_at_a_bounded_number_of_changes_off_the_logs_lock(query):
    """Anyone may ask a node's log (a caller without a claim too), and an L2 commit
    records into it under the node's L2 lock. While a query looks at the entries of a
    full log (65,536 changes of others), ``record`` (a commit) goes on; and the query
    looks at ``SCAN`` (= ``MAX_CHANGES``) of them at most, answering where it stopped
    (the router asks on from there). (Before: every query looked at all 65,536 under
    the log's lock, and the commit waited.)"""
    from raykv.cache_actors.node.residency_log import LOG_CHANGES
    from raykv.controllers.residency import MAX_CHANGES

    log = ResidencyLog()
    log.record(OB, "segment", (f"n_{i}" for i in range(LOG_CHANGES)), True)
    slow = SlowOwner()
    ask = (lambda: log.since(0, slow, "")) if query == "since" else \
        (lambda: log.kept("segment", slow, "", 5))
    asking = threading.Thread(target=ask)
    asking.start()
    assert slow.scanning.wait(WAIT_S)
    recorded = threading.Thread(target=log.record, args=(OA, "l2", ["m_a"], True))
    recorded.start()
    recorded.join(WAIT_S)
    done = not recorded.is_alive()
    slow.free.set()
    asking.join(WAIT_S)
    recorded.join(WAIT_S)
    assert done, "record waited for the query's scan"
    assert log.last == LOG_CHANGES + 1
    assert log.since(0, OA, "") is None  # the oldest left for the commit's change
    assert log.since(1, OA, "") == ([], 1 + MAX_CHANGES)  # where the next call goes on
    assert log.since(1 + MAX_CHANGES, OA, "")[1] == 1 + 2 * MAX_CHANGES
    assert MAX_CHANGES < LOG_CHANGES


def test_l2_tells_the_log_what_became_ready_and_what_left():
    told = []
    index = L2Index(2, 1.0, lambda: 100.0, lambda k, ready: told.append((k, ready)))
    pages = index.reserve(ME, ["a", "b"])
    index.commit(ME, pages, [True, False], dirty=False)  # b was not written in full
    assert told == [("a", True)]
    index.release(ME)
    (p,) = index.reserve(ME, ["c"])
    index.commit(ME, [p], [True], dirty=False)
    index.release(ME)
    index.reserve(ME, ["d"])  # evicts a, the least recently used
    assert told == [("a", True), ("c", True), ("a", False)]
    assert index.ready_keys(5) == ["c"]


def test_a_node_answers_a_router_from_its_l2_then_its_log():
    node = FakeNode()
    log = ResidencyLog()
    pools = L2Pools(node, node, l2_bytes=1 << 20, log=log)
    costs = LoadCosts()
    costs.probed("seg-1", 1e-9, 0.001)  # its own segment: 1 GB/s and 1 ms a call
    store = SimpleNamespace(backend=SimpleNamespace(own_segment="seg-1"))
    query = ResidencyQuery("node-1", store, pools, lambda claim: claim, log, costs)
    far = time.monotonic() + 60
    h = pools.open((0, 0), layout(), 2, A)
    pages = pools.reserve(ME, h.name, ["m_a", "m_b"], A)
    pools.commit(ME, h.name, ["m_a", "m_b"], pages, [True, True], A)
    hb = pools.open((0, 0), layout(), 2, B)
    pb = pools.reserve(ME, hb.name, ["n_a"], B)
    pools.commit(ME, hb.name, ["n_a"], pb, [True], B)
    log.stored(["m_a", "m_y", "m_z"], [0, -800, 0], A)  # a put: m_y failed
    first = query.changes(None, A, far)  # no view yet: L2 as it is, then the log
    assert first.reset and sorted(first.changes) == [
        ("l2", "m_a", True), ("l2", "m_b", True), ("segment", "m_a", True),
        ("segment", "m_z", True)]
    assert first.seq == log.last and first.incarnation == log.incarnation
    assert first.load_s == {"segment": pytest.approx(0.001 + (1 << 20) * 1e-9)}
    pools.forget(h.name)  # the pool left the node: its keys left L2
    then = query.changes((first.incarnation, first.seq), A, far)
    assert not then.reset
    assert sorted(then.changes) == [("l2", "m_a", False), ("l2", "m_b", False)]
    assert query.changes(("another", then.seq), A, far).reset  # a restarted node's log
    with pytest.raises(DeadlineExceededError):
        query.changes(None, A, time.monotonic() - 1)


def _changes(node: str, seq: int, changes: list, reset: bool = False,
             incarnation: str = "i1") -> ResidencyChanges:
    return ResidencyChanges(node, incarnation, seq, reset, changes)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_view_answers_from_what_the_nodes_said():
    clock = Clock()
    view = ResidencyView(1.0, clock)
    view.watch(["n1", "n2"])
    keys = ["k0", "k1", "k2", "k3"]
    assert view.answer("n1", keys, 1) is None  # not heard from yet
    view.apply(_changes("n1", 3, [("l2", "k0", True), ("l2", "k1", True),
                                  ("segment", "k0", True)]))
    view.apply(_changes("n2", 1, [("segment", "k0", True), ("segment", "k1", True)]))
    a1, a2 = view.answer("n1", keys, 1), view.answer("n2", keys, 1)
    assert (a1.l2, a1.segment, a1.l3) == (2, 1, 2)
    assert (a2.l2, a2.segment, a2.l3) == (0, 2, 2)
    assert view.answer("n1", keys, 2).l2 == 1  # two keys a page (TP 2)
    assert view.since("n1") == ("i1", 3)
    view.apply(_changes("n1", 4, [("l2", "k0", False)]))  # evicted: a gap at page 0
    assert view.answer("n1", keys, 1).l2 == 0
    view.apply(_changes("n2", 5, [("l2", "k3", True)], incarnation="i2"))  # restarted
    a2 = view.answer("n2", keys, 1)
    assert (a2.l2, a2.segment, a2.l3) == (0, 0, 1)  # its segment went with it
    view.apply(_changes("n3", 1, [("l2", "k0", True)]))  # not watched: dropped
    assert view.answer("n3", keys, 1) is None


def test_the_view_keeps_each_nodes_last_told_load_estimates_and_no_others():
    view = ResidencyView(1.0, Clock())
    view.watch(["n1"])
    assert view.load_s("n1") == {} and view.load_s("n9") == {}
    told = {"segment": 0.002, "l3": 0.05, "l2": 1.0, "disk": 9.0, "bad": "x"}
    view.apply(ResidencyChanges("n1", "i1", 1, False, [], told))
    assert view.load_s("n1") == {"segment": 0.002, "l3": 0.05}  # credited tiers only
    view.apply(ResidencyChanges("n1", "i1", 2, False, [],
                                {"l3": float("nan"), "segment": -1.0}))
    assert view.load_s("n1") == {}  # nothing a number of seconds: no credit
    view.apply(ResidencyChanges("n1", "i1", 3, False, [], {"l3": 0.04}))
    assert view.load_s("n1") == {"l3": 0.04}  # the last told, not merged


def test_a_node_not_heard_from_is_stale_and_a_forgotten_node_unknown():
    clock = Clock()
    view = ResidencyView(1.0, clock)
    view.watch(["n1", "n2"])
    view.apply(_changes("n1", 1, [("segment", "k0", True)]))
    view.apply(_changes("n2", 1, []))
    clock.now = 1.5
    assert view.answer("n1", ["k0"], 1) is None and not view.fresh("n1")
    view.apply(_changes("n1", 1, []))
    view.apply(_changes("n2", 1, []))
    assert view.answer("n1", ["k0"], 1).segment == 1
    view.watch(["n2"])  # n1's replicas went away
    assert view.nodes == ["n2"] and view.answer("n2", ["k0"], 1).l3 == 0
    with pytest.raises(ValueError):
        ResidencyView(0, clock)


def test_the_view_keeps_a_bounded_number_of_keys(monkeypatch):
    monkeypatch.setattr(residency_view, "L2_KEYS", 3)
    monkeypatch.setattr(residency_view, "SEGMENT_KEYS", 2)
    view = ResidencyView(1.0, Clock())
    view.watch(["n1"])
    view.apply(_changes("n1", 9, [("l2", f"k{i}", True) for i in range(5)]
                        + [("segment", f"k{i}", True) for i in range(4)]))
    assert view.answer("n1", ["k2", "k3", "k4"], 1).l2 == 3
    assert view.answer("n1", ["k1"], 1).l2 == 0
    a = view.answer("n1", ["k2", "k3"], 1)
    assert (a.segment, a.l3) == (2, 2)
    assert view.answer("n1", ["k0"], 1).l3 == 0  # dropped from the segment view: not in L3
