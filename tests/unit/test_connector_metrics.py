"""``ConnectorMetrics``: a connector side's counters exported as what grew since the last
look, once each, with declared labels only; the hit and asked tokens by tier and the
loads' histograms with the engine's tenant and deployment (Ray's real export:
``tests/integration/test_metrics_export.py``)."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest
from raykv.integrations.vllm.connector_metrics import ConnectorMetrics
from raykv.integrations.vllm.connector_stats import ConnectorStats
from raykv.integrations.vllm.load_times import LoadTimes

from tests.unit.test_node_metrics import FakeMetric

TAGS = {"role": "worker", "tp_rank": "0", "model": "org/m"}
OWNER = {"tenant": "t1", "deployment": "dep"}


@pytest.fixture
def made(monkeypatch):
    made: dict[str, FakeMetric] = {}

    def make(name, *args, **kwargs):
        made[name] = FakeMetric(name, *args, **kwargs)
        return made[name]

    import ray.util

    fake = SimpleNamespace(Counter=make, Histogram=make)
    monkeypatch.setattr(ray.util, "metrics", fake, raising=False)
    monkeypatch.setitem(sys.modules, "ray.util.metrics", fake)
    return made


def test_counters_are_exported_as_they_grow_once_each(made):
    stats = ConnectorStats()
    m = ConnectorMetrics(stats, TAGS, export_s=3600.0)  # exported by hand below
    counter = made["raykv_connector"]
    m.export()
    assert counter.calls == []  # nothing counted yet
    stats.saved += 3
    stats.loaded += 2
    m.export()
    stats.saved += 1
    m.export()
    m.export()
    assert sorted((c[2]["counter"], c[1]) for c in counter.calls) == [
        ("loaded", 2), ("saved", 1), ("saved", 3)]
    stats.load_failed += 1
    m.close()  # what is left goes out
    assert counter.calls[-1][2] == {"counter": "load_failed"}
    assert counter.defaults == TAGS


def test_hit_tokens_by_tier_over_asked_tokens_and_loads_by_tier(made):
    stats, loads = ConnectorStats(), LoadTimes()
    m = ConnectorMetrics(stats, TAGS, export_s=3600.0, owner=OWNER, loads=loads)
    stats.asked_tokens += 96
    stats.l2_hit_tokens += 32
    stats.l3_hit_tokens += 16
    loads.record("l2", 0.002, 4096)
    loads.record("l3", 0.5, 8192)
    m.export()
    asked, hit = made["raykv_asked_tokens"], made["raykv_hit_tokens"]
    assert [c[1] for c in asked.calls] == [96]
    assert sorted((c[2]["tier"], c[1]) for c in hit.calls) == [("l2", 32), ("l3", 16)]
    assert asked.defaults == hit.defaults == OWNER | {"model": "org/m"}
    seconds, nbytes = made["raykv_load_seconds"], made["raykv_load_bytes"]
    assert [(c[2]["tier"], c[1]) for c in seconds.calls] == [("l2", 0.002), ("l3", 0.5)]
    assert [(c[2]["tier"], c[1]) for c in nbytes.calls] == [("l2", 4096), ("l3", 8192)]
    assert seconds.defaults == OWNER | {"model": "org/m", "tp_rank": "0"}
    m.export()  # CONTROL: nothing grew, nothing recorded: nothing new exported
    assert (len(asked.calls), len(hit.calls), len(seconds.calls)) == (1, 2, 2)
    stats.l3_hit_tokens += 16
    m.close()
    assert hit.calls[-1][1:] == (16, {"tier": "l3"}) and len(asked.calls) == 1


def test_load_guard_decisions_and_skipped_tokens_by_label(made):
    """The scheduler's ``guard_*`` counters become ``raykv_load_guard_decisions`` by
    decision and reason and ``raykv_load_guard_skipped_tokens`` by tier. CONTROL: a
    counter of another name reaches neither."""
    stats = ConnectorStats()
    m = ConnectorMetrics(stats, TAGS | {"role": "scheduler"}, export_s=3600.0,
                         owner=OWNER)
    stats.guard_mixed_slower_than_prefill += 2
    stats.guard_load_no_estimate += 1
    stats.guard_skipped_l3_tokens += 256
    stats.queries += 3
    m.export()
    decisions, skipped = made["raykv_load_guard_decisions"], made[
        "raykv_load_guard_skipped_tokens"]
    assert sorted((c[2]["decision"], c[2]["reason"], c[1]) for c in decisions.calls) == [
        ("load", "no_estimate", 1), ("mixed", "slower_than_prefill", 2)]
    assert [(c[2], c[1]) for c in skipped.calls] == [({"tier": "l3"}, 256)]
    assert decisions.defaults == OWNER | {"model": "org/m"}
    m.close()
