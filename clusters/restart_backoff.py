"""How long a supervisor waits between failed restarts of the process it keeps up
(pure: no Ray, no Mooncake).

A restart that fails (its port still taken, a start slower than its timeout) is tried
again, never given up: after the n-th failure in a row the next try comes
``min(cap_s, first_s * 2 ** (n - 1))`` seconds later, so a process that cannot start
is retried at most every ``cap_s`` seconds and comes back within ``cap_s`` of the
moment it can.
"""

from __future__ import annotations

FIRST_S = 1.0
"""Seconds before the try after the first failed restart."""
CAP_S = 30.0
"""The longest wait between two tries, in seconds."""


class RestartBackoff:
    """The failed restarts in a row of one process (``attempts``, reset by a
    restart that succeeds), the last failure's error (``last_error``, kept after a
    success: what went wrong last) and when to try next."""

    def __init__(self, first_s: float = FIRST_S, cap_s: float = CAP_S) -> None:
        if not 0 < first_s <= cap_s:
            raise ValueError(f"need 0 < first_s <= cap_s, got {first_s}, {cap_s}")
        self.first_s = first_s
        self.cap_s = cap_s
        self.attempts = 0
        self.last_error: str | None = None

    def failed(self, error: str) -> float:
        """Count a failed restart (``error``: what went wrong); the seconds to wait
        before the next try."""
        self.attempts += 1
        self.last_error = error
        return min(self.cap_s, self.first_s * 2.0 ** min(self.attempts - 1, 64))

    def succeeded(self) -> None:
        """A restart worked: the next failure starts again at ``first_s``."""
        self.attempts = 0
