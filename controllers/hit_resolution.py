"""Which prefixes every pool can restore, and the hit that follows (pure logic).

A prefix of ``L`` pages is restorable from a pool when:
- ``all_pages``: every page ``0..L-1`` of the pool exists (KV, indexer, draft);
- ``trailing_pages`` with window ``w``: the last ``w`` pages ``L-w..L-1`` exist (state
  pools such as Mamba or SWA keep a checkpoint per page; only the newest ones matter).
The empty prefix is always restorable. Trailing pools make holes, so the hit is the
largest length in the **intersection** of every pool's restorable lengths, not the
minimum of per-pool maxima. Across TP/PP ranks the same intersection is taken over
every rank's pools. Pure: integer masks. ``group_search`` computes the intersection
with these; the unit tests' oracle (``tests/unit/oracle.py``) computes it directly.
"""

from __future__ import annotations

from raykv.controllers.contract import PoolHitPolicy


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
