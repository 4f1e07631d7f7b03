"""raykv's node metrics through Ray's real metrics export, read back as a Prometheus
server scrapes them: a one-node cluster (real Ray, real ``mooncake_master``), a rank's
puts, gets, lookups, a group query and L2 ops (open, reserve, commit, a lookup, reads
that hit and miss, the write-behind to L3), then the node's metrics endpoint (Ray's metrics agent
on ``MetricsExportPort`` of ``ray.nodes()``), parsed with ``prometheus_client``'s
parser, until it shows them. Checked: every metric the node declares is there with the
label names it declares (Ray accepted them: a label set Ray refuses never reaches the
endpoint), its values equal the node actor's own ``stats()``, and the pool gauges are
still exported ``GAUGE_TTL_S`` after the last pool change. CONTROL: an outcome the node
never counted (a get error) is absent, and another node id has no series."""

from __future__ import annotations

import json
import re
import time
import urllib.request
import uuid
from pathlib import Path

import pytest
import ray

pytest.importorskip("prometheus_client", reason="Ray's metrics export comes with ray[default]")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402
from raykv import CacheClient, local_settings, start_local  # noqa: E402
from raykv.controllers import StorageConfig  # noqa: E402
from raykv.controllers.deployments import deployment_id  # noqa: E402
from raykv.controllers.pool_layout import PoolLayout  # noqa: E402

from tests.integration.ranks import MHA, indices  # noqa: E402

SCRAPE_S = 90.0  # Ray's agent exports every few seconds; a loaded 2-core host is slower
GAUGE_TTL_S = 40.0  # past twice Ray's default metrics report interval (10 s), with margin
L2_LAYOUT = PoolLayout.vllm(page_size=4, size=32, layer_num=1, head_num=1, head_dim=8,
                            dtype="bfloat16", itemsize=2)
NEW_LABELS = {  # the connector's hit and load metrics -> their label names
    "raykv_asked_tokens": {"tenant", "deployment", "model"},
    "raykv_hit_tokens": {"tier", "tenant", "deployment", "model"},
    "raykv_load_seconds": {"tier", "tenant", "deployment", "model", "tp_rank"},
    "raykv_load_bytes": {"tier", "tenant", "deployment", "model", "tp_rank"},
}
DASHBOARD = Path(__file__).resolve().parents[2] / "docs" / "grafana" / "raykv.json"
LABELS = {  # metric -> the label names the node declares for it (beside Ray's own)
    "raykv_objects": {"node", "op", "pool", "outcome", "tenant", "deployment"},
    "raykv_bytes": {"node", "op", "pool", "tenant", "deployment"},
    "raykv_exists_keys": {"node", "answer", "tenant", "deployment"},
    "raykv_call_seconds": {"node", "op"},
    "raykv_pool_bytes": {"node", "pool", "tenant", "deployment"},
    "raykv_group_queries": {"node", "answer"},
    "raykv_l2_pages": {"node", "event", "tenant", "deployment"},
    "raykv_l2_objects": {"node", "event"},
    "raykv_l2_write_behind_objects": {"node"},
    "raykv_link_bytes_per_second": {"node", "segment"},  # its own segment's, probed
}


@pytest.fixture(scope="module")
def cluster():
    with start_local(settings=local_settings(global_segment_size=64 << 20, l2_bytes=1 << 20),
                     num_nodes=1) as c:
        yield c


def scrape(node: dict) -> dict[str, list]:
    """Samples of the raykv metrics on ``node``'s metrics endpoint, by metric name
    (Ray's ``ray_`` prefix and the counters' ``_total`` taken off)."""
    url = f"http://{node['NodeManagerAddress']}:{node['MetricsExportPort']}/metrics"
    with urllib.request.urlopen(url, timeout=10) as answer:
        text = answer.read().decode()
    out: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        name = family.name.removeprefix("ray_")
        if name.startswith("raykv_"):
            out.setdefault(name, []).extend(family.samples)
    return out


def raw_names(node: dict) -> set[str]:
    """The sample names on ``node``'s metrics endpoint, as Prometheus stores them."""
    url = f"http://{node['NodeManagerAddress']}:{node['MetricsExportPort']}/metrics"
    with urllib.request.urlopen(url, timeout=10) as answer:
        text = answer.read().decode()
    return {s.name for family in text_string_to_metric_families(text)
            for s in family.samples}


