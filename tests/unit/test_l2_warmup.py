"""The warm-up of a new L2 pool (``cache_actors.node.l2_warmup``) against the real
``L2Pools`` and ``TouchJournal``, with fakes of the store (``FakeNode``), the peers and
the controller: what it reads, into which pages, within which budgets, and why it
stops."""

from __future__ import annotations

import dataclasses
import time

import pytest
from raykv.cache_actors.node.l2_warmup import L2Warmup
from raykv.cache_actors.node.touch_journal import TouchJournal
from raykv.controllers.deployments import Deployment
from raykv.controllers.node_records import Warmup, WarmupStats

from tests.unit.test_l2_pools import ME, A, FakeNode, l2, layout

PAGE = 64  # the bytes of one object of ``layout()``
DEP = Deployment(deployment_id="m_", model_name="m", extra_backend_tag=None, tp_size=1,
                 pp_size=1, is_mla_model=False, ranks={"0,0": "node-1"})


def key(i: int | str) -> str:
    return f"m_h{i}_0_kv"


class Peers:
    """The peers' journals (one ``TouchJournal`` each) as ``ask_peers`` answers them;
    ``asked``: each ask's (prefix, limit, prefer, wait_s); ``on_ask``: called at each."""

    def __init__(self, count: int = 1) -> None:
        self.journals = [TouchJournal() for _ in range(count)]
        self.asked: list[tuple] = []
        self.on_ask = lambda: None

    def ask(self, prefix, limit, prefer, wait_s):
        self.asked.append((prefix, limit, list(prefer), wait_s))
        self.on_ask()
        return [dict(j.recent(limit, prefix)) for j in self.journals]


class Metrics:
    def __init__(self) -> None:
        self.warmed: list[tuple] = []

    def record(self, owner, nbytes) -> None:
        self.warmed.append((owner, nbytes))


def setup(warm_bytes: int = 1 << 20, warm_s: float = 30.0, fetch=None, clock=time.monotonic,
          pages: int = 8):
    node, peers, metrics = FakeNode(), Peers(), Metrics()
    pools = l2(node)
    warm = L2Warmup(pools, peers.ask, fetch or (lambda dep: DEP), metrics.record,
                    warm_bytes=warm_bytes, warm_s=warm_s, clock=clock)
    return node, peers, metrics, pools, warm


def stored(node: FakeNode, peers: Peers, keys: list[str], now: float) -> None:
    """``keys`` are in L3, put by a peer's store call at ``now``."""
    node.stored.update({k: 0 for k in keys})
    peers.journals[0].touched(keys, [PAGE] * len(keys), now)


def finished(warm: L2Warmup) -> WarmupStats:
    deadline = time.monotonic() + 10
    while (s := warm.stats()).running:
        assert time.monotonic() < deadline, s
        time.sleep(0.005)
    return s


def test_a_new_pool_gets_the_hottest_runs_read_into_free_pages():
    node, peers, metrics, pools, warm = setup()
    stored(node, peers, [key(i) for i in range(3)], 1.0)
    stored(node, peers, [key(f"x{i}") for i in range(2)], 2.0)
    h = warm.opened(pools.open((0, 0), layout(8), 8, A), (0, 0), A)
    s = finished(warm)
    (w,) = s.warmups.values()
    assert dataclasses.replace(w, seconds=0) == Warmup(
        deployment="m_", rank=[0, 0], state="done", pages=5, bytes=5 * PAGE, chosen=5,
        stopped="done", seconds=0)
    assert s.pages == 5 and s.bytes == 5 * PAGE
    gets = [keys for op, keys in node.calls if op == "get"]
    # both runs chosen (the latest first), read coldest first: the hottest end most
    # recently used, the last pages of them L2 evicts
    assert gets == [[key(i) for i in range(3)], [key("x0"), key("x1")]]
    assert pools.lookup([key(i) for i in range(3)], 1, A) == 3
    assert pools.stats().warmed == 5 and pools.stats().filled == 0
    assert metrics.warmed == [(A.owner, 3 * PAGE), (A.owner, 2 * PAGE)]
    assert peers.asked == [("m_", 1024, ["node-1"], 5.0)]  # MIN_ANSWER
    # the same pool opened again (another engine): no second warm-up
    assert warm.opened(pools.open((0, 0), layout(8), 8, A), (0, 0), A) == h
    assert len(finished(warm).warmups) == 1 and len(peers.asked) == 1


def test_warm_up_fills_free_pages_only_and_never_evicts():
    """The pool holds 3 pages an engine wrote (ready, clean, not leased): a warm-up of 5
    pages reads 1, into the one free page, and stops for want of room; the engine's
    pages stay. CONTROL: a reader's fill of the same keys evicts the engine's pages."""
    node, peers, _, pools, warm = setup()
    h = pools.open((0, 0), layout(4), 4, A)
    mine = [key(f"e{i}") for i in range(3)]
    pages = pools.reserve(ME, h.name, mine, A)
    assert pools.commit(ME, h.name, mine, pages, [True] * 3, A) == 3
    deadline = time.monotonic() + 5
    while pools.stats().l3_put < 3:  # flushed: evictable
        assert time.monotonic() < deadline
        time.sleep(0.005)
    pools.acquire(ME, h.name, [], False, A)  # the engine's holds released
    hot = [key(i) for i in range(5)]
    stored(node, peers, hot, 1.0)
    warm.opened(h, (0, 0), A)
    (w,) = finished(warm).warmups.values()
    assert (w.pages, w.chosen, w.stopped) == (1, 4, "no room")  # 4: its size
    assert pools.resident(mine, A.owner) == [True] * 3
    assert pools.resident(hot, A.owner) == [True] + [False] * 4
    pools.acquire(ME, h.name, hot[1:], True, A)  # CONTROL: a reader's fill evicts
    assert pools.resident(mine, A.owner) == [False] * 3


