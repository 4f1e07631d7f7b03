"""Puts succeed right after a node actor restart (real Ray, real ``mooncake_master``,
embedded): the killed actor's segment stays listed by the master until the client's
heartbeats have been missing for ``-client_ttl`` (30 s here, so the window outlasts the
test), and Mooncake keeps placing objects on it; the node actor puts those again at once,
steered to its own live segment. The first puts after the new actor answers health all
succeed. Control, in the same window: a plain Mooncake client's puts (what the node actor
did before) fail with ``TRANSFER_FAIL`` for objects placed on the dead segment.
"""

from __future__ import annotations

import ctypes
import os
import signal
import time

import pytest
import ray
from raykv import CacheClient, local_settings, start_local
from raykv.cache_actors.errors import NodeUnavailableError
from raykv.controllers import StorageConfig
from raykv.controllers.pool_layout import MiB
from raykv.controllers.result_codes import TRANSFER_FAIL

from tests.integration.ranks import MHA, indices

PAGES = 32  # P(no object lands on the dead one of two segments) = 2**-32
RESTART_DEADLINE_S = 300.0  # generous: the machine may be loaded


@pytest.fixture(scope="module")
def cluster():
    with start_local(settings=local_settings(global_segment_size=64 * MiB), num_nodes=1,
                     master_args=["-client_ttl=30"]) as c:
        yield c


def restarted(actor) -> float:
    """SIGKILL the node actor; returns the monotonic time its successor first answered
    health."""
    old = ray.get(actor.health.remote())["pid"]
    os.kill(old, signal.SIGKILL)
    deadline = time.monotonic() + RESTART_DEADLINE_S
    while True:
        try:
            if ray.get(actor.health.remote(), timeout=10)["pid"] != old:
                return time.monotonic()
        except (ray.exceptions.RayError, TimeoutError):
            pass
        assert time.monotonic() < deadline, "the node actor did not come back"
        time.sleep(0.05)


def plain_puts(cluster, keys: list[str]) -> list[int]:
    """``keys`` put by a plain Mooncake client without a segment of its own."""
    from mooncake.store import MooncakeDistributedStore

    store = MooncakeDistributedStore()
    assert store.setup("127.0.0.1", cluster.metadata_server, 0, 16 * MiB, "tcp", "",
                       cluster.master_address) == 0
    buf = ctypes.create_string_buffer(4096 * len(keys))
    ptr = ctypes.addressof(buf)
    assert store.register_buffer(ptr, len(buf)) == 0
    try:
        return list(store.batch_put_from(keys, [ptr + 4096 * i for i in range(len(keys))],
                                         [4096] * len(keys)))
    finally:
        store.unregister_buffer(ptr)
        store.close()


def test_puts_succeed_as_soon_as_a_killed_node_actor_answers(cluster, uid):
    client = CacheClient(StorageConfig(model_name="restart/puts"))
    pool = client.create_host_pool("mha", name="restart-puts", **(MHA | {"size": 8 * PAGES}))
    client.register_mem_pool_host(pool)
    pool.kv_buffer.copy_(torch_random(pool.kv_buffer.shape).to(pool.kv_buffer.dtype))
    assert client.batch_set_v1([f"{uid}-warm"], indices(0, 1)) == [True]

    answered = restarted(cluster.node_actors[client.node_id])
    keys = [f"{uid}-{i}" for i in range(PAGES)]
    try:
        first = client.batch_set_v1(keys, indices(0, PAGES))
    except NodeUnavailableError:  # the channel of the killed actor: re-attach, once
        first = client.batch_set_v1(keys, indices(0, PAGES))
    took = time.monotonic() - answered
    control = plain_puts(cluster, [f"{uid}-plain-{i}" for i in range(PAGES)])
    print(f"first puts {took:.2f} s after the new actor answered; plain client's codes "
          f"{control}")
    assert first == [True] * PAGES
    assert client.batch_get_v1(keys, indices(4 * PAGES, PAGES)) == [True] * PAGES
    assert TRANSFER_FAIL in control, "the dead segment was gone already: no control"
    client.destroy_host_pool("restart-puts")
    client.close()


def torch_random(shape):
    import torch

    return torch.randn(shape, generator=torch.Generator().manual_seed(7))
