"""A rank's circuit breaker on one node actor (pure: no Ray, no I/O, any clock).

A node actor that is stopped, hung or gone costs every data call that waits on it a
whole deadline. Once calls in a row have run into their deadlines after being granted
one deadline in total (``failed``'s ``granted_s`` adding up to its ``limit_s``: one
call with its full ``timeout_s``, or several that a budget had shortened) the breaker
*opens*: data calls fail at once, without reaching the node actor, and a probe (the
caller's background thread, ``probe_answered`` / ``probe_wanted``) asks the actor a
cheap question now and then. The states:

- ``closed``: every call is admitted; a failure adds what it was granted, a success
  clears the sum.
- ``open``: no call is admitted (each one is counted as ``rejected``). The *hold*
  (``hold_s`` at first) starts when it opens; once it has passed, an answer of the probe
  moves it to ``trial``.
- ``trial``: one call at a time is admitted (the others are rejected); its success
  closes the breaker, its failure opens it again with the hold doubled (up to
  ``max_hold_s``), so an actor that answers the probe but fails data calls (a store
  call stuck inside Mooncake) costs one deadline per hold, not one per call.

A success reported in any state closes it (an answer from the node actor, even a late
one, is the best news there is); a failure reported while open changes nothing. Calls
that neither succeeded nor failed on the node actor's account (bad input, a budget
spent before the call went out) are ``released``: they free the trial's place.

Threads: thread-safe (one lock, held for a few assignments); ``clock`` gives seconds
(``time.monotonic`` by default; tests pass a fake).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum


class BreakerState(StrEnum):
    CLOSED = "closed"
    OPEN = "open"
    TRIAL = "trial"


@dataclass(frozen=True)
class BreakerSettings:
    """``hold_s``: how long the breaker stays open at least after it opened (also how
    often the probe asks), in seconds; ``max_hold_s``: the longest hold, reached by
    doubling after each failed trial."""

    hold_s: float = 1.0
    max_hold_s: float = 30.0

    def __post_init__(self) -> None:
        if not 0 < self.hold_s <= self.max_hold_s:
            raise ValueError(f"bad breaker settings {self}: need 0 < hold_s <= max_hold_s")


class CircuitBreaker:
    """See the module docstring. Counters (``counts()``): ``admitted``, ``rejected``,
    ``failed`` and ``succeeded`` calls, times ``opened``, ``trials`` started, probe
    ``answers`` received; and now: ``state``, the failures ``in_a_row`` while closed and
    the seconds they were granted (``granted_in_a_row_s``)."""

    def __init__(self, settings: BreakerSettings | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.settings = settings or BreakerSettings()
        self._clock = clock
        self._lock = threading.Lock()
        self._state = BreakerState.CLOSED
        self._in_a_row = 0  # failures since the last success
        self._granted = 0.0  # the seconds they were granted, together
        self._hold = self.settings.hold_s
        self._until = 0.0  # end of the current hold (clock seconds)
        self._trial_out = False  # a trial call is in flight
        self._counts = dict.fromkeys(("admitted", "rejected", "failed", "succeeded",
                                      "opened", "trials", "answers"), 0)

    @property
    def state(self) -> BreakerState:
        return self._state

    def counts(self) -> dict[str, int | str]:
        """A copy of the counters, with ``state`` and the ``in_a_row`` failures."""
        with self._lock:
            return {**self._counts, "state": self._state.value, "in_a_row": self._in_a_row,
                    "granted_in_a_row_s": self._granted}

    # ------------------------------------------------------------- the calls
    def admit(self) -> bool:
        """Whether a call may go to the node actor now; a caller admitted must report
        ``succeeded``, ``failed`` or ``released`` once."""
        with self._lock:
            if self._state is BreakerState.OPEN or (
                    self._state is BreakerState.TRIAL and self._trial_out):
                self._counts["rejected"] += 1
                return False
            if self._state is BreakerState.TRIAL:
                self._trial_out = True
                self._counts["trials"] += 1
            self._counts["admitted"] += 1
            return True

    def succeeded(self) -> None:
        """An admitted call was answered by the node actor: close."""
        with self._lock:
            self._counts["succeeded"] += 1
            self._state = BreakerState.CLOSED
            self._in_a_row, self._granted = 0, 0.0
            self._hold = self.settings.hold_s
            self._trial_out = False

    def failed(self, granted_s: float, limit_s: float) -> None:
        """An admitted call ran into its deadline after it was granted ``granted_s``
        seconds; ``limit_s``: a whole deadline of the caller (``timeout_s``)."""
        with self._lock:
            self._counts["failed"] += 1
            if self._state is BreakerState.TRIAL:
                self._hold = min(self._hold * 2, self.settings.max_hold_s)
                self._open()
            elif self._state is BreakerState.CLOSED:
                self._in_a_row += 1
                self._granted += granted_s
                if self._granted >= limit_s:
                    self._open()

    def released(self) -> None:
        """An admitted call ended without news of the node actor."""
        with self._lock:
            self._trial_out = False

    def _open(self) -> None:
        self._state = BreakerState.OPEN
        self._in_a_row, self._granted = 0, 0.0
        self._trial_out = False
        self._until = self._clock() + self._hold
        self._counts["opened"] += 1

    # ------------------------------------------------------------- the probe
    def probe_wanted(self) -> bool:
        """Whether a probe should run: the breaker is open."""
        return self._state is BreakerState.OPEN

    def hold_left(self) -> float:
        """Seconds until the hold ends (0 when it has, or the breaker is not open): the
        probe waits this long before it asks."""
        with self._lock:
            if self._state is not BreakerState.OPEN:
                return 0.0
            return max(0.0, self._until - self._clock())

    def probe_answered(self) -> None:
        """The node actor answered the probe: after the hold, the next call is a trial."""
        with self._lock:
            self._counts["answers"] += 1
            if self._state is BreakerState.OPEN and self._clock() >= self._until:
                self._state = BreakerState.TRIAL
                self._trial_out = False
