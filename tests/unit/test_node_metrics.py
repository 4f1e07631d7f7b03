"""NodeMetrics: every outcome counted at once for ``stats()``, Ray metrics updated only
by ``export`` (off the data path), each recorded amount exported exactly once."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from raykv.cache_actors.node import node_metrics
from raykv.cache_actors.node.node_metrics import NodeMetrics
from raykv.controllers.node_records import GroupQueryStats, MergedCallStats
from raykv.controllers.object_batch import ObjectBatch
from raykv.controllers.result_codes import ALREADY_PRESENT


class FakeMetric:
    """Stands in for a ``ray.util.metrics`` object: records what it was given, and, as
    Ray's does, refuses tags that are not exactly its declared ``tag_keys`` (with its
    default tags). Ray's real export: ``tests/integration/test_metrics_export.py``."""

    def __init__(self, name: str, description: str = "", boundaries=None,
                 tag_keys: tuple[str, ...] = ()) -> None:
        self.name = name
        self.tag_keys = set(tag_keys)
        self.defaults: dict = {}
        self.calls: list[tuple[str, float, dict]] = []

    def set_default_tags(self, tags: dict) -> None:
        assert set(tags) <= self.tag_keys, (self.name, tags)
        self.defaults = dict(tags)

    def _record(self, how: str, value: float, tags: dict | None) -> None:
        given = dict(tags or {})
        assert set(given | self.defaults) == self.tag_keys, (self.name, given)
        self.calls.append((how, value, given))

    def inc(self, value: float = 1.0, tags: dict | None = None) -> None:
        self._record("inc", value, tags)

    def observe(self, value: float, tags: dict | None = None) -> None:
        self._record("observe", value, tags)

    def set(self, value: float, tags: dict | None = None) -> None:
        self._record("set", value, tags)


NO_OWNER = {"tenant": "(none)", "deployment": "(none)"}  # a pool this actor has no owner of


@pytest.fixture
def recorded(monkeypatch):
    made: dict[str, FakeMetric] = {}

    def make(name, *args, **kwargs):
        made[name] = FakeMetric(name, *args, **kwargs)
        return made[name]

    monkeypatch.setattr(node_metrics, "metrics",
                        SimpleNamespace(Counter=make, Histogram=make, Gauge=make))
    m = NodeMetrics("node-0123456789", export_s=3600.0)  # exported by hand below
    yield m, made
    m.close()


def batch(pools: list[str], sizes: list[int]) -> ObjectBatch:
    b = ObjectBatch()
    for i, (pool, size) in enumerate(zip(pools, sizes, strict=True)):
        b.add(f"k{i}", pool, i * size, size)
    return b


def test_counts_are_current_before_any_export(recorded):
    m, made = recorded
    m.record_move("put", batch(["kv"] * 3, [8, 8, 8]), [0, ALREADY_PRESENT, -800], 0.01)
    m.record_move("get", batch(["kv", "mamba"], [8, 4]), [8, 4], 0.02)
    assert m.counters() == {"put_objects": 1, "put_present": 1, "put_error_-800": 1,
                            "put_bytes": 8, "get_objects": 2, "get_bytes": 12}
    assert m.pool_counters("kv") == {"put_ok": 1, "put_present": 1, "put_error_-800": 1,
                                     "get_ok": 1}
    assert m.pool_counters("mamba") == {"get_ok": 1}
    assert all(not metric.calls for metric in made.values())  # nothing on the data path


def test_export_hands_each_amount_to_ray_once(recorded):
    m, made = recorded
    for _ in range(3):  # the common case: one pool, every object moved
        m.record_move("put", batch(["kv"] * 2, [8, 8]), [0, 0], 0.01)
    m.record_move("get", batch(["kv"], [8]), [-704], 0.5)
    m.record_exists(0.001)
    m.record_group_query("looked_up")
    m.export()
    objects = {(c[2]["op"], c[2]["outcome"]): c[1] for c in made["raykv_objects"].calls}
    assert objects == {("put", "ok"): 6, ("get", "error_-704"): 1}
    assert made["raykv_bytes"].calls == [("inc", 48, {"op": "put", "pool": "kv"} | NO_OWNER)]
    assert sorted((c[2]["op"], c[1]) for c in made["raykv_call_seconds"].calls) == [
        ("exists", 0.001), ("get", 0.5), ("put", 0.01), ("put", 0.01), ("put", 0.01)]
    assert made["raykv_group_queries"].calls == [("inc", 1, {"answer": "looked_up"})]
    before = {name: len(metric.calls) for name, metric in made.items()}
    m.export()  # nothing new recorded: nothing exported again
    assert {name: len(metric.calls) for name, metric in made.items()} == before


