"""The scale-down benchmark's arithmetic: the seeded workload, hit rates (a request is
served up to its first miss), a drain's rates and the drain-time model."""

from __future__ import annotations

from collections import Counter

import pytest
from raykv_lab.bench.scale_down_workload import (
    after_vs_before,
    drain_model_s,
    drain_rates,
    hit_rate,
    leading,
    workload,
)


def test_the_workload_is_the_same_for_a_seed_and_skewed_to_a_hot_order():
    a = workload(7, 16, 400)
    assert a == workload(7, 16, 400) and a != workload(8, 16, 400)
    assert set(a) <= set(range(16))
    counts = Counter(a).most_common()
    assert counts[0][1] > 3 * counts[-1][1]  # Zipf: the hottest far above the coldest
    assert Counter(workload(7, 16, 400, skew=0.0)).most_common(1)[0][1] < counts[0][1]
    assert workload(1, 1, 3) == [0, 0, 0] and workload(1, 4, 0) == []


@pytest.mark.parametrize("args", [(1, 0, 4), (1, 4, -1), (1, 4, 4, -0.5)])
def test_a_bad_workload_is_refused(args):
    with pytest.raises(ValueError):
        workload(*args)


def test_a_request_is_served_up_to_its_first_miss():
    assert leading([True, True, False, True]) == 2
    assert leading([False, True]) == 0
    assert leading([True] * 3) == 3 and leading([]) == 0


def test_hit_rate_is_pages_served_over_pages_asked():
    assert hit_rate([16, 0, 8], [16, 16, 16]) == pytest.approx(0.5)
    assert hit_rate([4], [4]) == 1.0
    assert after_vs_before(0.5, 1.0) == 0.5
    for served, asked in (([5], [4]), ([-1], [4]), ([1], [1, 1]), ([0], [0])):
        with pytest.raises(ValueError):
            hit_rate(served, asked)
    with pytest.raises(ValueError):
        after_vs_before(1.0, 0.0)


def test_a_drains_rates_are_over_its_seconds():
    report = {"seconds": 2.0, "bytes_moved": 250_000_000, "objects_moved": 32}
    r = drain_rates(report, 1e9)
    assert r == {"gbps": pytest.approx(0.125), "objects_per_s": 16.0,
                 "link_fraction": pytest.approx(1.0)}
    assert drain_rates(report, None)["link_fraction"] is None
    with pytest.raises(ValueError):
        drain_rates(report | {"seconds": 0.0}, 1e9)


def test_the_drain_model_takes_the_slower_of_the_object_rate_and_the_link():
    assert drain_model_s(1024, 1 << 30, 16.0, 1e9) == pytest.approx(64.0)  # objects
    assert drain_model_s(16, 1 << 30, 16.0, 1e9) == pytest.approx(8 * (1 << 30) / 1e9)
    assert drain_model_s(16, 1 << 30, 16.0, None) == pytest.approx(1.0)
    with pytest.raises(ValueError):
        drain_model_s(1, 1, 0.0, None)
