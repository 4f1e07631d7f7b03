"""Pure (no vLLM, no Ray, no torch): the vLLM connector's counters as typed records, and
the one edge where they become vLLM's dicts and back.

- ``ConnectorStats``: one side's counters since it started (``ConnectorSide.stats``,
  ``RayKVConnector.stats``), counted on vLLM's threads, exported as the Ray metric
  ``raykv_connector`` by field name (``connector_metrics``). A misspelt counter is an
  ``AttributeError`` (the record has slots), never a new counter.
- ``StatsGrowth``: what a side's vLLM-shown counters (``SHOWN``) grew by between two of
  vLLM's ``get_kv_connector_stats`` calls (``vllm_stats.StatsDelta``), and a worker's loads
  summed per tier (``LoadTimes.take_sums``): the content of vLLM's
  ``KVConnectorStats.data``, which vLLM carries across its processes as a dict. It
  becomes that dict in ``growth_to_vllm`` and comes back in ``growth_from_vllm`` (which
  refuses keys it does not know), nowhere else (``vllm_stats``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import astuple, dataclass, fields
from typing import Any


@dataclass(slots=True)
class ConnectorStats:
    """One side's counters, all from 0 when the side starts; each only grows but
    ``loaded``, ``l2_loaded`` (a copy behind the forward that failed takes its blocks
    back: ``L2Steps``). Blocks are vLLM blocks of this side's TP rank."""

    queries: int = 0
    """Scheduler: hit queries asked (one per lookup that reached raykv)."""
    hit_blocks: int = 0
    """Scheduler: blocks its hit queries found past vLLM's own prefix cache."""
    l2_hit_blocks: int = 0
    """Scheduler: of ``hit_blocks``, those in the node's L2."""
    loaded: int = 0
    """Worker: blocks loaded into vLLM's KV cache."""
    load_failed: int = 0
    """Worker: blocks whose load failed (vLLM recomputes them)."""
    saved: int = 0
    """Worker: blocks saved."""
    save_failed: int = 0
    """Worker: blocks whose save failed."""
    save_refused: int = 0
    """Worker: blocks computed over a block whose load failed, never stored."""
    l2_loaded: int = 0
    """Worker: of ``loaded``, blocks loaded through the node's L2."""
    l2_saved: int = 0
    """Worker: of ``saved``, blocks saved into the node's L2."""
    async_lookups: int = 0
    """Scheduler, with ``async_transfers``: hits that vLLM loads asynchronously."""
    lookups_pending: int = 0
    """Scheduler, with ``async_transfers``: lookups answered "ask again later"."""
    async_loaded: int = 0
    """Worker, with ``async_transfers``: of ``loaded``, blocks loaded off the step."""
    load_dropped: int = 0
    """Worker, with ``async_transfers``: of ``load_failed``, blocks the load queue had
    no room for."""
    save_dropped: int = 0
    """Worker: blocks L2 had no page for: not saved, a future miss."""
    save_us: int = 0
    """Worker: microseconds of wall time spent in ``wait_for_save`` in steps that save."""
    save_cpu_us: int = 0
    """Worker: microseconds of the worker thread's CPU time in those calls."""
    load_us: int = 0
    """Worker: microseconds of wall time of ``start_load_kv``'s loads on the step."""
    load_cpu_us: int = 0
    """Worker: microseconds of the worker thread's CPU time in those loads."""
    lookup_us: int = 0
    """Scheduler: microseconds of wall time its hit queries took (without
    ``async_transfers``)."""
    loaded_behind: int = 0
    """Worker: of ``l2_loaded``, blocks copied layer by layer behind the forward."""
    layer_wait_us: int = 0
    """Worker: microseconds the forward waited for those copies in
    ``wait_for_layer_load``."""
    loaded_past_l2: int = 0
    """Worker: of ``loaded``, blocks read through the staging pool because L2 had no
    page to read them into."""
    asked_tokens: int = 0
    """Scheduler: tokens of the full blocks past vLLM's own prefix cache a lookup asked
    about (the hit rate's denominator)."""
    l2_hit_tokens: int = 0
    """Scheduler: of those, tokens it told vLLM to load that were found in the node's
    L2 (``load_times.hit_tokens``)."""
    l3_hit_tokens: int = 0
    """Scheduler: the same, found in L3."""
    guard_load_off: int = 0
    """Scheduler: lookups whose hit the load guard loaded, the guard being off
    (``load_choice``: ``guard_{decision}_{reason}``, one per lookup with a hit)."""
    guard_load_faster_than_prefill: int = 0
    """Scheduler: lookups whose hit was loaded, estimated faster than prefill."""
    guard_load_no_estimate: int = 0
    """Scheduler: lookups whose hit was loaded for want of an estimate."""
    guard_load_above_threshold: int = 0
    """Scheduler: lookups whose hit was loaded, longer than the guard's threshold."""
    guard_recompute_slower_than_prefill: int = 0
    """Scheduler: lookups whose hit was recomputed, estimated slower than prefill."""
    guard_recompute_below_threshold: int = 0
    """Scheduler: lookups whose hit was recomputed, shorter than the threshold."""
    guard_mixed_slower_than_prefill: int = 0
    """Scheduler: lookups whose hit was loaded in part, the rest slower than prefill."""
    guard_skipped_l2_tokens: int = 0
    """Scheduler: tokens of a hit the guard left to recompute that were in L2
    (``guard_skipped_{tier}_tokens``)."""
    guard_skipped_l3_tokens: int = 0
    """Scheduler: the same, in L3 (memory, or a tier the guard does not name)."""
    guard_skipped_l3_disk_tokens: int = 0
    """Scheduler: the same, on L3's disk tier."""


