"""The pure parts of a residency answer: leading pages and page counts."""

import pytest
from raykv.controllers.residency import Residency, check_pages, leading


def test_leading_counts_whole_pages_up_to_the_first_gap():
    assert leading([True] * 6, 2) == 3
    assert leading([True, True, True, False, True, True], 2) == 1  # page 1 lacks a rank
    assert leading([False, True, True, True], 1) == 0
    assert leading([], 1) == 0


def test_check_pages_refuses_a_ragged_chain():
    assert check_pages(["a", "b", "c", "d"], 2) == 2
    for bad in (3, 0, -1, 1.0, True):
        with pytest.raises(ValueError, match="no whole number of pages"):
            check_pages(["a", "b", "c", "d"], bad)


def test_best_is_nearest_tier_first():
    assert Residency("n", 8, 5, 3, 7, "h:1").best() == (5, 3, 7)
