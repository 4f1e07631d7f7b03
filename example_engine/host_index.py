"""The engine's L2 index: which page hashes sit in which slot of the node's host pools.

Host pools are raykv's shared host memory on the engine's node (L2). The index lets the
engine serve a prefix from them without asking L3 (Mooncake), and tells it which slots
it may reuse: least recently used first, never a slot the current request holds.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence


class HostIndex:
    """Page hash -> host slot for a pool of ``slots`` slots, with LRU replacement.

    Slots count pages (KV: one slot = ``page_size`` token slots; Mamba: one
    checkpoint).
    """

    def __init__(self, slots: int) -> None:
        self._where: OrderedDict[str, int] = OrderedDict()
        self._free = list(range(slots - 1, -1, -1))

    def __contains__(self, key: str) -> bool:
        return key in self._where

    def __len__(self) -> int:
        return len(self._where)

    def prefix(self, keys: Sequence[str]) -> int:
        """Number of leading ``keys`` present."""
        n = 0
        while n < len(keys) and keys[n] in self._where:
            n += 1
        return n

    def slots(self, keys: Iterable[str]) -> list[int]:
        """Slots of ``keys`` (all present), marking them recently used."""
        out = []
        for k in keys:
            self._where.move_to_end(k)
            out.append(self._where[k])
        return out

    def allocate(self, n: int, keep: Iterable[str] = ()) -> list[int]:
        """``n`` free slots, evicting least recently used entries not in ``keep``.
        ``RuntimeError`` if the pool is too small for that."""
        keep = set(keep)
        victims = (k for k in list(self._where) if k not in keep)
        while len(self._free) < n:
            victim = next(victims, None)
            if victim is None:
                raise RuntimeError(f"host pool too small: {n} slots wanted, "
                                   f"{len(self._free)} free, the rest in use")
            self._free.append(self._where.pop(victim))
        return [self._free.pop() for _ in range(n)]

    def insert(self, keys: Sequence[str], slots: Sequence[int]) -> None:
        """Record ``keys`` at ``slots`` (slots from ``allocate``)."""
        for k, s in zip(keys, slots, strict=True):
            self._where[k] = s

    def release(self, slots: Iterable[int]) -> None:
        """Give back allocated slots that were never inserted (a failed fetch)."""
        self._free.extend(slots)
