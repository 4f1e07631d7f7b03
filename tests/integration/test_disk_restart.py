"""The disk tier across restarts (real Ray, real ``mooncake_master``, embedded node
actors on a 24 MiB segment each, Mooncake's SSD offload under ``disk_dir``): pages put
beyond what memory holds are offloaded to the node's disk slot, and the master killed
and started again, a node actor killed and started again, and the whole cluster shut
down and started again on the same ``disk_dir`` each read them back byte-exact; a page
that was only in memory then misses (control: the restart did empty memory, so the hits
came from disk). After the whole restart a tenant reads its pages again, and another
tenant asking for the same tokens gets nothing (control: two clients without a tenant
do share pages across it).

Every page a get reports read is compared with what was written: never wrong bytes.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import ray
import torch
from raykv import CacheClient, local_settings, start_local
from raykv.cache_actors.errors import NodeUnavailableError
from raykv.controllers import StorageConfig
from raykv.controllers.node_records import TierStats
from raykv.controllers.pool_layout import MiB
from raykv.controllers.tenancy import TENANT_SECRET_ENV

from tests.integration.ranks import indices

PAGES = 320
TOKENS = 16
SHAPE = dict(page_size=TOKENS, size=TOKENS * PAGES, layer_num=4, head_num=8, head_dim=64,
             dtype=torch.float16)  # 128 KiB per page: 40 MiB in all, 24 MiB of segment
SETTINGS = dict(global_segment_size=24 * MiB, disk_bytes=1 << 30)
MASTER_ARGS = ["-default_kv_lease_ttl=2500"]  # puts wait out one lease
SECRET_A, SECRET_B = "a" * 32, "b" * 32
MODEL = "org/disk"
PUT_S = 180.0


def client_of(monkeypatch, secret: str | None, tenant: str | None = None
              ) -> tuple[CacheClient, object]:
    """A client in this process of ``tenant`` under ``secret`` (None: no tenant)."""
    if secret is None:
        monkeypatch.delenv(TENANT_SECRET_ENV, raising=False)
    else:
        monkeypatch.setenv(TENANT_SECRET_ENV, secret)
    extra = {} if tenant is None else {"tenant": tenant}
    client = CacheClient(StorageConfig(model_name=MODEL, extra_config=extra))
    pool = client.create_host_pool("mha", **SHAPE)
    client.register_mem_pool_host(pool)
    return client, pool


def put_all(client: CacheClient, keys: list[str]) -> None:
    """Every page put, 16 at a time; a put Mooncake refuses while memory fills (objects
    younger than the lease cannot be evicted yet) is tried again."""
    deadline = time.monotonic() + PUT_S
    for start in range(0, len(keys), 16):
        todo = list(range(start, min(start + 16, len(keys))))
        while todo:
            ok = client.batch_set_v1([keys[i] for i in todo],
                                     torch.cat([indices(i * TOKENS, 1, TOKENS) for i in todo]))
            todo = [i for i, done in zip(todo, ok, strict=True) if not done]
            assert time.monotonic() < deadline, f"pages {todo} were never stored"
            if todo:
                time.sleep(0.5)


def read_back(client: CacheClient, pool, keys: list[str], written: torch.Tensor) -> list[bool]:
    """Each page read into its zeroed slots; a page reported read must be exact."""
    pool.kv_buffer.zero_()
    got = []
    for start in range(0, len(keys), 32):
        part = keys[start:start + 32]
        for attempt in range(3):
            try:
                got += client.batch_get_v1(part, indices(start * TOKENS, len(part), TOKENS))
                break
            except NodeUnavailableError:  # a restarted node actor's channel: once more
                assert attempt < 2
                time.sleep(1)
    for i, hit in enumerate(got):
        slots = slice(i * TOKENS, (i + 1) * TOKENS)
        if hit:
            assert torch.equal(pool.kv_buffer[:, slots], written[:, slots]), \
                f"page {i} read back wrong bytes"
    return got


def tiers(cluster) -> TierStats:
    return ray.get(next(iter(cluster.node_actors.values())).stats.remote()).tiers


@pytest.fixture(scope="module")
def disk_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("disk"))


def test_a_node_actor_restart_and_a_cluster_restart_find_the_disk_tier(disk_dir, uid,
                                                                      monkeypatch):
    keys = [f"{uid}-{i}" for i in range(PAGES)]
    with start_local(1, local_settings(disk_dir=disk_dir, **SETTINGS),
                     master_args=MASTER_ARGS) as cluster:
        client, pool = client_of(monkeypatch, SECRET_A, "a")
        plain, plain_pool = client_of(monkeypatch, None)
        plain_pool.kv_buffer.copy_(torch.randn(pool.kv_buffer.shape,
                                               generator=torch.Generator().manual_seed(4)))
        plain_written = plain_pool.kv_buffer.clone()
        put_all(plain, keys[:16])
        pool.kv_buffer.copy_(torch.randn(pool.kv_buffer.shape,
                                         generator=torch.Generator().manual_seed(3)))
        written = pool.kv_buffer.clone()
        put_all(client, keys)
        time.sleep(2)
        before = tiers(cluster)
        assert before.used_bytes > 8 * MiB, before  # buckets reached the disk
        assert all(read_back(client, pool, keys, written))
        assert tiers(cluster).served.get("l3_disk", 0) > 0

        os.kill(cluster.master.proc.pid, signal.SIGKILL)  # the master alone
        cluster.master.proc.wait()
        cluster.master.restart()
        after_master = []
        deadline = time.monotonic() + 60
        while sum(after_master) < PAGES // 3:  # the client tells the new master its slot
            assert time.monotonic() < deadline, f"{sum(after_master)} pages after the master"
            time.sleep(1)
            after_master = read_back(client, pool, keys, written)
        print(f"after the master restart: {sum(after_master)} of {PAGES} pages")
        assert not after_master[-1]  # CONTROL: the last page was only in memory: gone

        actor = cluster.node_actors[client.node_id]
        old = ray.get(actor.health.remote())["pid"]
        os.kill(old, signal.SIGKILL)
        deadline = time.monotonic() + 120
        while True:
            try:
                if ray.get(actor.health.remote(), timeout=10)["pid"] != old:
                    break
            except (ray.exceptions.RayError, TimeoutError):
                pass
            assert time.monotonic() < deadline, "the node actor did not come back"
            time.sleep(0.2)
        after_kill = read_back(client, pool, keys, written)
        print(f"after the node actor restart: {sum(after_kill)} of {PAGES} pages")
        assert sum(after_kill) >= PAGES // 3
        assert not after_kill[-1]  # CONTROL: the last page was only in memory: gone
        client.close()
        plain.close()

    with start_local(1, local_settings(disk_dir=disk_dir, **SETTINGS),
                     master_args=MASTER_ARGS) as cluster:
        client, pool = client_of(monkeypatch, SECRET_A, "a")
        after_restart = read_back(client, pool, keys, written)
        print(f"after the cluster restart: {sum(after_restart)} of {PAGES} pages")
        assert sum(after_restart) >= PAGES // 3
        # two objects a page (K and V), all from disk now
        assert tiers(cluster).served.get("l3_disk", 0) >= 2 * sum(after_restart)
        assert "l3_memory" not in tiers(cluster).served
        other, other_pool = client_of(monkeypatch, SECRET_B, "b")
        assert not any(read_back(other, other_pool, keys, written))
        # CONTROL: clients without a tenant share their pages across a restart too
        plain, plain_pool = client_of(monkeypatch, None)
        assert all(read_back(plain, plain_pool, keys[:16], plain_written))
        other.close()
        plain.close()
        client.close()


def test_a_master_that_does_not_offload_is_named_when_a_disk_tier_joins(tmp_path):
    """A node actor's client with a disk slot, against a master started without offload
    (an external master, say): its start fails naming the master flags it needs, and
    the slot is free again. Control: the same master takes a client without a disk."""
    from raykv.cache_actors.node.disk_tier import DiskSlot
    from raykv.cache_actors.node.mooncake_backend import MooncakeBackend
    from raykv.clusters.mooncake_master import MooncakeMaster

    master = MooncakeMaster("127.0.0.1").start()
    try:
        join = dict(local_hostname="127.0.0.1", metadata_server=master.metadata_server,
                    master_server_addr=master.master_address, global_segment_size=16 * MiB,
                    local_buffer_size=16 * MiB)
        slot = DiskSlot.claim(str(tmp_path), 64 * MiB)
        with pytest.raises(RuntimeError, match="-enable_offload=true -offload_on_evict=true"):
            MooncakeBackend.embedded(**join, disk=slot)
        slot.release()
        MooncakeBackend.embedded(**join).close()  # CONTROL
    finally:
        master.stop()
