"""A restarted node actor trusts nothing it finds in /dev/shm but its own pool records
(real Ray, real mooncake_master, embedded): records planted or broken beside its own
are ignored, nothing outside its own files is mapped, and it comes back healthy with its
real pools. Before the fix, a planted record made it map any file read-write (here a
temporary file standing in for /etc/hostname), and a truncated one made its constructor
raise, so Ray restarted it forever."""

import contextlib
import json
import os
import signal
import stat
import time
from dataclasses import asdict

import pytest
import ray
from raykv import CacheClient
from raykv.cache_actors.errors import NodeUnavailableError
from raykv.controllers import StorageConfig
from raykv.controllers.naming import node_shm_prefix

from tests.integration.ranks import MHA, indices

POOL = "restart-kept"


@pytest.fixture(scope="module")
def kept(cluster):
    """A real pool of the head node with one stored page, and the node's prefix."""
    client = CacheClient(StorageConfig(model_name="restart/meta"))
    pool = client.create_host_pool("mha", name=POOL, **MHA)
    client.register_mem_pool_host(pool)
    prefix = node_shm_prefix(cluster.cluster_tag, client.node_id)
    yield client, pool, prefix
    client.destroy_host_pool(POOL)


def plant(prefix: str, stem: str, text: str) -> str:
    path = f"/dev/shm/{prefix}{stem}.json"
    with open(path, "w") as f:
        f.write(text)
    os.chmod(path, 0o600)
    return path


def restart(actor, timeout_s: float = 300.0) -> int:
    """SIGKILL the node actor and wait until Ray restarted it and it answers health;
    the new pid."""
    old = ray.get(actor.health.remote())["pid"]
    os.kill(old, signal.SIGKILL)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            pid = ray.get(actor.health.remote(), timeout=10)["pid"]
            if pid != old:
                return pid
        except (ray.exceptions.RayError, TimeoutError):
            pass
        assert time.monotonic() < deadline, "the node actor did not come back healthy"
        time.sleep(0.5)


def test_planted_records_are_ignored_after_a_restart(cluster, kept, tmp_path):
    client, pool, prefix = kept
    layout = asdict(pool.handle.layout)
    target = tmp_path / "hostname"
    target.write_bytes(b"x" * pool.nbytes)
    planted = [
        plant(prefix, "planted", json.dumps(
            {"name": "planted", "path": str(target), "layout": layout})),
        plant(prefix, "dots", json.dumps(
            {"name": "../dots", "path": prefix + "../dots", "layout": layout})),
    ]
    if os.getuid() == 0:  # a record of another user, pointing at the target too
        other = plant(prefix, "foreign", json.dumps(
            {"name": "foreign", "path": str(target), "layout": layout}))
        os.chown(other, 65534, 65534)
        planted.append(other)
    actor = cluster.node_actors[client.node_id]
    try:
        pid = restart(actor)
        with open(f"/proc/{pid}/maps") as f:
            maps = f.read()
        assert str(target) not in maps
        pools = {h.name for h in ray.get(actor.list_pools.remote())}
        assert POOL in pools and not pools & {"planted", "foreign", "../dots"}
        # the real pool came back and serves: a page round-trips through it (once the
        # master dropped the killed actor's segment, which puts may land in until then)
        client.attach_host_pool(POOL)
        deadline = time.monotonic() + 120
        while client.batch_set_v1(["restart-a"], indices(0, 1)) != [True]:
            assert time.monotonic() < deadline, "puts still fail after the restart"
            time.sleep(1)
        assert client.batch_get_v1(["restart-a"], indices(8, 1)) == [True]
    finally:
        for path in planted:
            for p in (path, path + ".bad"):
                if os.path.lexists(p):
                    os.unlink(p)


def test_a_truncated_record_does_not_stop_the_actor(cluster, kept):
    client, pool, prefix = kept
    good = f"/dev/shm/{prefix}{POOL}.json"
    with open(good) as f:
        text = f.read()
    path = plant(prefix, "truncated", text.replace(POOL, "truncated")[:40])
    actor = cluster.node_actors[client.node_id]
    try:
        restart(actor, timeout_s=120)
        assert POOL in {h.name for h in ray.get(actor.list_pools.remote())}
        assert os.path.exists(path + ".bad") and not os.path.exists(path)
    finally:
        for p in (path, path + ".bad"):
            if os.path.lexists(p):
                os.unlink(p)


def test_a_planted_fifo_or_link_does_not_stall_a_restart(cluster, kept):
    """A FIFO planted as a pool record used to hang the restarting actor's constructor
    (a blocking open, for good: Ray never got the actor back); a link is never followed.
    The actor comes back and serves; the time it took is printed, not asserted."""
    client, pool, prefix = kept
    fifo = f"/dev/shm/{prefix}fifo.json"
    link = f"/dev/shm/{prefix}linked.json"
    os.mkfifo(fifo, 0o600)
    os.symlink(f"/dev/shm/{prefix}{POOL}.json", link)
    actor = cluster.node_actors[client.node_id]
    try:
        start = time.monotonic()
        restart(actor, timeout_s=120)
        print(f"restarted over a FIFO and a link in {time.monotonic() - start:.1f} s")
        assert POOL in {h.name for h in ray.get(actor.list_pools.remote())}
        try:
            stored = client.batch_set_v1(["fifo-a"], indices(0, 1))
        except NodeUnavailableError:  # the killed actor's channel: re-attach, once
            stored = client.batch_set_v1(["fifo-a"], indices(0, 1))
        assert stored == [True]
        assert client.batch_get_v1(["fifo-a"], indices(8, 1)) == [True]
        assert stat.S_ISFIFO(os.lstat(fifo).st_mode) and os.path.islink(link)  # left alone
    finally:
        with contextlib.suppress(OSError):  # a reader still blocked on it gets EOF
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        for p in (fifo, link):
            if os.path.lexists(p):
                os.unlink(p)