def test_close_exports_what_is_left(recorded):
    m, made = recorded
    m.record_move("put", batch(["kv"], [8]), [0], 0.01)
    m.close()
    assert made["raykv_bytes"].calls == [("inc", 8, {"op": "put", "pool": "kv"} | NO_OWNER)]


def test_group_queries_and_merged_calls_are_counted_once_for_stats(recorded):
    """``GroupQueries`` and ``TransferMerger`` only report: the counts ``stats()`` shows
    are these, and the Ray metrics are exported from the same records."""
    m, made = recorded
    assert m.group_queries() == GroupQueryStats(
        recent=0, inflight=0, confirmed=0, looked_up=0, store_calls=0,
        deployment_fetches=0, store_seconds=0.0)
    assert m.merged_calls() == MergedCallStats(calls=0, batches=0, largest=0)
    for how in ("looked_up", "recent", "inflight", "looked_up", "confirmed"):
        m.record_group_query(how)
    m.record_group_store_call(0.25)
    m.record_group_store_call(0.5)
    m.record_deployment_fetch()
    for batches in (1, 3, 2):
        m.record_merged_call(batches)
    assert m.group_queries() == GroupQueryStats(
        recent=1, inflight=1, confirmed=1, looked_up=2, store_calls=2,
        deployment_fetches=1, store_seconds=0.75)
    assert m.merged_calls() == MergedCallStats(calls=3, batches=6, largest=3)
    m.export()
    answers = sorted((c[2]["answer"], c[1]) for c in made["raykv_group_queries"].calls)
    assert answers == [("confirmed", 1), ("inflight", 1), ("looked_up", 2), ("recent", 1)]
    assert sorted(c[1] for c in made["raykv_call_seconds"].calls
                  if c[2]["op"] == "group_exists") == [0.25, 0.5]


def test_tenant_and_deployment_labels_stay_bounded_as_pools_come_and_go(recorded):
    """Pools of ever new deployments created, used and destroyed: each tag keeps at most
    its bound of labels of its own (the rest under ``(other)``), every amount is still
    exported, and the per-pool state of a destroyed pool is dropped. Control: within the
    bound, every deployment and tenant is its own label."""
    from raykv.controllers.ownership import Owner

    m, made = recorded
    n = 10 * node_metrics.MAX_POOL_LABELS
    for i in range(n):
        pool, owner = f"p{i}", Owner(f"dep-{i}", f"tenant-{i % 100}")
        m.pool_size(pool, 64, owner)
        m.record_move("get", batch([pool], [8]), [8], 0.001)
        m.record_exists(0.001, [1, 0], owner)
        m.pool_size(pool, 0, owner)
    m.export()
    calls = [c for metric in made.values() for c in metric.calls]
    labels = {key: {c[2][key] for c in calls if key in c[2]}
              for key in ("pool", "tenant", "deployment")}
    assert len(labels["pool"]) == node_metrics.MAX_POOL_LABELS + 1
    assert len(labels["deployment"]) == node_metrics.MAX_DEPLOYMENT_LABELS + 1
    assert len(labels["tenant"]) == node_metrics.MAX_TENANT_LABELS + 1
    assert all(node_metrics.OTHER in v for v in labels.values())
    assert {"dep-0", "tenant-0", "p0"} <= set().union(*labels.values())
    got = sum(c[1] for c in made["raykv_bytes"].calls)
    assert got == 8 * n  # nothing lost to the bound
    hits = sum(c[1] for c in made["raykv_exists_keys"].calls if c[2]["answer"] == "hit")
    assert hits == n
    assert m._pools == {} and m._gauges == {} and m._pool_counts == {}
    last = {}  # the gauge of every label set ends at 0: no destroyed pool's bytes linger
    for _, value, tags in made["raykv_pool_bytes"].calls:
        last[tuple(sorted(tags.items()))] = value
    assert set(last.values()) == {0}


def test_pool_bytes_past_the_bound_are_summed_under_other(recorded):
    from raykv.controllers.ownership import Owner

    m, made = recorded
    for i in range(node_metrics.MAX_POOL_LABELS + 2):
        m.pool_size(f"p{i}", 10, Owner("d", "t"))
    other = [c for c in made["raykv_pool_bytes"].calls if c[2]["pool"] == node_metrics.OTHER]
    assert [c[1] for c in other] == [10, 20]  # two pools past the bound: their sum
    assert made["raykv_pool_bytes"].calls[0] == ("set", 10, {"pool": "p0", "tenant": "t",
                                                           "deployment": "d"})


