"""Rate-limited warnings: a recurring failure costs one log line per period, not one
per occurrence (runs in every raykv process)."""

from __future__ import annotations

import logging
import threading
import time

WARN_EVERY_S = 30.0
"""Default period: at most one line per kind per this many seconds."""


class ThrottledLog:
    """Warnings on ``logger`` at most once per ``period_s`` per kind, each with a count
    of the ones held back since, so a flood costs a line and one kind of trouble never
    hides another. Thread-safe: any thread may call ``warn``."""

    def __init__(self, logger: logging.Logger, period_s: float = WARN_EVERY_S) -> None:
        self._logger = logger
        self._period_s = period_s
        self._lock = threading.Lock()
        self._last: dict[str, tuple[float, int]] = {}  # kind -> (logged at, held since)

    def warn(self, kind: str, message: str, *args: object) -> None:
        """Log ``message % args`` unless a ``kind`` warning was logged within the
        period (then only count it)."""
        with self._lock:
            now = time.monotonic()
            last, held = self._last.get(kind, (-self._period_s, 0))
            if now - last < self._period_s:
                self._last[kind] = (last, held + 1)
                return
            self._last[kind] = (now, 0)
        suffix = f" ({held} more like this not logged)" if held else ""
        self._logger.warning(message + suffix, *args)
