"""The circuit breaker's state machine on a fake clock: when it opens (deadlines in a
row granted one whole deadline together), what it admits in each state, when a probe's
answer lets a trial through, and how the hold grows."""

from __future__ import annotations

import pytest
from raykv.cache_actors.rank.circuit_breaker import BreakerSettings, BreakerState, CircuitBreaker


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


TIMEOUT_S = 5.0  # the callers' whole deadline


def breaker(hold_s: float = 1.0, max_hold_s: float = 8.0) -> tuple[CircuitBreaker, Clock]:
    clock = Clock()
    return CircuitBreaker(BreakerSettings(hold_s, max_hold_s), clock), clock


def fail(b: CircuitBreaker, n: int = 1, granted_s: float = TIMEOUT_S) -> None:
    """``n`` admitted calls that ran into deadlines of ``granted_s``."""
    for _ in range(n):
        assert b.admit()
        b.failed(granted_s, TIMEOUT_S)


def test_one_call_that_waited_its_whole_deadline_opens_it():
    b, _ = breaker()
    fail(b)
    assert b.state is BreakerState.OPEN and b.counts()["opened"] == 1


def test_calls_shortened_by_a_budget_open_it_once_they_add_up_to_a_deadline():
    b, _ = breaker()
    fail(b, 3, granted_s=1.5)  # 4.5 s granted in a row
    assert b.state is BreakerState.CLOSED
    assert b.counts()["in_a_row"] == 3 and b.counts()["granted_in_a_row_s"] == 4.5
    assert b.admit()
    b.succeeded()  # a success clears the sum
    fail(b, 3, granted_s=1.5)
    assert b.state is BreakerState.CLOSED
    fail(b, granted_s=0.5)  # 5 s in a row
    assert b.state is BreakerState.OPEN


def test_an_open_breaker_admits_nothing_and_counts_the_rejections():
    b, clock = breaker()
    fail(b)
    assert [b.admit() for _ in range(5)] == [False] * 5
    clock.now += 1000  # time alone does not close it: only a probe's answer does
    assert not b.admit()
    counts = b.counts()
    assert counts["rejected"] == 6 and counts["admitted"] == 1 and counts["state"] == "open"
    assert b.probe_wanted()


def test_a_probe_answer_after_the_hold_lets_one_trial_through():
    b, clock = breaker(hold_s=1.0)
    fail(b)
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
    fail(b)
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
    fail(b)
    assert b.hold_left() == 1.0


def test_a_released_trial_frees_its_place_without_news():
    b, clock = breaker()
    fail(b)
    clock.now += 1
    b.probe_answered()
    assert b.admit()
    b.released()  # e.g. bad input: the actor's health is unknown
    assert b.state is BreakerState.TRIAL
    assert b.admit()


def test_late_outcomes_of_calls_admitted_before_it_opened():
    b, _ = breaker()
    assert b.admit() and b.admit()  # two calls in flight
    b.failed(TIMEOUT_S, TIMEOUT_S)
    assert b.state is BreakerState.OPEN
    b.failed(TIMEOUT_S, TIMEOUT_S)  # the second one's deadline: changes nothing
    assert b.state is BreakerState.OPEN and b.counts()["opened"] == 1
    b.succeeded()  # an answer, even a late one: the actor is back
    assert b.state is BreakerState.CLOSED and b.counts()["in_a_row"] == 0


@pytest.mark.parametrize("settings", [dict(hold_s=0.0), dict(hold_s=5.0, max_hold_s=1.0)])
def test_bad_settings_are_refused(settings):
    with pytest.raises(ValueError, match="bad breaker settings"):
        BreakerSettings(**settings)


def test_the_defaults_are_the_documented_ones():
    """docs/failure-model.md: a 1 s hold doubled up to 30 s."""
    assert BreakerSettings() == BreakerSettings(hold_s=1.0, max_hold_s=30.0)
