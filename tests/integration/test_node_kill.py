"""An embedded node actor killed with SIGKILL in the middle of traffic, against a real
two-node cluster: its Mooncake segment (which holds the objects it stored) dies with it,
Ray restarts it, and for the next 20 s ranks of the other node keep reading its keys and
putting new ones. A read reports a page only with the bytes its writer wrote (a miss
otherwise, never other bytes); a put that reports a page stored is read back exact, or
is a miss once the segment that held it is gone, never other bytes.
"""

from __future__ import annotations

import os
import signal
import time

import ray
import torch
from raykv.cache_actors.errors import NodeUnavailableError
from raykv.controllers import StorageConfig
from raykv.controllers.naming import node_actor_name

from tests.integration.ranks import indices, start_rank

N = 8
WATCH_S = 20.0


def cfg() -> StorageConfig:
    return StorageConfig(model_name="org/kill", extra_config={"timeout_s": 2.0})


def page_bytes(rank, start: int, n: int) -> list[torch.Tensor]:
    """The ``n`` pages from token slot ``start`` of ``rank``'s pool, one tensor each."""
    pages = ray.get(rank.pages.remote(start, n)).view(torch.uint8)
    return list(pages.chunk(n, dim=1))


def test_gets_and_puts_after_an_embedded_node_actor_is_killed(cluster, uid):
    node1, node2 = cluster.node_ids
    writer = start_rank(node1, cfg())
    reader = start_rank(node2, cfg())
    old = [f"{uid}-old-{i}" for i in range(N)]
    ray.get(writer.fill.remote(1))
    assert ray.get(writer.call.remote("batch_set_v1", old, indices(0, N))) == [True] * N
    written = page_bytes(writer, 0, N)
    assert ray.get(reader.call.remote("batch_get_v1", old, indices(32, N))) == [True] * N

    actor = ray.get_actor(node_actor_name(node1), namespace=cluster.namespace)
    os.kill(ray.get(actor.health.remote())["pid"], signal.SIGKILL)

    rounds = hits = misses = 0
    stored: dict[str, torch.Tensor] = {}  # key -> bytes of a put reported stored
    end = time.monotonic() + WATCH_S
    while time.monotonic() < end:
        rounds += 1
        try:
            got = ray.get(reader.call.remote("batch_get_v1", old, indices(32, N)))
        except NodeUnavailableError:
            got = [False] * N
        read = page_bytes(reader, 32, N)
        for i, ok in enumerate(got):
            if ok:
                hits += 1
                assert torch.equal(read[i], written[i]), f"round {rounds}: page {i} is wrong"
            else:
                misses += 1
        ray.get(reader.fill.remote(100 + rounds))  # new bytes in slots 0..N-1
        new = [f"{uid}-new-{rounds}-{i}" for i in range(N)]
        try:
            put = ray.get(reader.call.remote("batch_set_v1", new, indices(0, N)))
        except NodeUnavailableError:
            put = [False] * N
        fresh = page_bytes(reader, 0, N)
        stored.update({k: fresh[i] for i, (k, ok) in enumerate(zip(new, put, strict=True))
                       if ok})
        time.sleep(0.2)

    # Every page a put reported stored reads back as its bytes, or is a miss.
    # A read that fails as a whole (its deadline, on 2 loaded cores) reports no page: it
    # is tried again, up to 3 times, and counts as misses after that.
    keys = list(stored)
    wrong = exact = 0
    for start in range(0, len(keys), N):
        chunk = keys[start:start + N]
        got = [False] * len(chunk)
        for _ in range(3):
            try:
                got = ray.get(reader.call.remote("batch_get_v1", chunk,
                                                 indices(32, len(chunk))))
                break
            except NodeUnavailableError:
                continue
        read = page_bytes(reader, 32, len(chunk))
        for i, ok in enumerate(got):
            if ok:
                same = torch.equal(read[i], stored[chunk[i]])
                exact += same
                wrong += not same
    assert wrong == 0
    assert rounds > 5 and exact  # the loop ran, and pages put after the kill read back
    print(f"{rounds} rounds: {hits} pages read exact, {misses} misses; "
          f"{len(stored)} pages put and checked, {exact} read back exact")
