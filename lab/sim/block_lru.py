"""One LRU of blocks (pure): an engine's GPU prefix cache, or a per-engine host tier
(vLLM's own CPU offload, LMCache without a remote store)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container, Hashable, Sequence


def leading(keys: Sequence[Hashable], kept: Container[Hashable]) -> int:
    """How many leading ``keys`` are in ``kept`` (a prefix hit's length)."""
    n = 0
    while n < len(keys) and keys[n] in kept:
        n += 1
    return n


class BlockLRU:
    """At most ``capacity`` keys; the least recently used goes first."""

    def __init__(self, capacity: int) -> None:
        if type(capacity) is not int or capacity < 1:
            raise ValueError(f"a block cache holds >= 1 blocks, got {capacity!r}")
        self.capacity = capacity
        self._keys: OrderedDict[Hashable, None] = OrderedDict()

    def leading(self, keys: Sequence[Hashable]) -> int:
        """How many leading ``keys`` it holds (nothing refreshed)."""
        return leading(keys, self._keys)

    def insert(self, keys: Sequence[Hashable]) -> None:
        """``keys`` used now: each the most recently used, inserted if new (evicting)."""
        for k in keys:
            if k in self._keys:
                self._keys.move_to_end(k)
            else:
                self._keys[k] = None
                if len(self._keys) > self.capacity:
                    self._keys.popitem(last=False)
