"""lab.bench.sglang's arithmetic and checks (the run itself: docs/benchmarks.md)."""

import statistics

import pytest
from raykv.controllers.pool_layout import KiB, MiB
from raykv_lab.bench.sglang import check_sizes, judge, sglang_python, size_row


def raw(page_bytes: int, raykv: list[float], mooncake: list[float]) -> dict:
    times = {f"{b}_{op}": list(t) for b, t in (("raykv", raykv), ("mooncake", mooncake))
             for op in ("write", "prefetch", "load")}
    return {"page_bytes": page_bytes, "object_bytes": page_bytes // 2, "layers": 1,
            "batch": 4, "times": times, "raykv_zero_copy": True, "raykv_mode": "embedded",
            "raykv_staged_bytes": 0}


def test_size_row_pairs_iterations():
    # Iteration ratios (mooncake s / raykv s): 1.0, 0.5, 2.0 -> median 1.0; a slow
    # second iteration of both cancels out.
    row = size_row(raw(MiB, [1.0, 4.0, 1.0], [1.0, 2.0, 2.0]))
    assert row["ratio_write"] == row["ratio_prefetch"] == row["ratio_load"] == 1.0
    assert row["batch_bytes"] == 4 * MiB
    assert row["raykv_write"]["median_gbps"] == pytest.approx(4 * MiB / 1.0 / 1e9)
    assert row["raykv_write"]["median_pages_s"] == pytest.approx(4.0)
    assert row["mooncake_write"]["best_gbps"] == pytest.approx(4 * MiB / 1.0 / 1e9)


def test_judge_only_counts_pages_of_1mib_and_up():
    slow_small = size_row(raw(64 * KiB, [2.0], [1.0]))
    fine_big = size_row(raw(MiB, [1.0], [0.95]))
    slow_big = size_row(raw(4 * MiB, [1.0], [0.8]))
    (target,) = judge([slow_small, fine_big])
    assert judge([slow_small, fine_big])[target] is True
    assert judge([slow_small, fine_big, slow_big])[target] is False
    assert judge([slow_small])[target] is None


def test_sizes_and_python_are_checked_before_anything_starts(tmp_path):
    check_sizes([64 * KiB, 4 * MiB], batch=128, iters=1)
    with pytest.raises(ValueError, match="not a positive multiple of 64 KiB"):
        check_sizes([96 * KiB], batch=1, iters=1)
    with pytest.raises(ValueError, match="do not fit"):
        check_sizes([64 * MiB], batch=128, iters=1)
    with pytest.raises(ValueError, match="batch and iters"):
        check_sizes([64 * KiB], batch=0, iters=1)
    with pytest.raises(ValueError, match="sglang-venv"):
        sglang_python(str(tmp_path / "no-python"))


def test_median_ci_brackets_the_median_and_narrows_with_agreement():
    from raykv_lab.bench.toolkit import median_ci

    noisy = [0.6, 1.3, 0.9, 1.1, 0.7, 1.2, 0.95, 1.05, 0.8]
    lo, hi = median_ci(noisy)
    assert lo <= statistics.median(noisy) <= hi and hi - lo > 0.1
    assert median_ci([0.97] * 9) == (0.97, 0.97)
    assert median_ci(noisy) == (lo, hi)  # fixed seed: one run, one interval
