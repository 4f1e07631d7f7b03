"""Budgets on a fake clock: what a call may wait inside one (nested ones too), what
calls spend, that time outside calls is not spent, and that budgets are per thread."""

from __future__ import annotations

import threading

import pytest
from raykv.cache_actors.rank.call_budget import Budget, spending, time_left


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def call(clock: Clock, seconds: float) -> None:
    """A call that takes ``seconds``."""
    with spending(clock):
        clock.now += seconds


def test_outside_a_budget_a_call_has_its_own_deadline():
    assert time_left(5.0) == 5.0
    call(Clock(), 3.0)  # spends nothing anywhere
    assert time_left(5.0) == 5.0


def test_calls_inside_a_budget_share_it_and_time_between_them_is_free():
    clock, step = Clock(), Budget(5.0)
    with step:
        assert time_left(5.0) == 5.0
        call(clock, 2.0)
        assert time_left(5.0) == 3.0
    clock.now += 60.0  # the forward, outside the budget
    with step:  # entered again: the same budget
        assert time_left(5.0) == 3.0
        call(clock, 3.5)
        assert time_left(5.0) == 0.0  # spent: the next call fails at once
    assert step.left() == 0.0
    assert time_left(5.0) == 5.0  # left: no budget on this thread


def test_nested_budgets_bound_by_the_smaller_and_are_spent_together():
    clock, outer, inner = Clock(), Budget(10.0), Budget(2.0)
    with outer:
        call(clock, 1.0)
        with inner:
            assert time_left(5.0) == 2.0
            call(clock, 1.5)
        assert time_left(30.0) == 7.5
    assert (outer.left(), inner.left()) == (7.5, 0.5)


def test_a_call_that_raises_still_spends():
    clock, step = Clock(), Budget(5.0)
    with step, pytest.raises(TimeoutError), spending(clock):
        clock.now += 5.0
        raise TimeoutError
    assert step.left() == 0.0


def test_a_budget_bounds_only_the_thread_that_entered_it():
    seen = []
    with Budget(0.0):
        t = threading.Thread(target=lambda: seen.append(time_left(5.0)))
        t.start()
        t.join()
        assert time_left(5.0) == 0.0
    assert seen == [5.0]


def test_a_negative_budget_is_refused():
    with pytest.raises(ValueError, match="seconds >= 0"):
        Budget(-1.0)
