"""Shared memory that fails cleanly, against real Ray and a real mooncake_master.

- A node whose ``/dev/shm`` is Docker's default 64 MiB (a private tmpfs mounted there
  for a child process and everything it starts: Ray, the master, the node actor)
  refuses a pool it cannot hold with a ``ValueError`` naming the free space and the fix,
  and keeps serving; before, the pool was made sparse and the first write of one of its
  pages killed the writer with SIGBUS.
- An engine that truncates its memfd while the node actor serves it zero-copy gets
  failed gets, never a node actor killed by SIGBUS.
- A pool made for one engine process goes away after that process died; a shared pool
  stays.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap

import pytest
import ray
import torch
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
from raykv import CacheClient
from raykv.cache_actors.node.node_service import ENGINE_GRACE_S, ENGINE_REAP_S
from raykv.controllers import StorageConfig
from raykv.controllers.naming import node_actor_name
from raykv.controllers.pool_layout import PoolLayout

from tests.integration.processes import wait_for
from tests.integration.ranks import MHA

SMALL_SHM_NODE = textwrap.dedent("""
    import json
    import torch
    from raykv.cache_actors.rank.client import CacheClient
    from raykv import local_settings, start_local

    def mha(mib):  # an MHA pool of `mib` MiB: 4096 bytes per token slot
        return dict(page_size=16, size=mib * 256, layer_num=4, head_num=4, head_dim=64,
                    dtype=torch.bfloat16)

    out = {}
    with start_local(1, local_settings(global_segment_size=64 << 20), log_to_driver=False):
        client = CacheClient()
        pid = client.health()["pid"]
        try:
            big = client.create_host_pool("mha", name="big", **mha(96))
        except ValueError as e:
            out["refused"] = str(e)
        else:
            big.kv_buffer.fill_(1)  # a rank fills its pool
            out["wrote_big"] = True
        small = client.create_host_pool("mha", name="small", **mha(4))
        client.register_mem_pool_host(small)
        data = torch.randn(small.kv_buffer.shape).to(torch.bfloat16)
        small.kv_buffer.copy_(data)
        keys, idx = [f"k{i}" for i in range(8)], torch.arange(8 * 16)
        out["put"] = client.batch_set_v1(keys, idx)
        small.kv_buffer.zero_()
        out["get"] = client.batch_get_v1(keys, idx)
        out["same_bytes"] = bool(torch.equal(small.kv_buffer[:, :128], data[:, :128]))
        out["same_actor"] = client.health()["pid"] == pid
        out["pools"] = sorted(client.stats().pools)
    print("RESULT", json.dumps(out))
