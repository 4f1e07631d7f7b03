"""Which prefixes every pool can restore, and the hit that follows (pure logic).

A prefix of ``L`` pages is restorable from a pool when:
- ``all_pages``: every page ``0..L-1`` of the pool exists (KV, indexer, draft);
- ``trailing_pages`` with window ``w``: the last ``w`` pages ``L-w..L-1`` exist (state
  pools such as Mamba or SWA keep a checkpoint per page; only the newest ones matter).
The empty prefix is always restorable. Trailing pools make holes, so the hit is the
largest length in the **intersection** of every pool's restorable lengths, not the
minimum of per-pool maxima. Across TP/PP ranks the same intersection is taken over
every rank's pools. Pure: numpy and integer masks.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from raykv.controllers.contract import PoolHitPolicy, PoolName, PoolTransferResult


@dataclass(frozen=True)
class PoolPresence:
    """One pool's existence flags for pages ``0..n-1`` and how it counts hits."""

    exists: Sequence[bool]
    policy: PoolHitPolicy = PoolHitPolicy.ALL_PAGES
    window: int = 1

    def __post_init__(self) -> None:
        if self.policy not in tuple(PoolHitPolicy):
            raise ValueError(f"unknown hit policy {self.policy!r}: expected one of "
                             f"{[p.value for p in PoolHitPolicy]}")
        if self.policy == PoolHitPolicy.TRAILING_PAGES and self.window < 1:
            raise ValueError(f"trailing_pages needs a window >= 1, got {self.window}")


def restorable_mask(p: PoolPresence) -> np.ndarray:
    """``mask[L]`` (``L`` = 0..n pages) is True when pool ``p`` can restore a prefix of
    ``L`` pages."""
    exists = np.asarray(p.exists, dtype=bool)
    if p.policy == PoolHitPolicy.ALL_PAGES:
        present = np.concatenate(([0], np.cumsum(exists)))  # pages < L that exist
        return present == np.arange(exists.size + 1)
    ends = trailing_ends(exists.astype(np.uint8).tobytes(), p.window)
    mask = np.ones(exists.size + 1, dtype=bool)
    mask[1:] = np.frombuffer(ends.to_bytes(exists.size, "little"), dtype=np.uint8)
    return mask


def trailing_ends(present: bytes | bytearray, window: int) -> int:
    """For a trailing pool whose page ``p`` exists where byte ``p`` of ``present`` is 1
    (else 0): an integer whose byte ``p`` (little-endian) is 1 when pages
    ``max(0, p-window+1)..p`` all exist, i.e. a prefix of ``p + 1`` pages is restorable.
    O(log window) shifts of one integer."""
    n = len(present)
    acc = int.from_bytes(present, "little")  # byte p: pages p-span+1..p all exist
    span, w = 1, min(window, n)

    def back(v: int, k: int) -> int:  # byte p takes byte p-k; pages before 0 count
        return (v << (8 * k)) | int.from_bytes(b"\x01" * k, "little")
    while span * 2 <= w:
        acc &= back(acc, span)
        span *= 2
    if span < w:
        acc &= back(acc, w - span)
    return acc & int.from_bytes(b"\x01" * n, "little")


def pool_hit_pages(hit: int, policy: PoolHitPolicy, window: int) -> int:
    """Pages an extra pool must load for a hit of ``hit`` pages: all of them for
    ``all_pages``, the trailing window (at most the hit) for ``trailing_pages``."""
    return hit if policy == PoolHitPolicy.ALL_PAGES else min(window, hit)


def restorable_lengths(p: PoolPresence) -> set[int]:
    """Prefix lengths (pages, 0 included) that pool ``p`` can restore."""
    return set(np.flatnonzero(restorable_mask(p)).tolist())


def resolve_hits(kv: PoolPresence, extra: Mapping[PoolName, PoolPresence] | None = None,
                 ranks: Sequence[tuple[PoolPresence, Mapping[PoolName, PoolPresence]]] = (),
                 ) -> PoolTransferResult:
    """Intersect restorable lengths over KV, every extra pool and every further rank.

    ``ranks`` holds the (kv, extra) presences of the other ranks of a group. Every pool
    must describe the same number of pages. ``extra_pool_hit_pages`` says how many pages
    each extra pool must load for the hit: all of them for ``all_pages``, the trailing
    window (at most the hit) for ``trailing_pages``.
    """
    extra = dict(extra or {})
    groups = [(kv, extra), *ranks]
    n = len(kv.exists)
    common = np.ones(n + 1, dtype=bool)
    for rank_kv, rank_extra in groups:
        for pool in (rank_kv, *rank_extra.values()):
            if len(pool.exists) != n:
                raise ValueError(f"pools describe {len(pool.exists)} and {n} pages")
            common &= restorable_mask(pool)
    lengths = np.flatnonzero(common).tolist()
    hit = lengths[-1]
    per_pool = {name: pool_hit_pages(hit, p.policy, p.window) for name, p in extra.items()}
    return PoolTransferResult(kv_hit_pages=hit, extra_pool_hit_pages=per_pool,
                              restorable_prefix_pages=lengths)
