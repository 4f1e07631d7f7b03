"""The bound a test holds a call to raykv to when the failure model gives it one.

``docs/failure-model.md``: a data call on a stopped, hung or slow node
actor returns within its deadline, ``timeout_s`` (a zero-copy put or get whose store
call started in time: ``timeout_s`` plus the rest of that store call), and a call the
open breaker refuses returns at once. What a test measures also holds its caller's own
scheduling and, for a call made through a ``Rank`` actor, one Ray call, so it is held
to ``FACTOR`` x the documented seconds plus ``MARGIN_S``: room for a loaded 2-core
machine, while a call that takes ten times a 1 s deadline fails.
"""

from __future__ import annotations

FACTOR = 1.5
MARGIN_S = 2.0


def bound_s(documented_s: float) -> float:
    """Seconds a call whose documented bound is ``documented_s`` may take, measured."""
    return FACTOR * documented_s + MARGIN_S


def within(seconds: float, documented_s: float) -> bool:
    """Whether ``seconds`` measured meets the documented ``documented_s``."""
    return seconds <= bound_s(documented_s)