def test_l2_counts_are_exported_as_they_grow_once_each(recorded):
    """The L2 cache's counts (``L2Pools.counters``) read at each export: what grew since
    the last one is exported (a new pool's whole counts, nothing for a pool gone, never
    the write-behind's ``l3_put_pending``, which also falls)."""
    from raykv.controllers.ownership import Owner

    m, made = recorded
    owner = Owner("dep-a", "team-a")
    node = {"filled": 2, "fill_failed": 0, "l3_put": 3, "l3_put_pending": 1}
    pools = {"l2-a-1": (owner, {"hits": 4, "misses": 1, "written": 3})}
    m.watch_l2(lambda: (node, pools))
    m.export()
    pages = made["raykv_l2_pages"].calls
    assert sorted((c[2]["event"], c[1]) for c in pages) == [
        ("hits", 4), ("misses", 1), ("written", 3)]
    assert {(c[2]["tenant"], c[2]["deployment"]) for c in pages} == {("team-a", "dep-a")}
    assert sorted((c[2]["event"], c[1]) for c in made["raykv_l2_objects"].calls) == [
        ("filled", 2), ("l3_put", 3)]
    node |= {"l3_put": 5, "l3_put_pending": 0}
    pools = {"l2-a-1": (owner, {"hits": 6, "misses": 1, "written": 3}),
             "l2-a-2": (owner, {"hits": 1})}  # a new pool of the same deployment
    m.export()
    assert [(c[2]["event"], c[1]) for c in made["raykv_l2_pages"].calls[3:]] == [("hits", 3)]
    assert [(c[2]["event"], c[1]) for c in made["raykv_l2_objects"].calls[2:]] == [
        ("l3_put", 2)]
    pools = {}  # both gone: nothing more, and a later pool starts from its own counts
    m.export()
    pools = {"l2-a-3": (owner, {"hits": 1})}
    m.export()
    assert [(c[2]["event"], c[1]) for c in made["raykv_l2_pages"].calls[4:]] == [("hits", 1)]


def test_every_export_sets_the_pool_gauges_again(recorded):
    """Ray's export drops a gauge that was not set for two report intervals (found
    through its real export: ``test_metrics_export``), so each export sets every live
    pool's gauge again; a pool gone is set to 0 once, then no more."""
    from raykv.controllers.ownership import Owner

    m, made = recorded
    m.pool_size("p0", 64, Owner("d", "t"))
    m.pool_size("p1", 32, None)
    m.pool_size("p1", 0, None)
    m.export()
    m.export()
    sets = [(c[2]["pool"], c[1]) for c in made["raykv_pool_bytes"].calls]
    assert sets == [("p0", 64), ("p1", 32), ("p1", 0), ("p0", 64), ("p0", 64)]


def test_a_drains_report_is_counted_and_exported_by_outcome(recorded):
    m, made = recorded
    m.record_drain({"objects_moved": 3, "bytes_moved": 300, "objects_dropped": 1,
                    "bytes_dropped": 50, "objects_left": 0, "bytes_left": 0, "l2_pages": 2,
                    "state": "done"})
    assert m.counters() == {"drain_moved_objects": 3, "drain_moved_bytes": 300,
                            "drain_dropped_objects": 1, "drain_dropped_bytes": 50,
                            "drain_l2_flushed_objects": 2}
    m.export()
    assert sorted((c[2]["outcome"], c[1]) for c in made["raykv_drain_objects"].calls) == [
        ("dropped", 1), ("l2_flushed", 2), ("moved", 3)]
    assert sorted((c[2]["outcome"], c[1]) for c in made["raykv_drain_bytes"].calls) == [
        ("dropped", 50), ("moved", 300)]


def test_warmed_bytes_are_exported_once_by_owner(recorded):
    """The warm-up's bytes (``L2Warmup`` records each batch read) reach
    ``raykv_l2_warmed_bytes`` by the pool owner's tenant and deployment, each once."""
    from raykv.controllers.ownership import Owner

    m, made = recorded
    m.record_warmed(Owner("m_"), 128)
    m.record_warmed(Owner("m_"), 64)
    m.record_warmed(Owner("t1.x", "acme"), 32)
    assert made["raykv_l2_warmed_bytes"].calls == []  # not on the warm-up's path
    m.export()
    assert sorted((c[2]["tenant"], c[2]["deployment"], c[1])
                  for c in made["raykv_l2_warmed_bytes"].calls) == [
        ("(none)", "m_", 192), ("acme", "t1.x", 32)]
    m.export()
    assert len(made["raykv_l2_warmed_bytes"].calls) == 2
