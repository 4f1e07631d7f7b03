"""Processes of this machine told apart by pid and kernel start time, so that a reused
pid is never taken for the process it once named (Linux ``/proc``)."""

from __future__ import annotations

import os
from dataclasses import dataclass


def process_stat(pid: int) -> tuple[str, int] | None:
    """(state, start time in clock ticks since boot) of ``pid``, or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return None
    return fields[0], int(fields[19])


@dataclass(frozen=True)
class ProcessIdentity:
    """One process: its pid and the kernel's start time of that pid."""

    pid: int
    start_ticks: int

    @classmethod
    def of(cls, pid: int) -> ProcessIdentity | None:
        """The identity of the process ``pid`` now names; None if there is none."""
        st = process_stat(pid)
        return None if st is None else cls(pid, st[1])

    @classmethod
    def current(cls) -> ProcessIdentity:
        """This process."""
        me = cls.of(os.getpid())
        assert me is not None  # this process is running
        return me

    def alive(self) -> bool:
        """True while ``pid`` is this very process and has not exited (not a zombie)."""
        st = process_stat(self.pid)
        return st is not None and st[0] not in ("Z", "X") and st[1] == self.start_ticks
