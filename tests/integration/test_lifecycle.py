"""start_local / shutdown, shared-segment and process hygiene (both Mooncake modes), and
per-page failures when the store is full. Each test starts its own single-node cluster
(no other cluster may run)."""

import glob
import os
import stat

import ray
import torch
from raykv import CacheClient, local_settings, start_local
from raykv.cache_actors.node.client_supervisor import record_path
from raykv.cache_actors.shared_memory import SHM_DIR
from raykv.controllers import CONTROLLER_NAME, NAMESPACE, StorageConfig, node_actor_name
from raykv.controllers.naming import node_shm_prefix
from raykv.controllers.pool_layout import MiB

from tests.integration.processes import running_clients, wait_for


def test_start_local_then_shutdown_leaves_nothing(uid):
    with start_local(settings=local_settings(global_segment_size=64 * MiB), num_nodes=1) as c:
        master_pid = c.master.proc.pid
        assert c.master_address.startswith("127.0.0.1:")
        assert c.metadata_server.startswith("http://127.0.0.1:")
        (node_id,) = c.node_ids
        assert ray.get_actor(node_actor_name(node_id), namespace=NAMESPACE)
        info = ray.get(ray.get_actor(CONTROLLER_NAME, namespace=NAMESPACE).info.remote())
        assert info["node_ids"] == [node_id]
        assert info["master_address"] == c.master_address
        client = CacheClient(StorageConfig())
        pool = client.create_host_pool("mla", page_size=4, size=16, layer_num=1,
                                       kv_cache_dim=8, dtype=torch.float32)
        path = os.path.join(SHM_DIR, pool.handle.path)
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        prefix = node_shm_prefix(c.cluster_tag, node_id)
        assert glob.glob(os.path.join(SHM_DIR, prefix + "*"))
        client.close()
    assert not ray.is_initialized()
    assert not glob.glob(os.path.join(SHM_DIR, prefix + "*"))
    assert not os.path.exists(f"/proc/{master_pid}") or _zombie(master_pid)


def _zombie(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split()[2] == "Z"


def test_store_full_is_reported_per_page(uid):
    """Pages that do not fit in the store come back False; never success, never a crash."""
    with start_local(settings=local_settings(global_segment_size=16 * MiB), num_nodes=1) as c:
        client = CacheClient(StorageConfig(is_mla_model=True))
        pages = 32  # 1 MiB pages, twice what the store holds
        pool = client.create_host_pool("mla", page_size=16, size=16 * pages, layer_num=1,
                                       kv_cache_dim=64 * 1024, dtype=torch.uint8)
        client.register_mem_pool_host(pool)
        keys = [f"{uid}-{i}" for i in range(pages)]
        ok = client.batch_set_v1(keys, torch.arange(16 * pages))
        assert 0 < ok.count(True) < pages, ok
        # The store may start evicting early pages, so exists can end sooner, never later.
        assert client.batch_exists(keys) <= ok.index(False)
        got = client.batch_get_v1(keys, torch.arange(16 * pages))
        assert [g for g, o in zip(got, ok, strict=True) if not o] == [False] * ok.count(False)
        assert client.health()["store_healthy"]
        counters = client.stats().counters
        assert any(k.startswith("put_error_") for k in counters), counters
        assert c.node_actors


def test_shutdown_leaves_no_mooncake_client(uid):
    """Also after the actor re-adopted its client (which is then no child of it)."""
    c = start_local(settings=local_settings(standalone=True, host_pool_bytes=MiB), num_nodes=1)
    try:
        (node,) = c.node_ids
        record = record_path(node_shm_prefix(c.cluster_tag, node))
        assert stat.S_IMODE(os.stat(record).st_mode) == 0o600
        clients = running_clients(c)
        assert len(clients) == 1
        actor_pid = ray.get(c.node_actors[node].health.remote())["pid"]
        ray.kill(c.node_actors[node], no_restart=False)
        wait_for(lambda: ray.get(c.node_actors[node].health.remote())["pid"] != actor_pid,
                 "the node actor's restart")
        assert running_clients(c) == clients
    finally:
        c.shutdown()
    assert running_clients(c) == set()
    assert not [f for f in os.listdir(SHM_DIR) if f.startswith(node_shm_prefix(c.cluster_tag,
                                                                                node))]