def dashboard_names() -> set[str]:
    """The metric names the Grafana dashboard's queries name."""
    exprs = [t["expr"] for p in json.loads(DASHBOARD.read_text())["panels"]
             for t in p.get("targets", [])]
    return {m for e in exprs for m in re.findall(r"\bray_raykv_\w+", e)}


def total(samples: list, suffix: str = "", **labels: str) -> float:
    """The sum of ``samples`` named with ``suffix`` whose labels include ``labels``."""
    return sum(s.value for s in samples if s.name.endswith(suffix)
               and all(s.labels.get(k) == v for k, v in labels.items()))


def test_node_metrics_reach_rays_prometheus_export(cluster):
    uid = uuid.uuid4().hex[:8]
    client = CacheClient(StorageConfig(model_name=f"metrics/{uid}"))
    pool = client.create_host_pool("mha", **MHA)
    client.register_mem_pool_host(pool)
    keys = [f"{uid}-{i}" for i in range(3)]
    assert client.batch_set_v1(keys, indices(0, 3)) == [True] * 3
    assert client.batch_get_v1(keys, indices(16, 3)) == [True] * 3
    assert client.batch_exists(keys + [f"{uid}-none"]) == 3
    assert client.group_exists(keys).kv_hit_pages == 3
    l2 = client.l2()
    hashes = [f"{uid}-l2-{i}" for i in range(4)]
    l2_pool = l2.open(L2_LAYOUT, 8)
    changed = time.monotonic()  # the last pool made
    pages = l2.reserve(l2_pool.name, hashes)
    assert l2.commit(l2_pool.name, hashes, pages, [True] * 4) == 4
    assert l2.lookup(hashes, 1) == 4
    assert len(l2.acquire(l2_pool.name, hashes, False)) == 4  # hits
    assert l2.acquire(l2_pool.name, [f"{uid}-l2-none"], False) == []  # a miss
    deadline = time.monotonic() + SCRAPE_S
    while client.stats().l2.l3_put < 4:  # the write-behind landed
        assert time.monotonic() < deadline, client.stats().l2
        time.sleep(0.2)
    stats = client.stats()
    counters, l2_stats = stats.counters, stats.l2
    (l2_counts,) = [p for name, p in l2_stats.pools.items() if name == l2_pool.name]
    node_id = cluster.node_ids[0]
    (node,) = [n for n in ray.nodes() if n["NodeID"] == node_id]
    me = {"node": node_id[:12]}
    want = {  # (metric, suffix, labels) -> what the node's stats say
        ("raykv_objects", "_total", ("op", "put"), ("outcome", "ok")): counters["put_objects"],
        ("raykv_objects", "_total", ("op", "get"), ("outcome", "ok")): counters["get_objects"],
        ("raykv_bytes", "_total", ("op", "put")): counters["put_bytes"],
        ("raykv_group_queries", "_total", ("answer", "looked_up")):
            stats.group_queries.looked_up,
        ("raykv_pool_bytes", "", ("pool", pool.name)): pool.nbytes,
        ("raykv_pool_bytes", "", ("pool", l2_pool.name)): l2_pool.nbytes,
        ("raykv_l2_pages", "_total", ("event", "written")): l2_counts.written,
        ("raykv_l2_pages", "_total", ("event", "hits")): l2_counts.hits,
        ("raykv_l2_pages", "_total", ("event", "misses")): l2_counts.misses,
        ("raykv_l2_objects", "_total", ("event", "l3_put_submitted")):
            l2_stats.l3_put_submitted,
        ("raykv_l2_objects", "_total", ("event", "l3_put")): l2_stats.l3_put,
        ("raykv_l2_write_behind_objects", ""): l2_stats.l3_put_submitted
        - l2_stats.l3_put - l2_stats.l3_put_failed,  # 0: every put ended
    }
    assert counters["put_objects"] >= 3 and l2_counts.hits == 4 and l2_counts.misses
    got: dict = {}
    while True:
        found = scrape(node)
        got = {k: total(found.get(k[0], []), k[1], **me, **dict(k[2:])) for k in want}
        if got == want:
            break
        assert time.monotonic() < deadline, {k: (got[k], v) for k, v in want.items()
                                             if got[k] != v}
        time.sleep(1)
    at_least = {("raykv_exists_keys", "_total", ("answer", "hit")): 3,  # this rank's exists
                ("raykv_exists_keys", "_total", ("answer", "miss")): 1,
                ("raykv_call_seconds", "_count", ("op", "put")): 1,
                ("raykv_call_seconds", "_count", ("op", "get")): 1}
    for k, n in at_least.items():
        assert total(found.get(k[0], []), k[1], **me, **dict(k[2:])) >= n, k
    for metric, names in LABELS.items():
        assert found.get(metric), f"{metric} not exported"
        for sample in found[metric]:
            assert names <= set(sample.labels), (metric, sample.labels)
    objects = found["raykv_objects"]
    assert total(objects, "_total", **me, op="put", pool=pool.name,
                 deployment=deployment_id(client.config), tenant="(none)") == \
        stats.pools[pool.name].counters["put_ok"] == 2 * len(keys)  # K and V
    # CONTROL: what the node never counted is not there
    assert not [s for s in objects if s.labels.get("outcome", "").startswith("error")]
    assert total(objects, "_total", node="not-a-node") == 0
    # Ray's export drops a gauge not set for two report intervals (~20 s): the pool
    # gauges are still there well after the last pool change
    while time.monotonic() < changed + GAUGE_TTL_S:
        time.sleep(1)
    later = scrape(node)["raykv_pool_bytes"]
    # the names the Grafana dashboard queries for what this test did are the exported ones
    raw = raw_names(node)
    queried = {q for q in dashboard_names() if q.removeprefix("ray_").startswith(
        ("raykv_l2_pages", "raykv_l2_write_behind", "raykv_call_seconds"))}
    assert len(queried) == 3 and queried <= raw, queried - raw
    assert total(later, **me, pool=pool.name) == pool.nbytes, later
    assert total(later, **me, pool=l2_pool.name) == l2_pool.nbytes, later
    client.destroy_host_pool(l2_pool)
    client.destroy_host_pool(pool)
    client.close()


