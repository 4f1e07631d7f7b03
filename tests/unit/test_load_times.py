"""``load_times``: a lookup's tokens to load split by tier, a load's tier, and the
loads recorded for export (only those that loaded a block)."""

from __future__ import annotations

import pytest
from raykv.integrations.vllm.load_times import LoadTimes, hit_tokens, load_tier


def test_hit_tokens_split_at_the_l2_blocks():
    assert hit_tokens(64, 2, 16) == (32, 32)
    assert hit_tokens(63, 4, 16) == (63, 0)  # the last token left to compute
    assert hit_tokens(0, 3, 16) == (0, 0)
    assert hit_tokens(48, 0, 16) == (0, 48)


def test_a_load_is_labelled_by_its_slowest_tier():
    assert load_tier(3, 3) == "l2"
    assert load_tier(4, 3) == "l3"
    assert load_tier(1, 0) == "l3"


def test_timed_records_loads_of_blocks_only():
    loads = LoadTimes()
    assert loads.timed(lambda: 3, 3, 100) == 3
    assert loads.timed(lambda: 0, 0, 100) == 0  # nothing loaded: nothing recorded
    assert loads.timed(lambda: 5, 2, 100) == 5

    def fails() -> int:
        raise RuntimeError("store down")

    with pytest.raises(RuntimeError):
        loads.timed(fails, 0, 100)
    got = loads.drain()
    assert [(tier, n) for tier, _, n in got] == [("l2", 300), ("l3", 500)]
    assert all(seconds >= 0 for _, seconds, _ in got)
    assert loads.drain() == []  # CONTROL: each record drained once


def test_records_past_the_limit_drop_the_oldest():
    loads = LoadTimes(limit=2)
    for n in range(3):
        loads.record("l2", 0.0, n)
    assert [n for _, _, n in loads.drain()] == [1, 2]
