"""The circuit breaker's state machine on a fake clock: when it opens, what it admits in
each state, when a probe's answer lets a trial through, and how the hold grows."""

from __future__ import annotations

import pytest
from raykv.controllers.circuit_breaker import BreakerSettings, BreakerState, CircuitBreaker


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def breaker(failures: int = 2, hold_s: float = 1.0, max_hold_s: float = 8.0
            ) -> tuple[CircuitBreaker, Clock]:
    clock = Clock()
    return CircuitBreaker(BreakerSettings(failures, hold_s, max_hold_s), clock), clock


def fail(b: CircuitBreaker, n: int = 1) -> None:
    for _ in range(n):
        assert b.admit()
        b.failed()


def test_it_opens_after_failures_in_a_row_only():
    b, _ = breaker(failures=3)
    fail(b, 2)
    assert b.admit()
    b.succeeded()  # a success clears the count
    fail(b, 2)
    assert b.state is BreakerState.CLOSED and b.counts()["in_a_row"] == 2
    fail(b)
    assert b.state is BreakerState.OPEN and b.counts()["opened"] == 1


def test_an_open_breaker_admits_nothing_and_counts_the_rejections():
    b, clock = breaker()
    fail(b, 2)
    assert [b.admit() for _ in range(5)] == [False] * 5
    clock.now += 1000  # time alone does not close it: only a probe's answer does
    assert not b.admit()
    counts = b.counts()
    assert counts["rejected"] == 6 and counts["admitted"] == 2 and counts["state"] == "open"
    assert b.probe_wanted()


def test_a_probe_answer_after_the_hold_lets_one_trial_through():
    b, clock = breaker(hold_s=1.0)
    fail(b, 2)
    assert b.hold_left() == 1.0
    clock.now += 0.5
    b.probe_answered()  # within the hold: ignored
    assert b.state is BreakerState.OPEN and b.hold_left() == 0.5
    clock.now += 0.5
    b.probe_answered()
    assert b.state is BreakerState.TRIAL and not b.probe_wanted()
    assert b.admit()  # the trial
    assert not b.admit() and not b.admit()  # others wait for its outcome
    b.succeeded()
    assert b.state is BreakerState.CLOSED
    assert all(b.admit() for _ in range(3))
    assert b.counts()["trials"] == 1


def test_a_failed_trial_opens_again_with_the_hold_doubled_up_to_the_most():
    b, clock = breaker(hold_s=1.0, max_hold_s=3.0)
    fail(b, 2)
    holds = []
    for _ in range(4):
        clock.now += b.hold_left()
        b.probe_answered()
        fail(b)  # the trial fails
        assert b.state is BreakerState.OPEN
        holds.append(b.hold_left())
    assert holds == [2.0, 3.0, 3.0, 3.0]
    clock.now += b.hold_left()
    b.probe_answered()
    assert b.admit()
    b.succeeded()  # a success resets the hold
    fail(b, 2)
    assert b.hold_left() == 1.0


def test_a_released_trial_frees_its_place_without_news():
    b, clock = breaker()
    fail(b, 2)
    clock.now += 1
    b.probe_answered()
    assert b.admit()
    b.released()  # e.g. bad input: the actor's health is unknown
    assert b.state is BreakerState.TRIAL
    assert b.admit()


def test_late_outcomes_of_calls_admitted_before_it_opened():
    b, _ = breaker()
    assert b.admit() and b.admit() and b.admit()  # three calls in flight
    b.failed()
    b.failed()
    assert b.state is BreakerState.OPEN
    b.failed()  # the third one's deadline: changes nothing
    assert b.state is BreakerState.OPEN and b.counts()["opened"] == 1
    b.succeeded()  # an answer, even a late one: the actor is back
    assert b.state is BreakerState.CLOSED and b.counts()["in_a_row"] == 0


@pytest.mark.parametrize("settings", [dict(failures=0), dict(hold_s=0.0),
                                      dict(hold_s=5.0, max_hold_s=1.0)])
def test_bad_settings_are_refused(settings):
    with pytest.raises(ValueError, match="bad breaker settings"):
        BreakerSettings(**settings)


def test_the_defaults_are_the_documented_ones():
    """docs/architecture.md, failure model: two deadlines in a row, a 1 s hold doubled
    up to 30 s."""
    assert BreakerSettings() == BreakerSettings(failures=2, hold_s=1.0, max_hold_s=30.0)
