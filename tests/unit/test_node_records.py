"""A node actor's stats as typed records (``controllers.node_records``, pure): a misspelt
field fails where the dict answered a silent default; the JSON edge (``as_dict``: ``raykv
status --json``, benchmark results) gives the dicts the node answered before, key for key
and in order, the fields a node has only sometimes (the standalone client process, the
tiers with seals, a disk slot) left out while absent; the records cross Ray (pickled) as
they are."""

from __future__ import annotations

import json
import pickle
from dataclasses import FrozenInstanceError, replace

import pytest
from raykv.controllers.node_records import (
    ClientProcess,
    L2PoolStats,
    LinkView,
    NodeStats,
    PoolOwner,
    PoolStats,
    StatsFailed,
    TierStats,
    Warmup,
    as_dict,
)

from tests.unit.fakes import IDLE_NODE, node_stats

NODE_KEYS = [  # NodeStore.stats, node_stats.node_stats, then NodeCacheActor.stats
    "mode", "host_pool_bytes", "host_pool_used", "exposed_ports", "mooncake_endpoint",
    "own_segment", "node_id", "uptime_s", "global_segment_size", "pools", "tenants",
    "untenanted", "counters", "group_queries", "confirmed_pages", "merged_calls", "l2",
    "warnings", "residency", "warmup", "l2_evictions", "loads"]
"""The keys of a node actor's stats dict before they were records, in its order."""


def test_a_misspelt_field_fails_where_the_dict_answered_a_default():
    stats = node_stats(counters={"get_objects": 3})
    assert stats.l2.l3_put == 0 and stats.counters["get_objects"] == 3
    with pytest.raises(AttributeError):
        stats.l2.l3_puts  # noqa: B018  # a misspelt counter
    with pytest.raises(FrozenInstanceError):
        stats.uptime_s = 2.0  # type: ignore[misc]
    # CONTROL: the dict a reader had before took the misspelling for a counter of 0
    assert as_dict(stats)["l2"].get("l3_puts", 0) == 0


def test_json_is_the_dict_the_node_answered_before_key_for_key():
    plain = as_dict(IDLE_NODE)
    assert list(plain) == NODE_KEYS  # no client process, no tiers: left out
    assert list(plain["l2"]) == ["l2_bytes", "used", "pools", "filled", "fill_failed",
                                 "warmed", "warm_failed", "l3_put_submitted", "l3_put",
                                 "l3_put_retried", "l3_put_failed", "l3_put_pending"]
    assert list(plain["loads"]) == ["links", "l3_disk", "overall", "queue_wait_s",
                                    "located_keys"]
    assert plain["untenanted"] == {"pool_bytes": 0, "pools": 0, "quota": None}
    assert plain["group_queries"] == {"recent": 0, "inflight": 0, "confirmed": 0,
                                      "looked_up": 0, "store_calls": 0,
                                      "deployment_fetches": 0, "store_seconds": 0.0}
    pool = L2PoolStats(pages=4, ready=3, dirty=1, held=0, leased=2, hits=5, misses=1,
                       written=3, evicted=0, full=0, flushed=2, aborted=0)
    warmup = Warmup(deployment="d", rank=[0, 1], state="done", pages=2, bytes=8,
                    chosen=2, stopped="done", seconds=0.5)
    full = node_stats(
        own_segment="10.0.0.1:15000",
        mooncake_client=ClientProcess(pid=9, port=4242, adopted=True, restarts=1,
                                      alive=True),
        tiers=TierStats(served={"l3_disk": 2}, served_bytes={"l3_disk": 64}, refused={}),
        pools={"kv": PoolStats(kind="mha", bytes=64, pages=4,
                               owner=PoolOwner(deployment="d", tenant=None),
                               counters={"put_ok": 2})},
        l2=replace(IDLE_NODE.l2, pools={"l2-kv": pool}),
        warmup=replace(IDLE_NODE.warmup, warmups={"l2-kv": warmup}),
        loads=replace(IDLE_NODE.loads, links={"10.0.0.2:15000": LinkView(
            mb_per_s=float("inf"), fixed_ms=0.1, samples=2, probe_age_s=None)}))
    plain = as_dict(full)
    assert list(plain) == [*NODE_KEYS[:6], "mooncake_client", "tiers", *NODE_KEYS[6:]]
    assert plain["mooncake_client"] == {"pid": 9, "port": 4242, "adopted": True,
                                        "restarts": 1, "alive": True}
    assert plain["tiers"] == {"served": {"l3_disk": 2}, "served_bytes": {"l3_disk": 64},
                              "refused": {}}  # no disk slot: path and bytes left out
    assert as_dict(replace(full.tiers, path="/d", limit_bytes=8, used_bytes=1)) == {
        "served": {"l3_disk": 2}, "served_bytes": {"l3_disk": 64}, "refused": {},
        "path": "/d", "limit_bytes": 8, "used_bytes": 1}
    assert plain["pools"]["kv"] == {"kind": "mha", "bytes": 64, "pages": 4, "owner": {
        "deployment": "d", "tenant": None}, "counters": {"put_ok": 2}}
    assert plain["l2"]["pools"]["l2-kv"] == {
        "pages": 4, "ready": 3, "dirty": 1, "held": 0, "leased": 2, "hits": 5, "misses": 1,
        "written": 3, "evicted": 0, "full": 0, "flushed": 2, "aborted": 0}
    assert plain["warmup"]["warmups"]["l2-kv"] == {
        "deployment": "d", "rank": [0, 1], "state": "done", "pages": 2, "bytes": 8,
        "chosen": 2, "stopped": "done", "seconds": 0.5}
    assert plain["loads"]["links"]["10.0.0.2:15000"] == {
        "mb_per_s": float("inf"), "fixed_ms": 0.1, "samples": 2, "probe_age_s": None}
    assert plain["own_segment"] == "10.0.0.1:15000"
    assert as_dict(StatsFailed("gone")) == {"error": "gone"}
    json.dumps(plain)  # plain data all through


def test_records_cross_ray_as_they_are():
    stats = node_stats(tiers=TierStats(served={}, served_bytes={}, refused={"mac": 1},
                                       path="/d", limit_bytes=8, used_bytes=1))
    again = pickle.loads(pickle.dumps(stats))
    assert again == stats and isinstance(again, NodeStats)
    assert again.tiers.refused == {"mac": 1}
