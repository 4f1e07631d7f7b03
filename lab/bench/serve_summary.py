"""The arithmetic of the end-to-end routing benchmark (``serve_routing``): per router,
from one record per request, and the ratios against the issue's targets. Pure logic, no
Ray.

Percentiles interpolate linearly between the two nearest ranks of the sorted samples
(p50 of an even count is the mean of the middle two). Times in milliseconds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

TARGETS = {
    "computed_vs_pow2": 0.5,           # RayKVRouter's computed fraction / pow-2's
    "computed_vs_prefix_affinity": 0.8,
    "ttft_p95_vs_prefix_affinity": 0.8,
    "requests_max_over_min": 2.0,       # RayKVRouter's, per replica
    "overhead_p99_ms": 5.0,             # RayKVRouter's own time per request
}
"""Each target is met when the measured value is at most the target."""


@dataclass(frozen=True)
class Outcome:
    """One request as the client saw it: ``ttft_s`` (seconds from sending to the first
    streamed token), ``prompt_tokens`` and ``cached_tokens`` (the engine's usage),
    ``replica`` (the replica that ran it; None if unknown), ``error`` (None: answered)."""

    stream: str
    turn: int
    ttft_s: float | None
    prompt_tokens: int
    cached_tokens: int
    replica: str | None
    error: str | None = None


def percentile(values: list[float], q: float) -> float | None:
    """The ``q`` quantile (0..1) of ``values``, linearly interpolated; None if empty."""
    if not 0 <= q <= 1:
        raise ValueError(f"q must be in [0, 1], got {q}")
    if not values:
        return None
    s = sorted(values)
    x = q * (len(s) - 1)
    lo = math.floor(x)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (x - lo)


def _ms(value: float | None) -> float | None:
    return None if value is None else value * 1e3


def summarize(outcomes: list[Outcome], replicas: list[str]) -> dict:
    """One router's figures: ``requests``, ``failed``, ``ttft_p50_ms`` / ``ttft_p95_ms``
    (answered requests), ``computed_fraction`` (1 - cached / prompt tokens over answered
    requests; None if no prompt token), ``per_replica`` (requests each of ``replicas``
    ran, zeros included; requests whose replica is unknown are counted in ``unplaced``)
    and ``requests_max_over_min`` (None if some replica ran none)."""
    done = [o for o in outcomes if o.error is None]
    ttft = [o.ttft_s for o in done if o.ttft_s is not None]
    prompt = sum(o.prompt_tokens for o in done)
    cached = sum(o.cached_tokens for o in done)
    per = {r: 0 for r in replicas}
    unplaced = 0
    for o in done:
        if o.replica in per:
            per[o.replica] += 1
        else:
            unplaced += 1
    counts = list(per.values())
    return {
        "requests": len(outcomes), "failed": len(outcomes) - len(done),
        "ttft_p50_ms": _ms(percentile(ttft, 0.5)), "ttft_p95_ms": _ms(percentile(ttft, 0.95)),
        "prompt_tokens": prompt, "cached_tokens": cached,
        "computed_fraction": 1 - cached / prompt if prompt else None,
        "per_replica": per, "unplaced": unplaced,
        "requests_max_over_min": (max(counts) / min(counts)
                                  if counts and min(counts) > 0 else None),
    }


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def verdict(runs: dict[str, dict]) -> dict:
    """The targets for ``runs`` (router name -> its summary; ``raykv``, ``pow2`` and
    ``prefix_affinity`` used, ``raykv`` with ``overhead_p99_ms``): per target its
    ``value``, ``target`` and ``met`` (None when a run or a figure is missing; a
    replica that ran no request misses the max/min target)."""
    raykv, pow2, pca = runs.get("raykv"), runs.get("pow2"), runs.get("prefix_affinity")

    def get(run: dict | None, key: str) -> float | None:
        return None if run is None else run.get(key)

    values = {
        "computed_vs_pow2": _ratio(get(raykv, "computed_fraction"),
                                   get(pow2, "computed_fraction")),
        "computed_vs_prefix_affinity": _ratio(get(raykv, "computed_fraction"),
                                              get(pca, "computed_fraction")),
        "ttft_p95_vs_prefix_affinity": _ratio(get(raykv, "ttft_p95_ms"),
                                              get(pca, "ttft_p95_ms")),
        "requests_max_over_min": get(raykv, "requests_max_over_min"),
        "overhead_p99_ms": get(raykv, "overhead_p99_ms"),
    }
    out = {k: {"value": v, "target": TARGETS[k], "met": None if v is None else v <= TARGETS[k]}
           for k, v in values.items()}
    if raykv is not None and "per_replica" in raykv and values["requests_max_over_min"] is None:
        out["requests_max_over_min"]["met"] = False  # a replica ran none
    return out