def test_budgets_of_bytes_and_time():
    node, peers, _, pools, warm = setup(warm_bytes=2 * PAGE + 1)
    stored(node, peers, [key(i) for i in range(4)], 1.0)
    warm.opened(pools.open((0, 0), layout(8), 8, A), (0, 0), A)
    (w,) = finished(warm).warmups.values()
    assert (w.pages, w.chosen, w.stopped) == (2, 2, "done")
    assert pools.resident([key(i) for i in range(4)], A.owner) == [True, True, False, False]
    # time: the clock passes the budget once the peers answered
    now = [0.0]

    def clock() -> float:
        return now[0]

    node, peers, _, pools, warm = setup(warm_s=10.0, clock=clock)
    stored(node, peers, [key(i) for i in range(3)], 1.0)
    peers.on_ask = lambda: now.__setitem__(0, 11.0)
    warm.opened(pools.open((0, 0), layout(8), 8, A), (0, 0), A)
    (w,) = finished(warm).warmups.values()
    assert (w.pages, w.chosen, w.stopped) == (0, 3, "time")
    assert peers.asked[0][3] == 5.0  # the peers' wait: within the budget
    assert not [c for c in node.calls if c[0] == "get"]


def test_a_page_l3_lost_ends_its_run_and_the_next_run_follows():
    node, peers, _, pools, warm = setup()
    stored(node, peers, [key(i) for i in range(3)], 1.0)
    stored(node, peers, [key("a"), key("b")], 2.0)
    del node.stored[key("a")]  # the first page of the latest run is gone from L3
    warm.opened(pools.open((0, 0), layout(8), 8, A), (0, 0), A)
    (w,) = finished(warm).warmups.values()
    assert (w.pages, w.stopped) == (3, "done")
    assert pools.resident([key("a"), key("b")], A.owner) == [False, False]
    assert pools.resident([key(i) for i in range(3)], A.owner) == [True] * 3
    assert pools.stats().warm_failed == 2  # a, and b: no use without a


@pytest.mark.parametrize("case", ["off", "no room", "nothing", "unknown", "bad rank", "late"])
def test_when_no_warm_up_reads_anything(case):
    """Off (0 bytes), no pool (the node had no L2 room), no peer touched the rank's
    objects, a deployment the controller does not know, a rank outside the
    deployment, the time budget spent before the peers are asked."""
    def unknown(dep):
        raise ValueError(f"no deployment {dep}")

    ticks = iter(range(0, 1000, 6))  # each look at the clock: 6 s later (budget: 10 s)
    node, peers, metrics, pools, warm = setup(
        warm_bytes=0 if case == "off" else 1 << 20, fetch=unknown if case == "unknown" else None,
        warm_s=10.0, clock=(lambda: next(ticks)) if case == "late" else time.monotonic)
    if case != "nothing":
        stored(node, peers, [key(0)], 1.0)
    rank = (1, 0) if case == "bad rank" else (0, 0)
    h = None if case == "no room" else pools.open(rank, layout(8), 8, A)
    assert warm.opened(h, rank, A) is h
    s = finished(warm)
    if case in ("off", "no room"):
        assert s.warmups == {} and peers.asked == []
    else:
        (w,) = s.warmups.values()
        assert w.stopped == {"nothing": "nothing", "late": "time",
                                "unknown": "unknown deployment"}.get(case, "error: ValueError")
        assert bool(peers.asked) == (case == "nothing")
    assert s.pages == 0 and metrics.warmed == [] and pools.stats().warmed == 0


def test_a_closed_warm_up_starts_nothing():
    node, peers, _, pools, warm = setup()
    stored(node, peers, [key(0)], 1.0)
    warm.close()
    warm.opened(pools.open((0, 0), layout(8), 8, A), (0, 0), A)
    assert warm.stats().warmups == {} and peers.asked == []


def test_the_ranks_key_suffix_comes_from_the_deployment():
    """A rank (1, 1) of a TP 2 x PP 2 deployment takes ``_1_1_kv`` objects only, never
    another rank's whose key ends alike (``_0_1_kv``)."""
    dep = dataclasses.replace(DEP, tp_size=2, pp_size=2)
    node, peers, _, pools, warm = setup(fetch=lambda d: dep)
    keys = ["m_a_1_1_kv", "m_a_0_1_kv", "m_a_1_kv"]
    node.stored.update({k: 0 for k in keys})
    peers.journals[0].touched(keys, [PAGE] * 3, 1.0)
    warm.opened(pools.open((1, 1), layout(8), 8, A), (1, 1), A)
    finished(warm)
    assert pools.resident(keys, A.owner) == [True, False, False]
    assert peers.asked[0][1] == 1024 * 4  # every rank's keys share the journal


def test_opened_never_waits_for_the_warm_up():
    """``opened`` returns while the peers have not answered (the warm-up runs on its own
    thread): the engine's ``l2_open`` is never held up by it. CONTROL: once the peers
    answer, the same warm-up reads the pages."""
    import threading

    node, peers, _, pools, warm = setup()
    stored(node, peers, [key(0)], 1.0)
    answer = threading.Event()
    peers.on_ask = lambda: answer.wait(10)
    h = pools.open((0, 0), layout(8), 8, A)
    assert warm.opened(h, (0, 0), A) is h
    (w,) = warm.stats().warmups.values()
    assert w.state in ("queued", "running") and w.pages == 0
    answer.set()
    (w,) = finished(warm).warmups.values()
    assert (w.pages, w.stopped) == (1, "done")