""")


def test_a_pool_dockers_default_shm_cannot_hold_is_refused_by_the_node():
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare(1) to give a child process its own /dev/shm")
    script = ("mount -t tmpfs -o size=64m tmpfs /dev/shm && exec \"$0\" -c \"$1\"")
    run = subprocess.run(["unshare", "--mount", "sh", "-c", script, sys.executable,
                          SMALL_SHM_NODE], capture_output=True, text=True, timeout=300)
    assert run.returncode != -signal.SIGBUS, "a process of the node died of SIGBUS"
    assert run.returncode == 0, run.stderr[-4000:]
    out = json.loads(run.stdout.split("RESULT ", 1)[1])
    assert "wrote_big" not in out
    msg = out["refused"]
    assert f"pool 'big' needs {96 << 20} bytes of shared memory but /dev/shm has " \
           f"{64 << 20} bytes free (of {64 << 20})" in msg
    assert "--shm-size" in msg and "--host-pool-size" in msg
    # The node kept serving, with the pool that fits, from the same actor process.
    assert out["put"] == [True] * 8 and out["get"] == [True] * 8 and out["same_bytes"]
    assert out["same_actor"] and out["pools"] == ["small"]


ENGINE_LAYOUT = PoolLayout.mha(page_size=4, size=256, layer_num=2, head_num=2, head_dim=8,
                               dtype="float16", itemsize=2)


@pytest.mark.parametrize("memfd_flags", ["sglang", "sealable"])
def test_an_engine_truncating_its_memfd_never_kills_the_node_actor(cluster, uid,
                                                                     memfd_flags):
    """This process is the engine: its memfd (made as SGLang 0.5.23 makes it, or
    sealable) is adopted by its node actor, pages go out and back zero-copy, then the
    engine truncates the memfd: gets fail, the node actor lives on."""
    flags = os.MFD_CLOEXEC | (os.MFD_ALLOW_SEALING if memfd_flags == "sealable" else 0)
    fd = os.memfd_create("sglang_host_pool_test", flags)
    os.ftruncate(fd, ENGINE_LAYOUT.nbytes)
    client = CacheClient(StorageConfig(model_name=f"shm-{uid}"))
    actor = ray.get_actor(node_actor_name(client.node_id), namespace=cluster.namespace)
    name = f"engine-{uid}"
    st = os.fstat(fd)
    ray.get(actor.adopt_engine_pool.remote(name, f"/proc/{os.getpid()}/fd/{fd}",
                                           ENGINE_LAYOUT, (st.st_dev, st.st_ino),
                                           client.owner_claim()))
    try:
        pool = client.attach_host_pool(name)  # the engine's own memory, mapped again
        client.register_mem_pool_host(pool)
        pid = client.health()["pid"]
        data = torch.randn(pool.kv_buffer.shape).to(torch.float16)
        pool.kv_buffer.copy_(data)
        pages = ENGINE_LAYOUT.num_pages
        keys, idx = [f"{uid}-{i}" for i in range(pages)], torch.arange(pages * 4)
        assert client.batch_set_v1(keys, idx) == [True] * pages
        pool.kv_buffer.zero_()
        assert client.batch_get_v1(keys, idx) == [True] * pages
        assert torch.equal(pool.kv_buffer, data)
        del data

        if memfd_flags == "sealable":  # sealed by the node actor: it cannot shrink
            with pytest.raises(PermissionError):
                os.ftruncate(fd, 0)
            assert client.batch_get_v1(keys, idx) == [True] * pages
        else:
            os.ftruncate(fd, 0)  # every page of the pool is gone
            for _ in range(3):
                with pytest.raises(ValueError, match="truncated its memfd to 0 bytes"):
                    client.batch_get_v1(keys, idx)
            os.ftruncate(fd, ENGINE_LAYOUT.nbytes)  # back (zero-filled): served again
            assert client.batch_get_v1(keys, idx) == [True] * pages
        assert client.health()["pid"] == pid, "the node actor died and was restarted"
        assert client.health()["store_healthy"]
    finally:
        client.destroy_host_pool(name)
        client.close()
        os.close(fd)


@ray.remote(num_cpus=0)
class Engine:
    """An engine process with a pool of its own (``per_process``) and a shared one."""

    def __init__(self, shared: str, own: str) -> None:
        self.client = CacheClient()
        self.pools = [self.client.create_host_pool("mha", name=shared, **MHA),
                      self.client.create_host_pool("mha", name=own, per_process=True, **MHA)]

    def ready(self) -> int:
        return os.getpid()


def test_pools_of_one_engine_process_go_with_it(cluster, uid):
    """A ``per_process`` pool (what SGLang staging and vLLM pools are) is removed by the
    node's engine reaper after its process died; a shared pool stays (L2 outlives a
    crashed rank)."""
    node = ray.get_runtime_context().get_node_id()
    actor = ray.get_actor(node_actor_name(node), namespace=cluster.namespace)
    shared, own = f"shared-{uid}", f"own-{uid}"
    engine = Engine.options(scheduling_strategy=NodeAffinitySchedulingStrategy(
        node, soft=False)).remote(shared, own)
    ray.get(engine.ready.remote())

    def pools() -> set[str]:
        return {h.name for h in ray.get(actor.list_pools.remote())}

    try:
        assert {shared, own} <= pools()
        ray.kill(engine)  # the engine process dies without cleaning up
        wait_for(lambda: own not in pools(), f"the removal of {own}",
                 timeout_s=ENGINE_GRACE_S + 4 * ENGINE_REAP_S + 60)
        assert shared in pools()
    finally:
        ray.get(actor.destroy_pool.remote(shared, CacheClient().owner_claim()))  # its owner
