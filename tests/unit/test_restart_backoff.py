"""The master supervisor's wait between failed restarts (``clusters.restart_backoff``):
doubling from ``first_s``, never above ``cap_s``, never giving up, back to ``first_s``
after a restart that worked."""

import pytest
from raykv.clusters.restart_backoff import RestartBackoff


def test_waits_double_up_to_the_cap_and_start_again_after_a_success():
    backoff = RestartBackoff(first_s=1.0, cap_s=30.0)
    waits = [backoff.failed(f"error {i}") for i in range(8)]
    assert waits == [1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0, 30.0]
    assert backoff.attempts == 8 and backoff.last_error == "error 7"
    for _ in range(5000):  # hours of failures: still a wait, never an overflow
        assert backoff.failed("still down") == 30.0
    backoff.succeeded()
    assert backoff.attempts == 0 and backoff.last_error == "still down"  # what went wrong
    assert backoff.failed("again") == 1.0


@pytest.mark.parametrize("first, cap", [(0.0, 1.0), (2.0, 1.0), (-1.0, 5.0)])
def test_bad_waits_are_refused(first, cap):
    with pytest.raises(ValueError):
        RestartBackoff(first, cap)
