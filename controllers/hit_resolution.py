"""Which prefixes every pool can restore, and the hit that follows (pure logic).

A prefix of ``L`` pages is restorable from a pool when:
- ``all_pages``: every page ``0..L-1`` of the pool exists (KV, indexer, draft);
- ``trailing_pages`` with window ``w``: the last ``w`` pages ``L-w..L-1`` exist (state
  pools such as Mamba or SWA keep a checkpoint per page; only the newest ones matter).
The empty prefix is always restorable. Trailing pools make holes, so the hit is the
largest length in the **intersection** of every pool's restorable lengths, not the
minimum of per-pool maxima. Across TP/PP ranks the same intersection is taken over
every rank's pools. Pure: numpy only.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from controllers.contract import PoolHitPolicy, PoolName, PoolTransferResult


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
    ``L`` pages. Vectorised: O(n) whatever the window."""
    exists = np.asarray(p.exists, dtype=bool)
    if p.policy == PoolHitPolicy.ALL_PAGES:
        present = np.concatenate(([0], np.cumsum(exists)))  # pages < L that exist
        return present == np.arange(exists.size + 1)
    return trailing_masks(exists[None, :], np.array([p.window]))[0]


def trailing_masks(exists: np.ndarray, windows: np.ndarray) -> np.ndarray:
    """For rows of trailing pools at once: ``exists`` is ``(rows, n)`` bool, ``windows``
    ``(rows,)``; ``mask[r, L]`` (``L`` = 0..n) is True when pages ``L-w..L-1`` of row
    ``r`` all exist."""
    rows, n = exists.shape
    present = np.concatenate((np.zeros((rows, 1), np.int64), np.cumsum(exists, axis=1)),
                             axis=1)  # present[r, L] = pages < L that exist
    lengths = np.arange(n + 1)
    start = np.maximum(lengths[None, :] - np.asarray(windows)[:, None], 0)
    return present - np.take_along_axis(present, start, axis=1) == lengths[None, :] - start


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