def test_vllm_connector_counters_reach_rays_prometheus_export(cluster, tmp_path):
    """vLLM's scheduler driving ``RayKVConnector`` in this process (``vllm_steps``):
    an engine computes and saves a prompt, a fresh one loads it. The counters of both
    sides (``RayKVConnector.stats``) reach the node's endpoint as ``raykv_connector``
    by counter, role, TP rank and model, equal to the sides' own (both engines' sums:
    one series per side); the hit rate's tokens (``raykv_asked_tokens``,
    ``raykv_hit_tokens`` by tier) and the load's histograms (``raykv_load_seconds``,
    ``raykv_load_bytes`` by tier) with the documented labels, equal to what the
    connector counted and loaded; vLLM's own connector stats (what its scheduler
    reports, ``get_kv_connector_stats``) equal them too. CONTROL: after the first
    engine, a miss, the tokens asked are exported but no hit token and no load (the
    counters grow with the second engine's load, not before); a counter that stayed 0
    (``load_failed``) is absent."""
    pytest.importorskip("vllm", reason="the vLLM connector's counters need vLLM")
    from raykv.integrations.vllm.connector_metrics import LOAD_BYTES
    from raykv_lab.engines.vllm_model import make_llama

    from tests.integration.vllm_steps import StepEngine

    model = make_llama(str(tmp_path / "tiny-llama"))
    name = f"connector-{uuid.uuid4().hex[:8]}"
    prompt = [3 + (i * 7) % 1997 for i in range(4 * 16 + 1)]  # 4 blocks to save / load
    (node,) = [n for n in ray.nodes() if n["NodeID"] == cluster.node_ids[0]]
    mine = {"model": name}

    def exported(metric: str, suffix: str, **labels: str) -> float:
        return total(scrape(node).get(metric, []), suffix, **mine, **labels)

    def wait_for(want: dict) -> dict[str, list]:
        """Scrape until every ``(metric, suffix, labels) -> value`` of ``want`` holds."""
        deadline = time.monotonic() + SCRAPE_S
        while True:
            found = scrape(node)
            got = {k: total(found.get(k[0], []), k[1], **mine, **dict(k[2:])) for k in want}
            if got == want:
                return found
            assert time.monotonic() < deadline, {k: (got[k], v) for k, v in want.items()
                                                 if got[k] != v}
            time.sleep(1)

    engines = [StepEngine(model, name)]
    engines[0].add(prompt)
    engines[0].run()
    engines[0].close()  # each side exports what is left
    first = engines[0].scheduler.connector.stats
    assert engines[0].worker.stats.saved == 4
    assert first.asked_tokens == 4 * 16 and first.l3_hit_tokens == 0  # a miss
    wait_for({("raykv_asked_tokens", "_total"): 4 * 16})
    # CONTROL: nothing hit or loaded yet, so none of those counters is there
    assert exported("raykv_hit_tokens", "_total") == 0
    assert exported("raykv_load_seconds", "_count") == 0
    engines.append(StepEngine(model, name))  # loads what the first saved
    engines[1].add(prompt)
    engines[1].run()
    engines[1].close()
    second, worker = engines[1].scheduler.connector.stats, engines[1].worker.stats
    assert worker.loaded == 4 and second.l3_hit_tokens == 4 * 16
    assert second.l2_hit_tokens == 0  # no L2 cache in these engines: every hit is L3's
    found = wait_for({("raykv_asked_tokens", "_total"): 2 * 4 * 16,
                      ("raykv_hit_tokens", "_total", ("tier", "l3")): 4 * 16,
                      ("raykv_load_seconds", "_count", ("tier", "l3")): 1,  # one load
                      ("raykv_load_bytes", "_count", ("tier", "l3")): 1})
    # Ray's export keeps a histogram's bucket counts (its _sum is their midpoints'):
    # the load's 4 blocks of 128 bytes fall in the smallest bucket
    block_bytes = engines[1].kv[0].nbytes  # one block of the engine's one layer
    assert 4 * block_bytes <= LOAD_BYTES[0]
    assert [s.value for s in found["raykv_load_bytes"] if s.labels.get("model") == name
            and s.name.endswith("_bucket") and float(s.labels["le"]) == LOAD_BYTES[0]] == [1]
    assert total(found.get("raykv_hit_tokens", []), "_total", **mine, tier="l2") == 0
    for metric, names in NEW_LABELS.items():
        samples = [s for s in found[metric] if s.labels.get("model") == name]
        assert samples and all(names <= set(s.labels) for s in samples), metric
        assert {s.labels["tenant"] for s in samples} == {"(none)"}
        assert "(none)" not in {s.labels["deployment"] for s in samples}
    # vLLM's own connector stats, summed as its scheduler reports them
    assert engines[0].vllm_stats.saved == 4
    assert engines[0].vllm_stats.asked_tokens == 4 * 16
    assert engines[1].vllm_stats.loaded == 4
    assert engines[1].vllm_stats.l3_hit_tokens == 4 * 16
    assert engines[1].vllm_stats.load_failed == 0  # never grew
    want = {}
    for role, side in (("worker", lambda e: e.connector),
                       ("scheduler", lambda e: e.scheduler.connector)):
        for counter in ("saved", "loaded", "queries", "hit_blocks"):
            n = sum(getattr(side(e).stats, counter) for e in engines)
            if n:
                want[(role, counter)] = n
    assert want[("worker", "saved")] == 4 and want[("scheduler", "hit_blocks")] == 4
    deadline = time.monotonic() + SCRAPE_S
    while True:
        samples = scrape(node).get("raykv_connector", [])
        got = {k: total(samples, "_total", role=k[0], counter=k[1], model=name,
                        tp_rank="0") for k in want}
        if got == want:
            break
        assert time.monotonic() < deadline, (got, want)
        time.sleep(1)
    assert all({"counter", "role", "tp_rank", "model"} <= set(s.labels) for s in samples)
    assert total(samples, "_total", counter="load_failed", model=name) == 0  # CONTROL
    # the names the Grafana dashboard queries for these metrics are the exported ones
    raw = raw_names(node)
    queried = {q for q in dashboard_names() if q.removeprefix("ray_").startswith(
        ("raykv_asked_tokens", "raykv_hit_tokens", "raykv_load_", "raykv_connector"))}
    assert queried and queried <= raw, queried - raw
