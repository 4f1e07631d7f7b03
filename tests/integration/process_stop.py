"""SIGSTOP a process and wait until it is stopped (a test helper, no raykv import).

``os.kill(pid, SIGSTOP)`` returns before the process stops: the kernel stops the
thread that takes the signal first, and that thread stops the others. On a busy
machine a thread of the target (a node actor's channel thread) can still answer a
request sent right after ``kill`` returned; a test that asserts what callers of a
hung process see must wait until every thread is stopped.
"""

from __future__ import annotations

import os
import signal
import time

STOP_WAIT_S = 10.0


def _states(pid: int) -> list[str]:
    """The scheduler state letter of each thread of ``pid`` (``/proc/<pid>/task``)."""
    states = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                stat = f.read()
        except FileNotFoundError:  # the thread ended meanwhile
            continue
        states.append(stat[stat.rindex(")") + 2])  # the field after "(comm)"
    return states


def stop_process(pid: int, wait_s: float = STOP_WAIT_S) -> None:
    """SIGSTOP ``pid``; return once all its threads are stopped (state ``T``).
    ``TimeoutError`` if they are not within ``wait_s`` seconds."""
    os.kill(pid, signal.SIGSTOP)
    end = time.monotonic() + wait_s
    while not all(s in "Tt" for s in _states(pid)):
        if time.monotonic() > end:
            raise TimeoutError(f"process {pid} not stopped after {wait_s} s: "
                               f"{sorted(set(_states(pid)))}")
        time.sleep(0.001)