@dataclass(frozen=True, slots=True)
class StatsGrowth:
    """What ``KVConnectorStats.data`` carries (module docstring): each ``SHOWN``
    counter's growth in the interval (``ConnectorStats`` says what it counts; a growth
    may be negative where the counter was taken back), and a worker's loads since its
    last report summed per tier (those tiers' ``LoadTimes`` records: what the scheduler
    side's load guard reads, never logged or exported). Summed over vLLM's workers and
    intervals with ``+``."""

    queries: int = 0
    hit_blocks: int = 0
    l2_hit_blocks: int = 0
    asked_tokens: int = 0
    l2_hit_tokens: int = 0
    l3_hit_tokens: int = 0
    loaded: int = 0
    l2_loaded: int = 0
    load_failed: int = 0
    load_dropped: int = 0
    saved: int = 0
    l2_saved: int = 0
    save_failed: int = 0
    save_refused: int = 0
    save_dropped: int = 0
    guard_load_off: int = 0
    guard_load_faster_than_prefill: int = 0
    guard_load_no_estimate: int = 0
    guard_load_above_threshold: int = 0
    guard_recompute_slower_than_prefill: int = 0
    guard_recompute_below_threshold: int = 0
    guard_mixed_slower_than_prefill: int = 0
    guard_skipped_l2_tokens: int = 0
    guard_skipped_l3_tokens: int = 0
    guard_skipped_l3_disk_tokens: int = 0
    l2_load_us: int = 0
    """Microseconds of the loads from L2 (``load_times.L2``), summed."""
    l2_load_bytes: int = 0
    """Bytes of the loads from L2, summed."""
    l3_load_us: int = 0
    """Microseconds of the loads that read L3 (``load_times.L3``), summed."""
    l3_load_bytes: int = 0
    """Bytes of those loads, summed."""

    def __add__(self, other: StatsGrowth) -> StatsGrowth:
        return StatsGrowth(*(a + b for a, b in zip(astuple(self), astuple(other),
                                                   strict=True)))

    def __sub__(self, other: StatsGrowth) -> StatsGrowth:
        return StatsGrowth(*(a - b for a, b in zip(astuple(self), astuple(other),
                                                   strict=True)))


GROWTH_KEYS = tuple(f.name for f in fields(StatsGrowth))
"""Every key ``KVConnectorStats.data`` may carry, in the record's order."""
SHOWN = GROWTH_KEYS[:GROWTH_KEYS.index("l2_load_us")]
"""The counters vLLM logs and exports (blocks, tokens and the load guard's decisions),
in the order it logs them; the microsecond sums stay in ``RayKVConnector.stats`` and
``raykv_connector``."""


def growth_to_vllm(growth: StatsGrowth) -> dict[str, int]:
    """``growth`` as ``KVConnectorStats.data``: field name -> value, the fields that are
    not 0 (``growth_from_vllm`` gives it back exactly)."""
    return {name: n for name, n in zip(GROWTH_KEYS, astuple(growth), strict=True) if n}


def growth_from_vllm(data: Mapping[str, Any]) -> StatsGrowth:
    """The ``StatsGrowth`` of a ``KVConnectorStats.data`` (``growth_to_vllm``'s, or
    vLLM's sum of several); a key it lacks is 0. ``ValueError`` naming them if it holds
    a key ``StatsGrowth`` has no field for or a value that is no integer (another
    raykv version's connector, or not raykv's stats)."""
    unknown = sorted(str(k) for k in data if k not in GROWTH_KEYS)
    if unknown:
        raise ValueError(f"raykv's vLLM connector stats have no counter {unknown} "
                         f"(known: {', '.join(GROWTH_KEYS)}); run one raykv version in "
                         "every vLLM process")
    bad = sorted(k for k, v in data.items() if type(v) is not int)
    if bad:
        raise ValueError(f"raykv's vLLM connector stats hold values that are no integer "
                         f"for {bad}")
    return StatsGrowth(**data)


def shown(stats: ConnectorStats) -> StatsGrowth:
    """The ``SHOWN`` counters of ``stats``, their totals (no load sums)."""
    return StatsGrowth(**{name: getattr(stats, name) for name in SHOWN})
