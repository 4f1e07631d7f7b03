"""The arithmetic of the scale-down benchmark (``lab.bench.scale_down``), pure: the
seeded workload, hit rates and the drain's rates (no Ray, no Mooncake, no torch).

- ``workload``: which prefix each request asks for, Zipf-weighted (prefix ``i`` of the
  hot order with weight ``1 / (i + 1) ** skew``), the hot order and the draws fixed by
  ``seed``: the same requests before and after the scale-down;
- ``hit_rate``: the share of the pages asked for that were served (a request is served
  its leading pages up to the first miss: an engine uses a prefix up to its first gap);
- ``drain_rates``: what one drain report moved per second (GB/s of 1e9 bytes, objects a
  second, the fraction of the link); ``drain_model_s``: the seconds a drain of
  ``objects`` objects of ``nbytes`` bytes needs by the model the measured rates give
  (the slower of the move tasks' object rate and the link), a model, not a measurement.
"""

from __future__ import annotations

import random
from collections.abc import Sequence


def workload(seed: int, prefixes: int, requests: int, skew: float = 1.0) -> list[int]:
    """``requests`` prefix indices in ``range(prefixes)``, drawn with Zipf weights over a
    hot order shuffled by ``seed``. ``ValueError`` for ``prefixes`` < 1, ``requests`` < 0
    or ``skew`` < 0."""
    if prefixes < 1 or requests < 0 or not skew >= 0:
        raise ValueError(f"need prefixes >= 1, requests >= 0 and skew >= 0, got "
                         f"{prefixes}, {requests}, {skew}")
    rng = random.Random(seed)
    order = list(range(prefixes))
    rng.shuffle(order)
    weights = [1.0 / (rank + 1) ** skew for rank in range(prefixes)]
    return rng.choices(order, weights=weights, k=requests)


def leading(got: Sequence[bool]) -> int:
    """Pages served of one request: those before its first miss."""
    for i, ok in enumerate(got):
        if not ok:
            return i
    return len(got)


def hit_rate(served: Sequence[int], asked: Sequence[int]) -> float:
    """Pages served over pages asked for, over the requests (``served[i]`` of
    ``asked[i]``); ``ValueError`` when nothing was asked or a request was served more
    than it asked."""
    if len(served) != len(asked) or any(s < 0 or s > a for s, a in zip(served, asked,
                                                                         strict=True)):
        raise ValueError("each request is served between 0 and the pages it asked for")
    total = sum(asked)
    if total <= 0:
        raise ValueError("no page was asked for")
    return sum(served) / total


def after_vs_before(after: float, before: float) -> float:
    """The hit rate after the scale-down over the one before (``ValueError`` if before
    is 0: nothing to compare with)."""
    if before <= 0:
        raise ValueError("the hit rate before is 0: nothing to compare with")
    return after / before


def drain_rates(report: dict, link_bps: float | None) -> dict:
    """One drain report's rates: ``gbps`` (bytes moved per second, 1e9), ``objects_per_s``
    and ``link_fraction`` (bits moved per second over ``link_bps``; None when not
    shaped), over the report's ``seconds`` (the whole drain: flush, lookups, moves)."""
    seconds = report["seconds"]
    if seconds <= 0:
        raise ValueError(f"a drain report's seconds must be > 0, got {seconds!r}")
    gbps = report["bytes_moved"] / seconds / 1e9
    return {"gbps": gbps, "objects_per_s": report["objects_moved"] / seconds,
            "link_fraction": None if link_bps is None else gbps * 8e9 / link_bps}


def drain_model_s(objects: int, nbytes: int, objects_per_s: float,
                  link_bps: float | None) -> float:
    """Seconds to drain ``objects`` objects of ``nbytes`` bytes in all, by the model: the
    slower of ``objects_per_s`` (Mooncake's move tasks) and the link (None: no link
    bound)."""
    if objects_per_s <= 0:
        raise ValueError(f"objects_per_s must be > 0, got {objects_per_s!r}")
    by_link = 0.0 if link_bps is None else nbytes * 8 / link_bps
    return max(objects / objects_per_s, by_link)
