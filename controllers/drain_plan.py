"""What a drain moves off a leaving node's segment, and in which order (pure: no Ray,
no Mooncake).

A drain (``cache_actors.node.segment_drain``) moves the objects whose only complete
replica is on the leaving segment to other nodes' segments, hottest first, and never
makes room for them by evicting: Mooncake evicts when the store's bytes in use pass its
high watermark (``-eviction_high_watermark_ratio`` of the capacity), whatever it evicts
then, so the bytes a drain may move are bounded by ``room``, and ``fitting`` leaves
(drops) each object that would pass that bound.

Sizes are bytes; the order is ``hot_order``'s (most recently touched first).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

HIGH_WATERMARK = 0.95
"""Mooncake's default ``eviction_high_watermark_ratio``."""


def room(capacity: int, allocated: int, leaving_capacity: int, leaving_allocated: int,
         high_watermark: float = HIGH_WATERMARK) -> int:
    """The bytes that may move onto the store's other segments without its use passing
    ``high_watermark`` of its capacity, both while the leaving segment still counts
    (``capacity``, ``allocated``: the whole store's) and once it is gone (its
    ``leaving_capacity`` and ``leaving_allocated`` out). 0 when there is none.
    ``ValueError`` for a negative size, a leaving segment larger than the store, or a
    watermark outside (0, 1]."""
    sizes = (capacity, allocated, leaving_capacity, leaving_allocated)
    if any(type(s) is not int or s < 0 for s in sizes):
        raise ValueError(f"sizes must be ints >= 0, got {sizes}")
    if leaving_capacity > capacity or leaving_allocated > allocated:
        raise ValueError(f"the leaving segment ({leaving_allocated} of {leaving_capacity} "
                         f"bytes) is larger than the store ({allocated} of {capacity})")
    if not (isinstance(high_watermark, float | int) and 0 < high_watermark <= 1):
        raise ValueError(f"high_watermark must be in (0, 1], got {high_watermark!r}")
    before = math.floor(high_watermark * capacity) - allocated
    after = math.floor(high_watermark * (capacity - leaving_capacity)) \
        - (allocated - leaving_allocated)
    return max(0, min(before, after))


@dataclass
class DrainChoice:
    """``fitting``'s answer: ``take`` (key, size) to move, in order; ``dropped`` (key,
    size) that did not fit in the room."""

    take: list[tuple[str, int]] = field(default_factory=list)
    dropped: list[tuple[str, int]] = field(default_factory=list)


def fitting(ordered: Iterable[tuple[str, int]], room_bytes: int | None) -> DrainChoice:
    """Walk ``ordered`` (key, size), hottest first: each object that fits in what is
    left of ``room_bytes`` is taken, each that does not is dropped (a smaller, colder
    one after it may still be taken); None: no bound, everything is taken.
    ``ValueError`` for a negative room or size."""
    if room_bytes is not None and (type(room_bytes) is not int or room_bytes < 0):
        raise ValueError(f"room_bytes must be an int >= 0 or None, got {room_bytes!r}")
    choice = DrainChoice()
    left = room_bytes
    for key, size in ordered:
        if type(size) is not int or size < 0:
            raise ValueError(f"object {key!r} has size {size!r}")
        if left is None or size <= left:
            choice.take.append((key, size))
            left = None if left is None else left - size
        else:
            choice.dropped.append((key, size))
    return choice


def sole_on(keys: Sequence[str], located: Sequence[Sequence[str]], segment: str) -> list[str]:
    """Those of ``keys`` whose only complete replica is on ``segment`` (``located``: per
    key, the segments holding a complete replica of it)."""
    return [k for k, where in zip(keys, located, strict=True) if tuple(where) == (segment,)]

