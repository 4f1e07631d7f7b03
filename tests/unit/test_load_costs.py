"""A node's load costs (pure) and how its load estimates answer a group query (a fake
store)."""

from __future__ import annotations

import pytest
from raykv.cache_actors.node.load_costs import (
    DISK,
    MEMORY,
    KeyPlaces,
    LoadCosts,
    fit_probe,
    load_runs,
    observe,
    source_of,
    tier_estimates,
    whole_run,
)
from raykv.cache_actors.node.load_estimates import LoadEstimates, page_bytes
from raykv.controllers.contract import PoolName, PoolTransferResult
from raykv.controllers.deployments import Deployment, PoolSpec
from raykv.controllers.families import group_families
from raykv.controllers.load_guard import Rate
from raykv.controllers.result_codes import OBJECT_NOT_FOUND, TRANSFER_FAIL

from tests.unit.fakes import FakeBackend

A, B = "10.0.0.1:1000", "10.0.0.2:1000"


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_probe_fit_separates_latency_from_bandwidth():
    # 1 ms per call, 1 us per byte: 4 KiB in 5.096 ms, 256 KiB in 263.144 ms
    per_byte, fixed = fit_probe(4096, 1e-3 + 4096e-6, 262144, 1e-3 + 262144e-6)
    assert per_byte == pytest.approx(1e-6) and fixed == pytest.approx(1e-3)
    # a large read no slower than the small one: per byte is the large read's bound
    per_byte, fixed = fit_probe(4096, 0.01, 262144, 0.01)
    assert per_byte == pytest.approx(0.01 / 262144)
    assert fixed == pytest.approx(0.01 - 4096 * per_byte)
    with pytest.raises(ValueError):
        fit_probe(8, 1.0, 8, 1.0)


def test_runs_split_by_source_and_price_each_link():
    costs = LoadCosts()
    costs.probed(A, 1e-9, 0.0)    # 1 GB/s
    costs.probed(B, 1e-6, 0.001)  # 1 MB/s, 1 ms a call
    runs = load_runs([A, A, B, B, B, None], 1000, costs)
    assert [(t, p) for t, p, _ in runs] == [(MEMORY, 2), (MEMORY, 3), (DISK, 1)]
    assert runs[0][2] == pytest.approx(2e-6) and runs[1][2] == pytest.approx(0.004)
    assert runs[2][2] is None  # no disk read measured, no get at all
    # control: a disk read measured gives the disk run its estimate
    costs.observed({}, 1000, 0.01)
    assert load_runs([None], 1000, costs)[0][2] == pytest.approx(0.01)


def test_an_unknown_link_falls_back_to_every_get_together():
    costs = LoadCosts()
    assert costs.seconds(A, 1000) is None
    costs.observed({B: 1000}, 0, 0.002)
    assert costs.seconds(A, 1000) == pytest.approx(0.002)  # B's get is all it knows
    assert whole_run(3, 1000, costs) == [(MEMORY, 3, pytest.approx(0.006))]
    assert whole_run(3, 1000, LoadCosts()) == [(MEMORY, 3, None)]


def test_measured_gets_move_a_link_and_share_a_call_by_bytes():
    costs = LoadCosts()
    costs.probed(A, 1e-9, 0.0)
    before = costs.seconds(A, 1 << 20)
    for _ in range(10):  # the link got slow: 1 MB in 0.1 s, 3 MB of B's in the same call
        costs.observed({A: 1 << 20, B: 3 << 20}, 0, 0.4)
    assert costs.seconds(A, 1 << 20) > 50 * before
    assert costs.seconds(A, 1 << 20) == pytest.approx(0.1, rel=0.15)
    assert costs.seconds(B, 3 << 20) == pytest.approx(0.3)


def test_the_queue_wait_is_the_calls_in_flight_times_the_call_time():
    costs = LoadCosts(clock=Clock())
    costs.probed(A, 1e-9, 0.0)
    costs.probed(B, 1e-9, 0.0)
    costs.call_ended(costs.call_started(), 0.05)
    assert costs.queue_wait() == 0  # nothing in flight
    costs.call_started()
    costs.call_started()
    assert costs.queue_wait() == pytest.approx(0.1)
    runs = load_runs([A, B], 1000, costs)  # the wait is paid once, by the first run
    assert runs[0][2] == pytest.approx(0.1 + 1e-6) and runs[1][2] == pytest.approx(1e-6)


