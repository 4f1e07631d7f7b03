"""SegmentDrain over a fake store client and fake peers: what a drain moves (only what
the leaving segment alone holds, hottest first, within the room), where (the peers'
segments in turn, new puts steered there), what a deadline leaves, what standalone
mode reports; and the L2 write-behind's flush it starts with."""

from __future__ import annotations

import threading
import time

import pytest
from raykv.cache_actors.node.segment_drain import SegmentDrain
from raykv.cache_actors.node.touch_journal import Touch, TouchJournal

from tests.unit.fakes import FakeBackend
from tests.unit.test_l2_pools import ME, A, FakeNode, l2, layout

OWN = "10.213.0.2:12345"


class FakePeers:
    """Two peers; their touches are ``views`` (one dict per peer)."""

    def __init__(self, segments=("p1:1", "p2:2"), views=()) -> None:
        self._segments, self.views = list(segments), list(views)
        self.asked: list[list[str]] = []

    def segments(self, until: float) -> list[str]:
        return list(self._segments)

    def touches(self, keys, until: float) -> list[dict[str, Touch]]:
        self.asked.append(list(keys))
        return self.views


class Drained:
    """A drain of ``objects`` (key -> size), touched in that order (the last the
    hottest), over a fake store; ``shared``: keys with another replica elsewhere."""

    def __init__(self, objects: dict[str, int], shared=(), peers=None, **kw) -> None:
        self.backend = FakeBackend(objects)
        sole = set(objects) - set(shared)
        self.backend.locate = lambda keys: [(OWN,) if k in sole else (OWN, "p1:1")
                                            for k in keys]
        self.journal = TouchJournal()
        for i, (key, size) in enumerate(objects.items()):
            self.journal.touched([key], [size], 1000.0 + i)
        self.flushes: list[float] = []
        self.unhurried = 0
        self.reports: list[dict] = []
        self.peers = peers or FakePeers()
        self.drain = SegmentDrain(self.backend, self.journal, self._flush, self._unhurry,
                                  self.peers, self.reports.append, poll_s=0.001, **kw)

    def _flush(self, until: float) -> int:
        self.flushes.append(until)
        return 3

    def _unhurry(self) -> None:
        self.unhurried += 1


def test_moves_what_the_segment_alone_holds_hottest_first_to_the_peers_in_turn():
    d = Drained({"a": 10, "b": 20, "c": 30, "d": 40}, shared=["b"])
    report = d.drain.run(30.0, reason="test")
    # hottest first: d (touched last), c, a; b has a replica elsewhere and stays
    assert d.backend.moves == [("d", OWN, "p1:1"), ("c", OWN, "p2:2"), ("a", OWN, "p1:1")]
    assert (report["objects_moved"], report["bytes_moved"]) == (3, 80)
    assert report["state"] == "done" and report["reason"] == "test"
    assert report["candidates"] == 3 and report["l2_pages"] == 3 and report["targets"] == 2
    assert report["objects_left"] == report["objects_dropped"] == 0
    assert d.backend.steered == "p1:1" and not d.backend.prefers_own  # new puts elsewhere
    assert d.drain.draining and d.reports == [report] and d.drain.status() == report


def test_peers_touches_reorder_the_drain():
    """``a`` was read last on a peer: it moves first, although this node saw it first."""
    peers = FakePeers(views=[{"a": Touch(5000.0, 1, 10)}])
    d = Drained({"a": 10, "b": 20}, peers=peers)
    d.drain.run(30.0)
    assert [m[0] for m in d.backend.moves] == ["a", "b"]
    assert peers.asked == [["b", "a"]]  # this node's candidates, hottest first
    # CONTROL: without the peer's view, this node's own order
    d = Drained({"a": 10, "b": 20})
    d.drain.run(30.0)
    assert [m[0] for m in d.backend.moves] == ["b", "a"]


def test_what_does_not_fit_in_the_room_is_dropped_never_moved():
    d = Drained({"small": 10, "big": 50, "hot": 40})  # order: hot, big, small
    report = d.drain.run(30.0, room_bytes=60)
    assert [m[0] for m in d.backend.moves] == ["hot", "small"]
    assert (report["objects_dropped"], report["bytes_dropped"]) == (1, 50)
    assert report["bytes_moved"] == 50 <= 60


def test_at_the_deadline_what_did_not_end_is_left_not_moved():
    """Moves never end: the drain returns at its deadline with what it started in
    flight (bounded) and the rest unstarted, all counted left."""
    d = Drained({f"k{i}": 1 for i in range(10)}, in_flight=3)
    d.backend.move_state = lambda task: "running"
    report = d.drain.run(0.2)
    assert report["started"] == 3 and len(d.backend.moves) == 3
    assert (report["objects_left"], report["objects_moved"]) == (10, 0)
    assert [m[0] for m in d.backend.moves] == ["k9", "k8", "k7"]  # the hottest started


def test_failed_moves_are_counted_failed_and_the_rest_go_on():
    d = Drained({"a": 1, "b": 2, "c": 3})
    d.backend.move_states = {1: "failed"}  # the first task started: c's
    report = d.drain.run(30.0)
    assert (report["objects_failed"], report["bytes_failed"]) == (1, 3)
    assert (report["objects_moved"], report["bytes_moved"]) == (2, 3)


