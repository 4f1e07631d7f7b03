"""The touch journal: bounded, most recent first, merged over nodes."""

import pytest
from raykv.cache_actors.node.touch_journal import MAX_ANSWER, Touch, TouchJournal, hottest


def test_recent_is_most_recent_first_and_counts_touches():
    j = TouchJournal()
    j.touched(["a", "b"], [10, 20], now=1.0)
    j.touched(["a"], [10], now=2.0)
    assert j.recent() == [("a", Touch(2.0, 2, 10)), ("b", Touch(1.0, 1, 20))]
    assert j.of(["b", "zz"]) == {"b": Touch(1.0, 1, 20)}


def test_capacity_forgets_the_least_recently_touched():
    j = TouchJournal(capacity=2)
    j.touched(["a", "b"], [1, 1], now=1.0)
    j.touched(["a"], [1], now=2.0)
    j.touched(["c"], [1], now=3.0)
    assert [k for k, _ in j.recent()] == ["c", "a"]
    assert len(j.recent()) == 2


def test_prefix_limit_and_forget():
    j = TouchJournal()
    j.touched(["d1-x", "d2-y", "d1-z"], [1, 1, 1], now=5.0)
    assert [k for k, _ in j.recent(prefix="d1-")] == ["d1-z", "d1-x"]
    assert len(j.recent(limit=1)) == 1
    assert len(j.recent(limit=10 * MAX_ANSWER)) == 3
    j.forget(["d1-z"])
    assert [k for k, _ in j.recent(prefix="d1-")] == ["d1-x"]


def test_bad_capacity_and_mismatched_sizes_are_refused():
    with pytest.raises(ValueError):
        TouchJournal(capacity=0)
    with pytest.raises(ValueError):
        TouchJournal().touched(["a", "b"], [1], now=0.0)


def test_hottest_merges_nodes_latest_touch_first():
    one = {"a": Touch(1.0, 3, 8), "b": Touch(5.0, 1, 8)}
    two = {"a": Touch(7.0, 1, 8), "c": Touch(5.0, 4, 8)}
    assert hottest([one, two]) == [("a", Touch(7.0, 4, 8)), ("c", Touch(5.0, 4, 8)),
                                   ("b", Touch(5.0, 1, 8))]


def test_a_store_call_touches_what_it_stored_or_read():
    j = TouchJournal()
    j.moved("put", ["s", "p", "f"], [4, 4, 4], [0, 1, -200], now=1.0)
    j.moved("get", ["s", "m"], [4, 4], [4, -704], now=2.0)
    assert j.recent() == [("s", Touch(2.0, 2, 4)), ("p", Touch(1.0, 1, 4))]


def test_pages_served_from_l2_are_touches_now():
    import time

    j = TouchJournal()
    before = time.time()
    j.served(["a", "b"], 64)
    j.served([], 64)
    (a, ta), (b, tb) = sorted(j.recent())
    assert (a, b) == ("a", "b") and ta.size == tb.size == 64 and ta.last >= before