def test_a_call_that_hangs_raises_the_wait_by_its_age_until_it_ends():
    """A store call on a stopped peer: the wait grows with its age before it ends or
    fails, and drops back once it ended. Control: a call within the usual call time
    counts that time, not its age."""
    clock = Clock()
    costs = LoadCosts(clock=clock)
    costs.probed(A, 1e-9, 0.0)
    costs.call_ended(costs.call_started(), 0.05)
    hung = costs.call_started()
    clock.now += 0.01
    assert costs.queue_wait() == pytest.approx(0.05)  # control: younger than usual
    before = load_runs([A], 1000, costs)[0][2]
    clock.now += 3.0
    assert costs.queue_wait() == pytest.approx(3.01)
    assert load_runs([A], 1000, costs)[0][2] == pytest.approx(before + 3.01 - 0.05)
    assert tier_estimates(costs, None)[MEMORY] > 3.0  # a router is told too
    costs.call_ended(hung, 3.01)
    assert costs.queue_wait() == 0


def test_a_router_is_told_the_own_segment_and_the_median_other_link_per_mib():
    costs = LoadCosts()
    assert tier_estimates(costs, A) == {}  # nothing measured: no credit
    C, D = "10.0.0.3:1000", "10.0.0.4:1000"
    for seg, per_byte in ((A, 1e-10), (B, 1e-8), (C, 1e-9), (D, 1e-7)):
        costs.probed(seg, per_byte, 0.001)
    mib = 1 << 20
    got = tier_estimates(costs, A)
    assert got == {"segment": pytest.approx(0.001 + mib * 1e-10),
                   MEMORY: pytest.approx(0.001 + mib * 1e-8)}  # of B, C, D: B's
    costs.call_ended(costs.call_started(), 0.05)
    costs.call_started()  # one call in flight: both wait for it
    waited = tier_estimates(costs, A)
    assert waited["segment"] == pytest.approx(got["segment"] + 0.05)
    assert waited[MEMORY] == pytest.approx(got[MEMORY] + 0.05)
    assert set(tier_estimates(costs, None)) == {MEMORY}  # no segment of its own


def test_links_are_bounded_probed_in_turn_and_forgotten():
    clock = Clock()
    costs = LoadCosts(max_segments=2, clock=clock)
    assert costs.seen([A, B]) == [A, B] and costs.seen([A]) == []
    costs.seen(["10.0.0.3:1000"])  # over the bound: B, the least recently used, goes
    assert costs.segments() == [A, "10.0.0.3:1000"]
    assert costs.probe_due(60, 8) == [A, "10.0.0.3:1000"]
    costs.probed(A, 1e-9, 0.0)
    assert costs.probe_due(60, 8) == ["10.0.0.3:1000"]
    clock.now += 61
    costs.probed("10.0.0.3:1000", 1e-9, 0.0)
    assert costs.probe_due(60, 8) == [A]  # probed 61 s ago: due again
    costs.forget([A])
    assert costs.segments() == ["10.0.0.3:1000"]
    view = costs.view(3)
    assert view.links["10.0.0.3:1000"].mb_per_s == pytest.approx(1000)
    assert view.links["10.0.0.3:1000"].probe_age_s == 0 and view.located_keys == 3


def test_peers_never_used_are_probed_once_as_a_cold_start_and_used_links_again():
    clock = Clock()
    costs = LoadCosts(clock=clock)
    costs.known([A, B])
    assert costs.probe_due(60, 8) == [] and costs.cold(1) == [A]  # a few an interval
    costs.probed(A, 1e-9, 0.0)
    assert costs.cold(8) == [B]
    clock.now += 61
    assert costs.probe_due(60, 8) == []  # probed, never used since: not again
    costs.seen([A])
    assert costs.probe_due(60, 8) == [A]  # used since its probe: due again
    # control: a segment seen in use is due at once, without waiting for an interval
    costs.seen(["10.0.0.3:1000"])
    assert costs.probe_due(60, 8) == ["10.0.0.3:1000", A]


def test_key_places_expire_and_are_bounded():
    clock = Clock()
    places = KeyPlaces(max_keys=2, ttl_s=10, clock=clock)
    places.put({"a": A, "b": None})
    assert places.get(["a", "b", "c"]) == ({"a": A, "b": None}, ["c"])
    places.put({"c": B})
    assert places.get(["a"]) == ({}, ["a"])  # dropped: over the bound
    clock.now += 11
    assert places.get(["c"]) == ({}, ["c"])  # expired
    assert source_of([B, A], A) == A and source_of([B, A], None) == B
    assert source_of([], A) is None