def test_without_a_peer_segment_everything_is_dropped_and_puts_stay_home():
    d = Drained({"a": 1}, peers=FakePeers(segments=[]))
    report = d.drain.run(30.0)
    assert report["objects_dropped"] == 1 and d.backend.moves == []
    assert d.backend.steered is None


def test_a_client_that_cannot_locate_says_so_and_moves_nothing():
    """Standalone mode: the dummy client cannot tell which objects its segment holds.
    L2 is still flushed (to the peers' segments); nothing is claimed moved."""
    d = Drained({"a": 1})
    d.backend.can_locate = False
    report = d.drain.run(30.0)
    assert report["state"] == "no locate" and report["l2_pages"] == 3
    assert d.backend.moves == [] and report["objects_moved"] == 0
    assert d.backend.steered == "p1:1"


@pytest.mark.parametrize("args", [(0.0,), (-1.0,), (float("nan"),), (1e9,), ("5",),
                                  (5.0, -1), (5.0, 1.5), (5.0, None, ""), (5.0, None, 7)])
def test_bad_arguments_are_refused_before_anything_changes(args):
    d = Drained({"a": 1})
    with pytest.raises(ValueError):
        d.drain.run(*args)
    assert d.backend.steered is None and d.flushes == [] and d.drain.status() is None
    assert not d.drain.draining


def test_undo_steers_puts_home_again_and_one_drain_runs_at_a_time():
    d = Drained({f"k{i}": 1 for i in range(5)})
    d.backend.move_state = lambda task: "running"
    done: list[dict] = []
    t = threading.Thread(target=lambda: done.append(d.drain.run(30.0)))
    t.start()
    while not (d.drain.status() or {}).get("started"):
        time.sleep(0.005)
    status = d.drain.status()
    assert status["state"] == "running" and 0 < status["deadline_in_s"] <= 30
    with pytest.raises(ValueError, match="running"):
        d.drain.run(30.0)
    d.backend.move_state = lambda task: "done"
    d.drain.undo()
    t.join(10)
    assert done[0]["state"] == "called off" and d.backend.steered is None
    assert d.unhurried == 1 and not d.drain.draining


def test_flush_puts_l2_pages_waiting_for_a_retry_at_once():
    """A page whose put failed waits a long back-off: a drain's flush puts it now.
    CONTROL: without the flush it is still pending after several polls."""
    node = FakeNode()
    node.fail_puts = 1
    pools = l2(node)
    pools.write_behind.backoff_s = 3600.0
    h = pools.open((0, 0), layout(), 1, A)
    pages = pools.reserve(ME, h.name, ["m_a"], A)
    pools.commit(ME, h.name, ["m_a"], pages, [True], A)
    while pools.stats().l3_put_pending != 1:
        time.sleep(0.005)
    time.sleep(0.1)
    assert "m_a" not in node.stored  # control: the retry waits its back-off
    assert pools.write_behind.flush(time.monotonic() + 10) == 1
    assert "m_a" in node.stored and pools.stats().l3_put_pending == 0
    pools.close()


def test_the_first_moves_start_before_every_candidate_is_looked_up(monkeypatch):
    """Lookups go a chunk at a time while the moves of the hottest run; what the
    deadline finds not looked up is counted ``unlocated``, not left."""
    from raykv.cache_actors.node import segment_drain

    monkeypatch.setattr(segment_drain, "LOCATE_CHUNK", 2)
    d = Drained({f"k{i}": 1 for i in range(6)})
    calls: list[str] = []
    located = d.backend.locate
    d.backend.locate = lambda keys: calls.append("locate") or located(keys)
    started = d.backend.start_move
    d.backend.start_move = lambda *a: calls.append("move") or started(*a)
    report = d.drain.run(30.0)
    assert calls.index("move") < len(calls) - 1 - calls[::-1].index("locate")
    assert report["objects_moved"] == 6 and report["unlocated"] == 0

    d = Drained({f"k{i}": 1 for i in range(6)})
    d.backend.locate = lambda keys: time.sleep(0.15) or [(OWN,)] * len(keys)
    report = d.drain.run(0.2)
    assert report["unlocated"] > 0 and report["candidates"] < 6
    assert report["candidates"] == report["objects_moved"] + report["objects_left"]


def test_an_undo_during_the_peers_answer_is_never_overridden_by_the_drains_steering():
    """The drain asks its peers; an undo comes meanwhile: puts stay home."""
    class UndoingPeers(FakePeers):
        def segments(self, until: float) -> list[str]:
            d.drain.undo()
            return super().segments(until)

    d = Drained({"a": 1}, peers=UndoingPeers())
    report = d.drain.run(30.0)
    assert report["state"] == "called off" and d.backend.steered is None
    assert not d.drain.draining


def test_a_node_without_a_segment_has_nothing_to_move():
    d = Drained({"a": 1})
    d.backend.own_segment = None
    report = d.drain.run(30.0)
    assert report["state"] == "done" and report["candidates"] == 0 and d.backend.moves == []
