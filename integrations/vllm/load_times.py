"""Pure (no vLLM, no Ray): what the vLLM connector measures per request for the Ray
metrics of ``connector_metrics``: the tokens a lookup told vLLM to load, split by the
tier they were found in (``hit_tokens``), and each load's time and bytes by tier
(``LoadTimes``).

Tiers, as a lookup sees them: ``l2`` (the leading blocks in the node's L2 cache) and
``l3`` (the blocks after those, in the store; whether Mooncake serves them from memory
or from its disk tier, the node actors count per object: ``raykv_l3_served_objects``).
A load is labelled by the slowest tier it reads from: ``l3`` if any of its blocks was
found past the node's L2, else ``l2``.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

from raykv.integrations.vllm.connector_stats import StatsGrowth

L2, L3 = "l2", "l3"
TIERS = (L2, L3)


def hit_tokens(load_tokens: int, l2_blocks: int, block_size: int) -> tuple[int, int]:
    """The ``load_tokens`` a lookup told vLLM to load (0 or more), by tier, ``(l2,
    l3)``: the first ``l2_blocks`` blocks' tokens are ``l2``'s, the rest ``l3``'s."""
    l2 = min(load_tokens, l2_blocks * block_size)
    return l2, load_tokens - l2


def load_tier(loaded: int, l2_blocks: int) -> str:
    """The tier of a load of ``loaded`` leading blocks whose first ``l2_blocks`` a
    lookup found in the node's L2."""
    return L2 if loaded <= l2_blocks else L3


class LoadTimes:
    """Loads measured and not yet exported: ``(tier, seconds, bytes)`` each, kept twice:
    for the Ray metrics (``drain``) and for the load guard's estimates on the scheduler
    side (``take_sums``, handed to vLLM in the worker's connector stats). ``record``
    from vLLM's threads (the step, the load thread), ``drain`` from the exporter's
    thread, ``take_sums`` from the step's; a deque's append and popleft are each atomic,
    so none takes a lock. Bounded: past ``limit`` records not taken the oldest are
    dropped."""

    def __init__(self, limit: int = 10_000) -> None:
        self._records: deque[tuple[str, float, int]] = deque(maxlen=limit)
        self._unsummed: deque[tuple[str, float, int]] = deque(maxlen=limit)

    def record(self, tier: str, seconds: float, nbytes: int) -> None:
        """One load of ``nbytes`` (the blocks it loaded) from ``tier`` that took
        ``seconds`` (until it returned to its caller)."""
        self._records.append((tier, seconds, nbytes))
        self._unsummed.append((tier, seconds, nbytes))

    def timed(self, load: Callable[[], int], l2_blocks: int, block_bytes: int) -> int:
        """``load()`` (the leading blocks it loaded; what it raises propagates),
        recorded if it loaded any: its tier (``load_tier``), its seconds and the
        blocks' bytes (``block_bytes`` each)."""
        t0 = time.perf_counter()
        n = load()
        if n > 0:
            self.record(load_tier(n, l2_blocks), time.perf_counter() - t0, n * block_bytes)
        return n

    def drain(self) -> list[tuple[str, float, int]]:
        """The records since the last call, oldest first."""
        return _take(self._records)

    def take_sums(self) -> StatsGrowth:
        """The loads recorded since the last call, summed per tier: a growth of the
        load sums alone (``l2_load_us`` in microseconds, ``l2_load_bytes``, and
        ``l3``'s)."""
        us, nbytes = dict.fromkeys(TIERS, 0), dict.fromkeys(TIERS, 0)
        for tier, seconds, size in _take(self._unsummed):
            us[tier] += int(seconds * 1e6)
            nbytes[tier] += size
        return StatsGrowth(l2_load_us=us[L2], l2_load_bytes=nbytes[L2],
                           l3_load_us=us[L3], l3_load_bytes=nbytes[L3])


def _take(records: deque) -> list:
    """Pop everything in ``records``, oldest first (another taker may take some)."""
    out = []
    while records:
        try:
            out.append(records.popleft())
        except IndexError:  # another taker took the last one
            break
    return out
