"""The store's use of its memory, as its master reports it, and the room a drain has.

The Mooncake master serves Prometheus text on its metrics port (``MooncakeMaster``'s
``metrics_port``, ``http://127.0.0.1:<port>/metrics``): ``master_total_capacity_bytes``
and ``master_allocated_bytes`` for the whole store, ``segment_total_capacity_bytes`` and
``segment_allocated_bytes`` per segment (label ``segment``: its name, ``host:port``, what
a node reports as its ``segment``). ``read_store_usage`` reads them within a bounded
time and answers None when it cannot (master down, slow, or another text); a drain's
``room_bytes`` is ``StoreUsage.room_without`` of the leaving segment.
"""

from __future__ import annotations

import re
import urllib.request
from dataclasses import dataclass, field

from raykv.controllers.drain_plan import HIGH_WATERMARK, room

READ_TIMEOUT_S = 2.0
"""How long one read of the master's metrics may take, in seconds."""
READ_ATTEMPTS = 3
"""Reads of the master's metrics a drain's room tries before it counts as unknown."""
MAX_TEXT = 4 << 20
"""The most bytes of metrics text read (a real answer has a few KiB per segment)."""
_LINE = re.compile(r'^(\w+)(?:\{segment="([^"]*)"\})? (\S+)$')


@dataclass(frozen=True)
class StoreUsage:
    """The store's ``capacity`` and ``allocated`` bytes, and per segment name its
    ``(allocated, capacity)``."""

    capacity: int
    allocated: int
    segments: dict[str, tuple[int, int]] = field(default_factory=dict)

    def room_without(self, segment: str, high_watermark: float = HIGH_WATERMARK) -> int:
        """The bytes a drain of ``segment`` may move (``drain_plan.room``); a segment
        the master does not list counts as empty and of no capacity."""
        allocated, capacity = self.segments.get(segment, (0, 0))
        return room(self.capacity, self.allocated, min(capacity, self.capacity),
                    min(allocated, self.allocated), high_watermark)


def parse_store_usage(text: str) -> StoreUsage | None:
    """The usage in the master's metrics ``text``; None if it lacks the store's totals."""
    totals: dict[str, int] = {}
    segments: dict[str, list[int]] = {}
    for line in text.splitlines():
        m = _LINE.match(line.strip())
        if m is None:
            continue
        name, segment, value = m.groups()
        try:
            number = int(float(value))
        except ValueError:
            continue
        if segment is None and name in ("master_total_capacity_bytes",
                                        "master_allocated_bytes"):
            totals[name] = number
        elif segment is not None and name in ("segment_allocated_bytes",
                                              "segment_total_capacity_bytes"):
            slot = segments.setdefault(segment, [0, 0])
            slot[name == "segment_total_capacity_bytes"] = number
    if len(totals) != 2:
        return None
    return StoreUsage(totals["master_total_capacity_bytes"], totals["master_allocated_bytes"],
                      {s: (a, c) for s, (a, c) in segments.items()})


def read_store_usage(metrics_url: str, timeout_s: float = READ_TIMEOUT_S) -> StoreUsage | None:
    """The store's usage from the master's metrics at ``metrics_url``; None if it could
    not be read within ``timeout_s`` seconds or holds no usage."""
    try:
        with urllib.request.urlopen(metrics_url, timeout=timeout_s) as answer:
            text = answer.read(MAX_TEXT).decode("utf-8", "replace")
    except (OSError, ValueError):
        return None
    return parse_store_usage(text)


def drain_room(metrics_url: str | None, segment: str | None,
               timeout_s: float = READ_TIMEOUT_S, attempts: int = READ_ATTEMPTS) -> int:
    """The bytes a drain of ``segment`` may move (``StoreUsage.room_without``), read from
    the master's metrics at ``metrics_url`` (``attempts`` reads at most, each within
    ``timeout_s``: a loaded master answers late); 0 when that is not known (no URL, no
    segment, the metrics unreadable): a drain that cannot know the room moves nothing
    rather than push the store past its eviction watermark."""
    if metrics_url is None or segment is None:
        return 0
    for _ in range(attempts):
        if (usage := read_store_usage(metrics_url, timeout_s)) is not None:
            return usage.room_without(segment)
    return 0
