"""bench-ranks' verdict on its targets (pure: made-up cases, no cluster)."""

from raykv.controllers.pool_layout import KiB
from raykv_lab.bench.ranks import judge


def case(ranks: int, page_bytes: int, ratio: float, cpu_ratio: float = 0.5) -> dict:
    return {"ranks": ranks, "page_bytes": page_bytes, "ratio": ratio, "cpu_ratio": cpu_ratio}


def test_throughput_targets_count_pages_of_256kib_and_up():
    every_n = ">= 0.9x raw at every N, pages >= 256 KiB"
    eight = "8 ranks >= 0.9x of 8 raw clients at pages >= 256 KiB"
    fine = [case(n, size, 0.95) for n in (1, 8) for size in (256 * KiB, 1024 * KiB)]
    assert judge(fine + [case(1, 64 * KiB, 0.5)])[every_n] is True
    verdict = judge(fine + [case(1, 256 * KiB, 0.8)])
    assert verdict[every_n] is False and verdict[eight] is True
    assert judge([case(8, 1024 * KiB, 0.85)])[eight] is False
    assert judge([case(1, 64 * KiB, 0.95)])[every_n] is None


def test_cpu_target_is_judged_at_eight_ranks_only():
    cpu = "CPU-s per GB <= 1.2x raw at N=8"
    assert judge([case(1, 256 * KiB, 1.0, cpu_ratio=2.0)])[cpu] is None
    assert judge([case(8, 64 * KiB, 1.0, cpu_ratio=1.3)])[cpu] is False
    assert judge([case(8, 64 * KiB, 1.0, cpu_ratio=1.1)])[cpu] is True
