"""Budgets: the seconds a rank's thread may wait on raykv in total over several data
calls (pure: no Ray, no I/O).

An engine that calls raykv several times in one step (vLLM: a hit query per new
request on the scheduler thread; loads before and saves after the forward on a worker
thread) should wait at most one deadline per step, not one per call. A ``Budget`` holds
that allowance. Entered on a thread (``with budget:``), it bounds every data call the
thread makes inside: the call waits at most the smaller of its own deadline and what
is left (``time_left``), and the seconds it took are spent from every budget entered on
the thread (``spending``; nested ones too). A call that starts with nothing left fails
at once without reaching the node actor (``NodeLink.data``). The same budget may be
entered again and again (a step's first lookup to its last) and on several threads at
once (they spend it together); time outside the calls (the forward) is not spent.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

_entered = threading.local()  # .budgets: the budgets entered on this thread, innermost last


class Budget:
    """``seconds`` of waiting on raykv, to be spent by the data calls made while it is
    entered (see the module docstring)."""

    def __init__(self, seconds: float) -> None:
        if not seconds >= 0:
            raise ValueError(f"a budget needs seconds >= 0, got {seconds!r}")
        self.seconds = float(seconds)
        self._spent = 0.0
        self._lock = threading.Lock()

    def left(self) -> float:
        """Seconds still to spend (0 at the least)."""
        return max(0.0, self.seconds - self._spent)

    def spend(self, seconds: float) -> None:
        with self._lock:
            self._spent += seconds

    def __enter__(self) -> Budget:
        stack = getattr(_entered, "budgets", None)
        if stack is None:
            stack = _entered.budgets = []
        stack.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        stack = _entered.budgets
        # the innermost entry of this budget (entries of one thread nest)
        del stack[len(stack) - 1 - stack[::-1].index(self)]


def time_left(limit: float) -> float:
    """Seconds a call starting now on this thread may wait: ``limit``, or less when a
    budget entered on this thread has less left."""
    return min([limit, *(b.left() for b in getattr(_entered, "budgets", ()))])


@contextmanager
def spending(clock: Callable[[], float] = time.monotonic) -> Iterator[None]:
    """Spend the seconds the block takes (by ``clock``) from every budget entered on
    this thread, however the block ends."""
    budgets = list(getattr(_entered, "budgets", ()))
    start = clock()
    try:
        yield
    finally:
        took = clock() - start
        for b in budgets:
            b.spend(took)