class LocateCounting(FakeBackend):
    """The shared fake, counting locates."""

    def __init__(self) -> None:
        super().__init__()
        self.locates = 0

    def locate(self, keys):
        self.locates += 1
        return super().locate(keys)


def deployment() -> Deployment:
    spec = PoolSpec(PoolName.KV, "mha", ("k", "v"))
    return Deployment("d", "m", None, 2, 1, False, pools={PoolName.KV: spec},
                      page_bytes={"0,0": {"kv": [100, 100]}, "1,0": {"kv": [300, 300]}})


def answered(estimates: LoadEstimates, result: PoolTransferResult, keys: list[str]):
    got = []
    estimates.answer(lambda r, e: got.append((r, e)), deployment(), keys, [])(result, None)
    return got


def test_a_hit_is_located_once_and_a_miss_never():
    backend = LocateCounting()
    dep = deployment()
    families = group_families(dep, [])
    keys = ["h0", "h1", "h2"]
    for h in keys[:2]:
        backend.objects[families.prefix + h + families.families[0].suffixes[0]] = 100
    assert page_bytes(dep, []) == 600  # the largest rank's page
    estimates = LoadEstimates(backend)
    estimates.costs.probed(backend.own_segment, 1e-6, 0.0)
    miss = PoolTransferResult()
    assert answered(estimates, miss, keys) == [(miss, None)]
    assert backend.locates == 0 and miss.load_runs == []
    hit = PoolTransferResult(kv_hit_pages=2)
    replies = []
    estimates.answer(lambda r, e: replies.append(r), dep, keys, [])(hit, None)
    estimates.close()  # the locate thread: its estimate done, then no other
    estimates._executor.shutdown(wait=True)
    assert replies == [hit] and backend.locates == 1
    assert hit.load_runs == [(MEMORY, 2, pytest.approx(2 * 600e-6))]
    # another rank asking later gets the same runs with no locate (shared answer)
    assert answered(estimates, hit, keys)[0][0].load_runs == hit.load_runs
    assert backend.locates == 1
    # control: a fresh answer of the same pages is estimated from the remembered places
    again = PoolTransferResult(kv_hit_pages=2)
    assert answered(estimates, again, keys)[0][0].load_runs == hit.load_runs
    assert backend.locates == 1


def test_a_node_that_cannot_locate_gives_one_run():
    backend = LocateCounting()
    backend.can_locate = False
    estimates = LoadEstimates(backend)
    estimates.costs.observed({}, 0, 0.0)  # nothing measured: no estimate
    hit = PoolTransferResult(kv_hit_pages=3)
    answered(estimates, hit, ["a", "b", "c"])
    assert hit.load_runs == [(MEMORY, 3, None)] and backend.locates == 0


def test_the_link_gauge_follows_the_estimates_and_zeroes_a_forgotten_link(monkeypatch):
    from types import SimpleNamespace

    from raykv.cache_actors.node import tier_metrics
    from raykv.cache_actors.node.tier_metrics import LinkMetrics

    from tests.unit.test_node_metrics import FakeMetric

    made = {}

    def make(name, *args, **kwargs):
        made[name] = FakeMetric(name, *args, **kwargs)
        return made[name]

    monkeypatch.setattr(tier_metrics, "metrics", SimpleNamespace(Gauge=make))
    costs = LoadCosts()
    costs.probed(A, 1e-8, 0.0)  # 100 MB/s
    costs.seen([B])             # not estimated yet: not set
    m = LinkMetrics("node-0123456789abcdef", lambda: costs.view(0))
    gauge = made["raykv_link_bytes_per_second"]
    m.export()
    assert [(c[1], c[2]) for c in gauge.calls] == [(pytest.approx(1e8), {"segment": A})]
    costs.forget([A])
    m.export()
    assert (gauge.calls[-1][1], gauge.calls[-1][2]) == (0, {"segment": A})


def test_a_failed_read_is_a_bound_that_only_slows_its_source():
    """1 MB that never arrived after 2 s: the 100 MB/s source now estimates slower; the
    same failure after 1 ms, or on a source with no estimate, changes nothing. Control:
    the 1 ms read served counts, and makes the source faster."""
    mb = 1_000_000
    slowed = Rate(prior_per_unit=1e-8)
    observe(slowed, mb, 2.0, failed=True)
    assert slowed.seconds(mb) > 0.3 and slowed.samples == 1
    quick = Rate(prior_per_unit=1e-8)
    observe(quick, mb, 0.001, failed=True)
    assert quick.seconds(mb) == pytest.approx(0.01) and quick.samples == 0
    unknown = Rate()
    observe(unknown, mb, 2.0, failed=True)
    assert unknown.seconds(mb) is None
    served = Rate(prior_per_unit=1e-8)
    observe(served, mb, 0.001)
    assert served.seconds(mb) < 0.01 and served.samples == 1


