"""The vLLM connector's counters as typed records (``integrations.vllm.connector_stats``,
pure): a misspelt counter fails where a dict took it as a new one; the one edge to
vLLM's dicts gives back exactly what it was handed and refuses keys it does not know.
vLLM's own logging and Prometheus of them: ``tests/unit/test_vllm_stats.py``."""

from __future__ import annotations

from dataclasses import FrozenInstanceError, fields

import pytest
from raykv.integrations.vllm.connector_stats import (
    GROWTH_KEYS,
    SHOWN,
    ConnectorStats,
    StatsGrowth,
    growth_from_vllm,
    growth_to_vllm,
    shown,
)
from raykv.integrations.vllm.load_choice import (
    DECISIONS,
    GUARD_TIERS,
    GuardOutcome,
    count,
    decision_key,
    skipped_key,
)


def test_a_misspelt_counter_fails_where_a_dict_made_a_new_one():
    stats = ConnectorStats()
    stats.queries += 1
    with pytest.raises(AttributeError):
        stats.qeuries += 1  # type: ignore[attr-defined]
    with pytest.raises(AttributeError):
        stats.qeuries = 1  # type: ignore[attr-defined]  # slots: no new attribute
    assert stats == ConnectorStats(queries=1)
    # CONTROL: the dict the counters were before counted the misspelt key silently
    old = dict.fromkeys(f.name for f in fields(ConnectorStats))
    old["qeuries"] = 1
    assert "qeuries" in old
    with pytest.raises(FrozenInstanceError):
        StatsGrowth().loaded = 1  # type: ignore[misc]  # a growth is never written


def test_every_guard_label_has_its_counter_and_an_unknown_one_fails():
    names = {f.name for f in fields(ConnectorStats)}
    assert {decision_key(d, r) for d, r in DECISIONS} <= names
    assert {skipped_key(t) for t in GUARD_TIERS} <= names
    assert set(SHOWN) <= names
    stats = ConnectorStats()
    count(stats, GuardOutcome(2, "mixed", "slower_than_prefill", {"l3_disk": 32, "x": 16},
                              (), None))  # type: ignore[arg-type]
    assert (stats.guard_mixed_slower_than_prefill, stats.guard_skipped_l3_disk_tokens,
            stats.guard_skipped_l3_tokens) == (1, 32, 16)  # an unnamed tier counts as l3
    with pytest.raises(AttributeError):  # CONTROL: a label pair without a counter
        count(stats, GuardOutcome(2, "load", "misspelt", {}, (), None))  # type: ignore


def test_the_vllm_edge_round_trips_exactly():
    growth = StatsGrowth(*range(-3, len(GROWTH_KEYS) - 3))  # every field, 0 and < 0 too
    data = growth_to_vllm(growth)
    assert "queries" in data and 0 not in data.values()  # a 0 is not carried
    assert growth_from_vllm(data) == growth
    assert growth_to_vllm(growth_from_vllm(data)) == data
    assert growth_from_vllm({}) == StatsGrowth() and growth_to_vllm(StatsGrowth()) == {}
    assert (growth + growth) - growth == growth


def test_the_vllm_edge_refuses_unknown_keys_and_values_by_name():
    with pytest.raises(ValueError, match=r"no counter \['lodaed'\]") as e:
        growth_from_vllm({"loaded": 1, "lodaed": 2})
    assert "run one raykv version" in str(e.value)
    with pytest.raises(ValueError, match=r"no counter \['load_us'\]"):
        growth_from_vllm({"load_us": 5})  # raykv's own, never handed to vLLM
    with pytest.raises(ValueError, match=r"no integer for \['loaded', 'saved'\]"):
        growth_from_vllm({"loaded": 1.5, "saved": True, "queries": 2})


def test_shown_takes_the_shown_counters_alone():
    stats = ConnectorStats(loaded=4, load_us=900, l3_hit_tokens=64)
    assert growth_to_vllm(shown(stats)) == {"loaded": 4, "l3_hit_tokens": 64}
