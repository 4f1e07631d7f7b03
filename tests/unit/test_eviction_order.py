"""The eviction policies of an L2 pool (``eviction_order``): each one's order on small
hand-made sequences, and through ``L2Index`` that none evicts a held, leased or dirty
page."""

from __future__ import annotations

import functools

import pytest
from raykv.cache_actors.node.eviction_order import check_eviction, eviction_order
from raykv.cache_actors.node.l2_index import L2Index
from raykv.controllers.node_settings import L2_EVICTIONS
from raykv.controllers.result_codes import FULL

from tests.unit.test_l2_index import A, B, Clock, EvictsHeldPages, failures, simulate, written


def takes(order, n: int, evictable=lambda p: True) -> list[int | None]:
    return [order.take(evictable) for _ in range(n)]


def one_hit_then_ghost(name: str) -> list[int | None]:
    """Pages 0-2 (keys a-c) in a pool of 10, page 1 used; two victims; page 3 holds key a
    again (a comes back), page 4 key d; one victim more."""
    order = eviction_order(name, 10)
    for p, k in enumerate("abc"):
        order.add(p, k)
    order.used(1)
    out = takes(order, 2)
    order.add(3, "a")
    order.add(4, "d")
    return out + takes(order, 1)


def test_lru_takes_the_least_recently_used_page():
    assert one_hit_then_ghost("lru") == [0, 2, 1]


def test_s3fifo_drops_a_new_unused_page_before_a_used_one():
    """Page 1 was used in the small FIFO, so it moved to main; key a came back from the
    ghost queue into main; d, new and unused, goes first. Control: LRU takes page 1
    there (the least recently used)."""
    assert one_hit_then_ghost("s3fifo") == [0, 2, 4]


def test_s3fifo_gives_used_main_pages_another_turn():
    order = eviction_order("s3fifo", 10)
    for p, k in enumerate("ab"):
        order.add(p, k)
    assert takes(order, 1) == [0]  # small's unused head: a is a ghost now
    order.add(0, "a")  # back: main
    order.add(2, "c")  # small
    order.used(1)
    assert takes(order, 1) == [2]  # small at its share: b (used) to main, c goes
    order.add(2, "d")  # a key not in the ghost queue: small again
    order.used(0)
    # small at its share: d (unused) goes; then main: a was used there, so it gets
    # another turn and b (its use spent on the move to main) goes first. Control: LRU
    # would take b's page 1 before page 0 only by recency, here it is by use.
    assert takes(order, 3) == [2, 1, 0]


def test_slru_takes_probation_before_protected_and_demotes_over_its_share():
    order = eviction_order("slru", 5)
    for p in range(3):
        order.add(p, f"k{p}")
    order.used(0)
    assert takes(order, 3) == [1, 2, 0]
    order = eviction_order("slru", 2)  # protected holds one page
    order.add(0, "a")
    order.add(1, "b")
    order.used(0)
    order.used(1)  # 0 falls back to probation
    assert list(order.hottest()) == [1, 0]
    assert takes(order, 1) == [0]


@pytest.mark.parametrize("name", L2_EVICTIONS)
def test_a_policy_skips_pages_that_are_not_evictable(name):
    order = eviction_order(name, 4)
    for p in range(4):
        order.add(p, f"k{p}")
        order.used(p)
    assert order.take(lambda p: False) is None
    assert order.take(lambda p: p == 2) == 2
    assert sorted(order.hottest()) == [0, 1, 3]


@pytest.mark.parametrize("name", L2_EVICTIONS)
def test_no_policy_evicts_a_held_leased_or_dirty_page(name):
    """A pool of 4 pages: k0 dirty, k1 held by a reader, k2 leased, k3 not; 12 new keys
    written one after the other all go through k3's page, and a reservation of two keys
    finds a page for one only. Control: once k0 is flushed, the reader released and the
    lease over, a reservation of four keys evicts all four."""
    clock = Clock()
    ix = L2Index(4, 10, clock, eviction=name)
    pages = written(ix, A, ["k0"], dirty=True) + written(ix, A, ["k1", "k2", "k3"])
    ix.release(A)
    assert ix.acquire(A, ["k1"]) == [pages[1]]
    assert ix.lookup(["k2"]) == 1
    for i in range(12):
        written(ix, B, [f"n{i}"])
        ix.release(B)
        assert all(ix.page_of(k) is not None for k in ("k0", "k1", "k2")), (name, i)
    assert ix.page_of("k3") is None
    assert ix.reserve(B, ["x0", "x1"])[1] == FULL
    ix.release(B)
    ix.flushed([pages[0]], ["k0"])
    ix.release(A)
    clock.t = 11
    assert all(p >= 0 for p in ix.reserve(B, ["x0", "x1", "x2", "x3"]))
    assert all(ix.page_of(k) is None for k in ("k0", "k1", "k2"))


@pytest.mark.parametrize("name", L2_EVICTIONS)
@pytest.mark.parametrize("seed", range(6))
def test_random_holders_never_read_other_bytes_under_each_policy(name, seed):
    simulate(seed, functools.partial(L2Index, eviction=name))


@pytest.mark.parametrize("name", L2_EVICTIONS)
def test_control_each_policy_evicting_held_pages_lets_a_reader_see_other_bytes(name):
    class Evicts(EvictsHeldPages):
        def __init__(self, *args) -> None:
            super().__init__(*args, eviction=name)

    failed = failures(Evicts)
    assert failed >= 10, failed


def test_a_policy_is_named_by_one_of_evictions():
    assert check_eviction("s3fifo") == "s3fifo"
    with pytest.raises(ValueError, match="L2 eviction"):
        check_eviction("lfu")
    with pytest.raises(ValueError, match="L2 eviction"):
        L2Index(4, 10, Clock(), eviction="LRU")