class FailingReads(FakeBackend):
    """The shared fake whose gets of ``failing`` keys answer ``code`` after ``took_s``
    on ``clock``."""

    def __init__(self, clock: Clock, failing: list[str], code: int, took_s: float) -> None:
        super().__init__()
        self.clock, self.failing, self.code, self.took_s = clock, failing, code, took_s

    def get(self, keys, ptrs, sizes):
        if keys != self.failing:
            return super().get(keys, ptrs, sizes)
        self.clock.now += self.took_s
        return [self.code] * len(keys)


@pytest.mark.parametrize("code", [TRANSFER_FAIL, OBJECT_NOT_FOUND])
def test_a_get_whose_bytes_failed_to_arrive_slows_its_link_and_a_miss_does_not(
        monkeypatch, code):
    """A get of 4 objects of 1 MB on this node's segment (probed at 1 GB/s) that fails
    them after 5 s: the link's estimate grows past 0.2 s a MB (a peer that stalls, then
    fails, is seen as slow). Control: 4 misses after 5 s are not measured at all."""
    import time as real_time

    from raykv.cache_actors.node import load_estimates

    clock = Clock()
    monkeypatch.setattr(load_estimates.time, "perf_counter", clock)
    keys = [f"k{i}" for i in range(4)]
    backend = FailingReads(clock, keys, code, 5.0)
    backend.objects.update(dict.fromkeys(keys, 1_000_000))  # located on the own segment
    estimates = LoadEstimates(backend)
    estimates.costs.probed(backend.own_segment, 1e-9, 0.0)
    assert estimates.get(keys, [0] * 4, [1_000_000] * 4) == [code] * 4
    if code == OBJECT_NOT_FOUND:
        assert not estimates._pending  # a miss: nothing to measure
        return
    estimates.start()
    try:
        end = real_time.monotonic() + 10
        while estimates.costs.seconds(backend.own_segment, 1_000_000) < 0.2:
            assert real_time.monotonic() < end, estimates.stats()
            real_time.sleep(0.01)
    finally:
        estimates.close()


def test_peers_are_asked_again_soon_while_a_listed_node_has_not_told_its_segment(
        monkeypatch):
    """A node starting beside others that have not told their segments yet asks for the
    node list again after ``COLD_RETRY_S``, until every listed node told. CONTROL: once
    all told, not again within the retry period."""
    import time as real_time

    from raykv.cache_actors.node import load_estimates

    monkeypatch.setattr(load_estimates, "COLD_RETRY_S", 0.05)
    answers = [([], False), ([B], False), ([B], True)]
    calls: list[float] = []

    def peers():
        calls.append(real_time.monotonic())
        return answers[min(len(calls), len(answers)) - 1]

    estimates = LoadEstimates(FakeBackend())
    estimates.start(peers)
    try:
        end = real_time.monotonic() + 10
        while len(calls) < 3:
            assert real_time.monotonic() < end, calls
            real_time.sleep(0.01)
        real_time.sleep(0.5)
        assert len(calls) == 3
    finally:
        estimates.close()


class PeerObjects(FakeBackend):
    """The shared fake whose objects all lie on the peer ``B``'s segment."""

    def locate(self, keys):
        return [(B,) if k in self.objects else () for k in keys]


@pytest.mark.parametrize("own", [None, A])
def test_a_node_that_gives_no_memory_probes_its_peers_and_puts_no_probe(own):
    """A node with no segment of its own (``global_segment_size`` 0) still probes a peer
    of the node list, and puts no probe object of its own. CONTROL: a node with a
    segment puts its two."""
    import time as real_time

    from raykv.cache_actors.node.link_probe import LARGE, SMALL, probe_key

    peer_probes = {probe_key(B, SMALL): SMALL, probe_key(B, LARGE): LARGE}
    backend = PeerObjects(peer_probes)
    backend.own_segment = own
    estimates = LoadEstimates(backend)
    estimates.start(lambda: ([B], True))
    try:
        end = real_time.monotonic() + 10
        while (link := estimates.stats().links.get(B)) is None or link.probe_age_s is None:
            assert real_time.monotonic() < end, estimates.stats()
            real_time.sleep(0.01)
    finally:
        estimates.close()
    put = set(backend.objects) - set(peer_probes)
    assert put == (set() if own is None else {probe_key(A, SMALL), probe_key(A, LARGE)})
