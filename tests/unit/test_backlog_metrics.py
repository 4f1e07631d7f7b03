"""``BacklogMetrics``: the write-behind's backlog (objects handed over whose put has
not ended) set on its gauge at every export."""

from __future__ import annotations

from types import SimpleNamespace

from raykv.cache_actors.node import backlog_metrics
from raykv.cache_actors.node.backlog_metrics import BacklogMetrics, backlog

from tests.unit.test_node_metrics import FakeMetric


def test_the_gauge_follows_the_backlog(monkeypatch):
    made = {}

    def make(name, *args, **kwargs):
        made[name] = FakeMetric(name, *args, **kwargs)
        return made[name]

    monkeypatch.setattr(backlog_metrics, "metrics", SimpleNamespace(Gauge=make))
    counts = {"l3_put_submitted": 10, "l3_put": 4, "l3_put_failed": 1, "l3_put_retried": 3}
    m = BacklogMetrics("node-0123456789abcdef", lambda: (counts, {}))
    gauge = made["raykv_l2_write_behind_objects"]
    assert gauge.defaults == {"node": "node-0123456"}
    m.export()
    counts.update(l3_put=9)
    m.export()
    assert [c[1] for c in gauge.calls] == [5, 0]  # set again even when 0
    # CONTROL: retries do not end a put; an empty L2 has no backlog
    assert backlog({"l3_put_submitted": 2, "l3_put_retried": 2}) == 2
    assert backlog({}) == 0
